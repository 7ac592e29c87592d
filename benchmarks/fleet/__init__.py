"""The time-to-fleet harness (issue 29): simulated engine hosts in network namespaces, a
rate-limited origin, an nginx caching tier, and our real pull on every host.

- ``origin``: a static HTTP server with Range support and a request log (the origin in the
  benchmark and in the tests);
- ``nginx``: the caching tier's configuration (docs/FLEET.md) and its process;
- ``netns``: namespaces, a bridge, veth pairs and ``tc`` rate limits, torn down on every exit;
- ``run``: one benchmark run (modes, hosts, results, the model).
"""
