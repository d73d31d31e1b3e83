# Set-up and the two commands the README opens with. Works on a fresh machine with Python 3.11 and pip:
# torch 2.13.0 (CPU build) is pinned so pip takes it from the local wheel instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup main test lint

$(BIN)/fabric-hsdp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/fabric-hsdp

main: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python examples/main_job.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider
