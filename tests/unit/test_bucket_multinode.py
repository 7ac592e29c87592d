"""Ranks on several nodes publish one version to one bucket, each with a staging copy of its own
(``WEIGHTSYNC_BUCKET_RANK_REPORTS=1``, storage.rank_reports), against a real S3 server on
loopback. Each rank is a separate process with its own ``WEIGHTSYNC_BUCKET_STAGING_DIR``; the
test is the caller that carries the manifests between them (the barrier of the protocol)."""

from __future__ import annotations

import json
import multiprocessing
import os

import msgspec
import pytest

from core_support import mutate
from weightsync import cli, errors
from weightsync.storage import rank_reports
from weightsync.storage.source import BucketSource

from bucket_support import bucket_run, s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()
INDEX = "model.safetensors.index.json"


def _rank_main(conn, url: str, rank: int, world: int, staging: str, template: str, seed: dict, seed_version: int,
               env: dict) -> None:
    """One rank on its own "node": its own staging dir; commands from the test over ``conn``."""
    os.environ.update(env)
    os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"] = staging
    os.environ["WEIGHTSYNC_BUCKET_RANK_REPORTS"] = "1"
    from weightsync import Publisher
    from weightsync.publisher.publish import ShardManifest

    try:
        pub = Publisher(url, rank=rank, world_size=world, workers=1, template_dir=template)
        pub.seed_snapshot(seed, seed_version)
        conn.send(("ok", pub.source_dir))
    except Exception as e:  # reported to the test, which fails on it
        conn.send(("error", (type(e).__name__, str(e), None)))
        return
    while True:
        cmd, args = conn.recv()
        try:
            out = None
            if cmd == "write":
                v, kind, tensors = args
                prepared = pub.prepare(v, tensors, kind="full" if kind == "full" else None)
                pub.choose_kind(v, 0, 1, requested=kind)  # the kind the test chose; a side anchor when one is due
                out = msgspec.to_builtins(pub.write(prepared, kind))
            elif cmd == "commit":
                v, kind, manifests = args
                pub.commit(v, kind, [msgspec.convert(m, ShardManifest) for m in manifests])
            elif cmd == "confirm":
                pub.confirm(args)
            elif cmd == "discard":
                out = pub.discard_pending()
            elif cmd == "exit":
                pub.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("error", (type(e).__name__, str(e), getattr(e, "ranks", None), getattr(e, "error_type", None))))


class Rank:
    """A rank process; ``call`` returns its answer or raises RankFailed with its typed error."""

    def __init__(self, run, rank: int, staging: str, owners: dict, seed_version: int = 0, env: "dict | None" = None):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.owners, self.rank = owners, rank
        seed = {n: a for n, a in run.tensors[seed_version].items() if owners[n] == rank}
        self.proc = ctx.Process(target=_rank_main, args=(child, run.url, rank, 2, staging, run.seed, seed, seed_version,
                                                         dict(env or {})), daemon=True)
        self.proc.start()
        self.staging = self._answer()

    def _answer(self, timeout: float = 120.0):
        assert self.conn.poll(timeout), f"rank {self.rank} did not answer within {timeout:.0f}s"
        status, value = self.conn.recv()
        if status == "error":
            raise RankFailed(*value)
        return value

    def call(self, cmd: str, *args):
        self.conn.send((cmd, args if len(args) != 1 else args[0]))
        return self._answer()

    def write(self, v: int, kind: str, tensors: dict) -> dict:
        return self.call("write", v, kind, {n: a for n, a in tensors.items() if self.owners[n] == self.rank})

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except Exception:
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class RankFailed(Exception):
    def __init__(self, type_name: str, message: str, ranks, error_type: "str | None" = None):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.ranks, self.error_type = type_name, message, ranks, error_type


@pytest.fixture
def nodes(bucket_run, fast_tmp_path):
    """Start ranks on "nodes" (a staging dir each); every process is stopped at the end."""
    started: list[Rank] = []
    owners = {n: i % 2 for i, n in enumerate(sorted(bucket_run.tensors[0]))}

    def start(rank: int, seed_version: int = 0, env: "dict | None" = None, node: str = "") -> Rank:
        r = Rank(bucket_run, rank, str(fast_tmp_path / (node or f"node{rank}")), owners, seed_version, env)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def _index(url: str, v: int) -> "dict | None":
    try:
        return json.loads(BucketSource(url).read(f"weight_v{v:06d}/{INDEX}"))
    except FileNotFoundError:
        return None


def _shards_in(staging: str) -> set[str]:
    return {f for _, _, files in os.walk(staging) for f in files if f.endswith(".safetensors")}


