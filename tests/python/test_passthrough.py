"""BOUNCE as a drop-in for UCX: loading, options, pass-through transfers and notifications in
one process and in two, side by side with UCX, and clean failures. (Issue: foundation.)"""
import os
import textwrap
import time

import numpy as np
import pytest

import nixlkit
from conftest import run_isolated
from test_bounce import stats as counters

N, S = 4096, 4096


def assert_bounced(before, after, op):
    """One transfer took the bounce path and succeeded there: none went through plain UCX."""
    ok = "bounce_ok" if op == "WRITE" else "bounce_read_ok"
    assert after["bounce_xfers"] - before["bounce_xfers"] == 1, (before, after)
    assert after[ok] - before[ok] == 1, (before, after)
    assert after["passthrough_xfers"] == before["passthrough_xfers"], "it went through plain UCX"


def test_plugin_is_discovered_without_env_and_reports_manifest_options():
    assert "NIXL_PLUGIN_DIR" not in os.environ
    a = nixlkit.agent("opts", backends=())
    assert "BOUNCE" in a.get_plugin_list()
    opts = a.get_plugin_params("BOUNCE")
    # the manifest is the one source of truth for these
    import tomllib
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "plugin-manifest", "manifest.toml"), "rb") as f:
        manifest = tomllib.load(f)
    for o in manifest["option"]:
        assert opts[o["name"]] == o["default"], o["name"]
    # every UCX option is accepted unchanged, so it is listed too, with UCX's default
    ucx = a.get_plugin_params("UCX")
    assert ucx, "UCX lists options"
    for k, v in ucx.items():
        assert opts[k] == v, k


def _one_process_pair(backend="BOUNCE", params=None):
    a = nixlkit.agent("w1", (backend,), params)
    b = nixlkit.agent("t1", (backend,), params)
    return a, b


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_scattered_transfer_one_process_is_byte_exact(op):
    a, b = nixlkit.agent(f"i-{op}"), nixlkit.agent(f"t-{op}")
    lay = nixlkit.Scattered(N, S, seed=11 if op == "WRITE" else 12)
    local = nixlkit.pattern(100, lay.src_bytes) if op == "WRITE" else nixlkit.pattern(101, lay.dst_bytes)
    remote = nixlkit.pattern(200, lay.dst_bytes) if op == "WRITE" else nixlkit.pattern(201, lay.src_bytes)
    before = local.copy() if op == "READ" else remote.copy()
    nixlkit.register(a, local)
    nixlkit.register(b, remote)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    # Both loaded: once the HELLOs are through, 4096 pieces of 4 KiB take the bounce path
    # (waiting makes the path certain; posted earlier they would pass through to UCX).
    nixlkit.wait_ready(a)
    s0 = counters(a)
    if op == "WRITE":
        lo = a.get_xfer_descs(lay.src_list(local.ctypes.data), "DRAM")
        re = a.get_xfer_descs(lay.dst_list(remote.ctypes.data), "DRAM")
    else:  # READ remote packed pieces into scattered local slots
        lo = a.get_xfer_descs(lay.dst_list(local.ctypes.data), "DRAM")
        re = a.get_xfer_descs(lay.src_list(remote.ctypes.data), "DRAM")
    h = a.initialize_xfer(op, lo, re, f"t-{op}", b"xfer-done", backends=["BOUNCE"])
    assert a.transfer(h) != "ERR"
    nixlkit.wait_xfer(a, h, peers=[b])
    nixlkit.wait_notif(b, f"i-{op}", b"xfer-done", others=[a])
    assert_bounced(s0, counters(a), op)
    if op == "WRITE":
        nixlkit.assert_same(remote, lay.expected(local, before), "WRITE destination")
    else:
        nixlkit.assert_same(local, lay.expected(remote, before), "READ destination")
    a.release_xfer_handle(h)


