"""Side-by-side transfer benchmark: BOUNCE vs plain UCX (with and without UCX's SGL put) vs one
contiguous write of the same bytes, two processes, DRAM, measured in ONE run on one machine.

    .venv/bin/python benches/compare.py [--descs 16384] [--size 4096] [--iters 15]

Each variant runs in its own initiator process (UCX reads NIXL_UCX_SGL_ENABLE at engine
creation) against a target process (tests/python/peer.py). A sample is the time from
transfer() to DONE for a re-posted, already prepared request. The variants run in `--rounds`
rounds, the order rotated each round, so a slow spell of the machine lands on all of them; the
table reports the median over every round's samples and the ratios the issues ask for.

Before any ratio is printed, each variant must have taken the path its name says, by its
initiator engine's counters (every post through the same-host path, the bounce path, or passed
through to UCX; an environment variable can override a variant's settings, and this catches
it), and the target's whole buffer must hold exactly the bytes written and nothing else changed.
Otherwise the run fails with the reason and no ratio. Each ratio with a goal says whether
the goal was met or MISSED (`--strict`: exit status 1 when one is missed).
"""
import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(os.path.dirname(HERE), "tests", "python")
sys.path.insert(0, PY)
sys.path.insert(0, HERE)
from child import run_child  # noqa: E402


def initiator(backend, descs, size, iters, contiguous, params, poll_sleep_us=0, scatter_src=False):
    import numpy as np
    import nixlkit
    from conftest import Peer

    total = descs * size
    slot_spread = 2
    peer = Peer()
    meta, raddr = peer.start(name="bench-tgt", backends=[backend], params=params,
                             size=total * (1 if contiguous else slot_spread), seed=7)
    ag = nixlkit.agent("bench-ini", (backend,), params)
    src = nixlkit.pattern(8, total * (2 if scatter_src else 1))
    nixlkit.register(ag, src, backend)
    ag.add_remote_agent(meta)
    peer.call(op="load", meta=base64.b64encode(ag.get_agent_metadata()).decode())
    if contiguous:
        lo = [(src.ctypes.data, total, 0)]
        re = [(raddr, total, 0)]
    else:
        slots = np.random.default_rng(9).permutation(descs * slot_spread)[:descs]
        if scatter_src:  # sources scattered too: every chunk must be gathered
            src_slots = np.random.default_rng(10).permutation(descs * 2)[:descs]
            lo = [(src.ctypes.data + int(k) * size, size, 0) for k in src_slots]
        else:  # sources packed: chunks are written straight from them (no gather copy)
            lo = [(src.ctypes.data + i * size, size, 0) for i in range(descs)]
        re = [(raddr + int(k) * size, size, 0) for k in slots]
    counters = (lambda: {k: int(v) for k, v in nixlkit.live_params(ag, backend).items() if k.startswith("stats.")}) \
        if backend == "BOUNCE" else dict
    before = counters()
    h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(lo, "DRAM"), ag.get_xfer_descs(re, "DRAM"),
                           "bench-tgt", b"", backends=[backend])
    samples = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        if ag.transfer(h) == "ERR":
            raise SystemExit("transfer failed")
        while True:
            s = ag.check_xfer_state(h)
            if s == "DONE":
                break
            if s == "ERR":
                raise SystemExit("transfer failed")
            if poll_sleep_us:
                time.sleep(poll_sleep_us * 1e-6)
        if i >= 2:  # two warm-ups
            samples.append(time.perf_counter() - t0)
    after = counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    # The target's whole buffer: what every post wrote (the same bytes each time) over its
    # initial pattern, and nothing else.
    expected = nixlkit.pattern(7, total * (1 if contiguous else slot_spread))
    for (s_addr, n, _), (r_addr, _, _) in zip(lo, re):
        expected[r_addr - raddr:r_addr - raddr + n] = src[s_addr - src.ctypes.data:s_addr - src.ctypes.data + n]
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        path = os.path.join(tmp, "tgt.bin")
        peer.call(op="dump", path=path)
        got = np.fromfile(path, dtype=np.uint8)
    exact = got.shape == expected.shape and bool(np.array_equal(got, expected))
    print("RESULT " + json.dumps({"samples": samples, "posts": iters + 2, "stats": delta, "exact": exact}),
          flush=True)
    peer.close()
    nixlkit.leave(0)


