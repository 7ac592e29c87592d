"""Bucket against directory: publish and pull of one checkpoint through a real S3 server on
loopback (SeaweedFS ``weed mini``, ``testbed/s3_server.py``) and through a local directory, in
the same run, interleaved round by round.

Measured per case (medians over the rounds): wall seconds, this process's CPU seconds (the
client's threads included: obstore runs in-process) per GB, and the server's CPU seconds per GB
(it shares the box, so its CPU is part of the bucket's cost here). Cases:

- publish v1 (a full version: every tensor) and v2 (a delta from v1, ~1% of the elements);
- pull v1 into a fresh local dir (a seed from the full version), and v2 onto v1 (a chain).

Targets (issue 26): a pull from the bucket >= 0.8x the directory's throughput and <= 1.2x its
CPU per GB. Both sources read from the page cache here (no cache drop on a shared box), so the
directory's numbers are a kernel copy at memory speed: the hardest comparison for the bucket.

    .venv/bin/python benchmarks/bench_bucket.py [--preset small] [--rounds 3] [--append]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_data import PRESETS, qwen3_tensors  # noqa: E402
from testbed.s3_server import S3Server  # noqa: E402
from weightsync import Publisher, pull  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def make_tensors(preset: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """bf16 bits as uint16, random (incompressible: the wire carries every byte)."""
    return {n: rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for n, shape in qwen3_tensors(PRESETS[preset]).items()}


def step(tensors: dict[str, np.ndarray], rng: np.random.Generator, density: float) -> dict[str, np.ndarray]:
    out = {}
    for n, a in tensors.items():
        b = a.copy().reshape(-1)
        k = max(1, int(b.size * density))
        pos = rng.choice(b.size, size=k, replace=False)
        b[pos] ^= 1
        out[n] = b.reshape(a.shape)
    return out


def write_seed(directory: str, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write('{"model_type": "qwen3"}')
    # bf16 bits stored as int16-shaped views of the same bytes: the core treats dtypes as bytes
    save_file({n: a.view(np.int16) for n, a in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


class Meter:
    def __init__(self, server: S3Server | None):
        self.server = server

    def __enter__(self):
        self.t, self.c = time.perf_counter(), time.process_time()
        self.s = self.server.cpu_seconds() if self.server else 0.0
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t
        self.cpu = time.process_time() - self.c
        self.server_cpu = (self.server.cpu_seconds() - self.s) if self.server else 0.0


def run_round(kind: str, target: str, seed: str, work: str, v1, v2, server) -> dict[str, tuple[float, float, float, int]]:
    """Publish v1, v2 into ``target``, pull v1 then v2 into a fresh local dir: (wall, cpu, server cpu, bytes)."""
    out = {}
    raw1 = {n: a.view(np.int16) for n, a in v1.items()}
    raw2 = {n: a.view(np.int16) for n, a in v2.items()}
    pub = Publisher(target, template_dir=seed, encoding="sparse-v1", prune=False)
    pub.seed_snapshot(raw1, 0)
    with Meter(server) as m:
        r = pub.publish(1, raw1, full=True)
    out["publish v1 (full)"] = (m.wall, m.cpu, m.server_cpu, r.wire_nbytes)
    if server is not None:
        with Meter(server) as m:
            nbytes = store_only(target, os.path.join(seed, "model.safetensors"))
        out["the server alone: a checkpoint's bytes from curl (one PUT)"] = (m.wall, m.cpu, m.server_cpu, nbytes)
    with Meter(server) as m:
        r = pub.publish(2, raw2)
    out["publish v2 (delta)"] = (m.wall, m.cpu, m.server_cpu, r.wire_nbytes)
    pub.close()
    if server is not None:
        with Meter(server) as m:
            nbytes = serve_only(target, "weight_v000001/")
        out["the server alone: v1's shards to curl"] = (m.wall, m.cpu, m.server_cpu, nbytes)
        with Meter(server) as m:
            nbytes = receive_only(target, "weight_v000001/")
        out["the client's receive alone (bytes dropped)"] = (m.wall, m.cpu, m.server_cpu, nbytes)
    local = os.path.join(work, f"local-{kind}-{uuid.uuid4().hex[:6]}")
    with Meter(server) as m:
        r = pull(local, seed, target, 1)
    out["pull v1 (seed from full)"] = (m.wall, m.cpu, m.server_cpu, r.source_nbytes or r.seed_nbytes)
    with Meter(server) as m:
        r = pull(local, seed, target, 2)
    out["pull v2 (chain)"] = (m.wall, m.cpu, m.server_cpu, r.source_nbytes)
    shutil.rmtree(local, ignore_errors=True)
    return out


def store_only(url: str, path: str) -> int:
    """What the server alone takes to store a checkpoint's bytes: one PUT of ``path`` by ``curl``
    through a presigned URL (next to no client work), to a scratch key deleted after. Its wall
    time is the floor a full publish of these bytes to this server, on this box, can reach."""
    import datetime as _dt
    import subprocess

    import obstore

    from weightsync.storage.source import BucketSource

    src = BucketSource(url)
    key = f"bench-floor/{uuid.uuid4().hex}"
    signed = obstore.sign(src.store, "PUT", key, _dt.timedelta(seconds=600))
    if subprocess.run(["curl", "-sf", "-o", "/dev/null", "-T", path, signed]).returncode != 0:
        raise RuntimeError("curl failed to PUT to the server")
    src.delete([key])
    return os.path.getsize(path)


def serve_only(url: str, prefix: str) -> int:
    """What the server alone takes to send a version's shards: the pull's ranged GETs (same range
    size, same number in flight), each by a ``curl`` writing to /dev/null through a presigned URL,
    so the client costs next to nothing. Its wall time is the floor a pull of these bytes from this
    server, on this box, can reach. Returns the bytes sent."""
    import datetime as _dt
    import subprocess

    import obstore

    from weightsync.storage.client import FETCH_IN_FLIGHT, FETCH_RANGE_NBYTES
    from weightsync.storage.source import BucketSource

    src = BucketSource(url)
    rng, in_flight = int(FETCH_RANGE_NBYTES.get()), int(FETCH_IN_FLIGHT.get())
    jobs = []
    for key, obj in sorted(src.list(prefix).items()):
        if key.endswith(".safetensors"):
            signed = obstore.sign(src.store, "GET", key, _dt.timedelta(seconds=600))
            jobs += [(signed, a, min(a + rng, obj.size) - 1) for a in range(0, obj.size, rng)]
    running: list = []
    for signed, a, b in jobs:
        while len(running) >= in_flight:
            running.pop(0).wait()
        running.append(subprocess.Popen(["curl", "-sf", "-o", "/dev/null", "-r", f"{a}-{b}", signed]))
    for p in running:
        if p.wait() != 0:
            raise RuntimeError("curl failed against the server")
    return sum(b - a + 1 for _, a, b in jobs)


def receive_only(url: str, prefix: str) -> int:
    """The client's part a pull cannot shed: the same ranged GETs, read by ``http.client`` into a
    reused buffer as the pull reads them, the bytes dropped (no write, no check). Its CPU over the
    directory's seed pull is the floor of the bucket's CPU ratio here: the directory pays one copy
    into the page cache, the bucket that same write plus the receive. Returns the bytes read."""
    import datetime as _dt
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlsplit

    import obstore

    from weightsync.storage.client import FETCH_IN_FLIGHT, FETCH_RANGE_NBYTES
    from weightsync.storage.source import BucketSource

    src = BucketSource(url)
    rng, in_flight = int(FETCH_RANGE_NBYTES.get()), int(FETCH_IN_FLIGHT.get())
    jobs = []
    for key, obj in sorted(src.list(prefix).items()):
        if key.endswith(".safetensors"):
            signed = urlsplit(obstore.sign(src.store, "GET", key, _dt.timedelta(seconds=600)))
            jobs += [(signed, a, min(a + rng, obj.size)) for a in range(0, obj.size, rng)]

    def one(job) -> int:
        signed, a, b = job
        conn = http.client.HTTPConnection(signed.netloc, timeout=60)
        try:
            conn.request("GET", f"{signed.path}?{signed.query}", headers={"Range": f"bytes={a}-{b - 1}"})
            resp = conn.getresponse()
            buf, got = memoryview(bytearray(1 << 20)), 0
            while got < b - a:
                n = resp.readinto(buf[: min(len(buf), b - a - got)])
                if not n:
                    raise RuntimeError("a short body from the server")
                got += n
            return got
        finally:
            conn.close()

    with ThreadPoolExecutor(in_flight) as pool:
        return sum(pool.map(one, jobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--append", action="store_true", help=f"append the table to {RESULTS}")
    args = ap.parse_args()
    rng = np.random.default_rng(26)
    work = tempfile.mkdtemp(prefix="ws-bench-bucket-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    server = S3Server.start(os.path.join(work, "s3"))
    os.environ.update(server.env())
    os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"] = os.path.join(work, "staging")
    # The loopback server speaks plain HTTP; uploads go unsigned as they do over HTTPS by default.
    os.environ.setdefault("WEIGHTSYNC_BUCKET_UNSIGNED_PAYLOAD", "1")
    rows: dict[str, dict[str, list]] = {}
    try:
        v1 = make_tensors(args.preset, rng)
        v2 = step(v1, rng, args.density)
        seed = os.path.join(work, "seed")
        write_seed(seed, v1)
        total = sum(a.nbytes for a in v1.values())
        for i in range(args.rounds):
            for kind in (("dir", "bucket") if i % 2 == 0 else ("bucket", "dir")):
                target = os.path.join(work, f"src-{i}") if kind == "dir" else server.url(f"bench/{i}")
                res = run_round(kind, target, seed, work, v1, v2, server if kind == "bucket" else None)
                for case, val in res.items():
                    rows.setdefault(case, {}).setdefault(kind, []).append(val)
                if kind == "dir":
                    shutil.rmtree(target, ignore_errors=True)
                print(f"round {i + 1} {kind}: " + ", ".join(f"{c}: {v[0]:.2f}s" for c, v in res.items()), flush=True)
        table = report(args, rows, total)
        print(table)
        if args.append:
            with open(RESULTS, "a") as f:
                f.write("\n" + table)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(args, rows, total: int) -> str:
    def med(vals, i):
        return statistics.median(v[i] for v in vals)

    lines = [
        f"### Bucket vs directory (S3 on loopback), CPU ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})",
        "",
        f"`benchmarks/bench_bucket.py --preset {args.preset} --rounds {args.rounds}`: a {total / 1e6:.0f} MB bf16 checkpoint, "
        f"a delta of {args.density:.0%} of the elements; SeaweedFS 4.48 `weed mini` on 127.0.0.1 sharing the box; "
        "uploads with an unsigned payload (the HTTPS default); medians. Throughput = bytes moved / wall; CPU = this process's CPU-s per GB (obstore's threads included); "
        "server = weed's CPU-s per GB. Ratios: bucket against directory. \"The server alone\": the seed pull's ranged GETs "
        "by curl to /dev/null (next to no client work), against the directory's seed pull: the throughput floor a bucket seed pull "
        "can reach here. \"The client's receive alone\": the same GETs read as the pull reads them, bytes dropped: the CPU a "
        "bucket pull adds to the directory's at least. \"A checkpoint's bytes from curl (one PUT)\": the publish's floor likewise.",
        "",
        "| case | bytes | dir wall | bucket wall | throughput ratio | dir CPU s/GB | bucket CPU s/GB | CPU ratio | server CPU s/GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, by in rows.items():
        d, b = by.get("dir"), by["bucket"]
        if d is None:  # the floors: no directory counterpart; compared with the directory's same step
            d = rows["publish v1 (full)" if "PUT" in case else "pull v1 (seed from full)"]["dir"]
        nbytes = med(b, 3) or med(d, 3)
        gb = max(nbytes, 1) / 1e9
        dw, bw = med(d, 0), med(b, 0)
        dc, bc = med(d, 1) / gb, med(b, 1) / gb
        sc = med(b, 2) / gb
        lines.append(
            f"| {case} | {nbytes / 1e6:.1f} MB | {dw:.2f} s | {bw:.2f} s | {dw / bw:.2f}x | {dc:.2f} | {bc:.2f} | "
            f"{bc / dc if dc else float('nan'):.2f}x | {sc:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
