"""A model-based differential test of an engine's weight updates, on a real sglang server (issue 19).

Role: one sequence generator, model and oracle, shared by the TP=2, PP=2 and DP=2 modules (each
runs it on its own shared server: ``run_model_sequences(server, ...)``). A seeded RNG draws a
sequence of steps:

- ``pull``: publish the run's next version (xor, overwrite or sparse-v1) if the local checkpoint
  already holds the newest, then ``/pull_weights`` the newest;
- ``update``: ``/update_weights_from_pulled`` of what the local checkpoint holds;
- ``disk_other``: ``/update_weights_from_disk`` of another dir (new bytes, no marker);
- ``new_run``: a new run under the same source path (its newest version at, above or at 1 below
  the served one), pulled and updated;
- ``seed_replaced``: the engine's seed dir replaced in place by another model, then a new run
  from it, pulled and updated;
- ``reseed_full`` / ``reseed_anchor``: a new run whose newest version is a full version / a delta
  with a side anchor, so the pull reseeds from it; then updated;
- ``fault``: a one-shot fault file for one rank, drawn at random (mid-scatter; or mid-restore
  after a mid-scatter fault on another rank), then pull + update;
- ``kill_helper``: every rank's pull helper killed: mid-pull where the server has a pre-read hook
  gate (the pull is held at the hook), else between pulls; then pull + update;
- ``reload_fault``: another path served, then an update (which must reload) with one rank's
  reload failing once (repeated on every rank) or twice (a failure; then the retry);
- ``other_writer``: another writer of the engine's weights (sglang's reload of another dir, its
  ``/weights_checker reset_tensors``, or release and resume of memory occupation) lands between
  two steps of an update's transaction, generation paused: before the vote, between the vote and
  the apply (or the reload), or between the apply and the commit (held there by the tokenizer's
  test gate, ``WEIGHTSYNC_TEST_TXN_GATE``, where the server has one; else between the pull and the
  update). The update must end with every rank on the target (issue 28).

The model tracks which bytes the engine must hold (a content hash of the published tensors) and
the version it may claim. After every step: every rank's ``/weights_digest`` either equals the
previous step's (a call that failed, or no update), or the step's update succeeded; each rank's
live version is the one the model allows (or unknown). At the end the oracle reloads a dir holding
exactly each content seen (``/update_weights_from_disk``: the digest the engine reports after a
plain reload) and every recorded step's digests must equal the oracle of the content it claims.
The digests are blake2b of each rank's parameter bytes as sglang laid them out (TP shards, fused
qkv/gate_up, padded vocab, post-load transforms), so they are not computable from the checkpoint:
a reload is the oracle.

Profiles: by default 2 sequences of 10 steps (every step kind once, shuffled; about 40 s on a
2-core box); ``WEIGHTSYNC_LIVE_MODEL_STEPS=N`` runs N steps per sequence and
``WEIGHTSYNC_LIVE_MODEL_SEQUENCES=M`` M sequences (``WEIGHTSYNC_LIVE_MODEL_SEED_BASE=B`` shifts
their seeds by B, away from CI's); ``WEIGHTSYNC_LIVE_MODEL_SEED=S`` replays sequence seed S. A failure prints the seed and every step taken so far.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

STEPS_ENV = "WEIGHTSYNC_LIVE_MODEL_STEPS"
SEQUENCES_ENV = "WEIGHTSYNC_LIVE_MODEL_SEQUENCES"
SEED_ENV = "WEIGHTSYNC_LIVE_MODEL_SEED"
SEED_BASE_ENV = "WEIGHTSYNC_LIVE_MODEL_SEED_BASE"  # another set of sequences than CI's

KINDS = ("pull", "update", "disk_other", "new_run", "seed_replaced", "reseed_full", "reseed_anchor", "fault",
         "kill_helper", "reload_fault", "other_writer")
ENCODINGS = ("xor", "overwrite", "sparse-v1")


# The default profile: 2 sequences of one round each (every kind once per sequence, in two
# orders). Measured on the 2-core box with the post-update proof: 18 steps and their oracle
# reloads take 25 s at TP=2, 33-47 s at DP=2 and about 38 s at PP=2, so one round is ~20 s a
# sequence (CI allows ~60 s per module).
DEFAULT_SEQUENCES = 2
DEFAULT_STEPS = len(KINDS)


def profile(default_seed: int) -> tuple[list[int], int]:
    """(sequence seeds, steps per sequence) from the environment."""
    steps = int(os.environ.get(STEPS_ENV) or DEFAULT_STEPS)
    if os.environ.get(SEED_ENV):
        return [int(os.environ[SEED_ENV])], steps
    n = int(os.environ.get(SEQUENCES_ENV) or DEFAULT_SEQUENCES)
    base = default_seed + int(os.environ.get(SEED_BASE_ENV) or 0)
    return [base + i for i in range(n)], steps


def draw_kinds(rng: random.Random, steps: int) -> list[str]:
    """Rounds of every kind once, shuffled (so the short profile covers each), cut to ``steps``."""
    out: list[str] = []
    while len(out) < steps:
        round_ = list(KINDS)
        rng.shuffle(round_)
        out += round_
    return out[:steps]


def content_key(tensors: dict) -> str:
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RunFeed:
    """One run of a source dir, published from the seed dir as it is now (version 0)."""

    def __init__(self, number: int, seed_dir: str, source_dir: str, seed: int, names) -> None:
        from testbed.feed import VersionFeed

        shutil.rmtree(source_dir, ignore_errors=True)  # a new run under the same path
        self.number = number
        self.feed = VersionFeed(seed_dir, source_dir, seed=seed)
        self.names = names
        self.top = 0
        self.kinds: dict[int, str] = {0: "seed"}

    @property
    def source_dir(self) -> str:
        return self.feed.source_dir

    def publish_next(self, kind: str) -> int:
        """Publish ``top + 1`` as ``kind``: an encoding, ``full`` or ``anchor`` (a delta with a side anchor)."""
        from weightsync import Publisher
        from testbed.tiny_qwen3 import perturb_state_dict, to_raw_tensors

        version = self.top + 1
        previous = self.feed.expected[version - 1]
        tensors = perturb_state_dict(previous, version, seed=self.feed.seed, names=self.names)
        encoding = kind if kind in ENCODINGS else "xor"
        publisher = Publisher(self.source_dir, encoding=encoding, template_dir=self.feed.model_dir,
                              anchor_max_deltas=1 if kind == "anchor" else 0, anchor_fraction=0.0)
        try:
            publisher.seed_snapshot(to_raw_tensors(previous), version=version - 1)
            publisher.publish(version, to_raw_tensors(tensors), full=True if kind == "full" else None)
        finally:
            publisher.close()
        self.feed.expected[version] = tensors
        self.top = version
        self.kinds[version] = kind
        return version


@dataclass
class Served:
    """What the engine must hold: a content, and the version number it may claim for it (None: none)."""

    key: str
    version: Optional[int]
    label: str


@dataclass
class Record:
    step: int
    what: str
    key: str  # the content the engine must hold after the step
    label: str
    digests: dict


@dataclass
class Sequence:
    """One sequence's state: the model of the engine, and everything it needs to run steps."""

    server: Any
    root: Path
    seed_dir: str
    local: str
    source_dir: str
    ranks: list
    rng: random.Random
    names: Any
    gate: Optional[Path]
    faults: Path
    model_kwargs: dict
    template: Path
    contents: dict = field(default_factory=dict)  # content key -> tensors
    log: list = field(default_factory=list)
    records: list = field(default_factory=list)
    run: Optional[RunFeed] = None
    runs: int = 0
    local_holds: Optional[tuple] = None  # (run number, version) the local checkpoint verifiably holds
    served: Optional[Served] = None
    alternative: Optional[Served] = None  # after a failed update: the target, if the engine reloaded it and says so
    last_digests: Optional[dict] = None
    counts: dict = field(default_factory=dict)
    txn_gate: Optional[Path] = None  # the tokenizer's transaction gate (WEIGHTSYNC_TEST_TXN_GATE), if the server has one
    writers: tuple = ("reload", "reset_tensors", "release_resume")  # a writer the server refuses is dropped

    def note(self, line: str) -> None:
        self.log.append(line)

    def describe(self) -> str:
        return "\n".join(f"  {line}" for line in self.log)


