"""The bounce data path between real NIXL agents in separate processes: gather -> one write ->
scatter, byte-exact, with the engine's own counters proving which path each transfer took.
(Issue: host-memory data path.)"""
import base64
import os
import threading
import time

import numpy as np
import pytest

import nixlkit

B = "BOUNCE"
# The longest gap between an application's passes that its run of driving tolerates
# (`pace::LONGEST_DRIVING_GAP`).
LONGEST_DRIVING_GAP_S = 200e-6


def stats(ag):
    p = nixlkit.live_params(ag, B)
    return {k[len("stats."):]: int(v) for k, v in p.items() if k.startswith("stats.")}


def connect(ag, p, ready=True, n=1):
    """Both sides load each other's metadata (as NIXL users do) and, when both run BOUNCE with
    bounce on, wait until each may bounce to the other (HELLO exchanged)."""
    p.call(op="load", meta=base64.b64encode(ag.get_agent_metadata()).decode())
    if ready:
        nixlkit.wait_ready(ag, n)
        p.call(op="wait_ready", n=1)


def pair(peer, src, tx, rx, rx_size, rx_seed, params=None, rx_params=None, ready=True):
    """This process's agent `tx` with `src` registered, and a peer process `rx` whose buffer of
    `rx_size` bytes holds pattern(rx_seed); connected both ways. Returns (agent, peer, raddr)."""
    p = peer()
    meta, raddr = p.start(name=rx, size=rx_size, seed=rx_seed, params=rx_params)
    ag = nixlkit.agent(tx, params=params)
    nixlkit.register(ag, src)
    ag.add_remote_agent(meta)
    connect(ag, p, ready=ready)
    return ag, p, raddr


def remote_buffer(p, tmp_path, name="r.bin"):
    path = tmp_path / name
    p.call(op="dump", path=str(path))
    return np.fromfile(path, dtype=np.uint8)


def write_from_here(ag, peer_name, lay, src, raddr, notif=b"", deadline=60, every=0.0):
    lo = ag.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(lay.dst_list(raddr), "DRAM")
    h = ag.initialize_xfer("WRITE", lo, re, peer_name, notif, backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h, deadline=deadline, every=every)
    ag.release_xfer_handle(h)


ZMQ = {"bounce_control": "zmq", "bounce_zmq_host": "127.0.0.1"}


@pytest.mark.parametrize("control", ["ucx", "zmq"])
@pytest.mark.parametrize("n, size", [(16384, 4096)])
def test_many_small_writes_bounce_byte_exact_with_notification(peer, tmp_path, n, size, control):
    """Over either control channel (with zmq the control frames go over ZMQ and the UCX
    notifications carry only the application's own), the transfer is bounced, byte-exact, and
    its notification arrives (that it comes only after the data is observed in
    test_kv_patterns.py, whose target checks the blocks the moment it arrives)."""
    lay = nixlkit.Scattered(n, size, seed=41)
    src = nixlkit.pattern(501, lay.src_bytes)
    params = ZMQ if control == "zmq" else None
    tx, rx = f"tx-{control}", f"rx-{control}"
    ag, p, raddr = pair(peer, src, tx=tx, rx=rx, rx_size=lay.dst_bytes, rx_seed=500, params=params, rx_params=params)
    before = stats(ag)
    write_from_here(ag, rx, lay, src, raddr, notif=b"kv-ready")
    p.call(op="notif_wait", **{"from": tx, "msg": "kv-ready"})
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(500, lay.dst_bytes)), "destination")
    after = stats(ag)
    assert after["bounce_xfers"] == before["bounce_xfers"] + 1
    assert after["bounce_ok"] == before["bounce_ok"] + 1
    assert after["bounce_bytes"] - before["bounce_bytes"] == n * size
    assert after["passthrough_xfers"] == before["passthrough_xfers"]


@pytest.mark.parametrize("control", ["ucx", "zmq"])
@pytest.mark.parametrize("rx_inline", ["16KiB", "0"])
def test_a_small_write_rides_in_its_want_or_goes_the_usual_way_when_the_target_declines(
        peer, tmp_path, control, rx_inline):
    """A bounced WRITE that fits one chunk of at most bounce_inline_bytes (256 x 64 B) carries its
    bytes in its WANT: the target puts them in a region it grants itself and scatters them, and
    its ACK alone completes the transfer (no GRANT, no write). A target that takes no inline
    bytes GRANTs as for any WANT and the chunk is written as usual. Byte-exact either way, the
    bytes around every destination untouched, the notification delivered."""
    lay = nixlkit.Scattered(256, 64, seed=46)
    src = nixlkit.pattern(541, lay.src_bytes)
    params = ZMQ if control == "zmq" else {}
    tx, rx = f"tx-inline-{control}-{rx_inline}", f"rx-inline-{control}-{rx_inline}"
    ag, p, raddr = pair(peer, src, tx=tx, rx=rx, rx_size=lay.dst_bytes, rx_seed=540, params=params,
                        rx_params={**params, "bounce_inline_bytes": rx_inline})
    before = stats(ag)
    for i in range(3):
        write_from_here(ag, rx, lay, src, raddr, notif=f"small-{i}".encode())
        p.call(op="notif_wait", **{"from": tx, "msg": f"small-{i}"})
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(540, lay.dst_bytes)), "destination")
    after = stats(ag)
    theirs = {k[len("stats."):]: int(v) for k, v in p.call(op="params")["params"].items() if k.startswith("stats.")}
    # ack_waits: chunks written and ACKed after a DATA; grant_waits: transfers that got a GRANT.
    d = {k: after[k] - before[k]
         for k in ("bounce_ok", "inline_sent", "inline_acks", "inline_declined", "ack_waits", "grant_waits")}
    taken = rx_inline != "0"
    n, declined = (3, 0) if taken else (0, 3)
    assert d == {"bounce_ok": 3, "inline_sent": 3, "inline_acks": n, "inline_declined": declined,
                 "ack_waits": declined, "grant_waits": declined}, d
    assert theirs["inline_taken"] == (3 if taken else 0), theirs


