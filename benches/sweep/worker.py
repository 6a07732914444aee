"""One side of a sweep pair, in its own process: a NIXL agent with one backend variant, a
registered buffer per memory kind, and (initiator) the measured closed loop or (target) a
thread receiving the notifications. Driven over stdin/stdout with one JSON object per line,
like tests/python/peer.py.

Commands (every reply is one JSON line with "ok"):
  {"op": "start", "name", "backend", "params", "sync", "mems": {"DRAM": bytes, ...}}
      -> {"meta": b64, "addr": {mem: address}}
  {"op": "load", "meta": b64}           add the other side's agent
  {"op": "ready", "backend"}            (BOUNCE) wait until the peer may take the bounce path
  {"op": "pace", "us"}                  (target) poll notifications every `us` us from now
      -> {"notifs": received so far, "cpu": process CPU seconds so far, "threads": per name}
  {"op": "run", "point", "budget", "peer", "raddr", "src", "notif_thread", "notif"}
      (initiator) one measurement -> {"lat", "loop_wall", "bytes", "stats_before", "stats_after",
      "cpu", "threads", "check_calls", "check_call_s", "notif_calls", "notif_call_s"}
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


class Buffers:
    """One registered buffer per memory kind; VRAM through torch on CUDA."""

    def __init__(self, ag, backend, sizes, gpu):
        self.keep, self.addr, self.dev = [], {}, {}
        for mem, nbytes in sizes.items():
            if mem == "DRAM":
                arr = np.ones(nbytes, dtype=np.uint8)  # touched: no first-write page faults
                addr, dev = arr.ctypes.data, 0
            else:
                import torch  # only where VRAM is swept (the driver checked CUDA is there)
                arr = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
                addr, dev = arr.data_ptr(), gpu
            self.keep.append(arr)
            self.addr[mem], self.dev[mem] = addr, dev
            ag.register_memory(ag.get_reg_descs([(addr, nbytes, dev, "")], mem), backends=[backend])


def layout(base, dev, region_off, size, count, slots):
    """Nx3 (address, length, device) rows for `count` descriptors at `slots` of a region."""
    rows = np.empty((count, 3), dtype=np.int64)
    rows[:, 0] = base + region_off + slots.astype(np.int64) * size
    rows[:, 1] = size
    rows[:, 2] = dev
    return rows


class Initiator:
    def __init__(self, ag, bufs):
        self.ag, self.bufs = ag, bufs

    def requests(self, cmd):
        """Prepared handles, one per request in flight; each request its own region while the
        buffer has room (then regions are shared: the bytes race, the timing does not care)."""
        p, ag = cmd["point"], self.ag
        size, count, conc, mem = p["size"], p["count"], p["conc"], p["mem"]
        region = size * count * SPREAD
        nreg = max(1, min(conc, cmd["buffer_bytes"] // region))
        rng = np.random.default_rng(count * 7919 + size)
        handles = []
        for r in range(conc):
            off = (r % nreg) * region
            dst = rng.permutation(count * SPREAD)[:count]
            src = rng.permutation(count * SPREAD)[:count] if cmd["src"] == "scattered" else np.arange(count)
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
                    if n >= b["max_samples"] or (el >= b["max_time"] and n > 0) \
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
        return dict(lat=lat, loop_wall=wall, bytes=completed * p["size"] * p["count"], cpu=cpu,
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
                bufs = Buffers(ag, cmd["backend"], cmd["mems"], cmd.get("gpu", 0))
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
