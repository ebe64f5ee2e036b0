# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv when it is missing and install what they need (CPU torch 2.13.0, ~2 minutes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: demo test test-slow test-all install docs clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" --ignore=tests/gpu $(PYTEST_ARGS)

# the slow lane of .ci/run: the 100k-frame fuzz, unbounded long polls, chaos in pinned states (~15 min on 2 cores)
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not gpu" --ignore=tests/gpu $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

docs: $(STAMP)
	$(VENV)/bin/fleetrl config docs > docs/config.md

clean-venv:
	rm -rf $(VENV)
