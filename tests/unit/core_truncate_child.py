"""Child process of the truncated-shard tests: runs one read of the source dir and cuts every
delta shard to its header (every payload cut) at the moment the first payload is about to be used (after the
pull has checked the shards and opened or mapped them). A map of a shard cut short kills the
process with SIGBUS; the test asserts this child ends with a typed error instead.

    python core_truncate_child.py library   LOCAL SEED SOURCE TARGET   # weightsync.pull
    python core_truncate_child.py cli       LOCAL SEED SOURCE TARGET   # weightsync.cli.main(["pull", ...])
    python core_truncate_child.py positions LOCAL SEED SOURCE TARGET   # puller.positions.iter_changed_elements

Prints "ok" (exit 0), or "typed <ErrorClass>" (exit 3) for a ``WeightSyncError``; the CLI's
own exit code and output are passed through.
"""

from __future__ import annotations

import glob
import os
import struct
import sys

CUT: list[str] = []


def cut_shards(source: str) -> None:
    if CUT:
        return
    for path in sorted(glob.glob(os.path.join(source, "weight_v*", "*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        os.truncate(path, 8 + n + 1)  # the header stays, every payload is cut
        CUT.append(path)


def cut_before(obj, attr: str, source: str) -> None:
    """Wrap ``obj.attr`` so the shards are cut just before its first call."""
    real = getattr(obj, attr)

    def wrapped(*a, **k):
        cut_shards(source)
        return real(*a, **k)

    setattr(obj, attr, wrapped)


def main(argv: list[str]) -> int:
    mode, local, seed, source, target = argv
    import weightsync.puller.apply as apply_mod
    import weightsync.puller.positions as positions
    from weightsync import errors, pull
    from weightsync.codecs import _CODECS

    for codec in _CODECS.values():
        for attr in ("apply", "apply_chain"):
            if hasattr(codec, attr):
                cut_before(codec, attr, source)
    cut_before(apply_mod, "apply_xor_chain", source)
    cut_before(positions, "changed_elements", source)
    try:
        if mode == "library":
            pull(local, seed, source, int(target), workers=1)
        elif mode == "cli":
            from weightsync.cli import main as cli_main

            return cli_main(["--json", "pull", local, "--seed-dir", seed, "--source-dir", source,
                             "--version", target, "--workers", "1"])  # fmt: skip
        elif mode == "positions":
            chain, indexes = positions.plan_change_chain(source, 0, int(target))
            for _ in positions.iter_changed_elements(local, source, chain, indexes):
                pass
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except errors.WeightSyncError as e:
        print(f"typed {type(e).__name__}: {e}", flush=True)
        return 3
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
