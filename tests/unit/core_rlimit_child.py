"""Child process of the bounded-resource tests: pulls under a low descriptor limit.

    python core_rlimit_child.py pull    NOFILE LOCAL SEED SOURCE TARGET WORKERS
    python core_rlimit_child.py exhaust NOFILE LOCAL SEED SOURCE TARGET WORKERS
        # exhaust: the pre-read hook (inside the lock, before the source is read) opens
        # /dev/null until EMFILE and keeps all but a few descriptors: enough to plan and load,
        # not to apply a long chain. Report how the pull failed and the marker it left;
        # release them and pull again

Prints one JSON object. The limit is set with setrlimit before weightsync is imported.
"""

from __future__ import annotations

import json
import os
import resource
import sys


SPARE = 6  # descriptors left free: plan and load need 2 at a time, the apply many more


def marker(local: str):
    try:
        with open(os.path.join(local, ".weight_sync", "state.json")) as f:
            return int(json.load(f)["version"])
    except FileNotFoundError:
        return None


def main(argv: list[str]) -> int:
    mode, nofile, local, seed, source, target, workers = argv
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), hard))
    from weightsync import errors, pull

    out: dict = {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
    if mode == "pull":
        r = pull(local, seed, source, int(target), workers=int(workers))
        out.update(action=r.action, deltas=r.deltas_applied, reseeded=r.reseeded, marker=marker(local))
    elif mode == "exhaust":
        hoard: list[int] = []

        def exhaust(source_dir: str, target_version: int) -> None:
            while True:
                try:
                    hoard.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
            for _ in range(SPARE):
                os.close(hoard.pop())

        try:
            pull(local, seed, source, int(target), exhaust, workers=int(workers))
            out["first"] = "success"
        except errors.WeightSyncError as e:
            out.update(first=type(e).__name__, error_type=e.error_type, message=str(e),
                       is_oserror=isinstance(e, OSError), errno_name=getattr(e, "errno_name", None))
        except OSError as e:
            out.update(first=f"bare {type(e).__name__}", message=str(e))
        out["marker_after_failure"] = marker(local)
        out["hoarded"] = len(hoard)
        for fd in hoard:
            os.close(fd)
        r = pull(local, seed, source, int(target), workers=int(workers))
        out.update(action=r.action, deltas=r.deltas_applied, reseeded=r.reseeded, marker=marker(local))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
