"""CPU-test stand-in for ``torchvision`` (see ``tests/cpu_scaffolding/_cpu_standin.py``).

Import-only: sglang imports torchvision through its multimodal configs at module load; a
text-only model never calls it. Every name resolves and raises when called.
"""

import sys

from _cpu_standin import make_standin_package

__version__ = "0.0.0+cpu-test-standin"
make_standin_package(sys.modules[__name__])
