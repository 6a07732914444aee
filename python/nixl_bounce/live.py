"""The doctor's live check, run in its own interpreter: two local agents create BOUNCE, load
each other's metadata, and WRITE 1024 scattered 4 KiB pieces that must take the bounce path
(the engine's stats.* counters say so), byte-checked. Prints one JSON line with the result.

    python -m nixl_bounce.live nixl_cu12
"""
import importlib
import json
import os
import sys
import time

N, SIZE = 1024, 4096
DEADLINE_S = 30.0
# Small arenas: the check must not cost a host its memory.
PARAMS = {"bounce_arena_size": "32MiB"}


class Failed(Exception):
    def __init__(self, stage, message):
        super().__init__(message)
        self.stage = stage


def _stats(agent):
    params = dict(agent.agent.getBackendParams(agent.backends["BOUNCE"])[0])
    return {k[len("stats."):]: int(v) for k, v in params.items() if k.startswith("stats.")}


def _poll(*agents):
    for a in agents:
        a.get_new_notifs()


def check(package):
    """Runs the transfer with NIXL package `package`; returns a dict of figures."""
    import numpy as np
    nixl = importlib.import_module(package)
    cfg = nixl.nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=0)
    agents = {}
    for name in ("doctor-tx", "doctor-rx"):
        a = nixl.nixl_agent(name, cfg)
        try:
            a.create_backend("BOUNCE", dict(PARAMS))
        except Exception as e:  # NIXL raises its own exception types
            raise Failed("create BOUNCE", f"{type(e).__name__}: {e}") from None
        agents[name] = a
    tx, rx = agents["doctor-tx"], agents["doctor-rx"]

    rng = np.random.default_rng(15)
    src = rng.integers(0, 256, size=N * SIZE, dtype=np.uint8)
    dst = rng.integers(0, 256, size=2 * N * SIZE, dtype=np.uint8)  # scattered into twice the room
    slots = rng.permutation(2 * N)[:N]
    expected = dst.copy()
    for i, k in enumerate(slots):
        expected[k * SIZE:(k + 1) * SIZE] = src[i * SIZE:(i + 1) * SIZE]
    for a, buf in ((tx, src), (rx, dst)):
        a.register_memory(a.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"),
                          backends=["BOUNCE"])

    # Metadata both ways, as NIXL applications do: the receiver answers through our conn info.
    tx.add_remote_agent(rx.get_agent_metadata())
    rx.add_remote_agent(tx.get_agent_metadata())
    end = time.monotonic() + DEADLINE_S
    while _stats(tx).get("peers_ready", 0) < 1:
        _poll(tx, rx)
        if time.monotonic() > end:
            raise Failed("bounce ready", f"the peer never became bounce-ready in {DEADLINE_S:.0f} s (no HELLO)")
        time.sleep(0.001)

    before = _stats(tx)
    lo = tx.get_xfer_descs([(src.ctypes.data + i * SIZE, SIZE, 0) for i in range(N)], "DRAM")
    re = tx.get_xfer_descs([(dst.ctypes.data + int(k) * SIZE, SIZE, 0) for k in slots], "DRAM")
    h = tx.initialize_xfer("WRITE", lo, re, "doctor-rx", b"doctor", backends=["BOUNCE"])
    t0 = time.perf_counter()
    if tx.transfer(h) == "ERR":
        raise Failed("transfer", "posting the WRITE failed")
    while True:
        state = tx.check_xfer_state(h)
        _poll(rx)
        if state == "DONE":
            break
        if state == "ERR" or time.monotonic() > end:
            raise Failed("transfer", f"the WRITE ended in state {state}")
    ms = (time.perf_counter() - t0) * 1e3
    tx.release_xfer_handle(h)
    after = _stats(tx)

    if not np.array_equal(dst, expected):
        bad = int(np.count_nonzero(dst != expected))
        raise Failed("bytes", f"{bad} destination bytes differ after the WRITE")
    bounced = after.get("bounce_ok", 0) - before.get("bounce_ok", 0)
    if bounced != 1:
        fallbacks = {k: after[k] - before.get(k, 0) for k in after
                     if k.startswith("fallback_") and after[k] != before.get(k, 0)}
        raise Failed("bounce path", f"the WRITE did not bounce (bounce_ok +{bounced}, fallbacks {fallbacks})")
    return {"descriptors": N, "bytes": N * SIZE, "ms": round(ms, 2),
            "chunks": after.get("bounce_chunks", 0) - before.get("bounce_chunks", 0)}


def main():
    package = sys.argv[1] if len(sys.argv) > 1 else "nixl_cu12"
    try:
        out = {"ok": True, **check(package)}
    except Failed as e:
        out = {"ok": False, "stage": e.stage, "error": str(e)}
    except Exception as e:  # anything else is reported, not raised: the doctor prints it
        out = {"ok": False, "stage": "setup", "error": f"{type(e).__name__}: {e}"}
    print("NIXL_BOUNCE_LIVE " + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # NIXL 1.5.1 can crash in interpreter teardown once UCX ran (see README)


if __name__ == "__main__":
    main()
