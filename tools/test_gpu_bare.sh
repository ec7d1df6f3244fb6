#!/bin/bash
# tests/gpu on a GPU machine whose python3 has torch with CUDA (and triton, transformers, pytest) but not our
# stack and no package index: a lent machine, or a bare node before the container is built.
#   bash tools/test_gpu_bare.sh prepare   # here, with the venv: megatron-core and transformers wheels at the lock's
#                                         # versions into .whl/, SGLang's GPU tensor-hash module alone into .gpu/
#                                         # (and its device-UUID reductions, for bench/tensor_buckets.py)
#   bash tools/test_gpu_bare.sh run       # there, in a copy of the repo with .whl/ and .gpu/; logs in $OUT
# Importing `sglang` pulls in its whole CUDA stack; the trainer's GPU checksums need one Triton kernel of it, so that
# module travels by itself (its imports are torch and triton). Last run: see docs/gpu.md "Checked on a GPU".
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  lock() { grep -i "^$1==" requirements/cpu-lock.txt; }
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$(lock megatron-core)" \
    "$(lock transformers)" || exit 1
  hash=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])")/kernels/ops/memory/gpu_tensor_hash.py
  mkdir -p .gpu/sglang_hash/sglang/kernels/ops/memory
  for d in sglang sglang/kernels sglang/kernels/ops sglang/kernels/ops/memory; do : > ".gpu/sglang_hash/$d/__init__.py"; done
  cp "$hash" .gpu/sglang_hash/sglang/kernels/ops/memory/
  # bench/tensor_buckets.py --device cuda: SGLang's device-UUID reductions (patch_torch.py, verbatim) and, in place of
  # its sglang.srt.utils.common (which imports the whole stack), the three names patch_torch takes from it.
  mkdir -p .gpu/sglang_hash/sglang/srt/utils
  for d in sglang/srt sglang/srt/utils; do : > ".gpu/sglang_hash/$d/__init__.py"; done
  cp "$(dirname "$(dirname "$hash")")/../../srt/utils/patch_torch.py" .gpu/sglang_hash/sglang/srt/utils/
  printf '%s\n' "import torch" "from packaging.version import parse" "torch_release = parse(torch.__version__).release" \
    "def is_npu(): return False" "def is_musa(): return False" > .gpu/sglang_hash/sglang/srt/utils/common.py
  echo "prepared: $(ls .whl | tr '\n' ' ')and SGLang's gpu_tensor_hash.py" ;;
run)
  export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/slimish-gpu}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  # A .pth file rather than PYTHONPATH: the test's trainer processes get PYTHONPATH=<repo> (tests/multiproc.py).
  printf '%s\n' /tmp/site "$PWD" "$PWD/.gpu/sglang_hash" \
    > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/slimish_gpu_check.pth"
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys, torch, triton, megatron.core as m, transformers as t; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__, 'transformers', t.__version__)"
    python3 -c "import sys; from slimish.cli import main; sys.exit(main(['check-gpu']))"
  } 2>&1 | grep -v -e "warnings.warn" -e "UserWarning" | tee "$OUT/env.txt"
  timeout "${T1:-400}" python3 -m pytest tests/gpu -p no:cacheprovider -v --basetemp=/tmp/slimish-gpu-pytest 2>&1 | tee "$OUT/test_gpu.log"
  rc=${PIPESTATUS[0]}
  timeout "${T2:-120}" python3 bench/tensor_buckets.py --device cuda 2>&1 | tee "$OUT/bench_tensor_buckets.log"
  exit "$rc" ;;
*) echo "usage: bash tools/test_gpu_bare.sh prepare|run" >&2; exit 2 ;;
esac
