"""`nixl-bounce doctor`'s checks that read the host, each given the host's answer (the whole
doctor runs in test_install.py): what it says, and that it warns, never fails, where BOUNCE
still works by another path (but fails under CI where a check could give no answer)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from nixl_bounce import doctor, probes  # noqa: E402


@pytest.mark.parametrize("scope, state, says", [
    (None, "OK", "no Yama"),
    (0, "OK", "ptrace_scope 0"),
    (1, "OK", "PR_SET_PTRACER_ANY"),
    (2, "WARN", "CAP_SYS_PTRACE"),
    (3, "WARN", "no process may attach"),
])
def test_the_same_host_check_follows_yamas_ptrace_scope(capsys, scope, state, says):
    r = doctor.Report()
    doctor._check_same_host(r, scope)
    out = capsys.readouterr().out
    assert out.startswith(f"[{state:^4}] same-host path for host memory (CMA)"), out
    assert says in out, out
    assert ("fix:" in out) == (state == "WARN"), out
    assert r.failed == 0, "a host that forbids CMA still bounces: a warning, not a failure"


def test_the_ptrace_scope_is_read_from_yama_none_only_without_it(tmp_path):
    f = tmp_path / "ptrace_scope"
    f.write_text("1\n")
    assert probes.ptrace_scope(str(f)) == 1
    f.write_text("garbage")
    got = probes.ptrace_scope(str(f))
    assert isinstance(got, probes.Unreadable) and "garbage" in got.why, got
    assert isinstance(probes.ptrace_scope(str(tmp_path)), probes.Unreadable), "a folder cannot be read"
    assert probes.ptrace_scope(str(tmp_path / "absent")) is None, "only a missing file means no Yama"
    if not os.path.exists(probes.YAMA_PTRACE_SCOPE):
        assert probes.ptrace_scope() is None
    else:
        try:
            expected = int(open(probes.YAMA_PTRACE_SCOPE).read())
        except (OSError, ValueError):
            assert isinstance(probes.ptrace_scope(), probes.Unreadable)
        else:
            assert probes.ptrace_scope() == expected


@pytest.mark.parametrize("ci, state", [(None, "WARN"), ("0", "WARN"), ("true", "FAIL"), (" YES ", "FAIL"),
                                       ("1", "FAIL")])
def test_an_unreadable_ptrace_scope_is_not_no_yama(capsys, monkeypatch, ci, state):
    """Yama's file is there but gave no number: the scope is unknown, never OK "(no Yama)"; a
    WARN, and under CI a FAIL (every check must give an answer)."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    r = doctor.Report()
    doctor._check_same_host(r, probes.Unreadable("ptrace_scope holds 'garbage', not a number"))
    out = capsys.readouterr().out
    assert out.startswith(f"[{state:^4}] same-host path for host memory (CMA): could not read"), out
    assert "no Yama" not in out and "garbage" in out and "fix:" in out, out
    assert r.failed == (state == "FAIL"), out


@pytest.mark.parametrize("value, allowed", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" On\n", True),
    (None, False), ("", False), ("0", False), ("false", False), ("no", False), ("off", False),
    ("2", False), ("y", False), ("enabled", False),
])
def test_the_untested_nixl_opt_in_follows_the_plugins_rule(value, allowed):
    """The same values as the plugin's guard (src/sys/nixl_version.rs is_opt_in): 1, true, yes,
    on, any case, trimmed."""
    assert doctor.allow_untested(value) is allowed


def _nixl(tmp_path, versions, package="nixl_cu12"):
    lib_dir = tmp_path / f".{package}.mesonpy.libs"
    lib_dir.mkdir()
    for v in versions:
        d = tmp_path / f"{package}-{v}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {v}\n\nbody\n")
    from nixl_bounce import locate
    return locate._from_lib_dir(str(lib_dir))


@pytest.mark.parametrize("opt_in", [" yes ", "ON"])
def test_the_nixl_check_honours_every_opt_in_value(capsys, monkeypatch, tmp_path, opt_in):
    monkeypatch.setenv(doctor.ALLOW_UNTESTED_ENV, opt_in)
    nixl = _nixl(tmp_path, ["9.9.9"])
    r = doctor.Report()
    doctor._check_nixl(r, nixl, ("1.5.1",))
    out = capsys.readouterr().out
    assert out.startswith("[WARN] NIXL: nixl_cu12 9.9.9") and "loading anyway" in out, out
    assert r.failed == 0, out
    monkeypatch.setenv(doctor.ALLOW_UNTESTED_ENV, "off")
    doctor._check_nixl(r, nixl, ("1.5.1",))
    assert "[FAIL] NIXL" in capsys.readouterr().out and r.failed == 1


