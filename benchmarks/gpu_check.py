"""The GPU kit's driver (run by benchmarks/gpu_check.sh; see benchmarks/README.md "The GPU kit").

Subcommands, each one process so a time limit or a crash stops one part only:

    wheels   check the carried wheel set against benchmarks/gpu_wheels.txt (one wheel per pin,
             CPython 3.12 manylinux x86_64) and the 64 MiB limit with the working tree; list
             which of them this interpreter can install
    mirror   fill the rehearsal's box-mirror folder (gpu_mirror/sitecustomize.py)
    engine   live apply on the device, in process, with sglang's own Qwen3 class: the map learnt
             from its load_weights and proven; v1 (1% changed) and v2 (4% of v1) published and
             pulled for real; each staged from the pull, a fault injected mid-scatter (must
             restore exactly), then patched (pointers unchanged, every parameter bit-identical
             to load_weights of that version); the pause (CUDA events) against that reload
    trainer  the trainer's tests on the device (torch_publish's CUDA compare among them), and
             the bytes its device-side diff moves to the host per step against the full model's
    merge    the parts' JSON into one, with the targets judged

Every part writes its JSON after each step, so a part stopped at its limit still says how far
it got.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import traceback
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

WHEELS_FILE = os.path.join(HERE, "gpu_wheels.txt")
BOX_PACKAGES_FILE = os.path.join(HERE, "gpu_box_packages.txt")
TRAVEL_LIMIT = 64 << 20  # what the device tool carries: the working tree and the wheels together
PAUSE_TARGET_MS = 50.0  # at 4% changed (issue 20)
PAUSE_TARGET_RATIO = 0.05
MiB = 1 << 20


def norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str = WHEELS_FILE) -> dict[str, str]:
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[norm_name(name)] = version.strip()
    return pins


def read_box_packages(path: str = BOX_PACKAGES_FILE) -> set[str]:
    with open(path) as f:
        return {norm_name(line.strip()) for line in f if line.strip() and not line.startswith("#")}


class Recorder:
    """One part's JSON, rewritten after every step."""

    def __init__(self, path: str, **head: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {"steps_done": [], **head}
        self.t0 = time.perf_counter()
        self.save()

    def step(self, name: str, **values: Any) -> None:
        self.data.update(values)
        self.data["steps_done"].append(name)
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 3)
        self.save()
        print(f"[gpu_check] {name}: " + ", ".join(f"{k}={_short(v)}" for k, v in values.items()), flush=True)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            self.data["error"] = f"{type(exc).__name__}: {exc}"
            self.data["traceback"] = traceback.format_exc()[-6000:]
            self.save()
            raise


def _short(v: Any) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) < 160 else s[:157] + "..."


# --- wheels -----------------------------------------------------------------------------------


def wheel_name_version(filename: str) -> tuple[str, str]:
    parts = os.path.basename(filename).split("-")
    return norm_name(parts[0]), parts[1]


def working_tree_nbytes() -> int | None:
    """Tracked files plus untracked files git does not ignore: what the device tool carries
    (None where there is no git or no repository: the box's copy of the tree)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for rel in out.split(b"\0"):
        path = os.path.join(REPO, rel.decode())
        if rel and os.path.isfile(path) and not os.path.islink(path):
            total += os.path.getsize(path)
    return total


def check_wheels(wheel_dir: str) -> dict:
    """The carried set against the pins and the size limit; which wheels install on this Python."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    pins = read_pins()
    box = read_box_packages()
    here_tags = set(sys_tags())
    files = sorted(f for f in os.listdir(wheel_dir) if f.endswith(".whl")) if os.path.isdir(wheel_dir) else []
    problems, found, installable, not_here = [], {}, [], []
    for f in files:
        name, version = wheel_name_version(f)
        _, _, _, tags = parse_wheel_filename(f)
        if name in found:
            problems.append(f"two wheels of {name}: {found[name]} and {f} (one version each: two stop the install)")
        found[name] = f
        if name not in pins:
            problems.append(f"{f} is not in gpu_wheels.txt")
        elif pins[name] != version:
            problems.append(f"{f}: gpu_wheels.txt pins {name}=={pins[name]}")
        box_ok = any(t.interpreter in ("cp312", "py3") and t.abi in ("cp312", "abi3", "none")
                     and (t.platform == "any" or (t.platform.startswith("manylinux") and t.platform.endswith("x86_64")))
                     for t in tags)
        if not box_ok:
            problems.append(f"{f} does not install on the box (CPython 3.12, manylinux x86_64)")
        (installable if tags & here_tags else not_here).append(f)
    for name in sorted(set(pins) - set(found)):
        problems.append(f"{name}=={pins[name]} is pinned but not in {wheel_dir} (run: bash benchmarks/gpu_check.sh fetch)")
    for name in sorted(set(pins) & box):
        problems.append(f"{name} is on the box already (gpu_box_packages.txt): carrying another version shadows it")
    wheels_nbytes = sum(os.path.getsize(os.path.join(wheel_dir, f)) for f in files)
    tree = working_tree_nbytes()
    tree_nbytes = tree or 0
    if tree is not None and wheels_nbytes + tree_nbytes > TRAVEL_LIMIT:
        problems.append(f"the wheels ({wheels_nbytes / MiB:.1f} MiB) and the working tree ({tree_nbytes / MiB:.1f} MiB) "
                        f"pass the {TRAVEL_LIMIT / MiB:.0f} MiB the device tool carries")
    return {
        "wheels": len(files), "wheels_mib": round(wheels_nbytes / MiB, 2), "tree_mib": None if tree is None else round(tree_nbytes / MiB, 2),
        "travel_mib": None if tree is None else round((wheels_nbytes + tree_nbytes) / MiB, 2), "limit_mib": TRAVEL_LIMIT // MiB,
        "installable_here": installable, "not_installable_here": [wheel_name_version(f)[0] for f in not_here],
        "problems": problems,
    }