VARIANTS = [
    # name, backend, contiguous, extra env, path. "BOUNCE scattered" is the plugin as shipped:
    # between two processes of one host that is the same-host path (CMA); "BOUNCE bounced" turns
    # it off, as between two hosts. "BOUNCE 1 contiguous" is the pass-through (a large transfer
    # takes the same-host path too, bounce_cma_large_bytes: off there); "BOUNCE 1 contig CMA" is
    # the plugin as shipped.
    ("BOUNCE scattered", "BOUNCE", False, {}, "cma"),
    ("BOUNCE bounced", "BOUNCE", False, {"NIXL_BOUNCE_CMA": "0"}, "bounce"),
    ("UCX scattered", "UCX", False, {}, None),
    ("UCX+SGL scattered", "UCX", False, {"NIXL_UCX_SGL_ENABLE": "1"}, None),
    ("UCX 1 contiguous", "UCX", True, {}, None),
    ("BOUNCE 1 contiguous", "BOUNCE", True, {"NIXL_BOUNCE_CMA_LARGE_BYTES": "0"}, "pass"),
    ("BOUNCE 1 contig CMA", "BOUNCE", True, {}, "cma-large"),
]

# Per path: the counter that must count every post, and those that must not move.
PATHS = {
    "cma": ("stats.cma_ok", ("stats.bounce_xfers", "stats.passthrough_xfers")),
    "bounce": ("stats.bounce_ok", ("stats.cma_xfers", "stats.passthrough_xfers")),
    # The gate runs at prep: one prepared request passed through, posted `posts` times.
    "pass": ("stats.passthrough_xfers", ("stats.bounce_xfers", "stats.cma_xfers")),
}


def cma_large_bytes():
    """bounce_cma_large_bytes as the engine reads it: a contiguous transfer of at least this
    takes the same-host path, a smaller one passes through to UCX."""
    import tomllib
    raw = os.environ.get("NIXL_BOUNCE_CMA_LARGE_BYTES")
    if raw is None:
        with open(os.path.join(os.path.dirname(HERE), "plugin-manifest", "manifest.toml"), "rb") as f:
            raw = next(o["default"] for o in tomllib.load(f)["option"] if o["name"] == "bounce_cma_large_bytes")
    return parse_bytes(raw)


def parse_bytes(text):
    """A byte count as the engine reads one (proto/src/config.rs `parse_bytes`): digits and an
    optional binary suffix K/KB/KiB, M/MB/MiB, G/GB/GiB in any case, blanks allowed before it.
    A value the engine would not take falls back to the default there; here it is an error."""
    t = text.strip()
    digits = len(t) - len(t.lstrip("0123456789"))
    shift = {"": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20, "g": 30, "gb": 30,
             "gib": 30}.get(t[digits:].strip().lower())
    if not digits or shift is None:
        raise SystemExit(f"FAIL: cannot tell the path of 'BOUNCE 1 contig CMA': bounce_cma_large_bytes={text!r} "
                         f"is not a byte count")
    return int(t[:digits]) << shift


def path_problem(name, path, res, total):
    """Why variant `name`'s result does not show its path (None when it does)."""
    if path == "cma-large":
        large = cma_large_bytes()
        path = "cma" if large and total >= large else "pass"
    if not res["exact"]:
        return f"{name}: the target's buffer is not what the writes should have left"
    if path is None:
        return None
    d = res["stats"]
    counted, still = PATHS[path]
    want = 1 if path == "pass" else res["posts"]
    moved = {k: d.get(k, 0) for k in still if d.get(k, 0)}
    if d.get(counted, 0) != want or moved:
        return (f"{name}: expected every post on the {path} path ({counted} +{want}), got {counted} "
                f"+{d.get(counted, 0)}, {moved or 'nothing else'} (an environment variable overriding "
                f"the variant's settings?)")
    return None


