"""One-way transfers past a target's mailbox slots (issue 13): a target holds at most a quarter
of its 256 mailbox slots for one initiator (64), and a one-way WANT that finds none waits for
one instead of being dropped. Real NIXL agents, the target in its own process and never loading
the initiator (one way): the initiator posts more one-way WRITEs at once than its slot cap, then
as many READs. What must hold: every transfer completes, every destination byte is the one its
transfer carried (each transfer from a pattern of its own seed) and every byte between the
destinations is untouched; the counters show the bounce path, WANTs that waited for a slot
(`one_way_queued` > 0) and none dropped (`one_way_refused` == 0)."""
import os
import signal
import time

import numpy as np

import nixlkit
from test_failures import ARENA, SLACK_S, SMALL, dump, peer_stats, procs, settle, settle_local, stats, watchdog  # noqa: F401

# 80 transfers in flight, 16 past the 64 slots one initiator may hold; each 1024 x 512 B, so it
# bounces (at least 256 small descriptors) yet moves little (the test stays quick on 2 cores).
XFERS = 80
PIECES, SIZE = 1024, 512
# Waiting for a slot is not progress: the waiting transfers' no-progress timeout must outlast
# the first 64 transfers through a 4 MiB arena, on a loaded 2-core machine.
PARAMS = {**SMALL, "bounce_request_timeout_ms": "20000"}


def layouts(seed):
    """One scattered layout per transfer, each with its own destination permutation."""
    return [nixlkit.Scattered(PIECES, SIZE, seed=seed + k) for k in range(XFERS)]


def post_all(ag, handles, hold, deadline=40):
    """Posts every prepared transfer back to back while the target process `hold` is stopped
    (SIGSTOP), so that all of them are in flight at once however fast the first ones could
    finish (a posting thread now runs the WANT out itself, and small transfers finished while
    later ones were still being posted), then lets it go on and waits for all; returns their
    states and when each ended after the first post."""
    t0 = time.monotonic()
    os.kill(hold, signal.SIGSTOP)
    try:
        for h in handles:
            assert ag.transfer(h) != "ERR"
    finally:
        os.kill(hold, signal.SIGCONT)
    posted = time.monotonic() - t0
    states, ended = run_all(ag, handles, deadline)
    print(f"\nposted {len(handles)} in {posted * 1e3:.1f} ms", end="")
    return states, ended


def run_all(ag, handles, deadline):
    """Polls every handle until none is in flight; returns their states and when each ended."""
    t0 = time.monotonic()
    states, ended = [None] * len(handles), [None] * len(handles)
    while any(s is None for s in states) and time.monotonic() - t0 < deadline:
        for i, h in enumerate(handles):
            if states[i] is None:
                st = ag.check_xfer_state(h)
                if st != "PROC":
                    states[i], ended[i] = st, time.monotonic() - t0
        ag.get_new_notifs()
    return states, ended


def check_counters(ag, p, s0, t0, ok_key):
    s1 = settle_local(ag, ARENA, SLACK_S, "initiator")
    t1 = settle(lambda: peer_stats(p), ARENA, SLACK_S, "target")
    assert s1[ok_key] - s0[ok_key] == XFERS, (s0, s1)
    assert s1["passthrough_xfers"] == s0["passthrough_xfers"], "a transfer went through plain UCX"
    assert s1["one_way_sent"] - s0["one_way_sent"] == XFERS
    assert t1["one_way_answered"] - t0["one_way_answered"] == XFERS
    assert t1["one_way_queued"] - t0["one_way_queued"] > 0, "no WANT waited for a slot: the test proves nothing"
    assert t1["one_way_refused"] == t0["one_way_refused"], "a WANT was dropped"
    assert t1["peer_arenas_loaded"] == 0, "the target loaded the initiator: not one way"
    return s1, t1


def expected_all(lays, sources, before):
    """The destinations after every transfer k moved its layout's pieces of `sources` (laid
    back to back, one transfer's sources each) into its part of `before`."""
    sb, db = lays[0].src_bytes, lays[0].dst_bytes
    return np.concatenate([lay.expected(sources[k * sb:(k + 1) * sb], before[k * db:(k + 1) * db])
                           for k, lay in enumerate(lays)])


def transfer_all(ag, op, peer_name, lists, hold):
    """Prepares one `op` per (local, remote) descriptor list pair, posts them all back to back
    while process `hold` is stopped, waits until each is DONE and releases them; returns when
    each ended (see `post_all`)."""
    handles = [ag.initialize_xfer(op, ag.get_xfer_descs(lo, "DRAM"), ag.get_xfer_descs(re, "DRAM"),
                                  peer_name, b"", backends=["BOUNCE"]) for lo, re in lists]
    states, ended = post_all(ag, handles, hold)
    assert states == ["DONE"] * len(handles), f"states: {states}"
    for h in handles:
        ag.release_xfer_handle(h)
    return ended


