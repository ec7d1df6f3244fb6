"""`slimish plan` against hand computations and Megatron-Core's own parameter count: the recipes' models counted as
Megatron builds them, one trainer rank's share of a layout, the memory of the 405B recipe's rank and engine, the
405B full-broadcast sync time, and the command's output for every recipe."""

from __future__ import annotations

import json

import pytest

from slimish.config import load_config
from slimish.planning.memory import colocated_gpu, engine_gpu, trainer_rank
from slimish.planning.params import count_params
from slimish.planning.walls import step_walls
from tests.conftest import REPO
from tests.megatron_bridge.real_configs import LLAMA31_405B, QWEN3_8B, QWEN3_30B_A3B, trimmed
from tests.megatron_bridge.test_real_shapes import megatron_meta_shapes

RECIPES = {"qwen3_8b_math_grpo": QWEN3_8B, "qwen3_8b_math_grpo_colocated": QWEN3_8B,
           "qwen3_30b_a3b_math_grpo": QWEN3_30B_A3B,
           "llama31_405b_math_grpo": LLAMA31_405B}


def recipe(name: str, tmp_path, *overrides: str):
    (tmp_path / "config.json").write_text(json.dumps(RECIPES[name]))
    return load_config(REPO / "configs" / "recipes" / f"{name}.yaml", [f"model.hf_path={tmp_path}", *overrides],
                       files=False)


@pytest.mark.parametrize("name", ["llama31_405b", "qwen3_8b", "qwen3_30b_a3b", "deepseek_v3", "glm45"])
def test_the_count_is_megatron_cores(name, megatron_world):
    """The plan counts what Megatron-Core builds (on the meta device; MoE models trimmed to their first sparse layer,
    every sparse layer being alike)."""
    import torch

    from slimish.megatron_bridge.hf_config import architecture_from_hf

    cfg = trimmed(name)
    megatron = sum(torch.Size(s).numel() for s in megatron_meta_shapes(architecture_from_hf(cfg)).values())
    assert count_params(cfg).total == megatron


