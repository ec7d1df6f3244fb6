"""Benchmark what reading the initial weights costs each trainer rank: whole reads (as before slice reads: every
rank reads whole tensors, the reference model reads them again) against slice reads (each rank its TP / PP slice,
the reference copying the policy), and a start from a torch_dist checkpoint (model.megatron_path): converted at
TP1 (`megatron`) and with `--tp 2` (`megatron_tp2`: its chunks cut at the TP2 slices).

    python bench/startup.py [--workdir /tmp] [--layers 8] [--layouts tp2 pp2]

It writes a random Llama-shaped bf16 checkpoint (hidden 1024, 16 heads, 4 key-value groups, 32000-token vocabulary;
about 40 MiB a layer plus 125 MiB of embedding and output layer) and its `slimish convert hf-to-megatron` outputs,
then for each layout starts two gloo ranks (fresh interpreters) that build the policy and the reference model and
fill them (`InitialWeights`) once per mode. Before each mode rank 0 drops the files from the page cache
(posix_fadvise DONTNEED after an fsync), so /proc/self/io read_bytes shows what came from the disk (two ranks
reading the same page concurrently count it once, on whichever faulted it in). Per rank it prints the bytes the HF
reader requested, rchar, read_bytes and seconds (the policy's and the reference's loads together), then
    megatron_tp2_vs_tp1_rchar_ratio=<the ranks' largest rchar from the --tp 2 conversion over the TP1 one's>
and last
    slices_vs_whole_rchar_ratio=<x> slices_vs_whole_s_ratio=<y>
the ranks' largest rchar (and seconds) with slice reads over the same with whole reads, over every layout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
          "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
          "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
MODES = ("whole", "slices", "megatron", "megatron_tp2")


def write_model(root: Path, layers: int) -> tuple[Path, Path]:
    """The HF checkpoint and the root of its two conversions (`megatron`: at TP1; `megatron_tp2`: --tp 2)."""
    from slimish.megatron_bridge.convert import hf_to_megatron
    from slimish.megatron_bridge.hf_io import write_hf_shards
    from slimish.megatron_bridge.hf_shapes import expected_hf_shapes

    hf = root / "hf"
    hf.mkdir(parents=True)
    config = {**CONFIG, "num_hidden_layers": layers}
    (hf / "config.json").write_text(json.dumps(config))
    shapes = expected_hf_shapes(config)
    specs = [(name, torch.empty(shape, dtype=torch.bfloat16, device="meta")) for name, shape in shapes.items()]
    generator = torch.Generator().manual_seed(0)
    tensors = ((name, (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16))
               for name, meta in specs)
    write_hf_shards(hf, specs, tensors, max_shard_bytes=256 << 20)
    converted = root / "converted"
    for name, tp in (("megatron", 1), ("megatron_tp2", 2)):
        hf_to_megatron(hf_dir=hf, out_dir=converted / name, tensor_parallel=tp, progress=False)
    os.sync()
    return hf, converted


def evict(*dirs: Path) -> None:
    """Drop the files of `dirs` from the page cache (clean pages only: they were synced)."""
    for directory in dirs:
        for file in directory.rglob("*"):
            if file.is_file():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def rank_main(args) -> None:
    """One rank: build and fill the policy and the reference model in each mode; write its reports as JSON."""
    from slimish.compat import megatron_cpu

    megatron_cpu.apply()
    import torch.distributed as dist

    from slimish.megatron_bridge import bridge, slice_read
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.megatron_bridge.initial_weights import InitialWeights
    from slimish.trainer.model import build_gpt_model
    from slimish.trainer.parallel import ParallelLayout, init_parallel, shutdown_parallel

    torch.set_num_threads(1)
    tp, pp = LAYOUTS[args.layout]
    init_parallel(ParallelLayout(rank=args.rank, world_size=2, tensor_parallel=tp, pipeline_parallel=pp),
                  master_addr="127.0.0.1", master_port=args.port, backend="gloo", seed=0)
    arch = architecture_from_hf(read_hf_config(args.hf))
    sliced, shared = slice_read.read_local, bridge.copy_weights
    reports = {}
    for mode in MODES:
        if mode == "whole":  # main before slice reads: whole tensors, sliced in memory; the reference reads again
            slice_read.read_local = lambda *a, **kw: (slice_read.read_whole(*a, **kw), False)
            bridge.copy_weights = lambda source, target: False
        else:
            slice_read.read_local, bridge.copy_weights = sliced, shared
        models = [build_gpt_model(arch, tensor_parallel=tp, pipeline_parallel=pp, dtype=torch.bfloat16)
                  for _ in range(2)]
        if args.rank == 0:
            evict(Path(args.hf), Path(args.megatron))
        dist.barrier()
        start = str(Path(args.megatron) / mode) if mode.startswith("megatron") else ""
        weights = InitialWeights(arch, hf_path=args.hf, megatron_path=start)
        for model in models:
            weights.load([model])
        reports[mode] = weights.report()
        del models
    Path(args.out).write_text(json.dumps(reports))
    dist.barrier()
    shutdown_parallel()


def run_layout(layout: str, hf: Path, megatron: Path, work: Path) -> list[dict]:
    from slimish.network import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    outs = [work / f"{layout}-rank{rank}.json" for rank in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--layout",
                               layout, "--hf", str(hf), "--megatron", str(megatron), "--out", str(out)], env=env)
             for rank, out in enumerate(outs)]
    codes = [proc.wait(timeout=1800) for proc in procs]
    if any(codes):
        raise SystemExit(f"{layout}: ranks exited with {codes}")
    return [json.loads(out.read_text()) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    for name in ("--rank", "--port"):
        parser.add_argument(name, type=int)
    for name in ("--layout", "--hf", "--megatron", "--out"):
        parser.add_argument(name)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    mib = 1 << 20
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-startup-") as tmp:
        work = Path(tmp)
        hf, megatron = write_model(work, args.layers)
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        print(f"checkpoint: {args.layers} layers, {size / mib:.0f} MiB of safetensors")
        print(f"{'layout':<7}{'mode':<14}{'rank':>5}{'requested MiB':>15}{'rchar MiB':>11}{'read_bytes MiB':>16}"
              f"{'seconds':>9}")
        worst = {mode: {"rchar": 0.0, "seconds": 0.0} for mode in MODES}
        for layout in args.layouts:
            for rank, reports in enumerate(run_layout(layout, hf, megatron, work)):
                for mode, report in reports.items():
                    print(f"{layout:<7}{mode:<14}{rank:>5}{report['requested'] / mib:>15.1f}"
                          f"{report['rchar'] / mib:>11.1f}{report['read_bytes'] / mib:>16.1f}"
                          f"{report['seconds']:>9.2f}")
                    worst[mode]["rchar"] = max(worst[mode]["rchar"], report["rchar"])
                    worst[mode]["seconds"] = max(worst[mode]["seconds"], report["seconds"])
    print(f"megatron_tp2_vs_tp1_rchar_ratio={worst['megatron_tp2']['rchar'] / worst['megatron']['rchar']:.3f}")
    print(f"slices_vs_whole_rchar_ratio={worst['slices']['rchar'] / worst['whole']['rchar']:.3f} "
          f"slices_vs_whole_s_ratio={worst['slices']['seconds'] / worst['whole']['seconds']:.3f}")


if __name__ == "__main__":
    main()
