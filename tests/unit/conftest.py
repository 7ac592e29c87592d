"""Fixtures and hypothesis profiles of the unit tests.

Profiles: ``fast`` (default; CI on 2 cores) and ``thorough`` (many more examples and longer
stateful runs), chosen with ``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fast",
    max_examples=40,
    deadline=None,  # real files: an fsync can stall on a busy CI disk
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE", "fast"))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's name: reproducible, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _shm_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def fast_tmp_path(tmp_path):
    """A fresh dir on tmpfs when the machine has one (else ``tmp_path``): the core fsyncs every
    file it writes, which costs tens of ms each on a busy CI disk. Still real files."""
    root = _shm_root()
    if root is None:
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="ws-test-", dir=root)
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fast_module_tmp(tmp_path_factory):
    """Module-scoped ``fast_tmp_path``."""
    root = _shm_root()
    if root is None:
        yield tmp_path_factory.mktemp("ws")
        return
    path = tempfile.mkdtemp(prefix="ws-module-", dir=root)
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
