"""Where a bounced transfer's time goes, from BOUNCE's timeline events (issues 12, 13).

BOUNCE marks each step of a transfer with a TRACE event of target `bounce_timeline` (a
submit, each control frame sent and handled, each copy queued, started and finished on its
worker, each write posted and done, each READ, each completion, each idle park of the
reactor and each application `getNotifs`), with its process and thread. Both processes of a
benchmark write them to stderr, or, much cheaper (about 0.1 us a mark against microseconds for
a line to stderr), to the flight recorder's files in a directory; this script puts them on one
clock and splits them into the initiator's transfers:

    NIXL_BOUNCE_MARKS=/tmp/marks .venv/bin/python benches/kv_patterns.py --rounds 3 \\
        --only pull-two-way --variants "BOUNCE bounced,UCX"
    python3 benches/timeline.py /tmp/marks [--dump] [--all]

    BENCH_VERBOSE=1 NIXL_BOUNCE_LOG=bounce_timeline=trace \\
        .venv/bin/python benches/kv_patterns.py ... 2> timeline.log
    python3 benches/timeline.py timeline.log

The recorder's writer appends every 20 ms: empty the directory between runs.

Prints, per transfer (microseconds after its submit): when the target handled the first
PULL or WANT, its first gather started and ended on a worker, the first READY/GRANT was sent
and handled, the first READ was posted, the first RELEASE sent, the first scatter started and
ended, and the transfer completed; then the medians of the transfers that follow a pause of
more than 5 ms ("first" of a block) and of the others. `--hops` prints instead the control exchange
step by step (WANT or PULL sent and handled, GRANT, DATA, ACK, completion): the median time
of each after submit, the median and 90th percentile of its gap from the step before, and
which threads took it (the application's poller or BOUNCE's reactor). `--dump` prints every event of both
processes around each first transfer (`--all` adds parks and application polls). The clocks
of two processes of one host agree; across hosts they do not.
"""

import argparse
import os
import re
import statistics
from collections import Counter
from datetime import datetime

LINE = re.compile(r"^(\S+) TRACE (\S+) pid=(\d+) thread=(\S+) id=(\d+)")
NOISE = ("park", "unpark", "app-pull", "fetch", "fetch-done")
COLUMNS = [  # (column, event, side)
    ("want", ("recv-PULL", "recv-WANT"), "target"),
    ("gstart", ("worker-start",), "target"),
    ("gend", ("worker-end",), "target"),
    ("ready", ("send-GRANT",), "target"),
    ("rready", ("recv-GRANT",), "initiator"),
    ("read", ("read",), "initiator"),
    ("rel", ("send-RELEASE",), "initiator"),
    ("sstart", ("worker-start",), "initiator"),
    ("send", ("worker-end",), "initiator"),
]


