"""The fast fetch of an S3 pull (presigned ranged GETs read by ``http.client``,
``storage/signed_get.py``) against the slow one (obstore's stream) as the oracle, on the real S3
server: random object sizes, range sizes and ranges in flight, with a fault caused for real at a
random point of the fetch: the object replaced or deleted mid-read, 503 SlowDown answers, bodies
cut short by a proxy. The contract both paths keep: exactly the planned object's bytes, or a typed
"changed / gone, retry" error; never other bytes, never a short file reported whole. Where the
outcome does not depend on timing (no fault, throttling, cut bodies) both give the bytes."""

from __future__ import annotations

import os
import uuid

import numpy as np
import obstore
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.cutting_proxy import CuttingProxy
from testbed.s3_server import ThrottlingProxy
from weightsync import errors
from weightsync.storage.source import BucketSource

from bucket_support import s3_env, s3_server_fixture  # noqa: F401 (fixtures)

s3 = s3_server_fixture()

FAULTS = ("none", "replace", "delete", "throttle", "cut")
EXAMPLES = 300 if os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE") == "thorough" else 12


class Outcome:
    def __init__(self, data: "bytes | None", error: "BaseException | None"):
        self.data = data
        self.error = error


def fetch_once(s3, url: str, key: str, original: bytes, path: str, fault: str, at: float, n: int, tmp: str,
               monkeypatch) -> Outcome:
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_SIGNED_GET", "1" if path == "signed" else "0")
    obstore.put(BucketSource(url).store, key, original)  # the planned object, fresh for each path
    proxy = None
    if fault == "throttle":
        proxy = ThrottlingProxy(s3.s3, refuse=n)
    elif fault == "cut":
        proxy = CuttingProxy(s3.s3, cut=n, after=400 + int(at * 4000))
    try:
        if proxy is not None:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        src = BucketSource(url)
        obj = src.list()[key]
        fired: list[bool] = []

        def progress(done: int, total: int) -> None:
            if fired or done < at * total:
                return
            fired.append(True)
            if fault == "replace":
                obstore.put(_direct_store(s3, url), key, original[::-1] + b"x")
            elif fault == "delete":
                obstore.delete(_direct_store(s3, url), key)

        dst = os.path.join(tmp, f"{path}-{uuid.uuid4().hex[:6]}")
        try:
            src.fetch(obj, dst, progress)
        except errors.WeightSyncError as e:
            return Outcome(None, e)
        assert (src._signed is not None) == (path == "signed"), "the path under test was not the one taken"
        with open(dst, "rb") as f:
            return Outcome(f.read(), None)
    finally:
        if proxy is not None:
            proxy.close()
            monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)


def _direct_store(s3, url: str):
    """A store that talks to the server itself, not through the proxy (the fault's writer)."""
    saved = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = s3.endpoint
    try:
        return BucketSource(url).store
    finally:
        if saved is not None:
            os.environ["AWS_ENDPOINT_URL"] = saved


@pytest.fixture
def env(s3_env, monkeypatch, fast_tmp_path):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_DEADLINE_S", "30")
    return s3_env


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    size=st.integers(0, 3 << 20),
    range_nbytes=st.sampled_from([4 << 10, 64 << 10, 1 << 20, 4 << 20]),
    in_flight=st.integers(1, 4),
    fault=st.sampled_from(FAULTS),
    at=st.floats(0.0, 0.9),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_signed_fetch_gives_what_the_stream_gives_under_random_faults(
    env, monkeypatch, fast_tmp_path, size, range_nbytes, in_flight, fault, at, n, seed
):
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", str(range_nbytes))
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_IN_FLIGHT", str(in_flight))
    url = env.url(f"fetch-model/{uuid.uuid4().hex[:8]}")
    key = "weight_v000001/model.safetensors"
    original = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    got = {path: fetch_once(env, url, key, original, path, fault, at, n, str(fast_tmp_path), monkeypatch)
           for path in ("stream", "signed")}
    for path, out in got.items():
        if out.error is None:
            assert out.data == original, f"{path}: other bytes than the planned object's, reported whole"
        else:
            assert fault in ("replace", "delete"), f"{path}: {fault} must not fail: {out.error!r}"
            assert isinstance(out.error, errors.SourceNotReadyError) and out.error.retryable, repr(out.error)
            if fault == "replace":
                assert isinstance(out.error, errors.SourceChangedError), repr(out.error)
    if fault in ("none", "throttle", "cut"):
        assert got["signed"].data == got["stream"].data == original


