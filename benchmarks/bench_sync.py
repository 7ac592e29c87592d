"""Benchmark: our publish/pull (sparse-v1 and xor) against the upstream design, same data.

    make bench                                  # small preset (~300 MB), fits a 2-core box
    .venv/bin/python benchmarks/bench_sync.py --preset qwen3-4b --device cuda   # big box

Data: a Qwen3-shaped bf16 checkpoint and a stream of RL updates (fp32 master + Adam,
rounded to bf16; see bench_data.py), ending with one dense step where a full version must
win. For every step it measures, for the baseline (benchmarks/baseline_upstream.py) and for
the real ``weightsync.Publisher`` / ``weightsync.pull``:

- wire bytes (delta payload bytes), and ours against the order-0 entropy of the change
  (per tensor: n H(changed) + k H(difference | changed));
- publish throughput: diff + encode + compress + checksum from host memory, with one worker
  (per core) and with all workers;
- pull throughput: apply + verify + flush of one version into a local checkpoint.

Then: catch-up over 8 pending deltas against a single delta, pull scaling 1 vs N workers, and
the puller's peak memory in a fresh subprocess (anonymous memory sampled every 2 ms, since
the mmap'd checkpoint's file pages count in RSS but are page cache, not the puller's heap).
It prints one table and appends it, with the date and the machine, to benchmarks/RESULTS.md.

Files live in --workdir (default /dev/shm when present, so disk speed does not hide the CPU
cost; both sides flush and fsync the same way).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import baseline_upstream as base  # noqa: E402
from bench_data import DEFAULT_STEPS, PRESETS, RLStream  # noqa: E402
from weightsync import Publisher, RawTensor, pull  # noqa: E402
from weightsync.codecs import sparse_v2 as codec_sparse2  # noqa: E402
from weightsync.publisher.encoding_choice import Cost, EncodingChooser  # noqa: E402
from weightsync.fsio import write_file  # noqa: E402
from weightsync.format.safetensors_io import iter_file_chunks  # noqa: E402

ENCODINGS = ("sparse-v1", "sparse-v2", "xor")
AUTO_LINKS = (1e6, 100e6)  # bytes/s per puller the report says encoding "auto" chooses at
CATCHUP = 8
MB = 1e6


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    import zstandard

    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = ", GPU " + torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem}{gpu}; Linux {platform.release()}; Python {platform.python_version()}, "
        f"numpy {np.__version__}, zstandard {zstandard.__version__}"
    )


def order0_entropy_nbytes(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> float:
    """Per tensor: n H(p_changed) + k H(new - old | changed), in bytes (bf16 bits as uint16)."""
    bits = 0.0
    for name, n_arr in new.items():  # noqa: B007
        o = old[name].reshape(-1)
        nw = n_arr.reshape(-1)
        d = nw - o  # uint16, modular
        k = int(np.count_nonzero(d))
        n = d.size
        if k == 0:
            continue
        p = k / n
        if p < 1:
            bits += n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
        counts = np.bincount(d, minlength=65536)[1:]
        counts = counts[counts > 0] / k
        bits += k * float(-(counts * np.log2(counts)).sum())
    return bits / 8


# sparse-v2 bitstream 3's neighbourhood buckets of r changes among the previous 64 elements
NEIGHBOUR_BUCKET = np.array([0, 1, 2, 3, 3, 4, 4, 4, 5, 5, 5, 5, 5] + [6] * 8 + [7] * 44, np.int64)


def _binary_entropy_bits(members: np.ndarray, changes: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(members > 0, changes / np.maximum(members, 1), 0.0)
        h = -(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0) + np.where(p < 1, (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)), 0))
    return float((members * h).sum())


def context_entropy_nbytes(old: dict[str, np.ndarray], new: dict[str, np.ndarray], neighbours: bool = False) -> float:
    """Per tensor, conditioned on the old element's exponent e (what sparse-v2's receiver
    knows): sum_e n_e H(p_changed | e) + k H(new - old | e, changed), in bytes. With
    ``neighbours`` the change mask is conditioned on (e, the bucket of the changes among the
    previous 64 elements) as well: the context bitstream 3 codes it in (a static per-tensor
    estimate, learning cost not counted)."""
    bits = 0.0
    for name, n_arr in new.items():
        o = old[name].reshape(-1)
        nw = n_arr.reshape(-1)
        e = ((o >> 7) & 0xFF).astype(np.int64)
        changed = o != nw
        k = int(np.count_nonzero(changed))
        if k == 0:
            continue
        ke = np.bincount(e[changed], minlength=256).astype(np.float64)
        if neighbours:
            before = np.concatenate([[0], np.cumsum(changed, dtype=np.int64)])
            at = np.arange(o.size)
            recent = before[at] - before[np.maximum(at - 64, 0)]
            ctx = e * 8 + NEIGHBOUR_BUCKET[recent]
            bits += _binary_entropy_bits(np.bincount(ctx, minlength=2048).astype(np.float64),
                                         np.bincount(ctx[changed], minlength=2048).astype(np.float64))
        else:
            bits += _binary_entropy_bits(np.bincount(e, minlength=256).astype(np.float64), ke)
        d = (nw[changed] - o[changed]).astype(np.int64)
        _, joint = np.unique(e[changed] * 65536 + d, return_counts=True)
        marginal = ke[ke > 0]
        bits += float(-(joint * np.log2(joint / k)).sum()) - float(-(marginal * np.log2(marginal / k)).sum())
    return bits / 8


def write_checkpoint(directory: str, tensors: dict[str, np.ndarray]) -> str:
    os.makedirs(directory, exist_ok=True)
    entries = [(n, "BF16", tuple(a.shape), a) for n, a in sorted(tensors.items())]
    path = os.path.join(directory, "model.safetensors")
    write_file(path, iter_file_chunks(entries, {"format": "pt"}))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3", "note": "benchmark checkpoint"}, f)
    return path


def as_raw(tensors: dict[str, np.ndarray]) -> dict[str, RawTensor]:
    return {n: RawTensor("BF16", tuple(a.shape), a) for n, a in tensors.items()}


class CpuMeter:
    """Process CPU seconds (all threads) spent in a call, less the time spent in garbage
    collections (their cost depends on how many objects the calling process holds, here one
    that imported torch, not on the work measured). On a shared, loaded machine CPU seconds
    are steadier than wall time; both are reported."""

    def __init__(self) -> None:
        import gc

        self.gc_s = 0.0
        self._t: float | None = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.process_time()
        elif self._t is not None:
            self.gc_s += time.process_time() - self._t
            self._t = None

    def run(self, fn, *a, **k):
        g0, c0, w0 = self.gc_s, time.process_time(), time.perf_counter()
        out = fn(*a, **k)
        return out, time.process_time() - c0 - (self.gc_s - g0), time.perf_counter() - w0


METER: CpuMeter | None = None


def publish_prepared(pub: Publisher, prepared) -> str:
    kind, _ = pub.choose_kind(
        prepared.version, prepared.delta_nbytes, prepared.full_nbytes, prepared.changed_elements, prepared.total_elements
    )
    manifest = pub.write(prepared, kind)
    pub.commit(prepared.version, kind, [manifest])
    return kind


def rss_child(argv: list[str]) -> None:
    """Run one pull and print its peak anonymous memory (sampled) and VmHWM, as JSON."""
    local, seed, source, target, workers = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    peak = [0]
    stop = threading.Event()

    def anon_kb() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        return 0

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.002)

    base_kb = anon_kb()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    res = pull(local, seed, source, target, workers=workers)
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    peak[0] = max(peak[0], anon_kb())
    hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    print(json.dumps({"peak_anon_mb": peak[0] / 1024, "start_anon_mb": base_kb / 1024, "vmhwm_mb": hwm / 1024,
                      "seconds": dt, "action": res.action}))


def measure_rss(local: str, seed: str, source: str, target: int, workers: int) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--rss-child", local, seed, source, str(target), str(workers)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def gpu_diff_probe(stream: RLStream, lr: float) -> str | None:
    """On a GPU: diff on the device and move only the changed elements, against moving all."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    old = {n: w.to(torch.bfloat16) for n, w in stream.master.items()}
    stream.step(lr)
    new = {n: w.to(torch.bfloat16) for n, w in stream.master.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    full = [t.view(torch.int16).cpu() for t in new.values()]
    torch.cuda.synchronize()
    t_full = time.perf_counter() - t0
    nbytes_full = sum(t.numel() * 2 for t in full)
    t0 = time.perf_counter()
    moved = 0
    for n in new:
        a, b = old[n].view(torch.int16).reshape(-1), new[n].view(torch.int16).reshape(-1)
        idx = torch.nonzero(a != b).squeeze(1).to(torch.int32)
        vals = b[idx.long()]
        moved += idx.numel() * 6
        idx.cpu(), vals.cpu()
    torch.cuda.synchronize()
    t_sparse = time.perf_counter() - t0
    return (
        f"GPU diff: move all {nbytes_full / MB:.0f} MB to host {t_full:.3f}s; diff on GPU + move changed only "
        f"{moved / MB:.1f} MB {t_sparse:.3f}s ({t_full / t_sparse:.1f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--device", default="cpu", help="where the trainer simulation runs (cuda on a GPU box)")
    ap.add_argument("--steps", type=int, default=len(DEFAULT_STEPS), help="use the first N steps (the last is dense)")
    ap.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each per-core publish measurement (best is kept)")
    ap.add_argument("--percore-mb", type=float, default=0, help="measure per-core publish on a subset of about this size")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--rss-child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child)
        return

    import logging

    logging.basicConfig(level=logging.WARNING)
    N = args.workers
    steps = DEFAULT_STEPS[: max(2, args.steps - 1)] + [DEFAULT_STEPS[-1]] if args.steps < len(DEFAULT_STEPS) else DEFAULT_STEPS
    machine = describe_machine()
    root = args.workdir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    work = os.path.join(root, f"weightsync-bench-{os.getpid()}")
    os.makedirs(work)
    print(f"machine: {machine}\nworkdir: {work}  preset: {args.preset}  workers: {N}  load: {os.getloadavg()}", flush=True)
    try:
        report = run(args, N, steps, machine, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report)
    if not args.no_append:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write(report + "\n")


