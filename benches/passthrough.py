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

Checked, outside the timed intervals, before any figure is printed (otherwise a FAIL line and
exit code 1, no table):
  - the path: the BOUNCE engine's counters (`stats.*`) read before and after each BOUNCE block.
    `passthrough_xfers` counts at prep (a request the gate hands to UCX is a UCX request, and
    every post of it is UCX's), so it must move by exactly the handles prepared (the two WRITE
    handles at set-up, one per sample of "prep+release"), and `bounce_xfers`, `cma_xfers` and
    `ipc_xfers`, which count posts, must not move at all: no post of any row bounced or took
    the same-host path;
  - the bytes: each echo buffer holds the 64 MiB destination, a 4 KiB guard, the 4 KiB
    destination and another guard, seed-distinct from the sources; the sources are refilled
    with new seeds before the last block, so after it the destinations must hold the new
    sources (a post of the last block wrote them) and the guards their first bytes. Compared
    once, after the echo process dumps its buffers on leaving.
A busy wait that sees no completion (or no pong) for DEADLINE_S stops the run with a message.

Expected on stderr, and said so after the table: "WARN dropping control frame peer="ini-BOUNCE"
... never loaded" lines (at most 10 a second). Each unload of meta-BOUNCE sends it a FORGET
(README "Trust model"), which meta-BOUNCE, never having loaded ini-BOUNCE, drops; the counts
(`forgets_sent`, meta-BOUNCE's `control_dropped`) are printed, and any frame ini-BOUNCE itself
dropped is flagged. Also, at times, a UCX "tcp_ep.c ... recv(-1) failed" ERROR from the same
unloads (in a two-agent script, 0-7 per 20 BOUNCE load+unload cycles, none for plain UCX's).
Loading ini-BOUNCE into meta-BOUNCE would turn most drops into replies racing the next unload,
and add frames to the measured agent's reactor: the row would measure something else.

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
SMALL = 4096
GUARD = 4096
# The echo's buffer: [0, BIG) the 64 MiB WRITE's destination, a guard, the 4 KiB WRITE's
# destination, a guard. The 4 KiB WRITE's source is the last 4 KiB of the 64 MiB one's, so the
# two destinations get different bytes.
SMALL_DST = BIG + GUARD
ECHO_BYTES = SMALL_DST + SMALL + GUARD
SMALL_SRC = BIG - SMALL
# Seeds, distinct per backend and role (index = the backend's place in BACKENDS).
ECHO_SEED, SRC_SEED, LAST_SRC_SEED = 40, 20, 30
DEADLINE_S = 30.0  # a busy wait with no completion for this long stops the run
# BOUNCE counters of the path: passthrough_xfers counts prepared handles, the others posts.
PATH_KEYS = ("passthrough_xfers", "bounce_xfers", "cma_xfers", "ipc_xfers")
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
    is polled, so that two spinning processes, not three, share the machine's cores. On leaving
    it writes each backend's buffer to `<flag_path>.<backend>` (the byte check)."""
    import mmap

    import nixlkit

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL's own log lines must not corrupt the reply lines
    parent = os.getppid()
    with open(flag_path, "r+b") as f:
        flag = mmap.mmap(f.fileno(), 1)
    agents, bufs = [], []
    for i, b in enumerate(BACKENDS):
        ag = nixlkit.agent(f"echo-{b}", (b,))
        buf = nixlkit.pattern(ECHO_SEED + i, ECHO_BYTES)
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
            for b, buf in zip(BACKENDS, bufs):
                buf.tofile(f"{flag_path}.{b}")
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
        self.src = nixlkit.pattern(SRC_SEED + BACKENDS.index(backend), BIG)
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
        self.small = self._prep(SMALL, SMALL_SRC, SMALL_DST)
        self.big = self._prep(BIG)

    def _prep(self, n, src_off=0, dst_off=0):
        ag = self.ag
        lo = ag.get_xfer_descs([(self.src.ctypes.data + src_off, n, 0)], "DRAM")
        re = ag.get_xfer_descs([(self.raddr + dst_off, n, 0)], "DRAM")
        return ag.initialize_xfer("WRITE", lo, re, self.peer, b"", backends=[self.backend])

    def refill(self):
        """New source bytes (in place: the buffer stays registered), before the last block."""
        import nixlkit

        self.src[:] = nixlkit.pattern(LAST_SRC_SEED + BACKENDS.index(self.backend), BIG)

    def counters(self):
        """The BOUNCE engine's counters now (getNotifs publishes them): {name: value}."""
        import nixlkit

        self.ag.get_new_notifs()  # only between blocks: no pong is outstanding then
        return {k[len("stats."):]: int(v) for k, v in nixlkit.live_params(self.ag, self.backend).items()
                if k.startswith("stats.")}

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
        raise SystemExit(f"FAIL: {self.backend}: the echo process never answered")

    def _pongs(self):
        n = 0
        for _, msgs in self.ag.get_new_notifs().items():
            n += sum(1 for m in msgs if m == b"pong")
        return n

    # One sample of each operation, in seconds.
    def notif_rtt(self):
        t0 = time.perf_counter()
        self.ag.send_notif(self.peer, b"ping")
        spins = 0
        while not self._pongs():
            spins += 1
            if not spins % 4096 and time.perf_counter() - t0 > DEADLINE_S:
                raise SystemExit(f"FAIL: {self.backend}: no pong within {DEADLINE_S:.0f} s of a ping")
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
        spins = 0
        while st not in ("DONE", "ERR"):
            st = self.ag.check_xfer_state(h)
            spins += 1
            if not spins % 1024 and st == "PROC" and time.perf_counter() - t0 > DEADLINE_S:
                raise SystemExit(f"FAIL: {self.backend}: a WRITE was still in flight after {DEADLINE_S:.0f} s")
        if st != "DONE":
            raise SystemExit(f"FAIL: {self.backend}: transfer failed ({st})")
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
# Handles each sample of a row prepares (each counted once in passthrough_xfers); other rows none.
PREPS_PER_SAMPLE = {"prep+release 1 desc": 1}
META_SHARE = dict((name, share) for name, _, share in META_OPS)["load+unload metadata"]
SETUP = "set-up (the two WRITE handles)"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def path_problems(moved, preps):
    """Why the BOUNCE engine's counters do not show every request of a row handed to UCX.
    `moved`: {row: {counter: change over the row's BOUNCE blocks}}, `preps`: {row: handles the
    row prepared}. Every prepared handle must count as one pass-through (the gate runs at prep),
    and no post may count on the bounce path or the same-host path (those count posts)."""
    problems = []
    for row, d in moved.items():
        elsewhere = {k: d[k] for k in PATH_KEYS[1:] if d.get(k)}
        if elsewhere:
            problems.append(f"BOUNCE {row}: posts left UCX ({', '.join(f'{k} +{v}' for k, v in elsewhere.items())})")
        want, got = preps.get(row, 0), d.get("passthrough_xfers", 0)
        if got != want:
            problems.append(f"BOUNCE {row}: passthrough_xfers moved by {got}, expected {want} "
                            f"(one per handle prepared)")
    return problems


def expected_echo(index, src):
    """What backend `index`'s echo buffer must hold after the last block: its own pattern, with
    the two destinations holding what the WRITEs of the last block sent."""
    import nixlkit

    exp = nixlkit.pattern(ECHO_SEED + index, ECHO_BYTES)
    exp[:BIG] = src
    exp[SMALL_DST:SMALL_DST + SMALL] = src[SMALL_SRC:]
    return exp


def byte_problems(backend, got, expected):
    """Where the echo's buffer differs from what it must hold, by region (empty: exact)."""
    import numpy as np

    if got.shape != expected.shape:
        return [f"{backend}: the echo's buffer has {got.size} bytes, expected {expected.size}"]
    regions = (("the 64 MiB WRITE's destination", 0, BIG), ("the guard after it", BIG, SMALL_DST),
               ("the 4 KiB WRITE's destination", SMALL_DST, SMALL_DST + SMALL),
               ("the guard after that", SMALL_DST + SMALL, ECHO_BYTES))
    out = []
    for name, lo, hi in regions:
        bad = np.flatnonzero(got[lo:hi] != expected[lo:hi])
        if bad.size:
            out.append(f"{backend}: {bad.size} of {hi - lo} bytes wrong in {name} (first at +{int(bad[0])})")
    return out


def run_blocks(ops, blocks, block, sides, samples, activate, moved, before_last=None):
    """`blocks` rounds of every op in `ops`, each a block of samples per backend in turn; the
    backends' order is swapped every block, so neither always runs first (right after the
    switch) or second. The BOUNCE engine's path counters are read around each of its blocks
    (untimed) and summed per row into `moved`. `before_last` runs before the last round."""
    bounce = sides["BOUNCE"]
    for k in range(blocks):
        if k == blocks - 1 and before_last:
            before_last()
        order = list(enumerate(BACKENDS))
        if k % 2:
            order.reverse()
        for name, method, share in ops:
            n = max(1, int(block * share))
            for i, b in order:  # interleaved: each block alternates the backends
                activate(i)
                f = getattr(sides[b], method)
                c0 = bounce.counters() if b == "BOUNCE" else None
                f()  # one warm-up per block keeps a cold first sample out of the tail
                samples[b][name].extend(f() for _ in range(n))
                if c0 is not None:
                    c1 = bounce.counters()
                    row = moved.setdefault(name, {})
                    for key in set(c0) | set(c1):
                        if c1.get(key, 0) != c0.get(key, 0):
                            row[key] = row.get(key, 0) + c1.get(key, 0) - c0.get(key, 0)


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
    import shutil
    import tempfile

    import nixlkit

    tmp = tempfile.mkdtemp(prefix="passthrough-")
    flag_path = os.path.join(tmp, "active")
    with open(flag_path, "wb") as f:
        f.write(b"\0")
    flag = open(flag_path, "r+b")

    def activate(i):
        flag.seek(0)
        flag.write(bytes([i]))
        flag.flush()

    proc = subprocess.Popen([sys.executable, __file__, "--echo", flag_path], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    run, failed = {}, None
    try:
        measure(args, proc, activate, run)
    except SystemExit as e:  # a failed or stuck transfer, an echo that never answered
        failed = e.code
    finally:
        # Whatever happened (a SystemExit from a failed transfer, Ctrl-C, ...), the echo
        # process must not busy-poll on: tell it to leave (the flag; a closed stdin if it still
        # waits for our metadata), and kill it if it does not. It dumps its buffers first.
        activate(len(BACKENDS))
        try:
            proc.stdin.close()
        except OSError:
            pass
        end = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < end:
            # Our agents keep progressing while the echo leaves (it dumps 2 x 64 MiB first).
            for s in run.get("sides", {}).values():
                s.ag.get_new_notifs()
            time.sleep(0.001)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "samples" not in run:
            shutil.rmtree(tmp, ignore_errors=True)
    if failed is not None:
        print(failed if isinstance(failed, str) else f"FAIL: exit {failed}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        nixlkit.leave(1)
    rc = report(args, run, flag_path)
    shutil.rmtree(tmp, ignore_errors=True)
    nixlkit.leave(rc)


def measure(args, proc, activate, run):
    """Joins the echo process and measures; what it found goes into `run`."""
    hellos = [json.loads(proc.stdout.readline()) for _ in BACKENDS]
    sides = run["sides"] = {b: Side(b, h) for b, h in zip(BACKENDS, hellos)}
    for s in sides.values():
        proc.stdin.write(base64.b64encode(s.ag.get_agent_metadata()).decode() + "\n")
    proc.stdin.flush()
    bounce = sides["BOUNCE"]
    moved = run["moved"] = {}
    for i, s in enumerate(sides.values()):
        activate(i)
        s.wait_first_pong()
        c0 = s.counters() if s is bounce else None
        s.prepare()
        if c0 is not None:
            c1 = s.counters()
            moved[SETUP] = {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)}
    meta0 = dropped(bounce.other)
    ini0 = bounce.counters()
    samples = {b: {name: [] for name, _, _ in OPS + META_OPS} for b in BACKENDS}
    blocks = max(1, args.rounds // args.block)

    def refill():
        for s in sides.values():
            s.refill()

    run_blocks(OPS, blocks, args.block, sides, samples, activate, moved, before_last=refill)
    run_blocks(META_OPS, blocks, args.block, sides, samples, activate, moved)
    ini1 = bounce.counters()
    run["ini_dropped"], run["forgets"] = (ini1.get(k, 0) - ini0.get(k, 0) for k in ("control_dropped", "forgets_sent"))
    # meta-BOUNCE's reactor handles the last FORGETs a moment later: up to a second for them.
    end = time.monotonic() + 1.0
    while (d := dropped(bounce.other) - meta0) < run["forgets"] and time.monotonic() < end:
        time.sleep(0.01)
    run["meta_dropped"] = d
    run["blocks"] = blocks
    run["preps"] = {SETUP: 2, **{name: blocks * (max(1, int(args.block * share)) + 1) * PREPS_PER_SAMPLE[name]
                                 for name, _, share in OPS + META_OPS if name in PREPS_PER_SAMPLE}}
    run["posts"] = {name: blocks * (max(1, int(args.block * share)) + 1)
                    for name, method, share in OPS if method.startswith("write")}
    run["samples"] = samples


def dropped(ag):
    """Control frames a BOUNCE agent dropped so far (getNotifs publishes the counter)."""
    import nixlkit

    ag.get_new_notifs()
    return int(nixlkit.live_params(ag, "BOUNCE").get("stats.control_dropped", 0))


def report(args, run, flag_path):
    """Checks the path and the bytes, then prints the table (or FAIL lines); the exit code."""
    import numpy as np

    samples, sides = run["samples"], run["sides"]
    problems = path_problems(run["moved"], run["preps"])
    for i, b in enumerate(BACKENDS):
        path = f"{flag_path}.{b}"
        if not os.path.exists(path):
            problems.append(f"{b}: the echo process left no dump of its buffer")
            continue
        problems += byte_problems(b, np.fromfile(path, dtype=np.uint8), expected_echo(i, sides[b].src))
    if problems:
        for p in problems:
            print(f"FAIL: {p}")
        print("FAIL: no figure of this run measures the pass-through; none printed")
        return 1
    samples = run["samples"]
    blocks = run["blocks"]
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
    setup = run["moved"][SETUP]
    reasons = ", ".join(f"{k} +{v}" for k, v in sorted(setup.items()) if k.startswith("fallback_"))
    posts = " and ".join(f"{n} {name[len('WRITE '):]}" for name, n in run["posts"].items())
    preps = run["preps"]["prep+release 1 desc"]
    print(f"  checked: BOUNCE's WRITE handles passed through to UCX at prep ({reasons}); none of their "
          f"{posts} posts, nor any other call, took the bounce path, CMA or CUDA IPC (bounce_xfers, "
          f"cma_xfers, ipc_xfers unchanged); the {preps} preps of 'prep+release' all passed through")
    print("  checked: both echo buffers hold the last block's sources in their destinations and "
          "their own bytes around them")
    loads = run["blocks"] * (max(1, int(args.block * META_SHARE)) + 1)
    if run["meta_dropped"] or run["forgets"]:
        print(f"  note: the 'WARN dropping control frame peer=\"ini-BOUNCE\" ... never loaded' lines on "
              f"stderr (at most 10 a second) are meta-BOUNCE's: on the {loads} unloads of "
              f"'load+unload metadata' ini-BOUNCE sent it {run['forgets']} FORGETs (README \"Trust "
              f"model\"), and meta-BOUNCE, which never loads ini-BOUNCE, dropped {run['meta_dropped']} "
              f"frame(s): expected, harmless to every figure above")
    print(f"  note: a UCX 'tcp_ep.c ... recv(-1) failed: Input/output error' line on stderr, when there "
          f"is one, comes from ini-BOUNCE's unloads of meta-BOUNCE on 'load+unload metadata' (UCX closing the "
          f"endpoints to an agent of this process; plain UCX's unloads print none): harmless to every figure above")
    if run["ini_dropped"]:
        print(f"  WARNING: ini-BOUNCE dropped {run['ini_dropped']} control frames: not explained by "
              f"this benchmark (see the WARN lines on stderr)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f)
    return 0


if __name__ == "__main__":
    main()
