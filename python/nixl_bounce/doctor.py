"""`nixl-bounce doctor`: every check prints OK, WARN or FAIL, each problem with its fix; the
exit code is 1 when anything FAILed."""
import json
import os
import subprocess
import sys
from typing import List, Optional

from nixl_bounce import (ALLOW_UNTESTED_ENV, PLUGIN_FILE, TESTED_NIXL_VERSIONS, __version__,
                         bundled_plugin, locate, plugin_files, probes)

#: NIXL_PLUGIN_API_VERSION of the NIXL releases BOUNCE is built for.
PLUGIN_API_VERSION = 1
LIVE_TIMEOUT_S = 120


class Report:
    def __init__(self):
        self.failed = 0

    def line(self, state: str, what: str, fix: Optional[str] = None):
        if state == "FAIL":
            self.failed += 1
        print(f"[{state:^4}] {what}")
        if fix:
            print(f"       fix: {fix}")

    def ok(self, what):
        self.line("OK", what)

    def warn(self, what, fix=None):
        self.line("WARN", what, fix)

    def fail(self, what, fix):
        self.line("FAIL", what, fix)


def _tested_versions(r: Report, plugin: str):
    try:
        from_so = probes.tested_nixl_versions(plugin)
    except OSError as e:
        r.fail(f"cannot load the wheel's plugin {plugin}: {e}",
               "reinstall nixl-bounce (pip install --force-reinstall <wheel>)")
        return TESTED_NIXL_VERSIONS
    if from_so is None:
        r.warn(f"{plugin} does not say which NIXL versions it accepts (an older build?)",
               "reinstall nixl-bounce from a current wheel")
        return TESTED_NIXL_VERSIONS
    return from_so


def _check_nixl(r: Report, nixl: locate.NixlInstall, tested) -> None:
    if nixl.version in tested:
        r.ok(f"NIXL: {nixl.describe()} (tested with this build)")
    elif os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        r.warn(f"NIXL: {nixl.describe()}, NOT one this build was tested with ({', '.join(tested)}); "
               f"loading anyway because {ALLOW_UNTESTED_ENV}=1",
               f"pip install --no-deps {(nixl.package or 'nixl_cu12').replace('_', '-')}=={tested[-1]}")
    else:
        r.fail(f"NIXL: {nixl.describe()}, NOT one this build was tested with ({', '.join(tested)}): "
               "BOUNCE refuses to load into it",
               f"pip install --no-deps {(nixl.package or 'nixl_cu12').replace('_', '-')}=={tested[-1]}, "
               f"or accept the risk with {ALLOW_UNTESTED_ENV}=1")


def _check_plugin_dir(r: Report, nixl: locate.NixlInstall) -> bool:
    """The plugin dir, UCX and BOUNCE in it; True when BOUNCE is installed."""
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env and os.path.abspath(env) != os.path.abspath(nixl.plugin_dir):
        r.warn(f"NIXL_PLUGIN_DIR={env} is set: NIXL looks there, not in {nixl.plugin_dir}",
               f"unset NIXL_PLUGIN_DIR, or put {PLUGIN_FILE} and libplugin_UCX.so there")
    if not os.path.isdir(nixl.plugin_dir):
        r.fail(f"plugin directory {nixl.plugin_dir} is missing",
               "reinstall NIXL (pip install --force-reinstall --no-deps nixl-cu12==1.5.1)")
        return False
    r.ok(f"plugin directory: {nixl.plugin_dir}")
    ucx = os.path.join(nixl.plugin_dir, plugin_files.UCX_PLUGIN_FILE)
    if os.path.isfile(ucx):
        try:
            api = probes.plugin_api_version(ucx)
        except OSError as e:
            r.fail(f"UCX plugin {ucx} cannot be loaded: {e}", "reinstall NIXL")
        else:
            if api == PLUGIN_API_VERSION:
                r.ok(f"UCX plugin found ({plugin_files.UCX_PLUGIN_FILE}, plugin API {api})")
            else:
                r.fail(f"UCX plugin has plugin API version {api}; BOUNCE speaks {PLUGIN_API_VERSION}",
                       "install the NIXL version this build was tested with")
    else:
        r.fail(f"no {plugin_files.UCX_PLUGIN_FILE} in {nixl.plugin_dir}: BOUNCE delegates to it",
               "reinstall NIXL, or set bounce_ucx_plugin / NIXL_BOUNCE_UCX_PLUGIN to its path")
    target = plugin_files.installed_path(nixl)
    if not os.path.isfile(target):
        r.fail(f"BOUNCE is not installed ({target} missing)", "nixl-bounce install")
        return False
    if plugin_files.is_current(nixl):
        r.ok(f"BOUNCE installed: {target} (same file as the wheel's)")
    else:
        r.fail(f"BOUNCE at {target} differs from this wheel's {bundled_plugin()}",
               "nixl-bounce install (replaces it with this wheel's)")
    try:
        api = probes.plugin_api_version(target)
    except OSError as e:
        r.fail(f"{target} cannot be loaded: {e}", "nixl-bounce install")
        return False
    if api == PLUGIN_API_VERSION:
        r.ok(f"BOUNCE plugin API version {api}")
    else:
        r.fail(f"BOUNCE declares plugin API version {api}, expected {PLUGIN_API_VERSION}",
               "nixl-bounce install")
    return True


