"""The sweep's figures (matplotlib, written as PNG): latency against descriptor size per
backend, tail latency against requests in flight, and the crossover map of where BOUNCE wins."""
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI machines
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from . import report  # noqa: E402

# One style in every figure: p50 a solid line with dots, the tail a dashed line with crosses,
# hollow where it is the slowest of fewer than report.P99_MIN_SAMPLES samples (not a p99).
P50_STYLE = dict(ls="-", marker="o", ms=3)
TAIL_STYLE = dict(ls="--", marker="x", ms=4, alpha=0.7)


def _lines(ax, x, pts, colour, b, scale=1.0):
    """p50 and tail of `pts` (rows) against `x`, in the shared styles."""
    ax.plot(x, [r["p50_us"] / scale for r in pts], color=colour, label=f"{b} p50", **P50_STYLE)
    tails = [report.tail(r) for r in pts]
    few = [lbl != "p99" for _, lbl in tails]
    ax.plot(x, [v / scale for v, _ in tails], color=colour,
            label=f"{b} p99" + (" (o: max, n<" + str(report.P99_MIN_SAMPLES) + ")" if any(few) else ""),
            **TAIL_STYLE)
    xs = [xx for xx, f in zip(x, few) if f]
    if xs:
        ax.plot(xs, [v / scale for (v, _), f in zip(tails, few) if f], ls="none", marker="o", ms=6,
                mfc="none", mec=colour)


def _tail_note(fig, rows):
    if any(report.tail(r)[1] != "p99" for r in rows):
        fig.text(0.01, 0.005, f"p99 points circled: fewer than {report.P99_MIN_SAMPLES} samples, "
                 "plotted is the slowest sample (the max of n)", fontsize=6)


