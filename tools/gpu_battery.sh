#!/bin/bash
# The GPU battery: what one lent GPU machine (bare: python 3.12 with torch + CUDA, triton, transformers, pytest; no
# SGLang, Ray or Transformer Engine; no package index; 64 MiB carried in, 8 files back; 15 minutes of device time a
# session, machine start included) can prove, prepared here and run there in one call.
#
#   bash tools/gpu_battery.sh prepare    # here, with the venv (make gpu-battery-prepare): megatron-core's wheel for
#                                        # python 3.12 into .whl/, SGLang's two GPU modules into .gpu/; fails past the
#                                        # size limit
#   bash tools/gpu_battery.sh size       # what would travel (tracked + untracked files, .whl/, .gpu/), against 64 MiB
#   bash tools/gpu_battery.sh run        # there, in the repository root; logs in $OUT (at most 8 files)
#   ONLY=moe,attention bash tools/gpu_battery.sh run   # some parts only (a rerun)
#   DRY=1 bash tools/gpu_battery.sh run  # here, on the CPU with the venv: every part starts, at tiny sizes (make test)
#
# Parts, in the order of what their evidence is worth (each with its own timeout; PART_TIMEOUT_SCALE scales them):
#   env        nvidia-smi, versions, `slimish check-gpu`                                                  env.txt
#   moe        one-rank RL steps of a tiny Qwen3-MoE and a tiny DeepSeek-V3 on the GPU against the CPU     moe.log
#   attention  the trainer's local attention against its SDPA one at 2k / 8k / 32k tokens, padded, packed attention.log
#   long       one RL step of a 32k-token packed micro-batch (SDPA attention, bf16): peak memory, time  long.log
#   nccl       the weight-sync group on NCCL at one rank: a bucket, an abort, a second group               nccl.log
#   copies     host<->device rates pinned / pageable; flatten + CUDA-IPC buckets of a 4 GiB model          copies.log
#   tests_gpu  tests/gpu as `make test-gpu` runs it (the rest of the trainer's one-rank checks)             tests_gpu.log
# and summary.txt: each part's exit status and seconds. The device call (docs/gpu.md "The GPU battery"):
#   carry [".whl", ".gpu"], command "bash tools/gpu_battery.sh run", timeout_s 540.
set -u
cd "$(dirname "$0")/.."
LIMIT_MIB=${LIMIT_MIB:-64}  # what a device call carries (a test lowers it)
LIMIT_BYTES=$((LIMIT_MIB * 1024 * 1024))
PARTS_ALL="env moe attention long nccl copies tests_gpu"

travelling_bytes() {
  # What a device call carries: tracked and untracked-not-ignored files, plus the carried .whl/ and .gpu/.
  { git ls-files -z --cached --others --exclude-standard; find .whl .gpu -type f -print0 2>/dev/null; } \
    | sort -zu | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

check_size() {
  local bytes
  bytes=$(travelling_bytes)
  printf 'carried: %s MiB of the %d MiB limit (.whl: %s, .gpu: %s)\n' "$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')" \
    "$LIMIT_MIB" "$(du -sh .whl 2>/dev/null | cut -f1)" "$(du -sh .gpu 2>/dev/null | cut -f1)"
  if [ "$bytes" -gt "$LIMIT_BYTES" ]; then
    echo "gpu_battery: $bytes bytes would travel, over the $LIMIT_MIB MiB a device call carries: remove what is not needed" >&2
    return 1
  fi
}

prepare() {
  local py=.venv/bin/python
  [ -x "$py" ] || { echo "gpu_battery prepare: no .venv here; run make venv first" >&2; return 1; }
  lock() { grep -i "^$1==" requirements/cpu-lock.txt; }
  rm -rf .whl .gpu
  # megatron-core only: the machine's own transformers (5.17.0 there) would come first on the path all the same (the
  # carried wheels are added by a .pth file, after site-packages).
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$(lock megatron-core)" || return 1
  # SGLang's GPU tensor hash (the engines' checksums; its imports are torch and triton) and its device-UUID CUDA-IPC
  # reductions (bench/tensor_buckets.py --device cuda) travel alone: importing `sglang` pulls in its whole CUDA stack.
  local sglang
  sglang=$("$py" -c "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])")
  local root=.gpu/sglang_hash/sglang
  mkdir -p "$root/kernels/ops/memory" "$root/srt/utils"
  for d in "" kernels kernels/ops kernels/ops/memory srt srt/utils; do : > "$root/$d/__init__.py"; done
  cp "$sglang/kernels/ops/memory/gpu_tensor_hash.py" "$root/kernels/ops/memory/"
  cp "$sglang/srt/utils/patch_torch.py" "$root/srt/utils/"
  # In place of sglang.srt.utils.common (which imports the whole stack): the three names patch_torch takes from it.
  printf '%s\n' "import torch" "from packaging.version import parse" "torch_release = parse(torch.__version__).release" \
    "def is_npu(): return False" "def is_musa(): return False" > "$root/srt/utils/common.py"
  echo "prepared: $(ls .whl | tr '\n' ' ')and SGLang's gpu_tensor_hash.py and patch_torch.py"
  check_size
}

# run_part NAME SECONDS COMMAND...: the part's output into $OUT/<log>, its status and time into the summary.
run_part() {
  local name=$1 seconds=$2 log=$3
  shift 3
  case ",${ONLY:-${PARTS_ALL// /,}}," in *",$name,"*) ;; *) return 0 ;; esac
  seconds=$(awk -v s="$seconds" -v k="${PART_TIMEOUT_SCALE:-1}" 'BEGIN {print int(s * k)}')
  echo "=== $name (at most ${seconds}s) ==="
  local t0=$SECONDS rc
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | grep --line-buffered -v -e "warnings.warn" -e "UserWarning" \
    | tee -a "$OUT/$log"
  rc=${PIPESTATUS[0]}
  printf '%-10s rc=%-3s %4ss %s\n' "$name" "$rc" $((SECONDS - t0)) \
    "$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "(timed out)")" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || FAILED="${FAILED:-}$name "
}

