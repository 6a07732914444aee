"""Victim and hostile NIXL agents for test_failures.py, driven line by line over stdin/stdout
(JSON), like peer.py. One process may hold several agents (by name); while idle it polls all of
them.

Commands (one JSON object per line; every reply is one JSON line with "ok"):
  {"op": "agent", "name": N, "params": {...}}          -> {"meta": b64}
  {"op": "buffer", "agent": N, "size": B, "seed": S, "register": R}
      the process's buffer, filled with pattern(seed); only its first R bytes are registered
      (the rest is a canary no peer may ever write); a later one replaces it for "dump",
      "register" and "write", the earlier ones kept alive (still registered)
                                                              -> {"addr": int}
  {"op": "register", "agent": N, "off": O, "len": L}
      registers buffer[O:O+L] too, after the metadata went out     -> {"meta": b64}
  {"op": "load", "agent": N, "meta": b64}
  {"op": "dump", "path": P}
  {"op": "write", "agent": N, "to": A, "n", "size", "seed", "src_off", "raddr", "timeout"}
      scattered WRITE of Scattered(n, size, seed) from buffer+src_off to raddr
      -> {"state": "DONE"|"ERR", "seconds": t, "error": str?}
  {"op": "wait_ready", "agent": N, "n": K}   wait until N may bounce to K peers (HELLO seen)
  {"op": "params", "agent": N}                           -> {"params": {...}}
  {"op": "fuzz", "agents": [N...], "to": A, "seconds": T, "seed": S, "targets": {...},
   "endpoints": bool, "max_flows": F, "forge": bool, "sessions": [int...]}
      sends hostile control frames through the real notification channel for T seconds (with
      "endpoints": false, no WANT carries a forged reverse-path endpoint; at most F transfer
      ids are ever announced, so at most F flows can hold credits at the victim); frames carry
      the first agent's real session; with "forge", every fourth group is a forgery sent by
      the first agent (other agents' "sessions", or wrong tokens for its own live flows)
      -> {"sent": k, "send_errors": e, "kinds": {...}, "forged": {kind: frames to refuse}}
  {"op": "exit"}
"""
import base64
import os
import random
import re
import struct
import time

import nixlkit


