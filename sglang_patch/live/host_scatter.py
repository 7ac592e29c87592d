"""The pause's writes into CPU parameters, and their read-back, in one compiled loop.

``_host_scatter.c`` writes a patch block by block and reads each block back from the
parameter's memory right after its write, while its lines are still in cache, comparing every
element bit for bit with the staged value. Through numpy the same read-back is a gather, a
compare and a scan per chunk, about half the write's own cost on the benchmark model; here it
is a few percent of it (``benchmarks/bench_read_back.py``).

The extension is optional (``setup.py``): without it, ``compiled()`` is None and the scatter
writes and reads back through numpy and torch (``live.patch``), as exact and slower.

Callers pass tensors, never pointers: every check that makes the raw loop safe is here (CPU,
contiguous, the integer position type, the same element width on both sides, the range).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

try:
    from . import _host_scatter as _compiled  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: live.patch's numpy path
    _compiled = None

# Elements written, then read back, at a time. Measured on 100M bf16 elements (this 2-core box,
# medians of 25): at 1% written the read-back adds 12% to the write in blocks of 256, 18% in
# blocks of 64; at 5%, 1% (256) and none (64). Larger blocks leave the lines the read-back needs
# out of the L1 cache.
BLOCK = 256
# The read-back is timed on one block in this many (a clock read per block of 256 elements would
# cost about as much as the read-back itself) and scaled to all of them.
TIME_EVERY = 16

__all__ = ["BLOCK", "ReadBackResult", "compiled", "scatter", "scatter_and_read_back"]


class ReadBackResult(NamedTuple):
    first_differing: int  # the first entry (of the patch's positions) that read back other bits; -1: none
    read_back_s: float  # time in the read-back loops (sampled; it includes waiting for the writes to land)


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
    """``scatter``, each block read back and compared right after its write; stops at the first
    block with an element that reads back other bits (the blocks before it and that one are
    written). Needs ``compiled()``."""
    module, args = _args(flat, index, values, start, stop)
    bad, read_back_ns = module.scatter_checked(*args, BLOCK, TIME_EVERY)
    return ReadBackResult(int(bad), read_back_ns / 1e9)


def _args(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor, start: int,
          stop: Optional[int]) -> tuple[Any, tuple]:
    if _compiled is None:
        raise RuntimeError("the compiled host scatter (sglang_patch/live/_host_scatter.c) is not built")
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
