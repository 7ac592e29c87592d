"""Whether two tensors' bits differ, found without allocating: the pause's checks on a device.

A reduction does not do: ``torch.equal``, ``torch.sum(out=)``, ``count_nonzero``, ``any`` on CUDA
take a workspace from the caching allocator for a large input (a multi-block reduction's buffer
and semaphores), and ``torch.equal`` makes a whole bool tensor besides. So the compare writes
0/1 per element into a scratch of int64 made beforehand (``torch.ne`` into ``out=``), and those
0/1 values are used as *positions*: ``index_fill_`` of a pair of flags at them sets flag 0
always and flag 1 only if some element differed. Both are element-wise kernels over existing
storage; the flags are read once, by one small copy to the host, after the writes' fence.

The scratch is ``CHUNK`` elements per device at most (2 MB); a longer compare runs chunk by chunk.
How many elements differ is counted only after a flag says some did (the failure path, which
may allocate: the update fails or reloads anyway).
"""

from __future__ import annotations

from typing import Optional

import torch

CHUNK = 1 << 18


class DifferFlags:
    """Per device: the int64 scratch and one pair of flags per slot (a patch, a group), made
    before the pause; ``mark`` queues a compare on the current stream, ``differing`` reads every
    slot's verdict at once (a synchronising copy of ``2 x slots`` bytes to pageable host memory)."""

    def __init__(self, device: torch.device | str, slots: int, largest: Optional[int] = None, row: int = 1) -> None:
        """``largest``: the most elements one compare covers; ``row``: the most elements of one
        row (dim 0) of a tensor compared (chunks are whole rows: a view need not be flat)."""
        n = max(CHUNK if largest is None else max(1, min(CHUNK, int(largest))), int(row))
        # zeros, not empty: written now, so the pause takes no first-touch page faults on them
        self.scratch = torch.zeros(n, dtype=torch.int64, device=device)
        self.flags = torch.zeros((max(1, slots), 2), dtype=torch.bool, device=device)
        self.host = torch.zeros((max(1, slots), 2), dtype=torch.bool)

    @property
    def nbytes(self) -> int:
        return self.scratch.nbytes + self.flags.nbytes

    def reset(self) -> None:
        self.flags.zero_()

    def mark(self, slot: int, got: torch.Tensor, expected: torch.Tensor) -> None:
        """Flag ``slot`` if any element of ``got`` holds other bits than ``expected`` (the same
        shape, integer dtype and device; either may be a strided view), chunk by chunk of rows."""
        pair = self.flags[slot]
        if got.dim() == 0:
            got, expected = got.reshape(1), expected.reshape(1)  # views
        rows = int(got.shape[0])
        row = int(got[0].numel()) if rows else 1
        per_chunk = max(1, int(self.scratch.numel()) // max(1, row))
        for r0 in range(0, rows, per_chunk):
            r1 = min(rows, r0 + per_chunk)
            part = self.scratch[:(r1 - r0) * row]
            torch.ne(got[r0:r1], expected[r0:r1], out=part.view((r1 - r0,) + tuple(got.shape[1:])))
            pair.index_fill_(0, part, True)

    def differing(self) -> torch.Tensor:
        """One bool per slot: did any of its elements differ (host, a view of ``host``)."""
        self.host.copy_(self.flags)
        return self.host[:, 1]
