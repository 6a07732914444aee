"""The `nixl-bounce` command: install, uninstall, doctor."""
import argparse
import os
import sys

from nixl_bounce import __version__, bundled_plugin, plugin_files
from nixl_bounce.locate import NixlNotFound, find


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _tested_versions():
    """The NIXL versions the wheel's plugin accepts (its own list, else this package's)."""
    from nixl_bounce import TESTED_NIXL_VERSIONS, probes
    try:
        return probes.tested_nixl_versions(bundled_plugin()) or TESTED_NIXL_VERSIONS
    except OSError:
        return TESTED_NIXL_VERSIONS


def _warn_untested(nixl, tested) -> None:
    from nixl_bounce import ALLOW_UNTESTED_ENV
    from nixl_bounce.doctor import allow_untested
    if nixl.version in tested:
        return
    dist = (nixl.package or "nixl_cu12").replace("_", "-")
    if allow_untested(os.environ.get(ALLOW_UNTESTED_ENV)):
        _warn(f"{nixl.describe()} is NOT a NIXL version this build was tested with ({', '.join(tested)}); "
              f"BOUNCE loads into it only because {ALLOW_UNTESTED_ENV} is set, at your own risk")
    else:
        _warn(f"{nixl.describe()} is NOT a NIXL version this build was tested with ({', '.join(tested)}): "
              f"BOUNCE will refuse to load into it. Fix: pip install --no-deps {dist}=={tested[-1]} "
              f"(or accept the risk with {ALLOW_UNTESTED_ENV}=1)")


def _warn_no_kernels() -> None:
    try:
        built = plugin_files.gpu_kernels(bundled_plugin())
    except OSError:
        return
    if not built:
        _warn(f"this nixl-bounce wheel was built WITHOUT its GPU kernels (NVRTC was not found when it "
              f"was built): GPU-memory (VRAM) transfers will not bounce and the same-host CUDA IPC path "
              f"is off; host-memory transfers are unaffected. On GPU hosts, "
              f"{plugin_files.REBUILD_WITH_KERNELS}")


def _install_into_plugin_dir_env(installs) -> int:
    """With NIXL_PLUGIN_DIR set (and not one of the NIXLs' own folders) NIXL loads plugins only
    from there: install there too, or say loudly that NIXL keeps loading whatever is there."""
    env = plugin_files.plugin_dir_override()
    if not env or any(plugin_files.same_dir(env, n.plugin_dir) for n in installs):
        return 0
    target = os.path.join(os.path.abspath(os.path.expanduser(env)), plugin_files.PLUGIN_FILE)
    if not os.path.isdir(env):
        print(f"error: NIXL_PLUGIN_DIR={env} is set but is not a folder: NIXL loads plugins only from "
              f"there, so it will find none (no BOUNCE). Fix: unset NIXL_PLUGIN_DIR, or create that "
              f"folder and run nixl-bounce install again", file=sys.stderr)
        return 1
    try:
        result = plugin_files.install_into(env)
    except OSError as e:
        what = "an OLD or foreign BOUNCE that is there" if os.path.exists(target) else "no BOUNCE at all"
        print(f"error: NIXL_PLUGIN_DIR={env} is set, so NIXL loads plugins only from there, and {target} "
              f"was NOT updated: {e}. NIXL will load {what}. Fix: copy {bundled_plugin()} to {target} "
              f"yourself, or unset NIXL_PLUGIN_DIR", file=sys.stderr)
        return 1
    print(f"{result}: {target} (NIXL_PLUGIN_DIR: NIXL loads plugins only from there)")
    if not os.environ.get(plugin_files.UCX_PLUGIN_ENV):
        from nixl_bounce import probes
        from nixl_bounce.doctor import ucx_fix
        beside = os.path.join(os.path.dirname(target), plugin_files.UCX_PLUGIN_FILE)
        why = f"there is none in {env}" if not os.path.exists(beside) else None
        if why is None:
            err = probes.load_error_alone(beside)
            why = f"{beside} cannot load from there ({err})" if err else None
        if why:
            _warn(f"BOUNCE in NIXL_PLUGIN_DIR delegates to NIXL's UCX plugin, and {why}. "
                  f"Fix: {ucx_fix(installs[0])}. NIXL itself then offers only the backends in "
                  f"NIXL_PLUGIN_DIR (BOUNCE passes everything else to UCX)")
    return 0


