"""What a pull refuses, and how it says so: "not there" is not "not yet", local faults are
local, a user's files are guarded, a full version (or a side anchor) must have the model's
layout, a header is checked as well as the bytes, and a seed on tmpfs is hashed in full.

Every behaviour goes through the core's ``pull`` (which the CLI, the Python API and the engine's
endpoint all call); the CLI's exit codes and JSON are checked by running the real ``weightsync``
command in a subprocess.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.format.layout import version_dir
from weightsync.format.manifest import encode_run_identity
from weightsync.fsio import find_memory_filesystem
from weightsync.inspect import verify_local

import interop_writer
from core_support import (
    INDEX,
    SINGLE,
    assert_checkpoint_is,
    marker_version,
    mutate,
    random_tensors,
    read_checkpoint_bytes,
    tensor_bytes,
    write_hf_checkpoint,
)

SIZES = {"a": ("float32", (32, 16)), "b": ("float32", (64,)), "c": ("int16", (24,))}
WEIGHTSYNC = os.path.join(os.path.dirname(sys.executable), "weightsync")


class World:
    def __init__(self, root: str, sizes=SIZES):
        self.root = root
        self.rng = np.random.default_rng(5)
        self.seed, self.source, self.local = (os.path.join(root, n) for n in ("seed", "src", "local"))
        self.t = [random_tensors(self.rng, sizes)]
        write_hf_checkpoint(self.seed, self.t[0])

    def publish(self, n: int, *, full_at: "set[int]" = frozenset(), keep: "int | None" = None) -> None:
        pub = Publisher(self.source, encoding="xor", workers=1, keep_versions=keep)
        pub.seed_snapshot(self.t[-1], version=len(self.t) - 1)
        for _ in range(n):
            v = len(self.t)
            self.t.append(mutate(self.t[-1], self.rng, 0.05))
            pub.publish(v, self.t[v], full=v in full_at)
        pub.close()

    def publish_with_side_anchors(self, last: int, **pub_kw) -> list[int]:
        """Versions 1..``last`` from the seed, a side anchor every third delta; -> the anchors' versions."""
        pub = Publisher(self.source, encoding="xor", workers=1, anchor_max_deltas=3, **pub_kw)
        pub.seed_snapshot(self.t[0])
        for v in range(1, last + 1):
            self.t.append(mutate(self.t[-1], self.rng, 0.05))
            pub.publish(v, self.t[v])
        pub.close()
        return sorted(int(n[len("anchor_v"):]) for n in os.listdir(self.source) if n.startswith("anchor_v"))

    def pull(self, target: int, **kw):
        return pull(self.local, self.seed, self.source, target, **kw)


@pytest.fixture
def world(fast_tmp_path) -> World:
    return World(str(fast_tmp_path))


def cli(*argv: str) -> tuple[int, dict | None, str]:
    """(exit code, the JSON printed, stderr) of the real ``weightsync --json ...`` command."""
    proc = subprocess.run([WEIGHTSYNC, "--json", *argv], capture_output=True, text=True, timeout=120)
    out = proc.stdout.strip()
    doc = json.loads(out) if out else None
    return proc.returncode, doc, proc.stderr


def header_offset_of(path: str, needle: bytes) -> int:
    with open(path, "rb") as f:
        head = f.read(4096)
    at = head.find(needle)
    assert at > 8, f"{needle!r} not in the header of {path}"
    return at


