"""One-way metadata (issue 13): the initiator loads the target's metadata, the target never loads
the initiator's, and a WRITE still bounces: the target answers through its mailbox
and the initiator READs it. Real NIXL agents, the target in its own process. What must hold:
every byte lands (and nothing else changes), the counters prove the one-way path on both sides,
and every failure resolves the transfer: a target killed mid-transfer, a transfer cancelled
mid-flight (both arenas come back whole, then the same pair is byte-exact again). Over both
control channels."""
import base64
import signal
import struct
import time

import pytest

import nixlkit
from conftest import run_isolated
from test_failures import (ARENA, SLACK_S, SMALL, TIMEOUT_MS, ZMQ, dump, kill_mid_flight, meta_b64,  # noqa: F401
                           peer_stats, post, procs, resolve, settle, settle_local, stats, streaming_kill_or_cancel, watchdog)

CONTROL = {"ucx": {}, "zmq": ZMQ}


def one_way(ag, meta):
    """Only the initiator loads the target: no HELLO can come back, so a bounce is one way."""
    ag.add_remote_agent(meta)


def pair_script(prefix, control, seed):
    """The start of a `run_isolated` script: agents `{prefix}-a` and `{prefix}-b` of this
    process with SMALL arenas over `control`, layouts `small` (1024 x 4 KiB) and `big`
    (8192 x 4 KiB), and `dst`, a buffer for big's destinations (registered by the caller)."""
    params = {**SMALL, **CONTROL[control]}
    return f"""
import gc, time
import nixlkit
from conftest import run_isolated
P = {params!r}
a, b = nixlkit.agent("{prefix}-a", params=P), nixlkit.agent("{prefix}-b", params=P)
small, big = nixlkit.Scattered(1024, 4096, seed={seed}), nixlkit.Scattered(8192, 4096, seed={seed + 1})
dst = nixlkit.pattern({seed + 2}, big.dst_bytes)
"""


def write_one_way_exact(ag, p, name, lay, src, raddr, tmp_path, before):
    lo = ag.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re = ag.get_xfer_descs(lay.dst_list(raddr), "DRAM")
    h = ag.initialize_xfer("WRITE", lo, re, name, b"", backends=["BOUNCE"])
    assert ag.transfer(h) != "ERR"
    st, _ = resolve(ag, h, 30)
    assert st == "DONE", f"one-way transfer to {name}: {st}"
    ag.release_xfer_handle(h)
    nixlkit.assert_same(dump(p, tmp_path, f"{name}.bin"), lay.expected(src, before), f"destination at {name}")


@pytest.mark.parametrize("case", ["ucx", "zmq", "ucx-region-plans"])
def test_a_one_way_write_is_byte_exact_and_both_sides_count_the_mailbox(procs, tmp_path, case):
    """ucx-region-plans: each chunk's runs travel behind its data (bounce_region_plan_runs, the
    GPU default's mechanism, here on host arenas), so no PLAN frame carries them."""
    plans = case.endswith("region-plans")
    params = {**SMALL, **CONTROL[case.removesuffix("-region-plans")],
              **({"bounce_region_plan_runs": "64"} if plans else {})}
    lay = nixlkit.Scattered(16384, 4096, seed=61)  # 64 MiB through 4 MiB arenas: rings wrap
    p = procs()
    meta, raddr = p.start(name=f"ow-rx-{case}", size=lay.dst_bytes, seed=62, params=params)
    ag = nixlkit.agent(f"ow-tx-{case}", params=params)
    src = nixlkit.pattern(63, lay.src_bytes)
    nixlkit.register(ag, src)
    one_way(ag, meta)
    s0, t0 = stats(ag), peer_stats(p)
    with watchdog(90, [p], "one-way write"):
        write_one_way_exact(ag, p, f"ow-rx-{case}", lay, src, raddr, tmp_path, nixlkit.pattern(62, lay.dst_bytes))
    s1 = settle_local(ag, ARENA, SLACK_S, "initiator")
    t1 = settle(lambda: peer_stats(p), ARENA, SLACK_S, "target")
    assert s1["one_way_sent"] == s0["one_way_sent"] + 1 and s1["bounce_ok"] == s0["bounce_ok"] + 1
    assert s1["passthrough_xfers"] == s0["passthrough_xfers"], "the transfer went through plain UCX"
    assert t1["one_way_answered"] == t0["one_way_answered"] + 1
    # Every answer (a GRANT and an ACK per chunk) was written as a record and read back.
    chunks = s1["bounce_chunks"] - s0["bounce_chunks"]
    assert t1["records_written"] - t0["records_written"] == 2 * chunks
    assert s1["records_read"] - s0["records_read"] == 2 * chunks
    assert t1["peer_arenas_loaded"] == 0, "the target loaded the initiator: not one way"
    sent = s1["region_plans_sent"] - s0["region_plans_sent"]
    if plans:
        assert sent == chunks and t1["region_plans_received"] - t0["region_plans_received"] == chunks, (s1, t1)
    else:
        assert sent == 0, s1


