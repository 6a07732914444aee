"""The control hops of a bounced transfer against UCX's notification floor (issue 12), measured
side by side in ONE run, two processes, blocks of UCX and BOUNCE samples interleaved.

    .venv/bin/python benches/control_hops.py [--blocks 20] [--block 20] [--descs 256] [--size 64]

A bounced WRITE of `--descs` scattered pieces of `--size` bytes costs two control round trips
(WANT -> GRANT, then DATA -> ACK), one write of the gathered chunk and a gather and a scatter of a
few KiB. Its floor on UCX is what the same messages cost there: one write of that many bytes plus
two notification round trips. Measured, per block:
  - notif round trip: send_notif, then get_new_notifs polled until the echo's pong arrives;
  - the same with a notification as large as the bounced WRITE's control frames (the median
    over the warm-up block's WRITEs of each one's `stats.control_sent_bytes` over its
    `stats.control_sent`): for a WRITE that rides inline, its WANT exactly, whose bytes and runs
    make it several KiB (16,705 B for 256 x 64 B), so this is the floor of its one round trip.
    Until session 47 this was the mean over the whole block, which took in the odd liveness
    PING (15,922 B): below the size where UCX's send of a notification grows by 3.5 us at once
    (message and agent name past about 16,479 B, 2 cores), so the WANT was set against a
    cheaper notification than itself;
  - UCX floor: a 1-descriptor UCX WRITE of descs x size bytes (post, check until DONE), then two
    notification round trips, timed as one sample;
  - WRITE descs x size: the scattered WRITE on each backend (post, check until DONE); on BOUNCE it
    bounces (checked: stats.bounce_ok grows by one per sample), on UCX it is UCX's own;
  - the same WRITE on BOUNCE while the target does not call into NIXL at all (an "idle target":
    only BOUNCE's reactor progresses its engine there). Its ratio is against UCX's WRITE to the
    polling target: UCX is not measured against an idle target, because its WRITE may need the
    target's progress (measured here: one stayed in flight for good);
  - both WRITEs again after a pause before each sample (drawn at random, `--apart-ms` on
    average, default 20), to the polling target and (BOUNCE) to the idle one: a transfer that
    comes after a pause, when both sides' threads have gone quiet and an idle target's reactor
    has backed off to its longest idle park. The polling row shows what a pause costs anyway
    (both processes' wake-ups, cold caches); the idle row adds the target reactor's park.
Prints p50 / p99 of each (the p50 ratio column divides the p50 columns beside it) and the hop
estimate: what one control round trip of the bounce path costs against a notification round
trip, from the p50s printed and the round trips each bounced WRITE took (the engine's counts:
`grant_waits`, `ack_waits`, `inline_acks`). A WRITE of k round trips with a data write: its p50
less the UCX WRITE alone (the floor less its 2 RTT), over k, against the notification round trip
(k = 2: (bounced WRITE - UCX floor) / 2 + one RTT). An inline WRITE (one round trip, its bytes
in the WANT, no data write): the whole WRITE against the round trip of a notification of its
WANT's size. No estimate when the WRITEs mixed kinds, a row is missing (--only), or it would
not be positive (noise larger than the difference).
Then the two round trips as the initiator's engine timed them (`stats.grant_wait_ns` and
`stats.ack_wait_ns` over their counts): WANT -> GRANT and DATA -> ACK (the target's scatter of
the chunk in it), each the median over blocks of the block's mean, beside the notification
round trip taken the same way (before session 46 its p50, against which a mean's tail read as
up to 20% more). A WRITE small enough to ride in its WANT (`bounce_inline_bytes`, 16 KiB by
default: 256 x 64 B does) has one round trip instead, WANT -> ACK (`stats.inline_ack_wait_ns`);
run with NIXL_BOUNCE_INLINE_BYTES=0 to measure the two-round-trip exchange. A larger WRITE
(`--size 4096`: 1 MiB, one chunk) writes its chunk into the standing credit its initiator keeps
at the target (`bounce_standing_bytes`), with no WANT -> GRANT either: DATA -> ACK is its one
round trip; run with NIXL_BOUNCE_STANDING_BYTES=0 to measure the full exchange.
"""
import argparse
import base64
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

# This benchmark measures the bounce path. Between two processes of one host BOUNCE takes the
# same-host path (CMA) instead, so that is off here (child processes inherit the environment).
os.environ.setdefault("NIXL_BOUNCE_CMA", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))
sys.path.insert(0, HERE)
from child import leave_after  # noqa: E402