@pytest.mark.parametrize("rx_standing", ["256KiB", "0"])
@pytest.mark.parametrize("control", ["ucx", "zmq"])
def test_writes_after_the_first_write_their_chunk_into_a_standing_credit_with_no_grant_wait(
        peer, tmp_path, control, rx_standing):
    """The first bounced WRITE to a peer opens a standing flow there; the target grants it one
    region ahead of any transfer. Each later WRITE (256 x 256 B: one chunk, too large to ride
    in its WANT) claims that region for its chunk and writes it at once, with no WANT -> GRANT
    round trip, and the chunk's ACK gives the region back to the standing flow. A target that gives
    no standing credit refuses the flow and every WRITE takes the full exchange. Byte-exact
    either way, the bytes around every destination untouched, the notification delivered."""
    lay = nixlkit.Scattered(256, 256, seed=47)
    src = nixlkit.pattern(551, lay.src_bytes)
    params = ZMQ if control == "zmq" else {}
    tx, rx = f"tx-standing-{control}-{rx_standing}", f"rx-standing-{control}-{rx_standing}"
    ag, p, raddr = pair(peer, src, tx=tx, rx=rx, rx_size=lay.dst_bytes, rx_seed=550, params=params,
                        rx_params={**params, "bounce_standing_bytes": rx_standing})
    before = stats(ag)
    for i in range(4):
        write_from_here(ag, rx, lay, src, raddr, notif=f"standing-{i}".encode())
        p.call(op="notif_wait", **{"from": tx, "msg": f"standing-{i}"})
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(550, lay.dst_bytes)), "destination")
    after = stats(ag)
    theirs = {k[len("stats."):]: int(v) for k, v in p.call(op="params")["params"].items() if k.startswith("stats.")}
    d = {k: after[k] - before[k] for k in ("bounce_ok", "standing_opened_out", "standing_claims", "grant_waits")}
    given = rx_standing != "0"
    claims = 3 if given else 0
    assert d == {"bounce_ok": 4, "standing_opened_out": 1, "standing_claims": claims, "grant_waits": 4 - claims}, d
    t = {k: theirs[k] for k in ("standing_opened", "standing_refused", "standing_taken", "standing_kept")}
    assert t == {"standing_opened": int(given), "standing_refused": int(not given), "standing_taken": claims,
                 "standing_kept": claims}, t
    # Each claimed region came back with its ACK; the target holds it (256 KiB) for the next
    # claim, until the lease's end.
    assert theirs["arena_standing_bytes"] == (256 << 10 if given else 0), theirs


@pytest.mark.parametrize("pieces,split,chunks", [(256, "512KiB", 2), (256, "0", 1), (1024, "512KiB", 4), (1024, "0", 2)])
def test_a_write_of_a_few_chunks_moves_in_up_to_four_that_overlap_unless_splitting_is_off(
        peer, tmp_path, pieces, split, chunks):
    """A bounced WRITE that fits in fewer than four 2 MiB chunks moves in up to four of about
    equal size, none under `bounce_split_bytes` (512 KiB by default), so that one chunk's
    gather, write and scatter overlap another's: 1 MiB (256 x 4 KiB) as two of 512 KiB, a
    4 MiB KV request (1024 x 4 KiB) as four of 1 MiB; with 0 as one and two. Byte-exact
    either way, with the bytes around every destination untouched."""
    lay = nixlkit.Scattered(pieces, 4096, seed=61)
    src = nixlkit.pattern(611, lay.src_bytes)
    rx = f"rx-split-{pieces}-{split}"
    ag, p, raddr = pair(peer, src, tx=f"tx-split-{pieces}-{split}", rx=rx, rx_size=lay.dst_bytes, rx_seed=610,
                        params={"bounce_split_bytes": split})
    before = stats(ag)
    for _ in range(2):
        write_from_here(ag, rx, lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(610, lay.dst_bytes)), "destination")
    after = stats(ag)
    d = {k: after[k] - before[k] for k in ("bounce_ok", "bounce_chunks")}
    assert d == {"bounce_ok": 2, "bounce_chunks": 2 * chunks}, d


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_mixed_unaligned_sizes_bounce_byte_exact(peer, tmp_path, streaming):
    """Unaligned pieces scatter byte-exact with ordinary stores (the default) and with
    non-temporal ones (their head and tail lines go through ordinary stores): the receiver's
    `stats.scatter_streamed_bytes` shows which (none, or most of the bytes)."""
    rng = np.random.default_rng(7)
    sizes = [int(x) for x in rng.integers(512, 1 << 20, size=300)]
    sizes[:200] = [int(x) for x in rng.integers(512, 4096, size=200)]  # mostly small: gate's average
    lay = nixlkit.Scattered(len(sizes), 0, seed=42, sizes=sizes)
    src = nixlkit.pattern(511, lay.src_bytes)
    gate = {"bounce_min_descriptor_count": "64", "bounce_max_average_descriptor_size": "1MiB"}
    ag, p, raddr = pair(peer, src, tx="tx-mixed", rx="rx-mixed", rx_size=lay.dst_bytes, rx_seed=510,
                        params=gate, rx_params={**gate, "bounce_streaming_scatter": streaming})
    write_from_here(ag, "rx-mixed", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(510, lay.dst_bytes)), "mixed destination")
    assert stats(ag)["bounce_ok"] == 1
    streamed = int(p.call(op="params")["params"]["stats.scatter_streamed_bytes"])
    if streaming == "false":
        assert streamed == 0
    else:
        # Every piece is 512 B or more; at most its two partial lines are not streamed.
        assert sum(sizes) >= streamed >= sum(sizes) - 128 * len(sizes), (streamed, sum(sizes))


