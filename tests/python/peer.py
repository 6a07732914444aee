"""A NIXL agent in its own process, driven line by line over stdin/stdout (JSON), for the
two-process tests and benchmarks. While idle it keeps polling its agent, so transfers that need
the target to progress (and notifications) move even when the other process is busy.

Commands (one JSON object per line; every reply is one JSON line with "ok"):
  {"op": "start", "name": N, "backends": [...], "params": {...}, "size": BYTES, "seed": S,
   "mem": "DRAM"|"VRAM", "dev": GPU}
      -> {"meta": b64, "addr": int}   (buffer filled with pattern(seed); VRAM: a torch tensor)
      "host": {"size": BYTES, "seed": S} also registers a host-memory buffer with the same
      agent (a GPU worker that moves host memory too) -> "host_addr": int
      "cuda_late": true makes the agent before the process touches CUDA (VRAM)
      "at": ADDR puts the (host) buffer at that virtual address (mmap MAP_FIXED_NOREPLACE)
      "spare": {"at": ADDR, "size": BYTES} maps that much zeroed memory there, never registered
  {"op": "load", "meta": b64}                 add a remote agent
  {"op": "unload", "name": A}                 remove remote agent A (NIXL's remove_remote_agent)
  {"op": "notif_wait", "from": A, "msg": M}   wait until that notification arrived
  {"op": "notif_send", "to": A, "msg": M}     ("b64": B instead of "msg": raw bytes)
  {"op": "meta"}                              -> {"meta": b64}: the agent's whole metadata
  {"op": "partial_meta"}                      -> {"meta": b64}: the buffer's registration
      metadata for BOUNCE without connection info (NIXL's get_partial_agent_metadata)
  {"op": "dump", "path": P, "host": bool}     write the buffer (the host buffer) to a file
      ("spare": true: the unregistered memory of "spare")
  {"op": "fill", "seed": S}                   refill the buffer with pattern(seed)
  {"op": "write", "to": A, "n": N, "size": S, "seed": L, "src_off": O, "raddr": R,
   "notif": M, "sizes": [..]?}   scattered WRITE of Scattered(N, S, L) from buffer+O to R
      -> {"state": "DONE"|"ERR", "seconds": t}
  {"op": "wait_ready", "n": K}               wait until K peers may take the bounce path
  {"op": "params", "backend": B}             -> {"params": {...}} (live backend params)
  {"op": "wakeups"}                           -> {"wakeups": W} (its reactor threads' wake-ups)
  {"op": "stage_serve", "from": A, "n": N, "size": S, "seed": L, "stage_off": O, "count": K}
      hand staging (VRAM benchmarks): K times, wait for notif "staged" from A, scatter the
      staging area at buffer+O to Scattered(N, S, L)'s slots with torch, answer "scattered"
  {"op": "dereg"}                              deregister the buffer (from every backend)
  {"op": "exit"}
"""
import base64
import time

import numpy as np

import nixlkit