def run(args, N: int, steps, machine: str, work: str) -> str:
    global METER
    METER = CpuMeter()
    t_gen = time.perf_counter()
    stream = RLStream(PRESETS[args.preset], device=args.device)
    v0 = stream.bf16()
    total_nbytes = sum(a.nbytes for a in v0.values())
    seed = os.path.join(work, "seed")
    seed_file = write_checkpoint(seed, v0)
    pubs = {}
    locals_ = {}
    for enc in ENCODINGS:
        src = os.path.join(work, f"src-{enc}")
        pubs[enc] = Publisher(src, encoding=enc, workers=N, prune=False)  # the catch-up needs the whole chain
        pubs[enc].seed_snapshot(as_raw(v0))
        locals_[enc] = os.path.join(work, f"local-{enc}")
        pull(locals_[enc], seed, src, 0, workers=N)
    base_dir = os.path.join(work, "baseline")
    os.makedirs(base_dir)
    base_local = os.path.join(base_dir, "local.safetensors")
    shutil.copyfile(seed_file, base_local)
    base_pool_n = ThreadPoolExecutor(N)
    base_pool_1 = ThreadPoolExecutor(1)
    # per-core figures on a subset (every k-th tensor by name) when --percore-mb is below the size
    names = sorted(v0)
    subset = names
    if args.percore_mb and args.percore_mb * MB < total_nbytes:
        k = max(1, int(total_nbytes / (args.percore_mb * MB)))
        subset = names[::k]
    scale = total_nbytes / sum(v0[n].nbytes for n in subset)
    pub1s = {enc: Publisher(os.path.join(work, f"percore-{enc}"), encoding=enc, workers=1) for enc in ENCODINGS}
    # encoding "auto": its real sample per step (the sample does not depend on the link; each
    # declared link is one more choose() on it), on the publisher's pool as in a publish
    choosers = [EncodingChooser(Cost.from_knobs(link), 1, pubs["sparse-v1"]._pool) for link in AUTO_LINKS]
    print(f"checkpoint: {len(v0)} tensors, {total_nbytes / MB:.0f} MB bf16 (set-up {time.perf_counter() - t_gen:.1f}s)", flush=True)

    rows = []
    prev = v0
    base_files = []
    for i, (lr, label) in enumerate(steps, start=1):
        cur = stream.step(lr)
        raw = as_raw(cur)
        row = {"step": i, "label": label}
        # publish per core: one worker, CPU seconds, best of --reps, on the per-core subset (scaled
        # to the whole checkpoint); the order-0 entropy is measured on the same subset
        sub_prev = {n: prev[n] for n in subset}
        sub_cur = {n: cur[n] for n in subset}
        _, row["base_pub1_s"], _ = min((METER.run(base.prepare, sub_prev, sub_cur, 1, base_pool_1) for _ in range(args.reps)),
                                       key=lambda t: t[1])
        row["base_pub1_s"] *= scale
        row["entropy_sub"] = order0_entropy_nbytes(sub_prev, sub_cur)
        row["ctx_entropy_sub"] = context_entropy_nbytes(sub_prev, sub_cur)
        row["nb_entropy_sub"] = context_entropy_nbytes(sub_prev, sub_cur, neighbours=True)
        for enc in ENCODINGS:
            pub1s[enc].seed_snapshot(as_raw(sub_prev), version=i - 1)
            runs = [METER.run(pub1s[enc].prepare, i, as_raw(sub_cur)) for _ in range(args.reps)]
            row[f"{enc}_pub1_s"] = min(r[1] for r in runs) * scale
            row[f"{enc}_wire_sub"] = runs[0][0].delta_nbytes
            del runs
        # publish with all workers (wall), then write: the baseline's files and our versions
        (bprep, _), _, row["base_pubN_s"] = METER.run(base.prepare, prev, cur, N, base_pool_n)
        row["base_wire"] = sum(len(f) for f, _ in bprep.values() if f is not None)
        bfile = os.path.join(base_dir, f"delta-{i:03d}.safetensors")
        base.write_delta(bfile, bprep)
        base_files.append(bfile)
        del bprep
        sample, _, row["auto_sample_s"] = METER.run(choosers[0].sample, i, pubs["sparse-v1"].snapshot.jobs(raw))
        row["auto"] = [_auto_choice(c, sample, pubs["sparse-v1"].full_above_changed_fraction) for c in choosers]
        for enc in ENCODINGS:
            pub = pubs[enc]
            prepared, _, row[f"{enc}_pubN_s"] = METER.run(pub.prepare, i, raw)
            row[f"{enc}_wire"] = prepared.delta_nbytes
            row["changed"] = prepared.changed_elements / prepared.total_elements
            row[f"{enc}_kind"] = publish_prepared(pub, prepared)
            if row[f"{enc}_kind"] == "full":  # what actually crossed the wire
                row[f"{enc}_wire"] = prepared.full_nbytes
            del prepared
        # pull one version: ours, then the baseline
        for enc in ENCODINGS:
            res, row[f"{enc}_pullcpu_s"], _ = METER.run(pull, locals_[enc], seed, os.path.join(work, f"src-{enc}"), i, workers=N)
            assert res.applied_version == i, res
            # apply + verify + flush of a delta; the seed copy of a full version
            row[f"{enc}_pull_s"] = res.seed_s + res.apply_s + res.flush_s
            row[f"{enc}_pullwall_s"] = res.seconds  # the whole pull() call (plan, lock, marker, clean-up)
            row[f"{enc}_pull_action"] = res.action
        _, row["base_pullcpu_s"], row["base_pull_s"] = METER.run(base.apply, base_local, [bfile], N)
        rows.append(row)
        print(_row_line(row, total_nbytes), flush=True)
        prev = cur
    base_pool_n.shutdown()
    base_pool_1.shutdown()

    # catch-up over CATCHUP pending deltas, pull scaling, peak memory
    n_cu = min(CATCHUP, len(steps) - 1)
    extra = {}
    for enc in ENCODINGS:
        src = os.path.join(work, f"src-{enc}")
        loc = os.path.join(work, f"catchup-{enc}")
        pull(loc, seed, src, 0, workers=N)
        res, extra[f"{enc}_catchupcpu_s"], _ = METER.run(pull, loc, seed, src, n_cu, workers=N)
        extra[f"{enc}_catchup_s"] = res.apply_s + res.flush_s
        extra[f"{enc}_reseed_s"] = pull(loc, seed, src, 0, workers=N).seed_s  # what a full version costs
        res = pull(loc, seed, src, 1, workers=1)
        extra[f"{enc}_pull1w_s"] = res.apply_s + res.flush_s
        pull(loc, seed, src, 0, workers=N)
        res = pull(loc, seed, src, 1, workers=N)
        extra[f"{enc}_pullNw_s"] = res.apply_s + res.flush_s
        pull(loc, seed, src, 0, workers=N)
        extra[f"{enc}_rss"] = measure_rss(loc, seed, src, n_cu, N)
        shutil.rmtree(loc, ignore_errors=True)
    cu_local = os.path.join(base_dir, "catchup.safetensors")
    shutil.copyfile(seed_file, cu_local)
    _, extra["base_catchupcpu_s"], extra["base_catchup_s"] = METER.run(base.apply, cu_local, base_files[:n_cu], N)
    shutil.copyfile(seed_file, cu_local)
    extra["base_pull1w_s"] = base.apply(cu_local, base_files[:1], 1)
    shutil.copyfile(seed_file, cu_local)
    extra["base_pullNw_s"] = base.apply(cu_local, base_files[:1], N)
    gpu_line = gpu_diff_probe(stream, steps[0][0]) if args.device != "cpu" else None
    return _report(args, machine, N, total_nbytes, len(v0), rows, extra, n_cu, gpu_line)


