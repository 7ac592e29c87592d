"""Faults on the real S3 server (SeaweedFS ``weed mini`` on loopback), injected at a chosen
point of a pull through its byte progress: the server killed and restarted mid-pull, killed for
longer than the deadline, and an object replaced while the pull reads it. A pull either
succeeds with exactly the published bytes or fails typed with the local state untouched."""

from __future__ import annotations

import threading
import time

import obstore
import pytest

from core_support import assert_checkpoint_is, marker_version
from weightsync import errors
from weightsync.puller.bucket import pull_from_bucket as _pull_from_bucket
from weightsync.puller.pull import _check_local_dir, pull as _pull
from weightsync.storage.source import BucketSource

from bucket_support import bucket_run, s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()


def pull_from_bucket(*args, **kwargs):
    """``pull`` from a bucket with a ``fetch_progress`` callback (the byte progress of the fetch)."""
    return _pull_from_bucket(_pull, _check_local_dir, *args, **kwargs)


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of 1 KiB, one at a time: a fault lands between two ranges of one object."""
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", "1024")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_IN_FLIGHT", "1")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_OBJECTS_IN_FLIGHT", "1")


def once_after(nbytes: int, action):
    """A fetch_progress callback that runs ``action`` once, when ``nbytes`` have been fetched."""
    fired = []

    def progress(done: int, total: int) -> None:
        if not fired and done >= nbytes:
            fired.append((done, total))
            action()

    progress.fired = fired  # type: ignore[attr-defined]
    return progress


def test_a_server_killed_and_restarted_mid_pull_is_retried_to_the_published_bytes(bucket_run, small_ranges, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "120")
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    server = bucket_run.s3

    back = threading.Timer(1.5, server.restart)

    def crash_then_come_back() -> None:
        server.kill()
        back.start()

    progress = once_after(2048, crash_then_come_back)
    local = bucket_run.fresh_local()
    try:
        result = pull_from_bucket(local, bucket_run.seed, bucket_run.url, 1, fetch_progress=progress)
    finally:
        if back.is_alive():
            back.join()
    assert progress.fired and progress.fired[0][0] < progress.fired[0][1]  # the crash came mid-fetch
    assert result.applied_version == 1
    assert_checkpoint_is(local, bucket_run.expected[1])
    bucket_run.assert_pulls(2, local)


def test_a_server_gone_past_the_deadline_is_a_retryable_typed_error_and_the_local_state_stays(bucket_run, small_ranges, monkeypatch):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 2, full_at={1})
    local = bucket_run.fresh_local()
    bucket_run.assert_pulls(1, local)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "3")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "1")
    server = bucket_run.s3
    progress = once_after(1, server.kill)
    try:
        with pytest.raises((errors.BucketUnavailableError, errors.SourceNotReadyError)) as e:
            pull_from_bucket(local, bucket_run.seed, bucket_run.url, 2, fetch_progress=progress)
        assert e.value.retryable
    finally:
        if server.proc is not None and server.proc.poll() is not None:
            server.restart()
    assert marker_version(local) == 1
    assert_checkpoint_is(local, bucket_run.expected[1])
    # The short deadline was for the pull that met the dead server; the retry gets the defaults
    # (weed answers its readiness probe a moment before it serves objects again: 500s meanwhile).
    monkeypatch.delenv("WEIGHTSYNC_BUCKET_DEADLINE_S")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "5")  # the fixture's
    bucket_run.assert_pulls(2, local)  # the retry, once the server is back


def test_an_object_replaced_mid_read_is_changed_retry_and_never_applied(bucket_run, small_ranges):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    src = BucketSource(bucket_run.url)
    shard = next(k for k in src.list("weight_v000001/") if k.endswith(".safetensors"))
    original = src.read(shard)

    def replace() -> None:
        obstore.put(src.store, shard, original[:-1] + bytes([original[-1] ^ 0xFF]))

    local = bucket_run.fresh_local()
    with pytest.raises(errors.SourceChangedError) as e:
        pull_from_bucket(local, bucket_run.seed, bucket_run.url, 1, fetch_progress=once_after(1024, replace))
    assert e.value.retryable and shard.rsplit("/", 1)[1] in str(e.value)
    assert marker_version(local) is None
    obstore.put(src.store, shard, original)  # put back: the retry pulls the published bytes
    bucket_run.assert_pulls(1, local)


def test_throttling_503_slowdown_is_retried_with_backoff_to_the_published_bytes(bucket_run, small_ranges, monkeypatch):
    from testbed.s3_server import ThrottlingProxy

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    proxy = ThrottlingProxy(bucket_run.s3.s3, refuse=6)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # every request now passes the throttle
        result = bucket_run.assert_pulls(1)
        assert proxy.refused == 6 and result.applied_version == 1
    finally:
        proxy.close()


def test_throttling_past_the_deadline_is_a_retryable_typed_error(bucket_run, small_ranges, monkeypatch):
    from testbed.s3_server import ThrottlingProxy

    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    proxy = ThrottlingProxy(bucket_run.s3.s3, refuse=10**9)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "2")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "1")
    local = bucket_run.fresh_local()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with pytest.raises(errors.BucketUnavailableError) as e:
            bucket_run.assert_pulls(1, local)
        assert e.value.retryable and e.value.http_status == 503
        assert marker_version(local) is None
    finally:
        proxy.close()


def test_a_version_pruned_while_the_pull_fetches_it_is_not_ready_and_nothing_is_applied(bucket_run, small_ranges):
    pub = bucket_run.publisher()
    bucket_run.publish_versions(pub, 1, full_at={1})
    src = BucketSource(bucket_run.url)
    listing = src.list("weight_v000001/")
    index = "weight_v000001/model.safetensors.index.json"
    rest = [k for k in listing if k != index]

    def prune() -> None:  # what a publisher's pruning does: the index first, then the rest
        src.delete([index])
        src.delete(rest)

    local = bucket_run.fresh_local()
    with pytest.raises(errors.SourceNotReadyError) as e:
        pull_from_bucket(local, bucket_run.seed, bucket_run.url, 1, fetch_progress=once_after(1024, prune))
    assert e.value.retryable
    assert marker_version(local) is None
