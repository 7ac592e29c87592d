"""The publish side refuses ordinary mistakes before it writes anything (issue 25 points 2, 3, 4,
8; issue 28 point 10, publish side).

Driven through the command line (``weightsync.cli.main``, real checkpoints on disk) and the
Python API; every published version is pulled back by the real puller. "Nothing written" is
checked as the source dir's whole listing, sizes and mtimes, before and after.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from weightsync import Publisher, errors, pull
from weightsync.cli import main

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SIZES = {"embed": ("float32", (64, 16)), "layers.0.w": ("float32", (32, 32)), "norm": ("float32", (16,))}


class Run:
    """A seed checkpoint, checkpoints of later versions, and a source dir published by the CLI."""

    def __init__(self, root: str, rng: np.random.Generator):
        self.root, self.rng = root, rng
        self.source = os.path.join(root, "src")
        self.t = [random_tensors(rng, SIZES)]
        self.ckpt = [self.checkpoint(0, self.t[0])]

    def checkpoint(self, name, tensors) -> str:
        path = os.path.join(self.root, f"ckpt-{name}")
        shutil.rmtree(path, ignore_errors=True)
        write_hf_checkpoint(path, tensors)
        return path

    def next(self, names=None) -> str:
        self.t.append(mutate(self.t[-1], self.rng, 0.05, names))
        self.ckpt.append(self.checkpoint(len(self.t) - 1, self.t[-1]))
        return self.ckpt[-1]

    def cli(self, *argv: str) -> int:
        return main(["publish", self.source, *argv])

    def publish_delta(self, v: int, base: str | None = None) -> int:
        return self.cli("--version", str(v), "--checkpoint", self.ckpt[v], "--base-checkpoint", base or self.ckpt[v - 1])

    def listing(self) -> dict[str, tuple[int, int]]:
        out = {}
        for d, _, files in os.walk(self.source):
            for f in files:
                st = os.stat(os.path.join(d, f))
                out[os.path.relpath(os.path.join(d, f), self.source)] = (st.st_size, st.st_mtime_ns)
        return out

    def assert_pulls(self, v: int) -> None:
        local = os.path.join(self.root, f"local-{v}-{len(os.listdir(self.root))}")
        assert pull(local, self.ckpt[0], self.source, v).applied_version == v
        assert_checkpoint_is(local, tensor_bytes(self.t[v]))


@pytest.fixture
def run(fast_tmp_path, rng):
    return Run(str(fast_tmp_path), rng)


def _json_error(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


# --- 25.2: the version number ------------------------------------------------------------------


def test_a_publish_with_a_gap_in_versions_is_refused_before_writing(run, capsys):
    run.next()
    assert run.publish_delta(1) == 0
    run.next()
    run.next()
    before = run.listing()
    assert main(["--json", "publish", run.source, "--version", "3", "--checkpoint", run.ckpt[3],
                 "--base-checkpoint", run.ckpt[2]]) == 2
    err = _json_error(capsys)
    assert err["error_type"] == "version_out_of_order"
    assert "the newest published version is v1, so the next version is 2" in err["message"]
    assert run.listing() == before  # nothing written
    assert run.cli("--version", "3", "--checkpoint", run.ckpt[3], "--full") == 2  # a full version is no exception
    assert run.listing() == before
    assert run.publish_delta(2) == 0 and run.publish_delta(3) == 0
    run.assert_pulls(3)


@pytest.mark.parametrize("version", ["0", "-1"])
def test_a_version_below_1_is_refused_before_writing(run, capsys, version):
    run.next()
    for how in (["--full"], ["--base-checkpoint", run.ckpt[0]]):
        assert run.cli("--version", version, "--checkpoint", run.ckpt[1], *how) == 2
        assert "version 0 is the seed dir" in capsys.readouterr().err
    assert not os.path.exists(run.source)  # not even the source dir was created
    run.assert_pulls(0)


def test_a_full_version_may_open_an_empty_source_dir_at_any_number_a_delta_may_not(run):
    """A run continuing its numbering in a fresh dir (the trainers' restart): its first version is full."""
    run.next()
    pub = Publisher(run.source, workers=1)
    pub.seed_snapshot(run.t[0], version=6)
    with pytest.raises(errors.VersionNumberError, match=r"nothing is published yet, so the next version is 1"):
        pub.publish(7, run.t[1], full=False)
    assert pub.publish(7, run.t[1], full=True).kind == "full"
    run.t = run.t + [run.t[1]] * 6
    run.assert_pulls(7)
    pub.close()


# --- 25.3: a delta's base ----------------------------------------------------------------------


def test_a_delta_from_the_wrong_base_is_refused_naming_the_first_tensor_that_differs(run, capsys):
    run.next()
    run.next()
    assert run.publish_delta(1) == 0
    before = run.listing()
    # v2 diffed against v0's bytes instead of v1's: every pull of it would fail as corrupt.
    assert main(["--json", "publish", run.source, "--version", "2", "--checkpoint", run.ckpt[2],
                 "--base-checkpoint", run.ckpt[0]]) == 2
    err = _json_error(capsys)
    assert err["error_type"] == "base_mismatch"
    assert "the base of the delta v2 is not version 1: tensor embed differs first" in err["message"]
    assert run.listing() == before
    assert run.publish_delta(2) == 0
    run.assert_pulls(2)


def test_a_tensor_unchanged_since_the_seed_is_checked_against_the_run_s_seed_digests(run, capsys):
    """v1 changes only ``embed``: v2's base check of ``norm`` reaches back to the seed digests
    that ``weightsync-run.json`` recorded when v1 was published."""
    run.next(names=["embed"])
    assert run.publish_delta(1) == 0
    with open(os.path.join(run.source, "weightsync-run.json")) as f:
        recorded = json.load(f)["seed"]
    assert set(recorded["digests"]) == set(SIZES) and recorded["layout"]["norm"] == ["F32", [16]]
    run.next(names=["embed"])
    wrong = dict(run.t[1])
    wrong["norm"] = run.t[1]["norm"] + np.float32(1)  # only the tensor v1 left alone is wrong
    bad_base = run.checkpoint("bad-base", wrong)
    assert run.publish_delta(2, base=bad_base) == 2
    assert "tensor norm differs first: v1 records" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(run.source, "weight_v000002"))
    assert run.publish_delta(2) == 0
    run.assert_pulls(2)