def run_variant(backend, contiguous, env, args):
    cmd = [sys.executable, __file__, "--child", backend, "--descs", str(args.descs), "--size",
           str(args.size), "--iters", str(args.iters), "--poll-sleep-us", str(args.poll_sleep_us)] \
        + (["--contiguous"] if contiguous else []) + (["--scatter-src"] if args.scatter_src else [])
    res, why = run_child(cmd, 600, env)
    if res is None:
        raise SystemExit(f"FAIL: variant {backend} failed: {why}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--descs", type=int, default=16384)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5, help="samples per variant and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every variant, the order rotated")
    ap.add_argument("--child")
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--poll-sleep-us", type=int, default=0,
                    help="sleep between status polls (0: spin, the strictest setting for BOUNCE)")
    ap.add_argument("--scatter-src", action="store_true",
                    help="scatter the source descriptors too (default: packed sources)")
    ap.add_argument("--only", help="run only variants whose name contains this (no ratios)")
    ap.add_argument("--strict", action="store_true",
                    help="exit with status 1 when a goal is missed (a missed goal is always printed as MISSED)")
    args = ap.parse_args()
    if args.child:
        initiator(args.child, args.descs, args.size, args.iters, args.contiguous, {}, args.poll_sleep_us, args.scatter_src)
        return
    mib = args.descs * args.size / 2**20
    print(f"WRITE of {args.descs} x {args.size} B = {mib:.0f} MiB, DRAM, two processes, "
          f"{args.rounds} rounds of {args.iters} samples each (median of all), status polled "
          + (f"every {args.poll_sleep_us} us" if args.poll_sleep_us else "in a busy loop")
          + (", sources scattered too" if args.scatter_src else ", sources packed"))
    chosen = [v for v in VARIANTS if not args.only or args.only in v[0]]
    if not chosen:
        raise SystemExit(f"no variant's name contains {args.only!r}: {[v[0] for v in VARIANTS]}")
    samples = {v[0]: [] for v in chosen}
    totals = {v[0]: {} for v in chosen}  # each variant's counters, summed over its rounds
    for r in range(args.rounds):
        k = r % len(chosen)
        for name, backend, contiguous, env, path in chosen[k:] + chosen[:k]:
            res = run_variant(backend, contiguous, env, args)
            problem = path_problem(name, path, res, args.descs * args.size)
            if problem:
                raise SystemExit("FAIL: " + problem)
            samples[name] += res["samples"]
            for k, v in res["stats"].items():
                totals[name][k] = totals[name].get(k, 0) + v
    med = {}
    for name, *_ in chosen:
        med[name] = statistics.median(samples[name])
        q = sorted(samples[name])
        st = totals[name]
        print(f"  {name:22s} median {med[name]*1e3:8.2f} ms   "
              f"min {q[0]*1e3:8.2f}  max {q[-1]*1e3:8.2f}   {mib / med[name] / 1024:6.2f} GiB/s"
              + (f"   chunks={st.get('stats.bounce_chunks', 0)} cma={st.get('stats.cma_ok', 0)}"
                 f" bounced={st.get('stats.bounce_ok', 0)} passed={st.get('stats.passthrough_xfers', 0)}"
                 if st else ""))
    print("  (every variant on its path by its counters, summed over its rounds; the target's buffer byte-exact)")
    print("  BOUNCE scattered is the plugin as shipped: between two processes of one host it copies by CMA\n"
          "  (the same-host path); BOUNCE bounced is the bounce path, what two hosts get.")
    if args.only:
        return
    b = med["BOUNCE scattered"]
    missed = 0

    def ratio(label, value, goal, note=""):
        nonlocal missed
        missed += value > goal
        print(f"  {label:34s} = {value:.3f}   (goal <= {goal}: {'met' if value <= goal else 'MISSED'}){note}")

    print("ratios:")
    ratio("BOUNCE / UCX scattered", b / med["UCX scattered"], 0.4)
    ratio("BOUNCE / UCX+SGL scattered", b / med["UCX+SGL scattered"], 0.4)
    ratio("BOUNCE bounced / UCX scattered", med["BOUNCE bounced"] / med["UCX scattered"], 0.4)
    ratio("BOUNCE / UCX 1 contiguous", b / med["UCX 1 contiguous"], 2.5)
    ratio("BOUNCE 1 contig / UCX 1 contig", med["BOUNCE 1 contiguous"] / med["UCX 1 contiguous"], 1.1,
          "   (pass-through overhead)")
    print(f"  {'BOUNCE 1 contig CMA / UCX 1 contig':34s} = "
          f"{med['BOUNCE 1 contig CMA'] / med['UCX 1 contiguous']:.3f}   (as shipped: the same-host path from "
          f"bounce_cma_large_bytes up; no goal)")
    if missed:
        print(f"{missed} goal(s) MISSED" + ("" if args.strict else " (--strict makes that an exit status of 1)"))
        if args.strict:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
