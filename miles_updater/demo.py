"""The whole loop on one CPU machine: a Megatron trainer on Ray publishes deltas, sglang pulls them.

    python -m miles_updater.demo [--steps 6] [--engines 1] [--workdir DIR] [--source dir|s3]

What runs (all real, loopback only): a local Ray cluster (2 CPUs); a tiny Qwen3 HF checkpoint
built offline; a Megatron trainer of TP=2 ranks as Ray actors (gloo), each taking real Adam
steps; a local directory as the shared filesystem (``--source s3``: a bucket of a real S3 server,
SeaweedFS ``weed mini`` on 127.0.0.1, that the demo starts and stops; its credentials reach the
trainer and the engines through the environment only); one or more real sglang CPU servers with the
``/pull_weights`` plugin. Each step trains, publishes version v (delta or full), has every engine
pull it while generating, reloads it, and checks that the engine's greedy output equals
transformers' greedy output on the trainer's published bytes. At the end: a table per version
and a PNG plot (``DIR/demo.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "the quick brown fox jumps over"
MAX_NEW_TOKENS = 8
# The engine computes in fp32 from the bf16 checkpoint, like the transformers reference: two bf16
# kernels can flip a greedy choice between near-tied logits, which would hide real mismatches.
# The demo's Adam steps (lr 4e-4 on a tiny bf16 model) change far more elements than an RL step
# does, above the engine's default live-apply threshold (10% of a rank's elements, where a
# real model's scatter costs about a reload): the engine patches every delta live here, so the
# table shows live applies beside the reloads of the full versions.
ENGINE_ARGS = ["--dtype", "float32", "--update-weights-live-max-changed-fraction", "1"]


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps, one sync (one version) after each")
    p.add_argument("--engines", type=int, default=1, help="sglang CPU servers (each ~1.5 GB)")
    p.add_argument("--tp", type=int, default=2, help="trainer tensor-parallel ranks (Ray actors)")
    p.add_argument("--lr", type=float, default=4e-4, help="Adam learning rate (sets how many bytes change)")
    p.add_argument("--encoding", default="sparse-v1", choices=("sparse-v1", "xor", "overwrite"))
    p.add_argument("--full-every", type=int, default=4, help="publish a full version every N versions")
    p.add_argument("--apply", default="auto", choices=("auto", "live", "reload"),
                   help="--update-weight-apply: live apply of the changed elements, or a full reload")
    p.add_argument("--workdir", default=None, help="where everything goes (default: a fresh temp dir)")
    p.add_argument("--source", default="dir", choices=("dir", "s3"),
                   help="where versions are published: a local dir, or a local S3 server the demo starts")
    p.add_argument("--keep", action="store_true", help="keep the workdir of a temp run")
    return p.parse_args(argv)


def _updater_config(hf_dir: str, workdir: Path, ns: argparse.Namespace, disk_dir: str | None = None):
    """Build the updater's config through the same flags a miles trainer would parse."""
    from miles_updater.args import add_update_weight_arguments, validate_update_weight_args

    parser = add_update_weight_arguments(argparse.ArgumentParser())
    args = parser.parse_args([
        "--update-weight-transfer-mode", "disk-delta",
        "--update-weight-disk-dir", disk_dir or str(workdir / "shared"),
        "--update-weight-local-checkpoint-dir", str(workdir / "local" / "ckpt"),
        "--update-weight-delta-encoding", ns.encoding,
        "--update-weight-full-every", str(ns.full_every),
        "--update-weight-apply", ns.apply,
        "--hf-checkpoint", hf_dir,
        "--update-weight-engine-timeout-s", "120",
    ])
    return validate_update_weight_args(args)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _differing_tensors(published: dict, local: dict) -> list[str]:
    """Names whose bytes differ between the trainer's published tensors and a local checkpoint."""
    import torch

    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t

    return [n for n in published if n not in local or not torch.equal(raw(published[n]), raw(local[n]))]


def print_table(rows: list[dict]) -> None:
    head = (f"{'ver':>3} {'kind':<5} {'changed B':>9} {'changed el':>10} {'wire':>10} {'full':>10} "
            f"{'publish s':>9} {'pull s':>7} {'pause s':>7} {'apply':<6} {'scattered':>9} {'loss':>7}  "
            f"engine==trainer  files==bytes")
    print(head)
    print("-" * len(head))
    for r in rows:
        r = {**r, "changed_fraction_bytes": r.get("changed_fraction_bytes") or 0.0,
             "changed_fraction_elements": r.get("changed_fraction_elements") or 0.0}
        print(f"{r['version']:>3} {r['kind']:<5} {r['changed_fraction_bytes']:>9.2%} "
              f"{r['changed_fraction_elements']:>10.2%} {_fmt_bytes(r['wire_nbytes']):>10} "
              f"{_fmt_bytes(r['full_nbytes']):>10} {r['publish_s']:>9.3f} {r['pull_s']:>7.3f} "
              f"{r['pause_s']:>7.3f} {r.get('apply_mode') or '-':<6} {r.get('elements_scattered') or 0:>9} "
              f"{'-' if r['loss'] is None else format(r['loss'], '.3f'):>7}  "
              f"{'yes' if r['match'] else 'NO':>15}  {'yes' if r['files_equal'] else 'NO':>11}")
    reasons = [(r["version"], a["engine"], a["reason"]) for r in rows for a in r.get("applies") or []
               if a.get("mode") != "live" and a.get("reason")]
    for version, engine, reason in reasons:
        print(f"  v{version} {engine}: reload ({reason})")


