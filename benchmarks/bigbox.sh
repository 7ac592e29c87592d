#!/usr/bin/env bash
# The whole sync benchmark on a big box (16 cores, an H200, 128 GiB) in one call of a few minutes:
# the real Qwen3-4B layout (8.0 GB of bf16, 398 tensors), the trainer simulation on the GPU,
# every figure of bench_sync.py (wire bytes, publish per core and with 16 workers, pull, catch-up
# over 8 deltas, 1 vs 16 workers, puller peak memory), plus the GPU-diff probe (diff on the
# device, move only the changed elements to the host) when CUDA is there; then the engine
# benchmark (bench_engine.py: pull inside vs outside the engine, pause of reload vs live apply).
#
#   bash benchmarks/bigbox.sh                # defaults below
#   STEPS=6 bash benchmarks/bigbox.sh        # shorter run
#   bash benchmarks/bigbox.sh --no-append    # extra args go to bench_sync.py and bench_engine.py
#
# Needs numpy, zstandard, xxhash, msgspec and torch importable by $PY (the box has no network:
# carry a prepared environment). On the lent H200 box (no sglang server possible, minutes per
# call) run benchmarks/gpu_check.sh instead: it carries its wheels, proves live apply in
# process and runs bench_sync.py at 4B within its budget (benchmarks/README.md, "The GPU kit"). Files go to /dev/shm when it has room (about 45 GB), else to
# $WORKDIR or /tmp; results are appended to benchmarks/RESULTS.md and printed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
"$PY" -c "import numpy, zstandard, xxhash, msgspec, torch" || {
    echo "bigbox.sh: $PY lacks numpy/zstandard/xxhash/msgspec/torch" >&2
    exit 2
}

# sparse-v2's range coder is compiled in place (a carried tree may lack it, or hold another
# machine's build); without a compiler sparse-v2 writes bitstream 2 and the report says so.
"$PY" setup.py --quiet build_ext --inplace >/dev/null 2>&1 ||
    echo "bigbox: the compiled range coder did not build; sparse-v2 falls back to bitstream 2" >&2

DEVICE=cpu
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
fi

need_gb=45
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc '0-9' || echo 0)
if [ -z "${WORKDIR:-}" ]; then
    if [ "${shm_free_gb:-0}" -ge "$need_gb" ]; then WORKDIR=/dev/shm; else WORKDIR=/tmp; fi
fi

WORKERS=${WORKERS:-$(nproc)}
STEPS=${STEPS:-10}
echo "bigbox: $(nproc) cores, device=$DEVICE, workdir=$WORKDIR, workers=$WORKERS, steps=$STEPS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

# per-core publish is measured on a ~1 GB subset (one worker on 8 GB would take minutes) and
# scaled; one repetition each, since the box is not shared.
"$PY" benchmarks/bench_sync.py --preset qwen3-4b --device "$DEVICE" --workers "$WORKERS" \
    --steps "$STEPS" --workdir "$WORKDIR" --percore-mb 1024 --reps 1 "$@"

# The engine side: a real sglang server (on the GPU when there is one) over the same Qwen3-4B
# layout at TP=1; a pull through /pull_weights against the same pull in a plain process, and
# the pause of /update_weights_from_disk against live apply (/update_weights_from_pulled) at 4%
# changed elements (target: live pause <= 50 ms and <= 5% of the reload's). Needs sglang
# importable by $PY; SKIP_ENGINE=1 skips it.
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
    if "$PY" -c "import sglang" 2>/dev/null; then
        "$PY" benchmarks/bench_engine.py --preset qwen3-4b --tp 1 --fractions 0.04 --device "$DEVICE" \
            --reps "${ENGINE_REPS:-3}" --workdir "$WORKDIR" "$@"
    else
        echo "bigbox: $PY cannot import sglang; skipping the engine benchmark (bench_engine.py)" >&2
    fi
fi
