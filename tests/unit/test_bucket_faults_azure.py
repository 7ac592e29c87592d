"""Faults on a real Azure Blob server (Azurite on loopback), as ``test_bucket_faults.py`` injects
them on S3, at a chosen point of a pull through its byte progress: the server killed and
restarted mid-pull, killed for longer than the deadline, an object replaced while the pull reads
it, and a throttling proxy in front answering Azure's ``503 ServerBusy``. A pull either succeeds
with exactly the published bytes or fails typed with the local state untouched.

Azurite saves its blob metadata every 5 s (and on a graceful stop), so a SIGKILL loses the last
seconds' writes: every test that kills the server first lets the publish settle
(``AzuriteServer.settle``: a graceful stop and restart). The kill then loses nothing that the
pull reads, and what is tested is the client's side of the crash, as on S3.

Azure has no presigned ranged reads here (``signed_get`` signs only S3), so the ranges go
through obstore's own GET with ``If-Match``.

A missing Azurite skips the module, except under CI (``CI=true``), where it fails, as in
``test_bucket_other_stores.py``.
"""

from __future__ import annotations

import threading

import obstore
import pytest

from core_support import assert_checkpoint_is, marker_version
from weightsync import errors
from weightsync.puller.bucket import pull_from_bucket as _pull_from_bucket
from weightsync.puller.pull import _check_local_dir, pull as _pull
from weightsync.storage.source import BucketSource

from bucket_support import BucketRun, store_server, use_only_store


@pytest.fixture(scope="module")
def azurite():
    """One Azurite for the module, started once and stopped at its end."""
    from testbed.azurite_server import AzuriteServer, azurite_binary

    yield from store_server("azurite", azurite_binary() is not None,
                            "scripts/setup_env.sh installs it into .venv/azurite", AzuriteServer.start)