def cmd_wheels(args) -> int:
    report = check_wheels(args.wheel_dir)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    with open(args.installable, "w") as f:
        f.write("".join(os.path.join(args.wheel_dir, w) + "\n" for w in report["installable_here"]))
    print(f"[gpu_check] wheels: {report['wheels']} wheels, {report['wheels_mib']} MiB; with the working tree "
          f"{report['travel_mib']} of {report['limit_mib']} MiB; not installable on this Python: "
          f"{report['not_installable_here'] or 'none'}")
    for p in report["problems"]:
        print(f"[gpu_check] wheels: PROBLEM: {p}")
    return 1 if report["problems"] else 0


# --- the box mirror ---------------------------------------------------------------------------


def cmd_mirror(args) -> int:
    """Link every installed distribution the box also has (and ``--also``) into ``args.dir``."""
    from importlib.metadata import distributions

    allowed = read_box_packages() | {norm_name(n) for n in args.also.split(",") if n.strip()}
    pins = read_pins()
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    os.makedirs(args.dir, exist_ok=True)
    linked, refused, version_drift = 0, [], []
    for dist in distributions(path=[site]):
        name = norm_name(dist.metadata["Name"])
        if name not in allowed:
            refused.append(name)
            continue
        if name in pins and pins[name] != dist.version:
            version_drift.append(f"{name}: carried {pins[name]}, here {dist.version}")
        for top in {f.parts[0] for f in (dist.files or []) if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            src, dst = os.path.join(site, top), os.path.join(args.dir, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
                linked += 1
    print(f"[gpu_check] mirror: {linked} entries of the box's packages linked; {len(refused)} distributions "
          "installed here are hidden (not on the box, not carried)")
    for d in version_drift:
        print(f"[gpu_check] mirror: PROBLEM: the rehearsal's twin differs from the carried wheel: {d}")
    return 1 if version_drift else 0


# --- the engine part --------------------------------------------------------------------------


@contextlib.contextmanager
def sglang_cpu_view() -> Iterator[None]:
    """sglang's module-level device probes answer "no CUDA" while this is held.

    The box has no sgl_kernel or flashinfer (far too large to carry), and sglang imports their
    CUDA entry points at module load when it sees a GPU. No forward pass runs here: what is
    proven is the loader's copies and our writes into parameters that do live on the device,
    so sglang takes its CPU import path (as in the CPU tests) while the tensors are CUDA's.
    """
    import torch

    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_available = real


def init_sglang_single_rank(port: int) -> None:
    """A one-rank gloo process group with sglang's parallel state (as tests/e2e/live_models_child.py)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
    from live_models_child import init_sglang_single_rank as init

    if not port:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    init(port)


class Timer:
    """Wall time of a block, after the device finished its work (CUDA events too when asked)."""

    def __init__(self, device: str, events: bool = False) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.events = events and self.cuda
        self.s = self.event_ms = 0.0

    def __enter__(self) -> "Timer":
        if self.cuda:
            self.torch.cuda.synchronize()
        if self.events:
            self.e0 = self.torch.cuda.Event(enable_timing=True)
            self.e1 = self.torch.cuda.Event(enable_timing=True)
            self.e0.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.events:
            self.e1.record()
        if self.cuda:
            self.torch.cuda.synchronize()
        self.s = time.perf_counter() - self.t0
        if self.events:
            self.event_ms = self.e0.elapsed_time(self.e1)


class Allocations:
    """What a block allocates (issue 19, point 9: nothing inside the pause): the torch ops that
    made a new tensor (``new_tensors``, ``tests/unit/live_support.NewTensors``, on any device)
    and on CUDA the caching allocator's allocation requests (``device_allocations``, from
    ``torch.cuda.memory_stats``: kernels' own workspaces too; None on the CPU)."""

    def __init__(self, device: str) -> None:
        unit_tests = os.path.join(REPO, "tests", "unit")
        if unit_tests not in sys.path:
            sys.path.insert(0, unit_tests)
        from live_support import NewTensors

        self.cuda = device.startswith("cuda")
        self.mode = NewTensors()
        self.new_tensors: list[str] = []
        self.device_allocations: int | None = None

    @staticmethod
    def _requests() -> int:
        import torch

        return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))

    def __enter__(self) -> "Allocations":
        self.before = self._requests() if self.cuda else 0
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        self.new_tensors = list(self.mode.created)
        if self.cuda:
            self.device_allocations = self._requests() - self.before


def pinned_host_blocks() -> dict:
    """The caching host allocator's pinned blocks (CUDA only; {} elsewhere or where torch lacks it)."""
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    stats = torch.cuda.host_memory_stats()
    return {k: stats[k] for k in ("num_host_alloc", "active_requests.allocated", "allocated_bytes.current") if k in stats}


