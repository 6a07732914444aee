"""A hostile third agent against a one-way target's mailbox (issue 13, test_mailbox_trust.py),
in its own process, driven line by line over stdin/stdout (JSON) like peer.py.

The forger is a plain UCX agent. It never talks BOUNCE: everything it needs comes from the
target's published metadata. The BOUNCE connection info there is an envelope holding the
target's capabilities (among them the mailbox's offset, slots and ring, and the host
registration it lies in: address, length and the inner UCX engine's public data for it -- its
remote key) around the inner UCX engine's own conn info (its worker address).
`forged_metadata` re-frames exactly those bytes as NIXL metadata of a UCX agent under the
target's name whose one registration is the mailbox's, so the forger's own UCX engine can
RDMA-READ and RDMA-WRITE the mailbox: what any agent that loaded the target's metadata can do.

Finding the mailbox: the capabilities give its registration's address and its offset in it,
`slots` rings of `ring` 64-byte records. Which slot a transfer uses is derived from its secret
token, so the forger cannot aim: it READs the whole mailbox and goes after every slot whose
latest record (by the plain sequence-number field, at the ring position it claims) is new.

Commands (one JSON object per line; every reply is one JSON line with "ok"):
  {"op": "start", "name": N, "target_meta": b64, "seed": S}
      a UCX agent N that loads the target's arena as above and READs the mailbox once (the
      baseline: slots whose latest record is older are left alone)
      -> {"mailbox": {"addr", "offset", "slots", "ring"}, "mailbox_base", "mailbox_len"}
  {"op": "forge"}
      one round: READ the mailbox and, after the latest record of every slot that moved since
      the baseline (once per record), write one forged record where the next one goes, the
      kinds in turn: garbage; the latest record with the next sequence number and one bit
      flipped; the latest record itself (genuine, moved one position on); a genuine record of
      another slot; an older genuine record of the same slot (a replay); an ACK for the latest
      record's chunk and region with the next sequence number (every field right but the MAC,
      which needs the token)                  -> {"n": written now, "written": {kind: n}, "active_slots"}
  {"op": "check_forged"}  READ again -> {"present": n}: how many of the last round's (or
      forge_acks') records are still in place
  {"op": "harass", "seconds": T}
      forge rounds for T seconds while the target runs, going only after slots whose latest
      record stayed the same since the previous READ (the target waits, the reader polls)
      -> {"rounds", "landed": forged records still in place at the next READ, "written", "active_slots"}
  {"op": "snapshot"}   READ the mailbox: the baseline for forge_acks
  {"op": "forge_acks", "mac": "grant"|"zero"|"random"}
      one shot against a target that no longer writes (the test stopped it): for every slot
      that moved since the snapshot, fill every ring position after its latest record with
      forged records that would complete the transfer: an ACK for each chunk granted but not
      yet acknowledged, then GRANT + ACK pairs for the chunks after it, each with the right
      slot, sequence number, transfer id, chunk and a genuine GRANT's region; the MAC a
      genuine GRANT's, zero or random            -> {"written": n, "slots": n, "xfers": [...]}
  {"op": "exit"}
"""
import base64
import random
import struct
import time

import numpy as np

import nixlkit

RECORD = 64
ENVELOPE_MAGIC = b"NXBOUNCE"
GRANT, READY, ACK, FAIL = 1, 2, 3, 4


# ---------------------------------------------------------------------------------------------
# what the target published


def _u64(b, at):
    return struct.unpack_from("<Q", b, at)[0], at + 8


def _blob(b, at):
    (n,) = struct.unpack_from("<I", b, at)
    return bytes(b[at + 4:at + 4 + n]), at + 4 + n


