"""``weightsync``: the operator's command line.

    weightsync publish SOURCE_DIR --version N --checkpoint DIR [--base-checkpoint DIR] [--full]
    weightsync pull LOCAL_DIR --seed-dir DIR --source-dir DIR --version N
    weightsync inspect SOURCE_DIR [--version N] [--tensors] [--density]
    weightsync verify LOCAL_DIR --source-dir DIR --version N [--seed-dir DIR]
    weightsync prune SOURCE_DIR --keep K [--dry-run]

Results print as tables (``--json`` for scripts). Exit codes: 0 ok, 1 verification found
mismatches, 2 bad request, 3 source not ready (retry later), 4 corrupt artifact, 5 local state,
6 conflict (another pull holds the host lock), 7 the host ran out of descriptors, memory or disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Sequence

import msgspec

from . import errors
from .codecs import supported_encodings
from .format.checksum import DEFAULT_CHECKSUM, supported_checksums

EXIT_CODES = [
    (errors.HostResourceError, 7),
    (errors.ConflictError, 6),
    (errors.SourceNotReadyError, 3),
    (errors.LocalStateError, 5),
    (errors.CorruptArtifactError, 4),
    (errors.InvalidRequestError, 2),
    (errors.PublishError, 2),
    (errors.WeightSyncError, 2),
]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = [bool(rows) and all(_is_number(row[i]) for row in cells[1:] if row[i]) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_number(s: str) -> bool:
    try:
        float(s.rstrip("%").replace(",", ""))
        return True
    except ValueError:
        return False


def human_bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Progress:
    """One line on stderr, rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, label: str, enabled: bool = True):
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        frac = done / total
        decile = int(frac * 10)
        if not self.tty and decile == self._last_decile and done != total:
            return
        self._last_decile = decile
        bar = "#" * int(frac * 30)
        msg = f"{self.label} [{bar:<30}] {done}/{total} {time.perf_counter() - self.t0:.1f}s"
        sys.stderr.write(("\r" + msg) if self.tty else (msg + "\n"))
        if self.tty and done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _emit(args, obj, table: str) -> None:
    if args.json:
        print(json.dumps(msgspec.to_builtins(obj), indent=1))
    else:
        print(table)


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
        result = pub.publish(args.version, new, full=True if args.full else None)
    finally:
        pub.close()
    table = format_table(
        ["version", "kind", "encoding", "reason", "wire", "full", "changed elements"],
        [[result.version, result.kind, result.encoding, result.reason, human_bytes(result.wire_nbytes),
          human_bytes(result.full_nbytes), f"{100 * result.changed_fraction:.3f}%"]],
    )
    if result.encoding_reason:
        table += f"\nencoding: {result.encoding_reason}"
    _emit(args, result, table)
    return 0


def cmd_pull(args) -> int:
    from .puller.pull import pull

    result = pull(
        args.local_dir, args.seed_dir, args.source_dir, args.version, args.hook,
        lock_timeout_s=args.lock_timeout, workers=args.workers, progress=Progress("apply", not args.json),
    )
    table = format_table(
        ["version", "action", "deltas", "read", "seconds", "reason"],
        [[result.applied_version, result.action, result.deltas_applied, human_bytes(result.nbytes_read),
          f"{result.seconds:.3f}", result.reason]],
    )
    _emit(args, result, table)
    return 0


