"""The box mirror of the GPU kit's rehearsal (benchmarks/gpu_check.sh --device cpu).

With ``WEIGHTSYNC_BOX_MIRROR_DIR`` set (and this folder on ``PYTHONPATH``), this interpreter's own
site-packages leave ``sys.path`` and that folder takes their place. ``gpu_check.py mirror``
fills it with links to the installed distributions the H200 box's image also has (their modules
and their metadata), plus the carried packages that cannot be installed on this interpreter
(cp312 wheels on a cp311 rehearsal: their same-version twins from here). So an import of
anything else fails here as it would on the box, and ``importlib.util.find_spec`` and package
metadata answer as they would there.

Why: the box has no network, so a package that sglang's model import needs and nobody carried
fails only there, in minutes that cannot be bought back; here, where everything is installed,
it would go unnoticed.
"""

from __future__ import annotations

import os
import sys
import sysconfig


def _install() -> None:
    mirror = os.environ.get("WEIGHTSYNC_BOX_MIRROR_DIR")
    if not mirror:
        return
    site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    kept = [p for p in sys.path if os.path.realpath(p or ".") not in site]
    sys.path[:] = kept + [mirror]
    sys.path_importer_cache.clear()


_install()
