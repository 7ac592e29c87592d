"""Multi-GPU: Qwen3-4B, a Megatron trainer on 4 GPUs (TP=2 x DP=2, Ray actors, NCCL) and two
sglang engines of TP=2 on the other 4 GPUs, synced through disk-delta versions.

CI-test-style checks after every sync (as slime's ``--ci-test`` does for its weight updates):
- at start: each engine snapshots its weights (loaded from the HF checkpoint), zeroes them
  (``/weights_checker reset_tensors``), reloads from its local checkpoint at version 0 and must
  compare equal to the snapshot: the reload path restores the exact weights;
- after each of several optimizer steps: the engine host's local checkpoint holds exactly the
  trainer's published bytes (xxh3-128 per tensor), both engines report the same in-memory weight
  checksum, and both generate the same greedy tokens.

Needs: 8 CUDA GPUs on one node, sglang with this repo's plugin installed (``pip install -e .``),
megatron-core, ray, and a local Qwen3-4B checkpoint in ``QWEN3_4B_DIR``
(``huggingface-cli download Qwen/Qwen3-4B --local-dir /data/Qwen3-4B``). Run:

    QWEN3_4B_DIR=/data/Qwen3-4B pytest -m gpu tests/e2e/megatron/test_qwen3_4B_disk_delta.py

Skipped, with the reason, where any of this is missing.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MODEL_DIR = os.environ.get("QWEN3_4B_DIR", "")
N_STEPS = 3
PROMPT = "The capital of France is"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def _skip_reason() -> str | None:
    n = _gpu_count()
    if n < 8:
        return (f"needs 8 CUDA GPUs (4 trainer ranks TP=2 x DP=2 + two TP-2 sglang engines); this machine "
                f"has {n}")
    if not MODEL_DIR or not os.path.isdir(MODEL_DIR):
        return ("set QWEN3_4B_DIR to a local Qwen3-4B HF checkpoint dir "
                "(huggingface-cli download Qwen/Qwen3-4B --local-dir DIR)")
    return None


if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)

import requests  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GpuEngine:
    """A real sglang server of TP=2 on two GPUs, on loopback, with the /pull_weights plugin."""

    def __init__(self, gpus: str, root: Path, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL_DIR, "--tp-size", "2",
               "--host", "127.0.0.1", "--port", str(self.port), "--mem-fraction-static", "0.6",
               "--pull-weights-allowed-roots", str(root)]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpus))

    def wait_healthy(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"sglang exited ({self.proc.returncode}); see {self.log.name}"
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.url} not healthy after {timeout_s}s; see {self.log.name}")

    def post(self, path: str, body=None, timeout: float = 600):
        r = requests.post(self.url + path, json=body, timeout=timeout)
        assert r.status_code == 200, f"{path}: HTTP {r.status_code} {r.text[:500]}"
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def _local_digests(local_dir: str) -> dict:
    import xxhash
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(local_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                out[name] = xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(__import__("torch").uint8).numpy())
    return out


def test_qwen3_4B_disk_delta_engines_hold_the_trainers_weights_after_each_sync(tmp_path):
    import ray

    from miles_updater.args import add_update_weight_arguments, validate_update_weight_args
    from miles_updater.cpu_trainer import MegatronCPUTrainer
    from miles_updater.engines import make_engine_actor_class

    root = tmp_path.resolve()
    config = validate_update_weight_args(add_update_weight_arguments(argparse.ArgumentParser()).parse_args([
        "--update-weight-transfer-mode", "disk-delta",
        "--update-weight-disk-dir", str(root / "shared"),
        "--update-weight-local-checkpoint-dir", str(root / "local" / "ckpt"),
        "--hf-checkpoint", MODEL_DIR,
    ]))
    engines = [GpuEngine("4,5", root, root / "engine0.log"), GpuEngine("6,7", root, root / "engine1.log")]
    ray.init(num_gpus=4, num_cpus=8, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # Ray gives GPUs 0-3 to the trainer
    try:
        port = _free_port()
        trainers = [MegatronCPUTrainer.options(num_gpus=1, num_cpus=1).remote(
            r, 4, port, config, tp=2, lr=1e-5, device="cuda") for r in range(4)]
        for e in engines:
            e.wait_healthy()
        # Reload check: snapshot, zero, reload the local checkpoint at v0, compare.
        for e in engines:
            e.post("/weights_checker", {"action": "snapshot"})
            e.post("/weights_checker", {"action": "reset_tensors"})
        Actor = make_engine_actor_class()
        handles = [Actor.remote(e.url, name=f"engine{i}", timeout_s=600) for i, e in enumerate(engines)]
        ray.get(trainers[0].connect_rollout_engines.remote(handles, ["engine0", "engine1"]))
        ray.get([t.start.remote() for t in trainers])
        ray.get(handles[0].pull_weights.remote(config.local_checkpoint_dir, ray.get(trainers[0].source_dir.remote()), 0))
        for e in engines:
            e.post("/update_weights_from_disk", {"model_path": config.local_checkpoint_dir, "weight_version": "0"})
            e.post("/weights_checker", {"action": "compare"})

        for step in range(1, N_STEPS + 1):
            ray.get([t.train_step.remote() for t in trainers])
            m = ray.get([t.update_weights.remote() for t in trainers])[0]
            assert m["version"] == step and [p["applied_version"] for p in m["pulls"]] == [step, step]
            published = ray.get(trainers[0].published_digests.remote())
            assert published == _local_digests(config.local_checkpoint_dir), f"v{step}: local bytes differ"
            sums = [e.post("/weights_checker", {"action": "checksum"})["per_engine_checksum"] for e in engines]
            assert sums[0] == sums[1], f"v{step}: the two engines hold different weights"
            outs = [requests.post(e.url + "/generate", json={"text": PROMPT, "sampling_params": {
                "temperature": 0, "max_new_tokens": 16}}, timeout=300).json()["output_ids"] for e in engines]
            assert outs[0] == outs[1]
            print(f"v{step} {m['kind']}: changed {m['changed_fraction_bytes']:.2%} of bytes, wire "
                  f"{m['wire_nbytes']} B of {m['full_nbytes']} B; publish {m['publish_s']:.1f}s pull "
                  f"{m['pull_s']:.1f}s pause {m['pause_s']:.1f}s ({m['apply_mode']})")
        ray.get([t.close.remote() for t in trainers])
    finally:
        ray.shutdown()
        for e in engines:
            e.stop()