def test_two_ranks_on_two_nodes_publish_a_full_then_deltas_that_a_fresh_host_pulls_exactly(bucket_run, nodes):
    anchors = {"WEIGHTSYNC_ANCHOR_MAX_DELTAS": "2"}  # v3, the second delta after v1, gets a side anchor
    r0, r1 = nodes(0, env=anchors), nodes(1, env=anchors)
    assert r0.staging != r1.staging
    for v, kind in ((1, "full"), (2, "delta"), (3, "delta")):
        new = bucket_run.next_tensors()
        m1 = r1.write(v, kind, new)  # rank 1 first: at v1 no lease is in the bucket yet
        m0 = r0.write(v, kind, new)
        assert m1["report_key"] and not m0["report_key"]
        # v3: rank 0 is not given rank 1's manifest and finds its report under its own lease.
        r0.call("commit", v, kind, [m0, m1] if v < 3 else [m0])
        r1.call("confirm", v)
        index = _index(bucket_run.url, v)
        assert index is not None
        assert {f.split("-")[1] for f in index["weight_map"].values()} == {"r00000", "r00001"}
        assert not BucketSource(bucket_run.url).list(f"weight_v{v:06d}/.ranks/")  # the reports went with the commit
    for v in (1, 2, 3):
        bucket_run.assert_pulls(v)  # each version on a fresh host: exactly the published tensors
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    assert bucket_run.assert_pulls(3, local).action == "chain"  # the deltas apply on v1's bytes
    # Rank 0 committed without ever holding rank 1's bytes (their sizes, digests and layouts came
    # from the reports), and rank 1's copy holds only its own shards plus the committed indexes.
    assert all("-r00001-" not in f for f in _shards_in(r0.staging))
    assert all("-r00000-" not in f for f in _shards_in(r1.staging))
    assert os.path.exists(os.path.join(r1.staging, "weight_v000003", INDEX))
    anchor = json.loads(BucketSource(bucket_run.url).read(f"anchor_v000003/{INDEX}"))
    assert {f.split("-")[1] for f in anchor["weight_map"].values()} == {"r00000", "r00001"}
    # Rank 1 restarts on a new node (an empty staging dir): its copy is filled with the indexes
    # and its own shards only, and v4 goes on from there.
    r1.stop()
    r1 = nodes(1, seed_version=3, node="node1-new")
    assert _shards_in(r1.staging) and all("-r00001-" in f for f in _shards_in(r1.staging))
    new = bucket_run.next_tensors()
    m1, m0 = r1.write(4, "delta", new), r0.write(4, "delta", new)
    r0.call("commit", 4, "delta", [m0, m1])
    r1.call("confirm", 4)
    bucket_run.assert_pulls(4)
    assert bucket_run.assert_pulls(4, local).action == "chain"


def test_a_rank_that_never_reports_makes_rank_0_fail_naming_it_and_no_index_is_written(bucket_run, nodes):
    r0 = nodes(0, env={"WEIGHTSYNC_BUCKET_RANK_REPORT_WAIT_S": "1"})
    new = bucket_run.next_tensors()
    m0 = r0.write(1, "full", new)
    with pytest.raises(RankFailed) as e:
        r0.call("commit", 1, "full", [m0])
    assert e.value.type_name == "RankReportMissingError" and e.value.ranks == [1]
    assert e.value.error_type == "rank_report_missing"  # its own stable type (weightsync.errors)
    assert "rank(s) [1]" in e.value.message
    assert _index(bucket_run.url, 1) is None
    assert not os.path.exists(os.path.join(r0.staging, "weight_v000001", INDEX))
    # The rank comes, writes and reports: the same commit, retried, lands with every rank's tensors.
    r1 = nodes(1)
    m1 = r1.write(1, "full", new)
    r0.call("commit", 1, "full", [m0, m1])
    r1.call("confirm", 1)
    bucket_run.assert_pulls(1)