def test_write_larger_than_both_arenas_streams_through(peer, tmp_path):
    small = {"bounce_arena_size": "4MiB", "bounce_max_chunk_size": "1MiB"}
    lay = nixlkit.Scattered(8192, 4096, seed=43)  # 32 MiB through 4 MiB arenas
    src = nixlkit.pattern(521, lay.src_bytes)
    ag, p, raddr = pair(peer, src, tx="tx-big", rx="rx-big", rx_size=lay.dst_bytes, rx_seed=520,
                        params=small, rx_params=small)
    write_from_here(ag, "rx-big", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(520, lay.dst_bytes)), "streamed destination")
    s = stats(ag)
    assert s["bounce_ok"] == 1 and s["bounce_chunks"] >= 32
    assert s["arena_free_bytes"] + s["arena_standing_bytes"] == 4 << 20  # every staging region came back


def test_bidirectional_at_once(peer, tmp_path):
    lay_out = nixlkit.Scattered(4096, 4096, seed=44)
    lay_in = nixlkit.Scattered(4096, 4096, seed=45)
    p = peer()
    # peer buffer: [dst for our writes | src for its writes]
    meta, raddr = p.start(name="bi-peer", size=lay_out.dst_bytes + lay_in.src_bytes, seed=530)
    ag = nixlkit.agent("bi-here")
    here = nixlkit.pattern(531, lay_out.src_bytes + lay_in.dst_bytes)
    here_before = here.copy()
    nixlkit.register(ag, here)
    ag.add_remote_agent(meta)
    connect(ag, p)
    src_out = here[:lay_out.src_bytes]
    dst_in = here[lay_out.src_bytes:]
    # the peer writes into us while we write into it
    p.send(op="write", to="bi-here", n=4096, size=4096, seed=45, src_off=lay_out.dst_bytes,
           raddr=dst_in.ctypes.data, notif="in-done")
    write_from_here(ag, "bi-peer", lay_out, src_out, raddr)
    r = p.recv()
    assert r["state"] == "DONE", r
    nixlkit.wait_notif(ag, "bi-peer", b"in-done")
    peer_before = nixlkit.pattern(530, lay_out.dst_bytes + lay_in.src_bytes)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got[:lay_out.dst_bytes],
                        lay_out.expected(src_out, peer_before[:lay_out.dst_bytes]), "peer side")
    nixlkit.assert_same(dst_in, lay_in.expected(peer_before[lay_out.dst_bytes:],
                                                here_before[lay_out.src_bytes:]), "our side")
    assert stats(ag)["bounce_ok"] == 1
    assert int(p.call(op="params")["params"]["stats.bounce_ok"]) == 1


def test_four_senders_to_one_receiver(peer, tmp_path):
    n, size, k = 2048, 4096, 4
    lays = [nixlkit.Scattered(n, size, seed=60 + i) for i in range(k)]
    part = lays[0].dst_bytes
    ag = nixlkit.agent("sink")
    dst = nixlkit.pattern(600, part * k)
    before = dst.copy()
    nixlkit.register(ag, dst)
    peers = []
    for i in range(k):
        p = peer()
        meta, _ = p.start(name=f"src{i}", size=lays[i].src_bytes, seed=610 + i)
        ag.add_remote_agent(meta)
        connect(ag, p, n=i + 1)
        peers.append(p)
    for i, p in enumerate(peers):
        p.send(op="write", to="sink", n=n, size=size, seed=60 + i, raddr=dst.ctypes.data + i * part,
               notif=f"done{i}")
    for i, p in enumerate(peers):
        assert p.recv()["state"] == "DONE"
        nixlkit.wait_notif(ag, f"src{i}", f"done{i}".encode())
    for i in range(k):
        src_i = nixlkit.pattern(610 + i, lays[i].src_bytes)
        nixlkit.assert_same(dst[i * part:(i + 1) * part],
                            lays[i].expected(src_i, before[i * part:(i + 1) * part]), f"sender {i}")
    # Each sender took the bounce path (not UCX's) exactly once, and the receiver's arena is whole
    # again once every region is scattered and acked.
    for i, p in enumerate(peers):
        ps = p.call(op="params")["params"]
        assert int(ps["stats.bounce_ok"]) == 1, (i, ps)
        assert int(ps["stats.bounce_xfers"]) == 1, (i, ps)
        assert int(ps["stats.passthrough_xfers"]) == 0, (i, ps)
    s = stats(ag)
    assert s["arena_free_bytes"] + s["arena_standing_bytes"] == 256 << 20, s


