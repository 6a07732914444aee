"""From measurements to what a user reads: one row per (point, backend) with nixlbench's
columns, the ratio to UCX, the path BOUNCE's counters say each transfer took; the table, the
CSV, the gate derived from the crossover, and the closing summary."""
import csv
import statistics

import numpy as np

REFERENCE = "UCX"  # the ratio column divides by this variant's median at the same point
POINT_KEYS = ("shape", "op", "mem", "block_size", "batch_size", "concurrency")
COLUMNS = POINT_KEYS + ("backend", "samples", "avg_us", "p50_us", "p99_us", "min_us", "max_us",
                        "gbps", "ratio_p50_vs_ucx", "path", "check", "bounce_xfers", "bounce_chunks",
                        "chunks_direct", "initiator_cpu_s", "target_cpu_s", "completed", "target_notifs",
                        "notif_calls", "wall_s")
# Below this many samples a 99th percentile is (nearly) the slowest sample: the table, the
# summary and the plots then show the slowest sample and say so ("max of n").
P99_MIN_SAMPLES = 100
FALLBACKS = ("op", "mem", "count", "size", "peer", "disabled", "unproven")
SAME_HOST = ("cma", "ipc")  # the same-host paths' labels: host memory (CMA), GPU memory (CUDA IPC)


def fmt_size(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n}B"


def path(stats_before, stats_after):
    """Which path the measurement's transfers took, from BOUNCE's live counters: `bounce`,
    `cma` or `ipc` (the same-host paths, `stats.cma_xfers` / `stats.ipc_xfers`), `ucx:<gate
    reason>` (a fallback, counted when the request was prepared; `unproven`: a destination's
    metadata carried no BOUNCE key), `mixed:<a>+<b>` when the transfers took several, or `?`
    when no counter moved."""
    if not stats_after:
        return "ucx"
    d = {k[6:]: int(v) - int(stats_before.get(k, 0)) for k, v in stats_after.items() if k.startswith("stats.")}
    if d.get("bounce_failed", 0):
        return "bounce-failed"
    taken = [p for p, key in (("bounce", "bounce_xfers"), ("cma", "cma_xfers"), ("ipc", "ipc_xfers"))
             if d.get(key, 0)]
    if d.get("passthrough_xfers", 0):
        why = [r for r in FALLBACKS if d.get(f"fallback_{r}", 0)]
        taken.append("ucx:" + ("+".join(why) or "?"))
    if not taken:
        return "?"
    return taken[0] if len(taken) == 1 else "mixed:" + "+".join(taken)


def paths_in(label):
    """The paths a `path()` label names (`mixed:bounce+ucx:count` -> bounce, ucx:count)."""
    return label[len("mixed:"):].split("+") if label.startswith("mixed:") else [label]


def took_bounce(label):
    return any(p.startswith("bounce") for p in paths_in(label))


def why_nothing_bounced(labels):
    """Why no transfer of a memory kind took the bounce path, from its rows' path labels."""
    parts = {p for label in labels for p in paths_in(label)}
    reasons = {r for p in parts if p.startswith("ucx:") for r in p[4:].split("+")}
    why = []
    if parts & set(SAME_HOST):
        why.append("the same-host path took them (it is tried before the bounce path between processes "
                   "of one host: sweep with NIXL_BOUNCE_CMA=0 / NIXL_BOUNCE_CUDA_IPC=0, or between hosts)")
    if "mem" in reasons:
        why.append("the engines' arena is not of this memory kind (sweep it on its own, --mems VRAM)")
    if "unproven" in reasons:
        why.append("a destination's metadata carried no BOUNCE key (not published by a BOUNCE engine)")
    if reasons & {"count", "size"}:
        why.append("the gate's thresholds kept them on UCX (the gate under test must admit the grid)")
    if reasons & {"peer", "disabled"}:
        why.append("bounce was off or the peer could not bounce")
    if not why:
        why.append("BOUNCE's counters did not say which path they took")
    return "; ".join(why)


def delta(res, key):
    after, before = res["stats_after"], res["stats_before"]
    return int(after.get(f"stats.{key}", 0)) - int(before.get(f"stats.{key}", 0)) if after else 0


def notif_problem(notifying, completed, received):
    """For a shape whose every transfer carries a notification (`notifying`): what is wrong when
    the target did not receive exactly one per completed transfer, else None."""
    if not notifying or received == completed:
        return None
    if received < completed:
        return (f"notifications: the target received {received} for {completed} completed transfers "
                f"({completed - received} missing)")
    return f"notifications: the target received {received} for {completed} completed transfers ({received - completed} extra)"


