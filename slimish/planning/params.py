"""Parameter counts of a model from its config.json, whole and per trainer rank of a parallel layout.

The tensors are the checkpoint's for the config (`hf_shapes.expected_hf_shapes`: worked out from config.json for the
supported families, equal to the tensors transformers builds; transformers' model on the meta device otherwise), so
the count is the checkpoint's. Per rank, as Megatron-Core lays the model out:
  - the layers split over the pipeline stages evenly or as parallel.first_stage_layers / last_stage_layers say;
    the embedding sits on the first stage and the output layer on the last (vocab split over tensor parallelism);
  - matrices split over tensor parallelism, and so are the q/k/v biases (column-parallel); norms and the router
    (Megatron replicates it on every tensor-parallel rank) are kept whole;
  - routed experts split over expert parallelism, and each expert's matrices over tensor parallelism (Megatron's
    default expert tensor parallelism is the tensor-parallel size).
Multi-token-prediction layers are not built by the trainer and not counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    total: int              # every parameter the trainer builds
    active: int             # per token: routed experts counted at topk / num_experts
    embedding: int          # input embedding (vocab x hidden)
    output: int             # output layer (0 when tied to the embedding)
    per_layer: list[int]    # non-expert parameters of each layer (attention, norms, dense MLP, router, shared)
    experts_per_layer: list[int]  # routed-expert parameters of each layer
    matrices_per_layer: list[int]  # of per_layer: the ones tensor parallelism splits (matrices, q/k/v biases)

    def rank(self, *, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int,
             stage: int, expert_tensor_parallel: int = 0, stage_layers: list[int] | None = None) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters held by one trainer rank of pipeline stage `stage`
        (`expert_tensor_parallel` 0: tensor_parallel); `stage_layers`: each stage's layer count
        (`slimish.megatron_bridge.hf_config.pipeline_stage_layers`; None: even)."""
        expert_split = expert_parallel * (expert_tensor_parallel or tensor_parallel)
        layers = len(self.per_layer)
        if stage_layers is None:
            first, last = stage * layers // pipeline_parallel, (stage + 1) * layers // pipeline_parallel
        else:
            first = sum(stage_layers[:stage])
            last = first + stage_layers[stage]
        dense = experts = 0
        for k in range(first, last):
            whole = self.per_layer[k] - self.matrices_per_layer[k]
            dense += whole + self.matrices_per_layer[k] // tensor_parallel
            experts += self.experts_per_layer[k] // expert_split
        if stage == 0:
            dense += self.embedding // tensor_parallel
        if stage == pipeline_parallel - 1:
            dense += self.output // tensor_parallel
        return dense, experts


def _split_over_tp(name: str, shape) -> bool:
    """Whether Megatron splits this layer tensor over tensor parallelism: every matrix but the router's
    (`mlp.gate.weight`, replicated), and the q/k/v biases of the column-parallel projection (checked against Megatron's
    own build at each large recipe's layout: tests/megatron_bridge/test_real_shapes.py)."""
    if len(shape) == 2:
        return not name.endswith(".mlp.gate.weight")
    return name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))


def count_params(hf_config: dict) -> ParamCount:
    from slimish.megatron_bridge.hf_config import architecture_from_hf
    from slimish.megatron_bridge.hf_shapes import expected_hf_shapes

    arch = architecture_from_hf(hf_config)
    layers = hf_config["num_hidden_layers"]
    shapes = expected_hf_shapes(hf_config)
    per_layer, experts, matrices = [0] * layers, [0] * layers, [0] * layers
    embedding = output = 0
    for name, shape in shapes.items():
        size = 1
        for dim in shape:
            size *= dim
        match = LAYER.match(name)
        if match:
            k = int(match.group(1))
            if k >= layers:  # a multi-token-prediction layer: skipped by the bridge
                continue
            if ".mlp.experts." in name:
                experts[k] += size
            else:
                per_layer[k] += size
                matrices[k] += size if _split_over_tp(name, shape) else 0
        elif name.startswith("model.embed_tokens"):
            embedding += size
        elif name.startswith("lm_head"):
            output += size
        else:  # the final norm: last stage, kept whole
            per_layer[-1] += size
    topk_share = arch.moe.topk / arch.moe.num_experts if arch.moe else 1.0
    dense = sum(per_layer) + embedding + output
    return ParamCount(total=dense + sum(experts), active=dense + int(sum(experts) * topk_share), embedding=embedding,
                      output=output, per_layer=per_layer, experts_per_layer=experts, matrices_per_layer=matrices)
