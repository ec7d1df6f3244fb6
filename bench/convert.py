"""Benchmark `slimish convert hf-to-megatron` against `cp` on synthetic ~2 GiB and ~8 GiB checkpoints.

    python bench/convert.py [--workdir /tmp] [--sizes-gib 2 8] [--workers N]      (or: make bench)

For each size it writes a random Llama-shaped bf16 checkpoint (real tensor names and shapes; the layer count sets
the size) as several safetensors shards and flushes it to disk, then times, in alternating rounds (--rounds), `cp` of
the shards (+ fsync, as the conversion fsyncs its output) and the conversion (the function behind the CLI) in a
child process, which reports its peak RSS (VmHWM) and, apart, its peak RSS after its imports and before converting
(torch's own share). Every timing starts with no dirty pages (the
previous output is deleted and the disk synced) and reads the shards from the page cache. Each side's best time
over the rounds is used (as timeit does): a single timing on a shared virtual disk swings 3-4x with other guests'
I/O, which only ever adds time. Conversion time is measured inside the child after its imports (a fixed start-up
cost, printed too). Everything is deleted afterwards. A line per size gives seconds, the ratio to cp of that size,
the peak RSS and the load average (the machine may be shared); the last line printed is
    convert_vs_cp_ratio=<x> ratio_<s>g=<r> ... peak_rss_<s>g_mib=<m> ... largest_tensor_mib=<c> workers=<n>
with convert_vs_cp_ratio = conversion throughput / cp throughput over all sizes from 8 GiB on (over all sizes when
none is that large). Targets: ratio >= 0.5 from 8 GiB on; peak RSS flat as the size grows (bounded by two chunks
per worker, or the largest fused tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slimish.megatron_bridge.hf_io import write_hf_shards

# Llama-3.2-1B-like widths with a smaller vocabulary; the layer count is chosen to reach each size.
BASE_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
               "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
               "vocab_size": 64000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
MiB = 1 << 20


def hf_specs(config: dict) -> list[tuple[str, torch.Tensor]]:
    """(HF name, meta tensor) of every tensor of `config`, as transformers names and shapes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **kwargs),
                                                 dtype=torch.bfloat16)
    return list(model.state_dict().items())


def nbytes(specs) -> int:
    return sum(meta.numel() * meta.element_size() for _, meta in specs)


def config_for_size(target_bytes: int) -> dict:
    per_layer = nbytes(hf_specs({**BASE_CONFIG, "num_hidden_layers": 2})) - nbytes(
        hf_specs({**BASE_CONFIG, "num_hidden_layers": 1}))
    fixed = nbytes(hf_specs({**BASE_CONFIG, "num_hidden_layers": 1})) - per_layer
    return {**BASE_CONFIG, "num_hidden_layers": max(1, round((target_bytes - fixed) / per_layer))}


