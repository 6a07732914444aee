"""Finding installed NIXLs: the Python package, its version and its plugin directory.

The PyPI wheels (nixl-cu12, nixl-cu13) put libnixl.so in `site-packages/.nixl_cuXX.mesonpy.libs/`
and NIXL's plugins in its `plugins/` folder, where NIXL looks when NIXL_PLUGIN_DIR is unset. The
version comes from the wheel's `nixl_cuXX-<version>.dist-info/METADATA` beside the package: the
same place the plugin's own version guard reads, so both always agree.
"""
import glob
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional

#: Importable names of NIXL's PyPI wheels, in the order they are looked for.
PACKAGES = ("nixl_cu12", "nixl_cu13")

_LIBS_DIR = re.compile(r"^\.(nixl_cu\d+)\.mesonpy\.libs$")


class NixlNotFound(Exception):
    """No NIXL where we looked: `what` says what is wrong, `fix` what to do; the message is
    both, joined by `sep`."""

    def __init__(self, what: str, fix: str, sep: str = "; "):
        super().__init__(f"{what}{sep}{fix}")
        self.what = what
        self.fix = fix


@dataclass(frozen=True)
class NixlInstall:
    """One installed NIXL."""

    #: Python package name (`nixl_cu12`), or None for a NIXL not installed from a wheel.
    package: Optional[str]
    #: Version from the wheel's metadata, or None when there is none.
    version: Optional[str]
    #: The folder holding libnixl.so.
    lib_dir: str

    @property
    def plugin_dir(self) -> str:
        """Where NIXL looks for plugins by default (`plugins/` beside libnixl.so)."""
        return os.path.join(self.lib_dir, "plugins")

    @property
    def site(self) -> str:
        """The folder holding lib_dir (site-packages for a wheel)."""
        return os.path.dirname(self.lib_dir)

    def describe(self) -> str:
        name = self.package or "NIXL"
        return f"{name} {self.version or '(unknown version)'} at {self.lib_dir}"


def dist_infos(site: str, package: str) -> List[str]:
    """Every `<site>/<package>-*.dist-info` folder, sorted. More than one (a left-over of an
    interrupted upgrade) makes the version ambiguous: the plugin's guard takes the first its
    directory listing gives, in no defined order."""
    return sorted(glob.glob(os.path.join(site, f"{package}-*.dist-info")))


def metadata_version(dist_info: str) -> Optional[str]:
    """`Version:` of `<dist_info>/METADATA`, or None."""
    try:
        with open(os.path.join(dist_info, "METADATA"), encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():  # end of the header block
                    break
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return None


def wheel_version(site: str, package: str) -> Optional[str]:
    """`Version:` of `<site>/<package>-*.dist-info/METADATA` (the first, sorted, that has
    one), or None."""
    for d in dist_infos(site, package):
        version = metadata_version(d)
        if version:
            return version
    return None


def _from_lib_dir(lib_dir: str) -> NixlInstall:
    lib_dir = os.path.abspath(lib_dir)
    m = _LIBS_DIR.match(os.path.basename(lib_dir))
    package = m.group(1) if m else None
    version = wheel_version(os.path.dirname(lib_dir), package) if package else None
    return NixlInstall(package, version, lib_dir)


def from_path(path: str) -> NixlInstall:
    """The NIXL at `path`: its lib folder (holding libnixl.so), its plugins folder, a
    site-packages folder holding one NIXL wheel, or the wheel's Python package folder."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, "libnixl.so")):
        return _from_lib_dir(path)
    parent = os.path.dirname(path)
    if os.path.basename(path) == "plugins" and os.path.isfile(os.path.join(parent, "libnixl.so")):
        return _from_lib_dir(parent)
    libs = sorted(glob.glob(os.path.join(path, ".nixl_cu*.mesonpy.libs", "libnixl.so")))
    if len(libs) == 1:
        return _from_lib_dir(os.path.dirname(libs[0]))
    if len(libs) > 1:
        raise NixlNotFound(f"{path} holds several NIXLs ({', '.join(libs)})", "give one of those folders")
    beside = os.path.join(parent, f".{os.path.basename(path)}.mesonpy.libs")
    if os.path.isfile(os.path.join(beside, "libnixl.so")):
        return _from_lib_dir(beside)
    raise NixlNotFound(f"no libnixl.so in or under {path}",
                      "give NIXL's lib folder (the one holding libnixl.so)")


def importable() -> List[NixlInstall]:
    """The NIXL wheels this Python can import, without importing them (that would load NIXL)."""
    found = []
    for package in PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg_dir = list(spec.submodule_search_locations)[0]
        lib_dir = os.path.join(os.path.dirname(pkg_dir), f".{package}.mesonpy.libs")
        if os.path.isfile(os.path.join(lib_dir, "libnixl.so")):
            found.append(_from_lib_dir(lib_dir))
    return found


def find(nixl_path: Optional[str] = None) -> List[NixlInstall]:
    """The NIXL at `nixl_path`, else every importable NIXL wheel; raises NixlNotFound."""
    if nixl_path:
        return [from_path(nixl_path)]
    found = importable()
    if not found:
        raise NixlNotFound(
            "no NIXL found",
            "install it (pip install --no-deps nixl-cu12==1.5.1, or nixl-cu13 on CUDA 13 "
            "hosts) in this Python's environment, or give --nixl-path <folder holding libnixl.so>",
            sep=": ")
    return found


def orphaned_plugins(plugin_file: str) -> List[str]:
    """Our plugin left in a NIXL wheel's plugin folder after that NIXL was uninstalled (pip
    removes the files it installed, not the one `nixl-bounce install` added): every
    `<entry>/.nixl_cuXX.mesonpy.libs/plugins/<plugin_file>` of this Python's path with no
    libnixl.so beside the folder."""
    found = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        pattern = os.path.join(entry, ".nixl_cu*.mesonpy.libs", "plugins", plugin_file)
        for plugin in sorted(glob.glob(pattern)):
            lib_dir = os.path.dirname(os.path.dirname(plugin))
            real = os.path.realpath(plugin)
            if not os.path.isfile(os.path.join(lib_dir, "libnixl.so")) and real not in found:
                found.append(real)
    return found
