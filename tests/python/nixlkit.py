"""Shared helpers for the end-to-end tests: agents, seed-distinct patterns, scattered layouts,
byte-exact checks (destinations AND the bytes around them), and two-process peers.

Every test here talks to the real NIXL 1.5.1 from PyPI with the BOUNCE plugin installed by
ci/setup; nothing is mocked.
"""
import os
import time

import numpy as np
try:  # the PyPI twin for CUDA 13 hosts (the GPU machine) has the same API
    import nixl_cu12 as nixl_package
except ImportError:  # pragma: no cover - only where nixl-cu12 is absent
    import nixl_cu13 as nixl_package
nixl_agent = nixl_package.nixl_agent
nixl_agent_config = nixl_package.nixl_agent_config
nixl_thread_sync_t = nixl_package.nixl_thread_sync_t


def plugin_dir():
    """The plugin folder of whichever NIXL wheel is installed (nixl-cu12 here, nixl-cu13 on the
    GPU host): `.<package>.mesonpy.libs/plugins` beside the package."""
    site = os.path.dirname(os.path.dirname(nixl_package.__file__))
    return os.path.join(site, f".{nixl_package.__name__}.mesonpy.libs", "plugins")

DEADLINE_S = 30.0


def agent(name, backends=("BOUNCE",), params=None, threads=False):
    """A NIXL agent with no progress thread (tests poll both sides) and the given backends."""
    cfg = nixl_agent_config(enable_prog_thread=False, backends=[],
                            num_threads=0)
    if threads:
        cfg = nixl_agent_config(enable_prog_thread=False, backends=[],
                                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    a = nixl_agent(name, cfg)
    for b in backends:
        # Host memory unless the test asks otherwise: with bounce_arena_mem=auto an agent made
        # after a GPU test in the same process (a current CUDA context) gets a GPU arena, and
        # its DRAM transfers stay on UCX (seen on the GPU host: every later DRAM READ and
        # one-way test failed when run in one pytest session after test_gpu.py).
        defaults = {"bounce_arena_mem": "dram"} if b == "BOUNCE" else {}
        a.create_backend(b, {**defaults, **(params or {})})
    return a


def live_params(ag, backend="BOUNCE"):
    """The backend's params as the engine reports them NOW (NIXL's getBackendParams; the Python
    wrapper's get_backend_params returns a copy cached at creation)."""
    return dict(ag.agent.getBackendParams(ag.backends[backend])[0])


def wait_ready(ag, n=1, deadline=DEADLINE_S, backend="BOUNCE"):
    """Waits until `ag` may bounce to `n` peers (they loaded our metadata, said HELLO and answered
    our ask about it)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        poll(ag)  # getNotifs refreshes the published counters
        if int(live_params(ag, backend).get("stats.peers_ready", 0)) >= n:
            return
        time.sleep(0.001)
    raise AssertionError(f"{n} bounce-ready peer(s) never appeared")


def pattern(seed, nbytes):
    """Bytes that differ for every seed, so a mix-up between transfers can't go unnoticed."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def register(ag, arr, backend="BOUNCE"):
    descs = ag.get_reg_descs([(addr(arr), arr.nbytes, dev(arr), "")], mem(arr))
    return ag.register_memory(descs, backends=[backend])


class Gaps:
    """The gaps a spinning application left between its calls into the plugin: on a loaded
    machine it is kept off its core now and then, for longer than a run of driving tolerates
    (`longest_s`), and each such gap may cost its reactor thread a few wake-ups (a new run, a
    short stand-down) that are no fault of the pacing under test. Timed from one call's start to
    the next's: a call kept off its core, or waiting in the plugin, is as absent from the run
    of driving as the application between calls. The reactor tests' `Gaps`."""

    def __init__(self, longest_s):
        self.longest_s, self.last, self.broken = longest_s, None, 0

    def call(self):
        """The application calls into the plugin."""
        now = time.perf_counter()
        if self.last is not None and now - self.last > self.longest_s:
            self.broken += 1
        self.last = now

    def allowance(self, elapsed_s):
        """The wake-ups a reactor thread that sleeps its longest (1 ms) beside the calls may take
        in `elapsed_s`: one a millisecond and half as many more (its own wake-ups come late on a
        busy machine, and a wait cut short by a pass may follow), a few for each broken run, and
        a handful to start."""
        ms = int(elapsed_s * 1e3)
        return ms + ms // 2 + 6 * self.broken + 5

    def __repr__(self):
        return f"Gaps(broken={self.broken} over {self.longest_s * 1e6:.0f} us)"


class VramBuf:
    """A GPU buffer (a torch uint8 tensor) with the few numpy-like operations the helpers use:
    `nbytes`, `fill` from a host pattern, `host()` to copy it back, `tofile`."""

    def __init__(self, host_bytes, device=0):
        import torch
        self.device = device
        self.t = torch.empty(len(host_bytes), dtype=torch.uint8, device=f"cuda:{device}")
        self.fill(host_bytes)
        self.nbytes = len(host_bytes)

    def fill(self, host_bytes):
        import torch
        self.t.copy_(torch.from_numpy(np.ascontiguousarray(host_bytes)))
        torch.cuda.synchronize(self.device)

    def host(self):
        import torch
        torch.cuda.synchronize(self.device)
        return self.t.cpu().numpy()

    def tofile(self, path):
        self.host().tofile(path)


def addr(buf):
    """The address NIXL descriptors use for a host (numpy) or GPU (VramBuf) buffer."""
    return buf.t.data_ptr() if isinstance(buf, VramBuf) else buf.ctypes.data


def mem(buf):
    return "VRAM" if isinstance(buf, VramBuf) else "DRAM"


def dev(buf):
    return buf.device if isinstance(buf, VramBuf) else 0


def gpu_skip_reason():
    """Why GPU tests cannot run here (None when they can). CI has no GPU: there these tests
    say "skipped: no GPU" by design, and run on the GPU machine."""
    try:
        import torch
    except ImportError:
        return "no GPU: torch is not installed"
    if not torch.cuda.is_available():
        return "no GPU: torch sees no CUDA device"
    return None


class Scattered:
    """`n` pieces of `size` bytes: sources packed in order, destinations scattered (permuted
    slots in a buffer `spread` times larger, so most destination bytes must stay untouched)."""

    def __init__(self, n, size, seed, spread=2, sizes=None):
        self.n = n
        self.sizes = list(sizes) if sizes is not None else [size] * n
        # Mixed sizes shift each destination by 0..7 bytes (unaligned), so their slot is 8 bytes
        # wider than the largest piece: a shifted piece then always ends inside its own slot
        # (k*slot + 7 + max(sizes) < (k+1)*slot) and never overlaps the next slot's piece. Uniform
        # sizes are not shifted and keep slot == size (peers rebuild them from `size`).
        slot = max(self.sizes) + (8 if sizes is not None else 0)
        self.slot = slot
        rng = np.random.default_rng(seed + 1)
        self.slots = rng.permutation(n * spread)[:n]
        self.src_offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.src_bytes = int(sum(self.sizes))
        self.dst_bytes = int(n * spread * slot)
        # unaligned destinations when sizes are mixed: shift each by a seed-dependent amount
        self.dst_shift = [int(rng.integers(0, 8)) if sizes is not None else 0 for _ in range(n)]

    def src_list(self, base, dev=0):
        return [(base + int(o), s, dev) for o, s in zip(self.src_offsets, self.sizes)]

    def dst_list(self, base, dev=0):
        return [(base + int(k) * self.slot + sh, s, dev)
                for k, s, sh in zip(self.slots, self.sizes, self.dst_shift)]

    def expected(self, src, dst_before):
        out = dst_before.copy()
        for o, s, k, sh in zip(self.src_offsets, self.sizes, self.slots, self.dst_shift):
            d = int(k) * self.slot + sh
            out[d:d + s] = src[o:o + s]
        return out


def assert_same(actual, expected, what):
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual != expected)
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at offset {bad[0]}")


