"""A long run with the default settings: 1,000 versions, then a host joins at the end.

The host must read at most about 2x the checkpoint from the source dir (side anchors), under a
limit of 256 file descriptors, and the source dir must stay bounded (pruning). Small tensors,
so it runs in seconds; the pull runs in a child process that lowers its own fd limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from weightsync import Publisher
from weightsync.format.layout import list_anchors, list_versions

from core_support import assert_checkpoint_is, mutate, random_tensors, tensor_bytes, write_hf_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"embed": ("float32", (64, 32)), "w1": ("float32", (32, 64)), "w2": ("float32", (32, 64)), "norm": ("float32", (64,))}
VERSIONS = 1000

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    from weightsync import pull
    r = pull(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    print(json.dumps({"source_nbytes": r.source_nbytes, "action": r.action, "reason": r.reason,
                      "deltas": r.deltas_applied}))
    """
)


def dir_nbytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_thousand_versions_then_a_late_host_joins_within_the_read_budget_under_256_fds(fast_tmp_path, rng):
    root = str(fast_tmp_path)
    seed, source, local = (os.path.join(root, n) for n in ("seed", "src", "local"))
    t = random_tensors(rng, SIZES)
    write_hf_checkpoint(seed, t)
    checkpoint_nbytes = os.path.getsize(os.path.join(seed, "model.safetensors"))
    pub = Publisher(source, workers=1)  # the defaults: sparse-v1, side anchors, pruning
    pub.seed_snapshot(t)
    largest_dir = 0
    for v in range(1, VERSIONS + 1):
        t = mutate(t, rng, 0.02)
        pub.publish(v, t)
        if v % 100 == 0:
            largest_dir = max(largest_dir, dir_nbytes(source))
    pub.close()
    versions, anchors = list_versions(source), list_anchors(source)
    assert versions[-1] == VERSIONS and versions[0] > VERSIONS - 200, "pruning keeps the source dir short"
    assert len(anchors) <= 3
    # Bounded: two anchors and the deltas since the older one (about 2 checkpoints), plus slack
    # for per-file headers of these tiny tensors; independent of the run's length.
    assert largest_dir <= 6 * checkpoint_nbytes, (largest_dir, checkpoint_nbytes)

    out = subprocess.run(
        [sys.executable, "-c", CHILD, local, seed, source, str(VERSIONS)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["action"] == "seed+chain" and "side anchor" in result["reason"], result
    assert result["source_nbytes"] <= 2 * checkpoint_nbytes, result
    assert_checkpoint_is(local, tensor_bytes(t))