def fence_ordering(staged: Any, device: str, sleep_ms: float = 50.0) -> dict:
    """The real CUDA fence (``sglang_patch.live.scatter.device.CudaFence``) with a side stream standing
    in for sglang's forward stream: a 'forward' queued there before the pause (a sleep, then a
    read of an element the update writes) must read the old value (the writes waited for it on
    the device), a read queued there after the pause the new one (it waited for the writes'
    event), and the pause's wall clock must include the forward's sleep (it ends after the
    device did). Leaves the parameters as they were (restored)."""
    import torch

    from sglang_patch.live.scatter.device import CudaFence
    from sglang_patch.live.scatter.patch import scatter_with_undo

    p = max(staged.patches, key=lambda q: q.index.numel())
    k = int(p.index[0])
    old_value, new_value = p.flat[k].clone(), p.values[0].to(device)
    seen_before, seen_after = torch.empty_like(old_value), torch.empty_like(old_value)
    forward, schedule = torch.cuda.Stream(torch.device(device)), torch.cuda.Stream(torch.device(device))
    kept, staged.fence = staged.fence, CudaFence(torch.device(device), forward)
    cycles = int(sleep_ms * 1.5e6)  # about sleep_ms at 1.5 GHz; measured below
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(forward):
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
    torch.cuda.synchronize()
    sleep_ms = e0.elapsed_time(e1)
    try:
        with torch.cuda.stream(forward):
            torch.cuda._sleep(cycles)
            seen_before.copy_(p.flat[k])
        with torch.cuda.stream(schedule):  # the loop's stream, as sglang's scheduler thread has it
            t0 = time.perf_counter()
            undo, _ = scatter_with_undo(staged)
            pause_ms = (time.perf_counter() - t0) * 1e3
        with torch.cuda.stream(forward):
            seen_after.copy_(p.flat[k])
        torch.cuda.synchronize()
        out = {"forward_read_old_before_the_writes": bool(torch.equal(seen_before, old_value)),
               "forward_read_new_after_the_writes": bool(torch.equal(seen_after, new_value)),
               "pause_ms_with_a_forward_queued": round(pause_ms, 3), "forward_sleep_ms": round(sleep_ms, 3),
               "restored": undo.restore().restored}  # on the current stream: the fence orders it too
    finally:
        staged.fence = kept
    out["ok"] = (out["forward_read_old_before_the_writes"] and out["forward_read_new_after_the_writes"]
                 and out["pause_ms_with_a_forward_queued"] >= 0.9 * sleep_ms and out["restored"])
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def _workdir(root: str | None, need_gb: float) -> str:
    import shutil

    if root:
        return root
    for cand in ("/dev/shm", "/tmp"):
        try:
            if shutil.disk_usage(cand).free > need_gb * (1 << 30):
                return cand
        except OSError:
            continue
    return "/tmp"


def make_versions(shape, device: str, fractions: list[float], seed: int = 0):
    """v0 (bf16 of N(0, 0.02); norms N(1, 0.05)) made on the device, then each version flips the
    lowest mantissa bit of ``fraction`` of the previous one's elements (engine_data.py's rule,
    drawn with torch so 8 GB take seconds on a GPU). Yields (version, device tensors, host uint16)."""
    import numpy as np
    import torch

    from bench_data import qwen3_tensors

    gen = torch.Generator(device=device).manual_seed(seed)
    cur = {}
    for name, shp in qwen3_tensors(shape).items():
        x = torch.randn(shp, generator=gen, device=device, dtype=torch.float32)
        x = x * 0.05 + 1.0 if len(shp) == 1 else x * 0.02
        cur[name] = x.to(torch.bfloat16)
        del x

    def host(ts):
        return {n: t.view(torch.int16).cpu().numpy().view(np.uint16) for n, t in ts.items()}

    yield 0, cur, host(cur)
    for version, fraction in enumerate(fractions, start=1):
        nxt = {}
        for name, t in cur.items():
            new = t.clone()
            flat = new.view(-1).view(torch.int16)
            k = int(round(fraction * flat.numel()))
            if k:
                pos = torch.randint(0, flat.numel(), (k,), generator=gen, device=device).unique()
                flat[pos] ^= 1
            nxt[name] = new
        cur = nxt
        yield version, cur, host(cur)


def write_checkpoint(model_dir: str, tensors: dict, shape) -> None:
    """An HF checkpoint dir: config.json (Qwen3, tied embeddings) and ~1 GB bf16 shards."""
    from engine_data import config_json, write_sharded_weights

    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config_json(shape, 0), f, indent=1)
    write_sharded_weights(model_dir, tensors)


def checkpoint_files(directory: str) -> list[str]:
    from weightsync.format.manifest import checkpoint_weight_files

    return [os.path.join(directory, f) for f in checkpoint_weight_files(directory)]


