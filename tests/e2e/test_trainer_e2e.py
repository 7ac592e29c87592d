"""End to end on the CPU: Ray + a Megatron trainer (TP=2, gloo) + a real sglang server with the plugin.

One sglang server and one Ray cluster serve the whole module (they take most of the time).
After each real optimizer step the trainer publishes a version and drives the engine to it;
the engine's greedy output must equal transformers' greedy output on the trainer's published
bytes, the engine host's local checkpoint must hold exactly those bytes, and the engine's
``weight_version`` (``GET /model_info``) must name the version. A pull killed midway (SIGKILL
while applying) and then retried must still end bit-exact. A trainer killed and resumed from a
saved step, with the same run id, continues the engine's versions upward.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox jumps over"
N_TOKENS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import argparse

    import ray

    from miles_updater.args import add_update_weight_arguments, validate_update_weight_args
    from miles_updater.cpu_trainer import MegatronCPUTrainer
    from miles_updater.demo import ENGINE_ARGS
    from miles_updater.engines import make_engine_actor_class
    from testbed.live import wait_until_map_proven
    from testbed.sglang_cpu import SglangCpuServer, find_free_port
    from testbed.tiny_qwen3 import make_tiny_qwen3

    work = tmp_path_factory.mktemp("e2e").resolve()
    hf = make_tiny_qwen3(work / "hf", seed=0)
    # An AdamW step at this lr changes most elements of the tiny bf16 model, above the engine's
    # default live threshold (10%, where a reload is as cheap): allow any density, so that every
    # delta is patched live and checked here (the threshold's fallback: test_live_apply_tp2.py).
    server = SglangCpuServer(hf, extra_args=ENGINE_ARGS + ["--pull-weights-allowed-roots", str(work),
                                                           "--update-weights-live-max-changed-fraction", "1"],
                             # The mode is chosen by measured pauses, and this tiny model reloads in
                             # about 8 ms, faster than a live apply's fixed cost: every reload takes as
                             # long as a real model's, so that each delta is patched live and checked.
                             env={"WEIGHTSYNC_TEST_RELOAD_DELAY_S": "0.3"},
                             log_path=work / "sglang.log").start(wait_healthy=False)
    args = add_update_weight_arguments(argparse.ArgumentParser()).parse_args([
        "--update-weight-mode", "delta", "--update-weight-transport", "disk",
        "--update-weight-disk-dir", str(work / "shared"),
        "--update-weight-local-checkpoint-dir", str(work / "local" / "ckpt"),
        "--hf-checkpoint", hf,
    ])
    config = validate_update_weight_args(args)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}})
    try:
        port = find_free_port()
        trainers = [MegatronCPUTrainer.remote(r, 2, port, config, tp=2, lr=4e-4, seed=0) for r in range(2)]
        server.wait_healthy()
        # The map is built and proven on a thread after start-up: the first sync must not race it.
        wait_until_map_proven(server)
        engine = make_engine_actor_class().remote(server.base_url, name="engine0", timeout_s=120)
        ray.get(trainers[0].connect_rollout_engines.remote([engine], ["engine0"]))
        ray.get([t.start.remote() for t in trainers])

        def make_trainers(port, **kw):
            return [MegatronCPUTrainer.remote(r, 2, port, config, tp=2, lr=4e-4, seed=0, **kw) for r in range(2)]

        yield dict(ray=ray, trainers=trainers, engine=engine, server=server, config=config, hf=hf, work=work,
                   make_trainers=make_trainers)
    finally:
        ray.shutdown()
        server.stop()


def _step(loop, update_engines=True):
    ray = loop["ray"]
    ray.get([t.train_step.remote() for t in loop["trainers"]])
    return ray.get([t.update_weights.remote(update_engines) for t in loop["trainers"]])[0]


def _assert_engine_matches_trainer(loop, version=None):
    import torch

    from testbed.tiny_qwen3 import read_state_dict

    ray = loop["ray"]
    if version is not None:
        assert ray.get(loop["engine"].weight_version.remote()) == str(version)
    published = ray.get(loop["trainers"][0].published_tensors.remote())
    local = read_state_dict(loop["config"].local_checkpoint_dir)
    assert sorted(published) == sorted(local)
    for name, t in published.items():
        assert torch.equal(t.view(torch.uint8), local[name].view(torch.uint8)), f"{name} differs on the engine host"
    expected = ray.get(loop["trainers"][0].reference_greedy.remote(PROMPT, N_TOKENS))
    got = ray.get(loop["engine"].generate_ids.remote(PROMPT, N_TOKENS))
    assert got == expected
    return got


def test_engine_greedy_equals_transformers_after_each_real_optimizer_step(loop):
    outputs = []
    for step in range(1, 4):
        m = _step(loop)
        assert m["version"] == step
        assert m["kind"] == "delta"
        assert 0 < m["changed_fraction_bytes"] < 1 and 0 < m["wire_nbytes"] < m["full_nbytes"]
        assert m["pulls"][0]["applied_version"] == step and m["pulls"][0]["actions"] == ["chain"]
        assert min(m["publish_s"], m["pull_s"], m["pause_s"]) > 0
        _assert_applied(m)
        outputs.append(_assert_engine_matches_trainer(loop, step))
    # The server answered with the weights of each version: at least one step changed its output
    # relative to the seed model (otherwise equality above could be a stale engine).
    from miles_updater.cpu_trainer import greedy_from_tensors
    from testbed.tiny_qwen3 import read_state_dict

    seed_output = greedy_from_tensors(loop["hf"], read_state_dict(loop["hf"]), PROMPT, N_TOKENS)
    assert any(o != seed_output for o in outputs)


def test_pull_killed_midway_then_retried_ends_bit_exact(loop):
    ray = loop["ray"]
    m = _step(loop, update_engines=False)  # published, engines not told yet
    version = m["version"]
    source_dir = ray.get(loop["trainers"][0].source_dir.remote())
    local = loop["config"].local_checkpoint_dir
    state = Path(local) / ".weight_sync" / "state.json"
    assert state.exists()
    # A pull of this host killed while applying: the progress callback announces the first
    # applied tensor, then stalls so the kill lands mid-apply.
    code = (
        "import sys, time\n"
        "from weightsync import pull\n"
        "def progress(done, total):\n"
        "    print('APPLYING', done, total, flush=True); time.sleep(60)\n"
        f"pull({local!r}, {os.path.realpath(loop['hf'])!r}, {source_dir!r}, {version}, progress=progress)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("APPLYING") or not line:
                break
        assert line.startswith("APPLYING"), f"the pull never started applying: {line!r}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The killed pull left no applied-version marker: the local state is torn, not "at v-1".
    assert not state.exists()
    retry = ray.get([t.update_engines_to.remote(version) for t in loop["trainers"]])[0]
    assert retry["pulls"][0]["applied_version"] == version
    assert any("seed" in a for a in retry["pulls"][0]["actions"])  # reseeded and replayed the chain
    _assert_applied(retry)  # the engine's weights never left the chain: still a live patch
    _assert_engine_matches_trainer(loop)
    # And the next ordinary sync chains from the repaired state.
    m = _step(loop)
    assert m["pulls"][0]["actions"] == ["chain"]
    _assert_applied(m)
    _assert_engine_matches_trainer(loop)


def _assert_applied(m, *, reload_because: str | None = None):
    """The pause applied the version the way it must: live for a delta the engine can patch (the
    map is proven before the first sync, and the live version is in the same run's chain), else
    a reload whose reason contains ``reload_because`` (a run's first version is full)."""
    [apply] = m["applies"]
    assert m["apply_mode"] == apply["mode"]
    if reload_because is None:
        assert apply["mode"] == "live", (f"v{m['version']} ({m['changed_fraction_elements']:.1%} of elements changed) "
                                         f"reloaded where it should be live: {apply['reason']}")
        assert apply["elements_scattered"] > 0 and m["elements_scattered"] == apply["elements_scattered"], apply
    else:
        assert apply["mode"] == "reload", f"v{m['version']} applied live, expected a reload ({reload_because}): {apply}"
        assert reload_because in apply["reason"], apply


def test_a_trainer_resumed_from_a_saved_step_continues_the_engine_versions(loop):
    from testbed.sglang_cpu import find_free_port

    ray = loop["ray"]
    checkpoint = str(loop["work"] / "trainer-step")
    ray.get([t.save_checkpoint.remote(checkpoint) for t in loop["trainers"]])
    m = _step(loop)  # one more version after the saved step, then the trainer dies
    _assert_applied(m)
    newest = m["version"]
    _assert_engine_matches_trainer(loop, newest)
    run_id = os.path.basename(ray.get(loop["trainers"][0].source_dir.remote())).removeprefix("run-")
    first_run_dir = ray.get(loop["trainers"][0].source_dir.remote())
    # The same run id (it used to fail with "version 1 is already published"); a fresh run id is
    # covered, with pruning, on gloo ranks in tests/unit/test_miles_updater_faults.py.
    for run, label in ((run_id, "the same run id"),):
        for t in loop["trainers"]:
            ray.kill(t)
        loop["trainers"] = loop["make_trainers"](port=find_free_port(), run_id=run, resume_from=checkpoint)
        ray.get(loop["trainers"][0].connect_rollout_engines.remote([loop["engine"]], ["engine0"]))
        ray.get([t.start.remote() for t in loop["trainers"]])
        source_dir = ray.get(loop["trainers"][0].source_dir.remote())
        assert (source_dir == first_run_dir) == (run is not None), label
        m = _step(loop)
        # Numbered after the newest version the engine has seen, and a full version (the resumed
        # trainer's snapshot is the seed), which the engine host seeds from.
        assert m["version"] == newest + 1, label
        assert m["kind"] == "full" and m["pulls"][0]["actions"] == ["seed"], label
        _assert_applied(m, reload_because=f"v{newest + 1} in the chain v{newest} -> v{newest + 1} is a full version")
        _assert_engine_matches_trainer(loop, newest + 1)
        m = _step(loop)
        assert m["version"] == newest + 2 and m["kind"] == "delta", label
        assert m["pulls"][0]["actions"] == ["chain"], label
        _assert_applied(m)  # after the reload of the full version, its delta patches live
        _assert_engine_matches_trainer(loop, newest + 2)
        newest = m["version"]


def test_a_plain_pytorch_trainer_publishes_every_step_to_the_engine(loop):
    """A transformers Qwen3 and AdamW (no Megatron; the engine is driven over HTTP, not Ray)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_updater.cpu_trainer import greedy_from_tensors
    from miles_updater.torch_publish import TorchWeightSync
    from testbed.tiny_qwen3 import read_state_dict

    hf, local = loop["hf"], loop["config"].local_checkpoint_dir
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = AutoTokenizer.from_pretrained(hf)(["every version is published as a delta and pulled by each host"] * 2,
                                            return_tensors="pt").input_ids
    sync = TorchWeightSync(str(loop["work"] / "shared"), hf, local_checkpoint_dir=local,
                           engines=[loop["server"].base_url])
    try:
        first = None
        for step in range(3):
            loss = model(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            m = sync.publish(model)
            first = first or m.version
            # Numbered after the Megatron runs in the same disk dir; the first version is full.
            assert m.version == first + step and m.kind == ("full" if step == 0 else "delta")
            assert m.pulls[0]["applied_version"] == m.version
            # The run's first version is full, in a new run dir: the engine's live version is not in its chain.
            _assert_applied(m.as_dict(), reload_because=None if step else "came from another source dir")
            published = sync.published_state_dict()
            on_host = read_state_dict(local)
            for name, t in published.items():
                assert torch.equal(on_host[name].view(torch.uint8), t.view(torch.uint8)), name
            expected = greedy_from_tensors(hf, published, PROMPT, N_TOKENS)
            engine = sync.engine_sync.engines.clients[0]
            assert engine.generate_ids(PROMPT, N_TOKENS) == expected
            assert engine.weight_version() == str(m.version)
    finally:
        sync.close()
