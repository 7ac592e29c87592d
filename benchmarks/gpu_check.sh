#!/usr/bin/env bash
# The GPU kit (issue 20): every GPU path proven and the pause measured in one call of the H200
# box, under 6 minutes, with what it needs carried as wheels. See benchmarks/README.md.
#
#   bash benchmarks/gpu_check.sh fetch          # here: download the wheels of gpu_wheels.txt into .whl/, check the size
#   bash benchmarks/gpu_check.sh check-wheels   # here: the carried set against the pins and the 64 MiB limit
#   bash benchmarks/gpu_check.sh run [--device cuda|cpu] [--preset qwen3-4b|small] [--budget-s 330]
#                                    [--parts engine,trainer,bench] [--mirror] [--out DIR]
#
# On the box (one `run` call of the device tool, carry [".whl"], timeout_s 420):
#   bash benchmarks/gpu_check.sh run            # = --device cuda --preset qwen3-4b, results in $OUT
# The rehearsal here (what tests/e2e/test_gpu_kit_rehearsal.py runs):
#   bash benchmarks/gpu_check.sh run --device cpu --preset small --mirror
#
# run: installs the carried wheels into a temporary --target (the device README's pip line), then
# the parts in order of value, each under its own time limit, all inside --budget-s:
#   engine   live apply on the device with sglang's own Qwen3 class (exactness, fault, the pause)
#   trainer  the trainer's tests on the device and its device-to-host bytes per step
#   bench    bench_sync.py --preset qwen3-4b --device cuda, few steps (the sync benchmark at 4B)
# Everything lands in $OUT: gpu_check.json (verdicts + every figure), gpu_check.md (the block for
# benchmarks/RESULTS.md), gpu_check.log and trainer_junit.xml.
# --mirror (the rehearsal): this interpreter sees only the packages the box has plus the
# carried ones (benchmarks/gpu_mirror/sitecustomize.py), so a missing wheel fails here first.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PY:-python3}
WHEELS=${WHEELS:-$REPO/.whl}

fetch() {
    mkdir -p "$WHEELS"
    # pip matches a manylinux_2_N tag exactly: sglang 0.5.23's wheel is manylinux_2_34
    local plats=()
    for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
        manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        plats+=(--platform "$p")
    done
    # a wheel of another version left from an earlier list would stop the install on the box
    find "$WHEELS" -name '*.whl' -delete
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plats[@]}" -d "$WHEELS" -r benchmarks/gpu_wheels.txt \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) || return 1
    check_wheels
}

check_wheels() {
    local tmp
    tmp=$(mktemp -d)
    "$PY" benchmarks/gpu_check.py wheels --wheel-dir "$WHEELS" --json "$tmp/wheels.json" --installable "$tmp/list"
    local rc=$?
    rm -rf "$tmp"
    return $rc
}