@pytest.fixture
def az_run(azurite, monkeypatch, fast_tmp_path, rng) -> BucketRun:
    """A run on a fresh prefix of the server, its AZURE_* variables the only store variables in
    the environment (nothing can reach an S3 path by accident), a staging dir per test. A test
    that leaves the server down (a failed assertion) gets it back for the next one."""
    use_only_store(azurite, monkeypatch, fast_tmp_path)
    yield BucketRun(str(fast_tmp_path), azurite, rng)
    if azurite.proc is None or azurite.proc.poll() is not None:
        azurite.restart()


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of 1 KiB, one at a time: a fault lands between two ranges of one object."""
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", "1024")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_IN_FLIGHT", "1")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_OBJECTS_IN_FLIGHT", "1")


def pull_from_bucket(*args, **kwargs):
    """``pull`` from a bucket with a ``fetch_progress`` callback (the byte progress of the fetch)."""
    return _pull_from_bucket(_pull, _check_local_dir, *args, **kwargs)


def once_after(nbytes: int, action):
    """A fetch_progress callback that runs ``action`` once, when ``nbytes`` have been fetched."""
    fired = []

    def progress(done: int, total: int) -> None:
        if not fired and done >= nbytes:
            fired.append((done, total))
            action()

    progress.fired = fired  # type: ignore[attr-defined]
    return progress


def throttling_proxy(server, refuse: int):
    from testbed.azurite_server import SERVER_BUSY
    from testbed.s3_server import ThrottlingProxy

    return ThrottlingProxy(server.port, refuse=refuse, answer=SERVER_BUSY)


def test_an_azure_server_killed_and_restarted_mid_pull_is_retried_to_the_published_bytes(az_run, small_ranges, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "120")
    pub = az_run.publisher()
    az_run.publish_versions(pub, 2, full_at={1})
    server = az_run.s3
    server.settle()  # the publish saved: the kill below loses nothing the pull reads

    back = threading.Timer(1.5, server.restart)

    def crash_then_come_back() -> None:
        server.kill()
        back.start()

    progress = once_after(2048, crash_then_come_back)
    local = az_run.fresh_local()
    try:
        result = pull_from_bucket(local, az_run.seed, az_run.url, 1, fetch_progress=progress)
    finally:
        if back.is_alive():
            back.join()
    assert progress.fired and progress.fired[0][0] < progress.fired[0][1]  # the crash came mid-fetch
    assert result.applied_version == 1
    assert_checkpoint_is(local, az_run.expected[1])
    az_run.assert_pulls(2, local)


def test_an_azure_server_gone_past_the_deadline_is_a_retryable_typed_error_and_the_local_state_stays(az_run, small_ranges, monkeypatch):
    pub = az_run.publisher()
    az_run.publish_versions(pub, 2, full_at={1})
    server = az_run.s3
    server.settle()
    local = az_run.fresh_local()
    az_run.assert_pulls(1, local)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "3")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "1")
    progress = once_after(1, server.kill)
    try:
        with pytest.raises((errors.BucketUnavailableError, errors.SourceNotReadyError)) as e:
            pull_from_bucket(local, az_run.seed, az_run.url, 2, fetch_progress=progress)
        assert e.value.retryable
    finally:
        if server.proc is not None and server.proc.poll() is not None:
            server.restart()
    assert progress.fired  # the server went away during the fetch, not before it
    assert marker_version(local) == 1
    assert_checkpoint_is(local, az_run.expected[1])
    az_run.assert_pulls(2, local)  # the retry, once the server is back


def test_an_azure_blob_replaced_mid_read_is_changed_retry_and_never_applied(az_run, small_ranges):
    pub = az_run.publisher()
    az_run.publish_versions(pub, 1, full_at={1})
    src = BucketSource(az_run.url)
    shard = next(k for k in src.list("weight_v000001/") if k.endswith(".safetensors"))
    original = src.read(shard)

    def replace() -> None:  # same size, one byte other: only the ETag (If-Match) tells
        obstore.put(src.store, shard, original[:-1] + bytes([original[-1] ^ 0xFF]))

    local = az_run.fresh_local()
    progress = once_after(1024, replace)
    with pytest.raises(errors.SourceChangedError) as e:
        pull_from_bucket(local, az_run.seed, az_run.url, 1, fetch_progress=progress)
    assert progress.fired and progress.fired[0][0] < progress.fired[0][1]  # replaced mid-object
    assert e.value.retryable and shard.rsplit("/", 1)[1] in str(e.value)
    assert marker_version(local) is None
    obstore.put(src.store, shard, original)  # put back: the retry pulls the published bytes
    az_run.assert_pulls(1, local)


def test_azure_throttling_503_server_busy_is_retried_with_backoff_to_the_published_bytes(az_run, small_ranges, monkeypatch):
    pub = az_run.publisher()
    az_run.publish_versions(pub, 1, full_at={1})
    proxy = throttling_proxy(az_run.s3, refuse=6)
    try:
        # Every request now passes the throttle (a new endpoint: a new client, not a cached one).
        monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", az_run.s3.endpoint_at(proxy.port))
        result = az_run.assert_pulls(1)
        assert proxy.refused == 6 and result.applied_version == 1
    finally:
        proxy.close()


def test_azure_throttling_past_the_deadline_is_a_retryable_typed_error(az_run, small_ranges, monkeypatch):
    pub = az_run.publisher()
    az_run.publish_versions(pub, 1, full_at={1})
    proxy = throttling_proxy(az_run.s3, refuse=10**9)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "2")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "1")
    local = az_run.fresh_local()
    try:
        monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", az_run.s3.endpoint_at(proxy.port))
        with pytest.raises(errors.BucketUnavailableError) as e:
            az_run.assert_pulls(1, local)
        assert e.value.retryable and e.value.http_status == 503
        assert proxy.refused > 0  # the throttle, not something else, is what ran out the deadline
        assert marker_version(local) is None
    finally:
        proxy.close()
