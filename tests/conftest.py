"""Shared fixtures: tiny models built locally (nothing from a hub) and a one-process Megatron world; and the test
tiers, marked by folder (`pytest_collection_modifyitems`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slimish.network import free_port  # tests import it from here

REPO = Path(__file__).resolve().parents[1]

# A test's tier follows from its folder, so that a new file there cannot join the fast tier (`-m "not e2e and not
# slurm"`) by forgetting a mark: tests/e2e/ needs real engines, tests/slurm/ a simulated cluster (both minutes, the
# whole machine). tests/gpu/ has no mark: it is part of the fast tier, where each test skips without a GPU.
TIER_BY_FOLDER = {"e2e": "e2e", "slurm": "slurm"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects (pytest's mark plugin, in the same hook)
def pytest_collection_modifyitems(config, items):
    tests = REPO / "tests"
    for item in items:
        parts = Path(item.path).parts[len(tests.parts):] if Path(item.path).is_relative_to(tests) else ()
        if parts and parts[0] in TIER_BY_FOLDER:
            item.add_marker(TIER_BY_FOLDER[parts[0]])


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
    """family -> a tiny random mixture-of-experts model (Qwen3-MoE: softmax router; GLM-4.5: sigmoid router with
    correction bias, shared expert, a first dense layer; DeepSeek-V3: grouped sigmoid router, shared expert,
    multi-latent attention), with the same locally trained tokenizer as `tiny_models`."""
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-moe")
    return {family: build_tiny_model(root / family, corpus=echo_digit.corpus(), family=family)
            for family in ("qwen3_moe", "glm4_moe", "deepseek_v3")}


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
