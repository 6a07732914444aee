"""What a sweep measures: the dimensions, the presets, the backend variants, and the order the
points run in (every backend at a point before the next point, starting backend rotated, so a
drift of the machine's load touches all backends alike)."""
import dataclasses
import itertools
import re

KiB = 1024
MiB = 1024 * KiB


@dataclasses.dataclass(frozen=True)
class Shape:
    """How the application drives its agent (the agent's sync mode follows from it)."""
    sync: str  # NIXL thread sync mode of both agents: none | strict | rw
    notif_thread: bool  # a second thread calls get_new_notifs while the first polls
    notif: bool  # every transfer carries a notification for the target
    doc: str


SHAPES = {
    "poll": Shape("none", False, False,
                  "one thread posts and polls check_xfer_state (benches/compare.py's shape)"),
    "mt-strict": Shape("strict", True, True,
                       "thread 1 posts and polls check_xfer_state, thread 2 calls "
                       "get_new_notifs; agents in STRICT sync mode; a notification per transfer"),
    "mt-rw": Shape("rw", True, True, "as mt-strict with agents in RW sync mode"),
}

OPS = ("WRITE", "READ")
MEMS = ("DRAM", "VRAM")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One backend configuration, run in its own pair of processes (UCX reads
    NIXL_UCX_SGL_ENABLE at engine creation, so it is per process)."""
    label: str
    backend: str  # the NIXL backend name both agents create
    params: tuple  # ((key, value), ...) backend params
    env: tuple  # ((key, value), ...) extra environment of both processes

    @property
    def is_bounce(self):
        return self.backend == "BOUNCE"


# The gate wide open: every point measures the bounce path itself, so the crossover (and from
# it the gate's defaults) can be read off the sweep. --shipped-gate measures the routing as is.
OPEN_GATE = (("bounce_min_descriptor_count", "1"), ("bounce_max_average_descriptor_size", "1GiB"))

# The environment variables of the gate (README "Configuration"). An environment variable wins
# over a backend param, so one of these inherited by the workers overrides OPEN_GATE: the points
# it excludes go to UCX and measure nothing of the bounce path (the crossover leaves them out).
GATE_ENV = ("NIXL_BOUNCE_ENABLE", "NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT", "NIXL_BOUNCE_MAX_AVERAGE_DESCRIPTOR_SIZE")


def inherited_gate_env(environ):
    """The gate's variables set in `environ` (the sweep's own environment, which every worker
    inherits), name -> value."""
    return {k: environ[k] for k in GATE_ENV if k in environ}


def gate_env_warning(inherited):
    """The loud warning for `inherited_gate_env`'s answer (lines, no trailing newline)."""
    names = " ".join(f"{k}={v}" for k, v in inherited.items())
    return (f"WARNING: inherited from the environment: {names}\n"
            "WARNING: environment variables win over backend params, so these OVERRIDE the sweep's open "
            "gate in every BOUNCE worker:\n"
            "WARNING: the points they exclude go to UCX and are left out of the crossover and the derived "
            "gate (unmeasured), which cannot reach beyond them.\n"
            f"WARNING: unset them (env -u {' -u '.join(inherited)} ...) to derive a gate, or pass "
            "--shipped-gate to measure the routing they give.")


