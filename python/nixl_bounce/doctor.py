"""`nixl-bounce doctor`: every check prints OK, WARN or FAIL, each problem with its fix; the
exit code is 1 when anything FAILed. Under CI (the CI environment variable 1, true or yes) a
check that cannot give an answer (an unreadable ptrace scope, a skipped live check) FAILs."""
import json
import os
import re
import subprocess
import sys
from typing import List, Optional, Sequence

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

    def line(self, state: str, what: str, fix: Optional[str] = None, detail: Sequence[str] = ()):
        if state == "FAIL":
            self.failed += 1
        print(f"[{state:^4}] {what}")
        for d in detail:
            print(f"       | {d}")
        if fix:
            print(f"       fix: {fix}")

    def ok(self, what):
        self.line("OK", what)

    def warn(self, what, fix=None):
        self.line("WARN", what, fix)

    def fail(self, what, fix, detail: Sequence[str] = ()):
        self.line("FAIL", what, fix, detail)


def _load_fix(error: str) -> str:
    """What to do about a plugin that the dynamic loader refused with `error`."""
    m = re.search(r"(GLIBC(?:XX)?_[0-9.]+)' not found", error)
    if m:
        # Not a broken install: the wheel was built on a newer distribution than this one
        # (review 55 L5). NIXL's own wheels are manylinux_2_28.
        return (f"this wheel was built against a newer C library than this host has ({m.group(1)} is "
                f"missing): build nixl-bounce on this host or on the oldest distribution you deploy to "
                f"(README \"Install into your own NIXL\"), then install that wheel")
    return "reinstall nixl-bounce (pip install --force-reinstall <wheel>)"


def _tested_versions(r: Report, plugin: str):
    try:
        from_so = probes.tested_nixl_versions(plugin)
    except OSError as e:
        r.fail(f"cannot load the wheel's plugin {plugin}: {e}", _load_fix(str(e)))
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


def ucx_fix(nixl: locate.NixlInstall) -> str:
    """How to point BOUNCE at NIXL's own UCX plugin: a copy or link of it elsewhere cannot find
    its UCX libraries (they are found relative to the folder NIXL installed it in)."""
    return (f"set {plugin_files.UCX_PLUGIN_ENV}={os.path.join(nixl.plugin_dir, plugin_files.UCX_PLUGIN_FILE)} "
            f"(or the backend param bounce_ucx_plugin) in the processes that use NIXL: NIXL's own "
            f"copy, where its UCX libraries are found; a copy or link of it elsewhere cannot load them")


def _has_gpus() -> bool:
    """Whether this host has (or is meant to have) GPUs: CUDA shows some, or a driver is
    installed but broken."""
    c = probes.cuda()
    return bool(c.gpus) or c.broken


def _check_kernels(r: Report, plugin: str, gpus: Optional[bool] = None) -> None:
    """Whether the plugin NIXL loads carries its GPU kernels (PTX embedded at build time by
    NVRTC): without them its GPU-memory (VRAM) bounce path and same-host CUDA IPC path are off."""
    try:
        built = plugin_files.gpu_kernels(plugin)
    except OSError as e:
        r.warn(f"cannot read {plugin} to see whether it carries its GPU kernels: {e}", "nixl-bounce install")
        return
    if built:
        r.ok(f"BOUNCE carries its GPU kernels (PTX built by {built})")
        return
    if gpus is None:
        gpus = _has_gpus()
    what = (f"BOUNCE at {plugin} was built WITHOUT its GPU kernels (no NVRTC at build time): "
            f"GPU-memory (VRAM) transfers do not bounce and the same-host CUDA IPC path is off")
    if gpus:
        r.warn(what + "; this host has GPUs", plugin_files.REBUILD_WITH_KERNELS)
    else:
        r.ok(what + "; this host has no GPU, so host-memory transfers lose nothing (a GPU host needs "
             "a build with them)")


