"""VRAM -> VRAM side by side on the GPU machine: BOUNCE vs plain UCX vs UCX's best configuration
vs hand staging vs one contiguous write of the same bytes, two processes (one process gets no
cuda_ipc), every variant in ONE run.

    python3 benches/gpu_compare.py [--shapes 16384x4096,4096x16384,1024x65536] [--iters 20] [--rounds 1]
                                   [--peer-gpu 0] [--inflight 64] [--op WRITE|READ]
                                   [--local-mem VRAM|DRAM] [--remote-mem VRAM|DRAM]
                                   [--variant-timeout 300] [--mps]

With --op READ the initiator reads the target's scattered pieces into its packed buffer (the
way vLLM's decode side pulls KV); hand staging is a WRITE recipe and is not run then.
With --local-mem DRAM or --remote-mem DRAM that side's buffer is host memory and its BOUNCE
engine has a host arena (a KV store of host memory against a GPU worker): the mixes bounce
between a host arena and a GPU arena; hand staging (a torch scatter) is not run then.

Variants (each in its own initiator process, against a target process running peer.py):
  BOUNCE            bounce_arena_mem=vram: between two processes of one host, the same-host path
                    (one kernel through CUDA IPC mappings of the peer's registrations)
  BOUNCE bounced    the same with bounce_cuda_ipc=false: the bounce path
  BOUNCE both bounced  bounce_arena_mem=both (a host and a GPU arena in each engine), the bounce
                    path: each side's memory picks its arena
  UCX               plain UCX, no progress thread
  UCX+SGL           NIXL_UCX_SGL_ENABLE=1
  UCX best          num_threads=4 + SGL
  hand staging      what an application can do by hand on plain UCX: sources are packed, so one
                    WRITE of all bytes into a staging area at the target with a notification,
                    a torch scatter there, a notification back
  contiguous        one WRITE of the same bytes (the link's ceiling)
A sample is the time from transfer() (or the staging WRITE) to DONE (or the answer). Also
--inflight N transfers of 1024 x 4 KiB posted at once: p50 / p99 of their completion times.
BENCH_TRACE=DIR records both BOUNCE processes' CUDA activity into DIR/*.json (torch.profiler).
--mps runs every process under an MPS daemon of its own (private pipe and log directories in a
temporary directory, quit at exit; no GPU setting is changed): two processes on one GPU then
share it instead of taking turns (about 130 us a switch), as two hosts' GPUs would.
"""
import argparse
import base64
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(os.path.dirname(HERE), "tests", "python")
sys.path.insert(0, PY)
sys.path.insert(0, HERE)
from child import run_child, to_ucx  # noqa: E402

VARIANTS = [
    # name, backend, params, env, mode
    ("BOUNCE", "BOUNCE", {"bounce_arena_mem": "vram"}, {}, "scattered"),
    ("BOUNCE bounced", "BOUNCE", {"bounce_arena_mem": "vram", "bounce_cuda_ipc": "false"}, {}, "scattered"),
    ("BOUNCE both bounced", "BOUNCE", {"bounce_arena_mem": "both", "bounce_cuda_ipc": "false"}, {}, "scattered"),
    ("UCX", "UCX", {}, {}, "scattered"),
    ("UCX+SGL", "UCX", {}, {"NIXL_UCX_SGL_ENABLE": "1"}, "scattered"),
    ("UCX best (4 thr+SGL)", "UCX", {"num_threads": "4"}, {"NIXL_UCX_SGL_ENABLE": "1"}, "scattered"),
    ("hand staging", "UCX", {}, {}, "staged"),
    ("contiguous", "UCX", {}, {}, "contiguous"),
]


