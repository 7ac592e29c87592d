"""Which parts of the plugin installed in this process, and why a part did not.

Its own module so that the route (which answers 503 with the reason) and the plugin (which
installs the parts) both read it without importing each other.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

log = logging.getLogger("sglang_patch.plugin")

_failures: dict[str, str] = {}


def unavailable_reason() -> Optional[str]:
    """Why ``/pull_weights`` cannot work in this process (a part failed to install), or None."""
    if not _failures:
        return None
    return "; ".join(f"{part}: {why}" for part, why in sorted(_failures.items()))


def guarded(part: str, install: Callable) -> Callable:
    """``install`` wrapped so that a failure is logged in one line and recorded, never raised."""

    def run(module) -> None:
        try:
            install(module)
        except Exception as exc:
            _failures[part] = f"{type(exc).__name__}: {exc}"
            log.error(
                "weightsync pull_weights: the %s part failed to install (%s); sglang serves on "
                "without it and /pull_weights answers 503",
                part, _failures[part],
            )  # fmt: skip
            log.debug("weightsync pull_weights: %s install traceback", part, exc_info=True)

    return run
