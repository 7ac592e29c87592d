"""Benchmark: what reading back every written element costs the live pause on the CPU.

    .venv/bin/python benchmarks/bench_read_back.py            # ~1 min on a 2-core box
    .venv/bin/python benchmarks/bench_read_back.py --elements 20000000 --reps 9

The pause writes each patch into its parameter and reads every written element back to compare
it with the staged value (issue 19). This times, on one bf16 parameter of ``--elements`` elements
and sorted random positions at each density, in turns (one rep of each variant per round):

- ``write``: the compiled loop's write alone (``ParamPatch.write_new``): the baseline;
- ``write + read-back``: the pause's scatter itself (``scatter_with_undo``: the compiled loop,
  each element read back a few entries after its write);
- ``numpy write`` and ``numpy write + read-back``: the same two calls with the extension switched
  off, as on an install without a C compiler (numpy's fancy assignment for sparse patches,
  ``index_copy_`` for dense ones, then a gather, a compare and a scan per chunk).

It prints medians, each against the compiled write, and the read-back's own cost (the
difference against its write), with the scatter's own estimate beside it (``ReadBack.seconds``:
the loop's fused chunks against its probe chunks' write rate, plus the probes' own read-back:
what the reply reports as ``written_read_back_s``). With ``--append`` it appends the table to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_patch.live.scatter import host_scatter  # noqa: E402
from sglang_patch.live.scatter.patch import ParamPatch, RestoreBuffers, StagedUpdate, scatter_with_undo  # noqa: E402


def staged(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> StagedUpdate:
    """One patch staged as the pause gets it: its undo log and restore buffers made beforehand."""
    patch = ParamPatch("bench", flat, index, values, flat[index])
    return StagedUpdate(0, 1, None, "", 0, patches=[patch], restore_buffers=RestoreBuffers([patch]))


@contextlib.contextmanager
def without_extension():
    """The host scatter as on an install where ``_host_scatter.c`` was not built."""
    saved, host_scatter._compiled = host_scatter._compiled, None
    try:
        yield
    finally:
        host_scatter._compiled = saved


def measure(elements: int, density: float, reps: int, rng: np.random.Generator) -> dict:
    flat = torch.zeros(elements, dtype=torch.bfloat16)
    flat_bits = flat.view(torch.int16).numpy()
    flat_bits[:] = rng.integers(-30000, 30000, elements, dtype=np.int16)  # touch every page first
    n = int(elements * density)
    index = torch.from_numpy(np.sort(rng.choice(elements, n, replace=False)).astype(np.int64))
    values = torch.from_numpy(rng.integers(-30000, 30000, n, dtype=np.int16)).view(torch.bfloat16)
    update = staged(flat, index, values)
    self_timed: list[float] = []

    def checked() -> None:
        undo, _ = scatter_with_undo(update)
        self_timed.append(undo.read_back.seconds)

    def switched_off(run):
        def call() -> None:
            with without_extension():
                run()
        return call

    variants = {
        "write": update.patches[0].write_new,
        "write + read-back": checked,
        "numpy write": switched_off(update.patches[0].write_new),
        "numpy write + read-back": switched_off(lambda: scatter_with_undo(update)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, run in variants.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out["self_timed"] = statistics.median(self_timed)
    out["n"] = n
    return out


def report(rows: dict, elements: int, reps: int) -> str:
    lines = [
        f"### Read-back of the written elements, CPU ({datetime.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} cores)",
        "",
        f"One bf16 parameter of {elements:,} elements, sorted random positions; medians of {reps} rounds "
        "(`benchmarks/bench_read_back.py`). Ratios against the compiled write alone.",
        "",
        "| changed | elements | write | write + read-back | read-back's cost | the loop's own estimate "
        "| numpy write | numpy write + read-back | numpy read-back's cost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for density, r in rows.items():
        base = r["write"]
        lines.append(
            f"| {density:.1%} | {r['n']:,} | {base * 1e3:.2f} ms | {r['write + read-back'] * 1e3:.2f} ms "
            f"({r['write + read-back'] / base:.2f}x) | {(r['write + read-back'] - base) / base:+.2f}x "
            f"| {r['self_timed'] * 1e3:.2f} ms ({r['self_timed'] / base:.2f}x) "
            f"| {r['numpy write'] * 1e3:.2f} ms ({r['numpy write'] / base:.2f}x) "
            f"| {r['numpy write + read-back'] * 1e3:.2f} ms ({r['numpy write + read-back'] / base:.2f}x) "
            f"| {(r['numpy write + read-back'] - r['numpy write']) / r['numpy write']:+.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--densities", default="0.001,0.01,0.05")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    if host_scatter.compiled() is None:
        print("sglang_patch.live.scatter._host_scatter is not built: run scripts/setup_env.sh", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as in the pause
    rng = np.random.default_rng(0)
    rows = {}
    for density in (float(d) for d in args.densities.split(",")):
        print(f"[bench_read_back] {density:.1%} of {args.elements:,} elements, {args.reps} rounds ...", flush=True)
        rows[density] = measure(args.elements, density, args.reps, rng)
    text = report(rows, args.elements, args.reps)
    print(text)
    if args.append:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
