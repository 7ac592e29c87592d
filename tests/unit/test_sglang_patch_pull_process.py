"""A rank's pull runs in a helper process of its own (sglang_patch.pull.process), tested with
real processes and real pulls, without sglang: where it runs and on which CPUs, what a killed
or cancelled helper reports, that the local checkpoint stays honest and the next pull recovers,
and the fallback to the scheduler process when no helper can start."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import weightsync
from sglang_patch.pull import process as pull_process
from sglang_patch.live.mapping.stage import Placement, StageJob, stage_job
from sglang_patch.pull.process import HelperRankPuller
from sglang_patch.pull.rank import RankPuller
from sglang_patch.server_flags import PullWeightsOptions
from weightsync.errors import LockTimeoutError

from core_support import assert_checkpoint_is, marker_version, tensor_bytes, write_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GATE_HOOK = "testbed.hooks.record_pre_read"


@pytest.fixture
def world(fast_tmp_path, rng, monkeypatch):
    """A seed model, a source with v1 and v2, and a request factory (all below one allowed root)."""
    root = fast_tmp_path
    seed, source, local = str(root / "model"), str(root / "source"), str(root / "local")
    v0 = {f"w{i}": np.frombuffer(rng.bytes(4096 * 2), dtype=np.uint16).reshape(64, 64).copy() for i in range(4)}
    write_hf_checkpoint(seed, v0)
    pub = weightsync.Publisher(source, template_dir=seed)
    pub.seed_snapshot(v0)
    versions = {0: v0}
    cur = v0
    for v in (1, 2):
        cur = {n: a.copy() for n, a in cur.items()}
        for a in cur.values():
            a.reshape(-1)[rng.integers(0, a.size, 40)] ^= np.uint16(1)
        pub.publish(v, cur)
        versions[v] = cur
    pub.close()
    gate = root / "gate"
    monkeypatch.setenv("TESTBED_PRE_READ_HOOK_GATE", str(gate))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))

    def request(version: int):
        return SimpleNamespace(local_checkpoint_dir=local, source_dir=source, target_version=version)

    def puller(hook: str | None = None, **kwargs) -> HelperRankPuller:
        options = PullWeightsOptions(pre_read_hook=hook, allowed_roots=(str(root),))
        return HelperRankPuller(RankPuller(options=options, seed_dir=seed, host="h/node0", rank="dp0/tp0"), **kwargs)

    return SimpleNamespace(root=root, seed=seed, source=source, local=local, versions=versions, gate=gate,
                           request=request, puller=puller)


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_local_holds(world, version: int) -> None:
    assert_checkpoint_is(world.local, tensor_bytes(world.versions[version]))


def test_the_pull_runs_in_a_helper_process_on_the_engine_cpus_not_the_schedulers(world):
    puller = world.puller(cpus=pull_process.engine_cpus())
    try:
        report = puller(world.request(1))
        assert report.success and report.applied_version == 1, report
        ready = puller.helper_info()
        assert ready is not None and ready.pid != os.getpid()
        assert ready.cpus == pull_process.engine_cpus()
        assert_local_holds(world, 1)
        report = puller(world.request(2))  # the same helper serves the next pull
        assert report.success and puller.helper_info().pid == ready.pid
        assert_local_holds(world, 2)
    finally:
        puller.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind the scheduler to one")
def test_a_scheduler_bound_to_one_core_still_pulls_on_every_engine_cpu(world):
    """sglang binds each scheduler to its OMP cores after our module captured the engine's CPUs;
    threads would inherit the binding, the helper does not."""
    code = (
        "import os, sys, json, types; sys.path[:0] = [%r];"
        "from sglang_patch.pull import process as pull_process;"  # captures the engine's CPUs first, as the scheduler does
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from sglang_patch.pull.rank import RankPuller; from sglang_patch.server_flags import PullWeightsOptions;"
        "h = pull_process.HelperRankPuller(RankPuller(options=PullWeightsOptions(), seed_dir=None, host='h', rank='r'));"
        "r = h(types.SimpleNamespace(local_checkpoint_dir='/x', source_dir='/y', target_version=1));"
        "assert r.error_type == 'forbidden', r;"  # refused (no allowed roots), by the helper
        "print(json.dumps([sorted(os.sched_getaffinity(0)), h.helper_info().cpus])); h.close()"
    ) % ROOT
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    scheduler_cpus, helper_cpus = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(scheduler_cpus) == 1
    assert helper_cpus == sorted(os.sched_getaffinity(0))


def test_a_killed_helper_is_a_typed_failure_and_the_next_pull_recovers_exactly(world):
    first = world.puller()
    assert first(world.request(1)).success
    first.close()
    puller = world.puller(hook=GATE_HOOK)
    try:
        box: list = []
        t = threading.Thread(target=lambda: box.append(puller(world.request(2))))
        t.start()
        wait_for(lambda: (world.gate / "started-2").exists())
        pid = puller.helper_info().pid
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        report = box[0]
        assert not report.success
        assert report.error_type == "pull_worker_died" and report.http_status == 500
        assert f"pid {pid}" in report.message and "signal 9" in report.message
        assert report.applied_version == 1  # the marker names what the host verifiably holds
        (world.gate / "release").touch()
        report = puller(world.request(2))
        assert report.success and report.applied_version == 2, report
        assert puller.helper_info().pid != pid
        assert_local_holds(world, 2)
    finally:
        (world.gate / "release").touch()
        puller.close()


def test_cancel_kills_the_running_pull_and_reports_the_given_error(world):
    puller = world.puller(hook=GATE_HOOK)
    try:
        box: list = []
        t = threading.Thread(target=lambda: box.append(puller(world.request(1))))
        t.start()
        wait_for(lambda: (world.gate / "started-1").exists())
        pid = puller.helper_info().pid
        assert puller.cancel(LockTimeoutError("/x/.weight_sync/lock", 5.0))
        t.join(30)
        assert not t.is_alive()
        report = box[0]
        assert not report.success and report.error_type == "conflict" and "/x/.weight_sync/lock" in report.message
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), timeout_s=10)
        assert weightsync.applied_version(world.local) is None  # nothing verified, nothing claimed
        (world.gate / "release").touch()
        assert puller(world.request(1)).success
        assert_local_holds(world, 1)
    finally:
        (world.gate / "release").touch()
        puller.close()


def test_no_helper_means_the_pull_runs_in_the_calling_process_and_says_so(world, monkeypatch):
    monkeypatch.setattr(pull_process.sys, "executable", "/bin/false")
    puller = world.puller()
    try:
        report = puller(world.request(1))
        assert report.success and report.applied_version == 1
        assert "pulled in the scheduler process" in report.reason and "did not start" in report.reason
        assert_local_holds(world, 1)
    finally:
        puller.close()


def test_the_in_process_switch_keeps_the_pull_in_the_scheduler_process(world, monkeypatch):
    monkeypatch.setenv(pull_process.IN_PROCESS_ENV, "1")
    puller = pull_process.make_rank_puller(world.puller().puller)
    report = puller(world.request(1))
    assert report.success and puller.helper_info() is None and puller._helper is None
    assert_local_holds(world, 1)


@pytest.mark.parametrize("in_process", [False, True])
def test_the_after_pull_hook_runs_in_the_calling_process_after_each_success_only(world, in_process):
    calls: list = []
    puller = world.puller()
    puller.on_verified = lambda local, source, version, stager: calls.append((os.getpid(), local, source, version))
    puller.in_process = in_process
    try:
        assert puller(world.request(1)).success
        assert calls == [(os.getpid(), os.path.realpath(world.local), os.path.realpath(world.source), 1)]
        assert not puller(world.request(7)).success  # not published: no hook
        assert len(calls) == 1
        puller.on_verified = lambda *a: 1 / 0  # a failing hook cannot fail the pull
        assert puller(world.request(2)).success
    finally:
        puller.close()


def _identity_job(world, from_version: int, to_version: int, **kwargs) -> StageJob:
    # each checkpoint tensor is one parameter of the same name, element for element; w3 is split
    # in two boxes over two parameters, and w2 is ignored on this rank
    n = 64 * 64
    placements = {f"w{i}": [Placement(f"w{i}", f"p{i}", (n,), 0, (1,), 0, (1,))] for i in (0, 1)}
    placements["w3"] = [Placement("w3", "p3a", (32, 64), 0, (64, 1), 0, (64, 1)),
                        Placement("w3", "p3b", (64, 32), 32, (64, 1), 0, (32, 1))]
    fields = dict(local_checkpoint_dir=world.local, source_dir=world.source, from_version=from_version,
                  to_version=to_version, max_elements=10**6, placements=placements, unused=["w2"], reload_only={})
    fields.update(kwargs)
    return StageJob(**fields)


@pytest.mark.parametrize("in_process", [False, True])
def test_staging_in_the_helper_hands_back_exactly_what_staging_here_computes(world, in_process):
    seen: list = []

    early: list = []

    def on_verified(local, source, version, stager):
        job = _identity_job(world, version - 1, version)
        reply, patches = stager(job, lambda ready: early.append((ready, [p.index.copy() for p in ready])))
        here_reply, here = stage_job(job)
        seen.append((reply, patches, here_reply, here))

    puller = world.puller(on_verified=on_verified, in_process=in_process)
    try:
        assert puller(world.request(1)).success
        reply, patches, here_reply, here = seen[0]
        assert reply.refused is None and reply.error is None, reply
        assert (reply.elements, reply.tensors) == (here_reply.elements, here_reply.tensors) and reply.elements > 0
        assert [(p.param, p.dtype) for p in patches] == [(p.param, p.dtype) for p in here]
        for got, want in zip(patches, here):
            assert np.array_equal(got.index, want.index) and np.array_equal(got.values, want.values)
        if in_process:
            assert early == []  # the values come with the positions
        else:  # the positions came first, complete, in the very patches the values then filled
            ((ready, indexes),) = early
            assert ready is patches and all(np.array_equal(i, p.index) for i, p in zip(indexes, patches))
        # and what they hold is the truth: the changed elements of v0 -> v1 with v1's values
        v0, v1 = world.versions[0], world.versions[1]
        by_param = {p.param: p for p in patches}
        for i in (0, 1):
            changed = np.flatnonzero(v0[f"w{i}"].reshape(-1) != v1[f"w{i}"].reshape(-1))
            assert np.array_equal(by_param[f"p{i}"].index, changed)
            assert np.array_equal(by_param[f"p{i}"].values, v1[f"w{i}"].reshape(-1)[changed])
        assert "p2" not in by_param
        w3 = v1["w3"]
        for name, sl in (("p3a", w3[:32]), ("p3b", w3[:, 32:])):
            if name in by_param:
                flat = np.ascontiguousarray(sl).reshape(-1)
                assert np.array_equal(flat[by_param[name].index], by_param[name].values)
    finally:
        puller.close()


def _memfd_inodes_mapped_here() -> set[int]:
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:weightsync-live-stage" in line}


def test_a_stagings_shared_file_is_written_again_only_once_its_last_view_is_gone(world):
    """The helper writes a staging into the file of an earlier one (its pages already exist)
    only after every view of that file here is gone; a helper that refuses spends the file."""
    gc.collect()
    seen: dict = {}

    def same(patches, want):
        return all(np.array_equal(p.index, w.index) and np.array_equal(p.values, w.values) for p, w in zip(patches, want))

    def on_verified(local, source, version, stager):
        if version == 1:
            seen["first"] = stager(_identity_job(world, 0, 1))[1]
            seen["first_copy"] = [p._replace(index=p.index.copy(), values=p.values.copy()) for p in seen["first"]]
            return
        spare = puller._spare
        assert spare._fd is None  # the first staging's views are alive: nothing may write its file
        second = stager(_identity_job(world, 1, 2))[1]
        assert same(seen["first"], seen["first_copy"])  # untouched by the second
        del seen["first"]
        gc.collect()
        assert spare._fd is not None  # its last view is gone: the file is spare
        first_file = os.fstat(spare._fd).st_ino
        third = stager(_identity_job(world, 0, 2))[1]
        assert spare._fd is None and first_file in _memfd_inodes_mapped_here()
        assert same(third, stage_job(_identity_job(world, 0, 2))[1])
        assert same(second, stage_job(_identity_job(world, 1, 2))[1])
        del second, third
        gc.collect()
        refused, patches = stager(_identity_job(world, 0, 2, max_elements=3))
        assert patches == [] and "more than 3" in refused.refused and spare._fd is None  # spent, not shared
        seen["last"] = same(stager(_identity_job(world, 1, 2))[1], stage_job(_identity_job(world, 1, 2))[1])

    puller = world.puller(on_verified=on_verified)
    try:
        assert puller(world.request(1)).success and puller(world.request(2)).success
        assert seen["last"] is True
    finally:
        puller.close()


def test_a_kept_map_of_a_local_file_sees_it_rewritten_in_place_and_remaps_a_replaced_one(fast_tmp_path):
    from sglang_patch.live.mapping.stage import KeptMaps

    path = str(fast_tmp_path / "model.safetensors")
    with open(path, "wb") as f:
        f.write(b"a" * 8192)
    kept = KeptMaps().begin(str(fast_tmp_path))
    first = kept.map_of(path)
    with open(path, "r+b") as f:  # as the pull writes: in place
        f.seek(4096)
        f.write(b"b" * 10)
    assert kept.map_of(path) is first and first[4096:4100] == b"bbbb"
    with open(path + ".new", "wb") as f:
        f.write(b"c" * 8192)
    os.replace(path + ".new", path)  # another file at the same path
    again = kept.map_of(path)
    assert again is not first and again[:4] == b"cccc"
    with open(path, "ab") as f:  # the same file, another size
        f.write(b"d" * 4096)
    grown = kept.map_of(path)
    assert grown is not again and len(grown) == 12288
    kept.begin(str(fast_tmp_path / "elsewhere"))  # another dir: the old maps go
    assert grown.closed
    kept.close()


def _deleted_files_mapped(pid: int, under: str) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(None, 5)[5].strip() for line in f
                if line.rstrip().endswith("(deleted)") and under in line]


def test_kept_maps_of_deleted_or_replaced_files_are_dropped_at_the_next_staging(fast_tmp_path):
    from sglang_patch.live.mapping.stage import KeptMaps

    local = fast_tmp_path / "local"
    local.mkdir()
    paths = [str(local / f"model-0000{i}-of-00003.safetensors") for i in (1, 2, 3)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(b"a" * 8192)
    kept = KeptMaps().begin(str(local))
    maps = [kept.map_of(p) for p in paths]
    # a reseed to another layout: one file deleted, one replaced by a new file, one kept as is
    os.unlink(paths[0])
    with open(paths[1] + ".new", "wb") as f:
        f.write(b"b" * 8192)
    os.replace(paths[1] + ".new", paths[1])
    assert len(_deleted_files_mapped(os.getpid(), str(local))) == 2
    kept.begin(str(local))  # the next staging from the same dir
    assert maps[0].closed and maps[1].closed and not maps[2].closed
    assert _deleted_files_mapped(os.getpid(), str(local)) == []
    assert kept.map_of(paths[2]) is maps[2]
    kept.close()


def test_the_pull_helper_unmaps_a_replaced_local_file_after_the_next_pull(world):
    """The helper keeps its maps between stagings; a file the local dir no longer holds (here
    replaced by a copy, as a reseed does) must not stay mapped until the helper exits."""
    staged: list = []

    def on_verified(local, source, version, stager):
        if version == 1:
            staged.append(stager(_identity_job(world, 0, 1))[0])

    puller = world.puller(on_verified=on_verified)
    try:
        assert puller(world.request(1)).success
        assert staged and staged[0].error is None and staged[0].elements > 0, staged
        pid = puller.helper_info().pid
        from weightsync.format.manifest import checkpoint_weight_files

        [name] = checkpoint_weight_files(world.local)
        path = os.path.join(world.local, name)
        with open(path, "rb") as src, open(path + ".copy", "wb") as dst:
            dst.write(src.read())
        os.replace(path + ".copy", path)
        assert len(_deleted_files_mapped(pid, world.local)) == 1  # the helper still maps the old file
        assert puller(world.request(2)).success  # no staging for v2: only the pull itself may drop it
        assert _deleted_files_mapped(pid, world.local) == []
        assert_local_holds(world, 2)
    finally:
        puller.close()


def test_staging_refuses_a_change_past_the_threshold_and_one_to_a_reload_only_tensor(world):
    puller = world.puller(in_process=True)
    assert puller(world.request(1)).success
    reply, patches = stage_job(_identity_job(world, 0, 1, max_elements=3))
    assert patches == [] and "more than 3 changed elements" in reply.refused
    reply, _ = stage_job(_identity_job(world, 0, 1, reload_only={"w1": "w1 is packed after loading"}))
    assert reply.refused == "w1 is packed after loading"


def test_a_closed_helper_finishes_its_deferred_flush_and_exits(world):
    puller = world.puller()
    report = puller(world.request(1))
    assert report.success
    proc = puller._helper.proc
    puller.close()
    proc.wait(timeout=60)
    assert proc.returncode == 0
    assert weightsync.applied_version(world.local) == 1  # the marker was written before it left


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_helper_whose_scheduler_died_mid_pull_exits_instead_of_lingering(world):
    """No orphans: the helper watches its parent even while a pull holds it busy."""
    code = f"""