def cmd_install(args) -> int:
    code = 0
    installs = find(args.nixl_path)
    tested = _tested_versions()
    for nixl in installs:
        try:
            result = plugin_files.install(nixl)
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
            continue
        print(f"{result}: {plugin_files.installed_path(nixl)} ({nixl.describe()})")
        _warn_untested(nixl, tested)
        if not os.path.isfile(os.path.join(nixl.plugin_dir, plugin_files.UCX_PLUGIN_FILE)):
            _warn(f"no {plugin_files.UCX_PLUGIN_FILE} in {nixl.plugin_dir}: BOUNCE delegates to it; set "
                  f"the backend param bounce_ucx_plugin (or {plugin_files.UCX_PLUGIN_ENV}) to its path")
    code |= _install_into_plugin_dir_env(installs)
    _warn_no_kernels()
    return code


def _orphans(nixl_path):
    """Plugins of ours whose NIXL is gone: the folder `nixl_path` names when it holds one (a
    plugins folder whose libnixl.so went with its wheel), else every one on this Python's path
    (see `locate.orphaned_plugins`)."""
    from nixl_bounce import locate
    if nixl_path:
        target = os.path.join(os.path.abspath(os.path.expanduser(nixl_path)), plugin_files.PLUGIN_FILE)
        return [target] if os.path.lexists(target) else []
    return locate.orphaned_plugins(plugin_files.PLUGIN_FILE)


def cmd_uninstall(args) -> int:
    code = 0
    try:
        installs, missing = find(args.nixl_path), None
    except NixlNotFound as e:
        installs, missing = [], e
    # `pip uninstall nixl-cuXX` before us leaves our plugin behind, where `find` sees no NIXL
    # any more (review 55 L3): removed too; a NIXL path that was found names nothing else.
    orphans = [] if args.nixl_path and installs else _orphans(args.nixl_path)
    if missing and not orphans:
        raise missing
    for nixl in installs:
        try:
            removed = plugin_files.uninstall(nixl)
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
            continue
        state = "removed" if removed else "not installed"
        print(f"{state}: {plugin_files.installed_path(nixl)}")
    for orphan in orphans:
        try:
            plugin_files.uninstall_from(os.path.dirname(orphan))
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
            continue
        print(f"removed: {orphan} (left behind: its NIXL is no longer installed)")
    env = plugin_files.plugin_dir_override()
    if env and os.path.isdir(env) and not any(plugin_files.same_dir(env, n.plugin_dir) for n in installs):
        try:
            if plugin_files.uninstall_from(env):
                print(f"removed: {os.path.join(env, plugin_files.PLUGIN_FILE)} (NIXL_PLUGIN_DIR)")
        except OSError as e:
            print(f"error: NIXL_PLUGIN_DIR={env}: {e}; NIXL, which loads plugins only from there, "
                  f"still offers BOUNCE", file=sys.stderr)
            code = 1
    return code


def cmd_doctor(args) -> int:
    from nixl_bounce import doctor
    return doctor.run(args.nixl_path, live=not args.no_live)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nixl-bounce", description=(
        "Installs the BOUNCE backend plugin into an installed NIXL (nixl-cu12 / nixl-cu13) and "
        "checks the set-up."))
    parser.add_argument("--version", action="version", version=f"nixl-bounce {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    path_help = ("NIXL's lib folder (holding libnixl.so), its plugins folder, or a site-packages "
                 "folder; default: every NIXL wheel this Python can import")
    p = sub.add_parser("install", help="copy libplugin_BOUNCE.so into every importable NIXL's plugin "
                                       "directory (and NIXL_PLUGIN_DIR when set)")
    p.add_argument("--nixl-path", help=path_help)
    p.set_defaults(func=cmd_install)
    p = sub.add_parser("uninstall", help="remove libplugin_BOUNCE.so from NIXL's plugin directory "
                                         "(and any left where a NIXL was uninstalled first)")
    p.add_argument("--nixl-path", help=path_help + "; or a plugins folder whose NIXL is gone")
    p.set_defaults(func=cmd_uninstall)
    p = sub.add_parser("doctor", help="check NIXL's version, the plugin and its UCX plugin, GPU kernels, "
                                      "CUDA, same-host (ptrace) permission, NIXL_BOUNCE_* overrides, and "
                                      "a live two-agent bounce")
    p.add_argument("--nixl-path", help=path_help)
    p.add_argument("--no-live", action="store_true", help="skip the live two-agent transfer")
    p.set_defaults(func=cmd_doctor)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except (NixlNotFound, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: once NIXL's UCX libraries are loaded (doctor's ABI
    # probe), NIXL 1.5.1's bundled networking library can crash at normal exit.
    os._exit(code)
