"""A model-based test of a bucket as the source dir, on the real S3 server (SeaweedFS on loopback).

Hypothesis drives random sequences of the source-dir model's step kinds that apply to a bucket
(``test_core_source_dir_model.py``, same oracle): publish (delta, full, or the publisher's
choice; side anchors due every two deltas; pruning to the newest few after each commit), a
publisher process that dies at any one of its writes (local staging or bucket: a spawned
process calls ``os._exit`` there) and is restarted, a publisher restart, explicit pruning of the
bucket (``prune_bucket``, what ``weightsync prune s3://...`` runs), a prune while one index in
the bucket is unreadable (damaged, nested too deeply, absent mid-restore) and restored after,
a second publisher of the run on another host (its own staging copy, a spawned process)
committing the next version the first one is about to publish, a pull on any host to any
version, a host joining, one flipped byte in any shard in the bucket, a shard header retyped
to a dtype of the same width, and the repair of that damage.

Not here (they do not apply to a bucket as such): a seed dir edited in place with a new run
(a property of the puller's local state, covered by the directory model), and a death halfway
through one object's write (a PUT or a multipart upload lands whole or not at all).

What must hold after every step:
- a pull that returns success holds exactly the bytes the trainer meant for its target, under
  the headers (dtype, shape) it meant, and its marker names it;
- every failure is a ``WeightSyncError`` the model explains: the target pruned (or never
  published), a backwards pull, or damage in the bucket; with nothing damaged, a pull of a
  published, retained version at or above the host's never fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import multiprocessing

import obstore
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from core_support import (
    ST_OF_NP,
    THOROUGH,
    checkpoint_files,
    marker_version,
    mutate,
    random_tensors,
    raw_header,
    read_checkpoint_bytes,
    tensor_bytes,
    write_hf_checkpoint,
)
from weightsync import Publisher, errors, pull
from weightsync.publisher.prune import prune_bucket
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
INDEX = "model.safetensors.index.json"
DIED = 77  # a spawned publisher's exit code when it died at the chosen write
MAX_HOSTS = 3


def _count(step: str) -> None:
    STEPS[step] = STEPS.get(step, 0) + 1


def _publisher(url: str, seed: str, tensors: dict, version: int) -> Publisher:
    pub = Publisher(url, template_dir=seed, encoding="sparse-v1", workers=1, keep_versions=KEEP, anchor_max_deltas=2)
    pub.seed_snapshot({n: as_raw(a) for n, a in tensors.items()}, version=version)
    return pub


def _publish_until_death(env: dict, url: str, seed: str, base: dict, base_version: int, v: int, new: dict,
                         at_write: int) -> None:  # fmt: skip
    """In a spawned process (a fork would copy the client's runtime threads mid-state): a
    restarted trainer publishing ``v`` whose ``at_write``-th write (a file in the staging copy, or
    a PUT, conditional create or DELETE in the bucket) never happens: the process exits there."""
    os.environ.update(env)
    import weightsync.publisher.publish as publish_mod
    from weightsync.storage import source as source_mod

    count = [0]

    def dying(real):
        def write(*a, **kw):
            count[0] += 1
            if count[0] > at_write:
                os._exit(DIED)
            return real(*a, **kw)
        return write

    publish_mod.write_file, publish_mod.write_bytes = dying(publish_mod.write_file), dying(publish_mod.write_bytes)
    for name in ("put_file", "create", "replace", "delete"):
        setattr(source_mod.BucketSource, name, dying(getattr(source_mod.BucketSource, name)))
    pub = _publisher(url, seed, base, base_version)
    pub.publish(v, new, full=False)
    pub.close()
    os._exit(0)


def _publish_from_another_process(env: dict, url: str, seed: str, base: dict, base_version: int, v: int, new: dict) -> None:
    """In a spawned process (its staging copy named by ``env``): a restarted trainer."""
    os.environ.update(env)
    pub = _publisher(url, seed, base, base_version)
    pub.publish(v, new)
    pub.close()


def _spawn(target, *args) -> int:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(300)
    assert proc.exitcode is not None, "the spawned publisher did not finish"
    return proc.exitcode


def _local_layout(local: str) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for fname in checkpoint_files(local):
        _, hdr = raw_header(os.path.join(local, fname))
        out.update({n: (e["dtype"], e["shape"]) for n, e in hdr.items() if n != "__metadata__"})
    return out


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
            self.stagings = 0
            self.damaged: dict[str, bytes] = {}  # key -> the original bytes
            self.src = BucketSource(self.url)
            self.pub: Publisher | None = self._publisher(0)

        def _env(self) -> dict[str, str]:
            return {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "WEIGHTSYNC_"))}

        def _published(self) -> set[int]:
            return {int(k.split("/")[0][len("weight_v"):]) for k in self.src.list() if k.startswith("weight_v")
                    and k.endswith(INDEX)}

        def _publisher(self, version: int) -> Publisher:
            return _publisher(self.url, self.seed, self.tensors[version], version)

        def teardown(self):
            if self.pub is not None:
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
            if self.pub is None:
                self.pub = self._publisher(self.top)
            self.pub.publish(self.top + 1, new, full=full if self.top + 1 > 1 else True)
            self.tensors.append(new)
            self.expected[self.top] = tensor_bytes(new)
            STEPS["publish"] = STEPS.get("publish", 0) + 1

        @rule(density=st.sampled_from([0.001, 0.01]))
        def publish_a_sparse_step(self, density):
            self.publish("delta", density)

        @rule()
        def restart_publisher(self):
            if self.pub is not None:
                self.pub.close()
            self.pub = self._publisher(self.top)

        @rule(at_write=st.integers(0, 14), density=st.sampled_from([0.01, 0.3]))
        def publish_and_die(self, at_write, density):
            """A trainer process dies at one of its writes while publishing the next version; the
            next publish is a restarted one on the same staging copy. The version counts as the
            trainer's once its index is committed in the staging copy (a restarted publisher
            uploads it before anything newer): until then a pull of it is "not ready"."""
            if self.damaged:
                return
            if self.pub is not None:
                self.pub.close()
                self.pub = None
            v = self.top + 1
            new = mutate(self.tensors[-1], rng, density)
            code = _spawn(_publish_until_death, self._env(), self.url, self.seed, self.tensors[self.top], self.top, v,
                          new, at_write)  # fmt: skip
            assert code in (0, DIED), f"the dying publisher failed otherwise (exit {code})"
            staging = os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"]
            from weightsync.storage.bucket_publish import default_staging_dir
            from weightsync.storage.url import parse_bucket_url

            local_index = os.path.join(default_staging_dir(parse_bucket_url(self.url)), f"weight_v{v:06d}", INDEX)
            assert local_index.startswith(staging)
            if os.path.exists(local_index) or v in self._published():
                self.tensors.append(new)
                self.expected[v] = tensor_bytes(new)
            _count(f"publisher {'died' if code == DIED else 'finished'}")

        @rule(keep=st.integers(1, 3))
        def prune(self, keep):
            report = prune_bucket(self.url, keep)
            _count("prune")
            if report.pruned:
                _count("prune deleted")

        @rule(data=st.data(), keep=st.integers(1, 3), how=st.sampled_from(["damaged", "nested", "absent"]))
        def prune_while_an_index_is_unreadable(self, data, keep, how):
            published = sorted(self._published())
            if not published:
                return
            v = data.draw(st.sampled_from(published), label="version")
            key = f"weight_v{v:06d}/{INDEX}"
            good = self.src.read(key)
            if how == "absent":
                self.src.delete([key])
            else:
                bad = good[:1] + b"#" + good[1:] if how == "damaged" else b"[" * 50_000 + b"]" * 50_000
                obstore.put(self.src.store, key, bad)
            report = prune_bucket(self.url, keep)
            if how != "absent":
                assert v not in report.pruned and v in report.unreadable  # flagged, never judged
            if self.src.list(prefix=f"weight_v{v:06d}/"):
                obstore.put(self.src.store, key, good)  # restored: its shards are all still there
                _count(f"prune with an index {how}: kept")
            else:
                _count(f"prune with an index {how}: pruned")

        @rule(first_prepared=st.booleans(), other_host=st.booleans(), density=st.sampled_from([0.01, 0.3]))
        def a_second_publisher_of_the_run(self, first_prepared, other_host, density):
            """A restarted trainer (another process: on this host, the same staging copy; on
            another host, an empty one, filled from the bucket) commits the next version while
            the first one is about to publish it (or has prepared it): the first one's attempt
            fails loud and never lands; the second's version stands, and the trainer goes on
            from the second one's staging copy."""
            if self.damaged:
                return
            if self.pub is None:
                self.pub = self._publisher(self.top)
            v = self.top + 1
            old, new = mutate(self.tensors[-1], rng, density), mutate(self.tensors[-1], rng, density)
            prepared = self.pub.prepare(v, old) if first_prepared else None
            env = self._env()
            # Another host sees the bucket only: the trainer's newest version must be there (one a
            # dead publisher committed in its staging copy only is uploaded by a restart on its host).
            other_host = other_host and (self.top == 0 or self.top in self._published())
            if other_host:
                self.stagings += 1
                env["WEIGHTSYNC_BUCKET_STAGING_DIR"] = os.path.join(self.root, f"staging-host-{self.stagings}")
            code = _spawn(_publish_from_another_process, env, self.url, self.seed, self.tensors[self.top],
                          self.top, v, new)  # fmt: skip
            assert code == 0, "the second publisher failed"
            landed = self.src.read(f"weight_v{v:06d}/{INDEX}")
            with pytest.raises(errors.WeightSyncError):
                if prepared is not None:
                    kind, _ = self.pub.choose_kind(v, prepared.delta_nbytes, prepared.full_nbytes)
                    self.pub.commit(v, kind, [self.pub.write(prepared, kind)])
                else:
                    self.pub.publish(v, old)
            assert self.src.read(f"weight_v{v:06d}/{INDEX}") == landed, "the superseded publisher replaced the index"
            self.tensors.append(new)
            self.expected[v] = tensor_bytes(new)
            self.pub.close()
            self.pub = None
            os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"] = env["WEIGHTSYNC_BUCKET_STAGING_DIR"]
            _count(f"second publisher committed ({'another host' if other_host else 'this host'})")

        @rule()
        def a_host_joins(self):
            if len(self.hosts) < MAX_HOSTS:
                self.applied[len(self.hosts)] = None
                self.hosts.append(os.path.join(self.root, f"host{len(self.hosts)}"))
                _count("host joined")

        @rule(host=st.integers(0, MAX_HOSTS - 1), back=st.sampled_from([0, 0, 1, 2, 5]))
        def pull_a_version(self, host, back):
            host = host % len(self.hosts)
            target = max(0, self.top - back)
            published = self._published()
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
            want = {n: (ST_OF_NP[a.dtype.name], list(a.shape)) for n, a in self.tensors[target].items()}
            assert _local_layout(self.hosts[host]) == want, f"host {host} at v{target} holds other headers"
            assert marker_version(self.hosts[host]) == target
            self.applied[host] = target

        # Pulls weigh as much as the other steps together: they are what the oracle checks.
        @rule(host=st.integers(0, MAX_HOSTS - 1), back=st.sampled_from([0, 1, 3]))
        def pull_again(self, host, back):
            self.pull_a_version(host, back)

        @rule(host=st.integers(0, MAX_HOSTS - 1))
        def pull_the_newest(self, host):
            self.pull_a_version(host, 0)

        @rule()
        def the_seed_dir_rewritten_with_its_own_bytes(self):
            # New inodes, same bytes (a seed dir restored from a copy): the seed's fingerprint
            # changes, so a host's next pull reseeds while the mirror's plan was priced with the
            # marker's old fingerprint (the fast path that skips hashing the seed twice) and
            # fetched only the chain above the marker: its fallback must fetch the rest.
            for name in os.listdir(self.seed):
                path = os.path.join(self.seed, name)
                shutil.copyfile(path, path + ".tmp")
                os.replace(path + ".tmp", path)
            _count("seed dir rewritten")

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

        @rule(pick=st.integers(0, 10**6))
        def retype_a_header(self, pick):
            """One tensor's dtype in a shard header in the bucket changed to another of the same
            width: every byte count and digest still match, only the meaning changes."""
            same_width = {b'"F32"': b'"I32"', b'"I32"': b'"F32"'}
            shards = sorted(k for k in self.src.list() if k.endswith(".safetensors") and k not in self.damaged)
            if not shards:
                return
            key = shards[pick % len(shards)]
            data = self.src.read(key)
            n = int.from_bytes(data[:8], "little")
            head = data[8:8 + n]
            spots = [(at, old) for old in same_width for at in range(len(head)) if head.startswith(old, at)]
            if not spots:
                return
            at, old = spots[pick % len(spots)]
            self.damaged[key] = data
            obstore.put(self.src.store, key, data[:8] + head[:at] + same_width[old] + head[at + len(old):] + data[8 + n:])
            _count("retype")

        @rule()
        def repair(self):
            for key, data in self.damaged.items():
                obstore.put(self.src.store, key, data)
            self.damaged.clear()

    BucketModel.TestCase.settings = settings(
        max_examples=40 if THOROUGH else 6, stateful_step_count=25 if THOROUGH else 15, deadline=None,
    )
    run_state_machine_as_test(BucketModel, settings=BucketModel.TestCase.settings)


def test_report_how_many_steps_ran():
    print(f"\nbucket model: {dict(sorted(STEPS.items()))}")
