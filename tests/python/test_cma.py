"""The same-host path for host memory (bounce_cma): between two processes of one host, a
transfer the gate would bounce is copied by the kernel straight between the two address spaces
(process_vm_writev / process_vm_readv), once, on the copy workers. Real NIXL agents in two
processes, byte-exact (every byte between the destinations too), the counters proving the path.

conftest.py turns the path off for the rest of the suite; each test here turns it on (the
environment is read when an agent is made, and peer processes inherit it).
"""
import base64
import os
import signal
import struct
import time

import numpy as np
import pytest

import nixlkit
from conftest import run_isolated
from peer import fixed_buffer
from test_bounce import B, connect, remote_buffer, stats

ON = {"NIXL_BOUNCE_CMA": "1"}


@pytest.fixture
def cma(monkeypatch):
    monkeypatch.setenv("NIXL_BOUNCE_CMA", "1")


def peer_stats(p):
    params = p.call(op="params")["params"]
    return {k[len("stats."):]: int(v) for k, v in params.items() if k.startswith("stats.")}


def setup(peer, name, tx_bytes, rx_bytes, tx_seed, rx_seed, two_way=True, peer_env=None, meta_edit=None):
    """This process's agent `name`-tx with a buffer of pattern(tx_seed), and a peer process
    `name`-rx with pattern(rx_seed); our agent loads the peer's metadata (edited by
    `meta_edit`), the peer ours only when `two_way`."""
    p = peer({**ON, **(peer_env or {})})
    meta, raddr = p.start(name=f"{name}-rx", size=rx_bytes, seed=rx_seed)
    ag = nixlkit.agent(f"{name}-tx")
    buf = nixlkit.pattern(tx_seed, tx_bytes)
    nixlkit.register(ag, buf)
    ag.add_remote_agent(meta_edit(meta) if meta_edit else meta)
    if two_way:
        connect(ag, p)
    return ag, p, raddr, buf


def descs(ag, op, lay, buf, raddr):
    if op == "WRITE":
        return ag.get_xfer_descs(lay.src_list(buf.ctypes.data), "DRAM"), ag.get_xfer_descs(lay.dst_list(raddr), "DRAM")
    return ag.get_xfer_descs(lay.dst_list(buf.ctypes.data), "DRAM"), ag.get_xfer_descs(lay.src_list(raddr), "DRAM")


def post_notified(ag, p, h, name, msg):
    """Posts `h` of agent `name`-tx, waits for it, then for its notification at the peer."""
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    p.call(op="notif_wait", **{"from": f"{name}-tx", "msg": msg})


def assert_landed(op, lay, p, tmp_path, buf, src_seed, dst_seed):
    """The destination (the peer's buffer for a WRITE, ours for a READ) holds the sources'
    bytes at `lay`'s destinations and its own bytes everywhere else."""
    got = remote_buffer(p, tmp_path) if op == "WRITE" else buf
    nixlkit.assert_same(got, lay.expected(nixlkit.pattern(src_seed, lay.src_bytes),
                                          nixlkit.pattern(dst_seed, lay.dst_bytes)), f"{op} destination")


