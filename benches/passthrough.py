"""Pass-through cost: every operation BOUNCE hands to UCX, measured against plain UCX in ONE run,
two processes, interleaved (a block of UCX samples and a block of BOUNCE samples, in turn, the
order of the two swapped every block), so that machine noise, and any cost of switching, lands on
both alike.

    .venv/bin/python benches/passthrough.py [--rounds 2000] [--block 100]

Measured per backend (the initiator process and the echo process each hold one agent per backend;
the echo polls get_new_notifs of the backend being measured and answers each "ping" with a "pong"):
  - notification round trip: send_notif, then get_new_notifs polled until the pong arrives;
  - one empty get_new_notifs call;
  - register + deregister of a 4 KiB buffer;
  - prep + release of a one-descriptor WRITE;
  - a one-descriptor 4 KiB WRITE and a 1 x 64 MiB WRITE (post, then check until DONE);
  - the agent's metadata made (get_agent_metadata: connection info and the public data of its
    one registration), and another agent's metadata loaded and unloaded (add_remote_agent,
    then remove_remote_agent, of a third agent of the same backend in this process with one
    registration). On BOUNCE a load of a peer that can bounce also loads its arena and mailbox
    registrations and greets it (HELLO), and the unload hands them back: work plain UCX has
    not, and the price of the bounce path's set-up, paid once per peer.
Prints p50 / p99 per backend and the BOUNCE / UCX ratio of the p50 columns.

Forced, whatever the environment says (an inherited value would change what a row measures):
NIXL_BOUNCE_CMA_LARGE_BYTES=0 (see FORCED_ENV); the output's first line says so.
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(os.path.dirname(HERE), "tests", "python")
sys.path.insert(0, PY)

BIG = 64 << 20
# Between two processes of one host a WRITE of at least bounce_cma_large_bytes takes the
# same-host path (CMA) instead of UCX: off here, so that the 64 MiB WRITE measures the
# pass-through, as between hosts. Forced (not setdefault): an inherited value would silently
# make the row measure CMA instead. Child processes inherit the environment.
FORCED_ENV = {"NIXL_BOUNCE_CMA_LARGE_BYTES": "0"}
OVERRIDDEN = {k: os.environ[k] for k, v in FORCED_ENV.items() if os.environ.get(k, v) != v}
os.environ.update(FORCED_ENV)
BACKENDS = ("UCX", "BOUNCE")


def echo(flag_path):
    """The echo process: one agent per backend, answering each ping with a pong and serving as the
    WRITE target. Only the agent of the backend being measured (a byte in the shared flag file)
    is polled, so that two spinning processes, not three, share the machine's cores."""
    import mmap

    import nixlkit

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL's own log lines must not corrupt the reply lines
    parent = os.getppid()
    with open(flag_path, "r+b") as f:
        flag = mmap.mmap(f.fileno(), 1)
    agents, bufs = [], []
    for b in BACKENDS:
        ag = nixlkit.agent(f"echo-{b}", (b,))
        buf = nixlkit.pattern(1, BIG)
        nixlkit.register(ag, buf, b)
        agents.append(ag)
        bufs.append(buf)
        out.write(json.dumps({"meta": base64.b64encode(ag.get_agent_metadata()).decode(),
                              "addr": buf.ctypes.data}) + "\n")
    out.flush()
    for ag in agents:
        ag.add_remote_agent(base64.b64decode(sys.stdin.readline()))
    spins = 0
    while True:
        active = flag[0]
        spins += 1
        # Told to leave, or the initiator is gone (killed before it could tell us): leave,
        # never busy-poll on for nobody.
        if active >= len(agents) or (spins % 4096 == 0 and os.getppid() != parent):
            out.write("bye\n")
            out.flush()
            nixlkit.leave(0)
        ag = agents[active]
        for sender, msgs in ag.get_new_notifs().items():
            for m in msgs:
                if m == b"ping":
                    ag.send_notif(sender, b"pong")