_mailbox = {}


def poll(ag):
    """Progresses `ag` and keeps the notifications it returns, so polling an agent for progress
    never loses a notification a later wait_notif looks for."""
    box = _mailbox.setdefault(id(ag), [])
    for sender, msgs in ag.get_new_notifs().items():
        box.extend((sender, m) for m in msgs)
    return box


def reactor_wakeups():
    """{thread id: voluntary context switches} of this process's BOUNCE reactor threads (Linux).
    A reactor thread gives its core up only to sleep, so each switch is one wake-up after a
    sleep (a park, or a wait for the driver's lock)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "bounce-reactor":
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                out[int(tid)] = next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue  # a thread that ended meanwhile
    return out


def wait_xfer(ag, handle, peers=(), deadline=DEADLINE_S, every=0.0):
    """Polls until the transfer is DONE (also polling `peers` so their side progresses), every
    `every` seconds (0: in a busy loop)."""
    end = time.monotonic() + deadline
    first = True
    while True:
        if every and not first:
            time.sleep(every)
        first = False
        state = ag.check_xfer_state(handle)
        for p in peers:
            poll(p)
        if state == "DONE":
            return
        if state == "ERR":
            raise AssertionError("transfer failed")
        if time.monotonic() > end:
            raise AssertionError("transfer did not finish in time")


def settle(ag, handle, deadline=10.0):
    """Posts `handle` and polls it until it settles: "DONE", "ERR" (a post or check that
    raised counts as "ERR"), or its last state when `deadline` seconds pass first. For tests
    where failing is the expected outcome (`wait_xfer` raises on it)."""
    end = time.monotonic() + deadline
    try:
        state = ag.transfer(handle)
        while state not in ("DONE", "ERR") and time.monotonic() < end:
            state = ag.check_xfer_state(handle)
    except Exception:
        state = "ERR"
    return state


def write_exact(tx, rx, rx_name, lay, src, dst, before, what, notif=b""):
    """A host-memory WRITE of Scattered `lay` from `src` (registered with `tx`) to `dst` (with
    `rx`, another agent of this process): posted, waited for (polling `rx` too), and every byte
    of `dst` checked against `before` with the pieces written."""
    h = tx.initialize_xfer("WRITE", tx.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM"),
                           tx.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM"), rx_name, notif)
    tx.transfer(h)
    wait_xfer(tx, h, peers=[rx])
    assert_same(dst, lay.expected(src, before), what)


def wait_notif(ag, sender, msg, others=(), deadline=DEADLINE_S):
    """Polls `ag` until `msg` from `sender` arrives."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        box = poll(ag)
        for o in others:
            poll(o)
        if (sender, msg) in box:
            box.remove((sender, msg))
            return
        time.sleep(0.0005)
    raise AssertionError(f"notification {msg!r} from {sender} never arrived")


