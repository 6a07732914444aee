"""The `nixl-bounce` command: install, uninstall, doctor."""
import argparse
import os
import sys

from nixl_bounce import __version__, bundled_plugin, plugin_files
from nixl_bounce.locate import NixlNotFound, find


def _plugin_dir_env_note():
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env:
        print(f"note: NIXL_PLUGIN_DIR={env} is set, so NIXL looks only there; copy or link "
              f"{bundled_plugin()} into it (next to libplugin_UCX.so) or unset it")


def cmd_install(args) -> int:
    for nixl in find(args.nixl_path):
        result = plugin_files.install(nixl)
        print(f"{result}: {plugin_files.installed_path(nixl)} ({nixl.describe()})")
        if not os.path.isfile(os.path.join(nixl.plugin_dir, plugin_files.UCX_PLUGIN_FILE)):
            print(f"warning: no {plugin_files.UCX_PLUGIN_FILE} in {nixl.plugin_dir}: BOUNCE delegates "
                  f"to it; set the backend param bounce_ucx_plugin (or NIXL_BOUNCE_UCX_PLUGIN) to its path")
    _plugin_dir_env_note()
    return 0


def cmd_uninstall(args) -> int:
    for nixl in find(args.nixl_path):
        removed = plugin_files.uninstall(nixl)
        state = "removed" if removed else "not installed"
        print(f"{state}: {plugin_files.installed_path(nixl)}")
    return 0


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
    p = sub.add_parser("install", help="copy libplugin_BOUNCE.so into NIXL's plugin directory")
    p.add_argument("--nixl-path", help=path_help)
    p.set_defaults(func=cmd_install)
    p = sub.add_parser("uninstall", help="remove libplugin_BOUNCE.so from NIXL's plugin directory")
    p.add_argument("--nixl-path", help=path_help)
    p.set_defaults(func=cmd_uninstall)
    p = sub.add_parser("doctor", help="check NIXL, the plugin, CUDA, and a live two-agent bounce")
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