def per_update_check(args: Any, cmap: Any, params: dict, local: str, version: int, staged: Any, pause_ms: float) -> dict:
    """Issue 19's check after an update (``sglang_patch.live.check``), on the weights that hold
    ``version``: a fresh sample against the local checkpoint and every scattered element against
    the staged value; then again with one planted wrong element, which it must find."""
    import torch

    from sglang_patch.live.mapping.coordinate_map import CheckpointReader
    from sglang_patch.live.check import SAMPLE_PER_TENSOR, SAMPLE_TENSORS_PER_UPDATE, check_update

    read = CheckpointReader(local).tensor
    with Timer(args.device) as t:
        check = check_update("bench", cmap, params, read, version=version, counter=1, patches=staged.patches,
                             max_tensors=SAMPLE_TENSORS_PER_UPDATE)
    with Timer(args.device) as t_sample:
        sample_only = check_update("bench", cmap, params, read, version=version, counter=2,
                                   max_tensors=SAMPLE_TENSORS_PER_UPDATE)
    p = staged.patches[0]
    bits = p.flat.view(torch.int16 if p.flat.element_size() == 2 else torch.int32)
    k = int(p.index[0])
    with torch.no_grad():
        bits[k] ^= 1  # one bit of one scattered element
        planted = check_update("bench", cmap, params, read, version=version, counter=3, patches=staged.patches,
                               max_tensors=SAMPLE_TENSORS_PER_UPDATE)
        bits[k] ^= 1
    return {"verified_elements": check.verified_elements, "mismatches": check.mismatches,
            "sampled_elements": check.sampled_elements, "scattered_elements": check.scattered_elements,
            "not_checkable_params": check.not_checkable_params, "sample_mismatches": sample_only.mismatches,
            "per_tensor": SAMPLE_PER_TENSOR, "tensors_per_update": SAMPLE_TENSORS_PER_UPDATE,
            "check_ms": round(t.s * 1e3, 3), "sample_only_ms": round(t_sample.s * 1e3, 3),
            "check_over_pause": round(t.s * 1e3 / pause_ms, 4) if pause_ms else None,
            "planted_found": planted.mismatches == 1, "planted_detail": planted.detail}


def differing_params(a: dict, b: dict) -> list[str]:
    """Names whose bytes differ (compared on the device, as integers: NaN and -0.0 count)."""
    from sglang_patch.live.mapping.coordinate_map import as_int_bits

    return sorted(n for n in a if not bool((as_int_bits(a[n]) == as_int_bits(b[n])).all()))


ENGINE_PRESETS = {"qwen3-4b": "qwen3-4b", "medium": "small", "small": "tiny"}  # -> bench_data.PRESETS (medium: ~300 MB)


