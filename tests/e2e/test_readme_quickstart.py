"""The README's quickstart runs as written, so it cannot rot: its bash block(s), unchanged, in
bash from the repository root, with a real sglang CPU server (one, TP=1, started and stopped by
the block itself). Only ``TMPDIR`` points into the test's temp dir, so ``mktemp -d`` lands there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART_PORT = 30000  # what the README's block names


def quickstart_script() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    match = re.search(r"\n## Quickstart[^\n]*\n(.*?)(?=\n## )", text, re.S)
    assert match, "README.md has no '## Quickstart' section"
    blocks = re.findall(r"```bash\n(.*?)```", match.group(1), re.S)
    assert blocks, "the quickstart has no bash block"
    return "\n".join(blocks)


def json_replies(stdout: str) -> list[dict]:
    """The JSON objects curl printed (each reply is one line of JSON, maybe without a newline)."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while (start := stdout.find('{"success"', pos)) >= 0:
        obj, pos = decoder.raw_decode(stdout, start)
        out.append(obj)
    return out


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_the_readme_quickstart_runs_as_written_with_a_real_engine(tmp_path):
    script = quickstart_script()
    assert "python -m testbed.tiny_qwen3" in script and "python -m testbed.sglang_cpu" in script
    assert port_is_free(QUICKSTART_PORT), f"port {QUICKSTART_PORT}, which the quickstart uses, is taken"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the block left running (it should leave nothing)
        except ProcessLookupError:
            pass
    detail = f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
    assert proc.returncode == 0, detail
    # the command line's part: a delta published, pulled (seeded, then the chain) and verified
    assert re.search(r"^\s*1\s+delta\s+sparse-v1\s", stdout, re.M), detail
    assert re.search(r"^\s*1\s+seed\+chain\s+1\s", stdout, re.M), detail
    assert "v1: " in stdout and ", 0 mismatched" in stdout, detail
    # the engine's part: both curls answered success for version 1
    pulled, served = json_replies(stdout)
    assert pulled["success"] is True and pulled["applied_version"] == 1, pulled
    assert served["success"] is True and served["weight_version"] == 1 and served["mode"] in ("live", "reload"), served
    assert port_is_free(QUICKSTART_PORT), "the quickstart's engine is still running after its `kill`"
