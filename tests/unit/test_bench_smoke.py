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
