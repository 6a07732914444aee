"""Background progress through BOUNCE is UCX's (issue 13): an agent created as frameworks create
theirs asks NIXL for a progress thread, and a passive side that never polls while the READs run
must still serve the other side's READs, over TCP, where a READ needs the target's progress. Idle
CPU is measured beside UCX's own progress thread (the idle side there polls every 100 ms).

Two "hosts": network namespaces joined by a veth pair (test_failures.py's fixture), UCX over TCP.
"""
import base64
import statistics
import subprocess
import time

import nixlkit
from test_failures import procs, two_hosts, watchdog  # noqa: F401  (pytest fixtures)

LAYOUT = dict(n=1024, size=4096, seed=81)
REPS = 7
POLL_MS = 100
# The READ test's target makes no call into NIXL at all while the READs run (its next poll would
# come an hour later): a READ that needed the target's application to poll would never end.
NEVER_MS = 3_600_000


def links_up(two_hosts, deadline=10.0):
    """Waits until both ends of the veth link report carrier: UCX refuses a device that is not
    running yet ("no usable transports"), and a fresh veth pair takes a moment to get there."""
    end = time.monotonic() + deadline
    for ns, dev, _ in two_hosts.values():
        while "LOWER_UP" not in subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev],
                                               capture_output=True, text=True).stdout:
            assert time.monotonic() < end, f"{dev} in {ns} never came up"
            time.sleep(0.05)


# (label, backend, params): BOUNCE as shipped, BOUNCE with its bounce path off (pure
# pass-through: no reactor runs, so the inner engine's own progress thread must), and BOUNCE
# whose bounce path is on but cannot start (its ZMQ control socket cannot bind an address of
# TEST-NET-1, not this host's: no reactor, and the inner engine made without UCX's thread, so
# BOUNCE's own background progress thread must; review 57).
VARIANTS = (("UCX", "UCX", {}), ("BOUNCE", "BOUNCE", {}),
            ("BOUNCE-passthrough", "BOUNCE", {"bounce_enable": "false"}),
            ("BOUNCE-not-started", "BOUNCE", {"bounce_control": "zmq", "bounce_zmq_host": "192.0.2.1"}))
PASS_THROUGH = ("BOUNCE-passthrough", "BOUNCE-not-started")


def start_pair(two_hosts, procs, backend, tag, params=None, ini_poll_ms=0.5, tgt_poll_ms=POLL_MS):
    """A passive target in host b (polls every `tgt_poll_ms`) and an initiator in host a, both
    with the progress thread NIXL's default config asks for; only the initiator loads the
    target."""
    links_up(two_hosts)
    made = {}
    for side, role, poll_ms in (("b", "tgt", tgt_poll_ms), ("a", "ini", ini_poll_ms)):
        ns, dev, _ = two_hosts[side]
        p = procs("progress_peer.py", prefix=("ip", "netns", "exec", ns),
                  env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev})
        lay = nixlkit.Scattered(**LAYOUT)
        size = lay.dst_bytes if role == "tgt" else lay.src_bytes
        seed = 801 if role == "tgt" else 802
        meta, addr = p.start(name=f"{role}-{tag}", backend=backend, params=params or {}, size=size,
                             seed=seed, poll_ms=poll_ms, prog_thread=True)
        made[role] = (p, meta, addr)
    ini, tgt = made["ini"], made["tgt"]
    ini[0].call(op="load", meta=base64.b64encode(tgt[1]).decode())
    return ini, tgt


def counters(p):
    """A progress_peer's BOUNCE counters (its "params" command)."""
    return {k[6:]: int(v) for k, v in p.call(op="params")["params"].items() if k.startswith("stats.")}


