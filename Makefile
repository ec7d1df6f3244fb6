# The two commands a new user types:
#   make quickstart   install the pinned CPU stack into .venv, build the tiny model, run a real RL job on CPU
#   make test         install the same stack, lint, and run the test suite (fast tier + end-to-end + Slurm)
# Other targets: make venv | make venv-gpu | make test-fast | make test-gpu [EMULATE=1] | make gpu-battery-prepare | make lint | make docs | make bench | make bench-partial | make bench-sync | make bench-sync-sharded |
#   make bench-flatten | make bench-tensor-buckets | make bench-long | make bench-attention | make bench-estimators | make bench-async | make bench-rollout | make bench-reward-workers | make bench-step-time
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.slimish-installed
PYTEST_ARGS ?=

.PHONY: venv venv-gpu quickstart test test-fast test-gpu gpu-battery-prepare lint docs bench bench-partial bench-sync bench-sync-sharded bench-flatten bench-tensor-buckets bench-long bench-attention bench-estimators bench-async bench-rollout bench-reward-workers bench-step-time clean

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

# The GPU stack (requirements/gpu-lock.txt: the CPU lock plus Transformer Engine) in $(VENV), on a GPU node with the
# CUDA 13 toolkit and cuDNN headers (Transformer Engine's torch extension builds from source), then FlashInfer's
# prebuilt kernels for the locked flashinfer-python (its cubins and JIT cache, from FlashInfer's own wheel index, for
# the node's GPUs or FLASHINFER_SM, e.g. sm90a): without them every engine compiles its kernels with nvcc at first
# use, minutes per engine. Never run by CI.
FLASHINFER_SM ?=
venv-gpu: venv
	$(BIN)/pip install --quiet --no-build-isolation -r requirements/gpu-lock.txt
	$(BIN)/python -m flashinfer download-kernels $(if $(FLASHINFER_SM),--sm $(FLASHINFER_SM))
	$(BIN)/python tools/check_stack.py
	$(BIN)/slimish check-gpu
	$(BIN)/python -c "import transformer_engine.pytorch; print('gpu stack ok')"

quickstart: venv
	$(BIN)/slimish make-tiny --out artifacts/tiny
	$(BIN)/slimish train configs/quickstart_cpu.yaml

lint: venv
	$(BIN)/ruff check slimish tests bench tools
	$(BIN)/python tools/check_devices.py
	$(BIN)/lint-imports --no-cache

# docs/config.md, generated from the config schema (tests/test_docs.py fails when it is out of date)
docs: venv
	$(BIN)/slimish config --markdown > docs/config.md

# The fast tier runs in TEST_WORKERS processes (pytest-xdist; each file's tests together, in order, on one of them):
# run alone, its tests keep ~1.1 of 2 cores busy. The e2e and Slurm tiers follow in one process: their jobs want the
# whole machine, bind fixed ports and share engines (tests/e2e/conftest.py). TEST_WORKERS=0: the fast tier in one.
# Exit status 5 is pytest's "no test selected" (a PYTEST_ARGS that picks tests of one part only): not a failure.
TEST_WORKERS ?= 2
FAST_TIER := -m "not e2e and not slurm" -n $(TEST_WORKERS) --dist loadfile

test: lint
	$(BIN)/pytest $(FAST_TIER) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest -m "e2e or slurm" $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: venv
	$(BIN)/pytest $(FAST_TIER) $(PYTEST_ARGS)

# tests/gpu on this machine's NVIDIA GPU; one line and nothing else without one. EMULATE=1: the same tests on the
# emulated GPU (slimish/compat/emulated_gpu.py), which any machine has.
test-gpu: venv
ifeq ($(EMULATE),1)
	SLIMISH_EMULATED_GPU=1 $(BIN)/pytest tests/gpu $(PYTEST_ARGS)
else
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		$(BIN)/pytest tests/gpu $(PYTEST_ARGS); \
	else echo "make test-gpu: skipped, no usable CUDA device here (make test-gpu EMULATE=1 runs tests/gpu on the emulated GPU)"; fi
endif

# What a lent GPU machine runs (tools/gpu_battery.sh run, docs/gpu.md "The GPU battery"), built here: wheels for its
# python 3.12 and SGLang's two GPU modules; fails if more than a device call carries (64 MiB) would travel.
gpu-battery-prepare: venv
	bash tools/gpu_battery.sh prepare

bench: venv
	$(BIN)/python bench/convert.py

bench-partial: venv
	$(BIN)/python bench/partial_rollout.py

bench-sync: venv
	$(BIN)/python bench/weight_sync.py

bench-sync-sharded: venv
	$(BIN)/python bench/weight_sync.py --engine-tp 2 --layers 8
	$(BIN)/python bench/weight_sync.py --engine-tp 2 --layers 8 --senders 2

bench-flatten: venv
	$(BIN)/python bench/flatten.py

# DEVICE=cuda on a GPU machine: the tensor transport's fresh buffer per bucket against reused ones, over CUDA IPC
bench-tensor-buckets: venv
	$(BIN)/python bench/tensor_buckets.py --device $(or $(DEVICE),cpu)

bench-long: venv
	$(BIN)/python bench/long_sequences.py

# The core attention alone on the CPU: Megatron's local (S x S) attention against SDPA at 2k / 8k / 32k tokens.
bench-attention: venv
	$(BIN)/python bench/attention.py

bench-estimators: venv
	$(BIN)/python bench/estimators.py

bench-async: venv
	$(BIN)/python bench/async_modes.py

bench-rollout: venv
	$(BIN)/python bench/rollout_overhead.py

# The quickstart's step time at this tree against BASELINE (a git revision), alternating jobs in one run.
BASELINE ?= HEAD~1
bench-step-time: venv
	$(BIN)/python bench/step_time.py --baseline $(BASELINE)

bench-reward-workers: venv
	$(BIN)/python bench/reward_workers.py

clean:
	rm -rf $(VENV) artifacts runs .pytest_cache
