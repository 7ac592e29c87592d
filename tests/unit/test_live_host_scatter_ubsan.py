"""Live apply's compiled host scatter (``sglang_patch/live/scatter/_host_scatter.c``) under
UndefinedBehaviorSanitizer: built with ``-fsanitize=alignment,undefined`` into a temporary dir
and driven in a child process over every element width, chunk sizes that do and do not divide
the patch, a position staged twice (a read-back mismatch) and a position out of range. Any
undefined behaviour UBSan sees aborts the child. A few seconds; skipped only where no C compiler
with UBSan exists.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_codec_sparse2_ubsan import build_with_ubsan

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "sglang_patch", "live", "scatter", "_host_scatter.c")  # fmt: skip

CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import _host_scatter as hs
rng = np.random.default_rng(9)
for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
    dst = rng.integers(0, 200, 5000).astype(dtype)
    index = np.sort(rng.choice(dst.size, 900, replace=False)).astype(np.int64)
    src = rng.integers(0, 200, 900).astype(dtype)
    for chunk in (1, 7, 31, 33, 256, 900, 5000):  # shorter and longer than the loop's lag of 32
        d = dst.copy()
        bad, *times = hs.scatter_checked(d.ctypes.data, d.size, index.ctypes.data, src.ctypes.data, 0, 900, d.itemsize, chunk, 3)
        assert bad == -1 and min(times) >= 0 and np.array_equal(d[index], src), (dtype, chunk)
    twice = index.copy(); twice[501] = twice[500]
    other = src.copy(); other[501] = other[500] + 1
    for chunk, probe_every in ((256, 1), (256, 100), (40, 100)):  # a probe chunk; a fused one
        d = dst.copy()
        bad, *_ = hs.scatter_checked(d.ctypes.data, d.size, twice.ctypes.data, other.ctypes.data, 0, 900, d.itemsize, chunk, probe_every)
        assert bad == 500, (chunk, probe_every, bad)
    out = index.copy(); out[10] = dst.size
    for call in (lambda: hs.scatter(dst.ctypes.data, dst.size, out.ctypes.data, src.ctypes.data, 0, 900, dst.itemsize),
                 lambda: hs.scatter_checked(dst.ctypes.data, dst.size, out.ctypes.data, src.ctypes.data, 0, 900, dst.itemsize, 256, 1),
                 lambda: hs.scatter_checked(dst.ctypes.data, dst.size, out.ctypes.data, src.ctypes.data, 0, 900, dst.itemsize, 8, 100)):
        try:
            call()
        except IndexError:
            pass
        else:
            raise AssertionError("an out-of-range position was written")
print("scatters ok")
"""


def test_the_host_scatter_has_no_undefined_behaviour_at_any_width_chunk_or_fault(tmp_path):
    if build_with_ubsan(str(tmp_path), SOURCE) is None:
        pytest.skip("no C compiler with UBSan here")
    env = dict(os.environ, UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert "runtime error" not in out.stderr, out.stderr[-4000:]
    assert out.returncode == 0 and "scatters ok" in out.stdout, (out.returncode, out.stdout, out.stderr[-4000:])
