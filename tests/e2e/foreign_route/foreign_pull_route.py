"""A stand-in for an sglang build that ships its own ``POST /pull_weights`` (sglang-miles, slime).

Loaded as an sglang plugin (entry point ``foreign_pull_route`` in the dist-info next to this
file, which the test puts on the server's ``PYTHONPATH``). Such builds define the route in
sglang's own ``http_server`` module; to reproduce that without editing sglang, this plugin adds
the route to sglang's app the moment the module creates it (``app = FastAPI(...)`` in the module
body), so the route exists before the module has finished importing, and so before any plugin
can patch it, whichever order the plugins load in.
"""

import sys

import fastapi
from fastapi.responses import JSONResponse

SERVED_BY = "foreign_pull_route"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"


async def pull_weights():
    return JSONResponse({"served_by": SERVED_BY})


def load() -> None:
    original = fastapi.FastAPI.__init__
    if getattr(original, "_foreign_pull_route", False):
        return

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if sys._getframe(1).f_globals.get("__name__") == HTTP_SERVER:
            self.add_api_route("/pull_weights", pull_weights, methods=["POST"])

    init._foreign_pull_route = True
    fastapi.FastAPI.__init__ = init