class Side:
    """The initiator's agent for one backend, joined to its agent in the echo process."""

    def __init__(self, backend, hello):
        import nixlkit

        self.backend = backend
        self.name = f"ini-{backend}"
        self.peer = f"echo-{backend}"
        self.raddr = hello["addr"]
        self.ag = nixlkit.agent(self.name, (backend,))
        self.src = nixlkit.pattern(2, BIG)
        nixlkit.register(self.ag, self.src, backend)
        self.ag.add_remote_agent(base64.b64decode(hello["meta"]))
        self.small = None
        self.big = None
        self.tiny = nixlkit.pattern(3, 4096)
        # A third agent of the backend whose metadata the initiator loads and unloads.
        self.other_name = f"meta-{backend}"
        self.other = nixlkit.agent(self.other_name, (backend,))
        self.other_buf = nixlkit.pattern(4, 4096)
        nixlkit.register(self.other, self.other_buf, backend)
        self.other_meta = self.other.get_agent_metadata()

    def prepare(self):
        self.small = self._prep(4096)
        self.big = self._prep(BIG)

    def _prep(self, n):
        ag = self.ag
        lo = ag.get_xfer_descs([(self.src.ctypes.data, n, 0)], "DRAM")
        re = ag.get_xfer_descs([(self.raddr, n, 0)], "DRAM")
        return ag.initialize_xfer("WRITE", lo, re, self.peer, b"", backends=[self.backend])

    def wait_first_pong(self, deadline_s=30.0):
        """The echo may need a moment to load our metadata: ping until the first pong."""
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
        raise SystemExit(f"{self.backend}: the echo process never answered")

    def _pongs(self):
        n = 0
        for _, msgs in self.ag.get_new_notifs().items():
            n += sum(1 for m in msgs if m == b"pong")
        return n

    # One sample of each operation, in seconds.
    def notif_rtt(self):
        t0 = time.perf_counter()
        self.ag.send_notif(self.peer, b"ping")
        while not self._pongs():
            pass
        return time.perf_counter() - t0

    def empty_poll(self):
        t0 = time.perf_counter()
        self.ag.get_new_notifs()
        return time.perf_counter() - t0

    def register(self):
        ag = self.ag
        t0 = time.perf_counter()
        d = ag.get_reg_descs([(self.tiny.ctypes.data, self.tiny.nbytes, 0, "")], "DRAM")
        r = ag.register_memory(d, backends=[self.backend])
        ag.deregister_memory(r, backends=[self.backend])
        return time.perf_counter() - t0

    def prep(self):
        t0 = time.perf_counter()
        h = self._prep(4096)
        self.ag.release_xfer_handle(h)
        return time.perf_counter() - t0

    def _write(self, h):
        t0 = time.perf_counter()
        st = self.ag.transfer(h)
        while st not in ("DONE", "ERR"):
            st = self.ag.check_xfer_state(h)
        if st != "DONE":
            raise SystemExit(f"{self.backend}: transfer failed")
        return time.perf_counter() - t0

    def get_metadata(self):
        t0 = time.perf_counter()
        self.ag.get_agent_metadata()
        return time.perf_counter() - t0

    def load_metadata(self):
        t0 = time.perf_counter()
        self.ag.add_remote_agent(self.other_meta)
        self.ag.remove_remote_agent(self.other_name)
        return time.perf_counter() - t0

    def write_4k(self):
        return self._write(self.small)

    def write_64m(self):
        return self._write(self.big)

