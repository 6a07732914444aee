"""The benchmarks' own guard rails (review 55): a benchmark prints no figure for a variant that
did not take its path on every post, or whose bytes are wrong, and says which goals it missed.
These checks decide whether a printed number means anything, so they are specified here
without a plugin: counters and buffers are given, the verdict is checked."""
import os
import sys

import pytest

import nixlkit

BENCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benches")
sys.path.insert(0, BENCHES)

import compare  # noqa: E402
import gpu_compare  # noqa: E402
import kv_patterns  # noqa: E402


# kv_patterns: every post counted once on the variant's path

def test_kv_bounced_variant_needs_every_post_bounced():
    assert kv_patterns.path_problem("BOUNCE bounced", {"bounce_xfers": 36, "bounce_ok": 36}, 36) is None
    # one post that returned DONE without moving anything leaves the counters short
    assert "35 of 36" in kv_patterns.path_problem("BOUNCE bounced", {"bounce_xfers": 35, "bounce_ok": 35}, 36)
    assert kv_patterns.path_problem("BOUNCE bounced", {"bounce_xfers": 36, "bounce_ok": 36, "cma_ok": 1}, 36)
    assert kv_patterns.path_problem("BOUNCE bounced", {"bounce_xfers": 37, "bounce_ok": 36}, 36)


def test_kv_shipped_variant_needs_every_post_on_the_same_host_path():
    assert kv_patterns.path_problem("BOUNCE", {"cma_xfers": 36, "cma_ok": 36}, 36) is None
    assert kv_patterns.path_problem("BOUNCE", {"ipc_ok": 20, "cma_ok": 16}, 36) is None
    assert "1 of 36" in kv_patterns.path_problem("BOUNCE", {"cma_ok": 1}, 36)
    assert kv_patterns.path_problem("BOUNCE", {"cma_ok": 36, "bounce_xfers": 1}, 36)