def _auto_choice(chooser: EncodingChooser, sample, dense_fraction: float) -> tuple[str, float, float]:
    """(encoding, estimated extra apply s, estimated saved bytes) at the chooser's declared link."""
    est = chooser.estimate(sample)
    return chooser.choose(sample, dense_fraction).encoding, est.extra_apply_s, est.v1_nbytes - est.v2_nbytes


def _report_auto(rows: list[dict]) -> list[str]:
    """What encoding "auto" chose per step, against the choice this run's own measurements make
    (sparse-v2 when the bytes it saved, at the link, outweigh its measured extra pull CPU)."""
    realistic = [r for r in rows if r["label"] != "dense"]
    short = {"sparse-v1": "v1", "sparse-v2": "v2"}
    parts = []
    for k, link in enumerate(AUTO_LINKS):
        picks = " ".join(short.get(r["auto"][k][0], r["auto"][k][0]) for r in rows)
        oracle = [("sparse-v2" if (r["sparse-v1_wire"] - r["sparse-v2_wire"]) / link
                   > r["sparse-v2_pullcpu_s"] - r["sparse-v1_pullcpu_s"] else "sparse-v1") for r in realistic]
        agree = sum(r["auto"][k][0] == o for r, o in zip(realistic, oracle))
        parts.append(f"at {link / 1e6:g} MB/s per puller {picks} (the measured figures agree on {agree}/{len(realistic)} "
                     "realistic steps)")
    est = sum(r["auto"][0][1] for r in realistic)
    measured = sum(r["sparse-v2_pullcpu_s"] - r["sparse-v1_pullcpu_s"] for r in realistic)
    saved_est = sum(r["auto"][0][2] for r in realistic)
    saved = sum(r["sparse-v1_wire"] - r["sparse-v2_wire"] for r in realistic)
    sample_s = sum(r["auto_sample_s"] for r in rows)
    pub_s = sum(r["sparse-v1_pubN_s"] for r in rows)
    return [
        f"- encoding auto, per step (the dense one last): {'; '.join(parts)}; on realistic steps its sample estimated "
        f"{saved_est / MB:.2f} MB saved (measured {saved / MB:.2f}) and {est:.2f} CPU-s of extra apply (measured "
        f"{measured:.2f}); the sample took {100 * sample_s / max(pub_s, 1e-9):.0f}% of sparse-v1's publish time (wall)",
    ]


