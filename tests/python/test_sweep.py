"""The sweep tool (benches/sweep) itself: a tiny real sweep (two processes per backend, real NIXL
and BOUNCE) must run, write exactly the rows its dimensions ask for, divide by UCX's medians as
it prints them, report the path BOUNCE's counters saw, check every row's bytes and
notifications (and fail a broken one), warn about inherited gate variables, and draw its plots.
Plus the pure parts (gate derivation, crossover, data check, backend specs) on synthetic input."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benches.sweep import plan, plots, report, worker  # noqa: E402


def sweep(out, *args, env=None):
    """Runs `python -m benches.sweep --preset tiny ARGS` into `out`: (process, CSV rows)."""
    r = subprocess.run([sys.executable, "-m", "benches.sweep", "--preset", "tiny", "--out", str(out),
                        "--no-progress", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env)
    rows = []
    if os.path.exists(os.path.join(out, "sweep.csv")):
        with open(os.path.join(out, "sweep.csv")) as f:
            rows = list(csv.DictReader(f))
    return r, rows


def clean_env(**extra):
    """This environment without the gate's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in plan.GATE_ENV}
    env.update(extra)
    return env


def table_rows(stdout):
    """The printed table's rows by section: dicts of their cells."""
    sections, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = sections.setdefault(line, [])
        elif line.startswith("Sweep on"):  # the summary follows the table
            current = None
        elif current is not None and line.strip() and line.split()[0].isdigit():
            cells = line.split()
            assert len(cells) == len(report.HEADER), line
            current.append(dict(size=cells[0], count=cells[1], conc=cells[2], backend=cells[3],
                                p50=float(cells[5]), p99=cells[6], n=cells[7], ratio=float(cells[9]),
                                path=cells[10], check=cells[11]))
    return sections


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    r, rows = sweep(out, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    return out, r.stdout, rows


def test_csv_has_exactly_the_swept_rows(tiny):
    _, _, rows = tiny
    p = plan.PRESETS["tiny"]
    want = {(shape, op, "DRAM", str(size), str(count), str(conc), backend)
            for shape in p["shapes"] for op in p["ops"] for size in p["sizes"] for count in p["counts"]
            for conc in p["concs"] for backend in p["backends"]}
    got = [(r["shape"], r["op"], r["mem"], r["block_size"], r["batch_size"], r["concurrency"], r["backend"])
           for r in rows]
    assert len(got) == len(set(got)) == len(want)
    assert set(got) == want
    budget = p["budget"]
    for r in rows:
        assert int(r["samples"]) >= budget.min_samples, r
        assert 0 < float(r["min_us"]) <= float(r["p50_us"]) <= float(r["p99_us"]) <= float(r["max_us"]), r
        assert float(r["gbps"]) > 0, r


def test_ratio_column_is_p50_over_ucx_p50(tiny):
    _, _, rows = tiny
    ucx = {tuple(r[k] for k in report.POINT_KEYS): float(r["p50_us"]) for r in rows if r["backend"] == "UCX"}
    for r in rows:
        want = float(r["p50_us"]) / ucx[tuple(r[k] for k in report.POINT_KEYS)]
        assert float(r["ratio_p50_vs_ucx"]) == pytest.approx(want, abs=0.0015), r
    assert {float(r["ratio_p50_vs_ucx"]) for r in rows if r["backend"] == "UCX"} == {1.0}


def test_printed_table_ratios_match_printed_medians(tiny):
    """The ratio a reader sees divides the two p50 columns the reader sees; beside P99 the row's
    sample count, and under 100 samples the P99 cell says it is the slowest sample (max:X)."""
    _, stdout, rows = tiny
    sections = table_rows(stdout)
    assert len(sections) == 2  # WRITE and READ
    csv_rows = {(r["op"], r["block_size"], r["batch_size"], r["concurrency"], r["backend"]): r for r in rows}
    seen = 0
    for head, lines in sections.items():
        op = head.split()[1]
        ucx = {(x["size"], x["count"], x["conc"]): x["p50"] for x in lines if x["backend"] == "UCX"}
        for x in lines:
            assert x["ratio"] == pytest.approx(x["p50"] / ucx[(x["size"], x["count"], x["conc"])], rel=0.005, abs=0.002)
            r = csv_rows[(op, x["size"], x["count"], x["conc"], x["backend"])]
            assert x["n"] == r["samples"], (x, r)
            if int(r["samples"]) < report.P99_MIN_SAMPLES:
                assert x["p99"] == f"max:{float(r['max_us']):.1f}", (x, r)
            else:
                assert x["p99"] == f"{float(r['p99_us']):.1f}", (x, r)
            assert x["check"] == "ok"
            seen += 1
    assert seen == 8
    if any(x["p99"].startswith("max:") for lines in sections.values() for x in lines):
        assert "X is the slowest of the row's samples (the max of n)" in stdout


def test_every_row_passed_its_data_check(tiny):
    """Both buffers were filled with seed-distinct bytes before each measurement and checked
    after it: every row of a working sweep passes, having completed at least its samples."""
    _, _, rows = tiny
    for r in rows:
        assert r["check"] == "ok", r
        assert int(r["completed"]) >= int(r["samples"]), r
        assert int(r["target_notifs"]) == 0, r  # the poll shape carries no notification


def test_path_column_comes_from_the_counters(tiny):
    """The tiny sweep opens the gate, so BOUNCE's WRITEs and READs (host memory) bounce; UCX
    rows are plain UCX."""
    _, _, rows = tiny
    assert {r["op"] for r in rows if r["backend"] != "UCX"} == {"WRITE", "READ"}, "both operations swept"
    for r in rows:
        if r["backend"] == "UCX":
            assert r["path"] == "ucx", r
        else:
            assert r["path"] == "bounce", r
            assert r["check"] == "ok", r
            assert int(r["bounce_xfers"]) >= int(r["samples"]), r


def test_plots_and_summary_are_written(tiny):
    out, stdout, _ = tiny
    for name in ("latency_vs_size_DRAM_poll.png", "p99_vs_concurrency_DRAM_poll.png", "crossover_DRAM.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert str(out / name) in stdout
    summary = (out / "summary.txt").read_text()
    assert "Gate" in summary and "--preset gate" in summary
    assert (out / "table.txt").read_text().strip() in stdout


def test_shipped_gate_fallback_is_reported(tmp_path):
    """With the gate as shipped (at least 256 descriptors), a 64-descriptor WRITE goes to UCX
    and the path column names the gate's reason."""
    r, rows = sweep(tmp_path, "--shipped-gate", "--counts", "64", "--ops", "WRITE", "--concurrency", "1",
                    env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert {row["backend"]: row["path"] for row in rows} == {"BOUNCE": "ucx:count", "UCX": "ucx"}
    assert all(row["check"] == "ok" for row in rows), rows


def test_gate_is_the_widest_all_winning_rectangle():
    K = 1024
    # bounce wins from 256 descriptors up to 16 KiB, and at 64 KiB only from 4096
    wins = {(s, c): (c >= 256 and s <= 16 * K) or (c >= 4096 and s <= 64 * K)
            for s in (K, 4 * K, 16 * K, 64 * K, 256 * K) for c in (16, 256, 4096)}
    assert report.derive_gate(wins) == (256, 16 * K)
    assert report.derive_gate({k: False for k in wins}) is None
    assert report.derive_gate({k: True for k in wins}) == (16, 256 * K)
    # large sizes measured only at small counts (the rest over the request cap): the gate must
    # not extend to them on the strength of the small sizes' wins at large counts
    skipped = {(s, c): c >= 4096 for s in (K, 4 * K, 64 * K) for c in (16, 256, 4096) if not (s == 64 * K and c == 4096)}
    assert report.derive_gate(skipped) == (4096, 4 * K)


def test_backend_specs():
    v = plan.parse_variant("BOUNCE:bounce_check_wait_us=0")
    assert v.backend == "BOUNCE" and dict(v.params)["bounce_check_wait_us"] == "0"
    assert dict(v.params)["bounce_min_descriptor_count"] == "1"  # gate open unless shipped
    assert plan.parse_variant("BOUNCE", shipped_gate=True).params == ()
    assert dict(plan.parse_variant("UCX+SGL").env) == {"NIXL_UCX_SGL_ENABLE": "1"}
    assert dict(plan.parse_variant("UCX-MT", ucx_threads=3).params) == {"num_threads": "3"}
    v = plan.parse_variant("UCX+SGL:UCX_TLS=tcp,num_workers=2")
    assert dict(v.env) == {"NIXL_UCX_SGL_ENABLE": "1", "UCX_TLS": "tcp"}
    assert dict(v.params) == {"num_workers": "2"}
    v = plan.parse_variant("nowait=BOUNCE:bounce_check_wait_us=0")
    assert v.label == "nowait" and v.backend == "BOUNCE" and dict(v.params)["bounce_check_wait_us"] == "0"
    with pytest.raises(ValueError):
        plan.parse_variant("TCP")
    with pytest.raises(ValueError):
        plan.parse_variant("UCX:novalue")


def synthetic(backend, count, ratio, path="bounce", check="ok", size=4096, conc=1, samples=50):
    return dict(shape="poll", op="WRITE", mem="DRAM", block_size=size, batch_size=count, concurrency=conc,
                backend=backend, samples=samples, avg_us=100.0 * ratio, p50_us=100.0 * ratio,
                p99_us=150.0 * ratio, min_us=90.0 * ratio, max_us=160.0 * ratio, gbps=1.0,
                ratio_p50_vs_ucx=ratio, path=path, check=check)


def test_crossover_leaves_out_rows_off_the_bounce_path():
    """A BOUNCE row whose transfers went to UCX (an inherited gate variable), took a mix of
    paths or failed its check measures nothing of the bounce path: it is no BOUNCE loss, and
    the crossover, the derived gate and the map leave it out (and the summary says so)."""
    rows = []
    for count, ratio, path, check in ((16, 1.0, "ucx:count", "ok"), (64, 1.01, "mixed:bounce+ucx:count", "ok"),
                                      (256, 0.5, "bounce", "ok"), (1024, 0.4, "bounce", "ok"),
                                      (4096, 0.3, "bounce", "FAIL: data (target): ...")):
        rows += [synthetic("BOUNCE", count, ratio, path, check), synthetic("UCX", count, 1.0, "ucx")]
    # a point whose UCX reference failed its check is no evidence either
    rows += [synthetic("BOUNCE", 16384, 0.2), synthetic("UCX", 16384, 1.0, "ucx", "FAIL: data (target): ...")]
    ratios, conc = report.crossover(rows, "poll", "DRAM")
    assert conc == 1
    assert ratios == {(4096, 256): 0.5, (4096, 1024): 0.4}
    assert report.left_out(rows, "poll", "DRAM") == {
        (4096, 16): "ucx:count", (4096, 64): "mixed:bounce+ucx:count", (4096, 4096): "check failed",
        (4096, 16384): "check failed"}
    # counting the UCX-vs-UCX points as losses would have closed the gate at 256 just the same;
    # here the left-out ones cannot extend it below 256 either, and the summary names them
    assert report.derive_gate({k: v < 0.9 for k, v in ratios.items()}) == (256, 4096)
    text = report.summary(rows, dict(machine="m", elapsed=1.0, outdir="o"), 0.9)
    assert "bounce_min_descriptor_count=256" in text
    assert "Left out, unmeasured" in text and "16 x 4KiB (ucx:count)" in text and "4096 x 4KiB (check failed)" in text
    assert "CHECK FAILED in 2 of 12 rows" in text


def test_crossover_of_only_non_bounce_rows_derives_nothing():
    rows = [synthetic("BOUNCE", 256, 0.99, "ucx:count"), synthetic("UCX", 256, 1.0, "ucx"),
            synthetic("BOUNCE", 1024, 0.5, "ucx:count"), synthetic("UCX", 1024, 1.0, "ucx")]
    assert report.crossover(rows, "poll", "DRAM")[0] == {}
    text = report.summary(rows, dict(machine="m", elapsed=1.0, outdir="o"), 0.9)
    assert "bounce_min_descriptor_count" not in text
    assert "none the bounce path" in text


def test_inherited_gate_variables_are_found():
    env = {"NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT": "512", "NIXL_BOUNCE_CMA": "0", "NIXL_BOUNCE_ENABLE": "false",
           "PATH": "/bin"}
    found = plan.inherited_gate_env(env)
    assert found == {"NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT": "512", "NIXL_BOUNCE_ENABLE": "false"}
    text = plan.gate_env_warning(found)
    assert "NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT=512" in text and "NIXL_BOUNCE_ENABLE=false" in text
    assert "OVERRIDE the sweep's open gate" in text
    assert plan.inherited_gate_env({"NIXL_BOUNCE_CMA": "1"}) == {}


def test_inherited_gate_variable_warns_and_its_points_are_left_out(tmp_path):
    """The review's case: with NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT=512 exported, the sweep warns
    (naming it) before and after, the 256-descriptor BOUNCE row is `ucx:count`, and it is left
    out of the gate instead of counted as a loss."""
    r, rows = sweep(tmp_path, "--counts", "256,1024", "--ops", "WRITE", "--concurrency", "1",
                    env=clean_env(NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT="512"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: inherited from the environment: NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT=512" in r.stderr
    assert "OVERRIDE the sweep's open gate" in r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT=512" in summary and "OVERRIDE" in summary
    paths = {(row["backend"], row["batch_size"]): row["path"] for row in rows}
    assert paths[("BOUNCE", "256")] == "ucx:count" and paths[("BOUNCE", "1024")] == "bounce", paths
    assert "Left out, unmeasured (not the bounce path, or a failed check): 256 x 4KiB (ucx:count)" in summary


def emulate(requests, size, region, src_seed, dst_seed, nbytes):
    """Two buffers filled as the workers fill them, and the destination after the requests'
    copies (in order: where requests share a region, the last one wins)."""
    src, dst = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    worker.fill_pattern(src, src_seed)
    worker.fill_pattern(dst, dst_seed)
    for off, d, s in requests:
        dst[off:off + region].reshape(-1, size)[d] = src[off:off + region].reshape(-1, size)[s]
    return src, dst


@pytest.mark.parametrize("conc,nbytes", [(2, 1 << 20), (3, 256 << 10)], ids=["own-regions", "shared-regions"])
def test_data_check_catches_a_broken_destination(conc, nbytes):
    point = dict(size=1024, count=64, conc=conc, op="WRITE", mem="DRAM")
    region, slots = worker.request_slots(point, nbytes, "scattered")
    reqs = [(off, tgt, ini) for off, ini, tgt in slots]  # WRITE: target slots from initiator slots
    src, good = emulate(reqs, 1024, region, 21, 22, nbytes)
    assert worker.check_destination(good, 1024, region, reqs, 22, 21) == []
    assert worker.check_source(src, 21) == []
    off, d, s = reqs[-1]
    at = off + int(d[0]) * 1024

    def broken(change):
        dst = good.copy()
        change(dst)
        return worker.check_destination(dst, 1024, region, reqs, 22, 21)

    def flip(i):
        return lambda b: b.__setitem__(i, b[i] ^ 0x5A)

    # a corrupted byte in a destination
    assert any("do not hold their source's bytes" in p for p in broken(flip(at + 100)))
    # a destination never written (it still holds the destination's own bytes)
    assert any("do not hold their source's bytes" in p
               for p in broken(lambda b: worker.fill_pattern(b[at:at + 1024], 22, at)))
    # a destination written from the wrong source slot
    wrong = off + int(s[1]) * 1024
    assert any("do not hold their source's bytes" in p
               for p in broken(lambda b: b.__setitem__(slice(at, at + 1024), src[wrong:wrong + 1024])))
    # a stale copy: the right slot, but bytes of an earlier measurement's source seed
    assert any("do not hold their source's bytes" in p
               for p in broken(lambda b: worker.fill_pattern(b[at:at + 1024], 19, off + int(s[0]) * 1024)))
    # a byte outside every destination, inside a region
    untouched = sorted(set(range(2 * 64)) - {int(x) for o, dd, _ in reqs if o == 0 for x in dd})[0]
    assert any("outside the destinations" in p for p in broken(flip(untouched * 1024 + 3)))
    # a byte past the regions
    past = max(o for o, _, _ in reqs) + region
    if past < nbytes:
        assert any("past the requests' regions" in p for p in broken(flip(nbytes - 1)))
    # the source side: any change to it
    src[5] ^= 1
    assert worker.check_source(src, 21) != []


def test_patterns_differ_by_seed_and_by_slot():
    """Seed-distinct fills, and no two slots of a region alike (a misplaced slot cannot pass)."""
    a, b = np.empty(1 << 20, np.uint8), np.empty(1 << 20, np.uint8)
    worker.fill_pattern(a, 1)
    worker.fill_pattern(b, 2)
    assert (a != b).mean() > 0.99
    rows = a.reshape(-1, 4096)
    assert len({bytes(r[:64]) for r in rows}) == len(rows)
    # a pattern read from an offset equals the same pattern's bytes there
    part = np.empty(5000, np.uint8)
    worker.fill_pattern(part, 1, 123456)
    assert np.array_equal(part, a[123456:128456])
    assert worker.first_difference(a[123456:128456], 1, 123456) is None


def test_notification_shortfall_fails_the_row():
    assert report.notif_problem(False, 10, 0) is None
    assert report.notif_problem(True, 10, 10) is None
    assert "2 missing" in report.notif_problem(True, 10, 8)
    assert "1 extra" in report.notif_problem(True, 10, 11)
    res = dict(lat=[0.001, 0.002], bytes=1, loop_wall=1.0, stats_before={}, stats_after={}, cpu=0.1,
               target_cpu=0.1, target_notifs=8, notif_calls=0, completed=10,
               problems=[report.notif_problem(True, 10, 8)])
    row = report.row(plan.Point("mt-strict", "WRITE", "DRAM", 4096, 16, 1), plan.parse_variant("UCX"), res)
    assert row["check"].startswith("FAIL: notifications") and "2 missing" in row["check"]


def test_corrupted_destination_fails_the_sweep(tmp_path):
    """End to end: a BOUNCE variant whose destination gets a byte flipped after its transfers
    (the worker's test hook) fails every one of its rows, the table and summary say so, they
    are left out of the gate, and the sweep exits 1; the healthy UCX rows pass."""
    r, rows = sweep(tmp_path, "--ops", "WRITE,READ", "--concurrency", "1", "--backends",
                    "BOUNCE=BOUNCE:BENCH_SWEEP_TEST_CORRUPT=1", "UCX", env=clean_env())
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED: 2 of 4 rows failed their data or notification check" in r.stderr
    assert "CHECK FAILED: poll WRITE DRAM 256 x 4KiB, 1 in flight, BOUNCE: FAIL: data (target)" in r.stderr
    assert "CHECK FAILED: poll READ DRAM 256 x 4KiB, 1 in flight, BOUNCE: FAIL: data (initiator)" in r.stderr
    for row in rows:
        if row["backend"] == "BOUNCE":
            assert row["check"].startswith("FAIL: data") and "do not hold their source's bytes" in row["check"], row
        else:
            assert row["check"] == "ok", row
    checks = {(x["backend"], x["check"]) for lines in table_rows(r.stdout).values() for x in lines}
    assert checks == {("BOUNCE", "FAIL"), ("UCX", "ok")}
    summary = (tmp_path / "summary.txt").read_text()
    assert "CHECK FAILED in 2 of 4 rows" in summary
    assert "bounce_min_descriptor_count" not in summary  # no gate from broken rows


def test_notifying_shape_checks_notifications(tmp_path):
    """mt-strict carries one notification per transfer: the target receives exactly one per
    completed transfer (the driver waits for the last ones), and the rows pass."""
    r, rows = sweep(tmp_path, "--shapes", "mt-strict", "--ops", "WRITE", env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(rows) == 4
    for row in rows:
        assert row["check"] == "ok", row
        assert int(row["target_notifs"]) == int(row["completed"]) >= int(row["samples"]), row


def test_time_cap_keeps_the_floor_and_short_rows_are_marked(tmp_path):
    """--max-time 0 stops sampling at once, yet every row gets the preset's floor of samples
    (not one); rows under the asked minimum are marked `n!` and explained."""
    r, rows = sweep(tmp_path, "--ops", "WRITE", "--concurrency", "1", "--samples", "10", "--max-time", "0",
                    env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    floor = plan.PRESETS["tiny"]["budget"].floor
    assert floor > 1
    for row in rows:
        assert floor <= int(row["samples"]) < 10, row
    cells = [x["n"] for lines in table_rows(r.stdout).values() for x in lines]
    assert cells and all(c.endswith("!") for c in cells), cells
    assert "fewer than the budget's minimum of 10 samples" in r.stdout


def test_quick_preset_gives_slow_points_several_samples():
    b = plan.PRESETS["quick"]["budget"]
    assert b.floor >= 5 and b.floor <= b.min_samples


def test_plots_share_line_styles_and_label_their_axes(monkeypatch, tmp_path):
    """p50 solid and p99 dashed in both line plots; latency_vs_size labels its x axis."""
    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    rows = []
    for b in ("BOUNCE", "UCX"):
        for conc in (1, 2):
            for size in (1024, 4096):
                rows.append(synthetic(b, 256, 0.5 if b == "BOUNCE" else 1.0, "bounce" if b == "BOUNCE" else "ucx",
                                      size=size, conc=conc, samples=200 if size == 1024 else 5))
    for r in rows:
        r["op"] = "WRITE"
    assert plots.latency_vs_size(rows, "DRAM", "poll", str(tmp_path / "a.png"))
    assert plots.p99_vs_concurrency(rows, "DRAM", "poll", str(tmp_path / "b.png"))
    assert len(figs) == 2
    for fig in figs:
        for ax in fig.axes:
            assert ax.get_xlabel(), ax.get_title()
            styles = {ln.get_label(): ln.get_linestyle() for ln in ax.get_lines() if not ln.get_label().startswith("_")}
            assert styles["BOUNCE p50"] == "-" and styles["UCX p50"] == "-", styles
            p99 = {k: v for k, v in styles.items() if "p99" in k}
            assert len(p99) == 2 and set(p99.values()) == {"--"}, styles
    assert figs[0].axes[0].get_xlabel() == "descriptor size"
