"""KV-cache transfers the way frameworks make them (issue 13): BOUNCE vs plain UCX, side by side
in ONE run, two processes, DRAM, a paged KV cache laid out as vLLM lays it out
(tests/python/kvcache.py: one registration per layer, [K|V] x blocks x block bytes).

    .venv/bin/python benches/kv_patterns.py [--rounds 15] [--layers 16] [--blocks 512]
        [--per-request 32] [--requests 8] [--block-bytes 4096] [--only pull-one-way]
        [--mem VRAM [--peer-gpu 1]] [--variants "BOUNCE bounced,UCX"] [--prep-each]
        [--pause-ms 40] [--evict-mib 512] [--samples]

--mem VRAM (on a GPU machine) puts both caches in GPU memory (one torch tensor per layer, both
processes on GPU 0, or the target's on --peer-gpu) and gives BOUNCE a GPU arena (bounce_arena_mem=vram): between two processes
of one host that is the same-host path.

Cases: pull (the decode side READs the request's blocks from the prefill side, the READ
carrying a notification, as vLLM's NIXL connector does) and push (the context side WRITEs them
into the generation side with a notification, as the reference design does), each with
metadata loaded both ways (two-way) and by the initiator only (one-way: the target never calls
add_remote_agent). Each case runs in a child process (the initiator) against a target process
(tests/python/kv_peer.py); both hold one agent per variant (BOUNCE as shipped, which between
processes of one host takes the same-host path; "BOUNCE bounced", that path off, as between two
hosts; UCX), each with its own cache, and the variants are measured in interleaved blocks (a
round: one block per variant, each round starting with the variant that ended the one before,
so every variant has as many blocks right after one of its own as any other), so machine noise
lands on all alike.

A block: the 8 requests one by one (1024 descriptors each with the defaults), then one batch of
all 8 (8192 descriptors); each a prepared request re-posted (with --prep-each: prepared right
before its post and released after, the prep timed too, as vLLM's connector prepares each
request's own block ids), timed from transfer() to DONE
(status polled in a busy loop; the target process polls its agents every 0.5 ms meanwhile, as
a framework's loop would), then the target must have seen every notification. One
warm-up round is not counted. `--pause-ms` idles before each block (the first request of a
block then follows a pause with no transfer, as between a framework's batches), `--evict-mib`
writes through a buffer that large before each block instead (cold caches, no idle thread:
which of the two makes a block's first request slow), `--samples`
prints every request's time in order. Reported per backend: batch median; per-request p50 and p99
(over rounds x requests), and the same split by the block before each (right after a block of
the same variant, as a framework using one backend runs, or after another variant's block:
the first request of a block that follows another backend's pays for the caches that block
took); ratios BOUNCE / UCX (goal <= 0.4 on the batch) and p99 / p50 (goal <= 1.5), each
"met" or "MISSED" (`--strict`: exit status 1 when one is missed; a p99 of fewer than 100
requests is their largest, and printed as such); the path the initiator's BOUNCE engine took (its counters: the gate runs when a
request is prepared, so `passthrough_xfers` and `fallback_*` count the 9 prepared requests,
`bounce_xfers` / `bounce_ok` count posts); and a byte-exact check of both caches of every
variant after the run: the destinations are refilled with other bytes and every request posted
once more, untimed, first, so the check proves the last posts wrote. A case prints no figure
unless every variant's caches are byte-exact and BOUNCE's counters show every post of each of
its variants on its path, counted once (as shipped: the same-host path; bounced: bounced;
neither: a request passed to UCX), so an inherited
`NIXL_BOUNCE_*` that overrides a variant's settings fails the run instead of mislabelling it.
"""
import argparse
import base64
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(os.path.dirname(HERE), "tests", "python")
sys.path.insert(0, PY)
sys.path.insert(0, HERE)
from child import run_child, to_ucx  # noqa: E402

