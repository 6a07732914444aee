"""`nixl-bounce doctor`'s checks that read the host, each given the host's answer (the whole
doctor runs in test_install.py): what it says, and that it warns, never fails, where BOUNCE
still works by another path."""
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


def test_the_ptrace_scope_is_read_from_yama_or_is_none(tmp_path):
    f = tmp_path / "ptrace_scope"
    f.write_text("1\n")
    assert probes.ptrace_scope(str(f)) == 1
    f.write_text("garbage")
    assert probes.ptrace_scope(str(f)) is None
    assert probes.ptrace_scope(str(tmp_path / "absent")) is None
    expected = None if not os.path.exists(probes.YAMA_PTRACE_SCOPE) else int(open(probes.YAMA_PTRACE_SCOPE).read())
    assert probes.ptrace_scope() == expected
