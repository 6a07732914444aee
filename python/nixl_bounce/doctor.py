"""`nixl-bounce doctor`: every check prints OK, WARN or FAIL, each problem with its fix; the
exit code is 1 when anything FAILed. Under CI (the CI environment variable 1, true or yes) a
check that cannot give an answer (an unreadable ptrace scope, a skipped live check) FAILs."""
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


def _ascii_lower(value: str) -> str:
    return value.translate({c: c + 32 for c in range(ord("A"), ord("Z") + 1)})


def allow_untested(value: Optional[str]) -> bool:
    """Whether a NIXL_BOUNCE_ALLOW_UNTESTED_NIXL value opts in: the plugin guard's rule
    (src/sys/nixl_version.rs `is_opt_in`): 1, true, yes or on, any case, surrounding
    whitespace ignored."""
    return value is not None and _ascii_lower(value.strip()) in ("1", "true", "yes", "on")


def under_ci(value: Optional[str] = None) -> bool:
    """Whether this runs under CI: the CI environment variable (or `value`) is 1, true or yes,
    any case, as ci/test reads it."""
    if value is None:
        value = os.environ.get("CI")
    return value is not None and _ascii_lower(value.strip()) in ("1", "true", "yes")


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
    if tuple(from_so) != tuple(TESTED_NIXL_VERSIONS):
        r.warn(f"the plugin's tested NIXL versions ({', '.join(from_so) or 'none'}) differ from this "
               f"package's list ({', '.join(TESTED_NIXL_VERSIONS)}); checking against the plugin's, which "
               f"its version guard enforces",
               "reinstall nixl-bounce from one wheel (the plugin and the Python package come from "
               "different builds)")
    return from_so


def _check_nixl(r: Report, nixl: locate.NixlInstall, tested) -> None:
    opt_in = os.environ.get(ALLOW_UNTESTED_ENV)
    if nixl.version in tested:
        r.ok(f"NIXL: {nixl.describe()} (tested with this build)")
    elif allow_untested(opt_in):
        r.warn(f"NIXL: {nixl.describe()}, NOT one this build was tested with ({', '.join(tested)}); "
               f"loading anyway because {ALLOW_UNTESTED_ENV}={opt_in.strip()}",
               f"pip install --no-deps {(nixl.package or 'nixl_cu12').replace('_', '-')}=={tested[-1]}")
    else:
        r.fail(f"NIXL: {nixl.describe()}, NOT one this build was tested with ({', '.join(tested)}): "
               "BOUNCE refuses to load into it",
               f"pip install --no-deps {(nixl.package or 'nixl_cu12').replace('_', '-')}=={tested[-1]}, "
               f"or accept the risk with {ALLOW_UNTESTED_ENV}=1")
    _check_dist_infos(r, nixl)


def _check_dist_infos(r: Report, nixl: locate.NixlInstall) -> None:
    """Several `<package>-*.dist-info` folders (a left-over of an interrupted upgrade or a
    copied site-packages): the plugin's guard reads the first its directory listing gives, in
    no defined order, and the doctor the first sorted, so the two may judge different versions."""
    if not nixl.package:
        return
    infos = locate.dist_infos(nixl.site, nixl.package)
    if len(infos) < 2:
        return
    named = ", ".join(f"{os.path.basename(d)} (Version: {locate.metadata_version(d) or 'none'})"
                      for d in infos)
    r.warn(f"several {nixl.package}-*.dist-info in {nixl.site}: {named}; the plugin's version guard "
           f"reads whichever the directory listing gives first, so it may judge another version than "
           f"the {nixl.version or 'unknown one'} shown here",
           "delete the dist-info folder(s) of the version(s) not installed (left-overs), keeping the one "
           "whose RECORD matches the installed files, then run the doctor again")


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
    if c.broken:
        r.warn(f"CUDA: libcuda.so.1 loads but does not work ({c.error}"
               + (f", driver {c.driver}" if c.driver else "") + "); only host memory (DRAM) transfers "
               "can run here",
               "check the NVIDIA driver with nvidia-smi (after a driver upgrade, reboot or reload its "
               "kernel module) and that this process may see the GPUs (CUDA_VISIBLE_DEVICES, the "
               "container's device access)")
        return
    if c.error:
        r.ok(f"CUDA: none ({c.error}); host memory (DRAM) transfers only")
        return
    gpus = ", ".join(c.gpus) if c.gpus else "no GPUs"
    want = 13 if nixl.package == "nixl_cu13" else 12 if nixl.package == "nixl_cu12" else None
    have = c.driver_int // 1000
    if c.driver_int <= 0:
        r.warn(f"CUDA driver version unknown (cuDriverGetVersion failed); {len(c.gpus)} GPU(s): {gpus}"
               + (f"; GPU (VRAM) transfers with {nixl.package} need a CUDA {want} driver" if want else ""),
               "check the NVIDIA driver with nvidia-smi")
    elif want and have < want:
        other = f"nixl_cu{have}"
        r.warn(f"CUDA driver {c.driver} with {nixl.package}: GPU (VRAM) transfers need a CUDA {want} driver",
               (f"use {other.replace('_', '-')} or update the NVIDIA driver" if other in locate.PACKAGES
                else f"update the NVIDIA driver to one for CUDA {want} or later"))
    else:
        r.ok(f"CUDA driver {c.driver}; {len(c.gpus)} GPU(s): {gpus}")


