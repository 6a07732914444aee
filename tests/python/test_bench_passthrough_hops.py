"""The guard rails of benches/passthrough.py and benches/control_hops.py (review 55, M6 and M3):
passthrough prints no figure unless every BOUNCE request of every row went to UCX and the echo's
bytes are right; control_hops' hop estimate uses the round trips the WRITEs took and is never
negative. Specified without a plugin: counters, buffers and p50s are given."""
import os
import sys

import numpy as np

BENCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benches")
sys.path.insert(0, BENCHES)
_env = dict(os.environ)
import control_hops  # noqa: E402
import passthrough  # noqa: E402
# Both set NIXL_BOUNCE_* variables for their own runs at import: not for the tests after these.
os.environ.clear()
os.environ.update(_env)


# passthrough.py: the path

def test_passthrough_every_prepared_handle_passes_through_and_no_post_leaves_ucx():
    preps = {passthrough.SETUP: 2, "prep+release 1 desc": 44}
    good = {passthrough.SETUP: {"passthrough_xfers": 2, "fallback_count": 2},
            "prep+release 1 desc": {"passthrough_xfers": 44, "fallback_count": 44},
            "WRITE 1 x 4 KiB": {}, "load+unload metadata": {"forgets_sent": 24}}
    assert passthrough.path_problems(good, preps) == []
    # a handle the gate let through to the same-host path: one pass-through short, its posts on CMA
    bad = {**good, passthrough.SETUP: {"passthrough_xfers": 1}, "WRITE 1 x 4 KiB": {"cma_xfers": 104}}
    problems = passthrough.path_problems(bad, preps)
    assert any("moved by 1, expected 2" in p for p in problems)
    assert any("WRITE 1 x 4 KiB" in p and "cma_xfers +104" in p for p in problems)
    for key in ("bounce_xfers", "ipc_xfers"):
        assert passthrough.path_problems({**good, "WRITE 1 x 64 MiB": {key: 1}}, preps)
    # a row that prepares nothing must count no pass-through either
    assert passthrough.path_problems({**good, "empty getNotifs": {"passthrough_xfers": 1}}, preps)


# passthrough.py: the bytes

def _echo(index, src):
    return passthrough.expected_echo(index, src)


def test_passthrough_bytes_destinations_and_guards():
    src = np.random.default_rng(1).integers(0, 256, passthrough.BIG, dtype=np.uint8)
    exp = _echo(0, src)
    assert passthrough.byte_problems("UCX", exp.copy(), exp) == []
    for at, region in ((5, "64 MiB WRITE's destination"), (passthrough.BIG, "guard after it"),
                       (passthrough.SMALL_DST + 7, "4 KiB WRITE's destination"),
                       (passthrough.ECHO_BYTES - 1, "guard after that")):
        got = exp.copy()
        got[at] ^= 0xFF
        (p,) = passthrough.byte_problems("BOUNCE", got, exp)
        assert region in p, p
    # the 4 KiB WRITE's bytes differ from what the 64 MiB one would put there
    assert not np.array_equal(exp[passthrough.SMALL_DST:passthrough.SMALL_DST + passthrough.SMALL],
                              src[:passthrough.SMALL])
    assert passthrough.byte_problems("UCX", exp[:-1].copy(), exp)


# control_hops.py: the hop estimate

US = 1e-6


def test_hops_inline_write_is_one_round_trip_against_a_frame_sized_notification():
    # session 55's default run: 256 x 64 B inline, the WRITE below the 2-RTT floor
    est = control_hops.hop_estimate(60 * US, 90 * US, 30 * US, 45 * US, {"inline_ack_wait": 30}, 30)
    hop, base, label, k = est
    assert (hop, base, k) == (60 * US, 45 * US, 1) and "WANT's size" in label


def test_hops_two_round_trips_keep_the_old_formula_and_one_takes_the_write_off():
    two = control_hops.hop_estimate(100 * US, 70 * US, 20 * US, 25 * US, {"grant_wait": 30, "ack_wait": 30}, 30)
    assert abs(two[0] - ((100 - 70) / 2 + 20) * US) < 1e-12 and two[3] == 2
    one = control_hops.hop_estimate(100 * US, 70 * US, 20 * US, 25 * US, {"ack_wait": 30}, 30)  # standing credit
    assert abs(one[0] - (100 - (70 - 40)) * US) < 1e-12 and one[3] == 1


def test_hops_never_negative_and_none_for_mixed_kinds():
    est = control_hops.hop_estimate(10 * US, 90 * US, 10 * US, 12 * US, {"grant_wait": 30, "ack_wait": 30}, 30)
    assert est[0] is None and "noise" in est[1]
    mixed = control_hops.hop_estimate(60 * US, 90 * US, 30 * US, 45 * US, {"inline_ack_wait": 20, "ack_wait": 10}, 30)
    assert mixed[0] is None and "no single kind" in mixed[1]
    assert control_hops.hop_estimate(None, None, None, None, {}, 0)[0] is None
