"""Shared parts of the bucket tests: one real S3 server (SeaweedFS ``weed mini`` on loopback)
per test module, its credentials in the environment, and a run (seed checkpoint, versions kept
by their exact bytes) published to a fresh prefix of it.

    pytestmark = ...; s3 = s3_server_fixture()   # in a test module
    def test_x(bucket_run): ...
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import numpy as np
import pytest

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint
from testbed.s3_server import S3Server
from weightsync import Publisher, pull

SIZES = {
    "embed": ("float32", (64, 16)),
    "layers.0.w": ("float32", (32, 32)),
    "layers.1.w": ("float32", (32, 32)),
    "norm": ("float32", (16,)),
    "bias": ("int16", (5,)),
}


def s3_server_fixture():
    """A module-scoped fixture: the server, started once for the module and stopped at its end."""

    @pytest.fixture(scope="module")
    def s3():
        root = tempfile.mkdtemp(prefix="ws-s3-")
        server = S3Server.start(root)
        try:
            yield server
        finally:
            server.stop()
            shutil.rmtree(root, ignore_errors=True)

    return s3


@pytest.fixture
def s3_env(s3, monkeypatch, fast_tmp_path):
    """The server's AWS_* variables in the environment (the only place credentials come from),
    and a staging dir for publishers under the test's tmp dir."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging"))
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "5")
    return s3


class BucketRun:
    """A seed checkpoint and a bucket prefix; ``expected[v]`` is the bytes of version v."""

    def __init__(self, root: str, s3: S3Server, rng: np.random.Generator):
        self.root, self.s3, self.rng = root, s3, rng
        self.url = s3.url(f"runs/{uuid.uuid4().hex[:12]}")
        self.seed = os.path.join(root, "seed")
        self.tensors = [random_tensors(rng, SIZES)]
        write_hf_checkpoint(self.seed, self.tensors[0])
        self.expected = [tensor_bytes(self.tensors[0])]
        self._locals = 0

    def publisher(self, **kw) -> Publisher:
        kw.setdefault("encoding", "sparse-v1")
        kw.setdefault("workers", 1)
        pub = Publisher(self.url, template_dir=self.seed, **kw)
        pub.seed_snapshot(self.tensors[0])
        return pub

    def next_tensors(self, density: float = 0.02) -> dict[str, np.ndarray]:
        new = mutate(self.tensors[-1], self.rng, density)
        self.tensors.append(new)
        self.expected.append(tensor_bytes(new))
        return new

    def publish_versions(self, pub: Publisher, n: int, full_at: "set[int]" = frozenset()) -> None:
        for _ in range(n):
            v = len(self.tensors)
            pub.publish(v, self.next_tensors(), full=True if v in full_at else None)

    def fresh_local(self) -> str:
        self._locals += 1
        return os.path.join(self.root, f"local{self._locals}")

    def assert_pulls(self, v: int, local: str | None = None, **kw):
        local = local or self.fresh_local()
        result = pull(local, self.seed, self.url, v, **kw)
        assert result.applied_version == v
        assert_checkpoint_is(local, self.expected[v])
        return result


STORE_PREFIXES = ("AWS_", "AZURE_", "AZURITE_", "GOOGLE_")


def store_server(name: str, installed: bool, install_hint: str, start):
    """A module's server of another store (``start(root)`` gives it, a context manager), started
    once and stopped at the end. Not installed: a skip on a developer's machine, a failure under
    CI (``CI=true``), where a missing install step in ``scripts/setup_env.sh`` must be seen."""
    if not installed:
        why = f"{name} is not installed ({install_hint})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; under CI every store's server must be installed")
        pytest.skip(why)
    root = tempfile.mkdtemp(prefix=f"ws-{name}-")
    try:
        with start(root) as server:
            yield server
    finally:
        shutil.rmtree(root, ignore_errors=True)


def use_only_store(server, monkeypatch, fast_tmp_path) -> None:
    """``server.env()`` the only store variables in the environment (the only place credentials
    come from; nothing reaches another store by accident), a staging dir under the test's tmp
    dir, and the client's retries short."""
    for k in list(os.environ):
        if k.startswith(STORE_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_STAGING_DIR", str(fast_tmp_path / "staging"))
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_RETRY_TIMEOUT_S", "5")


@pytest.fixture
def bucket_run(s3_env, fast_tmp_path, rng) -> BucketRun:
    return BucketRun(str(fast_tmp_path), s3_env, rng)


def upload_dir_state(source, root: str, known: "dict[str, str]") -> int:
    """Make the bucket prefix of ``source`` (a ``BucketSource``) hold exactly the files under the
    directory ``root``, under the same keys ('/'-separated): a file new or changed since the last
    call is put, a key whose file is gone is deleted. A bucket copied from disk pulls the same
    (docs/BUCKETS.md), so a test that damages a source dir in place gets the same damage in the
    bucket. ``known`` (key -> digest of the bytes put) is kept by the caller between calls, so
    unchanged files are not put again. Returns the number of objects put.

    A symlink has no bucket equivalent: it is refused (ValueError) rather than uploaded as its
    target's bytes, which would test something else than the case it was written for."""
    import hashlib

    import obstore

    present: dict[str, str] = {}
    put = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                raise ValueError(f"{path} is a symlink: a bucket has no symlinks; run this case on a directory only")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, "rb") as f:
                data = f.read()
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            present[key] = digest
            if known.get(key) != digest:
                obstore.put(source.store, key, data)
                known[key] = digest
                put += 1
    gone = sorted(k for k in source.list() if k not in present)
    if gone:
        source.delete(gone)
    for k in gone:
        known.pop(k, None)
    return put