def child(args):
    import nixlkit
    from conftest import Peer

    backend, params, mode = args.backend, json.loads(args.params), args.mode
    here, there = args.local_mem, args.remote_mem
    dev_there = args.peer_gpu if there == "VRAM" else 0

    def on(mem):  # a BOUNCE engine's arena follows its side's memory (`both` has each kind)
        if backend != "BOUNCE" or params.get("bounce_arena_mem") == "both":
            return params
        return {**params, "bounce_arena_mem": mem.lower()}
    n, size = args.n, args.size
    lay = nixlkit.Scattered(n, size, seed=5)
    total = n * size
    peer = Peer()
    # target buffer: [scattered destination slots | staging area]
    meta, raddr = peer.start(name="gtgt", backends=[backend], params=on(there), size=lay.dst_bytes + total,
                             seed=6, mem=there, dev=dev_there)
    ag = nixlkit.agent("gini", (backend,), on(here))
    src = nixlkit.VramBuf(nixlkit.pattern(7, total), 0) if here == "VRAM" else nixlkit.pattern(7, total)
    nixlkit.register(ag, src, backend)
    ag.add_remote_agent(meta)
    peer.call(op="load", meta=base64.b64encode(ag.get_agent_metadata()).decode())
    if backend == "BOUNCE":
        nixlkit.wait_ready(ag, 1)
    base = nixlkit.addr(src)
    if mode == "scattered":
        lo, re = lay.src_list(base, 0), lay.dst_list(raddr, dev_there)
    else:  # one descriptor: the staging area, or the same bytes contiguous
        lo, re = [(base, total, 0)], [(raddr + lay.dst_bytes, total, dev_there)]
    h = ag.initialize_xfer(args.op, ag.get_xfer_descs(lo, here), ag.get_xfer_descs(re, there),
                           "gtgt", b"staged" if mode == "staged" else b"", backends=[backend])
    posts = 0

    def post_once():
        nonlocal posts
        posts += 1
        if ag.transfer(h) == "ERR":
            raise SystemExit("transfer failed")
        while True:
            s = ag.check_xfer_state(h)
            if s == "DONE":
                break
            if s == "ERR":
                raise SystemExit("transfer failed")
        if mode == "staged":
            nixlkit.wait_notif(ag, "gtgt", b"scattered")

    if mode == "staged":
        peer.send(op="stage_serve", **{"from": "gini"}, n=n, size=size, seed=5,
                  stage_off=lay.dst_bytes, count=args.iters + 2)
    samples = []
    if backend == "BOUNCE":
        nixlkit.gpu_trace(f"initiator-{n}x{size}")
    for i in range(args.iters + 2):
        t0 = time.perf_counter()
        post_once()
        if i >= 2:
            samples.append(time.perf_counter() - t0)
    if mode == "staged":
        peer.recv()
    mismatch = check_bytes(args, peer, src, lay, mode, post_once)
    inflight = []
    if args.inflight and mode == "scattered":
        small = nixlkit.Scattered(1024, 4096, seed=8)
        hs = []
        for j in range(args.inflight):
            off = (j * small.src_bytes) % max(1, total - small.src_bytes + 1)
            lo = ag.get_xfer_descs(small.src_list(base + off, 0), here)
            re = ag.get_xfer_descs(small.dst_list(raddr, dev_there), there)
            hs.append(ag.initialize_xfer(args.op, lo, re, "gtgt", b"", backends=[backend]))
        for _ in range(3):
            t0 = time.perf_counter()
            for x in hs:
                posts += 1
                if ag.transfer(x) == "ERR":
                    raise SystemExit("transfer failed")
            left = set(range(len(hs)))
            while left:
                for j in list(left):
                    s = ag.check_xfer_state(hs[j])
                    if s == "DONE":
                        inflight.append(time.perf_counter() - t0)
                        left.discard(j)
                    elif s == "ERR":
                        raise SystemExit("transfer failed")
    stats = {}
    if backend == "BOUNCE":
        stats = {k: v for k, v in nixlkit.live_params(ag, backend).items() if k.startswith("stats.")}
    print("RESULT " + json.dumps({"samples": samples, "inflight": inflight, "stats": stats, "posts": posts,
                                  "mismatch": mismatch}), flush=True)
    peer.close()
    nixlkit.leave(0)