def test_two_dist_infos_are_reported_naming_both(capsys, monkeypatch, tmp_path):
    """The plugin's guard takes the first dist-info its directory listing gives, the doctor the
    first sorted: with two left, they may judge different versions, so the doctor says so."""
    monkeypatch.delenv(doctor.ALLOW_UNTESTED_ENV, raising=False)
    r = doctor.Report()
    doctor._check_nixl(r, _nixl(tmp_path, ["1.5.1", "1.6.0"]), ("1.5.1",))
    out = capsys.readouterr().out
    assert "[ OK ] NIXL: nixl_cu12 1.5.1" in out, out
    assert "[WARN] several nixl_cu12-*.dist-info" in out, out
    assert "nixl_cu12-1.5.1.dist-info (Version: 1.5.1)" in out, out
    assert "nixl_cu12-1.6.0.dist-info (Version: 1.6.0)" in out, out
    assert r.failed == 0, out


def test_one_dist_info_says_nothing_more(capsys, tmp_path):
    r = doctor.Report()
    doctor._check_nixl(r, _nixl(tmp_path, ["1.5.1"]), ("1.5.1",))
    assert capsys.readouterr().out.count("\n") == 1


def _cuda(monkeypatch, **kw):
    monkeypatch.setattr(doctor.probes, "cuda", lambda: probes.Cuda(**kw))


def test_a_driver_that_loads_but_fails_cuinit_is_a_warning(capsys, monkeypatch, tmp_path):
    _cuda(monkeypatch, driver="12.4", driver_int=12040, error="cuInit failed: CUDA_ERROR_UNKNOWN (999)",
          broken=True)
    r = doctor.Report()
    doctor._check_cuda(r, _nixl(tmp_path, ["1.5.1"]))
    out = capsys.readouterr().out
    assert out.startswith("[WARN] CUDA: libcuda.so.1 loads but does not work"), out
    assert "CUDA_ERROR_UNKNOWN" in out and "fix:" in out and r.failed == 0, out


def test_no_driver_at_all_is_fine(capsys, monkeypatch, tmp_path):
    _cuda(monkeypatch, error="libcuda.so.1 not found, no NVIDIA driver on this machine")
    r = doctor.Report()
    doctor._check_cuda(r, _nixl(tmp_path, ["1.5.1"]))
    assert capsys.readouterr().out.startswith("[ OK ] CUDA: none")


def test_an_unknown_driver_version_suggests_no_nixl_cu0(capsys, monkeypatch, tmp_path):
    _cuda(monkeypatch, driver=None, driver_int=0, gpus=["NVIDIA H100"])
    r = doctor.Report()
    doctor._check_cuda(r, _nixl(tmp_path, ["1.5.1"]))
    out = capsys.readouterr().out
    assert out.startswith("[WARN] CUDA driver version unknown"), out
    assert "nixl-cu0" not in out and "cu0" not in out, out


@pytest.mark.parametrize("driver_int, suggests", [(11080, "update the NVIDIA driver"), (12040, "use nixl-cu12")])
def test_an_old_driver_suggests_only_wheels_that_exist(capsys, monkeypatch, tmp_path, driver_int, suggests):
    _cuda(monkeypatch, driver=f"{driver_int // 1000}.{driver_int % 1000 // 10}", driver_int=driver_int,
          gpus=["NVIDIA H100"])
    r = doctor.Report()
    doctor._check_cuda(r, _nixl(tmp_path, ["1.5.1"], package="nixl_cu13"))
    out = capsys.readouterr().out
    assert out.startswith("[WARN] CUDA driver") and suggests in out, out
    assert "nixl-cu11" not in out, out


