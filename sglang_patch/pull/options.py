"""The operator's settings for the pull and live apply, as every scheduler process sees them.

Plain data (no sglang): ``sglang_patch.server_flags`` fills it from the server's flags or the
environment; the pull and live apply read it.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from .coordinator import DEFAULT_TIMEOUT_S

# Above this fraction of a rank's mapped elements, a scatter costs about what a reload does
# (index_copy_ ~2 ns per element vs a reload's ~0.4 ns per element here) and the staged values
# take (8 + itemsize) bytes per element of host memory: reload instead.
DEFAULT_LIVE_MAX_CHANGED_FRACTION = 0.1


class PullWeightsOptions(msgspec.Struct, frozen=True):
    """The operator's settings for ``/pull_weights``, as every scheduler process sees them."""

    pre_read_hook: Optional[str] = None
    allowed_roots: tuple[str, ...] = ()
    live_max_changed_fraction: float = DEFAULT_LIVE_MAX_CHANGED_FRACTION
    timeout_s: float = DEFAULT_TIMEOUT_S
