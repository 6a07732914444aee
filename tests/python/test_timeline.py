"""The transfer timeline (`NIXL_BOUNCE_LOG=bounce_timeline=trace`, read by benches/timeline.py):
two real processes bouncing KV requests leave, for every request, a submit and a completion in
the initiator, the target's handling of the initiator's first frame and the copies on both
sides' workers, in that order on one clock (and each control frame handled after it was sent,
each answer sent after its cause; one way, each answer a mailbox record put by the target and
then fetched by the initiator); and nothing of it when the target is off. The flight recorder
(`NIXL_BOUNCE_MARKS=DIR`) keeps the same steps, in memory and then in DIR, with each control
frame's encoding and hand-over to the channel after its send step, on one thread."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benches import timeline  # noqa: E402


def run_kv(tmp_path, pattern, log, marks=None):
    env = dict(os.environ, BENCH_VERBOSE="1")
    env.pop("NIXL_BOUNCE_LOG", None)
    env.pop("NIXL_BOUNCE_MARKS", None)
    if log:
        env["NIXL_BOUNCE_LOG"] = log
    if marks:
        env["NIXL_BOUNCE_MARKS"] = str(marks)
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
        check_steps(timeline.events(run_kv(tmp_path, pattern, "bounce_timeline=trace")), pattern, first_frame)


def check_steps(evs, pattern, first_frame):
    """The steps of a 3-request run of `pattern` (two processes), wherever they were read from."""
    initiator, xfers = timeline.transfers(evs)
    # 3 rounds (a warm-up, one kept, and the untimed one whose bytes are checked) x (3 requests
    # + the batch).
    assert len(xfers) == 12, (pattern, len(xfers))
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


def test_the_flight_recorder_keeps_the_steps_in_its_directory_and_logs_nothing(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    err = run_kv(tmp_path, "pull-one-way", None, marks=marks)
    assert timeline.events(err) == [], "the recorder writes no stderr line"
    files = sorted(marks.iterdir())
    assert len(files) == 2 and all(f.name.startswith("marks.") for f in files), files
    check_steps(timeline.events([str(marks)]), "pull-one-way", "recv-PULL")
    # Each file is in recording order: per thread the clock never goes back, and each control
    # frame's send step is followed on its thread by its encoding and its hand-over (a slow
    # hand-over's own mark may come between), both naming the frame's length.
    frames = 0
    for f in files:
        by_thread = {}
        for line in f.read_text().splitlines():
            m = timeline.LINE.match(line)
            assert m and m[1].startswith("@"), line
            by_thread.setdefault(m[4], []).append((int(m[1][1:]), m[2], int(m[5])))
        for thread, steps in by_thread.items():
            assert all(a[0] <= b[0] for a, b in zip(steps, steps[1:])), thread
            named = [s for s in steps if not s[1].startswith("slow-")]
            for i, (_, what, _) in enumerate(named):
                if what.startswith("send-"):
                    frames += 1
                    assert [w for _, w, _ in named[i + 1:i + 3]] == ["encoded", "sent"], (thread, named[i:i + 3])
                    assert named[i + 1][2] == named[i + 2][2] > 0, named[i:i + 3]
    assert frames >= 8, "every request sent at least its PULL"
