"""The HTTP route ``POST /pull_weights`` (added to sglang's FastAPI app when it is imported).

Body: ``{"local_checkpoint_dir": str, "source_dir": str, "target_version": int}``, parsed strictly
(``sglang_patch.pull.request``: ``"1"`` or ``true`` as a version is a 400). Auth: sglang's
admin-optional level, exactly like ``/update_weights_from_disk`` (``--admin-api-key`` if set,
else ``--api-key`` if set, else open). Reply: 200 ``{"success": true, ...}`` or a 4xx/5xx with
``{"success": false, "error_type": ..., "message": ...}`` (see ``sglang_patch.pull.results``): 400
bad_request (also a ``target_version`` beyond int64), 403 forbidden, 404 source_not_ready, 409
PullInProgress (another target is being pulled; ``target_version`` names it), 415
unsupported_media_type (a body not sent as ``application/json``), 422 corrupt_artifact /
unsupported_format, 500 local_state_corrupt / internal_error, 503 unavailable (shutting down, or
the plugin could not install into this sglang), 504 pull_timeout. Tracebacks go to the server
log only, and only for internal errors.

The route needs nothing of the plugin but ``request`` and ``results`` to answer: if another part
failed to install (even the IPC types), it still answers 503 with the reason.
"""

import logging
from typing import Annotated, Any, Callable

from fastapi import Body, FastAPI, Request
from fastapi.responses import ORJSONResponse

from . import metrics, parts
from .pull import request as request_body, results
from weightsync.errors import EngineUnavailableError

log = logging.getLogger(__name__)

ROUTE_PATH = "/pull_weights"
ROUTE_MARK = "_weightsync_pull_weights_route"  # set on our endpoint: tells ours from another plugin's


def install_route(app: FastAPI, get_tokenizer_manager: Callable[[], Any]) -> bool:
    """Add ``POST /pull_weights`` to ``app``; the body is answered by the tokenizer.

    Returns False, adding nothing, when the app already has the route: ours (idempotent), or
    another one (sglang-miles and slime's patch ship their own), which then keeps serving; one
    log line says which.
    """
    existing = find_route(app, ROUTE_PATH)
    if existing is not None:
        if not getattr(existing.endpoint, ROUTE_MARK, False):
            log.warning(
                "weightsync plugin: POST %s is already served by %s (registered before this plugin "
                "loaded); that route keeps serving and weightsync's is not added",
                ROUTE_PATH, describe_endpoint(existing.endpoint),
            )  # fmt: skip
        return False
    from sglang.srt.utils.auth import AuthLevel, auth_level

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def pull_weights(request: Request):
        """Bring every host's local checkpoint to a published weight version."""
        target_version = -1
        try:
            reason = parts.unavailable_reason()
            if reason is not None:
                raise EngineUnavailableError(f"/pull_weights is unavailable on this engine: {reason}")
            request_body.check_json_content_type(ROUTE_PATH, request.headers.get("content-type"))
            body = request_body.parse_pull_body(await request.body())
            target_version = body.target_version
            from . import tokenizer_side

            fields = await tokenizer_side.pull_weights_fields(get_tokenizer_manager(), body)
        except Exception as exc:
            fields = results.error_reply_fields(target_version, exc, where="in the HTTP server")
            if fields["error_type"] == results.INTERNAL_ERROR:
                log.exception("pull_weights: the request failed")
            else:
                log.warning("pull_weights: %s %s", fields["http_status"], fields["message"])
            local = None
        else:
            local = body.local_checkpoint_dir
        reply = results.http_body(fields)
        metrics.observe_pull(reply, local)
        return ORJSONResponse(reply, status_code=fields["http_status"])

    setattr(pull_weights, ROUTE_MARK, True)
    app.add_api_route(ROUTE_PATH, pull_weights, methods=["POST"])
    log.info("weightsync plugin: POST %s is served by weightsync (%s)", ROUTE_PATH, __name__)
    return True