run() {
  export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/slimish-gpu-battery}
  mkdir -p "$OUT"
  local py pytest_gpu=(-p no:cacheprovider -v --basetemp=/tmp/slimish-gpu-pytest)
  if [ "${DRY:-0}" = 1 ]; then
    # Every part starts and reaches its last line, on the CPU, at sizes that take seconds.
    py=$PWD/.venv/bin/python
    export CUDA_VISIBLE_DEVICES=""
  else
    py=python3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "gpu_battery: the carried wheels did not install (carry .whl: make gpu-battery-prepare)" >&2; exit 3; }
    # A .pth file rather than PYTHONPATH: the tests' trainer processes get PYTHONPATH=<repo> (tests/multiproc.py).
    printf '%s\n' /tmp/site "$PWD" "$PWD/.gpu/sglang_hash" \
      > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/slimish_gpu_check.pth"
  fi
  : > "$OUT/summary.txt"
  local dry=${DRY:-0}
  run_part env 60 env.txt bash -c "
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo 'nvidia-smi: not here'
    $py -c \"import sys, torch, triton, megatron.core as m, transformers as t; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'megatron-core', m.__version__, 'transformers', t.__version__)\"
    $py -c 'import importlib.util as u; print(\"transformer_engine:\", \"installed\" if u.find_spec(\"transformer_engine\") else \"absent\")'
    $py -m slimish.cli check-gpu || [ $dry = 1 ]"
  if [ "$dry" = 1 ]; then
    run_part moe 120 moe.log "$py" -m pytest tests/gpu/test_trainer_on_gpu.py -k moe --collect-only -q -p no:cacheprovider
    run_part attention 120 attention.log "$py" bench/attention_memory.py --device cpu --tokens 64,128 --heads 4 \
      --kv-heads 2 --head-dim 16 --dtype float32
    run_part long 120 long.log "$py" tools/gpu_checks/long_packed_step.py --device cpu --tokens 1024 --chunk 256
    run_part nccl 60 nccl.log "$py" tools/gpu_checks/nccl_weight_group.py --backend gloo --mib 4
    run_part copies 120 copies.log bash -c "$py bench/host_device_copies.py --device cpu --mib 8 --rounds 2 &&
      $py bench/tensor_buckets.py --device cpu --model-mib 16 --bucket-mb 4 --rounds 1"
    run_part tests_gpu 120 tests_gpu.log "$py" -m pytest tests/gpu --collect-only -q -p no:cacheprovider
  else
    run_part moe 240 moe.log python3 -m pytest tests/gpu/test_trainer_on_gpu.py -k moe -n 2 "${pytest_gpu[@]}"
    run_part attention 150 attention.log python3 bench/attention_memory.py
    run_part long 180 long.log python3 tools/gpu_checks/long_packed_step.py --tokens 32768
    run_part nccl 60 nccl.log python3 tools/gpu_checks/nccl_weight_group.py
    run_part copies 120 copies.log bash -c "python3 bench/host_device_copies.py &&
      python3 bench/tensor_buckets.py --device cuda --model-mib 4096 --bucket-mb 512 --rounds 2"
    # The offload test prints its figures, which pytest-xdist's workers would swallow: it runs by itself after.
    run_part tests_gpu 240 tests_gpu.log bash -c "python3 -m pytest tests/gpu -k 'not moe and not offload' -n 4 \
      ${pytest_gpu[*]}; rc=\$?; python3 -m pytest tests/gpu -k offload ${pytest_gpu[*]} || rc=1; exit \$rc"
  fi
  echo "=== summary ==="
  cat "$OUT/summary.txt"
  [ -z "${FAILED:-}" ] || { echo "gpu_battery: failed: $FAILED" >&2; exit 1; }
}

case "${1:-}" in
prepare) prepare ;;
size) check_size ;;
run) run ;;
*) echo "usage: bash tools/gpu_battery.sh prepare|size|run   (ONLY=part,... DRY=1)" >&2; exit 2 ;;
esac
