# Set-up and the two commands the README opens with. Works on a fresh machine with Python 3.11 and pip:
# torch 2.13.0 (CPU build) is pinned so pip takes it from the local wheel instead of a multi-GB CUDA build, and every
# other package at the version CI tests (.ci/constraints.txt). `make test CONSTRAINTS=` tests the newest versions.
# `make test-torch TORCH=2.11.0` runs the core tests (CORE_TESTS) on another torch in .venv-torch-2.11.0 (a CUDA
# wheel from the registry, which runs on CPU); PINS="lightning==2.6.1 ..." replaces those packages' constraints.
PYTHON ?= python3
TORCH ?= 2.13.0
PINS ?=
# The floor: torch 2.8 with the oldest Lightning tested and the torchao release made for torch 2.8.
FLOOR_PINS := lightning==2.6.1 pytorch-lightning==2.6.1 torchao==0.13.0
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= .ci/constraints.txt
PYTEST_ARGS ?=
# pytest-timeout's session limits (tests/conftest.py cuts each test's timeout to what is left, so a hang ends named):
# `make test` measured 1015 s on a fresh clone, the core tests 181-312 s (2.14.1 the slowest); a hang stops the run
# (make stops at the first failure), so one limit is spent at most, long before CI's 90 minutes.
SESSION_TIMEOUT ?= 2400
CORE_SESSION_TIMEOUT ?= 900
space := $(subst ,, )
# Every path that differs across torch releases (fabric_hsdp/versions.py): raw loads of every format and mode, full
# and sharded save/load with resharding, async saves, HSDP and TP training parity, mixed precision, the dry run,
# convert.
CORE_TESTS ?= tests/checkpoint/test_load_raw.py tests/checkpoint/test_save_load.py tests/checkpoint/test_convert.py \
	tests/checkpoint/test_save_filter.py tests/tensor_parallel/test_training.py tests/tensor_parallel/test_checkpoints.py \
	tests/test_fsdp.py tests/test_init.py tests/test_strategy.py tests/test_dryrun.py tests/test_versions.py \
	tests/test_gradients.py

.PHONY: setup setup-test main test lint test-core test-torch test-range

# A user's set-up: the package and what the examples need (`.[examples]`: litgpt, transformers), no test extras. The
# constraints, less the packages PINS names (each pinned instead). torchao comes only with `.[float8]` (or the test
# extras): where it is installed, every process that imports transformers imports it too, and its import logs lines
# that look like failures ("Failed to load .../torchao/_C_mxfp8...so") and two torch deprecation warnings.
$(BIN)/fabric-hsdp: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH)
	$(if $(CONSTRAINTS),grep -v -x -E '($(subst $(space),|,$(foreach pin,$(PINS),$(firstword $(subst ==, ,$(pin))))))==.*' \
		$(CONSTRAINTS) > $(VENV)/constraints.txt)
	$(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(VENV)/constraints.txt) -e ".[examples]" $(PINS)
	$(BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	touch $@

# The test suite's extras on top (pytest, ruff, safetensors, torchao for the float8 conversion test).
$(VENV)/.test-extras: $(BIN)/fabric-hsdp
	$(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(VENV)/constraints.txt) -e ".[test]" $(PINS)
	$(BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	touch $@

setup: $(BIN)/fabric-hsdp

setup-test: $(VENV)/.test-extras

main: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python examples/main_job.py

# The planted bugs (tests/mutations/plants.py) must each still apply to the code: a plant whose snippet moved away
# would silently guard nothing.
lint: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tests/mutations/run.py --check

# --durations: the slowest tests and the total are printed, so the next person sees where the time goes.
# FABRIC_HSDP_NO_SKIPS=1: a skipped test fails (tests/conftest.py): all the README promises must have run.
test: lint
	FABRIC_HSDP_NO_SKIPS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 \
		--session-timeout=$(SESSION_TIMEOUT) $(PYTEST_ARGS)

# The core tests in this venv (no lint: `make test` lints).
# Killing a blocking save at each point (49 s) stays in the whole suite: nothing in it differs across releases.
test-core: setup-test
	FABRIC_HSDP_NO_SKIPS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 \
		--session-timeout=$(CORE_SESSION_TIMEOUT) $(PYTEST_ARGS) $(CORE_TESTS) \
		--deselect tests/checkpoint/test_save_load.py::test_killed_saves_leave_old_or_new_checkpoint

test-torch:
	$(MAKE) test-core VENV=.venv-torch-$(TORCH) TORCH=$(TORCH) PINS="$(PINS)"

# The tested range beyond the pinned torch: the floor (torch 2.8), 2.11 and 2.14.1. DROP_VENVS=1 (CI) removes each
# venv after its run: 5-7 GB each, their wheels stay in pip's cache.
test-range:
	$(MAKE) test-torch TORCH=2.8.0 PINS="$(FLOOR_PINS)"
	$(if $(DROP_VENVS),rm -rf .venv-torch-2.8.0)
	$(MAKE) test-torch TORCH=2.11.0
	$(if $(DROP_VENVS),rm -rf .venv-torch-2.11.0)
	$(MAKE) test-torch TORCH=2.14.1
	$(if $(DROP_VENVS),rm -rf .venv-torch-2.14.1)