def test_a_hello_forged_under_the_targets_name_leaves_the_write_one_way_and_exact(procs, tmp_path):
    """A third agent that holds the target's metadata (so its name and session) says HELLO to
    the initiator as the target, from an agent named like it. Taken at its word, the
    HELLO would switch the initiator to two way, whose frames the target (which never loaded
    the initiator) drops: every WRITE would fail. It is only asked about, with a PING that the
    real target never answers, so the WRITE stays one way and lands byte-exact."""
    from hostile_peer import MAGIC, RAW, VERSION, session_of
    lay = nixlkit.Scattered(4096, 4096, seed=71)
    p, forger = procs(), procs()
    name = "ow-hello-rx"
    meta, raddr = p.start(name=name, size=lay.dst_bytes, seed=72, params=SMALL)
    ag = nixlkit.agent("ow-hello-tx", params=SMALL)
    src = nixlkit.pattern(73, lay.src_bytes)
    nixlkit.register(ag, src)
    one_way(ag, meta)
    # NIXL loads metadata only through a backend both agents have: the forger runs BOUNCE too
    # (its own HELLO, under its own session, is refused as stale).
    forger.start(name=name, size=4096, seed=74, params={**SMALL, **RAW})
    forger.call(op="load", meta=meta_b64(ag))
    # Header (the target's session), then a load tag: any, the forger knows no real one.
    hello = MAGIC + bytes([VERSION, 5]) + struct.pack("<QQ", session_of(meta), 0x5EED)
    s0 = stats(ag)
    forger.call(op="notif_send", to="ow-hello-tx", b64=base64.b64encode(hello).decode())
    deadline = time.monotonic() + 10
    while stats(ag)["hello_asks"] == s0["hello_asks"]:
        assert time.monotonic() < deadline, "the forged HELLO never reached the initiator's engine"
        ag.get_new_notifs()
        time.sleep(0.005)
    time.sleep(0.4)  # its asks at 0, 0.1 and 0.3 s go to the real target, which drops them
    ag.get_new_notifs()  # the engine publishes its counters into the params when called
    s1 = stats(ag)
    assert s1["hellos_confirmed"] == s0["hellos_confirmed"] and s1["peers_ready"] == 0, s1
    assert s1["hello_asks"] >= s0["hello_asks"] + 2, "an unanswered ask is repeated"
    with watchdog(60, [p, forger], "one-way write after a forged HELLO"):
        write_one_way_exact(ag, p, name, lay, src, raddr, tmp_path, nixlkit.pattern(72, lay.dst_bytes))
    s2 = stats(ag)
    assert s2["one_way_sent"] == s0["one_way_sent"] + 1 and s2["bounce_ok"] == s0["bounce_ok"] + 1, s2


def test_a_peer_that_reloads_our_metadata_without_restarting_goes_two_way_again():
    """b unloads a's metadata and loads it again (same process, same session: no restart). Its
    HELLO then finds a's side confirmed already; a asks about it anyway (at most once a second),
    and the HELLO in that ask lets b ask about a in turn, so b goes two way to a again instead
    of staying one way. b's WRITE to a bounces two way and lands byte-exact."""
    from conftest import run_isolated
    code = """
import nixlkit
from conftest import run_isolated
a, b = nixlkit.agent("rl-a"), nixlkit.agent("rl-b")
lay = nixlkit.Scattered(1024, 4096, seed=81)
src, dst = nixlkit.pattern(82, lay.src_bytes), nixlkit.pattern(83, lay.dst_bytes)
nixlkit.register(b, src), nixlkit.register(a, dst)
a_meta = a.get_agent_metadata()
a.add_remote_agent(b.get_agent_metadata()); b.add_remote_agent(a_meta)
nixlkit.wait_ready(a), nixlkit.wait_ready(b)
b.remove_remote_agent("rl-a")
b.add_remote_agent(a_meta)
nixlkit.wait_ready(b, deadline=10)
nixlkit.write_exact(b, a, "rl-a", lay, src, dst, nixlkit.pattern(83, lay.dst_bytes), "after the reload")
s = {k[6:]: int(v) for k, v in nixlkit.live_params(b).items() if k.startswith("stats.")}
print("RESULT", s["bounce_ok"], s["one_way_sent"], s["peers_ready"], flush=True)
nixlkit.leave(0)
"""
    rc, out = run_isolated(code)
    assert rc == 0, out[-3000:]
    assert "RESULT 1 0 1" in out, ("bounced two way after the reload", out[-3000:])


