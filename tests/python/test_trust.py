"""A peer may make BOUNCE scatter only where it could write with plain UCX (issue 10, item 7):
into registrations whose metadata it was given. Real NIXL agents in two processes: the victim
in hostile_peer.py, the peer in this process.

The peer here is a real BOUNCE agent that loaded the victim's metadata (so its frames pass the
session rule), but the victim registers a second buffer only afterwards: the peer never gets
that buffer's metadata, hence never its key. Whatever frames it forges -- a WANT with no proof
or a made-up one, then DATA for the granted regions aimed at that buffer, a WANT carrying its
chunk inline aimed there, or a standing flow of its own claimed by a WANT that proves nothing --
the buffer's bytes must not change. A normal WRITE into the buffer whose metadata it does hold still bounces,
byte-exactly."""
import base64
import random
import time


import hostile_peer as hp
import nixlkit
from test_failures import SLACK_S, SMALL, TIMEOUT_MS, dump, meta_b64, peer_stats, procs, settle, stats, watchdog  # noqa: F401 (procs: fixture)

MIB = 1 << 20
ARENA = 4 << 20


def pump(ag, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ag.get_new_notifs()


def victim_and_peer(v, prefix, seed, register_src=None):
    """A victim agent in process `v` with a 2 MiB buffer of pattern(seed): [0, 1 MiB)
    registered, its metadata loaded by a peer here (which may send raw frames, hp.RAW; it
    registers `register_src` first); [1, 2 MiB) registered only afterwards, so the peer never
    sees it. Both loaded both ways and ready. Returns (peer, victim's metadata, its buffer's
    address, the hidden half's address)."""
    victim = f"{prefix}-victim"
    v.call(op="agent", name=victim, params=SMALL)
    r = v.call(op="buffer", agent=victim, size=2 * MIB, seed=seed, register=MIB)
    addr, vmeta = r["addr"], r["meta"]
    peer = nixlkit.agent(f"{prefix}-peer", params={**SMALL, **hp.RAW})
    if register_src is not None:
        nixlkit.register(peer, register_src)
    peer.add_remote_agent(base64.b64decode(vmeta))
    v.call(op="load", agent=victim, meta=meta_b64(peer))
    v.call(op="wait_ready", agent=victim, n=1)
    nixlkit.wait_ready(peer, 1)
    v.call(op="register", agent=victim, off=MIB, len=MIB)  # the peer never sees this
    return peer, vmeta, addr, addr + MIB


def test_a_peer_without_a_buffers_metadata_cannot_make_bounce_scatter_into_it(procs, tmp_path):
    v = procs("hostile_peer.py")
    lay = nixlkit.Scattered(1024, 256, seed=110)  # 1024 x 256 B pieces into the first MiB
    assert lay.dst_bytes <= MIB
    with watchdog(90, [v], "trust test"):
        src = nixlkit.pattern(112, lay.src_bytes)
        peer, vmeta, addr, hidden = victim_and_peer(v, "t", 111, register_src=src)
        before = nixlkit.pattern(111, 2 * MIB)
        v0, p0 = peer_stats(v, agent="t-victim"), stats(peer)

        # Forgeries under the peer's real session (it is loaded at the victim).
        session = hp.session_of(peer.get_agent_metadata())
        rnd = random.Random(113)
        made_up = 0
        for reg in range(1, 9):  # a WANT "proving" the hidden registration by guessing
            x = 9000 + reg
            peer.send_notif("t-victim", hp.want(session, x, [64 << 10], token=x,
                                                proofs=[(reg, rnd.randbytes(16))]))
            made_up += 1
        # The same with the chunk inline in the WANT, aimed at the hidden buffer: the bytes must
        # never be put anywhere.
        inline = (rnd.randbytes(4096), [(0, hidden, 4096, 1, 0, 0)])
        for reg in range(1, 9):
            x = 9200 + reg
            peer.send_notif("t-victim", hp.want(session, x, [4096], token=x, proofs=[(reg, rnd.randbytes(16))],
                                                inline=inline))
            made_up += 1
        pump(peer, 0.05)
        unproven = 0
        for x in range(9300, 9304):  # inline WANTs proving nothing: refused whole
            peer.send_notif("t-victim", hp.want(session, x, [4096], token=x, inline=inline))
            unproven += 1
        for x in range(9100, 9104):  # WANTs proving nothing, then DATA into the hidden buffer
            peer.send_notif("t-victim", hp.want(session, x, [64 << 10], token=x))
            pump(peer, 0.03)  # the victim grants one 64 KiB region somewhere in its arena
            for k in range(ARENA // (64 << 10)):  # one of these names the granted region
                runs = [(0, hidden + (x - 9100) * (64 << 10), 4096, 1, 0, 0)]
                peer.send_notif("t-victim", hp.data(session, x, 0, (k * (64 << 10), 64 << 10), runs, token=x))
            unproven += 1
            pump(peer, 0.05)
        # A standing flow of its own, claimed by transfers that prove nothing, then DATA into the
        # hidden buffer through every candidate region: the claimed region is the transfer's,
        # and its DATA is refused all the same.
        sx, st = (1 << 63) | 9400, 0x5747
        peer.send_notif("t-victim", hp.want(session, sx, [64 << 10], token=st, standing="open"))
        pump(peer, 0.03)
        for x in range(9401, 9404):
            peer.send_notif("t-victim", hp.want(session, x, [4096], token=x, standing=("claim", sx, st)))
            pump(peer, 0.03)
            for k in range(ARENA // (64 << 10)):
                runs = [(0, hidden + (x - 9401) * 4096, 4096, 1, 0, 0)]
                peer.send_notif("t-victim", hp.data(session, x, 0, (k * (64 << 10), 64 << 10), runs, token=x))
            unproven += 1
            pump(peer, 0.05)
        v1 = settle(lambda: peer_stats(v, agent="t-victim"), ARENA, TIMEOUT_MS / 1000 + SLACK_S,
                    "victim after the forged frames")
        got = dump(v, tmp_path, "forged.bin")
        nixlkit.assert_same(got, before, "victim buffer after forged frames (hidden half included)")
        # Every made-up proof, and every WANT opening a flow with no proof at all (plain, inline
        # or claiming the standing credit), was refused as a forgery: since review 56 a flow
        # opens only on a WANT proving a registration, two way too (a loaded peer's name and
        # session are published). None got an answer, so the DATAs after them name flows that
        # never were: late frames, ignored uncounted (`addressed_flow`).
        assert v1["control_forged"] - v0["control_forged"] == made_up + unproven, (v0, v1)
        # The victim drops exactly one frame per forged WANT and no other (proto/src/receiver.rs,
        # BadProof). The standing WANT (which proves nothing by design: it names no
        # destination, and standing credits are capped apart) is accepted. A frame dropped for
        # any other reason (undecodable, wrong session) would be one never checked against the
        # hidden buffer: the count would be above this.
        delta = sorted((k, v0[k], v1[k]) for k in v1 if v0[k] != v1[k])
        assert v1["control_dropped"] - v0["control_dropped"] == made_up + unproven, delta
        assert v1["standing_taken"] - v0["standing_taken"] == 0, (v0, v1)  # no claim without a proof

        # The buffer whose metadata the peer holds: a normal WRITE still bounces, byte-exact.
        lo = peer.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
        re = peer.get_xfer_descs(lay.dst_list(addr), "DRAM")
        h = peer.initialize_xfer("WRITE", lo, re, "t-victim", b"", backends=["BOUNCE"])
        assert peer.transfer(h) != "ERR"
        nixlkit.wait_xfer(peer, h, deadline=30)
        peer.release_xfer_handle(h)
        p1 = stats(peer)
        got = dump(v, tmp_path, "honest.bin")
    assert p1["bounce_ok"] == p0["bounce_ok"] + 1, (p0, p1)
    assert p1["fallback_unproven"] == p0["fallback_unproven"], (p0, p1)
    nixlkit.assert_same(got[:lay.dst_bytes], lay.expected(src, before[:lay.dst_bytes]), "proven destination")
    nixlkit.assert_same(got[lay.dst_bytes:], before[lay.dst_bytes:], "rest of the buffer, hidden half included")


def test_a_flow_proving_one_registration_cannot_scatter_into_another(procs, tmp_path):
    """The step past the proof (review 57): a peer that proves the registration whose metadata
    it holds opens a flow, then aims the flow's bytes at a registration it never saw, by a DATA
    for the region it was granted and by a chunk inline in a proven WANT. Both reach the checks
    of their runs (`stats.data_runs_refused`) and are refused there; nothing lands in either
    buffer."""
    v = procs("hostile_peer.py")
    with watchdog(60, [v], "proven-flow trust test"):
        peer, vmeta, _, hidden = victim_and_peer(v, "pv", 121)
        before = nixlkit.pattern(121, 2 * MIB)
        session = hp.session_of(peer.get_agent_metadata())
        (reg, key), = hp.registrations_of(base64.b64decode(vmeta))
        v0 = peer_stats(v, agent="pv-victim")
        # A proven flow: its one 64 KiB chunk is granted the first region of the victim's fresh
        # arena, and its DATA names that region, with a run into the hidden registration.
        x = 9500
        peer.send_notif("pv-victim", hp.want(session, x, [64 << 10], token=x, proofs=[hp.proof(reg, key, x, "pv-peer", x)]))
        pump(peer, 0.05)
        peer.send_notif("pv-victim", hp.data(session, x, 0, (0, 64 << 10), [(0, hidden, 4096, 1, 0, 0)], token=x))
        # A proven WANT carrying its chunk inline, aimed at the hidden registration.
        x = 9501
        inline = (random.Random(122).randbytes(4096), [(0, hidden + 4096, 4096, 1, 0, 0)])
        peer.send_notif("pv-victim", hp.want(session, x, [4096], token=x, proofs=[hp.proof(reg, key, x, "pv-peer", x)],
                                             inline=inline))
        v1 = settle(lambda: peer_stats(v, agent="pv-victim"), ARENA, TIMEOUT_MS / 1000 + SLACK_S,
                    "victim after the proven flows' runs")
        got = dump(v, tmp_path, "proven.bin")
    nixlkit.assert_same(got, before, "victim buffer after the proven flows (hidden half included)")
    delta = sorted((k, v0[k], v1[k]) for k in v1 if v0[k] != v1[k])
    # Both proofs held (nothing forged); both were refused by the checks of their runs, and
    # dropped for that alone.
    assert v1["control_forged"] == v0["control_forged"], delta
    assert v1["data_runs_refused"] - v0["data_runs_refused"] == 2, delta
    assert v1["control_dropped"] - v0["control_dropped"] == 2, delta


def run_pin_regions(mode, tmp_path):
    """Runs pin_regions.py in its own process (it sets the plugin's trace log before NIXL loads
    it); returns its JSON summary."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "pin_regions.py"), mode, str(tmp_path / "trace.log")],
                       cwd=here, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_region_left_unwritten_while_its_flow_writes_the_others_is_reclaimed(tmp_path):
    """Review 61 (credits, H1), no KEEPs: a key holder's four flows each write chunks 1, 2, 3,
    ... and never chunk 0, whose regions sit one per max-chunk block of the victim's arena. A
    flow's lease ran from its last progress, so those regions stayed held for ever; now each
    region's own cap freezes its flow (no more grants), which then ends by its lease. Within
    four timeouts all four are reclaimed, and the chunk-0 DATAs sent after that scatter
    nothing."""
    out = run_pin_regions("nokeep", tmp_path)
    assert out["timed_out"] == 4, out
    assert out["late_scattered"] == [], f"regions left unwritten for four timeouts still held: {out}"


def test_regions_pinned_at_each_max_chunk_block_stop_an_honest_peer_once_at_most(tmp_path):
    """Review 61 (credits, H1), with KEEPs: while the pins held, every max-chunk WRITE of an
    honest peer failed by its timeout (5 of 5 in 12 s) and drain mode held every other peer's
    grants about 0.9 of a timeout each time. Now a flow whose region stayed idle a region cap
    after its grant is granted nothing more, and ends by its lease (KEEPs hold it at most one
    and a half timeouts past its last progress): the honest WRITEs posted meanwhile fail (two
    here, of 2 s each; up to four on a slow machine), every later one lands."""
    out = run_pin_regions("attack", tmp_path)
    p = [st for st, _ in out["P"]]
    assert p.count("DONE") >= 3 and "ERR" not in p[4:], out["P"][:8]
    assert all(st == "DONE" for st, _ in out["Q"]), out["Q"]
    assert out["timed_out"] >= 4, out