def _run(monkeypatch, tmp_path, live, find=None):
    """doctor.run with the host's answers stubbed: a tested NIXL, BOUNCE installed, no CUDA."""
    plugin = tmp_path / "libplugin_BOUNCE.so"
    plugin.write_bytes(b"")
    monkeypatch.setattr(doctor, "bundled_plugin", lambda: str(plugin))
    monkeypatch.setattr(doctor, "_tested_versions", lambda r, p: ("1.5.1",))
    nixl = _nixl(tmp_path, ["1.5.1"])
    monkeypatch.setattr(doctor.locate, "find", find or (lambda path: [nixl]))
    monkeypatch.setattr(doctor, "_check_plugin_dir", lambda r, n: True)
    monkeypatch.setattr(doctor, "_check_cuda", lambda r, n: None)
    monkeypatch.setattr(doctor.probes, "ptrace_scope", lambda: 0)
    monkeypatch.setattr(doctor, "_live", lambda r, n: (r.ok("live: stub"), True)[1])
    return doctor.run(None, live=live)


@pytest.mark.parametrize("ci", [None, "false"])
def test_a_skipped_live_check_is_said_in_the_verdict(capsys, monkeypatch, tmp_path, ci):
    monkeypatch.delenv(doctor.ALLOW_UNTESTED_ENV, raising=False)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _run(monkeypatch, tmp_path / "a", live=False) == 0
    assert capsys.readouterr().out.rstrip().endswith("all checks passed (live check skipped)")
    assert _run(monkeypatch, tmp_path / "b", live=True) == 0
    assert capsys.readouterr().out.rstrip().endswith("all checks passed")


