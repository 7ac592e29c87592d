"""Benchmark: the engine side on a real sglang CPU server. A pull through ``/pull_weights``
against the same pull in a plain process, and the pause of a weight update.

    .venv/bin/python benchmarks/bench_engine.py                      # 1.3 GB Qwen3 shape, TP=1 and TP=2
    .venv/bin/python benchmarks/bench_engine.py --in-process-too     # also the old in-scheduler pull
    .venv/bin/python benchmarks/bench_engine.py --preset qwen3-4b --tp 1   # bigbox.sh

Data (engine_data.py): a servable Qwen3-shaped bf16 model (v0, the server's --model-path) and
two published delta versions: v1 changes 1% of v0's elements, v2 changes 5% of v1's.

1. The cause, without a server: the same pull in a plain process, alone and beside a Python
   thread that busy-polls (what sglang's scheduler loop does), and beside it with a 0.2 ms GIL
   switch interval. If the busy thread slows the pull and the short switch interval gives the
   speed back, the pull loses its time waiting for the GIL.
2. Pull inside against outside, per TP: reset the local checkpoint to v0, then pull v1, through
   the endpoint (wall time of the HTTP call) and in a plain process (the ``pull()`` call, same
   durability: verified in the page cache, flush in the background); the two interleaved, each
   waited until durable, the median of --reps. Target: endpoint <= 1.2x plain.
3. The pause, per TP: ``/update_weights_from_disk`` of the local checkpoint at v1 and at v2
   (wall time of the call, and the time from the call until a /generate sent right after it
   returns: when the engine serves again), and, where the engine has it,
   ``/update_weights_from_pulled`` for the same versions (live apply), with the ratio.

Prints one report and appends it to benchmarks/RESULTS.md. Servers run through the testbed's
launcher (loopback only); files live in --workdir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

PROMPT = "the quick brown fox"


# --- the plain process side ------------------------------------------------------------------


def plain_child(argv: list[str]) -> None:
    """In a fresh process: reset ``local`` to v0, then time ``pull`` of the target (after one
    untimed warm-up pull of it), as JSON.

    ``busy``: a Python thread busy-polls meanwhile (``switch_s`` > 0 also sets the GIL switch
    interval), as sglang's scheduler loop does around the in-process pull."""
    local, seed, source, target, busy, switch_s = argv[0], argv[1], argv[2], int(argv[3]), argv[4] == "1", float(argv[5])
    import weightsync
    from weightsync.puller.pull import wait_until_durable

    # Warm, as the engine's long-lived pull helper is: one pull of the target first, so the
    # timed one does not pay this fresh process's first touch of its buffers.
    weightsync.pull(local, seed, source, 0)
    weightsync.pull(local, seed, source, target)
    weightsync.pull(local, seed, source, 0)
    stop = threading.Event()
    if busy:
        if switch_s > 0:
            sys.setswitchinterval(switch_s)

        def spin() -> None:
            while not stop.is_set():
                pass

        threading.Thread(target=spin, daemon=True).start()
    c0 = time.process_time()
    t0 = time.perf_counter()
    res = weightsync.pull(local, seed, source, target, durability="deferred")
    wall = time.perf_counter() - t0
    stop.set()
    cpu = time.process_time() - c0
    wait_until_durable(local)
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "apply_s": res.apply_s, "action": res.action}))


def plain_pull(local: str, seed: str, source: str, target: int, *, busy: bool = False, switch_s: float = 0.0) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--plain-child", local, seed, source, str(target),
         "1" if busy else "0", str(switch_s)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the server side -------------------------------------------------------------------------