def retype_header(path: str, tensor: str, old: bytes = b'"F32"', new: bytes = b'"I32"') -> None:
    """Change one tensor's dtype in a safetensors header in place (same width: the bytes, and
    every byte count, stay the same; only the meaning changes)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        entry = raw.find(json.dumps(tensor).encode() + b":")
        at = raw.find(old, entry)
        assert entry >= 0 and at > entry, (tensor, raw[:200])
        f.seek(8 + at)
        f.write(new)


# --- 25.1: a full version that lacks a tensor is not served -----------------------------------


def test_an_upstream_full_version_that_lacks_a_tensor_is_refused_naming_it_with_local_untouched(world):
    world.publish(1)
    world.pull(1)
    t2 = mutate(world.t[1], world.rng, 0.1)
    interop_writer.write_full_version(world.source, 2, {n: v for n, v in t2.items() if n != "b"})
    with pytest.raises(errors.LayoutMismatchError, match=r"full version v2 .*lacks tensors \['b'\]") as ei:
        world.pull(2)
    assert ei.value.http_status == 422 and ei.value.error_type == "corrupt_artifact"
    assert marker_version(world.local) == 1
    assert_checkpoint_is(world.local, tensor_bytes(world.t[1]))


def test_a_full_version_with_another_dtype_or_shape_is_refused_naming_the_tensor(world):
    t1 = dict(world.t[0])
    t1["c"] = world.t[0]["c"].view(np.uint16)  # same bytes, another dtype
    t1["b"] = world.t[0]["b"].reshape(8, 8)  # same bytes, another shape
    interop_writer.write_full_version(world.source, 1, t1)
    with pytest.raises(errors.LayoutMismatchError) as ei:
        world.pull(1)
    text = str(ei.value)
    assert "tensor b is F32[8, 8], the model's is F32[64]" in text and "tensor c is U16[24], the model's is I16[24]" in text
    assert not os.path.exists(os.path.join(world.local, SINGLE)), "refused before the seed copied anything"


def test_the_cli_exits_4_with_json_on_a_full_version_that_lacks_a_tensor(world):
    interop_writer.write_full_version(world.source, 1, {n: v for n, v in world.t[0].items() if n != "a"})
    code, doc, _ = cli("pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "1")
    assert code == 4 and doc["error_type"] == "corrupt_artifact" and "lacks tensors ['a']" in doc["message"]


def test_a_full_version_published_with_allow_layout_change_is_served(world):
    t1 = {n: v for n, v in world.t[0].items() if n != "b"}
    interop_writer.write_full_version(world.source, 1, t1)
    ipath = os.path.join(version_dir(world.source, 1), INDEX)
    with open(ipath) as f:
        index = json.load(f)
    index["metadata"]["allow_layout_change"] = "true"
    with open(ipath, "w") as f:
        json.dump(index, f)
    assert world.pull(1).action == "seed"
    assert read_checkpoint_bytes(world.local) == tensor_bytes(t1)


def test_a_full_version_our_publisher_wrote_with_allow_layout_change_is_served(world):
    world.publish(1)
    t2 = mutate(world.t[1], world.rng, 0.1)
    t2["c"] = t2["c"].reshape(4, 6)  # a new shape: the layout changes
    pub = Publisher(world.source, encoding="xor", workers=1)
    pub.seed_snapshot(t2, version=1)  # a snapshot of the new layout: what a full version is written from
    pub.publish(2, t2, full=True, allow_layout_change=True)
    pub.close()
    world.pull(1)
    assert world.pull(2).action == "seed"
    assert read_checkpoint_bytes(world.local) == tensor_bytes(t2)


# --- 28.6: the header is checked, not only the bytes ----------------------------------------------


def test_a_full_version_whose_header_says_another_dtype_of_the_same_width_is_refused(world):
    world.publish(2, full_at={2})
    vdir = version_dir(world.source, 2)
    with open(os.path.join(vdir, INDEX)) as f:
        shard = json.load(f)["weight_map"]["a"]
    retype_header(os.path.join(vdir, shard), "a")  # F32 -> I32: every digest still matches
    with pytest.raises(errors.LayoutMismatchError, match=r"tensor a is I32\[32, 16\], the model's is F32\[32, 16\]"):
        world.pull(2)
    assert not os.path.exists(world.local) or marker_version(world.local) is None


def test_a_side_anchor_whose_header_changed_is_passed_over_and_the_pull_is_exact(fast_tmp_path):
    w = World(str(fast_tmp_path))
    anchors = w.publish_with_side_anchors(7)
    assert anchors, "the publisher wrote side anchors"
    a = anchors[-1]
    adir = os.path.join(w.source, f"anchor_v{a:06d}")
    with open(os.path.join(adir, INDEX)) as f:
        shard = json.load(f)["weight_map"]["a"]
    retype_header(os.path.join(adir, shard), "a")
    result = w.pull(a)
    assert "failed its check" in result.reason and "tensor a is I32" in result.reason, result.reason
    assert_checkpoint_is(w.local, tensor_bytes(w.t[a]))


def test_verify_fails_a_local_header_retyped_in_place_naming_the_tensor(world):
    world.publish(1)
    world.pull(1)
    retype_header(os.path.join(world.local, SINGLE), "a")
    report = verify_local(world.local, world.source, 1, world.seed)
    assert not report.ok and report.layout_checked and not report.mismatched  # the bytes are right
    assert report.layout_mismatched == ["tensor a is I32[32, 16], the model's is F32[32, 16]"]
    code, doc, _ = cli("verify", world.local, "--source-dir", world.source, "--version", "1", "--seed-dir", world.seed)
    assert code == 1 and doc["layout_mismatched"] == report.layout_mismatched
    # Without --seed-dir: the layout the run file recorded with v1 (our publisher writes it).
    code, doc, _ = cli("verify", world.local, "--source-dir", world.source, "--version", "1")
    assert code == 1 and doc["layout_mismatched"] == report.layout_mismatched


def test_a_header_retyped_in_a_version_published_with_allow_layout_change_is_refused_by_its_recorded_layout(world):
    world.publish(1)
    t2 = mutate(world.t[1], world.rng, 0.1)
    t2["c"] = t2["c"].reshape(4, 6)
    pub = Publisher(world.source, encoding="xor", workers=1)
    pub.seed_snapshot(t2, version=1)
    pub.publish(2, t2, full=True, allow_layout_change=True)
    pub.close()
    vdir = version_dir(world.source, 2)
    with open(os.path.join(vdir, INDEX)) as f:
        index = json.load(f)
    assert index["layout"]["c"] == ["I16", [4, 6]] and index["layout"]["a"] == ["F32", [32, 16]]
    retype_header(os.path.join(vdir, index["weight_map"]["a"]), "a")
    with pytest.raises(errors.LayoutMismatchError, match=r"the layout of its index's record: tensor a is I32\[32, 16\]"):
        world.pull(2)


def test_verify_checks_headers_against_the_layout_the_index_records(world):
    world.publish(2, full_at={2})
    world.pull(2)
    retype_header(_shard_of(world.local, "a"), "a")  # the local copy of the full version's shard
    os.unlink(os.path.join(world.source, "weightsync-run.json"))  # no run record: only the index's layout is left
    report = verify_local(world.local, world.source, 2)
    assert report.layout_checked and report.layout_mismatched == ["tensor a is I32[32, 16], the model's is F32[32, 16]"]


def _shard_of(directory: str, tensor: str) -> str:
    with open(os.path.join(directory, INDEX)) as f:
        return os.path.join(directory, json.load(f)["weight_map"][tensor])


# --- 25.5: "not there" is not "not yet" -------------------------------------------------------------


def test_a_source_dir_that_does_not_exist_is_a_bad_request_not_a_retry(world):
    missing = os.path.join(world.root, "no-such-run")
    with pytest.raises(errors.SourceDirUnusableError, match="does not exist") as ei:
        pull(world.local, world.seed, missing, 1)
    assert ei.value.http_status == 400 and not ei.value.retryable
    assert not os.path.exists(world.local)
    code, doc, _ = cli("pull", world.local, "--seed-dir", world.seed, "--source-dir", missing, "--version", "1")
    assert code == 2 and doc["error_type"] == "bad_request"


def test_a_dir_that_holds_no_weightsync_run_is_a_bad_request(world):
    stray = os.path.join(world.root, "stray")
    os.makedirs(os.path.join(stray, "checkpoints"))
    with pytest.raises(errors.SourceDirUnusableError, match="holds no weightsync run"):
        pull(world.local, world.seed, stray, 1)


def test_a_run_dir_whose_target_is_not_published_yet_stays_not_ready(world):
    os.makedirs(world.source)
    with open(os.path.join(world.source, "weightsync-run.json"), "wb") as f:  # a run, no version yet
        f.write(encode_run_identity("0" * 32, 0.0))
    with pytest.raises(errors.VersionMissingError) as ei:
        world.pull(1)
    assert ei.value.retryable
    os.makedirs(os.path.join(world.root, "empty"))  # a dir the publisher has just created
    with pytest.raises(errors.SourceNotReadyError):
        pull(world.local, world.seed, os.path.join(world.root, "empty"), 1)
    code, _, _ = cli("pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "1")
    assert code == 3


def test_a_pruned_version_says_it_was_pruned_and_names_the_oldest_pullable(world):
    world.publish(6, full_at={4}, keep=2)
    kept = sorted(int(n[len("weight_v"):]) for n in os.listdir(world.source) if n.startswith("weight_v"))
    assert kept[0] > 1
    with pytest.raises(errors.VersionPrunedError, match=rf"version 1 was pruned .*oldest version still pullable is v{kept[0]}") as ei:
        world.pull(1)
    assert ei.value.oldest_pullable == kept[0] and ei.value.http_status == 400
    assert world.pull(kept[0]).applied_version == kept[0]


def test_inspect_exits_non_zero_on_a_missing_dir_or_version(world):
    world.publish(1)
    code, doc, _ = cli("inspect", os.path.join(world.root, "typo"))
    assert code == 2 and doc["error_type"] == "bad_request"
    code, doc, _ = cli("inspect", world.source, "--version", "7")
    assert code == 3 and doc["error_type"] == "source_not_ready"
    code, doc, _ = cli("inspect", world.source, "--version", "1")
    assert code == 0 and doc["status"] == "published"


# --- 25.6: local faults are local -------------------------------------------------------------------


def test_local_that_is_a_regular_file_is_a_local_fault_with_json(world):
    world.publish(1)
    with open(world.local, "w") as f:
        f.write("not a dir")
    code, doc, err = cli("pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "1")
    assert code == 5 and doc["error_type"] == "local_state_corrupt" and "not a directory" in doc["message"], err
    assert "Traceback" not in err
    under = os.path.join(world.local, "sub")  # not creatable: its parent is a file
    with pytest.raises(errors.LocalDirUnusableError, match="cannot be created"):
        pull(under, world.seed, world.source, 1)


def test_a_read_only_local_dir_is_a_local_fault_with_json(world, tmp_path):
    world.publish(1)
    local = str(tmp_path / "local")  # on a disk filesystem: chattr works there
    os.makedirs(local)
    if os.geteuid() == 0:  # root writes through any mode bits; an immutable dir refuses even root
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", local]).returncode != 0:
            pytest.skip("cannot make a dir read-only for root here (no chattr +i)")
    else:
        os.chmod(local, 0o555)
    try:
        code, doc, err = cli("pull", local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "1")
        with pytest.raises(errors.LocalDirUnusableError):  # a dir that cannot be created in it
            pull(os.path.join(local, "sub"), world.seed, world.source, 1)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", local], check=True)
        os.chmod(local, 0o755)
    assert code == 5 and doc["error_type"] == "local_state_corrupt" and "read-only" in doc["message"], (code, doc, err)
    assert "Traceback" not in err
    assert os.listdir(local) == []


def test_a_truncated_local_shard_under_a_valid_marker_is_reseeded_not_a_no_op(world):
    world.publish(2)
    world.pull(2)
    path = os.path.join(world.local, SINGLE)
    os.truncate(path, os.path.getsize(path) - 16)
    result = world.pull(2)
    assert result.action != "noop" and "the marker recorded" in result.reason, result.reason
    assert_checkpoint_is(world.local, tensor_bytes(world.t[2]))


def test_verify_calls_a_damaged_local_file_a_local_fault(world):
    world.publish(1)
    world.pull(1)
    path = os.path.join(world.local, SINGLE)
    os.truncate(path, 100)  # the header runs past the end now
    with pytest.raises(errors.LocalFileDamagedError):
        verify_local(world.local, world.source, 1, world.seed)
    code, doc, _ = cli("verify", world.local, "--source-dir", world.source, "--version", "1")
    assert code == 5 and doc["error_type"] == "local_state_corrupt"


# --- 25.7: guard the user's data --------------------------------------------------------------------


def test_pull_into_a_users_non_empty_dir_is_refused_unless_forced(world):
    world.publish(1)
    os.makedirs(world.local)
    mine = os.path.join(world.local, SINGLE)
    with open(mine, "wb") as f:
        f.write(b"the user's own model")
    args = ("pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "1")
    code, doc, _ = cli(*args)
    assert code == 2 and "weightsync did not write it" in doc["message"] and SINGLE in doc["message"]
    with open(mine, "rb") as f:
        assert f.read() == b"the user's own model"
    code, doc, _ = cli(*args, "--force")
    assert code == 0 and doc["applied_version"] == 1
    assert_checkpoint_is(world.local, tensor_bytes(world.t[1]))


def test_an_engines_own_local_dir_pulls_again_without_force(world):
    world.publish(3)
    world.pull(1)  # the first pull into a fresh dir needs nothing
    assert world.pull(3).applied_version == 3  # the dir holds .weight_sync/: ours
    os.unlink(os.path.join(world.local, ".weight_sync", "state.json"))  # torn: still ours
    assert world.pull(3).action.startswith("seed")


# --- 25.8: Ctrl-C -------------------------------------------------------------------------------------


def test_ctrl_c_during_pull_prints_one_line_on_local_and_exits_130(world):
    world.publish(2)
    world.pull(1)
    hooks = os.path.join(world.root, "hooks")
    os.makedirs(hooks)
    with open(os.path.join(hooks, "interrupt_hook.py"), "w") as f:
        f.write("import os, signal\n\ndef hook(source_dir, version):\n    os.kill(os.getpid(), signal.SIGINT)\n")
    proc = subprocess.run(
        [WEIGHTSYNC, "pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "2",
         "--hook", "interrupt_hook.hook"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": hooks},
        # A shell starting this suite in the background leaves SIGINT ignored, and Python then never
        # raises KeyboardInterrupt: give the child the disposition a terminal's Ctrl-C meets.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.returncode == 130, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "holds verified v1" in lines[0], proc.stderr
    assert marker_version(world.local) == 1


# --- 28.8: a seed on tmpfs edited through a shared mapping ---------------------------------------------


def test_a_seed_edited_through_a_shared_mapping_on_tmpfs_is_not_taken_for_version_0(fast_tmp_path):
    # A file larger than the fingerprint's four 4 KiB file samples, so the edit lands in
    # bytes that only a full hash reads.
    world = World(str(fast_tmp_path), {"a": ("float32", (256, 256)), "b": ("float32", (64,))})
    if find_memory_filesystem(world.seed) is None:
        pytest.skip("the seed dir is not on a memory filesystem here")
    assert world.pull(0).action == "seed"
    path = os.path.join(world.seed, SINGLE)
    before = os.stat(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE) as m:
        _, off, nbytes = _location(world.seed, "a")
        at = off + nbytes // 6 + 5  # away from every sample of the fingerprint
        assert 3 * 4096 < at < os.path.getsize(path) // 3 - 4096
        m[at] ^= 0xFF
        m.flush()
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns,
    ), "a mapped write on tmpfs keeps the file's stat"
    result = world.pull(0)
    assert result.action == "seed", result.reason
    assert read_checkpoint_bytes(world.local) == read_checkpoint_bytes(world.seed)


def _location(directory: str, name: str):
    from core_support import tensor_location

    return tensor_location(directory, name)


# --- 28.10: typed errors everywhere ---------------------------------------------------------------------


def test_an_incomplete_seed_dir_is_a_typed_bad_request(world):
    write_hf_checkpoint(os.path.join(world.root, "sharded"), world.t[0], shards=2)
    seed = os.path.join(world.root, "sharded")
    os.unlink(os.path.join(seed, "model-00002-of-00002.safetensors"))
    with pytest.raises(errors.SeedDirUnusableError, match="model-00002-of-00002.safetensors"):
        pull(world.local, seed, world.source, 0)
    code, doc, err = cli("pull", world.local, "--seed-dir", seed, "--source-dir", world.source, "--version", "0")
    assert code == 2 and doc["error_type"] == "bad_request" and "Traceback" not in err


def test_a_local_dir_hard_linked_to_the_seed_is_reseeded_without_touching_the_seed(world):
    world.publish(1)
    os.makedirs(world.local)
    for n in os.listdir(world.seed):
        os.link(os.path.join(world.seed, n), os.path.join(world.local, n))
    seed_bytes = read_checkpoint_bytes(world.seed)
    assert world.pull(1, force=True).applied_version == 1
    assert_checkpoint_is(world.local, tensor_bytes(world.t[1]))
    assert read_checkpoint_bytes(world.seed) == seed_bytes
    assert not os.path.samefile(os.path.join(world.local, SINGLE), os.path.join(world.seed, SINGLE))


def test_a_deeply_nested_small_index_is_malformed_not_a_recursion_error(world):
    world.publish(1)
    vdir = os.path.join(world.source, "weight_v000002")
    os.makedirs(vdir)
    with open(os.path.join(vdir, INDEX), "w") as f:
        f.write('{"metadata": ' + "[" * 200_000 + "]" * 200_000 + ', "weight_map": {}}')
    with pytest.raises(errors.MalformedHeaderError, match="nests too deeply"):
        world.pull(2)
    code, doc, err = cli("pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "2")
    assert code == 4 and "Traceback" not in err


def test_a_deeply_nested_shard_header_is_malformed_not_a_recursion_error(world):
    interop_writer.write_full_version(world.source, 1, world.t[0], with_index=False)
    path = os.path.join(version_dir(world.source, 1), SINGLE)
    raw = b"[" * 100_000 + b"]" * 100_000
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(errors.SourceNotReadyError):  # an index-less single file that is not complete
        world.pull(1)
    from weightsync.format.safetensors_io import read_header

    with pytest.raises(errors.MalformedHeaderError, match="nests too deeply"):
        read_header(path)


def test_a_version_pruned_between_its_dir_check_and_its_read_is_typed(world, monkeypatch):
    """The dir of the target exists when checked and is gone when read (a prune in between):
    the race is caused by removing the dir at that moment, through the reader's own call."""
    from weightsync.format import manifest

    world.publish(3, keep=0)
    real = manifest._load_index_json

    def vanish(path):
        if "weight_v000001" in path:
            shutil.rmtree(os.path.dirname(path))
        return real(path)

    monkeypatch.setattr(manifest, "_load_index_json", vanish)
    with pytest.raises(errors.VersionPrunedError, match="version 1 was pruned"):
        world.pull(1)
    assert not os.path.exists(world.local), "a first pull that fails leaves no trace"