def test_a_run_without_seed_digests_still_publishes_and_pulls(run):
    """Compat: a run file of an older publisher (no ``seed``), and a source dir without one."""
    run.next(names=["embed"])
    assert run.publish_delta(1) == 0
    path = os.path.join(run.source, "weightsync-run.json")
    with open(path) as f:
        obj = json.load(f)
    del obj["seed"]
    with open(path, "w") as f:
        json.dump(obj, f)
    run.next()
    assert run.publish_delta(2) == 0
    os.unlink(path)
    run.next()
    assert run.publish_delta(3) == 0
    run.assert_pulls(3)


# --- 25.4: a full version that changes the layout ------------------------------------------------


LAYOUT_CHANGES = {
    "a dtype": lambda t: {**t, "norm": t["norm"].astype(np.float64)},
    "a shape": lambda t: {**t, "norm": np.concatenate([t["norm"], t["norm"]])},
    "a tensor dropped": lambda t: {n: a for n, a in t.items() if n != "norm"},
    "a tensor added": lambda t: {**t, "extra": np.zeros(4, np.float32)},
}


@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_a_full_version_mid_run_that_changes_the_layout_is_refused_unless_allowed(run, capsys, change):
    run.next()
    assert run.publish_delta(1) == 0
    changed = run.checkpoint("changed", LAYOUT_CHANGES[change](run.t[1]))
    before = run.listing()
    assert main(["--json", "publish", run.source, "--version", "2", "--checkpoint", changed, "--full"]) == 2
    err = _json_error(capsys)
    assert err["error_type"] == "layout_change" and "--allow-layout-change" in err["message"]
    assert "changes the layout of v1: " in err["message"]
    assert run.listing() == before
    assert run.cli("--version", "2", "--checkpoint", changed, "--full", "--allow-layout-change") == 0
    with open(os.path.join(run.source, "weight_v000002", INDEX)) as f:
        assert json.load(f)["metadata"]["layout_change"]  # recorded; upstream readers ignore it
    with pytest.raises(errors.LayoutChangeError):  # the API refuses the same way
        pub = Publisher(run.source, workers=1)
        pub.seed_snapshot(run.t[1], version=2)
        pub.publish(3, run.t[1], full=True)


def test_a_full_version_with_the_same_layout_is_published(run):
    run.next()
    assert run.publish_delta(1) == 0
    run.next()
    assert run.cli("--version", "2", "--checkpoint", run.ckpt[2], "--full") == 0
    run.assert_pulls(2)