def _check_same_host(r: Report, scope) -> None:
    """Whether processes of this host may use the same-host path for host memory (CMA): Yama's
    ptrace scope `scope` (None: no Yama; a `probes.Unreadable`: Yama's file is there but gave
    no number) decides, as it does for UCX's own cma transport."""
    what = "same-host path for host memory (CMA)"
    if isinstance(scope, probes.Unreadable):
        msg = (f"{what}: could not read Yama's ptrace scope ({scope.why}), so whether processes of "
               f"this host may use it is unknown (a peer it may not reach is bounced to)")
        fix = (f"make {probes.YAMA_PTRACE_SCOPE} readable (it normally is, to every user) and "
               f"run the doctor again")
        if under_ci():
            r.fail(msg + "; CI is set: every check must give an answer", fix)
        else:
            r.warn(msg, fix)
    elif scope is None or scope == 0:
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


def _live(r: Report, nixl: locate.NixlInstall) -> bool:
    """The live check; False when it was skipped (a FAIL under CI)."""
    importable = {n.lib_dir for n in locate.importable()}
    if nixl.package is None or nixl.lib_dir not in importable:
        what = f"live check skipped: {nixl.describe()} is not importable from {sys.executable}"
        fix = "run the doctor with the Python of that environment"
        if under_ci():
            r.fail(what + "; CI is set: every check must run", fix)
        else:
            r.warn(what, fix)
        return False
    try:
        proc = subprocess.run([sys.executable, "-m", "nixl_bounce.live", nixl.package],
                              capture_output=True, text=True, timeout=LIVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        r.fail(f"live check: no result in {LIVE_TIMEOUT_S} s", "run with NIXL_BOUNCE_LOG=debug to see where it stops")
        return True
    lines = [l for l in proc.stdout.splitlines() if l.startswith("NIXL_BOUNCE_LIVE ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        r.fail(f"live check crashed (exit code {proc.returncode}): {tail}",
               "run `python -m nixl_bounce.live` with NIXL_BOUNCE_LOG=debug and report it")
        return True
    res = json.loads(lines[-1][len("NIXL_BOUNCE_LIVE "):])
    if res["ok"]:
        r.ok(f"live: two agents created BOUNCE, exchanged metadata and bounced a WRITE of "
             f"{res['descriptors']} x 4 KiB ({res['chunks']} chunk(s), {res['ms']} ms), bytes checked")
        return True
    bounce_lines = [l for l in proc.stderr.splitlines() if "BOUNCE" in l and ("ERROR" in l or "refus" in l)]
    detail = f" ({bounce_lines[-1].strip()})" if bounce_lines else ""
    fixes = {
        "create BOUNCE": "see the NIXL line above; `nixl-bounce install` and a tested NIXL fix most causes",
        "bounce ready": "check that both agents run BOUNCE with bounce_enable=true and the same bounce_control",
        "bounce path": "check the bounce_min_descriptor_count / bounce_max_average_descriptor_size params",
    }
    r.fail(f"live check failed at '{res['stage']}': {res['error']}{detail}",
           fixes.get(res["stage"], "run with NIXL_BOUNCE_LOG=debug and report it"))
    return True


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
        r.fail(e.what, e.fix)
        return 1
    live_skipped = False
    for nixl in installs:
        _check_nixl(r, nixl, tested)
        installed = _check_plugin_dir(r, nixl)
        _check_cuda(r, nixl)
        _check_same_host(r, probes.ptrace_scope())
        if not live:
            live_skipped = True
        elif installed and not _live(r, nixl):
            live_skipped = True
    if not live and under_ci():
        r.fail("live check skipped (--no-live); CI is set: every check must run",
               "run the doctor without --no-live")
    if r.failed:
        print(f"{r.failed} problem(s) found")
    else:
        print("all checks passed (live check skipped)" if live_skipped else "all checks passed")
    return 1 if r.failed else 0
