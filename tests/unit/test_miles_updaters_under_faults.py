"""A model-based test of the trainer side under faults (issue 21): random sequences of training
steps, publishes and faults, with the disk recovering later.

The publish side is real: ``TorchWeightSync`` on a real transformers model (a tiny Qwen3), the
real core writing real files. Any publish step fails once or for a while: the encode, a shard
write, the index write, the pruning after it, the core's post-write hook, or the engine-side
post-write hook. (The barrier exists only with several ranks: the Megatron updater's gloo tests,
tests/unit/test_miles_updater_faults.py and test_miles_updater_pending.py, fail it.)

The engines are in-process stand-ins, used only because a test cannot make a real sglang
server's pull, pause, apply or continue fail on demand: each pulls with the core's real ``pull``
onto its own local checkpoint dir, and its "live weights" are the digests of that dir's tensors
at the moment it applied (what a reload would read). A failed apply keeps the old weights, as
sglang does. Any of the four calls fails once or for a while, on one engine.

After every step:
- each committed version on disk holds exactly the trainer's weights at a step that tried to
  publish that number (read back with the core's ``pull``), and its files never change (no
  version number is reused for other bytes);
- every engine serves a published version, its live weights are that version's bytes, and the
  trainer's ``served`` map names that version (or None before any sync reached it);
- once every fault is gone, the run publishes again and every engine reaches the new version.

Profiles: the default is short (CI); ``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough`` runs many more
and longer sequences.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import weightsync.publisher.publish as publish_mod
from miles_updater.engines import EngineCallError, EngineSyncError
from miles_updater.gather import ST_TO_TORCH
from miles_updater.torch_publish import TorchWeightSync
from weightsync import pull
from weightsync.format.layout import INDEX_NAME

THOROUGH = os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE") == "thorough"
PUBLISH_FAULTS = ["encode", "shard write", "index write", "prune", "core hook", "engine hook"]
ENGINE_CALLS = ["pull_weights", "pause_generation", "apply", "continue_generation"]
N_ENGINES = 2
FOR_A_WHILE = 10  # "fails for a while": more failures than any number of retries in a sequence


class _World:
    """Built once per module: the checkpoint, the model and its seed weights."""

    def __init__(self):
        from transformers import AutoModelForCausalLM

        from testbed.tiny_qwen3 import make_tiny_qwen3

        self.root = tempfile.mkdtemp(prefix="ws-updaters-faults-")
        self.hf = make_tiny_qwen3(os.path.join(self.root, "hf"), seed=7)
        self.model = AutoModelForCausalLM.from_pretrained(self.hf, dtype=torch.float32)
        self.seed_state = {n: t.detach().clone() for n, t in self.model.state_dict().items()}


_WORLD: _World | None = None


def _world() -> _World:
    global _WORLD
    if _WORLD is None:
        _WORLD = _World()
    return _WORLD


@pytest.fixture(scope="module", autouse=True)
def _clean_world():
    yield
    if _WORLD is not None:
        shutil.rmtree(_WORLD.root, ignore_errors=True)


def _digests_of_dir(local: str) -> dict[str, str]:
    from testbed.tiny_qwen3 import read_state_dict

    return {n: xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
            for n, t in read_state_dict(local).items()}


def _dir_fingerprint(vdir: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(vdir)):
        with open(os.path.join(vdir, name), "rb") as f:
            out[name] = xxhash.xxh3_128_hexdigest(f.read())
    return out


class Faults:
    """Armed failures: name -> how many more times that step fails."""

    def __init__(self):
        self.left: dict[str, int] = {}

    def arm(self, name: str, times: int) -> None:
        self.left[name] = times

    def hit(self, name: str) -> bool:
        if self.left.get(name, 0) > 0:
            self.left[name] -= 1
            return True
        return False

    def clear(self) -> None:
        self.left.clear()


class EngineStandIn:
    """An engine whose pull is the core's real ``pull`` onto its own local dir; see the module doc."""

    def __init__(self, name: str, hf: str, local: str, faults: Faults, seed_digests: dict[str, str]):
        self.name, self.hf, self.local, self.faults = name, hf, local, faults
        self.live_version = 0  # it starts serving the checkpoint, v0
        self.live = dict(seed_digests)
        self.paused = False

    def _maybe_fail(self, call: str) -> None:
        if self.faults.hit(f"{self.name}:{call}"):
            raise EngineCallError(self.name, call, f"injected failure of {call}", status=500)

    def pull_weights(self, local_checkpoint_dir, source_dir, target_version):
        self._maybe_fail("pull_weights")
        result = pull(self.local, self.hf, source_dir, int(target_version))
        return {"success": True, "applied_version": result.applied_version, "action": result.action, "seconds": 0.0}

    def pause_generation(self, mode="retract"):
        self._maybe_fail("pause_generation")
        self.paused = True
        return {"success": True}

    def _apply(self, call: str, version) -> dict:
        self._maybe_fail("apply")  # a failed apply keeps the old weights
        self.live, self.live_version = _digests_of_dir(self.local), int(version)
        return {"success": True, "mode": "live" if call == "live" else "reload", "weight_version": str(version),
                "elements_scattered": 0, "reason": ""}

    def update_weights_from_pulled(self, local_checkpoint_dir, target_version, flush_cache=True):
        return self._apply("live", target_version)

    def update_weights_from_disk(self, model_path, weight_version=None, flush_cache=True):
        return self._apply("reload", weight_version)

    def continue_generation(self):
        self._maybe_fail("continue_generation")
        self.paused = False
        return {"success": True}

    def weight_version(self):
        return str(self.live_version)


