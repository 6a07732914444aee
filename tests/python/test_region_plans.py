"""Region plans between real NIXL agents in two processes (issue 11): a WRITE chunk's scatter
runs travel in its region, behind its data, in the fixed-width form of
`bounce_proto::wire::region_plan`; the receiver's copy engine checks them there before it
scatters. Byte-exact, with both sides' counters proving the path: the receiver got region plans
and refused none, and no PLAN frame was sent."""
import pytest

import nixlkit
from test_bounce import pair, remote_buffer, stats, write_from_here

REGION_PLANS = {"bounce_region_plan_runs": "64"}


def peer_stats(p):
    params = p.call(op="params")["params"]
    return {k[len("stats."):]: int(v) for k, v in params.items() if k.startswith("stats.")}


@pytest.mark.parametrize("n, size, arena", [(16384, 4096, None), (8192, 4096, "4MiB")])
def test_scattered_write_carries_its_plans_in_the_regions_byte_exact(peer, tmp_path, n, size, arena):
    """16384 x 4 KiB scattered in 32 MiB chunks, and 32 MiB streamed through 4 MiB arenas (1 MiB
    chunks, each holding a little less data to leave room for its plan): every destination
    byte and every byte between destinations as expected."""
    lay = nixlkit.Scattered(n, size, seed=61)
    src = nixlkit.pattern(601, lay.src_bytes)
    small = {"bounce_arena_size": arena, "bounce_max_chunk_size": "1MiB"} if arena else {}
    tx, rx = f"tx-rp-{n}", f"rx-rp-{n}"
    ag, p, raddr = pair(peer, src, tx=tx, rx=rx, rx_size=lay.dst_bytes, rx_seed=600,
                        params={**REGION_PLANS, **small}, rx_params=small or None)
    for round_ in range(2):  # the prepared plan is reused; the arena is not wiped between
        write_from_here(ag, rx, lay, src, raddr, notif=b"rp-%d" % round_)
        p.call(op="notif_wait", **{"from": tx, "msg": "rp-%d" % round_})
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(600, lay.dst_bytes)), "destination")
    mine, theirs = stats(ag), peer_stats(p)
    assert mine["bounce_ok"] == 2 and mine["passthrough_xfers"] == 0
    assert mine["region_plans_sent"] >= 2 * (2 if arena is None else 32), mine
    assert mine["plans_sent"] == 0, "no PLAN frame carries runs that travel in the region"
    assert theirs["region_plans_received"] == mine["region_plans_sent"], (mine, theirs)
    assert theirs["region_plans_failed"] == 0


def test_few_runs_per_chunk_keep_their_plans_in_control_frames(peer, tmp_path):
    """A chunk with fewer runs than bounce_region_plan_runs sends them as before: contiguous
    destinations merge into one run per chunk."""
    lay = nixlkit.Scattered(4096, 4096, seed=62)
    lay.slots = list(range(4096))  # destinations in source order: one run per chunk
    src = nixlkit.pattern(611, lay.src_bytes)
    ag, p, raddr = pair(peer, src, tx="tx-rp-few", rx="rx-rp-few", rx_size=lay.dst_bytes, rx_seed=610,
                        params=REGION_PLANS)
    write_from_here(ag, "rx-rp-few", lay, src, raddr)
    got = remote_buffer(p, tmp_path)
    nixlkit.assert_same(got, lay.expected(src, nixlkit.pattern(610, lay.dst_bytes)), "destination")
    mine, theirs = stats(ag), peer_stats(p)
    # It bounced (a fallback to UCX would send no region plan either) ...
    assert mine["bounce_ok"] == 1 and mine["passthrough_xfers"] == 0, mine
    # ... with its runs in control frames, none in a region.
    assert mine["region_plans_sent"] == 0 and theirs["region_plans_received"] == 0, (mine, theirs)
