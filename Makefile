# Everything a fresh machine needs goes through scripts/setup_env.sh (idempotent).
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup_env.sh

demo: setup
	$(PY) -m miles_updater.demo

test: setup
	$(PY) -m pytest -q -ra tests

test-fast: setup
	$(PY) -m pytest -q -ra tests/unit -m "not slow"

bench: setup
	$(PY) benchmarks/bench_sync.py
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf .venv .pytest_cache .hypothesis
