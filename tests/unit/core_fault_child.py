"""Child process of the fault tests: pulls in a loop (to be SIGKILLed), or pulls once together
with siblings (to check that one host does the work once).

    python core_fault_child.py loop  LOCAL SEED SOURCE T1,T2,...   # prints "ready", pulls forever
    python core_fault_child.py once  LOCAL SEED SOURCE TARGET GO_FILE
                                     # waits for GO_FILE, pulls once, prints the PullResult as JSON

The pre-read hook ``core_fault_child.record_hook`` appends one line per call to the file named
by ``WS_HOOK_LOG``: the tests count the lines to see how often a host really read the source.
"""

from __future__ import annotations

import itertools
import os
import sys
import time


def record_hook(source_dir: str, target_version: int) -> None:
    with open(os.environ["WS_HOOK_LOG"], "a") as f:
        f.write(f"{os.getpid()} {target_version}\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str]) -> int:
    import msgspec

    from weightsync import pull

    mode, local, seed, source = argv[:4]
    if mode == "loop":
        targets = [int(t) for t in argv[4].split(",")]
        print("ready", flush=True)
        for i, target in enumerate(itertools.cycle(targets)):
            pull(local, seed, source, target, durability="deferred" if i % 3 == 2 else "sync")
        return 0
    if mode == "once":
        target, go_file = int(argv[4]), argv[5]
        print("ready", flush=True)
        while not os.path.exists(go_file):
            time.sleep(0.001)
        result = pull(local, seed, source, target, pre_read_hook="core_fault_child.record_hook", lock_timeout_s=120)
        print(msgspec.json.encode(result).decode(), flush=True)
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
