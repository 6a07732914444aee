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
