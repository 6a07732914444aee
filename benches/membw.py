"""This machine's memory-copy floor for one 16384 x 4 KiB host-memory transfer (issue 14).

A bounced host-memory WRITE on a machine without an RDMA NIC copies its 64 MiB three times on
the CPU: the gather into staging, UCX's cma "RDMA" write (process_vm_writev) into the peer's
arena, and the scatter. Plain UCX copies once (a cma write per descriptor) but pays per
descriptor. This prints what one and two cores copy per second here, and the floor that puts
under BOUNCE: three copies spread over both cores at best.

    .venv/bin/python benches/membw.py
"""
import os
import threading
import time

import numpy as np

MIB = 1 << 20
NBYTES = 64 * MIB


def best(f, reps=7):
    f()  # first touch
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return min(t)


def main():
    nbytes = NBYTES
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    one = best(lambda: np.copyto(dst, src))
    # Two cores at once (numpy releases the GIL in copies): each copies its own 64 MiB.
    src_b, dst_b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)

    def pair():
        t = threading.Thread(target=np.copyto, args=(dst_b, src_b))
        t.start()
        np.copyto(dst, src)
        t.join()

    two = best(pair)
    cores = os.cpu_count()
    print(f"{cores} cores; 64 MiB copies, min of 7")
    print(f"  one core, contiguous:        {one * 1e3:6.1f} ms  {nbytes / one / 1e9:5.1f} GB/s")
    print(f"  two cores, one copy each:    {two * 1e3:6.1f} ms  {2 * nbytes / two / 1e9:5.1f} GB/s together")
    floor = 3 * nbytes / (2 * nbytes / two)
    print(f"  floor for three copies of 64 MiB over both cores: {floor * 1e3:.1f} ms "
          f"(plus nothing else: no control, no waiting)")


if __name__ == "__main__":
    main()
