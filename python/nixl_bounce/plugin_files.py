"""Placing the bundled plugin into a NIXL plugin directory and removing it, idempotently.

The copy goes to a temporary name in the same folder and is renamed over the target, so a
process that has the old plugin mapped keeps a consistent file and NIXL never sees half a file.
"""
import hashlib
import os
from typing import Optional

from nixl_bounce import PLUGIN_FILE, bundled_plugin
from nixl_bounce.locate import NixlInstall

UCX_PLUGIN_FILE = "libplugin_UCX.so"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def installed_path(nixl: NixlInstall) -> str:
    return os.path.join(nixl.plugin_dir, PLUGIN_FILE)


def is_current(nixl: NixlInstall, source: Optional[str] = None) -> bool:
    """True when the plugin in `nixl` is byte-identical to `source` (the wheel's by default)."""
    target = installed_path(nixl)
    return os.path.isfile(target) and sha256(target) == sha256(source or bundled_plugin())


def install(nixl: NixlInstall, source: Optional[str] = None) -> str:
    """Copies the plugin into `nixl`'s plugin dir; returns 'installed', 'updated' or 'unchanged'."""
    source = source or bundled_plugin()
    if not os.path.isfile(source):
        raise FileNotFoundError(f"the wheel's plugin {source} is missing; reinstall nixl-bounce")
    if not os.path.isdir(nixl.plugin_dir):
        raise FileNotFoundError(f"NIXL's plugin directory {nixl.plugin_dir} does not exist")
    target = installed_path(nixl)
    existed = os.path.exists(target)
    if existed and is_current(nixl, source):
        return "unchanged"
    tmp = os.path.join(nixl.plugin_dir, f".{PLUGIN_FILE}.tmp-{os.getpid()}")
    try:
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return "updated" if existed else "installed"


def uninstall(nixl: NixlInstall) -> bool:
    """Removes the plugin from `nixl`; False when it was not there."""
    target = installed_path(nixl)
    if not os.path.lexists(target):
        return False
    os.unlink(target)
    return True
