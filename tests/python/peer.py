"""A NIXL agent in its own process, driven line by line over stdin/stdout (JSON), for the
two-process tests and benchmarks. While idle it keeps polling its agent, so transfers that need
the target to progress (and notifications) move even when the other process is busy.

Commands (one JSON object per line; every reply is one JSON line with "ok"):
  {"op": "start", "name": N, "backends": [...], "params": {...}, "size": BYTES, "seed": S}
      -> {"meta": b64, "addr": int}   (buffer filled with pattern(seed))
  {"op": "load", "meta": b64}                 add a remote agent
  {"op": "notif_wait", "from": A, "msg": M}   wait until that notification arrived
  {"op": "notif_send", "to": A, "msg": M}
  {"op": "dump", "path": P}                   write the buffer to a file
  {"op": "fill", "seed": S}                   refill the buffer with pattern(seed)
  {"op": "write", "to": A, "n": N, "size": S, "seed": L, "src_off": O, "raddr": R,
   "notif": M, "sizes": [..]?}   scattered WRITE of Scattered(N, S, L) from buffer+O to R
      -> {"state": "DONE"|"ERR", "seconds": t}
  {"op": "wait_ready", "n": K}               wait until K peers may take the bounce path
  {"op": "params", "backend": B}             -> {"params": {...}} (live backend params)
  {"op": "exit"}
"""
import base64
import json
import os
import time

import nixlkit


def main():
    ag = None
    buf = None
    seen = []
    # Replies get a private copy of stdout; everything else printed to fd 1 (NIXL's own log
    # lines) goes to stderr so it can't corrupt the reply stream.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(**kw):
        kw.setdefault("ok", True)
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def poll():
        if ag is None:
            return
        for sender, msgs in ag.get_new_notifs().items():
            for m in msgs:
                seen.append((sender, m))

    for cmd in nixlkit.commands(poll, lambda: ag is not None):
        op = cmd["op"]
        try:
            if op == "start":
                ag = nixlkit.agent(cmd["name"], cmd.get("backends", ["BOUNCE"]), cmd.get("params"))
                buf = nixlkit.pattern(cmd.get("seed", 0), cmd["size"])
                for b in cmd.get("backends", ["BOUNCE"]):
                    nixlkit.register(ag, buf, b)
                reply(meta=base64.b64encode(ag.get_agent_metadata()).decode(), addr=buf.ctypes.data)
            elif op == "load":
                ag.add_remote_agent(base64.b64decode(cmd["meta"]))
                reply()
            elif op == "notif_wait":
                want = (cmd["from"], cmd["msg"].encode())
                end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
                while want not in seen and time.monotonic() < end:
                    poll()
                if want in seen:
                    seen.remove(want)
                    reply()
                else:
                    reply(ok=False, error="notification timed out")
            elif op == "notif_send":
                ag.send_notif(cmd["to"], cmd["msg"].encode())
                reply()
            elif op == "dump":
                buf.tofile(cmd["path"])
                reply()
            elif op == "fill":
                buf[:] = nixlkit.pattern(cmd["seed"], buf.nbytes)
                reply()
            elif op == "write":
                lay = nixlkit.Scattered(cmd["n"], cmd["size"], cmd["seed"], sizes=cmd.get("sizes"))
                base = buf.ctypes.data + cmd.get("src_off", 0)
                lo = ag.get_xfer_descs(lay.src_list(base), "DRAM")
                re = ag.get_xfer_descs(lay.dst_list(cmd["raddr"]), "DRAM")
                t0 = time.perf_counter()
                h = ag.initialize_xfer("WRITE", lo, re, cmd["to"], cmd.get("notif", "").encode(),
                                       backends=[cmd.get("backend", "BOUNCE")])
                state = ag.transfer(h)
                end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
                while state not in ("DONE", "ERR") and time.monotonic() < end:
                    try:
                        state = ag.check_xfer_state(h)
                    except Exception as e:
                        state = "ERR"
                        break
                    poll()
                secs = time.perf_counter() - t0
                try:
                    ag.release_xfer_handle(h)
                except Exception:
                    pass
                reply(state=state, seconds=secs)
            elif op == "wait_ready":
                nixlkit.wait_ready(ag, cmd.get("n", 1))
                reply()
            elif op == "params":
                reply(params=nixlkit.live_params(ag, cmd.get("backend", "BOUNCE")))
            elif op == "exit":
                reply()
                nixlkit.leave(0)
            else:
                reply(ok=False, error=f"unknown op {op}")
        except Exception as e:  # report, keep serving: the test decides
            reply(ok=False, error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