# --- the engine calls ---------------------------------------------------------------------------


def post(seq: Sequence, route: str, body: dict):
    resp = seq.server.post(route, body, timeout=300)
    try:
        data = resp.json()
    except ValueError:
        data = {"text": resp.text}
    return resp.status_code, data


def digests(seq: Sequence) -> dict:
    from testbed.live import weights_digest

    return weights_digest(seq.server)


def write_checkpoint(seq: Sequence, directory: Path, tensors: dict) -> str:
    """An HF checkpoint dir holding exactly ``tensors`` (the seed's config, tokenizer and shard layout)."""
    from safetensors.torch import save_file

    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(seq.template, directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards: dict[str, dict] = {}
    for name, file in index["weight_map"].items():
        shards.setdefault(file, {})[name] = tensors[name].contiguous()
    for file, part in shards.items():
        save_file(part, str(directory / file), metadata={"format": "pt"})
    return str(directory)


def remember(seq: Sequence, tensors: dict) -> str:
    key = content_key(tensors)
    seq.contents.setdefault(key, tensors)
    return key


def pull(seq: Sequence, version: int, *, may_fail: bool = False) -> bool:
    status, body = post(seq, "/pull_weights", {"local_checkpoint_dir": seq.local, "source_dir": seq.run.source_dir,
                                               "target_version": version})
    seq.note(f"  pull v{version} of run {seq.run.number} ({seq.run.kinds[version]}): {status} "
             f"{body.get('error_type') or body.get('hosts', [{}])[0].get('action', '')}")
    if status == 200:
        seq.local_holds = (seq.run.number, version)
        return True
    assert may_fail, f"pull v{version} failed unexpectedly: {status} {body}"
    seq.local_holds = None  # the marker names only verified bytes; the next pull finds out
    return False


def update(seq: Sequence, *, fault_pending: bool = False) -> None:
    """``/update_weights_from_pulled`` of what the local checkpoint holds, and the model's verdict."""
    holds = seq.local_holds
    target = holds[1] if holds else seq.run.top
    status, body = post(seq, "/update_weights_from_pulled", {"local_checkpoint_dir": seq.local, "target_version": target})
    seq.note(f"  update v{target}: {status} mode={body.get('mode')} rolled_back={body.get('rolled_back')} "
             f"scattered={body.get('elements_scattered')} reason={body.get('reason') or body.get('message')!r}"[:400])
    if status == 200:
        served_after_success(seq, body, target)
        return
    expected_failure = (fault_pending and status == 500) or (holds is None and status == 400)
    assert expected_failure, f"update v{target} failed unexpectedly: {status} {body}"
    assert body.get("success") is False, body
    # Failed: the engine still holds what it held (checked against the previous digests), unless a
    # rank that could not restore reloaded the local dir, and then it must claim the target.
    if holds is not None and holds[0] == seq.run.number:
        seq.alternative = Served(remember(seq, seq.run.feed.expected[target]), target,
                                 f"run {seq.run.number} v{target} (reloaded after a failed update)")


def served_after_success(seq: Sequence, body: dict, target: int) -> None:
    holds = seq.local_holds
    assert body.get("success") is True and body.get("weight_version") == target, body
    assert holds is not None and holds[0] == seq.run.number, f"a success for v{target} the local dir does not hold"
    seq.served = Served(remember(seq, seq.run.feed.expected[target]), target, f"run {seq.run.number} v{target}")


# --- the steps ----------------------------------------------------------------------------------


def step_pull(seq: Sequence) -> None:
    if seq.local_holds == (seq.run.number, seq.run.top):
        seq.run.publish_next(seq.rng.choice(ENCODINGS))
    pull(seq, seq.run.top)


def step_update(seq: Sequence) -> None:
    if seq.local_holds is None or seq.local_holds[0] != seq.run.number:
        pull(seq, seq.run.top)
    update(seq)


def step_disk_other(seq: Sequence) -> None:
    from testbed.tiny_qwen3 import perturb_state_dict

    base = seq.contents[seq.served.key]
    tensors = perturb_state_dict(base, seq.rng.randrange(1, 10**6), seed=seq.rng.randrange(10**6))
    path = write_checkpoint(seq, seq.root / "other_path", tensors)
    status, body = post(seq, "/update_weights_from_disk", {"model_path": path})
    seq.note(f"  update_weights_from_disk {path}: {status}")
    assert status == 200 and body.get("success") is not False, body
    seq.served = Served(remember(seq, tensors), None, "another path")


def start_run(seq: Sequence, publish: list) -> None:
    seq.runs += 1
    seq.run = RunFeed(seq.runs, seq.seed_dir, seq.source_dir, seq.rng.randrange(10**6), seq.names)
    for kind in publish:
        seq.run.publish_next(kind)
    seq.note(f"  run {seq.runs} under {seq.source_dir}: v1..v{seq.run.top} {publish}")


def step_new_run(seq: Sequence) -> None:
    served = seq.served.version or 0
    top = seq.rng.choice([max(served, 1), served + 1, max(served - 1, 1)])
    start_run(seq, [seq.rng.choice(ENCODINGS) for _ in range(top)])
    pull(seq, seq.run.top)
    update(seq)


def step_seed_replaced(seq: Sequence) -> None:
    from testbed.tiny_qwen3 import make_tiny_qwen3

    fresh = make_tiny_qwen3(seq.root / "fresh_seed", seed=seq.rng.randrange(1, 10**6), **seq.model_kwargs)
    for name in sorted(os.listdir(fresh)):  # in place: same names, new files
        src = os.path.join(fresh, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(seq.seed_dir, name + ".tmp"))
            os.replace(os.path.join(seq.seed_dir, name + ".tmp"), os.path.join(seq.seed_dir, name))
    seq.note(f"  seed dir {seq.seed_dir} replaced in place")
    start_run(seq, [seq.rng.choice(ENCODINGS) for _ in range(seq.rng.randint(1, 2))])
    pull(seq, seq.run.top)
    update(seq)


def step_reseed(seq: Sequence, kind: str) -> None:
    start_run(seq, [seq.rng.choice(ENCODINGS), kind])
    pull(seq, seq.run.top)
    update(seq)


def step_fault(seq: Sequence) -> None:
    from testbed.live import wait_until_map_proven

    wait_until_map_proven(seq.server)  # a fault fires only mid-scatter: give live apply its map
    if seq.local_holds == (seq.run.number, seq.run.top) or seq.local_holds is None:
        seq.run.publish_next(seq.rng.choice(ENCODINGS))
    pull(seq, seq.run.top)
    rank = seq.rng.choice(seq.ranks)
    files = [seq.faults / ("live-apply-fault-" + rank.replace("/", "_"))]
    others = [r for r in seq.ranks if r != rank]
    if others and seq.rng.random() < 0.3:  # and the restore of another rank fails too
        files.append(seq.faults / ("live-restore-fault-" + seq.rng.choice(others).replace("/", "_")))
    for f in files:
        f.touch()
    seq.note(f"  fault files {[f.name for f in files]}")
    try:
        update(seq, fault_pending=True)
    finally:
        left = [f.name for f in files if f.exists()]
        for f in files:
            f.unlink(missing_ok=True)
    seq.note(f"  fault files not consumed (no scatter reached them): {left}")


def step_reload_fault(seq: Sequence) -> None:
    """An update that must reload (the engine serves another path first), and one rank's reload
    fails: once (repeated on every rank: a success that says so) or twice (a failure that says
    the ranks differ; the retry brings every rank to the target)."""
    step_disk_other(seq)
    if seq.local_holds is None or seq.local_holds[0] != seq.run.number:
        pull(seq, seq.run.top)
    target = seq.local_holds[1]
    rank, times = seq.rng.choice(seq.ranks), seq.rng.choice([1, 2])
    fault = seq.faults / ("live-reload-fault-" + rank.replace("/", "_"))
    fault.write_text(str(times))
    try:
        status, body = post(seq, "/update_weights_from_pulled", {"local_checkpoint_dir": seq.local,
                                                                 "target_version": target})
    finally:
        fault.unlink(missing_ok=True)
    seq.note(f"  update v{target} with {rank}'s reload failing {times}x: {status} mode={body.get('mode')} "
             f"reason={body.get('reason') or body.get('message')!r}"[:400])
    if times == 1:
        assert status == 200 and body.get("mode") == "reload", body
        assert f"the reload failed on some rank ({rank}: injected reload fault" in body.get("reason", ""), body
        served_after_success(seq, body, target)
        return
    assert status == 500 and body.get("success") is False, body
    assert "failed twice" in body.get("message", "") and "retry" in body.get("message", ""), body
    update(seq)  # the retry


def helper_pids(seq: Sequence) -> list:
    import psutil

    out = []
    for child in psutil.Process(seq.server.proc.pid).children(recursive=True):
        try:
            if "sglang_patch.pull.process" in " ".join(child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            continue
    return out


def kill_helpers(seq: Sequence) -> list:
    import signal

    pids = helper_pids(seq)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # SIGKILL lands when the kernel next runs the process: until its parent can reap it, the
    # engine's liveness check (poll) still sees it alive, and a pull sent to it now is a death
    # mid-pull. A killed leader shows as a zombie while its other threads still exit (one may
    # sit in an fsync of a deferred flush), and waitpid waits for them: so wait until the zombie
    # is alone in its thread group.
    deadline = time.monotonic() + 30
    for pid in pids:
        while time.monotonic() < deadline and not _reapable(pid):
            time.sleep(0.02)
    return pids


def _reapable(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def step_kill_helper(seq: Sequence) -> None:
    version = seq.run.publish_next(seq.rng.choice(ENCODINGS))
    if seq.gate is None:
        seq.note(f"  killed the idle pull helpers {kill_helpers(seq)}")
        pull(seq, version)
        update(seq)
        return
    started = seq.gate / f"started-{version}"
    started.unlink(missing_ok=True)
    (seq.gate / "release").unlink()
    reply: dict = {}
    thread = threading.Thread(target=lambda: reply.setdefault("ok", pull(seq, version, may_fail=True)))
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline, "the pull never reached its pre-read hook"
            time.sleep(0.05)
        seq.note(f"  killed the pull helpers mid-pull {kill_helpers(seq)}")
    finally:
        (seq.gate / "release").touch()
    thread.join(300)
    assert not thread.is_alive(), "the pull got no reply after its helpers were killed"
    pull(seq, version)  # a new helper starts
    update(seq)


# Where another writer lands: the phases held (the first the transaction reaches is where it
# waits; after a vote for reload the reload phase comes next, after a failed apply the rollback).
WRITER_WINDOWS = {
    "before the vote": ("vote",),
    "between the vote and the apply": ("apply", "reload"),
    "between the apply and the commit": ("commit", "rollback", "reload"),
}


def write_weights_as_another_writer(seq: Sequence) -> str:
    """One of sglang's other writers of the weights; what it did."""
    while True:
        writer = seq.rng.choice(seq.writers)
        if writer == "reload":
            from testbed.tiny_qwen3 import perturb_state_dict

            tensors = perturb_state_dict(seq.contents[seq.served.key], seq.rng.randrange(1, 10**6),
                                         seed=seq.rng.randrange(10**6))
            path = write_checkpoint(seq, seq.root / "other_writer", tensors)
            status, body = post(seq, "/update_weights_from_disk", {"model_path": path})
            assert status == 200 and body.get("success") is not False, body
            return f"update_weights_from_disk {path}"
        if writer == "reset_tensors":
            status, body = post(seq, "/weights_checker", {"action": "reset_tensors"})
            assert status == 200, body
            return "weights_checker reset_tensors"
        status, body = post(seq, "/release_memory_occupation", {})
        if status != 200:  # not on this build: never drawn again
            seq.writers = tuple(w for w in seq.writers if w != writer)
            seq.note(f"  release_memory_occupation refused ({status}): dropped from the writers")
            continue
        status, body = post(seq, "/resume_memory_occupation", {})
        assert status == 200, f"resume_memory_occupation after a release: {status} {body}"
        return "release + resume_memory_occupation"


def step_other_writer(seq: Sequence) -> None:
    """Another writer between two steps of an update's transaction, paused; every rank must end
    on the target (the transaction reloads it when it finds the weights moved)."""
    from testbed.live import wait_until_map_proven

    wait_until_map_proven(seq.server)  # so that the update would go live but for the writer
    if seq.local_holds == (seq.run.number, seq.run.top) or seq.local_holds is None:
        seq.run.publish_next(seq.rng.choice(ENCODINGS))
    pull(seq, seq.run.top)
    target = seq.local_holds[1]
    if seq.txn_gate is None:  # no gate: between the pull (and its staging) and the update
        seq.note(f"  {write_weights_as_another_writer(seq)} between the pull and the update")
        update(seq)
        return
    window = seq.rng.choice(sorted(WRITER_WINDOWS))
    holds = [seq.txn_gate / f"hold-{phase}" for phase in WRITER_WINDOWS[window]]
    reached = [seq.txn_gate / f"at-{phase}" for phase in WRITER_WINDOWS[window]]
    status, body = post(seq, "/pause_generation", {"mode": "in_place"})
    assert status == 200, body
    reply: dict = {}
    thread, where = None, None
    try:
        for f in reached:
            f.unlink(missing_ok=True)
        for f in holds:
            f.touch()
        thread = threading.Thread(target=lambda: reply.setdefault("r", post(
            seq, "/update_weights_from_pulled", {"local_checkpoint_dir": seq.local, "target_version": target})))
        thread.start()
        deadline = time.monotonic() + 120
        while not any(f.exists() for f in reached) and thread.is_alive():
            assert time.monotonic() < deadline, f"the update never reached {window}"
            time.sleep(0.02)
        where = next((f.name[len("at-"):] for f in reached if f.exists()), None)
        what = write_weights_as_another_writer(seq)
        seq.note(f"  {what} {'held before the ' + where if where else 'after the update (no phase reached)'} "
                 f"({window})")
    finally:
        for f in holds:
            f.unlink(missing_ok=True)
        if thread is not None:
            thread.join(300)
        status_c, body_c = post(seq, "/continue_generation", {})
    assert not thread.is_alive(), "the update got no reply"
    assert status_c == 200, body_c
    status, body = reply["r"]
    seq.note(f"  update v{target}: {status} mode={body.get('mode')} reason={body.get('reason') or body.get('message')!r}"[:400])
    if where is None:  # the writer came after the reply: the engine holds the writer's bytes
        assert status == 200 and body.get("weight_version") == target, body
        update(seq)  # and the next update brings the target back (the live version is unknown)
        return
    assert status == 200 and body.get("success") is True and body.get("weight_version") == target, body
    assert body.get("mode") == "reload", f"a {body.get('mode')} success over weights another writer moved: {body}"
    served_after_success(seq, body, target)


STEPS: dict[str, Callable[[Sequence], None]] = {
    "pull": step_pull,
    "update": step_update,
    "disk_other": step_disk_other,
    "new_run": step_new_run,
    "seed_replaced": step_seed_replaced,
    "reseed_full": lambda seq: step_reseed(seq, "full"),
    "reseed_anchor": lambda seq: step_reseed(seq, "anchor"),
    "fault": step_fault,
    "kill_helper": step_kill_helper,
    "reload_fault": step_reload_fault,
    "other_writer": step_other_writer,
}


# --- the checks ---------------------------------------------------------------------------------


def check_step(seq: Sequence, step: int, what: str, before: Served) -> None:
    """The immediate checks: ranks agree on their claim, an unchanged content means unchanged digests."""
    now = digests(seq)
    assert sorted(now) == seq.ranks, sorted(now)
    claims = {r["live_version"] for r in now.values()}
    assert len(claims) == 1, f"the ranks claim different live versions: { {k: r['live_version'] for k, r in now.items()} }"
    [claim] = claims
    alternative, seq.alternative = seq.alternative, None
    if alternative is not None and claim == alternative.version and claim != seq.served.version:
        seq.served = alternative
    served = seq.served
    assert claim in (None, served.version), (
        f"the engine claims v{claim}; the model allows {served.version} ({served.label}) or unknown")
    if served.key == before.key:
        from testbed.live import assert_same_weights

        assert_same_weights(now, seq.last_digests)  # no update landed (or one failed): not one byte moved
    seq.records.append(Record(step, what, served.key, served.label, now))
    seq.last_digests = now


def check_against_oracle(seq: Sequence) -> int:
    """Reload a dir holding each content seen; every step's digests must equal its content's reload."""
    from testbed.live import assert_same_weights

    oracle: dict[str, dict] = {}
    for n, key in enumerate(dict.fromkeys(r.key for r in seq.records)):
        path = write_checkpoint(seq, seq.root / f"oracle_{n}", seq.contents[key])
        status, body = post(seq, "/update_weights_from_disk", {"model_path": path})
        assert status == 200, body
        oracle[key] = digests(seq)
    for r in seq.records:
        try:
            assert_same_weights(r.digests, oracle[r.key])
        except AssertionError as exc:
            raise AssertionError(f"after step {r.step} ({r.what}) the engine should hold {r.label}: {exc}") from None
    return len(oracle)


def run_sequence(seq: Sequence, kinds: list) -> None:
    from testbed.tiny_qwen3 import read_state_dict

    # A known start: a reload of the seed dir as it is now (v0, or unknown after a replaced seed).
    status, body = post(seq, "/update_weights_from_disk", {"model_path": seq.seed_dir})
    assert status == 200, body
    start_run(seq, [])
    seq.served = Served(remember(seq, read_state_dict(seq.seed_dir)), 0, "the seed dir")
    seq.note("start: reload of the seed dir")
    seq.last_digests = digests(seq)
    seq.records.append(Record(0, "start", seq.served.key, seq.served.label, seq.last_digests))
    for step, kind in enumerate(kinds, 1):
        seq.note(f"step {step}: {kind}")
        before = seq.served
        STEPS[kind](seq)
        seq.counts[kind] = seq.counts.get(kind, 0) + 1
        check_step(seq, step, kind, before)


def run_model_sequences(server: Any, *, root: Path, seed_dir: str, local: str, faults: Path, default_seed: int,
                        gate: Optional[Path] = None, names=None, model_kwargs: Optional[dict] = None,
                        txn_gate: Optional[Path] = None) -> dict:
    """Run the profile's sequences on ``server``; returns what ran (for the test's report).
    ``txn_gate``: the server's ``WEIGHTSYNC_TEST_TXN_GATE`` dir, if any (``other_writer`` then lands
    inside the transaction)."""
    seeds, steps = profile(default_seed)
    template = root / "template"
    shutil.rmtree(template, ignore_errors=True)
    template.mkdir(parents=True)
    for name in os.listdir(seed_dir):
        if os.path.isfile(os.path.join(seed_dir, name)) and not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(seed_dir, name), template / name)
    ranks = sorted(digests_of(server))
    totals = {"sequences": 0, "steps": 0, "contents": 0, "kinds": {}}
    for seed in seeds:
        rng = random.Random(seed)
        kinds = draw_kinds(rng, steps)
        seq = Sequence(server=server, root=root, seed_dir=seed_dir, local=local, source_dir=str(root / "model_src"),
                       ranks=ranks, rng=rng, names=names, gate=gate, faults=faults, model_kwargs=model_kwargs or {},
                       template=template, txn_gate=txn_gate)
        t0 = time.monotonic()
        try:
            run_sequence(seq, kinds)
            contents = check_against_oracle(seq)
        except BaseException as exc:
            print(f"\n[live model] sequence seed {seed} failed (replay: {SEED_ENV}={seed} {STEPS_ENV}={steps}); "
                  f"steps {kinds}:\n{seq.describe()}")
            raise AssertionError(f"sequence seed {seed}: {exc}\nsteps taken:\n{seq.describe()}") from exc
        totals["sequences"] += 1
        totals["steps"] += len(kinds)
        totals["contents"] += contents
        for k, v in seq.counts.items():
            totals["kinds"][k] = totals["kinds"].get(k, 0) + v
        print(f"\n[live model] seed {seed}: {len(kinds)} steps, {contents} contents checked by reload, "
              f"{time.monotonic() - t0:.1f}s\n{seq.describe()}")
    return totals


def digests_of(server: Any) -> dict:
    from testbed.live import weights_digest

    return weights_digest(server)
