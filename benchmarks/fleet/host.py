"""One simulated engine host (run inside its namespace by the harness): imports weightsync,
says it is ready, waits for the common start, then runs our real ``pull()`` into its own local
checkpoint against its own seed, and writes when it held the verified version.

    python -m benchmarks.fleet.host --local L --seed S --url U --version V --ready R --go G --result J
        [--swarm-listen IP:PORT --swarm-peers IP:PORT,... --linger-until FILE]

With ``--swarm-listen`` the host joins the fleet's BitTorrent swarm (``weightsync.storage.swarm``):
its session starts before "ready" (an engine's lives as long as the engine), and after its pull it
keeps seeding until ``--linger-until`` exists, as an engine host seeds a version until the next.
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
    ap.add_argument("--swarm-listen", default=None)
    ap.add_argument("--swarm-peers", default="")
    ap.add_argument("--linger-until", default=None)
    a = ap.parse_args()
    from weightsync import pull  # imported before "ready": start-up is not part of the figure

    swarm = None
    if a.swarm_listen:
        from weightsync.format.layout import sync_dir
        from weightsync.storage.swarm import SwarmConfig, swarm_for

        swarm = SwarmConfig(a.swarm_listen, a.swarm_peers.split(","))
        os.makedirs(sync_dir(a.local), exist_ok=True)
        swarm_for(swarm, sync_dir(a.local))  # the session listens before the start
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
        r = pull(a.local, a.seed, a.url, a.version, swarm=swarm if swarm is not None else False)
        out.update(finish=time.time(), ok=r.applied_version == a.version, action=r.action, reason=r.reason)
    except Exception as e:  # the harness reports it; a failed host fails the run
        out.update(finish=None, ok=False, error=f"{type(e).__name__}: {e}")
    if swarm is not None:
        from weightsync.storage.swarm import recent_outcomes

        outs = recent_outcomes()
        out["swarm"] = {"delivered": sum(len(o.delivered) for o in outs), "fell_back": sum(len(o.fell_back) for o in outs),
                        "rejected": sum(len(o.rejected) for o in outs), "hash_failures": max([o.hash_failures for o in outs] or [0]),
                        "why": "; ".join(o.why for o in outs if o.why)}
    tmp = a.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, a.result)
    if swarm is not None and a.linger_until:
        while not os.path.exists(a.linger_until) and time.time() < deadline:
            time.sleep(0.05)
        # Leaving the fleet: libtorrent's session teardown at interpreter exit can wait on peers
        # (a banned one included); the result is written, so exit at once.
        os._exit(0)


if __name__ == "__main__":
    main()
