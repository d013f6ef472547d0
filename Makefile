# Everything a contributor does, one target each. The venv is .venv (or $TOKENDANCE_VENV);
# `make setup` creates it, every other target runs the set-up first (a no-op when current).
VENV ?= $(if $(TOKENDANCE_VENV),$(TOKENDANCE_VENV),.venv)
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench-quality bench-multiagent lint docs

setup:  ## virtual env, torch, SGLang, this package, the default model (idempotent)
	bash scripts/setup_cpu.sh

demo: setup  ## the main command: a multi-agent round on TokenDance vs stock SGLang
	bash scripts/serve_demo.sh

test:  ## every test, slow ones (real servers on SmolLM2) included: what CI runs
	bash scripts/run_tests.sh

test-fast:  ## tests that start no server (about 4 minutes)
	bash scripts/run_tests.sh -m "not slow"

bench-quality: setup  ## blended vs full prefill quality sweep (~20 min on 2 cores)
	$(PY) -m sglang_tokendance.bench_quality

bench-multiagent: setup  ## All-Gather rounds: stock radix vs TokenDance
	$(PY) -m sglang_tokendance.bench_multiagent

lint: setup  ## ruff (pyflakes + pycodestyle), settings in pyproject.toml
	$(PY) -m pip install -q --disable-pip-version-check "ruff==0.17.5"
	$(VENV)/bin/ruff check python test

docs: setup  ## regenerate docs/options.md from TokenDanceArgs
	$(PY) -m sglang_tokendance.server_args > docs/options.md
