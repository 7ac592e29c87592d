"""The time-to-fleet harness (issue 29.1) at a small size: three hosts in network namespaces,
one nginx cache, a small delta, our real pull on every host. It asserts what the benchmark's
figures rest on (every host holds the trainer's bytes, the cache tier takes one copy from the
origin) and that nothing is left behind, also when a run fails. No timings are asserted.

Skips only where the kernel (or a missing root) refuses network namespaces.
"""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks.fleet.netns import Fabric, our_namespaces, namespaces_usable
from benchmarks.fleet.run import run_fleet

_usable, _why = namespaces_usable()
pytestmark = [pytest.mark.skipif(not _usable, reason=f"network namespaces refused here: {_why}"), pytest.mark.slow]


def _processes_mentioning(text: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def test_a_small_fleet_holds_the_published_bytes_in_both_modes_and_the_cache_takes_one_copy(fast_tmp_path):
    work = str(fast_tmp_path / "fleet")
    before = set(our_namespaces())
    report = run_fleet(3, 1, model_mb=4, changed=0.3, host_mbit=80, src_mbit=80, modes=["direct", "cache"],
                       repeats=1, work=work, timeout_s=120, log=lambda s: None)
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["direct"]["all_ok"] and rows["cache"]["all_ok"], rows
    delta = report["shape"]["delta_MB"] * 1e6
    # direct: every host read the delta from the origin; cache: the origin sent it once (plus indexes)
    assert rows["direct"]["origin_bytes"] >= 3 * delta
    assert delta <= rows["cache"]["origin_bytes"] < 1.5 * delta
    assert set(our_namespaces()) <= before
    assert not _processes_mentioning(work)
    assert not os.path.exists(work)


def test_a_failed_run_tears_down_every_namespace_and_process(fast_tmp_path):
    work = str(fast_tmp_path / "fleet-fail")
    before = set(our_namespaces())
    with pytest.raises((TimeoutError, RuntimeError)):
        # No host can start in a millisecond: the run fails while hosts and the origin are up.
        run_fleet(2, 1, model_mb=1, changed=0.3, host_mbit=80, src_mbit=80, modes=["direct"], repeats=1,
                  work=work, timeout_s=0.001, log=lambda s: None)
    assert set(our_namespaces()) <= before
    assert not _processes_mentioning(work)


def test_a_fabric_left_by_an_exception_inside_it_is_deleted():
    with pytest.raises(ZeroDivisionError):
        with Fabric(2, 80, 80) as fab:
            tag = fab.tag
            assert len(our_namespaces(tag)) == 4  # the switch, the source, two hosts
            marker = f"fleet-test-{tag}"
            fab.spawn(fab.host(0), [sys.executable, "-c", "import time; time.sleep(300)", marker])
            1 / 0
    assert our_namespaces(tag) == []
    assert not _processes_mentioning(marker)


def test_caches_serving_torn_copies_slow_the_fleet_but_every_host_holds_the_published_bytes(fast_tmp_path):
    work = str(fast_tmp_path / "fleet-torn")
    report = run_fleet(3, 1, model_mb=4, changed=0.3, host_mbit=80, src_mbit=80, modes=["cache"], repeats=1,
                       work=work, timeout_s=120, log=lambda s: None, fault="torn_cache")
    (row,) = report["rows"]
    assert row["torn_copies"] >= 1
    assert row["all_ok"], row
    delta = report["shape"]["delta_MB"] * 1e6
    # the cache's fill, then each of the three hosts refetched the torn file from the origin
    assert row["origin_bytes"] >= 4 * delta * 0.99
    assert not _processes_mentioning(work)


def test_a_benchmark_stopped_with_sigterm_mid_run_leaves_no_namespace_or_process(fast_tmp_path):
    import signal
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    before = set(our_namespaces())
    proc = subprocess.Popen([sys.executable, os.path.join(root, "benchmarks", "bench_fleet.py"), "--hosts", "2",
                             "--caches", "1", "--model-mb", "1", "--repeats", "50", "--host-mbit", "8", "--src-mbit", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root)
    try:
        deadline = time.monotonic() + 120
        while not _processes_mentioning("benchmarks.fleet.host"):  # hosts up: mid-run
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the benchmark never started its hosts"
            time.sleep(0.1)
        ours = set(our_namespaces()) - before
        assert ours
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (set(our_namespaces()) & ours)
    assert not _processes_mentioning("benchmarks.fleet.host") and not _processes_mentioning("benchmarks.fleet.origin")
