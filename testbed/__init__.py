"""CPU testbed shared by tests and the demo: a tiny Qwen3 checkpoint and a real sglang CPU server.

Modules:
- ``testbed.tiny_qwen3``: build a tiny Qwen3 HF checkpoint + tokenizer offline; transformers'
  greedy continuation for given weights (the reference the server must match).
- ``testbed.sglang_cpu``: launch/stop ``python -m sglang.launch_server`` on the CPU, loopback only,
  with this repo's sglang plugin installed and the CPU-test stand-ins on ``PYTHONPATH``.
- ``testbed.live``: a server's per-rank ``/weights_digest`` records, waiting for the live-apply
  map's proof, and "same bytes in every parameter of every rank".
- ``testbed.s3_server``, ``testbed.azurite_server``, ``testbed.gcs_server``: real object stores on
  loopback (SeaweedFS, Azurite, fake-gcs-server) for the bucket tests and benchmark, on one base
  (``testbed.loopback``: free ports, the process, and the fault proxies' accept loop);
  ``ThrottlingProxy`` (503s) and ``testbed.cutting_proxy`` (bodies cut short) sit in front of one.
"""