def find_route(app: FastAPI, path: str) -> Any:
    """The app's route for ``path`` (any method), or None."""
    return next((route for route in app.router.routes if getattr(route, "path", None) == path), None)


def describe_endpoint(endpoint: Any) -> str:
    """'module.function' of a route's endpoint, for the log."""
    name = getattr(endpoint, "__qualname__", None) or getattr(endpoint, "__name__", None) or repr(endpoint)
    module = getattr(endpoint, "__module__", None)
    return f"{module}.{name}" if module else name


def _live_error_body(error_type: str, message: str) -> dict:
    """The error shape of ``/update_weights_from_pulled`` for a call that never reached an engine."""
    return {"success": False, "error_type": error_type, "mode": None, "rolled_back": False, "message": message}


def install(module: Any = None) -> None:
    """Add the route to sglang's app (call when ``sglang.srt.entrypoints.http_server`` is imported)."""
    if module is None:
        from sglang.srt.entrypoints import http_server as module
    install_route(module.app, lambda: module._global_state.tokenizer_manager)
    install_live_routes(module.app, lambda: module._global_state.tokenizer_manager)


# --- live apply ---------------------------------------------------------------------------------

LIVE_ROUTE_PATH = "/update_weights_from_pulled"
DIGEST_ROUTE_PATH = "/weights_digest"


def install_live_routes(app: FastAPI, get_tokenizer_manager: Callable[[], Any]) -> None:
    """``POST /update_weights_from_pulled`` (admin-optional, like ``/pull_weights``) and
    ``POST /weights_digest`` (admin: a debug call that hashes every parameter on every rank)."""
    if any(getattr(route, "path", None) == LIVE_ROUTE_PATH for route in app.router.routes):
        return
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from . import tokenizer_side
    from .io_types import UpdateWeightsFromPulledReqInput, WeightsDigestReqInput, live_http_body

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def update_weights_from_pulled(request: Request):
        """Serve a pulled version: patch the changed elements live, or reload the local checkpoint."""
        try:  # parsed here, strictly, like /pull_weights (pydantic took a text/plain body and 2**64)
            request_body.check_json_content_type(LIVE_ROUTE_PATH, request.headers.get("content-type"))
            body = request_body.parse_live_body(await request.body())
        except Exception as exc:
            error_type, status = results.classify_error(exc)
            log.warning("update_weights_from_pulled: %s %s", status, results.describe_error(exc))
            return ORJSONResponse(_live_error_body(error_type, results.describe_error(exc)), status_code=status)
        obj = UpdateWeightsFromPulledReqInput(
            local_checkpoint_dir=body.local_checkpoint_dir, target_version=body.target_version,
            flush_cache=body.flush_cache, torch_empty_cache=body.torch_empty_cache,
        )
        try:
            output = await tokenizer_side.update_weights_from_pulled(get_tokenizer_manager(), obj)
        except Exception as exc:
            log.exception("update_weights_from_pulled: the request failed")
            return ORJSONResponse(
                _live_error_body("internal_error", f"update_weights_from_pulled failed in the server: {type(exc).__name__}: {exc}"),
                status_code=500,
            )
        reply = live_http_body(output)
        metrics.observe_update_from_pulled(reply)
        return ORJSONResponse(reply, status_code=output.http_status)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)  # ADMIN_FORCE would refuse every call on a server without an admin key
    async def weights_digest(obj: Annotated[WeightsDigestReqInput, Body()], request: Request):
        """Debug: every parameter's digest on every rank, with the live version and map summary."""
        import msgspec

        output = await tokenizer_side.weights_digest(get_tokenizer_manager(), obj)
        return ORJSONResponse({"success": True, "ranks": msgspec.to_builtins(output.ranks)})

    app.add_api_route(LIVE_ROUTE_PATH, update_weights_from_pulled, methods=["POST"])
    app.add_api_route(DIGEST_ROUTE_PATH, weights_digest, methods=["POST"])