@pytest.mark.parametrize("metadata", ["two-way", "one-way"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_same_host_transfer_is_one_copy_byte_exact(cma, peer, tmp_path, op, metadata):
    """16384 x 4 KiB, posted twice from one prepared request, each with a notification the
    peer sees after the bytes; nothing bounced, nothing passed to UCX; with metadata loaded
    both ways or only by us (the peer never loads ours: vLLM's pull, the reference design's
    push)."""
    lay = nixlkit.Scattered(16384, 4096, seed=1101)
    name = f"c1-{op.lower()}-{metadata}"
    if op == "WRITE":
        ag, p, raddr, buf = setup(peer, name, lay.src_bytes, lay.dst_bytes, 1102, 1103, metadata == "two-way")
    else:
        ag, p, raddr, buf = setup(peer, name, lay.dst_bytes, lay.src_bytes, 1103, 1102, metadata == "two-way")
    lo, re = descs(ag, op, lay, buf, raddr)
    h = ag.initialize_xfer(op, lo, re, f"{name}-rx", b"c1-done", backends=[B])
    for _ in range(2):
        if op == "READ":
            buf[:] = nixlkit.pattern(1103, lay.dst_bytes)
        post_notified(ag, p, h, name, "c1-done")
    ag.release_xfer_handle(h)
    assert_landed(op, lay, p, tmp_path, buf, 1102, 1103)
    s, t = stats(ag), peer_stats(p)
    assert s["cma_xfers"] == 2 and s["cma_ok"] == 2, s
    assert s["bounce_xfers"] == 0 and s["passthrough_xfers"] == 0, s
    assert t["bounce_ok"] == 0 and t["cma_xfers"] == 0, t


def one_piece(ag, op, buf, raddr, n, peer_name):
    """One descriptor of `n` bytes between the start of `buf` and the peer's buffer, to its end."""
    h = ag.initialize_xfer(op, ag.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM"),
                           ag.get_xfer_descs([(raddr, n, 0)], "DRAM"), peer_name, b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    ag.release_xfer_handle(h)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_large_transfer_of_few_descriptors_takes_the_path_split_over_its_threads(cma, peer, tmp_path, op):
    """Three descriptors of 10 MiB in all (unaligned, mixed sizes): too few for the gate, yet
    at least bounce_cma_large_bytes (8 MiB), so the same-host path copies them, each large
    piece cut between the path's threads; byte-exact, with every byte between the
    destinations untouched. A transfer below that size, and any with the option 0, go to UCX."""
    lay = nixlkit.Scattered(3, 0, seed=1121, sizes=[(3 << 20) + 5, 6 << 20, 1234567])
    name = f"c3-{op.lower()}"
    if op == "WRITE":
        ag, p, raddr, buf = setup(peer, name, lay.src_bytes, lay.dst_bytes, 1122, 1123)
    else:
        ag, p, raddr, buf = setup(peer, name, lay.dst_bytes, lay.src_bytes, 1123, 1122)
    lo, re = descs(ag, op, lay, buf, raddr)
    h = ag.initialize_xfer(op, lo, re, f"{name}-rx", b"c3-done", backends=[B])
    post_notified(ag, p, h, name, "c3-done")
    ag.release_xfer_handle(h)
    assert_landed(op, lay, p, tmp_path, buf, 1122, 1123)
    s = stats(ag)
    assert s["cma_xfers"] == 1 and s["cma_ok"] == 1, s
    assert s["passthrough_xfers"] == 0 and s["bounce_xfers"] == 0, s
    # At least two threads (bounce_cma_workers is 2 or more) and 10 MiB: a part's end falls
    # inside a piece, and that piece was cut between them.
    assert s["cma_pieces_cut"] >= 1, s
    # One descriptor of 1 MiB: below the size, UCX moves it. Its source holds new bytes first
    # (seed 1124), so the piece it moves shows in the destination.
    dst_now = lay.expected(nixlkit.pattern(1122, lay.src_bytes), nixlkit.pattern(1123, lay.dst_bytes))
    src_now = nixlkit.pattern(1124, lay.src_bytes)
    if op == "WRITE":
        buf[:] = src_now
    else:
        p.call(op="fill", seed=1124)
    one_piece(ag, op, buf, raddr, 1 << 20, f"{name}-rx")
    dst_now[:1 << 20] = src_now[:1 << 20]
    nixlkit.assert_same(remote_buffer(p, tmp_path, "piece.bin") if op == "WRITE" else buf, dst_now,
                        f"{op} destination after the 1 MiB piece")
    cut = s["cma_pieces_cut"]
    s = stats(ag)
    assert s["cma_xfers"] == 1 and s["passthrough_xfers"] == 1 and s["bounce_xfers"] == 0, s
    assert s["cma_pieces_cut"] == cut, s


def test_with_the_large_size_off_a_large_transfer_of_few_descriptors_goes_to_ucx(cma, peer, monkeypatch, tmp_path):
    """bounce_cma_large_bytes=0: only what the gate's thresholds admit takes the path."""
    monkeypatch.setenv("NIXL_BOUNCE_CMA_LARGE_BYTES", "0")
    n = 16 << 20
    ag, p, raddr, buf = setup(peer, "c4", n, n, 1131, 1132)
    one_piece(ag, "WRITE", buf, raddr, n, "c4-rx")
    nixlkit.assert_same(remote_buffer(p, tmp_path), nixlkit.pattern(1131, n), "the peer's buffer")
    s = stats(ag)
    assert s["cma_xfers"] == 0 and s["passthrough_xfers"] == 1 and s["bounce_xfers"] == 0, s


def test_a_peer_without_records_is_bounced_to(cma, peer, tmp_path):
    """A peer with the path off publishes no record: transfers to it bounce, silently."""
    lay = nixlkit.Scattered(4096, 4096, seed=1111)
    ag, p, raddr, buf = setup(peer, "c2", lay.src_bytes, lay.dst_bytes, 1112, 1113,
                              peer_env={"NIXL_BOUNCE_CMA": "0"})
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    h = ag.initialize_xfer("WRITE", lo, re, "c2-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(buf, nixlkit.pattern(1113, lay.dst_bytes)), "bounced")
    s = stats(ag)
    assert s["cma_xfers"] == 0 and s["bounce_ok"] == 1, s


def forge(field_off, value, size):
    """A metadata editor replacing a field of the CMA record (offset from the envelope's magic)."""
    def edit(meta):
        at = meta.find(b"NXBNCREG\x03\x00")
        assert at >= 0, "the peer's metadata carries no CMA record"
        at += field_off
        return meta[:at] + value.to_bytes(size, "little") + meta[at + size:]
    return edit


# Offsets in a version-3 envelope: magic+version 10, id 8, key 32, node 16, then the PID
# namespace (8), the pid (4), the start time (8).
PID_AT, START_AT = 10 + 8 + 32 + 16 + 8, 10 + 8 + 32 + 16 + 8 + 4


@pytest.mark.parametrize("forged", ["pid", "start"])
def test_a_record_naming_another_process_is_refused(cma, peer, tmp_path, forged):
    """A record whose pid is another live process (pid 1), or whose start time is not the
    pid's (a reused pid): nothing is copied through CMA; the transfer bounces, byte-exact."""
    lay = nixlkit.Scattered(4096, 4096, seed=1121)
    edit = forge(PID_AT, 1, 4) if forged == "pid" else forge(START_AT, 1, 8)
    ag, p, raddr, buf = setup(peer, f"c3-{forged}", lay.src_bytes, lay.dst_bytes, 1122, 1123, meta_edit=edit)
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    h = ag.initialize_xfer("WRITE", lo, re, f"c3-{forged}-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(buf, nixlkit.pattern(1123, lay.dst_bytes)), "bounced")
    s = stats(ag)
    assert s["cma_xfers"] == 0 and s["bounce_ok"] == 1, s


def test_peer_killed_between_posts_fails_at_once_then_a_new_peer_works(cma, peer, tmp_path):
    """The peer's process is gone: the next post of a prepared request answers ERR at once (its
    pid is checked at every post), and a new peer then gets a byte-exact same-host transfer."""
    lay = nixlkit.Scattered(4096, 4096, seed=1131)
    ag, p, raddr, buf = setup(peer, "c4", lay.src_bytes, lay.dst_bytes, 1132, 1133)
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    h = ag.initialize_xfer("WRITE", lo, re, "c4-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    # At once means at the post itself, not a check later (no stopwatch): the post answers ERR
    # (or raises) before any copy starts, so the path never counts it as posted.
    try:
        state = ag.transfer(h)
    except Exception:
        state = "ERR"
    assert state == "ERR", f"the post to a killed peer answered {state}"
    s = stats(ag)
    assert (s["cma_xfers"], s["cma_ok"], s["bounce_xfers"], s["passthrough_xfers"]) == (1, 1, 0, 0), s
    ag.release_xfer_handle(h)
    ag.remove_remote_agent("c4-rx")
    p2 = peer(ON)
    meta, raddr2 = p2.start(name="c4-rx2", size=lay.dst_bytes, seed=1134)
    ag.add_remote_agent(meta)
    connect(ag, p2)
    lo, re = descs(ag, "WRITE", lay, buf, raddr2)
    h = ag.initialize_xfer("WRITE", lo, re, "c4-rx2", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    ag.release_xfer_handle(h)
    nixlkit.assert_same(remote_buffer(p2, tmp_path, "r2.bin"), lay.expected(buf, nixlkit.pattern(1134, lay.dst_bytes)),
                        "after the kill")
    assert stats(ag)["cma_ok"] == 2


def test_release_while_in_flight_waits_and_loses_nothing(cma, peer, tmp_path):
    """Requests released right after their posts: the release waits for the copy, so once it
    returns the destination holds every byte and the source is no longer read (refilled with
    other bytes, a full request then writes those)."""
    lay = nixlkit.Scattered(16384, 4096, seed=1141)
    ag, p, raddr, buf = setup(peer, "c5", lay.src_bytes, lay.dst_bytes, 1142, 1143)
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    before = nixlkit.pattern(1143, lay.dst_bytes)
    for _ in range(3):
        h = ag.initialize_xfer("WRITE", lo, re, "c5-rx", b"", backends=[B])
        assert ag.transfer(h) != "ERR"
        ag.release_xfer_handle(h)
    # Released, so done with: every byte landed, none read later (the source changes now).
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(buf, before), "after the releases returned")
    buf[:] = nixlkit.pattern(1144, lay.src_bytes)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(nixlkit.pattern(1142, lay.src_bytes), before),
                        "after the source changed: a released copy read it")
    h = ag.initialize_xfer("WRITE", lo, re, "c5-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(buf, before), "after the full request")
    s = stats(ag)
    assert s["cma_xfers"] == 4 and s["bounce_xfers"] == 0, s


def test_the_notification_goes_out_though_the_request_is_never_checked(cma, peer, tmp_path):
    """An application that posts a notified WRITE and then only polls its notifications,
    waiting for its peer's answer to it, never asking about its request: UCX sends the
    notification behind the data whether the request is asked about or not, and so must the
    same-host path (it was sent only by a status query, and both sides waited for ever).
    Our polls of `getNotifs` send it once the copy has ended; then the request reads DONE."""
    lay = nixlkit.Scattered(4096, 4096, seed=1151)
    ag, p, raddr, buf = setup(peer, "c10", lay.src_bytes, lay.dst_bytes, 1152, 1153)
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    h = ag.initialize_xfer("WRITE", lo, re, "c10-rx", b"c10-done", backends=[B])
    assert ag.transfer(h) != "ERR"
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert not ag.get_new_notifs(), "nothing was sent to us"
        time.sleep(0.01)
    r = p.call(op="notif_wait", timeout=5, **{"from": "c10-tx", "msg": "c10-done"})
    assert r.get("ok"), r
    assert ag.check_xfer_state(h) == "DONE"
    ag.release_xfer_handle(h)
    nixlkit.assert_same(remote_buffer(p, tmp_path), lay.expected(buf, nixlkit.pattern(1153, lay.dst_bytes)), "landed")
    s = stats(ag)
    assert s["cma_xfers"] == 1 and s["cma_ok"] == 1 and s["bounce_xfers"] == 0, s


def test_a_deregistered_destination_is_not_written(cma, peer, tmp_path):
    """The peer deregisters its buffer (its memory stays allocated): the next post of a
    prepared request fails at once, and not one byte of the peer's buffer changes after the
    deregistration. The bounce path refuses such writes at the receiver; CMA reads the
    registration's liveness word in the peer before every post."""
    lay = nixlkit.Scattered(4096, 4096, seed=1151)
    ag, p, raddr, buf = setup(peer, "c6", lay.src_bytes, lay.dst_bytes, 1152, 1153)
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    h = ag.initialize_xfer("WRITE", lo, re, "c6-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    before = remote_buffer(p, tmp_path, "before.bin")
    p.call(op="dereg")
    buf[:] = nixlkit.pattern(1154, lay.src_bytes)  # other bytes, so a write would show
    state = nixlkit.settle(ag, h)
    assert state == "ERR", state
    after = remote_buffer(p, tmp_path, "after.bin")
    assert (after == before).all(), "the deregistered buffer was written"
    s = stats(ag)
    assert s["cma_xfers"] == 1 and s["cma_ok"] == 1, s


def test_a_local_deregistration_waits_for_our_copies_into_it(cma, peer):
    """A READ into our buffer is still being copied by the path's threads when the application
    deregisters the buffer: the deregistration returns only once the copy has ended (the
    application may reuse the memory then, as PyTorch's allocator does), so not one byte is
    written after it, and the transfer, posted while the memory was registered, is done."""
    size = 256 << 20
    p = peer(ON)
    meta, raddr = p.start(name="c7-rx", size=size, seed=1171)
    # Two copy threads: the posting thread copies the first half itself, a worker the second.
    ag = nixlkit.agent("c7-tx", params={"bounce_cma_workers": "2"})
    ag.add_remote_agent(meta)
    theirs = nixlkit.pattern(1171, size)
    in_flight = 0
    for _ in range(3):
        # A fresh buffer whose first half only is touched: the worker's half is faulted in by
        # its copy, which so outlasts the poster's and is still running as the post returns.
        buf = np.empty(size, dtype=np.uint8)
        buf[:size // 2] = 0
        tail = buf[size - size // 8:]
        reg = nixlkit.register(ag, buf)
        lo = ag.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
        re = ag.get_xfer_descs([(raddr, size, 0)], "DRAM")
        h = ag.initialize_xfer("READ", lo, re, "c7-rx", b"", backends=[B])
        assert ag.transfer(h) != "ERR"
        # Whether the copy was still running as the deregistration began: in flight at this
        # check, just before. Not deterministic (the copy may end between this check and the
        # call, or before it on a machine whose cores are all free), so it is counted over the
        # rounds, and at least one must have been.
        in_flight += ag.check_xfer_state(h) == "PROC"
        ag.deregister_memory(reg, backends=[B])
        assert ag.check_xfer_state(h) == "DONE", "the copy into the buffer ended before its deregistration returned"
        # Every byte landed before the deregistration returned: the READ is whole.
        nixlkit.assert_same(buf, theirs, "the READ's destination when its deregistration returned")
        tail[:] = 0xAB  # the application's memory again
        time.sleep(0.2)
        assert int(np.count_nonzero(tail != 0xAB)) == 0, "written after its deregistration"
        ag.release_xfer_handle(h)
    print(f"\nthe READ was in flight as its deregistration began in {in_flight} of 3 rounds")
    assert in_flight >= 1, "the copy had always ended before its deregistration began: nothing was waited for"
    s = stats(ag)
    assert s["cma_xfers"] == 3 and s["cma_ok"] == 3 and s["bounce_xfers"] == 0 and s["passthrough_xfers"] == 0, s


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_request_prepared_over_our_memory_deregistered_since_fails_at_its_post(cma, peer, tmp_path, op):
    """The application deregisters the buffer a prepared request copies from (WRITE) or into
    (READ), then posts the request: it fails (never DONE), nothing of the buffer is read into
    the peer or written here, and a request prepared again once the buffer is registered again
    moves every byte. UCX's request would use a memory handle freed by then; ours knows."""
    lay = nixlkit.Scattered(1024, 4096, seed=1181)
    ag, p, raddr, buf = setup(peer, "c8", lay.src_bytes if op == "WRITE" else lay.dst_bytes,
                              lay.dst_bytes if op == "WRITE" else lay.src_bytes, 1182, 1183)
    lo, re = descs(ag, op, lay, buf, raddr)
    h = ag.initialize_xfer(op, lo, re, "c8-rx", b"", backends=[B])
    peer_before = remote_buffer(p, tmp_path, "before.bin")
    ag.deregister_memory(ag.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"), backends=[B])
    ours_before = buf.copy()
    state = nixlkit.settle(ag, h)
    assert state == "ERR", state
    assert (remote_buffer(p, tmp_path, "after.bin") == peer_before).all(), "the peer's buffer changed"
    assert (buf == ours_before).all(), "our deregistered buffer was written"
    ag.release_xfer_handle(h)
    nixlkit.register(ag, buf)
    h = ag.initialize_xfer(op, lo, re, "c8-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    assert_landed(op, lay, p, tmp_path, buf, 1182 if op == "WRITE" else 1183, 1183 if op == "WRITE" else 1182)
    s = stats(ag)
    assert s["cma_xfers"] == 1 and s["cma_ok"] == 1 and s["bounce_xfers"] == 0, s


def test_deregistering_a_registration_inside_another_leaves_requests_over_the_other_working(cma, peer, tmp_path):
    """Review 60 L3. Our buffer is registered whole, and a part of it again (4 KiB from 2 KiB
    in, which holds no descriptor whole: NIXL matches every one to the whole buffer). The part
    is deregistered between two posts of a prepared WRITE: that memory is still registered, so
    as under UCX the second post moves every byte by the same path. It used to fail
    (`Deregistered`): every request touching the part's range was revoked."""
    lay = nixlkit.Scattered(1024, 4096, seed=1191)
    ag, p, raddr, buf = setup(peer, "c9", lay.src_bytes, lay.dst_bytes, 1192, 1193)
    part = ag.get_reg_descs([(buf.ctypes.data + 2048, 4096, 0, "")], "DRAM")
    ag.register_memory(part, backends=[B])
    lo, re = descs(ag, "WRITE", lay, buf, raddr)
    h = ag.initialize_xfer("WRITE", lo, re, "c9-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    p.call(op="fill", seed=1194)
    ag.deregister_memory(part, backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    assert_landed("WRITE", lay, p, tmp_path, buf, 1192, 1194)
    s = stats(ag)
    assert s["cma_xfers"] == 2 and s["cma_ok"] == 2 and s["bounce_xfers"] == 0, s
    ag.release_xfer_handle(h)



@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_request_prepared_before_the_peer_was_removed_fails_at_its_post(cma, peer, tmp_path, op):
    """The application removes the peer (`remove_remote_agent`: NIXL unloads its metadata) after
    preparing a request to it, then posts the request: it fails, and not one byte moves either
    way; loaded again, the old request still fails and a new one moves every byte (review 55).
    NIXL 1.5.1 refuses such a post itself (NIXL_ERR_NOT_FOUND) before BOUNCE sees it; behind
    that, the same-host paths bind each request to the loads it was prepared from, as the
    bounce path binds its requests to the peer's incarnation (specs
    `keys::a_same_host_request_is_bound_to_the_loads_it_was_prepared_from` and the CMA path's
    unit test), for a NIXL that does not, or a post racing the removal."""
    lay = nixlkit.Scattered(1024, 4096, seed=1191)
    write = op == "WRITE"
    ag, p, raddr, buf = setup(peer, "c11", lay.src_bytes if write else lay.dst_bytes,
                              lay.dst_bytes if write else lay.src_bytes, 1192, 1193)
    lo, re = descs(ag, op, lay, buf, raddr)
    h = ag.initialize_xfer(op, lo, re, "c11-rx", b"", backends=[B])
    peer_before = remote_buffer(p, tmp_path, "before.bin")
    ag.remove_remote_agent("c11-rx")
    if write:
        buf[:] = nixlkit.pattern(1194, lay.src_bytes)  # other bytes, so a write would show
    ours_before = buf.copy()
    assert nixlkit.settle(ag, h) == "ERR", "a request to a removed peer copied"
    assert (remote_buffer(p, tmp_path, "after.bin") == peer_before).all(), "the removed peer's buffer changed"
    assert (buf == ours_before).all(), "a READ from the removed peer wrote here"
    s = stats(ag)
    assert s["cma_xfers"] == 0 and s["bounce_xfers"] == 0, s
    # Loaded again (the same process, the same registration): the old request names the
    # load that was removed.
    ag.add_remote_agent(base64.b64decode(p.call(op="meta")["meta"]))
    assert nixlkit.settle(ag, h) == "ERR", "a request prepared from a removed load copied"
    assert (remote_buffer(p, tmp_path, "again.bin") == peer_before).all(), "the peer's buffer changed"
    ag.release_xfer_handle(h)
    if write:
        buf[:] = nixlkit.pattern(1192, lay.src_bytes)
    h = ag.initialize_xfer(op, lo, re, "c11-rx", b"", backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    ag.release_xfer_handle(h)
    assert_landed(op, lay, p, tmp_path, buf, 1192 if write else 1193, 1193 if write else 1192)
    s = stats(ag)
    assert s["cma_xfers"] == 1 and s["cma_ok"] == 1 and s["bounce_xfers"] == 0, s

CMA_THREADS = """
import os, nixlkit
def cma_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            n += f.read().startswith("bounce-cma-")
    return n
before = cma_threads()
ag = nixlkit.agent("threads", params=PARAMS)
def cpus():
    # As Rust's available_parallelism: the affinity mask, lowered by a cgroup v2 CPU quota.
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n
print("THREADS", cma_threads() - before, cpus())
nixlkit.leave(0)
"""


@pytest.mark.parametrize("set_to", [None, "3"])
def test_the_path_runs_the_threads_set_else_half_the_cpus_between_2_and_8(cma, set_to):
    """`bounce_cma_workers`: the threads the path starts (named `bounce-cma-N`), counted in a
    fresh process: the value set, or for the default 0 half the CPUs the process may run on,
    at least 2 and at most 8."""
    params = {} if set_to is None else {"bounce_cma_workers": set_to}
    rc, out = run_isolated(f"PARAMS = {params!r}\n" + CMA_THREADS, env=ON)
    assert rc == 0, out[-3000:]
    line = [x for x in out.splitlines() if x.startswith("THREADS ")]
    assert line, out[-3000:]
    threads, cpus = map(int, line[0].split()[1:])
    want = int(set_to) if set_to else min(8, max(2, cpus // 2))
    assert threads == want, (threads, cpus, out[-2000:])


def test_a_record_planted_by_a_failed_load_never_takes_our_writes_to_another_agent(cma, peer, tmp_path):
    """Review 55 H1. Agent C of this host holds A's metadata, so A's registration id and key,
    and has a buffer of its own at the same virtual address as A's. It hands us its
    registration metadata with A's id and key in place of its own and no connection info: our
    load of it fails (UCX has no connection to C), but its same-host record used to stay
    behind, to be taken by the next load of a registration under A's id and key. A's own
    metadata carries no record (A's same-host path is off), so our scattered WRITE to A went
    by CMA into C's process and was reported DONE, A's buffer untouched. Only the load of the
    blob that carried a record may keep it: the WRITE now bounces into A."""
    at = 0x7E0000000000
    lay = nixlkit.Scattered(4096, 4096, seed=1201)
    a = peer({"NIXL_BOUNCE_CMA": "0"})
    meta_a, addr_a = a.start(name="h1-rx", size=lay.dst_bytes, seed=1202, at=at)
    c = peer(ON)
    _, addr_c = c.start(name="h1-c", size=lay.dst_bytes, seed=1203, at=at)
    assert addr_a == addr_c == at
    partial = base64.b64decode(c.call(op="partial_meta")["meta"])
    # A registration's public data: magic (8 bytes), layout version (2), id (8), key (32).
    i, j = meta_a.index(b"NXBNCREG"), partial.index(b"NXBNCREG")
    forged = partial[:j + 10] + meta_a[i + 10:i + 50] + partial[j + 50:]
    assert forged != partial and len(forged) == len(partial)
    ag = nixlkit.agent("h1-tx")
    buf = nixlkit.pattern(1204, lay.src_bytes)
    nixlkit.register(ag, buf)
    with pytest.raises(Exception):
        ag.add_remote_agent(forged)  # no connection info: the inner engine refuses the load
    ag.add_remote_agent(meta_a)
    connect(ag, a)
    before = stats(ag)
    h = ag.initialize_xfer("WRITE", *descs(ag, "WRITE", lay, buf, at), "h1-rx", b"h1")
    post_notified(ag, a, h, "h1", "h1")
    moved = {k: v - before.get(k, 0) for k, v in stats(ag).items() if v != before.get(k, 0)}
    assert not moved.get("cma_xfers") and moved.get("bounce_ok") == 1, moved
    assert_landed("WRITE", lay, a, tmp_path, buf, 1204, 1202)
    nixlkit.assert_same(remote_buffer(c, tmp_path, "c.bin"), nixlkit.pattern(1203, lay.dst_bytes), "C's buffer")


def cma_records(meta):
    """Every CMA record in `meta`: where its envelope starts, and its fields (version-3
    envelope: magic+version 10, id 8, key 32, node 16, then the PID namespace, pid, start time,
    address, length, liveness word and tag)."""
    magic, out = b"NXBNCREG\x03\x00", []
    at = meta.find(magic)
    while at >= 0:
        pidns, pid, start, addr, length, live, tag = struct.unpack_from("<QIQQQQQ", meta, at + 66)
        out.append(dict(at=at, node=meta[at + 50:at + 66], pidns=pidns, pid=pid, start=start, addr=addr,
                        len=length, live=live, tag=tag))
        at = meta.find(magic, at + 1)
    return out


def test_a_record_naming_bytes_off_the_word_grid_never_writes_the_process(cma, peer, tmp_path):
    """Review 60 H1. Process K publishes two registrations whose liveness words are adjacent;
    its memory at T is mapped but never registered. Agent C of this process holds K's
    metadata and registers a buffer of its own at T, and hands us its metadata with its CMA
    record rewritten to name K and the 24 bytes 8 past K's first word: K's first range and its
    second tag, which read as a word proving the range [len, len + tag), nearly all of K. Our
    WRITE to C at T went by CMA into K's unregistered memory and was reported DONE. Now the
    record proves nothing: the WRITE bounces into C, byte-exact, and K's memory stays zero."""
    T, n, size, stride = 0x7E4000000000, 256, 4096, 8192
    k = peer(ON)
    meta_k, _ = k.start(name="h60-k", size=4096, seed=1301, host={"size": 4096, "seed": 1302},
                        spare={"at": T, "size": n * stride})
    recs = cma_records(meta_k)
    a, b = next(((a, b) for a in recs for b in recs if b["live"] == a["live"] + 24), (None, None))
    assert a is not None, f"a fresh process's two registrations take adjacent words: {recs}"
    c = nixlkit.agent("h60-c")
    cbuf = fixed_buffer(T, n * stride)
    cbuf[:] = nixlkit.pattern(1303, n * stride)
    nixlkit.register(c, cbuf)
    meta_c = c.get_agent_metadata()
    (mine,) = cma_records(meta_c)
    at = mine["at"] + 66
    fields = struct.pack("<QIQQQQQ", a["pidns"], a["pid"], a["start"], a["len"], b["tag"], a["live"] + 8, a["addr"])
    forged = meta_c[:mine["at"] + 50] + a["node"] + fields + meta_c[at + len(fields):]
    assert len(forged) == len(meta_c)
    x = nixlkit.agent("h60-x")
    src = nixlkit.pattern(1304, n * stride)
    nixlkit.register(x, src)
    x.add_remote_agent(forged)
    before = stats(x)
    lo = x.get_xfer_descs([(src.ctypes.data + i * stride, size, 0) for i in range(n)], "DRAM")
    re = x.get_xfer_descs([(T + i * stride, size, 0) for i in range(n)], "DRAM")
    h = x.initialize_xfer("WRITE", lo, re, "h60-c", b"", backends=[B])
    assert x.transfer(h) != "ERR"
    nixlkit.wait_xfer(x, h)
    moved = {key: v - before.get(key, 0) for key, v in stats(x).items() if v != before.get(key, 0)}
    assert not moved.get("cma_xfers"), moved
    spare = tmp_path / "spare.bin"
    k.call(op="dump", path=str(spare), spare=True)
    assert not np.fromfile(spare, dtype=np.uint8).any(), "K's unregistered memory was written"
    want = nixlkit.pattern(1303, n * stride).reshape(n, stride).copy()
    want[:, :size] = src.reshape(n, stride)[:, :size]
    nixlkit.assert_same(cbuf, want.reshape(-1), "C's buffer")
    x.release_xfer_handle(h)
