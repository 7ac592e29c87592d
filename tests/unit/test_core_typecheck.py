"""The core ships ``py.typed``, so its annotations are a promise to every caller: mypy, run with
the repository's ``[tool.mypy]`` settings (pyproject.toml), finds no error in ``weightsync``
and checks every module of it."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="mypy is not installed in this interpreter (scripts/setup_env.sh installs it with the test tools)",
)
def test_core_package_type_checks_clean(tmp_path):
    # A fresh cache dir: no .mypy_cache left in the repo, and no stale result reused.
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert out.returncode == 0, f"mypy found errors in weightsync:\n{out.stdout}\n{out.stderr}"
    checked = re.search(r"Success: no issues found in (\d+) source files", out.stdout)
    assert checked, out.stdout
    # [tool.mypy] files must cover the whole package, not a part of it.
    modules = glob.glob(os.path.join(REPO, "weightsync", "**", "*.py"), recursive=True)
    assert int(checked.group(1)) == len(modules), out.stdout
