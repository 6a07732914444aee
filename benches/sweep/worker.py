"""One side of a sweep pair, in its own process: a NIXL agent with one backend variant, a
registered buffer per memory kind, and (initiator) the measured closed loop or (target) a
thread receiving the notifications. Driven over stdin/stdout with one JSON object per line,
like tests/python/peer.py.

Commands (every reply is one JSON line with "ok"):
  {"op": "start", "name", "backend", "params", "sync", "mems": {"DRAM": bytes, ...}, "seed"}
      -> {"meta": b64, "addr": {mem: address}}
  {"op": "load", "meta": b64}           add the other side's agent
  {"op": "ready", "backend"}            (BOUNCE) wait until the peer may take the bounce path
  {"op": "fill", "mem", "seed"}         fill the whole buffer of `mem` with the pattern of `seed`
  {"op": "pace", "us"}                  (target) poll notifications every `us` us from now
      -> {"notifs": received so far, "cpu": process CPU seconds so far, "threads": per name}
  {"op": "wait_notifs", "want", "timeout_s"}
      (target) wait until `want` notifications were received in all (or the timeout)
      -> {"notifs": received so far}
  {"op": "run", "point", "budget", "peer", "raddr", "src", "notif_thread", "notif"}
      (initiator) one measurement -> {"lat", "loop_wall", "bytes", "completed", "stats_before",
      "stats_after", "cpu", "threads", "check_calls", "check_call_s", "notif_calls", "notif_call_s"}
  {"op": "check", "side", "mem", "point", "buffer_bytes", "src", "seeds": {side: seed}}
      after a measurement, both sides filled before it with `seeds`: the destination side checks
      that every destination slot holds its source slot's bytes and every other byte of its
      buffer its own pattern; the source side that its buffer is untouched -> {"problems": [...]}
  {"op": "exit"}
"""
import base64
import json
import os
import resource
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "python"))
import nixlkit  # noqa: E402  (the test suite's agent helpers: one way to build agents)
from nixlkit import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # noqa: E402

SYNC = {"none": nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW}
SPREAD = 2  # scattered layouts pick `count` slots out of SPREAD * count


def cpu_seconds():
    """CPU time of this whole process (every thread: BOUNCE's reactor and copy workers too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu():
    """CPU seconds per thread name (/proc: the reactor, copy workers, UCX's and Python's own
    threads), summed over threads of the same name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


# The data check. Each side fills its buffer with a pattern of its own seed before every
# measurement (a fresh seed each time, so bytes left by an earlier measurement, or by a stale
# staging buffer, never pass for this one's), and afterwards the destination side recomputes
# what each destination slot must hold from the source side's seed. A pattern is a random tile of
# a prime length repeated: slot k of a region starts k * size bytes into it, a different place in
# the tile for every slot (size and the prime share no factor), so a slot written to the wrong
# place does not match either.
PERIOD = 4194301  # prime, 4 MiB - 3
_tiles = {}


def tile(seed):
    t = _tiles.get(seed)
    if t is None:
        if len(_tiles) >= 4:
            _tiles.pop(next(iter(_tiles)))
        t = _tiles[seed] = np.frombuffer(np.random.default_rng(seed).bytes(PERIOD), dtype=np.uint8)
    return t


def _pieces(n, start):
    """(lo, hi, k): bytes lo..hi of n bytes of a pattern taken from offset `start` of it are the
    tile's bytes from k on."""
    pos, k = 0, start % PERIOD
    while pos < n:
        m = min(PERIOD - k, n - pos)
        yield pos, pos + m, k
        pos, k = pos + m, 0


def fill_pattern(dst, seed, start=0):
    """Writes into `dst` (uint8) the bytes start.. of the pattern of `seed`."""
    t = tile(seed)
    for lo, hi, k in _pieces(len(dst), start):
        dst[lo:hi] = t[k:k + hi - lo]


