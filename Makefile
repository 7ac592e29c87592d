# Everything a fresh machine needs goes through scripts/setup_env.sh (idempotent).
PY := .venv/bin/python
# The second supported sglang (0.5.16) lives in a venv of its own; the version-matrix run starts
# its servers with this interpreter (testbed/sglang_cpu.py reads WEIGHTSYNC_SGLANG_PYTHON).
PY_SGLANG0516 := .venv-sglang0516/bin/python
# The pull module's last test is a live apply and a rolled-back one (issue 19: live apply runs on 0.5.16 too).
# A pull from a bucket (s3://) runs on both too (issue 26).
SGLANG_MATRIX_TESTS := tests/e2e/test_engine_pull_tp2.py tests/e2e/test_live_map_models.py tests/e2e/test_live_other_writers.py \
  tests/e2e/test_bucket_engine_pull.py tests/e2e/test_live_update_check_failure.py
export PYTHONUNBUFFERED := 1

.PHONY: setup setup-main demo test test-sglang0516 test-fast bench bench-fleet clean

setup:
	bash scripts/setup_env.sh

setup-main:  # only .venv (what the demo, the unit tests and the benchmarks need)
	SKIP_SGLANG0516=1 bash scripts/setup_env.sh

demo: setup-main
	$(PY) -m miles_updater.demo

test: setup
	$(PY) -m pytest -q -ra tests
	$(MAKE) --no-print-directory test-sglang0516

# One shared-server module against sglang 0.5.16 (the whole suite runs against 0.5.23 above).
test-sglang0516: setup
	WEIGHTSYNC_SGLANG_PYTHON=$(PY_SGLANG0516) $(PY) -m pytest -q -ra $(SGLANG_MATRIX_TESTS)

test-fast: setup-main
	$(PY) -m pytest -q -ra tests/unit -m "not slow"

bench: setup-main
	$(PY) benchmarks/bench_sync.py
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_read_back.py --append
	$(PY) benchmarks/bench_bucket.py --rounds 3 --append

# Time to fleet (issue 29, docs/FLEET.md): 8 and 16 hosts in network namespaces (root), direct
# against the nginx caching tier; appends its table to benchmarks/RESULTS.md.
bench-fleet: setup-main
	$(PY) benchmarks/bench_fleet.py --hosts 8,16 --repeats 3 --append

clean:
	rm -rf .venv .venv-sglang0516 .pytest_cache .hypothesis
