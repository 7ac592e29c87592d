"""The pause's writes into CPU parameters, and their read-back, in one compiled loop.

``_host_scatter.c`` writes a patch and reads each element back from the parameter's memory a
few entries after its write, in the same loop, comparing it bit for bit with the staged value.
Through numpy the same read-back is a gather, a compare and a scan per chunk, 0.65-0.8x of the
write's own cost on a 100M-element parameter; here its own estimate is 0.01-0.09x of it
(``benchmarks/bench_read_back.py``).

The extension is optional (``setup.py``): without it, ``compiled()`` is None and the scatter
writes and reads back through numpy and torch (``live.scatter.patch``), as exact and slower.

Callers pass tensors, never pointers: every check that makes the raw loop safe is here (CPU,
contiguous, the integer position type, the same element width on both sides, the range).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

try:
    from . import _host_scatter as _compiled  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: live.scatter.patch's numpy path
    _compiled = None

# Elements per chunk: most chunks are written and read back in one loop (each element read a few
# entries after its write, so the read's load overlaps the writes after it), every
# ``PROBE_EVERY``-th one (the first included) as a probe, written alone and then read back in a
# pass of its own, both timed: what the read-back costs is then measured in every scatter (the
# fused chunks' time against the probes' write rate, plus the probes' own read-back), not guessed.
# Measured on 100M bf16 elements (``benchmarks/bench_read_back.py``): the read-back adds about 6% to
# a 1% write and 3% to a 5% one; without the extension, 65-80%.
CHUNK = 4096
PROBE_EVERY = 16

__all__ = ["CHUNK", "ReadBackResult", "ScatterTimings", "compiled", "scatter", "scatter_and_read_back"]


class ScatterTimings(NamedTuple):
    """What one compiled scatter timed: its fused chunks (written and read back in one loop) and
    its probe chunks (written alone, then read back in a pass of their own). Summed over a
    scatter's patches, ``read_back_s`` tells what its read-back cost."""

    fused_ns: float = 0.0
    fused_elements: int = 0
    plain_ns: float = 0.0
    plain_elements: int = 0
    probe_read_ns: float = 0.0

    def __add__(self, other: "ScatterTimings") -> "ScatterTimings":  # type: ignore[override]
        return ScatterTimings(*(a + b for a, b in zip(self, other)))

    @property
    def read_back_s(self) -> float:
        """The probes' own read-back, plus what the fused chunks took beyond the probes' write
        rate (what they would have cost without reading back); never below the probes' part."""
        extra = 0.0
        if self.plain_elements:
            extra = max(0.0, self.fused_ns - self.plain_ns / self.plain_elements * self.fused_elements)
        return (self.probe_read_ns + extra) / 1e9


class ReadBackResult(NamedTuple):
    first_differing: int  # the first entry (of the patch's positions) that read back other bits; -1: none
    timings: ScatterTimings


def compiled() -> Optional[Any]:
    """The compiled module, or None where the extension was not built."""
    return _compiled


def scatter(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor, start: int = 0,
            stop: Optional[int] = None) -> None:
    """``flat[index[start:stop]] = values[start:stop]``, bit for bit, in place; needs ``compiled()``."""
    module, args = _args(flat, index, values, start, stop)
    module.scatter(*args)


def scatter_and_read_back(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor, start: int = 0,
                          stop: Optional[int] = None) -> ReadBackResult:
    """``scatter``, every element read back from the parameter's memory and compared bit for bit
    with its value; stops at the first element that reads back other bits (the chunks before it
    and that one are written). Needs ``compiled()``."""
    module, args = _args(flat, index, values, start, stop)
    bad, *timings = module.scatter_checked(*args, CHUNK, PROBE_EVERY)
    return ReadBackResult(int(bad), ScatterTimings(*timings))


def _args(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor, start: int,
          stop: Optional[int]) -> tuple[Any, tuple]:
    if _compiled is None:
        raise RuntimeError("the compiled host scatter (sglang_patch/live/scatter/_host_scatter.c) is not built")
    n = int(index.numel())
    stop = n if stop is None else stop
    for name, t in (("parameter", flat), ("positions", index), ("values", values)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"the host scatter's {name} must be a contiguous CPU tensor, got {t.device} "
                             f"with strides {tuple(t.stride())}")
    if index.dtype != torch.int64:
        raise ValueError(f"the host scatter's positions must be int64, got {index.dtype}")
    if flat.element_size() != values.element_size():
        raise ValueError(f"the host scatter writes {values.element_size()}-byte values into a parameter of "
                         f"{flat.element_size()}-byte elements")
    for name, t in (("parameter", flat), ("positions", index), ("values", values)):
        if t.data_ptr() % t.element_size():  # the loop reads whole elements through typed pointers
            raise ValueError(f"the host scatter's {name} start at an address not aligned to its "
                             f"{t.element_size()}-byte elements")
    if not 0 <= start <= stop <= n or int(values.numel()) < n:
        raise ValueError(f"the host scatter's range {start}:{stop} is outside {n} positions "
                         f"({int(values.numel())} values)")
    return _compiled, (flat.data_ptr(), int(flat.numel()), index.data_ptr(), values.data_ptr(), start, stop,
                       flat.element_size())
