"""The two compiled parts: the core's sparse-v2 bitstream 3 range coder (weightsync/codecs/_sparse2_rc.c)
and live apply's host scatter and read-back (sglang_patch/live/scatter/_host_scatter.c).

Everything else is in pyproject.toml. Both extensions are optional: an install without a C
compiler still reads and writes every other encoding, and sparse-v2 bitstream 2
(codecs/sparse_v2.py); live apply then writes CPU parameters through numpy (live/host_scatter.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "weightsync.codecs._sparse2_rc", ["weightsync/codecs/_sparse2_rc.c"], extra_compile_args=["-O2"], optional=True
        ),
        Extension(
            "sglang_patch.live.scatter._host_scatter", ["sglang_patch/live/scatter/_host_scatter.c"], extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
