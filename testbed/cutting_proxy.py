"""A loopback proxy in front of an HTTP server that cuts the first ``cut`` ranged GET answers
after ``after`` bytes (headers included) by closing both connections: a body cut short, as a
dropped connection or a restarted load balancer gives. Everything else passes through, one
request per connection. Signatures stay valid: the client signs for the proxy's host, and the
server checks the Host header it receives (as ``s3_server.ThrottlingProxy``).

    with CuttingProxy(upstream_port, cut=3, after=5000) as proxy:
        env["AWS_ENDPOINT_URL"] = proxy.endpoint
"""

from __future__ import annotations

from .loopback import LoopbackProxy


class CuttingProxy(LoopbackProxy):
    THREAD_NAME = "cutting-proxy"

    def __init__(self, upstream_port: int, cut: int, after: int):
        self.cut = cut
        self.after = after
        self.cuts = 0
        super().__init__(upstream_port)  # last: it starts serving

    def decide(self, ranged_get: bool) -> tuple[bytes | None, int | None]:
        if ranged_get and self.cuts < self.cut:
            self.cuts += 1
            return None, self.after
        return None, None