def test_64_concurrent_transfers_from_8_threads(peer, tmp_path):
    n, size, per_thread, threads = 512, 4096, 8, 8
    total = per_thread * threads
    lays = [nixlkit.Scattered(n, size, seed=700 + j) for j in range(total)]
    part = lays[0].dst_bytes
    p = peer()
    meta, raddr = p.start(name="rx-mt", size=part * total, seed=800)
    ag = nixlkit.agent("tx-mt", threads=True, params={"bounce_min_descriptor_count": "256"})
    srcs = [nixlkit.pattern(900 + j, lays[j].src_bytes) for j in range(total)]
    for s in srcs:
        nixlkit.register(ag, s)
    ag.add_remote_agent(meta)
    connect(ag, p)
    errors = []

    def worker(t):
        try:
            for j in range(t * per_thread, (t + 1) * per_thread):
                write_from_here(ag, "rx-mt", lays[j], srcs[j], raddr + j * part)
        except Exception as e:  # collected and asserted below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    got = remote_buffer(p, tmp_path)
    before = nixlkit.pattern(800, part * total)
    for j in range(total):
        nixlkit.assert_same(got[j * part:(j + 1) * part],
                            lays[j].expected(srcs[j], before[j * part:(j + 1) * part]), f"transfer {j}")
    assert stats(ag)["bounce_ok"] == total


def test_gate_sends_few_descriptors_to_plain_ucx_and_bounces_a_read_of_many(peer, tmp_path):
    p = peer()
    lay = nixlkit.Scattered(64, 4096, seed=46)  # below bounce_min_descriptor_count
    meta, raddr = p.start(name="rx-gate", size=lay.dst_bytes, seed=540)
    ag = nixlkit.agent("tx-gate")
    src = nixlkit.pattern(541, lay.dst_bytes)
    nixlkit.register(ag, src)
    ag.add_remote_agent(meta)
    connect(ag, p)
    write_from_here(ag, "rx-gate", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(540, lay.dst_bytes)), "gated WRITE")
    # a READ of many small descriptors bounces (issue 13): the peer gathers, we READ and scatter
    before = src.copy()
    lo = ag.get_xfer_descs([(src.ctypes.data + i * 512, 256, 0) for i in range(1024)], "DRAM")
    re = ag.get_xfer_descs([(raddr + i * 512, 256, 0) for i in range(1024)], "DRAM")
    h = ag.initialize_xfer("READ", lo, re, "rx-gate", b"", backends=[B])
    ag.transfer(h)
    nixlkit.wait_xfer(ag, h)
    want = before.copy()
    for i in range(1024):
        want[i * 512:i * 512 + 256] = got[i * 512:i * 512 + 256]
    nixlkit.assert_same(src, want, "READ destinations, and the gaps between them untouched")
    s = stats(ag)
    assert s["bounce_xfers"] == 1 and s["bounce_read_ok"] == 1
    assert s["fallback_count"] == 1 and s["fallback_op"] == 0
    assert s["passthrough_xfers"] == 1