@pytest.mark.parametrize("control", ["ucx", "zmq"])
def test_a_restarted_peer_bounces_one_way_before_we_reload_it_and_its_flow_survives_the_reload(control):
    """a and b load each other; b restarts under the same name (its GOODBYE confirmed, a still
    holds its old metadata) and writes to a before a reloads it. Plain UCX's one-sided write
    would land; BOUNCE dropped every frame of the new incarnation as stale and failed the write
    after the request timeout. Now it bounces one way, byte-exact, under an id of its own at a.
    Then a reloads b (disconnect, load) while a write of b's streams one way through the
    arenas: the write completes byte-exact (the reload reclaimed the old incarnation only, and
    the new one kept its flows' id), and b's next write goes two way."""
    from conftest import run_isolated
    code = pair_script("rs", control, 91) + f"""
nixlkit.register(a, dst)
a_meta = a.get_agent_metadata()
src = nixlkit.pattern(94, big.src_bytes)
nixlkit.register(b, src)
a.add_remote_agent(b.get_agent_metadata()); b.add_remote_agent(a_meta)
nixlkit.wait_ready(a), nixlkit.wait_ready(b)
nixlkit.write_exact(b, a, "rs-a", small, src, dst, dst.copy(), "before the restart")
del b; gc.collect()                       # GOODBYE: a keeps b's metadata and session
b = nixlkit.agent("rs-b", params=P)       # the restart: a new session, the same name
src = nixlkit.pattern(95, big.src_bytes)
nixlkit.register(b, src)
b.add_remote_agent(a_meta)                # b loads a; a does not reload b yet
st = lambda ag: {{k[6:]: int(v) for k, v in nixlkit.live_params(ag).items() if k.startswith("stats.")}}
def post(lay):
    h = b.initialize_xfer("WRITE", b.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM"),
                          b.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM"), "rs-a", b"")
    assert b.transfer(h) != "ERR"
    return h
s0, t = st(b), time.monotonic()
before = dst.copy()
nixlkit.wait_xfer(b, post(small), peers=[a], deadline=20)
s1 = st(b)
nixlkit.assert_same(dst, small.expected(src, before), "the restarted peer's write before the reload")
print("RESULT before", s1["bounce_ok"] - s0["bounce_ok"], s1["one_way_sent"] - s0["one_way_sent"],
      s1["passthrough_xfers"] - s0["passthrough_xfers"], round(time.monotonic() - t, 2), flush=True)
for attempt in range(5):                  # reload a's view of b while b's write is in flight
    before = dst.copy()
    h = post(big)
    in_flight = b.check_xfer_state(h) == "PROC"
    a.remove_remote_agent("rs-b"); a.add_remote_agent(b.get_agent_metadata())
    nixlkit.wait_xfer(b, h, peers=[a], deadline=60)
    nixlkit.assert_same(dst, big.expected(src, before), "the write in flight across the reload")
    b.release_xfer_handle(h)
    if in_flight:
        break
nixlkit.wait_ready(b, deadline=10)        # a's HELLO after the reload: two way again
s2 = st(b)
before = dst.copy()
nixlkit.write_exact(b, a, "rs-a", small, src, dst, before, "two way after the reload")
s3 = st(b)
print("RESULT across", int(in_flight), s2["bounce_ok"] - s1["bounce_ok"], s2["one_way_sent"] - s1["one_way_sent"],
      s2["bounce_failed"] - s0["bounce_failed"], flush=True)
print("RESULT after", s3["bounce_ok"] - s2["bounce_ok"], s3["one_way_sent"] - s2["one_way_sent"], flush=True)
nixlkit.leave(0)
"""
    rc, out = run_isolated(code, timeout=180)
    assert rc == 0, out[-3000:]
    r = {line.split()[1]: line.split()[2:] for line in out.splitlines() if line.startswith("RESULT ")}
    assert set(r) == {"before", "across", "after"}, out[-3000:]
    ok, one_way, passthrough, secs = r["before"]
    # Bounced one way (not plain UCX, not by a timeout: the request timeout is 3 s).
    assert (ok, one_way, passthrough) == ("1", "1", "0"), r
    assert float(secs) < 2, f"took {secs} s: the write waited for a timeout"
    in_flight, ok, one_way, failed = r["across"]
    assert in_flight == "1", "no attempt had the write in flight at the reload"
    assert int(ok) == int(one_way) >= 1 and failed == "0", r
    assert r["after"] == ["1", "0"], f"not two way after the reload: {r}"


