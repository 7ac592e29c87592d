"""One time-to-fleet run: publish a model and one delta, build the fabric, then per mode and
repeat bring every host from nothing to the version with our real pull, and report.

Modes (same version, same data, same run):
  direct  every host pulls from the origin (today's "every host reads the source");
  cache   ``caches`` hosts also run the nginx caching tier (benchmarks/fleet/nginx-cache.conf.template);
          host i pulls through cache i % caches, with WEIGHTSYNC_HTTP_ORIGIN naming the origin;
  swarm   every host joins the version's BitTorrent v2 swarm (``weightsync.storage.swarm``; the
          publisher wrote ``payload.torrent``), the origin as web seed, the fleet's roster as peers,
          and keeps seeding until the whole fleet is done.

Faults (``fault=``, issue 29.4): ``torn_cache`` (cache mode), ``bad_peer`` (an extra fleet member
serving corrupted pieces: benchmarks/fleet/bad_peer.py), ``half_killed`` (every odd host killed as
soon as any host holds swarm bytes; the survivors are judged), ``throttled_source`` (the origin
answers 503 SlowDown to the first 2·H payload requests, in every mode).

Time to fleet = max over hosts of (the time its pull returned the verified version) - the common
start. Each mode starts from fresh local dirs and fresh caches. Every host's tensors are then
read back and compared with the trainer's (xxh3-128 per tensor): ``all_ok``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import xxhash

from .netns import Fabric
from .nginx import NginxCache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
ORIGIN_PORT, CACHE_PORT = 8000, 8080


def model_times(hosts: int, caches: int, d_mb: float, host_mbps: float, src_mbps: float) -> dict[str, float]:
    """The note's transport lower bounds (MB, MB/s): direct max(H D/S, D/b); the cache tier with
    nginx's store-and-forward lock max(C D/S, D/b) + (H/C - 1) D/b; the swarm
    max(D/S, D/b, H D/(S + H b)) (the note measured about 1.2 D/b + 3 s of start-up on this box)."""
    per_cache = -(-hosts // caches) if caches else hosts
    return {
        "swarm": max(d_mb / src_mbps, d_mb / host_mbps, hosts * d_mb / (src_mbps + hosts * host_mbps)),
        "direct": max(hosts * d_mb / src_mbps, d_mb / host_mbps),
        "cache": max(caches * d_mb / src_mbps, d_mb / host_mbps) + max(per_cache - 1, 0) * d_mb / host_mbps if caches else float("nan"),
    }


def build_run(work: str, model_mb: float, changed: float, seed: int = 0, torrent: bool = False) -> tuple[str, str, dict[str, str], int]:
    """A seed checkpoint and a run with v1 (a sparse-v1 delta: ``changed`` of the elements moved
    a little; with ``torrent``, published with its payload.torrent). Returns (www root, seed dir,
    tensor -> xxh3-128 of v1's bytes, delta bytes)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    try:
        from core_support import write_hf_checkpoint
    finally:
        sys.path.pop(0)
    from weightsync import Publisher

    rng = np.random.default_rng(seed)
    n = int(model_mb * (1 << 20)) // 4 // 4
    t0 = {f"layers.{i}.w": rng.standard_normal(n, dtype=np.float32).reshape(-1, 256) for i in range(4)}
    seed_dir = os.path.join(work, "seed")
    write_hf_checkpoint(seed_dir, t0)
    www = os.path.join(work, "www")
    if torrent:
        os.environ["WEIGHTSYNC_PUBLISH_TORRENT"] = "1"
    try:
        pub = Publisher(os.path.join(www, "run"), template_dir=seed_dir, encoding="sparse-v1", workers=1)
        _publish_v1(pub, t0, t1 := {}, rng, changed)
    finally:
        if torrent:
            os.environ.pop("WEIGHTSYNC_PUBLISH_TORRENT", None)
    vdir = os.path.join(www, "run", "weight_v000001")
    with open(os.path.join(vdir, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    delta = sum(os.path.getsize(os.path.join(vdir, f)) for f in files)
    expected = {k: xxhash.xxh3_128_hexdigest(np.ascontiguousarray(v).tobytes()) for k, v in t1.items()}
    return www, seed_dir, expected, delta


def _publish_v1(pub, t0: dict, t1: dict, rng, changed: float) -> None:
    pub.seed_snapshot(t0)
    for k, v in t0.items():
        v = v.copy()
        flat = v.reshape(-1)
        moved = rng.random(flat.size) < changed
        flat[moved] += rng.standard_normal(int(moved.sum()), dtype=np.float32) * np.float32(1e-3)
        t1[k] = v
    pub.publish(1, t1, full=False)
    pub.close()


def check_host(local: str, expected: dict[str, str]) -> bool:
    """The host's tensors, read back from its local checkpoint, hash to the trainer's."""
    from weightsync import read_checkpoint_tensors

    try:
        got = read_checkpoint_tensors(local)
    except Exception:
        return False
    return set(got) == set(expected) and all(
        xxhash.xxh3_128_hexdigest(got[k].bytes_view().tobytes()) == d for k, d in expected.items())


def origin_bytes(log_path: str) -> int:
    try:
        with open(log_path) as f:
            return sum(json.loads(line)[2] for line in f if line.strip())
    except FileNotFoundError:
        return 0


def origin_refusals(log_path: str) -> int:
    """How many requests the origin answered 503 SlowDown (the throttled_source fault)."""
    try:
        with open(log_path) as f:
            return sum(json.loads(line)[1].endswith(" 503") for line in f if line.strip())
    except FileNotFoundError:
        return 0


def tear_cached_copies(fab: Fabric, tier: "list[NginxCache]", url_path: str, files: list[str]) -> int:
    """The fault "a cache serves a torn object": each cache fetches ``files`` once (from inside
    its host), then a byte of each cached body is flipped on disk; nginx serves it as it is.
    Returns how many cached copies were torn."""
    torn = 0
    for j, cache in enumerate(tier):
        for name in files:
            url = f"{cache.base_url}{url_path}/{name}"
            subprocess.run(["ip", "netns", "exec", fab.host(j), PY, "-c",
                            "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=120).read()", url],
                           check=True, capture_output=True)
            base = os.path.basename(name)
            for entry in cache.cache_files():
                with open(entry, "rb") as f:
                    head = f.read(4096)
                if base.encode() in head:
                    with open(entry, "r+b") as f:
                        f.seek(-7, os.SEEK_END)
                        b = f.read(1)
                        f.seek(-7, os.SEEK_END)
                        f.write(bytes([b[0] ^ 0xFF]))
                    torn += 1
    return torn


SWARM_PORT = 6881


def run_mode(fab: Fabric, mode: str, caches: int, work: str, url_path: str, seeds: list[str],
             expected: dict[str, str], origin_log: str, timeout_s: float, fault: "str | None" = None,
             payload_files: "list[str] | None" = None, www: "str | None" = None) -> dict:
    n = len(seeds)  # the fabric may hold one more namespace: the bad peer's
    mdir = os.path.join(work, f"mode-{mode}-{time.monotonic_ns()}")
    os.makedirs(mdir)
    tier: list[NginxCache] = []
    torn = 0
    killed: list[int] = []
    before = origin_bytes(origin_log)
    refused_before = origin_refusals(origin_log)
    linger = os.path.join(mdir, "fleet.done")
    roster = [f"{fab.host_ip(i)}:{SWARM_PORT}" for i in range(n)]
    try:
        if mode == "cache":
            for j in range(caches):
                tier.append(NginxCache(os.path.join(mdir, f"nginx{j}"), fab.host_ip(j), CACHE_PORT,
                                       f"{fab.source_ip}:{ORIGIN_PORT}", netns=fab.host(j)).start())
            if fault == "torn_cache":
                torn = tear_cached_copies(fab, tier, url_path, payload_files or [])
        if mode == "swarm" and fault == "bad_peer":
            ready = os.path.join(mdir, "bad_peer.ready")
            vdir = os.path.join(www or "", url_path.strip("/"), "weight_v000001")
            fab.spawn(fab.host(n), [PY, "-m", "benchmarks.fleet.bad_peer", "--torrent", os.path.join(vdir, "payload.torrent"),
                                    "--files", vdir, "--listen", f"{fab.host_ip(n)}:{SWARM_PORT}",
                                    "--work", os.path.join(mdir, "bad_peer"), "--ready", ready],
                      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
            _wait_for([ready], [], timeout_s, "the bad peer's start-up")
            roster.insert(0, f"{fab.host_ip(n)}:{SWARM_PORT}")  # first in every host's list
        go = os.path.join(mdir, "go")
        procs = []
        for i in range(n):
            hdir = os.path.join(mdir, f"h{i}")
            os.makedirs(hdir)
            env = dict(os.environ, WEIGHTSYNC_APPLY_WORKERS="1", PYTHONPATH=ROOT)
            extra: list[str] = []
            if mode == "cache":
                url = f"http://{fab.host_ip(i % caches)}:{CACHE_PORT}{url_path}"
                env["WEIGHTSYNC_HTTP_ORIGIN"] = f"http://{fab.source_ip}:{ORIGIN_PORT}"
            else:
                url = f"http://{fab.source_ip}:{ORIGIN_PORT}{url_path}"
                env.pop("WEIGHTSYNC_HTTP_ORIGIN", None)
            if mode == "swarm":
                extra = ["--swarm-listen", f"{fab.host_ip(i)}:{SWARM_PORT}", "--swarm-peers", ",".join(roster),
                         "--linger-until", linger]
            procs.append(fab.spawn(fab.host(i), [
                PY, "-m", "benchmarks.fleet.host", "--local", os.path.join(hdir, "local"), "--seed", seeds[i],
                "--url", url, "--version", "1", "--ready", os.path.join(hdir, "ready"), "--go", go,
                "--result", os.path.join(hdir, "result.json"), "--wait-s", str(timeout_s), *extra], env=env, cwd=ROOT))
        _wait_for([os.path.join(mdir, f"h{i}", "ready") for i in range(n)], procs, timeout_s, "host start-up")
        t0 = time.time() + 0.5
        with open(go + ".tmp", "w") as f:
            f.write(repr(t0))
        os.replace(go + ".tmp", go)
        if fault == "half_killed":
            killed = _kill_half_mid_swarm(mdir, procs, timeout_s)
        alive = [i for i in range(n) if i not in killed]
        _wait_for([os.path.join(mdir, f"h{i}", "result.json") for i in alive], [procs[i] for i in alive], timeout_s,
                  f"{mode} pulls")
        with open(linger, "w") as f:
            f.write("1")
        for i in alive:
            procs[i].wait(timeout=30)
    finally:
        for c in tier:
            c.stop()
    results = []
    for i in alive:
        with open(os.path.join(mdir, f"h{i}", "result.json")) as f:
            r = json.load(f)
        r["bytes_ok"] = check_host(os.path.join(mdir, f"h{i}", "local"), expected)
        results.append(r)
    finishes = sorted((r["finish"] - r["t0"]) if r.get("finish") else float("inf") for r in results)
    out = {
        "mode": mode, "fleet_s": round(finishes[-1], 3), "p50_s": round(finishes[len(finishes) // 2], 3),
        "first_s": round(finishes[0], 3), "all_ok": all(r["ok"] and r["bytes_ok"] for r in results),
        "origin_bytes": origin_bytes(origin_log) - before,
        "errors": sorted({r["error"] for r in results if r.get("error")})[:3],
    }
    if mode == "swarm":
        sw = [r.get("swarm") or {} for r in results]
        out["swarm"] = {k: sum(x.get(k, 0) for x in sw) for k in ("delivered", "fell_back", "rejected", "hash_failures")}
        out["swarm"]["why"] = sorted({x.get("why") for x in sw if x.get("why")})[:3]
    if fault:
        out.update(fault=fault, torn_copies=torn, killed=len(killed), hosts_judged=len(results),
                   origin_refusals=origin_refusals(origin_log) - refused_before)
    shutil.rmtree(mdir, ignore_errors=True)
    return out


def _kill_half_mid_swarm(mdir: str, procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Every odd host killed (SIGKILL, its process group) once any host holds swarm bytes and
    before every host is done: mid-swarm."""
    import signal

    n = len(procs)
    deadline = time.monotonic() + timeout_s

    def swarm_bytes(i: int) -> int:
        total = 0
        for root, _dirs, files in os.walk(os.path.join(mdir, f"h{i}", "local", ".weight_sync", "swarm")):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_blocks
                except FileNotFoundError:
                    pass
        return total

    while not any(swarm_bytes(i) for i in range(n)):
        if time.monotonic() > deadline:
            raise TimeoutError("half_killed: no host received a swarm byte")
        time.sleep(0.02)
    victims = [i for i in range(1, n, 2)]
    for i in victims:
        try:
            os.killpg(procs[i].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for i in victims:
        procs[i].wait(timeout=30)
    return victims


def _wait_for(paths: list[str], procs: list[subprocess.Popen], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        dead = [p for p in procs if p.poll() not in (None, 0)]
        if dead:
            raise RuntimeError(f"{what}: a host process exited with {dead[0].returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {sum(not os.path.exists(p) for p in paths)} host(s) not done in {timeout_s:.0f}s")
        time.sleep(0.05)


def run_fleet(hosts: int, caches: int, model_mb: float, changed: float, host_mbit: float, src_mbit: float,
              modes: "list[str]", repeats: int, work: "str | None" = None, timeout_s: float = 300,
              log=print, fault: "str | None" = None) -> dict:
    """Everything, torn down at the end (also on failure). Returns rows and a summary.

    ``fault``: ``torn_cache`` (in cache mode every cache holds a torn copy of each payload file
    before the hosts start: ``tear_cached_copies``), ``bad_peer``, ``half_killed``,
    ``throttled_source`` (the module's doc)."""
    base = work or tempfile.mkdtemp(prefix="ws-fleet-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(base, exist_ok=True)
    try:
        www, seed_dir, expected, delta = build_run(base, model_mb, changed, torrent="swarm" in modes)
        with open(os.path.join(www, "run", "weight_v000001", "model.safetensors.index.json")) as f:
            payload_files = [f"weight_v000001/{n}" for n in sorted(set(json.load(f)["weight_map"].values()))]
        seeds = []
        for i in range(hosts):  # each host its own seed dir (hard links: the same bytes, no more memory)
            d = os.path.join(base, f"seed-h{i}")
            shutil.copytree(seed_dir, d, copy_function=os.link)
            seeds.append(d)
        d_mb = delta / 1e6
        b, s = host_mbit / 8, src_mbit / 8
        model = model_times(hosts, caches, d_mb, b, s)
        shape = {"hosts": hosts, "caches": caches, "delta_MB": round(d_mb, 2), "model_MB": model_mb,
                 "host_MBps": b, "src_MBps": s, "H_b_over_S": round(hosts * b / s, 2), "D_over_b_s": round(d_mb / b, 2)}
        log(json.dumps({"shape": shape}))
        rows = []
        origin_log = os.path.join(base, "origin.log")
        throttle = ["--throttle", str(2 * hosts)] if fault == "throttled_source" else []
        with Fabric(hosts + (1 if fault == "bad_peer" else 0), host_mbit, src_mbit) as fab:
            fab.spawn(fab.source, [PY, "-m", "benchmarks.fleet.origin", www, "--bind", fab.source_ip, "--port",
                                   str(ORIGIN_PORT), "--log", origin_log, *throttle], cwd=ROOT,
                      env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait_port(fab, fab.source, fab.source_ip, ORIGIN_PORT)
            for rep in range(repeats):
                for mode in modes:
                    load = os.getloadavg()[0]
                    r = run_mode(fab, mode, caches, base, "/run", seeds, expected, origin_log, timeout_s,
                                 fault, payload_files, www)
                    r.update(rep=rep, model_s=round(model[mode], 2), load_avg=round(load, 1))
                    rows.append(r)
                    log(json.dumps(r))
        return {"shape": shape, "rows": rows, "summary": summarise(rows, modes, model)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _wait_port(fab: Fabric, ns: str, ip: str, port: int, wait_s: float = 20) -> None:
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), 0.3).close()\n"
             "except OSError:\n sys.exit(1)")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if subprocess.run(["ip", "netns", "exec", ns, PY, "-c", probe, ip, str(port)], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {ip}:{port} in {ns} after {wait_s}s")


def summarise(rows: list[dict], modes: list[str], model: dict[str, float]) -> dict:
    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2]

    out = {}
    base = median([r["fleet_s"] for r in rows if r["mode"] == "direct"]) if any(r["mode"] == "direct" for r in rows) else None
    for m in modes:
        v = [r["fleet_s"] for r in rows if r["mode"] == m]
        if not v:
            continue
        med = median(v)
        out[m] = {"fleet_median_s": med, "spread_s": [min(v), max(v)], "model_s": round(model[m], 2),
                  "ratio_vs_direct": round(med / base, 2) if base else None,
                  "all_ok": all(r["all_ok"] for r in rows if r["mode"] == m),
                  "origin_MB_median": round(median([r["origin_bytes"] for r in rows if r["mode"] == m]) / 1e6, 2)}
    return out