# (name, backend, params): "BOUNCE" as shipped (between processes of one host, the same-host
# path: CMA for host memory, CUDA IPC for GPU memory), "BOUNCE bounced" with that path off (what
# two hosts get), and plain UCX.
VARIANTS = (("BOUNCE", "BOUNCE", {}), ("BOUNCE bounced", "BOUNCE", {"bounce_cma": "false", "bounce_cuda_ipc": "false"}),
            ("UCX", "UCX", {}))
BACKENDS = tuple(v[0] for v in VARIANTS)
CASES = [(p, m) for p in ("pull", "push") for m in ("two-way", "one-way")]
# Issue 13's goals: the bounced batch at most this fraction of UCX's; a request's p99 at most
# this multiple of its p50.
BATCH_GOAL, TAIL_GOAL = 0.4, 1.5
# Added to a side's seed to refill its destinations before the untimed check round.
REFILL = 1000
PATH_KEYS = ("cma_xfers", "cma_ok", "ipc_xfers", "ipc_ok", "bounce_xfers", "bounce_ok", "bounce_failed", "one_way_sent",
             "region_plans_sent", "mailbox_fetches", "mailbox_fetch_us", "passthrough_xfers", "fallback_op",
             "fallback_peer", "fallback_count", "fallback_size", "fallback_unproven")


