"""One simulated engine host (run inside its namespace by the harness): imports weightsync,
says it is ready, waits for the common start, then runs our real ``pull()`` into its own local
checkpoint against its own seed, and writes when it held the verified version.

    python -m benchmarks.fleet.host --local L --seed S --url U --version V --ready R --go G --result J
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--local", "--seed", "--url", "--ready", "--go", "--result"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--wait-s", type=float, default=600)
    a = ap.parse_args()
    from weightsync import pull  # imported before "ready": start-up is not part of the figure

    with open(a.ready, "w") as f:
        f.write(str(os.getpid()))
    deadline = time.time() + a.wait_s
    while not os.path.exists(a.go):
        if time.time() > deadline:
            return
        time.sleep(0.01)
    with open(a.go) as f:
        t0 = float(f.read())
    while time.time() < t0:
        time.sleep(max(0.0, min(0.005, t0 - time.time())))
    out: dict = {"t0": t0}
    try:
        r = pull(a.local, a.seed, a.url, a.version)
        out.update(finish=time.time(), ok=r.applied_version == a.version, action=r.action, reason=r.reason)
    except Exception as e:  # the harness reports it; a failed host fails the run
        out.update(finish=None, ok=False, error=f"{type(e).__name__}: {e}")
    tmp = a.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, a.result)


if __name__ == "__main__":
    main()
