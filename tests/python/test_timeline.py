"""The transfer timeline (`NIXL_BOUNCE_LOG=bounce_timeline=trace`, read by benches/timeline.py):
two real processes bouncing KV requests leave, for every request, a submit and a completion in
the initiator, the target's handling of the initiator's first frame and the copies on both
sides' workers, in that order on one clock (and each control frame handled after it was sent,
each answer sent after its cause; one way, each answer a mailbox record put by the target and
then fetched by the initiator); and nothing of it when the target is off."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benches import timeline  # noqa: E402


def run_kv(tmp_path, pattern, log):
    env = dict(os.environ, BENCH_VERBOSE="1")
    env.pop("NIXL_BOUNCE_LOG", None)
    if log:
        env["NIXL_BOUNCE_LOG"] = log
    err = tmp_path / f"{pattern}-{bool(log)}.log"
    with open(err, "w") as f:
        r = subprocess.run([sys.executable, "benches/kv_patterns.py", "--rounds", "1", "--only", pattern,
                            "--variants", "BOUNCE bounced", "--requests", "3"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + err.read_text()[-3000:]
    assert "byte-exact" in r.stdout, r.stdout
    return str(err)


def test_each_bounced_request_leaves_its_steps_in_order_on_one_clock(tmp_path):
    for pattern, first_frame in (("push-two-way", "recv-WANT"), ("pull-two-way", "recv-PULL"),
                                 ("pull-one-way", "recv-PULL")):
        evs = timeline.events(run_kv(tmp_path, pattern, "bounce_timeline=trace"))
        initiator, xfers = timeline.transfers(evs)
        # 2 rounds (a warm-up and one kept) x (3 requests + the batch).
        assert len(xfers) == 8, (pattern, len(xfers))
        pids = {p for _, p, _, _, _ in evs}
        assert len(pids) == 2 and initiator in pids, pids
        for t0, end, body in xfers:
            steps = [(t, p == initiator, what, thread) for t, p, what, _, thread in body]
            assert end > t0
            want = next(t for t, mine, what, _ in steps if not mine and what == first_frame)
            work = [t for t, _, what, thread in steps if what == "worker-start" and thread.startswith("bounce-copy")]
            assert t0 <= want <= end, (pattern, steps[:10])
            assert work and all(t0 <= t <= end for t in work), (pattern, steps[:10])
            assert any(mine for _, mine, what, _ in steps if what == "worker-start"), "the initiator's copies"
            assert any(not mine for _, mine, what, _ in steps if what == "worker-start"), "the target's copies"
        # The step-by-step view of the control exchange (`timeline.py --hops`): every transfer
        # sent its first frame, had it handled and completed, and each answer follows its cause.
        caused = [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7), (7, 8)]
        for row in timeline.hop_steps(initiator, xfers):
            assert row[0] and row[1] and row[8], (pattern, row)
            if pattern.endswith("one-way"):
                # the target's READY is a record in its mailbox, seen in one of our fetches
                assert row[2] and row[3], (pattern, row)
            for a, b in caused:
                if row[a] and row[b]:
                    assert row[a][0] <= row[b][0], (pattern, timeline.HOP_STEPS[a][0], timeline.HOP_STEPS[b][0], row)


def test_with_the_target_off_nothing_is_logged(tmp_path):
    assert timeline.events(run_kv(tmp_path, "push-two-way", None)) == []