class Target:
    """The target process (kv_peer.py), driven line by line."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(PY, "kv_peer.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=PY,
            stderr=None if os.environ.get("BENCH_VERBOSE") else subprocess.DEVNULL)

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"target died (rc={self.proc.poll()}) during {cmd['op']}")
        r = json.loads(line)
        if not r.get("ok"):
            raise SystemExit(f"target {cmd['op']} failed: {r.get('error')}")
        return r


def counters(ag, backend):
    import nixlkit
    nixlkit.poll(ag)  # getNotifs publishes the counters
    return {k[len("stats."):]: int(v) for k, v in nixlkit.live_params(ag, backend).items()
            if k.startswith("stats.")}


class Side:
    """One backend's pair: our agent and cache, the target's agent, the prepared requests."""

    def __init__(self, variant, case, target, layout, reqs, mem, peer_gpu=0, prep_each=False):
        import kvcache
        import nixlkit
        import numpy as np

        pattern, metadata = case
        self.variant, backend, extra = variant
        self.backend = backend
        tag = f"{pattern}-{metadata}-{self.variant.replace(' ', '-')}"
        self.name, self.peer = (f"decode-{tag}", f"prefill-{tag}") if pattern == "pull" else \
            (f"context-{tag}", f"generation-{tag}")
        self.tgt_seed, self.ini_seed = 20, 10
        params = {**({"bounce_arena_mem": "vram"} if backend == "BOUNCE" and mem == "VRAM" else {}), **extra} or None
        r = target.call(op="start", name=self.peer, backend=backend, layout=layout.__dict__,
                        seed=self.tgt_seed, mem=mem, dev=peer_gpu, params=params)
        self.ag = nixlkit.agent(self.name, (backend,), params)
        self.cache = kvcache.GpuKvCache(layout, self.ini_seed) if mem == "VRAM" else \
            kvcache.KvCache(layout, self.ini_seed)
        self.cache.register(self.ag, backend)
        self.ag.add_remote_agent(base64.b64decode(r["meta"]))
        if metadata == "two-way":
            target.call(op="load", name=self.peer,
                        meta=base64.b64encode(self.ag.get_agent_metadata()).decode())
            if backend == "BOUNCE":
                nixlkit.wait_ready(self.ag)
        op = "READ" if pattern == "pull" else "WRITE"
        # before the requests are prepared: the gate runs (and counts a pass-through) at prep
        self.before = counters(self.ag, backend) if backend == "BOUNCE" else {}

        def prep(group, notif):
            mine = [d for q in group for d in self.cache.descs(
                q.dst_blocks if pattern == "pull" else q.src_blocks)]
            theirs = [(a, n, peer_gpu) for q in group for a, n, _ in kvcache.block_descs(
                layout, r["bases"], q.src_blocks if pattern == "pull" else q.dst_blocks)]
            return self.ag.initialize_xfer(op, self.ag.get_xfer_descs(mine, mem),
                                           self.ag.get_xfer_descs(theirs, mem), self.peer,
                                           notif, backends=[backend])

        self.prep_each = prep_each
        # --prep-each makes each request right before its post, timed with it, and releases it
        # after, as vLLM's connector does: both sides' block lists prepared once
        # (prep_xfer_dlist: every layer x K/V x block), a request made from its block ids
        # (make_prepped_xfer).
        if prep_each:
            every = range(layout.blocks)
            local = self.ag.prep_xfer_dlist("NIXL_INIT_AGENT", self.cache.descs(every), mem, backends=[backend])
            remote = self.ag.prep_xfer_dlist(self.peer, [(a, n, peer_gpu) for a, n, _ in kvcache.block_descs(
                layout, r["bases"], every)], mem, backends=[backend])

            def ids(blocks):  # as vLLM computes them: with numpy, handed over as an array
                rows = kvcache.rows_of(layout, blocks)
                return (np.arange(layout.layers)[:, None] * (2 * layout.blocks) + rows[None, :]).ravel()

            def made(group, notif):
                mine = [b for q in group for b in (q.dst_blocks if pattern == "pull" else q.src_blocks)]
                theirs = [b for q in group for b in (q.src_blocks if pattern == "pull" else q.dst_blocks)]
                return self.ag.make_prepped_xfer(op, local, ids(mine), remote, ids(theirs), notif,
                                                 backends=[backend])
        self.prep = made if prep_each else prep
        # the 8 requests one by one, then the batch: prepared once here, or per post
        self.groups = [([q], q.notif) for q in reqs] + [(reqs, b"batch")]
        self.handles = [] if prep_each else [prep(*g) for g in self.groups]
        self.single_s, self.batch_s, self.prep_single_s, self.prep_batch_s = [], [], [], []
        self.after_own = []  # per kept block: did it follow a block of this variant (see child)
        self.posts = 0  # every transfer() of this variant, timed or not

    def post_fresh(self, group, notif):
        """Makes the request, posts it and releases it: (total time, prep time)."""
        t0 = time.perf_counter()
        h = self.prep(group, notif)
        prep = time.perf_counter() - t0
        dt = self.post(h, t0)
        self.ag.release_xfer_handle(h)
        return dt, prep

    def post(self, h, t0=None):
        t0 = time.perf_counter() if t0 is None else t0
        self.posts += 1
        state = self.ag.transfer(h)
        while state not in ("DONE", "ERR"):
            state = self.ag.check_xfer_state(h)
        if state != "DONE":
            raise SystemExit(f"{self.backend}: transfer failed")
        return time.perf_counter() - t0

    def block(self, target, keep):
        if self.prep_each:
            times, preps = zip(*[self.post_fresh(*g) for g in self.groups])
        else:
            times, preps = [self.post(h) for h in self.handles], []
        singles, batch = list(times[:-1]), times[-1]
        # every notification must reach the target, each once: 8 requests + the batch
        target.call(op="take", name=self.peer, **{"from": self.name},
                    msgs=[base64.b64encode(notif).decode() for _, notif in self.groups])
        if keep:
            self.single_s.extend(singles)
            self.batch_s.append(batch)
            if preps:
                self.prep_single_s.extend(preps[:-1])
                self.prep_batch_s.append(preps[-1])


def child(case, args):
    import kvcache
    import nixlkit
    import numpy

    layout = kvcache.KvLayout(args.layers, args.blocks, args.block_bytes)
    reqs = kvcache.make_requests(layout, args.requests, args.per_request, seed=7)
    target = Target()
    if args.mem == "VRAM":
        import torch
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda:0")  # the GPU current before the agents are made
    sides = [Side(v, case, target, layout, reqs, args.mem, args.peer_gpu, args.prep_each) for v in chosen(args)]
    if args.mem == "VRAM":
        # BENCH_TRACE=DIR: this process's CUDA activity from here to the end (benches/trace_kernels.py)
        nixlkit.gpu_trace(f"kv-initiator-{case[0]}-{case[1]}")
    # --evict-mib: a buffer written through before each block, which evicts the last-level cache
    # the two processes share on one socket without leaving any thread idle.
    evict = numpy.zeros(args.evict_mib << 20, dtype=numpy.uint8) if args.evict_mib else None
    prev = None
    for rnd in range(args.rounds + 1):
        for s in block_order(sides, rnd):
            time.sleep(args.pause_ms / 1e3)
            if evict is not None:
                evict.fill(rnd & 0xFF)
            s.block(target, keep=rnd > 0)
            if rnd > 0:
                # whether this block came right after one of the same variant (nothing of another
                # backend's between its requests and the previous ones: the steady state of a
                # framework that uses one backend) or after another variant's block
                s.after_own.append(prev is s and not args.pause_ms and not args.evict_mib)
            prev = s
    # Every timed round re-posts the same requests with the same bytes, so the caches alone
    # would only prove that some post wrote each destination: refill the destinations with
    # other bytes and post every request once more (untimed) before the byte check.
    for s in sides:
        if case[0] == "pull":
            s.cache.fill(s.ini_seed + REFILL)
        else:
            target.call(op="fill", name=s.peer, seed=s.tgt_seed + REFILL)
        s.block(target, keep=False)
    out = {}
    for s in sides:
        # byte-exact: the destinations hold the sources' bytes, everything else is untouched
        if case[0] == "pull":
            for q in reqs:
                s.cache.expect_request(q, s.tgt_seed)
            mine = s.cache.check().as_dict()
            theirs = target.call(op="check", name=s.peer)["report"]
        else:
            mine = s.cache.check().as_dict()
            target.call(op="expect", name=s.peer, src_seed=s.ini_seed,
                        requests={"count": args.requests, "blocks": args.per_request, "seed": 7})
            theirs = target.call(op="check", name=s.peer)["report"]
        path = {}
        if s.backend == "BOUNCE":
            after = counters(s.ag, s.backend)
            path = {k: after.get(k, 0) - s.before.get(k, 0) for k in PATH_KEYS
                    if after.get(k, 0) != s.before.get(k, 0)}
        out[s.variant] = {"single": s.single_s, "batch": s.batch_s, "path": path, "after_own": s.after_own,
                          "posts": s.posts,
                          "prep_single": s.prep_single_s, "prep_batch": s.prep_batch_s,
                          "exact": mine["clean"] and theirs["clean"], "mine": mine, "theirs": theirs}
    print("RESULT " + json.dumps(out), flush=True)
    target.call(op="exit")
    nixlkit.leave(0)


def chosen(args):
    """The variants asked for (--variants), in VARIANTS' order."""
    names = args.variants.split(",") if args.variants else BACKENDS
    unknown = set(names) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(BACKENDS)}")
    return [v for v in VARIANTS if v[0] in names]


