"""Where sparse-v2's bytes go: per step, the bytes of each stream (changed positions, signs,
large-change flags, large-change sizes, tables), beside the entropy of what it codes given the
old element's exponent (per 2^20-element segment, 256 exponent bins), and per class of one
segment of one tensor.

    .venv/bin/python benchmarks/sparse2_streams.py --steps 4 --every 4

Same data as bench_sync.py (bench_data.RLStream, seed 0); ``--every k`` codes every k-th
tensor only (a quick look); nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from bench_data import DEFAULT_STEPS, PRESETS, RLStream  # noqa: E402
from weightsync import codec_sparse2 as c2  # noqa: E402
from weightsync.codecs import get_codec  # noqa: E402


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return -(p * np.log2(p) + q * np.log2(q))


def _hcounts(c: np.ndarray) -> float:
    c = c[c > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


def _part_nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (c2.Rice, c2.Values)):
        return len(x.rem) + len(x.quo)
    return len(x)


def _order(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.int64)
    return np.where(x >> 15, x ^ 0xFFFF, x ^ 0x8000)


def stream_bytes(old: np.ndarray, new: np.ndarray, name: str, out: dict, per_class: list | None) -> None:
    enc = c2.CODEC.encode(old.view(np.uint8), new.view(np.uint8), 2, 1, name)
    if enc is None:
        return
    parsed = c2.parse(enc.payload, old.nbytes, name)
    coded = 0
    for seg in parsed.segments:
        for c in seg.classes:
            sizes = {"positions": _part_nbytes(c.mask), "signs": _part_nbytes(c.signs),
                     "flags": _part_nbytes(c.flags), "sizes": _part_nbytes(c.values)}
            for key, v in sizes.items():
                out[key] += v
                coded += v
            if per_class is not None and seg.start == 0:
                per_class.append((c.lo >> 7, c.hi >> 7, c.members, c.changes, c.nbig, sizes))
    out["tables"] += len(enc.payload) - coded
    out["sparse-v1"] += len(get_codec("sparse-v1").encode(old.view(np.uint8), new.view(np.uint8), 2, 1, name).payload)
    for s0 in range(0, old.size, c2.SEG_ELEMENTS):
        o, n = old[s0 : s0 + c2.SEG_ELEMENTS], new[s0 : s0 + c2.SEG_ELEMENTS]
        changed = o != n
        k = int(changed.sum())
        if not k:
            continue
        key = ((o >> 7) & 0xFF).astype(np.int64)
        ne = np.bincount(key, minlength=256).astype(np.float64)
        ke = np.bincount(key[changed], minlength=256).astype(np.float64)
        present = ne > 0
        out["H positions"] += float((ne[present] * _h(ke[present] / ne[present])).sum()) / 8
        out["H signs"] += k / 8
        kc = key[changed]
        mag = np.abs(_order(n[changed]) - _order(o[changed])) - 1
        _, joint = np.unique(kc * 70000 + mag, return_counts=True)
        out["H flags+sizes"] += (_hcounts(joint) - _hcounts(np.bincount(kc))) / 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=1, help="code every k-th tensor only")
    args = ap.parse_args()
    stream = RLStream(PRESETS[args.preset])
    prev = stream.bf16()
    names = sorted(prev)[:: args.every]
    show = next((n for n in names if "mlp" in n), names[0])
    print("| step | positions | signs | flags | sizes | tables | v2 total | v2/v1 | H positions | H signs | H flags+sizes | v2/Hctx |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    classes: list = []
    for i, (lr, label) in enumerate(DEFAULT_STEPS[: args.steps], start=1):
        cur = stream.step(lr)
        out = dict.fromkeys(["positions", "signs", "flags", "sizes", "tables", "sparse-v1", "H positions", "H signs",
                             "H flags+sizes"], 0.0)
        for name in names:
            stream_bytes(prev[name].reshape(-1), cur[name].reshape(-1), name, out, classes if (i == 1 and name == show) else None)
        total = sum(out[k] for k in ("positions", "signs", "flags", "sizes", "tables"))
        hctx = out["H positions"] + out["H signs"] + out["H flags+sizes"]
        mb = lambda x: f"{x / 1e6:.3f}"  # noqa: E731
        print(f"| {i} {label} | {mb(out['positions'])} | {mb(out['signs'])} | {mb(out['flags'])} | {mb(out['sizes'])} | "
              f"{mb(out['tables'])} | {mb(total)} | {total / out['sparse-v1']:.3f}x | {mb(out['H positions'])} | "
              f"{mb(out['H signs'])} | {mb(out['H flags+sizes'])} | {total / hctx:.3f}x |")
        prev = cur
    print(f"\nstep 1, {show}, segment 0, per class (keys [lo, hi), bytes):")
    for lo, hi, members, k, nbig, sizes in classes:
        print(f"- keys [{lo:#x}, {hi:#x}): {members} members, {k} changed ({k / max(members, 1):.3f}), {nbig} large; {sizes}")


if __name__ == "__main__":
    main()
