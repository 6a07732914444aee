"""The target side of the KV-cache tests and benchmark, in its own process: one or more NIXL
agents, each with its own paged KV cache (kvcache.KvCache), driven by JSON lines on stdin
(every reply is one JSON line with "ok"). It never loads a peer's metadata unless told to
("load"), so it can play the target of one-way metadata.

Commands:
  {"op": "start", "name": N, "backend": B, "params": {...}, "layout": {...}, "seed": S,
   "mem": "DRAM"|"VRAM", "dev": GPU}
      -> {"meta": b64, "bases": [...]}   an agent N with backend B and a cache of `seed`'s
         bytes, one registration per layer (bases: the layers' addresses); VRAM: the layers
         are tensors on GPU `dev` (kvcache.GpuKvCache)
  {"op": "load", "name": N, "meta": b64}     N adds a remote agent (two-way metadata only)
  {"op": "fill", "name": N, "seed": S}       refill N's cache with `seed`'s bytes
  {"op": "watch", "name": N, "prefix": P, "seed": S}   map the initiator's cache (its layers
      made by kvcache.shared_layers(P), holding `seed`'s bytes) read-only into this process
  {"op": "serve", "name": N, "from": A, "requests": {"count", "blocks", "seed"},
   "expect": [index | "batch", ...], "verify": "own" | "initiator" | null, "src_seed": S,
   "reuse_seed": R | null}
      polls N until the expected notifications from A arrived (b"req-<i>", b"batch"), and on
      seeing each one, before polling again:
        verify: the destination blocks of those requests (N's own cache for a push, the
          watched initiator's for a pull) must now hold their blocks from `src_seed`'s cache;
          the count of wrong bytes at that moment is reported;
        reuse_seed (pull): N then overwrites those requests' source blocks with its bytes, as
          a prefill worker reusing blocks the decode side said it has read;
      -> {"seen": [{"msg", "t", "bad"}...]}  (t: time.monotonic(), comparable across processes)
  {"op": "take", "name": N, "from": A, "n": K}   wait until K notifications from A arrived
      ("msgs": [b64, ...] instead of "n": until exactly those arrived, each once)
      (any messages; for the benchmark's re-posted requests) and forget them
  {"op": "expect", "name": N, "requests": {...}, "src_seed": S}   N's cache must now hold those
      requests' blocks from `src_seed`'s cache (a push whose notifications were taken)
  {"op": "check", "name": N}   -> {"report": CheckReport}   every byte of N's cache
  {"op": "params", "name": N}  -> {"params": {...}}         N's live backend params
  {"op": "exit"}
"""
import base64
import time

import kvcache
import nixlkit

# Between polls while waiting for notifications: a framework's loop polls between other work,
# and a spinning target would take a core from the engines under test on a 2-core machine.
POLL_GAP_S = 0.0002


