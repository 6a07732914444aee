"""What a notification costs by its size, on UCX and through BOUNCE side by side in ONE run, two
processes (issue 12).

    .venv/bin/python benches/notif_sizes.py [--sizes 64,4096,16384,16470,16479,16705,32768]
                                            [--n 400] [--name NAME]

For each size (message bytes, b"ping" and zeros) and each backend in turn: the time
`send_notif` takes to return on the sending thread, and the round trip until the target's
small "pong" is back (`get_new_notifs` polled), p50 of `--n` samples. The target polls its
agent and answers each ping.

Why it exists: UCX's send of a notification grows by about 3.5 us at once where the message
and the sender's agent name together pass about 16,479 bytes (2 cores, NIXL 1.5.1's UCX; the
agent name rides in NIXL's serialized notification, so a longer `--name` moves the step to a
smaller message). An inline WANT of 256 x 64 B is 16,705 bytes, past it; set against a
notification below it, its round trip looked 1.6-1.9x "a notification of its size" (issue 12,
sessions 43-46) where against one of its real size it is 0.97-1.08x (BENCHMARKS.md, session 47).
"""
import argparse
import base64
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))
sys.path.insert(0, HERE)
from child import leave_after  # noqa: E402

BACKENDS = ("UCX", "BOUNCE")


def target():
    """Two agents (one per backend); answers every ping with a pong until a "bye"."""
    import nixlkit

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL's own log lines must not corrupt the reply lines
    agents = [nixlkit.agent(f"size-target-{b}", (b,)) for b in BACKENDS]
    for ag in agents:
        out.write(base64.b64encode(ag.get_agent_metadata()).decode() + "\n")
    out.flush()
    for ag in agents:
        ag.add_remote_agent(base64.b64decode(sys.stdin.readline()))
    while True:
        for ag in agents:
            for sender, msgs in ag.get_new_notifs().items():
                for m in msgs:
                    if m.startswith(b"ping"):
                        ag.send_notif(sender, b"pong")
                    elif m == b"bye":
                        out.write("bye\n")
                        out.flush()
                        nixlkit.leave(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,4096,8192,16384,16470,16479,16705,24576,32768")
    ap.add_argument("--n", type=int, default=400, help="samples per size and backend")
    ap.add_argument("--name", default="size-ini", help="the initiator's agent name (its length matters)")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.target:
        return target()
    import nixlkit

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--target"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    metas = [proc.stdout.readline() for _ in BACKENDS]
    agents = {}
    for b, meta in zip(BACKENDS, metas):
        # Names of one length: the step falls at the same message size on both.
        ag = nixlkit.agent(f"{args.name}-{b[0]}", (b,))
        ag.add_remote_agent(base64.b64decode(meta))
        agents[b] = ag
    for ag in agents.values():
        proc.stdin.write(base64.b64encode(ag.get_agent_metadata()).decode() + "\n")
    proc.stdin.flush()

    def pongs(ag):
        return sum(m == b"pong" for _, msgs in ag.get_new_notifs().items() for m in msgs)

    def ping(b, msg, deadline_s):
        ag, peer = agents[b], f"size-target-{b}"
        t0 = time.perf_counter_ns()
        ag.send_notif(peer, msg)
        t1 = time.perf_counter_ns()
        end = time.monotonic() + deadline_s
        while not pongs(ag):
            if time.monotonic() > end:
                return None
        return (t1 - t0) / 1e3, (time.perf_counter_ns() - t0) / 1e3

    # The target may need a moment to load our metadata (and BOUNCE to say HELLO).
    for b in BACKENDS:
        end = time.monotonic() + 30
        while ping(b, b"ping", 0.2) is None:
            if time.monotonic() > end:
                raise SystemExit(f"{b}: no pong from the target in 30 s")
    print(f"notification cost by size, two processes, no progress thread, {os.cpu_count()} cores, "
          f"p50 of {args.n} each; initiator agent names of {len(args.name) + 2} characters")
    print(f"  {'bytes':>7s}  {'UCX send':>9s} {'UCX RT':>8s}  {'BOUNCE send':>11s} {'BOUNCE RT':>9s}  RT ratio")
    for size in (int(s) for s in args.sizes.split(",")):
        msg = b"ping" + bytes(max(size - 4, 0))
        res = {b: ([], []) for b in BACKENDS}
        for _ in range(args.n // 20):  # blocks of 20, the backends interleaved
            for b in BACKENDS:
                for _ in range(20):
                    got = ping(b, msg, 5.0)
                    if got is None:
                        raise SystemExit(f"{b}: no pong for a {size} B ping in 5 s")
                    res[b][0].append(got[0])
                    res[b][1].append(got[1])
        med = {b: (statistics.median(s), statistics.median(r)) for b, (s, r) in res.items()}
        print(f"  {size:7d}  {med['UCX'][0]:7.1f}us {med['UCX'][1]:6.1f}us  {med['BOUNCE'][0]:9.1f}us "
              f"{med['BOUNCE'][1]:7.1f}us  {med['BOUNCE'][1] / med['UCX'][1]:8.2f}")
    agents["UCX"].send_notif("size-target-UCX", b"bye")
    leave_after(proc)


if __name__ == "__main__":
    main()