def cmd_inspect(args) -> int:
    from .inspect import describe_source, describe_version

    if args.version is None:
        summaries = describe_source(args.source_dir)
        rows = [[s.version, s.kind, s.status, s.base_version, s.delta_encoding, s.checksum_format, s.tensors,
                 human_bytes(s.wire_nbytes)] for s in summaries]
        table = format_table(["version", "kind", "status", "base", "encoding", "checksum", "tensors", "wire"], rows)
        _emit(args, summaries, table)
        return 0
    s = describe_version(args.source_dir, args.version, details=args.tensors, density=args.density, seed_dir=args.seed_dir)
    head = format_table(
        ["version", "kind", "status", "base", "encoding", "checksum", "tensors", "wire", "density"],
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

    report = verify_local(args.local_dir, args.source_dir, args.version, args.seed_dir, Progress("verify", not args.json))
    rows = [[n, e, a] for n, e, a in report.mismatched]
    table = f"v{report.version}: {report.checked} tensor(s) checked, {len(report.mismatched)} mismatched"
    if report.missing:
        shown = ", ".join(report.missing[:10]) + (f" (and {len(report.missing) - 10} more)" if len(report.missing) > 10 else "")
        table += f", {len(report.missing)} missing from the local checkpoint: {shown}"
    if report.unchecked:
        table += f", {len(report.unchecked)} unchecked (pass --seed-dir to check tensors unchanged since version 0)"
    if rows:
        table += "\n\n" + format_table(["tensor", "expected", "actual"], rows)
    _emit(args, report, table)
    return 0 if report.ok else 1


def cmd_prune(args) -> int:
    from .publisher.prune import prune_versions

    pruned = prune_versions(args.source_dir, keep=args.keep, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    _emit(args, {"pruned": pruned, "dry_run": args.dry_run}, f"{verb} {len(pruned)} version(s): {pruned}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightsync", description="Publish and pull weight versions.")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log the plan and each step")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("publish", help="publish one version from an HF checkpoint dir")
    s.add_argument("source_dir")
    s.add_argument("--version", type=int, required=True)
    s.add_argument("--checkpoint", required=True, help="HF checkpoint holding the new weights")
    s.add_argument("--base-checkpoint", help="HF checkpoint holding version - 1 (for a delta)")
    s.add_argument("--full", action="store_true", help="publish a full version (an anchor)")
    s.add_argument("--encoding", default=None, choices=[*supported_encodings(), "auto"],
                   help="delta encoding; auto: sparse-v1 or sparse-v2, whichever costs a puller less (needs the link)")
    s.add_argument("--link-bytes-per-s", type=float, default=None,
                   help="for --encoding auto: bytes/s one puller gets from SRC (default: WEIGHTSYNC_LINK_BYTES_PER_S)")
    s.add_argument("--checksum", default=DEFAULT_CHECKSUM, choices=supported_checksums())
    s.add_argument("--template-dir", help="dir whose config/tokenizer files a full version carries")
    s.add_argument("--fallback-fraction", type=float, default=None, help="full version when delta bytes > F x full")
    s.add_argument("--full-above-changed-fraction", type=float, default=None, help="full version when > F of elements changed")
    s.add_argument("--keep", type=int, default=None, help="prune older versions, keeping this many")
    s.set_defaults(func=cmd_publish)

    s = sub.add_parser("pull", help="bring a local checkpoint to a version")
    s.add_argument("local_dir")
    s.add_argument("--seed-dir", required=True, help="the engine's own model (version 0)")
    s.add_argument("--source-dir", required=True)
    s.add_argument("--version", type=int, required=True)
    s.add_argument("--hook", help="pre-read hook import path")
    s.add_argument("--lock-timeout", type=float, default=None)
    s.add_argument("--workers", type=int, default=None)
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("inspect", help="list versions, or describe one")
    s.add_argument("source_dir")
    s.add_argument("--version", type=int)
    s.add_argument("--tensors", action="store_true", help="list the tensors of the version")
    s.add_argument("--density", action="store_true", help="count each payload's changed elements and bytes")
    s.add_argument("--seed-dir", help="the model (version 0), for element widths when no full version precedes")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="check a local checkpoint against a version's digests")
    s.add_argument("local_dir")
    s.add_argument("--source-dir", required=True)
    s.add_argument("--version", type=int, required=True)
    s.add_argument("--seed-dir", help="the engine's own model, for tensors unchanged since version 0")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("prune", help="delete versions no pull can need")
    s.add_argument("source_dir")
    s.add_argument("--keep", type=int, default=2)
    s.add_argument("--dry-run", action="store_true")
    s.set_defaults(func=cmd_prune)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "encoding", "") is None:
        from .publisher.publish import DEFAULT_ENCODING

        args.encoding = DEFAULT_ENCODING
    try:
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
