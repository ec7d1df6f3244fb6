"""The GPU recipes in configs/recipes/: each validates against its model's released config.json (the checkpoints
themselves are not downloadable here), its parallel layout divides the model the way Megatron-Core and SGLang
require, and the GPUs it asks for add up to the count its header gives for `sbatch`."""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import save_file

from slimish.config import load_config
from slimish.megatron_bridge.hf_config import architecture_from_hf, pipeline_stage_layers, transformer_config
from tests.conftest import REPO
from tests.megatron_bridge.real_configs import (
    DEEPSEEK_V3,
    GLM45,
    LLAMA31_405B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
)

# Every recipe and its model's released config.json (tests/planning/test_plan.py and tests/config/test_engine_flags.py
# read this table too).
RECIPES = {"qwen3_8b_math_grpo": QWEN3_8B, "qwen3_8b_math_grpo_colocated": QWEN3_8B,
           "qwen3_8b_math_grpo_32k": QWEN3_8B,
           "qwen3_30b_a3b_math_grpo": QWEN3_30B_A3B,
           "llama31_405b_math_grpo": LLAMA31_405B, "llama31_405b_math_grpo_h100": LLAMA31_405B,
           "deepseek_v3_math_grpo": DEEPSEEK_V3, "qwen3_235b_a22b_math_grpo": QWEN3_235B_A22B,
           "glm45_math_grpo": GLM45}


def test_every_recipe_is_checked():
    assert {p.stem for p in (REPO / "configs" / "recipes").glob("*.yaml")} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_validates_and_its_layout_fits_the_model(name, tmp_path):
    hf_config = RECIPES[name]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    save_file({}, model_dir / "model.safetensors")  # stands in for the weights: validation reads headers only
    (model_dir / "tokenizer.json").write_text("{}")  # stands in for the tokenizer: validation asks that it is there
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1? Put the final answer in \\boxed{}.", "label": "2"}) + "\n")
    path = REPO / "configs" / "recipes" / f"{name}.yaml"
    cfg = load_config(path, [f"model.hf_path={model_dir}", f"data.path={data}"])  # validates

    par, engine = cfg.parallel, cfg.rollout.engine
    assert cfg.model.dtype == "bfloat16" and engine.device == "cuda"
    arch = architecture_from_hf(hf_config)
    # Megatron-Core checks heads / TP, experts / EP, MoE at TP > 1 with sequence parallelism, the stages' layers
    transformer_config(arch, tensor_parallel=par.tensor_parallel, pipeline_parallel=par.pipeline_parallel,
                       expert_parallel=par.expert_parallel, sequence_parallel=par.sequence_parallel,
                       context_parallel=par.context_parallel, cp_comm_type=par.cp_comm_type,
                       first_stage_layers=par.first_stage_layers, last_stage_layers=par.last_stage_layers)
    stages = pipeline_stage_layers(hf_config["num_hidden_layers"], par.pipeline_parallel,
                                   first=par.first_stage_layers, last=par.last_stage_layers)
    assert len(stages) == par.pipeline_parallel and sum(stages) == hf_config["num_hidden_layers"]
    for tp in (par.tensor_parallel, engine.tensor_parallel):
        assert hf_config["num_attention_heads"] % tp == 0
        kv = hf_config["num_key_value_heads"]
        assert kv % tp == 0 or tp % kv == 0, "SGLang splits or replicates KV heads"

    nodes, gpus_per_node = map(int, re.search(r"(\d+) nodes? of (\d+) GPUs", path.read_text()).groups())
    if cfg.placement.colocate:  # every GPU holds a trainer rank and an engine rank
        assert par.num_trainer_ranks == engine.num_engines * engine.tensor_parallel == nodes * gpus_per_node
    else:
        assert par.num_trainer_ranks + engine.num_engines * engine.tensor_parallel == nodes * gpus_per_node
    # An engine runs on one node, or on nodes_per_engine whole nodes (8 of its ranks on each)
    assert engine.tensor_parallel <= gpus_per_node if engine.nodes_per_engine == 1 else \
        engine.tensor_parallel == engine.nodes_per_engine * gpus_per_node
    assert f"sbatch -N {nodes} --gpus-per-node {gpus_per_node} launch/train.sbatch configs/recipes/{name}.yaml" in \
        path.read_text()