def commands(idle, active, interval=lambda: 0.0005):
    """The JSON-line commands of a helper process's stdin, one dict each. While `active()`,
    waiting for the next one calls `idle()` every `interval()` seconds (0.5 ms: to keep the
    agents polled); at the end of input the process leaves."""
    import json
    import select
    import sys
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], interval() if active() else None)
        if not ready:
            idle()
            continue
        line = sys.stdin.readline()
        if not line:
            leave(0)
        yield json.loads(line)


def serve(handlers, idle, active, interval=lambda: 0.0005):
    """A helper process's command loop: each JSON-line command `{"op": name, ...}` from stdin
    goes to `handlers[name](cmd)`, whose dict (anything else: nothing) is the reply, one JSON line with
    `"ok": true` added; "exit" replies and leaves; an unknown op or an exception is replied as
    `{"ok": false, "error": ...}` and the loop goes on (the test decides). Replies get a private
    copy of stdout; whatever else writes to fd 1 (NIXL's own log lines) goes to stderr. `idle`,
    `active` and `interval` as for `commands`."""
    import json
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(**kw):
        kw.setdefault("ok", True)
        out.write(json.dumps(kw) + "\n")
        out.flush()

    for cmd in commands(idle, active, interval):
        op = cmd["op"]
        try:
            if op == "exit":
                reply()
                leave(0)
            elif op in handlers:
                r = handlers[op](cmd)
                reply(**(r if isinstance(r, dict) else {}))
            else:
                reply(ok=False, error=f"unknown op {op}")
        except Exception as e:  # report, keep serving: the test decides
            reply(ok=False, error=f"{type(e).__name__}: {e}")


BEFORE_LEAVE = []
if os.environ.get("NIXL_BOUNCE_MARKS"):
    # BOUNCE's flight recorder writes its marks every 20 ms from a thread of its own; an exit
    # without teardown (below) would lose the last ones (a benchmark's final transfers).
    BEFORE_LEAVE.append(lambda: time.sleep(0.05))


def gpu_trace(name):
    """With BENCH_TRACE=DIR (GPU benchmarks), records this process's CUDA activity (CUPTI, through
    torch.profiler: every kernel and copy in the process, the plugin's included) until `leave`,
    which writes DIR/NAME.json (Chrome trace). No-op without BENCH_TRACE."""
    out = os.environ.get("BENCH_TRACE")
    if not out:
        return
    import torch.profiler as tp
    prof = tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA])
    prof.start()

    def export():
        prof.stop()
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"{name}.json"))

    BEFORE_LEAVE.append(export)


def leave(code=0):
    """Exit without running interpreter teardown: NIXL 1.5.1's bundled networking library can
    crash at normal exit (see the plugin facts). Engine unload is tested explicitly elsewhere.
    Runs BEFORE_LEAVE first (trace writers)."""
    import sys
    for f in BEFORE_LEAVE:
        f()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