def path_problem(variant, path, posts):
    """Why the initiator engine's counters (`path`: the keys of PATH_KEYS that moved) do not show
    every one of the variant's `posts` transfers on its path, each counted once (None when they
    do). The gate runs at prep, so any pass-through or fallback counted means a request went to
    UCX; a post that returned DONE without moving anything would leave its counter short."""
    if variant == "UCX":
        return None
    went = to_ucx(path)
    if went:
        return f"requests went to UCX ({went})"
    same_host = path.get("cma_ok", 0) + path.get("ipc_ok", 0)
    bounced, submitted = path.get("bounce_ok", 0), path.get("bounce_xfers", 0)
    if variant == "BOUNCE bounced":
        if same_host or bounced != posts or submitted != posts:
            return f"not every post bounced ({bounced} of {posts} posts bounced, {same_host} took the same-host path)"
    elif same_host != posts or submitted:
        return f"not every post took the same-host path ({same_host} of {posts} posts did, {submitted} bounced)"
    return None


def block_order(sides, rnd):
    """The variants' blocks in round `rnd`: each round starts with the variant that ended the one
    before (A B | B A | A B with two, A B C | C A B | B C A with three), so every variant has
    as many blocks right after one of its own (a framework's steady state) as any other, and
    takes each place in the round equally often."""
    start = -rnd % len(sides)
    return sides[start:] + sides[:start]


