"""A stand-in for an sglang build that ships its own ``POST /pull_weights`` (sglang-miles, slime).

Loaded as an sglang plugin (entry point ``foreign_pull_route`` in the dist-info next to this
file; this directory comes first on the test server's ``PYTHONPATH``, so it is discovered, and
loaded, before weightsync's). It adds its route to sglang's app as soon as
``sglang.srt.entrypoints.http_server`` has executed, i.e. before weightsync's plugin patches that
module: the same state weightsync meets on a server whose own http_server defines the route.
"""

from fastapi.responses import JSONResponse

SERVED_BY = "foreign_pull_route"


async def pull_weights():
    return JSONResponse({"served_by": SERVED_BY})


def _add_route(module) -> None:
    module.app.add_api_route("/pull_weights", pull_weights, methods=["POST"])


def load() -> None:
    # Any post-import mechanism will do; this one runs callbacks in registration order, and this
    # plugin registers first.
    from sglang_patch._post_import import when_imported

    when_imported("sglang.srt.entrypoints.http_server", _add_route)