@pytest.mark.parametrize("ci", ["1", "True", "yes"])
def test_under_ci_a_skipped_live_check_fails(capsys, monkeypatch, tmp_path, ci):
    monkeypatch.delenv(doctor.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setenv("CI", ci)
    assert _run(monkeypatch, tmp_path, live=False) == 1
    out = capsys.readouterr().out
    assert "[FAIL] live check skipped (--no-live)" in out and "all checks passed" not in out, out


def test_a_nixl_path_error_is_said_once(capsys, monkeypatch, tmp_path):
    real_find = doctor.locate.find
    assert _run(monkeypatch, tmp_path, live=False,
                find=lambda path: real_find(str(tmp_path / "nothing"))) == 1
    out = capsys.readouterr().out
    assert out.count("no libnixl.so in or under") == 1, out
    assert "fix: give NIXL's lib folder" in out, out


# --- The plugin NIXL loads (NIXL_PLUGIN_DIR), its GPU kernels, the UCX plugin it delegates to,
# --- and the live check's environment (review 55: M1, M2, M3, M5, L1, L2, L4).

from nixl_bounce import cli, plugin_files  # noqa: E402

#: What kernels/build_ptx.rs embeds at the head of the PTX.
PTX = b"// Built by NVRTC 12.0 from kernels/gather_scatter.cu\n.version 8.0\n.target compute_80\n.visible .entry gather(\n"


def _plugin(path, kernels=True, extra=b""):
    path.write_bytes(b"\x7fELF" + b"\0" * 64 + (PTX if kernels else b"") + b"\0tail" + extra)
    return str(path)


def test_gpu_kernels_are_read_from_the_plugin_file(tmp_path):
    assert plugin_files.gpu_kernels(_plugin(tmp_path / "a.so")) == "NVRTC 12.0 from kernels/gather_scatter.cu"
    assert plugin_files.gpu_kernels(_plugin(tmp_path / "b.so", kernels=False)) is None
    (tmp_path / "c.so").write_bytes(b"")
    assert plugin_files.gpu_kernels(str(tmp_path / "c.so")) is None
    # the marker alone (no PTX entry after it) is not kernels
    (tmp_path / "d.so").write_bytes(b"// Built by NVRTC 12.0 from x\n")
    assert plugin_files.gpu_kernels(str(tmp_path / "d.so")) is None


def test_the_real_plugin_says_it_carries_kernels():
    """The plugin this checkout built (ci/setup builds it with NVRTC)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    built = os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(root, "target"),
                         "release", "libnixl_bounce.so")
    if not os.path.isfile(built):
        from conftest import cannot_run
        cannot_run("no release build of the plugin here (ci/setup makes one)")
    assert (plugin_files.gpu_kernels(built) or "").startswith("NVRTC "), built


@pytest.mark.parametrize("kernels, gpus, state", [(True, True, "OK"), (False, True, "WARN"), (False, False, "OK")])
def test_a_plugin_without_gpu_kernels_warns_on_a_gpu_host(capsys, tmp_path, kernels, gpus, state):
    r = doctor.Report()
    doctor._check_kernels(r, _plugin(tmp_path / "p.so", kernels=kernels), gpus=gpus)
    out = capsys.readouterr().out
    assert out.startswith(f"[{state:^4}] BOUNCE"), out
    assert ("WITHOUT its GPU kernels" in out) == (not kernels), out
    if state == "WARN":
        assert "nvidia-cuda-nvrtc-cu12==12.0.140" in out and "BOUNCE_NVRTC_LIB" in out, out
    assert r.failed == 0


def _fake_nixl(tmp_path, monkeypatch, loads=True):
    """A NIXL wheel layout with stand-in plugins; the wheel's plugin is `bundled`; loading a
    plugin is stubbed (API version 1; a fresh process loads it when `loads`)."""
    site = tmp_path / "site"
    plugins = site / ".nixl_cu12.mesonpy.libs" / "plugins"
    plugins.mkdir(parents=True)
    (site / ".nixl_cu12.mesonpy.libs" / "libnixl.so").write_bytes(b"")
    (plugins / "libplugin_UCX.so").write_bytes(b"ucx")
    info = site / "nixl_cu12-1.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nixl_cu12\nVersion: 1.5.1\n\n")
    bundled = _plugin(tmp_path / "bundled.so")
    for mod in (doctor, plugin_files, cli):
        monkeypatch.setattr(mod, "bundled_plugin", lambda: bundled)
    monkeypatch.setattr(doctor.probes, "plugin_api_version", lambda p: 1)
    monkeypatch.setattr(doctor.probes, "load_error_alone",
                        lambda p: None if loads else "libucp-b39b3ed9.so.0.0.0: cannot open shared object file")
    monkeypatch.setattr(doctor, "_has_gpus", lambda: False)
    monkeypatch.delenv(plugin_files.UCX_PLUGIN_ENV, raising=False)
    from nixl_bounce import locate
    nixl = locate.from_path(str(site))
    plugin_files.install(nixl)
    return nixl, bundled


def test_with_nixl_plugin_dir_the_doctor_checks_the_plugin_nixl_loads(capsys, monkeypatch, tmp_path):
    """The default folder holds the current plugin, NIXL_PLUGIN_DIR a stale one: NIXL loads
    the stale one, so that is a FAIL (it was a WARN and "all checks passed")."""
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch)
    env_dir = tmp_path / "pd"
    env_dir.mkdir()
    _plugin(env_dir / "libplugin_BOUNCE.so", extra=b"old")
    monkeypatch.setenv("NIXL_PLUGIN_DIR", str(env_dir))
    monkeypatch.setenv(plugin_files.UCX_PLUGIN_ENV, os.path.join(nixl.plugin_dir, "libplugin_UCX.so"))
    r = doctor.Report()
    assert doctor._check_plugin_dir(r, nixl)
    out = capsys.readouterr().out
    assert f"[FAIL] BOUNCE at {env_dir}/libplugin_BOUNCE.so, the one NIXL loads, differs" in out, out
    assert "fix: nixl-bounce install with NIXL_PLUGIN_DIR set" in out, out
    assert "same file as the wheel's" not in out and r.failed == 1, out
    # missing there: a FAIL too, with the same fix
    os.unlink(env_dir / "libplugin_BOUNCE.so")
    r = doctor.Report()
    assert not doctor._check_plugin_dir(r, nixl)
    out = capsys.readouterr().out
    assert f"[FAIL] BOUNCE is not installed ({env_dir}/libplugin_BOUNCE.so missing)" in out, out
    assert "with NIXL_PLUGIN_DIR set" in out and r.failed == 1, out
    # NIXL_PLUGIN_DIR naming NIXL's own folder (another spelling) is no override
    monkeypatch.setenv("NIXL_PLUGIN_DIR", nixl.plugin_dir + "/.")
    r = doctor.Report()
    assert doctor._check_plugin_dir(r, nixl)
    out = capsys.readouterr().out
    assert "NIXL_PLUGIN_DIR" not in out and "same file as the wheel's" in out and r.failed == 0, out


def test_a_ucx_plugin_copied_or_linked_into_nixl_plugin_dir_fails_with_the_env_fix(capsys, monkeypatch, tmp_path):
    """NIXL's UCX plugin finds its UCX libraries relative to its own folder: a link or copy
    beside BOUNCE in NIXL_PLUGIN_DIR cannot load them; the fix is NIXL_BOUNCE_UCX_PLUGIN."""
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch, loads=False)
    env_dir = tmp_path / "pd"
    env_dir.mkdir()
    plugin_files.install_into(str(env_dir))
    os.symlink(os.path.join(nixl.plugin_dir, "libplugin_UCX.so"), env_dir / "libplugin_UCX.so")
    monkeypatch.setenv("NIXL_PLUGIN_DIR", str(env_dir))
    r = doctor.Report()
    doctor._check_plugin_dir(r, nixl)
    out = capsys.readouterr().out
    own = os.path.join(nixl.plugin_dir, "libplugin_UCX.so")
    assert f"[FAIL] UCX plugin {env_dir}/libplugin_UCX.so cannot be loaded: libucp" in out, out
    assert f"fix: set NIXL_BOUNCE_UCX_PLUGIN={own}" in out, out
    assert "next to libplugin_UCX.so" not in out and "libplugin_UCX.so there" not in out, out
    assert r.failed == 1, out


def _install(monkeypatch, nixl, capsys):
    monkeypatch.setattr(cli, "_tested_versions", lambda: ("1.5.1",))
    import argparse
    code = cli.cmd_install(argparse.Namespace(nixl_path=nixl.site))
    out, err = capsys.readouterr()
    return code, out, err


def test_install_updates_the_copy_in_nixl_plugin_dir(capsys, monkeypatch, tmp_path):
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch)
    env_dir = tmp_path / "pd"
    env_dir.mkdir()
    _plugin(env_dir / "libplugin_BOUNCE.so", extra=b"old")
    monkeypatch.setenv("NIXL_PLUGIN_DIR", str(env_dir))
    code, out, err = _install(monkeypatch, nixl, capsys)
    assert code == 0, out + err
    assert f"updated: {env_dir}/libplugin_BOUNCE.so (NIXL_PLUGIN_DIR" in out, out
    assert plugin_files.is_same_file(str(env_dir / "libplugin_BOUNCE.so"), bundled)
    # no UCX plugin there and no NIXL_BOUNCE_UCX_PLUGIN: say what works (not "copy it there")
    assert f"NIXL_BOUNCE_UCX_PLUGIN={nixl.plugin_dir}/libplugin_UCX.so" in err, err
    assert "next to libplugin_UCX.so" not in out + err, out + err


def test_install_says_loudly_when_it_cannot_update_nixl_plugin_dir(capsys, monkeypatch, tmp_path):
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch)
    env_dir = tmp_path / "pd"
    env_dir.mkdir()
    _plugin(env_dir / "libplugin_BOUNCE.so", extra=b"old")
    monkeypatch.setenv("NIXL_PLUGIN_DIR", str(env_dir))
    real = plugin_files.install_into

    def refuse(d, source=None):
        if os.path.realpath(d) == os.path.realpath(env_dir):
            raise plugin_files._unwritable(d, PermissionError(13, "Permission denied"))
        return real(d, source)
    monkeypatch.setattr(plugin_files, "install_into", refuse)
    code, out, err = _install(monkeypatch, nixl, capsys)
    assert code == 1, out + err
    assert f"error: NIXL_PLUGIN_DIR={env_dir} is set" in err and "was NOT updated" in err, err
    assert "an OLD or foreign BOUNCE" in err and f"copy {bundled} to" in err, err


def test_an_unwritable_plugin_dir_names_the_folder_and_the_fix(monkeypatch, tmp_path):
    """Not a bare errno about a temp file (review 55 L2)."""
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch)
    os.unlink(plugin_files.installed_path(nixl))

    def denied(a, b):
        raise PermissionError(13, "Permission denied", a)
    monkeypatch.setattr(plugin_files.os, "replace", denied)
    with pytest.raises(OSError) as e:
        plugin_files.install(nixl)
    msg = str(e.value)
    assert msg.startswith(f"cannot write into {nixl.plugin_dir} (Permission denied)"), msg
    assert ".tmp-" not in msg and "NIXL_PLUGIN_DIR" in msg, msg
    assert not [f for f in os.listdir(nixl.plugin_dir) if ".tmp-" in f], "temp file left behind"


def test_install_into_an_untested_nixl_says_so(capsys, monkeypatch, tmp_path):
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch)
    monkeypatch.delenv(doctor.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.delenv("NIXL_PLUGIN_DIR", raising=False)
    meta = os.path.join(nixl.site, "nixl_cu12-1.5.1.dist-info", "METADATA")
    open(meta, "w").write("Metadata-Version: 2.1\nName: nixl_cu12\nVersion: 1.5.0\n\n")
    code, out, err = _install(monkeypatch, nixl, capsys)
    assert code == 0 and out.startswith("unchanged:"), out + err
    assert "nixl_cu12 1.5.0" in err and "NOT a NIXL version this build was tested with" in err, err
    assert "pip install --no-deps nixl-cu12==1.5.1" in err, err


def test_install_says_when_the_wheel_has_no_gpu_kernels(capsys, monkeypatch, tmp_path):
    nixl, bundled = _fake_nixl(tmp_path, monkeypatch)
    monkeypatch.delenv("NIXL_PLUGIN_DIR", raising=False)
    code, out, err = _install(monkeypatch, nixl, capsys)
    assert "GPU kernels" not in err, err
    _plugin(tmp_path / "bundled.so", kernels=False)
    code, out, err = _install(monkeypatch, nixl, capsys)
    assert code == 0 and "built WITHOUT its GPU kernels" in err and "BOUNCE_NVRTC_LIB" in err, out + err


def test_the_live_check_runs_without_the_users_overrides_and_says_which():
    environ = {"NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT": "4096", "NIXL_BOUNCE_ENABLE": "0",
               "NIXL_BOUNCE_ARENA_MEM": "vram", "NIXL_BOUNCE_UCX_PLUGIN": "/x/libplugin_UCX.so",
               "NIXL_BOUNCE_LOG": "debug", "NIXL_BOUNCE_ALLOW_UNTESTED_NIXL": "1", "NIXL_PLUGIN_DIR": "/p",
               "PATH": "/bin"}
    assert doctor.ignored_overrides(environ) == [
        "NIXL_BOUNCE_ARENA_MEM", "NIXL_BOUNCE_ENABLE", "NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT"]
    env = doctor.live_env(environ)
    assert not [k for k in env if k in doctor.ignored_overrides(environ)]
    for kept in ("NIXL_BOUNCE_UCX_PLUGIN", "NIXL_BOUNCE_LOG", "NIXL_BOUNCE_ALLOW_UNTESTED_NIXL",
                 "NIXL_PLUGIN_DIR", "PATH"):
        assert env[kept] == environ[kept], kept


@pytest.mark.parametrize("enable, state", [("0", "WARN"), ("true", "OK"), (None, "OK")])
def test_the_overrides_in_effect_are_named(capsys, monkeypatch, enable, state):
    for k in list(os.environ):
        if k.startswith("NIXL_BOUNCE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT", "4096")
    if enable is not None:
        monkeypatch.setenv("NIXL_BOUNCE_ENABLE", enable)
    r = doctor.Report()
    doctor._check_env_overrides(r, live=True)
    out = capsys.readouterr().out
    assert out.startswith(f"[{state:^4}] environment overrides set:"), out
    assert "NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT='4096'" in out and "your own runs" in out, out
    assert "the live check below runs without them" in out and r.failed == 0, out
    assert ("turns the bounce path OFF" in out) == (state == "WARN"), out


def _live_run(monkeypatch, tmp_path, result, stderr):
    """doctor._live with the child stubbed; returns the environment the child was given."""
    import json
    import subprocess
    nixl = _nixl(tmp_path, ["1.5.1"])
    monkeypatch.setattr(doctor.locate, "importable", lambda: [nixl])
    seen = {}

    def run(cmd, **kw):
        seen.update(kw.get("env") or {})
        return subprocess.CompletedProcess(cmd, 0, "NIXL_BOUNCE_LIVE " + json.dumps(result) + "\n", stderr)
    monkeypatch.setattr(doctor.subprocess, "run", run)
    r = doctor.Report()
    doctor._live(r, nixl)
    return r, seen


def test_a_live_failure_shows_the_childs_log_lines(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NIXL_BOUNCE_ENABLE", "0")
    stderr = ("noise\n2026-01-01T00:00:00Z  WARN BOUNCE bounce is off (bounce_enable=false)\n"
              "more noise\n")
    r, env = _live_run(monkeypatch, tmp_path, {"ok": False, "stage": "bounce ready",
                                               "error": "the peer never became bounce-ready in 30 s (no HELLO)"},
                       stderr)
    out = capsys.readouterr().out
    assert "NIXL_BOUNCE_ENABLE" not in env, "the live check ran with the user's override"
    assert "[FAIL] live check failed at 'bounce ready'" in out, out
    assert "       | 2026-01-01T00:00:00Z  WARN BOUNCE bounce is off" in out, out
    assert "see stderr" not in out and "noise" not in out and r.failed == 1, out


def test_a_missing_module_in_the_live_check_says_what_to_install(capsys, monkeypatch, tmp_path):
    r, _ = _live_run(monkeypatch, tmp_path, {"ok": False, "stage": "setup",
                                             "error": "ModuleNotFoundError: No module named 'numpy'"}, "")
    out = capsys.readouterr().out
    assert "fix: pip install numpy" in out and "report it" not in out, out


def test_the_wheel_build_refuses_a_plugin_without_kernels_unless_asked(tmp_path):
    """setup.py's check: pip hides cargo's warning, so a kernel-less build must stop (or be
    asked for with BOUNCE_ALLOW_NO_KERNELS=1)."""
    assert plugin_files.kernels_build_check(_plugin(tmp_path / "k.so"), {}) is None
    bare = _plugin(tmp_path / "bare.so", kernels=False)
    msg, fatal = plugin_files.kernels_build_check(bare, {})
    assert fatal and "WITHOUT its GPU kernels" in msg and "nvidia-cuda-nvrtc-cu12==12.0.140" in msg, msg
    assert "BOUNCE_ALLOW_NO_KERNELS=1" in msg, msg
    msg, fatal = plugin_files.kernels_build_check(bare, {"BOUNCE_ALLOW_NO_KERNELS": "1"})
    assert not fatal and "Building it anyway" in msg, msg


def _uninstall(nixl_path, capsys):
    import argparse
    code = cli.cmd_uninstall(argparse.Namespace(nixl_path=nixl_path))
    out, err = capsys.readouterr()
    return code, out, err


def test_uninstall_removes_a_plugin_left_where_nixl_was_uninstalled_first(capsys, monkeypatch, tmp_path):
    """`pip uninstall nixl-cu12` before `nixl-bounce uninstall` takes libnixl.so and leaves our
    plugin: uninstall still finds it on this Python's path, or in the plugins folder given,
    and says why it was left (review 55 L3)."""
    from nixl_bounce import locate
    monkeypatch.delenv("NIXL_PLUGIN_DIR", raising=False)
    for given in (False, True):
        nixl, _ = _fake_nixl(tmp_path / str(given), monkeypatch)
        orphan = plugin_files.installed_path(nixl)
        os.unlink(os.path.join(nixl.lib_dir, "libnixl.so"))  # what pip removes
        # This Python's path is the fake site alone (every module used is imported already).
        monkeypatch.setattr(sys, "path", [nixl.site])
        monkeypatch.setattr(cli, "find", lambda path: locate.find(path) if path else [])
        if given:
            code, out, err = _uninstall(nixl.plugin_dir, capsys)
        else:
            assert locate.orphaned_plugins(plugin_files.PLUGIN_FILE) == [os.path.realpath(orphan)]
            code, out, err = _uninstall(None, capsys)
        assert code == 0, out + err
        assert "left behind: its NIXL is no longer installed" in out, out
        assert not os.path.exists(orphan)
        assert locate.orphaned_plugins(plugin_files.PLUGIN_FILE) == []
    # Nothing of ours in a folder without NIXL: the error says what was looked for.
    with pytest.raises(locate.NixlNotFound):
        _uninstall(str(tmp_path / "nothing"), capsys)


def test_a_plugin_built_for_a_newer_c_library_is_not_called_a_broken_install():
    """On a host with an older glibc than the build machine's the plugin cannot load; the fix is
    a wheel built for that host, not a reinstall of the same one (review 55 L5)."""
    glibc = ("/x/libplugin_BOUNCE.so: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.34' not found "
             "(required by /x/libplugin_BOUNCE.so)")
    fix = doctor._load_fix(glibc)
    assert "GLIBC_2.34 is missing" in fix and "oldest distribution" in fix and "reinstall" not in fix, fix
    assert "GLIBCXX_3.4.30 is missing" in doctor._load_fix(glibc.replace("GLIBC_2.34", "GLIBCXX_3.4.30"))
    assert doctor._load_fix("/x/libplugin_BOUNCE.so: invalid ELF header").startswith("reinstall nixl-bounce")