def cmd_engine(args) -> int:
    import shutil

    import torch

    from bench_data import PRESETS

    rec = Recorder(args.json, part="engine", device=args.device, preset=args.preset)
    with rec.guarded():
        shape = PRESETS[ENGINE_PRESETS[args.preset]]
        fractions = [float(x) for x in args.fractions.split(",")]
        workers = os.cpu_count() or 1
        dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        rec.step("start", torch=torch.__version__, device_name=dev_name, python=sys.version.split()[0],
                 fractions=fractions, workers=workers)

        # sglang: its own Qwen3 class in a one-rank process group, parameters on the device
        t0 = time.perf_counter()
        with sglang_cpu_view():
            init_sglang_single_rank(args.port)
            import sglang
            from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
            from sglang.srt.models.qwen3 import Qwen3ForCausalLM
        from transformers import Qwen3Config

        from engine_data import config_json
        from sglang_patch.live.mapping.coordinate_map import CheckpointReader, build_coordinate_map, prove_map
        from sglang_patch.live.scatter.patch import StagedUpdate, finish_staging, reload_only_reasons, scatter_with_undo
        from sglang_patch.live.mapping.stage import StageJob, stage_job
        from sglang_patch.live.scatter.device import pause_fence_for
        from weightsync import Publisher, RawTensor, pull

        cfg = Qwen3Config(**{k: v for k, v in config_json(shape, 0).items() if k not in ("architectures",)})
        before_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        built_on = "the device"
        try:
            try:
                with sglang_cpu_view(), torch.device(args.device):
                    model = Qwen3ForCausalLM(cfg)
            except Exception as exc:  # a layer that asks sglang for its device: build on the CPU, then move
                built_on = f"the CPU, then moved ({type(exc).__name__}: {exc})"
                with sglang_cpu_view():
                    model = Qwen3ForCausalLM(cfg).to(args.device)
        finally:
            torch.set_default_dtype(before_dtype)
        params = {n: p.data for n, p in model.named_parameters()}
        on_device = sorted({str(p.device) for p in params.values()})
        rec.step("model", sglang=sglang.__version__, built_on=built_on, model_s=round(time.perf_counter() - t0, 3), params=len(params),
                 param_devices=on_device, param_nbytes=sum(p.numel() * p.element_size() for p in params.values()))

        def load(directory: str) -> float:
            with sglang_cpu_view(), Timer(args.device) as t:
                model.load_weights(safetensors_weights_iterator(checkpoint_files(directory)))
            return t.s

        work = os.path.join(_workdir(args.workdir, 20 if args.preset == "qwen3-4b" else 0.1), f"gpu-check-{os.getpid()}")
        model_dir, source, local = (os.path.join(work, d) for d in ("model", "source", "local"))
        if args.keep_model_dir:
            with open(args.keep_model_dir, "w") as f:
                f.write(model_dir)
        try:
            versions = make_versions(shape, args.device, fractions)
            _, dev0, host0 = next(versions)
            t0 = time.perf_counter()
            write_checkpoint(model_dir, host0, shape)
            pub = Publisher(source, workers=workers)
            pub.seed_snapshot({n: RawTensor("BF16", tuple(a.shape), a) for n, a in host0.items()})
            del dev0, host0
            rec.step("v0", data_dir=work, write_s=round(time.perf_counter() - t0, 3),
                     checkpoint_nbytes=sum(os.path.getsize(p) for p in checkpoint_files(model_dir)))

            reader0 = CheckpointReader(model_dir)
            with sglang_cpu_view():
                cmap = build_coordinate_map(model, reader0.specs())
            pull(local, model_dir, source, 0, workers=workers)
            reload_v0_s = load(local)
            proven = prove_map(cmap, params, CheckpointReader(local).tensor)
            mapped_params = {p.param for ps in cmap.placements.values() for p in ps}
            rec.step("map", map_build_s=round(cmap.build_s, 3), map_nbytes=cmap.nbytes(), proven=proven,
                     proof_s=round(cmap.proof_s, 3), proven_params=len(cmap.proven_params),
                     unproven=sorted(mapped_params - set(cmap.proven_params)),
                     reload_only_params=cmap.reload_only_params, reload_only_tensors=cmap.reload_only_tensors,
                     unused_tensors=sorted(cmap.unused_tensors), reload_v0_s=round(reload_v0_s, 3))
            if not proven or cmap.reload_only_params or cmap.reload_only_tensors:
                raise RuntimeError("the map is not proven for every parameter: live apply would reload")

            results = []
            for version, _dev, host in versions:
                frac = fractions[version - 1]
                row: dict[str, Any] = {"version": version, "fraction": frac}
                t0 = time.perf_counter()
                res = pub.publish(version, {n: RawTensor("BF16", tuple(a.shape), a) for n, a in host.items()})
                row.update(publish_s=round(time.perf_counter() - t0, 3), kind=res.kind, encoding=res.encoding,
                           changed_elements=res.changed_elements,
                           changed=res.changed_elements / max(1, res.total_elements), wire_nbytes=res.wire_nbytes)
                del _dev, host
                pres = pull(local, model_dir, source, version, workers=workers)
                row.update(pull_s=round(pres.seconds, 3), pull_action=pres.action)

                # staging: the helper's half (positions from the payloads, values from the local
                # checkpoint), then the engine's (casts, undo log, pinned host buffers)
                job = StageJob(local_checkpoint_dir=local, source_dir=source, from_version=version - 1,
                               to_version=version, max_elements=10**12, placements=cmap.placements,
                               unused=sorted(cmap.unused_tensors), reload_only=reload_only_reasons(cmap))
                reply, patches = stage_job(job)
                if reply.refused or reply.error:
                    raise RuntimeError(f"staging v{version} refused: {reply.refused or reply.error}")
                staged = StagedUpdate(version - 1, version, source, local, 0)
                staged.elements, staged.tensors = reply.elements, reply.tensors
                pinned_before = pinned_host_blocks()
                with Timer(args.device) as t_eng:
                    # device_copies: the path a CUDA parameter takes, rehearsed on the CPU too
                    finish_staging(patches, params, staged, device_copies=True)
                staged.fence = pause_fence_for(params)  # as LiveApplyState does at staging
                pinned_after = pinned_host_blocks()
                row.update(stage_helper_s=round(reply.stage_s, 4), stage_engine_s=round(t_eng.s, 4),
                           stage_s=round(reply.stage_s + t_eng.s, 4), staged_elements=staged.elements,
                           staged_nbytes=staged.nbytes, staged_device_nbytes=staged.device_nbytes,
                           patches=len(staged.patches),
                           device_copies=all(p.device_values is not None and p.device_values.device == p.flat.device
                                             and p.device_index.device == p.flat.device for p in staged.patches),
                           fence=type(staged.fence).__name__,
                           pinned_host_during_staging={k: pinned_after[k] - pinned_before.get(k, 0) for k in pinned_after})
                del patches

                # a fault mid-scatter: every parameter must be restored exactly
                before = {n: p.clone() for n, p in params.items()}
                ptrs = {n: p.data_ptr() for n, p in params.items()}

                class InjectedFault(RuntimeError):
                    pass

                def fail_midway(k: int, param: str) -> None:
                    if k == len(staged.patches) // 2:
                        raise InjectedFault(f"injected at patch {k} ({param})")

                raised = False
                with Timer(args.device) as t_fault, Allocations(args.device) as fault_alloc:
                    try:
                        scatter_with_undo(staged, before_write=fail_midway)
                    except InjectedFault:
                        raised = True
                row.update(fault_raised=raised, fault_restore_s=round(t_fault.s, 4),
                           fault_not_restored=differing_params(before, params),
                           fault_new_tensors=fault_alloc.new_tensors[:5],
                           fault_device_allocations=fault_alloc.device_allocations)

                # the pause and a restore allocate nothing (apart from the timed ones below)
                with Allocations(args.device) as pause_alloc:
                    undo, _ = scatter_with_undo(staged)
                with Allocations(args.device) as restore_alloc:
                    restored = undo.restore()
                row.update(pause_new_tensors=pause_alloc.new_tensors[:5], pause_device_allocations=pause_alloc.device_allocations,
                           restore_new_tensors=restore_alloc.new_tensors[:5],
                           restore_device_allocations=restore_alloc.device_allocations,
                           restored_after_allocation_check=restored.restored)
                if args.device.startswith("cuda"):
                    row["fence_ordering"] = fence_ordering(staged, args.device)

                # the pause, repeated: scatter, restore (timed too), ..., the last scatter stays
                pauses, walls, restores, written = [], [], [], 0
                for rep in range(args.reps):
                    with Timer(args.device, events=True) as t:
                        undo, written = scatter_with_undo(staged)
                    pauses.append(t.event_ms if t.events else t.s * 1e3)
                    walls.append(t.s * 1e3)
                    if rep < args.reps - 1:
                        with Timer(args.device) as t_r:
                            undo.restore()
                        restores.append(t_r.s * 1e3)
                if abs(frac - 0.04) < 1e-9:
                    row["profile"] = profile_scatter(staged, undo)
                row.update(pause_ms=round(_median(pauses), 3), pause_ms_all=[round(x, 3) for x in pauses],
                           pause_wall_ms=round(_median(walls), 3), restore_ms=round(_median(restores), 3) if restores else None,
                           elements_written=written, pointers_unchanged=all(p.data_ptr() == ptrs[n] for n, p in params.items()))
                del before
                live = {n: p.clone() for n, p in params.items()}
                row["reload_s"] = round(load(local), 4)
                row["pause_over_reload"] = round(row["pause_ms"] / 1e3 / row["reload_s"], 5)
                row["not_bit_identical_to_reload"] = differing_params(live, params)
                row["pointers_unchanged_after_reload"] = all(p.data_ptr() == ptrs[n] for n, p in params.items())
                row["per_update_check"] = per_update_check(args, cmap, params, local, version, staged, row["pause_ms"])
                del live, staged, undo
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                results.append(row)
                rec.step(f"v{version}", versions=results)
            pub.close()
            rec.step("done", ok=all(
                r["fault_raised"] and not r["fault_not_restored"] and r["pointers_unchanged"] and nothing_allocated(r)
                and r.get("fence_ordering", {}).get("ok", True)
                and not r["not_bit_identical_to_reload"]
                and r["elements_written"] == r["staged_elements"] == r["changed_elements"]
                and r["per_update_check"]["mismatches"] == 0 and r["per_update_check"]["planted_found"]
                for r in results))
        finally:
            if not args.keep_data:
                shutil.rmtree(work, ignore_errors=True)
    return 0