@pytest.mark.parametrize("control", ["ucx", "zmq"])
def test_a_peer_that_unloads_our_metadata_gets_our_writes_one_way_from_then_on(control):
    """a and b load each other; then b unloads a (remove_remote_agent) and does not load it
    again, while a goes on writing to b. Through plain UCX a's one-sided writes would go on.
    Before, a's two-way frames went unanswered and each write failed as a lost peer after the
    liveness probe's ~2 s. Now b tells a as it unloads it (a FORGET proving the secret of its
    load of a, which only b's PONGs carried): a write in flight then fails at once, posted
    again it lands byte-exact one way, and so do the next ones (a READ, as vLLM pulls, too).
    When b loads a again, a's writes go two way again."""
    from conftest import run_isolated
    code = pair_script("fg", control, 101) + f"""
nixlkit.register(b, dst)
src = nixlkit.pattern(104, big.src_bytes)
nixlkit.register(a, src)
pulled = nixlkit.pattern(105, small.dst_bytes)  # where a's READ from b lands
nixlkit.register(a, pulled)
a_meta = a.get_agent_metadata()
a.add_remote_agent(b.get_agent_metadata()); b.add_remote_agent(a_meta)
nixlkit.wait_ready(a), nixlkit.wait_ready(b)
st = lambda ag: {{k[6:]: int(v) for k, v in nixlkit.live_params(ag).items() if k.startswith("stats.")}}
def handle(lay):
    return a.initialize_xfer("WRITE", a.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM"),
                             a.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM"), "fg-b", b"")
def settle(h, deadline=20):
    t, state = time.monotonic(), "PROC"
    while state not in ("DONE", "ERR") and time.monotonic() < t + deadline:
        try:
            state = a.check_xfer_state(h)
        except Exception:
            state = "ERR"
        nixlkit.poll(b)
    return state, round(time.monotonic() - t, 2)
nixlkit.write_exact(a, b, "fg-b", small, src, dst, dst.copy(), "two way before the unload")
s0 = st(a)
for attempt in range(5):                  # b unloads a while a's write is in flight
    before = dst.copy()
    h = handle(big)
    assert a.transfer(h) != "ERR"
    in_flight = a.check_xfer_state(h) == "PROC"
    if attempt == 0 or in_flight:
        b.remove_remote_agent("fg-a")
    state, secs = settle(h)
    print("RESULT in-flight", int(in_flight), state, secs, flush=True)
    if state == "ERR":                    # failed at the unload: posted again, one way
        assert a.transfer(h) != "ERR"
        state, secs = settle(h)
    assert state == "DONE", state
    nixlkit.assert_same(dst, big.expected(src, before), "the write posted again after the unload")
    a.release_xfer_handle(h)
    if in_flight:
        break
s1 = st(a)
before = dst.copy()
h = handle(small)
assert a.transfer(h) != "ERR"
state, secs = settle(h)
s2 = st(a)
nixlkit.assert_same(dst, small.expected(src, before), "the next write")
print("RESULT next", state, secs, s2["one_way_sent"] - s1["one_way_sent"], s2["bounce_ok"] - s1["bounce_ok"], flush=True)
# A READ (the way vLLM pulls) goes one way too: b's packed bytes into a's scattered slots.
before, packed = pulled.copy(), dst[:small.src_bytes].copy()
h = a.initialize_xfer("READ", a.get_xfer_descs(small.dst_list(pulled.ctypes.data), "DRAM"),
                      a.get_xfer_descs(small.src_list(dst.ctypes.data), "DRAM"), "fg-b", b"")
assert a.transfer(h) != "ERR"
state, secs = settle(h)
s5 = st(a)
nixlkit.assert_same(pulled, small.expected(packed, before), "a READ after the unload")
print("RESULT read", state, secs, s5["one_way_sent"] - s2["one_way_sent"], s5["bounce_ok"] - s2["bounce_ok"], flush=True)
sb = st(b)
print("RESULT forget", sb["forgets_sent"], s5["peers_forgot_us"], s5["peers_declared_dead"] - s0["peers_declared_dead"],
      s1["one_way_sent"] - s0["one_way_sent"], flush=True)
b.add_remote_agent(a_meta)                # b loads a again: two way again
nixlkit.wait_ready(a, deadline=10)
s3 = st(a)
nixlkit.write_exact(a, b, "fg-b", small, src, dst, dst.copy(), "two way after b loads a again")
s4 = st(a)
print("RESULT reload", s4["bounce_ok"] - s3["bounce_ok"], s4["one_way_sent"] - s3["one_way_sent"], flush=True)
nixlkit.leave(0)
"""
    rc, out = run_isolated(code, timeout=180)
    assert rc == 0, out[-3000:]
    r = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r.setdefault(line.split()[1], []).append(line.split()[2:])
    assert set(r) == {"in-flight", "next", "read", "forget", "reload"}, out[-3000:]
    in_flight, state, secs = r["in-flight"][-1]
    assert in_flight == "1", f"no attempt had the write in flight at the unload: {r}"
    # At once: not after the probe's ~2 s or the request timeout (3 s here).
    assert state in ("ERR", "DONE") and float(secs) < 1.5, r
    state, secs, one_way, ok = r["next"][0]
    assert (state, one_way, ok) == ("DONE", "1", "1") and float(secs) < 1.5, f"not one way at once: {r}"
    state, secs, one_way, ok = r["read"][0]
    assert (state, one_way, ok) == ("DONE", "1", "1") and float(secs) < 1.5, f"READ not one way at once: {r}"
    sent, forgot, dead, one_way_before = r["forget"][0]
    assert (sent, forgot, dead) == ("1", "1", "0"), f"b's FORGET, a's count, no death: {r}"
    assert int(one_way_before) >= 1, f"the write posted again went one way: {r}"
    assert r["reload"][0] == ["1", "0"], f"not two way after b loaded a again: {r}"