def check_bytes(args, peer, src, lay, mode, post_once):
    """Every byte the variant's transfer must have written, after one more post (untimed) into
    destinations refilled with other bytes, so the check proves that post wrote; and the bytes
    around the destinations (and the source side) untouched. Returns a mismatch's description,
    or None. Every timed post moved the same bytes, so the destinations alone could not tell a
    post that moved nothing from one that did."""
    import tempfile

    import numpy as np
    import nixlkit

    total = lay.src_bytes
    size_there = lay.dst_bytes + total
    host = (lambda b: b.host()) if isinstance(src, nixlkit.VramBuf) else (lambda b: b)

    def there():
        with tempfile.TemporaryDirectory(prefix="gpu-compare-") as tmp:
            path = os.path.join(tmp, "tgt.bin")
            peer.call(op="dump", path=path)
            return np.fromfile(path, dtype=np.uint8)

    def refill(buf, seed):
        if isinstance(buf, nixlkit.VramBuf):
            buf.fill(nixlkit.pattern(seed, buf.nbytes))
        else:
            buf[:] = nixlkit.pattern(seed, buf.nbytes)

    if args.op == "WRITE":
        peer.call(op="fill", seed=61)
        if mode == "staged":
            peer.send(op="stage_serve", **{"from": "gini"}, n=lay.n, size=lay.sizes[0], seed=5,
                      stage_off=lay.dst_bytes, count=1)
        post_once()
        if mode == "staged":
            peer.recv()
        sent = host(src)
        want = nixlkit.pattern(61, size_there)
        if mode in ("scattered", "staged"):
            want[:lay.dst_bytes] = lay.expected(sent, want[:lay.dst_bytes])
        if mode in ("contiguous", "staged"):
            want[lay.dst_bytes:] = sent
        got, where, src_want = there(), "the target's buffer", nixlkit.pattern(7, total)
        if not np.array_equal(host(src), src_want):
            return "the initiator's source buffer changed"
    else:  # READ: our buffer is the destination
        refill(src, 71)
        post_once()
        theirs = nixlkit.pattern(6, size_there)
        if mode == "scattered":
            want = np.concatenate([theirs[d:d + s] for d, s, _ in lay.dst_list(0)])
        else:
            want = theirs[lay.dst_bytes:].copy()
        got, where = host(src), "the initiator's buffer"
        if not np.array_equal(there(), theirs):
            return "the target's buffer changed"
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got != want) if got.shape == want.shape else [0]
        return f"{where}: {len(bad)} bytes differ, first at offset {int(bad[0])}"
    return None


def run(name, backend, params, env, mode, n, size, args):
    cmd = [sys.executable, __file__, "--child", "--backend", backend, "--params", json.dumps(params),
           "--mode", mode, "--n", str(n), "--size", str(size), "--iters", str(args.iters),
           "--peer-gpu", str(args.peer_gpu), "--inflight", str(args.inflight), "--op", args.op,
           "--local-mem", args.local_mem, "--remote-mem", args.remote_mem]
    res, why = run_child(cmd, args.variant_timeout, env)
    if res is None:
        print(f"  {name}: FAILED, {why}")
    return res