def events(paths):
    """Every mark of the logs at `paths`: stderr logs (an ISO time per line) or the flight
    recorder's files (`NIXL_BOUNCE_MARKS=DIR`: `@NS` per line, nanoseconds since the epoch);
    a directory stands for its `marks.*.log` files. One path may be given as a string."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.startswith("marks."))
        else:
            files.append(p)
    out = []
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE.match(line)
                if not m:
                    continue
                if m[1].startswith("@"):
                    us = int(m[1][1:]) // 1000
                else:
                    us = int(datetime.fromisoformat(m[1].replace("Z", "+00:00")).timestamp() * 1e6)
                out.append((us, int(m[3]), m[2], int(m[5]), m[4]))
    return sorted(out)


def transfers(evs):
    """The initiator's transfers, each from its submit to its completion, with every event of
    either process in between; the initiator is the process that submits first."""
    initiator = next((p for _, p, what, _, _ in evs if what == "submit"), None)
    out, cur = [], None
    for e in evs:
        if e[2] == "submit" and e[1] == initiator:
            cur = [e]
            out.append(cur)
        elif cur is not None:
            cur.append(e)
    done = []
    for t in out:
        end = next((x[0] for x in t if x[2] == "complete" and x[1] == initiator), None)
        if end is not None:
            done.append((t[0][0], end, [x for x in t if x[0] <= end]))
    return initiator, done


# The control exchange of a transfer, step by step: (step, the events that mark it, side).
# One way, the target's answers are mailbox records it puts (put-GRANT, put-READY, put-ACK) and
# the initiator finds them in a fetch of the mailbox (fetched: the first fetch that brought any).
HOP_STEPS = [
    ("send WANT/PULL", ("send-WANT", "send-PULL"), "initiator"),
    ("target handles it", ("recv-WANT", "recv-PULL"), "target"),
    ("send GRANT/READY", ("send-GRANT", "put-GRANT", "put-READY"), "target"),
    ("initiator handles it", ("recv-GRANT", "fetched"), "initiator"),
    ("send DATA", ("send-DATA",), "initiator"),
    ("target handles it", ("recv-DATA",), "target"),
    ("send ACK", ("send-ACK", "put-ACK"), "target"),
    ("initiator handles it", ("recv-ACK",), "initiator"),
    ("complete", ("complete",), "initiator"),
]


def first(initiator, t0, body, whats, side):
    """The first of the events `whats` on `side` ("initiator" or "target") in a transfer's
    `body`, as (microseconds after its submit at `t0`, thread); None when it has none."""
    ours = side == "initiator"
    return next(((t - t0, th) for t, p, w, _, th in body if w in whats and (p == initiator) == ours), None)


def hop_steps(initiator, xfers):
    """Per transfer, the first event of each of HOP_STEPS as (microseconds after submit, thread),
    or None where the transfer had none (an inline WANT has no GRANT or DATA, a READ no DATA)."""
    return [[first(initiator, t0, body, whats, side) for _, whats, side in HOP_STEPS] for t0, _, body in xfers]


def print_hops(initiator, xfers):
    """Medians of each step's time after submit and of its gap from the step before it (when the
    transfer had both), with the threads that took it: where each control hop's time goes."""
    rows = hop_steps(initiator, xfers)
    print(f"{'step':22s} {'side':9s} {'at p50':>7s} {'gap p50':>8s} {'gap p90':>8s}  transfers  threads")
    for i, (name, _, side) in enumerate(HOP_STEPS):
        at = [r[i][0] for r in rows if r[i]]
        if not at:
            continue
        gaps = sorted(r[i][0] - r[i - 1][0] for r in rows if r[i] and i > 0 and r[i - 1])
        threads = dict(Counter(r[i][1] for r in rows if r[i]))
        gap50 = f"{statistics.median(gaps):8.0f}" if gaps else f"{'-':>8s}"
        gap90 = f"{gaps[int(0.9 * len(gaps))]:8.0f}" if gaps else f"{'-':>8s}"
        print(f"{name:22s} {side:9s} {statistics.median(at):7.0f} {gap50} {gap90}  {len(at):9d}  {threads}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", nargs="+", help="stderr logs, flight-recorder files, or their directory")
    ap.add_argument("--hops", action="store_true",
                    help="the control exchange step by step (medians, gaps, threads) instead of the table")
    ap.add_argument("--dump", action="store_true", help="every event around each first transfer")
    ap.add_argument("--all", action="store_true", help="with --dump: parks and application polls too")
    ap.add_argument("--pause-ms", type=float, default=5.0, help="a transfer after a longer pause is a first")
    args = ap.parse_args()
    evs = events(args.log)
    initiator, xfers = transfers(evs)
    if not xfers:
        raise SystemExit("no complete transfer in the log (was NIXL_BOUNCE_LOG=bounce_timeline=trace set?)")
    if args.hops:
        print_hops(initiator, xfers)
        return
    names = [c for c, _, _ in COLUMNS] + ["done"]
    print("pause_ms " + " ".join(f"{n:>7}" for n in names) + "   (microseconds after each transfer's submit)")
    rows, prev_end = [], None
    for t0, end, body in xfers:
        pause = (t0 - prev_end) / 1e3 if prev_end is not None else 0.0
        prev_end = end
        row = {}
        for col, whats, side in COLUMNS:
            hit = first(initiator, t0, body, whats, side)
            row[col] = hit[0] if hit else None
        row["done"] = end - t0
        rows.append((pause, row))
        print(f"{pause:8.1f} " + " ".join(f"{row[n] if row[n] is not None else '-':>7}" for n in names))
    for label, keep in (("first", lambda p: p > args.pause_ms), ("others", lambda p: p <= args.pause_ms)):
        group = [r for p, r in rows if keep(p)]
        if group:
            # A step no transfer of the group had (a one-way run has no GRANT) is "-", not 0.
            seen = [[r[n] for r in group if r[n] is not None] for n in names]
            meds = [f"{int(statistics.median(xs)):>7}" if xs else f"{'-':>7}" for xs in seen]
            print(f"{label:>8} " + " ".join(meds) + f"   ({len(group)} transfers)")
    if args.dump:
        prev_end = None
        for t0, end, _ in xfers:
            if prev_end is not None and (t0 - prev_end) / 1e3 > args.pause_ms:
                print(f"--- a transfer after a pause of {(t0 - prev_end) / 1e3:.1f} ms")
                for t, p, what, ident, thread in evs:
                    if t0 - 1500 <= t <= end and (args.all or what not in NOISE):
                        side = "INI" if p == initiator else "TGT"
                        print(f"{t - t0:8d} {side} {thread:15s} {what} {ident}")
            prev_end = end


if __name__ == "__main__":
    main()
