"""Where a rank's pull runs: a helper process with the engine's whole CPU set, not the scheduler.

Why (measured; benchmarks/README.md, "the pull inside the engine"): sglang's scheduler loop
busy-polls in Python at about 100% of a core, so it holds the GIL nearly all the time. The
core's apply threads give the GIL up around every C call (decompress, XOR, hash of each 2 MiB
chunk) and must take it back after each; every take-back waits out the busy thread's switch
interval (5 ms). A pull that applies in 0.7 s in a plain process took 3.8-17 s inside the
scheduler. On CPUs where sglang binds each rank to its OMP cores, threads the scheduler starts
also inherit that binding.

The helper (one per scheduler rank, long-lived, serves one pull at a time):
- is a fresh interpreter, ``python -m sglang_patch.pull.process FD``, started with
  ``subprocess`` (fork+exec): never a bare fork of the scheduler (whose threads, locks and device
  state a fork would copy), nor ``multiprocessing``'s spawn (which re-imports sglang's main module);
- binds itself to the CPUs the engine process was started with (captured when this module is
  first imported in the scheduler process, before sglang binds the scheduler to its cores);
- speaks length-prefixed msgpack frames over a socketpair: ``HelperConfig`` -> ``HelperReady``,
  then per pull ``PullJob`` -> ``RankPullReport`` (the same ``RankPuller`` runs inside), and,
  after a pull, live apply's ``StageJob`` -> ``StageReply`` plus the staged arrays as a memfd
  passed with ``SCM_RIGHTS`` (``live.mapping.stage``: the heavy half of staging, off the scheduler's GIL);
- keeps running after it replies, so the core's deferred flush (fsync, marker, lock release)
  finishes in it, and exits when its scheduler goes away (EOF on the socket, or a new parent pid).

A helper that exits or is killed before it replies is a typed failure (``PullWorkerDiedError``),
and the next pull starts a new helper; the core's marker protocol keeps the local checkpoint
honest meanwhile (no marker until every tensor is verified and flushed, so the next pull
reseeds). ``cancel(error)`` kills a running pull's helper and makes the waiting call return
``error`` as its failure (for deadlines). If no helper can be started, the pull runs in a thread
of the scheduler process (slow but sound) and the reply says why. ``SGLANG_PULL_WEIGHTS_IN_PROCESS=1``
chooses that path on purpose (the benchmark's "before").
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Union

import msgspec

from weightsync.errors import PullWorkerDiedError

from ..live.mapping.stage import (KEPT_MAPS, Patch, SpareFile, StageJob, StagePositions, StageReply, read_shared, stage_job,
                          stage_job_shared)
from . import results
from .options import PullWeightsOptions
from .rank import RankPuller

log = logging.getLogger(__name__)

IN_PROCESS_ENV = "SGLANG_PULL_WEIGHTS_IN_PROCESS"
START_TIMEOUT_S = 180.0  # a fresh interpreter importing numpy/zstandard on a loaded 2-core box
_POLL_S = 0.2
_LEN = struct.Struct("!I")


def _affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


# The scheduler process imports this module (through scheduler_side) when sglang's scheduler
# module loads, before the model runner binds the process to its OMP cores.
_ENGINE_CPUS = _affinity()


def engine_cpus() -> list[int]:
    """The CPUs the engine process had before sglang bound the scheduler to its cores."""
    return sorted(_ENGINE_CPUS)


class HelperConfig(msgspec.Struct, frozen=True):
    """What a helper needs to act as one rank (sent once, right after it starts)."""

    options: PullWeightsOptions
    seed_dir: Optional[str]
    host: str
    rank: str
    cpus: list[int]
    parent_pid: int


class HelperReady(msgspec.Struct, frozen=True):
    pid: int
    cpus: list[int]


class PullJob(msgspec.Struct, frozen=True, tag="pull"):
    """One pull request's fields, unvalidated (the helper's RankPuller checks them)."""

    local_checkpoint_dir: Any
    source_dir: Any
    target_version: Any


_encoder = msgspec.msgpack.Encoder()


def send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    data = _encoder.encode(message)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, kind: type) -> Any:
    """The next frame decoded as ``kind``, or None at EOF (the peer is gone)."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    if body is None:
        return None
    return msgspec.msgpack.decode(body, type=kind)


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class HelperStartError(RuntimeError):
    """No helper process could be started (the pull then runs in the scheduler process)."""