OPS = [
    # name, method, samples per block relative to --block
    ("notif round trip", "notif_rtt", 1.0),
    ("empty getNotifs", "empty_poll", 1.0),
    ("register+deregister 4 KiB", "register", 0.2),
    ("prep+release 1 desc", "prep", 0.2),
    ("WRITE 1 x 4 KiB", "write_4k", 0.5),
    ("WRITE 1 x 64 MiB", "write_64m", 0.05),
]
# Measured after all of OPS, in blocks of their own: every load and unload leaves UCX endpoints
# closing in the initiator's worker, and interleaved with the rows above they slowed plain
# UCX's own calls there (an empty getNotifs 5 us instead of 1.7 on 2 cores).
META_OPS = [
    ("get metadata", "get_metadata", 0.2),
    ("load+unload metadata", "load_metadata", 0.1),
]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_blocks(ops, blocks, block, sides, samples, activate):
    """`blocks` rounds of every op in `ops`, each a block of samples per backend in turn; the
    backends' order is swapped every block, so neither always runs first (right after the
    switch) or second."""
    for k in range(blocks):
        order = list(enumerate(BACKENDS))
        if k % 2:
            order.reverse()
        for name, method, share in ops:
            n = max(1, int(block * share))
            for i, b in order:  # interleaved: each block alternates the backends
                activate(i)
                f = getattr(sides[b], method)
                f()  # one warm-up per block keeps a cold first sample out of the tail
                samples[b][name].extend(f() for _ in range(n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000, help="notification round trips per backend")
    ap.add_argument("--block", type=int, default=100, help="samples per backend before switching")
    ap.add_argument("--echo", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the raw samples to this file")
    args = ap.parse_args()
    if args.echo:
        echo(args.echo)
        return
    import nixlkit

    import tempfile

    flag_path = os.path.join(tempfile.mkdtemp(), "active")
    with open(flag_path, "wb") as f:
        f.write(b"\0")
    flag = open(flag_path, "r+b")

    def activate(i):
        flag.seek(0)
        flag.write(bytes([i]))
        flag.flush()

    proc = subprocess.Popen([sys.executable, __file__, "--echo", flag_path], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        measure(args, proc, activate)
    finally:
        # Whatever happened (a SystemExit from a failed transfer, Ctrl-C, ...), the echo
        # process must not busy-poll on: tell it to leave (the flag; a closed stdin if it still
        # waits for our metadata), and kill it if it does not.
        activate(len(BACKENDS))
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    nixlkit.leave(0)


def measure(args, proc, activate):
    """Joins the echo process, measures, prints (and writes --json)."""
    hellos = [json.loads(proc.stdout.readline()) for _ in BACKENDS]
    sides = {b: Side(b, h) for b, h in zip(BACKENDS, hellos)}
    for s in sides.values():
        proc.stdin.write(base64.b64encode(s.ag.get_agent_metadata()).decode() + "\n")
    proc.stdin.flush()
    for i, s in enumerate(sides.values()):
        activate(i)
        s.wait_first_pong()
        s.prepare()
    samples = {b: {name: [] for name, _, _ in OPS + META_OPS} for b in BACKENDS}
    blocks = max(1, args.rounds // args.block)
    for ops in (OPS, META_OPS):
        run_blocks(ops, blocks, args.block, sides, samples, activate)
    cpus = os.cpu_count()
    forced = " ".join(f"{k}={v}" for k, v in FORCED_ENV.items())
    print(f"pass-through cost, two processes, DRAM, no progress thread, {cpus} cores, "
          f"{blocks} interleaved blocks (order swapped every block); forced: {forced}"
          + (f" (overriding the environment's {', '.join(f'{k}={v}' for k, v in OVERRIDDEN.items())})"
             if OVERRIDDEN else ""))
    print(f"  {'operation':28s} {'UCX p50':>10s} {'UCX p99':>10s} {'BOUNCE p50':>11s} "
          f"{'BOUNCE p99':>11s} {'p50 ratio':>10s}")
    for name, _, _ in OPS + META_OPS:
        u, x = samples["UCX"][name], samples["BOUNCE"][name]
        ratio = pct(x, .5) / pct(u, .5)  # the ratio of the two p50 columns printed beside it
        unit, k = ("ms", 1e3) if "64 MiB" in name else ("us", 1e6)
        print(f"  {name:28s} {pct(u, .5)*k:8.1f}{unit} {pct(u, .99)*k:8.1f}{unit} "
              f"{pct(x, .5)*k:9.1f}{unit} {pct(x, .99)*k:9.1f}{unit} {ratio:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f)


if __name__ == "__main__":
    main()
