"""sparse-v2's compiled range coder under UndefinedBehaviorSanitizer (issue 18, point 8).

Our writer packs tensors back to back, so a tensor's elements can start at any byte offset of
a shard, and the local checkpoint's regions the decoder writes into are as aligned as that
file. The coder reads and writes elements through ``memcpy``; this test builds it with
``-fsanitize=alignment,undefined -fno-sanitize-recover=all`` into a temporary dir and, in a
child process, encodes and decodes segments of every width at byte offsets 0..7. A misaligned
dereference (or any other undefined behaviour UBSan sees) aborts the child. A few seconds;
skipped only where no C compiler with UBSan exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "weightsync", "codecs", "_sparse2_rc.c")  # fmt: skip

CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import _sparse2_rc as rc
rng = np.random.default_rng(5)
n = 3000
for width in (1, 2, 4, 8):
    for offset in range(8):
        old_buf = bytearray(n * width + 8)
        new_buf = bytearray(n * width + 8)
        old = rng.integers(0, 256, n * width, dtype=np.uint8)
        new = old.copy()
        changed = rng.random(n) < 0.2
        for b in range(width):  # whole elements change, some only in their low byte
            flip = rng.integers(1, 256, n, dtype=np.uint8) * (changed & ((b == 0) | (rng.random(n) < 0.5)))
            new[b::width] ^= flip.astype(np.uint8)
        old_buf[offset : offset + n * width] = old.tobytes()
        new_buf[offset : offset + n * width] = new.tobytes()
        o = memoryview(old_buf)[offset : offset + n * width]
        w = memoryview(new_buf)[offset : offset + n * width]
        coded, k, _ = rc.encode_segment(o, w, width)
        seg = bytearray(n * width + 8)
        seg[offset : offset + n * width] = old.tobytes()
        rc.decode_segment(memoryview(seg)[offset : offset + n * width], coded, width, k)
        assert bytes(seg[offset : offset + n * width]) == new.tobytes(), (width, offset)
print("round trips ok")
"""


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def build_with_ubsan(out_dir: str, source: str = SOURCE) -> str | None:
    """The extension ``source`` (the coder by default) built with UBSan into ``out_dir``, named
    after the source file; None when this machine cannot build it."""
    cc = _compiler()
    if cc is None:
        return None
    name = os.path.splitext(os.path.basename(source))[0]
    target = os.path.join(out_dir, name + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [cc, "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer",
           "-fsanitize=alignment,undefined", "-fno-sanitize-recover=all",
           "-I", sysconfig.get_paths()["include"], source, "-o", target]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        if "sanitize" in built.stderr or "ubsan" in built.stderr:
            return None  # a compiler without UBSan
        raise AssertionError(f"{name} does not build: {built.stderr[-3000:]}")
    return target


def run_round_trips(module_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    return subprocess.run([sys.executable, "-c", CHILD, module_dir], capture_output=True, text=True, timeout=120, env=env)


def test_the_range_coder_has_no_undefined_behaviour_at_any_element_alignment(tmp_path):
    if build_with_ubsan(str(tmp_path)) is None:
        pytest.skip("no C compiler with UBSan here")
    out = run_round_trips(str(tmp_path))
    assert "runtime error" not in out.stderr, out.stderr[-4000:]
    assert out.returncode == 0 and "round trips ok" in out.stdout, (out.returncode, out.stdout, out.stderr[-4000:])
