"""Talking to rollout engines: an HTTP client for one sglang server, and groups that call many.

Role: every call the trainer makes to an engine during a sync (``/pull_weights``,
``/pause_generation``, ``/update_weights_from_pulled`` or ``/update_weights_from_disk``,
``/continue_generation``) goes through ``SGLangEngineClient``, which puts a timeout on each call
and turns every failure into an ``EngineCallError`` that names the engine, the call and the reason.

Retry policy of ``pull_weights`` (why):
- "source not ready" (HTTP 404, ``error_type: source_not_ready``) means the shared filesystem has
  not shown the version to that host yet (NFS attribute caching, object-store lag); waiting fixes
  it, so it is retried with exponential backoff up to ``not_ready_retry_s``.
- "the same pull is still running" (HTTP 409, ``error_type: PullInProgress`` for this very
  target version, e.g. after this client's own timeout) finishes by itself: it is waited for,
  with backoff, up to ``pull_timeout_s``. A 409 for another target is a real conflict: raised.
- A corrupt artifact (422) or any other error will not fix itself: it is raised at once.

Engine groups call one method on every engine (or a subset) concurrently: ``ThreadEngineGroup``
wraps clients in threads (tests, tools); ``RayEngineGroup`` wraps Ray actor handles (miles/slime's
rollout engines), whose methods are expected to have the client's names and signatures.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import requests

log = logging.getLogger(__name__)

SOURCE_NOT_READY = "source_not_ready"
PULL_IN_PROGRESS = "PullInProgress"


class EngineCallError(RuntimeError):
    """An engine call failed; carries the engine, the call, the engine's error type and reply."""

    def __init__(self, engine: str, call: str, reason: str, *, status: int | None = None,
                 error_type: str | None = None, reply: dict | None = None):
        self.engine = engine
        self.call = call
        self.status = status
        self.error_type = error_type
        self.reason = reason
        self.reply = reply or {}
        where = f"HTTP {status}" + (f" {error_type}" if error_type else "") if status else "no reply"
        super().__init__(f"engine {engine}: {call} failed ({where}): {reason}")

    @property
    def is_source_not_ready(self) -> bool:
        return self.status == 404 and self.error_type == SOURCE_NOT_READY

    @property
    def is_missing_route(self) -> bool:
        """HTTP 404 without our error shape: the server has no such route (an older engine)."""
        return self.status == 404 and self.error_type is None

    def is_same_pull_in_progress(self, target_version: int) -> bool:
        """409: a pull to this very target is still running on the engine (its result will come)."""
        return (self.status == 409 and self.error_type == PULL_IN_PROGRESS
                and self.reply.get("target_version") == target_version)

    def __reduce__(self):  # survive pickling through Ray with the attributes intact
        return (_rebuild_error, (self.engine, self.call, self.reason, self.status, self.error_type, self.reply))


def _rebuild_error(engine, call, reason, status, error_type, reply=None):
    return EngineCallError(engine, call, reason, status=status, error_type=error_type, reply=reply)


@dataclass(frozen=True)
class EngineTimeouts:
    """The HTTP timeouts of every engine call (``--update-weight-{engine,pull}-timeout-s``,
    ``--update-weight-not-ready-retry-s``): one object, so the clients, the Ray actors wrapping them
    and the trainer's bound on the engine phase all hold the same numbers."""

    engine_timeout_s: float = 120.0
    pull_timeout_s: float = 1800.0
    not_ready_retry_s: float = 60.0

    def client_kwargs(self) -> dict:
        return dict(timeout_s=self.engine_timeout_s, pull_timeout_s=self.pull_timeout_s,
                    not_ready_retry_s=self.not_ready_retry_s)


