"""Review 61 (credits, H1), run by test_trust.py: a key holder pins a few small regions of a
victim's arena, one at each max-chunk boundary, and writes every other chunk of their flows.
The share cap counts bytes only, so it passes; an honest max-chunk flow never fits; drain mode
then stops every grant to every peer. Before session 61 the pins lived for ever (a flow's lease
ran from its last progress, and the flows progressed through their other chunks); now each
region has its own cap.

One process, four agents: victim V, honest P (256 KiB chunks) and Q (64 KiB chunks), hostile H
(raw frames, holds V's registration metadata, as any peer given it does). H learns where V
placed its regions from V's trace (a real attacker reads its GRANT frames). Usage:
`pin_regions.py MODE TRACE_FILE` with MODE `nokeep` (H writes the other chunks, never chunk 0,
no KEEPs, no honest traffic), `attack` (the same with KEEPs while P and Q write), `idle` (H
writes nothing) or `baseline`. The last line is a JSON summary."""
import json
import os
import re
import struct
import sys
import time

LOG = sys.argv[2] if len(sys.argv) > 2 else "/tmp/pin_regions.log"
os.environ["NIXL_BOUNCE_LOG"] = "warn,bounce_proto::scheduler::fair=trace,bounce_proto::receiver=trace"
err = os.dup(2)
fd = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(fd, 2)
sys.stderr = os.fdopen(err, "w", buffering=1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nixlkit  # noqa: E402
import hostile_peer as hp  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "attack"
T_MS = 2000
KIB = 1024
BASE = {"bounce_request_timeout_ms": str(T_MS), "bounce_arena_size": "1MiB",
        "bounce_arena_granularity": "64KiB", "bounce_max_chunk_size": "256KiB",
        "bounce_max_inflight_chunks": "4", "bounce_standing_bytes": "0", "bounce_inline_bytes": "0",
        "bounce_cma": "false"}
KEEP = 9


def keep(session, xfer, token):
    return hp.header(KEEP, session) + struct.pack("<Q", xfer) + hp.tok(token)


def stats(ag):
    return {k[6:]: int(v) for k, v in nixlkit.live_params(ag).items() if k.startswith("stats.")}


V = nixlkit.agent("v", params=BASE)
P = nixlkit.agent("p", params=BASE)
Q = nixlkit.agent("q", params=BASE)
H = nixlkit.agent("h", params={**BASE, **hp.RAW})
vbuf = nixlkit.pattern(1, 4 << 20)
nixlkit.register(V, vbuf)
vmeta = V.get_agent_metadata()
srcP = nixlkit.pattern(2, 256 * KIB)
srcQ = nixlkit.pattern(3, 64 * KIB)
nixlkit.register(P, srcP)
nixlkit.register(Q, srcQ)
for a in (P, Q, H):
    a.add_remote_agent(vmeta)
    V.add_remote_agent(a.get_agent_metadata())
ALL = (V, P, Q, H)


def pump(s):
    end = time.monotonic() + s
    while True:
        for a in ALL:
            a.get_new_notifs()
        if time.monotonic() >= end:
            return


end = time.monotonic() + 15
while time.monotonic() < end:
    pump(0.01)
    if all(int(nixlkit.live_params(a).get("stats.peers_ready", 0)) >= 1 for a in (P, Q, H)) and \
            int(nixlkit.live_params(V).get("stats.peers_ready", 0)) >= 3:
        break
else:
    raise SystemExit("not ready")

(reg, key), = hp.registrations_of(vmeta)
hs = hp.session_of(H.get_agent_metadata())
vaddr = vbuf.ctypes.data
GRANT_RE = re.compile(r"grant flow=FlowKey \{ peer: PeerId\((\d+)\), xfer: XferId\((\d+)\) \} chunk=(\d+) offset=(\d+) len=(\d+)")
seen = 0


def new_grants():
    global seen
    with open(LOG) as f:
        f.seek(seen)
        text = f.read()
        seen = f.tell()
    return [tuple(map(int, m.groups())) for m in GRANT_RE.finditer(text)]


def check(ag, h):
    try:
        return ag.check_xfer_state(h)
    except Exception as e:
        return "ERR"


def post(ag, lay, src, what):
    lo = ag.get_xfer_descs(lay.src_list(src.ctypes.data), "DRAM")
    re_ = ag.get_xfer_descs(lay.dst_list(vaddr + (2 << 20)), "DRAM")
    h = ag.initialize_xfer("WRITE", lo, re_, "v", b"", backends=["BOUNCE"])
    st = ag.transfer(h)
    return [h, st, time.monotonic(), what]


layP = nixlkit.Scattered(1024, 256, seed=5)  # 256 KiB, one 256 KiB chunk
layQ = nixlkit.Scattered(256, 256, seed=6)   # 64 KiB, one 64 KiB chunk
print("sizes", layP.src_bytes, layQ.src_bytes, flush=True)

if MODE == "baseline":
    xs = [post(P, layP, srcP, "P"), post(Q, layQ, srcQ, "Q")]
    t0 = time.monotonic()
    while any(x[1] not in ("DONE", "ERR") for x in xs) and time.monotonic() - t0 < 10:
        pump(0.005)
        for x in xs:
            if x[1] not in ("DONE", "ERR"):
                x[1] = (P if x[3] == "P" else Q).check_xfer_state(x[0])
    print("baseline", [(x[3], x[1]) for x in xs], f"{time.monotonic() - t0:.3f}s", flush=True)
    print("grants", new_grants(), flush=True)
    os._exit(0)

# --- H pins: 4 flows, each chunk 0 lands at a 256 KiB boundary (fresh arena, next-fit) ---
flows = {}  # xfer -> token
vid_h = None
pinned = {}  # xfer -> offset of chunk 0
outstanding = {}  # (xfer, chunk) -> offset
done_data = set()
for i in range(4):
    x = 7000 + i
    flows[x] = x
    H.send_notif("v", hp.want(hs, x, [64 * KIB] * 4000, token=x, proofs=[hp.proof(reg, key, x, "h", x)]))
    pump(0.05)
    for peer, xf, ch, off, ln in new_grants():
        if xf in flows:
            outstanding[(xf, ch)] = off
        if xf in flows and ch == 0:
            pinned[xf] = off
            vid_h = peer
print("pinned chunk-0 regions", pinned, flush=True)
assert sorted(pinned.values()) == [0, 256 * KIB, 512 * KIB, 768 * KIB], pinned
s0 = stats(V)
print("V free bytes after pinning", s0.get("arena_free_bytes"), flush=True)

last_keep = 0.0


KEEPS = MODE != "nokeep"
CYCLE = MODE != "idle"


def hostile_step():
    """H writes every chunk of its flows but chunk 0 (a DATA scattering the region into V's
    registered buffer, which H may write anyway), and KEEPs its flows."""
    global last_keep
    for peer, xf, ch, off, ln in new_grants():
        if xf in flows:
            outstanding[(xf, ch)] = off
        else:
            print(f"  t={time.monotonic() - t0:.2f} grant to other flow peer={peer} xfer={xf} chunk={ch} off={off} len={ln}", flush=True)
    for (xf, ch), off in list(outstanding.items()):
        if ch == 0 or not CYCLE:
            continue
        del outstanding[(xf, ch)]
        H.send_notif("v", hp.data(hs, xf, ch, (off, 64 * KIB), [(0, vaddr + ch % 16 * 64 * KIB, 64 * KIB, 1, 0, 0)], token=xf))
    if KEEPS and time.monotonic() - last_keep > 0.2:
        last_keep = time.monotonic()
        for xf in flows:
            H.send_notif("v", keep(hs, xf, xf))



t0 = time.monotonic()
if MODE in ("nokeep", "idle"):
    # No honest traffic: does a never-written region outlive its lease (T/2 = 1 s)?
    while time.monotonic() - t0 < 4 * T_MS / 1000:
        hostile_step()
        pump(0.01)
    s1 = stats(V)
    print(f"t={time.monotonic() - t0:.2f} (4 T): flows_timed_out {s0['flows_timed_out']} -> {s1['flows_timed_out']}",
          f"regions_quarantined {s0['regions_quarantined']} -> {s1['regions_quarantined']}", flush=True)
    # Now DATA for each never-written chunk 0: accepted only if the flow still holds that region.
    for xf, off in pinned.items():
        H.send_notif("v", hp.data(hs, xf, 0, (off, 64 * KIB), [(0, vaddr, 64 * KIB, 1, 0, 0)], token=xf))
    pump(0.3)
    with open(LOG) as f:
        text = f.read()
    sc = re.findall(r"scatter peer=\d+ xfer=(700\d) chunk=0 ", text)
    print(f"chunk-0 DATAs after 4 T scattered (never-written regions still held) for flows: {sorted(set(sc))}", flush=True)
    print(json.dumps({"timed_out": s1["flows_timed_out"] - s0["flows_timed_out"], "late_scattered": sorted(set(sc))}))
    os._exit(0)

# MODE attack: P re-posts a 256 KiB WRITE as soon as the last one ends; Q a 64 KiB one 0.2 s
# after each P post.
results = {"P": [], "Q": []}
while time.monotonic() - t0 < 0.5:
    hostile_step()
    pump(0.01)
xP, xQ = None, None
q_for = None  # the P post time Q was last posted after
while time.monotonic() - t0 < 12:
    hostile_step()
    pump(0.01)
    if xP is None:
        xP = post(P, layP, srcP, "P")
    elif xP[1] not in ("DONE", "ERR"):
        xP[1] = check(P, xP[0])
        if xP[1] in ("DONE", "ERR"):
            results["P"].append((xP[1], round(time.monotonic() - xP[2], 2)))
            P.release_xfer_handle(xP[0])
            xP = None
            continue
    if xQ is None and q_for != xP[2] and time.monotonic() - xP[2] > 0.2:
        q_for = xP[2]
        xQ = post(Q, layQ, srcQ, "Q")
    elif xQ is not None:
        xQ[1] = check(Q, xQ[0])
        if xQ[1] in ("DONE", "ERR"):
            results["Q"].append((xQ[1], round(time.monotonic() - xQ[2], 2)))
            Q.release_xfer_handle(xQ[0])
            xQ = None
s1 = stats(V)
print("P WRITEs (256 KiB chunk):", results["P"], flush=True)
print("Q WRITEs (64 KiB chunk):", results["Q"], flush=True)
print("pins never written, still at", sorted(pinned.values()), flush=True)
for k in ("flows_timed_out", "control_dropped", "regions_quarantined"):
    print(" ", k, s0.get(k), "->", s1.get(k), flush=True)
print(json.dumps({"P": results["P"], "Q": results["Q"], "timed_out": s1["flows_timed_out"] - s0["flows_timed_out"]}))
os._exit(0)