def _row_line_v2(r: dict, total: int) -> str:
    gbs = lambda key: total / r[key] / 1e9  # noqa: E731
    trio = lambda fmt: " ".join("%5.2f" % gbs(fmt % who) for who in ("base", "sparse-v1", "sparse-v2"))  # noqa: E731
    return (
        f"| {r['step']:>2} {r['label']:<7} | {r['sparse-v2_wire'] / MB:7.2f} | {r['sparse-v2_wire'] / r['sparse-v1_wire']:5.3f}x "
        f"| {r['sparse-v2_wire'] / r['base_wire']:5.3f}x | {r['sparse-v2_wire_sub'] / max(r['entropy_sub'], 1):5.2f}x "
        f"| {r['sparse-v2_wire_sub'] / max(r['ctx_entropy_sub'], 1):5.2f}x | {r['ctx_entropy_sub'] / max(r['entropy_sub'], 1):5.3f} "
        f"| {r['sparse-v2_wire_sub'] / max(r['nb_entropy_sub'], 1):5.2f}x | {r['nb_entropy_sub'] / max(r['entropy_sub'], 1):5.3f} "
        f"| {trio('%s_pub1_s')} | {trio('%s_pull_s')} | {trio('%s_pullcpu_s')} | {r['sparse-v2_kind']} |"
    )