# --- the engine's endpoint gets the same answers (its per-rank pull, the reply's status) --------------


def _engine_pull(world: World, source: str, target: int):
    from types import SimpleNamespace

    from sglang_patch.pull.options import PullWeightsOptions
    from sglang_patch.pull.rank import RankPuller

    puller = RankPuller(options=PullWeightsOptions(allowed_roots=(world.root,)), seed_dir=world.seed, host="h/node0",
                        rank="dp0/tp0")
    report = puller(SimpleNamespace(local_checkpoint_dir=world.local, source_dir=source, target_version=target))
    from weightsync.puller.pull import wait_until_durable

    wait_until_durable(world.local)  # the engine pulls with deferred durability
    return report


def test_the_engine_endpoint_answers_422_for_a_full_version_lacking_a_tensor_and_400_for_a_wrong_source(world):
    world.publish(1)
    ok = _engine_pull(world, world.source, 1)
    assert ok.success and ok.applied_version == 1
    interop_writer.write_full_version(world.source, 2, {n: v for n, v in world.t[1].items() if n != "b"})
    bad = _engine_pull(world, world.source, 2)
    assert (bad.success, bad.http_status, bad.error_type) == (False, 422, "corrupt_artifact") and "['b']" in bad.message
    assert bad.applied_version == 1
    missing = _engine_pull(world, os.path.join(world.root, "no-such-run"), 2)
    assert (missing.http_status, missing.error_type) == (400, "bad_request")
    assert _engine_pull(world, world.source, 1).success  # the engine's own dir: no --force needed