class _HelperGone(Exception):
    def __init__(self, pid: int, returncode: Optional[int]):
        self.pid = pid
        self.returncode = returncode


class _Helper:
    """One running helper process and our end of its socket."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.ready: Optional[HelperReady] = None

    @classmethod
    def spawn(cls, config: HelperConfig) -> "_Helper":
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,  # stdout/stderr: the scheduler's, i.e. the server log
                env=_helper_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        helper = cls(proc, ours)
        try:
            send_frame(ours, config)
        except OSError:
            pass  # it died at once; waiting for its HelperReady tells how
        return helper

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def wait_frame(self, kind: type, timeout_s: Optional[float], stop: Callable[[], bool]) -> Any:
        """The helper's next frame; raises _HelperGone if it exits (or ``stop()``), TimeoutError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if stop():
                self.kill()
            readable, _, _ = select.select([self.sock], [], [], _POLL_S)
            if readable:
                try:
                    frame = recv_frame(self.sock, kind)
                except (OSError, msgspec.DecodeError):
                    frame = None
                if frame is not None:
                    return frame
                self.kill()  # EOF or garbage: whatever is left of it must not write on
                raise _HelperGone(self.proc.pid, self.reap())
            if self.proc.poll() is not None:
                raise _HelperGone(self.proc.pid, self.proc.returncode)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the pull helper (pid {self.proc.pid}) did not answer within {timeout_s:.0f}s")

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass

    def reap(self) -> Optional[int]:
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Close our end: an idle helper finishes any deferred flush and exits on the EOF."""
        try:
            self.sock.close()
        except OSError:
            pass


def _helper_env() -> dict[str, str]:
    # The server's whole environment: the host's source and fleet settings (WEIGHTSYNC_HTTP_ORIGIN,
    # WEIGHTSYNC_SWARM_PEERS / _LISTEN / _TRACKER, bucket endpoint and credentials) reach the core's
    # pull() here, never through a request.
    env = dict(os.environ)
    # The helper must import this very package, wherever the scheduler found it: a source tree
    # goes first on its path; an installed package is found anyway (and site-packages must not
    # go ahead of the standard library).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.basename(package_parent) not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    return env


Stager = Callable[[StageJob], "tuple[StageReply, list[Patch]]"]
OnVerified = Callable[[str, str, int, Stager], None]


class HelperRankPuller:
    """``puller(request) -> RankPullReport`` that runs the rank's pull in its helper process.

    Called from the coordinator's pull thread, one pull at a time; ``cancel`` may be called from
    any thread (the scheduler's, on a deadline). ``on_verified(local_dir, source_dir, version,
    stager)`` runs here, in the scheduler process, after every successful pull (wherever the pull
    ran), with the resolved dirs: work that needs the engine's own state (live apply's staging),
    which may hand its engine-free part to the helper through ``stager`` (``self.stage``). It
    cannot fail the pull; its exceptions are logged. ``in_process=True`` never starts a helper.
    """

    def __init__(
        self, puller: RankPuller, *, cpus: Optional[list[int]] = None, start_timeout_s: float = START_TIMEOUT_S,
        on_verified: Optional[OnVerified] = None, in_process: bool = False,
    ):
        self.puller = puller
        self.cpus = list(cpus) if cpus is not None else engine_cpus()
        self.start_timeout_s = start_timeout_s
        self.on_verified = on_verified
        self.in_process = in_process
        self._lock = threading.Lock()  # guards _helper
        self._call_lock = threading.Lock()
        self._helper: Optional[_Helper] = None
        self._cancel_error: Optional[BaseException] = None
        self._spare = SpareFile()  # the last staging's shared file, once nothing here maps it

    def config(self) -> HelperConfig:
        p = self.puller
        return HelperConfig(options=p.options, seed_dir=p.seed_dir, host=p.host, rank=p.rank, cpus=self.cpus,
                            parent_pid=os.getpid())

    def start(self) -> None:
        """Start the helper now (returns at once; it imports the core while the engine loads)."""
        if self.in_process:
            return
        try:
            self._live_helper()
        except Exception:
            log.exception("pull_weights %s: could not start the pull helper; will retry on the first pull", self.puller.rank)

    def __call__(self, request: Any) -> results.RankPullReport:
        # One pull at a time per helper. A call while another is still in flight means the
        # caller gave up on that one (the coordinator abandons a pull at its deadline and then
        # accepts the next): the old pull is killed rather than left to hold up this one, and
        # its frames never mix with ours.
        if not self._call_lock.acquire(blocking=False):
            self.cancel(PullWorkerDiedError(
                pid=getattr(self.helper_info(), "pid", -1), returncode=None, rank=self.puller.rank,
                target_version=None, detail="superseded: a newer pull started on this rank after the caller gave up on it",
            ))
            self._call_lock.acquire()
        try:
            return self._pull(request)
        finally:
            self._call_lock.release()

    def _pull(self, request: Any) -> results.RankPullReport:
        report = self.puller(request) if self.in_process else self._pull_in_helper(request)
        if report.success and self.on_verified is not None:
            self._run_on_verified(request, report)
        return report

    def _run_on_verified(self, request: Any, report: results.RankPullReport) -> None:
        try:
            checked = self.puller.check_paths(request)
            self.on_verified(checked.local_checkpoint_dir, checked.source_dir, int(report.applied_version), self.stage)
        except Exception:
            log.exception("pull_weights %s: the after-pull hook failed (the pull itself succeeded)", self.puller.rank)

    def stage(self, job: StageJob, positions_ready: Optional[Callable[[list[Patch]], None]] = None,
              ) -> tuple[StageReply, list[Patch]]:
        """Run live apply's staging ``job`` in the helper (in this process without one).

        ``positions_ready(patches)``: called (on this thread) as soon as every patch's positions
        are readable, their values not yet: the same patches this returns once the values are
        in too (a refusal or failure returns none, and their values are never filled).

        Only from ``on_verified``, i.e. inside a pull call, so the helper is idle and ours.
        A helper that dies here is discarded (the next pull starts another) and the reply
        refuses, so the update reloads instead of patching live.
        """
        helper = self._helper
        if self.in_process or helper is None or helper.ready is None or not helper.is_alive():
            return stage_job(job, positions_ready)
        try:
            self._send_stage_job(helper, job)
            first = helper.wait_frame(Union[StagePositions, StageReply], None, stop=self._is_cancelled)
            if isinstance(first, StageReply):  # refused, failed, or nothing to patch
                return msgspec.structs.replace(first, patches=[]), []
            _, fds, _, _ = socket.recv_fds(helper.sock, 1, 1)
            if not fds:
                raise _HelperGone(helper.proc.pid, helper.proc.poll())
            complete = [False]  # only a file whose helper finished writing it may be reused
            fd = fds[0]
            try:
                patches = read_shared(fd, first.patches, first.shared_nbytes,
                                      unmapped=self._spare.keep_when_unmapped(fd, only_if=lambda: complete[0]))
            except BaseException:
                os.close(fd)
                raise
            if positions_ready is not None:
                positions_ready(patches)
            reply = helper.wait_frame(StageReply, None, stop=self._is_cancelled)
            if reply.refused is not None or reply.error is not None:
                return reply, []
            complete[0] = True
            return reply, patches
        except (_HelperGone, OSError) as gone:
            self._discard(helper)
            log.error("pull_weights %s: the pull helper failed while staging: %s", self.puller.rank, gone)
            return StageReply(refused=f"the pull helper (pid {helper.proc.pid}) failed while staging the live update"), []

    def _send_stage_job(self, helper: "_Helper", job: StageJob) -> None:
        """Send ``job`` with the spare shared file, if any, for the helper to write into; the
        file is the helper's from here (our copy is closed), so one that fails never returns."""
        spare = self._spare.take()
        if spare is None:
            send_frame(helper.sock, job)
            return
        try:
            send_frame(helper.sock, msgspec.structs.replace(job, memfd_follows=True))
            socket.send_fds(helper.sock, [b"F"], [spare])
        finally:
            os.close(spare)

    def _pull_in_helper(self, request: Any) -> results.RankPullReport:
        start = time.monotonic()
        self._cancel_error = None
        try:
            helper = self._ready_helper()
        except HelperStartError as exc:
            if self._cancel_error is not None:
                return self.puller.failure(request, self._cancel_error, time.monotonic() - start)
            log.warning("pull_weights %s: %s; pulling in the scheduler process instead (slower)", self.puller.rank, exc)
            report = self.puller(request)
            report.reason = f"{report.reason} (pulled in the scheduler process: {exc})".strip()
            return report
        job = PullJob(request.local_checkpoint_dir, request.source_dir, request.target_version)
        try:
            send_frame(helper.sock, job)
            return helper.wait_frame(results.RankPullReport, None, stop=self._is_cancelled)
        except (_HelperGone, OSError) as gone:
            self._discard(helper)
            error = self._cancel_error or self._died(helper, gone, request)
            log.error("pull_weights %s: %s", self.puller.rank, error)
            return self.puller.failure(request, error, time.monotonic() - start)

    def helper_info(self) -> Optional[HelperReady]:
        """The running helper's pid and CPUs, once it said it is ready (else None)."""
        helper = self._helper
        return helper.ready if helper is not None else None

    def cancel(self, error: BaseException) -> bool:
        """Kill the running pull's helper; the waiting call returns a failed report of ``error``.

        Returns True if a helper was running. The local checkpoint stays honest: a pull killed
        before its flush leaves no marker for the target, and the next pull reseeds.
        """
        self._cancel_error = error
        helper = self._helper
        if helper is None or not helper.is_alive():
            return False
        helper.kill()
        return True

    def close(self) -> None:
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.close()
        self._spare.close()

    # --- internals ------------------------------------------------------------------------------

    def _is_cancelled(self) -> bool:
        return self._cancel_error is not None

    def _live_helper(self) -> _Helper:
        with self._lock:
            if self._helper is None or not self._helper.is_alive():
                if self._helper is not None:
                    self._helper.reap()
                    self._helper.close()
                self._helper = _Helper.spawn(self.config())
                log.info("pull_weights %s: started pull helper pid %d", self.puller.rank, self._helper.proc.pid)
            return self._helper

    def _ready_helper(self) -> _Helper:
        try:
            helper = self._live_helper()
        except Exception as exc:
            raise HelperStartError(f"no pull helper: {type(exc).__name__}: {exc}") from exc
        if helper.ready is None:
            try:
                helper.ready = helper.wait_frame(HelperReady, self.start_timeout_s, stop=self._is_cancelled)
            except (_HelperGone, TimeoutError, OSError) as exc:
                helper.kill()
                self._discard(helper)
                detail = f"exited with {exc.returncode}" if isinstance(exc, _HelperGone) else str(exc)
                raise HelperStartError(f"the pull helper (pid {helper.proc.pid}) did not start: {detail}") from exc
            log.info("pull_weights %s: pull helper pid %d ready on CPUs %s", self.puller.rank, helper.ready.pid,
                     _cpu_list(helper.ready.cpus))
        return helper

    def _discard(self, helper: _Helper) -> None:
        helper.reap()
        helper.close()
        with self._lock:
            if self._helper is helper:
                self._helper = None

    def _died(self, helper: _Helper, gone: BaseException, request: Any) -> PullWorkerDiedError:
        code = gone.returncode if isinstance(gone, _HelperGone) else helper.proc.poll()
        return PullWorkerDiedError(
            pid=helper.proc.pid, returncode=code, rank=self.puller.rank,
            target_version=getattr(request, "target_version", None),
        )