def test_a_passive_target_serves_reads_over_tcp_without_waiting_for_its_polls(two_hosts, procs, tmp_path):
    lay = nixlkit.Scattered(**LAYOUT)
    medians = {}
    with watchdog(200, procs.all, "READs from a passive target"):
        for i, (backend, base, params) in enumerate(VARIANTS):
            (ini, _, _), (tgt, _, raddr) = start_pair(two_hosts, procs, base, f"rd{i}", params, tgt_poll_ms=NEVER_MS)
            if base == "BOUNCE":
                s0, t0 = counters(ini), counters(tgt)
            # Every READ ends DONE though the target's application makes no call meanwhile
            # (no command goes to it, and its idle poll is an hour away): its progress came
            # from the background alone. Event order, no stopwatch.
            r = ini.call(op="read", **{"from": f"tgt-rd{i}"}, raddr=raddr, reps=REPS, **LAYOUT)
            assert r["state"] == "DONE" and len(r["seconds"]) == REPS, (backend, r)
            # every byte: the initiator's buffer now holds the target's slots in order
            path = tmp_path / f"{backend}.bin"
            ini.call(op="dump", path=str(path))
            got = nixlkit.np.fromfile(path, dtype=nixlkit.np.uint8)
            target = nixlkit.pattern(801, lay.dst_bytes)
            want = nixlkit.np.concatenate([target[int(k) * lay.slot:(int(k) + 1) * lay.slot] for k in lay.slots])
            nixlkit.assert_same(got, want, f"{backend} READ from a passive target")
            # The path each variant claims: BOUNCE bounced every READ, one way (the target never
            # loaded the initiator: it answered through its mailbox), none through plain UCX;
            # with its bounce path off, every READ went through the inner UCX engine.
            if base == "BOUNCE":
                s1, t1 = counters(ini), counters(tgt)
                d = {k: s1[k] - s0[k] for k in ("bounce_xfers", "bounce_read_ok", "one_way_sent", "passthrough_xfers")}
                if backend == "BOUNCE":
                    assert d == {"bounce_xfers": REPS, "bounce_read_ok": REPS, "one_way_sent": REPS,
                                 "passthrough_xfers": 0}, (backend, d, s1)
                    assert t1["one_way_answered"] - t0["one_way_answered"] == REPS, (backend, t0, t1)
                else:
                    assert d == {"bounce_xfers": 0, "bounce_read_ok": 0, "one_way_sent": 0,
                                 "passthrough_xfers": REPS}, (backend, d, s1)
            medians[backend] = statistics.median(r["seconds"][1:])
            print(f"{backend}: READ 1024 x 4 KiB from a target not polling over TCP: "
                  f"median {medians[backend] * 1e3:.2f} ms of {[round(s * 1e3, 2) for s in r['seconds']]}")
            ini.close()
            tgt.close()
    # Without background progress a READ would wait for the target's next poll: never, here
    # (with a target polling every 100 ms: 211 ms per READ measured for BOUNCE-passthrough
    # before the fix; 17-27 ms with it on the 2-core machine). How close BOUNCE comes to UCX
    # is a figure, not a check (a timed bound on a shared 2-core machine failed by 0.14 ms
    # once): printed here, and in BENCHMARKS.md.
    for b in ("BOUNCE", *PASS_THROUGH):
        print(f"{b} / UCX: {medians[b] / medians['UCX']:.2f}")


def test_idle_cpu_with_the_progress_thread_asked_for_stays_far_below_ucx(two_hosts, procs):
    cpu = {}
    with watchdog(120, procs.all, "idle CPU"):
        for i, (backend, base, params) in enumerate(VARIANTS):
            (ini, _, _), (tgt, _, _) = start_pair(two_hosts, procs, base, f"idle{i}", params, ini_poll_ms=POLL_MS)
            ini.send(op="cpu", seconds=2.0)
            t = tgt.call(op="cpu", seconds=2.0)
            i = ini.recv()
            cpu[backend] = (t["cpu"] + i["cpu"]) / max(t["wall"], i["wall"])
            print(f"{backend}: two idle agents with a progress thread asked for: {cpu[backend]:.3f} cores")
            ini.close()
            tgt.close()
    # The lead over UCX is what must hold; the absolute bound leaves room for a loaded 2-core
    # CI machine (two UCX threads waking every 1 ms on their event fds, plus Python's polls:
    # measured 0.06-0.10 cores there).
    for b in ("BOUNCE", *PASS_THROUGH):
        assert cpu[b] < 0.25 and cpu[b] < cpu["UCX"] / 4, cpu
