"""A NIXL agent in its own process for test_progress.py: created as frameworks create theirs
(NIXL's default config: a progress thread asked for), and polled only every `poll_ms` while idle
(a passive side that rarely calls into NIXL). Driven line by line over stdin/stdout (JSON), like
peer.py.

Commands (every reply is one JSON line with "ok"):
  {"op": "start", "name": N, "backend": B, "params": {...}, "size": BYTES, "seed": S,
   "poll_ms": P, "prog_thread": bool}         -> {"meta": b64, "addr": int}
  {"op": "load", "meta": b64}
  {"op": "read", "from": A, "n": N, "size": S, "seed": L, "raddr": R, "reps": K}
      K times: READ Scattered(N, S, L)'s destination slots at R (the remote buffer) into this
      buffer's first N * S bytes, polling only this agent -> {"seconds": [...], "state": "DONE"|"ERR"}
  {"op": "cpu", "seconds": T}  stay idle (polling every poll_ms) for T s -> {"cpu": s, "wall": s}
  {"op": "dump", "path": P}
  {"op": "params", "backend": B}  -> {"params": {...}}: the backend's live params (its counters:
      which path the transfers took), after a poll (getNotifs publishes them)
  {"op": "exit"}
"""
import base64
import resource
import time

import nixlkit
from nixlkit import nixl_agent, nixl_agent_config


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ag, buf, poll_s = None, None, 0.0005

    def poll():
        if ag is not None:
            ag.get_new_notifs()

    def start(cmd):
        nonlocal ag, buf, poll_s
        cfg = nixl_agent_config(enable_prog_thread=cmd.get("prog_thread", True), backends=[])
        ag = nixl_agent(cmd["name"], cfg)
        ag.create_backend(cmd["backend"], dict(cmd.get("params") or {}))
        buf = nixlkit.pattern(cmd.get("seed", 0), cmd["size"])
        nixlkit.register(ag, buf, cmd["backend"])
        poll_s = cmd.get("poll_ms", 0.5) / 1000
        return {"meta": base64.b64encode(ag.get_agent_metadata()).decode(), "addr": nixlkit.addr(buf)}

    def read(cmd):
        lay = nixlkit.Scattered(cmd["n"], cmd["size"], cmd["seed"])
        lo = ag.get_xfer_descs(lay.src_list(nixlkit.addr(buf)), "DRAM")
        re = ag.get_xfer_descs(lay.dst_list(cmd["raddr"]), "DRAM")
        times, state = [], "DONE"
        for _ in range(cmd.get("reps", 1)):
            h = ag.initialize_xfer("READ", lo, re, cmd["from"], b"")
            t0 = time.perf_counter()
            state = ag.transfer(h)
            end = time.monotonic() + nixlkit.DEADLINE_S
            while state not in ("DONE", "ERR") and time.monotonic() < end:
                state = ag.check_xfer_state(h)
            times.append(time.perf_counter() - t0)
            ag.release_xfer_handle(h)
            if state != "DONE":
                break
        return {"seconds": times, "state": state}

    def cpu(cmd):
        c0, t0 = cpu_seconds(), time.monotonic()
        while time.monotonic() - t0 < cmd["seconds"]:
            time.sleep(poll_s)
            poll()
        return {"cpu": cpu_seconds() - c0, "wall": time.monotonic() - t0}

    def params(cmd):
        poll()
        return {"params": nixlkit.live_params(ag, cmd.get("backend", "BOUNCE"))}

    # Polled every `poll_ms` of its start command: a passive target that rarely polls.
    nixlkit.serve({
        "start": start,
        "load": lambda cmd: ag.add_remote_agent(base64.b64decode(cmd["meta"])),
        "read": read,
        "cpu": cpu,
        "dump": lambda cmd: buf.tofile(cmd["path"]),
        "params": params,
    }, idle=poll, active=lambda: ag is not None, interval=lambda: poll_s)


if __name__ == "__main__":
    main()
