"""Placing the bundled plugin into a NIXL plugin directory and removing it, idempotently.

The copy goes to a temporary name in the same folder and is renamed over the target, so a
process that has the old plugin mapped keeps a consistent file and NIXL never sees half a file.
"""
import hashlib
import mmap
import os
from typing import Optional

from nixl_bounce import PLUGIN_FILE, bundled_plugin
from nixl_bounce.locate import NixlInstall

UCX_PLUGIN_FILE = "libplugin_UCX.so"
#: The environment variable that points BOUNCE at the UCX plugin it delegates to.
UCX_PLUGIN_ENV = "NIXL_BOUNCE_UCX_PLUGIN"
#: Set to 1 to build a wheel without GPU kernels on purpose (setup.py refuses otherwise).
ALLOW_NO_KERNELS_ENV = "BOUNCE_ALLOW_NO_KERNELS"
NVRTC_PIN = "nvidia-cuda-nvrtc-cu12==12.0.140"

#: What kernels/build_ptx.rs puts first in the PTX it embeds (`// Built by NVRTC 12.0 from
#: kernels/gather_scatter.cu`); a build without NVRTC embeds an empty PTX, so no such line.
_KERNEL_MARKER = b"// Built by NVRTC "
_PTX_ENTRY = b".entry "

#: How to build a plugin that carries its kernels (the doctor's and setup.py's fix).
REBUILD_WITH_KERNELS = (
    f"build the wheel with NVRTC: `pip install {NVRTC_PIN}`, then "
    "`BOUNCE_NVRTC_LIB=$(python -c 'import nvidia.cuda_nvrtc as n, os; "
    "print(os.path.join(n.__path__[0], \"lib\", \"libnvrtc.so.12\"))') "
    "pip wheel --no-deps -w dist .` in the checkout (ci/setup does this), "
    "then `pip install --force-reinstall --no-deps dist/nixl_bounce-*.whl` and `nixl-bounce install`")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gpu_kernels(path: str) -> Optional[str]:
    """What built the GPU kernels embedded in the plugin at `path` (`NVRTC 12.0 from
    kernels/gather_scatter.cu`), or None when it carries none (built without NVRTC: its VRAM
    bounce and CUDA IPC paths are then off). Read from the file, without loading it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(_KERNEL_MARKER)
            while at >= 0:
                end = m.find(b"\n", at)
                if end > at and m.find(_PTX_ENTRY, end) >= 0:
                    return m[at + 12:end].decode(errors="replace").strip()  # after "// Built by "
                at = m.find(_KERNEL_MARKER, at + 1)
    return None


def kernels_build_check(built: str, environ=None):
    """For setup.py: None when the plugin at `built` carries its GPU kernels, else `(message,
    fatal)`: fatal unless BOUNCE_ALLOW_NO_KERNELS (1, true, yes, on) asks for a host-memory-only
    wheel. NVRTC missing makes kernels/build_ptx.rs print only a cargo warning, which pip hides."""
    environ = os.environ if environ is None else environ
    if gpu_kernels(built):
        return None
    allow = environ.get(ALLOW_NO_KERNELS_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    msg = (f"\n*** nixl-bounce: {built} was built WITHOUT its GPU kernels: NVRTC was not found "
           f"(BOUNCE_NVRTC_LIB={environ.get('BOUNCE_NVRTC_LIB', '(unset)')}). Such a plugin does not "
           f"bounce GPU-memory (VRAM) transfers and has no same-host CUDA IPC path. ***\n"
           f"Fix: {REBUILD_WITH_KERNELS}.\n")
    if allow:
        return msg + f"Building it anyway: {ALLOW_NO_KERNELS_ENV} is set.\n", False
    return msg + f"Or, for a host-memory-only wheel, set {ALLOW_NO_KERNELS_ENV}=1.", True


def plugin_dir_override() -> Optional[str]:
    """NIXL_PLUGIN_DIR when set (not empty): NIXL then loads plugins from there only."""
    return os.environ.get("NIXL_PLUGIN_DIR") or None


def same_dir(a: str, b: str) -> bool:
    """Whether two spellings name one folder (symlinks resolved)."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def installed_path(nixl: NixlInstall) -> str:
    return os.path.join(nixl.plugin_dir, PLUGIN_FILE)


def is_current(nixl: NixlInstall, source: Optional[str] = None) -> bool:
    """True when the plugin in `nixl` is byte-identical to `source` (the wheel's by default)."""
    return is_same_file(installed_path(nixl), source)


def is_same_file(target: str, source: Optional[str] = None) -> bool:
    """True when `target` is byte-identical to `source` (the wheel's plugin by default)."""
    return os.path.isfile(target) and sha256(target) == sha256(source or bundled_plugin())


def _unwritable(plugin_dir: str, e: OSError) -> OSError:
    """A write error that names the folder and says what to do (not a temp file's errno)."""
    why = e.strerror or str(e)
    return OSError(
        f"cannot write into {plugin_dir} ({why}); run nixl-bounce as the user that owns that "
        f"environment (or with sudo), use a virtual environment of your own, or copy "
        f"{bundled_plugin()} into a folder you own, point NIXL_PLUGIN_DIR at it and set "
        f"{UCX_PLUGIN_ENV} to NIXL's libplugin_UCX.so")


def install_into(plugin_dir: str, source: Optional[str] = None) -> str:
    """Copies the plugin into `plugin_dir`; returns 'installed', 'updated' or 'unchanged'."""
    source = source or bundled_plugin()
    if not os.path.isfile(source):
        raise FileNotFoundError(f"the wheel's plugin {source} is missing; reinstall nixl-bounce")
    if not os.path.isdir(plugin_dir):
        raise FileNotFoundError(f"NIXL's plugin directory {plugin_dir} does not exist")
    target = os.path.join(plugin_dir, PLUGIN_FILE)
    existed = os.path.exists(target)
    if existed and is_same_file(target, source):
        return "unchanged"
    tmp = os.path.join(plugin_dir, f".{PLUGIN_FILE}.tmp-{os.getpid()}")
    try:
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except (PermissionError, OSError) as e:
        if isinstance(e, PermissionError) or e.errno in (13, 30):  # EACCES, EROFS
            raise _unwritable(plugin_dir, e) from None
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return "updated" if existed else "installed"


def install(nixl: NixlInstall, source: Optional[str] = None) -> str:
    """Copies the plugin into `nixl`'s plugin dir; returns 'installed', 'updated' or 'unchanged'."""
    return install_into(nixl.plugin_dir, source)


def uninstall_from(plugin_dir: str) -> bool:
    """Removes the plugin from `plugin_dir`; False when it was not there."""
    target = os.path.join(plugin_dir, PLUGIN_FILE)
    if not os.path.lexists(target):
        return False
    try:
        os.unlink(target)
    except OSError as e:
        if isinstance(e, PermissionError) or e.errno in (13, 30):
            raise _unwritable(plugin_dir, e) from None
        raise
    return True


def uninstall(nixl: NixlInstall) -> bool:
    """Removes the plugin from `nixl`; False when it was not there."""
    return uninstall_from(nixl.plugin_dir)