def test_an_s3_fetch_takes_the_signed_path_unless_it_is_turned_off_or_a_proxy_is_set(env, monkeypatch, fast_tmp_path):
    url = env.url(f"fetch-model/{uuid.uuid4().hex[:8]}")
    key = "weight_v000001/model.safetensors"
    data = os.urandom(10_000)

    def path_taken() -> bool:
        src = BucketSource(url)
        obstore.put(src.store, key, data)
        dst = str(fast_tmp_path / uuid.uuid4().hex)
        src.fetch(src.list()[key], dst)
        with open(dst, "rb") as f:
            assert f.read() == data
        return src._signed is not None

    assert path_taken()
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_SIGNED_GET", "0")
    assert not path_taken()
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_SIGNED_GET", "1")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # http.client would not go through it: obstore does
    monkeypatch.setenv("NO_PROXY", "")
    assert not path_taken()


def test_a_presigned_url_is_reused_while_young_and_signed_again_once_half_its_lifetime_passed(env, monkeypatch):
    import time as real_time

    from weightsync.storage import signed_get
    from weightsync.storage.signed_get import SignedRanges

    src = BucketSource(env.url(f"fetch-model/{uuid.uuid4().hex[:8]}"))
    reader = SignedRanges.for_store(src.store, src.url)
    assert reader is not None
    signed: list[str] = []
    real_sign = obstore.sign
    monkeypatch.setattr(obstore, "sign", lambda store, method, key, expires: signed.append(key) or real_sign(store, method, key, expires))
    first = reader.signed_url("weight_v000001/a.safetensors", 600)
    assert reader.signed_url("weight_v000001/a.safetensors", 600) == first and len(signed) == 1
    later = real_time.monotonic() + 400  # past half of the 660 s lifetime
    monkeypatch.setattr(signed_get, "_now", lambda: later)
    reader.signed_url("weight_v000001/a.safetensors", 600)
    assert signed == ["weight_v000001/a.safetensors"] * 2


def _counting_connects(monkeypatch) -> list[int]:
    import http.client

    made: list[int] = []
    real = http.client.HTTPConnection.connect

    def connect(self):
        made.append(1)
        return real(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", connect)
    return made


def test_a_signed_fetch_keeps_one_connection_per_thread_and_closes_them_all_when_done(env, monkeypatch, fast_tmp_path):
    from weightsync.storage import source as source_mod

    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", str(64 << 10))
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_IN_FLIGHT", "2")
    made_sessions: list = []

    class Recorded(source_mod.Connections):
        def __init__(self):
            super().__init__()
            made_sessions.append(self)

    monkeypatch.setattr(source_mod, "Connections", Recorded)
    src = BucketSource(env.url(f"fetch-model/{uuid.uuid4().hex[:8]}"))
    data = os.urandom(1 << 20)  # 16 ranges
    obstore.put(src.store, "weight_v000001/model.safetensors", data)
    obj = src.list()["weight_v000001/model.safetensors"]
    made = _counting_connects(monkeypatch)
    dst = str(fast_tmp_path / "dst")
    src.fetch(obj, dst)
    with open(dst, "rb") as f:
        assert f.read() == data
    assert src._signed is not None
    assert 1 <= len(made) <= 2, f"{len(made)} connections for 16 ranges on 2 threads (one per range: no keep-alive)"
    assert [s.open_count() for s in made_sessions] == [0], "a connection of the fetch left open"


def test_a_kept_connection_the_server_closed_is_replaced_at_once_and_the_bytes_are_exact(env, monkeypatch, fast_tmp_path):
    import socket

    from weightsync.storage import source as source_mod

    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RANGE_NBYTES", str(64 << 10))
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_IN_FLIGHT", "1")
    sessions: list = []

    class Recorded(source_mod.Connections):
        def __init__(self):
            super().__init__()
            sessions.append(self)

    monkeypatch.setattr(source_mod, "Connections", Recorded)
    src = BucketSource(env.url(f"fetch-model/{uuid.uuid4().hex[:8]}"))
    data = os.urandom(1 << 20)  # 16 ranges, one at a time
    obstore.put(src.store, "weight_v000001/model.safetensors", data)
    obj = src.list()["weight_v000001/model.safetensors"]

    def drop_kept_connections(done: int, total: int) -> None:
        if done % (64 << 10) == 0 and done < total:  # a range just ended: its connection is kept
            for conn in sessions[-1]._open:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # what a server's idle timeout does

    made = _counting_connects(monkeypatch)
    slept: list[float] = []
    real_sleep = source_mod.time.sleep
    monkeypatch.setattr(source_mod.time, "sleep", lambda s: slept.append(s) or real_sleep(s))
    dst = str(fast_tmp_path / "dst")
    src.fetch(obj, dst, drop_kept_connections)
    with open(dst, "rb") as f:
        assert f.read() == data
    # Every range after the first found its kept connection dead and opened a new one at once:
    # none was given up and asked again after a backoff.
    assert len(made) == 16 and slept == []
