"""NVTX ranges reach an NVTX tool (issue 11: "the pipeline shows up in Nsight Systems").

Nsight Systems collects NVTX ranges through NVTX's injection interface: NVTX loads the library
named by NVTX_INJECTION64_PATH and routes every range to it. tests/nvtx/probe.c is such a
library that records each push and pop; a bounced WRITE run under it with NIXL_BOUNCE_NVTX=1
must leave the engine's pipeline there as ranges (submit, the control frames and their sends,
the gather, the write, the scatter), nested per thread as the spans are. The NVTX library is
CUDA's libnvtx3interop (PyPI nvidia-nvtx-cu12, installed by ci/setup); no GPU is needed.
"""
import collections
import glob
import json
import os
import shutil
import subprocess
import sys

from conftest import cannot_run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def nvtx_library():
    """libnvtx3interop.so.1 of the nvidia-nvtx wheel in this interpreter's environment."""
    import site
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    for d in dirs:
        for path in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvtx3interop.so.1")):
            return path
    return None


def missing(what):
    """A check that cannot run says so; under CI it fails (ci/setup installs what it needs)."""
    cannot_run(f"cannot check NVTX ranges: {what}")


def test_a_bounced_write_shows_its_pipeline_as_nvtx_ranges(tmp_path):
    lib = nvtx_library()
    if lib is None:
        missing("libnvtx3interop.so.1 not found (pip install nvidia-nvtx-cu12)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        missing("no C compiler to build the NVTX probe")
    probe = tmp_path / "probe.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(probe), os.path.join(ROOT, "tests", "nvtx", "probe.c")],
                   check=True)
    out = tmp_path / "ranges.txt"
    env = dict(os.environ, NIXL_BOUNCE_NVTX="1", NIXL_BOUNCE_NVTX_LIB=lib, NVTX_INJECTION64_PATH=str(probe),
               BOUNCE_NVTX_PROBE_OUT=str(out), NIXL_BOUNCE_CMA="0",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, os.path.join(HERE, "nvtx_transfer.py")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    counters = json.loads(r.stdout.strip().splitlines()[-1])
    assert counters["stats.bounce_ok"] == 1, counters

    lines = out.read_text().splitlines()
    assert lines and lines[0].startswith("init "), "the NVTX library never attached the probe"
    pushed = collections.Counter()
    depth = collections.defaultdict(int)
    for line in lines[1:]:
        kind, tid, _ns, *name = line.split(" ", 3)
        if kind == "push":
            depth[tid] += 1
            pushed[name[0] if name else ""] += 1
        else:
            assert kind == "pop", line
            depth[tid] -= 1
            assert depth[tid] >= 0, f"a pop without its push on thread {tid}"
    # The engine's threads end with the process (no teardown): each keeps at most its
    # outermost range open (the reactor's).
    assert all(d <= 1 for d in depth.values()), dict(depth)
    for stage in ("submit", "control", "send", "gather", "write", "scatter"):
        assert pushed[stage] >= 1, f"no '{stage}' range among {dict(pushed)}"
    # One WANT, GRANT, DATA and ACK per chunk at least: a control range and a send per frame.
    assert pushed["send"] >= 2 and pushed["control"] >= 2, dict(pushed)
