"""Issue 13: KV-cache transfers the way frameworks make them, between real NIXL agents in two
processes, with a paged KV cache laid out as vLLM lays it out (kvcache.py: one registration per
layer, [K|V] x blocks x 4 KiB, 16 layers, random block ids per request):

- pull (vLLM's NIXL connector): the decode side (initiator) READs the request's blocks from the
  prefill side, the READ carrying a notification; the prefill side waits for it, checks at
  that moment that every byte of the request is already in the decode side's blocks (the
  decode side's layers are mapped shared, /dev/shm, so the prefill process can look at them),
  and then reuses the request's blocks at once (overwrites them), as a prefill worker frees
  them;
- push (the reference design): the context side (initiator) WRITEs the blocks into the
  generation side with a notification; the generation side waits for it and checks, at the
  moment it sees it, that every byte of the request is already in place.

Each pattern runs with metadata loaded both ways ("two-way") and only by the initiator
("one-way": the target never calls add_remote_agent; that is how both frameworks do it). Per
case: 8 requests one by one (1024 descriptors each), then one batch of 8 fresh requests
(8192 descriptors), every byte of both caches checked (the destinations hold the source's
bytes, everything else is untouched) and the engine's counters proving which path they took.

BOUNCES lists the (pattern, metadata) cases that take the bounce path: for those the
initiator's bounce counters must account for every transfer; for the rest every transfer must
be plain UCX pass-through (and still byte-exact). Add a case here when its path lands.
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import kvcache
import nixlkit
from conftest import HERE, Peer

BOUNCES = {("push", "two-way"), ("push", "one-way"), ("pull", "two-way"), ("pull", "one-way")}

B = "BOUNCE"
LAYOUT = kvcache.KvLayout(layers=16, blocks=512, block_bytes=4096)
COUNT, BLOCKS = 8, 32
DESCS = LAYOUT.layers * 2 * BLOCKS  # per request: 16 x 2 x 32 = 1024


class KvPeer(Peer):
    """The target side in its own process (kv_peer.py)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "kv_peer.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ), cwd=HERE)

    def start(self, **kw):
        r = self.call(op="start", **kw)
        return base64.b64decode(r["meta"]), r["bases"]


@pytest.fixture
def kv_peer():
    peers = []

    def make():
        p = KvPeer()
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()