@pytest.mark.parametrize("control", ["ucx", "zmq"])
def test_a_target_in_another_process_that_unloads_us_is_written_one_way_at_once(procs, tmp_path, control):
    """The test above across two processes (as deployments run): the target, in its own
    process, loads the initiator and then unloads it; its FORGET reaches the initiator before
    its inner engine disconnects, and the initiator's next write goes one way at once,
    byte-exact, with no peer declared dead."""
    params = {**SMALL, **CONTROL[control]}
    lay = nixlkit.Scattered(1024, 4096, seed=111)
    p = procs()
    meta, raddr = p.start(name=f"fgp-rx-{control}", size=lay.dst_bytes, seed=112, params=params)
    ag = nixlkit.agent(f"fgp-tx-{control}", params=params)
    src = nixlkit.pattern(113, lay.src_bytes)
    nixlkit.register(ag, src)
    ag.add_remote_agent(meta)
    p.call(op="load", meta=base64.b64encode(ag.get_agent_metadata()).decode())
    nixlkit.wait_ready(ag)
    s0 = stats(ag)
    p.call(op="unload", name=f"fgp-tx-{control}")
    with watchdog(60, [p], "write after the unload"):
        t = time.monotonic()
        write_one_way_exact(ag, p, f"fgp-rx-{control}", lay, src, raddr, tmp_path, nixlkit.pattern(112, lay.dst_bytes))
        secs = time.monotonic() - t
    s1, t1 = stats(ag), peer_stats(p)
    assert (t1["forgets_sent"], s1["peers_forgot_us"] - s0["peers_forgot_us"]) == (1, 1), (s1, t1)
    assert s1["one_way_sent"] == s0["one_way_sent"] + 1 and s1["bounce_ok"] == s0["bounce_ok"] + 1, s1
    assert s1["peers_declared_dead"] == s0["peers_declared_dead"], s1
    assert secs < 1.5, f"took {secs:.2f} s: the write waited on the probe"


