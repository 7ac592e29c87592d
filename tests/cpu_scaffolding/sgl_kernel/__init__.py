"""CPU-test stand-in for ``sgl_kernel`` (see ``tests/cpu_scaffolding/_cpu_standin.py``).

Import-only: every name resolves and raises when called. ``sgl_kernel.scalar_type`` is left
unresolvable so sglang falls back to its own pure-Python scalar types.
"""

import sys

from _cpu_standin import make_standin_package

make_standin_package(sys.modules[__name__], missing=("sgl_kernel.scalar_type",))