def first_difference(a, seed, start=0):
    """The index of the first byte of `a` that is not the pattern's (from `start`), or None."""
    t = tile(seed)
    for lo, hi, k in _pieces(len(a), start):
        if not np.array_equal(a[lo:hi], t[k:k + hi - lo]):
            return lo + int(np.flatnonzero(a[lo:hi] != t[k:k + hi - lo])[0])
    return None


class Scratch:
    """Two reusable host arrays for the expected contents of a region (kept between checks:
    allocating them again would fault every page in again)."""

    def __init__(self):
        self.arrs = [None, None]

    def get(self, i, n):
        if self.arrs[i] is None or len(self.arrs[i]) < n:
            self.arrs[i] = None
            self.arrs[i] = np.empty(n, dtype=np.uint8)
        return self.arrs[i][:n]


def check_destination(buf, size, region, requests, own_seed, src_seed, scratch=None):
    """Problems (strings; none when all is well) of the destination buffer `buf` after a
    measurement: `requests` is [(off, dst_slots, src_slots)], request r having copied the source
    buffer's slots `src_slots` of its region at `off` to the slots `dst_slots` of the region at
    `off` here (slots of `size` bytes; the source buffer held the pattern of `src_seed`, this
    one that of `own_seed`). Every destination slot must hold its source slot's bytes (where
    requests share a region, those of one of the requests that wrote it: they race), every
    other slot of the regions and every byte past them the pattern of `own_seed`."""
    scratch = scratch or Scratch()
    problems = []
    nslots = region // size
    step = max(1, (8 << 20) // size)  # rows compared at once: 8 MiB
    by_off = {}
    for off, d, s in requests:
        by_off.setdefault(off, []).append((np.asarray(d), np.asarray(s)))
    word = np.uint64 if size % 8 == 0 else np.uint8  # compare 8 bytes at a time where rows allow

    def rows(a):
        return a.view(word).reshape(nslots, -1)

    for off, reqs in sorted(by_off.items()):
        got = rows(buf[off:off + region])
        src = scratch.get(0, region)
        fill_pattern(src, src_seed, off)
        src = rows(src)
        own = scratch.get(1, region)
        fill_pattern(own, own_seed, off)
        own = rows(own)
        # Each written slot's source slot: the request whose source's first 8 bytes it holds
        # (requests sharing the region race for its slots), then one full compare per slot.
        touched, ok = np.zeros(nslots, dtype=bool), np.zeros(nslots, dtype=bool)
        source = np.full(nslots, -1, dtype=np.int64)
        head = 1 if word is np.uint64 else min(size, 8)
        for d, s in reqs:
            touched[d] = True
            hit = (got[d, :head] == src[s, :head]).all(axis=1)
            source[d[hit]] = s[hit]
        slot = np.flatnonzero(touched & (source >= 0))
        for b in range(0, len(slot), step):
            ok[slot[b:b + step]] = (got[slot[b:b + step]] == src[source[slot[b:b + step]]]).all(axis=1)
        bad = np.flatnonzero(touched & ~ok)
        if len(bad):
            problems.append(f"{len(bad)} of {int(touched.sum())} destination slots of the region at offset "
                            f"{off} do not hold their source's bytes (first at offset {off + int(bad[0]) * size})")
        same = np.empty(nslots, dtype=bool)
        for b in range(0, nslots, step):
            same[b:b + step] = (got[b:b + step] == own[b:b + step]).all(axis=1)
        changed = np.flatnonzero(~touched & ~same)
        if len(changed):
            problems.append(f"{len(changed)} slots outside the destinations of the region at offset {off} "
                            f"changed (first at offset {off + int(changed[0]) * size})")
    past = max(by_off) + region if by_off else 0
    at = first_difference(buf[past:], own_seed, past)
    if at is not None:
        problems.append(f"bytes past the requests' regions changed (first at offset {past + at})")
    return problems


def check_source(buf, own_seed):
    """Problems of a source buffer after a measurement: it must still hold its own pattern."""
    at = first_difference(buf, own_seed)
    return [] if at is None else [f"the source buffer changed (first at offset {at})"]


class Buffers:
    """One registered buffer per memory kind; VRAM through torch on CUDA. Filled with a
    pattern of `seed` (touched: no first-write page faults later)."""

    def __init__(self, ag, backend, sizes, gpu, seed):
        self.keep, self.addr, self.dev, self.host = {}, {}, {}, {}
        for mem, nbytes in sizes.items():
            if mem == "DRAM":
                arr = np.empty(nbytes, dtype=np.uint8)
                addr, dev = arr.ctypes.data, 0
            else:
                import torch  # only where VRAM is swept (the driver checked CUDA is there)
                arr = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
                addr, dev = arr.data_ptr(), gpu
            self.keep[mem] = arr
            self.addr[mem], self.dev[mem] = addr, dev
            self.fill(mem, seed)
            ag.register_memory(ag.get_reg_descs([(addr, nbytes, dev, "")], mem), backends=[backend])

    def fill(self, mem, seed):
        arr = self.keep[mem]
        if mem == "DRAM":
            fill_pattern(arr, seed)
            return
        import torch
        host = self.host.get(mem)
        if host is None:
            host = self.host[mem] = np.empty(arr.numel(), dtype=np.uint8)
        fill_pattern(host, seed)
        arr.copy_(torch.from_numpy(host))
        torch.cuda.synchronize(arr.device)

    def contents(self, mem):
        """The buffer's bytes as a host array (DRAM: the buffer itself)."""
        arr = self.keep[mem]
        return arr if mem == "DRAM" else arr.cpu().numpy()


def layout(base, dev, region_off, size, count, slots):
    """Nx3 (address, length, device) rows for `count` descriptors at `slots` of a region."""
    rows = np.empty((count, 3), dtype=np.int64)
    rows[:, 0] = base + region_off + slots.astype(np.int64) * size
    rows[:, 1] = size
    rows[:, 2] = dev
    return rows


def request_slots(point, buffer_bytes, src_mode):
    """(region, [(off, initiator_slots, target_slots)] per request in flight): request r uses
    the region at `off` of both buffers, its own while the buffer has room (then regions are
    shared: the bytes race, the timing does not care), `count` slots of `size` bytes out of
    SPREAD * count there: scattered on the target, scattered or packed on the initiator (`src`).
    Deterministic, so the side that checks the bytes can recompute it."""
    size, count, conc = point["size"], point["count"], point["conc"]
    region = size * count * SPREAD
    nreg = max(1, min(conc, buffer_bytes // region))
    rng = np.random.default_rng(count * 7919 + size)
    out = []
    for r in range(conc):
        dst = rng.permutation(count * SPREAD)[:count]
        src = rng.permutation(count * SPREAD)[:count] if src_mode == "scattered" else np.arange(count)
        out.append(((r % nreg) * region, src, dst))
    return region, out


def check(bufs, cmd, scratch):
    """The "check" command: this side's problems after a measurement."""
    p, side = cmd["point"], cmd["side"]
    buf = bufs.contents(cmd["mem"])
    dest = "target" if p["op"] == "WRITE" else "initiator"
    other = "initiator" if side == "target" else "target"
    if side != dest:
        return check_source(buf, cmd["seeds"][side])
    region, slots = request_slots(p, cmd["buffer_bytes"], cmd["src"])
    # request r moved initiator slots `ini` to target slots `tgt` (WRITE) or back (READ)
    reqs = [(off, tgt, ini) if side == "target" else (off, ini, tgt) for off, ini, tgt in slots]
    if os.environ.get("BENCH_SWEEP_TEST_CORRUPT") == "1":  # the test suite's broken transfer
        off, d, _ = reqs[0]
        buf[off + int(d[0]) * p["size"]] ^= 0xFF
    return check_destination(buf, p["size"], region, reqs, cmd["seeds"][side], cmd["seeds"][other], scratch)


class Initiator:
    def __init__(self, ag, bufs):
        self.ag, self.bufs = ag, bufs

    def requests(self, cmd):
        """Prepared handles, one per request in flight (see `request_slots`)."""
        p, ag = cmd["point"], self.ag
        size, count, mem = p["size"], p["count"], p["mem"]
        handles = []
        _, slots = request_slots(p, cmd["buffer_bytes"], cmd["src"])
        for r, (off, src, dst) in enumerate(slots):
            lo = layout(self.bufs.addr[mem], self.bufs.dev[mem], off, size, count, src)
            re = layout(cmd["raddr"][mem], cmd["rdev"][mem], off, size, count, dst)
            notif = f"n{r}".encode() if cmd["notif"] else b""
            handles.append(ag.initialize_xfer(p["op"], ag.get_xfer_descs(lo, mem),
                                              ag.get_xfer_descs(re, mem), cmd["peer"], notif,
                                              backends=[cmd["backend"]]))
        return handles

    def run(self, cmd):
        """The closed loop: `conc` requests in flight; each one re-posted the moment it is
        DONE; a sample is one request's time from transfer() to the check that saw DONE."""
        ag, backend = self.ag, cmd["backend"]
        # Read before the requests are prepared: the gate counts its fallbacks at prep time.
        stats_before = nixlkit.live_params(ag, backend) if backend == "BOUNCE" else {}
        handles = self.requests(cmd)
        stop_notifs = threading.Event()
        notif_calls, notif_time = [0], [0.0]

        def notif_loop():  # the application's second thread
            t = time.perf_counter
            pause = cmd.get("notif_sleep_us", 0) * 1e-6
            while not stop_notifs.is_set():
                t0 = t()
                ag.get_new_notifs()
                notif_time[0] += t() - t0
                notif_calls[0] += 1
                if pause:
                    time.sleep(pause)

        helper = threading.Thread(target=notif_loop, daemon=True) if cmd["notif_thread"] else None
        if helper:
            helper.start()
        ok = False
        try:
            res = self.closed_loop(cmd, handles, stats_before, notif_calls, notif_time)
            ok = True
            return res
        finally:  # also on a failed transfer: no thread left polling a half-torn-down loop
            stop_notifs.set()
            if helper:
                helper.join()
            for h in handles:
                try:
                    ag.release_xfer_handle(h)
                except Exception:
                    if ok:  # after a failure the first error is the one to report
                        raise

    def closed_loop(self, cmd, handles, stats_before, notif_calls, notif_time):
        ag, b = self.ag, cmd["budget"]
        # One full round of the requests in flight is dropped too: their first completions come
        # in a burst (posted together), not at the steady state the samples should show.
        lat, warm = [], max(b["warmup"], len(handles))
        completed = 0
        posted = [0.0] * len(handles)
        live = [True] * len(handles)
        cpu0, threads0 = cpu_seconds(), thread_cpu()
        check_calls, check_time = 0, 0.0
        clock = time.perf_counter
        t_start = clock()
        t_measure = None
        for i, h in enumerate(handles):
            posted[i] = clock()
            if ag.transfer(h) == "ERR":
                raise RuntimeError("transfer() failed")
        sampling = True
        while any(live):
            for i, h in enumerate(handles):
                if not live[i]:
                    continue
                t0 = clock()
                state = ag.check_xfer_state(h)
                check_time += clock() - t0
                check_calls += 1
                if state == "PROC":
                    continue
                if state != "DONE":
                    raise RuntimeError(f"transfer ended {state}")
                now = clock()
                completed += 1
                if warm > 0:
                    warm -= 1
                    if warm == 0:
                        t_measure = now
                elif sampling:
                    lat.append(now - posted[i])
                if sampling and t_measure is not None:
                    n, el = len(lat), now - t_measure
                    if n >= b["max_samples"] or (el >= b["max_time"] and n >= max(1, b.get("floor", 1))) \
                            or (n >= b["min_samples"] and el >= b["min_time"]):
                        sampling = False
                if sampling:
                    posted[i] = clock()
                    if ag.transfer(h) == "ERR":
                        raise RuntimeError("transfer() failed")
                else:
                    live[i] = False
        cpu = cpu_seconds() - cpu0
        threads1 = thread_cpu()
        threads = {k: round(v - threads0.get(k, 0), 3) for k, v in threads1.items() if v - threads0.get(k, 0) > 0}
        wall = clock() - t_start
        stats_after = nixlkit.live_params(ag, cmd["backend"]) if cmd["backend"] == "BOUNCE" else {}
        p = cmd["point"]
        # Bandwidth as nixlbench gives it: every byte moved over the whole loop's time.
        return dict(lat=lat, loop_wall=wall, bytes=completed * p["size"] * p["count"], completed=completed, cpu=cpu,
                    notif_calls=notif_calls[0], notif_call_s=notif_time[0], check_calls=check_calls,
                    check_call_s=check_time, threads=threads,
                    stats_before=stats_before, stats_after=stats_after)


class Target:
    """Receives the transfers' notifications on a thread of its own, every `pace` us: the
    application on the other side waiting for its data. NIXL calls from the command thread
    and this one are serialized here, so the NONE sync mode stays safe."""

    def __init__(self, ag, lock):
        self.ag, self.lock = ag, lock
        self.pace = 0.005
        self.notifs = 0
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self):
        while True:
            with self.lock:
                for msgs in self.ag.get_new_notifs().values():
                    self.notifs += len(msgs)
            time.sleep(self.pace)


def main():
    out = os.fdopen(os.dup(1), "w")  # replies on a private stdout; NIXL's log lines to stderr
    os.dup2(2, 1)
    ag = bufs = role = None
    lock = threading.Lock()
    scratch = Scratch()

    def reply(**kw):
        kw.setdefault("ok", True)
        out.write(json.dumps(kw) + "\n")
        out.flush()

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "start":
                if list(cmd["mems"]) == ["VRAM"]:
                    # As frameworks do: the GPU is current before the agent exists, so BOUNCE's
                    # arena (bounce_arena_mem=auto) goes to that GPU's memory. A sweep of both
                    # memory kinds keeps a host arena, and its VRAM points pass through.
                    import torch
                    torch.cuda.set_device(cmd.get("gpu", 0))
                    torch.empty(1, device=f"cuda:{cmd.get('gpu', 0)}")
                cfg = nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=0,
                                        sync_mode=SYNC[cmd["sync"]])
                ag = nixl_agent(cmd["name"], cfg)
                ag.create_backend(cmd["backend"], dict(cmd.get("params") or {}))
                bufs = Buffers(ag, cmd["backend"], cmd["mems"], cmd.get("gpu", 0), cmd.get("seed", 1))
                if cmd["role"] == "target":
                    role = Target(ag, lock)
                else:
                    role = Initiator(ag, bufs)
                reply(meta=base64.b64encode(ag.get_agent_metadata()).decode(), addr=bufs.addr, dev=bufs.dev)
            elif op == "load":
                with lock:
                    ag.add_remote_agent(base64.b64decode(cmd["meta"]))
                reply()
            elif op == "ready":
                nixlkit.wait_ready(ag, 1, backend=cmd["backend"])
                reply()
            elif op == "fill":
                bufs.fill(cmd["mem"], cmd["seed"])
                reply()
            elif op == "check":
                reply(problems=check(bufs, cmd, scratch))
            elif op == "wait_notifs":
                end = time.monotonic() + cmd["timeout_s"]
                while role.notifs < cmd["want"] and time.monotonic() < end:
                    time.sleep(0.001)
                reply(notifs=role.notifs)
            elif op == "pace":
                role.pace = cmd["us"] * 1e-6
                reply(notifs=role.notifs, cpu=cpu_seconds(), threads=thread_cpu())
            elif op == "run":
                reply(**role.run(cmd))
            elif op == "exit":
                reply()
                nixlkit.leave(0)
            else:
                reply(ok=False, error=f"unknown op {op}")
        except Exception as e:  # reported to the driver, which stops the sweep with it
            reply(ok=False, error=f"{type(e).__name__}: {e}")
    nixlkit.leave(0)


if __name__ == "__main__":
    main()
