"""A model-based test of the source dir (issue 18, "How it must be shown").

Hypothesis drives random sequences of: publish (delta, full or the publisher's choice, side
anchors due every two deltas, pruning after every commit), a publish whose process dies
before or in the middle of any one of its file writes (a real death: a forked child calls
``os._exit`` there, so no cleanup code runs), a publisher restart, explicit pruning, one
flipped byte in any shard of any anchor or version, a repair of that damage, a host joining,
a pull on any host to any version, a seed dir edited in place (size and mtime kept)
followed by a new run from the edited model, a second publisher of the same run (a real forked
process) committing the next version while the first one holds written shards or is about to
publish it (the first one's attempt must fail loud and never land), and a prune while one index
is unreadable (damaged, nested too deeply, or absent mid-restore), restored after, and a
shard header of a full version or an anchor whose dtype is changed to another of the same width
(every digest still matches).

What must hold after every step:
- every pull that returns success holds exactly the bytes the trainer meant for its target,
  under the headers (dtype, shape) it meant, and its marker names that target;
- every failure is a ``WeightSyncError``, and one the model can explain: the target pruned,
  a backwards pull, or damage in the source dir; a retry after the damage is repaired pulls
  the exact bytes. With nothing damaged, a pull of a published version never fails;
- a publish refused because its base does not match what the source dir records happens only
  over damage (a shard header holds the digests it reads).

Default profile: a handful of short sequences (CI); ``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough``
runs many more and longer ones. Every run adds its count of sequences and steps to
``SEQUENCES`` (printed by ``test_report_how_many_sequences_ran``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import weightsync.publisher.publish as publish_mod
from weightsync import Publisher, errors, pull, supported_encodings
from weightsync.publisher.prune import prune_versions

from core_support import (
    ST_OF_NP,
    THOROUGH,
    checkpoint_files,
    marker_version,
    mutate,
    raw_header,
    read_checkpoint_bytes,
    tensor_bytes,
    write_hf_checkpoint,
)

INDEX = "model.safetensors.index.json"
MAX_VERSIONS = 8
MAX_HOSTS = 3
DIED = 77  # a forked publisher's exit code when it died at the chosen write
BASE_REFUSED = 78  # a forked publisher's exit code when its base check refused (over damage only)
SPEC = {"embed": ("float32", (48, 16)), "layer.w": ("float16", (64, 8)), "norm": ("float32", (16,)), "step": ("int32", (1,))}
SEQUENCES = {"sequences": 0, "steps": 0}


class SourceDirModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.root = tempfile.mkdtemp(prefix="ws-srcmodel-", dir=shm)
        self.seed_dir = os.path.join(self.root, "seed")
        self.source = os.path.join(self.root, "src")
        self.hosts = [os.path.join(self.root, "host0")]
        self.tensors: dict[int, dict[str, np.ndarray]] = {}  # committed versions of this run
        self.pub: Publisher | None = None
        self.damage: dict[str, tuple[int, bytes]] = {}  # path -> (its inode, its bytes before the flip)
        self.runs = 0
        SEQUENCES["sequences"] += 1

    def teardown(self) -> None:
        if self.pub is not None:
            self.pub.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- the run --------------------------------------------------------------------------------

    @initialize(seed=st.integers(0, 2**32 - 1), shards=st.integers(1, 2))
    def make_model(self, seed, shards):
        rng = np.random.default_rng(seed)
        t0 = {n: np.frombuffer(rng.bytes(int(np.prod(s)) * np.dtype(d).itemsize), d).reshape(s).copy() for n, (d, s) in SPEC.items()}
        write_hf_checkpoint(self.seed_dir, t0, shards=shards)
        self.tensors = {0: t0}

    @property
    def latest(self) -> int:
        return max(self.tensors)

    def _new_publisher(self, encoding: str) -> Publisher:
        pub = Publisher(self.source, encoding=encoding, workers=1, anchor_max_deltas=2, keep_versions=2, prune=True)
        pub.seed_snapshot(self.tensors[self.latest], version=self.latest)
        return pub

    def _step(self) -> None:
        SEQUENCES["steps"] += 1

    @precondition(lambda self: self.latest < MAX_VERSIONS)
    @rule(how=st.sampled_from(["delta", "delta", "full", "auto"]), encoding=st.sampled_from(supported_encodings()),
          density=st.sampled_from([0.0, 0.02, 0.3]), pick=st.integers(0, 2**32 - 1))
    def publish(self, how, encoding, density, pick):
        self._step()
        if self.pub is None:
            self.pub = self._new_publisher(encoding)
        v = self.latest + 1
        new = self._next_tensors(pick, density)
        full = {"delta": False, "full": True, "auto": None}[how]
        try:
            result = self.pub.publish(v, new, full=full)
        except errors.BaseMismatchError:
            # The check read a digest from a damaged shard header: only over damage, and a
            # publish after the repair goes through.
            assert self._live_damage(), "a base refused with nothing damaged"
            event("publish refused over damage (base check)")
            self._repair()
            self.pub.close()
            self.pub = self._new_publisher(encoding)
            result = self.pub.publish(v, new, full=full)
        assert result.version == v
        self.tensors[v] = new
        event(f"published {result.kind}{' + anchor' if result.anchor_nbytes else ''}")

    def _next_tensors(self, pick: int, density: float) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(pick)
        prev = self.tensors[self.latest]
        return mutate(prev, rng, density, [n for n in sorted(prev) if rng.random() < 0.6])

    @precondition(lambda self: self.latest < MAX_VERSIONS)
    @rule(at_write=st.integers(0, 8), midway=st.booleans(), encoding=st.sampled_from(supported_encodings()),
          density=st.sampled_from([0.02, 0.3]), pick=st.integers(0, 2**32 - 1))
    def publish_and_die(self, at_write, midway, encoding, density, pick):
        """A publisher process that dies before (or halfway through) its ``at_write``-th file
        write; what it leaves behind is whatever it wrote. The trainer then restarts."""
        self._step()
        if self.pub is not None:
            self.pub.close()
            self.pub = None
        v = self.latest + 1
        new = self._next_tensors(pick, density)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                code = _publish_until_death(self.source, self.tensors[self.latest], self.latest, v, new, encoding,
                                            at_write, midway)  # fmt: skip
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code == BASE_REFUSED:
            assert self._live_damage(), "the forked publisher's base was refused with nothing damaged"
            event("forked publisher refused over damage (base check)")
            self._repair()
            return
        assert code in (0, DIED), f"the forked publisher failed otherwise (exit {code})"
        committed = os.path.exists(os.path.join(self.source, f"weight_v{v:06d}", INDEX))
        if committed:  # the index landed before the death (or nothing died): v is published
            self.tensors[v] = new
        event(f"publisher {'died' if code == DIED else 'finished'}, v{'' if committed else ' not'} committed")

    @rule()
    def restart_publisher(self):
        self._step()
        if self.pub is not None:
            self.pub.close()
            self.pub = None

    @rule(keep=st.integers(1, 3))
    def prune(self, keep):
        self._step()
        prune_versions(self.source, keep)

    @rule(tensor=st.sampled_from(sorted(SPEC)), pos=st.integers(0, 10**6), mask=st.integers(1, 255))
    def edit_the_seed_in_place_and_start_a_new_run(self, tensor, pos, mask):
        """The model dir edited in place (size and mtime kept); the trainer starts a new run from
        it in a fresh source dir. Hosts keep whatever they hold."""
        self._step()
        from safetensors.numpy import load_file

        from core_support import tensor_location

        path, off, nbytes = tensor_location(self.seed_dir, tensor)
        st_ = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(off + pos % nbytes)
            b = f.read(1)[0]
            f.seek(off + pos % nbytes)
            f.write(bytes([b ^ mask]))
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))
        if self.pub is not None:
            self.pub.close()
            self.pub = None
        shutil.rmtree(self.source, ignore_errors=True)
        self.damage.clear()
        t0: dict[str, np.ndarray] = {}
        for fname in sorted(glob.glob(os.path.join(self.seed_dir, "*.safetensors"))):
            t0.update(load_file(fname))
        self.tensors = {0: t0}
        self.runs += 1
        event("seed dir edited in place, new run")

    # --- a second publisher of the run -------------------------------------------------------------

    @precondition(lambda self: self.latest < MAX_VERSIONS)
    @rule(first_wrote=st.booleans(), encoding=st.sampled_from(supported_encodings()),
          density=st.sampled_from([0.02, 0.3]), pick=st.integers(0, 2**32 - 2))
    def a_second_publisher_of_the_run(self, first_wrote, encoding, density, pick):
        """A restarted trainer (a forked process) publishes the next version while the first
        publisher has written its shards of that version (``first_wrote``) or is about to publish
        it: the first one's attempt fails loud and never lands; the second one's version stands."""
        self._step()
        self._repair()  # the base checks of both read the source dir: no damage in this step
        if self.pub is None:
            self.pub = self._new_publisher(encoding)
        v = self.latest + 1
        prev = self.tensors[self.latest]
        old = mutate(prev, np.random.default_rng(pick), density)
        new = mutate(prev, np.random.default_rng(pick + 1), density)
        written = None
        if first_wrote:
            prepared = self.pub.prepare(v, old)
            kind, _ = self.pub.choose_kind(v, prepared.delta_nbytes, prepared.full_nbytes)
            written = (kind, self.pub.write(prepared, kind))
        pid = os.fork()
        if pid == 0:  # the second publisher: never returns into pytest
            code = 1
            try:
                second = Publisher(self.source, encoding=encoding, workers=1, anchor_max_deltas=2, keep_versions=2,
                                   prune=True)
                second.seed_snapshot(prev, version=self.latest)
                second.publish(v, new)
                second.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the second publisher failed"
        self.tensors[v] = new
        index = os.path.join(self.source, f"weight_v{v:06d}", INDEX)
        with open(index, "rb") as f:
            landed = f.read()
        if written is not None:
            with pytest.raises(errors.SupersededPublisherError):
                self.pub.commit(v, written[0], [written[1]])
        else:
            with pytest.raises((errors.VersionConflictError, errors.SupersededPublisherError)):
                self.pub.publish(v, old)
        with open(index, "rb") as f:
            assert f.read() == landed, "the superseded publisher rewrote the committed index"
        self.pub.close()
        self.pub = None  # the superseded trainer is gone; the next publish is a restarted one
        event(f"second publisher committed; the first {'had written' if first_wrote else 'had not written'}")

    # --- an index unreadable during a prune ----------------------------------------------------

    @rule(data=st.data(), keep=st.integers(1, 3), how=st.sampled_from(["damaged", "nested", "absent"]))
    def prune_while_an_index_is_unreadable(self, data, keep, how):
        """One version's index is unreadable while a prune runs (damaged, nested too deeply, or
        moved away mid-restore); it is restored after (if its dir is still there)."""
        self._step()
        indexes = sorted(glob.glob(os.path.join(self.source, "weight_v*", INDEX)))
        if not indexes:
            return
        path = data.draw(st.sampled_from(indexes), label="index")
        with open(path, "rb") as f:
            good = f.read()
        if how == "absent":
            os.unlink(path)
        else:
            # (a byte flipped inside a key can leave JSON that parses to another index: not this step)
            bad = good[:1] + b"#" + good[1:] if how == "damaged" else b"[" * 50_000 + b"]" * 50_000
            with open(path, "wb") as f:
                f.write(bad)
        prune_versions(self.source, keep)
        if os.path.isdir(os.path.dirname(path)):
            with open(path, "wb") as f:
                f.write(good)
            event(f"prune with an index {how}: version kept")
        else:
            event(f"prune with an index {how}: version pruned")

    # --- damage ---------------------------------------------------------------------------------

    def _shards(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.source, "weight_v*", "*.safetensors"))
                      + glob.glob(os.path.join(self.source, "anchor_v*", "*.safetensors")))  # fmt: skip

    @rule(data=st.data())
    def flip_one_byte_of_a_shard(self, data):
        self._step()
        shards = [p for p in self._shards() if p not in self.damage]
        if not shards:
            return
        path = data.draw(st.sampled_from(shards), label="shard")
        with open(path, "rb") as f:
            original = f.read()
        pos = data.draw(st.integers(0, len(original) - 1), label="byte")
        mask = data.draw(st.integers(1, 255), label="mask")
        with open(path, "r+b") as f:
            f.seek(pos)
            f.write(bytes([original[pos] ^ mask]))
        self.damage[path] = (os.stat(path).st_ino, original)
        event("damaged an anchor" if "/anchor_v" in path else "damaged a version's shard")

    @rule(data=st.data())
    def retype_a_header(self, data):
        """One tensor's dtype in a shard header changed to another of the same width (F32 to
        I32, F16 to BF16, I32 to F32): every byte count and every digest still match, only the
        meaning changes. A pull must not serve it (issue 28, point 6)."""
        self._step()
        same_width = {b'"F32"': b'"I32"', b'"I32"': b'"F32"', b'"F16"': b'"BF16"'}
        candidates = []
        for path in self._shards():
            if path in self.damage:
                continue
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                raw = f.read(n)
            candidates += [(path, at, old) for old in same_width for at in _find_all(raw, old)]
        if not candidates:
            return
        path, at, old = data.draw(st.sampled_from(candidates), label="header dtype")
        with open(path, "rb") as f:
            original = f.read()
        new = same_width[old]
        head = original[8:8 + int.from_bytes(original[:8], "little")]
        raw = head[:at] + new + head[at + len(old):]
        if len(raw) != len(head):  # F16 -> BF16 is one byte longer: take a padding space
            if not raw.endswith(b" "):
                return
            raw = raw[:-1]
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(raw)
        self.damage[path] = (os.stat(path).st_ino, original)
        event("retyped a header of an anchor" if "/anchor_v" in path else "retyped a header of a version's shard")

    def _live_damage(self) -> list[str]:
        """The damaged files still there as damaged (not pruned, not replaced by a republish)."""
        live = []
        for path, (ino, _) in self.damage.items():
            try:
                if os.stat(path).st_ino == ino:
                    live.append(path)
            except FileNotFoundError:
                pass
        return live

    def _repair(self) -> None:
        for path, (ino, original) in self.damage.items():
            try:
                if os.stat(path).st_ino != ino:
                    continue  # a republish replaced the damaged file (a new inode): nothing to repair
            except FileNotFoundError:
                continue  # pruned meanwhile
            with open(path, "r+b") as f:
                f.write(original)
        self.damage.clear()

    @rule()
    def repair(self):
        self._step()
        self._repair()

    # --- hosts ----------------------------------------------------------------------------------

    @precondition(lambda self: len(self.hosts) < MAX_HOSTS)
    @rule()
    def a_host_joins(self):
        self._step()
        self.hosts.append(os.path.join(self.root, f"host{len(self.hosts)}"))

    @rule(data=st.data())
    def pull_on_a_host(self, data):
        self._step()
        local = data.draw(st.sampled_from(self.hosts), label="host")
        target = data.draw(st.integers(0, self.latest), label="target")
        try:
            action = self._pull_exactly(local, target)
            event(f"pull ok: {action}")
            return
        except errors.BackwardPullError:
            assert (marker_version(local) or 0) > target
            event("pull refused: backwards")
            return
        except errors.WeightSyncError as e:
            first = e
        # A failure must be one the model can explain, and a retry must then recover.
        published = target == 0 or os.path.exists(os.path.join(self.source, f"weight_v{target:06d}", INDEX))
        if not published:
            event(f"pull failed (v{target} pruned): {type(first).__name__}")
            return
        if self._live_damage():
            event(f"pull failed over damage: {type(first).__name__}")
            self._repair()
            try:
                self._pull_exactly(local, target)
                return
            except errors.ChainBrokenError as e:
                first = e
        raise AssertionError(f"pull of v{target} on {os.path.basename(local)} failed with nothing damaged: {first!r}")

    def _pull_exactly(self, local: str, target: int) -> str:
        result = pull(local, self.seed_dir, self.source, target, workers=1)
        assert result.applied_version == target
        assert marker_version(local) == target
        actual = read_checkpoint_bytes(local)
        expected = tensor_bytes(self.tensors[target])
        bad = sorted(n for n in set(actual) | set(expected) if actual.get(n) != expected.get(n))
        assert not bad, f"{os.path.basename(local)} reports v{target} ({result.action}) but differs in {bad}"
        # The same bytes under another dtype are other weights: the headers must match too.
        layout = _local_layout(local)
        want = {n: (ST_OF_NP[a.dtype.name], list(a.shape)) for n, a in self.tensors[target].items()}
        assert layout == want, f"{os.path.basename(local)} reports v{target} ({result.action}) with other headers"
        return result.action + (" (reseeded)" if result.reseeded else "")


def _find_all(raw: bytes, needle: bytes) -> list[int]:
    out, at = [], raw.find(needle)
    while at >= 0:
        out.append(at)
        at = raw.find(needle, at + 1)
    return out


def _local_layout(local: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from the local checkpoint's headers, parsed by hand."""
    out = {}
    for fname in checkpoint_files(local):
        _, hdr = raw_header(os.path.join(local, fname))
        out.update({n: (e["dtype"], e["shape"]) for n, e in hdr.items() if n != "__metadata__"})
    return out


