# The two commands a new user types:
#   make quickstart   install the pinned CPU stack into .venv, build the tiny model, run a real RL job on CPU
#   make test         install the same stack, lint, and run the test suite (fast tier + end-to-end + Slurm)
# Other targets: make venv | make test-fast | make lint | make docs | make bench | make bench-partial | make bench-sync |
#   make bench-flatten | make bench-long | make bench-estimators | make bench-async | make bench-rollout
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.slimish-installed
PYTEST_ARGS ?=

.PHONY: venv quickstart test test-fast lint docs bench bench-partial bench-sync bench-flatten bench-long bench-estimators bench-async bench-rollout clean

venv: $(STAMP)

# torch first (pinned), so that resolving the rest keeps it; then the whole lock; then slimish itself.
$(STAMP): requirements/cpu-lock.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $$(grep -E '^(torch|torchvision)==' requirements/cpu-lock.txt)
	$(BIN)/pip install --quiet -r requirements/cpu-lock.txt
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/python -c "import slimish.compat.megatron_cpu as m; m.apply(); import sglang, sglang_router, ray; print('stack ok')"
	touch $(STAMP)

quickstart: venv
	$(BIN)/slimish make-tiny --out artifacts/tiny
	$(BIN)/slimish train configs/quickstart_cpu.yaml

lint: venv
	$(BIN)/ruff check slimish tests bench

# docs/config.md, generated from the config schema (tests/test_docs.py fails when it is out of date)
docs: venv
	$(BIN)/slimish config --markdown > docs/config.md

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/pytest -m "not e2e and not slurm" $(PYTEST_ARGS)

bench: venv
	$(BIN)/python bench/convert.py

bench-partial: venv
	$(BIN)/python bench/partial_rollout.py

bench-sync: venv
	$(BIN)/python bench/weight_sync.py

bench-flatten: venv
	$(BIN)/python bench/flatten.py

bench-long: venv
	$(BIN)/python bench/long_sequences.py

bench-estimators: venv
	$(BIN)/python bench/estimators.py

bench-async: venv
	$(BIN)/python bench/async_modes.py

bench-rollout: venv
	$(BIN)/python bench/rollout_overhead.py

clean:
	rm -rf $(VENV) artifacts runs .pytest_cache
