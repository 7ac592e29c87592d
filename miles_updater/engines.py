"""Talking to rollout engines: an HTTP client for one sglang server, and groups that call many.

Role: every call the trainer makes to an engine during a sync (``/pull_weights``,
``/pause_generation``, ``/flush_cache``, ``/update_weights_from_disk``,
``/continue_generation``) goes through ``SGLangEngineClient``, which puts a timeout on each call
and turns every failure into an ``EngineCallError`` that names the engine, the call and the reason.

Retry policy (why): "source not ready" (HTTP 404, ``error_type: source_not_ready``) means the
shared filesystem has not shown the version to that host yet (NFS attribute caching, object-store
lag); waiting fixes it, so it is retried with exponential backoff up to a deadline. A corrupt
artifact (422) or any other error will not fix itself: it is raised at once.

Engine groups call one method on every engine concurrently: ``ThreadEngineGroup`` wraps clients
in threads (tests, tools); ``RayEngineGroup`` wraps Ray actor handles (miles/slime's rollout
engines), whose methods are expected to have the client's names and signatures.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, Sequence

import requests

log = logging.getLogger(__name__)

SOURCE_NOT_READY = "source_not_ready"


class EngineCallError(RuntimeError):
    """An engine call failed; carries the engine, the call and the engine's error type."""

    def __init__(self, engine: str, call: str, reason: str, *, status: int | None = None,
                 error_type: str | None = None):
        self.engine = engine
        self.call = call
        self.status = status
        self.error_type = error_type
        self.reason = reason
        where = f"HTTP {status}" + (f" {error_type}" if error_type else "") if status else "no reply"
        super().__init__(f"engine {engine}: {call} failed ({where}): {reason}")

    @property
    def is_source_not_ready(self) -> bool:
        return self.status == 404 and self.error_type == SOURCE_NOT_READY

    def __reduce__(self):  # survive pickling through Ray with the attributes intact
        return (_rebuild_error, (self.engine, self.call, self.reason, self.status, self.error_type))


def _rebuild_error(engine, call, reason, status, error_type):
    return EngineCallError(engine, call, reason, status=status, error_type=error_type)


class SGLangEngineClient:
    """HTTP client of one sglang server (with the ``/pull_weights`` plugin).

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        name: how errors and logs name this engine (default: the URL).
        api_key: sent as a bearer token when the server has one.
        timeout_s: timeout of control calls (pause, flush, reload, continue).
        pull_timeout_s: timeout of one ``/pull_weights`` call (it copies a checkpoint).
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

    # --- plumbing -------------------------------------------------------------------------

    def _post(self, call: str, path: str, body: Any, timeout_s: float, params: dict | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            resp = self._session.post(self.base_url + path, json=body, params=params, headers=headers,
                                      timeout=timeout_s)
        except requests.Timeout:
            raise EngineCallError(self.name, call, f"no reply within {timeout_s:.0f}s") from None
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
            raise EngineCallError(self.name, call, str(reason), status=resp.status_code, error_type=error_type)
        return payload

    # --- the calls of a sync --------------------------------------------------------------

    def pull_weights(self, local_checkpoint_dir: str, source_dir: str, target_version: int) -> dict:
        """Bring the engine host's local checkpoint to ``target_version`` (retries "not ready")."""
        body = {"local_checkpoint_dir": local_checkpoint_dir, "source_dir": source_dir,
                "target_version": int(target_version)}
        deadline = time.monotonic() + self.not_ready_retry_s
        delay = self.backoff_initial_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._post("pull_weights", "/pull_weights", body, self.pull_timeout_s)
            except EngineCallError as e:
                if not e.is_source_not_ready or time.monotonic() + delay > deadline:
                    if e.is_source_not_ready:
                        raise EngineCallError(
                            self.name, "pull_weights",
                            f"{e.reason} (still not ready after {attempt} attempts over "
                            f"{self.not_ready_retry_s:.0f}s; is the shared filesystem mounted on this host?)",
                            status=e.status, error_type=e.error_type) from None
                    raise
                log.info("engine %s: v%d not visible yet (attempt %d), retrying in %.1fs",
                         self.name, target_version, attempt, delay)
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
        try:
            resp = self._session.get(self.base_url + "/get_weight_version", timeout=self.timeout_s)
            return resp.json().get("weight_version") if resp.ok else None
        except (requests.RequestException, ValueError):
            return None


