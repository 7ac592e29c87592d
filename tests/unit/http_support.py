"""A scripted HTTP server on loopback for the unit tests that stand in for an engine's routes
(``test_miles_engine_sync``, ``test_miles_updater_engine_rounds``): the JSON reply and the serving
thread; each test's handler decides what to answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer_json(handler: BaseHTTPRequestHandler, status: int, reply) -> None:
    data = json.dumps(reply).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def serve_on_loopback(handler_cls: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread, str]:
    """-> (server, its serving thread, its base URL) on a free loopback port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.server_address[1]}"
