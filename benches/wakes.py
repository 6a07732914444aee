"""Wake-ups after a transfer: how often each engine's reactor thread wakes, and the CPU it takes,
in the time after a bounced WRITE while the application does other work.

    .venv/bin/python benches/wakes.py [--rounds 5] [--after-ms 300] [--poll-ms 5]

Two agents in this process (the initiator and the target of the WRITE, 1024 x 4 KiB scattered,
host memory, bounced: agents of one process take the bounce path). Each round posts the WRITE,
polls until it is done, then for `--after-ms` only sleeps and calls `get_new_notifs` on both
agents every `--poll-ms` (an application busy elsewhere), and reads each reactor thread's
voluntary context switches (one per wake-up) from /proc and CPU time from its thread clock. An idle reactor wakes at
least once per `bounce_idle_park_us` (1 ms by default); more than that is its idle ramp, which
is for frames that come unannounced. Linux only. Compare builds with `NIXL_PLUGIN_DIR`.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import nixlkit  # noqa: E402

PIECES, SIZE = 1024, 4096


def thread_cpu_s(tid):
    """Thread `tid`'s CPU time, exact (the scheduler's own clock of that thread, Linux's
    MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)); /proc's utime and stime are sampled at timer
    ticks, which a thread that wakes on a timer is charged for far beyond what it runs."""
    return time.clock_gettime(((~tid) << 3) | 6)


def reactors():
    """{thread id: (wake-ups so far, CPU seconds)} of this process's reactor threads."""
    out = {}
    for tid, wakeups in nixlkit.reactor_wakeups().items():
        try:
            out[tid] = (wakeups, thread_cpu_s(tid))
        except OSError:
            continue  # a thread that ended meanwhile
    return out


def agent_with_reactor(name, known):
    """The agent and its reactor thread's id (the one new thread of that name)."""
    ag = nixlkit.agent(name)
    new = set(reactors()) - known
    if len(new) != 1:
        raise SystemExit(f"expected one new reactor thread for {name}, found {len(new)}")
    return ag, new.pop()


def main():
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--after-ms", type=float, default=300)
    ap.add_argument("--poll-ms", type=float, default=5)
    args = ap.parse_args()
    ini, r_ini = agent_with_reactor("wakes-ini", set(reactors()))
    tgt, r_tgt = agent_with_reactor("wakes-tgt", set(reactors()) | {r_ini})
    src = (np.arange(PIECES * SIZE) % 251).astype(np.uint8)
    dst = np.zeros(2 * PIECES * SIZE, dtype=np.uint8)
    ini.register_memory(ini.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    tgt.register_memory(tgt.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    ini.add_remote_agent(tgt.get_agent_metadata())
    tgt.add_remote_agent(ini.get_agent_metadata())
    nixlkit.wait_ready(ini)
    nixlkit.wait_ready(tgt)
    h = ini.initialize_xfer(
        "WRITE",
        ini.get_xfer_descs([(src.ctypes.data + i * SIZE, SIZE, 0) for i in range(PIECES)], "DRAM"),
        ini.get_xfer_descs([(dst.ctypes.data + 2 * i * SIZE, SIZE, 0) for i in range(PIECES)], "DRAM"),
        "wakes-tgt", b"wakes")
    before = int(nixlkit.live_params(ini).get("stats.bounce_ok", 0))
    rows = []
    for _ in range(args.rounds):
        state = ini.transfer(h)
        while state not in ("DONE", "ERR"):
            state = ini.check_xfer_state(h)
            tgt.get_new_notifs()
        if state != "DONE":
            raise SystemExit("the WRITE failed")
        a = reactors()
        end = time.monotonic() + args.after_ms / 1e3
        while time.monotonic() < end:
            time.sleep(args.poll_ms / 1e3)
            ini.get_new_notifs()
            tgt.get_new_notifs()
        b = reactors()
        rows.append([(b[r][0] - a[r][0], (b[r][1] - a[r][1]) * 1e3) for r in (r_ini, r_tgt)])
    ini.get_new_notifs()
    bounced = int(nixlkit.live_params(ini).get("stats.bounce_ok", 0)) - before
    if bounced != args.rounds:
        raise SystemExit(f"only {bounced} of {args.rounds} WRITEs bounced")
    print(f"reactor wake-ups in the {args.after_ms:.0f} ms after each bounced WRITE of {PIECES} x {SIZE} B, "
          f"application polling every {args.poll_ms:g} ms, {args.rounds} rounds:")
    for i, who in enumerate(("initiator", "target")):
        wakes = [r[i][0] for r in rows]
        cpu = sum(r[i][1] for r in rows) / (args.rounds * args.after_ms)
        per = 1e3 * sum(r[i][1] for r in rows) / max(1, sum(wakes))
        print(f"  {who:9s}  median {statistics.median(wakes):6.0f}  (each round: {wakes})  "
              f"CPU {100 * cpu:.2f}% of a core, {per:.1f} us a wake-up")


if __name__ == "__main__":
    main()
