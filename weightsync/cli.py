"""``weightsync``: the operator's command line.

    weightsync publish SOURCE_DIR --version N --checkpoint DIR [--base-checkpoint DIR] [--full]
    weightsync pull LOCAL_DIR --seed-dir DIR --source-dir DIR --version N
    weightsync inspect SOURCE_DIR [--version N] [--tensors] [--density]
    weightsync verify LOCAL_DIR --source-dir DIR --version N [--seed-dir DIR]
    weightsync prune SOURCE_DIR --keep K [--dry-run]
    weightsync version

Results print as tables (``--json`` for scripts; ``--json`` and ``-v`` go before or after the
subcommand). Long work shows progress in bytes on stderr (``weightsync.progress``). The exit
codes are ``EXIT_CODE_TABLE``, which ``--help`` prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from typing import Sequence

import msgspec

from . import errors, progress
from .codecs import supported_encodings
from .format.checksum import DEFAULT_CHECKSUM, supported_checksums
from .progress import human_bytes

EXIT_CODES = [
    (errors.HostResourceError, 7),
    (errors.ConflictError, 6),
    (errors.SourceNotReadyError, 3),
    (errors.LocalStateError, 5),
    (errors.CorruptArtifactError, 4),
    (errors.InvalidRequestError, 2),
    (errors.RankReportMissingError, 3),  # another rank has not reported yet: the same commit succeeds once it does
    (errors.PublishError, 2),
    (errors.BucketUnavailableError, 3),  # the store did not answer within the deadline: retry later
    (errors.WeightSyncError, 2),
]

# What each exit code means to a script; --help prints it, the README repeats it.
EXIT_CODE_TABLE = [
    (0, "ok"),
    (1, "verify found tensors that differ from the version, or missing ones"),
    (2, "bad request: fix the command (a wrong path, flag or version number); retrying will not help"),
    (3, "the source is not ready yet (the version is still being written): retry later"),
    (4, "a corrupt artifact in the source dir (republish it)"),
    (5, "the local state is at fault (LOCAL is not a usable directory, or damaged)"),
    (6, "conflict (another pull holds the host lock, or the version exists with other bytes)"),
    (7, "the host ran out of descriptors, memory or disk: free some and retry"),
    (130, "interrupted (Ctrl-C); a pull says on stderr what state LOCAL is left in"),
]

EXAMPLES = """\
examples:
  weightsync publish /shared/run1 --version 1 --checkpoint ckpt_v1 --base-checkpoint /models/qwen3
  weightsync pull /local/ckpt --seed-dir /models/qwen3 --source-dir /shared/run1 --version 1
  weightsync inspect /shared/run1
  weightsync inspect /shared/run1 --version 1 --tensors --density --seed-dir /models/qwen3
  weightsync verify /local/ckpt --source-dir /shared/run1 --version 1 --seed-dir /models/qwen3
  weightsync prune /shared/run1 --keep 2 --dry-run
  weightsync --json inspect /shared/run1      (--json and -v also work after the subcommand)
"""


def exit_code_help() -> str:
    return "exit codes:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODE_TABLE) + "\n"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table; a column empty in every row is left out (it would say nothing)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    keep = [i for i in range(len(headers)) if not rows or any(row[i] for row in cells[1:])]
    cells = [[row[i] for i in keep] for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keep))]
    right = [bool(rows) and all(_is_number(row[i]) for row in cells[1:] if row[i]) for i in range(len(keep))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_number(s: str) -> bool:
    try:
        float(s.rstrip("%").removesuffix(" B").removesuffix(" KiB").removesuffix(" MiB").removesuffix(" GiB")
              .removesuffix(" TiB").replace(",", ""))
        return True
    except ValueError:
        return False


SHORT_REASON_CHARS = 48


def short_reason(reason: str | None) -> str:
    """A table's reason cell: the first clause, at most ``SHORT_REASON_CHARS``; ``-v`` prints it whole."""
    text = (reason or "").strip()
    for cut in ("; ", " (", ": "):
        if cut in text:
            text = text.split(cut, 1)[0]
    if len(text) > SHORT_REASON_CHARS:
        text = text[: SHORT_REASON_CHARS - 3].rstrip() + "..."
    return text