import sys, threading, time, types
sys.path[:0] = [{ROOT!r}]
from sglang_patch.pull import process as pull_process
from sglang_patch.live.mapping.stage import Placement, StageJob, stage_job
from sglang_patch.pull.rank import RankPuller
from sglang_patch.server_flags import PullWeightsOptions
options = PullWeightsOptions(pre_read_hook={GATE_HOOK!r}, allowed_roots=({str(world.root)!r},))
h = pull_process.HelperRankPuller(RankPuller(options=options, seed_dir={world.seed!r}, host="h", rank="r"))
request = types.SimpleNamespace(local_checkpoint_dir={world.local!r}, source_dir={world.source!r}, target_version=1)
threading.Thread(target=h, args=(request,), daemon=True).start()
while h.helper_info() is None:
    time.sleep(0.02)
print(h.helper_info().pid, flush=True)
time.sleep(600)
"""
    scheduler = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        helper_pid = int(scheduler.stdout.readline())
        wait_for(lambda: (world.gate / "started-1").exists())
        scheduler.kill()
        scheduler.wait(10)
        wait_for(lambda: _is_zombie(helper_pid) or not os.path.exists(f"/proc/{helper_pid}"), timeout_s=30)
    finally:
        world.gate.mkdir(exist_ok=True)
        (world.gate / "release").touch()
        scheduler.kill()


def test_a_second_call_supersedes_an_abandoned_first_one_instead_of_waiting_for_it(world):
    """The coordinator starts a new pull only after giving up on the old one (its deadline): the
    old helper is killed, its caller gets a typed failure, the new pull runs in a fresh helper,
    and their frames never mix."""
    puller = world.puller(hook=GATE_HOOK)
    try:
        box: dict = {}
        first = threading.Thread(target=lambda: box.setdefault(1, puller(world.request(1))))
        first.start()
        wait_for(lambda: (world.gate / "started-1").exists())
        old_pid = puller.helper_info().pid
        second = threading.Thread(target=lambda: box.setdefault(2, puller(world.request(2))))
        second.start()
        first.join(60)  # returns at once: killed, not waited for
        assert not first.is_alive() and 2 not in box
        wait_for(lambda: (world.gate / "started-2").exists())
        (world.gate / "release").touch()
        second.join(60)
        assert not box[1].success and box[1].error_type == "pull_worker_died" and "superseded" in box[1].message
        assert box[2].success and box[2].applied_version == 2, box[2]
        assert puller.helper_info().pid != old_pid
        assert_local_holds(world, 2)
    finally:
        (world.gate / "release").touch()
        puller.close()