def test_kv_any_request_passed_to_ucx_fails_every_bounce_variant():
    for variant in ("BOUNCE", "BOUNCE bounced"):
        assert "UCX" in kv_patterns.path_problem(variant, {"bounce_ok": 36, "bounce_xfers": 36,
                                                           "passthrough_xfers": 1}, 36)
    assert kv_patterns.path_problem("UCX", {}, 36) is None


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_kv_every_round_starts_with_the_variant_that_ended_the_one_before(n):
    sides = [f"v{i}" for i in range(n)]
    rounds = 4 * n  # kept rounds, after the warm-up round 0
    seq = [s for r in range(rounds + 1) for s in kv_patterns.block_order(sides, r)]
    for r in range(rounds):
        order = kv_patterns.block_order(sides, r)
        assert sorted(order) == sorted(sides), "each variant once a round"
        if r:
            assert order[0] == kv_patterns.block_order(sides, r - 1)[-1]
    if n > 1:
        # as many blocks right after one of its own for every variant: one per n rounds
        after_own = {s: 0 for s in sides}
        for prev, cur in zip(seq, seq[1:]):
            after_own[cur] += prev == cur
        assert after_own == {s: rounds // n for s in sides}
        # and every variant takes every place in a round equally often
        for place in range(n):
            firsts = [kv_patterns.block_order(sides, r)[place] for r in range(rounds)]
            assert all(firsts.count(s) == rounds // n for s in sides)


def test_kv_p99_of_fewer_than_100_samples_is_their_max_and_says_so():
    xs = [1.0] * 47 + [9.0]
    assert kv_patterns.pct(xs, 99) == 9.0
    assert kv_patterns.pct(xs, 50) == 1.0
    assert kv_patterns.pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5, "the median, not the upper one"
    assert kv_patterns.pct(list(range(1, 201)), 99) == 198
    assert kv_patterns.p99_label(48) == "p99 (max of 48)"
    assert kv_patterns.p99_label(120) == "p99 (of 120)"


# compare.py: the same, on one shape

def test_compare_every_post_on_its_path_and_the_bytes_exact():
    res = {"exact": True, "posts": 7, "stats": {"stats.bounce_ok": 7}}
    assert compare.path_problem("BOUNCE bounced", "bounce", res, 1 << 26) is None
    short = dict(res, stats={"stats.bounce_ok": 6})
    assert "bounce path" in compare.path_problem("BOUNCE bounced", "bounce", short, 1 << 26)
    leaked = dict(res, stats={"stats.bounce_ok": 7, "stats.passthrough_xfers": 1})
    assert compare.path_problem("BOUNCE bounced", "bounce", leaked, 1 << 26)
    assert "buffer" in compare.path_problem("UCX scattered", None, dict(res, exact=False), 1 << 26)


# gpu_compare.py: the byte check proves the last post wrote

class FakePeer:
    """The target process's buffer, as peer.py serves it (fill, dump)."""

    def __init__(self, size, seed):
        self.buf = nixlkit.pattern(seed, size)

    def call(self, op, **cmd):
        if op == "fill":
            self.buf[:] = nixlkit.pattern(cmd["seed"], self.buf.nbytes)
        elif op == "dump":
            self.buf.tofile(cmd["path"])
        else:
            raise AssertionError(op)


class Args:
    def __init__(self, op):
        self.op = op


@pytest.mark.parametrize("mode", ["scattered", "contiguous"])
def test_gpu_compare_write_check_passes_only_when_the_last_post_wrote(mode):
    lay = nixlkit.Scattered(64, 256, seed=5)
    src = nixlkit.pattern(7, lay.src_bytes)

    def fresh():
        return FakePeer(lay.dst_bytes + lay.src_bytes, 6)

    def writes(peer):
        def post():
            if mode == "scattered":
                peer.buf[:lay.dst_bytes] = lay.expected(src, peer.buf[:lay.dst_bytes])
            else:
                peer.buf[lay.dst_bytes:] = src
        return post

    peer = fresh()
    assert gpu_compare.check_bytes(Args("WRITE"), peer, src, lay, mode, writes(peer)) is None
    # a post that moved nothing: the destinations keep the refill's bytes
    peer = fresh()
    assert "target's buffer" in gpu_compare.check_bytes(Args("WRITE"), peer, src, lay, mode, lambda: None)

    # a write that also changed one byte outside its destinations: a slot no piece goes to,
    # or, for the contiguous write, the scattered slots' area
    taken = {int(k) for k in lay.slots}
    free_slot = next(k for k in range(lay.dst_bytes // lay.slot) if k not in taken)
    outside = free_slot * lay.slot if mode == "scattered" else 0

    def spills():
        writes(peer)()
        peer.buf[outside] ^= 0xFF
    peer = fresh()
    assert "1 bytes differ" in gpu_compare.check_bytes(Args("WRITE"), peer, src, lay, mode, spills)


def test_gpu_compare_read_check_passes_only_when_the_last_post_read():
    lay = nixlkit.Scattered(64, 256, seed=5)
    peer = FakePeer(lay.dst_bytes + lay.src_bytes, 6)
    mine = nixlkit.pattern(7, lay.src_bytes)

    def reads():
        for (o, s), (d, _, _) in zip(((int(o), s) for o, s in zip(lay.src_offsets, lay.sizes)), lay.dst_list(0)):
            mine[o:o + s] = peer.buf[d:d + s]

    assert gpu_compare.check_bytes(Args("READ"), peer, mine, lay, "scattered", reads) is None
    mine[:] = nixlkit.pattern(7, lay.src_bytes)
    assert "initiator's buffer" in gpu_compare.check_bytes(Args("READ"), peer, mine, lay, "scattered", lambda: None)


def test_gpu_compare_counts_every_post_on_its_path():
    ok = {"stats.bounce_ok": "17"}
    assert gpu_compare.path_problem("BOUNCE bounced", ok, "WRITE", False, 17) is None
    assert "16 of 17" in gpu_compare.path_problem("BOUNCE bounced", {"stats.bounce_ok": "16"}, "WRITE", False, 17)
    assert gpu_compare.path_problem("BOUNCE", {"stats.ipc_ok": "17"}, "WRITE", False, 17) is None
    assert gpu_compare.path_problem("BOUNCE", {"stats.ipc_ok": "1"}, "WRITE", False, 17)
    assert gpu_compare.path_problem("BOUNCE", {"stats.ipc_ok": "5", "stats.bounce_ok": "12"}, "WRITE", True, 17) is None
    assert gpu_compare.path_problem("BOUNCE", {"stats.ipc_ok": "5"}, "WRITE", True, 17)
    assert "UCX" in gpu_compare.path_problem("BOUNCE", {"stats.ipc_ok": "17", "stats.passthrough_xfers": "1"},
                                             "WRITE", False, 17)