class SGLangEngineClient:
    """HTTP client of one sglang server (with the ``/pull_weights`` plugin).

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        name: how errors and logs name this engine (default: the URL).
        api_key: sent as a bearer token when the server has one.
        timeout_s: timeout of control calls (pause, apply, reload, continue).
        pull_timeout_s: timeout of one ``/pull_weights`` call (it copies a checkpoint), and how
            long a pull to the same target that is still running is waited for.
        not_ready_retry_s: how long to keep retrying "source not ready".
        backoff_initial_s, backoff_max_s: the retry backoff.
    """

    def __init__(self, base_url: str, *, name: str | None = None, api_key: str | None = None,
                 timeout_s: float = 120.0, pull_timeout_s: float = 1800.0, not_ready_retry_s: float = 60.0,
                 backoff_initial_s: float = 0.2, backoff_max_s: float = 5.0):
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.not_ready_retry_s = not_ready_retry_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._session = requests.Session()

    def set_timeouts(self, timeouts: EngineTimeouts) -> None:
        """Take the trainer's timeouts (the flags win over what the client was built with: the
        trainer's bound on the engine phase is derived from them)."""
        self.timeout_s = timeouts.engine_timeout_s
        self.pull_timeout_s = timeouts.pull_timeout_s
        self.not_ready_retry_s = timeouts.not_ready_retry_s

    def timeouts(self) -> EngineTimeouts:
        return EngineTimeouts(self.timeout_s, self.pull_timeout_s, self.not_ready_retry_s)

    # --- plumbing -------------------------------------------------------------------------

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _post(self, call: str, path: str, body: Any, timeout_s: float, params: dict | None = None) -> Any:
        try:
            resp = self._session.post(self.base_url + path, json=body, params=params, headers=self._headers(),
                                      timeout=timeout_s)
        except requests.Timeout:
            raise EngineCallError(self.name, call, f"no reply within {timeout_s:g}s") from None
        except requests.RequestException as e:
            raise EngineCallError(self.name, call, f"cannot reach {self.base_url}{path}: {e}") from None
        try:
            payload = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code >= 400 or (isinstance(payload, dict) and payload.get("success") is False):
            error_type = payload.get("error_type") if isinstance(payload, dict) else None
            if isinstance(payload, dict):
                reason = payload.get("message") or payload.get("detail") or str(payload)
            else:
                reason = (payload or "").strip()[:500] or resp.reason
            if resp.status_code == 404 and error_type is None and path == "/pull_weights":
                reason = (f"{reason}; the server has no /pull_weights endpoint: is the sglang_patch plugin "
                          f"installed on it (entry point group sglang.srt.plugins)?")
            raise EngineCallError(self.name, call, str(reason), status=resp.status_code, error_type=error_type,
                                  reply=payload if isinstance(payload, dict) else None)
        return payload

    # --- the calls of a sync --------------------------------------------------------------

    def pull_weights(self, local_checkpoint_dir: str, source_dir: str, target_version: int) -> dict:
        """Bring the engine host's local checkpoint to ``target_version`` (see the retry policy)."""
        body = {"local_checkpoint_dir": local_checkpoint_dir, "source_dir": source_dir,
                "target_version": int(target_version)}
        start = time.monotonic()
        delay = self.backoff_initial_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._post("pull_weights", "/pull_weights", body, self.pull_timeout_s)
            except EngineCallError as e:
                if e.is_source_not_ready:
                    limit_s, state = self.not_ready_retry_s, "not ready"
                    hint = "is the shared filesystem mounted on this host?"
                elif e.is_same_pull_in_progress(target_version):
                    # Our own earlier request (e.g. after a client timeout): its result will come.
                    limit_s, state = self.pull_timeout_s, "running (an earlier request's pull to the same version)"
                    hint = "the engine's pull deadline should have ended it; see the engine's log"
                else:
                    raise
                if time.monotonic() + delay > start + limit_s:
                    raise EngineCallError(
                        self.name, "pull_weights",
                        f"{e.reason} (still {state} after {attempt} attempts over {limit_s:g}s; {hint})",
                        status=e.status, error_type=e.error_type, reply=e.reply) from None
                log.info("engine %s: v%d still %s (attempt %d), retrying in %.1fs",
                         self.name, target_version, state, attempt, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._post("pause_generation", "/pause_generation", {"mode": mode}, self.timeout_s)

    def flush_cache(self) -> Any:
        return self._post("flush_cache", "/flush_cache", None, self.timeout_s)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 flush_cache: bool = True) -> dict:
        body = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._post("update_weights_from_disk", "/update_weights_from_disk", body, self.timeout_s)

    def update_weights_from_pulled(self, local_checkpoint_dir: str, target_version: int,
                                   flush_cache: bool = True) -> dict:
        """Apply the pulled version to the live weights (or the engine reloads it itself).

        The reply says ``mode: "live"`` or ``"reload"`` (with the reason), ``elements_scattered``
        and the engine's own ``pause_s``. A server without the route answers 404 (no error type).
        """
        body = {"local_checkpoint_dir": local_checkpoint_dir, "target_version": int(target_version),
                "flush_cache": flush_cache}
        return self._post("update_weights_from_pulled", "/update_weights_from_pulled", body, self.timeout_s)

    def continue_generation(self) -> dict:
        return self._post("continue_generation", "/continue_generation", {}, self.timeout_s)

    # --- helpers for checks and the demo ----------------------------------------------------

    def generate_ids(self, prompt: str, max_new_tokens: int = 8) -> list[int]:
        """Greedy output token ids (temperature 0, EOS does not stop)."""
        out = self._post("generate", "/generate", {
            "text": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        }, self.timeout_s)
        return list(out["output_ids"])

    def weight_version(self) -> str | None:
        """The weight version the engine serves (``GET /model_info``; None if it cannot say)."""
        try:
            resp = self._session.get(self.base_url + "/model_info", headers=self._headers(), timeout=self.timeout_s)
            return resp.json().get("weight_version") if resp.ok else None
        except (requests.RequestException, ValueError, AttributeError):
            return None


