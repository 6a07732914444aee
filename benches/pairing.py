"""Pairing time: how long two BOUNCE agents take, from loading each other's metadata, until each
may bounce to the other (its HELLO said and the PING that asks about it answered).

    .venv/bin/python benches/pairing.py [--pairs 15]

Two agents in this process per pair: both `add_remote_agent` calls, then `get_new_notifs` on both
until `stats.peers_ready` is 1 on both. Prints the median, min and max over the pairs. Paid once
per peer load; compare builds by running it with each build's `NIXL_PLUGIN_DIR`.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import nixlkit  # noqa: E402

PARAMS = {"bounce_arena_size": "4MiB"}


def ready(ag):
    ag.get_new_notifs()  # the engine publishes its counters when called
    return int(nixlkit.live_params(ag, "BOUNCE").get("stats.peers_ready", 0)) >= 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=15)
    args = ap.parse_args()
    took = []
    for i in range(args.pairs):
        a, b = nixlkit.agent(f"pair-a{i}", params=PARAMS), nixlkit.agent(f"pair-b{i}", params=PARAMS)
        t0 = time.perf_counter()
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
        deadline = time.monotonic() + 10
        while not (ready(a) and ready(b)):
            if time.monotonic() > deadline:
                raise SystemExit(f"pair {i} never became ready")
        took.append((time.perf_counter() - t0) * 1e3)
        del a, b
    print(f"pairing (both loads to both ready), {args.pairs} pairs: median {statistics.median(took):.2f} ms, "
          f"min {min(took):.2f}, max {max(took):.2f}")


if __name__ == "__main__":
    main()