def test_an_anchor_pruned_while_a_first_pull_plans_is_not_ready_not_unusable(fast_tmp_path, monkeypatch):
    """A prune that removes a side anchor and its version between the planner's check of the
    anchor and its look at the anchor's files (caused here through the planner's own call, the
    race being too narrow to hit by timing): "not ready, retry", never ``AnchorUnusableError``
    (422, "restore from a backup") for an anchor nobody damaged."""
    from weightsync.format.layout import anchor_dir
    from weightsync.puller import plan
    from weightsync.publisher.prune import _delete

    w = World(str(fast_tmp_path), {"a": ("float32", (64, 64)), "b": ("float32", (64,))})
    w.publish_with_side_anchors(9, keep_versions=2)
    assert os.path.isdir(anchor_dir(w.source, 6)) and not os.path.isdir(version_dir(w.source, 5))
    real = plan.check_anchor

    def pruned_meanwhile(source_dir, version, index=None):
        found = real(source_dir, version, index)
        if version == 6:  # the prune point moved past 6: its version, then its anchor, go
            _delete(version_dir(source_dir, 6))
            _delete(anchor_dir(source_dir, 6))
        return found

    monkeypatch.setattr(plan, "check_anchor", pruned_meanwhile)
    with pytest.raises(errors.SourceNotReadyError) as ei:
        w.pull(8)
    assert not isinstance(ei.value, errors.AnchorUnusableError) and ei.value.retryable
    monkeypatch.setattr(plan, "check_anchor", real)
    assert w.pull(9).applied_version == 9  # the retry plans from what is kept
    assert_checkpoint_is(w.local, tensor_bytes(w.t[9]))


