"""Build a recipe's model at its own layout on the meta device, one trainer rank per pipeline stage, in one process.

    python -m tests.megatron_bridge.recipe_meta_build RECIPE.yaml MODEL OUT.json

torch's `fake` process-group backend stands in for the recipe's whole world (every collective a no-op, no peers):
this process joins it as the first rank of each pipeline stage in turn (tensor, context and expert rank 0), Megatron
sets up its TP / PP / EP / ETP groups at the recipe's sizes, and `build_gpt_model` builds that rank's stage on the
meta device (no memory: shapes only). Written to OUT.json per stage: the rank, its decoder layers (global numbers),
whether it holds the embedding and the output layer, and its parameters (non-expert, routed-expert), counted as
Megatron built them. The local attention spec stands in for Transformer Engine's (same parameters; TE is absent on
the CPU). The router's correction bias (a buffer, a weight of the checkpoint all the same) counts as a parameter.
"""

from __future__ import annotations

import json
import sys


def main(recipe: str, model: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from slimish.compat import megatron_cpu
    from slimish.config import load_config
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.trainer.model import build_gpt_model

    megatron_cpu.apply()
    cfg = load_config(recipe, [f"model.hf_path={model}"], files=False)
    par = cfg.parallel
    arch = architecture_from_hf(read_hf_config(model))
    world, pp = par.num_trainer_ranks, par.pipeline_parallel
    stages = []
    for stage in range(pp):
        rank = stage * (world // pp)  # Megatron's default order (tp-cp-ep-dp-pp): the pipeline rank varies slowest
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=par.tensor_parallel, pipeline_model_parallel_size=pp,
            context_parallel_size=par.context_parallel, expert_model_parallel_size=par.expert_parallel,
            expert_tensor_parallel_size=par.expert_tensor_parallel or par.tensor_parallel,
            create_gloo_process_groups=False)  # gloo would connect to the (absent) peers
        assert parallel_state.get_pipeline_model_parallel_rank() == stage
        with torch.device("meta"):
            gpt = build_gpt_model(arch, tensor_parallel=par.tensor_parallel, pipeline_parallel=pp,
                                  expert_parallel=par.expert_parallel,
                                  expert_tensor_parallel=par.expert_tensor_parallel, dtype=torch.bfloat16,
                                  sequence_parallel=par.sequence_parallel, context_parallel=par.context_parallel,
                                  first_stage_layers=par.first_stage_layers, last_stage_layers=par.last_stage_layers,
                                  attention="local")
        experts = sum(p.numel() for n, p in gpt.named_parameters() if ".mlp.experts." in n)
        # the router's correction bias is a buffer (a weight all the same: the checkpoint holds it)
        total = sum(p.numel() for p in gpt.parameters()) + sum(
            b.numel() for n, b in gpt.named_buffers() if n.endswith("router.expert_bias"))
        stages.append({"rank": rank, "layers": [layer.layer_number for layer in gpt.decoder.layers],
                       "embedding": gpt.pre_process, "output_layer": gpt.post_process,
                       "params": [total - experts, experts]})
        del gpt
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(stages, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
