"""benches/cma_floor.c, the same-host path's floor that BENCHMARKS.md cites, still builds and
measures: compiled with the system's C compiler and run on one thread."""

import re
import shutil
import subprocess
from pathlib import Path

from conftest import cannot_run

ROOT = Path(__file__).resolve().parents[2]


def test_the_cross_memory_copy_floor_builds_and_writes_every_piece(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        cannot_run("no C compiler (cc or gcc) to build benches/cma_floor.c")
    exe = tmp_path / "cma_floor"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-pthread", str(ROOT / "benches/cma_floor.c"), "-o", str(exe)],
                   check=True, timeout=120)
    # It exits 1 if any process_vm_writev moves fewer bytes than asked.
    out = subprocess.run([str(exe), "1", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    m = re.search(r"16384 x 4096 B, 1 thread\(s\), destinations scattered: best of 15 ([\d.]+) ms", out.stdout)
    assert m, out.stdout
    assert float(m.group(1)) > 0
    bad = subprocess.run([str(exe), "0", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
