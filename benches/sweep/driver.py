"""Runs a sweep: one pair of worker processes (initiator, target) per backend variant and
application shape, all variants' pairs alive together so every point is measured by every
backend back to back (starting backend rotated), with a progress bar."""
import base64
import dataclasses
import json
import os
import subprocess
import sys
import time

from tqdm import tqdm

from . import plan, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACTIVE_PACE_US = 500  # the target's notification poll while a measurement runs (as peer.py)
IDLE_PACE_US = 5000  # and between measurements, so idle pairs leave the cores to the others
NOTIF_WAIT_S = 10.0  # after a measurement of a notifying shape: the longest wait for the last ones



# The sweep maps the bounce path (the gate's thresholds come from it): the same-host path,
# which BOUNCE takes between two processes of one host by default, is off unless the
# environment or a variant (`NAME=BOUNCE:NIXL_BOUNCE_CMA=1`) turns it on.
SWEEP_ENV = {"NIXL_BOUNCE_CMA": "0"}

class Worker:
    """A benches/sweep/worker.py process (stderr, NIXL's and BOUNCE's log, to `log_path`)."""

    def __init__(self, env, log_path):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "benches.sweep.worker"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env={**SWEEP_ENV, **os.environ, **env})
        self.log_path = log_path
        self.last = None

    def send(self, **cmd):
        self.last = cmd["op"]
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died (rc={self.proc.poll()}) during {self.last}; "
                               f"its log: {self.log_path}")
        r = json.loads(line)
        if not r.get("ok"):
            raise RuntimeError(f"worker {self.last} failed: {r.get('error')} (log: {self.log_path})")
        return r

    def call(self, **cmd):
        self.send(**cmd)
        return self.recv()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Pair:
    """Initiator and target agents of one backend variant in one application shape."""

    def __init__(self, variant, shape, index, mems, logdir, gpus):
        self.variant, self.shape = variant, shape
        sync = plan.SHAPES[shape].sync
        env = dict(variant.env)
        tag = f"{index:02d}-{shape}-{safe(variant.label)}"
        self.ini = Worker(env, os.path.join(logdir, f"{tag}-initiator.log"))
        self.tgt = Worker(env, os.path.join(logdir, f"{tag}-target.log"))
        self.ini_name, self.tgt_name = f"sweep-ini-{index}", f"sweep-tgt-{index}"
        common = dict(op="start", backend=variant.backend, params=dict(variant.params), sync=sync, mems=mems)
        self.ini.send(role="initiator", name=self.ini_name, gpu=gpus[0], seed=1, **common)
        self.tgt.send(role="target", name=self.tgt_name, gpu=gpus[1], seed=2, **common)

    def connect(self):
        """Second half of start-up (after every pair's processes were launched)."""
        ini, tgt = self.ini.recv(), self.tgt.recv()
        self.raddr, self.rdev = tgt["addr"], tgt["dev"]
        self.ini.call(op="load", meta=tgt["meta"])
        self.tgt.call(op="load", meta=ini["meta"])
        if self.variant.is_bounce:
            self.ini.call(op="ready", backend="BOUNCE")

    def measure(self, point, budget, src, buffer_bytes, seq, notif_sleep_us=0):
        shape = plan.SHAPES[point.shape]
        # Untimed, before: both buffers get fresh bytes of seeds of this measurement's own.
        seeds = {"initiator": 2 * seq + 11, "target": 2 * seq + 12}
        t_fill = time.monotonic()
        both(self, "fill", dict(mem=point.mem), {side: dict(seed=seed) for side, seed in seeds.items()})
        fill_s = time.monotonic() - t_fill
        before = self.tgt.call(op="pace", us=ACTIVE_PACE_US)
        try:
            res = self.ini.call(op="run", point=dataclasses.asdict(point), budget=dataclasses.asdict(budget),
                                peer=self.tgt_name, raddr=self.raddr, rdev=self.rdev, src=src,
                                notif=shape.notif, notif_thread=shape.notif_thread,
                                backend=self.variant.backend, buffer_bytes=buffer_bytes[point.mem],
                                notif_sleep_us=notif_sleep_us)
            if shape.notif:  # the last transfers' notifications may still be on their way
                self.tgt.call(op="wait_notifs", want=before["notifs"] + res["completed"], timeout_s=NOTIF_WAIT_S)
        finally:
            after = self.tgt.call(op="pace", us=IDLE_PACE_US)
        res["target_cpu"] = after["cpu"] - before["cpu"]
        res["target_notifs"] = after["notifs"] - before["notifs"]
        res["target_threads"] = {k: round(v - before["threads"].get(k, 0), 3) for k, v in after["threads"].items()
                                 if v - before["threads"].get(k, 0) > 0}
        # Untimed, after: the bytes (destination side) and the untouched source (the other).
        check = dict(mem=point.mem, point=dataclasses.asdict(point), buffer_bytes=buffer_bytes[point.mem],
                     src=src, seeds=seeds)
        t_check = time.monotonic()
        replies = both(self, "check", check, {"initiator": dict(side="initiator"), "target": dict(side="target")})
        res["fill_s"], res["check_s"] = fill_s, time.monotonic() - t_check  # the check's cost (measurements.jsonl)
        problems = [f"data ({side}): {p}" for side in ("initiator", "target") for p in replies[side]["problems"]]
        notifs = report.notif_problem(shape.notif, res["completed"], res["target_notifs"])
        res["problems"] = problems + ([notifs] if notifs else [])
        return res

    def close(self):
        self.ini.close()
        self.tgt.close()


