"""When a version is published full rather than as a delta: the rule every rank applies to the
same totals (over all ranks), so every rank reaches the same kind.

A full version wins on schedule (every ``full_every`` versions), when the delta's bytes would
exceed ``fallback_fraction`` of the full size, or when more than ``full_above_changed_fraction``
of the elements changed (a dense step: a full version is cheaper to pull than to apply).
"""

from __future__ import annotations

from typing import Literal

from .. import knobs

Kind = Literal["delta", "full"]


class KindRule:
    def __init__(self, full_every: int = 0, fallback_fraction: float | None = None,
                 full_above_changed_fraction: float | None = None):
        self.full_every = int(full_every)
        self.fallback_fraction = float(knobs.FALLBACK_FRACTION.get() if fallback_fraction is None else fallback_fraction)
        self.full_above_changed_fraction = float(
            knobs.FULL_ABOVE_CHANGED_FRACTION.get() if full_above_changed_fraction is None else full_above_changed_fraction
        )

    def full_by_schedule(self, version: int) -> bool:
        return self.full_every > 0 and version % self.full_every == 0

    def decide(
        self, version: int, delta_nbytes: int, full_nbytes: int, changed_elements: int | None, total_elements: int | None
    ) -> tuple[Kind, str]:
        """The kind of ``version`` and why."""
        if self.full_by_schedule(version):
            return "full", f"every {self.full_every} versions"
        if full_nbytes and delta_nbytes > self.fallback_fraction * full_nbytes:
            return "full", (
                f"delta would be {delta_nbytes / full_nbytes:.0%} of the full size "
                f"(threshold {self.fallback_fraction:.0%})"
            )
        if changed_elements is not None and total_elements:
            changed = changed_elements / total_elements
            if changed > self.full_above_changed_fraction:
                return "full", (
                    f"{changed:.0%} of the elements changed "
                    f"(threshold {self.full_above_changed_fraction:.0%}); a full version is cheaper to pull"
                )
        return "delta", f"delta is {delta_nbytes / max(full_nbytes, 1):.2%} of the full size"


__all__ = ["Kind", "KindRule"]