def profile_scatter(staged, undo) -> str:
    """The scatter once more (after a restore) under torch's profiler: the table of the device's
    and the host's time per operation, to say where a missed pause goes. Leaves it patched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sglang_patch.live.scatter.patch import scatter_with_undo

    cuda = any(p.flat.device.type == "cuda" for p in staged.patches)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    undo.restore()
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            scatter_with_undo(staged)
            sync()
        return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=12)
    except Exception as exc:  # the profiler is a bonus: the measurements stand without it
        sync()
        scatter_with_undo(staged)  # patched whether or not it failed before its scatter: the same values again
        return f"the profiler failed: {type(exc).__name__}: {exc}"


# --- the trainer part -------------------------------------------------------------------------


def cmd_trainer(args) -> int:
    import xml.etree.ElementTree as ET

    import torch

    rec = Recorder(args.json, part="trainer", device=args.device)
    with rec.guarded():
        junit = args.json + ".junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *args.tests]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=REPO, timeout=args.pytest_timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:  # the device diff below still runs
            done = subprocess.CompletedProcess(cmd, 124, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or ""),
                                               f"pytest stopped after {args.pytest_timeout:g}s")
        print(done.stdout[-6000:], done.stderr[-3000:], flush=True)
        outcomes = {}
        if os.path.exists(junit):
            for case in ET.parse(junit).getroot().iter("testcase"):
                status = "passed"
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        status = child.tag
                outcomes[case.get("name")] = status
        cuda_test = outcomes.get("test_cuda_model_is_compared_on_the_device", "not run")
        rec.step("pytest", pytest_rc=done.returncode, pytest_s=round(time.perf_counter() - t0, 2), outcomes=outcomes,
                 cuda_test=cuda_test,
                 cuda_test_ok=(cuda_test == "passed") if args.device.startswith("cuda") else (cuda_test == "skipped"))
        rec.step("device_diff", **device_diff_bytes(args.device, args.model_dir, args.preset))
    return 0


def device_diff_bytes(device: str, model_dir: str | None, preset: str) -> dict:
    """torch_publish's stager on device tensors of a Qwen3 layout: the bytes that cross to the
    host on the first stage (all) and after 1% and 4% of the elements changed (only those),
    and that the host buffers then hold exactly the device's bytes."""
    import tempfile

    import torch

    from bench_data import PRESETS
    from miles_updater.torch_publish import StateDictStager
    from sglang_patch.live.mapping.coordinate_map import CheckpointReader

    shape = PRESETS[ENGINE_PRESETS[preset]]
    own = None
    if not model_dir or not os.path.isdir(model_dir):
        own = tempfile.mkdtemp(prefix="gpu-check-trainer-", dir=_workdir(None, 20 if preset == "qwen3-4b" else 0.1))
        model_dir = os.path.join(own, "model")
        _, _, host = next(make_versions(shape, device, []))
        write_checkpoint(model_dir, host, shape)
        del host
    try:
        reader = CheckpointReader(model_dir)
        tensors = {s.name: reader.tensor(s.name).to(device, copy=True) for s in reader.specs()}  # never the read-only map
        stager = StateDictStager(model_dir, device_compare=True)
        out: dict[str, Any] = {"device_compare_on": device}
        with Timer(device) as t:
            stager.stage(tensors)
        out.update(full_nbytes=stager.staging_nbytes(), first_d2h_nbytes=stager.d2h_nbytes, first_stage_s=round(t.s, 3))
        gen = torch.Generator(device=device).manual_seed(7)
        for fraction in (0.01, 0.04):
            for t_ in tensors.values():
                flat = t_.view(-1).view(torch.int16)
                k = int(round(fraction * flat.numel()))
                if k:
                    flat[torch.randint(0, flat.numel(), (k,), generator=gen, device=device).unique()] ^= 1
            with Timer(device) as t:
                stager.stage(tensors)
            host = stager.published_state_dict()
            same = all(torch.equal(host[n].view(torch.int16), tensors[n].cpu().view(torch.int16)) for n in tensors)
            key = f"{round(fraction * 100)}pct"
            out[f"d2h_nbytes_{key}"] = stager.d2h_nbytes
            out[f"d2h_over_full_{key}"] = round(stager.d2h_nbytes / out["full_nbytes"], 5)
            out[f"stage_s_{key}"] = round(t.s, 4)
            out[f"host_equals_device_{key}"] = same
        return out
    finally:
        if own:
            import shutil

            shutil.rmtree(own, ignore_errors=True)