def _check_cuda(r: Report, nixl: locate.NixlInstall) -> None:
    c = probes.cuda()
    if c.error:
        r.ok(f"CUDA: none ({c.error}); host memory (DRAM) transfers only")
        return
    gpus = ", ".join(c.gpus) if c.gpus else "no GPUs"
    want = 13 if nixl.package == "nixl_cu13" else 12 if nixl.package == "nixl_cu12" else None
    if want and c.driver_int // 1000 < want:
        r.warn(f"CUDA driver {c.driver} with {nixl.package}: GPU (VRAM) transfers need a CUDA {want} driver",
               f"use nixl-cu{c.driver_int // 1000} or update the NVIDIA driver")
    else:
        r.ok(f"CUDA driver {c.driver}; {len(c.gpus)} GPU(s): {gpus}")


def _check_same_host(r: Report, scope: Optional[int]) -> None:
    """Whether processes of this host may use the same-host path for host memory (CMA): Yama's
    ptrace scope `scope` (None: no Yama) decides, as it does for UCX's own cma transport."""
    what = "same-host path for host memory (CMA)"
    if scope is None or scope == 0:
        r.ok(f"{what}: allowed between processes of one user"
             + (" (no Yama)" if scope is None else " (Yama ptrace_scope 0)"))
    elif scope == 1:
        r.ok(f"{what}: allowed (Yama ptrace_scope 1: UCX's cma component lets processes of the user "
             f"attach, PR_SET_PTRACER_ANY, when BOUNCE's inner UCX engine starts)")
    elif scope == 2:
        r.warn(f"{what}: only processes with CAP_SYS_PTRACE may use it (Yama ptrace_scope 2); "
               f"host-memory transfers between processes of this host bounce instead",
               "give the processes CAP_SYS_PTRACE, or set kernel.yama.ptrace_scope to 1 if your "
               "security policy allows")
    else:
        r.warn(f"{what}: unavailable (Yama ptrace_scope {scope}: no process may attach); "
               f"host-memory transfers between processes of this host bounce instead",
               "set kernel.yama.ptrace_scope to 1 if your security policy allows (needs a reboot "
               "from 3)")


def _live(r: Report, nixl: locate.NixlInstall) -> None:
    importable = {n.lib_dir for n in locate.importable()}
    if nixl.package is None or nixl.lib_dir not in importable:
        r.warn(f"live check skipped: {nixl.describe()} is not importable from {sys.executable}",
               f"run the doctor with the Python of that environment")
        return
    try:
        proc = subprocess.run([sys.executable, "-m", "nixl_bounce.live", nixl.package],
                              capture_output=True, text=True, timeout=LIVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        r.fail(f"live check: no result in {LIVE_TIMEOUT_S} s", "run with NIXL_BOUNCE_LOG=debug to see where it stops")
        return
    lines = [l for l in proc.stdout.splitlines() if l.startswith("NIXL_BOUNCE_LIVE ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        r.fail(f"live check crashed (exit code {proc.returncode}): {tail}",
               "run `python -m nixl_bounce.live` with NIXL_BOUNCE_LOG=debug and report it")
        return
    res = json.loads(lines[-1][len("NIXL_BOUNCE_LIVE "):])
    if res["ok"]:
        r.ok(f"live: two agents created BOUNCE, exchanged metadata and bounced a WRITE of "
             f"{res['descriptors']} x 4 KiB ({res['chunks']} chunk(s), {res['ms']} ms), bytes checked")
        return
    bounce_lines = [l for l in proc.stderr.splitlines() if "BOUNCE" in l and ("ERROR" in l or "refus" in l)]
    detail = f" ({bounce_lines[-1].strip()})" if bounce_lines else ""
    fixes = {
        "create BOUNCE": "see the NIXL line above; `nixl-bounce install` and a tested NIXL fix most causes",
        "bounce ready": "check that both agents run BOUNCE with bounce_enable=true and the same bounce_control",
        "bounce path": "check the bounce_min_descriptor_count / bounce_max_average_descriptor_size params",
    }
    r.fail(f"live check failed at '{res['stage']}': {res['error']}{detail}",
           fixes.get(res["stage"], "run with NIXL_BOUNCE_LOG=debug and report it"))


def run(nixl_path: Optional[str], live: bool = True) -> int:
    r = Report()
    plugin = bundled_plugin()
    print(f"nixl-bounce {__version__} (plugin {plugin})")
    if not os.path.isfile(plugin):
        r.fail(f"the wheel's plugin {plugin} is missing", "pip install --force-reinstall <nixl-bounce wheel>")
        return 1
    tested = _tested_versions(r, plugin)
    try:
        installs: List[locate.NixlInstall] = locate.find(nixl_path)
    except locate.NixlNotFound as e:
        r.fail(str(e).split(":")[0], str(e).split(":", 1)[-1].strip())
        return 1
    for nixl in installs:
        _check_nixl(r, nixl, tested)
        installed = _check_plugin_dir(r, nixl)
        _check_cuda(r, nixl)
        _check_same_host(r, probes.ptrace_scope())
        if live and installed:
            _live(r, nixl)
    print("all checks passed" if r.failed == 0 else f"{r.failed} problem(s) found")
    return 1 if r.failed else 0