def _long_reason(args, reason: str | None) -> str:
    """The whole reason under the table, with ``-v``, when the cell shortened it."""
    if args.verbose and reason and short_reason(reason) != reason.strip():
        return f"\nreason: {reason}"
    return ""


def _emit(args, obj, table: str) -> None:
    try:
        if args.json:
            print(json.dumps(msgspec.to_builtins(obj), indent=1))
        else:
            print(table)
        sys.stdout.flush()
    except BrokenPipeError:
        # `weightsync inspect SRC | head`: the reader left, which is no error of ours (and no
        # traceback); stdout goes to /dev/null so that the interpreter's exit flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _count_progress(args, label: str):
    """``fn(done, total)`` for work counted in items (verify's tensors), on the progress stream."""
    reporter = progress.reporter_for(json=args.json, verbose=args.verbose)
    if reporter is None or not reporter.bars:
        return None
    bar: list = []

    def report(done: int, total: int) -> None:
        if not bar:
            bar.append(progress.ByteBar(label, total, reporter.stream, tty=reporter.tty, unit="tensors"))
        bar[0].advance(done - bar[0].done)
        if done >= total:
            bar[0].close()

    return report


# --- commands -------------------------------------------------------------------------------


def cmd_publish(args) -> int:
    from .publisher.publish import Publisher, read_checkpoint_tensors

    pub = Publisher(
        args.source_dir, encoding=args.encoding, checksum=args.checksum, template_dir=args.template_dir or args.checkpoint,
        fallback_fraction=args.fallback_fraction, full_above_changed_fraction=args.full_above_changed_fraction,
        keep_versions=args.keep, link_bytes_per_s=args.link_bytes_per_s,
    )
    try:
        new = read_checkpoint_tensors(args.checkpoint)
        if args.full:
            pub.seed_snapshot(new, version=args.version - 1)
        elif args.base_checkpoint:
            pub.seed_snapshot_from_checkpoint(args.base_checkpoint, version=args.version - 1)
        else:
            raise errors.PublishError(
                "a delta needs the previous version's bytes: pass --base-checkpoint DIR (an HF checkpoint of "
                f"version {args.version - 1}), or --full to publish a full version"
            )
        result = pub.publish(args.version, new, full=True if args.full else None,
                             allow_layout_change=args.allow_layout_change)
    finally:
        pub.close()
    table = format_table(
        ["version", "kind", "encoding", "written to SRC", "changed elements", "reason"],
        [[result.version, result.kind, result.encoding, human_bytes(result.wire_nbytes + result.anchor_nbytes),
          # a full version's change is not measured against its predecessor: left blank, not "0%"
          "" if result.kind == "full" else f"{100 * result.changed_fraction:.3f}%", short_reason(result.reason)]],
    )
    table += _long_reason(args, result.reason)
    if result.encoding_reason and args.verbose:
        table += f"\nencoding: {result.encoding_reason}"
    _emit(args, result, table)
    return 0


def cmd_pull(args) -> int:
    from .puller.pull import describe_local_state, pull

    try:
        result = pull(
            args.local_dir, args.seed_dir, args.source_dir, args.version, args.hook,
            lock_timeout_s=args.lock_timeout, workers=args.workers, force=args.force,
        )
    except KeyboardInterrupt:  # one line on what LOCAL holds, and the shell's code for SIGINT
        print(f"interrupted: {describe_local_state(args.local_dir)}", file=sys.stderr)
        return 130
    table = format_table(
        ["version", "action", "deltas", "read from SRC", "seconds", "reason"],
        [[result.applied_version, result.action, result.deltas_applied, human_bytes(result.source_nbytes),
          f"{result.seconds:.3f}", short_reason(result.reason)]],
    )
    table += _long_reason(args, result.reason)
    _emit(args, result, table)
    return 0