def bounce_caps(meta):
    """The BOUNCE capabilities in an agent's metadata (proto/src/wire/envelope.rs and caps.rs):
    envelope magic, u16 version, u8 flags, u32 caps length, then the caps: u16 wire version, u8
    control, u64 session, u8 arena count, each arena (u8 memory, five u64: device, base, length,
    usable capacity, max chunk, and its key as a u32-length blob), the endpoint as a u32-length
    blob, the mailbox (u64 offset, u32 slots, u32 ring) and its registration (u64 base, u64
    length, the key as a u32-length blob), the u64 request timeout in ms; after the caps the
    inner UCX conn info as a u32-length blob. The arena fields are the first arena's."""
    at = meta.find(ENVELOPE_MAGIC)
    assert at >= 0 and meta[at + 10] & 1, "no BOUNCE capabilities in the target's metadata"
    (caps_len,) = struct.unpack_from("<I", meta, at + 11)
    c = at + 15
    fields = {}
    fields["session"], p = _u64(meta, c + 3)
    arenas = meta[p]
    p += 1
    for i in range(arenas):
        p += 1  # memory kind
        values = []
        for _ in range(5):
            v, p = _u64(meta, p)
            values.append(v)
        key, p = _blob(meta, p)
        if i == 0:
            for name, v in zip(("arena_dev", "arena_base", "arena_len", "usable", "max_chunk"), values):
                fields[name] = v
            fields["arena_key"] = key
    _, p = _blob(meta, p)  # the ZMQ endpoint
    fields["mailbox_offset"], p = _u64(meta, p)
    fields["slots"], fields["ring"] = struct.unpack_from("<II", meta, p)
    fields["mailbox_base"], p = _u64(meta, p + 8)
    fields["mailbox_len"], p = _u64(meta, p)
    fields["mailbox_key"], p = _blob(meta, p)
    fields["request_timeout_ms"], p = _u64(meta, p)
    assert p == c + caps_len, "capability blob of an unexpected length"
    fields["inner"], _ = _blob(meta, c + caps_len)
    return fields


def _str(tag, value):
    """One field of NIXL's metadata serialization: the tag, a u64 length, the bytes."""
    return tag + struct.pack("<Q", len(value)) + value


def agent_name(meta):
    tag = b"nixlSerDes|Agent"
    assert meta.startswith(tag)
    (n,) = struct.unpack_from("<Q", meta, len(tag))
    return meta[len(tag) + 8:len(tag) + 8 + n].decode()


def forged_metadata(meta):
    """NIXL metadata of a UCX agent under the target's name: the inner UCX conn info, and one
    DRAM registration, the target's mailbox registration, whose public data is its key."""
    c = bounce_caps(meta)
    name = agent_name(meta).encode()
    desc = struct.pack("<QQQ", c["mailbox_base"], c["mailbox_len"], 0) + c["mailbox_key"]
    return (b"nixlSerDes" + _str(b"|Agent", name)
            + _str(b"|Conns", struct.pack("<Q", 1)) + _str(b"|t", b"UCX") + _str(b"|c", c["inner"])
            + _str(b"|", b"MemSection") + _str(b"|nixlSecElms", struct.pack("<Q", 1))
            + _str(b"|bknd", b"UCX") + _str(b"|nixlDList", b"nixlSDList")
            + _str(b"|t", struct.pack("<I", 0)) + _str(b"|n", struct.pack("<Q", 1)) + _str(b"|", desc)
            + b"|"), c


# ---------------------------------------------------------------------------------------------
# records, as far as a party without the token can read them


def fields(rec):
    """The plain fields of a record (proto/src/mailbox/record.rs): anyone can read them; only
    the MAC needs the token."""
    rec = bytes(rec)
    return {"version": rec[0], "kind": rec[1], "slot": struct.unpack_from("<I", rec, 4)[0],
            "seq": struct.unpack_from("<Q", rec, 8)[0], "xfer": struct.unpack_from("<Q", rec, 16)[0],
            "chunk": struct.unpack_from("<I", rec, 24)[0], "region": struct.unpack_from("<QQ", rec, 32)}


def record(kind, slot, seq, xfer, chunk, region, mac):
    body = struct.pack("<BBBBIQQII", 1, kind, 0, 0, slot, seq, xfer, chunk, 0) + struct.pack("<QQ", *region)
    return body + mac


