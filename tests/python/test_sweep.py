"""The sweep tool (benches/sweep) itself: a tiny real sweep (two processes per backend, real NIXL
and BOUNCE) must run, write exactly the rows its dimensions ask for, divide by UCX's medians as
it prints them, report the path BOUNCE's counters saw, and draw its plots. Plus the pure parts
(gate derivation, backend specs) on synthetic input."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benches.sweep import plan, report  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    r = subprocess.run([sys.executable, "-m", "benches.sweep", "--preset", "tiny", "--out", str(out),
                        "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
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
    """The ratio a reader sees divides the two p50 columns the reader sees."""
    _, stdout, _ = tiny
    sections, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = sections.setdefault(line, [])
        elif line.startswith("Sweep on"):  # the summary follows the table
            current = None
        elif current is not None and line.strip() and line.split()[0].isdigit():
            cells = line.split()
            assert len(cells) == 10, line
            current.append(dict(size=cells[0], count=cells[1], conc=cells[2], backend=cells[3],
                                p50=float(cells[5]), ratio=float(cells[8]), path=cells[9]))
    assert len(sections) == 2  # WRITE and READ
    seen = 0
    for lines in sections.values():
        ucx = {(x["size"], x["count"], x["conc"]): x["p50"] for x in lines if x["backend"] == "UCX"}
        for x in lines:
            assert x["ratio"] == pytest.approx(x["p50"] / ucx[(x["size"], x["count"], x["conc"])], rel=0.005, abs=0.002)
            seen += 1
    assert seen == 8


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
    r = subprocess.run([sys.executable, "-m", "benches.sweep", "--preset", "tiny", "--shipped-gate",
                        "--counts", "64", "--ops", "WRITE", "--concurrency", "1", "--out", str(tmp_path),
                        "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "sweep.csv") as f:
        paths = {row["backend"]: row["path"] for row in csv.DictReader(f)}
    assert paths == {"BOUNCE": "ucx:count", "UCX": "ucx"}


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