def cmd_inspect(args) -> int:
    from .inspect import check_version_there, describe_source, describe_version

    if args.version is not None:
        check_version_there(args.source_dir, args.version)  # not there: a typed error, never exit 0
    if args.version is None:
        summaries = describe_source(args.source_dir)
        rows = [[s.version, s.kind, s.status, s.base_version, s.delta_encoding, s.checksum_format, s.tensors,
                 human_bytes(s.wire_nbytes)] for s in summaries]
        table = format_table(["version", "kind", "status", "base", "encoding", "checksum", "tensors", "stored"], rows)
        _emit(args, summaries, table)
        return 0
    s = describe_version(args.source_dir, args.version, details=args.tensors, density=args.density, seed_dir=args.seed_dir)
    head = format_table(
        ["version", "kind", "status", "base", "encoding", "checksum", "tensors", "stored", "density"],
        [[s.version, s.kind, s.status, s.base_version, s.delta_encoding, s.checksum_format, s.tensors,
          human_bytes(s.wire_nbytes), "" if s.density is None else f"{100 * s.density:.3f}%"]],
    )
    if s.tensor_details:
        head += "\n\n" + format_table(
            ["tensor", "shard", "payload", "tensor bytes", "changed elements", "changed bytes"],
            [[t.name, t.shard, human_bytes(t.payload_nbytes), human_bytes(t.tensor_nbytes), t.changed_elements,
              t.changed_bytes] for t in s.tensor_details],
        )
    if s.note:
        head += f"\n\nnote: {s.note}"
    _emit(args, s, head)
    return 0


def cmd_verify(args) -> int:
    from .inspect import verify_local

    report = verify_local(args.local_dir, args.source_dir, args.version, args.seed_dir, _count_progress(args, "verify"))
    rows = [[n, e, a] for n, e, a in report.mismatched]
    table = f"v{report.version}: {report.checked} tensor(s) checked, {len(report.mismatched)} mismatched"
    if report.missing:
        shown = ", ".join(report.missing[:10]) + (f" (and {len(report.missing) - 10} more)" if len(report.missing) > 10 else "")
        table += f", {len(report.missing)} missing from the local checkpoint: {shown}"
    if report.unchecked:
        table += f", {len(report.unchecked)} unchecked (pass --seed-dir to check tensors unchanged since version 0)"
    if report.layout_mismatched:
        table += f", {len(report.layout_mismatched)} header(s) not of the model's layout: {'; '.join(report.layout_mismatched[:5])}"
    if rows:
        table += "\n\n" + format_table(["tensor", "expected", "actual"], rows)
    _emit(args, report, table)
    return 0 if report.ok else 1


def cmd_prune(args) -> int:
    from .publisher.prune import prune_source

    report = prune_source(args.source_dir, keep=args.keep, dry_run=args.dry_run)
    pruned = report.pruned
    verb = "would delete" if args.dry_run else "deleted"
    table = f"{verb} {len(pruned)} version(s): {pruned}"
    for v, why in sorted(report.unreadable.items()):  # kept, with its side anchor: flagged, never a traceback
        table += f"\nskipped v{v}: its index is unreadable ({why})"
    _emit(args, {"pruned": pruned, "dry_run": args.dry_run,
                 "unreadable": {str(v): why for v, why in sorted(report.unreadable.items())}}, table)
    return 0


def tool_version() -> str:
    """The installed package's version (the checkout's ``__version__`` when run from a checkout)."""
    from importlib import metadata

    from . import __version__

    try:
        installed = metadata.version("weightsync")
    except metadata.PackageNotFoundError:
        return __version__
    return installed


def cmd_version(args) -> int:
    version = tool_version()
    _emit(args, {"version": version}, f"weightsync {version}")
    return 0


# --- the parser -----------------------------------------------------------------------------


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and appends ``(default: X)`` where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.required:
            return text
        if action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        return text


def _common_options(*, top: bool) -> argparse.ArgumentParser:
    """--json and -v, accepted before and after the subcommand. Below the top level the default
    is SUPPRESS, so a subcommand that does not see the flag keeps what the top level parsed."""
    common = argparse.ArgumentParser(add_help=False)
    default = False if top else argparse.SUPPRESS
    common.add_argument("--json", action="store_true", default=default,
                        help="print one JSON object on stdout instead of a table; no progress on stderr")
    common.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log the plan and each step; show progress even when stderr is not a terminal, "
                             "and whole reasons under the tables")
    return common