def tail(r):
    """(value in us, label) of a row's tail latency: its p99 from P99_MIN_SAMPLES samples or
    more, else its slowest sample, labelled as such."""
    if r["samples"] >= P99_MIN_SAMPLES:
        return r["p99_us"], "p99"
    return r["max_us"], f"max of {r['samples']}"


def row(point, variant, res):
    lat = np.array(res["lat"]) * 1e6
    problems = res.get("problems", [])
    return dict(shape=point.shape, op=point.op, mem=point.mem, block_size=point.size,
                batch_size=point.count, concurrency=point.conc, backend=variant.label,
                samples=len(lat), avg_us=float(lat.mean()), p50_us=float(np.percentile(lat, 50)),
                p99_us=float(np.percentile(lat, 99)), min_us=float(lat.min()), max_us=float(lat.max()),
                gbps=res["bytes"] / res["loop_wall"] / 1e9,
                ratio_p50_vs_ucx=None, path=path(res["stats_before"], res["stats_after"]),
                check="FAIL: " + "; ".join(problems) if problems else "ok",
                bounce_xfers=delta(res, "bounce_xfers"), bounce_chunks=delta(res, "bounce_chunks"),
                chunks_direct=delta(res, "chunks_direct"), initiator_cpu_s=res["cpu"],
                target_cpu_s=res["target_cpu"], completed=res.get("completed"), target_notifs=res["target_notifs"],
                notif_calls=res["notif_calls"], wall_s=res["loop_wall"])


def point_of(r):
    return tuple(r[k] for k in POINT_KEYS)


def add_ratios(rows):
    """ratio_p50_vs_ucx = p50 / (the UCX variant's p50 at the same point), rounded as printed."""
    ref = {point_of(r): r["p50_us"] for r in rows if r["backend"] == REFERENCE}
    for r in rows:
        base = ref.get(point_of(r))
        r["ratio_p50_vs_ucx"] = round(r["p50_us"] / base, 3) if base else None
    return rows


def write_csv(rows, path_):
    with open(path_, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()})


HEADER = ("Block Size (B)", "Batch Size", "In flight", "Backend", "Avg Lat. (us)", "P50 Lat. (us)",
          "P99 Lat. (us)", "Samples", "B/W (GB/Sec)", "vs UCX (p50)", "Path", "Check")


