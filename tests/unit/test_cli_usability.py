"""The ``weightsync`` command behaves as people expect a CLI to (``hf``, ``git``): global flags
anywhere, every option explained with its default, ``--help`` with examples and the exit codes,
a ``version`` command, tables with one clearly named byte count, no empty columns and short
reasons, progress in bytes (rate, ETA) on stderr for long work, and a pull that waits for the
host lock says who holds it. Real files and a real second process throughout.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import weightsync
from weightsync import progress
from weightsync.cli import EXIT_CODE_TABLE, EXIT_CODES, SHORT_REASON_CHARS, _HelpFormatter, build_parser, format_table, main

from core_support import mutate, random_tensors, write_hf_checkpoint

SIZES = {"a": ("float32", (256, 64)), "b": ("int16", (128, 32)), "c": ("uint8", (1000,))}


@pytest.fixture
def world(fast_tmp_path):
    root = str(fast_tmp_path)
    rng = np.random.default_rng(5)
    seed, step1, source, local = (os.path.join(root, n) for n in ("seed", "step1", "src", "local"))
    t0 = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, t0)
    write_hf_checkpoint(step1, mutate(t0, rng, 0.05))
    return {"root": root, "seed": seed, "step1": step1, "source": source, "local": local}


def publish_v1(world, capsys, *extra: str):
    """Publish v1 (a delta) through the command; its captured (out, err)."""
    code = main(["publish", world["source"], "--version", "1", "--checkpoint", world["step1"],
                 "--base-checkpoint", world["seed"], *extra])
    assert code == 0
    return capsys.readouterr()


def pull_argv(world, *extra: str) -> list[str]:
    return ["pull", world["local"], "--seed-dir", world["seed"], "--source-dir", world["source"], "--version", "1", *extra]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_json_and_verbose_work_before_and_after_the_subcommand(world, capsys):
    publish_v1(world, capsys)
    outputs = []
    for argv in (["--json", "inspect", world["source"]], ["inspect", world["source"], "--json"],
                 ["-v", "inspect", "--json", world["source"]], ["inspect", world["source"], "--json", "-v"]):
        assert main(argv) == 0, argv
        outputs.append(json.loads(capsys.readouterr().out))
    assert all(o == outputs[0] for o in outputs) and outputs[0][0]["version"] == 1
    parser = build_parser()
    for argv, verbose, as_json in ((["-v", "version"], True, False), (["version", "-v"], True, False),
                                   (["version"], False, False), (["--json", "version", "-v"], True, True)):
        args = parser.parse_args(argv)
        assert (args.verbose, args.json) == (verbose, as_json), argv


def test_every_option_says_what_it_does_and_its_default():
    parser = build_parser()
    formatter = _HelpFormatter("weightsync")
    for name, sub in {"": parser, **subcommands(parser)}.items():
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, (name, action.dest)
            flag = action.nargs == 0
            if action.option_strings and not flag and not action.required:
                assert "default" in formatter._get_help_string(action), (name, action.option_strings)


def test_help_shows_examples_and_every_exit_code(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "weightsync pull " in text
    documented = {code for code, _ in EXIT_CODE_TABLE}
    assert {code for _, code in EXIT_CODES} | {0, 1} <= documented
    for code, meaning in EXIT_CODE_TABLE:
        assert f"  {code}  {meaning}" in text
    for name in subcommands(build_parser()):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert f"weightsync {name}" in text.split("examples:", 1)[1] and "exit codes:" in text, name


def test_weightsync_version_prints_the_tool_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"weightsync {weightsync.__version__}"
    assert main(["version", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"version": weightsync.__version__}


def test_a_column_empty_in_every_row_is_left_out_of_a_table(world, capsys):
    assert format_table(["a", "empty", "b"], [[1, None, "x"], [2, "", "y"]]).splitlines()[0].split() == ["a", "b"]
    code = main(["publish", world["source"], "--version", "1", "--checkpoint", world["step1"], "--full"])
    assert code == 0
    capsys.readouterr()
    assert main(["inspect", world["source"]]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert "base" not in header and "encoding" not in header  # a full version has neither
    assert main(["inspect", world["source"], "--version", "1"]) == 0
    assert "density" not in capsys.readouterr().out  # only with --density


def test_the_publish_and_pull_tables_name_one_byte_count(world, capsys):
    table = publish_v1(world, capsys).out
    header = table.splitlines()[0]
    assert header.count("written to SRC") == 1 and "wire" not in header and "full " not in header
    assert main(pull_argv(world)) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.count("read from SRC") == 1 and " read " not in header.replace("read from SRC", "")


def test_the_reason_cell_is_short_and_the_whole_reason_comes_with_verbose(world, capsys):
    publish_v1(world, capsys)
    assert main(["--json", *pull_argv(world)]) == 0
    whole = json.loads(capsys.readouterr().out)["reason"]
    assert len(whole) > SHORT_REASON_CHARS  # a seed and a chain: the reason is long
    os.rename(world["local"], world["local"] + ".first")
    assert main(pull_argv(world)) == 0
    out = capsys.readouterr().out
    row = out.splitlines()[2]
    assert whole not in out and len(row.split("  ")[-1].strip()) <= SHORT_REASON_CHARS
    os.rename(world["local"], world["local"] + ".second")
    assert main(pull_argv(world, "-v")) == 0
    assert f"reason: {whole}" in capsys.readouterr().out


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_progress_line_shows_bytes_done_of_total_rate_and_eta():
    clock, out = FakeClock(), io.StringIO()
    bar = progress.ByteBar("seed copy", 100 << 20, out, tty=False, clock=clock)
    clock.now += 1.0
    bar.advance(25 << 20)
    assert bar.line() == "seed copy  25.0 MiB / 100.0 MiB   25%  25.0 MiB/s  ETA 3s"
    clock.now += 3.0
    bar.advance(75 << 20)
    assert bar.line() == "seed copy  100.0 MiB / 100.0 MiB  100%  25.0 MiB/s  in 4s"
    # off a terminal: one line per 10% step reached, the last one once
    assert out.getvalue().splitlines() == [
        "seed copy  25.0 MiB / 100.0 MiB   25%  25.0 MiB/s  ETA 3s",
        "seed copy  100.0 MiB / 100.0 MiB  100%  25.0 MiB/s  in 4s",
    ]


def test_a_progress_line_on_a_terminal_is_rewritten_in_place_and_ends_with_a_newline():
    clock, out = FakeClock(), io.StringIO()
    bar = progress.ByteBar("apply", 10 << 20, out, tty=True, clock=clock)
    for _ in range(10):
        clock.now += 0.5
        bar.advance(1 << 20)
    text = out.getvalue()
    assert text.count("\r") == 10 and text.endswith("in 5s\n") and text.count("\n") == 1


class FakeStream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_is_silent_under_json_and_off_a_terminal_unless_verbose():
    assert progress.reporter_for(json=True, verbose=True, stream=FakeStream(True)) is None
    quiet = progress.reporter_for(json=False, verbose=False, stream=FakeStream(False))
    assert quiet is not None and quiet.stage("x", 10) is progress.SILENT  # notices only
    assert progress.reporter_for(json=False, verbose=False, stream=FakeStream(True)).bars
    assert progress.reporter_for(json=False, verbose=True, stream=FakeStream(False)).bars
    assert progress.stage("nothing installed", 10) is progress.SILENT


def test_a_verbose_publish_and_pull_report_each_long_step_in_bytes(world, capsys):
    err = publish_v1(world, capsys, "-v").err
    for stage in ("read step1", "read seed", "publish: snapshot of the base", "publish: encode", "publish: write"):
        lines = [line for line in err.splitlines() if line.startswith(stage + "  ")]
        assert lines and "  100%  " in lines[-1] and "B/s" in lines[-1], (stage, err)
    assert main(pull_argv(world, "-v")) == 0
    err = capsys.readouterr().err
    seed_bytes = sum(os.path.getsize(os.path.join(world["seed"], f)) for f in os.listdir(world["seed"]))
    from weightsync.progress import human_bytes

    assert f"seed copy (v0)  {human_bytes(seed_bytes)} / {human_bytes(seed_bytes)}  100%" in err
    assert "apply  " in err and "100%" in err.split("apply  ", 1)[1]
    # the same pull under --json, or off a terminal without -v, prints no progress
    for argv in (["--json", *pull_argv(world)], pull_argv(world)):
        os.rename(world["local"], world["local"] + f".{len(argv)}")
        assert main(argv) == 0
        assert "seed copy" not in capsys.readouterr().err


HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from weightsync.puller.lock import acquire_host_lock
    held = acquire_host_lock(sys.argv[1], 5)
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


def test_a_pull_waiting_for_the_host_lock_names_the_pid_that_holds_it(world, capsys):
    publish_v1(world, capsys)
    os.makedirs(world["local"])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, world["local"]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(pull_argv(world, "--lock-timeout", "1"))  # default verbosity, stderr not a terminal
        err = capsys.readouterr().err
        assert code != 0
        assert f"waiting for the pull lock {world['local']}" in err and f"held by pid {holder.pid} on this host" in err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_step_that_fails_midway_leaves_its_line_and_the_error_starts_on_a_new_one():
    clock, out = FakeClock(), FakeStream(True)
    reporter = progress.BarReporter(out, tty=True, clock=clock)
    with pytest.raises(OSError):
        with progress.reporting(reporter):
            bar = progress.stage("seed copy (v0)", 100)
            clock.now += 1
            bar.advance(40)
            raise OSError("disk gone")
    text = out.getvalue()
    assert text.endswith("seed copy (v0)  40 B / 100 B   40%  40 B/s  ETA 2s\n") and text.count("\n") == 1


@pytest.mark.parametrize("kernel_error", [None, "EXDEV", "ENOSYS"])
def test_a_seed_copy_with_progress_copies_every_byte_in_chunks_and_tells_each_one(tmp_path, monkeypatch, kernel_error):
    import errno

    from weightsync.fsio import copy_file

    if kernel_error is not None:  # a kernel or filesystem pair without copy_file_range (not causable here)
        def refuse(*args, **kwargs):
            raise OSError(getattr(errno, kernel_error), kernel_error)

        monkeypatch.setattr(os, "copy_file_range", refuse)
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 123, dtype=np.uint8).tobytes()
    src.write_bytes(data)
    dst.write_bytes(b"old bytes")
    told: list[int] = []
    import weightsync.fsio as fsio

    monkeypatch.setattr(fsio, "_copy_in_chunks", lambda s, d, p, chunk=1 << 20, f=fsio._copy_in_chunks: f(s, d, p, chunk))
    assert copy_file(str(src), str(dst), told.append) == len(data)
    assert dst.read_bytes() == data and sum(told) == len(data) and len(told) == 4


def test_a_seed_copy_that_runs_out_of_disk_says_so_instead_of_retrying_another_way(tmp_path, monkeypatch):
    import errno

    from weightsync.fsio import copy_file

    calls = []

    def full(*args, **kwargs):
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    (tmp_path / "src").write_bytes(b"x" * 1000)
    with pytest.raises(OSError) as raised:
        copy_file(str(tmp_path / "src"), str(tmp_path / "dst"), lambda n: None)
    assert raised.value.errno == errno.ENOSPC and len(calls) == 1


def test_a_reader_that_stops_early_gets_no_traceback(world, capsys):
    """`weightsync inspect SRC --json | head -1`: the pipe closes under the command."""
    publish_v1(world, capsys)
    cmd = [sys.executable, "-m", "weightsync.cli", "inspect", world["source"], "--version", "1", "--tensors", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd())
    proc.stdout.close()  # the reader is gone before the first byte
    assert proc.wait(timeout=120) == 0
    assert b"Traceback" not in proc.stderr.read()
