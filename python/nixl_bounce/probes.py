"""ctypes probes that need no NIXL Python API: a plugin's API version and the CUDA driver."""
import ctypes
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple


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


def ptrace_scope(path: str = YAMA_PTRACE_SCOPE) -> Optional[int]:
    """Yama's ptrace scope (0-3), which decides whether one process may copy into another by
    cross-memory attach (BOUNCE's same-host path for host memory, UCX's cma); None without
    Yama (or an unreadable value), where processes of one user may."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


@dataclass
class Cuda:
    """What the CUDA driver reports; `error` says why nothing was seen."""

    driver: Optional[str] = None
    driver_int: int = 0
    gpus: List[str] = field(default_factory=list)
    error: Optional[str] = None


def cuda() -> Cuda:
    """The CUDA driver version and GPUs, through libcuda's driver API (no torch, no toolkit)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return Cuda(error="libcuda.so.1 not found, no NVIDIA driver on this machine")
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
        driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    else:
        driver = None
    rc = lib.cuInit(0)
    if rc != 0:
        return Cuda(driver, version.value, error=f"cuInit failed with CUDA error {rc}")
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return Cuda(driver, version.value, error="cuDeviceGetCount failed")
    gpus = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        if lib.cuDeviceGet(ctypes.byref(dev), i) == 0 and lib.cuDeviceGetName(name, 256, dev) == 0:
            gpus.append(name.value.decode(errors="replace"))
        else:
            gpus.append(f"GPU {i} (name unavailable)")
    return Cuda(driver, version.value, gpus)