run() {
    local device=auto preset=qwen3-4b budget=330 parts=engine,trainer,bench mirror=0
    local out=${OUT:-$REPO/out/gpu-check}
    while [ $# -gt 0 ]; do
        case $1 in
            --device) device=$2; shift 2 ;;
            --preset) preset=$2; shift 2 ;;
            --budget-s) budget=$2; shift 2 ;;
            --parts) parts=$2; shift 2 ;;
            --mirror) mirror=1; shift ;;
            --out) out=$2; shift 2 ;;
            *) echo "gpu_check.sh: unknown option $1" >&2; return 2 ;;
        esac
    done
    mkdir -p "$out"
    local start=$SECONDS
    exec > >(tee "$out/gpu_check.log") 2>&1
    if [ "$device" = auto ]; then
        device=cpu
        "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && device=cuda
    fi
    work=$(mktemp -d /tmp/gpu-check.XXXXXX)  # global: the EXIT trap removes it
    trap 'rm -rf "$work"' EXIT
    echo "gpu_check: $(date -u '+%F %T') UTC, $(nproc) cores, device=$device, preset=$preset, budget ${budget}s, parts $parts, mirror=$mirror"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"

    # the carried wheels, into a temporary site dir (the device README's line); where this Python
    # cannot install one (a cp312 wheel on a cp311 rehearsal), its same-version twin installed
    # here stays visible through the mirror instead
    local merged=()
    "$PY" benchmarks/gpu_check.py wheels --wheel-dir "$WHEELS" --json "$work/wheels.json" --installable "$work/installable"
    local wrc=$?
    merged+=("wheels:$work/wheels.json:$wrc:0:0")
    [ $wrc = 0 ] || echo "gpu_check: the carried wheel set has problems (above); going on with what there is"
    # a check that could not run still installs every carried wheel (the device README's line)
    [ -f "$work/installable" ] || ls "$WHEELS"/*.whl >"$work/installable" 2>/dev/null
    local site=$work/site
    if [ -s "$work/installable" ]; then
        # shellcheck disable=SC2046
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            $(cat "$work/installable") || { echo "gpu_check: installing the carried wheels failed"; return 1; }
    fi
    export PYTHONPATH="$site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    if [ "$mirror" = 1 ]; then
        local also
        also=$("$PY" -c "import json, sys; print(','.join(json.load(open(sys.argv[1]))['not_installable_here']))" "$work/wheels.json")
        "$PY" benchmarks/gpu_check.py mirror --dir "$work/mirror" --also "$also" ||
            echo "gpu_check: the mirror differs from the box (above)"
        export WEIGHTSYNC_BOX_MIRROR_DIR=$work/mirror
        export PYTHONPATH="$REPO/benchmarks/gpu_mirror:$PYTHONPATH"
    fi
    export PYTHONUNBUFFERED=1

    # sparse-v2's range coder, compiled in place (best effort: without it bitstream 2 is written)
    timeout 60 "$PY" setup.py --quiet build_ext --inplace >"$work/build.log" 2>&1 ||
        echo "gpu_check: the range coder did not build (sparse-v2 falls back to bitstream 2): $(tail -2 "$work/build.log")"

    left() { echo $((budget - (SECONDS - start))); }
    part() {  # part NAME LIMIT CMD...: run CMD under min(LIMIT, what is left less a reserve)
        local name=$1 limit=$2
        shift 2
        local room=$(($(left) - 15))
        [ "$limit" -gt "$room" ] && limit=$room
        if [ "$limit" -lt 20 ]; then
            echo "gpu_check: part $name not run: $(left)s of the budget left"
            merged+=("$name:$work/$name.json:125:0:0")
            return
        fi
        echo "gpu_check: part $name (limit ${limit}s)"
        local t0=$SECONDS
        timeout -k 5 "$limit" "$@"
        local rc=$?
        echo "gpu_check: part $name rc=$rc in $((SECONDS - t0))s"
        merged+=("$name:$work/$name.json:$rc:$((SECONDS - t0)):$limit")
    }
    local big=0
    [ "$preset" = qwen3-4b ] && big=1
    local data=$work/data
    mkdir -p "$data"
    case ",$parts," in *,engine,*)
        # sglang's CPU import path with the kernel package stubbed (as the CPU tests do)
        part engine $((big ? 200 : 150)) env SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$REPO/tests/cpu_scaffolding:$PYTHONPATH" \
            "$PY" benchmarks/gpu_check.py engine --device "$device" --preset "$preset" --json "$work/engine.json" \
            --keep-data --keep-model-dir "$work/model_dir"
        ;;
    esac
    case ",$parts," in *,trainer,*)
        local model_dir=""
        [ -s "$work/model_dir" ] && model_dir=$(cat "$work/model_dir")
        part trainer $((big ? 55 : 120)) "$PY" benchmarks/gpu_check.py trainer --device "$device" --preset "$preset" \
            --json "$work/trainer.json" ${model_dir:+--model-dir "$model_dir"} --pytest-timeout $((big ? 40 : 100))
        cp "$work/trainer.json.junit.xml" "$out/trainer_junit.xml" 2>/dev/null || true
        ;;
    esac
    # the engine's data (8 GB at 4B) goes before the benchmark needs the room
    [ -s "$work/model_dir" ] && rm -rf "$(dirname "$(cat "$work/model_dir")")"
    case ",$parts," in *,bench,*)
        local bench_preset=$preset steps=3
        [ "$preset" = small ] && bench_preset=tiny
        [ "$preset" = medium ] && bench_preset=small
        # bench_sync.py keeps its files in /dev/shm by default: about 45 GB at 4B (bigbox.sh's rule)
        local bench_dir=/tmp shm_gb
        shm_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc '0-9')
        [ "${shm_gb:-0}" -ge $((big ? 45 : 1)) ] && bench_dir=/dev/shm
        part bench 200 bash -c "\"$PY\" benchmarks/bench_sync.py --preset $bench_preset --device $device --steps $steps \
            --reps 1 --percore-mb 512 --no-append --workdir $bench_dir $([ "$big" = 1 ] && echo "--workers $(nproc)") \
            && echo '{\"ran\": true}' > \"$work/bench.json\""
        ;;
    esac
    "$PY" benchmarks/gpu_check.py merge --out "$out/gpu_check.json" --device "$device" --preset "$preset" "${merged[@]}"
    local rc=$?
    echo "gpu_check: done in $((SECONDS - start))s of ${budget}s; $out/gpu_check.json"
    sleep 1  # the log's tee drains before the device tool collects $OUT
    return $rc
}

cmd=${1:-run}
[ $# -gt 0 ] && shift
case $cmd in
    fetch) fetch ;;
    check-wheels) check_wheels ;;
    run) run "$@" ;;
    *) echo "usage: bash benchmarks/gpu_check.sh fetch|check-wheels|run [options]" >&2; exit 2 ;;
esac
