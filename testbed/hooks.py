"""A pre-read hook for tests: records each call and can hold a pull at a gate.

Used as ``--custom-pull-weights-pre-read-hook testbed.hooks.record_pre_read``. Configured through
the server's environment:

- ``TESTBED_PRE_READ_HOOK_LOG``: file that gets one line ``<pid> <source_dir> <version>`` per call;
- ``TESTBED_PRE_READ_HOOK_GATE``: a directory; each call first creates ``started-<version>``
  there, then waits (up to 120 s) until a file ``release`` exists there. With no gate it returns
  at once. A test uses the gate to hold a pull "in progress" while it checks concurrency, or to
  stand for a read of a hung filesystem;
- ``TESTBED_PRE_READ_HOOK_CONTROL``: a JSON file; while it exists, ``{"pp_rank": P, "sleep_s": S}``
  makes the call on pipeline stage P (and only there) sleep S seconds, holding the host's pull
  lock as a slow read would; ``{"first_sleeps_s": S}`` makes the first call to arrive (the stage
  that took the lock first, whichever it is) sleep S seconds, and writes its stage to the file
  ``<control>.first`` (``slept_stage`` reads it back).
"""

from __future__ import annotations

import json
import os
import re
import time


def record_pre_read(source_dir: str, target_version: int) -> None:
    log_path = os.environ.get("TESTBED_PRE_READ_HOOK_LOG")
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()} {source_dir} {target_version}\n")
    _obey_control(os.environ.get("TESTBED_PRE_READ_HOOK_CONTROL"))
    gate = os.environ.get("TESTBED_PRE_READ_HOOK_GATE")
    if gate:
        os.makedirs(gate, exist_ok=True)
        open(os.path.join(gate, f"started-{target_version}"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
            time.sleep(0.05)


def _obey_control(control_path: str | None) -> None:
    if not control_path or not os.path.exists(control_path):
        return
    with open(control_path) as f:
        control = json.load(f)
    if "first_sleeps_s" in control:
        try:  # only one call creates the marker: it is the one holding the lock
            fd = os.open(control_path + ".first", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(str(_pp_rank()))
        time.sleep(float(control["first_sleeps_s"]))
        return
    if control.get("pp_rank") is not None and control["pp_rank"] != _pp_rank():
        return
    time.sleep(float(control.get("sleep_s", 0)))


def slept_stage(control_path: str) -> int | None:
    """The stage that ``first_sleeps_s`` made sleep, once one has (the marker is removed)."""
    try:
        with open(control_path + ".first") as f:
            stage = int(f.read())
    except (OSError, ValueError):
        return None
    os.unlink(control_path + ".first")
    return stage


def _pp_rank() -> int:
    """This pull's pipeline stage, from the process title sglang gives a scheduler
    (``sglang::scheduler_PP1``): this process's (a pull in the scheduler) or its parent's (the
    scheduler's pull helper); 0 without one."""
    for pid in ("self", str(os.getppid())):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        found = re.search(r"sglang::scheduler\S*_PP(\d+)", title)
        if found:
            return int(found.group(1))
    return 0


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
