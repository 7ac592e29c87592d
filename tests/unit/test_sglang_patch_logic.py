"""The engine patch's decisions, tested without sglang: path policy, result merging, and the
collective protocol that finishes a pull on every TP rank at the same loop iteration."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from sglang_patch.pull import results
from sglang_patch.pull.coordinator import PullCoordinator, SingleRankGroup
from sglang_patch.paths import check_request_paths, parse_allowed_roots
from weightsync.errors import (
    BackwardPullError,
    ChecksumMismatchError,
    InvalidRequestError,
    PathNotAllowedError,
    PullInProgressError,
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


def test_a_path_the_os_cannot_use_is_a_bad_request_with_a_short_message(roots):
    allowed, _ = roots
    long_path = str(allowed) + ("/" + "d" * 200) * 500  # ~100 KB inside the allowed root
    with pytest.raises(InvalidRequestError, match="must be shorter than 4096 bytes") as info:
        check_request_paths(long_path, str(allowed / "shared"), (str(allowed),))
    assert info.value.http_status == 400 and len(str(info.value)) < 600
    with pytest.raises(InvalidRequestError, match="at most 255") as info:
        check_request_paths(str(allowed / ("n" * 300)), str(allowed / "shared"), (str(allowed),))
    assert info.value.http_status == 400


def test_a_refused_long_path_is_cut_short_in_the_message(roots):
    allowed, outside = roots
    path = str(outside) + "/" + "/".join(["y" * 100] * 30)  # 3 KB, outside every root
    with pytest.raises(PathNotAllowedError) as info:
        check_request_paths(path, str(allowed / "shared"), (str(allowed),))
    assert len(str(info.value)) < 600 and "characters)" in str(info.value)


# --- request body ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ['"1"', "true", "1.0", "null", "[1]"])
def test_the_body_takes_only_a_json_integer_as_the_target_version(version):
    from sglang_patch.pull.request import parse_pull_body

    raw = b'{"local_checkpoint_dir": "/l", "source_dir": "/s", "target_version": %s}' % version.encode()
    with pytest.raises(InvalidRequestError, match=r"target_version") as info:
        parse_pull_body(raw)
    assert info.value.http_status == 400
    assert parse_pull_body(raw.replace(version.encode(), b"1")).target_version == 1


def test_a_body_missing_a_field_or_not_an_object_is_a_bad_request():
    from sglang_patch.pull.request import parse_pull_body

    with pytest.raises(InvalidRequestError, match="source_dir"):
        parse_pull_body(b'{"local_checkpoint_dir": "/l", "target_version": 1}')
    for raw in (b"[]", b"", b"{", b'"x"'):
        with pytest.raises(InvalidRequestError, match="Expected"):
            parse_pull_body(raw)


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


def test_an_os_error_on_the_request_path_is_a_bad_request_and_its_file_name_is_cut():
    import errno

    exc = OSError(errno.ENAMETOOLONG, "File name too long", "/a/" + "x" * 100_000)
    report = results.report_failure("h/node0", "dp0/tp0", exc)
    assert (report.error_type, report.http_status) == ("bad_request", 400)
    assert "File name too long" in report.message and len(report.message) < 1000
    other = results.report_failure("h/node0", "dp0/tp0", OSError(errno.EIO, "I/O error", "/s/x"))
    assert (other.error_type, other.http_status) == ("internal_error", 500)


def test_no_message_in_a_reply_is_longer_than_the_cap():
    report = results.report_failure("h/node0", "dp0/tp0", InvalidRequestError("p" * 100_000))
    assert len(report.message) <= results.MAX_MESSAGE_CHARS
    reply = results.summarize(1, results.merge_host_results([report]))
    assert len(reply["message"]) <= 4 * results.MAX_MESSAGE_CHARS


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
    refused = results.error_reply_fields(2, PullInProgressError(2, 1))
    merged = results.merge_replies(2, [group0, refused])
    assert (merged["http_status"], merged["error_type"], merged["target_version"]) == (409, "PullInProgress", 1)


# --- coordinator ---------------------------------------------------------------------------------


class ThreadGroup:
    """Collectives between threads (one per simulated TP rank), like gloo's: everyone must join."""

    def __init__(self, size: int, timeout_s: float = 10.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list = [None] * size

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


class DictChannel:
    """The stage channel in memory (sglang's is the torch.distributed store)."""

    def __init__(self):
        self.values: dict = {}
        self.posted: list = []

    def post(self, key, value):
        self.posted.append(key)
        self.values[key] = value

    def take(self, key):
        return self.values.pop(key, None)


class FakeClock:
    """A monotonic clock that moves only when a test says so (deadlines without waiting)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class _Req:
    def __init__(self, target_version, local="/l", source="/s", rid=None):
        self.target_version = target_version
        self.local_checkpoint_dir = local
        self.source_dir = source
        self.rid = rid


def _make(rank, group, run, replies, *, timeout_s=600.0, stage=None, clock=time.monotonic, label=None):
    from sglang_patch.pull.coordinator import Stage

    return PullCoordinator(
        group=group,
        run_rank_pull=run,
        host="h/node0",
        rank=label or f"dp0/tp{rank}",
        make_reply=lambda fields: fields,
        send_reply=lambda reply, req: replies.append((rank, req, reply)),
        timeout_s=timeout_s,
        stage=stage or Stage(),
        clock=clock,
    )


def _run_loop(coordinators, requests_at, iterations, actions_at=None):
    """Each rank runs the same scheduler loop: requests are seen at the same iteration everywhere.
    ``actions_at[i]`` is called (by rank 0) at iteration i: e.g. a pull thread is released."""
    errors = []
    immediate = []

    def loop(rank):
        try:
            for i in range(iterations):
                if rank == 0 and actions_at and i in actions_at:
                    actions_at[i]()
                for req in requests_at.get(i, []):
                    out = coordinators[rank].on_request(req)
                    if out is not None:
                        immediate.append((rank, req, out))
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


def _ok(rank_label, action="chain"):
    return lambda req: results.report_success("h/node0", rank_label, _Outcome(req.target_version, action))


def test_ranks_finish_together_even_when_one_rank_is_much_slower():
    group = ThreadGroup(2)
    replies: list = []
    release = threading.Event()

    def run(rank):
        def pull(req):
            if rank == 1:
                release.wait(10)
            return results.report_success("h/node0", f"dp0/tp{rank}", _Outcome(req.target_version, "chain" if rank == 0 else "noop"))

        return pull

    coords = [_make(r, group.member(r), run(r), replies) for r in range(2)]
    _run_loop(coords, {5: [_Req(4)]}, iterations=800, actions_at={50: release.set})
    assert sorted(rank for rank, _, _ in replies) == [0, 1]
    for _, _, reply in replies:
        assert reply["success"] and reply["target_version"] == 4
        assert reply["hosts"][0].ranks == ["dp0/tp0", "dp0/tp1"]
    assert not any(c.is_pending for c in coords)


def test_a_rank_whose_pull_raises_still_joins_and_the_reply_fails():
    group = ThreadGroup(2)
    replies: list = []

    def run(rank):
        def pull(req):
            if rank == 1:
                raise BackwardPullError(1, 3)
            return results.report_success("h/node0", f"dp0/tp{rank}", _Outcome(req.target_version, "noop"))

        return pull

    coords = [_make(r, group.member(r), run(r), replies) for r in range(2)]
    _run_loop(coords, {0: [_Req(1)]}, iterations=200)
    assert len(replies) == 2
    for _, _, reply in replies:
        assert not reply["success"] and reply["error_type"] == "bad_request"


def test_a_pull_to_another_target_while_one_runs_is_refused_as_pull_in_progress_on_every_rank():
    group = ThreadGroup(2)
    replies: list = []
    release = threading.Event()

    def pull(req):
        release.wait(5)
        return results.report_success("h/node0", "dp0/tp0", _Outcome(req.target_version, "chain"))

    coords = [_make(r, group.member(r), pull, replies) for r in range(2)]
    immediate = _run_loop(coords, {0: [_Req(2)], 3: [_Req(3)], 4: [_Req(2, local="/other")]}, iterations=800,
                          actions_at={10: release.set})
    refused = sorted((rank, req.target_version, req.local_checkpoint_dir, out["error_type"], out["http_status"],
                      out["target_version"]) for rank, req, out in immediate)
    # The body's target_version names the running pull (what a trainer compares with its own).
    assert refused == [(0, 2, "/other", "PullInProgress", 409, 2), (0, 3, "/l", "PullInProgress", 409, 2),
                       (1, 2, "/other", "PullInProgress", 409, 2), (1, 3, "/l", "PullInProgress", 409, 2)]
    assert all("v3 was not queued" in out["message"] for _, req, out in immediate if req.target_version == 3)
    assert [reply["target_version"] for _, _, reply in replies] == [2, 2]  # only the first pull ran


def test_a_retry_of_the_running_pull_joins_it_and_both_requests_get_its_result():
    group = ThreadGroup(2)
    replies: list = []
    release = threading.Event()
    calls: list = []

    def pull(req):
        calls.append(req)
        release.wait(5)
        return results.report_success("h/node0", "dp0/tp0", _Outcome(req.target_version, "chain"))

    first, retry = _Req(7, rid="first"), _Req(7, rid="retry")
    coords = [_make(r, group.member(r), pull, replies) for r in range(2)]
    immediate = _run_loop(coords, {0: [first], 5: [retry]}, iterations=800, actions_at={10: release.set})
    assert immediate == []  # nobody was refused
    assert len(calls) == 2  # one pull per rank, not one per request
    answered = sorted((rank, req.rid) for rank, req, _ in replies)
    assert answered == [(0, "first"), (0, "retry"), (1, "first"), (1, "retry")]
    assert all(reply["success"] and reply["applied_version"] == 7 for _, _, reply in replies)


def _drive(coordinators, clock, *, until, max_iterations=2000):
    """Run the coordinators' loops in one thread (no collectives: single-rank groups)."""
    for _ in range(max_iterations):
        for c in coordinators:
            c.poll()
        if until():
            return
        clock.now += 0.01
        time.sleep(0.001)
    raise AssertionError("the condition was never met")


def test_a_hung_pull_times_out_at_the_deadline_and_the_late_finish_reports_nothing():
    clock = FakeClock()
    replies: list = []
    unblock = threading.Event()
    finished = threading.Event()

    def hung_pull(req):
        unblock.wait(30)  # a read of a hung filesystem
        finished.set()
        return results.report_success("h/node0", "dp0/tp0", _Outcome(req.target_version, "chain"))

    coord = _make(0, SingleRankGroup(), hung_pull, replies, timeout_s=60, clock=clock)
    assert coord.on_request(_Req(5)) is None
    coord.poll()
    clock.now += 59.0
    coord.poll()
    assert replies == [] and coord.is_pending
    # A retry of the same pull before the deadline joins it and gets the same (timeout) reply.
    assert coord.on_request(_Req(5, rid="retry")) is None
    clock.now += 2.0
    coord.poll()
    assert not coord.is_pending
    assert len(replies) == 2
    for _, _, reply in replies:
        assert (reply["success"], reply["error_type"], reply["http_status"]) == (False, "pull_timeout", 504)
        assert "dp0/tp0: the pull to v5 did not finish within 60 s" in reply["message"]
    # The abandoned thread finishes later: nothing more is sent, and a new pull can start.
    unblock.set()
    assert finished.wait(10)
    coord.poll()
    assert len(replies) == 2
    assert coord.on_request(_Req(6)) is None and coord.is_pending


def test_at_the_deadline_a_puller_that_can_cancel_is_cancelled_with_the_timeout():
    clock = FakeClock()
    replies: list = []
    unblock = threading.Event()

    class CancellablePull:
        def __init__(self):
            self.cancelled: list = []

        def __call__(self, req):
            unblock.wait(30)
            return results.report_failure("h/node0", "dp0/tp0", self.cancelled[0])

        def cancel(self, error):  # what the pull helper does: kill the process, end the wait
            self.cancelled.append(error)
            unblock.set()

    pull = CancellablePull()
    coord = _make(0, SingleRankGroup(), pull, replies, timeout_s=60, clock=clock)
    coord.on_request(_Req(5))
    clock.now += 61
    coord.poll()
    [error] = pull.cancelled
    assert error.error_type == "pull_timeout" and error.target_version == 5
    [(_, _, reply)] = replies
    assert reply["error_type"] == "pull_timeout"


def test_every_rank_agrees_on_the_timeout_even_if_only_one_rank_hangs():
    clock = FakeClock()
    group = ThreadGroup(2)
    replies: list = []
    unblock = threading.Event()

    def run(rank):
        def pull(req):
            if rank == 1:
                unblock.wait(30)
            return results.report_success("h/node0", f"dp0/tp{rank}", _Outcome(req.target_version, "chain"))

        return pull

    coords = [_make(r, group.member(r), run(r), replies, timeout_s=60, clock=clock) for r in range(2)]
    try:
        _run_loop(coords, {0: [_Req(5)]}, iterations=400, actions_at={50: lambda: setattr(clock, "now", clock.now + 61)})
    finally:
        unblock.set()
    assert sorted(rank for rank, _, _ in replies) == [0, 1]
    for _, _, reply in replies:
        assert reply["error_type"] == "pull_timeout"
        [host] = reply["hosts"]
        assert host.ranks == ["dp0/tp0", "dp0/tp1"] and not host.success


def _pipeline(run_by_stage, clock, *, timeout_s=600.0):
    """Stage 0 and stage 1 (TP=1 each) with one in-memory channel; replies of stage 0 only."""
    from sglang_patch.pull.coordinator import Stage

    channel, replies = DictChannel(), []
    coords = [
        _make(pp, SingleRankGroup(), run_by_stage[pp], replies, timeout_s=timeout_s, clock=clock,
              stage=Stage(pp_rank=pp, pp_size=2, leader=True, channel=channel), label=f"dp0/pp{pp}/tp0")
        for pp in range(2)
    ]
    return coords, channel, replies


def test_a_failure_on_a_later_pipeline_stage_fails_the_reply_and_names_that_stage():
    clock = FakeClock()

    def stage1_pull(req):
        raise VersionMissingError(req.target_version, "/s/weight_v000003")

    coords, channel, replies = _pipeline({0: _ok("dp0/pp0/tp0"), 1: stage1_pull}, clock)
    request = _Req(3, rid="r1")
    for c in coords:  # every stage sees the request, stage 0 first
        assert c.on_request(request) is None
    _drive(coords, clock, until=lambda: bool(replies))
    [(rank, _, reply)] = replies
    assert rank == 0  # stage 1 sends nothing itself
    assert (reply["success"], reply["error_type"], reply["http_status"]) == (False, "source_not_ready", 404)
    [host] = reply["hosts"]
    assert host.ranks == ["dp0/pp0/tp0", "dp0/pp1/tp0"]
    assert "dp0/pp1/tp0" in reply["message"]
    assert channel.posted == ["r1/pp1"] and channel.values == {}


def test_stage_zero_waits_for_every_later_stage_before_replying():
    clock = FakeClock()
    release = threading.Event()

    def slow_stage1(req):
        release.wait(10)
        return results.report_success("h/node0", "dp0/pp1/tp0", _Outcome(req.target_version, "noop"))

    coords, _, replies = _pipeline({0: _ok("dp0/pp0/tp0"), 1: slow_stage1}, clock)
    for c in coords:
        c.on_request(_Req(3, rid="r2"))
    _drive([coords[0]], clock, until=lambda: coords[0]._pending.done.is_set())
    for _ in range(20):
        for c in coords:
            c.poll()
        clock.now += 0.1
    assert replies == [] and coords[0].is_pending  # stage 0 is done, stage 1 is not
    release.set()
    _drive(coords, clock, until=lambda: bool(replies))
    [(_, _, reply)] = replies
    assert reply["success"] and reply["hosts"][0].ranks == ["dp0/pp0/tp0", "dp0/pp1/tp0"]


def test_a_pipeline_stage_that_never_reports_is_a_timeout_naming_the_stage():
    clock = FakeClock()
    coords, _, replies = _pipeline({0: _ok("dp0/pp0/tp0"), 1: _ok("dp0/pp1/tp0")}, clock, timeout_s=60)
    coords[0].on_request(_Req(3, rid="r3"))  # stage 1 never sees it (e.g. it died)
    _drive([coords[0]], clock, until=lambda: coords[0]._pending.done.is_set())
    clock.now += 61
    coords[0].poll()
    assert replies == []  # still inside the grace for a later stage's own deadline
    clock.now += coords[0].stage_grace_s
    coords[0].poll()
    [(_, _, reply)] = replies
    assert reply["error_type"] == "pull_timeout" and "pipeline stage 1" in reply["message"]


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
    [(_, _, reply)] = replies
    assert reply["error_type"] == "internal_error" and "disk on fire" in reply["message"]


def test_the_core_stays_free_of_engine_imports():
    # sglang_patch's decision modules import no sglang/torch; the core imports neither either.
    import subprocess

    code = (
        "import sys, sglang_patch.paths, sglang_patch.pull.results, sglang_patch.pull.coordinator,"
        " sglang_patch.server_flags;"
        "bad=[m for m in ('sglang','torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