def test_more_one_way_writes_than_a_peers_slots_all_land_byte_exact(procs, tmp_path):
    lays = layouts(seed=500)
    src_bytes, dst_bytes = lays[0].src_bytes, lays[0].dst_bytes
    p = procs()
    meta, raddr = p.start(name="ows-w-rx", size=XFERS * dst_bytes, seed=401, params=PARAMS)
    ag = nixlkit.agent("ows-w-tx", params=PARAMS)
    # Each transfer's source is a pattern of its own seed.
    src = np.concatenate([nixlkit.pattern(600 + k, src_bytes) for k in range(XFERS)])
    nixlkit.register(ag, src)
    ag.add_remote_agent(meta)  # the target never loads us: one way
    s0, t0 = stats(ag), peer_stats(p)
    lists = [(lay.src_list(src.ctypes.data + k * src_bytes), lay.dst_list(raddr + k * dst_bytes))
             for k, lay in enumerate(lays)]
    with watchdog(60, [p], "one-way writes past the slot cap"):
        ended = transfer_all(ag, "WRITE", "ows-w-rx", lists, p.proc.pid)
    before = nixlkit.pattern(401, XFERS * dst_bytes)
    expected = expected_all(lays, src, before)
    nixlkit.assert_same(dump(p, tmp_path, "ows-w-rx.bin"), expected, "destinations (and every byte between them)")
    _, t1 = check_counters(ag, p, s0, t0, "bounce_ok")
    print(f"; {XFERS} one-way WRITEs: first done {min(ended):.3f}s, last {max(ended):.3f}s,"
          f" {t1['one_way_queued'] - t0['one_way_queued']} waited for a slot")


def test_more_one_way_reads_than_a_peers_slots_all_land_byte_exact(procs):
    lays = layouts(seed=700)
    src_bytes, dst_bytes = lays[0].src_bytes, lays[0].dst_bytes
    p = procs()
    # The target's buffer holds every transfer's sources, back to back.
    meta, raddr = p.start(name="ows-r-tgt", size=XFERS * src_bytes, seed=801, params=PARAMS)
    ag = nixlkit.agent("ows-r-ini", params=PARAMS)
    dst = nixlkit.pattern(802, XFERS * dst_bytes)
    before = dst.copy()
    nixlkit.register(ag, dst)
    ag.add_remote_agent(meta)  # the target never loads us: one way
    s0, t0 = stats(ag), peer_stats(p)
    lists = [(lay.dst_list(dst.ctypes.data + k * dst_bytes), lay.src_list(raddr + k * src_bytes))
             for k, lay in enumerate(lays)]
    with watchdog(60, [p], "one-way READs past the slot cap"):
        ended = transfer_all(ag, "READ", "ows-r-tgt", lists, p.proc.pid)
    sources = nixlkit.pattern(801, XFERS * src_bytes)
    expected = expected_all(lays, sources, before)
    nixlkit.assert_same(dst, expected, "READ destinations (and every byte between them)")
    _, t1 = check_counters(ag, p, s0, t0, "bounce_read_ok")
    print(f"; {XFERS} one-way READs: first done {min(ended):.3f}s, last {max(ended):.3f}s,"
          f" {t1['one_way_queued'] - t0['one_way_queued']} waited for a slot")


def test_under_the_slot_cap_nothing_waits(procs, tmp_path):
    """The control: a few transfers in flight, well under the cap, and no WANT waits (so the
    tests above show the queue at work, not an artefact of counting)."""
    lays = [nixlkit.Scattered(PIECES, SIZE, seed=900 + k) for k in range(8)]
    src_bytes, dst_bytes = lays[0].src_bytes, lays[0].dst_bytes
    p = procs()
    meta, raddr = p.start(name="ows-c-rx", size=len(lays) * dst_bytes, seed=901, params=PARAMS)
    ag = nixlkit.agent("ows-c-tx", params=PARAMS)
    # Each transfer's source is a pattern of its own seed.
    src = np.concatenate([nixlkit.pattern(910 + k, src_bytes) for k in range(len(lays))])
    nixlkit.register(ag, src)
    ag.add_remote_agent(meta)  # the target never loads us: one way
    s0, t0 = stats(ag), peer_stats(p)
    with watchdog(60, [p], "one-way writes under the slot cap"):
        # Posted as the tests above post theirs: all at once, the target stopped meanwhile.
        lists = [(lay.src_list(src.ctypes.data + k * src_bytes), lay.dst_list(raddr + k * dst_bytes))
                 for k, lay in enumerate(lays)]
        handles = [ag.initialize_xfer("WRITE", ag.get_xfer_descs(lo, "DRAM"), ag.get_xfer_descs(re, "DRAM"),
                                      "ows-c-rx", b"", backends=["BOUNCE"]) for lo, re in lists]
        states, _ = post_all(ag, handles, p.proc.pid)
        assert states == ["DONE"] * len(lays), f"states: {states}"
        for h in handles:
            ag.release_xfer_handle(h)
    expected = expected_all(lays, src, nixlkit.pattern(901, len(lays) * dst_bytes))
    nixlkit.assert_same(dump(p, tmp_path, "ows-c-rx.bin"), expected, "destinations (and every byte between them)")
    s1 = settle_local(ag, ARENA, SLACK_S, "initiator")
    t1 = settle(lambda: peer_stats(p), ARENA, SLACK_S, "target")
    assert s1["bounce_ok"] - s0["bounce_ok"] == len(lays), (s0, s1)
    assert s1["one_way_sent"] - s0["one_way_sent"] == len(lays), (s0, s1)
    assert s1["passthrough_xfers"] == s0["passthrough_xfers"], "a transfer went through plain UCX"
    assert t1["one_way_answered"] - t0["one_way_answered"] == len(lays)
    assert t1["one_way_refused"] == t0["one_way_refused"], "a WANT was dropped"
    assert t1["one_way_queued"] == t0["one_way_queued"], "a WANT waited although slots were free"