def make_rank_puller(puller: RankPuller, *, on_verified: Optional[OnVerified] = None) -> HelperRankPuller:
    """The rank's puller, its helper started now (in the scheduler process if the operator asked)."""
    in_process = os.environ.get(IN_PROCESS_ENV, "").strip() not in ("", "0")
    if in_process:
        log.info("pull_weights %s: %s is set: pulls run in the scheduler process", puller.rank, IN_PROCESS_ENV)
    helper = HelperRankPuller(puller, on_verified=on_verified, in_process=in_process)
    helper.start()
    return helper


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) or "(unknown)"


# --- the helper process itself -------------------------------------------------------------------


def helper_main(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler shuts us down (EOF), not Ctrl-C
    config = recv_frame(sock, HelperConfig)
    if config is None:
        return 0
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"[%(asctime)s pull-helper {config.rank} pid {os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent(config.parent_pid)
    cpus = _bind_cpus(config.cpus)
    puller = RankPuller(options=config.options, seed_dir=config.seed_dir, host=config.host, rank=config.rank)
    send_frame(sock, HelperReady(pid=os.getpid(), cpus=cpus))
    pulled: set[str] = set()
    while True:
        job = recv_frame(sock, Union[PullJob, StageJob])
        if job is None:
            break
        if isinstance(job, StageJob):
            into_fd = None
            if job.memfd_follows:
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                if not fds:
                    break  # the scheduler went away mid-message
                into_fd = fds[0]
            _serve_stage_job(sock, job, into_fd)
            continue
        report = puller(job)
        if isinstance(job.local_checkpoint_dir, str):
            pulled.add(job.local_checkpoint_dir)
        KEPT_MAPS.drop_stale()  # a reseed replaced or deleted files: their blocks go now, not at the next staging
        send_frame(sock, report)
    from weightsync.puller.pull import wait_until_durable

    for local in pulled:  # let a deferred flush write its marker before we go
        wait_until_durable(local)
    return 0


def _serve_stage_job(sock: socket.socket, job: StageJob, into_fd: Optional[int]) -> None:
    """``StagePositions`` + the file once the positions are written (when there are patches),
    then the ``StageReply`` once the values are too (or why not)."""
    sent = []

    def positions_written(positions: StagePositions, fd: int) -> None:
        send_frame(sock, positions)
        socket.send_fds(sock, [b"F"], [fd])
        sent.append(True)

    fd = None
    try:
        reply, fd = stage_job_shared(job, into_fd, kept_maps=KEPT_MAPS, positions_written=positions_written)
    except Exception as exc:  # a bug or a malformed payload: the update reloads, the helper lives on
        log.exception("live apply staging of v%d failed", job.to_version)
        reply = StageReply(error=f"{type(exc).__name__}: {exc}")
    try:
        send_frame(sock, reply if sent and fd is not None else msgspec.structs.replace(reply, patches=[]))
    finally:
        if fd is not None:
            os.close(fd)
    if fd is not None:
        log.info("live apply: staged v%d -> v%d: %d elements in %.3fs (%d B shared, %s file)", job.from_version,
                 job.to_version, reply.elements, reply.stage_s, reply.shared_nbytes,
                 "a spare" if into_fd is not None else "a new")


def _bind_cpus(cpus: list[int]) -> list[int]:
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError) as exc:
        log.warning("could not bind to CPUs %s (%s); keeping %s", _cpu_list(cpus), exc, _cpu_list(sorted(_affinity())))
    return sorted(_affinity())


def _watch_parent(parent_pid: int) -> None:
    """Exit when the scheduler is gone even while a pull runs (its socket EOF is read only between pulls)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        log.warning("the scheduler (pid %d) is gone; exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="pull-helper-parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(helper_main(int(sys.argv[1])))