def table(rows, min_samples=None):
    """nixlbench's columns, one section per (shape, operation, memory), plus the sample count
    beside P99 (`max:X` there: fewer than P99_MIN_SAMPLES samples, X is the slowest; `n!`: fewer
    than `min_samples`, the budget's minimum) and the data/notification check (`ok` or `FAIL`)."""
    out = []
    widths = [max(len(h), 10) for h in HEADER]
    widths[3] = max([len(HEADER[3])] + [len(r["backend"]) for r in rows])
    widths[7] = len(HEADER[7])
    widths[10] = max([len(HEADER[10])] + [len(r["path"]) for r in rows])
    widths[11] = len(HEADER[11])
    sections = list(dict.fromkeys((r["shape"], r["op"], r["mem"]) for r in rows))
    short = few = failed = False
    for shape, op, mem in sections:
        out.append(f"\n== {op} {mem}, application shape: {shape} ==")
        out.append("  ".join(h.rjust(w) for h, w in zip(HEADER, widths)))
        sel = [r for r in rows if (r["shape"], r["op"], r["mem"]) == (shape, op, mem)]
        order = {b: i for i, b in enumerate(dict.fromkeys(r["backend"] for r in rows))}
        sel.sort(key=lambda r: (r["concurrency"], r["block_size"], r["batch_size"], order[r["backend"]]))
        for r in sel:
            ratio = "" if r["ratio_p50_vs_ucx"] is None else f"{r['ratio_p50_vs_ucx']:.3f}"
            value, label = tail(r)
            p99 = f"{value:.1f}" if label == "p99" else f"max:{value:.1f}"
            few |= label != "p99"
            n = str(r["samples"])
            if min_samples and r["samples"] < min_samples:
                n += "!"
                short = True
            ok = r.get("check", "ok") == "ok"
            failed |= not ok
            cells = (str(r["block_size"]), str(r["batch_size"]), str(r["concurrency"]), r["backend"],
                     f"{r['avg_us']:.1f}", f"{r['p50_us']:.1f}", p99, n, f"{r['gbps']:.3f}",
                     ratio, r["path"], "ok" if ok else "FAIL")
            out.append("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    notes = []
    if few:
        notes.append(f"max:X under P99: fewer than {P99_MIN_SAMPLES} samples, too few for a 99th percentile; "
                     "X is the slowest of the row's samples (the max of n).")
    if short:
        notes.append(f"n! under Samples: fewer than the budget's minimum of {min_samples} samples "
                     "(the measurement's time cap stopped it).")
    if failed:
        notes.append("FAIL under Check: the destination's bytes or the target's notifications were wrong; "
                     "the row's figures measure a broken transfer (its reason is in the summary and sweep.csv).")
    if notes:
        out.append("")
        out.extend(notes)
    return "\n".join(out) + "\n"


def derive_gate(wins):
    """The gate from a crossover: `wins` maps (size, count) -> bool (bounce faster). Returns
    (min_count, max_size): of the gates "count >= min_count and average size <= max_size"
    whose measured points are all wins, the one covering the most measured points (ties: the
    larger size). Every size up to max_size must have been measured at some count the gate
    admits: a gate never extends to sizes the sweep skipped there. None when no gate holds a
    single point."""
    sizes = sorted({s for s, _ in wins})
    counts = sorted({c for _, c in wins})
    best, best_n = None, 0
    for max_size in sizes:
        for c in counts:
            region = [(s, k) for s in sizes for k in counts if s <= max_size and k >= c and (s, k) in wins]
            seen = {s for s, _ in region}
            if any(s not in seen for s in sizes if s <= max_size):
                continue  # no evidence for some size inside this gate
            if all(wins[p] for p in region):
                if len(region) >= best_n:
                    best, best_n = (c, max_size), len(region)
                break  # a larger c only covers fewer points at this size
    return best


def _bounce_rows(rows, shape, mem, variant):
    return [r for r in rows if r["shape"] == shape and r["op"] == "WRITE" and r["mem"] == mem
            and r["backend"] == variant and r["ratio_p50_vs_ucx"] is not None]


def _measured(r, ref_ok):
    """Whether a BOUNCE row measures the bounce path: every transfer took it, and its checks
    and its UCX reference's passed. Anything else (`ucx:count` under an inherited gate, the
    same-host path, a mix, a failed check) is left out of the crossover: unmeasured."""
    return r["path"] == "bounce" and r.get("check", "ok") == "ok" and ref_ok.get(point_of(r), True)


def _ref_ok(rows):
    return {point_of(r): r.get("check", "ok") == "ok" for r in rows if r["backend"] == REFERENCE}


def crossover(rows, shape, mem, variant="BOUNCE", conc=None):
    """(size, count) -> BOUNCE/UCX p50 ratio for WRITE at one concurrency (the lowest run), of
    the points that measured the bounce path only (`_measured`; see `left_out` for the rest)."""
    sel = _bounce_rows(rows, shape, mem, variant)
    if not sel:
        return {}, None
    conc = conc or min(r["concurrency"] for r in sel)
    ref_ok = _ref_ok(rows)
    return {(r["block_size"], r["batch_size"]): r["ratio_p50_vs_ucx"] for r in sel
            if r["concurrency"] == conc and _measured(r, ref_ok)}, conc


def left_out(rows, shape, mem, variant="BOUNCE", conc=None):
    """(size, count) -> why, for the points `crossover` leaves out at the same concurrency: the
    row's path when it was not `bounce`, else `check failed`."""
    sel = _bounce_rows(rows, shape, mem, variant)
    if not sel:
        return {}
    conc = conc or min(r["concurrency"] for r in sel)
    ref_ok = _ref_ok(rows)
    return {(r["block_size"], r["batch_size"]): (r["path"] if r["path"] != "bounce" else "check failed")
            for r in sel if r["concurrency"] == conc and not _measured(r, ref_ok)}


def summary(rows, meta, win_below):
    """The closing text: warnings (inherited gate variables, failed checks), headline ratios,
    tail latency under load, the derived gate."""
    out = [f"Sweep on {meta['machine']}; {meta['elapsed']:.0f} s; results in {meta['outdir']}"]
    if meta.get("gate_warning"):
        out.append(meta["gate_warning"])
    failed = [r for r in rows if r.get("check", "ok") != "ok"]
    if failed:
        out.append(f"CHECK FAILED in {len(failed)} of {len(rows)} rows (left out of every ratio and gate below; "
                   "the sweep exits 1):")
        for r in failed:
            out.append(f"  {r['shape']} {r['op']} {r['mem']} {r['batch_size']} x {fmt_size(r['block_size'])}, "
                       f"{r['concurrency']} in flight, {r['backend']}: {r['check']}")
    bounce = [r for r in rows if r["backend"] == "BOUNCE" and r["ratio_p50_vs_ucx"] is not None
              and r.get("check", "ok") == "ok"]
    for shape in dict.fromkeys(r["shape"] for r in bounce):
        for op in ("WRITE", "READ"):
            sel = [r for r in bounce if r["shape"] == shape and r["op"] == op]
            if not sel:
                continue
            best = min(sel, key=lambda r: r["ratio_p50_vs_ucx"])
            paths = sorted({r["path"] for r in sel})
            out.append(f"- {shape} {op}: BOUNCE/UCX p50 from {best['ratio_p50_vs_ucx']:.3f} "
                       f"({best['batch_size']} x {fmt_size(best['block_size'])}, {best['concurrency']} in flight) "
                       f"to {max(r['ratio_p50_vs_ucx'] for r in sel):.3f}; median "
                       f"{statistics.median(r['ratio_p50_vs_ucx'] for r in sel):.3f}; paths {', '.join(paths)}")
            top = max(r["concurrency"] for r in sel)
            ucx = {point_of(r): r for r in rows if r["backend"] == REFERENCE}
            at = [r for r in sel if r["concurrency"] == top and point_of(r) in ucx]
            if top > 1 and at:
                worst = max(at, key=lambda r: tail(r)[0] / tail(ucx[point_of(r)])[0])
                u = ucx[point_of(worst)]
                (bt, bl), (ut, ul) = tail(worst), tail(u)
                out.append(f"  {top} in flight, worst tail vs UCX: {worst['batch_size']} x "
                           f"{fmt_size(worst['block_size'])}: BOUNCE p50 {worst['p50_us'] / 1e3:.2f} ms, "
                           f"{bl} {bt / 1e3:.2f} ms vs UCX p50 {u['p50_us'] / 1e3:.2f} ms, {ul} {ut / 1e3:.2f} ms")
    out.append("")
    out.append(f"Gate (BOUNCE wins = p50 below {win_below} x UCX's, WRITE, lowest concurrency run; "
               "only points whose transfers all took the bounce path count):")
    for mem in dict.fromkeys(r["mem"] for r in rows):
        mem_rows = [r for r in bounce if r["mem"] == mem and r["op"] == "WRITE"]
        every = [r for r in rows if r["backend"] == "BOUNCE" and r["mem"] == mem and r["op"] == "WRITE"
                 and r["ratio_p50_vs_ucx"] is not None]
        if every and not mem_rows:
            out.append(f"- {mem}: every BOUNCE WRITE row failed its check: nothing to derive.")
            continue
        if mem_rows and not any(took_bounce(r["path"]) for r in mem_rows):
            labels = sorted({r["path"] for r in mem_rows})
            out.append(f"- {mem}: every transfer took {', '.join(labels)}, none the bounce path; "
                       f"nothing to derive: {why_nothing_bounced(labels)}.")
            continue
        for shape in dict.fromkeys(r["shape"] for r in mem_rows):
            ratios, conc = crossover(rows, shape, mem)
            gone = left_out(rows, shape, mem)
            gate = derive_gate({k: v < win_below for k, v in ratios.items()})
            sizes = sorted({s for s, _ in ratios})
            counts = sorted({c for _, c in ratios})
            grid = f"{len(sizes)} sizes x {len(counts)} counts, {conc} in flight"
            if not ratios:
                out.append(f"- {mem} {shape}: no point measured the bounce path: nothing to derive.")
            elif gate is None:
                out.append(f"- {mem} {shape}: BOUNCE won at no measured point that could open a gate ({grid}): "
                           "keep the gate closed (bounce_enable=false) on this machine.")
            else:
                out.append(f"- {mem} {shape} ({grid}): bounce_min_descriptor_count={gate[0]} "
                           f"bounce_max_average_descriptor_size={fmt_size(gate[1])}   i.e. "
                           f"NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT={gate[0]} "
                           f"NIXL_BOUNCE_MAX_AVERAGE_DESCRIPTOR_SIZE={fmt_size(gate[1])}")
            if gone:
                pts = ", ".join(f"{c} x {fmt_size(s)} ({why})" for (s, c), why in sorted(gone.items()))
                out.append(f"  Left out, unmeasured (not the bounce path, or a failed check): {pts}.")
    out.append("  Only the measured grid counts: the gate is as fine as the sizes and counts swept.")
    out.append("  Re-derive on your machine: python -m benches.sweep --preset gate  "
               "(WRITE, DRAM, one request at a time, BOUNCE vs UCX, 512 B..1 MiB x 16..16384).")
    return "\n".join(out) + "\n"