def wire_version():
    """The frame version the plugin speaks, read from its source (proto/src/wire/frame.rs), so
    that a version bump cannot leave these frames behind, dropped for their version alone."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "proto", "src", "wire", "frame.rs")
    with open(src) as f:
        m = re.search(r"pub const WIRE_VERSION: u8 = (\d+);", f.read())
    if not m:
        raise SystemExit(f"WIRE_VERSION not found in {src}")
    return int(m.group(1))


MAGIC = b"\0BOUNC"
# The params of an agent that plays a hostile peer: its notifications go as they are, so the
# frames it sends with send_notif reach the victim's reactor raw, as from a peer running other
# code (an honest BOUNCE escapes a notification that begins with MAGIC: bounce_escape_notifs).
RAW = {"bounce_escape_notifs": "false"}
VERSION = wire_version()
WANT, GRANT, DATA, ACK = 1, 2, 3, 4
ENVELOPE_MAGIC = b"NXBOUNCE"
U64 = (1 << 64) - 1
LATER = None  # in a frame list: send the rest ~20 ms later (after the victim's GRANT)


def header(kind, session, version=VERSION):
    return MAGIC + bytes([version, kind]) + struct.pack("<Q", session)


def tok(token):
    """A transfer token: 128 bits, little-endian (proto/src/wire/codec.rs `Writer::token`)."""
    return (token & ((1 << 128) - 1)).to_bytes(16, "little")


# The u64 fields of the first arena in the capabilities, in order (proto/src/wire/caps.rs).
ARENA_U64 = ("arena_dev", "arena_base", "arena_len", "usable_capacity", "max_chunk")


def caps_offset(meta, field):
    """Where u64 capability `field` ("session", or one of the first arena's ARENA_U64) lies in
    an agent's metadata. The metadata holds the connection-info envelope raw: magic, u16
    version, u8 flags, u32 caps length, then the capabilities (u16 wire version, u8 control,
    u64 session, u8 arena count, then each arena: u8 memory kind and the u64 fields)."""
    at = meta.find(ENVELOPE_MAGIC)
    assert at >= 0 and meta[at + 10] & 1, "no BOUNCE capabilities in this agent's metadata"
    caps = at + 15
    if field == "session":
        return caps + 3
    return caps + 13 + 8 * ARENA_U64.index(field)


def session_of(meta):
    """The BOUNCE session (instance nonce) an agent publishes in its metadata: the frames it
    sends must carry it, or the peers that loaded the metadata refuse them."""
    return struct.unpack_from("<Q", meta, caps_offset(meta, "session"))[0]


def zmq_endpoint_of(meta):
    """The ZMQ control endpoint (`tcp://host:port`) an agent with `bounce_control=zmq`
    advertises in its capabilities: where anyone may connect and write frames."""
    import re
    m = re.search(rb"tcp://[0-9.]+:[0-9]+", meta)
    assert m, "no ZMQ endpoint in this agent's metadata"
    return m.group(0).decode()


def stream_message(name, frame):
    """`frame` sent under `name` over a ZMQ control connection: u16 name length, u32 frame
    length, the name, the frame (proto/src/wire/stream.rs `encode`). The victim's socket is a
    ZMQ_STREAM one, so a plain TCP connection reaches it: no ZMQ library needed."""
    n = name.encode()
    return struct.pack("<HI", len(n), len(frame)) + n + frame


PUBLIC_MAGIC = b"NXBNCREG"


def registrations_of(meta):
    """(registration id, 32-byte key) of each BOUNCE registration in an agent's metadata: its
    public-data envelopes (proto/src/wire/public.rs: magic, u16 version, u64 id, the key). What
    any agent given that metadata holds."""
    found, at = [], meta.find(PUBLIC_MAGIC)
    while at >= 0:
        reg = struct.unpack_from("<Q", meta, at + 10)[0]
        found.append((reg, bytes(meta[at + 18:at + 50])))
        at = meta.find(PUBLIC_MAGIC, at + 1)
    return found


def proof(reg, key, token, initiator, xfer):
    """The proof of registration `reg` (its `key`) for transfer `xfer` with `token`, made by
    the agent named `initiator` (proto/src/proof.rs: BLAKE3 keyed by the registration key over
    the token, the transfer id (u64, little-endian) and the initiator's derived name hash,
    truncated to 16 bytes): what a peer holding the registration's metadata can make, and a
    WANT or PULL opening a flow must carry."""
    import blake3
    by = blake3.blake3(initiator.encode(), derive_key_context="nixl-bounce 2026-12 proof initiator").digest()
    return reg, blake3.blake3(tok(token) + struct.pack("<Q", xfer) + by, key=key).digest()[:16]


def pull(session, xfer, token, chunks, proofs, first=0, total=None, endpoint=b"\0mailbox", arena=0):
    """A PULL (kind 11, proto/src/wire/frame.rs): READ chunks `chunks`, each (bytes, runs), from
    chunk `first` of `total`; one way (answered in the target's mailbox) by default."""
    total = len(chunks) if total is None else total
    body = struct.pack("<Q", xfer) + tok(token) + bytes([arena]) + struct.pack("<II", first, total)
    body += struct.pack("<I", len(endpoint)) + endpoint + struct.pack("<I", len(chunks))
    for nbytes, runs in chunks:
        body += struct.pack("<QI", nbytes, len(runs)) + runs_bytes(runs)
    body += struct.pack("<I", len(proofs)) + b"".join(struct.pack("<Q", r) + t for r, t in proofs)
    return header(11, session) + body


def want(session, xfer, chunks, endpoint=b"", token=0, proofs=(), inline=None, standing=None, arena=0):
    """arena: the receiver's arena the flow asks regions of (its index in the receiver's
    capabilities); proofs: (registration id, 16-byte tag) pairs (proto/src/proof.rs); inline: (bytes, runs),
    the one chunk carried in the WANT (proto/src/wire/frame.rs `Inline`), runs as for `data`;
    standing: None, "open", or ("claim", standing flow id, its token) (frame.rs `Standing`)."""
    tail = struct.pack("<I", 0)
    if inline is not None:
        payload, runs = inline
        tail = struct.pack("<I", len(payload)) + payload + struct.pack("<I", len(runs)) + runs_bytes(runs)
    if standing is None:
        tail += b"\x00"
    elif standing == "open":
        tail += b"\x01"
    else:
        _, sx, st = standing
        tail += b"\x02" + struct.pack("<Q", sx) + tok(st)
    return (header(WANT, session) + struct.pack("<Q", xfer) + tok(token) + bytes([arena]) + struct.pack("<I", len(endpoint))
            + endpoint + struct.pack("<I", len(chunks)) + b"".join(struct.pack("<Q", c) for c in chunks)
            + struct.pack("<I", len(proofs)) + b"".join(struct.pack("<Q", r) + t for r, t in proofs) + tail)


def grant(session, xfer, credits, token=0):
    return (header(GRANT, session) + struct.pack("<Q", xfer) + tok(token) + struct.pack("<I", len(credits))
            + b"".join(struct.pack("<IQQ", c, off, ln) for c, off, ln in credits))


def varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def runs_bytes(runs):
    """Scatter runs, delta-coded as in proto/src/wire.rs (`Writer::run`): a flags byte
    (1 strided, 2 new length, 4 region jump), the fields that differ from what the previous run
    implies, and the address as a zigzag varint of its distance from the previous run's end."""
    out, region_end, addr_end, prev_len = bytearray(), 0, 0, 0
    for off, addr, ln, count, rs, as_ in runs:
        strided = count != 1 or rs != 0 or as_ != 0
        flags = (1 if strided else 0) | (2 if ln != prev_len else 0) | (4 if off != region_end else 0)
        out.append(flags)
        if flags & 4:
            out += varint(off)
        delta = (addr - addr_end) & U64
        delta = delta - (1 << 64) if delta >> 63 else delta
        out += varint(((delta << 1) ^ (delta >> 63)) & U64)
        if flags & 2:
            out += varint(ln)
        if strided:
            out += varint(count) + varint(rs) + varint(as_)
        last = (count - 1) & U64
        region_end = (off + rs * last + ln) & U64
        addr_end = (addr + as_ * last + ln) & U64
        prev_len = ln
    return bytes(out)


def data(session, xfer, chunk, region, runs, token=0, region_plan_runs=0):
    """runs: (region_off, addr, len, count, region_stride, addr_stride); region_plan_runs: the
    count of runs the DATA says lie in its region (then `runs` must be empty)."""
    return (header(DATA, session) + struct.pack("<Q", xfer) + tok(token)
            + struct.pack("<IQQI", chunk, region[0], region[1], len(runs)) + runs_bytes(runs)
            + struct.pack("<I", region_plan_runs))


def ack(session, xfer, chunk, region, status, token=0):
    return (header(ACK, session) + struct.pack("<Q", xfer) + tok(token)
            + struct.pack("<IQQB", chunk, region[0], region[1], status))


class Fuzzer:
    """Frames a hostile peer can send: garbage, truncations, wrong versions/kinds, absurd counts,
    valid-looking WANT/GRANT/DATA/ACK whose scatter runs point where no peer may write, and
    forgeries (FORGED_KINDS) that a victim must refuse, every one, as not authentic: frames under
    another agent's session, and frames naming the hostile's own live flow with a wrong token.

    `session` is the session the sending agent really has (`session_of` its metadata), so that
    the plain frames reach the victim's protocol checks instead of all dying on the session
    rule; every non-forged frame carries token 0. `sessions` are other agents' sessions."""

    FORGED_KINDS = ("forged_session", "forged_token")

    def __init__(self, seed, targets, endpoints=True, max_flows=1 << 62, session=None, sessions=()):
        self.r = random.Random(seed)
        self.t = targets
        self.endpoints = endpoints
        self.max_flows = max_flows
        self.flows = 0
        self.session = self.r.getrandbits(64) | 1 if session is None else session
        self.others = [x for x in sessions if x != self.session]
        self.next_xfer = 1 << 40
        self.next_forged_xfer = 1 << 50
        # token -> the proofs the sending agent can make (it holds the victim's registration
        # metadata); None: it proves nothing. A WANT opening a flow must prove a registration,
        # so without them no plain WANT would get past the proof check to the ones behind it.
        self.prove = None

    def want(self, *args, **kw):
        """`want` with the sending agent's proofs for its token and transfer (none asked for a
        standing WANT, which names no destination, or where the caller gives its own)."""
        if self.prove is not None and "proofs" not in kw and kw.get("standing") != "open":
            kw["proofs"] = self.prove(kw.get("token", 0), args[1] if len(args) > 1 else kw["xfer"])
        return want(*args, **kw)

    FORBIDDEN_SHAPES = 7

    def forbidden_runs(self, pick=None):
        """Scatter runs that end outside registered memory (the canary, wild addresses,
        straddling the end of the registered part, overflowing strides)."""
        r, t = self.r, self.t
        can, can_len = t["canary"], t["canary_len"]
        reg_end = t["reg_addr"] + t["reg_len"]
        if pick is None:
            pick = r.randrange(self.FORBIDDEN_SHAPES)
        if pick == 0:
            return [(0, can + r.randrange(0, can_len - 64), 64, 1, 0, 0)]
        if pick == 1:  # starts inside registered memory, ends in the canary
            return [(0, reg_end - 32, 4096, 1, 0, 0)]
        if pick == 2:  # many copies striding from registered memory into the canary
            return [(0, reg_end - 8 * 4096, 4096, 64, 4096, 4096)]
        if pick == 3:
            return [(0, r.choice([0, 8, 0x1000, U64 - 4095, 0xdead_beef_0000]), 4096, 1, 0, 0)]
        if pick == 4:  # overflowing arithmetic
            return [(0, t["reg_addr"], U64, 2, 0, 0), (0, reg_end - 64, 64, 0xFFFF_FFFF, U64, U64)]
        if pick == 5:  # region offset outside the region
            return [(U64 - 10, can, 64, 1, 0, 0)]
        return [(0, can, 64, 1, 0, 0), (64, t["reg_addr"], 64, 1, 0, 0)]  # one bad run among good

    def guessed_region(self):
        g = 64 << 10
        return (self.r.randrange(0, 64) * g, self.r.choice([g, 2 * g, 1 << 20, 4096]))

    def frame(self):
        """(kind, frame or list of frames, forged): `forged` is how many of the frames a victim
        that loaded this agent must refuse as forgeries (kinds FORGED_KINDS only)."""
        kind, frames = self.plain_frame()
        return kind, frames, 0

    def forged_frame(self):
        """One of FORGED_KINDS: (kind, frames, forged)."""
        r, t, s = self.r, self.t, self.session
        if r.random() < 0.5:
            # A valid-looking frame under another agent's session (or a random one).
            f = bytearray(self.valid_looking()[1])
            other = r.choice(self.others) if self.others and r.random() < 0.7 else r.getrandbits(64)
            f[8:16] = struct.pack("<Q", other if other != s else s ^ 1)
            return "forged_session", bytes(f), 1
        # Our own flow, announced with token T, then frames naming it (right transfer id,
        # granted-region guesses) with wrong tokens: DATA aimed at the registered canary, a
        # cancel, a WANT for more chunks. Each must be refused; the real cancel ends the flow.
        self.next_forged_xfer += 1
        x, token = self.next_forged_xfer, r.getrandbits(128) | 1
        bad = token ^ (r.getrandbits(128) | 1)
        target = t.get("reg_canary", t["reg_addr"])
        forged = [data(s, x, 0, (k * (64 << 10), 64 << 10), [(0, target, 4096, 1, 0, 0)], token=bad)
                  for k in range(16)]
        forged += [self.want(s, x, [], token=bad), self.want(s, x, [4096], token=bad)]
        return "forged_token", [self.want(s, x, [64 << 10], token=token), LATER] + forged + [
            self.want(s, x, [], token=token)], len(forged)

    def plain_frame(self):
        r, t, s = self.r, self.t, self.session
        kind = r.randrange(16)
        victim_xfers = r.randrange(0, 256)  # small ids: collide with the victim's real transfers
        if kind == 0:
            return "garbage", MAGIC + r.randbytes(r.randrange(0, 300))
        if kind == 1:
            return "truncated", self.valid_looking()[1][: r.randrange(0, 60)]
        if kind == 2:
            f = bytearray(self.valid_looking()[1])
            f[6] = r.choice([0, 1, 3, 255])
            return "bad_version", bytes(f)
        if kind == 3:
            f = bytearray(self.valid_looking()[1])
            f[7] = r.choice([0, 5, 255])
            return "bad_kind", bytes(f)
        if kind == 4:  # the session and token bytes stay: a change there is a forgery (counted)
            f = bytearray(self.valid_looking()[1])
            for _ in range(r.randrange(1, 6)):
                i = r.randrange(len(f) - 32)
                f[i if i < 8 else i + 32] = r.randrange(256)
            return "bitflip", bytes(f)
        if kind == 5:  # absurd counts with short bodies
            return "absurd_count", r.choice([
                header(WANT, s) + struct.pack("<Q", 1) + tok(0) + b"\0" + struct.pack("<II", 0, 0xFFFF_FFFF) + b"\1" * 8,
                header(WANT, s) + struct.pack("<Q", 1) + tok(0) + b"\0" + struct.pack("<II", 0, 1 << 20) + b"\1" * 8,
                header(WANT, s) + struct.pack("<Q", 1) + tok(0) + b"\0" + struct.pack("<I", 0xFFFF_FFFF),
                header(GRANT, s) + struct.pack("<Q", 1) + tok(0) + struct.pack("<I", 1 << 16),
                header(DATA, s) + struct.pack("<Q", 1) + tok(0) + struct.pack("<IQQI", 0, 0, 1 << 16, 0xFFFF_FFFF),
                self.want(s, self.new_xfer(), [U64, U64]),
                self.want(s, self.new_xfer(), [1 << 62] * 64),
                self.want(s, self.new_xfer(), [64 << 10] * 4096),
            ])
        if kind == 6:
            return "grant_unknown", grant(s, victim_xfers, [(c, *self.guessed_region()) for c in range(r.randrange(1, 9))])
        if kind == 7:
            return "ack_unknown", ack(s, victim_xfers, r.randrange(0, 8), self.guessed_region(), r.randrange(3))
        if kind == 8:  # DATA for transfers this peer never announced, aimed at registered memory
            runs = [(0, t["reg_addr"] + r.randrange(0, t["reg_len"] - 4096), 4096, 1, 0, 0)]
            if "reg_canary" in t:
                runs.append((0, t["reg_canary"], 4096, 1, 0, 0))
            return "data_unknown_xfer", data(s, victim_xfers, r.randrange(0, 8), self.guessed_region(), runs)
        if kind == 9:  # announce, then (once granted) DATA into guessed regions, forbidden runs
            x = self.new_xfer()
            if r.random() < .5:
                # ...or DATA saying the runs lie in the region, where whatever an earlier flow
                # left (or nothing) must fail the victim's check: nothing scattered.
                return "want_then_region_plan", [self.want(s, x, [64 << 10] * r.randrange(1, 4)), LATER] + [
                    data(s, x, 0, (k * (64 << 10), 64 << 10), [], region_plan_runs=r.randrange(1, 64))
                    for k in range(64)]
            return "want_then_bad_data", [self.want(s, x, [64 << 10] * r.randrange(1, 4)), LATER] + [
                data(s, x, 0, (k * (64 << 10), 64 << 10), self.forbidden_runs()) for k in range(64)]
        if kind == 10:
            return "bad_data", data(s, self.new_xfer() if r.random() < .5 else victim_xfers,
                                    r.randrange(0, 4), self.guessed_region(), self.forbidden_runs())
        if kind == 11 and not self.endpoints:
            return "want", self.want(s, self.new_xfer(), [4096])
        if kind == 11:  # WANT with a garbage endpoint (the reverse path must not trust it)
            return "want_garbage_endpoint", self.want(s, self.new_xfer(), [4096], r.randbytes(r.randrange(1, 200)))
        if kind == 12:  # a truncated frame under another session: malformed first
            f = bytearray(self.valid_looking()[1])
            f[8:16] = struct.pack("<Q", r.getrandbits(64))
            return "replay_truncated", bytes(f[:20])
        if kind == 13:  # a WANT carrying its one chunk inline, scattered by forbidden runs
            size = r.choice([64, 4096, 16 << 10])
            return "inline_bad_runs", self.want(s, self.new_xfer(), [size], inline=(r.randbytes(size), self.forbidden_runs()))
        if kind == 14:  # a standing flow opened and claimed, then DATA into guessed regions
            # The standing flow's token follows from its id: once the flow budget is spent the
            # ids repeat, and a new token on a live flow would be a forgery (counted apart).
            sx, x = (1 << 63) | self.new_xfer(), self.new_xfer()
            st = sx ^ 0x5747
            return "standing_claim_bad_data", [
                self.want(s, sx, [64 << 10], token=st, standing="open"), LATER,
                self.want(s, x, [64 << 10], standing=("claim", sx, st)), LATER] + [
                data(s, x, 0, self.guessed_region(), self.forbidden_runs()) for _ in range(16)]
        if kind == 15 and r.random() < .5:  # a WANT through an arena the victim lacks, then DATA
            x = self.new_xfer()
            return "want_other_arena", [self.want(s, x, [64 << 10], arena=r.choice([1, 15, 16, 255])), LATER] + [
                data(s, x, 0, self.guessed_region(), self.forbidden_runs()) for _ in range(16)]
        return "cancel", self.want(s, r.choice([victim_xfers, self.new_xfer()]), [])

    def new_xfer(self):
        """A fresh transfer id, until the flow budget is spent; then the last one again (a WANT
        for it no longer opens a new flow at the victim)."""
        if self.flows < self.max_flows:
            self.flows += 1
            self.next_xfer += 1
        return self.next_xfer

    def valid_looking(self):
        s, r = self.session, self.r
        return r.choice([
            ("want", self.want(s, self.new_xfer(), [4096, 64 << 10])),
            ("grant", grant(s, r.randrange(256), [(0, 0, 64 << 10)])),
            ("data", data(s, r.randrange(256), 0, (0, 64 << 10), self.forbidden_runs())),
            ("ack", ack(s, r.randrange(256), 0, (0, 64 << 10), 0)),
        ])


def main():
    agents = {}
    loaded = {}  # agent name -> the metadata blobs it loaded
    buf = None
    earlier = []  # buffers an earlier "buffer" made, still registered

    def poll():
        for ag in agents.values():
            ag.get_new_notifs()

    def agent(cmd):
        # Every agent here may send raw frames (RAW); it changes nothing else.
        ag = nixlkit.agent(cmd["name"], cmd.get("backends", ["BOUNCE"]), {**RAW, **(cmd.get("params") or {})})
        agents[cmd["name"]] = ag
        return {"meta": base64.b64encode(ag.get_agent_metadata()).decode()}

    def buffer(cmd):
        nonlocal buf
        ag = agents[cmd["agent"]]
        if buf is not None:
            earlier.append(buf)
        buf = nixlkit.pattern(cmd["seed"], cmd["size"])
        n = cmd.get("register", cmd["size"])
        ag.register_memory(ag.get_reg_descs([(buf.ctypes.data, n, 0, "")], "DRAM"), backends=["BOUNCE"])
        # the agent's metadata now carries the registration
        return {"addr": buf.ctypes.data, "meta": base64.b64encode(ag.get_agent_metadata()).decode()}

    def register(cmd):
        ag = agents[cmd["agent"]]
        ag.register_memory(ag.get_reg_descs([(buf.ctypes.data + cmd["off"], cmd["len"], 0, "")], "DRAM"),
                           backends=["BOUNCE"])
        return {"meta": base64.b64encode(ag.get_agent_metadata()).decode()}

    def write(cmd):
        ag = agents[cmd["agent"]]
        lay = nixlkit.Scattered(cmd["n"], cmd["size"], cmd["seed"])
        lo = ag.get_xfer_descs(lay.src_list(buf.ctypes.data + cmd.get("src_off", 0)), "DRAM")
        re = ag.get_xfer_descs(lay.dst_list(cmd["raddr"]), "DRAM")
        t0 = time.perf_counter()
        err = None
        h = ag.initialize_xfer("WRITE", lo, re, cmd["to"], b"", backends=["BOUNCE"])
        try:
            state = ag.transfer(h)
            end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
            while state not in ("DONE", "ERR") and time.monotonic() < end:
                state = ag.check_xfer_state(h)
                poll()
        except Exception as e:
            state, err = "ERR", f"{type(e).__name__}: {e}"
        secs = time.perf_counter() - t0
        try:
            ag.release_xfer_handle(h)
        except Exception:
            pass
        return {"state": state, "seconds": secs, "error": err}

    def load(cmd):
        meta = base64.b64decode(cmd["meta"])
        agents[cmd["agent"]].add_remote_agent(meta)
        loaded.setdefault(cmd["agent"], []).append(meta)

    def fuzz(cmd):
        senders = [agents[n] for n in cmd["agents"]]
        # The first agent (the one the victim loaded) proves the victim's registrations whose
        # metadata it loaded, as any such peer can; the others' frames prove nothing.
        regs = [rk for meta in loaded.get(cmd["agents"][0], []) for rk in registrations_of(meta)]
        first = cmd["agents"][0]

        def prove(token, xfer):
            return [proof(reg, key, token, first, xfer) for reg, key in regs]
        # The first agent is the one the victim loaded: its frames carry its real session,
        # and it alone sends the forgeries (a victim refuses the others' frames earlier).
        fz = Fuzzer(cmd.get("seed", 0), cmd["targets"], cmd.get("endpoints", True),
                    cmd.get("max_flows", 1 << 62), session=session_of(senders[0].get_agent_metadata()),
                    sessions=cmd.get("sessions", ()))
        sent = errors = 0
        kinds, forged = {}, {}
        end = time.monotonic() + cmd["seconds"]
        later = []  # (due, sender, frames)
        i = 0
        # Over ZMQ (`zmq_to`: the victim's advertised endpoint), each sender's frames go on a
        # TCP connection of its own, under its name, as any process could write them.
        conns = {}
        if cmd.get("zmq_to"):
            import socket
            host, port = cmd["zmq_to"][len("tcp://"):].rsplit(":", 1)
            for name, sender in zip(cmd["agents"], senders):
                c = socket.create_connection((host, int(port)), timeout=5)
                conns[id(sender)] = (name, c)

        def send(sender, frames):
            nonlocal sent, errors
            for k, f in enumerate(frames):
                if f is LATER:
                    later.append((time.monotonic() + 0.02, sender, frames[k + 1:]))
                    return
                try:
                    if conns:
                        name, c = conns[id(sender)]
                        c.sendall(stream_message(name, f))
                    else:
                        sender.send_notif(cmd["to"], f)
                    sent += 1
                except Exception:
                    errors += 1

        while time.monotonic() < end:
            while later and later[0][0] <= time.monotonic():
                send(*later.pop(0)[1:])
            if cmd.get("forge") and i % 4 == 3:
                fz.prove = prove if regs else None
                kind, frames, n_forged = fz.forged_frame()
                sender = senders[0]
                forged[kind] = forged.get(kind, 0) + n_forged
            else:
                sender = senders[i % len(senders)]
                fz.prove = prove if regs and sender is senders[0] else None
                kind, frames, _ = fz.frame()
            kinds[kind] = kinds.get(kind, 0) + 1
            # every frame of one group comes from the same agent (one flow)
            send(sender, frames if isinstance(frames, list) else [frames])
            i += 1
            if i % 16 == 0:
                poll()
        while later:  # the rest of every group goes out (a forged group's real cancel)
            time.sleep(max(0.0, later[0][0] - time.monotonic()))
            send(*later.pop(0)[1:])
        for _, c in conns.values():
            c.close()
        return {"sent": sent, "send_errors": errors, "kinds": kinds, "forged": forged}

    nixlkit.serve({
        "agent": agent,
        "buffer": buffer,
        "register": register,
        "load": load,
        "dump": lambda cmd: buf.tofile(cmd["path"]),
        "write": write,
        "wait_ready": lambda cmd: nixlkit.wait_ready(agents[cmd["agent"]], cmd.get("n", 1), deadline=10),
        "params": lambda cmd: {"params": nixlkit.live_params(agents[cmd["agent"]])},
        "fuzz": fuzz,
    }, idle=poll, active=lambda: bool(agents))


if __name__ == "__main__":
    main()