@pytest.mark.parametrize("control", ["ucx", "zmq"])
def test_a_small_one_way_write_rides_in_its_want_and_one_ack_record_completes_it(procs, tmp_path, control):
    """256 x 64 B, one chunk within bounce_inline_bytes: the WANT carries the bytes, the target
    (which never loaded us) puts them in a region and scatters them, and writes one record, the
    ACK, which the initiator reads: no GRANT record, no write. Byte-exact, three times."""
    params = {**SMALL, **CONTROL[control]}
    lay = nixlkit.Scattered(256, 64, seed=67)
    p = procs()
    name = f"ow-inline-rx-{control}"
    meta, raddr = p.start(name=name, size=lay.dst_bytes, seed=68, params=params)
    ag = nixlkit.agent(f"ow-inline-tx-{control}", params=params)
    src = nixlkit.pattern(69, lay.src_bytes)
    nixlkit.register(ag, src)
    one_way(ag, meta)
    s0, t0 = stats(ag), peer_stats(p)
    with watchdog(60, [p], "one-way inline writes"):
        for _ in range(3):
            write_one_way_exact(ag, p, name, lay, src, raddr, tmp_path, nixlkit.pattern(68, lay.dst_bytes))
    s1 = settle_local(ag, ARENA, SLACK_S, "initiator")
    t1 = settle(lambda: peer_stats(p), ARENA, SLACK_S, "target")
    d = {k: s1[k] - s0[k] for k in ("one_way_sent", "bounce_ok", "inline_sent", "inline_acks", "records_read")}
    assert d == {"one_way_sent": 3, "bounce_ok": 3, "inline_sent": 3, "inline_acks": 3, "records_read": 3}, d
    # The target's arena was whole before its last counters were published (it does not poll
    # for them): give the publication a bounded moment, then check them exactly.
    end = time.monotonic() + SLACK_S
    while t1["records_written"] - t0["records_written"] < 3 and time.monotonic() < end:
        time.sleep(0.02)
        t1 = peer_stats(p)
    t = {k: t1[k] - t0[k] for k in ("one_way_answered", "inline_taken", "records_written")}
    assert t == {"one_way_answered": 3, "inline_taken": 3, "records_written": 3}, t
    assert t1["peer_arenas_loaded"] == 0, "the target loaded the initiator: not one way"


@pytest.mark.parametrize("control", ["ucx", "zmq"])
def test_a_one_way_target_killed_mid_transfer_fails_it_in_bounded_time(procs, tmp_path, control):
    params = {**SMALL, **CONTROL[control]}
    lay = nixlkit.Scattered(16384, 4096, seed=64)
    ag = nixlkit.agent(f"ow-survivor-{control}", params=params)
    src = nixlkit.pattern(65, lay.src_bytes)
    nixlkit.register(ag, src)
    def start(p, name):
        meta, raddr = p.start(name=name, size=lay.dst_bytes, seed=66, params=params)
        one_way(ag, meta)
        return raddr

    _, _, before = kill_mid_flight(ag, procs, start, lambda name, raddr: post(ag, name, lay, src, raddr))
    after = settle_local(ag, ARENA, TIMEOUT_MS / 1000 + SLACK_S, "initiator after the target's death")
    assert after["bounce_failed"] == before["bounce_failed"] + 1
    assert after["one_way_sent"] == before["one_way_sent"] + 1


def test_a_one_way_cancel_frees_both_arenas_then_the_pair_is_byte_exact(procs, tmp_path):
    lay = nixlkit.Scattered(16384, 4096, seed=67)
    p = procs()
    meta, raddr = p.start(name="ow-cancel-rx", size=lay.dst_bytes, seed=68, params=SMALL)
    ag = nixlkit.agent("ow-cancel-tx", params=SMALL)
    src = nixlkit.pattern(69, lay.src_bytes)
    nixlkit.register(ag, src)
    one_way(ag, meta)
    s0 = stats(ag)
    with watchdog(90, [p], "one-way cancel"):
        for attempt in range(3):
            h, st = streaming_kill_or_cancel(ag, "ow-cancel-rx", lay, src, raddr, lambda: None)
            if h is not None:
                ag.release_xfer_handle(h)  # still PROC: this cancels it
                break
            assert st == "DONE", st
        else:
            raise AssertionError("could not cancel mid-flight in 3 attempts")
        t0 = time.monotonic()
        mine = settle_local(ag, ARENA, TIMEOUT_MS / 1000 + SLACK_S, "initiator after cancel")
        settle(lambda: peer_stats(p), ARENA, TIMEOUT_MS / 1000 + SLACK_S, "target after cancel")
        settled = time.monotonic() - t0
        p.call(op="fill", seed=70)
        lay2 = nixlkit.Scattered(16384, 4096, seed=71)
        write_one_way_exact(ag, p, "ow-cancel-rx", lay2, src, raddr, tmp_path, nixlkit.pattern(70, lay2.dst_bytes))
    s1 = stats(ag)
    # Every attempt, the cancelled one included, went one way through the bounce path ...
    assert mine["bounce_xfers"] - s0["bounce_xfers"] == attempt + 1, (s0, mine)
    assert mine["one_way_sent"] - s0["one_way_sent"] == attempt + 1, (s0, mine)
    assert mine["passthrough_xfers"] == s0["passthrough_xfers"], "a transfer went through plain UCX"
    # ... and only those done before a cancel could land counted as successes.
    assert mine["bounce_ok"] - s0["bounce_ok"] == attempt, "the cancelled transfer was counted as a success"
    # The transfer after the cancel went the same way.
    assert (s1["bounce_ok"], s1["one_way_sent"]) == (mine["bounce_ok"] + 1, mine["one_way_sent"] + 1), (mine, s1)
    assert s1["passthrough_xfers"] == s0["passthrough_xfers"]
    # The cancel (a frame to the target) frees its regions at once, not by the timeout.
    assert settled < TIMEOUT_MS / 1000 / 2, f"regions came back only after {settled:.1f}s"


