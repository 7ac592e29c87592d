#!/usr/bin/env bash
# Builds .venv with everything the demo and the tests need on a CPU-only machine.
# Idempotent: a stamp file records the finished install; delete .venv to start over.
#
# Why the install is done by hand instead of `pip install .[engine,trainer]`:
# - sglang 0.5.23's own requirements pull several GB of CUDA wheels, so it goes in with
#   --no-deps plus the pure-Python packages it imports on the serving path;
# - megatron-core 0.19.2 declares Python >=3.12 but its cp311 wheel works here;
# - torch is pinned on every line so no resolver swaps in a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-complete-v1"
if [ -f "$STAMP" ]; then exit 0; fi

PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() {
  # This machine's pip config lists local package indexes that lack most names; pip warns once
  # per package about them. Drop those lines; everything else pip says is kept.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
PIP=(pip_install)
TORCH="torch==2.13.0"

echo "[setup] torch (CPU build) and the core's dependencies"
"${PIP[@]}" "$TORCH" numpy zstandard xxhash msgspec blake3 safetensors
echo "[setup] test tools"
"${PIP[@]}" "$TORCH" pytest pytest-timeout hypothesis requests matplotlib mypy
echo "[setup] sglang 0.5.23 (no deps) and what it imports on the serving path"
echo "[setup]   pip will list sglang's GPU requirements as 'not installed' and its torch pin as a conflict:"
echo "[setup]   expected, they are skipped on purpose (see the comment at the top of this script)"
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" "$TORCH" aiohttp fastapi 'uvicorn>=0.51' uvloop orjson pyzmq pydantic psutil \
  setproctitle transformers==5.19.0 tokenizers==0.23.2 pybase64 python-multipart \
  prometheus-client packaging tqdm regex pillow einops interegular partial_json_parser \
  openai==2.8.0 sentencepiece==0.2.1 tiktoken watchfiles distro scipy 'python-dateutil<3' \
  blobfile==3.0.0 httpx IPython dill apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf \
  jsonschema xgrammar==0.2.7 soundfile==0.13.1 triton
echo "[setup] megatron-core 0.19.2 (cp311 wheel, no deps) and ray"
"${PIP[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
"${PIP[@]}" "$TORCH" ray==2.60.0
echo "[setup] this project (editable)"
"${PIP[@]}" --no-deps -e .
touch "$STAMP"
echo "[setup] done: $VENV"