def test_verify_of_a_pruned_version_or_a_wrong_source_dir_says_so(world):
    world.publish(6, full_at={4}, keep=2)
    world.pull(6)
    code, doc, _ = cli("verify", world.local, "--source-dir", world.source, "--version", "1")
    assert code == 2 and "was pruned" in doc["message"]
    code, doc, _ = cli("verify", world.local, "--source-dir", os.path.join(world.root, "typo"), "--version", "6")
    assert code == 2 and "does not exist" in doc["message"]
    code, _, _ = cli("verify", world.local, "--source-dir", world.source, "--version", "6")
    assert code == 0


def test_a_side_anchor_whose_index_nests_too_deeply_is_passed_over(fast_tmp_path):
    w = World(str(fast_tmp_path))
    anchors = w.publish_with_side_anchors(7, keep_versions=0)
    a = anchors[-1]
    with open(os.path.join(w.source, f"anchor_v{a:06d}", INDEX), "w") as f:
        f.write('{"metadata": ' + "[" * 200_000 + "]" * 200_000 + "}")
    result = w.pull(7)
    assert f"anchor_v{a:06d}" not in result.reason or "failed" in result.reason, result.reason
    assert_checkpoint_is(w.local, tensor_bytes(w.t[7]))


def test_a_shard_that_is_a_directory_is_a_typed_corrupt_artifact(world):
    world.publish(1)
    vdir = version_dir(world.source, 1)
    shard = _shard_of(vdir, "a")
    os.unlink(shard)
    os.mkdir(shard)
    with pytest.raises(errors.CorruptArtifactError, match="Is a directory"):
        world.pull(1)
    code, doc, err = cli("pull", world.local, "--seed-dir", world.seed, "--source-dir", world.source, "--version", "1")
    assert code == 4 and doc["error_type"] == "corrupt_artifact" and "Traceback" not in err