def test_a_one_way_initiator_killed_with_a_transfer_open_and_restarted_under_its_name_is_served_at_once(tmp_path):
    """The target never loads the initiator's metadata, so it cannot tell a restarted initiator
    from the old one: a transfer the old process left open stays there until its timeout. The
    restarted process numbers its transfers above the old one's, so its first transfer meets no
    old flow, is not taken for a forgery (another token under an id in use), and is served at
    once, byte-exact. Until session 51 both numbered from 1, and the new transfer timed out."""
    timeout_ms = 10_000  # the old flow stays open this long: the restart comes well within it
    # An arena with room beside the old flow's window (8 of its 64 chunks granted): with none,
    # the new flow would wait for the dead one's regions, and go with its peer's unserved flows
    # when the old grant lapses (the target cannot tell the two incarnations apart).
    params = {**SMALL, "bounce_request_timeout_ms": str(timeout_ms), "bounce_arena_size": "32MiB"}
    big, small = nixlkit.Scattered(16384, 4096, seed=72), nixlkit.Scattered(1024, 4096, seed=73)
    rx = nixlkit.agent("ow-restart-rx", params=params)
    dst = nixlkit.pattern(74, big.dst_bytes)
    nixlkit.register(rx, dst)
    meta = tmp_path / "rx.meta"
    meta.write_bytes(rx.get_agent_metadata())

    def initiator(lay, seed, then):
        return f"""
import os, signal, time
import nixlkit
from conftest import run_isolated
ag = nixlkit.agent("ow-restart-tx", params={params!r})
lay = nixlkit.Scattered({lay.n}, 4096, seed={seed})
src = nixlkit.pattern({seed + 10}, lay.src_bytes)
nixlkit.register(ag, src)
ag.add_remote_agent(open({str(meta)!r}, "rb").read())
lo = ag.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
re = ag.get_xfer_descs(lay.dst_list({dst.ctypes.data}), "DRAM")
h = ag.initialize_xfer("WRITE", lo, re, "ow-restart-rx", b"", backends=["BOUNCE"])
t0 = time.monotonic()
assert ag.transfer(h) != "ERR"
{then}
"""
    nixlkit.poll(rx)
    s0 = stats(rx)
    # The first incarnation dies once the target answered its WANT (it read a GRANT record)
    # and before its transfer ended: its transfer is open at the target. Killed right after
    # its post, its WANT sometimes never left (review 57), and the test proved nothing.
    die_open = """
while time.monotonic() - t0 < 10:
    st = ag.check_xfer_state(h)
    ag.get_new_notifs()  # publishes the counters
    if int(nixlkit.live_params(ag, "BOUNCE")["stats.records_read"]) > 0:
        break
assert st == "PROC", f"the first transfer ended ({st}) before it could be left open"
os.kill(os.getpid(), signal.SIGKILL)
"""
    rc, out = run_isolated(initiator(big, 72, die_open), timeout=60)
    killed = time.monotonic()
    assert rc == -signal.SIGKILL, f"the first initiator was to die by SIGKILL: rc={rc}\n{out[-2000:]}"
    wait = """
st = ag.check_xfer_state(h)
while st == "PROC" and time.monotonic() - t0 < 8:
    st = ag.check_xfer_state(h)
print("STATE", st, time.monotonic() - t0, flush=True)
p = nixlkit.live_params(ag, "BOUNCE")
print("STATS", p["stats.one_way_sent"], p["stats.bounce_ok"], p["stats.passthrough_xfers"], flush=True)
"""
    time.sleep(0.5)  # the old transfer's chunks already sent settle at the target
    nixlkit.poll(rx)
    mid = stats(rx)
    # Its WANT reached the target before the kill, which answered it (a GRANT record in its
    # mailbox): there is an old flow for the restart to meet (review 57).
    assert mid["records_written"] > s0["records_written"], "the old flow never opened: this test would prove nothing"
    s0 = mid
    before = dst.copy()
    rc, out = run_isolated(initiator(small, 73, wait), timeout=60)
    restarted_after = time.monotonic() - killed
    nixlkit.poll(rx)  # getNotifs refreshes the published counters
    s1 = stats(rx)
    assert rc == 0, out[-3000:]
    state = [line for line in out.splitlines() if line.startswith("STATE")]
    assert state and state[0].split()[1] == "DONE", f"the restarted initiator's transfer: {state}\n{out[-3000:]}"
    assert float(state[0].split()[2]) < 5, f"served only after {state[0].split()[2]} s"
    # The restart came while the old transfer was still open at the target (or this test
    # proves nothing) ...
    assert restarted_after < timeout_ms / 1000, f"the restart took {restarted_after:.1f} s: past the old flow"
    assert s1["flows_timed_out"] == s0["flows_timed_out"], "the old flow was already gone"
    # ... and its frames were not taken for forgeries of the old one's.
    assert s1["control_forged"] == s0["control_forged"], (s0, s1)
    assert s1["records_written"] > s0["records_written"], "the target answered through its mailbox"
    # The restarted initiator's transfer bounced one way, not through plain UCX.
    counts = [line.split()[1:] for line in out.splitlines() if line.startswith("STATS")]
    assert counts == [["1", "1", "0"]], f"one_way_sent, bounce_ok, passthrough_xfers: {counts}"
    src2 = nixlkit.pattern(83, small.src_bytes)
    nixlkit.assert_same(dst, small.expected(src2, before), "destination of the restarted initiator's transfer")