def test_a_report_left_by_a_failed_earlier_attempt_with_other_bytes_is_never_committed(bucket_run, nodes):
    r0, r1 = nodes(0), nodes(1)
    v1 = bucket_run.next_tensors()
    m = [r.write(1, "full", v1) for r in (r0, r1)]
    r0.call("commit", 1, "full", m)
    r1.call("confirm", 1)
    # Attempt 1 at v2: both ranks write and rank 1 reports bytes A; rank 0 dies before its commit.
    other = mutate(bucket_run.tensors[1], bucket_run.rng, 0.05)
    stale = r1.write(2, "delta", other)
    r0.write(2, "delta", other)
    r0.stop(), r1.stop()
    assert stale["report_key"] in BucketSource(bucket_run.url).list("weight_v000002/.ranks/")
    # Attempt 2, new processes on the same nodes, with other bytes B. Rank 0 (a new writer lease)
    # given only its own manifest does not take attempt 1's report of rank 1.
    fast = {"WEIGHTSYNC_BUCKET_RANK_REPORT_WAIT_S": "1"}
    r0, r1 = nodes(0, seed_version=1, env=fast), nodes(1, seed_version=1)
    v2 = bucket_run.next_tensors()
    m0 = r0.write(2, "delta", v2)
    with pytest.raises(RankFailed) as e:
        r0.call("commit", 2, "delta", [m0])
    assert e.value.type_name == "RankReportMissingError" and e.value.ranks == [1]
    assert _index(bucket_run.url, 2) is None
    m1 = r1.write(2, "delta", v2)
    r0.call("commit", 2, "delta", [m0])  # now rank 1's report of this attempt is under rank 0's lease
    r1.call("confirm", 2)
    index = _index(bucket_run.url, 2)
    assert index is not None
    assert set(stale["weight_map"].values()).isdisjoint(index["weight_map"].values())
    assert set(m1["weight_map"].values()) <= set(index["weight_map"].values())
    bucket_run.assert_pulls(2)  # exactly B
    bucket_run.assert_pulls(1)


def test_a_version_discarded_on_every_rank_leaves_no_report_that_its_next_attempt_could_commit(bucket_run, nodes):
    r0, r1 = nodes(0), nodes(1)
    v1 = bucket_run.next_tensors()
    m = [r.write(1, "full", v1) for r in (r0, r1)]
    r0.call("commit", 1, "full", m)
    r1.call("confirm", 1)
    other = mutate(v1, bucket_run.rng, 0.05)
    stale = r1.write(2, "delta", other)
    r0.write(2, "delta", other)
    assert r1.call("discard") == 2 and r0.call("discard") == 2
    assert not BucketSource(bucket_run.url).list("weight_v000002/.ranks/")
    # The same writer lease, other bytes (full: the discard says so); rank 0 not given rank 1's
    # manifest finds exactly one report of rank 1, this attempt's.
    v2 = bucket_run.next_tensors()
    m1, m0 = r1.write(2, "full", v2), r0.write(2, "full", v2)
    assert m1["report_key"] != stale["report_key"]
    r0.call("commit", 2, "full", [m0])
    r1.call("confirm", 2)
    bucket_run.assert_pulls(2)


@pytest.mark.parametrize("make, error_type, retryable", [
    (lambda: errors.RankReportMissingError(3, "s3://b/run", [1, 2], 120.0, "; a detail"), "rank_report_missing", True),
    (lambda: errors.RankReportMismatchError(3, "s3://b/run", 1, "is for v2 rank 1"), "rank_report_mismatch", False),
])
def test_a_rank_report_error_is_a_typed_publish_error_with_its_own_type_and_exit_code(
        make, error_type, retryable, monkeypatch, capsys):
    """Both live in weightsync.errors with the other typed errors (storage.rank_reports names
    them too). The command line cannot publish with several ranks, so a command stands in to
    raise one: what is checked is the shape every command's error takes (exit code, JSON)."""
    e = make()
    assert type(e) is getattr(rank_reports, type(e).__name__)
    assert isinstance(e, errors.PublishError) and isinstance(e, ValueError)
    assert e.error_type == error_type and errors.error_types()[error_type] == 400 and e.retryable is retryable
    assert e.version == 3 and e.url == "s3://b/run"
    if isinstance(e, errors.RankReportMissingError):
        assert e.ranks == [1, 2] and e.waited_s == 120.0
        # The message spells out the knobs and the reports' prefix: the same names storage.rank_reports uses.
        for name in (rank_reports.RANK_REPORTS.env, rank_reports.REPORT_WAIT_S.env, rank_reports.reports_prefix(3)):
            assert name in str(e)
    else:
        assert e.rank == 1 and "the report of rank 1 in s3://b/run is for v2 rank 1; nothing was committed" in str(e)

    def fail(args):
        raise make()

    monkeypatch.setattr(cli, "cmd_version", fail)
    # A missing report is "retry later" (3: the same commit succeeds once the rank reports); a
    # mismatch is a bad call (2), as every other PublishError.
    assert cli.main(["--json", "version"]) == (3 if retryable else 2)
    out = json.loads(capsys.readouterr().out)
    assert out == {"success": False, "error_type": error_type, "message": str(e)}
