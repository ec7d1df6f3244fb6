"""One rank of a multi-process bridge test. For each model: build it at a TP/PP layout, fill it from its HF
checkpoint (or a Megatron distributed checkpoint), run one forward through every pipeline stage, export HF tensors.
Several models share one world because starting the processes (imports) costs more than the models.

Launched by tests.multiproc.run_world; by hand (one line per rank, same port):
  python tests/megatron_bridge/bridge_rank.py --rank 0 --world-size 2 --port 29555 --tp 2 --pp 1 [--ep 1] [--etp 0] \
      --model qwen3=HF_DIR [--model tied=HF_DIR:DIST_CKPT_DIR ...] --out OUT [--save-dist DIR] [--full-export]
Writes OUT/NAME/rank{R}.pt: {"tokens", "logits" (last stage, else None), "exported" ({hf name: tensor}: the tensors
outside the experts from TP and DP rank 0 only, the experts from ETP and EDP rank 0 only), "sizes" (Megatron's TP,
ETP, EP, DP and EDP sizes)}; with
--full-export also "full": the [(hf name, tensor)] this rank got from the whole-model (weight-sync) export, and
"owned": what it got from the owners' export (`export_owned_hf_tensors`), "owns" / "stage_leader" what it says
of itself.
With HF_DIR:DIST_CKPT_DIR the weights come from the distributed checkpoint, config.json from HF_DIR.
With --save-dist, Megatron-Core's own dist_checkpointing.save writes each loaded model to DIR/NAME.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist


def forward(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits on the last pipeline stage (None elsewhere), via Megatron's pipeline schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, seq)

    def step(data_iterator, model):
        output = model(next(data_iterator), positions, None)
        # The output layer leaves the logits split over the vocabulary across TP ranks.
        return output, lambda out: (out.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(out)})

    with torch.no_grad():
        outputs = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=[model],
                                              num_microbatches=1, seq_length=seq, micro_batch_size=batch,
                                              forward_only=True)
    return outputs[0]["logits"] if outputs else None


def run_model(*, hf: str, dist_ckpt: str | None, tp: int, pp: int, ep: int, etp: int, out: Path,
              save_to: Path | None, full_export: bool = False) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    from slimish.megatron_bridge.bridge import export_hf_tensors, load_hf_weights
    from slimish.megatron_bridge.full_export import (
        export_full_hf_tensors,
        export_owned_hf_tensors,
        is_stage_leader,
        owns_in_owned_export,
    )
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.trainer.model import build_gpt_model

    arch = architecture_from_hf(read_hf_config(hf))
    model = build_gpt_model(arch, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                            expert_tensor_parallel=etp).eval()
    if dist_ckpt:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), dist_ckpt))
    else:
        load_hf_weights(model, hf, arch)
    if save_to is not None:
        dist_checkpointing.save(model.sharded_state_dict(), str(save_to))
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = forward(model, tokens)
    exported = {name: tensor.clone() for name, tensor in export_hf_tensors(model, arch)}
    # Every rank exports the tensors it holds, gathered: keep one copy of each (the tensors outside the experts from
    # TP and data-parallel rank 0, the experts from ETP and expert-data-parallel rank 0).
    ps = parallel_state
    keep_dense = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    keep_experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    exported = {name: tensor for name, tensor in exported.items()
                if (keep_experts if ".mlp.experts." in name else keep_dense)}
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
             "ep": ps.get_expert_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
             "edp": ps.get_expert_data_parallel_world_size()}
    result = {"tokens": tokens, "logits": logits, "exported": exported, "sizes": sizes}
    if full_export:
        result["full"] = [(name, tensor.clone()) for name, tensor in export_full_hf_tensors(model, arch)]
        # The weight sync's several senders: each stage's leader its stage, each expert the rank that holds it.
        result["owned"] = [(name, tensor.clone()) for name, tensor in export_owned_hf_tensors(model, arch)]
        result["owns"], result["stage_leader"] = owns_in_owned_export(), is_stage_leader()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--tp", "--pp"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=0, help="expert tensor parallelism (0: --tp)")
    parser.add_argument("--model", action="append", required=True, help="NAME=HF_DIR or NAME=HF_DIR:DIST_CKPT_DIR")
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-dist", help="also save each model with Megatron's dist_checkpointing to DIR/NAME")
    parser.add_argument("--full-export", action="store_true", help="also run the whole-model (weight-sync) export")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from slimish.trainer.parallel import ParallelLayout, init_parallel, shutdown_parallel

    init_parallel(ParallelLayout(rank=args.rank, world_size=args.world_size, tensor_parallel=args.tp,
                                 pipeline_parallel=args.pp, expert_parallel=args.ep,
                                 expert_tensor_parallel=args.etp),
                  master_addr="127.0.0.1", master_port=args.port, backend="gloo", seed=1234)
    for spec in args.model:
        name, paths = spec.split("=", 1)
        hf, _, dist_ckpt = paths.partition(":")
        save_to = Path(args.save_dist) / name if args.save_dist else None
        if save_to is not None and dist.get_rank() == 0:
            save_to.mkdir(parents=True)
        dist.barrier()
        run_model(hf=hf, dist_ckpt=dist_ckpt or None, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                  out=Path(args.out) / name, save_to=save_to, full_export=args.full_export)
    shutdown_parallel()


if __name__ == "__main__":
    main()
