"""Where a GPU request's time goes, from a CUDA trace: each of BOUNCE's kernels, how long it ran
on the GPU, how long after its launch call it started, and what the GPU did just before it.

    python3 benches/trace_kernels.py DIR/kv-initiator.json [--prefix bounce_]

Reads a Chrome trace written by `nixlkit.gpu_trace` (torch.profiler over CUPTI: `BENCH_TRACE=DIR`
with `benches/kv_patterns.py --mem VRAM` or `benches/gpu_compare.py`). A kernel whose name
starts with `--prefix` is ours; any other GPU activity (UCX's cuda_ipc copies, other kernels)
is "other". Kernels are grouped by what came before them on the GPU: the first of ours after
other activity (a UCX block of the benchmark) against ours after ours. For each group: the
kernel's time on the GPU, and launch to start (the launch call's start on the CPU to the
kernel's start on the GPU; matched by CUPTI's correlation id, where the trace has the launch).
"""
import argparse
import json
import statistics


def load(path):
    with open(path) as f:
        t = json.load(f)
    return t["traceEvents"] if isinstance(t, dict) else t


def summary(events, prefix):
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda e: e["ts"])
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launches[c] = e["ts"]
    groups = {"after other GPU work": [], "after ours": []}
    prev = None
    for e in gpu:
        ours = e.get("cat") == "kernel" and e.get("name", "").startswith(prefix)
        if ours:
            c = (e.get("args") or {}).get("correlation")
            lag = e["ts"] - launches[c] if c in launches else None
            idle = e["ts"] - (prev["ts"] + prev["dur"]) if prev else None
            key = "after ours" if prev is not None and prev.get("_ours") else "after other GPU work"
            groups[key].append((e["dur"], lag, idle))
        e["_ours"] = ours
        prev = e
    return groups


def fmt(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"median {statistics.median(xs):7.1f} us  (min {min(xs):.1f}, max {max(xs):.1f}, n={len(xs)})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--prefix", default="bounce_")
    args = ap.parse_args()
    groups = summary(load(args.trace), args.prefix)
    for name, rows in groups.items():
        print(f"our kernels {name}: {len(rows)}")
        print(f"  on the GPU         {fmt([r[0] for r in rows])}")
        print(f"  launch to start    {fmt([r[1] for r in rows])}")
        print(f"  GPU idle before    {fmt([r[2] for r in rows])}")


if __name__ == "__main__":
    main()