def parse_variant(spec, ucx_threads=4, shipped_gate=False):
    """`BASE[:key=value,...]` -> Variant. BASE is BOUNCE, UCX, UCX+SGL or UCX-MT (UCX with
    num_threads=ucx_threads); the extra settings let one run A/B a setting, e.g.
    `BOUNCE:bounce_check_wait_us=0`: lower-case keys are backend params, UPPER-case keys
    environment variables of that variant's two processes (`UCX:UCX_TLS=tcp`,
    `BOUNCE:NIXL_PLUGIN_DIR=/other/build`). The label is the spec itself, or NAME given as
    `NAME=BASE[:...]`."""
    label = spec
    head = spec.partition(":")[0]
    if "=" in head:
        label, _, spec = spec.partition("=")
    base, _, rest = spec.partition(":")
    extra = []
    for kv in filter(None, rest.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ValueError(f"backend {spec!r}: expected key=value after ':', got {kv!r}")
        extra.append((k.strip(), v.strip()))
    if base == "BOUNCE":
        params, env = (() if shipped_gate else OPEN_GATE), ()
    elif base == "UCX":
        params, env = (), ()
    elif base == "UCX+SGL":
        params, env = (), (("NIXL_UCX_SGL_ENABLE", "1"),)
    elif base == "UCX-MT":
        params, env = (("num_threads", str(ucx_threads)),), ()
    else:
        raise ValueError(f"unknown backend {base!r} (BOUNCE, UCX, UCX+SGL, UCX-MT)")
    merged, merged_env = dict(params), dict(env)
    for k, v in extra:
        (merged_env if k.isupper() else merged)[k] = v
    return Variant(label, "BOUNCE" if base == "BOUNCE" else "UCX", tuple(sorted(merged.items())),
                   tuple(sorted(merged_env.items())))


@dataclasses.dataclass(frozen=True)
class Point:
    shape: str
    op: str
    mem: str
    size: int  # bytes per descriptor (nixlbench: block size)
    count: int  # descriptors per transfer (nixlbench: batch size)
    conc: int  # requests in flight

    @property
    def request_bytes(self):
        return self.size * self.count


@dataclasses.dataclass
class Budget:
    """How long one (point, backend) measurement runs: `warmup` completions (at least one per
    request in flight) are dropped, then it samples until it has `min_samples` AND `min_time`
    seconds, or `max_samples`, or `max_time` seconds once it has at least `floor` samples (so a
    slow point still gets `floor` samples; rows with fewer than `min_samples` are marked)."""
    warmup: int
    min_samples: int
    max_samples: int
    min_time: float
    max_time: float
    floor: int = 1


PRESETS = {
    # ci/demo: every backend, both shapes that matter, under two minutes on two busy cores.
    # 16384 x 4 KiB is benches/compare.py's point; 64 KiB x 16384 is over the request cap.
    "quick": dict(sizes=[4 * KiB, 64 * KiB], counts=[1024, 16384], concs=[1, 8], ops=["WRITE", "READ"],
                  mems=["DRAM"], shapes=["poll", "mt-strict"],
                  backends=["BOUNCE", "UCX", "UCX+SGL", "UCX-MT"],
                  budget=Budget(2, 5, 400, 0.05, 0.3, floor=5)),
    # Everything the issue lists. Hours on two cores: narrow it with the flags.
    "full": dict(sizes=[512 * 2 ** i for i in range(12)], counts=[16, 64, 256, 1024, 4096, 16384],
                 concs=[1, 8, 64, 128], ops=["WRITE", "READ"], mems=["DRAM", "VRAM"],
                 shapes=["poll", "mt-strict", "mt-rw"],
                 backends=["BOUNCE", "UCX", "UCX+SGL", "UCX-MT"],
                 budget=Budget(3, 30, 2000, 0.3, 2.0, floor=5)),
    # Only what the gate's crossover needs: WRITE, one request at a time, single-threaded.
    "gate": dict(sizes=[512 * 4 ** i for i in range(6)] + [1 * MiB], counts=[16, 64, 256, 1024, 4096, 16384],
                 concs=[1], ops=["WRITE"], mems=["DRAM"], shapes=["poll"], backends=["BOUNCE", "UCX"],
                 budget=Budget(2, 10, 400, 0.2, 1.0, floor=5)),
    # The tool's own test: seconds.
    "tiny": dict(sizes=[4 * KiB], counts=[256], concs=[1, 2], ops=["WRITE", "READ"], mems=["DRAM"],
                 shapes=["poll"], backends=["BOUNCE", "UCX"], budget=Budget(1, 3, 50, 0.02, 0.1, floor=3)),
}


def parse_size(text):
    """`4096`, `4K`, `4KiB`, `1M`, `1MiB` -> bytes (binary units, as the plugin's options)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m.group(2).lower()]


def points(shapes, ops, mems, sizes, counts, concs, max_request_bytes):
    """The points in run order (shape outermost: its agents' sync mode is fixed per process),
    and the ones skipped because one request would exceed `max_request_bytes`."""
    run, skipped = [], []
    for shape, mem, op, size, count, conc in itertools.product(shapes, mems, ops, sizes, counts, concs):
        p = Point(shape, op, mem, size, count, conc)
        (skipped if p.request_bytes > max_request_bytes else run).append(p)
    return run, skipped


def rotated(variants, i):
    """The variants starting at the i-th: no backend always runs first (or last) at a point."""
    k = i % len(variants)
    return variants[k:] + variants[:k]
