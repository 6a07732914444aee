"""READ bounce (issue 13): the initiator READs many small pieces of the target's registered
memory; the target gathers them into its arena, the initiator READs each region into its own
and scatters it. Real NIXL agents, the target in its own process, with metadata loaded both
ways or by the initiator only (the target answers through its mailbox then). What must hold:
every destination byte lands and nothing else changes, the counters prove the READ path, and
every failure resolves the transfer: a target killed mid-READ, a READ cancelled mid-flight
(both arenas come back whole, then the pair is byte-exact again)."""
import time

import numpy as np
import pytest

import nixlkit
from test_failures import (ARENA, SLACK_S, SMALL, TIMEOUT_MS, ZMQ, act_in_flight, connect, dump,  # noqa: F401
                           kill_mid_flight, peer_stats, procs, resolve, settle, settle_local, stats, watchdog)

CONTROL = {"ucx": {}, "zmq": ZMQ}


def reader_and_target(procs, names, lay, seeds, params, metadata):
    """A target process (`names[0]`) holding `lay`'s packed sources (pattern `seeds[0]`) and an
    agent here (`names[1]`) holding its scattered destinations (pattern `seeds[1]`), the
    target's metadata loaded both ways or by the agent only. Returns (target, its buffer's
    address, agent, destinations)."""
    p = procs()
    meta, raddr = p.start(name=names[0], size=lay.src_bytes, seed=seeds[0], params=params)
    ag = nixlkit.agent(names[1], params=params)
    dst = nixlkit.pattern(seeds[1], lay.dst_bytes)
    nixlkit.register(ag, dst)
    if metadata == "two-way":
        connect(ag, p, meta)
    else:
        ag.add_remote_agent(meta)
    return p, raddr, ag, dst


def post_read(ag, name, lay, dst, raddr):
    """Our scattered destinations, the target's packed sources."""
    lo = ag.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(lay.src_list(raddr), "DRAM")
    h = ag.initialize_xfer("READ", lo, re, name, b"", backends=["BOUNCE"])
    assert ag.transfer(h) != "ERR"
    return h




@pytest.mark.parametrize("metadata, control", [("one-way", "ucx"), ("two-way", "ucx"), ("one-way", "zmq")])
def test_a_read_lands_byte_exact_and_the_counters_prove_the_path(procs, metadata, control):
    params = {**SMALL, **CONTROL[control]}
    lay = nixlkit.Scattered(16384, 4096, seed=81)  # 64 MiB through 4 MiB arenas
    name = f"rd-tgt-{metadata}-{control}"
    p, raddr, ag, dst = reader_and_target(procs, (name, f"rd-ini-{metadata}-{control}"), lay, (82, 83), params, metadata)
    s0, t0 = stats(ag), peer_stats(p)
    with watchdog(90, [p], "READ"):
        h = post_read(ag, name, lay, dst, raddr)
        st, _ = resolve(ag, h, 30)
        assert st == "DONE", st
        ag.release_xfer_handle(h)
    nixlkit.assert_same(dst, lay.expected(nixlkit.pattern(82, lay.src_bytes), nixlkit.pattern(83, lay.dst_bytes)),
                        "READ destinations (and every byte between them)")
    s1 = settle_local(ag, ARENA, SLACK_S, "initiator")
    t1 = settle(lambda: peer_stats(p), ARENA, SLACK_S, "target")
    assert s1["bounce_read_ok"] == s0["bounce_read_ok"] + 1, (s0, s1)
    assert s1["passthrough_xfers"] == s0["passthrough_xfers"], "the READ went through plain UCX"
    chunks = s1["bounce_chunks"] - s0["bounce_chunks"]
    assert s1["read_chunks_pulled"] - s0["read_chunks_pulled"] == chunks
    assert t1["read_chunks_served"] - t0["read_chunks_served"] == chunks
    if metadata == "one-way":
        assert s1["one_way_sent"] == s0["one_way_sent"] + 1
        assert t1["records_written"] - t0["records_written"] == chunks, "a READY record per chunk"
        assert t1["peer_arenas_loaded"] == 0, "the target loaded the initiator: not one way"


