"""The engines' serving options as config keys (`slimish.config.engine_flags`): each becomes the flag SGLang's own
parser reads; every recipe's engine command line resolves in SGLang to the layout the recipe asks for; settings
that contradict each other are refused by `check-config`, naming the key.

SGLang resolves and checks its arguments on a machine without a GPU too (`prepare_server_args`, `resolve_once`,
`check_server_args`: sizes, divisibility, its backend choices). What only a GPU resolves: whether the kernels and
communication libraries a setting picks are there and run (DeepEP or another all-to-all backend, CUDA graph capture
up to `cuda_graph_max_bs`, the attention backend it chooses for the GPU's architecture) and how much KV cache
`mem_fraction_static` leaves."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from safetensors.torch import save_file

from slimish.config import ConfigError, load_config
from slimish.config.engine_flags import (
    A2A_BACKENDS,
    ALIASES,
    FLAGS,
    SHARD_DIRECT,
    SHARD_LOADER,
    SHARD_RECEIVER,
    flags_set_twice,
    serving_args,
)
from slimish.config.schema import EngineConfig
from slimish.engines.server import engine_argv, node_args
from tests.config.test_recipes import RECIPES
from tests.conftest import REPO


@pytest.fixture(scope="module")
def parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_flag_and_backend_is_sglangs(parser):
    options = {o: action for action in parser._actions for o in action.option_strings}
    for key, flags in FLAGS.items():
        for flag in (*flags, *ALIASES.get(key, ())):
            assert flag in options, f"SGLang has no {flag} ({key})"
    assert tuple(options["--moe-a2a-backend"].choices) == A2A_BACKENDS


def test_keys_at_their_defaults_add_nothing_and_others_land_where_sglang_reads_them(parser):
    assert serving_args(EngineConfig()) == []
    engine = replace(EngineConfig(), tensor_parallel=8, expert_parallel=8, attention_data_parallel=8,
                     moe_a2a_backend="deepep", mem_fraction_static=0.7, cuda_graphs=False, cuda_graph_max_bs=128)
    args = parser.parse_args(["--model-path", "m", *serving_args(engine)])
    assert (args.ep_size, args.attn_dp_size, args.moe_a2a_backend, args.mem_fraction_static) == (8, 8, "deepep", 0.7)
    assert args.cuda_graph_max_bs_decode == 128
    assert args.cuda_graph_backend_decode == args.cuda_graph_backend_prefill == "disabled"


def test_a_flag_a_key_owns_is_found_in_extra_args_whatever_its_spelling():
    engine = replace(EngineConfig(), extra_args=["--ep=2", "--disable-cuda-graph", "--chunked-prefill-size", "8"])
    assert flags_set_twice(engine) == [("expert_parallel", "--ep"), ("cuda_graphs", "--disable-cuda-graph")]


def _recipe_argv(name: str, model_dir, overrides: tuple[str, ...] = (), node_rank: int = 0
                 ) -> tuple[list[str], object]:
    hf_config = RECIPES[name]
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    save_file({}, model_dir / "model.safetensors")  # validation reads headers only
    (model_dir / "tokenizer.json").write_text("{}")  # and asks that a tokenizer is there
    data = model_dir / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1? Put the final answer in \\boxed{}.", "label": "2"}) + "\n")
    cfg = load_config(REPO / "configs" / "recipes" / f"{name}.yaml", [f"model.hf_path={model_dir}",
                                                                      f"data.path={data}", *overrides])
    eng = cfg.rollout.engine
    nodes = node_args(nnodes=eng.nodes_per_engine, node_rank=node_rank, rendezvous=("10.0.0.1", 29600))
    argv = engine_argv(model_path=str(model_dir), host="127.0.0.1", port=30000, device=eng.device,
                       dtype=cfg.model.dtype, tp=eng.tensor_parallel, max_total_tokens=eng.max_total_tokens, seed=0,
                       extra=[*serving_args(eng), *nodes, *eng.extra_args], colocated=cfg.placement.colocate)
    return argv[argv.index("sglang.launch_server") + 1:], eng


RESOLVE = """
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
from slimish.compat.cuda_driver_stub import preload_if_needed
preload_if_needed()
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.loads(sys.argv[1]):
    args = prepare_server_args(argv)
    args.resolve_once()
    args.check_server_args()
    out.append({k: getattr(args, k) for k in ("tp_size", "ep_size", "attn_dp_size", "moe_a2a_backend",
                                              "mem_fraction_static", "cuda_graph_max_bs_decode", "device", "nnodes",
                                              "node_rank", "dist_init_addr", "custom_weight_loader")})
