"""Benchmark `slimish convert hf-to-megatron` against `cp` on synthetic ~2 GiB and ~4 GiB checkpoints.

    python bench/convert.py [--workdir /tmp] [--sizes-gib 2 4]      (or: make bench)

For each size it writes a random Llama-shaped bf16 checkpoint (real tensor names and shapes; the layer count sets
the size) as several safetensors shards and flushes it to disk, then times, in alternating rounds (--rounds), `cp` of
the shards (+ fsync, as the conversion fsyncs its output) and the conversion (the function behind the CLI) in a
child process, which reports its peak RSS (VmHWM). Every timing starts with no dirty pages (the previous output is
deleted and the disk synced) and reads the shards from the page cache. Each side's best time over the rounds is
used (as timeit does): a single timing on a shared virtual disk swings 3-4x with other guests' I/O, which only
ever adds time. Conversion time is measured inside
the child after its imports (a fixed start-up cost, printed too). Everything is deleted afterwards. The last line
printed is
    convert_vs_cp_ratio=<x> peak_rss_2g_mib=<a> peak_rss_4g_mib=<b> largest_tensor_mib=<c>
with ratio = conversion throughput / cp throughput over all sizes. Targets: ratio >= 0.5; peak RSS <= 1024 MiB +
largest tensor, flat as the size doubles.
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
start = time.perf_counter()
hf_to_megatron(hf_dir=sys.argv[1], out_dir=sys.argv[2], progress=False)
seconds = time.perf_counter() - start
hwm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(seconds, hwm_kib)
"""


def time_convert(src: Path, dst: Path) -> tuple[float, float, float]:
    """(conversion seconds, child wall seconds including imports, peak RSS MiB) of a conversion in a child.

    Peak RSS is the child's own VmHWM: its ru_maxrss (wait4 / getrusage) would start at this process's RSS, because
    Linux carries the pre-exec memory of a vfork'ed child (this process's) into maxrss.
    """
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst)], stdout=subprocess.PIPE, text=True)
    output = proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"conversion of {src} failed with exit code {proc.returncode}")
    wall = time.perf_counter() - start
    seconds, hwm_kib = output.strip().splitlines()[-1].split()
    return float(seconds), wall, int(hwm_kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="alternating cp / convert timings per size")
    args = parser.parse_args()
    free = shutil.disk_usage(args.workdir).free
    need = 3.2 * max(args.sizes_gib) * (1 << 30)  # source + cp copy + conversion, one size at a time
    if free < need:
        sys.exit(f"need {need / (1 << 30):.1f} GiB free in {args.workdir}, have {free / (1 << 30):.1f}")
    total_bytes = cp_seconds = convert_seconds = 0.0
    rss, largest = {}, 0
    for size in args.sizes_gib:
        root = Path(tempfile.mkdtemp(prefix="slimish-bench-convert-", dir=args.workdir))
        try:
            config = config_for_size(int(size * (1 << 30)))
            size_bytes, largest_bytes = write_synthetic(root / "hf", config)
            os.sync()
            cp_times, conv_times, walls, peaks = [], [], [], []
            for _ in range(args.rounds):
                cp_times.append(time_cp(root / "hf", root / "cp"))
                shutil.rmtree(root / "cp")
                os.sync()
                conv, wall, peak = time_convert(root / "hf", root / "megatron")
                conv_times.append(conv)
                walls.append(wall)
                peaks.append(peak)
                shutil.rmtree(root / "megatron")
                os.sync()
            cp_s, conv_s = min(cp_times), min(conv_times)
            wall_s, peak = min(walls), max(peaks)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"{size:g} GiB target: {size_bytes / (1 << 30):.2f} GiB, {config['num_hidden_layers']} layers, "
              f"cp {size_bytes / cp_s / MiB:.0f} MiB/s ({cp_s:.1f} s), convert {size_bytes / conv_s / MiB:.0f} MiB/s "
              f"({conv_s:.1f} s; {wall_s:.1f} s with start-up), convert peak RSS {peak:.0f} MiB; best of "
              f"{args.rounds} rounds, cp {' '.join(f'{t:.1f}' for t in cp_times)} s, convert "
              f"{' '.join(f'{t:.1f}' for t in conv_times)} s", flush=True)
        total_bytes += size_bytes
        cp_seconds += cp_s
        convert_seconds += conv_s
        rss[size] = peak
        largest = max(largest, largest_bytes)
    ratio = (total_bytes / convert_seconds) / (total_bytes / cp_seconds)
    sizes = sorted(rss)
    print(f"convert_vs_cp_ratio={ratio:.2f} peak_rss_2g_mib={rss[sizes[0]]:.0f} "
          f"peak_rss_4g_mib={rss[sizes[-1]]:.0f} largest_tensor_mib={largest / MiB:.0f}")


if __name__ == "__main__":
    main()