def verdict(met):
    return "met" if met else "MISSED"


def split_blocks(single, after_own, per_block):
    """The requests of the blocks that came right after a block of the same variant (`steady`)
    and of the others (after another variant's block, or after a pause or an eviction), each in
    order."""
    steady, switched = [], []
    for i, own in enumerate(after_own):
        (steady if own else switched).extend(single[i * per_block:(i + 1) * per_block])
    return steady, switched


def pct(xs, p):
    """The `p`th percentile of `xs`, nearest rank (the 50th is the median): below 100 samples
    the 99th is their largest, which the printout says (`p99_label`)."""
    if p == 50:
        return statistics.median(xs)
    xs = sorted(xs)
    return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)]


def p99_label(n):
    """What the 99th percentile of `n` samples is."""
    return f"p99 (max of {n})" if n < 100 else f"p99 (of {n})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=512, help="blocks per layer (each K and V)")
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--per-request", type=int, default=32, help="blocks per request")
    ap.add_argument("--only", help="run only the cases whose name contains this (pull-one-way, push, ...)")
    ap.add_argument("--mem", choices=["DRAM", "VRAM"], default="DRAM")
    ap.add_argument("--peer-gpu", type=int, default=0,
                    help="with --mem VRAM: the target's GPU (1 on a two-GPU host: across NVLink)")
    ap.add_argument("--variants", help="comma-separated subset of " + ",".join(BACKENDS) +
                    " (alone, a variant's blocks follow each other with no other variant's in between)")
    ap.add_argument("--prep-each", action="store_true",
                    help="prepare each request (and the batch) right before its post, timed with it, "
                         "and release it after, as vLLM does; default: prepared once, posted every round")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="idle this long before each block (the target process still polls every 0.5 ms), "
                         "as a framework between batches")
    ap.add_argument("--evict-mib", type=int, default=0,
                    help="before each block, write through this many MiB in the initiator process (no "
                         "pause): caches the transfer's memory shares with it go cold, and nothing idles")
    ap.add_argument("--samples", action="store_true", help="print every request's time, in the order posted")
    ap.add_argument("--strict", action="store_true",
                    help="exit with status 1 when a goal is missed (a missed goal is always printed as MISSED)")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        pattern, metadata = args.child.split(":")
        child((pattern, metadata), args)
        return
    descs = args.layers * 2 * args.per_request
    print(f"KV cache: {args.layers} layers x [K|V] x {args.blocks} blocks of {args.block_bytes} B, "
          f"one registration per layer; {args.requests} requests of {args.per_request} random blocks "
          f"= {descs} descriptors ({descs * args.block_bytes / 2**20:.0f} MiB) each, batch "
          f"{args.requests * descs} descriptors; {args.mem}, two processes, {args.rounds} rounds "
          f"(interleaved blocks, each round starting with the variant that ended the one before), "
          f"status polled in a busy loop, "
          f"{'each request prepared right before its post and timed with it' if args.prep_each else 'requests prepared once'}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    missed = 0
    for pattern, metadata in CASES:
        name = f"{pattern}-{metadata}"
        if args.only and args.only not in name:
            continue
        cmd = [sys.executable, __file__, "--child", f"{pattern}:{metadata}"] + [
            a for k in ("rounds", "layers", "blocks", "block_bytes", "requests", "per_request", "mem",
                        "peer_gpu", "variants", "pause_ms", "evict_mib")
            if getattr(args, k) is not None
            for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))] + (["--prep-each"] if args.prep_each else [])
        res, why = run_child(cmd, 600)
        if res is None:
            raise SystemExit(f"case {name} failed: {why}")
        # No figure of a case whose bytes or paths are wrong.
        for b, x in res.items():
            if not x["exact"]:
                raise SystemExit(f"FAIL: {name}, {b}: not byte-exact: {json.dumps([x['mine'], x['theirs']])}")
            problem = path_problem(b, x["path"], x["posts"])
            if problem:
                raise SystemExit(f"FAIL: {name}, {b}: {problem}; engine's path: {json.dumps(x['path'])}")
        print(f"{name} ({'decode READs from prefill' if pattern == 'pull' else 'context WRITEs to generation'}"
              f", metadata {metadata}):")
        med = {}
        for b in res:
            x = res[b]
            med[b] = statistics.median(x["batch"])
            p50, p99 = pct(x["single"], 50), pct(x["single"], 99)
            # the first request of each block (posted after the target's last check, often to
            # an idle GPU or copy thread) against the rest: where the tail comes from
            first = statistics.median(x["single"][::args.requests])
            others = [t for i, t in enumerate(x["single"]) if i % args.requests]
            split = (f"  (first of a block {first * 1e3:.2f}, others {statistics.median(others) * 1e3:.2f})"
                     if others else "")
            if args.samples:
                print(f"  {b}: requests in order, ms: " + " ".join(f"{t * 1e3:.2f}" for t in x["single"]))
            steady, switched = split_blocks(x["single"], x.get("after_own", []), args.requests)
            print(f"  {b:14s} batch median {med[b] * 1e3:8.2f} ms   request p50 {p50 * 1e3:7.2f} ms  "
                  f"{p99_label(len(x['single']))} {p99 * 1e3:7.2f} ms  p99/p50 {p99 / p50:5.2f}{split}   "
                  f"byte-exact, {x['posts']} posts" + (", every one on its path" if b != "UCX" else ""))
            if steady and switched:
                print(f"  {'':14s} blocks right after one of its own ({len(steady) // args.requests}): p99/p50 "
                      f"{pct(steady, 99) / pct(steady, 50):.2f}, first of a block "
                      f"{statistics.median(steady[::args.requests]) * 1e3:.2f} ms;  after another variant's "
                      f"({len(switched) // args.requests}): first of a block "
                      f"{statistics.median(switched[::args.requests]) * 1e3:.2f} ms")
            if x.get("prep_single"):
                print(f"  {'':14s} of which prep: request median {statistics.median(x['prep_single']) * 1e3:.2f} ms, "
                      f"batch median {statistics.median(x['prep_batch']) * 1e3:.2f} ms")
        for name in ("BOUNCE", "BOUNCE bounced"):
            if name not in res:
                continue
            b = res[name]["single"]
            path = res[name]["path"]
            fetch = (f"   mailbox fetch mean {path['mailbox_fetch_us'] / path['mailbox_fetches']:.0f} us"
                     if path.get("mailbox_fetches") else "")
            ratio = ""
            if "UCX" in med:
                r = med[name] / med["UCX"]
                missed += r > BATCH_GOAL
                ratio = f"{name} / UCX batch = {r:.3f} (goal <= {BATCH_GOAL}: {verdict(r <= BATCH_GOAL)})   "
            tail = pct(b, 99) / pct(b, 50)
            missed += tail > TAIL_GOAL
            print(f"  {ratio or name + ': '}request p99/p50 = {tail:.2f} (goal <= {TAIL_GOAL}: "
                  f"{verdict(tail <= TAIL_GOAL)})   engine's path: {json.dumps(path)}{fetch}")
    if missed:
        print(f"{missed} goal(s) MISSED" + ("" if args.strict else " (--strict makes that an exit status of 1)"))
        if args.strict:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