def test_one_rank_holds_its_stage_and_its_shards():
    """A 4-layer Llama at TP2 x PP2: each layer's matrices halve, its two norms stay whole; stage 0 adds half the
    embedding, stage 1 half the output layer and the final norm."""
    cfg = {**LLAMA31_405B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    params = count_params(cfg)
    h, kv, ffn, vocab = 64, 2 * 16, 128, 256
    matrices = 2 * h * h + 2 * h * kv + 3 * h * ffn
    assert params.per_layer[:3] == [matrices + 2 * h] * 3 and params.per_layer[3] == matrices + 3 * h
    assert params.total == 4 * (matrices + 2 * h) + h + 2 * vocab * h
    assert params.rank(tensor_parallel=2, pipeline_parallel=2, expert_parallel=1, stage=0) == (
        2 * (matrices // 2 + 2 * h) + vocab * h // 2, 0)
    assert params.rank(tensor_parallel=2, pipeline_parallel=2, expert_parallel=1, stage=1) == (
        2 * (matrices // 2 + 2 * h) + h + vocab * h // 2, 0)


def test_experts_split_over_expert_and_tensor_parallelism():
    params = count_params(trimmed("qwen3_30b_a3b"))
    dense, experts = params.rank(tensor_parallel=2, pipeline_parallel=1, expert_parallel=4, stage=0)
    assert experts == sum(params.experts_per_layer) // 8
    # parallel.expert_tensor_parallel=1: each expert whole, the same dense part
    assert params.rank(tensor_parallel=2, pipeline_parallel=1, expert_parallel=4, expert_tensor_parallel=1,
                       stage=0) == (dense, sum(params.experts_per_layer) // 4)
    assert params.active < params.total and params.experts_per_layer[-1] == 128 * 3 * 2048 * 768


def test_the_405b_recipe_by_hand(tmp_path):
    """Stage 0 of TP8 x PP7 (18 of 126 layers) in bf16 with the distributed optimizer over DP2, full recompute,
    8192 + 512 tokens per micro-batch; an engine of TP8 whose KV pool (rollout.engine.max_total_tokens) is smaller than
its 128 requests of 8704 tokens."""
    cfg = recipe("llama31_405b_math_grpo", tmp_path)
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    arch = architecture_from_hf(LLAMA31_405B)
    params = count_params(LLAMA31_405B)
    h, ffn, kv, vocab = 16384, 53248, 8 * 128, 128256
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn
    rank = 18 * (layer // 8 + 2 * h) + vocab * h // 8  # stage 0 (stage 6 holds the output layer and final norm)
    assert sum(params.rank(tensor_parallel=8, pipeline_parallel=7, expert_parallel=1, stage=0)) == rank
    mem = trainer_rank(cfg, arch, params, prompt_tokens=512)
    last = 18 * (layer // 8 + 2 * h) + vocab * h // 8 + h
    assert mem.weights == 2 * last and mem.grads == 4 * last  # the fullest stage: the last one
    assert mem.optimizer == pytest.approx(12 * last / 2) and mem.optimizer_other == pytest.approx(12 * last)
    tokens = 8704
    working = tokens * h * (10 + 24 / 8) + 2 * 2 * (128 / 8) * tokens * tokens
    assert mem.activations == pytest.approx(7 * 18 * tokens * h * 2 + working)
    assert mem.activations_other == pytest.approx(7 * 18 * working)
    engine = engine_gpu(cfg, arch, params, prompt_tokens=512)
    assert engine.weights == pytest.approx(params.total * 2 / 8)
    pool = cfg.rollout.engine.max_total_tokens  # SGLang's KV pool: fewer than 128 full-length requests
    assert pool < 128 * 8704 and engine.kv_tokens == pool
    assert engine.kv_cache == pytest.approx(pool * 2 * 126 * 1 * 128 * 2)  # K and V, 126 layers, 1 kv head per rank


def test_the_405b_full_broadcast_sync_is_its_bytes_over_one_link(tmp_path):
    """405.85B bf16 parameters (812 GB) over one 400 Gb/s link: 16.2 s with stage senders; through rank 0 the six
    later stages' share first reaches it over the same kind of link: 30.1 s (the README's scale table)."""
    cfg = recipe("llama31_405b_math_grpo", tmp_path)
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    arch, params = architecture_from_hf(LLAMA31_405B), count_params(LLAMA31_405B)
    assert step_walls(cfg, arch, params).sync == pytest.approx(params.total * 2 / 50e9)
    assert step_walls(cfg, arch, params).sync == pytest.approx(16.23, abs=0.01)
    funnel = recipe("llama31_405b_math_grpo", tmp_path, "weight_sync.stage_senders=false")
    assert step_walls(funnel, arch, params).sync == pytest.approx(16.23 * (1 + 6 / 7), abs=0.01)


def test_overlapped_modes_take_the_longer_of_training_and_generation(tmp_path):
    """rl.mode sync adds the walls; one_step_off and async take max(train, rollout + reward) + sync, async with a
    sync every rl.sync_every steps (its share per step)."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    arch, params = architecture_from_hf(LLAMA31_405B), count_params(LLAMA31_405B)
    serial = step_walls(recipe("llama31_405b_math_grpo", tmp_path), arch, params)
    assert serial.step_seconds() == pytest.approx(serial.train + serial.rollout + serial.reward + serial.sync)
    off = step_walls(recipe("llama31_405b_math_grpo", tmp_path, "rl.mode=one_step_off"), arch, params)
    assert off.step_seconds() == pytest.approx(max(off.train, off.rollout + off.reward) + serial.sync)
    overlapped = recipe("llama31_405b_math_grpo", tmp_path, "rl.mode=async", "rl.sync_every=4",
                        "rollout.partial.mode=retract")
    walls = step_walls(overlapped, arch, params)
    assert walls.sync == pytest.approx(serial.sync / 4)
    assert walls.step_seconds() == pytest.approx(max(walls.train, walls.rollout + walls.reward) + serial.sync / 4)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_plan_prints_memory_and_the_binding_wall(name, tmp_path, capsys):
    from slimish.cli import main

    (tmp_path / "config.json").write_text(json.dumps(RECIPES[name]))
    path = REPO / "configs" / "recipes" / f"{name}.yaml"
    assert main(["plan", str(path), f"model.hf_path={tmp_path}"]) == 0
    out = capsys.readouterr().out
    for text in ("trainer rank", "engine GPU", "seconds per step:", "binding wall: "):
        assert text in out
    colocated = "colocated" in name
    assert ("colocated GPU (trainer rank and engine rank in turns)" in out) == colocated
    assert out.count(": fits") == 2 + colocated


def test_a_model_without_config_json_is_one_line(tmp_path, capsys):
    from slimish.cli import main

    path = REPO / "configs" / "recipes" / "qwen3_8b_math_grpo.yaml"
    assert main(["plan", str(path), f"model.hf_path={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_fits_the_gpus_its_header_names(name, tmp_path):
    """A trainer rank and an engine GPU of each recipe fit in the memory per GPU its first line states."""
    import re

    from slimish.megatron_bridge.hf_config import architecture_from_hf

    first_line = (REPO / "configs" / "recipes" / f"{name}.yaml").read_text().splitlines()[0]
    gpu_gb = float(re.search(r"(\d+) GB", first_line).group(1))
    cfg = recipe(name, tmp_path)
    assert cfg.plan.gpu_memory_gb == gpu_gb, "the recipe states its GPUs' memory for `slimish plan`"
    arch, params = architecture_from_hf(RECIPES[name]), count_params(RECIPES[name])
    assert trainer_rank(cfg, arch, params, prompt_tokens=cfg.plan.prompt_tokens).total <= gpu_gb * 1e9
    assert engine_gpu(cfg, arch, params, prompt_tokens=cfg.plan.prompt_tokens).total <= gpu_gb * 1e9
    if cfg.placement.colocate:
        trainer = trainer_rank(cfg, arch, params, prompt_tokens=cfg.plan.prompt_tokens)
        engine = engine_gpu(cfg, arch, params, prompt_tokens=cfg.plan.prompt_tokens)
        assert colocated_gpu(cfg, trainer, engine).peak <= gpu_gb * 1e9
