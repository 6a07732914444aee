"""How fast can a target answer an initiator that alone loaded the target's metadata? (issue 13)

Two real NIXL agents in two processes, plain UCX backend, DRAM, no progress threads (both sides
poll, as BOUNCE's reactor does). Measured side by side in ONE run, in alternating blocks so that
machine noise lands on both alike:

  (a) one-sided answers: the target writes 64-byte records into a ring of RING records in its
      own registered buffer (record n at position n % RING, as the mailbox design does); the
      initiator, which loaded only the target's metadata, fetches the whole ring with one RDMA
      READ (prepped once, the same handle re-posted) in a loop and takes every new record in
      order. Reported: latency from the target's write of each record to the initiator seeing
      it (p50/p99), the cost of one ring READ and of one 64-byte READ (post + checks until
      DONE, p50/p99). A record carries its sequence number at both ends; a READ that sees them
      differ (a torn record) is counted and read again. Records overwritten before any READ saw
      them (the initiator descheduled for a whole lap) are counted as lost.
  (b) reverse path: the target sends a notification to the initiator (so the target must load
      the initiator's metadata too). Reported: one-way latency from send_notif to the
      initiator's get_new_notifs returning it (p50/p99).

Both processes stamp with CLOCK_MONOTONIC (time.monotonic_ns), which is one clock machine-wide.
The target waits a random 50-500 us between records (busy, polling its agent so that transports
whose RDMA is emulated by messages, such as TCP, progress), so the initiator cannot phase-lock.

    .venv/bin/python benches/answer_path.py [--blocks 10] [--per-block 200] [--tls tcp]
                                            [--target-poll-ms 0]

`--tls` sets UCX_TLS for both processes (default: UCX's choice). `--target-poll-ms P` makes the
target poll its agent only every P ms between records (a passive target), to show what a
one-sided answer costs when the target does not progress.
"""
import argparse
import base64
import json
import os
import random
import struct
import subprocess
import sys
import time

# This benchmark runs plain UCX agents only (no BOUNCE backend is created): it measures the
# primitives a one-sided answer path would be built on (RDMA READs of a ring, notifications),
# not the bounce path. NIXL_BOUNCE_CMA=0 therefore changes nothing here; it is kept so that a
# BOUNCE agent added to this benchmark would not take the same-host path (CMA) between these two
# processes of one host (child processes inherit the environment).
os.environ.setdefault("NIXL_BOUNCE_CMA", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))

RECORD = 64
RING = 64  # records: a 4 KiB ring, 17 ms of records at the target's pace before a lap
# seq (u64) | stamp_ns (u64) | 40 bytes of padding | seq again (u64): a torn READ shows two seqs.
HEAD, TAIL = struct.Struct("<QQ"), struct.Struct("<Q")


_last_poll = [0]


def wait_gap(ag, lo_us, hi_us, poll_ms):
    """Busy-waits a random gap, polling the agent (always, or only every `poll_ms` ms)."""
    end = time.monotonic_ns() + random.randint(lo_us, hi_us) * 1000
    while time.monotonic_ns() < end:
        if poll_ms == 0 or time.monotonic_ns() - _last_poll[0] >= poll_ms * 1_000_000:
            ag.get_new_notifs()
            _last_poll[0] = time.monotonic_ns()


def target():
    """The target process: owns the mailbox buffer; writes records or sends notifications."""
    import nixlkit

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL's own log lines must not corrupt the reply lines
    ag = nixlkit.agent("target", ("UCX",))
    buf = nixlkit.pattern(0, 4096)
    buf[:] = 0
    nixlkit.register(ag, buf, "UCX")

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    reply(meta=base64.b64encode(ag.get_agent_metadata()).decode(), addr=buf.ctypes.data)
    seq = 0
    while True:
        while not select_ready():  # keep progressing between commands (wire-up needs it)
            ag.get_new_notifs()
        line = sys.stdin.readline()
        if not line:
            nixlkit.leave(0)
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "records":
            for _ in range(cmd["n"]):
                wait_gap(ag, 50, 500, cmd["poll_ms"])
                seq += 1
                # head first, tail last: a READ racing the write sees head != tail
                at = (seq % RING) * RECORD
                buf[at:at + 16] = memoryview(HEAD.pack(seq, time.monotonic_ns())).cast("B")
                buf[at + 56:at + 64] = memoryview(TAIL.pack(seq)).cast("B")
            # keep progressing until the initiator has seen the last one (TCP needs it)
            while not select_ready():
                wait_gap(ag, 50, 50, cmd["poll_ms"])
            sys.stdin.readline()
            reply(seq=seq)
        elif op == "load":
            ag.add_remote_agent(base64.b64decode(cmd["meta"]))
            reply()
        elif op == "notifs":
            for i in range(cmd["n"]):
                wait_gap(ag, 50, 500, 0)
                ag.send_notif("init", struct.pack("<QQ", i, time.monotonic_ns()))
            reply()
        elif op == "exit":
            reply()
            nixlkit.leave(0)


