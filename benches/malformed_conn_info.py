"""What NIXL's UCX engine does on loadRemoteConnInfo with a malformed worker address (issue 13).

A throwaway probe, never part of the test suite (some cases kill the process): for each way of
spoiling the UCX conn info inside an otherwise valid agent metadata blob, a fresh child process
creates a UCX agent, calls add_remote_agent with the spoiled blob, then tries one notification to
that agent, and reports how it ended (return code, signal, last stderr line).

    .venv/bin/python benches/malformed_conn_info.py
"""
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))

CASES = ("intact", "zeros", "ones", "random", "flip_first", "truncated_8")


def spoil(meta, case):
    """The metadata with the UCX conn info (the bytes after the `UCX|c` tag and its u64 length)
    replaced according to `case`; NIXL's own framing stays valid."""
    tag = meta.index(b"UCX|c") + len(b"UCX|c")
    (n,) = struct.unpack_from("<Q", meta, tag)
    start, end = tag + 8, tag + 8 + n
    addr = meta[start:end]
    if case == "intact":
        new = addr
    elif case == "zeros":
        new = bytes(n)
    elif case == "ones":
        new = b"\xff" * n
    elif case == "random":
        new = bytes((i * 131 + 17) & 0xFF for i in range(n))
    elif case == "flip_first":
        new = bytes([addr[0] ^ 0xFF]) + addr[1:]
    elif case == "truncated_8":
        new = addr[:8]
    return meta[:tag] + struct.pack("<Q", len(new)) + new + meta[end:]


def child(case):
    import nixlkit
    donor = nixlkit.agent("donor", ("UCX",))
    meta = spoil(donor.get_agent_metadata(), case)
    me = nixlkit.agent("loader", ("UCX",))
    try:
        me.add_remote_agent(meta)
        print("PROBE add_remote_agent returned", file=sys.stderr, flush=True)
        me.send_notif("donor", b"x")
        print("PROBE send_notif returned", file=sys.stderr, flush=True)
    except Exception as e:
        print(f"PROBE exception {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    nixlkit.leave(0)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    for case in CASES:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case],
                           capture_output=True, text=True, timeout=60)
        lines = [ln for ln in p.stderr.splitlines() if "NIXL INFO" not in ln and ln.strip()]
        how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
        print(f"{case:12s} {how:10s} | " + " || ".join(lines[-3:]))


if __name__ == "__main__":
    main()