def gpu_server_class():
    """The testbed's launcher with a GPU engine's command line and environment (bigbox.sh)."""
    from testbed.sglang_cpu import LOOPBACK, SglangCpuServer

    class SglangGpuServer(SglangCpuServer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.env.pop("SGLANG_USE_CPU_ENGINE", None)
            self.env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
            # no CPU stand-ins (sgl_kernel, torchvision) on a GPU box: only this repo
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)

        def command(self) -> list[str]:
            return [
                sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", LOOPBACK, "--port", str(self.port), "--tp-size", str(self.tp),
                "--mem-fraction-static", "0.6", *self.extra_args,
            ]

    return SglangGpuServer


class Engine:
    """One real sglang server over the benchmark's model, and the calls the benchmark makes."""

    def __init__(self, work: str, model_dir: str, source_dir: str, tp: int, *, in_process: bool, log_dir: str,
                 device: str = "cpu"):
        from testbed.sglang_cpu import SglangCpuServer

        env = {"SGLANG_PULL_WEIGHTS_IN_PROCESS": "1" if in_process else "0"}
        self.local = os.path.join(work, f"local-tp{tp}")
        self.source = source_dir
        server_class = gpu_server_class() if device == "cuda" else SglangCpuServer
        self.server = server_class(
            model_dir, tp=tp, env=env, max_total_tokens=2048, startup_timeout_s=900,
            extra_args=["--pull-weights-allowed-roots", ",".join(sorted({work, os.path.dirname(source_dir)}))],
            log_path=os.path.join(log_dir, f"server-tp{tp}{'-inproc' if in_process else ''}.log"),
        )

    def __enter__(self) -> "Engine":
        t0 = time.perf_counter()
        self.server.start()
        self.start_s = time.perf_counter() - t0
        self.server.generate(PROMPT, 1)  # warm-up
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def pull(self, version: int) -> tuple[float, dict]:
        body = {"local_checkpoint_dir": self.local, "source_dir": self.source, "target_version": version}
        t0 = time.perf_counter()
        resp = self.server.post("/pull_weights", body, timeout=1800)
        wall = time.perf_counter() - t0
        reply = resp.json()
        if not reply.get("success"):
            raise RuntimeError(f"/pull_weights v{version} failed: {reply}")
        self.wait_durable(version)
        return wall, reply

    def wait_durable(self, version: int, timeout_s: float = 600) -> None:
        """Until the deferred flush wrote the marker (so flushes never overlap a measurement)."""
        import weightsync

        deadline = time.monotonic() + timeout_s
        while weightsync.applied_version(self.local) != version:
            if time.monotonic() > deadline:
                raise RuntimeError(f"v{version} never became durable in {self.local}")
            time.sleep(0.05)

    def timed_update(self, path: str, body: dict) -> dict:
        """The call's wall time, and when a /generate sent right after it returned."""
        box: dict = {}

        def generate_after() -> None:
            time.sleep(0.02)  # let the update reach the engine first
            self.server.generate(PROMPT, 1)
            box["served_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        g = threading.Thread(target=generate_after)
        g.start()
        resp = self.server.post(path, body, timeout=1800)
        wall = time.perf_counter() - t0
        g.join()
        reply = resp.json()
        if resp.status_code != 200 or not reply.get("success", False):
            raise RuntimeError(f"{path} failed ({resp.status_code}): {reply}")
        return {"wall_s": wall, "served_s": box["served_s"], "reply": reply}

    def reload(self) -> dict:
        return self.timed_update("/update_weights_from_disk", {"model_path": self.local, "flush_cache": True})

    def live_apply(self, version: int) -> dict:
        return self.timed_update(
            "/update_weights_from_pulled", {"local_checkpoint_dir": self.local, "target_version": version, "flush_cache": True}
        )

    def has_live_apply(self) -> bool:
        resp = self.server.post("/update_weights_from_pulled", {}, timeout=60)
        return resp.status_code != 404

    def generate_s(self) -> float:
        t0 = time.perf_counter()
        self.server.generate(PROMPT, 1)
        return time.perf_counter() - t0


# --- measurements ----------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def measure_cause(model: str, source: str, local: str, reps: int) -> dict:
    rows: dict[str, list[dict]] = {"alone": [], "busy": [], "busy_si": []}
    for _ in range(reps):
        rows["alone"].append(plain_pull(local, model, source, 1))
        rows["busy"].append(plain_pull(local, model, source, 1, busy=True))
        rows["busy_si"].append(plain_pull(local, model, source, 1, busy=True, switch_s=0.0002))
    return rows


def unnamed_copy(model: str, work: str) -> str:
    """The model's files under another dir (hard links): a dir that names no version. The seed
    dir itself names v0 (its fingerprint), so a reload from it makes live apply stage after
    every pull, and the pull's wall would count the staging too."""
    out = os.path.join(work, "model-unnamed")
    if not os.path.isdir(out):
        os.makedirs(out)
        for name in os.listdir(model):
            src = os.path.join(model, name)
            if os.path.isfile(src):
                try:
                    os.link(src, os.path.join(out, name))
                except OSError:
                    shutil.copy2(src, os.path.join(out, name))
    return out


def measure_pull(engine: Engine, model: str, reps: int, work: str) -> dict:
    """The pull alone: the engine reloads the model from a dir that names no version first, so
    its live version is unknown and live apply stages nothing after these pulls (staging is
    measured with the pause)."""
    engine.timed_update("/update_weights_from_disk", {"model_path": unnamed_copy(model, work), "flush_cache": True})
    endpoint, plain = [], []
    for _ in range(reps):
        engine.pull(0)
        wall, _ = engine.pull(1)
        endpoint.append(wall)
        plain.append(plain_pull(engine.local, model, engine.source, 1)["wall_s"])
    return {"endpoint": endpoint, "plain": plain}


def measure_pause(engine: Engine, versions: list[int], reps: int, live: bool) -> dict:
    """Per version (each changes its fraction of the previous one's elements): the reload of the
    local checkpoint at that version and, if the engine has it, the live apply to it."""
    out: dict = {v: {"reload": [], "live": [], "pull_live": [], "stage_s": []} for v in versions}
    for _ in range(reps):
        engine.pull(0)
        engine.reload()  # the engine serves v0 from the local dir: its live version is known
        for version in versions:
            wall, _ = engine.pull(version)  # the live-apply side stages the change here
            if live:
                out[version]["pull_live"].append(wall)
                applied = engine.live_apply(version)
                out[version]["live"].append(applied)
                hosts = applied["reply"].get("hosts") or []
                out[version]["stage_s"].append(max((h.get("stage_s") or 0.0 for h in hosts), default=0.0))
            out[version]["reload"].append(engine.reload())
    return out


def run(args, work: str) -> str:
    import engine_data

    t0 = time.perf_counter()
    if args.data:
        model, source, versions = engine_data.build_or_reuse(args.data, args.preset, args.fractions)
    else:
        model, source, versions = engine_data.build(work, args.preset, args.fractions)
    build_s = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    print(f"data: {args.preset}, {nbytes / 1e9:.2f} GB, versions {versions} ({build_s:.0f}s)", flush=True)
    results: dict = {"versions": versions, "nbytes": nbytes, "tp": {}}
    if not args.skip_cause:
        results["cause"] = measure_cause(model, source, os.path.join(work, "local-plain"), args.reps)
        print("cause:", {k: [round(r["wall_s"], 2) for r in v] for k, v in results["cause"].items()}, flush=True)
    log_dir = args.log_dir or work
    for tp in args.tp:
        per: dict = {}
        for in_process in ([True, False] if args.in_process_too else [False]):
            key = "in_process" if in_process else "helper"
            with Engine(work, model, source, tp, in_process=in_process, log_dir=log_dir, device=args.device) as engine:
                row = {"start_s": engine.start_s, "pull": measure_pull(engine, model, args.reps, work)}
                print(f"tp{tp} {key} pull:", {k: [round(x, 2) for x in v] for k, v in row["pull"].items()}, flush=True)
                if not in_process and not args.skip_pause and (args.pause_tp is None or tp in args.pause_tp):
                    live = engine.has_live_apply() and not args.no_live
                    row["generate_s"] = med([engine.generate_s() for _ in range(3)])
                    row["live_available"] = live
                    row["pause"] = measure_pause(engine, [v["version"] for v in versions], args.reps, live)
                    print(f"tp{tp} pause:", {v: {k: [round(r["wall_s"], 3) for r in rs] for k, rs in p.items() if k in ("reload", "live")}
                                             for v, p in row["pause"].items()}, flush=True)
                shutil.rmtree(engine.local, ignore_errors=True)
            per[key] = row
        results["tp"][tp] = per
    return report(args, results)


def report(args, res: dict) -> str:
    from bench_sync import describe_machine

    lines = [
        f"## {args.date} — engine benchmark, preset {args.preset}: {res['nbytes'] / 1e9:.2f} GB bf16, real sglang CPU server",
        "",
        f"Machine: {describe_machine()}. Load average at the end {', '.join('%.1f' % x for x in os.getloadavg())} "
        "(a shared box: other jobs run beside the benchmark, so wall times are noisy; medians of "
        f"{args.reps} interleaved runs, spread min-max). Versions: "
        + ", ".join(f"v{v['version']} changes {100 * v['changed']:.2f}% of v{v['version'] - 1}'s elements" for v in res["versions"])
        + f". Engine: {args.device}.",
        "",
    ]
    cause = res.get("cause")
    if cause:
        alone, busy, busy_si = (med([r["wall_s"] for r in cause[k]]) for k in ("alone", "busy", "busy_si"))
        lines += [
            "The cause, in a plain process (reset to v0, pull v1, seconds):",
            "",
            "| pull v1 in a plain process | median s | spread | CPU s (median) |",
            "|---|---|---|---|",
            f"| alone | {alone:.2f} | {spread([r['wall_s'] for r in cause['alone']])} | {med([r['cpu_s'] for r in cause['alone']]):.2f} |",
            f"| beside a busy-polling Python thread | {busy:.2f} | {spread([r['wall_s'] for r in cause['busy']])} | {med([r['cpu_s'] for r in cause['busy']]):.2f} |",
            f"| the same, GIL switch interval 0.2 ms | {busy_si:.2f} | {spread([r['wall_s'] for r in cause['busy_si']])} | {med([r['cpu_s'] for r in cause['busy_si']]):.2f} |",
            "",
            f"- beside a busy-polling thread (what sglang's scheduler loop is) the pull takes {busy / alone:.2f}x as long as "
            f"alone; with a 0.2 ms switch interval {busy_si / alone:.2f}x. If the short interval recovers most of it, the "
            "pull's threads were waiting for the GIL (CPU seconds include the spinning thread's).",
            "",
        ]
    if res["tp"]:
        lines += [
            "The pull alone (the engine's live version unknown, so nothing is staged; staging is in the pause table):",
            "",
            "| TP | pull runs | /pull_weights v0->v1 median s | spread | plain process median s | spread | endpoint / plain |",
            "|---|---|---|---|---|---|---|",
        ]
    verdicts = []
    for tp, per in res["tp"].items():
        for key, row in per.items():
            e, p = row["pull"]["endpoint"], row["pull"]["plain"]
            ratio = med(e) / med(p)
            where = "in the scheduler process (before)" if key == "in_process" else "in a helper process"
            lines.append(f"| {tp} | {where} | {med(e):.2f} | {spread(e)} | {med(p):.2f} | {spread(p)} | {ratio:.2f}x |")
            if key == "helper":
                verdicts.append(f"TP={tp} {ratio:.2f}x ({'MET' if ratio <= 1.2 else 'NOT MET'})")
    if verdicts:
        lines += ["", f"- a pull through the endpoint costs at most 1.2x the same pull in a plain process: {', '.join(verdicts)}"]
    pause_lines: list[str] = []
    targets: list[str] = []
    for tp, per in res["tp"].items():
        row = per.get("helper", {})
        pause = row.get("pause")
        if not pause:
            continue
        gen = row["generate_s"]
        for facts in res["versions"]:
            version, label = facts["version"], f"{100 * facts['changed']:.1f}%"
            p = pause[version]
            rel = [r["wall_s"] for r in p["reload"]]
            rel_srv = [r["served_s"] for r in p["reload"]]
            line = (f"| {tp} | {label} | reload {med(rel):.3f} ({spread(rel)}) | until served {med(rel_srv):.3f} |")
            if p["live"]:
                live = [r["wall_s"] for r in p["live"]]
                live_srv = [r["served_s"] for r in p["live"]]
                modes = sorted({str(r["reply"].get("mode", "?")) for r in p["live"]})
                engine_pause = [float(r["reply"]["pause_s"]) for r in p["live"] if r["reply"].get("pause_s") is not None]
                if engine_pause:
                    modes.append(f"engine pause_s {med(engine_pause):.3f}")
                scatter = [max((h.get("scatter_s") or 0.0 for h in r["reply"].get("hosts") or []), default=0.0)
                           for r in p["live"]]
                ratio = med(live) / med(rel)
                stage = med(p["stage_s"])
                line += (f" live {med(live):.3f} ({spread(live)}) | until served {med(live_srv):.3f} | "
                         f"{ratio:.3f}x | {', '.join(modes)}, scatter {med(scatter):.3f} | staging {stage:.2f} |")
                targets.append(live_target(args.device, tp, label, med(live), ratio))
                targets.append(check_cost(tp, label, p["live"]))
                # the same version's pull: the /pull_weights wall (which returns after staging) less staging
                pull_alone = med([w - st for w, st in zip(p["pull_live"], p["stage_s"])])
                targets.append(
                    f"- TP={tp}, {label} changed: preparation while serving (staging, after the pull's verify) "
                    f"{stage:.2f}s against the same version's pull itself {pull_alone:.2f}s: {stage / pull_alone:.2f}x "
                    f"(target <= 1.0x: {'MET' if stage <= pull_alone else 'NOT MET'})"
                )
            else:
                line += " - | - | - | - | - |"
            pause_lines.append(line)
        pause_lines_gen = f"- an idle /generate of one token takes {gen:.3f} s at TP={tp} (inside every 'until served')"
        pause_lines.append(pause_lines_gen)
    if pause_lines:
        lines += [
            "",
            "The pause (seconds; wall of the call, and from the call until a /generate sent right after it returns):",
            "",
            "| TP | changed | /update_weights_from_disk | | /update_weights_from_pulled | | live / reload | mode | prep s |",
            "|---|---|---|---|---|---|---|---|---|",
            *[ln for ln in pause_lines if ln.startswith("|")],
            "",
            *[ln for ln in pause_lines if ln.startswith("-")],
        ]
        lines += [t for t in targets if t]
        if not any(per.get("helper", {}).get("live_available") for per in res["tp"].values()):
            lines.append("- live apply: this engine has no /update_weights_from_pulled route yet (reload only)")
    return "\n".join(lines) + "\n"


def check_cost(tp: int, label: str, applied: list[dict]) -> str:
    """The check of each live apply (issue 19's proof), inside the pause, against that pause:
    the written elements' read-back inside the scatter plus the check at commit (per call the
    slowest rank; medians over the calls). Target: at most 10% of the live pause."""
    def cost(c: dict) -> float:
        return (c.get("check_s") or 0.0) + (c.get("written_read_back_s") or 0.0)

    rows = []
    for r in applied:
        reply = r["reply"]
        checks = [c for h in reply.get("hosts") or [] for c in h.get("checks") or []]
        if reply.get("mode") != "live" or not checks or not reply.get("pause_s"):
            continue
        worst = max(checks, key=cost)
        rows.append((cost(worst), (worst.get("written_read_back_s") or 0.0) + (worst.get("scattered_check_s") or 0.0),
                     worst.get("sample_check_s") or 0.0, max(c.get("sample_prepared_s") or 0.0 for c in checks),
                     float(reply["pause_s"]), any(c.get("sample_read_in_pause") for c in checks),
                     max(c.get("sample_before_pause_s") or 0.0 for c in checks),
                     sum(c.get("sampled_elements") or 0 for c in checks),
                     sum(c.get("sampled_before_pause") or 0 for c in checks)))
    if not rows:
        return ""
    check, written, sample, prepared, pause, in_pause, before_s, sampled, before = (
        med([x[k] for x in rows]) for k in range(9))
    ratio = check / pause
    return (f"- TP={tp}, {label} changed: the check of the live apply {1000 * check:.1f} ms of the engine's "
            f"{1000 * pause:.1f} ms pause: {ratio:.3f}x (written elements, read back in the scatter "
            f"{1000 * written:.1f} ms, sample "
            f"{1000 * sample:.1f} ms{', read in the pause' if in_pause else ''}; at staging, while serving: the "
            f"sample read {1000 * prepared:.1f} ms, and {before:.0f} of its {sampled:.0f} elements (those at the "
            f"target's bytes already) verified {1000 * before_s:.1f} ms) (target <= 0.10x: {'MET' if ratio <= 0.10 else 'NOT MET'})")


def live_target(device: str, tp: int, label: str, live_s: float, ratio: float) -> str:
    """The issue's targets: CPU TP=2 live pause <= 10% of the reload's; GPU TP=1 <= 50 ms and <= 5%."""
    if device == "cuda" and tp == 1:
        ok = live_s <= 0.05 and ratio <= 0.05
        return f"- GPU, TP=1, {label} changed: live pause {1000 * live_s:.0f} ms, {ratio:.3f}x the reload's (target <= 50 ms and <= 0.05x: {'MET' if ok else 'NOT MET'})"
    if device == "cpu" and tp == 2:
        return f"- CPU, TP=2, {label} changed: live pause {ratio:.3f}x the reload's (target <= 0.10x: {'MET' if ratio <= 0.10 else 'NOT MET'})"
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="engine-1.3g")
    ap.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",") if x.strip()], default=[1, 2],
                    help="engine TP sizes, comma-separated ('' = no server: data and the cause only)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.01, 0.05],
                    help="changed fraction of each published version v1, v2, ...")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the engine runs (cuda: bigbox.sh)")
    ap.add_argument("--workdir", default=None, help="default: a fresh dir under /tmp (the page cache holds it)")
    ap.add_argument("--data", default=None, help="build the model and versions here once and reuse them (kept)")
    ap.add_argument("--in-process-too", action="store_true", help="also measure the pull inside the scheduler process")
    ap.add_argument("--skip-cause", action="store_true")
    ap.add_argument("--skip-pause", action="store_true")
    ap.add_argument("--pause-tp", type=lambda s: [int(x) for x in s.split(",") if x.strip()], default=None,
                    help="measure the pause only at these TP sizes (default: every --tp)")
    ap.add_argument("--no-live", action="store_true", help="reload pause only, even if the engine has live apply")
    ap.add_argument("--log-dir", default=None, help="keep the server logs here (default: in the work dir, removed)")
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--plain-child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_child:
        plain_child(args.plain_child)
        return
    import engine_data

    if args.preset not in engine_data.ENGINE_PRESETS:
        ap.error(f"--preset must be one of {sorted(engine_data.ENGINE_PRESETS)}")
    work = tempfile.mkdtemp(prefix="weightsync-bench-engine-", dir=args.workdir)
    print(f"workdir {work}, load {os.getloadavg()}", flush=True)
    try:
        text = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    if not args.no_append:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