# --- merge ------------------------------------------------------------------------------------


def cmd_merge(args) -> int:
    merged: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "device": args.device,
                              "preset": args.preset, "parts": {}}
    for spec in args.parts:
        name, path, rc, seconds, limit = spec.split(":")
        part: dict[str, Any] = {"rc": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                                "timed_out": int(rc) in (124, 137)}
        try:
            with open(path) as f:
                part.update(json.load(f))
        except (OSError, ValueError) as exc:
            part["missing"] = ("the budget was spent before it" if int(limit) == 0 and int(rc) == 125
                               else f"no result file ({type(exc).__name__}: {exc})")
        merged["parts"][name] = part
    merged["verdicts"] = verdicts(merged["parts"], args.device)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1, default=str)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(results_markdown(merged))
    print("[gpu_check] verdicts:")
    for k, v in merged["verdicts"].items():
        print(f"[gpu_check]   {k}: {v}")
    bad = [k for k, v in merged["verdicts"].items() if isinstance(v, str) and v.startswith(("FAIL", "not run"))]
    return 1 if bad else 0


def results_markdown(merged: dict) -> str:
    """The block for benchmarks/RESULTS.md: date, box, each verdict."""
    eng = merged["parts"].get("engine", {})
    box = f"{eng.get('device_name', merged['device'])}, {os.cpu_count()} cores, torch {eng.get('torch', '?')}"
    lines = [f"## GPU kit (gpu_check.sh), {merged['date_utc']} UTC, {box}, preset {merged['preset']}", ""]
    lines += [f"- {k}: {v}" for k, v in merged["verdicts"].items()]
    for name, part in merged["parts"].items():
        lines.append(f"- part {name}: rc {part['rc']} in {part['seconds']} s (limit {part['limit_s']} s)"
                     + (", stopped at its limit" if part["timed_out"] else ""))
    return "\n".join(lines) + "\n"


def nothing_allocated(row: dict) -> bool:
    """No new tensor and no device allocation in the pause, the restore and the faulted scatter;
    each patch's index and values on its parameter's device; no pinned block made at staging."""
    counts = [row.get(f"{k}_device_allocations") for k in ("fault", "pause", "restore")]
    return (row.get("device_copies") is True and row.get("restored_after_allocation_check") is True
            and not any(row.get(f"{k}_new_tensors", ["not measured"]) for k in ("fault", "pause", "restore"))
            and all(c in (0, None) for c in counts)
            and not any(v > 0 for k, v in row.get("pinned_host_during_staging", {}).items() if k != "allocated_bytes.current"))