def both(pair, op, common, per_side):
    """One command to both workers of `pair`, run by both at once; their replies by side."""
    pair.ini.send(op=op, **common, **per_side["initiator"])
    pair.tgt.send(op=op, **common, **per_side["target"])
    return {"initiator": pair.ini.recv(), "target": pair.tgt.recv()}


def safe(label):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def buffer_sizes(points, max_buffer):
    """Bytes to register per memory kind: room for every request in flight of the largest point
    up to `max_buffer` (beyond that requests share regions), never less than one request."""
    out = {}
    for p in points:
        region = p.size * p.count * 2  # worker.SPREAD
        want = max(region, min(max_buffer, region * p.conc))
        out[p.mem] = max(out.get(p.mem, 0), want)
    return out


def gpu_pair():
    """CUDA devices for initiator and target: two GPUs where there are two, else one shared."""
    try:
        import torch
        n = torch.cuda.device_count()
    except Exception:
        n = 0
    return (0, 1) if n > 1 else (0, 0)


def run(points, variants, budget, src, outdir, max_buffer, progress=True, on_row=None, notif_sleep_us=0):
    """Measures every point with every variant; returns the rows (report.row dicts). A row whose
    data or notification check failed says so in its `check` (and on stderr at once)."""
    logdir = os.path.join(outdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    buffers = buffer_sizes(points, max_buffer)
    gpus = gpu_pair() if "VRAM" in buffers else (0, 0)
    rows = []
    bar = tqdm(total=len(points) * len(variants), unit="run", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    shapes = list(dict.fromkeys(p.shape for p in points))
    index = seq = 0
    # Everything measured, samples and per-thread CPU included, one JSON object per line.
    raw = open(os.path.join(outdir, "measurements.jsonl"), "w")
    for shape in shapes:
        todo = [p for p in points if p.shape == shape]
        bar.set_description(f"{shape}: starting {len(variants)} pairs")
        pairs = {}
        try:
            for v in variants:
                pairs[v.label] = Pair(v, shape, index, buffers, logdir, gpus)
                index += 1
            for pr in pairs.values():
                pr.connect()
            for i, p in enumerate(todo):
                for v in plan.rotated(variants, i):
                    bar.set_description(f"{shape} {p.op} {p.mem} {p.count}x{report.fmt_size(p.size)} "
                                        f"x{p.conc} {v.label}")
                    res = pairs[v.label].measure(p, budget, src, buffers, seq, notif_sleep_us)
                    seq += 1
                    row = report.row(p, v, res)
                    rows.append(row)
                    if row["check"] != "ok":
                        tqdm.write(f"sweep: CHECK FAILED: {p.shape} {p.op} {p.mem} {p.count} x "
                                   f"{report.fmt_size(p.size)}, {p.conc} in flight, {v.label}: {row['check']}",
                                   file=sys.stderr)
                    raw.write(json.dumps({**row, "raw": res}) + "\n")
                    raw.flush()
                    if on_row:
                        on_row(row)
                    bar.update(1)
        finally:
            for pr in pairs.values():
                pr.close()
    bar.close()
    raw.close()
    return rows
