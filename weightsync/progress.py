"""Progress of long work (a seed copy, an apply, a publish), in bytes, with rate and ETA.

The core reports into whatever reporter the caller installed (``reporting``); with none
installed (the engine's pull helper, a trainer, the tests) every call is a no-op costing one
global read, so the hooks stay in the core without a parameter threaded through every layer.
The ``weightsync`` command installs a ``BarReporter`` on stderr when a person can see it (a
terminal, or ``-v``) and none under ``--json``.

Notices ("waiting for the lock held by pid N") go the same way: to the reporter when one is
installed, else to the module's logger at INFO, as before.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, TextIO

log = logging.getLogger(__name__)


class Stage:
    """One piece of long work; this base does nothing (no reporter installed)."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the stage's bytes are done (thread-safe)."""

    def close(self) -> None:
        """The stage is over (a failed one too)."""

    def __enter__(self) -> "Stage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SILENT = Stage()  # what ``stage`` answers with no reporter installed


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB' (binary units; plain bytes below 1 KiB)."""
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_seconds(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class ByteBar(Stage):
    """One line: ``label  done / total  pct  rate  ETA``.

    On a terminal the line is rewritten in place at most every ``min_interval_s``; elsewhere a
    line is printed every 10% (a log file stays readable). ``clock`` is injectable for tests.
    """

    def __init__(
        self, label: str, total: int, stream: TextIO, *, tty: bool, clock: Callable[[], float] = time.monotonic,
        min_interval_s: float = 0.1, unit: str = "bytes",
    ):
        self.label = label
        self.unit = unit  # "bytes", or a count's noun ("tensors")
        self.settle_s = 0.5  # no ETA before this much time has passed
        self.total = max(0, int(total))
        self.stream = stream
        self.tty = tty
        self.clock = clock
        self.min_interval_s = min_interval_s
        self.done = 0
        self.t0 = clock()
        self._lock = threading.Lock()
        self._last_draw = float("-inf")
        self._last_decile = -1
        self._closed = False

    def line(self) -> str:
        """The text shown now (also the tests' view of the bar)."""
        elapsed = self.clock() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        show = human_bytes if self.unit == "bytes" else (lambda n: f"{n:.0f} {self.unit}")
        parts = [self.label, f"{show(self.done)} / {show(self.total)}"]
        if self.total:
            parts.append(f"{100 * self.done // self.total:3d}%")  # floored: 100% only when done
        parts.append(f"{show(rate)}/s" if rate else "-")
        if self.done >= self.total:
            parts.append(f"in {human_seconds(elapsed)}")
        elif rate > 0 and elapsed >= self.settle_s:  # a rate from the first small file would promise nonsense
            parts.append(f"ETA {human_seconds((self.total - self.done) / rate)}")
        return "  ".join(parts)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if self._closed:
                return
            self.done = min(self.total, self.done + int(nbytes)) if self.total else self.done + int(nbytes)
            if self.total and self.done >= self.total:
                self._closed = True  # the last chunk ends the line: no close() needed
                self._draw(final=True)
            else:
                self._draw(final=False)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.done or self.tty:
                self._draw(final=True)

    def _draw(self, *, final: bool) -> None:
        now = self.clock()
        if self.tty:
            if not final and now - self._last_draw < self.min_interval_s:
                return
            self._last_draw = now
            self.stream.write("\r\x1b[K" + self.line() + ("\n" if final else ""))
        else:
            decile = int(10 * self.done / self.total) if self.total else 10
            if not final and decile <= max(self._last_decile, 0):  # a line per 10% reached
                return
            if final and self._last_decile == 10:
                return  # the 100% line is already out
            self._last_decile = decile
            self.stream.write(self.line() + "\n")
        self.stream.flush()


class BarReporter:
    """Makes a ``ByteBar`` per stage on ``stream``; prints notices as lines of their own."""

    def __init__(
        self, stream: TextIO | None = None, *, tty: bool | None = None, bars: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.bars = bars  # False: notices only
        self.clock = clock
        self._open: list[ByteBar] = []

    def stage(self, label: str, total_bytes: int) -> Stage:
        if not self.bars:
            return SILENT
        self._open = [bar for bar in self._open if not bar._closed]
        bar = ByteBar(label, total_bytes, self.stream, tty=self.tty, clock=self.clock)
        self._open.append(bar)
        return bar

    def close(self) -> None:
        """End every bar still open (a failed step's): its line stays where it stopped, and what
        is printed next (the error) starts on a line of its own."""
        for bar in self._open:
            bar.close()
        self._open = []

    def notice(self, message: str) -> None:
        self.stream.write(("\r\x1b[K" if self.tty else "") + message + "\n")
        self.stream.flush()


_reporter: BarReporter | None = None


@contextlib.contextmanager
def reporting(reporter: BarReporter | None) -> Iterator[None]:
    """Report the core's stages and notices to ``reporter`` for a block (None: stay silent)."""
    global _reporter
    before, _reporter = _reporter, reporter
    try:
        yield
    finally:
        _reporter = before
        if reporter is not None:
            reporter.close()


def stage(label: str, total_bytes: int) -> Stage:
    """A stage of ``total_bytes``; a no-op unless a reporter is installed. Use as a context manager."""
    reporter = _reporter
    return SILENT if reporter is None else reporter.stage(label, total_bytes)


def notice(message: str) -> None:
    """Something the person waiting should know now (to the reporter; else logged at INFO)."""
    reporter = _reporter
    if reporter is None:
        log.info("%s", message)
    else:
        reporter.notice(message)


def reporter_for(*, json: bool, verbose: bool, stream: TextIO | None = None) -> BarReporter | None:
    """The command line's choice: silent under ``--json``; otherwise notices on stderr, and bars
    when stderr is a terminal or under ``-v`` (then one line every 10%, for logs)."""
    if json:
        return None
    stream = stream if stream is not None else sys.stderr
    tty = bool(stream.isatty())
    return BarReporter(stream, tty=tty, bars=tty or verbose)


def counted_tensors(chunks: "Iterable[bytes | memoryview]", bar: Stage) -> "Iterator[bytes | memoryview]":
    """A safetensors file's chunks (``iter_file_chunks``: the header, then one per tensor) passed
    through; each tensor's bytes are told to ``bar`` once taken (written). The header is not
    counted, so a stage's total is the tensors' bytes, known before the file is built."""
    for i, chunk in enumerate(chunks):
        yield chunk
        if i:
            bar.advance(memoryview(chunk).nbytes)