@pytest.mark.parametrize("way", ["two-way", "one-way"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_peers_with_different_max_chunks_bounce_in_chunks_both_arenas_hold(peer, tmp_path, op, way):
    """A peer whose max chunk differs (a GPU arena's default is 32 MiB, a host arena's 2 MiB)
    is compatible: the initiator plans with the smaller, here the target's 512 KiB, so the
    target's 4 MiB arena grants every chunk. Byte-exact either way, the gaps untouched; one way
    (the target never loads us) the answers come through its mailbox."""
    lay = nixlkit.Scattered(4096, 4096, seed=53)  # 16 MiB: at least 32 chunks of 512 KiB
    small = {"bounce_arena_size": "4MiB", "bounce_max_chunk_size": "512KiB"}
    p = peer()
    rx = f"rx-chunks-{op}-{way}"
    size = lay.dst_bytes if op == "WRITE" else lay.src_bytes
    meta, raddr = p.start(name=rx, size=size, seed=570, params=small)
    ag = nixlkit.agent(f"tx-chunks-{op}-{way}", params={"bounce_max_chunk_size": "2MiB"})
    here = nixlkit.pattern(571, lay.src_bytes if op == "WRITE" else lay.dst_bytes)
    before = here.copy()
    nixlkit.register(ag, here)
    ag.add_remote_agent(meta)
    if way == "two-way":
        connect(ag, p)
    if op == "WRITE":
        write_from_here(ag, rx, lay, here, raddr)
        nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(here, nixlkit.pattern(570, size)),
                            "WRITE destinations")
    else:
        lo = ag.get_xfer_descs(lay.dst_list(here.ctypes.data), "DRAM")
        re = ag.get_xfer_descs(lay.src_list(raddr), "DRAM")
        h = ag.initialize_xfer("READ", lo, re, rx, b"", backends=[B])
        assert ag.transfer(h) != "ERR"
        nixlkit.wait_xfer(ag, h, deadline=60)
        ag.release_xfer_handle(h)
        nixlkit.assert_same(here, lay.expected(nixlkit.pattern(570, size), before), "READ destinations")
    s = stats(ag)
    assert s["peers_incompatible"] == 0 and s["passthrough_xfers"] == 0, s
    assert s["bounce_ok"] == 1 and s["bounce_chunks"] >= 32, s
    assert s["one_way_sent"] == (way == "one-way"), s


def test_capabilities_advertising_tiny_chunks_are_incompatible_and_the_peer_stays_on_ucx(peer, tmp_path):
    """Max chunks may differ (transfers take the smaller), but a forged capability blob cannot
    make this engine cut transfers into tiny chunks: a peer whose max chunk is below 1/1024 of
    ours (32 bytes here, edited into its real metadata) is incompatible, and a transfer to it
    goes to UCX, byte-exact."""
    import struct

    import hostile_peer as hp
    lay = nixlkit.Scattered(1024, 4096, seed=54)
    src = nixlkit.pattern(581, lay.src_bytes)
    p = peer()
    meta, raddr = p.start(name="rx-tiny", size=lay.dst_bytes, seed=580)
    off = hp.caps_offset(meta, "max_chunk")
    spoiled = bytearray(meta)
    assert struct.unpack_from("<Q", spoiled, off)[0] == 2 << 20, "the peer's default max chunk"
    struct.pack_into("<Q", spoiled, off, 32)
    ag = nixlkit.agent("tx-tiny")
    nixlkit.register(ag, src)
    ag.add_remote_agent(bytes(spoiled))
    write_from_here(ag, "rx-tiny", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(580, lay.dst_bytes)), "destination")
    s = stats(ag)
    assert s["peers_incompatible"] == 1 and s["fallback_peer"] == 1 and s["bounce_xfers"] == 0, s


@pytest.mark.parametrize("params, said", [
    ({"bounce_arena_mem": "auto", "bounce_arena_gpus": "0,1"},
     "bounce_arena_gpus names GPUs but CUDA is unusable: a host arena"),
    ({"bounce_arena_mem": "dram", "bounce_arena_gpus": "all"},
     "bounce_arena_gpus ignored: bounce_arena_mem=dram makes no GPU arena"),
])
def test_arena_gpus_without_a_gpu_arena_say_so_and_keep_the_host_arena(peer, tmp_path, capfd, params, said):
    """`bounce_arena_gpus` names the GPUs that get arenas. Where no GPU arena can be made (no
    GPU, as on CI), or none was asked for (`dram`), the engine says why once and bounces host
    memory through its one host arena, byte-exact. (With GPUs: test_gpu.py's arena-per-GPU
    tests.)"""
    if nixlkit.gpu_skip_reason() is None and "dram" not in params.values():
        pytest.skip("a GPU is usable here: test_gpu.py covers arenas on listed GPUs")
    lay = nixlkit.Scattered(1024, 4096, seed=59)
    src = nixlkit.pattern(593, lay.src_bytes)
    capfd.readouterr()
    ag, p, raddr = pair(peer, src, tx="tx-gpus", rx="rx-gpus", rx_size=lay.dst_bytes, rx_seed=594, params=params)
    err = capfd.readouterr().err
    assert said in err, err[-3000:]
    write_from_here(ag, "rx-gpus", lay, src, raddr)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(src, nixlkit.pattern(594, lay.dst_bytes)),
                        "WRITE destinations")
    s = stats(ag)
    assert (s["arenas"], s["arena_gpu"]) == (1, 0), s
    assert s["bounce_write_ok"] == 1 and s["passthrough_xfers"] == 0 and s["bounce_chunks_gpu_arena"] == 0, s