BACKENDS = ("UCX", "BOUNCE")
# The flag file the initiator steers the target with: byte 0 is the backend whose agent the
# target polls (len(BACKENDS): leave), byte 1 is 1 while the target must stay away from NIXL.
ACTIVE, IDLE = 0, 1


def target(flag_path, nbytes):
    """The target process: one agent per backend, each with a registered destination buffer;
    polls the active one and answers each "ping" with a "pong", or (idle) only sleeps."""
    import numpy as np

    import nixlkit

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL's own log lines must not corrupt the reply lines
    with open(flag_path, "r+b") as f:
        flag = mmap.mmap(f.fileno(), 2)
    agents, bufs = [], []
    for b in BACKENDS:
        ag = nixlkit.agent(f"hop-target-{b}", (b,))
        buf = np.zeros(nbytes, dtype=np.uint8)
        nixlkit.register(ag, buf, b)
        agents.append(ag)
        bufs.append(buf)
        out.write(json.dumps({"meta": base64.b64encode(ag.get_agent_metadata()).decode(),
                              "addr": buf.ctypes.data}) + "\n")
    out.flush()
    for ag in agents:
        ag.add_remote_agent(base64.b64decode(sys.stdin.readline()))
    while True:
        active = flag[ACTIVE]
        if active >= len(agents):
            out.write("bye\n")
            out.flush()
            nixlkit.leave(0)
        if flag[IDLE]:
            time.sleep(0.001)
            continue
        ag = agents[active]
        for sender, msgs in ag.get_new_notifs().items():
            for m in msgs:
                if m.startswith(b"ping"):
                    ag.send_notif(sender, b"pong")


class Side:
    """The initiator's agent for one backend, joined to its twin in the target process."""

    def __init__(self, backend, hello, descs, size):
        import nixlkit

        self.backend = backend
        self.peer = f"hop-target-{backend}"
        self.ag = nixlkit.agent(f"hop-ini-{backend}", (backend,))
        stride = 2 * size  # a gap after every piece: nothing merges, the pieces stay scattered
        self.src = nixlkit.pattern(5, descs * stride)
        nixlkit.register(self.ag, self.src, backend)
        self.ag.add_remote_agent(base64.b64decode(hello["meta"]))
        raddr = hello["addr"]
        self.lo_scattered = [(self.src.ctypes.data + i * stride, size, 0) for i in range(descs)]
        self.re_scattered = [(raddr + i * stride, size, 0) for i in range(descs)]
        self.lo_one = [(self.src.ctypes.data, descs * size, 0)]
        self.re_one = [(raddr, descs * size, 0)]
        self.scattered = self.one = None
        self.frame_ping = b"ping"  # sized once the bounced WRITE's frames are known

    def prepare(self):
        self.scattered = self._prep(self.lo_scattered, self.re_scattered)
        self.one = self._prep(self.lo_one, self.re_one)

    def _prep(self, lo, re):
        ag = self.ag
        return ag.initialize_xfer("WRITE", ag.get_xfer_descs(lo, "DRAM"), ag.get_xfer_descs(re, "DRAM"),
                                  self.peer, b"", backends=[self.backend])

    def wait_first_pong(self, deadline_s=30.0):
        """The target may need a moment to load our metadata: ping until the first pong."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                self.ag.send_notif(self.peer, b"ping")
            except Exception:
                time.sleep(0.01)
                continue
            t = time.monotonic() + 0.2
            while time.monotonic() < t:
                if self._pongs():
                    return
        raise SystemExit(f"{self.backend}: the target never answered")

    def _pongs(self):
        return sum(m == b"pong" for _, msgs in self.ag.get_new_notifs().items() for m in msgs)

    def _ping_pong(self, msg=b"ping", deadline_s=10.0):
        t0 = time.perf_counter()
        self.ag.send_notif(self.peer, msg)
        spins = 0
        while not self._pongs():
            spins += 1
            if not spins % 4096 and time.perf_counter() - t0 > deadline_s:
                raise SystemExit(f"{self.backend}: no pong within {deadline_s} s of a ping")

    def _write(self, h, deadline_s=10.0):
        st = self.ag.transfer(h)
        end = time.monotonic() + deadline_s
        while st not in ("DONE", "ERR"):
            st = self.ag.check_xfer_state(h)
            if st == "PROC" and time.monotonic() > end:
                raise SystemExit(f"{self.backend}: a WRITE was still in flight after {deadline_s} s")
        if st != "DONE":
            raise SystemExit(f"{self.backend}: transfer failed")

    def bounce_ok(self):
        import nixlkit

        return int(nixlkit.live_params(self.ag, self.backend).get("stats.bounce_ok", 0))

    def standing_claims(self):
        import nixlkit

        return int(nixlkit.live_params(self.ag, self.backend).get("stats.standing_claims", 0))

    def control_sent(self):
        """Control frames this engine sent so far, and their bytes."""
        import nixlkit

        p = nixlkit.live_params(self.ag, self.backend)
        return int(p.get("stats.control_sent", 0)), int(p.get("stats.control_sent_bytes", 0))

    def waits(self):
        """The engine's timed control round trips so far: {name: (count, summed ns)}."""
        import nixlkit

        p = nixlkit.live_params(self.ag, self.backend)
        pairs = {"grant_wait": "grant_waits", "ack_wait": "ack_waits", "inline_ack_wait": "inline_acks"}
        return {k: (int(p.get(f"stats.{n}", 0)), int(p.get(f"stats.{k}_ns", 0))) for k, n in pairs.items()}

    # One sample of each measurement, in seconds.
    def notif_rtt(self):
        t0 = time.perf_counter()
        self._ping_pong()
        return time.perf_counter() - t0

    def notif_rtt_frame(self):
        t0 = time.perf_counter()
        self._ping_pong(self.frame_ping)
        return time.perf_counter() - t0

    def floor(self):
        t0 = time.perf_counter()
        self._write(self.one)
        self._ping_pong()
        self._ping_pong()
        return time.perf_counter() - t0

    def write_scattered(self):
        t0 = time.perf_counter()
        self._write(self.scattered)
        return time.perf_counter() - t0

    def write_scattered_apart(self):
        # Not timed: the target's reactor backs off meanwhile. The pause is drawn at random
        # from [apart/2, 3 apart/2): a fixed pause phase-locks with the reactor's park period
        # (each sample then meets the park at the same phase, not at a random one: on 16 cores
        # a 20 ms pause gave 0.64 ms with 2 ms parks but 3.8 ms with 4 ms parks).
        time.sleep(self.apart * random.uniform(0.5, 1.5))
        return self.write_scattered()