# --- groups --------------------------------------------------------------------------------


class EngineGroup(Protocol):
    """Calls one method on every engine concurrently."""

    names: list[str]

    def submit(self, method: str, *args, **kwargs) -> Any:
        """Start the call on every engine; returns a handle for ``wait`` (does not block)."""

    def wait(self, pending: Any) -> list[Any]:
        """Results in engine order; raises ``EngineSyncError`` listing every engine that failed."""


class EngineSyncError(RuntimeError):
    """One or more engines failed a call; ``errors`` maps engine name -> exception."""

    def __init__(self, call: str, errors: dict[str, BaseException]):
        self.call = call
        self.errors = errors
        detail = "; ".join(str(e) for e in errors.values())
        super().__init__(f"{call} failed on {len(errors)} engine(s): {detail}")


class ThreadEngineGroup:
    """Engines as in-process clients, each call in its own thread."""

    def __init__(self, clients: Sequence[SGLangEngineClient]):
        self.clients = list(clients)
        self.names = [c.name for c in self.clients]
        self._pool = ThreadPoolExecutor(max(4, 2 * len(self.clients)), thread_name_prefix="engine-call")

    def submit(self, method: str, *args, **kwargs) -> tuple[str, list[Future]]:
        return method, [self._pool.submit(getattr(c, method), *args, **kwargs) for c in self.clients]

    def wait(self, pending) -> list[Any]:
        method, futures = pending
        results, errors = [], {}
        for name, fut in zip(self.names, futures):
            try:
                results.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - every engine's failure is reported
                errors[name] = e
                results.append(None)
        if errors:
            raise EngineSyncError(method, errors)
        return results


class RayEngineGroup:
    """Engines as Ray actor handles (``handle.method.remote(...)``), as miles/slime hold them."""

    def __init__(self, handles: Sequence[Any], names: Sequence[str] | None = None):
        self.handles = list(handles)
        self.names = list(names) if names else [f"engine{i}" for i in range(len(self.handles))]

    def submit(self, method: str, *args, **kwargs):
        return method, [getattr(h, method).remote(*args, **kwargs) for h in self.handles]

    def wait(self, pending) -> list[Any]:
        import ray

        method, refs = pending
        results, errors = [], {}
        for name, ref in zip(self.names, refs):
            try:
                results.append(ray.get(ref))
            except BaseException as e:  # noqa: BLE001
                cause = getattr(e, "cause", None)  # RayTaskError wraps the actor's exception
                errors[name] = cause if isinstance(cause, BaseException) else e
                results.append(None)
        if errors:
            raise EngineSyncError(method, errors)
        return results


def make_engine_actor_class():
    """A Ray actor class wrapping ``SGLangEngineClient`` (import-time free of Ray)."""
    import ray

    # Threaded actor: a long pull must not block generate calls or a concurrent pull on another host.
    @ray.remote(num_cpus=0, max_concurrency=8)
    class SGLangEngineActor:
        """A rollout engine as a Ray actor: the methods a miles/slime engine actor exposes."""

        def __init__(self, base_url: str, **client_kwargs):
            self.client = SGLangEngineClient(base_url, **client_kwargs)

        def pull_weights(self, local_checkpoint_dir, source_dir, target_version):
            return self.client.pull_weights(local_checkpoint_dir, source_dir, target_version)

        def pause_generation(self, mode="retract"):
            return self.client.pause_generation(mode)

        def flush_cache(self):
            return self.client.flush_cache()

        def update_weights_from_disk(self, model_path, weight_version=None, flush_cache=True):
            return self.client.update_weights_from_disk(model_path, weight_version, flush_cache)

        def continue_generation(self):
            return self.client.continue_generation()

        def generate_ids(self, prompt, max_new_tokens=8):
            return self.client.generate_ids(prompt, max_new_tokens)

        def base_url(self):
            return self.client.base_url

    return SGLangEngineActor