def verdicts(parts: dict, device: str) -> dict:
    """What each check says, in the issue's words: PASS / FAIL / met / missed / not run."""
    out: dict[str, Any] = {}
    wh = parts.get("wheels")
    if wh is not None:
        out["carried_wheels"] = ("PASS" if not wh.get("problems") and "wheels_mib" in wh else "FAIL") + (
            f": {wh.get('wheels')} wheels, {wh.get('wheels_mib')} MiB; with the working tree "
            + (f"{wh['travel_mib']} of {wh.get('limit_mib')} MiB" if wh.get("travel_mib") is not None else "(no git here to size it)") + (f"; {wh['problems']}" if wh.get("problems") else ""))
    eng = parts.get("engine", {})
    rows = eng.get("versions", [])
    if not rows:
        out["live_apply_exact"] = f"not run ({eng.get('error') or eng.get('missing') or 'no version finished'})"
    for r in rows:
        pct = f"{r['fraction'] * 100:g}%"
        ok = (r["fault_raised"] and not r["fault_not_restored"] and r["pointers_unchanged"]
              and not r["not_bit_identical_to_reload"]
              and r["elements_written"] == r["staged_elements"] == r["changed_elements"])
        out[f"live_apply_exact_{pct}"] = "PASS" if ok else (
            f"FAIL (fault raised {r['fault_raised']}, not restored {r['fault_not_restored'][:5]}, pointers unchanged "
            f"{r['pointers_unchanged']}, differ from reload {r['not_bit_identical_to_reload'][:5]})")
        out[f"pause_allocates_nothing_{pct}"] = ("PASS" if nothing_allocated(r) else "FAIL") + (
            f": new tensors in the pause {r.get('pause_new_tensors')}, the restore {r.get('restore_new_tensors')}, "
            f"the faulted scatter {r.get('fault_new_tensors')}; device allocations "
            f"{r.get('pause_device_allocations')}/{r.get('restore_device_allocations')}/{r.get('fault_device_allocations')}"
            f"{' (no CUDA allocator on the CPU: operators only)' if r.get('pause_device_allocations') is None else ''}; "
            f"device copies {r.get('device_copies')} ({r.get('staged_device_nbytes', 0) / MiB:.1f} MiB), "
            f"pinned at staging {r.get('pinned_host_during_staging')}")
        fo = r.get("fence_ordering")
        if fo is not None:
            out[f"pause_fence_{pct}"] = ("PASS" if fo["ok"] else "FAIL") + (
                f": a forward queued before the pause read the old value {fo['forward_read_old_before_the_writes']}, "
                f"one after it the new {fo['forward_read_new_after_the_writes']}; pause {fo['pause_ms_with_a_forward_queued']} ms "
                f"with a {fo['forward_sleep_ms']:g} ms forward queued")
        elif not device.startswith("cuda"):
            out[f"pause_fence_{pct}"] = "skipped on the CPU (HostFence; tests/unit/test_live_pause_fence.py)"
        out[f"pause_{pct}"] = (f"{r['pause_ms']:.2f} ms, reload {r['reload_s']:.3f} s "
                               f"({r['pause_over_reload']:.2%}); staging {r['stage_s']:.3f} s, pull {r['pull_s']:.3f} s")
        if abs(r["fraction"] - 0.04) < 1e-9:
            met = r["pause_ms"] <= PAUSE_TARGET_MS and r["pause_over_reload"] <= PAUSE_TARGET_RATIO
            where = "" if device.startswith("cuda") else " (CPU rehearsal: the target is the H200's)"
            out["pause_target_4%"] = ("met" if met else "missed") + (
                f": pause {r['pause_ms']:.2f} ms (target <= {PAUSE_TARGET_MS:g} ms), {r['pause_over_reload']:.2%} of the "
                f"reload (target <= {PAUSE_TARGET_RATIO:.0%}){where}")
    if eng.get("error"):
        out["engine_error"] = "FAIL: " + eng["error"]
    tr = parts.get("trainer", {})
    if "cuda_test_ok" in tr:
        out["trainer_tests"] = ("PASS" if tr["pytest_rc"] == 0 and tr["cuda_test_ok"] else "FAIL") + (
            f" (pytest rc {tr['pytest_rc']}; test_cuda_model_is_compared_on_the_device: {tr['cuda_test']})")
    else:
        out["trainer_tests"] = f"not run ({tr.get('error') or tr.get('missing') or 'no result'})"
    if "d2h_nbytes_4pct" in tr:
        same = tr["host_equals_device_1pct"] and tr["host_equals_device_4pct"]
        out["trainer_device_diff"] = ("PASS" if same else "FAIL (host buffers differ from the device)") + (
            f": d2h per step {tr['d2h_over_full_1pct']:.2%} (1%) and {tr['d2h_over_full_4pct']:.2%} (4%) "
            f"of the full model's {tr['full_nbytes'] / MiB:.0f} MiB")
    b = parts.get("bench")
    if b is not None:
        out["bench_sync"] = "ran" if b["rc"] == 0 else ("stopped at its time limit" if b["timed_out"] else f"FAIL (rc {b['rc']})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels")
    w.add_argument("--wheel-dir", default=os.path.join(REPO, ".whl"))
    w.add_argument("--json", required=True)
    w.add_argument("--installable", required=True, help="file: the wheels this Python can install, one a line")
    m = sub.add_parser("mirror")
    m.add_argument("--dir", required=True)
    m.add_argument("--also", default="", help="comma-separated distributions to keep visible (carried, cp312 only)")
    e = sub.add_parser("engine")
    t = sub.add_parser("trainer")
    for p in (e, t):
        p.add_argument("--device", default="cuda")
        p.add_argument("--preset", default="qwen3-4b", choices=sorted(ENGINE_PRESETS))
        p.add_argument("--json", required=True)
    e.add_argument("--fractions", default="0.01,0.04")
    e.add_argument("--reps", type=int, default=3, help="scatters timed per version (each but the last restored)")
    e.add_argument("--port", type=int, default=0, help="the process group's port (0: a free one)")
    e.add_argument("--workdir", default=None)
    e.add_argument("--keep-data", action="store_true")
    e.add_argument("--keep-model-dir", default=None, help=argparse.SUPPRESS)
    t.add_argument("--model-dir", default=None)
    t.add_argument("--pytest-timeout", type=float, default=120)
    t.add_argument("tests", nargs="*", default=["tests/unit/test_miles_torch_publish.py"])
    g = sub.add_parser("merge")
    g.add_argument("--out", required=True)
    g.add_argument("--device", required=True)
    g.add_argument("--preset", required=True)
    g.add_argument("parts", nargs="*", help="name:json:rc:seconds:limit")
    args = ap.parse_args()
    return {"wheels": cmd_wheels, "mirror": cmd_mirror, "engine": cmd_engine, "trainer": cmd_trainer,
            "merge": cmd_merge}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
