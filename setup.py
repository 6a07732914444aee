"""Build glue for the wheel (metadata lives in pyproject.toml): cargo builds the plugin, the
wheel carries it as `nixl_bounce/libplugin_BOUNCE.so`, tagged py3-none-<platform>."""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.dist import Distribution
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 ships bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))


def check_kernels(built):
    """Refuses a plugin built without its GPU kernels unless BOUNCE_ALLOW_NO_KERNELS=1
    (nixl_bounce.plugin_files.kernels_build_check)."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    try:
        from nixl_bounce import plugin_files
    finally:
        sys.path.pop(0)
    problem = plugin_files.kernels_build_check(built)
    if problem is None:
        return
    message, fatal = problem
    if fatal:
        raise SystemExit(message)
    sys.stderr.write(message)


class BuildWithPlugin(build_py):
    """build_py, plus the release build of the plugin copied in under NIXL's plugin name."""

    def run(self):
        super().run()
        try:
            subprocess.run(["cargo", "build", "--release", "--lib", "--quiet"], cwd=ROOT, check=True)
        except FileNotFoundError:
            raise SystemExit("building the nixl-bounce wheel needs a Rust toolchain: cargo is not on PATH "
                             "(https://rustup.rs)") from None
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
        built = os.path.join(target, "release", "libnixl_bounce.so")
        check_kernels(built)
        self.copy_file(built, os.path.join(self.build_lib, "nixl_bounce", "libplugin_BOUNCE.so"))


class NativeDistribution(Distribution):
    """Holds native code, so everything installs into platlib at the wheel's root."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """A platform wheel (it holds native code) for any Python 3 (it holds no extension module)."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildWithPlugin, "bdist_wheel": PlatformWheel})
