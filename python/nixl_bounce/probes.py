"""ctypes probes that need no NIXL Python API: a plugin's API version, the CUDA driver, and
Yama's ptrace scope."""
import ctypes
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union


def plugin_api_version(path: str) -> int:
    """The plugin API version a NIXL plugin declares: `nixl_plugin_init()` returns the plugin
    struct, whose first member is an int. Raises OSError when the file cannot be loaded."""
    lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    init = lib.nixl_plugin_init
    init.restype = ctypes.c_void_p
    init.argtypes = []
    plugin = init()
    if not plugin:
        raise OSError(f"nixl_plugin_init of {path} returned NULL")
    return ctypes.c_int.from_address(plugin).value


def load_error_alone(path: str, timeout: float = 60) -> Optional[str]:
    """Why `path` cannot be loaded by a fresh process (the loader's message), or None when it
    loads. A fresh process, not this one: libraries this process already loaded (another UCX
    plugin's UCX) would satisfy the file's dependencies here and hide a missing one."""
    code = ("import ctypes, os, sys\n"
            "try:\n"
            "    ctypes.CDLL(sys.argv[1], mode=os.RTLD_LOCAL | os.RTLD_NOW)\n"
            "except OSError as e:\n"
            "    print(e); sys.stdout.flush(); os._exit(1)\n"
            "os._exit(0)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, os.path.abspath(path)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"loading it took more than {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    return (proc.stdout.strip() or proc.stderr.strip() or f"exit code {proc.returncode}").splitlines()[-1]


def tested_nixl_versions(path: str) -> Optional[Tuple[str, ...]]:
    """The NIXL versions the plugin's version guard accepts, read from the plugin itself
    (`nixl_bounce_tested_nixl_versions`, comma-separated); None for a build without it."""
    lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    try:
        fn = lib.nixl_bounce_tested_nixl_versions
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    raw = fn() or b""
    return tuple(v for v in raw.decode().split(",") if v)


YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


class Unreadable:
    """A Yama ptrace scope that exists but could not be read or parsed; `why` says how."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self):
        return f"Unreadable({self.why!r})"


def ptrace_scope(path: str = YAMA_PTRACE_SCOPE) -> Union[int, None, Unreadable]:
    """Yama's ptrace scope (0-3), which decides whether one process may copy into another by
    cross-memory attach (BOUNCE's same-host path for host memory, UCX's cma). None only when
    the file does not exist (no Yama: processes of one user may); an `Unreadable` when it
    exists but cannot be read or holds no integer (the scope is then unknown, not absent)."""
    try:
        with open(path) as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        return Unreadable(f"cannot read {path}: {e.strerror or e}")
    try:
        return int(raw.strip())
    except ValueError:
        return Unreadable(f"{path} holds {raw.strip()[:40]!r}, not a number")


@dataclass
class Cuda:
    """What the CUDA driver reports; `error` says why nothing was seen. `broken` is True when
    libcuda.so.1 loads but does not work (cuInit or the device count failed): a driver is
    installed yet unusable, unlike a machine without one."""

    driver: Optional[str] = None
    #: cuDriverGetVersion's value (12040 for 12.4); 0 when it failed.
    driver_int: int = 0
    gpus: List[str] = field(default_factory=list)
    error: Optional[str] = None
    broken: bool = False


def _cuda_error(lib, rc: int) -> str:
    """`CUDA_ERROR_<NAME> (rc)` through cuGetErrorName (needs no cuInit), else the number."""
    name = ctypes.c_char_p()
    try:
        fn = lib.cuGetErrorName
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if fn(rc, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode(errors='replace')} ({rc})"
    except AttributeError:
        pass
    return f"CUDA error {rc}"


def cuda() -> Cuda:
    """The CUDA driver version and GPUs, through libcuda's driver API (no torch, no toolkit)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return Cuda(error="libcuda.so.1 not found, no NVIDIA driver on this machine")
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
        driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    else:
        driver, version.value = None, 0
    rc = lib.cuInit(0)
    if rc != 0:
        return Cuda(driver, version.value, error=f"cuInit failed: {_cuda_error(lib, rc)}", broken=True)
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return Cuda(driver, version.value, error=f"cuDeviceGetCount failed: {_cuda_error(lib, rc)}",
                    broken=True)
    gpus = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        if lib.cuDeviceGet(ctypes.byref(dev), i) == 0 and lib.cuDeviceGetName(name, 256, dev) == 0:
            gpus.append(name.value.decode(errors="replace"))
        else:
            gpus.append(f"GPU {i} (name unavailable)")
    return Cuda(driver, version.value, gpus)