def plot(rows: list[dict], path: Path) -> list[str]:
    """Write the two-panel plot to ``path``; returns the time panel's legend labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["version"] > 0]
    v = [r["version"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = ["tab:orange" if r["kind"] == "full" else "tab:blue" for r in rows]
    a.bar(v, [r["wire_nbytes"] for r in rows], color=colors, label="wire bytes (blue delta, orange full)")
    a.plot(v, [r["full_nbytes"] for r in rows], "k--", label="full-version bytes")
    a.set_yscale("log")
    a.set_xlabel("version")
    a.set_ylabel("bytes")
    a2 = a.twinx()
    a2.plot(v, [100 * r["changed_fraction_bytes"] for r in rows], "g-o", label="changed bytes %")
    a2.set_ylabel("changed bytes (%)")
    a2.set_ylim(0, 100)
    a.legend(loc="upper left", fontsize=8)
    a2.legend(loc="upper right", fontsize=8)
    a.set_title("what each version put on the shared filesystem")
    bottom = [0.0] * len(rows)
    for key, color in (("publish_s", "tab:purple"), ("pull_s", "tab:green")):
        vals = [r[key] for r in rows]
        b.bar(v, vals, bottom=bottom, color=color, label=key[:-2] + " (while generating)")
        bottom = [x + y for x, y in zip(bottom, vals)]
    # The pause is what rollouts feel: red for a full reload, cyan for a live apply of the changes.
    for mode, color in (("reload", "tab:red"), ("live", "tab:cyan"), ("mixed", "tab:olive")):
        pick = [i for i, r in enumerate(rows) if (r.get("apply_mode") or "reload") == mode]
        if pick:
            b.bar([v[i] for i in pick], [rows[i]["pause_s"] for i in pick], bottom=[bottom[i] for i in pick],
                  color=color, label=f"pause, {mode}")
    bottom = [x + r["pause_s"] for x, r in zip(bottom, rows)]
    for x, r, top in zip(v, rows, bottom):
        b.text(x, top, "=" if r["match"] else "X", ha="center", va="bottom")
    b.set_xlabel("version  ('=' engine output equals the trainer's)")
    b.set_ylabel("seconds")
    b.set_title("time per sync (the pause: generation stopped)")
    labels = [t.get_text() for t in b.legend(fontsize=8).get_texts()]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


def run(ns: argparse.Namespace) -> list[dict]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    repo_root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo_root))
    try:
        from testbed.sglang_cpu import SglangCpuServer, find_free_port
        from testbed.tiny_qwen3 import make_tiny_qwen3, read_state_dict
    except ImportError as exc:  # an installed wheel: the CPU testbed ships only in the repository
        raise SystemExit(f"the demo runs from a checkout of the repository (`make demo`): {exc}") from exc

    temp = ns.workdir is None
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="miles-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = make_tiny_qwen3(workdir / "hf", seed=0)
    s3, roots = None, [str(workdir)]
    if getattr(ns, "source", "dir") == "s3":
        s3 = _start_s3(workdir)
        roots.append(s3.url("demo"))
    try:
        return _run(ns, workdir, temp, hf_dir, roots, s3, SglangCpuServer, find_free_port, read_state_dict)
    finally:
        if s3 is not None:
            s3.stop()


def _start_s3(workdir: Path):
    """A real S3 server on loopback; its credentials and endpoint go into this process's
    environment, which the engines (subprocesses) and the trainer's Ray actors inherit."""
    from testbed.s3_server import S3Server

    s3 = S3Server.start(str(workdir / "s3"))
    os.environ.update(s3.env())
    # The trainer's ranks share one staging copy of what they upload (one machine here).
    os.environ["WEIGHTSYNC_BUCKET_STAGING_DIR"] = str(workdir / "staging")
    _say(f"S3 server (SeaweedFS weed mini) at {s3.endpoint}; publishing to {s3.url('demo/shared')}")
    return s3