# --- groups --------------------------------------------------------------------------------


@dataclass
class Pending:
    """Calls started on some engines: the method, the engines' indices, one future or ref each."""

    method: str
    indices: list[int]
    handles: list[Any]


class EngineGroup(Protocol):
    """Calls one method on every engine (or a subset) concurrently."""

    names: list[str]

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """Start the call on every engine; returns a handle for ``wait`` (does not block)."""

    def submit_to(self, indices: Sequence[int], method: str, *args, **kwargs) -> Pending:
        """Start the call on the engines at ``indices`` only."""

    def settle(self, pending: Pending) -> list[tuple[Any, BaseException | None]]:
        """(result, error) per called engine, in the order of ``pending.indices``; never raises."""

    def wait(self, pending: Pending) -> list[Any]:
        """Results in engine order; raises ``EngineSyncError`` listing every engine that failed."""

    def set_timeouts(self, timeouts: EngineTimeouts) -> list[str]:
        """Every engine's client takes ``timeouts``; returns the engines that cannot (an engine
        object or Ray actor without ``set_timeouts``: its calls keep timeouts of their own)."""

    def close(self) -> None:
        """Release what the group holds (threads); the engines themselves are not touched."""


class EngineSyncError(RuntimeError):
    """One or more engines failed a call; ``errors`` maps engine name -> exception.

    Raised by a sync (``EngineSync.update``), it also says where the fleet stands: ``served``
    maps every engine to the version it serves now (None: it could not say), ``version`` is the
    version the sync was bringing them to, and ``metrics`` the sync's ``SyncMetrics``.
    """

    def __init__(self, call: str, errors: dict[str, BaseException], *, served: dict | None = None,
                 version: int | None = None):
        self.call = call
        self.errors = errors
        self.served = dict(served) if served is not None else None
        self.version = version
        self.metrics = None
        super().__init__(call, errors)

    def __str__(self) -> str:
        detail = "; ".join(str(e) for e in self.errors.values())
        text = f"{self.call} failed on {len(self.errors)} engine(s): {detail}"
        if self.served is not None:
            where = ", ".join(f"{name} v{v}" if v is not None else f"{name} unknown" for name, v in self.served.items())
            target = f" (the sync was bringing them to v{self.version})" if self.version is not None else ""
            text += f". Engines now serve: {where}{target}; the next sync brings the lagging ones up first"
        return text

    def __reduce__(self):  # the attributes survive pickling (a Ray actor raising it)
        return (_rebuild_sync_error, (self.call, self.errors, self.served, self.version))


def _rebuild_sync_error(call, errors, served, version):
    return EngineSyncError(call, errors, served=served, version=version)


class _GroupBase:
    names: list[str]

    def submit(self, method: str, *args, **kwargs) -> Pending:
        return self.submit_to(range(len(self.names)), method, *args, **kwargs)

    def wait(self, pending: Pending) -> list[Any]:
        outcomes = self.settle(pending)
        errors = {self.names[i]: err for i, (_, err) in zip(pending.indices, outcomes) if err is not None}
        if errors:
            raise EngineSyncError(pending.method, errors)
        return [result for result, _ in outcomes]


