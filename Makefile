# Set-up and the two commands the README opens with. Works on a fresh machine with Python 3.11 and pip:
# torch 2.13.0 (CPU build) is pinned so pip takes it from the local wheel instead of a multi-GB CUDA build, and every
# other package at the version CI tests (.ci/constraints.txt). `make test CONSTRAINTS=` tests the newest versions.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= .ci/constraints.txt
PYTEST_ARGS ?=

.PHONY: setup main test lint

$(BIN)/fabric-hsdp: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"
	touch $@

setup: $(BIN)/fabric-hsdp

main: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python examples/main_job.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# --durations: the slowest tests and the total are printed, so the next person sees where the time goes.
# FABRIC_HSDP_NO_SKIPS=1: a skipped test fails (tests/conftest.py): all the README promises must have run.
test: lint
	FABRIC_HSDP_NO_SKIPS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 $(PYTEST_ARGS)