def _sel(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([report.fmt_size(s) for s in sizes], rotation=45, fontsize=7)


def latency_vs_size(rows, mem, shape, path):
    """p50 (line) and p99 (dashed) latency vs descriptor size, one panel per (operation, batch
    size), one colour per backend, one request in flight (the lowest concurrency run). Rows
    whose check failed are left out."""
    sel = [r for r in _sel(rows, mem=mem, shape=shape) if r.get("check", "ok") == "ok"]
    if not sel:
        return False
    conc = min(r["concurrency"] for r in sel)
    sel = _sel(sel, concurrency=conc)
    ops = list(dict.fromkeys(r["op"] for r in sel))
    counts = sorted({r["batch_size"] for r in sel})
    backends = list(dict.fromkeys(r["backend"] for r in sel))
    sizes = sorted({r["block_size"] for r in sel})
    fig, axes = plt.subplots(len(ops), len(counts), figsize=(3.6 * len(counts) + 1, 3.2 * len(ops)),
                             squeeze=False, sharex=True)
    for i, op in enumerate(ops):
        for j, count in enumerate(counts):
            ax = axes[i][j]
            for k, b in enumerate(backends):
                pts = sorted(_sel(sel, op=op, batch_size=count, backend=b), key=lambda r: r["block_size"])
                if not pts:
                    continue
                _lines(ax, [r["block_size"] for r in pts], pts, f"C{k}", b)
            ax.set_yscale("log")
            _size_axis(ax, sizes)
            ax.set_title(f"{op}, {count} descriptors", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(ops) - 1:
                ax.set_xlabel("descriptor size")
            if j == 0:
                ax.set_ylabel("latency per transfer (us)")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"Latency vs descriptor size: {mem}, {shape}, {conc} in flight", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    _tail_note(fig, sel)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def p99_vs_concurrency(rows, mem, shape, path):
    """p50 (line) and p99 (dashed) vs requests in flight for up to four descriptor sizes at the
    largest batch size run, one row per operation. Rows whose check failed are left out."""
    sel = [r for r in _sel(rows, mem=mem, shape=shape) if r.get("check", "ok") == "ok"]
    if not sel:
        return False
    count = max(r["batch_size"] for r in sel)
    sel = _sel(sel, batch_size=count)
    ops = list(dict.fromkeys(r["op"] for r in sel))
    sizes = sorted({r["block_size"] for r in sel})
    if len(sizes) > 4:
        sizes = [sizes[round(i * (len(sizes) - 1) / 3)] for i in range(4)]
    backends = list(dict.fromkeys(r["backend"] for r in sel))
    concs = sorted({r["concurrency"] for r in sel})
    fig, axes = plt.subplots(len(ops), len(sizes), figsize=(3.6 * len(sizes) + 1, 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            for k, b in enumerate(backends):
                pts = sorted(_sel(sel, op=op, block_size=size, backend=b), key=lambda r: r["concurrency"])
                if not pts:
                    continue
                _lines(ax, [r["concurrency"] for r in pts], pts, f"C{k}", b, scale=1e3)
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs)
            ax.set_xticklabels([str(c) for c in concs])
            ax.set_yscale("log")
            ax.set_title(f"{op}, {count} x {report.fmt_size(size)}", fontsize=9)
            ax.set_xlabel("requests in flight")
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("latency (ms)")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"Tail latency vs concurrency: {mem}, {shape}, {count} descriptors", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    _tail_note(fig, sel)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def crossover_map(rows, mem, shapes, path, win_below):
    """BOUNCE/UCX p50 ratio over descriptor size x count (WRITE, lowest concurrency), one panel
    per shape; green where BOUNCE wins, the derived gate outlined; points left out (not the
    bounce path, or a failed check) blank, with why in grey."""
    maps = [(s, *report.crossover(rows, s, mem)) for s in shapes]
    maps = [m for m in maps if m[1]]
    if not maps:
        return False
    fig, axes = plt.subplots(1, len(maps), figsize=(5.5 * len(maps), 4.2), squeeze=False)
    for ax, (shape, ratios, conc) in zip(axes[0], maps):
        gone = report.left_out(rows, shape, mem, conc=conc)
        sizes = sorted({s for s, _ in ratios} | {s for s, _ in gone})
        counts = sorted({c for _, c in ratios} | {c for _, c in gone})
        grid = [[ratios.get((s, c), float("nan")) for s in sizes] for c in counts]
        # symmetric around 1 in log space: 0.5x and 2x get equally strong colours
        span = max(max(ratios.values()), 1 / min(ratios.values()), 1.1)
        im = ax.imshow(grid, origin="lower", cmap="RdYlGn_r", norm=LogNorm(1 / span, span), aspect="auto")
        for y, c in enumerate(counts):
            for x, s in enumerate(sizes):
                v = ratios.get((s, c))
                if v is not None:
                    ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7)
                elif (s, c) in gone:
                    ax.text(x, y, gone[(s, c)], ha="center", va="center", fontsize=6, color="grey")
        gate = report.derive_gate({k: v < win_below for k, v in ratios.items()})
        if gate:
            x1 = sizes.index(gate[1]) + 0.5
            y0 = counts.index(gate[0]) - 0.5
            ax.add_patch(Rectangle((-0.5, y0), x1 + 0.5, len(counts) - 0.5 - y0, fill=False, lw=2, ec="black"))
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([report.fmt_size(s) for s in sizes], rotation=45, fontsize=7)
        ax.set_yticks(range(len(counts)))
        ax.set_yticklabels([str(c) for c in counts], fontsize=7)
        ax.set_xlabel("descriptor size")
        ax.set_ylabel("descriptors per transfer")
        ax.set_title(f"{shape}, {conc} in flight" + (f"; gate: >= {gate[0]}, <= {report.fmt_size(gate[1])}"
                                                     if gate else "; bounce wins nowhere"), fontsize=9)
        fig.colorbar(im, ax=ax, label="BOUNCE p50 / UCX p50 (WRITE)")
    fig.suptitle(f"Where BOUNCE wins: {mem} (below {win_below}; outlined: the derived gate)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    if any(report.left_out(rows, shape, mem, conc=conc) for shape, _, conc in maps):
        fig.text(0.01, 0.005, "grey: left out, unmeasured (the row's path was not the bounce path, "
                 "or its check failed)", fontsize=6)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def all_plots(rows, outdir, win_below):
    """Every figure the rows support; returns their paths."""
    out = []
    for mem in dict.fromkeys(r["mem"] for r in rows):
        shapes = list(dict.fromkeys(r["shape"] for r in rows if r["mem"] == mem))
        for shape in shapes:
            p = os.path.join(outdir, f"latency_vs_size_{mem}_{shape}.png")
            if latency_vs_size(rows, mem, shape, p):
                out.append(p)
            p = os.path.join(outdir, f"p99_vs_concurrency_{mem}_{shape}.png")
            if p99_vs_concurrency(rows, mem, shape, p):
                out.append(p)
        p = os.path.join(outdir, f"crossover_{mem}.png")
        if crossover_map(rows, mem, shapes, p, win_below):
            out.append(p)
    return out
