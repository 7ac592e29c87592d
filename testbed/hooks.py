"""A pre-read hook for tests: records each call and can hold a pull at a gate.

Used as ``--custom-pull-weights-pre-read-hook testbed.hooks.record_pre_read``. Configured through
the server's environment:

- ``TESTBED_PRE_READ_HOOK_LOG``: file that gets one line ``<pid> <source_dir> <version>`` per call;
- ``TESTBED_PRE_READ_HOOK_GATE``: a directory; each call first creates ``started-<version>``
  there, then waits (up to 120 s) until a file ``release`` exists there. With no gate it returns
  at once. A test uses the gate to hold a pull "in progress" while it checks concurrency.
"""

from __future__ import annotations

import os
import time


def record_pre_read(source_dir: str, target_version: int) -> None:
    log_path = os.environ.get("TESTBED_PRE_READ_HOOK_LOG")
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()} {source_dir} {target_version}\n")
    gate = os.environ.get("TESTBED_PRE_READ_HOOK_GATE")
    if gate:
        os.makedirs(gate, exist_ok=True)
        open(os.path.join(gate, f"started-{target_version}"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
            time.sleep(0.05)


def read_calls(log_path: str) -> list[tuple[int, str, int]]:
    """The calls recorded in ``log_path``: (pid, source_dir, version)."""
    if not os.path.exists(log_path):
        return []
    calls = []
    with open(log_path) as f:
        for line in f:
            pid, source_dir, version = line.split()
            calls.append((int(pid), source_dir, int(version)))
    return calls