def path_problem(name, stats, op, mixed, posts):
    """Why a BOUNCE variant's counters (absolute: its engine is fresh) do not show every one of
    its `posts` on its path, each counted once, or None. The gate runs at prep: any pass-through
    or fallback means the request went to UCX."""
    c = {k[len("stats."):]: int(v) for k, v in stats.items()}
    went = to_ucx(c)
    if went:
        return f"it went to UCX ({went})"
    ok = c.get("bounce_read_ok" if op == "READ" else "bounce_ok", 0)
    same_host = c.get("ipc_ok", 0) + c.get("cma_ok", 0)
    if "bounced" in name:
        if same_host or ok != posts:
            return f"not every post bounced ({ok} of {posts}; ipc_ok={c.get('ipc_ok')}, cma_ok={c.get('cma_ok')})"
    elif mixed:
        # As shipped with host memory on one side: the same-host path or the bounce path, never UCX.
        if same_host + ok != posts:
            return f"not every post on a BOUNCE path ({same_host} same-host + {ok} bounced of {posts})"
    elif same_host != posts or c.get("bounce_xfers", 0):
        return (f"not every post on the same-host path ({same_host} of {posts}, "
                f"bounce_xfers={c.get('bounce_xfers')})")
    return None


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_mps():
    """Starts an MPS daemon that only this run's processes use (they inherit its pipe directory)
    and quits it at exit."""
    import atexit
    import shutil
    import subprocess
    import tempfile
    ctl = shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        sys.exit("--mps: nvidia-cuda-mps-control is not on PATH")
    top = tempfile.mkdtemp(prefix="bounce-mps-")
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(top, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(top, "log")}
    for d in dirs.values():
        os.makedirs(d)
    os.environ.update(dirs)
    subprocess.run([ctl, "-d"], check=True)

    def quit_daemon():
        # Not waited for: `quit` waits for every client to go, and this process is one (torch
        # made its context), so waiting here would hang (it did, session 28 call 5). Detached,
        # it ends the daemon once this process has exited.
        q = subprocess.Popen([ctl], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        q.stdin.write(b"quit\n")
        q.stdin.close()

    atexit.register(quit_daemon)
    return top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096,4096x16384,1024x65536")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of every variant (a fresh pair of processes each), the order rotated each round")
    ap.add_argument("--peer-gpu", type=int, default=0)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--only", help="run only variants whose name contains this (or one of these, comma-separated)")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--backend")
    ap.add_argument("--params", default="{}")
    ap.add_argument("--mode")
    ap.add_argument("--n", type=int)
    ap.add_argument("--size", type=int)
    ap.add_argument("--op", choices=["WRITE", "READ"], default="WRITE")
    ap.add_argument("--variant-timeout", type=int, default=300,
                    help="seconds one variant (its two processes) may take before it is killed")
    ap.add_argument("--local-mem", choices=["VRAM", "DRAM"], default="VRAM")
    ap.add_argument("--remote-mem", choices=["VRAM", "DRAM"], default="VRAM")
    ap.add_argument("--mps", action="store_true", help="run every process under an MPS daemon of its own")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    # Before any CUDA context of this process: it connects to the daemon when one exists.
    mps = start_mps() if args.mps else None
    import torch
    mixed = "DRAM" in (args.local_mem, args.remote_mem)
    print(f"{args.local_mem} (initiator) / {args.remote_mem} (target) {args.op}, two processes, "
          f"initiator GPU 0 -> target GPU {args.peer_gpu} "
          f"({torch.cuda.get_device_name(0)}), median of {args.iters} x {args.rounds} round(s), order rotated"
          + (f", under an MPS daemon of its own ({mps})" if mps else ""))
    failed = False
    for shape in args.shapes.split(","):
        n, size = (int(x) for x in shape.split("x"))
        mib = n * size / 2**20
        print(f"{n} x {size} B = {mib:.0f} MiB")
        chosen = [v for v in VARIANTS
                  if not (args.only and not any(o in v[0] for o in args.only.split(",")))
                  and not (v[4] == "staged" and (args.op == "READ" or mixed))]
        # Per variant: every round's samples, in-flight times and counters (each round's own,
        # from a fresh engine), or None once a round of it failed.
        runs = {v[0]: {"samples": [], "inflight": [], "stats": []} for v in chosen}
        for r in range(args.rounds):
            # The order rotated each round, so drift and the first context land on all alike.
            k = r % len(chosen)
            for name, backend, params, env, mode in chosen[k:] + chosen[:k]:
                if runs[name] is None:
                    continue
                res = run(name, backend, params, env, mode, n, size, args)
                if not res:
                    # Plain UCX failing a shape is a finding (it did, DRAM -> VRAM on one host); a
                    # BOUNCE variant failing fails the run.
                    failed |= backend == "BOUNCE"
                    runs[name] = None
                    continue
                problem = res["mismatch"]
                if not problem and backend == "BOUNCE":
                    problem = path_problem(name, res["stats"], args.op, mixed, res["posts"])
                if problem:
                    print(f"  {name}: FAILED, {problem}: no figure")
                    failed = True
                    runs[name] = None
                    continue
                for key in ("samples", "inflight"):
                    runs[name][key] += res[key]
                runs[name]["stats"].append(res["stats"])
        med = {}
        for name, *_ in chosen:
            got = runs[name]
            if got is None:
                continue
            med[name] = statistics.median(got["samples"])
            extra = ""
            if got["inflight"]:
                extra = (f"   {args.inflight} in flight: p50 {pct(got['inflight'], .5)*1e3:.2f} ms "
                         f"p99 {pct(got['inflight'], .99)*1e3:.2f} ms")
            if got["stats"] and got["stats"][0]:
                s = {k: sum(int(x.get(k, 0)) for x in got["stats"]) for k in got["stats"][0]}
                ok = s.get("stats.bounce_read_ok") if args.op == "READ" else s.get("stats.bounce_ok")
                extra += (f"   ipc_ok={s.get('stats.ipc_ok')} chunks={s.get('stats.bounce_chunks')} ok={ok} "
                          f"region_plans={s.get('stats.region_plans_sent')}")
            print(f"  {name:22s} {med[name]*1e3:9.3f} ms  {mib / 1024 / med[name]:8.1f} GiB/s{extra}")
        if "BOUNCE" in med:
            b = med["BOUNCE"]
            for other in ("BOUNCE bounced", "UCX", "UCX best (4 thr+SGL)", "hand staging", "contiguous"):
                if other in med:
                    print(f"    BOUNCE / {other:22s} = {b / med[other]:.3f}")
        if "BOUNCE bounced" in med and "hand staging" in med:
            print(f"    BOUNCE bounced / hand staging    = {med['BOUNCE bounced'] / med['hand staging']:.3f}")
    if failed:
        raise SystemExit("FAIL: a BOUNCE variant failed or took another path (above)")


if __name__ == "__main__":
    main()
