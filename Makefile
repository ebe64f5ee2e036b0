# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv when it is missing and install what they need (CPU torch 2.13.0, ~2 minutes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=

VENV_VLLM ?= .venv-vllm
VENV_VERIFIERS ?= .venv-verifiers

.PHONY: demo test test-slow test-all test-cluster test-vllm test-verifiers test-health install docs clean-venv lint format

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu and not cluster and not quiet" --ignore=tests/vllm --ignore=tests/verifiers --durations=30 $(PYTEST_ARGS)

# healthy runs stay quiet (issue 23): the demo at max_staleness 0/2/4/8, 300 steps each, no health event (~17 min;
# not in .ci/run, which it would push past an hour)
test-health: $(STAMP)
	$(PY) -m pytest -q -m quiet tests/e2e/test_quiet_runs.py -p no:cacheprovider -s $(PYTEST_ARGS)

# Real engines on this machine: a one-host Slurm (slurm-wlm + munge from apt, daemons started by the
# tests) and a local Ray (the `ray` extra). Needs root; installs what it needs and fails loudly.
test-cluster: $(STAMP)
	bash scripts/cluster_deps.sh $(PY)
	$(PY) -m pytest -q -m cluster tests/cluster -p no:cacheprovider --durations=10 $(PYTEST_ARGS)

# The vLLM lane (opt-in; .ci/run runs it): vLLM's CPU backend in its own .venv-vllm (~3 min and ~3.4 GB
# the first time), then tests/vllm: engine, weights received in the worker, and `fleetrl run` with it.
test-vllm:
	VENV=$(VENV_VLLM) bash scripts/vllm_env.sh
	FLEETRL_VLLM_LANE=1 $(VENV_VLLM)/bin/python -m pytest -q tests/vllm -p no:cacheprovider $(PYTEST_ARGS)

# The verifiers lane: verifiers 0.4.0 (the optional extra, ~100 packages) in its own .venv-verifiers with CPU torch
# 2.13.0 (~2 min the first time; fails loudly when an install fails), then tests/verifiers: the adapter
# (`rollout.env.type: verifiers`) and `fleetrl run` training a local verifiers taskset.
test-verifiers:
	VENV=$(VENV_VERIFIERS) bash scripts/verifiers_env.sh
	$(VENV_VERIFIERS)/bin/python -m pytest -q -m verifiers tests/verifiers -p no:cacheprovider $(PYTEST_ARGS)

# the slow lane of .ci/run: the 100k-frame fuzz, unbounded long polls, chaos (short and pinned), the smoke configs that
# repeat grpo's path, ZeRO-2 on two ranks (~8 min on 2 cores here)
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not gpu and not cluster and not quiet" --ignore=tests/vllm --ignore=tests/verifiers --durations=30 $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not cluster and not quiet" --ignore=tests/vllm --ignore=tests/verifiers --durations=30 $(PYTEST_ARGS)

# ruff (lint + format check, line length 120) over the code; mypy over the typed floors: common/, broker/ and
# learner/algorithms/. mypy reads the fleetrl.* names through a tree of links in .lint/ (the editable install's
# import hook is invisible to it). The tools come with the dev extra.
MYPY_PACKAGES := -p fleetrl.common -p fleetrl.broker -p fleetrl.learner.algorithms
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@mkdir -p .lint/fleetrl && for d in common broker rollout learner app; do ln -sfn ../../$$d .lint/fleetrl/$$d; done
	$(VENV)/bin/mypy $(MYPY_PACKAGES)

# format the files given (FILES=...), or the whole tree; one commit of its own (it touches everything)
FILES ?= .
format: $(STAMP)
	$(VENV)/bin/ruff format $(FILES)

docs: $(STAMP)
	$(VENV)/bin/fleetrl config docs > docs/config.md

clean-venv:
	rm -rf $(VENV)