def _row_line(r: dict, total: int) -> str:
    gbs = lambda key: total / r[key] / 1e9  # noqa: E731
    trio = lambda fmt: " ".join("%5.2f" % gbs(fmt % who) for who in ("base", "sparse-v1", "xor"))  # noqa: E731
    return (
        f"| {r['step']:>2} {r['label']:<7} | {100 * r['changed']:6.2f}% "
        f"| {r['base_wire'] / MB:7.2f} | {r['sparse-v1_wire'] / MB:7.2f} {r['sparse-v1_wire'] / r['base_wire']:5.3f}x "
        f"| {r['xor_wire'] / r['base_wire']:5.3f}x | {r['sparse-v1_wire_sub'] / max(r['entropy_sub'], 1):5.2f}x "
        f"| {trio('%s_pub1_s')} | {trio('%s_pubN_s')} | {trio('%s_pull_s')} | {trio('%s_pullcpu_s')} "
        f"| {r['sparse-v1_kind']} |"
    )


def _report(args, machine, N, total, ntensors, rows, extra, n_cu, gpu_line) -> str:
    realistic = [r for r in rows if r["label"] != "dense"]
    dense = [r for r in rows if r["label"] == "dense"]

    def agg(key: str) -> float:
        return sum(r[key] for r in realistic)

    wire_worst = max(r["sparse-v1_wire"] / r["base_wire"] for r in realistic)
    wire_mean = agg("sparse-v1_wire") / agg("base_wire")
    pub1 = agg("base_pub1_s") / agg("sparse-v1_pub1_s")
    pub1_worst = min(r["base_pub1_s"] / r["sparse-v1_pub1_s"] for r in realistic)
    pub1_xor = agg("base_pub1_s") / agg("xor_pub1_s")
    pubN = agg("base_pubN_s") / agg("sparse-v1_pubN_s")
    pull_sp = agg("base_pull_s") / agg("sparse-v1_pull_s")
    pull_sp_worst = min(r["base_pull_s"] / r["sparse-v1_pull_s"] for r in realistic)
    pull_xor = agg("base_pull_s") / agg("xor_pull_s")
    pullcpu_sp = agg("base_pullcpu_s") / agg("sparse-v1_pullcpu_s")
    pullcpu_xor = agg("base_pullcpu_s") / agg("xor_pullcpu_s")
    cu_cpu = {enc: extra[f"{enc}_catchupcpu_s"] / (sum(r[f"{enc}_pullcpu_s"] for r in realistic[:n_cu]) / n_cu)
              for enc in ENCODINGS}
    cu_cpu_base = extra["base_catchupcpu_s"] / (sum(r["base_pullcpu_s"] for r in realistic[:n_cu]) / n_cu)
    single = {enc: sum(r[f"{enc}_pull_s"] for r in realistic[:n_cu]) / n_cu for enc in ENCODINGS}
    single_base = sum(r["base_pull_s"] for r in realistic[:n_cu]) / n_cu
    cu = {enc: extra[f"{enc}_catchup_s"] / single[enc] for enc in ENCODINGS}
    cu_base = extra["base_catchup_s"] / single_base
    rss = extra["sparse-v1_rss"]
    chunk_mb = 2.0
    rss_bound = 256 + N * chunk_mb
    fell_back = all(r["sparse-v1_kind"] == "full" for r in dense)

    dense_changed = ", ".join("%.0f%% changed" % (100 * r["changed"]) for r in dense)
    dense_kinds = ", ".join(r["sparse-v1_kind"] for r in dense)
    dense_base = ", ".join("%.0f%%" % (100 * r["base_wire"] / total) for r in dense)

    def ok(flag: bool) -> str:
        return "MET" if flag else "NOT MET"

    lines = [
        f"## {args.date} — preset {args.preset}: {ntensors} tensors, {total / MB:.0f} MB bf16, {N} workers",
        "",
        f"Machine: {machine}. Files on {args.workdir or '/dev/shm'}. Load average at the end "
        f"{', '.join('%.1f' % x for x in os.getloadavg())} (other jobs share this box: wall times are noisy).",
        "",
        "Throughputs in GB of checkpoint per second. pub/core: publish (diff + encode + compress + checksum",
        "from host memory) on one worker, per CPU-second; pubN: all workers, wall; pull: apply + verify + flush",
        "of one version, wall; pull/cpu: the same per CPU-second (garbage-collector pauses excluded).",
        "wire: delta payload bytes; H0: order-0 entropy of the change (per tensor). Each trio: base sparse-v1 xor.",
        "",
        "| step       | changed | base MB | sparse-v1 MB /base | xor/base | sp/H0 | pub/core b sp xor | pubN b sp xor     | pull b sp xor     | pull/cpu b sp xor | sp kind |",
        "|------------|---------|---------|--------------------|----------|-------|-------------------|-------------------|-------------------|-------------------|---------|",
        *(_row_line(r, total) for r in rows),
        "",
        f"- wire bytes, sparse-v1 / baseline on realistic steps: worst {wire_worst:.3f}x, overall {wire_mean:.3f}x "
        f"(target <= 0.55x on every step: {ok(wire_worst <= 0.55)}); against order-0 entropy "
        f"{agg('sparse-v1_wire_sub') / agg('entropy_sub'):.2f}x",
        f"- dense step ({dense_changed}): sparse-v1 published {dense_kinds} (full expected: {ok(fell_back)}); "
        f"baseline xor would be {dense_base} of the full size",
        f"- publish per core (CPU-seconds, one worker), baseline / ours: sparse-v1 {pub1:.2f}x (worst step {pub1_worst:.2f}x; target >= 1.5x: "
        f"{ok(pub1 >= 1.5)}), xor {pub1_xor:.2f}x (target >= 1: {ok(pub1_xor >= 1.0)}); with {N} workers sparse-v1 {pubN:.2f}x",
        f"- pull (apply + verify + flush): sparse-v1 {pull_sp:.2f}x the baseline (worst step {pull_sp_worst:.2f}x; "
        f"target >= 2x: {ok(pull_sp >= 2.0)}), xor {pull_xor:.2f}x (target >= 1.3x: {ok(pull_xor >= 1.3)}); "
        f"per CPU-second sparse-v1 {pullcpu_sp:.2f}x ({ok(pullcpu_sp >= 2.0)}), xor {pullcpu_xor:.2f}x ({ok(pullcpu_xor >= 1.3)})",
        f"- catch-up over {n_cu} pending deltas / one delta: sparse-v1 {cu['sparse-v1']:.2f}x, xor {cu['xor']:.2f}x, "
        f"baseline {cu_base:.2f}x (target <= 2x: sparse-v1 {ok(cu['sparse-v1'] <= 2)}, xor {ok(cu['xor'] <= 2)}); "
        f"absolute {extra['sparse-v1_catchup_s']:.2f}s / {extra['xor_catchup_s']:.2f}s / {extra['base_catchup_s']:.2f}s; "
        f"in CPU-seconds sparse-v1 {cu_cpu['sparse-v1']:.2f}x, xor {cu_cpu['xor']:.2f}x, baseline {cu_cpu_base:.2f}x",
        f"- pull scaling 1 -> {N} workers (step 1): sparse-v1 {extra['sparse-v1_pull1w_s'] / extra['sparse-v1_pullNw_s']:.2f}x, "
        f"xor {extra['xor_pull1w_s'] / extra['xor_pullNw_s']:.2f}x, baseline {extra['base_pull1w_s'] / extra['base_pullNw_s']:.2f}x",
        f"- puller peak anonymous memory (catch-up of {n_cu}, subprocess): sparse-v1 {rss['peak_anon_mb']:.0f} MB, "
        f"xor {extra['xor_rss']['peak_anon_mb']:.0f} MB (bound 256 MB + {N} x {chunk_mb:.0f} MB: "
        f"{ok(max(rss['peak_anon_mb'], extra['xor_rss']['peak_anon_mb']) < rss_bound)}); VmHWM incl. mapped file pages "
        f"{rss['vmhwm_mb']:.0f} MB",
        f"- absolute, realistic steps summed: publish per core base {agg('base_pub1_s'):.2f}s, sparse-v1 "
        f"{agg('sparse-v1_pub1_s'):.2f}s, xor {agg('xor_pub1_s'):.2f}s; pull base {agg('base_pull_s'):.2f}s, sparse-v1 "
        f"{agg('sparse-v1_pull_s'):.2f}s, xor {agg('xor_pull_s'):.2f}s; whole pull() calls sparse-v1 "
        f"{agg('sparse-v1_pullwall_s'):.2f}s, xor {agg('xor_pullwall_s'):.2f}s (plan, lock, marker, clean-up included)",
        f"- a full version instead (seed copy of the checkpoint on pull): {extra['sparse-v1_reseed_s']:.2f}s; the dense "
        f"step pulled ({dense_kinds}) in {', '.join('%.2fs' % r['sparse-v1_pull_s'] for r in dense)}",
    ]
    lines += _report_v2(N, total, rows, extra, n_cu, ok)
    lines += _report_auto(rows)
    if gpu_line:
        lines.append(f"- {gpu_line}")
    return "\n".join(lines) + "\n"


