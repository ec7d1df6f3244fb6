"""Shared fixtures: tiny models built locally (nothing from a hub) and a one-process Megatron world."""

from __future__ import annotations

from pathlib import Path

import pytest

from slimish.network import free_port  # tests import it from here

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> directory of a tiny random HF model with a locally trained tokenizer."""
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_model(root / family, corpus=echo_digit.corpus(), family=family)
            for family in ("qwen3", "qwen2", "llama")}


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    """family -> a tiny random mixture-of-experts model (Qwen3-MoE: softmax router; DeepSeek-V3: grouped sigmoid
    router, shared expert, multi-latent attention), with the same locally trained tokenizer as `tiny_models`."""
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-moe")
    return {family: build_tiny_model(root / family, corpus=echo_digit.corpus(), family=family)
            for family in ("qwen3_moe", "deepseek_v3")}


@pytest.fixture(scope="session")
def task_assets(tmp_path_factory, tiny_models) -> dict[str, str]:
    from slimish.tasks import echo_digit

    root = tmp_path_factory.mktemp("task")
    paths = echo_digit.write_datasets(root)
    return {"model": str(tiny_models["qwen3"]), **paths}


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world size 1) + Megatron parallel state (TP=PP=1) for in-process tests."""
    from slimish.trainer.parallel import ParallelLayout, init_parallel

    init_parallel(ParallelLayout(rank=0, world_size=1), master_addr="127.0.0.1", master_port=free_port(),
                  backend="gloo", seed=1234)
    yield
