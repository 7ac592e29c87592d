"""The core stands alone: importing ``weightsync`` and every module of it, in a fresh
interpreter, loads none of torch, sglang, megatron or ray (they import the core, never back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

FORBIDDEN = ("torch", "sglang", "megatron", "ray", "transformers")

SCRIPT = r"""
import importlib, json, pkgutil, sys
import weightsync
names = ["weightsync"] + [m.name for m in pkgutil.walk_packages(weightsync.__path__, "weightsync.")]
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:  # reported, and fails the test
        failed[name] = repr(e)
loaded = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps({"modules": names, "failed": failed, "top_level": loaded}))
"""


def test_importing_every_core_module_loads_no_framework():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=repo, env=env
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["failed"], report["failed"]
    assert {"weightsync.puller.pull", "weightsync.publisher.publish", "weightsync.puller.apply", "weightsync.puller.lock"} <= set(report["modules"])
    leaked = [m for m in report["top_level"] if m in FORBIDDEN]
    assert not leaked, f"importing the core loaded {leaked}"
