"""`python -m benches.sweep [--preset quick|full|gate|tiny] [overrides]` from the repo root.

Sweeps descriptor size x count x requests in flight x operation x memory x application shape
for every backend variant (BOUNCE, UCX, UCX+SGL, UCX-MT), two processes per variant, the
variants interleaved point by point. Writes table.txt, sweep.csv, summary.txt and PNG plots to
bench-results/<UTC timestamp>/ (or --out) and prints the table and the summary.
"""
import argparse
import datetime
import importlib.util
import os
import sys
import time

from . import driver, plan, plots, report


def csv_of(conv):
    return lambda text: [conv(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benches.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(plan.PRESETS), default="quick",
                    help="starting point for every dimension (default quick); flags override it")
    ap.add_argument("--sizes", type=csv_of(plan.parse_size), help="descriptor sizes, e.g. 512,4K,1M")
    ap.add_argument("--counts", type=csv_of(int), help="descriptors per transfer, e.g. 256,16384")
    ap.add_argument("--concurrency", type=csv_of(int), help="requests in flight, e.g. 1,8,64,128")
    ap.add_argument("--ops", type=csv_of(str.upper), help="WRITE,READ")
    ap.add_argument("--mems", type=csv_of(str.upper), help="DRAM,VRAM (VRAM needs torch with CUDA)")
    ap.add_argument("--shapes", type=csv_of(str), help=", ".join(f"{k}: {v.doc}" for k, v in plan.SHAPES.items()))
    ap.add_argument("--backends", nargs="+", metavar="SPEC",
                    help="BOUNCE UCX UCX+SGL UCX-MT; BASE:key=value,... adds backend params "
                         "(e.g. BOUNCE:bounce_check_wait_us=0). The ratio column divides by UCX.")
    ap.add_argument("--ucx-threads", type=int, default=4, help="num_threads of UCX-MT (default 4)")
    ap.add_argument("--shipped-gate", action="store_true",
                    help="run BOUNCE with its default gate (default: gate wide open, so every point "
                         "measures the bounce path and the crossover can be read)")
    ap.add_argument("--src", choices=["scattered", "packed"], default="scattered",
                    help="source layout (destinations are always scattered; default scattered)")
    ap.add_argument("--notif-sleep-us", type=int, default=0,
                    help="mt shapes: the notification thread sleeps this long between calls "
                         "(default 0: it spins, as a naive application does)")
    ap.add_argument("--warmup", type=int, help="completions dropped before sampling")
    ap.add_argument("--samples", type=int, help="minimum samples per measurement")
    ap.add_argument("--max-samples", type=int)
    ap.add_argument("--min-time", type=float, help="minimum seconds sampled per measurement")
    ap.add_argument("--max-time", type=float, help="maximum seconds sampled per measurement")
    ap.add_argument("--max-request-bytes", type=plan.parse_size, default=plan.parse_size("64M"),
                    help="skip points where one transfer moves more (default 64M)")
    ap.add_argument("--max-buffer", type=plan.parse_size, default=plan.parse_size("256M"),
                    help="registered bytes per process and memory kind (default 256M); requests "
                         "in flight share regions beyond it")
    ap.add_argument("--win-below", type=float, default=0.9,
                    help="BOUNCE 'wins' a point when its p50 is below this fraction of UCX's (default 0.9)")
    ap.add_argument("--out", help="results folder (default bench-results/<UTC timestamp>)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    preset = plan.PRESETS[args.preset]
    for key, attr in (("sizes", "sizes"), ("counts", "counts"), ("concs", "concurrency"), ("ops", "ops"),
                      ("mems", "mems"), ("shapes", "shapes"), ("backends", "backends")):
        if getattr(args, attr) is None:
            setattr(args, attr, list(preset[key]))
    b = preset["budget"]
    args.budget = plan.Budget(
        warmup=b.warmup if args.warmup is None else args.warmup,
        min_samples=b.min_samples if args.samples is None else args.samples,
        max_samples=b.max_samples if args.max_samples is None else args.max_samples,
        min_time=b.min_time if args.min_time is None else args.min_time,
        max_time=b.max_time if args.max_time is None else args.max_time,
        floor=min(b.floor, b.min_samples if args.samples is None else args.samples))
    for name, allowed in (("ops", plan.OPS), ("mems", plan.MEMS), ("shapes", plan.SHAPES)):
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}; choose from {list(allowed)}")
    return args


def cuda_present():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.cuda.is_available()


def machine():
    load = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {load[0]:.1f} at start"


def main(argv=None):
    args = parse_args(argv)
    if "VRAM" in args.mems and not cuda_present():
        print("sweep: no torch with CUDA here: VRAM skipped", file=sys.stderr)
        args.mems = [m for m in args.mems if m != "VRAM"]
        if not args.mems:
            sys.exit("sweep: no memory kind left to sweep")
    variants = [plan.parse_variant(s, args.ucx_threads, args.shipped_gate) for s in args.backends]
    if len({v.label for v in variants}) != len(variants):
        sys.exit("sweep: a backend is listed twice")
    # Inherited gate variables override the open gate in every worker: say so, loudly.
    inherited = plan.inherited_gate_env(os.environ)
    gate_warning = None
    if inherited and not args.shipped_gate and any(v.is_bounce for v in variants):
        gate_warning = plan.gate_env_warning(inherited)
        print(gate_warning, file=sys.stderr, flush=True)
    points, skipped = plan.points(args.shapes, args.ops, args.mems, args.sizes, args.counts, args.concurrency,
                                  args.max_request_bytes)
    if not points:
        sys.exit("sweep: nothing to run (every point is over --max-request-bytes)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    outdir = os.path.abspath(args.out or os.path.join("bench-results", stamp))
    os.makedirs(outdir, exist_ok=True)
    where = machine()
    print(f"sweep: {len(points)} points x {len(variants)} backends ({', '.join(v.label for v in variants)}), "
          f"sources {args.src}, destinations scattered; {where}"
          + (f"; {len(skipped)} points over {report.fmt_size(args.max_request_bytes)} per transfer skipped"
             if skipped else ""), flush=True)
    t0 = time.monotonic()
    rows = driver.run(points, variants, args.budget, args.src, outdir, args.max_buffer,
                      progress=not args.no_progress, notif_sleep_us=args.notif_sleep_us)
    report.add_ratios(rows)
    report.write_csv(rows, os.path.join(outdir, "sweep.csv"))
    text = report.table(rows, args.budget.min_samples)
    with open(os.path.join(outdir, "table.txt"), "w") as f:
        f.write(text)
    print(text)
    figures = plots.all_plots(rows, outdir, args.win_below)
    meta = dict(machine=where + f", {os.getloadavg()[0]:.1f} at end", elapsed=time.monotonic() - t0,
                outdir=outdir, gate_warning=gate_warning)
    summ = report.summary(rows, meta, args.win_below)
    summ += "Plots:\n" + "".join(f"  {p}\n" for p in figures)
    with open(os.path.join(outdir, "summary.txt"), "w") as f:
        f.write(summ)
    print(summ)
    failed = [r for r in rows if r["check"] != "ok"]
    if failed:
        sys.exit(f"sweep: FAILED: {len(failed)} of {len(rows)} rows failed their data or notification check "
                 "(see CHECK FAILED in the summary)")


if __name__ == "__main__":
    main()