@pytest.fixture
def shm():
    """A folder for layers mapped shared between the two processes (tmpfs where there is one)."""
    d = tempfile.mkdtemp(prefix="kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def initiator_cache(ag, p, tgt, shm, seed):
    """The initiator's cache, its layers mapped shared and watched by the target process."""
    prefix = os.path.join(shm, "initiator")
    cache = kvcache.KvCache(LAYOUT, seed, layers=kvcache.shared_layers(prefix, LAYOUT))
    cache.register(ag, B)
    p.call(op="watch", name=tgt, prefix=prefix, seed=seed)
    return cache


def stats(params):
    return {k[len("stats."):]: int(v) for k, v in params.items() if k.startswith("stats.")}


def counters(ag):
    """The initiator's counters now (a poll first: getNotifs publishes them)."""
    nixlkit.poll(ag)
    return stats(nixlkit.live_params(ag, B))


def moved(before, after):
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def transfer(ag, op, local, remote, target, notif):
    """One transfer, posted and polled to DONE; the target process polls itself."""
    h = ag.initialize_xfer(op, ag.get_xfer_descs(local, "DRAM"), ag.get_xfer_descs(remote, "DRAM"),
                           target, notif, backends=[B])
    assert ag.transfer(h) != "ERR"
    nixlkit.wait_xfer(ag, h)
    ag.release_xfer_handle(h)


def assert_clean(report, what, written):
    assert report["clean"], f"{what}: {json.dumps(report)}"
    assert report["written_rows"] == written, f"{what}: {json.dumps(report)}"


def run_requests(ag, p, pattern, names, cache, bases, tgt_seed, req_seed, batch, reuse_seed):
    """Moves the requests drawn from `req_seed` (one transfer each, or one batch of all) and
    checks the notifications' ordering as it goes. The initiator's cache is `cache`; the
    target's layers start at `bases` and hold `tgt_seed`'s bytes."""
    ini, tgt = names
    reqs = kvcache.make_requests(LAYOUT, COUNT, BLOCKS, req_seed)
    spec = {"count": COUNT, "blocks": BLOCKS, "seed": req_seed}
    pull = pattern == "pull"
    p.send(op="serve", name=tgt, **{"from": ini}, requests=spec,
           expect=["batch"] if batch else [r.index for r in reqs],
           verify="initiator" if pull else "own", src_seed=tgt_seed if pull else cache.seed,
           reuse_seed=reuse_seed if pull else None)
    groups = [reqs] if batch else [[r] for r in reqs]
    for group in groups:
        notif = b"batch" if batch else group[0].notif
        if pattern == "pull":  # decode side: our destinations <- the prefill side's sources
            local = [d for r in group for d in cache.descs(r.dst_blocks)]
            remote = [d for r in group for d in kvcache.block_descs(LAYOUT, bases, r.src_blocks)]
            transfer(ag, "READ", local, remote, tgt, notif)
            for r in group:
                cache.expect_request(r, tgt_seed)
            # DONE here; the prefill side reuses its blocks as soon as it sees the
            # notification, so any byte read after that shows up here as the reuse pattern
            bad = sum(cache.bad_bytes(r.dst_blocks) for r in group)
            assert bad == 0, f"request(s) {[r.index for r in group]}: {bad} bytes wrong after DONE"
        else:  # context side: our sources -> the generation side's destinations
            local = [d for r in group for d in cache.descs(r.src_blocks)]
            remote = [d for r in group for d in kvcache.block_descs(LAYOUT, bases, r.dst_blocks)]
            transfer(ag, "WRITE", local, remote, tgt, notif)
    seen = p.recv()["seen"]
    assert len(seen) == len(groups)
    late = [s for s in seen if s["bad"] != 0]
    assert not late, f"notification seen before its bytes were in place: {late}"


@pytest.mark.parametrize("metadata", ["two-way", "one-way"])
@pytest.mark.parametrize("pattern", ["pull", "push"])
def test_kv_requests_one_by_one_and_batched(kv_peer, shm, pattern, metadata):
    case = f"{pattern}-{metadata}"
    ini, tgt = (f"decode-{case}", f"prefill-{case}") if pattern == "pull" else \
        (f"context-{case}", f"generation-{case}")
    ini_seed, tgt_seed = 100, 200
    p = kv_peer()
    meta, bases = p.start(name=tgt, backend=B, layout=LAYOUT.__dict__, seed=tgt_seed)
    ag = nixlkit.agent(ini)
    cache = initiator_cache(ag, p, tgt, shm, ini_seed)
    ag.add_remote_agent(meta)
    if metadata == "two-way":
        p.call(op="load", name=tgt, meta=base64.b64encode(ag.get_agent_metadata()).decode())
        nixlkit.wait_ready(ag)  # HELLO exchanged: a WRITE may bounce from the first request
    before = counters(ag)
    tgt_before = stats(p.call(op="params", name=tgt)["params"])

    # 8 requests one by one
    run_requests(ag, p, pattern, (ini, tgt), cache, bases, tgt_seed, 13, False, 300)
    # one batch of 8 other requests, both caches refilled so nothing of the first phase counts
    ini_seed, tgt_seed = 101, 201
    cache.fill(ini_seed)
    p.call(op="watch", name=tgt, prefix=os.path.join(shm, "initiator"), seed=ini_seed)
    p.call(op="fill", name=tgt, seed=tgt_seed)
    run_requests(ag, p, pattern, (ini, tgt), cache, bases, tgt_seed, 14, True, 301)

    # every byte of both caches: destinations exact, everything else untouched (the READ's
    # target and the WRITE's initiator must be as they were, but for the prefill side's reuse)
    rows = COUNT * BLOCKS * 2 * LAYOUT.layers
    mine, theirs = cache.check().as_dict(), p.call(op="check", name=tgt)["report"]
    assert_clean(mine, f"{ini} ({pattern} initiator)", rows if pattern == "pull" else 0)
    assert_clean(theirs, f"{tgt} ({pattern} target)", rows if pattern == "push" else 0)

    d = moved(before, counters(ag))
    tgt_after = stats(p.call(op="params", name=tgt)["params"])
    dt = moved(tgt_before, tgt_after)
    print(f"\n{case}: initiator counters moved {d}\n{case}: target counters moved {dt}")
    # one-way really is one way: the target holds nothing of the initiator (its arena included)
    loaded = tgt_after["peer_arenas_loaded"]
    assert loaded == (1 if metadata == "two-way" else 0), tgt_after
    xfers, nbytes = COUNT + 1, 2 * COUNT * DESCS * LAYOUT.block_bytes
    if (pattern, metadata) in BOUNCES:
        assert d.get("bounce_xfers") == xfers and d.get("bounce_ok") == xfers, d
        assert d.get("bounce_bytes") == nbytes, d
        assert d.get("passthrough_xfers", 0) == 0 and d.get("bounce_failed", 0) == 0, d
        # per-direction counters (issue 13)
        per_dir = f"bounce_{'read' if pattern == 'pull' else 'write'}_ok"
        assert d.get(per_dir) == xfers, d
    else:
        assert d.get("passthrough_xfers") == xfers, d
        assert d.get("bounce_xfers", 0) == 0, d


def test_checker_sees_wrong_missing_and_stray_blocks():
    """The checker the tests above rely on fails for each way a transfer can go wrong."""
    small = kvcache.KvLayout(layers=2, blocks=64, block_bytes=4096)
    src, dst = kvcache.KvCache(small, 1), kvcache.KvCache(small, 2)
    req = kvcache.make_requests(small, 2, 8, seed=3)[0]
    rows = small.rows

    def copy(dst_blocks, src_blocks):
        for s, d in zip(src.layers, dst.layers):
            d.reshape(rows, -1)[kvcache.rows_of(small, dst_blocks)] = \
                s.reshape(rows, -1)[kvcache.rows_of(small, src_blocks)]

    dst.expect_request(req, src_seed=1)
    assert dst.check().bad_written > 0 and dst.bad_bytes(req.dst_blocks) > 0  # nothing arrived
    copy(req.dst_blocks, req.src_blocks)
    assert dst.check().clean and dst.bad_bytes(req.dst_blocks) == 0
    # one byte wrong in a written block
    dst.layers[1].view(np.uint8)[int(req.dst_blocks[0]) * small.block_bytes + 7] ^= 1
    r = dst.check()
    assert (r.bad_written, r.bad_untouched) == (1, 0), r
    copy(req.dst_blocks, req.src_blocks)
    # the right bytes in the wrong block: a stray write (and a K block read as its V block)
    free = np.setdiff1d(np.arange(small.blocks), req.dst_blocks)[0]
    copy([free], req.src_blocks[:1])
    r = dst.check()
    assert r.bad_written == 0 and r.bad_untouched_rows == 2 * small.layers, r
    dst.fill(2)
    dst.expect_request(req, src_seed=1)
    copy(req.dst_blocks, np.roll(req.src_blocks, 1))  # blocks swapped within the request
    assert dst.check().bad_written_rows == 2 * small.layers * len(req.dst_blocks)


@pytest.mark.parametrize("pattern", ["pull", "push"])
def test_ordering_checks_catch_a_notification_ahead_of_its_data(kv_peer, shm, pattern):
    """The ordering checks above can fail: a notification sent BEFORE the transfer is seen by
    the target with the request's bytes not in place, and (pull) makes the prefill side reuse
    blocks that a READ posted afterwards returns with the reuse pattern."""
    ini, tgt = f"early-{pattern}-ini", f"early-{pattern}-tgt"
    p = kv_peer()
    meta, bases = p.start(name=tgt, backend=B, layout=LAYOUT.__dict__, seed=210)
    ag = nixlkit.agent(ini)
    cache = initiator_cache(ag, p, tgt, shm, 110)
    ag.add_remote_agent(meta)
    req = kvcache.make_requests(LAYOUT, COUNT, BLOCKS, 15)[0]
    pull = pattern == "pull"
    p.send(op="serve", name=tgt, **{"from": ini}, requests={"count": COUNT, "blocks": BLOCKS, "seed": 15},
           expect=[0], verify="initiator" if pull else "own", src_seed=210 if pull else 110,
           reuse_seed=310 if pull else None)
    ag.send_notif(tgt, req.notif)
    seen = p.recv()["seen"]
    assert seen[0]["bad"] > 0, seen
    if pull:
        transfer(ag, "READ", cache.descs(req.dst_blocks),
                 kvcache.block_descs(LAYOUT, bases, req.src_blocks), tgt, b"")
        cache.expect_request(req, 210)
        assert cache.bad_bytes(req.dst_blocks) > 0