def _run(ns, workdir: Path, temp: bool, hf_dir: str, roots: list[str], s3, SglangCpuServer, find_free_port,
         read_state_dict) -> list[dict]:
    repo_root = Path(__file__).resolve().parent.parent
    config = _updater_config(hf_dir, workdir, ns, s3.url("demo/shared") if s3 is not None else None)
    _say(f"workdir {workdir}; tiny Qwen3 at {hf_dir}; shared dir {config.source_dir}")

    servers = [
        SglangCpuServer(hf_dir, extra_args=ENGINE_ARGS + ["--pull-weights-allowed-roots", ",".join(roots)],
                        log_path=workdir / f"sglang-{i}.log").start(wait_healthy=False)
        for i in range(ns.engines)
    ]
    _say(f"starting {ns.engines} sglang CPU server(s) (logs in {workdir}/sglang-*.log)")
    import ray

    from miles_updater.cpu_trainer import MegatronCPUTrainer, greedy_from_tensors
    from miles_updater.engines import make_engine_actor_class

    rows: list[dict] = []
    try:
        bucket_env = {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k == "WEIGHTSYNC_BUCKET_STAGING_DIR"}
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(repo_root), **bucket_env}})
        port = find_free_port()
        trainers = [MegatronCPUTrainer.remote(r, ns.tp, port, config, tp=ns.tp, lr=ns.lr)
                    for r in range(ns.tp)]
        _say(f"Ray up; {ns.tp} Megatron trainer rank(s) (TP={ns.tp}, gloo) loading the checkpoint")
        for s in servers:
            s.wait_healthy()
        _say("engines healthy: " + ", ".join(s.base_url for s in servers))
        Actor = make_engine_actor_class()
        engines = [Actor.remote(s.base_url, name=f"engine{i}", timeout_s=120) for i, s in enumerate(servers)]
        ray.get(trainers[0].connect_rollout_engines.remote(engines, [f"engine{i}" for i in range(len(engines))]))
        info = ray.get([t.start.remote() for t in trainers])[0]
        _say(f"baseline: pull_weights(0) sent to every engine without waiting; run {info['run_id']}")

        ref0 = greedy_from_tensors(hf_dir, read_state_dict(hf_dir), PROMPT, MAX_NEW_TOKENS)
        got0 = ray.get(engines[0].generate_ids.remote(PROMPT, MAX_NEW_TOKENS))
        rows.append(dict(version=0, kind="seed", changed_fraction_bytes=0.0, changed_fraction_elements=0.0,
                         wire_nbytes=0, full_nbytes=0, publish_s=0.0, pull_s=0.0, pause_s=0.0, loss=None,
                         match=ref0 == got0, files_equal=True, engine_ids=got0, trainer_ids=ref0))
        for step in range(1, ns.steps + 1):
            losses = ray.get([t.train_step.remote() for t in trainers])
            metrics = ray.get([t.update_weights.remote() for t in trainers])[0]
            ref = ray.get(trainers[0].reference_greedy.remote(PROMPT, MAX_NEW_TOKENS))
            outs = ray.get([e.generate_ids.remote(PROMPT, MAX_NEW_TOKENS) for e in engines])
            match = all(o == ref for o in outs)
            # One machine plays every host here, so the engine's local checkpoint can be compared
            # with the trainer's published bytes directly.
            differ = _differing_tensors(ray.get(trainers[0].published_tensors.remote()),
                                        read_state_dict(config.local_checkpoint_dir))
            rows.append(dict(metrics, loss=losses[0], match=match, files_equal=not differ, engine_ids=outs[0],
                             trainer_ids=ref))
            actions = ",".join(a for p in metrics["pulls"] for a in (p.get("actions") or []) if a)
            _say(f"step {step}: loss {losses[0]:.3f} -> v{metrics['version']} {metrics['kind']}: "
                 f"{metrics['changed_fraction_bytes']:.1%} bytes changed, wire {_fmt_bytes(metrics['wire_nbytes'])} "
                 f"of {_fmt_bytes(metrics['full_nbytes'])}; pull {metrics['pull_s']:.2f}s ({actions}), "
                 f"pause {metrics['pause_s']:.2f}s ({metrics['apply_mode']}); engine output {'==' if match else '!='} trainer's"
                 + (f"; local files differ in {differ[:3]}" if differ else ", local files == published bytes"))
        ray.get([t.close.remote() for t in trainers])
    finally:
        try:
            ray.shutdown()
        finally:
            for s in servers:
                s.stop()
    print()
    print_table(rows)
    png = workdir / "demo.png"
    plot(rows, png)
    (workdir / "demo.json").write_text(json.dumps(rows, indent=1, default=str))
    print()
    if not temp or ns.keep:
        _say(f"plot: {png}   metrics: {workdir / 'demo.json'}")
    else:
        # Keep the plot and the table; drop checkpoints and logs of a throwaway run.
        keep_dir = Path(tempfile.gettempdir()) / "miles-demo-latest"
        keep_dir.mkdir(exist_ok=True)
        shutil.copy(png, keep_dir / "demo.png")
        shutil.copy(workdir / "demo.json", keep_dir / "demo.json")
        shutil.rmtree(workdir, ignore_errors=True)
        _say(f"plot: {keep_dir / 'demo.png'}   metrics: {keep_dir / 'demo.json'} (temp workdir removed)")
    return rows


def main(argv=None) -> int:
    ns = parse_args(argv)
    t0 = time.time()
    rows = run(ns)
    ok = all(r["match"] and r["files_equal"] for r in rows)
    _say(f"done in {time.time() - t0:.0f}s: engine output {'matched' if ok else 'DID NOT match'} the trainer's "
         f"at every version")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