def test_a_target_whose_zmq_endpoint_cannot_be_reached_stays_on_ucx_at_once(procs, tmp_path):
    """Review 61, control M2. The target's metadata advertises a ZMQ endpoint the initiator
    cannot reach (here: its port rewritten to one nobody listens on, as `bounce_zmq_host` left
    at loopback between hosts, or a firewall, would leave it). Its one-way WANT would wait in a
    socket that never connects and the transfer fail by its timeout; instead the transfer goes
    to plain UCX (after at most one short wait for the connection, right after the load),
    DONE and byte-exact, twice, well inside the timeout, and no frame of ours was sent one way."""
    import socket
    params = {**SMALL, **ZMQ}
    lay = nixlkit.Scattered(1024, 4096, seed=121)
    p = procs()
    name = "ow-unreached-rx"
    meta, raddr = p.start(name=name, size=lay.dst_bytes, seed=122, params=params)
    from hostile_peer import zmq_endpoint_of
    real = zmq_endpoint_of(meta).encode()
    # A port of the same length nobody listens on (the metadata's lengths stay right).
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dead = b"tcp://127.0.0.1:%d" % port
        if len(dead) == len(real) and dead != real:
            break
    assert meta.count(real) == 1
    ag = nixlkit.agent("ow-unreached-tx", params=params)
    src = nixlkit.pattern(123, lay.src_bytes)
    nixlkit.register(ag, src)
    one_way(ag, meta.replace(real, dead))
    s0 = stats(ag)
    with watchdog(60, [p], "writes to an unreachable ZMQ endpoint"):
        for i in range(2):
            t = time.monotonic()
            write_one_way_exact(ag, p, name, lay, src, raddr, tmp_path, nixlkit.pattern(122, lay.dst_bytes))
            secs = time.monotonic() - t
            assert secs < TIMEOUT_MS / 1000 / 2, f"write {i} took {secs:.2f} s: it waited on the bounce path"
    s1 = stats(ag)
    d = {k: s1[k] - s0[k] for k in ("one_way_sent", "bounce_xfers", "one_way_unreached", "passthrough_xfers")}
    assert d == {"one_way_sent": 0, "bounce_xfers": 0, "one_way_unreached": 2, "passthrough_xfers": 2}, d