@pytest.mark.parametrize("op, metadata", [("READ", "one-way"), ("READ", "two-way"), ("WRITE", "two-way")])
def test_a_request_prepared_over_memory_deregistered_since_fails_at_its_post(procs, tmp_path, op, metadata):
    """Review 61 (READ, H1). A bounced request prepared, its local memory deregistered with
    nothing in flight, then posted: the core fails only transfers in flight, so the READ
    scattered into the deregistered memory (2 MB of it) and the WRITE gathered from it, both
    reported DONE. Now the deregistration revokes the request: its post fails, nothing of ours
    is written, nothing reaches the target. (The WRITE gathers its scattered sources: one
    written straight from user memory was already refused by its direct-write check.)"""
    lay = nixlkit.Scattered(512, 4096, seed=611)
    name = f"rd-dereg-{op}-{metadata}"
    p, raddr, ag, buf = reader_and_target(procs, (name, f"rd-dereg-ini-{op}-{metadata}"), lay, (612, 613), SMALL, metadata)
    lo = ag.get_xfer_descs(lay.dst_list(buf.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(lay.src_list(raddr), "DRAM")
    h = ag.initialize_xfer(op, lo, re, name, b"", backends=["BOUNCE"])
    t0 = peer_stats(p)
    ag.deregister_memory(ag.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"), backends=["BOUNCE"])
    with watchdog(60, [p], "a post after the deregistration"):
        try:
            st = ag.transfer(h)
        except Exception:
            st = "ERR"
        if st != "ERR":
            st, _ = resolve(ag, h, 10)
    assert st == "ERR", f"a {op} prepared over memory deregistered since ended {st}"
    nixlkit.assert_same(buf, nixlkit.pattern(613, lay.dst_bytes), "our deregistered memory")
    nixlkit.assert_same(dump(p, tmp_path, "target.bin")[:lay.src_bytes], nixlkit.pattern(612, lay.src_bytes),
                        "the target's memory")
    t1 = peer_stats(p)
    assert t1["read_chunks_served"] == t0["read_chunks_served"], "the target gathered for a revoked READ"
    ag.release_xfer_handle(h)


def test_a_captured_pull_sent_again_under_a_fresh_transfer_id_opens_nothing(procs):
    """Review 61 (READ, M1). A PULL's proofs bound its token and its initiator's name, not its
    transfer id, and the replay window is by id: a PULL seen on the wire, sent again with only
    its id changed, or a new PULL reusing its token and proof bytes with runs of the sender's
    choosing, was served (the target gathered those bytes into its arena, which anyone who
    loaded its metadata may READ). Since wire version 17 the id is bound: both are forgeries."""
    import base64
    import struct

    import hostile_peer as hp
    v = procs("hostile_peer.py")
    with watchdog(60, [v], "a captured PULL under a fresh id"):
        v.call(op="agent", name="rt-victim", params=SMALL)
        r = v.call(op="buffer", agent="rt-victim", size=1 << 20, seed=7, register=1 << 20)
        addr, vmeta = r["addr"], base64.b64decode(r["meta"])
        peer = nixlkit.agent("rt-peer", params={**SMALL, **hp.RAW})
        peer.add_remote_agent(vmeta)
        session = hp.session_of(peer.get_agent_metadata())
        (reg, key), = hp.registrations_of(vmeta)
        token, x = 0x1234_5678_9abc_def0_1122_3344_5566_7788, 1 << 50

        def send(frame):
            peer.send_notif("rt-victim", frame)
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                peer.get_new_notifs()
            return peer_stats(v, agent="rt-victim")

        genuine = hp.pull(session, x, token, [(4096, [(0, addr, 4096, 1, 0, 0)])], [hp.proof(reg, key, token, "rt-peer", x)])
        s1 = send(genuine)
        assert s1["read_chunks_served"] == 1, "the genuine PULL was served"
        send(hp.pull(session, x, token, [], [], total=0))  # its initiator cancels
        s3 = send(genuine)
        assert s3["control_replayed"] == s1["control_replayed"] + 1, "the same frame again is a replay"
        at = len(hp.header(11, session))
        fresh_id = bytearray(genuine)
        fresh_id[at:at + 8] = struct.pack("<Q", x + 1)
        s4 = send(bytes(fresh_id))
        captured = [(reg, bytes(genuine[-16:]))]
        s5 = send(hp.pull(session, x + 2, token, [(65536, [(0, addr + (512 << 10), 65536, 1, 0, 0)])], captured))
        assert (s4["read_chunks_served"], s5["read_chunks_served"]) == (1, 1), "a captured proof served a new READ"
        assert s5["control_forged"] == s3["control_forged"] + 2, (s3, s5)
        # The initiator's own next transfer, proven for its own id, is served.
        s6 = send(hp.pull(session, x + 3, token + 1, [(4096, [(0, addr, 4096, 1, 0, 0)])],
                          [hp.proof(reg, key, token + 1, "rt-peer", x + 3)]))
        assert s6["read_chunks_served"] == 2, s6


@pytest.mark.parametrize("metadata", ["one-way", "two-way"])
def test_a_read_whose_target_is_killed_fails_in_bounded_time(procs, metadata):
    lay = nixlkit.Scattered(16384, 4096, seed=84)
    ag = nixlkit.agent(f"rd-survivor-{metadata}", params=SMALL)
    dst = nixlkit.pattern(85, lay.dst_bytes)
    nixlkit.register(ag, dst)
    def start(p, name):
        meta, raddr = p.start(name=name, size=lay.src_bytes, seed=86, params=SMALL)
        if metadata == "two-way":
            connect(ag, p, meta)
        else:
            ag.add_remote_agent(meta)
        return raddr

    _, _, before = kill_mid_flight(ag, procs, start, lambda name, raddr: post_read(ag, name, lay, dst, raddr))
    after = settle_local(ag, ARENA, TIMEOUT_MS / 1000 + SLACK_S, "initiator after the target's death")
    assert after["bounce_failed"] == before["bounce_failed"] + 1
    assert after["bounce_read_ok"] == before["bounce_read_ok"]


def test_a_cancelled_read_frees_both_arenas_then_the_pair_is_byte_exact(procs):
    lay = nixlkit.Scattered(16384, 4096, seed=87)
    p = procs()
    meta, raddr = p.start(name="rd-cancel-tgt", size=lay.src_bytes, seed=88, params=SMALL)
    ag = nixlkit.agent("rd-cancel-ini", params=SMALL)
    dst = nixlkit.pattern(89, lay.dst_bytes)
    nixlkit.register(ag, dst)
    ag.add_remote_agent(meta)
    s0 = stats(ag)
    with watchdog(90, [p], "READ cancel"):
        for attempt in range(3):
            h, st = act_in_flight(ag, post_read(ag, "rd-cancel-tgt", lay, dst, raddr), lambda: None)
            if h is not None:
                ag.release_xfer_handle(h)  # still PROC: this cancels it
                # The release returns once nothing of the READ writes our memory any more (a
                # framework frees the destinations next): from here not one byte may change.
                released = dst.copy()
                break
            assert st == "DONE", st
            dst[:] = nixlkit.pattern(89, lay.dst_bytes)  # the next attempt starts from the same bytes
        else:
            raise AssertionError("could not cancel a READ mid-flight in 3 attempts")
        t0 = time.monotonic()
        mine = settle_local(ag, ARENA, TIMEOUT_MS / 1000 + SLACK_S, "initiator after cancel")
        settle(lambda: peer_stats(p), ARENA, TIMEOUT_MS / 1000 + SLACK_S, "target after cancel")
        settled = time.monotonic() - t0
        nixlkit.assert_same(dst, released, "our buffer after the release of the READ returned")
        # Nor after this point: refill, READ anew, and
        # compare the whole destination buffer.
        dst[:] = nixlkit.pattern(90, lay.dst_bytes)
        before = dst.copy()
        h = post_read(ag, "rd-cancel-tgt", lay, dst, raddr)
        st, _ = resolve(ag, h, 30)
        assert st == "DONE", st
        ag.release_xfer_handle(h)
        time.sleep(0.2)
        nixlkit.assert_same(dst, lay.expected(nixlkit.pattern(88, lay.src_bytes), before), "READ after a cancel")
    s1 = stats(ag)
    # Every attempt bounced (none went to plain UCX), the cancelled one included ...
    assert mine["bounce_xfers"] - s0["bounce_xfers"] == attempt + 1, (s0, mine)
    assert mine["passthrough_xfers"] == s0["passthrough_xfers"], "a READ went through plain UCX"
    # ... and only the ones that finished before a cancel could land counted as successes.
    assert mine["bounce_read_ok"] - s0["bounce_read_ok"] == attempt, "the cancelled READ was counted as a success"
    # The READ after the cancel bounced too.
    assert (s1["bounce_xfers"], s1["bounce_read_ok"]) == (mine["bounce_xfers"] + 1, mine["bounce_read_ok"] + 1), (mine, s1)
    assert s1["passthrough_xfers"] == s0["passthrough_xfers"]
    assert settled < TIMEOUT_MS / 1000 / 2, f"regions came back only after {settled:.1f}s"
    assert np.array_equal(dst, lay.expected(nixlkit.pattern(88, lay.src_bytes), before))
