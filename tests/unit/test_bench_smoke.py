"""The benchmark still runs end to end (tiny preset, three steps) and checks its own results:
every published version is pulled and verified by the real ``pull``, the baseline verifies its
digests, and the report names every figure. Slow: it imports torch for the trainer simulation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_benchmark_runs_end_to_end_on_the_tiny_preset(fast_tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_sync.py"), "--preset", "tiny", "--steps", "3",
         "--no-append", "--reps", "1", "--workdir", str(fast_tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = out.stdout
    for figure in ("wire bytes", "publish per core", "pull (apply + verify + flush)", "catch-up over",
                   "pull scaling", "peak anonymous memory"):
        assert figure in report, figure
    assert "| delta |" in report  # realistic steps publish deltas
    assert not os.listdir(fast_tmp_path), "the benchmark leaves its work dir behind"


@pytest.mark.slow
def test_engine_benchmark_builds_servable_data_and_measures_the_cause_without_a_server(fast_tmp_path):
    """The engine benchmark's server-free part (its servers are too slow for the suite): the
    model and versions it builds pull exactly, and the report names the cause's rows."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_engine.py"), "--preset", "engine-tiny", "--tp", "",
         "--reps", "1", "--no-append", "--workdir", str(fast_tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("| alone |", "| beside a busy-polling Python thread |", "GIL switch interval"):
        assert row in out.stdout, row
    assert "'kind': 'delta'" in out.stdout  # both versions published as deltas
    assert not os.listdir(fast_tmp_path), "the benchmark leaves its work dir behind"


@pytest.mark.slow
def test_history_measurement_is_consistent_on_the_tiny_preset():
    """benchmarks/sparse2_streams.py --history (the go/no-go figures for a history context in
    sparse-v2): its coder without history reproduces the real sparse-v2 bytes, the step after
    the seed has no history context, and more context never raises an entropy estimate, while
    an adaptive coder never beats the plug-in entropy it approximates."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import sparse2_streams
    finally:
        sys.path.pop(0)
    rows, ntensors = sparse2_streams.history_rows("tiny", 3, 1)
    assert ntensors > 10 and [r[0] for r in rows] == [1, 2, 3]
    for step, _, out, st0, st1, has_history in rows:
        assert has_history == (step > 1)
        assert abs(out["proj0"] / out["v2"] - 1) < 0.03, (step, out["proj0"], out["v2"])  # the calibration
        if not has_history:
            assert out["proj"] == out["proj0"] and st0["signs"] == st1["signs"]
        for stream in ("positions", "signs", "flags+sizes"):
            assert out[f"H {stream} hist"] <= out[f"H {stream} exp"] + 1e-6, (step, stream)
        for stream in ("positions", "flags+sizes"):
            for ctx in ("exp", "hist"):
                assert out[f"KT {stream} {ctx}"] >= out[f"H {stream} {ctx}"], (step, stream, ctx)
    assert rows[1][2]["p1"] > rows[1][2]["p0"]  # an element that just changed changes again more often
