"""`slimish plan`'s activation and state figures against the bytes Megatron really allocates on the emulated GPU.

A Qwen3-shaped model (4 layers, hidden 256, SwiGLU 768, 4 heads over 2 KV groups, fp32, the SDPA attention) trains
on one packed micro-batch of 2048 tokens at three layouts; `memory_rank.py` counts the bytes the emulated GPU holds
(`slimish.compat.emulated_gpu.memory_allocated` / `max_memory_allocated`, as CUDA's allocator counts them). The plan's
per-layer terms (`slimish.planning.memory.layer_terms`) are those autograd saves: `saved_tensors_hooks` checks them
byte for byte for the tiny Qwen3 and Llama layers.
"""

from __future__ import annotations

import json

import pytest

from tests.multiproc import run_world

TOKENS = 2048
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2 * TOKENS)

# id -> (world size, TP, overrides)
LAYOUTS = {
    "one-rank": (1, 1, ()),
    "tp2-sequence-parallel": (2, 2, ("parallel.sequence_parallel=true",)),
    "cp2-distributed-optimizer": (2, 1, ("parallel.context_parallel=2", "trainer.optimizer.distributed=true")),
}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("memory") / "qwen3", corpus=echo_digit.corpus(), **SHAPE)


def _plan(model, data, world: int, tp: int, extra: tuple[str, ...]):
    from slimish.config import load_config
    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.planning.memory import trainer_rank
    from slimish.planning.params import count_params
    from tests.kit.trainer import REPO
    from tests.planning.memory_rank import PROMPT, overrides

    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", ["eval.every=0", "sft.steps=0", *overrides(
        str(model), data, tokens=TOKENS, tp=tp, world=world), *extra])
    hf = read_hf_config(model)
    return trainer_rank(cfg, architecture_from_hf(hf), count_params(hf), prompt_tokens=PROMPT)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plan_counts_the_bytes_a_training_step_holds(task_assets, long_model, tmp_path, layout):
    """Each rank's peak over a training step (its state and the step's activations) is the plan's total within 10%,
    and the step's own share of it (the peak less the state held before the step) the plan's activations and logits
    within 10%; what is held after the step is the plan's weights, grads and optimizer (and, with sequence
    parallelism, Megatron's all-gather buffer) within 1%."""
    from tests.kit.trainer import REPO

    world, tp, extra = LAYOUTS[layout]
    out = tmp_path / "out"
    run_world(REPO / "tests/planning/memory_rank.py", world_size=world,
              args=["--tp", str(tp), "--hf", str(long_model), "--data", task_assets["train"], "--tokens", str(TOKENS),
                    "--out", str(out), *[arg for item in extra for arg in ("--set", item)]],
              env={"SLIMISH_EMULATED_GPU": "1", "SLIMISH_EMULATED_GPU_MEMORY": "1"})
    plan = _plan(long_model, task_assets["train"], world, tp, extra)
    assert plan.reference == 0 and plan.critic == 0
    state = plan.weights + plan.grads + plan.optimizer
    for rank in range(world):
        held = json.loads((out / f"rank{rank}.json").read_text())
        step = held["peak"] - held["held"] + plan.gather_buffer  # the buffer held from the first step on
        figures = (f"rank {rank}: held {held['after'] / 1e6:.2f} MB (plan {(state + plan.gather_buffer) / 1e6:.2f}), "
                   f"step {step / 1e6:.1f} MB (plan {(plan.activations + plan.logits) / 1e6:.1f}), "
                   f"peak {held['peak'] / 1e6:.1f} MB (plan {plan.total / 1e6:.1f})")
        print(figures)
        assert held["after"] == pytest.approx(state + plan.gather_buffer, rel=0.01), figures
        assert step == pytest.approx(plan.activations + plan.logits, rel=0.10), figures
        assert held["peak"] == pytest.approx(plan.total, rel=0.10), figures


def _saved_by_layer(model, *args, **kwargs) -> dict[str, int]:
    """Bytes each decoder layer saves for its backward pass in a forward of `model`: every storage once, attributed
    to the layer whose forward saved it first; parameters left out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[str] = ["-"]
    hooks = []

    def leave(_module, _args, _output) -> None:  # returns None: the layer's output is left as it is
        current.pop()

    for name, layer in model.named_modules():
        if name.startswith("decoder.layers.") and name.count(".") == 2:
            hooks.append(layer.register_forward_pre_hook(lambda _m, _a, name=name: current.append(name)))
            hooks.append(layer.register_forward_hook(leave))
    seen, saved = set(), {}

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            saved[current[-1]] = saved.get(current[-1], 0) + tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*args, **kwargs)
    for hook in hooks:
        hook.remove()
    return saved


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_layer_saves_what_the_plan_counts(family, dtype, tiny_models, tiny_moe_models, megatron_world):
    """Every decoder layer of the tiny models, built as the trainer builds them with the SDPA attention, saves for
    its backward pass the bytes `layer_terms` counts per token, for one packed row of two samples: byte for byte for
    the dense layers (Qwen3's q / k norms, GLM-4.5's partial rotary) and Qwen3-MoE's softmax router; within 2% for
    multi-latent attention (DeepSeek-V3: its latents' fp32 copies in bf16) and the sigmoid routers (GLM-4.5,
    DeepSeek-V3: their scores, bias and groups are not counted)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.planning.memory import DTYPE_BYTES, layer_terms
    from slimish.trainer.model import build_gpt_model

    path = {**tiny_models, **tiny_moe_models}[family]
    arch = architecture_from_hf(read_hf_config(path))
    model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1, dtype=getattr(torch, dtype),
                            attention="sdpa")
    length, tokens = 24, 48
    bounds = torch.tensor([0, length, tokens], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=length,
                             max_seqlen_kv=length)
    ids = torch.randint(0, arch.vocab_size, (1, tokens))
    positions = torch.cat([torch.arange(length), torch.arange(length)]).unsqueeze(0)
    saved = _saved_by_layer(model, ids, positions, None, packed_seq_params=packed)
    for layer in range(arch.num_layers):
        terms = layer_terms(arch, layer, attention="sdpa", dtype=DTYPE_BYTES[dtype], tp=1, etp=1, sp=False)
        sigmoid = arch.moe is not None and arch.moe.is_sparse(layer) and arch.moe.score_function == "sigmoid"
        exact = arch.mla is None and not sigmoid
        assert saved[f"decoder.layers.{layer}"] == pytest.approx(tokens * sum(terms.values()),
                                                                  rel=0 if exact else 0.02), (layer, terms)
