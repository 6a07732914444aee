"""Runs one benchmark variant as a child process and takes its RESULT line.

Each child runs in a session of its own and is killed as a group on a timeout: a child that
hangs has usually started a target process too, which would otherwise hold the pipes open and
stall the whole benchmark (plain UCX's scattered DRAM -> VRAM on the H200 host never finished).
"""
import json
import os
import signal
import subprocess


def run_child(cmd, timeout, env=None):
    """(result, error): the JSON after the child's `RESULT ` line, or None and why not.
    BENCH_VERBOSE=1 lets the child's stderr (BOUNCE's own log) through."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            stderr=None if os.environ.get("BENCH_VERBOSE") else subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout} s"
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), None
    return None, f"rc {proc.returncode}:\n{out}\n{(err or '')[-2000:]}"


def leave_after(proc, timeout=10):
    """Waits up to `timeout` s for a target process that was told to leave (killed if it has
    not), then leaves this process without interpreter teardown (`nixlkit.leave`)."""
    import nixlkit

    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    nixlkit.leave(0)


def to_ucx(counters):
    """The counters among a BOUNCE engine's (names without the "stats." prefix) that say a
    request went to plain UCX: the gate runs at prep, so any pass-through or fallback counted
    means one did. A benchmark whose variant should bounce or take the same-host path prints
    no figure when this is not empty."""
    return {k: v for k, v in counters.items() if v and (k == "passthrough_xfers" or k.startswith("fallback_"))}