def test_an_agent_of_another_wire_version_loads_and_stays_on_plain_ucx():
    """Metadata of a BOUNCE of another wire version (its capabilities say so) loads as an agent
    that cannot bounce: every transfer to it passes through to UCX, byte-exact, and the
    notification arrives. (Before, the whole load failed: two BOUNCE builds could not even
    exchange metadata.)"""
    a, b = nixlkit.agent("wv-a"), nixlkit.agent("wv-b")
    lay = nixlkit.Scattered(N, S, seed=13)
    src, dst = nixlkit.pattern(130, lay.src_bytes), nixlkit.pattern(131, lay.dst_bytes)
    before = dst.copy()
    nixlkit.register(a, src)
    nixlkit.register(b, dst)
    meta = b.get_agent_metadata()
    at = meta.find(b"NXBOUNCE")
    assert at >= 0, "no BOUNCE envelope in the metadata"
    # magic 8, envelope version 2, flags 1, capabilities length 4: the caps' u16 wire version.
    wv = at + 15
    newer = meta[:wv] + (int.from_bytes(meta[wv:wv + 2], "little") + 1).to_bytes(2, "little") + meta[wv + 2:]
    s0 = counters(a)
    a.add_remote_agent(newer)
    b.add_remote_agent(a.get_agent_metadata())
    # b says HELLO (it loaded a, and a's capabilities are readable to it); a cannot read b's,
    # so b never becomes a peer a may bounce to.
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        nixlkit.poll(a)
        nixlkit.poll(b)
    assert counters(a)["peers_ready"] == s0["peers_ready"], "a peer of another wire version became bounce-ready"
    lo = a.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re = a.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM")
    h = a.initialize_xfer("WRITE", lo, re, "wv-b", b"wv", backends=["BOUNCE"])
    assert a.transfer(h) != "ERR"
    nixlkit.wait_xfer(a, h, peers=[b])
    nixlkit.wait_notif(b, "wv-a", b"wv", others=[a])
    nixlkit.assert_same(dst, lay.expected(src, before), "destination")
    s1 = counters(a)
    assert s1["peers_incompatible"] - s0["peers_incompatible"] == 1, (s0, s1)
    assert s1["passthrough_xfers"] - s0["passthrough_xfers"] == 1 and s1["bounce_xfers"] == s0["bounce_xfers"], s1
    a.release_xfer_handle(h)


def test_registration_metadata_of_ours_we_cannot_read_is_refused_not_passed_to_ucx():
    """A registration's public data that is BOUNCE's by its magic but of a layout we cannot read
    (a newer version, say) is refused at load: handed to UCX it would be parsed as an rkey,
    which UCX reads with no length. The process survives, and the readable metadata loads."""
    a, b = nixlkit.agent("pd-a"), nixlkit.agent("pd-b")
    dst = nixlkit.pattern(141, 1 << 20)
    nixlkit.register(b, dst)
    meta = b.get_agent_metadata()
    at = meta.find(b"NXBNCREG")
    assert at >= 0, "no BOUNCE registration metadata"
    newer = meta[:at + 8] + (0x7f).to_bytes(2, "little") + meta[at + 10:]
    with pytest.raises(Exception):
        a.add_remote_agent(newer)
    # The process lives on, and an agent loads the readable metadata. (Not `a` again: NIXL
    # keeps the connection info of a load that failed later, and a second load of it is
    # refused, with UCX as with BOUNCE.)
    c = nixlkit.agent("pd-c")
    assert c.add_remote_agent(meta) == b"pd-b"


def test_gen_notif_both_ways_one_process():
    a, b = nixlkit.agent("n-a"), nixlkit.agent("n-b")
    buf_a, buf_b = nixlkit.pattern(1, 4096), nixlkit.pattern(2, 4096)
    nixlkit.register(a, buf_a)
    nixlkit.register(b, buf_b)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    a.send_notif("n-b", b"ping")
    nixlkit.wait_notif(b, "n-a", b"ping", others=[a])
    b.send_notif("n-a", b"pong")
    nixlkit.wait_notif(a, "n-b", b"pong", others=[b])