def fixed_buffer(addr, size):
    """`size` bytes of fresh anonymous memory at virtual address `addr` (refused if anything is
    mapped there), as a numpy array: two processes can then hold buffers at the same address."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot, flags = 0x1 | 0x2, 0x02 | 0x20 | 0x100000  # READ|WRITE; PRIVATE|ANONYMOUS|FIXED_NOREPLACE
    got = libc.mmap(addr, size, prot, flags, -1, 0)
    if got != addr:
        raise OSError(ctypes.get_errno(), f"cannot map {size} bytes at {addr:#x} (got {got})")
    return np.frombuffer((ctypes.c_uint8 * size).from_address(addr), dtype=np.uint8)


def main():
    ag = None
    buf = None
    hbuf = None
    spare = None
    regs = []
    seen = []

    def poll():
        if ag is None:
            return
        for sender, msgs in ag.get_new_notifs().items():
            for m in msgs:
                seen.append((sender, m))

    def start(cmd):
        nonlocal ag, buf, hbuf, spare
        vram = cmd.get("mem", "DRAM") == "VRAM"

        def touch_cuda():
            import torch
            torch.cuda.set_device(cmd.get("dev", 0))
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{cmd.get('dev', 0)}")
            nixlkit.gpu_trace(f"target-{cmd['name']}")

        # As frameworks do: the process's GPU is current before the agent is made (BOUNCE puts
        # its GPU arena on the GPU current at backend creation); "cuda_late" does it after.
        if vram and not cmd.get("cuda_late"):
            touch_cuda()
        ag = nixlkit.agent(cmd["name"], cmd.get("backends", ["BOUNCE"]), cmd.get("params"))
        if vram and cmd.get("cuda_late"):
            touch_cuda()
        buf = nixlkit.pattern(cmd.get("seed", 0), cmd["size"])
        if "at" in cmd:
            fixed = fixed_buffer(cmd["at"], cmd["size"])
            fixed[:] = buf
            buf = fixed
        if cmd.get("mem", "DRAM") == "VRAM":
            buf = nixlkit.VramBuf(buf, cmd.get("dev", 0))
        for b in cmd.get("backends", ["BOUNCE"]):
            regs.append(nixlkit.register(ag, buf, b))
        out = {"addr": nixlkit.addr(buf)}
        if "host" in cmd:
            hbuf = nixlkit.pattern(cmd["host"]["seed"], cmd["host"]["size"])
            for b in cmd.get("backends", ["BOUNCE"]):
                regs.append(nixlkit.register(ag, hbuf, b))
            out["host_addr"] = nixlkit.addr(hbuf)
        if "spare" in cmd:
            spare = fixed_buffer(cmd["spare"]["at"], cmd["spare"]["size"])
        return {"meta": base64.b64encode(ag.get_agent_metadata()).decode(), **out}

    def notif_wait(cmd):
        want = (cmd["from"], cmd["msg"].encode())
        end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
        while want not in seen and time.monotonic() < end:
            poll()
        if want not in seen:
            return {"ok": False, "error": "notification timed out"}
        seen.remove(want)

    def fill(cmd):
        if isinstance(buf, nixlkit.VramBuf):
            buf.fill(nixlkit.pattern(cmd["seed"], buf.nbytes))
        else:
            buf[:] = nixlkit.pattern(cmd["seed"], buf.nbytes)

    def write(cmd):
        lay = nixlkit.Scattered(cmd["n"], cmd["size"], cmd["seed"], sizes=cmd.get("sizes"))
        base = nixlkit.addr(buf) + cmd.get("src_off", 0)
        m, d = nixlkit.mem(buf), nixlkit.dev(buf)
        lo = ag.get_xfer_descs(lay.src_list(base, d), m)
        re = ag.get_xfer_descs(lay.dst_list(cmd["raddr"], cmd.get("rdev", d)), m)
        t0 = time.perf_counter()
        h = ag.initialize_xfer("WRITE", lo, re, cmd["to"], cmd.get("notif", "").encode(),
                               backends=[cmd.get("backend", "BOUNCE")])
        state = ag.transfer(h)
        end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
        while state not in ("DONE", "ERR") and time.monotonic() < end:
            try:
                state = ag.check_xfer_state(h)
            except Exception:
                state = "ERR"
                break
            poll()
        secs = time.perf_counter() - t0
        try:
            ag.release_xfer_handle(h)
        except Exception:
            pass
        return {"state": state, "seconds": secs}

    def stage_serve(cmd):
        import torch
        lay = nixlkit.Scattered(cmd["n"], cmd["size"], cmd["seed"])
        t = buf.t if isinstance(buf, nixlkit.VramBuf) else torch.from_numpy(buf)
        o, nb, sz = cmd["stage_off"], cmd["n"] * cmd["size"], cmd["size"]
        stage = t[o:o + nb].view(cmd["n"], sz)
        slots = torch.as_tensor(lay.slots.astype(np.int64), device=t.device)
        dst = t[:lay.dst_bytes].view(-1, sz)
        for _ in range(cmd["count"]):
            want = (cmd["from"], b"staged")
            while want not in seen:
                poll()
            seen.remove(want)
            dst.index_copy_(0, slots, stage)
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            ag.send_notif(cmd["from"], b"scattered")

    nixlkit.serve({
        "start": start,
        "load": lambda cmd: ag.add_remote_agent(base64.b64decode(cmd["meta"])),
        "unload": lambda cmd: [ag.remove_remote_agent(cmd["name"])] and None,
        "notif_wait": notif_wait,
        "notif_send": lambda cmd: ag.send_notif(
            cmd["to"], base64.b64decode(cmd["b64"]) if "b64" in cmd else cmd["msg"].encode()),
        "meta": lambda cmd: {"meta": base64.b64encode(ag.get_agent_metadata()).decode()},
        "partial_meta": lambda cmd: {"meta": base64.b64encode(ag.get_partial_agent_metadata(
            ag.get_reg_descs([(nixlkit.addr(buf), buf.nbytes, 0, "")], "DRAM"), False, ["BOUNCE"])).decode()},
        "dump": lambda cmd: (spare if cmd.get("spare") else hbuf if cmd.get("host") else buf).tofile(cmd["path"]),
        "fill": fill,
        "write": write,
        "wait_ready": lambda cmd: nixlkit.wait_ready(ag, cmd.get("n", 1)),
        "params": lambda cmd: {"params": nixlkit.live_params(ag, cmd.get("backend", "BOUNCE"))},
        "wakeups": lambda cmd: {"wakeups": sum(nixlkit.reactor_wakeups().values())},
        "stage_serve": stage_serve,
        "dereg": lambda cmd: [ag.deregister_memory(regs.pop()) for _ in list(regs)] and None,
    }, idle=poll, active=lambda: ag is not None)


if __name__ == "__main__":
    main()
