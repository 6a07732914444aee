"""One bounced WRITE between two agents of this process, for test_nvtx.py: run with
NIXL_BOUNCE_NVTX=1 and an NVTX injection library attached, it leaves the engine's spans in that
library's record. Prints the sender's bounce counters as JSON; exits non-zero if the bytes are
wrong."""
import json

import nixlkit

N, SIZE = 1024, 4096


def main():
    lay = nixlkit.Scattered(N, SIZE, seed=77)
    src = nixlkit.pattern(701, lay.src_bytes)
    dst = nixlkit.pattern(700, lay.dst_bytes)
    before = dst.copy()
    # No direct writes: the packed sources are gathered, so the gather shows too.
    params = {"bounce_direct_writes": "false"}
    tx, rx = nixlkit.agent("nvtx-tx", params=params), nixlkit.agent("nvtx-rx", params=params)
    nixlkit.register(tx, src)
    nixlkit.register(rx, dst)
    tx.add_remote_agent(rx.get_agent_metadata())
    rx.add_remote_agent(tx.get_agent_metadata())
    nixlkit.wait_ready(tx)
    lo = tx.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re = tx.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM")
    h = tx.initialize_xfer("WRITE", lo, re, "nvtx-rx", b"nvtx", backends=["BOUNCE"])
    assert tx.transfer(h) != "ERR"
    nixlkit.wait_xfer(tx, h, peers=(rx,))
    nixlkit.wait_notif(rx, "nvtx-tx", b"nvtx", others=(tx,))
    tx.release_xfer_handle(h)
    nixlkit.assert_same(dst, lay.expected(src, before), "destination")
    p = nixlkit.live_params(tx)
    print(json.dumps({k: int(v) for k, v in p.items() if k.startswith("stats.bounce")}), flush=True)


if __name__ == "__main__":
    main()
    nixlkit.leave(0)