# name, method, backends, target idle, the row whose UCX median the ratio divides by
OPS = [
    ("notif round trip", "notif_rtt", BACKENDS, False, "notif round trip"),
    ("notif RT, frame-sized", "notif_rtt_frame", BACKENDS, False, "notif RT, frame-sized"),
    ("UCX floor: write + 2 RTT", "floor", ("UCX",), False, None),
    ("WRITE scattered", "write_scattered", BACKENDS, False, "WRITE scattered"),
    ("  after a pause", "write_scattered_apart", BACKENDS, False, "  after a pause"),
    ("WRITE scattered, idle tgt", "write_scattered", ("BOUNCE",), True, "WRITE scattered"),
    ("  idle tgt, after a pause", "write_scattered_apart", ("BOUNCE",), True, "  after a pause"),
]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def hop_estimate(write, floor, rtt, frame_rtt, counts, writes):
    """One control round trip of the bounce path, from p50s (s): the bounced WRITE, the UCX floor
    (a UCX WRITE and 2 notification round trips), a notification round trip and one of the
    WANT's size; `counts`: the engine's {grant_wait, ack_wait, inline_ack_wait: round trips}
    over `writes` bounced WRITEs. Returns (estimate, what it is set against, its label, how
    many round trips a WRITE took) or (None, why not)."""
    if not writes or write is None:
        return None, "no bounced WRITE to a polling target measured"
    inline = counts.get("inline_ack_wait", 0)
    per_write = sum(counts.values()) / writes
    k = round(per_write)
    if abs(per_write - k) > 0.05 or k < 1 or inline not in (0, writes):
        return None, (f"the bounced WRITEs took {per_write:.2f} round trips each "
                      f"({', '.join(f'{n} {c}' for n, c in counts.items() if c)} over {writes} WRITEs): "
                      f"no single kind")
    if inline:  # k == 1: the WANT carries the bytes, there is no data write to take off
        if k != 1 or frame_rtt is None:
            return None, "an inline WRITE without a frame-sized notification measured"
        hop, base, label = write, frame_rtt, "the round trip of a notification of its WANT's size"
    else:
        if floor is None or rtt is None:
            return None, "no UCX floor or notification round trip measured"
        hop, base, label = (write - (floor - 2 * rtt)) / k, rtt, "the notification round trip"
    if hop <= 0:
        return None, (f"it came out {hop * 1e6:.1f}us (the bounced WRITE's p50 {write * 1e6:.1f}us, "
                      f"below the floor's data write): noise larger than the difference")
    return hop, base, label, k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=20, help="interleaved blocks")
    ap.add_argument("--block", type=int, default=20, help="samples per backend and block")
    ap.add_argument("--descs", type=int, default=256, help="pieces per scattered WRITE")
    ap.add_argument("--size", type=int, default=64, help="bytes per piece")
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the raw samples to this file")
    ap.add_argument("--only", help="run only the measurements whose name contains this (tracing)")
    ap.add_argument("--apart-ms", type=float, default=20.0,
                    help="mean pause before each sample of the 'after a pause' rows (drawn from 0.5x to 1.5x)")
    args = ap.parse_args()
    if args.target:
        target(args.target, 2 * args.size * args.descs)
        return
    import nixlkit

    flag_path = os.path.join(tempfile.mkdtemp(), "flag")
    with open(flag_path, "wb") as f:
        f.write(b"\0\0")
    with open(flag_path, "r+b") as f:
        flag = mmap.mmap(f.fileno(), 2)

    proc = subprocess.Popen([sys.executable, __file__, "--target", flag_path, "--descs", str(args.descs),
                             "--size", str(args.size)], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    hellos = [json.loads(proc.stdout.readline()) for _ in BACKENDS]
    sides = {b: Side(b, h, args.descs, args.size) for b, h in zip(BACKENDS, hellos)}
    for s in sides.values():
        s.apart = args.apart_ms / 1e3
    for s in sides.values():
        proc.stdin.write(base64.b64encode(s.ag.get_agent_metadata()).decode() + "\n")
    proc.stdin.flush()
    try:
        frame_bytes = 0
        for i, s in enumerate(sides.values()):
            flag[ACTIVE] = i
            s.wait_first_pong()
            if s.backend == "BOUNCE":
                nixlkit.wait_ready(s.ag)
            s.prepare()
            # Both writes, a block's worth, while the target polls: UCX's first puts to a peer need
            # the target's progress (measured: with only one before them, a UCX WRITE to the idle
            # target stayed IN_PROG).
            per_write = []
            for _ in range(args.block):
                sent0 = s.control_sent() if s.backend == "BOUNCE" else None
                s.write_scattered()
                if sent0:
                    n, nbytes = (a - b for a, b in zip(s.control_sent(), sent0))
                    if n:
                        per_write.append(nbytes // n)
                s.floor()
            if per_write:
                frame_bytes = int(statistics.median(per_write))
        # A notification of the bounced WRITE's control frame (b"ping" and zeros), on both.
        for s in sides.values():
            s.frame_ping = b"ping" + bytes(max(frame_bytes - 4, 0))
        samples = {(name, b): [] for name, _, backends, _, _ in OPS for b in backends}
        # Per block of bounced WRITEs (polling target, idle target): mean WANT -> GRANT and
        # DATA -> ACK as the initiator's engine timed them, in seconds.
        hops = {}
        # Per row of bounced WRITEs: the engine's round trips of each kind, and the WRITEs.
        rt_counts, rt_writes = {}, {}
        ok_before = sides["BOUNCE"].bounce_ok()
        claims_before = sides["BOUNCE"].standing_claims()
        bounced = 0
        for _ in range(args.blocks):
            for name, method, backends, idle, _ in OPS:
                if args.only and args.only not in name:
                    continue
                for b in backends:
                    flag[ACTIVE], flag[IDLE] = BACKENDS.index(b), int(idle)
                    if idle:
                        time.sleep(0.005)  # the target is past its last poll
                    f = getattr(sides[b], method)
                    f()  # one warm-up per block keeps a cold first sample out of the tail
                    timed = b == "BOUNCE" and method == "write_scattered"
                    w0 = sides[b].waits() if timed else None
                    samples[(name, b)].extend(f() for _ in range(args.block))
                    if timed:
                        w1 = sides[b].waits()
                        rt_writes[name] = rt_writes.get(name, 0) + args.block
                        for k in w1:
                            n, ns = w1[k][0] - w0[k][0], w1[k][1] - w0[k][1]
                            rt_counts.setdefault(name, {}).setdefault(k, 0)
                            rt_counts[name][k] += n
                            if n:
                                hops.setdefault((name, k), []).append(ns / n / 1e9)
                    if b == "BOUNCE" and method.startswith("write_scattered"):
                        bounced += args.block + 1
    except BaseException:
        flag[ACTIVE] = len(BACKENDS)  # the target leaves too
        raise
    flag[IDLE] = 0
    ok = sides["BOUNCE"].bounce_ok() - ok_before
    if ok != bounced:
        flag[ACTIVE] = len(BACKENDS)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"FAIL: {bounced - ok} of {bounced} BOUNCE WRITEs did not take the bounce path: no figure of "
              f"this run is the bounce path's, none printed")
        nixlkit.leave(1)
    print(f"control hops, two processes, DRAM, no progress thread, {os.cpu_count()} cores, "
          f"{args.blocks} interleaved blocks of {args.block}, WRITE of {args.descs} x {args.size} B; "
          f"its initiator's control frames {frame_bytes} B (median per WRITE)")
    print(f"  {'measurement':27s} {'UCX p50':>9s} {'UCX p99':>9s} {'BOUNCE p50':>11s} {'BOUNCE p99':>11s} "
          f"{'p50 ratio':>10s}")
    p50 = {}  # the p50 columns, which the ratio column and the hop estimate divide
    for name, _, backends, _, base in OPS:
        cols = []
        for b in BACKENDS:
            xs = samples.get((name, b))
            if xs:
                p50[(name, b)] = pct(xs, .5)
                cols += [f"{p50[(name, b)]*1e6:7.1f}us", f"{pct(xs, .99)*1e6:7.1f}us"]
            else:
                cols += ["-", "-"]
        ratio = (f"{p50[(name, 'BOUNCE')] / p50[(base, 'UCX')]:10.2f}"
                 if (name, "BOUNCE") in p50 and (base, "UCX") in p50 else f"{'-':>10s}")
        print(f"  {name:27s} {cols[0]:>9s} {cols[1]:>9s} {cols[2]:>11s} {cols[3]:>11s} {ratio}")
    est = hop_estimate(p50.get(("WRITE scattered", "BOUNCE")), p50.get(("UCX floor: write + 2 RTT", "UCX")),
                       p50.get(("notif round trip", "UCX")), p50.get(("notif RT, frame-sized", "UCX")),
                       rt_counts.get("WRITE scattered", {}), rt_writes.get("WRITE scattered", 0))
    if est[0] is None:
        print(f"  one bounce control round trip: no estimate ({est[1]}); see the engine's timings below")
    else:
        hop, base, label, k = est
        how = ("the whole inline WRITE, WANT -> ACK (its bytes in the WANT; includes the gather and scatter)"
               if label != "the notification round trip" else
               f"{k} round trip{'s' if k > 1 else ''} per WRITE, by the engine's counts; includes a share "
               f"of the gather and scatter")
        print(f"  one bounce control round trip ~ {hop*1e6:.1f}us against {label} {base*1e6:.1f}us "
              f"({hop / base:.2f}x; p50s; {how})")
    # The engine times its hops as a sum per block (a mean), so the notifications they are
    # compared with are taken the same way: each block's mean, the median over blocks. Set
    # against a median of single samples, a mean carries the tail (a 2-core block with one
    # 100 us sample) and made the hops look up to 20% slower than they are.
    def block_means(xs):
        return statistics.median(statistics.fmean(xs[i:i + args.block]) for i in range(0, len(xs), args.block))

    frame_xs, rtt_xs = samples.get(("notif RT, frame-sized", "UCX")), samples.get(("notif round trip", "UCX"))
    frame_rtt = block_means(frame_xs) if frame_xs else None
    rtt = block_means(rtt_xs) if rtt_xs else None
    if frame_rtt:
        for name in ("WRITE scattered", "WRITE scattered, idle tgt"):
            xs = hops.get((name, "inline_ack_wait"))
            if xs:
                m = statistics.median(xs)
                print(f"  WANT -> ACK, inline ({name}) against the round trip of a notification of its "
                      f"WANT's size: {m / frame_rtt:.2f}x (means per block, median over blocks)")
    if rtt:
        for name in ("WRITE scattered", "WRITE scattered, idle tgt"):
            for k, label in (("grant_wait", "WANT -> GRANT"), ("ack_wait", "DATA -> ACK"),
                             ("inline_ack_wait", "WANT -> ACK, inline")):
                xs = hops.get((name, k))
                if xs:
                    m = statistics.median(xs)
                    print(f"  {label:19s} timed by the engine ({name}): {m*1e6:6.1f}us, "
                          f"{m / rtt:.2f}x the notification round trip ({rtt*1e6:.1f}us; means per block)")
    print(f"  bounced: {ok} of {bounced} BOUNCE scattered WRITEs took the bounce path; "
          f"{sides['BOUNCE'].standing_claims() - claims_before} wrote their first chunk into a standing "
          f"credit (no WANT -> GRANT)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{n}|{b}": v for (n, b), v in samples.items()}, f)
    flag[ACTIVE] = len(BACKENDS)
    leave_after(proc)


if __name__ == "__main__":
    main()