class Forger:
    def __init__(self, cmd):
        meta = base64.b64decode(cmd["target_meta"])
        forged, self.caps = forged_metadata(meta)
        self.target = agent_name(meta)
        self.ring, self.slots = self.caps["ring"], self.caps["slots"]
        self.ring_bytes = self.ring * RECORD
        self.mb_len = self.slots * self.ring_bytes
        self.mb_addr = self.caps["mailbox_base"] + self.caps["mailbox_offset"]
        self.ag = nixlkit.agent(cmd["name"], ("UCX",))
        # the image of the mailbox READs land in, then room for what we write
        self.image = np.zeros(self.mb_len, dtype=np.uint8)
        self.out = np.zeros(self.mb_len, dtype=np.uint8)
        for buf in (self.image, self.out):
            nixlkit.register(self.ag, buf, "UCX")
        self.ag.add_remote_agent(forged)
        self.local = self.ag.get_xfer_descs([(self.image.ctypes.data, self.mb_len, 0)], "DRAM")
        self.remote = self.ag.get_xfer_descs([(self.mb_addr, self.mb_len, 0)], "DRAM")
        self.read_h = self.ag.initialize_xfer("READ", self.local, self.remote, self.target, b"", backends=["UCX"])
        self.last = None
        self.mine = {}  # mailbox offset -> the record we last wrote there
        self.history = {}  # slot -> {seq: record bytes}: every genuine-looking record seen
        self.forged = []   # (offset, bytes) of the last forge_acks or forge
        self.rnd = random.Random(cmd.get("seed", 0))
        self.turn = 0
        self.written = {k: 0 for k in self.KINDS}
        self.hit = {}  # slot -> the sequence number we last forged after
        self.active = set()
        # The first transfer wires the connection up, which needs the target to answer: do it
        # now, while it runs (the test stops it later and expects our READs to go on). What the
        # mailbox holds now is the baseline: slots whose latest record is older are left alone.
        self.start_top = self.prev_top = self.tops(self.read())

    def run(self, h, deadline_s=5.0):
        end = time.monotonic() + deadline_s
        state = self.ag.transfer(h)
        while state not in ("DONE", "ERR"):
            if time.monotonic() > end:
                raise RuntimeError(f"a UCX transfer into the target's arena still {state} after {deadline_s}s")
            state = self.ag.check_xfer_state(h)
        if state == "ERR":
            raise RuntimeError("a UCX transfer into the target's arena failed")

    def read(self):
        self.run(self.read_h)
        return self.image.copy()

    def write(self, items):
        """items: (mailbox offset, 64 bytes). One WRITE of one descriptor per record."""
        if not items:
            return
        lo, re = [], []
        for k, (off, rec) in enumerate(items):
            self.out[k * RECORD:(k + 1) * RECORD] = np.frombuffer(rec, dtype=np.uint8)
            lo.append((self.out.ctypes.data + k * RECORD, RECORD, 0))
            re.append((self.mb_addr + off, RECORD, 0))
        h = self.ag.initialize_xfer("WRITE", self.ag.get_xfer_descs(lo, "DRAM"), self.ag.get_xfer_descs(re, "DRAM"),
                                    self.target, b"", backends=["UCX"])
        self.run(h)
        self.ag.release_xfer_handle(h)

    def tops(self, img):
        """Per slot, the highest sequence number among records that sit where they claim to (their
        slot field and ring position agree) and that we did not write: the target's latest
        record as far as a party without the token can tell (0: none).

        A slot reused by a new transfer numbers its records from 1 again, over the old one's
        last lap: until the new transfer has overwritten the whole ring, the highest number is
        the old transfer's, and the position after it may hold a record of the new one that
        the reader has not taken yet (often its first, which the reader needs to find the
        slot at all). A forgery there would destroy a genuine record, a delay attack the
        frozen rounds must not make by mistake. So a slot counts (nonzero) only while every
        record placed in it names one transfer."""
        recs = img.reshape(self.slots, self.ring, RECORD)
        seq = recs[:, :, 8:16].copy().view("<u8")[:, :, 0]
        xfer = recs[:, :, 16:24].copy().view("<u8")[:, :, 0]
        slot = recs[:, :, 4:8].copy().view("<u4")[:, :, 0]
        pos = np.arange(self.ring, dtype=np.uint64)[None, :]
        placed = (recs.any(axis=2) & (slot == np.arange(self.slots, dtype=np.uint32)[:, None])
                  & (seq >= 1) & ((seq - 1) % np.uint64(self.ring) == pos)) & ~self.ours(recs)
        top = np.where(placed, seq, 0).max(axis=1)
        newest = xfer[np.arange(self.slots), np.where(placed, seq, 0).argmax(axis=1)]
        one_transfer = ~(placed & (xfer != newest[:, None])).any(axis=1)
        return np.where(one_transfer, top, 0)

    def ours(self, recs):
        """True where a position holds exactly what we wrote there ourselves."""
        mask = np.zeros(recs.shape[:2], dtype=bool)
        for off, rec in self.mine.items():
            s, p = divmod(off // RECORD, self.ring)
            mask[s, p] = bytes(recs[s, p]) == rec
        return mask

    def record_at(self, img, slot, seq):
        o = slot * self.ring_bytes + ((seq - 1) % self.ring) * RECORD
        return bytes(img[o:o + RECORD])

    # -----------------------------------------------------------------------------------------

    KINDS = ("garbage", "flipped", "moved", "other_slot", "replay", "forged_ack")

    def forge_round(self, quiet_only):
        """READ the mailbox; for every slot whose latest record is new since we began (and, with
        `quiet_only`, the same as at our previous READ: the target is waiting, so the reader
        polls the next position right now) and that we have not hit at this record yet, write
        one forged record where the next one goes. Returns [(offset, bytes)] written."""
        img = self.read()
        top = self.tops(img)
        for slot in np.flatnonzero(top != self.prev_top):
            slot, seq = int(slot), int(top[slot])
            if seq:
                self.history.setdefault(slot, {})[seq] = self.record_at(img, slot, seq)
        due = (top != self.start_top) & (top != 0)
        if quiet_only:
            due &= top == self.prev_top
        self.prev_top = top
        out = []
        for slot in np.flatnonzero(due):
            slot, seq = int(slot), int(top[slot])
            if self.hit.get(slot) == seq:
                continue
            self.hit[slot] = seq
            rec = self.record_at(img, slot, seq)
            self.history.setdefault(slot, {})[seq] = rec
            kind = self.KINDS[self.turn % len(self.KINDS)]
            self.turn += 1
            forged = self.forge(kind, slot, seq, rec)
            off = slot * self.ring_bytes + (seq % self.ring) * RECORD  # where seq + 1 goes
            self.written[kind] += 1
            self.mine[off] = forged
            out.append((off, forged))
        self.write(out)
        self.active.update(self.hit)
        return img, out

    def forge(self, kind, slot, seq, rec):
        """A record of `kind` for the position after `rec` (record `seq` of `slot`)."""
        rnd = self.rnd
        if kind == "garbage":
            return bytes([1]) + rnd.randbytes(RECORD - 1)
        if kind == "flipped":  # the next sequence number on the latest record, one bit off
            b = bytearray(rec)
            b[8:16] = struct.pack("<Q", seq + 1)
            i = rnd.randrange(RECORD)
            b[i] ^= 1 << rnd.randrange(8)
            return bytes(b)
        if kind == "moved":  # genuine, but at the position of the next one
            return rec
        if kind == "other_slot":  # a genuine record of another slot (another transfer)
            others = [s for s in self.history if s != slot]
            return rnd.choice(list(self.history[rnd.choice(others)].values())) if others else rec
        if kind == "replay":  # an old genuine record of this slot (an earlier lap or transfer)
            old = [r for s, r in self.history[slot].items() if s < seq]
            return rnd.choice(old) if old else rec
        f = fields(rec)  # an ACK for the latest record's chunk, with the next sequence number
        return record(ACK, slot, seq + 1, f["xfer"], f["chunk"], f["region"], rec[48:])

    def harass(self, seconds):
        """Free-running forge rounds (quiet slots only) for `seconds`: the target keeps running,
        so a forgery may land just after the target wrote the record it replaces."""
        landed = rounds = 0
        pending = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            img, out = self.forge_round(quiet_only=True)
            rounds += 1
            landed += sum(1 for off, rec in pending if bytes(img[off:off + RECORD]) == rec)
            pending = out
        return {"rounds": rounds, "landed": landed, **self.report()}

    def report(self):
        return {"written": dict(self.written), "active_slots": len(self.active)}

    def forge_acks(self, mac):
        rnd = random.Random(7)
        img = self.read()
        top, before = self.tops(img), self.tops(self.last)
        xfers, items = set(), []
        for slot in np.flatnonzero(top != before):
            slot, seq = int(slot), int(top[slot])
            if seq == 0:
                continue
            xfer = fields(self.record_at(img, slot, seq))["xfer"]
            xfers.add(xfer)
            # the transfer's records still in the ring (the last lap)
            recs = [fields(r) | {"mac": r[48:]} for r in (self.record_at(img, slot, q)
                                                          for q in range(max(1, seq - self.ring + 1), seq + 1))]
            recs = [r for r in recs if r["xfer"] == xfer]
            grants = [r for r in recs if r["kind"] == GRANT]
            acked = {r["chunk"] for r in recs if r["kind"] == ACK}
            todo = [(ACK, g["chunk"], g["region"], g["mac"]) for g in grants if g["chunk"] not in acked]
            template = grants[-1] if grants else recs[-1]
            chunk = max((r["chunk"] for r in recs), default=0)
            # Every position but the latest record's: the target stopped, so the reader has
            # consumed all it wrote, and nothing genuine is left to overwrite but that one.
            while len(todo) < self.ring - 1:
                chunk += 1
                todo += [(GRANT, chunk, template["region"], template["mac"]),
                         (ACK, chunk, template["region"], template["mac"])]
            for n, (kind, c, region, gmac) in enumerate(todo[:self.ring - 1]):
                m = gmac if mac == "grant" else bytes(16) if mac == "zero" else rnd.randbytes(16)
                off = slot * self.ring_bytes + ((seq + n) % self.ring) * RECORD
                items.append((off, record(kind, slot, seq + 1 + n, xfer, c, region, m)))
        self.write(items)
        self.forged = items
        self.mine.update(items)
        return {"written": len(items), "slots": len({o // self.ring_bytes for o, _ in items}), "xfers": sorted(xfers)}

    def check_forged(self):
        img = self.read()
        return sum(1 for off, rec in self.forged if bytes(img[off:off + RECORD]) == rec)


def main():
    fg = None

    def start(cmd):
        nonlocal fg
        fg = Forger(cmd)
        return {"mailbox": {"addr": fg.mb_addr, "offset": fg.caps["mailbox_offset"], "slots": fg.slots,
                            "ring": fg.ring}, "mailbox_base": fg.caps["mailbox_base"],
                "mailbox_len": fg.caps["mailbox_len"]}

    def snapshot(_cmd):
        fg.last = fg.read()
        fg.start_top = fg.prev_top = fg.tops(fg.last)

    def forge(_cmd):
        fg.forged = fg.forge_round(quiet_only=False)[1]
        return {"n": len(fg.forged), **fg.report()}

    nixlkit.serve({
        "start": start,
        "snapshot": snapshot,
        "harass": lambda cmd: fg.harass(cmd["seconds"]),
        "forge": forge,
        "forge_acks": lambda cmd: fg.forge_acks(cmd.get("mac", "grant")),
        "check_forged": lambda _cmd: {"present": fg.check_forged()},
    }, idle=lambda: fg.ag.get_new_notifs(), active=lambda: fg is not None)


if __name__ == "__main__":
    main()
