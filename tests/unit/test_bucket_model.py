"""A model-based test of a bucket as the source dir, on the real S3 server (SeaweedFS on loopback).

Hypothesis drives random sequences of: publish (delta, full, or the publisher's choice; side
anchors due every two deltas; pruning to the newest few after each commit), a publisher restart
(a new ``Publisher`` on the same staging copy, seeded with the last committed tensors), a pull
on one of two hosts to any version, one flipped byte in any shard in the bucket, and its repair.

What must hold after every step:
- a pull that returns success holds exactly the bytes the trainer meant for its target, and its
  marker names it;
- every failure is a ``WeightSyncError`` the model explains: the target pruned (or never
  published), a backwards pull, or damage in the bucket; with nothing damaged, a pull of a
  published, retained version at or above the host's never fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import obstore
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from core_support import THOROUGH, marker_version, mutate, random_tensors, read_checkpoint_bytes, tensor_bytes, write_hf_checkpoint
from weightsync import Publisher, errors, pull
from weightsync.publisher.snapshot import as_raw
from weightsync.storage.source import BucketSource

from bucket_support import s3_server_fixture

s3 = s3_server_fixture()
KEEP = 3
# Large enough that a sparse step is a delta (tiny tensors make every version full by the size rule).
SIZES = {
    "embed": ("float32", (256, 64)),
    "layers.0.w": ("float32", (128, 128)),
    "layers.1.w": ("float32", (128, 128)),
    "norm": ("float32", (64,)),
}
STEPS: dict[str, int] = {}  # rule -> how often it ran (test_report_how_many_steps_ran prints it)


def test_a_bucket_source_under_random_publishes_restarts_pulls_and_damage_serves_exact_bytes(s3, monkeypatch, rng):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "5")

    class BucketModel(RuleBasedStateMachine):
        @initialize()
        def start(self):
            self.root = tempfile.mkdtemp(prefix="ws-bucket-model-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"] = os.path.join(self.root, "staging")
            self.url = s3.url(f"model/{uuid.uuid4().hex[:12]}")
            self.seed = os.path.join(self.root, "seed")
            self.tensors = [random_tensors(rng, SIZES)]
            write_hf_checkpoint(self.seed, self.tensors[0])
            self.expected = {0: tensor_bytes(self.tensors[0])}
            self.hosts = [os.path.join(self.root, f"host{i}") for i in range(2)]
            self.applied: dict[int, int | None] = {0: None, 1: None}
            self.damaged: dict[str, bytes] = {}  # key -> the original bytes
            self.src = BucketSource(self.url)
            self.pub = self._publisher(0)

        def _publisher(self, version: int) -> Publisher:
            pub = Publisher(self.url, template_dir=self.seed, encoding="sparse-v1", workers=1, keep_versions=KEEP,
                            anchor_max_deltas=2)
            pub.seed_snapshot({n: as_raw(a) for n, a in self.tensors[version].items()}, version=version)
            return pub

        def teardown(self):
            self.pub.close()
            shutil.rmtree(self.root, ignore_errors=True)

        @property
        def top(self) -> int:
            return len(self.tensors) - 1

        @rule(kind=st.sampled_from(["delta", "delta", "full", "auto"]), density=st.sampled_from([0.001, 0.01, 0.3]))
        def publish(self, kind, density):
            if self.damaged:
                return  # the publisher reads nothing back from the bucket; keep the model simple
            new = mutate(self.tensors[-1], rng, density)
            full = {"delta": False, "full": True, "auto": None}[kind]
            STEPS[f"publish {kind}"] = STEPS.get(f"publish {kind}", 0) + 1
            self.pub.publish(self.top + 1, new, full=full if self.top + 1 > 1 else True)
            self.tensors.append(new)
            self.expected[self.top] = tensor_bytes(new)
            STEPS["publish"] = STEPS.get("publish", 0) + 1

        @rule(density=st.sampled_from([0.001, 0.01]))
        def publish_a_sparse_step(self, density):
            self.publish("delta", density)

        @rule()
        def restart_publisher(self):
            self.pub.close()
            self.pub = self._publisher(self.top)

        @rule(host=st.integers(0, 1), back=st.sampled_from([0, 0, 1, 2, 5]))
        def pull_a_version(self, host, back):
            target = max(0, self.top - back)
            published = {int(k.split("/")[0][len("weight_v"):]) for k in self.src.list() if k.startswith("weight_v")
                         and k.endswith("model.safetensors.index.json")}
            try:
                result = pull(self.hosts[host], self.seed, self.url, target)
            except errors.WeightSyncError as e:
                applied = self.applied[host]
                explained = (
                    bool(self.damaged)
                    or (target > 0 and target not in published)
                    or (applied is not None and target < applied)
                    or isinstance(e, errors.ChainBrokenError)  # retention pruned the chain below the host's state
                )
                assert explained, f"pull v{target} on host {host} failed with nothing to explain it: {e!r}"
                STEPS["explained failure"] = STEPS.get("explained failure", 0) + 1
                if isinstance(e, (errors.LocalStateError, errors.CorruptArtifactError)):
                    self.applied[host] = marker_version(self.hosts[host])
                return
            assert result.applied_version == target
            STEPS[result.action] = STEPS.get(result.action, 0) + 1
            got = read_checkpoint_bytes(self.hosts[host])
            assert got == self.expected[target], f"host {host} at v{target} holds other bytes"
            assert marker_version(self.hosts[host]) == target
            self.applied[host] = target

        @rule(pick=st.integers(0, 10**6))
        def damage_a_shard(self, pick):
            if pick % 3:
                return  # damage one step in three it is drawn: most sequences publish and pull more
            shards = sorted(k for k in self.src.list() if k.endswith(".safetensors") and k not in self.damaged)
            if not shards:
                return
            key = shards[pick % len(shards)]
            data = self.src.read(key)
            self.damaged[key] = data
            flipped = bytearray(data)
            flipped[-1 - pick % min(len(data) // 2, 64)] ^= 0x5A
            obstore.put(self.src.store, key, bytes(flipped))
            STEPS["damage"] = STEPS.get("damage", 0) + 1

        @rule()
        def repair(self):
            for key, data in self.damaged.items():
                obstore.put(self.src.store, key, data)
            self.damaged.clear()

    BucketModel.TestCase.settings = settings(
        max_examples=40 if THOROUGH else 4, stateful_step_count=25 if THOROUGH else 10, deadline=None,
    )
    run_state_machine_as_test(BucketModel, settings=BucketModel.TestCase.settings)


def test_report_how_many_steps_ran():
    print(f"\nbucket model: {dict(sorted(STEPS.items()))}")
