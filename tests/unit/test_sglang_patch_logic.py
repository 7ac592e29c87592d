"""The engine patch's decisions, tested without sglang: path policy, result merging, and the
collective protocol that finishes a pull on every TP rank at the same loop iteration."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from sglang_patch import results
from sglang_patch.coordinator import PullCoordinator, SingleRankGroup
from sglang_patch.paths import check_request_paths, parse_allowed_roots
from weightsync.errors import (
    BackwardPullError,
    ChecksumMismatchError,
    InvalidRequestError,
    PathNotAllowedError,
    VersionMissingError,
)


# --- paths ----------------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "shared").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    return allowed, outside


def test_no_allowed_roots_refuses_every_request(roots):
    allowed, _ = roots
    with pytest.raises(PathNotAllowedError, match="no allowed roots are configured"):
        check_request_paths(str(allowed / "local"), str(allowed / "shared"), ())


def test_paths_inside_a_root_are_accepted_and_resolved(roots):
    allowed, _ = roots
    checked = check_request_paths(str(allowed / "local"), str(allowed / "shared"), (str(allowed),))
    assert checked.local_checkpoint_dir == os.path.realpath(allowed / "local")
    assert checked.source_dir == os.path.realpath(allowed / "shared")


def test_a_path_outside_every_root_is_forbidden(roots):
    allowed, outside = roots
    with pytest.raises(PathNotAllowedError, match="not below any allowed root") as info:
        check_request_paths(str(outside / "local"), str(allowed / "shared"), (str(allowed),))
    assert info.value.http_status == 403 and info.value.error_type == "forbidden"


def test_a_dotdot_component_is_forbidden_even_if_it_lands_inside(roots):
    allowed, _ = roots
    with pytest.raises(PathNotAllowedError, match=r"'\.\.'"):
        check_request_paths(str(allowed / "shared" / ".." / "local"), str(allowed / "shared"), (str(allowed),))


def test_a_symlink_leading_out_of_the_root_is_forbidden(roots):
    allowed, outside = roots
    (allowed / "link").symlink_to(outside)
    with pytest.raises(PathNotAllowedError, match="symlink"):
        check_request_paths(str(allowed / "link" / "local"), str(allowed / "shared"), (str(allowed),))
    with pytest.raises(PathNotAllowedError, match="symlink"):
        check_request_paths(str(allowed / "local"), str(allowed / "link"), (str(allowed),))


def test_a_root_that_is_itself_a_symlink_still_contains_its_paths(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    root = str(tmp_path / "alias")
    checked = check_request_paths(f"{root}/local", f"{root}/shared", (root,))
    assert checked.local_checkpoint_dir == str(real / "local")


def test_relative_or_empty_paths_are_bad_requests(roots):
    allowed, _ = roots
    with pytest.raises(InvalidRequestError, match="absolute") as info:
        check_request_paths("local", str(allowed / "shared"), (str(allowed),))
    assert info.value.http_status == 400 and not isinstance(info.value, PathNotAllowedError)
    with pytest.raises(InvalidRequestError, match="non-empty"):
        check_request_paths("", str(allowed / "shared"), (str(allowed),))


def test_the_local_dir_must_not_overlap_the_seed_or_the_source(roots):
    allowed, _ = roots
    seed = allowed / "models" / "model"
    seed.mkdir(parents=True)
    (allowed / "elsewhere" / "shared").mkdir(parents=True)
    for local in (seed, seed / "sub", allowed / "models"):
        with pytest.raises(InvalidRequestError, match="engine's own model"):
            check_request_paths(
                str(local), str(allowed / "elsewhere" / "shared"), (str(allowed),), seed_dir=str(seed)
            )
    with pytest.raises(InvalidRequestError, match="overlap"):
        check_request_paths(str(allowed / "shared" / "local"), str(allowed / "shared"), (str(allowed),))


def test_allowed_roots_flag_parsing():
    assert parse_allowed_roots(None) == ()
    assert parse_allowed_roots("/a/b/, /c ,,/a/b") == ("/a/b", "/c")
    with pytest.raises(ValueError, match="not an absolute path"):
        parse_allowed_roots("relative")
    with pytest.raises(ValueError, match=r"'\.\.'"):
        parse_allowed_roots("/a/../b")


# --- results ----------------------------------------------------------------------------------


class _Outcome:
    def __init__(self, version, action, seconds=0.1, hook_ran=False, nbytes_read=10):
        self.applied_version, self.action, self.reason = version, action, f"{action} reason"
        self.seconds, self.hook_ran, self.nbytes_read, self.lock_wait_s = seconds, hook_ran, nbytes_read, 0.0


def test_colocated_ranks_merge_into_one_host_described_by_the_rank_that_worked():
    reports = [
        results.report_success("h/node0", "dp0/tp1", _Outcome(3, "noop", seconds=0.5)),
        results.report_success("h/node0", "dp0/tp0", _Outcome(3, "seed+chain", seconds=0.4, hook_ran=True)),
    ]
    [host] = results.merge_host_results(reports)
    assert host.ranks == ["dp0/tp0", "dp0/tp1"]
    assert host.success and host.action == "seed+chain" and host.hook_ran
    assert host.seconds == 0.5  # the slowest rank, including its wait for the lock
    reply = results.summarize(3, [host])
    assert reply["success"] and reply["http_status"] == 200 and reply["applied_version"] == 3


def test_one_failed_host_fails_the_reply_with_its_error():
    ok = results.report_success("h/node0", "dp0/tp0", _Outcome(2, "chain"))
    bad = results.report_failure("h/node1", "dp0/tp1", VersionMissingError(2, "/s/weight_v000002"), applied_version=1)
    reply = results.summarize(2, results.merge_host_results([ok, bad]))
    assert not reply["success"]
    assert (reply["error_type"], reply["http_status"]) == ("source_not_ready", 404)
    assert "h/node1" in reply["message"] and "h/node0" not in reply["message"]
    assert [h.success for h in reply["hosts"]] == [True, False]
    assert reply["applied_version"] is None  # hosts disagree


def test_the_error_a_retry_cannot_fix_wins_over_not_ready():
    a = results.report_failure("a/node0", "dp0/tp0", VersionMissingError(2, "/s"))
    b = results.report_failure("b/node1", "dp0/tp1", ChecksumMismatchError(2, [("w", "x", "y")], "xxh3-128"))
    reply = results.summarize(2, results.merge_host_results([a, b]))
    assert (reply["error_type"], reply["http_status"]) == ("corrupt_artifact", 422)


def test_an_untyped_exception_is_an_internal_error_without_traceback():
    report = results.report_failure("h/node0", "dp0/tp0", KeyError("boom"))
    assert (report.error_type, report.http_status) == ("internal_error", 500)
    assert "Traceback" not in report.message and "boom" in report.message


def test_no_answer_is_a_failure_and_a_wrong_version_is_not_success():
    assert results.summarize(1, [])["success"] is False
    wrong = results.merge_host_results([results.report_success("h/node0", "dp0/tp0", _Outcome(1, "noop"))])
    assert results.summarize(2, wrong)["success"] is False


def test_dp_replies_merge_per_host_and_conflicts_dominate():
    def group_reply(rank, action):
        report = results.report_success("h/node0", rank, _Outcome(1, action))
        return results.summarize(1, results.merge_host_results([report]))

    group0, group1 = group_reply("dp0/tp0", "chain"), group_reply("dp1/tp0", "noop")
    merged = results.merge_replies(1, [group0, group1])
    assert merged["success"] and [h.ranks for h in merged["hosts"]] == [["dp0/tp0", "dp1/tp0"]]
    conflict = results.conflict_fields(1, 1)
    assert results.merge_replies(1, [group0, conflict])["http_status"] == 409


# --- coordinator ---------------------------------------------------------------------------------


class ThreadGroup:
    """Collectives between threads (one per simulated TP rank), like gloo's: everyone must join."""

    def __init__(self, size: int, timeout_s: float = 10.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list = [None] * size
        self.calls = 0

    def member(self, rank: int):
        group = self

        class Member:
            size = group.size

            def all_min(self, value):
                return min(group._exchange(rank, value))

            def all_gather(self, obj):
                return group._exchange(rank, obj)

        return Member()

    def _exchange(self, rank, value):
        self._slots[rank] = value
        self._barrier.wait()  # raises BrokenBarrierError instead of hanging forever
        out = list(self._slots)
        self._barrier.wait()
        return out


class _Req:
    def __init__(self, target_version):
        self.target_version = target_version


def _make(rank, group, run, replies):
    return PullCoordinator(
        group=group,
        run_rank_pull=run,
        failure_report=lambda req, exc, s: results.report_failure("h", f"tp{rank}", exc, seconds=s),
        build_reply=lambda req, reports, s: ("reply", req.target_version, results.summarize(
            req.target_version, results.merge_host_results(reports), s)),
        build_conflict=lambda req, running: ("conflict", req.target_version, running.target_version),
        send_reply=lambda reply, req: replies.append((rank, reply)),
        build_internal_error=lambda req, exc: ("internal", str(exc)),
    )


def _run_loop(coordinators, requests_at, iterations):
    """Each rank runs the same scheduler loop: requests are seen at the same iteration everywhere."""
    errors = []
    immediate = []

    def loop(rank):
        try:
            for i in range(iterations):
                for req in requests_at.get(i, []):
                    out = coordinators[rank].on_request(req)
                    if out is not None:
                        immediate.append((rank, out))
                coordinators[rank].poll()
                time.sleep(0.001)
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(len(coordinators))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung in a collective"
    assert not errors, errors
    return immediate


def test_ranks_finish_together_even_when_one_rank_is_much_slower():
    group = ThreadGroup(2)
    replies: list = []

    def run(rank):
        def pull(req):
            time.sleep(0.3 if rank == 1 else 0.0)
            return results.report_success("h", f"tp{rank}", _Outcome(req.target_version, "chain" if rank == 0 else "noop"))

        return pull

    coords = [_make(r, group.member(r), run(r), replies) for r in range(2)]
    _run_loop(coords, {5: [_Req(4)]}, iterations=600)
    assert sorted(rank for rank, _ in replies) == [0, 1]
    for _, (kind, version, reply) in replies:
        assert kind == "reply" and version == 4 and reply["success"]
    assert not any(c.is_pending for c in coords)


def test_a_rank_whose_pull_raises_still_joins_and_the_reply_fails():
    group = ThreadGroup(2)
    replies: list = []

    def run(rank):
        def pull(req):
            if rank == 1:
                raise BackwardPullError(1, 3)
            return results.report_success("h", f"tp{rank}", _Outcome(req.target_version, "noop"))

        return pull

    coords = [_make(r, group.member(r), run(r), replies) for r in range(2)]
    _run_loop(coords, {0: [_Req(1)]}, iterations=200)
    assert len(replies) == 2
    for _, (_, _, reply) in replies:
        assert not reply["success"] and reply["error_type"] == "bad_request"


def test_a_second_pull_while_one_runs_is_refused_on_every_rank_not_queued():
    group = ThreadGroup(2)
    replies: list = []
    release = threading.Event()

    def pull(req):
        release.wait(5)
        return results.report_success("h", "tp", _Outcome(req.target_version, "chain"))

    coords = [_make(r, group.member(r), pull, replies) for r in range(2)]
    timer = threading.Timer(0.2, release.set)
    timer.start()
    immediate = _run_loop(coords, {0: [_Req(2)], 3: [_Req(3)]}, iterations=800)
    timer.cancel()
    assert sorted(immediate) == [(0, ("conflict", 3, 2)), (1, ("conflict", 3, 2))]
    assert [reply[1] for _, reply in replies] == [2, 2]  # only the first pull was ever run


def test_a_single_rank_needs_no_collective_and_never_raises_into_the_loop():
    replies: list = []

    def pull(req):
        raise RuntimeError("disk on fire")

    coord = _make(0, SingleRankGroup(), pull, replies)
    assert coord.on_request(_Req(1)) is None
    deadline = time.monotonic() + 5
    while coord.is_pending and time.monotonic() < deadline:
        coord.poll()
        time.sleep(0.01)
    [(_, (kind, _, reply))] = replies
    assert kind == "reply" and reply["error_type"] == "internal_error" and "disk on fire" in reply["message"]


def test_the_core_stays_free_of_engine_imports():
    # sglang_patch's decision modules import no sglang/torch; the core imports neither either.
    import subprocess

    code = (
        "import sys, sglang_patch.paths, sglang_patch.results, sglang_patch.coordinator,"
        " sglang_patch.server_flags;"
        "bad=[m for m in ('sglang','torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