class UpdatersUnderFaults(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        w = _world()
        self.w = w
        self.dir = tempfile.mkdtemp(prefix="run-", dir=w.root)
        w.model.load_state_dict(w.seed_state)
        self.faults = Faults()
        self.step = 0
        self.sync: TorchWeightSync | None = None
        self.candidates: dict[int, list[dict[str, str]]] = {}  # version -> the weights of calls that tried it
        self.published: dict[int, dict[str, str]] = {0: None}  # version -> its bytes read back (0: the seed)
        self.files: dict[int, dict[str, str]] = {}  # version -> its files' digests when first seen
        self.reached: set[str] = set()  # engines some sync reached (the trainer knows their version)
        self.verifier = os.path.join(self.dir, "verifier")
        self._patched: list = []

    @initialize()
    def start(self):
        w, faults = self.w, self.faults
        engines = [EngineStandIn(f"e{i}", w.hf, os.path.join(self.dir, f"engine{i}"), faults, {})
                   for i in range(N_ENGINES)]

        def engine_hook(args, vdir, rollout_engines):
            if faults.hit("engine hook"):
                raise OSError(errno.EIO, "injected failure of the engine-side post-write hook")

        self.sync = sync = TorchWeightSync(os.path.join(self.dir, "shared"), w.hf,
                                           local_checkpoint_dir=os.path.join(self.dir, "unused"),
                                           engines=engines, retry_backoff_s=0.0, publish_attempts=2,
                                           post_write_hook=engine_hook, keep_versions=3)
        sync.start()
        seed_digests = self._expected_now()
        self.published[0] = seed_digests
        for e in engines:
            e.live = dict(seed_digests)
        self.engines = engines
        pub = sync.publisher

        def core_hook(vdir):
            if faults.hit("core hook"):
                raise OSError(errno.EIO, "injected failure of the core's post-write hook")

        pub.post_write_hook = core_hook
        real_encode, real_prune = pub.encoder.prepare, pub.retention.prune

        def encode(*a, **kw):
            if faults.hit("encode"):
                raise OSError(errno.ENOMEM, "injected: the encoder ran out of memory")
            return real_encode(*a, **kw)

        def prune():
            if faults.hit("prune"):
                raise OSError(errno.EIO, "injected failure while pruning")
            return real_prune()

        pub.encoder.prepare, pub.retention.prune = encode, prune
        real_write_file, real_write_bytes = publish_mod.write_file, publish_mod.write_bytes
        source = sync.source_dir

        def write_file(path, chunks, **kw):
            if path.startswith(source) and faults.hit("shard write"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            return real_write_file(path, chunks, **kw)

        def write_bytes(path, data, **kw):
            if path.startswith(source) and path.endswith(INDEX_NAME) and "weight_v" in path and faults.hit("index write"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            return real_write_bytes(path, data, **kw)

        publish_mod.write_file, publish_mod.write_bytes = write_file, write_bytes
        self._patched = [(publish_mod, "write_file", real_write_file), (publish_mod, "write_bytes", real_write_bytes)]

    # --- the trainer ---------------------------------------------------------------------------

    def _expected_now(self) -> dict[str, str]:
        """The digests of the model's weights as the checkpoint's dtypes (what a publish must hold)."""
        state = self.w.model.state_dict()
        out = {}
        for name, spec in self.sync.stager.specs.items():
            t = state[name].detach().to(ST_TO_TORCH[spec.dtype]).contiguous()
            out[name] = xxhash.xxh3_128_hexdigest(t.view(-1).view(torch.uint8).numpy())
        return out

    @rule(seed=st.integers(0, 2**16), share=st.sampled_from([0.001, 0.01, 0.2]))
    def train_step(self, seed, share):
        """Some elements of some parameters move (a sparse step, or a denser one)."""
        self.step += 1
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.w.model.parameters():
                if torch.rand((), generator=g) < 0.5:
                    flat = p.view(-1)
                    k = max(1, int(flat.numel() * share))
                    idx = torch.randint(0, flat.numel(), (k,), generator=g)
                    flat[idx] += torch.randn(k, generator=g) * 0.05

    @rule()
    def publish(self):
        self._publish(must_succeed=False)

    def _publish(self, must_succeed: bool):
        sync = self.sync
        expected = self._expected_now()
        before = sync.version
        # This call finishes a pending version with its staged bytes first, then tries before + 1
        # (or the next number) with these weights: any number it may publish is a candidate.
        for v in range(before + 1, before + 3):
            self.candidates.setdefault(v, [])
        number = self._next_number()
        self.candidates[number].append(expected)
        try:
            m = sync.publish(self.w.model)
        except (OSError, EngineSyncError, MemoryError) as e:
            assert not must_succeed, f"with every fault gone, the publish failed: {e!r}"
            pub = sync.publisher
            if pub.pending_version == number or pub.version >= number:
                # These weights were written as that number: the rule says it is finished with them.
                self.candidates[number] = [expected]
            return
        assert m.version == number
        for e in self.engines:
            assert (e.live_version, e.paused) == (m.version, False), (e.name, e.live_version, e.paused)
        self.reached.update(e.name for e in self.engines)

    def _next_number(self) -> int:
        """The number the weights of this call will get: one past a version pending or landed."""
        sync, pub = self.sync, self.sync.publisher
        if pub.pending_version is not None or pub.version > sync.version:
            return max(pub.version, pub.pending_version or 0) + 1
        return sync.version + 1

    # --- faults --------------------------------------------------------------------------------

    @rule(step=st.sampled_from(PUBLISH_FAULTS), times=st.sampled_from([1, 2, FOR_A_WHILE]))
    def a_publish_step_fails(self, step, times):
        self.faults.arm(step, times)

    @rule(engine=st.integers(0, N_ENGINES - 1), call=st.sampled_from(ENGINE_CALLS),
          times=st.sampled_from([1, 2, FOR_A_WHILE]))
    def an_engine_call_fails(self, engine, call, times):
        self.faults.arm(f"e{engine}:{call}", times)

    @rule()
    def the_faults_are_gone_and_the_run_publishes_again(self):
        self.faults.clear()
        self._publish(must_succeed=True)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def every_promise_holds(self):
        if self.sync is None:
            return
        self.versions_on_disk_hold_the_weights_of_a_step_that_published_them_and_never_change()
        self.every_engine_serves_a_published_version_and_says_which()

    def versions_on_disk_hold_the_weights_of_a_step_that_published_them_and_never_change(self):
        source = self.sync.source_dir
        names = os.listdir(source) if os.path.isdir(source) else []  # made by the first publish
        committed = sorted(int(d[len("weight_v"):]) for d in names
                           if d.startswith("weight_v") and os.path.isfile(os.path.join(source, d, INDEX_NAME)))
        for v in committed:
            files = _dir_fingerprint(os.path.join(source, f"weight_v{v:06d}"))
            if v in self.files:
                assert files == self.files[v], f"v{v}'s files changed after it was committed"
                continue
            self.files[v] = files
            result = pull(self.verifier, self.w.hf, source, v)
            assert result.applied_version == v
            got = _digests_of_dir(self.verifier)
            assert got in self.candidates.get(v, []), f"v{v} holds bytes no step that tried v{v} had"
            self.published[v] = got
        # Numbers are never skipped (a chain needs each one), and the trainer counts only those on disk.
        assert self.sync.version <= max(committed, default=0)

    def every_engine_serves_a_published_version_and_says_which(self):
        served = self.sync.engine_sync.served
        for e in self.engines:
            assert e.live_version in self.published, f"{e.name} serves v{e.live_version}, never published"
            assert e.live == self.published[e.live_version], f"{e.name}'s weights are not v{e.live_version}'s bytes"
            if e.name in self.reached or served[e.name] is not None:
                assert served[e.name] == e.live_version, (e.name, served[e.name], e.live_version)

    def teardown(self):
        try:
            if self.sync is not None:
                self.faults.clear()
                self._publish(must_succeed=True)  # the run can always publish again
                self.every_promise_holds()
        finally:
            for obj, name, real in self._patched:
                setattr(obj, name, real)
            if self.sync is not None:
                self.sync.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def test_a_failed_apply_through_torch_weight_sync_names_each_engines_version_and_the_next_publish_brings_it_up_first(
        tmp_path):
    """Issue 21 point 5 through the trainer object: e1 can apply v2 neither live nor by a reload."""
    w = _world()
    w.model.load_state_dict(w.seed_state)
    faults = Faults()
    engines = [EngineStandIn(f"e{i}", w.hf, str(tmp_path / f"engine{i}"), faults, {}) for i in range(2)]
    sync = TorchWeightSync(str(tmp_path / "shared"), w.hf, local_checkpoint_dir=str(tmp_path / "unused"),
                           engines=engines, retry_backoff_s=0.0)
    try:
        with torch.no_grad():
            for k in (1, 2, 3):
                next(iter(w.model.parameters())).view(-1)[k] += 0.5
                if k == 2:
                    faults.arm("e1:apply", 2)  # the live call and the reload in the same pause
                    with pytest.raises(EngineSyncError) as info:
                        sync.publish(w.model)
                    assert info.value.served == {"e0": 2, "e1": 1} and info.value.version == 2
                    assert info.value.metrics.served == {"e0": 2, "e1": 1}
                    assert "Engines now serve: e0 v2, e1 v1" in str(info.value)
                    assert [e.live_version for e in engines] == [2, 1] and not any(e.paused for e in engines)
                    assert sync.version == 2  # published: the engines' failure does not unpublish it
                    continue
                m = sync.publish(w.model)
        assert m.version == 3 and m.caught_up == {"e1": 2} and m.served == {"e0": 3, "e1": 3}
        assert [e.live_version for e in engines] == [3, 3]
        assert engines[1].live == engines[0].live  # both hold v3's bytes
    finally:
        sync.close()
        w.model.load_state_dict(w.seed_state)


# Each step publishes a real model and pulls it back: a handful of sequences in CI, hundreds of
# longer ones in the thorough profile.
UpdatersUnderFaults.TestCase.settings = settings(
    max_examples=300 if THOROUGH else 6,
    stateful_step_count=40 if THOROUGH else 12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
test_the_updaters_under_faults_keep_every_promise = UpdatersUnderFaults.TestCase