def _report_v2(N, total, rows, extra, n_cu, ok) -> list[str]:
    """sparse-v2 beside sparse-v1 and the baseline, same run, same data."""
    realistic = [r for r in rows if r["label"] != "dense"]

    def agg(key: str) -> float:
        return sum(r[key] for r in realistic)

    worst_v1 = max(r["sparse-v2_wire"] / r["sparse-v1_wire"] for r in realistic)
    worst_base = max(r["sparse-v2_wire"] / r["base_wire"] for r in realistic)
    pub1 = agg("base_pub1_s") / agg("sparse-v2_pub1_s")
    pull = agg("base_pull_s") / agg("sparse-v2_pull_s")
    pull_worst = min(r["base_pull_s"] / r["sparse-v2_pull_s"] for r in realistic)
    pull_v1 = agg("sparse-v1_pull_s") / agg("sparse-v2_pull_s")
    pullcpu = agg("base_pullcpu_s") / agg("sparse-v2_pullcpu_s")
    single = sum(r["sparse-v2_pull_s"] for r in realistic[:n_cu]) / n_cu
    rss = extra["sparse-v2_rss"]
    return [
        "",
        f"sparse-v2 (bitstream {codec_sparse2.writer_bitstream()}: "
        + ("range coded, contexts the old element's exponent and the changes among the previous 64 elements"
           if codec_sparse2.writer_bitstream() == codec_sparse2.VERSION_RC else "classes of the old element's exponent")
        + "), same run: wire against sparse-v1 and the baseline;",
        "H0: order-0 entropy; Hctx: entropy given the old element's exponent (per tensor); Hnb: the same with the",
        "change mask also given the neighbourhood bucket (bitstream 3's context); H/H0 the bound such a context",
        "allows (static estimates: an adaptive coder pays a learning cost on top). Each trio: base sparse-v1 sparse-v2.",
        "",
        "| step       | v2 MB   | /v1    | /base  | v2/H0 | v2/Hctx | Hctx/H0 | v2/Hnb | Hnb/H0 | pub/core b v1 v2  | pull b v1 v2      | pull/cpu b v1 v2  | v2 kind |",
        "|------------|---------|--------|--------|-------|---------|---------|--------|--------|-------------------|-------------------|-------------------|---------|",
        *(_row_line_v2(r, total) for r in rows),
        "",
        f"- sparse-v2 wire bytes on realistic steps: worst {worst_v1:.3f}x sparse-v1's, overall "
        f"{agg('sparse-v2_wire') / agg('sparse-v1_wire'):.3f}x (target <= 0.72x on every step: {ok(worst_v1 <= 0.72)}); "
        f"against the baseline worst {worst_base:.3f}x, overall {agg('sparse-v2_wire') / agg('base_wire'):.3f}x "
        f"(target <= 0.33x: {ok(worst_base <= 0.33)})",
        f"- sparse-v2 against the entropy: {agg('sparse-v2_wire_sub') / agg('entropy_sub'):.3f}x order-0, "
        f"{agg('sparse-v2_wire_sub') / agg('ctx_entropy_sub'):.3f}x the exponent-conditional estimate "
        f"(which is {agg('ctx_entropy_sub') / agg('entropy_sub'):.3f}x order-0), "
        f"{agg('sparse-v2_wire_sub') / agg('nb_entropy_sub'):.3f}x the exponent-and-neighbourhood one "
        f"({agg('nb_entropy_sub') / agg('entropy_sub'):.3f}x order-0); sparse-v1 "
        f"{agg('sparse-v1_wire_sub') / agg('entropy_sub'):.3f}x order-0",
        f"- sparse-v2 publish per core: {pub1:.2f}x the baseline (target >= 1.0x: {ok(pub1 >= 1.0)}); "
        f"sparse-v1 {agg('base_pub1_s') / agg('sparse-v1_pub1_s'):.2f}x",
        f"- sparse-v2 pull (apply + verify + flush): {pull:.2f}x the baseline (worst step {pull_worst:.2f}x; target >= 1.0x: "
        f"{ok(pull >= 1.0)}), {pull_v1:.2f}x sparse-v1's; per CPU-second {pullcpu:.2f}x the baseline",
        f"- sparse-v2 catch-up over {n_cu} / one delta: {extra['sparse-v2_catchup_s'] / single:.2f}x "
        f"({extra['sparse-v2_catchup_s']:.2f}s); pull scaling 1 -> {N} workers "
        f"{extra['sparse-v2_pull1w_s'] / extra['sparse-v2_pullNw_s']:.2f}x",
        f"- sparse-v2 puller peak anonymous memory (catch-up of {n_cu}, subprocess): {rss['peak_anon_mb']:.0f} MB "
        f"(sparse-v1 {extra['sparse-v1_rss']['peak_anon_mb']:.0f} MB; bound 256 MB + {N} x 2 MB: "
        f"{ok(rss['peak_anon_mb'] < 256 + 2 * N)})",
    ]


if __name__ == "__main__":
    main()
