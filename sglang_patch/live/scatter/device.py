"""The one place live apply talks to the device's streams: the fence around the pause's writes.

On a CUDA engine, the scheduler thread issues the pause's writes (``live.scatter.patch.
scatter_with_undo``, ``UndoLog.restore``) on its current stream. sglang runs the loop under
``StreamContext(schedule_stream)`` and the forward either on that stream or, with the overlap
scheduler or pipeline stages, on ``model_runner.forward_stream`` (the same stream as
``scheduler.forward_stream``; 0.5.16 and 0.5.23 alike). Kernels of a forward launched before
the pause may still be reading the weights there, and the next forward must not start before
the writes end. A global ``torch.cuda.synchronize`` would wait for every stream of the device
(sglang's copy and scheduling streams too) in the hot path; events order exactly the two
streams concerned and leave the host free until the one wait the reply needs:

1. ``begin_writes``: the write stream waits (on the device) for what the forward stream holds.
2. ``end_writes``: an event after the last write; the forward stream waits for it.
3. ``wait``: the host waits for that event. A write that failed asynchronously (an illegal
   address, an ECC error) raises here, inside ``scatter_with_undo``, so the rank restores (or
   reports "not restored" and reloads) before it reports; the pause is timed after it.

On the CPU every write has finished when its call returns: ``HostFence`` does nothing. The
fence is made at staging (``pause_fence_for``), so the pause creates no event either.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

import torch

__all__ = ["CudaFence", "HostFence", "PauseFence", "forward_stream_of", "needs_device_copies", "pause_fence_for"]


class PauseFence(Protocol):
    def begin_writes(self) -> None: ...

    def end_writes(self) -> None: ...

    def wait(self) -> None: ...


class HostFence:
    """CPU parameters: each write is done when its call returns."""

    def begin_writes(self) -> None:
        pass

    def end_writes(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaFence:
    """Writes on the calling thread's current stream of ``device``, ordered with
    ``forward_stream`` by events, and one host wait for the last write."""

    def __init__(self, device: torch.device, forward_stream: Optional[Any] = None) -> None:
        self.device = device
        self.forward_stream = forward_stream
        self._forward_done = torch.cuda.Event()
        self._writes_done = torch.cuda.Event()
        self._stream: Optional[Any] = None
        # a CUDA event is created at its first record: record both now, outside the pause
        here = torch.cuda.current_stream(device)
        self._forward_done.record(here)
        self._writes_done.record(here)

    def _other_forward_stream(self, stream: Any) -> Optional[Any]:
        f = self.forward_stream
        return f if f is not None and f.cuda_stream != stream.cuda_stream else None

    def begin_writes(self) -> None:
        self._stream = torch.cuda.current_stream(self.device)
        forward = self._other_forward_stream(self._stream)
        if forward is not None:  # a forward still running reads the old weights: write after it
            self._forward_done.record(forward)
            self._stream.wait_event(self._forward_done)

    def end_writes(self) -> None:
        stream = self._stream or torch.cuda.current_stream(self.device)
        self._writes_done.record(stream)
        forward = self._other_forward_stream(stream)
        if forward is not None:  # the next forward reads the new weights only
            forward.wait_event(self._writes_done)

    def wait(self) -> None:
        self._writes_done.synchronize()


def needs_device_copies(flat: torch.Tensor) -> bool:
    """Whether a patch of ``flat`` keeps its positions and values on ``flat``'s device (made at
    staging), so that the pause copies nothing from the host (and allocates nothing there)."""
    return flat.device.type != "cpu"


def forward_stream_of(scheduler: Any) -> Optional[Any]:
    """The stream sglang's forward may run on besides the loop's own (None: none known)."""
    stream = getattr(scheduler, "forward_stream", None)
    if stream is None:
        runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        stream = getattr(runner, "forward_stream", None)
    return stream if isinstance(stream, torch.cuda.Stream) else None


def pause_fence_for(params: Mapping[str, torch.Tensor], scheduler: Any = None) -> PauseFence:
    """The fence for a pause that writes ``params`` (made at staging, not inside the pause)."""
    devices = {p.device for p in params.values() if p.device.type != "cpu"}
    if not devices:
        return HostFence()
    if len(devices) > 1 or next(iter(devices)).type != "cuda":
        raise RuntimeError(f"live apply supports parameters on the CPU or on one CUDA device, not on {sorted(map(str, devices))}")
    return CudaFence(next(iter(devices)), forward_stream_of(scheduler))