def test_an_application_notification_that_begins_like_a_control_frame_reaches_the_peer_as_sent():
    """BOUNCE's control frames begin with `\\0BOUNC`; an application notification beginning so
    (binary payloads may) went to the peer's reactor as a malformed frame and never to its
    application. Every way a notification leaves (genNotif, a pass-through WRITE's, a bounced
    WRITE's and READ's) now reaches the application byte for byte, in order among the others,
    and none is counted as a dropped control frame."""
    a, b = nixlkit.agent("esc-a"), nixlkit.agent("esc-b")
    lay = nixlkit.Scattered(512, S, seed=17)
    src, dst = nixlkit.pattern(40, lay.src_bytes), nixlkit.pattern(41, lay.dst_bytes)
    one_src, one_dst = nixlkit.pattern(42, 1 << 20), nixlkit.pattern(43, 1 << 20)
    for ag, buf in ((a, src), (b, dst), (a, one_src), (b, one_dst)):
        nixlkit.register(ag, buf)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    nixlkit.wait_ready(a)
    nixlkit.wait_ready(b)
    magic = b"\0BOUNC"
    # A valid HELLO frame's bytes too: as an application's notification it is still only bytes.
    sent = [magic + b" gen", b"plain", magic, magic + bytes(range(256)), b"\0BOUN", magic + b" write one",
            magic + b" write bounced", magic + b" read bounced"]
    s0, t0 = counters(a), counters(b)
    a.send_notif("esc-b", sent[0])
    a.send_notif("esc-b", sent[1])
    a.send_notif("esc-b", sent[2])
    a.send_notif("esc-b", sent[3])
    a.send_notif("esc-b", sent[4])
    one = [(one_src.ctypes.data, one_src.nbytes, 0)], [(one_dst.ctypes.data, one_dst.nbytes, 0)]
    h1 = a.initialize_xfer("WRITE", a.get_xfer_descs(one[0], "DRAM"), a.get_xfer_descs(one[1], "DRAM"), "esc-b",
                           sent[5])
    assert a.transfer(h1) != "ERR"
    nixlkit.wait_xfer(a, h1, peers=[b])
    before = dst.copy()
    h2 = a.initialize_xfer("WRITE", a.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM"),
                           a.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM"), "esc-b", sent[6])
    assert a.transfer(h2) != "ERR"
    nixlkit.wait_xfer(a, h2, peers=[b])
    nixlkit.assert_same(dst, lay.expected(src, before), "bounced WRITE")
    nixlkit.assert_same(one_dst, one_src, "pass-through WRITE")
    back = nixlkit.pattern(44, lay.src_bytes)
    nixlkit.register(a, back)
    before = back.copy()
    # READ the scattered destinations back into packed slots of `back`.
    h3 = a.initialize_xfer("READ", a.get_xfer_descs(lay.src_list(back.ctypes.data), "DRAM"),
                           a.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM"), "esc-b", sent[7])
    assert a.transfer(h3) != "ERR"
    nixlkit.wait_xfer(a, h3, peers=[b])
    nixlkit.wait_notif(b, "esc-a", sent[-1], others=[a])
    got = [m for who, m in nixlkit.poll(b) if who == "esc-a"]
    assert got == sent[:-1], got
    s1, t1 = counters(a), counters(b)
    moved = {k: s1[k] - s0[k] for k in ("bounce_ok", "bounce_read_ok", "passthrough_xfers")}
    assert moved == {"bounce_ok": 2, "bounce_read_ok": 1, "passthrough_xfers": 1}, moved
    assert t1["control_dropped"] == t0["control_dropped"], "a notification was taken for a control frame"
    for h in (h1, h2, h3):
        a.release_xfer_handle(h)


def test_bounce_and_ucx_side_by_side_in_one_agent():
    a = nixlkit.agent("sx-a", ("BOUNCE", "UCX"))
    b = nixlkit.agent("sx-b", ("BOUNCE", "UCX"))
    lay = nixlkit.Scattered(512, S, seed=5)
    for backend, seed in (("UCX", 30), ("BOUNCE", 31)):
        src = nixlkit.pattern(seed, lay.src_bytes)
        dst = nixlkit.pattern(seed + 1000, lay.dst_bytes)
        before = dst.copy()
        nixlkit.register(a, src, backend)
        nixlkit.register(b, dst, backend)
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        if backend == "BOUNCE":
            nixlkit.wait_ready(a)
        s0 = counters(a)
        lo = a.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
        re = a.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM")
        h = a.initialize_xfer("WRITE", lo, re, "sx-b", backend.encode(), backends=[backend])
        assert a.transfer(h) != "ERR"
        nixlkit.wait_xfer(a, h, peers=[b])
        nixlkit.wait_notif(b, "sx-a", backend.encode(), others=[a])
        nixlkit.assert_same(dst, lay.expected(src, before), f"{backend} destination")
        s1 = counters(a)
        if backend == "BOUNCE":
            assert_bounced(s0, s1, "WRITE")
        else:
            # The agent's UCX engine moved it: BOUNCE's engine was not asked.
            keys = ("bounce_xfers", "passthrough_xfers", "cma_xfers")
            assert [s1[k] for k in keys] == [s0[k] for k in keys], (s0, s1)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_scattered_transfer_two_processes_is_byte_exact(peer, tmp_path, op):
    lay = nixlkit.Scattered(N, S, seed=21 if op == "WRITE" else 22)
    p = peer()
    remote_size = lay.dst_bytes if op == "WRITE" else lay.src_bytes
    meta, raddr = p.start(name="tgt", size=remote_size, seed=300)
    a = nixlkit.agent("ini")
    local = nixlkit.pattern(400, lay.src_bytes if op == "WRITE" else lay.dst_bytes)
    local_before = local.copy()
    nixlkit.register(a, local)
    a.add_remote_agent(meta)
    import base64
    p.call(op="load", meta=base64.b64encode(a.get_agent_metadata()).decode())
    nixlkit.wait_ready(a)
    s0 = counters(a)
    if op == "WRITE":
        lo = a.get_xfer_descs(lay.src_list(local.ctypes.data), "DRAM")
        re = a.get_xfer_descs(lay.dst_list(raddr), "DRAM")
    else:
        lo = a.get_xfer_descs(lay.dst_list(local.ctypes.data), "DRAM")
        re = a.get_xfer_descs(lay.src_list(raddr), "DRAM")
    h = a.initialize_xfer(op, lo, re, "tgt", b"two-proc", backends=["BOUNCE"])
    assert a.transfer(h) != "ERR"
    nixlkit.wait_xfer(a, h)
    p.call(op="notif_wait", **{"from": "ini", "msg": "two-proc"})
    assert_bounced(s0, counters(a), op)
    remote_before = nixlkit.pattern(300, remote_size)
    if op == "WRITE":
        path = tmp_path / "remote.bin"
        p.call(op="dump", path=str(path))
        remote = np.fromfile(path, dtype=np.uint8)
        nixlkit.assert_same(remote, lay.expected(local, remote_before), "remote destination")
        nixlkit.assert_same(local, local_before, "source must not change")
    else:
        nixlkit.assert_same(local, lay.expected(remote_before, local_before), "READ destination")
    # notifications both ways across processes
    a.send_notif("tgt", b"hello")
    p.call(op="notif_wait", **{"from": "ini", "msg": "hello"})
    p.call(op="notif_send", to="ini", msg="world")
    nixlkit.wait_notif(a, "tgt", b"world")


@pytest.mark.parametrize("params, needle", [
    ({"bounce_ucx_plugin": "/nonexistent/libplugin_UCX.so"}, "UCX plugin was not found"),
    ({"bounce_max_inflight_chunks": "0"}, "invalid BOUNCE configuration"),
    ({"bounce_arena_granularity": "3000"}, "invalid BOUNCE configuration"),
    # A value that does not parse is refused too: in its place the default would do the
    # opposite of what was asked (review 55).
    ({"bounce_enable": "disable"}, 'bounce_enable: cannot parse "disable" from backend param'),
    ({"bounce_control": "zeromq"}, 'bounce_control: cannot parse "zeromq"'),
    ({"bounce_arena_size": "1.5GiB"}, 'bounce_arena_size: cannot parse "1.5GiB"'),
    # Out of bounds: a thread per worker (100000 took 45 s to fail), a socket listening on every
    # interface (it left the bounce path off with a warning before, review 55).
    ({"bounce_copy_workers": "100000"}, "bounce_copy_workers must be at most 256, got 100000"),
    ({"bounce_cma_workers": "257"}, "bounce_cma_workers must be at most 256"),
    ({"bounce_control": "zmq", "bounce_zmq_host": "0.0.0.0"}, 'bounce_zmq_host "0.0.0.0" is not a specific IP'),
])
def test_bad_setup_fails_creation_cleanly(params, needle):
    out = create_bounce_in_isolation(params)
    assert "create failed" in out and needle in out, out


def create_bounce_in_isolation(params):
    """Creates a BOUNCE backend with `params` in a fresh interpreter; returns its output after
    checking the process survived and NIXL stayed usable."""
    code = textwrap.dedent(f"""
        import nixlkit
        a = nixlkit.agent("bad", backends=())
        try:
            a.create_backend("BOUNCE", {params!r})
        except Exception as e:
            print("create failed:", type(e).__name__)
        else:
            print("create succeeded")
        # the process is still alive and NIXL still usable
        b = nixlkit.agent("good")
        print("still alive")
        nixlkit.leave(0)
    """)
    rc, out = run_isolated(code)
    assert rc == 0, out
    assert "still alive" in out, out
    return out


def test_inner_plugin_with_wrong_api_version_is_refused(tmp_path):
    so = tmp_path / "libplugin_UCX.so"
    src = tmp_path / "fake.c"
    src.write_text("struct p { int v; void *f[6]; };\n"
                   "static struct p plugin = { 2 };\n"
                   "void *nixl_plugin_init(void) { return &plugin; }\n")
    assert os.system(f"cc -shared -fPIC -o {so} {src}") == 0
    out = create_bounce_in_isolation({"bounce_ucx_plugin": str(so)})
    assert "create failed" in out and "plugin API version 2" in out, out


def test_inner_plugin_pointing_at_bounce_itself_is_refused():
    me = os.path.join(nixlkit.plugin_dir(), "libplugin_BOUNCE.so")
    out = create_bounce_in_isolation({"bounce_ucx_plugin": me})
    assert "create failed" in out and "is BOUNCE itself" in out, out


def test_engine_teardown_after_traffic_does_not_crash():
    # os._exit hides exit-time crashes, so destroy the agents explicitly first.
    code = textwrap.dedent("""
        import gc, nixlkit
        a, b = nixlkit.agent("td-a"), nixlkit.agent("td-b")
        lay = nixlkit.Scattered(256, 4096, seed=3)
        src, dst = nixlkit.pattern(1, lay.src_bytes), nixlkit.pattern(2, lay.dst_bytes)
        ra, rb = nixlkit.register(a, src), nixlkit.register(b, dst)
        a.add_remote_agent(b.get_agent_metadata())
        h = a.initialize_xfer("WRITE", a.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM"),
                              a.get_xfer_descs(lay.dst_list(dst.ctypes.data), "DRAM"), "td-b", b"x")
        a.transfer(h)
        nixlkit.wait_xfer(a, h, peers=[b])
        a.release_xfer_handle(h)
        a.remove_remote_agent("td-b")
        a.deregister_memory(ra); b.deregister_memory(rb)
        del a, b
        gc.collect()
        print("destroyed")
        nixlkit.leave(0)
    """)
    rc, out = run_isolated(code)
    assert rc == 0, out
    assert "destroyed" in out


def test_metadata_loaded_and_unloaded_in_a_tight_loop_warns_nothing_and_still_bounces():
    """An application that loads and unloads a peer as fast as it can (the pass-through
    benchmark's load+unload) races the reactor: a HELLO queued by one load can be handled while
    the next load is half done, when the inner engine does not know the peer yet. That is no
    fault (the reload queues its own HELLO) and must not be logged as one; the peer bounces
    after the churn as before it."""
    code = textwrap.dedent("""
        import nixlkit
        a, b = nixlkit.agent("churn-a"), nixlkit.agent("churn-b")
        lay = nixlkit.Scattered(256, 4096, seed=5)
        src, dst = nixlkit.pattern(11, lay.src_bytes), nixlkit.pattern(12, lay.dst_bytes)
        nixlkit.register(a, src), nixlkit.register(b, dst)
        meta = b.get_agent_metadata()
        for _ in range(1500):
            a.add_remote_agent(meta)
            a.remove_remote_agent("churn-b")
        a.add_remote_agent(meta)
        b.add_remote_agent(a.get_agent_metadata())
        nixlkit.wait_ready(a)
        nixlkit.write_exact(a, b, "churn-b", lay, src, dst, nixlkit.pattern(12, lay.dst_bytes), "after the churn", b"x")
        print("bounced", nixlkit.live_params(a)["stats.bounce_xfers"])
        nixlkit.leave(0)
    """)
    rc, out = run_isolated(code)
    assert rc == 0, out
    assert "bounced 1" in out, out
    assert "HELLO failed" not in out, out


@pytest.mark.parametrize("case", ["mismatched_counts", "outside_registered", "empty", "unequal_lengths"])
def test_bad_requests_get_the_same_answer_as_from_ucx(case):
    """Bad input at the API: an agent on BOUNCE answers exactly as one on UCX does (both reject
    it, neither moves a byte). NIXL's core may reject these before any backend sees them; the
    edge's own answers to bad input are cpp/tests/shim_test.cpp's."""
    outcomes = {}
    for backend in ("UCX", "BOUNCE"):
        a = nixlkit.agent(f"bad-{case}-{backend}-a", (backend,))
        b = nixlkit.agent(f"bad-{case}-{backend}-b", (backend,))
        src = nixlkit.pattern(1, 1 << 20)
        dst = nixlkit.pattern(2, 1 << 20)
        before = dst.copy()
        nixlkit.register(a, src, backend)
        nixlkit.register(b, dst, backend)
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        n = 512
        lo = [(src.ctypes.data + i * 1024, 1024, 0) for i in range(n)]
        re = [(dst.ctypes.data + i * 1024, 1024, 0) for i in range(n)]
        if case == "mismatched_counts":
            re = re[:-1]
        elif case == "outside_registered":
            re[7] = (dst.ctypes.data + (1 << 20), 1024, 0)
        elif case == "empty":
            lo, re = [], []
        elif case == "unequal_lengths":
            re[3] = (re[3][0], 512, 0)
        try:
            h = a.initialize_xfer("WRITE", a.get_xfer_descs(lo, "DRAM"), a.get_xfer_descs(re, "DRAM"),
                                  b.name, b"", backends=[backend])
            st = a.transfer(h)
            if st != "ERR":
                nixlkit.wait_xfer(a, h, peers=[b])
            outcomes[backend] = f"accepted:{st}"
        except Exception as e:
            outcomes[backend] = f"rejected:{type(e).__name__}"
        if outcomes[backend].startswith("rejected"):
            nixlkit.assert_same(dst, before, f"{backend}: a rejected request moved bytes")
    assert outcomes["BOUNCE"] == outcomes["UCX"], outcomes
    assert outcomes["UCX"].startswith("rejected"), outcomes
