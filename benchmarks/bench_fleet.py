"""Time to fleet (issue 29): H simulated engine hosts in network namespaces, rate-limited links
both ways and a rate-limited origin, every host running our real pull; "every host reads the
source" against the nginx caching tier and the BitTorrent v2 swarm (libtorrent), in the same run.
docs/FLEET.md. Needs root.

    python benchmarks/bench_fleet.py                       # 8 and 16 hosts, the note's link shapes
    python benchmarks/bench_fleet.py --hosts 16 --repeats 3 --append   # and write benchmarks/RESULTS.md

Figures: time to fleet (the last host holding the verified version) median of the repeats, its
spread, the model's lower bound beside it, the ratio against direct in the same run, the bytes
the origin served, and whether every host's tensors were read back equal to the trainer's.
Validity (the note, section 5): direct should land within about 20% of its model; halve
--host-mbit and --src-mbit and every time should double (else the box is CPU-bound).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fleet.netns import namespaces_usable  # noqa: E402
from benchmarks.fleet.run import run_fleet  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="8,16", help="fleet sizes, comma-separated")
    ap.add_argument("--caches", type=int, default=0, help="nginx caches (default: hosts / 4)")
    ap.add_argument("--model-mb", type=float, default=32)
    ap.add_argument("--changed", type=float, default=0.3, help="fraction of elements the delta moves")
    ap.add_argument("--host-mbit", type=float, default=20, help="each host's link, both ways (b)")
    ap.add_argument("--src-mbit", type=float, default=40, help="the origin's aggregate rate (S)")
    ap.add_argument("--modes", default="direct,cache,swarm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--fault", default=None, choices=["torn_cache", "bad_peer", "half_killed", "throttled_source"],
                    help="cause one of issue 29's faults in every run (benchmarks/fleet/run.py)")
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so the harness's teardown (processes, then namespaces) runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "swarm" in a.modes.split(","):
        try:
            import libtorrent  # noqa: F401
        except ImportError:
            print("bench_fleet: the swarm mode needs libtorrent (pip install 'weightsync[swarm]'; scripts/setup_env.sh "
                  "installs it), or leave it out: --modes direct,cache", file=sys.stderr)
            return 2
    ok, why = namespaces_usable()
    if not ok:
        print(f"bench_fleet: cannot run here: {why}", file=sys.stderr)
        return 2
    reports = []
    for h in [int(x) for x in a.hosts.split(",")]:
        caches = a.caches or max(1, h // 4)
        rep = run_fleet(h, caches, a.model_mb, a.changed, a.host_mbit, a.src_mbit, a.modes.split(","), a.repeats,
                        timeout_s=a.timeout_s, log=(lambda s: print(s, file=sys.stderr, flush=True)), fault=a.fault)
        reports.append(rep)
    table = render(reports, a.repeats)
    print(json.dumps(reports) if a.json else table)
    if a.append:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a") as f:
            f.write(table)
    bad = [(r["shape"]["hosts"], m) for r in reports for m, s in r["summary"].items() if not s["all_ok"]]
    return 1 if bad else 0


def render(reports: list[dict], repeats: int) -> str:
    lines = [f"\n### Time to fleet, measured {datetime.date.today()} (`make bench-fleet`, medians of {repeats})\n",
             "| hosts | caches | delta MB | H·b/S | mode | model s | time to fleet s (spread) | ratio vs direct | origin MB | every host bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        sh = r["shape"]
        for m, s in r["summary"].items():
            lines.append(f"| {sh['hosts']} | {sh['caches'] if m == 'cache' else '-'} | {sh['delta_MB']} | {sh['H_b_over_S']} | {m} | "
                         f"{s['model_s']} | {s['fleet_median_s']:.1f} ({s['spread_s'][0]:.1f}-{s['spread_s'][1]:.1f}) | "
                         f"{s['ratio_vs_direct']:.2f}x | {s['origin_MB_median']} | {'yes' if s['all_ok'] else 'NO'} |")
    loads = [row["load_avg"] for r in reports for row in r["rows"]]
    sh = reports[0]["shape"]
    lines.append(f"\nLinks: b = {sh['host_MBps']} MB/s per host both ways, S = {sh['src_MBps']} MB/s at the origin; "
                 f"load average during the runs {min(loads)}-{max(loads)}.\n")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
