"""What side anchors cost the publisher, and what they save a late host.

Publishes the same stream of versions twice with the default settings, once with side anchors
(the default) and once without (``anchor_fraction=0, anchor_max_deltas=0``, no pruning), and
prints per version: bytes written (delta shards, anchors), publish CPU time; then a fresh
host's pull of the newest version (bytes read from the source dir, CPU time, one worker). Ratios are
against the run without anchors, in the same process.

    .venv/bin/python benchmarks/anchor_cost.py [--mb 4] [--versions 300] [--changed 0.02]

The model is bf16-like (uint16 elements) and each version moves ``--changed`` of the elements
by +-1 (an RL step rounded to bf16 moves most weights by 0 or 1 ulp).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync import Publisher, RawTensor, pull  # noqa: E402


def make_model(mb: float, rng) -> dict[str, np.ndarray]:
    n = int(mb * (1 << 20)) // 2 // 8
    return {f"layers.{i}.w": rng.integers(0x3C00, 0x3D00, n, dtype=np.uint16) for i in range(8)}


def step(model, rng, changed: float) -> dict[str, np.ndarray]:
    out = {}
    for name, a in model.items():
        b = a.copy()
        k = max(1, int(changed * a.size))
        pos = rng.choice(a.size, k, replace=False)
        b[pos] += rng.choice(np.array([1, 0xFFFF], np.uint16), k)
        out[name] = b
    return out


def write_checkpoint(path: str, model) -> None:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file({n: a.view(np.uint16) for n, a in model.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{}")


def run(root: str, stream, anchors: bool, rep: int) -> dict:
    source = os.path.join(root, f"src-{rep}-anchors" if anchors else f"src-{rep}-plain")
    kw = {} if anchors else {"anchor_fraction": 0, "anchor_max_deltas": 0, "prune": False}
    pub = Publisher(source, workers=1, **kw)
    pub.seed_snapshot({n: RawTensor("BF16", a.shape, a) for n, a in stream[0].items()})
    delta_b = anchor_b = 0
    t0 = time.process_time()  # CPU-seconds of the process (the pool's threads included): a shared box's wall clock is noise
    for v in range(1, len(stream)):
        r = pub.publish(v, {n: RawTensor("BF16", a.shape, a) for n, a in stream[v].items()})
        delta_b += r.wire_nbytes
        anchor_b += r.anchor_nbytes
    publish_s = time.process_time() - t0
    pub.close()
    local = os.path.join(root, f"local-{rep}-anchors" if anchors else f"local-{rep}-plain")
    t0 = time.process_time()
    res = pull(local, os.path.join(root, "seed"), source, len(stream) - 1, workers=1)
    return {
        "delta_b": delta_b, "anchor_b": anchor_b, "publish_s": publish_s, "pull_s": time.process_time() - t0,
        "pull_read_b": res.source_nbytes, "pull_deltas": res.deltas_applied,
        "disk_b": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(source) for f in fs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=4)
    ap.add_argument("--versions", type=int, default=300)
    ap.add_argument("--changed", type=float, default=0.02)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workdir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    stream = [make_model(args.mb, rng)]
    for _ in range(args.versions):
        stream.append(step(stream[-1], rng, args.changed))
    root = tempfile.mkdtemp(prefix="ws-anchor-cost-", dir=args.workdir)
    try:
        write_checkpoint(os.path.join(root, "seed"), stream[0])
        full_b = sum(a.nbytes for a in stream[0].values())
        # Alternate the two runs and keep the faster of each (a shared box is noisy).
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for rep in range(args.reps):
            for anchors in ((False, True) if rep % 2 == 0 else (True, False)):
                runs[anchors].append(run(root, stream, anchors, rep))
        plain, anch = (
            dict(rs[0], publish_s=min(r["publish_s"] for r in rs), pull_s=min(r["pull_s"] for r in rs))
            for rs in (runs[False], runs[True])
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = args.versions
    print(f"model {full_b / 2**20:.1f} MiB, {n} versions, {args.changed:.1%} of elements changed per version")
    print(f"delta bytes per version        {plain['delta_b'] / n / 1024:9.1f} KiB ({plain['delta_b'] / n / full_b:.2%} of full)")
    print(f"anchor bytes per version       {anch['anchor_b'] / n / 1024:9.1f} KiB "
          f"(+{anch['anchor_b'] / max(plain['delta_b'], 1):.0%} over the deltas; {anch['anchor_b'] / full_b:.0f} anchors)")
    print(f"publish CPU per version        {plain['publish_s'] / n * 1e3:7.2f} ms without, "
          f"{anch['publish_s'] / n * 1e3:7.2f} ms with anchors (x{anch['publish_s'] / plain['publish_s']:.2f})")
    print(f"late host reads                {plain['pull_read_b'] / full_b:7.2f}x the model without "
          f"({plain['pull_deltas']} deltas), {anch['pull_read_b'] / full_b:.2f}x with anchors ({anch['pull_deltas']} deltas)")
    print(f"late host pull CPU             {plain['pull_s']:7.2f} s without, {anch['pull_s']:.2f} s with anchors")
    print(f"source dir at the end          {plain['disk_b'] / full_b:7.2f}x the model without pruning, "
          f"{anch['disk_b'] / full_b:.2f}x with anchors and default pruning")


if __name__ == "__main__":
    main()