class ThreadEngineGroup(_GroupBase):
    """Engines as in-process clients, each call in its own thread (``close`` ends the threads)."""

    def __init__(self, clients: Sequence[SGLangEngineClient]):
        self.clients = list(clients)
        self.names = [c.name for c in self.clients]
        self._pool = ThreadPoolExecutor(max(4, 2 * len(self.clients)), thread_name_prefix="engine-call")

    def set_timeouts(self, timeouts: EngineTimeouts) -> list[str]:
        unable = []
        for name, client in zip(self.names, self.clients):
            if hasattr(client, "set_timeouts"):
                client.set_timeouts(timeouts)
            else:
                unable.append(name)
        return unable

    def submit_to(self, indices, method: str, *args, **kwargs) -> Pending:
        indices = list(indices)
        return Pending(method, indices,
                       [self._pool.submit(getattr(self.clients[i], method), *args, **kwargs) for i in indices])

    def settle(self, pending: Pending) -> list[tuple[Any, BaseException | None]]:
        outcomes: list[tuple[Any, BaseException | None]] = []
        for fut in pending.handles:
            try:
                outcomes.append((fut.result(), None))
            except BaseException as e:  # noqa: BLE001 - every engine's failure is reported
                outcomes.append((None, e))
        return outcomes

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class RayEngineGroup(_GroupBase):
    """Engines as Ray actor handles (``handle.method.remote(...)``), as miles/slime hold them."""

    def __init__(self, handles: Sequence[Any], names: Sequence[str] | None = None):
        self.handles = list(handles)
        self.names = list(names) if names else [f"engine{i}" for i in range(len(self.handles))]

    def set_timeouts(self, timeouts: EngineTimeouts) -> list[str]:
        pending = self.submit("set_timeouts", timeouts)
        outcomes = self.settle(pending)
        failed = {self.names[i]: err for i, (_, err) in zip(pending.indices, outcomes) if err is not None}
        unable = [name for name, err in failed.items() if isinstance(err, AttributeError)]
        if len(unable) < len(failed):  # an actor that has the method and failed: a real failure
            raise EngineSyncError("set_timeouts", {n: e for n, e in failed.items() if n not in unable})
        return unable

    def submit_to(self, indices, method: str, *args, **kwargs) -> Pending:
        indices = list(indices)
        refs: list[Any] = []
        for i in indices:
            try:
                refs.append(getattr(self.handles[i], method).remote(*args, **kwargs))
            except AttributeError as e:  # an engine actor without this method (an older one)
                refs.append(e)
        return Pending(method, indices, refs)

    def settle(self, pending: Pending) -> list[tuple[Any, BaseException | None]]:
        import ray

        outcomes: list[tuple[Any, BaseException | None]] = []
        for ref in pending.handles:
            if isinstance(ref, BaseException):
                outcomes.append((None, ref))
                continue
            try:
                outcomes.append((ray.get(ref), None))
            except BaseException as e:  # noqa: BLE001
                cause = getattr(e, "cause", None)  # RayTaskError wraps the actor's exception
                outcomes.append((None, cause if isinstance(cause, BaseException) else e))
        return outcomes

    def close(self) -> None:
        pass  # the actors belong to the caller


def make_engine_actor_class():
    """A Ray actor class wrapping ``SGLangEngineClient`` (import-time free of Ray)."""
    import ray

    # Threaded actor: a long pull must not block generate calls or a concurrent pull on another host.
    @ray.remote(num_cpus=0, max_concurrency=8)
    class SGLangEngineActor:
        """A rollout engine as a Ray actor: the methods a miles/slime engine actor exposes."""

        def __init__(self, base_url: str, **client_kwargs):
            self.client = SGLangEngineClient(base_url, **client_kwargs)

        def set_timeouts(self, timeouts):
            self.client.set_timeouts(timeouts)

        def timeouts(self):
            return self.client.timeouts()

        def pull_weights(self, local_checkpoint_dir, source_dir, target_version):
            return self.client.pull_weights(local_checkpoint_dir, source_dir, target_version)

        def pause_generation(self, mode="retract"):
            return self.client.pause_generation(mode)

        def flush_cache(self):
            return self.client.flush_cache()

        def update_weights_from_disk(self, model_path, weight_version=None, flush_cache=True):
            return self.client.update_weights_from_disk(model_path, weight_version, flush_cache)

        def update_weights_from_pulled(self, local_checkpoint_dir, target_version, flush_cache=True):
            return self.client.update_weights_from_pulled(local_checkpoint_dir, target_version, flush_cache)

        def continue_generation(self):
            return self.client.continue_generation()

        def generate_ids(self, prompt, max_new_tokens=8):
            return self.client.generate_ids(prompt, max_new_tokens)

        def weight_version(self):
            return self.client.weight_version()

        def base_url(self):
            return self.client.base_url

    return SGLangEngineActor