def _add_command(sub, name: str, help: str, description: str, examples: str):
    return sub.add_parser(
        name, help=help, description=textwrap.fill(description, 96), parents=[_common_options(top=False)],
        formatter_class=_HelpFormatter, epilog="examples:\n" + examples + "\n" + exit_code_help(),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightsync", description="Publish weight versions to a shared directory and pull them onto each host.",
        parents=[_common_options(top=True)], formatter_class=_HelpFormatter, epilog=EXAMPLES + "\n" + exit_code_help(),
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = _add_command(
        sub, "publish", "publish one version from an HF checkpoint dir",
        "Publish version N into SOURCE_DIR: a delta against --base-checkpoint (the bytes of version N-1), "
        "or a full version with --full.",
        "  weightsync publish /shared/run1 --version 1 --checkpoint ckpt_v1 --base-checkpoint /models/qwen3\n"
        "  weightsync publish /shared/run1 --version 1 --checkpoint ckpt_v1 --full\n",
    )
    s.add_argument("source_dir", metavar="SOURCE_DIR", help="the run's shared directory (created on the first publish)")
    s.add_argument("--version", type=int, required=True, metavar="N", help="the version number: the newest published plus one")
    s.add_argument("--checkpoint", required=True, metavar="DIR", help="HF checkpoint dir holding the new weights")
    s.add_argument("--base-checkpoint", metavar="DIR",
                   help="HF checkpoint dir holding version N-1's bytes, to diff against (default: none; "
                        "a delta needs it, --full does not)")
    s.add_argument("--full", action="store_true", help="publish a full version instead of a delta")
    s.add_argument("--allow-layout-change", action="store_true",
                   help="let a full version change the tensor set, a dtype or a shape of the version before it "
                        "(refused otherwise; the index records it) (default: off)")
    s.add_argument("--encoding", default=None, choices=[*supported_encodings(), "auto"],
                   help="delta encoding; auto: sparse-v1 or sparse-v2, whichever costs a puller less (needs "
                        "--link-bytes-per-s) (default: sparse-v1)")
    s.add_argument("--link-bytes-per-s", type=float, default=None, metavar="B",
                   help="for --encoding auto: bytes/s one puller gets from SOURCE_DIR (default: "
                        "$WEIGHTSYNC_LINK_BYTES_PER_S; auto refuses to guess)")
    s.add_argument("--checksum", default=DEFAULT_CHECKSUM, choices=supported_checksums(),
                   help="the per-tensor checksum recorded in the index")
    s.add_argument("--template-dir", metavar="DIR",
                   help="dir whose config/tokenizer files a full version carries (default: --checkpoint)")
    s.add_argument("--fallback-fraction", type=float, default=None, metavar="F",
                   help="publish a full version when the delta would exceed F x the full size "
                        "(default: $WEIGHTSYNC_FALLBACK_FRACTION or 0.5)")
    s.add_argument("--full-above-changed-fraction", type=float, default=None, metavar="F",
                   help="publish a full version when more than F of the elements changed "
                        "(default: $WEIGHTSYNC_FULL_ABOVE_CHANGED_FRACTION or 0.5)")
    s.add_argument("--keep", type=int, default=None, metavar="K",
                   help="after publishing, prune older versions keeping the newest K (default: "
                        "$WEIGHTSYNC_KEEP_VERSIONS or 8)")
    s.set_defaults(func=cmd_publish)

    s = _add_command(
        sub, "pull", "bring a local checkpoint to a version",
        "Bring LOCAL_DIR to version N of --source-dir: seed it from --seed-dir (version 0) or a full version, "
        "apply the deltas in place, verify every tensor.",
        "  weightsync pull /local/ckpt --seed-dir /models/qwen3 --source-dir /shared/run1 --version 3\n",
    )
    s.add_argument("local_dir", metavar="LOCAL_DIR", help="the host-local checkpoint dir to bring up to date (created if missing)")
    s.add_argument("--seed-dir", required=True, metavar="DIR", help="the engine's own model (version 0)")
    s.add_argument("--source-dir", required=True, metavar="DIR", help="the run's shared directory")
    s.add_argument("--version", type=int, required=True, metavar="N", help="the version to reach (0: the seed dir)")
    s.add_argument("--hook", metavar="PKG.MOD.FN",
                   help="fn(source_dir, version) run before reading the source, e.g. to refresh a mount (default: none)")
    s.add_argument("--lock-timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for another pull on this host (default: $WEIGHTSYNC_LOCK_TIMEOUT_S or 600)")
    s.add_argument("--workers", type=int, default=None, metavar="N",
                   help="threads applying deltas (default: $WEIGHTSYNC_APPLY_WORKERS or one per core, at most 32)")
    s.add_argument("--force", action="store_true",
                   help="pull into a non-empty dir weightsync did not write, replacing its files (default: refused)")
    s.set_defaults(func=cmd_pull)

    s = _add_command(
        sub, "inspect", "list versions, or describe one",
        "List the versions in SOURCE_DIR, or describe one (--version N).",
        "  weightsync inspect /shared/run1\n"
        "  weightsync inspect /shared/run1 --version 3 --tensors --density --seed-dir /models/qwen3\n",
    )
    s.add_argument("source_dir", metavar="SOURCE_DIR", help="the run's shared directory")
    s.add_argument("--version", type=int, metavar="N", help="describe this version (default: list every version)")
    s.add_argument("--tensors", action="store_true", help="list the tensors of the version")
    s.add_argument("--density", action="store_true", help="count each payload's changed elements and bytes")
    s.add_argument("--seed-dir", metavar="DIR",
                   help="the model (version 0), for element widths when no full version precedes (default: none)")
    s.set_defaults(func=cmd_inspect)

    s = _add_command(
        sub, "verify", "check a local checkpoint against a version's digests",
        "Check every tensor of LOCAL_DIR against version N's digests; exit 1 on a mismatch or a missing tensor.",
        "  weightsync verify /local/ckpt --source-dir /shared/run1 --version 3 --seed-dir /models/qwen3\n",
    )
    s.add_argument("local_dir", metavar="LOCAL_DIR", help="the local checkpoint dir to check")
    s.add_argument("--source-dir", required=True, metavar="DIR", help="the run's shared directory")
    s.add_argument("--version", type=int, required=True, metavar="N", help="the version LOCAL_DIR should hold")
    s.add_argument("--seed-dir", metavar="DIR",
                   help="the engine's own model, to check tensors unchanged since version 0 (default: those stay unchecked)")
    s.set_defaults(func=cmd_verify)

    s = _add_command(
        sub, "prune", "delete versions no pull can need",
        "Delete old versions of SOURCE_DIR, keeping the newest K and whatever a fresh host needs to pull them.",
        "  weightsync prune /shared/run1 --keep 2 --dry-run\n",
    )
    s.add_argument("source_dir", metavar="SOURCE_DIR", help="the run's shared directory")
    s.add_argument("--keep", type=int, default=2, metavar="K", help="the newest versions to keep")
    s.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    s.set_defaults(func=cmd_prune)

    s = _add_command(sub, "version", "print the tool's version", "Print weightsync's version.", "  weightsync version\n")
    s.set_defaults(func=cmd_version)
    return p


def _refuse_a_bucket_where_unsupported(args) -> None:
    """Every command takes a bucket URL (docs/BUCKETS.md); an HTTP(S) source is for pull only,
    and the others say so instead of calling the URL missing."""
    source_dir = getattr(args, "source_dir", None)
    if args.func is not cmd_pull and isinstance(source_dir, str) and source_dir.startswith(("http://", "https://")):
        raise errors.InvalidRequestError(
            f"{source_dir} is an HTTP(S) source: only pull reads one (docs/FLEET.md). Run this command on the "
            "directory that server serves."
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "encoding", "") is None:
        from .publisher.publish import DEFAULT_ENCODING

        args.encoding = DEFAULT_ENCODING
    try:
        with progress.reporting(progress.reporter_for(json=args.json, verbose=args.verbose)):
            _refuse_a_bucket_where_unsupported(args)
            return args.func(args)
    except errors.WeightSyncError as e:
        code = next(c for cls, c in EXIT_CODES if isinstance(e, cls))
        if args.json:
            print(json.dumps({"success": False, "error_type": e.error_type, "message": str(e)}))
        else:
            print(f"error [{e.error_type}]: {e}", file=sys.stderr)
        return code
    except FileNotFoundError as e:
        print(f"error [not_found]: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