def write_synthetic(out_dir: Path, config: dict) -> tuple[int, int]:
    """Random bf16 checkpoint for `config`; returns (total bytes, largest tensor bytes)."""
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    specs = hf_specs(config)
    block = torch.randn(64 * MiB // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def tensors():
        for name, meta in specs:
            n = meta.numel()
            data = block.repeat(-(-n // block.numel()))[:n] if n > block.numel() else block[:n]
            yield name, data.reshape(meta.shape)

    write_hf_shards(out_dir, specs, tensors(), max_shard_bytes=512 * MiB)
    return nbytes(specs), max(meta.numel() * meta.element_size() for _, meta in specs)


def time_cp(src: Path, dst: Path) -> float:
    dst.mkdir()
    shards = sorted(str(p) for p in src.glob("*.safetensors"))
    start = time.perf_counter()
    subprocess.run(["cp", *shards, str(dst)], check=True)
    subprocess.run(["sync", *[str(dst / Path(s).name) for s in shards]], check=True)  # fsync those files only
    return time.perf_counter() - start


# The conversion as `slimish convert hf-to-megatron` runs it, timed inside the child after its imports (torch and
# torch.distributed.checkpoint take seconds to import on a busy 2-core machine, a fixed cost unrelated to size).
_CHILD = """import sys, time
from slimish.megatron_bridge.convert import hf_to_megatron
def hwm_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
imports_kib = hwm_kib()
start = time.perf_counter()
hf_to_megatron(hf_dir=sys.argv[1], out_dir=sys.argv[2], progress=False, workers=int(sys.argv[3]) or None)
seconds = time.perf_counter() - start
print(seconds, hwm_kib(), imports_kib)
"""


def time_convert(src: Path, dst: Path, workers: int) -> tuple[float, float, float, float]:
    """(conversion seconds, child wall seconds including imports, peak RSS MiB, peak RSS MiB after the imports) of a
    conversion in a child.

    Peak RSS is the child's own VmHWM: its ru_maxrss (wait4 / getrusage) would start at this process's RSS, because
    Linux carries the pre-exec memory of a vfork'ed child (this process's) into maxrss.
    """
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst), str(workers)], stdout=subprocess.PIPE,
                            text=True)
    output = proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"conversion of {src} failed with exit code {proc.returncode}")
    wall = time.perf_counter() - start
    seconds, hwm_kib, imports_kib = output.strip().splitlines()[-1].split()
    return float(seconds), wall, int(hwm_kib) / 1024, int(imports_kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=3, help="alternating cp / convert timings per size")
    parser.add_argument("--workers", type=int, default=0, help="conversion threads (0: the converter's default)")
    args = parser.parse_args()
    free = shutil.disk_usage(args.workdir).free
    # One size at a time: the source and either its cp copy or the conversion (each deleted before the next), 5% over.
    need = 2.1 * max(args.sizes_gib) * (1 << 30)
    if free < need:
        sys.exit(f"need {need / (1 << 30):.1f} GiB free in {args.workdir}, have {free / (1 << 30):.1f}")
    from slimish.megatron_bridge.convert import default_workers

    workers = args.workers or default_workers()
    results, largest = {}, 0
    for size in args.sizes_gib:
        root = Path(tempfile.mkdtemp(prefix="slimish-bench-convert-", dir=args.workdir))
        try:
            config = config_for_size(int(size * (1 << 30)))
            size_bytes, largest_bytes = write_synthetic(root / "hf", config)
            os.sync()
            cp_times, conv_times, walls, peaks, import_peaks, loads = [], [], [], [], [], []
            for _ in range(args.rounds):
                cp_times.append(time_cp(root / "hf", root / "cp"))
                shutil.rmtree(root / "cp")
                os.sync()
                loads.append(os.getloadavg()[0])
                conv, wall, peak, import_peak = time_convert(root / "hf", root / "megatron", workers)
                conv_times.append(conv)
                walls.append(wall)
                peaks.append(peak)
                import_peaks.append(import_peak)
                shutil.rmtree(root / "megatron")
                os.sync()
            cp_s, conv_s = min(cp_times), min(conv_times)
            wall_s, peak = min(walls), max(peaks)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"{size:g} GiB target: {size_bytes / (1 << 30):.2f} GiB, {config['num_hidden_layers']} layers, "
              f"cp {size_bytes / cp_s / MiB:.0f} MiB/s ({cp_s:.1f} s), convert {size_bytes / conv_s / MiB:.0f} MiB/s "
              f"({conv_s:.1f} s; {wall_s:.1f} s with start-up), ratio {cp_s / conv_s:.2f}, {workers} workers, convert "
              f"peak RSS {peak:.0f} MiB ({max(import_peaks):.0f} MiB after its imports); best of {args.rounds} rounds, "
              f"cp {' '.join(f'{t:.1f}' for t in cp_times)} s, convert {' '.join(f'{t:.1f}' for t in conv_times)} s; "
              f"1-minute load average {' '.join(f'{x:.1f}' for x in loads)}",
              flush=True)
        results[size] = (size_bytes, cp_s, conv_s, peak)
        largest = max(largest, largest_bytes)
    counted = [s for s in results if s >= 8] or list(results)
    ratio = sum(results[s][1] for s in counted) / sum(results[s][2] for s in counted)  # same bytes: time ratio
    per_size = " ".join(f"ratio_{s:g}g={results[s][1] / results[s][2]:.2f}" for s in results)
    rss = " ".join(f"peak_rss_{s:g}g_mib={results[s][3]:.0f}" for s in results)
    print(f"convert_vs_cp_ratio={ratio:.2f} {per_size} {rss} largest_tensor_mib={largest / MiB:.0f} workers={workers}")


if __name__ == "__main__":
    main()
