"""Fixtures and hypothesis profiles of the unit tests.

Profiles: ``fast`` (default; CI on 2 cores) and ``thorough`` (many more examples and longer
stateful runs), chosen with ``WEIGHTSYNC_HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import os
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

THOROUGH = os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE", "fast") == "thorough"


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's name: reproducible, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