# --- 25.8: a version already committed ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["delta", "full"])
def test_an_identical_retry_of_a_committed_version_exits_0_and_other_bytes_exit_6(run, capsys, kind):
    run.next()
    args = ["--full"] if kind == "full" else ["--base-checkpoint", run.ckpt[0]]
    assert run.cli("--version", "1", "--checkpoint", run.ckpt[1], *args) == 0
    before = run.listing()
    capsys.readouterr()
    assert main(["--json", "publish", run.source, "--version", "1", "--checkpoint", run.ckpt[1], *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reason"].startswith("already published, identical") and out["kind"] == kind
    assert run.listing() == before  # counted, never rewritten
    other = run.checkpoint("other", mutate(run.t[1], run.rng, 0.01))
    assert main(["--json", "publish", run.source, "--version", "1", "--checkpoint", other, *args]) == 6
    err = _json_error(capsys)
    assert err["error_type"] == "version_conflict" and "with other bytes: tensor" in err["message"]
    assert run.listing() == before
    run.assert_pulls(1)


def test_an_identical_retry_through_the_api_counts_the_version_and_the_next_follows(run):
    run.next()
    run.next()
    pub = Publisher(run.source, workers=1)
    pub.seed_snapshot(run.t[0])
    pub.publish(1, run.t[1])
    pub.close()
    again = Publisher(run.source, workers=1)  # a restarted trainer that does not know v1 landed
    again.seed_snapshot(run.t[0])
    result = again.publish(1, run.t[1])
    assert result.reason.startswith("already published, identical") and again.version == 1
    assert again.publish(2, run.t[2]).kind == "delta"
    run.assert_pulls(2)
    again.close()


# --- 28.10: out of disk while publishing ----------------------------------------------------------


def _small_filesystem_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _small_filesystem_available(), reason="needs a private mount namespace (unshare -m, mount)")
def test_running_out_of_disk_while_publishing_exits_7_with_json_never_a_traceback(run):
    """A real ENOSPC: the CLI publishes into a 256 KiB tmpfs mounted in a private mount
    namespace (gone with the process); the checkpoint is 1 MiB."""
    big = random_tensors(run.rng, {"w": ("float32", (512, 512))})
    ckpt = run.checkpoint("big", big)
    mnt = os.path.join(run.root, "small")
    os.makedirs(mnt)
    script = (f"mount -t tmpfs -o size=256k tmpfs {mnt} && cd {os.getcwd()} && "
              f"{sys.executable} -m weightsync.cli --json publish {mnt}/src --version 1 --checkpoint {ckpt} --full; "
              "echo exit=$?; ls -a " + mnt + "/src/weight_v000001 2>/dev/null | grep -c index || true")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "exit=7" in lines, proc.stdout + proc.stderr
    err = json.loads(lines[lines.index("exit=7") - 1])
    assert err["error_type"] == "host_resource_exhausted" and "ENOSPC" in err["message"]
    assert "Free disk space on the publishing host" in err["message"]
    assert lines[-1] == "0"  # no index: v1 is not published


def test_out_of_disk_through_the_api_is_a_typed_error_and_the_version_stays_retryable(run, monkeypatch):
    """The same through the Python API; the fault is injected at the one shard write (a test
    process cannot fill a real disk without a mount of its own: see the test above)."""
    import errno

    import weightsync.publisher.publish as publish_mod

    run.next()
    pub = Publisher(run.source, workers=1)
    pub.seed_snapshot(run.t[0])
    real = publish_mod.write_file

    def full_disk(path, chunks, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(publish_mod, "write_file", full_disk)
    with pytest.raises(errors.HostResourceError, match=r"ran out of disk space \(ENOSPC") as info:
        pub.publish(1, run.t[1])
    assert info.value.error_type == "host_resource_exhausted" and info.value.retryable
    monkeypatch.setattr(publish_mod, "write_file", real)
    assert pub.publish(1, run.t[1]).kind == "delta"
    run.assert_pulls(1)
    pub.close()


def test_several_ranks_cannot_drop_a_tensor_in_a_full_version_unless_allowed(run):
    """Each rank checks its own tensors' dtypes and shapes at write(); the tensor set is known
    only from every rank's manifest, so rank 0 refuses it at commit, before any index."""
    owners = {"embed": 0, "layers.0.w": 1, "norm": 1}
    run.next()
    pubs = [Publisher(run.source, rank=r, world_size=2, workers=1) for r in (0, 1)]
    for r, pub in enumerate(pubs):
        pub.seed_snapshot({n: a for n, a in run.t[0].items() if owners[n] == r})
    for v in (1,):
        prepared = [pub.prepare(v, {n: a for n, a in run.t[v].items() if owners[n] == r}) for r, pub in enumerate(pubs)]
        manifests = [pub.write(p, "delta") for pub, p in zip(pubs, prepared)]
        pubs[0].commit(v, "delta", manifests)
        pubs[1].confirm(v)
    # rank 1 restarted without "norm" (a checkpoint that lost it): a full v2 would drop it
    pubs[1] = Publisher(run.source, rank=1, world_size=2, workers=1)
    pubs[1].seed_snapshot({"layers.0.w": run.t[1]["layers.0.w"]}, version=1)
    prepared = [pub.prepare(2, {}, kind="full") for pub in pubs]
    manifests = [pub.write(p, "full") for pub, p in zip(pubs, prepared)]
    with pytest.raises(errors.LayoutChangeError, match=r"drops tensor norm"):
        pubs[0].commit(2, "full", manifests)
    assert not os.path.exists(os.path.join(run.source, "weight_v000002", INDEX))
    pubs[0].commit(2, "full", manifests, allow_layout_change=True)  # the caller says the model changed
    with open(os.path.join(run.source, "weight_v000002", INDEX)) as f:
        assert "layout_change" in json.load(f)["metadata"]
    for pub in pubs:
        pub.close()


def test_the_next_number_after_an_upstream_index_less_full_version_is_accepted(run):
    """An upstream writer's full version may be one ``model.safetensors`` without an index: it is
    published (FORMAT.md), so the number after it is the next one, not a gap."""
    from safetensors.numpy import save_file

    run.next()
    vdir = os.path.join(run.source, "weight_v000001")
    os.makedirs(vdir)
    save_file({n: np.ascontiguousarray(a) for n, a in run.t[1].items()}, os.path.join(vdir, "model.safetensors"))
    run.next()
    assert run.publish_delta(2) == 0
    run.assert_pulls(2)