def _check_ucx(r: Report, nixl: locate.NixlInstall, load_dir: str) -> None:
    """The UCX plugin BOUNCE delegates to: NIXL_BOUNCE_UCX_PLUGIN, else libplugin_UCX.so beside
    the BOUNCE NIXL loads (src/sys/inner_plugin.rs `locate_ucx_plugin`)."""
    configured = os.environ.get(plugin_files.UCX_PLUGIN_ENV) or None
    ucx = configured or os.path.join(load_dir, plugin_files.UCX_PLUGIN_FILE)
    how = f" ({plugin_files.UCX_PLUGIN_ENV})" if configured else ""
    own = os.path.join(nixl.plugin_dir, plugin_files.UCX_PLUGIN_FILE)
    if not os.path.isfile(ucx):
        fix = (ucx_fix(nixl) if os.path.isfile(own) and os.path.abspath(ucx) != os.path.abspath(own)
               else f"reinstall NIXL, or set bounce_ucx_plugin / {plugin_files.UCX_PLUGIN_ENV} to its path")
        r.fail(f"no UCX plugin at {ucx}{how}: BOUNCE delegates to it", fix)
        return
    if os.path.abspath(ucx) != os.path.abspath(own):
        # Not NIXL's own copy: its UCX libraries may be out of its reach; only a fresh process
        # tells (this one may have UCX loaded already).
        err = probes.load_error_alone(ucx)
        if err:
            r.fail(f"UCX plugin {ucx}{how} cannot be loaded: {err}",
                   ucx_fix(nixl) if os.path.isfile(own) else "reinstall NIXL")
            return
    try:
        api = probes.plugin_api_version(ucx)
    except OSError as e:
        r.fail(f"UCX plugin {ucx} cannot be loaded: {e}",
               "reinstall NIXL" if os.path.abspath(ucx) == os.path.abspath(own) else ucx_fix(nixl))
        return
    if api == PLUGIN_API_VERSION:
        r.ok(f"UCX plugin found ({ucx}{how}, plugin API {api})")
    else:
        r.fail(f"UCX plugin {ucx} has plugin API version {api}; BOUNCE speaks {PLUGIN_API_VERSION}",
               "install the NIXL version this build was tested with")


def _check_plugin_dir(r: Report, nixl: locate.NixlInstall) -> bool:
    """The plugin directory NIXL loads from (NIXL_PLUGIN_DIR when set, else NIXL's own), the
    UCX plugin BOUNCE delegates to, and the BOUNCE there; True when BOUNCE is installed."""
    override = plugin_files.plugin_dir_override()
    load_dir = nixl.plugin_dir
    fix = replace = "nixl-bounce install"
    if override and not plugin_files.same_dir(override, nixl.plugin_dir):
        load_dir = os.path.abspath(os.path.expanduser(override))
        fix = replace = ("nixl-bounce install with NIXL_PLUGIN_DIR set (it puts this wheel's copy there "
                         "too), or unset NIXL_PLUGIN_DIR")
        if not os.path.isdir(load_dir):
            r.fail(f"NIXL_PLUGIN_DIR={override} is set but is not a folder: NIXL loads plugins only "
                   f"from there, so it finds none",
                   f"unset NIXL_PLUGIN_DIR (NIXL then loads from {nixl.plugin_dir}), or create it and run {fix}")
            return False
        r.ok(f"NIXL_PLUGIN_DIR={override} is set: NIXL loads plugins only from there, not from "
             f"{nixl.plugin_dir} (and offers only the backends there); checking the plugins there")
    elif not os.path.isdir(nixl.plugin_dir):
        r.fail(f"plugin directory {nixl.plugin_dir} is missing",
               "reinstall NIXL (pip install --force-reinstall --no-deps nixl-cu12==1.5.1)")
        return False
    else:
        r.ok(f"plugin directory: {nixl.plugin_dir}")
    _check_ucx(r, nixl, load_dir)
    target = os.path.join(load_dir, PLUGIN_FILE)
    if not os.path.isfile(target):
        r.fail(f"BOUNCE is not installed ({target} missing)", fix)
        return False
    if plugin_files.is_same_file(target):
        r.ok(f"BOUNCE installed: {target} (same file as the wheel's)")
    else:
        r.fail(f"BOUNCE at {target}, the one NIXL loads, differs from this wheel's {bundled_plugin()} "
               f"(stale, or not this build)",
               replace if override else "nixl-bounce install (replaces it with this wheel's)")
    try:
        api = probes.plugin_api_version(target)
    except OSError as e:
        r.fail(f"{target} cannot be loaded: {e}", fix)
        return False
    if api == PLUGIN_API_VERSION:
        r.ok(f"BOUNCE plugin API version {api}")
    else:
        r.fail(f"BOUNCE declares plugin API version {api}, expected {PLUGIN_API_VERSION}", fix)
    _check_kernels(r, target)
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


#: NIXL_BOUNCE_* variables the live check keeps: where NIXL's UCX plugin is (part of the
#: install), the version guard's opt-in (the NIXL check reports it), the guard's test hook, and
#: logging. Every other NIXL_BOUNCE_* (the option overrides, which win over backend params, and
#: the recorders) is removed from the live check's environment: it tests the install.
LIVE_KEEPS = (plugin_files.UCX_PLUGIN_ENV, ALLOW_UNTESTED_ENV, "NIXL_BOUNCE_TEST_FAKE_NIXL_VERSION",
              "NIXL_BOUNCE_LOG", "NIXL_BOUNCE_LOG_SPANS")