def _publish_until_death(source: str, base: dict, base_version: int, v: int, new: dict, encoding: str,
                         at_write: int, midway: bool) -> int:  # fmt: skip
    """In a forked child: a fresh publisher of ``v`` whose ``at_write``-th file write (counting
    shard, anchor and index writes) never finishes: the process exits there, with no cleanup."""
    count = [0]
    real_file, real_bytes = publish_mod.write_file, publish_mod.write_bytes

    def die_here(path, chunks):
        if midway:  # half of what this write would have written, then the end
            with open(path + ".partial-death", "wb") as f:
                for i, c in enumerate(chunks):
                    if i % 2 == 0:
                        f.write(c)
        os._exit(DIED)

    def write_file(path, chunks, **kw):
        count[0] += 1
        if count[0] > at_write:
            die_here(path, chunks)
        return real_file(path, chunks, **kw)

    def write_bytes(path, data, **kw):
        count[0] += 1
        if count[0] > at_write:
            if midway:  # half of it, under a name no reader takes for the file
                with open(path + ".partial-death", "wb") as f:
                    f.write(data[: len(data) // 2])
            os._exit(DIED)
        return real_bytes(path, data, **kw)

    publish_mod.write_file, publish_mod.write_bytes = write_file, write_bytes
    pub = Publisher(source, encoding=encoding, workers=1, anchor_max_deltas=2, keep_versions=2, prune=True)
    pub.seed_snapshot(base, version=base_version)
    try:
        pub.publish(v, new, full=False)
    except errors.BaseMismatchError:
        return BASE_REFUSED
    pub.close()
    return 0


TestSourceDirModel = SourceDirModel.TestCase
TestSourceDirModel.settings = settings(
    settings.default,
    max_examples=400 if THOROUGH else 8,
    stateful_step_count=60 if THOROUGH else 25,
)


def test_report_how_many_sequences_ran():
    """Not a check: the count of sequences and steps this session's model runs made."""
    print(json.dumps(SEQUENCES))