class Side:
    def __init__(self, cmd):
        self.backend = cmd.get("backend", "BOUNCE")
        self.layout = kvcache.KvLayout(**cmd.get("layout", {}))
        vram = cmd.get("mem", "DRAM") == "VRAM"
        if vram:
            # As frameworks do: the GPU is current before the agent is made.
            import torch
            torch.cuda.set_device(cmd.get("dev", 0))
            torch.empty(1, device=f"cuda:{cmd.get('dev', 0)}")
        self.agent = nixlkit.agent(cmd["name"], (self.backend,), cmd.get("params"))
        self.cache = (kvcache.GpuKvCache(self.layout, cmd["seed"], cmd.get("dev", 0)) if vram
                      else kvcache.KvCache(self.layout, cmd["seed"]))
        self.cache.register(self.agent, self.backend)
        self.seen = []
        self.watched = None

    def poll(self):
        for sender, msgs in self.agent.get_new_notifs().items():
            self.seen.extend((sender, m) for m in msgs)

    def requests(self, spec):
        return kvcache.make_requests(self.layout, spec["count"], spec["blocks"], spec["seed"])

    def take(self, cmd):
        """Waits for `n` notifications from `from`, or, with `msgs` (base64), for exactly those
        (each once, in any order): a duplicated, mislabelled or empty one does not count."""
        sender = cmd["from"]
        want = [base64.b64decode(m) for m in cmd["msgs"]] if "msgs" in cmd else None
        left = len(want) if want is not None else cmd["n"]
        end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
        while left > 0:
            if time.monotonic() > end:
                what = f" ({sorted(want)} still missing)" if want is not None else ""
                raise TimeoutError(f"{left} notification(s) from {sender} never arrived{what}")
            self.poll()
            mine = []
            for x in self.seen:
                if x[0] != sender or len(mine) == left:
                    continue
                if want is None:
                    mine.append(x)
                elif x[1] in want:
                    want.remove(x[1])
                    mine.append(x)
            for x in mine:
                self.seen.remove(x)
            left -= len(mine)
            if left > 0 and not mine:
                time.sleep(POLL_GAP_S)

    def serve(self, cmd):
        reqs = self.requests(cmd["requests"])
        waiting = {}
        for e in cmd["expect"]:
            msg = b"batch" if e == "batch" else reqs[e].notif
            waiting[msg] = reqs if e == "batch" else [reqs[e]]
        sender = cmd["from"]
        end = time.monotonic() + cmd.get("timeout", nixlkit.DEADLINE_S)
        out = []
        while waiting:
            if time.monotonic() > end:
                raise TimeoutError(f"never saw {sorted(waiting)} from {sender}")
            self.poll()
            if not any(who == sender and msg in waiting for who, msg in self.seen):
                time.sleep(POLL_GAP_S)
                continue
            for (who, msg) in list(self.seen):
                if who != sender or msg not in waiting:
                    continue
                t = time.monotonic()
                self.seen.remove((who, msg))
                mine = waiting.pop(msg)
                bad = None
                if cmd.get("verify"):
                    dst = self.cache if cmd["verify"] == "own" else self.watched
                    for r in mine:
                        dst.expect_request(r, cmd["src_seed"])
                    bad = sum(dst.bad_bytes(r.dst_blocks) for r in mine)
                if cmd.get("reuse_seed") is not None:
                    for r in mine:
                        self.cache.overwrite(r.src_blocks, cmd["reuse_seed"])
                out.append({"msg": msg.decode(), "t": t, "bad": bad})
        return out


def main():
    sides = {}

    def start(cmd):
        s = Side(cmd)
        sides[cmd["name"]] = s
        return {"meta": base64.b64encode(s.agent.get_agent_metadata()).decode(), "bases": s.cache.bases}

    def watch(cmd):
        s = sides[cmd["name"]]
        s.watched = kvcache.KvCache(s.layout, cmd["seed"], attached=kvcache.attach_layers(cmd["prefix"], s.layout))

    def expect(cmd):
        s = sides[cmd["name"]]
        for r in s.requests(cmd["requests"]):
            s.cache.expect_request(r, cmd["src_seed"])

    def params(cmd):
        s = sides[cmd["name"]]
        s.poll()  # getNotifs publishes the engine's counters
        return {"params": nixlkit.live_params(s.agent, s.backend)}

    def idle():
        for s in sides.values():
            s.poll()

    nixlkit.serve({
        "start": start,
        "load": lambda cmd: sides[cmd["name"]].agent.add_remote_agent(base64.b64decode(cmd["meta"])),
        "fill": lambda cmd: sides[cmd["name"]].cache.fill(cmd["seed"]),
        "serve": lambda cmd: {"seen": sides[cmd["name"]].serve(cmd)},
        "watch": watch,
        "take": lambda cmd: sides[cmd["name"]].take(cmd),
        "expect": expect,
        "check": lambda cmd: {"report": sides[cmd["name"]].cache.check().as_dict()},
        "params": params,
    }, idle=idle, active=lambda: bool(sides))


if __name__ == "__main__":
    main()
