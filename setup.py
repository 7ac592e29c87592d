"""The one compiled part of the core: sparse-v2 bitstream 3's range coder (weightsync/codecs/_sparse2_rc.c).

Everything else is in pyproject.toml. The extension is optional: an install without a C compiler
still reads and writes every other encoding, and sparse-v2 bitstream 2 (codecs/sparse_v2.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "weightsync.codecs._sparse2_rc", ["weightsync/codecs/_sparse2_rc.c"], extra_compile_args=["-O2"], optional=True
        ),
    ]
)