def select_ready():
    import select
    return bool(select.select([sys.stdin], [], [], 0)[0])


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def fmt(name, xs):
    return f"{name:44s} n={len(xs):6d}  p50 {pct(xs, 50) / 1000:8.1f} us  p99 {pct(xs, 99) / 1000:8.1f} us"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="initiator")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--per-block", type=int, default=200)
    ap.add_argument("--tls", default=None)
    ap.add_argument("--target-poll-ms", type=int, default=0)
    args = ap.parse_args()
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    if args.role == "target":
        return target()

    import nixlkit

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "target"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(**cmd):
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()

    def recv():
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("target died")
        return json.loads(line)

    hello = recv()
    ag = nixlkit.agent("init", ("UCX",))
    local = nixlkit.pattern(1, 4096)
    nixlkit.register(ag, local, "UCX")
    ag.add_remote_agent(base64.b64decode(hello["meta"]))
    lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", [(local.ctypes.data, RECORD * RING, 0),
                                                (local.ctypes.data, RECORD, 0)], "DRAM")
    rh = ag.prep_xfer_dlist("target", [(hello["addr"], RECORD * RING, 0),
                                       (hello["addr"], RECORD, 0)], "DRAM")
    read = ag.make_prepped_xfer("READ", lh, [0], rh, [0], b"")
    small = ag.make_prepped_xfer("READ", lh, [1], rh, [1], b"")

    read_cost, small_cost, seen_lat, torn, reads, lost = [], [], [], 0, 0, 0
    notif_lat = []

    def one_read(read=read):
        t0 = time.perf_counter_ns()
        state = ag.transfer(read)
        while state == "PROC":
            state = ag.check_xfer_state(read)
        if state != "DONE":
            raise SystemExit("READ failed")
        return time.perf_counter_ns() - t0

    for _ in range(50):  # warm up: the first READ connects
        one_read()
    small_cost = [one_read(small) for _ in range(5000)]
    local[:] = 0

    # (b) needs the target to know us; loading it now changes nothing for (a)
    send(op="load", meta=base64.b64encode(ag.get_agent_metadata()).decode())
    recv()
    send(op="notifs", n=20)  # warm up: the first notification connects back
    got = 0
    while got < 20:
        got += len(ag.get_new_notifs().get("target", []))
    recv()

    last_seq = 0
    for block in range(args.blocks):
        # (a) one-sided: READ in a loop until the block's last record is seen
        want = last_seq + args.per_block
        send(op="records", n=args.per_block, poll_ms=args.target_poll_ms)
        deadline = time.monotonic() + 60
        while last_seq < want:
            cost = one_read()
            now = time.monotonic_ns()
            reads += 1
            read_cost.append(cost)
            while last_seq < want:  # take every new record in order
                at = ((last_seq + 1) % RING) * RECORD
                seq, stamp = HEAD.unpack_from(local, at)
                (tail,) = TAIL.unpack_from(local, at + 56)
                if seq != tail:
                    torn += 1
                    break
                if seq <= last_seq:
                    break  # not written yet (the previous lap's record)
                lost += seq - last_seq - 1  # lapped: the target wrote over unread records
                seen_lat.append(now - stamp)
                last_seq = seq
            if time.monotonic() > deadline:
                raise SystemExit(f"records stalled at {last_seq}/{want}")
        send(op="seen")
        recv()
        # (b) reverse path: notifications, initiator busy-polling
        send(op="notifs", n=args.per_block)
        got = 0
        while got < args.per_block:
            for m in ag.get_new_notifs().get("target", []):
                now = time.monotonic_ns()
                _, stamp = struct.unpack("<QQ", m)
                notif_lat.append(now - stamp)
                got += 1
        recv()

    send(op="exit")
    recv()
    tls = os.environ.get("UCX_TLS", "(UCX default)")
    print(f"UCX_TLS={tls}  target polls every {args.target_poll_ms} ms (0: busy)  "
          f"blocks={args.blocks} x {args.per_block}")
    print(fmt("(a) one-sided: target write -> initiator sees", seen_lat))
    print(fmt(f"(a) one-sided: one {RECORD * RING} B ring READ", read_cost))
    print(fmt(f"(a) one-sided: one {RECORD} B READ (alone)", small_cost))
    print(f"{'(a) ring READs per record':44s} {reads / max(1, last_seq):.1f}   torn: {torn}"
          f"   lost (lapped): {lost}")
    print(fmt("(b) reverse: send_notif -> initiator sees", notif_lat))
    nixlkit.leave(0)


if __name__ == "__main__":
    main()