_FALSE = ("0", "false", "no", "off")


def ignored_overrides(environ=None) -> List[str]:
    """The NIXL_BOUNCE_* variables set here that the live check runs without, sorted."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith("NIXL_BOUNCE_") and k not in LIVE_KEEPS)


def live_env(environ=None) -> dict:
    """The live check's environment: this one without `ignored_overrides`."""
    environ = os.environ if environ is None else environ
    drop = set(ignored_overrides(environ))
    return {k: v for k, v in environ.items() if k not in drop}


def _check_env_overrides(r: Report, live: bool) -> None:
    """Says which NIXL_BOUNCE_* overrides are set: they win over backend params in the user's
    own runs, and the live check runs without them."""
    names = ignored_overrides()
    if not names:
        return
    shown = ", ".join(f"{k}={os.environ[k]!r}" for k in names)
    what = (f"environment overrides set: {shown}; they win over backend params in your own runs"
            + ("; the live check below runs without them (it tests the install, not them)" if live else ""))
    enable = os.environ.get("NIXL_BOUNCE_ENABLE")
    if enable is not None and _ascii_lower(enable.strip()) in _FALSE:
        r.warn(what + "; NIXL_BOUNCE_ENABLE turns the bounce path OFF in every process that has it",
               "unset NIXL_BOUNCE_ENABLE where you want BOUNCE to bounce")
    else:
        r.ok(what)


def _stderr_lines(stderr: str, n: int = 6) -> List[str]:
    """The child's last `n` log lines that matter (BOUNCE's, warnings and errors), else its last
    `n` lines."""
    lines = [l.rstrip() for l in stderr.splitlines() if l.strip()]
    keep = [l for l in lines if "BOUNCE" in l or "ERROR" in l or "WARN" in l or "rror" in l]
    return (keep or lines)[-n:]


def _missing_module(error: str) -> Optional[str]:
    marker = "No module named '"
    if marker in error:
        return error.split(marker, 1)[1].split("'", 1)[0].split(".")[0]
    return None


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
    rerun = f"{sys.executable} -m nixl_bounce.live {nixl.package}"
    try:
        proc = subprocess.run([sys.executable, "-m", "nixl_bounce.live", nixl.package],
                              capture_output=True, text=True, timeout=LIVE_TIMEOUT_S, env=live_env())
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        r.fail(f"live check: no result in {LIVE_TIMEOUT_S} s",
               f"run `NIXL_BOUNCE_LOG=debug {rerun}` to see where it stops", _stderr_lines(err))
        return True
    lines = [l for l in proc.stdout.splitlines() if l.startswith("NIXL_BOUNCE_LIVE ")]
    if not lines:
        r.fail(f"live check crashed (exit code {proc.returncode})",
               f"run `NIXL_BOUNCE_LOG=debug {rerun}` and report it",
               _stderr_lines(proc.stderr) or ["(no output)"])
        return True
    res = json.loads(lines[-1][len("NIXL_BOUNCE_LIVE "):])
    if res["ok"]:
        r.ok(f"live: two agents created BOUNCE, exchanged metadata and bounced a WRITE of "
             f"{res['descriptors']} x 4 KiB ({res['chunks']} chunk(s), {res['ms']} ms), bytes checked")
        return True
    log = _stderr_lines(proc.stderr)
    said = " ".join([res["error"]] + log)
    stage = res["stage"]
    if stage == "create BOUNCE" and ("UCX plugin" in said or plugin_files.UCX_PLUGIN_FILE in said):
        fix = ucx_fix(nixl)
    elif stage == "create BOUNCE":
        fix = "the plugin's lines below say why; `nixl-bounce install` and a tested NIXL fix most causes"
    elif stage == "setup" and _missing_module(res["error"]):
        fix = (f"pip install {_missing_module(res['error'])} (with {sys.executable}; "
               f"NIXL's Python API needs it)")
    elif stage in ("bounce ready", "bounce path", "transfer"):
        fix = (f"the plugin's lines below say why; for more, run `NIXL_BOUNCE_LOG=debug {rerun}` "
               f"and report it")
    else:
        fix = f"run `NIXL_BOUNCE_LOG=debug {rerun}` and report it"
    r.fail(f"live check failed at '{stage}': {res['error']}", fix, log)
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
    _check_env_overrides(r, live)
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
