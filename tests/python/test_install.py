"""The user's install path, in fresh virtual environments: `pip install <wheel> nixl-cuXX==1.5.1`,
`nixl-bounce install` (idempotent), `nixl-bounce doctor` all green with a live two-agent bounce,
the version guard refusing an untested NIXL (simulated two ways) without killing the host
process, and `nixl-bounce uninstall`. Against nixl-cu12 and nixl-cu13 (both load on CPU-only
machines: host-memory transfers need no CUDA driver). (Issue 15.)

Downloads go through pip's own cache, so only the first run fetches NIXL.
"""
import glob
import os
import subprocess
import sys
import textwrap
import venv

import pytest

from conftest import cannot_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NIXL_VERSION = "1.5.1"
FAKE_ENV = "NIXL_BOUNCE_TEST_FAKE_NIXL_VERSION"
ALLOW_ENV = "NIXL_BOUNCE_ALLOW_UNTESTED_NIXL"


def _clean_env(**extra):
    """The environment without anything that would point NIXL or BOUNCE elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NIXL_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """BOUNCE_TEST_WHEEL when set (a wheel built elsewhere), else the wheel ci/setup built
    (dist/), else one built now from this tree."""
    if os.environ.get("BOUNCE_TEST_WHEEL"):
        return os.environ["BOUNCE_TEST_WHEEL"]
    built = sorted(glob.glob(os.path.join(ROOT, "dist", "nixl_bounce-*.whl")), key=os.path.getmtime)
    if built:
        return built[-1]
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(out), ROOT], check=True, cwd=ROOT)
    return glob.glob(str(out / "nixl_bounce-*.whl"))[0]


class Env:
    """A fresh venv with the wheel and one NIXL wheel installed."""

    def __init__(self, path, package):
        self.path = str(path)
        self.package = package  # nixl_cu12 / nixl_cu13
        self.python = os.path.join(self.path, "bin", "python")
        site = glob.glob(os.path.join(self.path, "lib", "python3*", "site-packages"))[0]
        self.site = site
        self.plugin = os.path.join(site, f".{package}.mesonpy.libs", "plugins", "libplugin_BOUNCE.so")

    def run(self, *args, env=None, timeout=180):
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                           env=_clean_env(**(env or {})), cwd=self.path)
        return r.returncode, r.stdout, r.stderr

    def cli(self, *args, env=None):
        return self.run(os.path.join(self.path, "bin", "nixl-bounce"), *args, env=env)

    def py(self, code, env=None):
        return self.run(self.python, "-c", textwrap.dedent(code), env=env)


def _make_env(tmp_path_factory, wheel, dist):
    path = tmp_path_factory.mktemp(dist)
    # No pip inside: the outer pip installs into it (--python), which is much faster than ensurepip.
    venv.EnvBuilder(with_pip=False).create(str(path))
    py = os.path.join(str(path), "bin", "python")
    cmd = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps",
           wheel, f"{dist}=={NIXL_VERSION}", "numpy"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_clean_env())
    if r.returncode != 0:
        why = f"pip could not install {dist}=={NIXL_VERSION}: {r.stderr.strip().splitlines()[-1:]}"
        # In CI a missing download is a failure, not a reason to skip: both wheels exist on
        # PyPI for Linux x86-64 and load on CPU-only machines.
        cannot_run(why)
    return Env(path, dist.replace("-", "_"))


@pytest.fixture(scope="module", params=["nixl-cu12", "nixl-cu13"])
def env(request, tmp_path_factory, wheel):
    return _make_env(tmp_path_factory, wheel, request.param)


def test_install_places_the_wheels_plugin_and_is_idempotent(env):
    rc, out, err = env.cli("install")
    assert rc == 0, out + err
    assert os.path.isfile(env.plugin), out
    bundled = os.path.join(env.site, "nixl_bounce", "libplugin_BOUNCE.so")
    with open(env.plugin, "rb") as a, open(bundled, "rb") as b:
        assert a.read() == b.read(), "installed plugin differs from the wheel's"
    rc, out, err = env.cli("install")
    assert rc == 0 and out.startswith("unchanged:"), out + err
    # the same NIXL given by path (its site-packages) is found too
    rc, out, err = env.cli("install", "--nixl-path", env.site)
    assert rc == 0 and "unchanged:" in out and env.package in out, out + err
    rc, out, err = env.cli("install", "--nixl-path", "/nonexistent")
    assert rc == 1 and "no libnixl.so" in err, out + err


def test_doctor_is_green_and_bounces_live(env):
    assert env.cli("install")[0] == 0
    rc, out, err = env.cli("doctor")
    assert rc == 0, out + err
    assert f"NIXL: {env.package} {NIXL_VERSION}" in out and "(tested with this build)" in out, out
    assert "UCX plugin found" in out and "BOUNCE plugin API version 1" in out, out
    assert "same file as the wheel's" in out and "CUDA" in out, out
    assert "same-host path for host memory (CMA)" in out, out
    assert "live: two agents created BOUNCE" in out and "bytes checked" in out, out
    assert "[FAIL]" not in out and out.rstrip().endswith("all checks passed"), out


GUARD_SCRIPT = """
    import os, sys
    from {package} import nixl_agent, nixl_agent_config
    import numpy as np
    a = nixl_agent("guard", nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=0))
    try:
        a.create_backend("BOUNCE", {{}})
        print("BOUNCE created")
    except Exception as e:
        print("BOUNCE refused:", type(e).__name__)
    # the host carries on: UCX still works in the same agent and process
    a.create_backend("UCX", {{}})
    buf = np.arange(4096, dtype=np.uint8)
    a.register_memory(a.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"), backends=["UCX"])
    print("host alive")
    sys.stdout.flush()
    os._exit(0)
"""


def test_guard_refuses_a_simulated_unknown_version_with_one_line_and_host_survives(env):
    assert env.cli("install")[0] == 0
    script = GUARD_SCRIPT.format(package=env.package)
    rc, out, err = env.py(script, env={FAKE_ENV: "9.9.9"})
    assert rc == 0, out + err
    assert "BOUNCE refused" in out and "host alive" in out, out + err
    # The test variable never acts silently: one warning names it (review 57).
    assert sum(f"{FAKE_ENV}=9.9.9: the version guard takes that" in l for l in err.splitlines()) == 1, err
    ours = [l for l in err.splitlines() if "BOUNCE" in l and "NIXL INFO" not in l
            and "createBackend" not in l and "the version guard takes that" not in l]
    assert len(ours) == 1, err
    assert ours[0].startswith("BOUNCE: refusing to load: NIXL 9.9.9"), ours
    assert f"tested with ({NIXL_VERSION})" in ours[0] and f"{ALLOW_ENV}=1" in ours[0], ours
    # the explicit override loads it, with a warning
    rc, out, err = env.py(script, env={FAKE_ENV: "9.9.9", ALLOW_ENV: "1"})
    assert rc == 0 and "BOUNCE created" in out and "host alive" in out, out + err
    assert "loading although NIXL 9.9.9" in err, err


def test_guard_reads_the_real_wheel_metadata_and_doctor_reports_it(env):
    """Not the test variable: the NIXL wheel's own METADATA says another version."""
    assert env.cli("install")[0] == 0
    meta = glob.glob(os.path.join(env.site, f"{env.package}-*.dist-info", "METADATA"))[0]
    original = open(meta).read()
    try:
        open(meta, "w").write(original.replace(f"Version: {NIXL_VERSION}", "Version: 1.6.0", 1))
        rc, out, err = env.py(GUARD_SCRIPT.format(package=env.package))
        assert rc == 0 and "BOUNCE refused" in out and "host alive" in out, out + err
        assert f"refusing to load: NIXL 1.6.0 (read from {meta})" in err, err
        rc, out, err = env.cli("doctor")
        assert rc == 1, out + err
        assert f"NIXL: {env.package} 1.6.0" in out and "NOT one this build was tested with" in out, out
        assert f"pip install --no-deps {env.package.replace('_', '-')}=={NIXL_VERSION}" in out, out
        assert "live check failed at 'create BOUNCE'" in out and "refusing to load" in out, out
        rc, out, err = env.cli("doctor", env={ALLOW_ENV: "1"})
        assert rc == 0 and "[WARN] NIXL" in out and "live: two agents" in out, out + err
    finally:
        open(meta, "w").write(original)


def test_uninstall_removes_it_and_doctor_says_how_to_fix(env):
    assert env.cli("install")[0] == 0
    rc, out, err = env.cli("uninstall")
    assert rc == 0 and out.startswith("removed:"), out + err
    assert not os.path.exists(env.plugin)
    rc, out, err = env.cli("uninstall")
    assert rc == 0 and out.startswith("not installed:"), out + err
    rc, out, err = env.cli("doctor", "--no-live")
    assert rc == 1 and "BOUNCE is not installed" in out and "fix: nixl-bounce install" in out, out
    # and NIXL no longer offers it
    rc, out, err = env.py(f"""
        import os, sys
        from {env.package} import nixl_agent, nixl_agent_config
        a = nixl_agent("x", nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=0))
        print(sorted(a.get_plugin_list()))
        sys.stdout.flush(); os._exit(0)
    """)
    assert rc == 0 and "'UCX'" in out and "'BOUNCE'" not in out, out + err


def test_nixl_plugin_dir_is_what_doctor_checks_and_install_updates(env, tmp_path):
    """With NIXL_PLUGIN_DIR set NIXL loads BOUNCE from there only: a stale copy there is a FAIL
    (not "all checks passed"), `install` updates it, a linked UCX plugin there cannot load its
    UCX libraries, and what the tools advise instead (NIXL_BOUNCE_UCX_PLUGIN naming NIXL's own
    libplugin_UCX.so) bounces live. The user's NIXL_BOUNCE_* overrides are named, not tested.
    (Review 55: M1, M2, M5.)"""
    assert env.cli("install")[0] == 0
    own_ucx = os.path.join(os.path.dirname(env.plugin), "libplugin_UCX.so")
    pd = tmp_path / "plugins"
    pd.mkdir()
    stale = pd / "libplugin_BOUNCE.so"
    stale.write_bytes(open(env.plugin, "rb").read() + b"old")
    os.symlink(own_ucx, pd / "libplugin_UCX.so")
    rc, out, err = env.cli("doctor", env={"NIXL_PLUGIN_DIR": str(pd)})
    assert rc == 1 and "all checks passed" not in out, out + err
    assert f"[FAIL] BOUNCE at {stale}, the one NIXL loads, differs" in out, out
    assert f"[FAIL] UCX plugin {pd}/libplugin_UCX.so cannot be loaded" in out, out
    assert f"fix: set NIXL_BOUNCE_UCX_PLUGIN={own_ucx}" in out, out

    rc, out, err = env.cli("install", env={"NIXL_PLUGIN_DIR": str(pd)})
    assert rc == 0 and f"updated: {stale} (NIXL_PLUGIN_DIR" in out, out + err
    assert f"NIXL_BOUNCE_UCX_PLUGIN={own_ucx}" in err, err
    with open(stale, "rb") as a, open(env.plugin, "rb") as b:
        assert a.read() == b.read(), "install left the copy in NIXL_PLUGIN_DIR stale"

    os.unlink(pd / "libplugin_UCX.so")
    rc, out, err = env.cli("doctor", env={"NIXL_PLUGIN_DIR": str(pd), "NIXL_BOUNCE_UCX_PLUGIN": own_ucx,
                                          "NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT": "4096"})
    assert rc == 0 and out.rstrip().endswith("all checks passed"), out + err
    assert f"BOUNCE installed: {stale} (same file as the wheel's)" in out, out
    assert "environment overrides set: NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT='4096'" in out, out
    assert "live: two agents created BOUNCE" in out and "bytes checked" in out, out