def test_both_arenas_without_a_gpu_keep_the_host_arena_and_bounce_host_memory(peer, tmp_path, capfd):
    """`bounce_arena_mem=both` asks for a host arena and a GPU arena. Where no GPU can be had
    (CI) the engine says so once, keeps the host arena alone (`stats.arenas` 1, `arena_gpu`
    0) and bounces host memory as any host-arena engine, to a peer of either setting, WRITE and
    READ, byte-exact. (With a GPU: test_gpu.py's two-arena tests.)"""
    if nixlkit.gpu_skip_reason() is None:
        pytest.skip("a GPU is usable here: test_gpu.py covers two arenas")
    both = {"bounce_arena_mem": "both"}
    lay = nixlkit.Scattered(1024, 4096, seed=57)
    src = nixlkit.pattern(591, lay.src_bytes)
    capfd.readouterr()
    ag, p, raddr = pair(peer, src, tx="tx-both", rx="rx-both", rx_size=lay.dst_bytes, rx_seed=590,
                        params=both, rx_params=both)
    err = capfd.readouterr().err
    assert "bounce_arena_mem=both but CUDA is unusable: a host arena only" in err \
        or "cannot open the GPU for the arena" in err, err[-3000:]
    write_from_here(ag, "rx-both", lay, src, raddr)
    before = nixlkit.pattern(590, lay.dst_bytes)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(src, before), "WRITE destinations")
    back = nixlkit.Scattered(1024, 4096, seed=58)
    dst = nixlkit.pattern(592, back.dst_bytes)
    nixlkit.register(ag, dst)
    lo = ag.get_xfer_descs(back.dst_list(dst.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(back.src_list(raddr), "DRAM")
    h = ag.initialize_xfer("READ", lo, re, "rx-both", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h, deadline=60)
    ag.release_xfer_handle(h)
    nixlkit.assert_same(dst, back.expected(lay.expected(src, before), nixlkit.pattern(592, back.dst_bytes)),
                        "READ destinations")
    s, t = stats(ag), {k[len("stats."):]: int(v) for k, v in p.call(op="params")["params"].items()
                       if k.startswith("stats.")}
    assert (s["arenas"], s["arena_gpu"], t["arenas"]) == (1, 0, 1), (s, t)
    assert s["bounce_write_ok"] == 1 and s["bounce_read_ok"] == 1 and s["passthrough_xfers"] == 0, s
    assert s["bounce_chunks_gpu_arena"] == 0, s


@pytest.mark.parametrize("case, params, rx_params, incompatible", [
    ("off", None, {"bounce_enable": "false"}, 0),  # the peer advertises no capabilities
    ("mix", ZMQ, None, 1),  # ZMQ control here, UCX control there: incompatible
])
def test_a_peer_that_cannot_bounce_with_us_silently_stays_on_ucx(peer, tmp_path, case, params, rx_params,
                                                                 incompatible):
    lay = nixlkit.Scattered(4096, 4096, seed=48)
    src = nixlkit.pattern(551, lay.src_bytes)
    ag, p, raddr = pair(peer, src, tx=f"tx-{case}", rx=f"rx-{case}", rx_size=lay.dst_bytes, rx_seed=550,
                        params=params, rx_params=rx_params, ready=False)
    write_from_here(ag, f"rx-{case}", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(550, lay.dst_bytes)), "destination")
    s = stats(ag)
    assert s["bounce_xfers"] == 0 and s["fallback_peer"] == 1
    assert s["peers_incompatible"] == incompatible


def test_idle_engine_does_not_eat_a_core(peer):
    """The reactor parks when idle: two connected BOUNCE engines that just finished a transfer
    use a small part of a core each while nothing happens, the target too, which still
    holds the initiator's standing credit (a standing flow waits for nothing; it once kept the
    target's reactor polling every 50 us: a third of a core on 2 cores)."""
    import resource
    import time
    lay = nixlkit.Scattered(1024, 4096, seed=49)
    src = nixlkit.pattern(561, lay.src_bytes)
    ag, p, raddr = pair(peer, src, tx="tx-idle", rx="rx-idle", rx_size=lay.dst_bytes, rx_seed=560)
    write_from_here(ag, "rx-idle", lay, src, raddr)
    assert stats(ag)["standing_opened_out"] == 1, "the target holds a standing flow for us"
    time.sleep(1.2)  # let the reactors ramp their idle parks up

    def target_cpu():
        with open(f"/proc/{p.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), target_cpu(), time.monotonic()
    time.sleep(2.0)
    r1, c1, t1 = resource.getrusage(resource.RUSAGE_SELF), target_cpu(), time.monotonic()
    share = ((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / (t1 - t0)
    target = (c1 - c0) / (t1 - t0)
    print(f"idle engine CPU share: initiator {share:.4f}, target {target:.4f} of one core")
    assert share < 0.1, f"an idle initiator used {share:.2%} of a core"
    # Its own process: Python and NIXL beside the engine (0.06 here, 0.35 while the standing
    # flow kept the reactor polling).
    assert target < 0.15, f"an idle target holding a standing flow used {target:.2%} of a core"


def test_an_initiators_reactor_sleeps_its_longest_park_as_soon_as_its_write_is_done(peer):
    """Its idle reactor ramps its sleeps up from short ones only after a peer addressed it (a
    frame of the peer's transfer, a HELLO, a PING): those frames come unannounced. An engine that
    only initiates has nothing coming once its transfer is done (its application's next post
    wakes the reactor), so it sleeps the longest park (1 ms) at once: about 290 wake-ups in the
    300 ms after a bounced WRITE, where ramping from the transfer gave 800-817 on 2 cores (the
    build before, same test; benches/wakes.py, BENCHMARKS.md "Session 37"). A loaded machine
    only lengthens sleeps."""
    import time
    lay = nixlkit.Scattered(1024, 4096, seed=53)
    src = nixlkit.pattern(571, lay.src_bytes)
    before = set(nixlkit.reactor_wakeups())
    ag, p, raddr = pair(peer, src, tx="tx-park", rx="rx-park", rx_size=lay.dst_bytes, rx_seed=570)
    (mine,) = set(nixlkit.reactor_wakeups()) - before
    time.sleep(0.4)  # pairing is the peer addressing us: its ramp runs out first
    # The application looks at its transfer every 2 ms, so the reactor thread moves it (an
    # application spinning on the status drives the passes itself, and the thread stands down).
    write_from_here(ag, "rx-park", lay, src, raddr, every=0.002)
    assert stats(ag)["bounce_ok"] == 1
    t0 = time.monotonic()
    w0 = nixlkit.reactor_wakeups()[mine]
    time.sleep(0.3)
    woke = nixlkit.reactor_wakeups()[mine] - w0
    took = time.monotonic() - t0  # the real window: a loaded machine oversleeps
    # No call into the plugin meanwhile, so no broken run of driving: the allowance is about
    # one wake a millisecond of the window measured, and half as many more (455 for 300 ms).
    most = nixlkit.Gaps(LONGEST_DRIVING_GAP_S).allowance(took)
    print(f"the initiator's reactor woke {woke} times in the {took * 1e3:.0f} ms after its WRITE (at most {most})")
    assert woke <= most, f"the initiator's reactor woke {woke} times in the {took * 1e3:.0f} ms after its WRITE"


def test_an_application_spinning_on_its_small_writes_leaves_its_reactor_asleep(peer, tmp_path):
    """An application that posts small bounced WRITEs one after another and spins on each one's
    status drives every pass itself; its reactor thread stands down meanwhile, waking about once
    a millisecond (the longest stand-down) to see whether the application still drives. Its
    checks come microseconds apart, but a post comes after the application's own work since
    the check that saw the previous WRITE done: when such a gap ended the run of driving, the
    reactor thread woke once or more per WRITE, and on 2 cores each wake took an application's
    core (issue 12; BENCHMARKS.md "Session 38", "Session 39"). The target's application
    spins on its notifications: its pulls hand each WANT to a pass on its thread, and its
    reactor thread sleeps beside them. The WRITEs ride inline (one frame each way) and land
    byte-exact."""
    import time
    lay = nixlkit.Scattered(256, 64, seed=59)
    src = nixlkit.pattern(591, lay.src_bytes)
    before = set(nixlkit.reactor_wakeups())
    ag, p, raddr = pair(peer, src, tx="tx-spin", rx="rx-spin", rx_size=lay.dst_bytes, rx_seed=590)
    (mine,) = set(nixlkit.reactor_wakeups()) - before
    lo = ag.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(lay.dst_list(raddr), "DRAM")
    h = ag.initialize_xfer("WRITE", lo, re, "rx-spin", b"", backends=[B])
    s0 = stats(ag)
    n = 1000
    # The target's application spins on its notifications meanwhile, so its own passes serve
    # the WANTs, as the initiator's serve its WRITEs.
    theirs0 = p.call(op="wakeups")["wakeups"]
    p.send(op="notif_wait", **{"from": "tx-spin", "msg": "stop"})
    # Between a WRITE seen done and the next post the application does 80 us of its own work
    # (a framework's bookkeeping): longer than a WRITE's own run of checks on a fast machine,
    # shorter than the longest gap a run of driving tolerates. The test times the gaps the
    # application leaves between its calls, as the plugin's run of driving sees them.
    gaps = nixlkit.Gaps(LONGEST_DRIVING_GAP_S)
    w0, t0 = nixlkit.reactor_wakeups()[mine], time.monotonic()
    for _ in range(n):
        busy = time.perf_counter() + 80e-6
        while time.perf_counter() < busy:
            pass
        gaps.call()
        assert ag.transfer(h) != "ERR"
        while True:
            gaps.call()
            state = ag.check_xfer_state(h)
            if state == "DONE":
                break
            assert state != "ERR" and time.monotonic() < t0 + nixlkit.DEADLINE_S, state
    took, woke = time.monotonic() - t0, nixlkit.reactor_wakeups()[mine] - w0
    ag.send_notif("rx-spin", b"stop")
    p.recv()
    theirs = p.call(op="wakeups")["wakeups"] - theirs0
    ag.release_xfer_handle(h)
    s1 = stats(ag)
    print(f"{n} WRITEs in {took * 1e3:.1f} ms; the initiator's reactor woke {woke} times, the target's {theirs};"
          f" {gaps.broken} gaps over {LONGEST_DRIVING_GAP_S * 1e6:.0f} us")
    assert s1["bounce_ok"] - s0["bounce_ok"] == n and s1["inline_acks"] - s0["inline_acks"] == n, (s0, s1)
    # About one wake a millisecond, a few more for each gap longer than the longest a run
    # tolerates (the machine kept the application off its core), and bursts where a check
    # meets the reactor thread's pass and waits: at most one wake per three WRITEs beyond
    # those. Measured on 2 cores: 168-291 wakes in 168-257 ms with 80-160 us of work between
    # WRITEs; 2,198-3,075 when a gap of 50 us ended each run, 337-2,561 when a gap longer than
    # its run did (a run counted no gap it came back after, nor the post's own pass, so one
    # that began shorter than the gaps never grew: a CI runner, 441 in 121 ms, no work between).
    most = gaps.allowance(took) + n // 3
    assert woke <= most, f"the initiator's reactor woke {woke} times in {n} WRITEs ({took * 1e3:.1f} ms, {gaps})"
    # The target's reactor sleeps beside its application's pulls, whose passes (one a WANT)
    # end short waits: 99-448 wakes measured (its count spans its two calls around the loop),
    # 879-1477 when it woke at the end of each such wait to look. Not asserted: with the
    # machine loaded (a clean-clone CI run beside other work: 1193), the target's Python is
    # kept off its core for longer than its streak of pulls tolerates, which no pacing can
    # tell from a puller that stopped. The reactor tests assert the target's side
    # (`beside_a_puller_that_drives_now_and_then_the_reactor_thread_sleeps_its_longest`).
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(590, lay.dst_bytes)), "destination")


def test_a_target_busy_in_other_ucx_calls_still_answers_bounced_writes(peer):
    """The target's application never polls NIXL; a thread of it registers and deregisters
    memory in a loop, each call holding the engine's inner lock. Only the target's reactor can
    pull the WANT and the DATAs out of UCX, and its background poll only *tries* that lock (it
    must never queue behind the application, whose every unlock would then pay a wake-up):
    the bounced WRITEs still complete, byte-exact, while the loop runs."""
    lay = nixlkit.Scattered(2048, 4096, seed=73)
    p = peer()
    meta, _ = p.start(name="tx-busy", size=lay.src_bytes, seed=731)
    dst = nixlkit.pattern(730, lay.dst_bytes)
    ag = nixlkit.agent("rx-busy")
    nixlkit.register(ag, dst)
    ag.add_remote_agent(meta)
    connect(ag, p)
    spare = nixlkit.pattern(732, 4096)
    stop, calls, errors = threading.Event(), [0], []

    def register_in_a_loop():
        d = ag.get_reg_descs([(spare.ctypes.data, spare.nbytes, 0, "")], "DRAM")
        try:
            while not stop.is_set():
                r = ag.register_memory(d, backends=[B])
                ag.deregister_memory(r, backends=[B])
                calls[0] += 1
        except Exception as e:  # reported below: the loop itself must not fail
            errors.append(e)

    busy = threading.Thread(target=register_in_a_loop)
    busy.start()
    try:
        for i in range(3):
            before = calls[0]
            r = p.call(op="write", to="rx-busy", n=lay.n, size=4096, seed=73, src_off=0,
                       raddr=dst.ctypes.data, timeout=30)
            assert r["state"] == "DONE", (i, r)
            assert calls[0] > before, "the target's application was not busy during the WRITE"
    finally:
        stop.set()
        busy.join()
    assert not errors, errors
    want = lay.expected(nixlkit.pattern(731, lay.src_bytes), nixlkit.pattern(730, lay.dst_bytes))
    nixlkit.assert_same(dst, want, "destination")
    theirs = {k[len("stats."):]: int(v) for k, v in p.call(op="params")["params"].items()
              if k.startswith("stats.")}
    assert theirs["bounce_ok"] == 3 and theirs["passthrough_xfers"] == 0, theirs


def test_nixl_telemetry_reports_bounced_transfers(peer, tmp_path):
    """With telemetry on, NIXL's core measures a bounced transfer like any other (bytes,
    descriptor count, times): BOUNCE reports completion only when the data is in place, so the
    core's transfer time covers gather, write and scatter (at least half the time this thread
    saw from the post to DONE)."""
    from nixlkit import nixl_agent, nixl_agent_config
    lay = nixlkit.Scattered(2048, 4096, seed=50)
    p = peer()
    meta, raddr = p.start(name="rx-tel", size=lay.dst_bytes, seed=570)
    ag = nixl_agent("tx-tel", nixl_agent_config(enable_prog_thread=False, backends=[],
                                                capture_telemetry=True))
    ag.create_backend(B, {})
    src = nixlkit.pattern(571, lay.src_bytes)
    nixlkit.register(ag, src)
    ag.add_remote_agent(meta)
    connect(ag, p)
    lo = ag.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(lay.dst_list(raddr), "DRAM")
    h = ag.initialize_xfer("WRITE", lo, re, "rx-tel", b"", backends=[B])
    t0 = time.perf_counter()
    ag.transfer(h)
    nixlkit.wait_xfer(ag, h)
    seen_us = (time.perf_counter() - t0) * 1e6
    t = ag.get_xfer_telemetry(h)
    assert t.totalBytes == 2048 * 4096
    assert t.descCount == 2048
    # Microseconds, post to the status query that saw DONE: most of what this thread waited.
    assert seen_us / 2 <= t.xferDuration <= seen_us * 1.1, (t.xferDuration, seen_us)
    s = stats(ag)
    assert s["bounce_ok"] == 1 and s["bounce_write_ok"] == 1 and s["passthrough_xfers"] == 0, s
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(src, nixlkit.pattern(570, lay.dst_bytes)), "destination")


@pytest.mark.parametrize("direct", ["true", "false"])
def test_packed_sources_are_written_directly_unless_disabled(peer, tmp_path, direct):
    """Sources packed in one registration: every chunk goes straight from user memory (no
    gather copy) unless bounce_direct_writes is off; the bytes are the same either way."""
    lay = nixlkit.Scattered(4096, 4096, seed=51)
    src = nixlkit.pattern(581, lay.src_bytes)
    ag, p, raddr = pair(peer, src, tx=f"tx-direct-{direct}", rx=f"rx-direct-{direct}",
                        rx_size=lay.dst_bytes, rx_seed=580, params={"bounce_direct_writes": direct})
    write_from_here(ag, f"rx-direct-{direct}", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(580, lay.dst_bytes)), "destination")
    s = stats(ag)
    assert s["bounce_ok"] == 1 and s["bounce_chunks"] > 0
    assert s["chunks_direct"] == (s["bounce_chunks"] if direct == "true" else 0), s