print(json.dumps(out))
"""


# Engines spanning nodes, the second node part's command line (the first is every recipe's case): the 405B recipe on
# nodes of 8 H100s, where 405B in bf16 (812 GB) does not fit one node's 640 GB, and DeepSeek-V3 (1.34 TB in bf16) on
# nodes of 8 H200s (1128 GB): each engine is TP16 over two nodes.
SPANNING = [("llama31_405b_math_grpo_h100", (), 1), ("deepseek_v3_math_grpo", (), 1)]


def test_every_recipes_engine_command_line_resolves_in_sglang(tmp_path):
    """SGLang parses, resolves and checks each recipe's engine arguments (as `slimish.engines.server` builds them)
    against the model's released config.json, and arrives at the recipe's layout; so do both node parts of an engine
    spanning two nodes. ~15 s (importing SGLang)."""
    cases = [(name, (), 0) for name in sorted(RECIPES)] + SPANNING
    argvs, engines = [], []
    for k, (name, overrides, node_rank) in enumerate(cases):
        (tmp_path / str(k)).mkdir()
        argv, engine = _recipe_argv(name, tmp_path / str(k), overrides, node_rank)
        argvs.append(argv)
        engines.append(engine)
    result = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(argvs)], capture_output=True, text=True,
                            cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for (name, _, node_rank), engine, got in zip(cases, engines, json.loads(result.stdout.strip().splitlines()[-1]),
                                                 strict=True):
        assert (got["nnodes"], got["node_rank"]) == (engine.nodes_per_engine, node_rank), name
        assert got["dist_init_addr"] == ("10.0.0.1:29600" if engine.nodes_per_engine > 1 else None), name
        assert got["device"] == "cuda" and got["tp_size"] == engine.tensor_parallel, name
        assert got["ep_size"] == engine.expert_parallel, name
        # the sharded syncs' engine-side loaders
        assert got["custom_weight_loader"] == [SHARD_LOADER, SHARD_RECEIVER, SHARD_DIRECT], name
        assert got["attn_dp_size"] == engine.attention_data_parallel, name
        assert got["moe_a2a_backend"] == engine.moe_a2a_backend, name
        if engine.mem_fraction_static:
            assert got["mem_fraction_static"] == engine.mem_fraction_static, name
        if engine.cuda_graph_max_bs:
            assert got["cuda_graph_max_bs_decode"] == engine.cuda_graph_max_bs, name


CONTRADICTIONS = [
    # (overrides, key named in the error, a fragment of the explanation); the tiny model is dense
    (["rollout.engine.tensor_parallel=2", "rollout.engine.expert_parallel=3"], "rollout.engine.expert_parallel",
     "must divide rollout.engine.tensor_parallel (2)"),
    (["rollout.engine.tensor_parallel=4", "rollout.engine.attention_data_parallel=3"],
     "rollout.engine.attention_data_parallel", "must divide"),
    (["rollout.engine.tensor_parallel=2", "rollout.engine.moe_a2a_backend=deepep"], "rollout.engine.expert_parallel",
     "SGLang would set --ep-size to 2"),
    (["rollout.engine.moe_a2a_backend=deep_ep"], "rollout.engine.moe_a2a_backend", "SGLang's are none, deepep"),
    (["rollout.engine.device=cuda", "rollout.engine.tensor_parallel=2", "rollout.engine.expert_parallel=2"],
     "rollout.engine.expert_parallel", "needs a mixture-of-experts model"),
    (["rollout.engine.device=cpu", "rollout.engine.tensor_parallel=2", "rollout.engine.expert_parallel=2"],
     "rollout.engine.expert_parallel", "fails at its first forward"),
    (["rollout.engine.mem_fraction_static=1.2"], "rollout.engine.mem_fraction_static", "must be in (0, 1)"),
    (["rollout.engine.extra_args=[--mem-fraction-static, '0.5']"], "rollout.engine.extra_args",
     "sets --mem-fraction-static, which rollout.engine.mem_fraction_static sets"),
    (["rollout.engine.cuda_graph_max_bs=-1"], "rollout.engine.cuda_graph_max_bs", ">= 0"),
    (["rollout.engine.tensor_parallel=2", "rollout.engine.nodes_per_engine=4"], "rollout.engine.nodes_per_engine",
     "must divide rollout.engine.tensor_parallel (2)"),
    (["rollout.engine.tensor_parallel=2", "rollout.engine.nodes_per_engine=2", "weight_sync.transport=tensor"],
     "weight_sync.transport", "cannot open"),
    (["rollout.engine.nodes_per_engine=0"], "rollout.engine.nodes_per_engine", "must be > 0"),
]


@pytest.mark.parametrize(("overrides", "key", "fragment"), CONTRADICTIONS)
def test_contradictory_serving_options_are_refused(task_assets, overrides, key, fragment):
    base = [f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}", "eval.every=0",
            f"sft.data_path={task_assets['sft']}"]
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/quickstart_cpu.yaml", base + overrides)
    assert err.value.key == key and fragment in str(err.value), str(err.value)


def test_an_moe_engine_with_expert_parallelism_loads(tiny_models, task_assets, tmp_path):
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", corpus=echo_digit.corpus(), family="qwen3_moe")
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={moe}", f"data.path={task_assets['train']}", "eval.every=0",
        f"sft.data_path={task_assets['sft']}", "rollout.engine.device=cuda", "rollout.engine.tensor_parallel=2",
        "rollout.engine.expert_parallel=2", "rollout.engine.moe_a2a_backend=deepep"])
    assert serving_args(cfg.rollout.engine) == ["--ep-size", "2", "--moe-a2a-backend", "deepep"]


def test_the_shard_loader_engines_register_is_slimishs():
    """The dotted paths every engine registers with --custom-weight-loader (SGLang imports them with its
    `dynamic_import`) name the sharded disk and broadcast syncs' engine-side loaders."""
    from sglang.srt.utils.common import dynamic_import

    from slimish.weight_sync.engine_loader import load_by_name, load_shard_files, receive_shard

    assert dynamic_import(SHARD_DIRECT) is load_by_name
    assert dynamic_import(SHARD_LOADER) is load_shard_files
    assert dynamic_import(SHARD_RECEIVER) is receive_shard
