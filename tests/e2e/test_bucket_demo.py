"""The demo with ``--source s3``: the whole loop (a Megatron trainer on Ray, a real sglang CPU
engine) with versions published to, and pulled from, a bucket of the real S3 server the demo
starts on loopback; every version's engine output and local files equal the trainer's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_demo_publishes_to_a_local_s3_server_it_starts_and_the_engine_serves_every_version(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # only the demo's server's
    out = subprocess.run(
        [sys.executable, "-m", "miles_updater.demo", "--source", "s3", "--steps", "2", "--workdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "publishing to s3://" in text and "shared dir s3://" in text
    assert "matched the trainer's at every version" in text
    assert not os.path.exists(tmp_path / "shared")  # nothing went to a local shared dir
