"""`slimish plan` against hand computations, Megatron-Core's own parameter count and what its local attention keeps for
the backward pass: the recipes' models counted as Megatron builds them, one trainer rank's share of a layout, the
memory of the 405B recipe's rank and engine, the core attention that runs (te / sdpa / local), sequence parallelism,
the reference model and the critic, the 405B full-broadcast sync time, and the command's output for every recipe."""

from __future__ import annotations

import json
import re

import pytest

from slimish.config import load_config
from slimish.planning.memory import colocated_gpu, core_attention, engine_gpu, trainer_rank
from slimish.planning.params import count_params
from slimish.planning.walls import step_walls
from tests.config.test_recipes import RECIPES
from tests.conftest import REPO
from tests.megatron_bridge.real_configs import DEEPSEEK_V3, LLAMA31_405B, QWEN3_8B, trimmed
from tests.megatron_bridge.test_real_shapes import megatron_meta_shapes


def recipe(name: str, tmp_path, *overrides: str):
    (tmp_path / "config.json").write_text(json.dumps(RECIPES[name]))
    return load_config(REPO / "configs" / "recipes" / f"{name}.yaml", [f"model.hf_path={tmp_path}", *overrides],
                       files=False)


@pytest.mark.parametrize("name", ["llama31_405b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3",
                                  "glm45"])
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
    # Sequence parallelism, trainer.attention auto planned as te, 126 layers' inputs in flight on stage 0 (7
    # micro-batches x 18) with full recompute, one layer's saved tensors and the MLP's backward beside them; no final
    # norm on stage 0; Megatron's all-gather buffer for the whole sequence.
    tokens = 8704
    layer = tokens * _layer_bytes(h=h, heads=128, groups=8, dim=128, ffn=ffn, tp=8, sp=True, dtype=2, attention="te")
    assert mem.attention == "te" and mem.reference == mem.critic == 0
    mlp_backward, buffer = tokens * ffn / 8 * 2, tokens * h * 2
    assert mem.gather_buffer == buffer
    assert mem.activations == pytest.approx(7 * 18 * tokens * h * 2 / 8 + layer + 3 * mlp_backward + buffer)
    assert mem.activations_other == pytest.approx(7 * 18 * layer + mlp_backward + buffer)
    engine = engine_gpu(cfg, arch, params, prompt_tokens=512)
    assert engine.weights == pytest.approx(params.total * 2 / 8)
    pool = cfg.rollout.engine.max_total_tokens  # SGLang's KV pool: fewer than 128 full-length requests
    assert pool < 128 * 8704 and engine.kv_tokens == pool
    assert engine.kv_cache == pytest.approx(pool * 2 * 126 * 1 * 128 * 2)  # K and V, 126 layers, 1 kv head per rank


def _layer_bytes(*, h: int, heads: int, groups: int, dim: int, ffn: int, tp: int, sp: bool, dtype: int,
                 attention: str, qk_norm: bool = False) -> float:
    """By hand, per token: what one dense SwiGLU layer saves for its backward pass (`memory.layer_terms`)."""
    outside, q, kv = (1 / tp if sp else 1), heads * dim, groups * dim
    te = attention == "te"
    norms = outside * 2 * ((h * dtype if te else 2 * h * 4) + 4)  # the local spec's norms work in fp32
    linear_inputs = outside * 2 * h * dtype
    qkv = (q + 2 * kv) / tp * dtype
    rstd = (heads + groups) / tp * 4
    fp32_inputs = (2 * q + kv + (kv if dtype < 4 else 0)) / tp * 4
    qk = 0.0 if not qk_norm else (q / tp * dtype if te else fp32_inputs) + rstd
    rope = ((q + kv) / tp + (0 if te else 4 * dim)) * dtype
    core = {"te": q / tp * dtype + 4 * heads / tp, "sdpa": 2 * q / tp * dtype + 4 * heads / tp,
            "local": (2 * q / tp + (2 * q / tp if groups < heads else 0)) * dtype}[attention]
    return norms + linear_inputs + qkv + qk + rope + core + 5 * ffn / tp * dtype


def _eight_b_layer(attention: str, *, sp: bool = True) -> float:
    return _layer_bytes(h=4096, heads=32, groups=8, dim=128, ffn=12288, tp=2, sp=sp, dtype=2, attention=attention,
                        qk_norm=True)


def _eight_b_final_norm(tokens: int, *, sp: bool = True, te: bool = False) -> float:
    h = 4096
    return tokens * ((1 / 2 if sp else 1) * ((h * 2 if te else 2 * h * 4) + 4) + h * 2)


def _eight_b(tmp_path, *overrides: str):
    """The Qwen3-8B recipe (TP2 x DP2, 2 padded rows of 8192 + 512 tokens per micro-batch, full recompute) and its
    trainer rank's memory."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    cfg = recipe("qwen3_8b_math_grpo", tmp_path, *overrides)
    return cfg, trainer_rank(cfg, architecture_from_hf(QWEN3_8B), count_params(QWEN3_8B), prompt_tokens=0)


def test_local_attention_grows_with_the_square_of_the_sequence_sdpa_linearly(tmp_path):
    """From 8k to 32k tokens per sample (4x), sdpa's activations grow 4x; the local attention's [s, s] share 16x: per
    layer kept, the fp32 softmax and the bf16 probabilities of 32 / 2 heads over 2 x s^2 elements, and one s^2 bool
    mask; in the layer being computed, Megatron's bf16 buffer for the scores and 6 bytes more per element."""
    heads, h, ffn = 32 / 2, 4096, 12288
    for s in (8192, 32768):
        _, sdpa = _eight_b(tmp_path, "trainer.attention=sdpa", f"rollout.max_new_tokens={s}")
        _, local = _eight_b(tmp_path, "trainer.attention=local", f"rollout.max_new_tokens={s}")
        _, te = _eight_b(tmp_path, "trainer.attention=auto", f"rollout.max_new_tokens={s}")
        tokens = 2 * s
        # 36 layers' inputs (/ TP with SP), one layer's saved tensors, the MLP's backward, the final norm, the buffer
        base = 36 * tokens * h * 2 / 2 + 3 * tokens * ffn / 2 * 2 + _eight_b_final_norm(tokens) + tokens * h * 2
        assert sdpa.attention == "sdpa" and sdpa.activations == pytest.approx(base + tokens * _eight_b_layer("sdpa"))
        assert local.activations == pytest.approx(base + tokens * _eight_b_layer("local")
                                                  + heads * 2 * s * s * (4 + 2) + s * s + heads * 2 * s * s * (2 + 6))
        assert sdpa.activations_attention_other == local.activations
        assert local.activations_attention_other == pytest.approx(te.activations)
    _, sdpa_8k = _eight_b(tmp_path, "trainer.attention=sdpa")
    _, sdpa_32k = _eight_b(tmp_path, "trainer.attention=sdpa", "rollout.max_new_tokens=32768")
    _, local_8k = _eight_b(tmp_path, "trainer.attention=local")
    assert sdpa_32k.activations == pytest.approx(4 * sdpa_8k.activations)

    def square(mem, sdpa, tokens):  # the local attention's bytes beyond sdpa's, less its per-token ones
        return mem.activations - sdpa.activations - tokens * (_eight_b_layer("local") - _eight_b_layer("sdpa"))

    assert square(local, sdpa_32k, 2 * 32768) == pytest.approx(16 * square(local_8k, sdpa_8k, 2 * 8192), rel=1e-4)
    # No recompute: every layer keeps its softmax and probabilities; the rest only in the layer being computed.
    _, no_recompute = _eight_b(tmp_path, "trainer.attention=local", "trainer.recompute=none")
    s, tokens = 8192, 2 * 8192
    rest = tokens * ffn / 2 * 2 + _eight_b_final_norm(tokens) + tokens * h * 2
    assert no_recompute.activations == pytest.approx(
        36 * (tokens * _eight_b_layer("local") + heads * 2 * s * s * 6 + s * s) + heads * 2 * s * s * 8 + rest)
    # Selective recompute of the core attention: every layer keeps its activations but the core attention's own (the
    # [s, s] ones, the context, the repeated keys and values), which only the layer being recomputed holds.
    _, selective = _eight_b(tmp_path, "trainer.attention=local", "trainer.recompute=selective")
    dropped = tokens * (2 * 4096 / 2 + 2 * 4096 / 2 - 4096 / 2) * 2  # all of the local attention's but proj's input
    assert selective.activations == pytest.approx(36 * (tokens * _eight_b_layer("local") - dropped) + dropped
                                                  + heads * 2 * s * s * 6 + s * s + heads * 2 * s * s * 8 + rest)
    assert selective.activations_other == pytest.approx(local_8k.activations)  # full recompute, the other way


def test_cpu_offload_moves_its_share_of_the_optimizer_to_host_memory(tmp_path):
    """trainer.optimizer.cpu_offload (the Qwen3-8B recipe: bf16, the distributed optimizer over DP2): its share of
    the fp32 main weights and moments (12 bytes per parameter) leaves the GPU for host memory, with a 4-byte host copy
    of those parameters' gradients; the rest of the rank is the same."""
    _, kept = _eight_b(tmp_path)
    for share, given in ((1.0, "true"), (0.25, "0.25")):
        _, moved = _eight_b(tmp_path, f"trainer.optimizer.cpu_offload={given}")
        assert moved.optimizer == pytest.approx(kept.optimizer * (1 - share))
        assert moved.optimizer_host == pytest.approx(kept.optimizer * share * 16 / 12)
        assert moved.total == pytest.approx(kept.total - kept.optimizer * share)
    assert kept.optimizer_host == 0


def _peak_bytes(keep, run, *args, **kwargs) -> int:
    """The peak bytes, while `run(*args, **kwargs)` runs, of the tensors it creates that `keep(tensor)` selects (each
    storage counted from its creation until it is freed)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live, now, peak = set(), [0], [0]

    def free(key: int, size: int) -> None:
        live.discard(key)
        now[0] -= size

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                storage = t.untyped_storage() if hasattr(t, "untyped_storage") and keep(t) else None
                if storage is not None and storage.data_ptr() not in live:
                    live.add(storage.data_ptr())
                    now[0] += storage.nbytes()
                    peak[0] = max(peak[0], now[0])
                    weakref.finalize(storage, free, storage.data_ptr(), storage.nbytes())
            return out

    with Track():
        run(*args, **kwargs)
    return peak[0]


def _forward_backward(module, *args, **kwargs) -> None:
    module(*args, **kwargs).float().sum().backward()


def _saved(forward, *args, **kwargs) -> dict:
    """The tensors `forward(*args, **kwargs)` saves for its backward pass, one per storage."""
    import torch

    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(t.untyped_storage().data_ptr(), t),
                                                  lambda t: t):
        forward(*args, **kwargs)
    return saved


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_local_attention_holds_what_megatrons_dot_product_attention_holds(dtype, megatron_world, monkeypatch):
    """What the plan counts for the local attention is what Megatron's DotProductAttention (through the packed
    wrapper slimish runs for trainer.attention=local) holds, on the CPU: the [s, s] tensors it saves for its backward
    pass (kept by every layer), and the peak of all its [s, s] tensors and its global buffer for the scores during a
    forward and backward pass (kept + the layer being computed), for 3 padded rows in one call and 3 packed samples
    one at a time. sdpa holds no [s, s] tensor and saves an fp32 log-sum-exp per head and query."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from slimish.compat.packed_attention import packed
    from slimish.planning.memory import DTYPE_BYTES
    from slimish.trainer.attention import SdpaAttention

    heads, groups, dim, s = 4, 2, 8, 48
    torch_dtype = getattr(torch, dtype)
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=dim, bf16=dtype == "bfloat16",
                               params_dtype=torch_dtype, masked_softmax_fusion=False, attention_dropout=0.0,
                               hidden_dropout=0.0, use_cpu_initialization=True)
    bounds = torch.tensor([0, s, 2 * s, 3 * s], dtype=torch.int32)
    rows = {"padded": ((s, 3), 3, {}),  # [s, b, heads, dim]: 3 rows of s in one call
            "packed": ((3 * s,), 1, {"packed_seq_params": PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=s, max_seqlen_kv=s)})}
    for name, attention in (("local", packed(DotProductAttention)), ("sdpa", SdpaAttention)):
        module = attention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for row, (shape, samples_at_once, kwargs) in rows.items():
            q, k, v = (torch.randn(*shape, n, dim, dtype=torch_dtype, requires_grad=True)
                       for n in (heads, groups, groups))
            saved = _saved(module, q, k, v, None, **kwargs)
            monkeypatch.setattr(parallel_state.get_global_memory_buffer(), "buffer", {})  # allocated in the call
            scores = heads * samples_at_once * s * s  # the global buffer's elements
            peak = _peak_bytes(lambda t, scores=scores: t.shape[-2:] == (s, s) or t.numel() == scores,
                               _forward_backward, module, q, k, v, None, **kwargs)
            square = sum(t.untyped_storage().nbytes() for t in saved.values() if t.shape[-2:] == (s, s))
            lse = sum(t.untyped_storage().nbytes() for t in saved.values()
                      if t.dtype == torch.float32 and t.shape[-2:] == (heads, s))  # [b, heads, s]
            kept, computing = core_attention(name, dtype=DTYPE_BYTES[dtype], heads=heads, tokens=3 * s, longest=s,
                                             samples_at_once=samples_at_once)
            if name == "local":
                assert (square, peak) == (kept, kept + computing), row
            else:  # its log-sum-exp is `layer_terms`' (per token, 4 bytes a head)
                assert (square, peak, kept, computing) == (0, 0, 0, 0) and lse == 4 * heads * 3 * s, row


def test_sequence_parallelism_divides_the_activations_outside_the_tensor_parallel_regions(tmp_path):
    """At TP2, sequence parallelism splits over TP what a layer keeps outside the tensor-parallel regions (its norms
    and the linear layers' inputs), each layer's input kept by full recompute from T*h to T*h/2, and the final norm;
    it adds Megatron's all-gather buffer (T*h); the core attention's bytes are the same either way."""
    tokens, h = 2 * 8192, 4096
    outside = _eight_b_layer("sdpa", sp=False) - _eight_b_layer("sdpa")
    assert outside == pytest.approx((2 * (2 * h * 4 + 4) + 2 * h * 2) / 2)
    final = _eight_b_final_norm(tokens, sp=False) - _eight_b_final_norm(tokens)
    _, on = _eight_b(tmp_path, "trainer.attention=sdpa")
    _, off = _eight_b(tmp_path, "trainer.attention=sdpa", "parallel.sequence_parallel=false")
    assert on.gather_buffer == tokens * h * 2 and off.gather_buffer == 0
    assert off.activations - on.activations == pytest.approx(36 * tokens * h * 2 / 2 + tokens * outside + final
                                                             - tokens * h * 2)
    _, on = _eight_b(tmp_path, "trainer.attention=sdpa", "trainer.recompute=none")
    _, off = _eight_b(tmp_path, "trainer.attention=sdpa", "trainer.recompute=none", "parallel.sequence_parallel=false")
    assert off.activations - on.activations == pytest.approx(36 * tokens * outside + final - tokens * h * 2)
    # At TP1 sequence parallelism is a no-op: the same plan.
    args = ("parallel.tensor_parallel=1", "parallel.num_trainer_ranks=2")
    _, tp1_on = _eight_b(tmp_path, *args)
    _, tp1_off = _eight_b(tmp_path, *args, "parallel.sequence_parallel=false")
    assert tp1_on == tp1_off


def test_kl_coef_adds_the_reference_model(tmp_path):
    """trainer.loss.kl_coef > 0 (or reward_kl_coef with an estimator that shapes rewards by it) builds the reference
    model: its weights in bf16, sharded like the policy's; its forward runs in turn with training (not added)."""
    _, grpo = _eight_b(tmp_path)
    cfg, kl = _eight_b(tmp_path, "trainer.loss.kl_coef=0.01")
    assert grpo.reference == 0 and kl.reference == kl.weights
    assert kl.total == pytest.approx(grpo.total + kl.weights)
    assert 0 < kl.reference_activations < kl.activations + kl.logits  # one chunk of logits twice, not thrice
    _, unused = _eight_b(tmp_path, "trainer.loss.reward_kl_coef=0.01")  # grpo does not shape rewards
    _, shaped = _eight_b(tmp_path, "trainer.loss.reward_kl_coef=0.01",
                         "trainer.loss.advantage_estimator=reinforce_plus_plus")
    assert unused.reference == 0 and shaped.reference == kl.weights
    from slimish.planning.report import plan_text

    assert "  ref   " in plan_text(cfg, QWEN3_8B) and "  ref   " not in plan_text(recipe("qwen3_8b_math_grpo",
                                                                                          tmp_path), QWEN3_8B)


def test_ppo_adds_the_critic(tmp_path):
    """advantage_estimator ppo builds the critic: the policy's weights plus a value head (hidden + 1) on the last
    stage, fp32 grads and optimizer state of all but its frozen output layer, and activations as the policy's (in
    turn with them: not added)."""
    cfg, ppo = _eight_b(tmp_path, "trainer.loss.advantage_estimator=ppo")
    _, grpo = _eight_b(tmp_path)
    h, vocab = 4096, 151936
    trained = ppo.weights / 2 - vocab * h / 2 + h + 1  # TP2: half the output layer is frozen
    assert ppo.critic_weights == ppo.weights + 2 * (h + 1)
    assert ppo.critic_grads == 4 * trained
    assert ppo.critic_optimizer == pytest.approx(12 * trained / 2)  # distributed over DP2
    assert ppo.critic_activations == ppo.activations and ppo.reference == 0
    assert ppo.total == pytest.approx(grpo.total + ppo.critic)
    from slimish.planning.report import plan_text

    assert "  critic " in plan_text(cfg, QWEN3_8B)


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


def test_a_sharded_disk_sync_reads_a_tth_per_engine_rank(tmp_path):
    """The 405B recipe over disk (812 GB at 10 GB/s): the full path writes it all from rank 0 (81 s) and every engine
    rank reads it all (81 s). Sharded, its seven stage leaders write their own stages at once (the fullest, the last
    with the output layer: 119.0 GB, 11.9 s) and each of the TP8 engines' ranks reads its own eighth (101.5 GB,
    10.1 s). DeepSeek-V3 (1.34 TB) on TP16 engines from its 16 owners (4 stages x EP4): the last stage's leader
    writes the most, 8.8 GB outside the experts and a quarter of its 338.2 GB of experts (9.3 s), each engine rank
    reads a sixteenth (8.4 s); no expert reaches a leader first."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    arch, params = architecture_from_hf(LLAMA31_405B), count_params(LLAMA31_405B)
    full = step_walls(recipe("llama31_405b_math_grpo", tmp_path, "weight_sync.transport=disk",
                             "weight_sync.sharded=off"), arch, params).sync
    sharded = step_walls(recipe("llama31_405b_math_grpo", tmp_path, "weight_sync.transport=disk"), arch, params).sync
    assert (full, sharded) == (pytest.approx(162.3, abs=0.1), pytest.approx(11.90 + 81.17 / 8, abs=0.01))
    arch, params = architecture_from_hf(DEEPSEEK_V3), count_params(DEEPSEEK_V3)
    assert step_walls(recipe("deepseek_v3_math_grpo", tmp_path, "weight_sync.transport=disk"), arch, params).sync == \
        pytest.approx(9.34 + 134.2 / 16, abs=0.01)


# Each large recipe's sync (docs/weight-sync.md, "At scale, on paper"): (route, senders, full s, sharded s) over
# broadcast at 50 GB/s per GPU link.
SCALE = {"llama31_405b_math_grpo": ("stages", 7, 16.23, 2.38),     # the last stage's 119.0 GB
         "deepseek_v3_math_grpo": ("owned", 16, 46.46, 1.87),      # the last stage's leader: 8.8 + 338.2 / 4 GB
         "glm45_math_grpo": ("owned", 64, 20.83, 1.76),            # an engine rank's 705.6 / 8 GB
         "qwen3_235b_a22b_math_grpo": ("owned", 32, 9.40, 1.18)}   # an engine rank's 470.2 / 8 GB


@pytest.mark.parametrize("name", sorted(SCALE))
def test_the_sharded_sync_goes_from_several_senders(name, tmp_path):
    """The large recipes' sharded sync, as `WeightSender._senders_route` sends it: the 405B from its seven stage
    leaders; the MoE recipes (CUDA engines: the owners' checksums combine) from every stage's expert-parallel
    owners. Over NCCL 'auto' keeps the full path (the wall counts it); weight_sync.sharded=on takes the sharded."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf
    from slimish.planning.walls import sync_estimate

    arch, params = architecture_from_hf(RECIPES[name]), count_params(RECIPES[name])
    route, senders, full, sharded = SCALE[name]
    auto = sync_estimate(recipe(name, tmp_path), arch, params)
    assert (auto.route, auto.senders, auto.taken) == (route, senders, "full")
    assert (auto.full, auto.sharded) == (pytest.approx(full, abs=0.01), pytest.approx(sharded, abs=0.01))
    assert step_walls(recipe(name, tmp_path), arch, params).sync == pytest.approx(full, abs=0.01)
    on = recipe(name, tmp_path, "weight_sync.sharded=on")
    assert sync_estimate(on, arch, params).taken == "sharded"
    assert step_walls(on, arch, params).sync == pytest.approx(sharded, abs=0.01)


def test_the_route_follows_the_senders_rules(tmp_path):
    """Without stage senders and expert parallelism rank 0 sends alone (the one-sender figure: the later stages'
    bytes reach it first); CPU engines whose expert parallelism is not a multiple of the trainer's keep the experts
    off the owners' route while checksums are on (SHA-256 does not combine), not with weight_sync.verify off; over
    gloo 'auto' shards the broadcast; engines of one rank or DP attention cannot be sharded."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf
    from slimish.planning.walls import sync_estimate

    arch, params = architecture_from_hf(LLAMA31_405B), count_params(LLAMA31_405B)
    alone = sync_estimate(recipe("llama31_405b_math_grpo", tmp_path, "weight_sync.stage_senders=false"), arch, params)
    assert (alone.route, alone.senders) == (None, 1)
    assert alone.sharded == pytest.approx(alone.full) == pytest.approx(16.23 * (1 + 6 / 7), abs=0.01)
    gloo = sync_estimate(recipe("llama31_405b_math_grpo", tmp_path, "parallel.backend=gloo"), arch, params)
    assert gloo.taken == "sharded"
    one = sync_estimate(recipe("llama31_405b_math_grpo", tmp_path, "rollout.engine.tensor_parallel=1",
                               "weight_sync.sharded=off"), arch, params)
    assert one.sharded is None and one.seconds == pytest.approx(16.23, abs=0.01)
    arch, params = architecture_from_hf(DEEPSEEK_V3), count_params(DEEPSEEK_V3)
    cpu = recipe("deepseek_v3_math_grpo", tmp_path, "rollout.engine.device=cpu")
    assert sync_estimate(cpu, arch, params).route == "stages"
    unverified = recipe("deepseek_v3_math_grpo", tmp_path, "rollout.engine.device=cpu", "weight_sync.verify=false")
    assert sync_estimate(unverified, arch, params).route == "owned"


def test_plan_prints_the_sync_both_ways(tmp_path):
    """The plan names the sync's figures full and sharded, the route and its senders, and which one the config
    takes and why."""
    from slimish.planning.report import plan_text

    text = plan_text(recipe("deepseek_v3_math_grpo", tmp_path), DEEPSEEK_V3)
    assert "one broadcast sync, wire seconds (400 Gb/s per GPU" in text
    assert "  full         46.5   (every engine rank receives the whole model)" in text
    assert "  sharded       1.9   (each engine rank its shard; 16 senders, route \"owned\"" in text
    assert "  taken: full (weight_sync.sharded=auto keeps the full path over NCCL; on shards it)" in text
    disk = plan_text(recipe("llama31_405b_math_grpo", tmp_path, "weight_sync.transport=disk"), LLAMA31_405B)
    assert "7 senders, route \"stages\"" in disk and "  taken: sharded (weight_sync.sharded=auto)" in disk
    tensor = plan_text(recipe("llama31_405b_math_grpo", tmp_path, "weight_sync.transport=tensor"), LLAMA31_405B)
    assert "wire seconds" not in tensor


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


def test_the_train_wall_counts_the_roles_the_trainer_builds(tmp_path):
    """The reference's forward where the trainer builds one (`builds_roles`, the set-up's rule: reward_kl_coef
    counts only for the estimators that use it), and ppo's critic (its values and its own optimizer pass)."""
    from slimish.megatron_bridge.hf_config import architecture_from_hf

    arch, params = architecture_from_hf(LLAMA31_405B), count_params(LLAMA31_405B)

    def train(*overrides):
        return step_walls(recipe("llama31_405b_math_grpo", tmp_path, "trainer.recompute=full",
                                 "trainer.loss.kl_coef=0", *overrides), arch, params).train

    alone = train()
    assert train("trainer.loss.reward_kl_coef=0.1") == pytest.approx(alone)  # grpo reads no reward KL: no reference
    assert train("trainer.loss.kl_coef=0.01") > alone
    assert train("trainer.loss.advantage_estimator=reinforce_plus_plus", "trainer.loss.reward_kl_coef=0.1") > alone
    assert train("trainer.loss.advantage_estimator=ppo") > alone


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


# Each known model's recipe
KNOWN_RECIPES = {"llama-3.1-405b": "llama31_405b_math_grpo", "qwen3-8b": "qwen3_8b_math_grpo",
                 "qwen3-30b-a3b": "qwen3_30b_a3b_math_grpo", "qwen3-235b-a22b": "qwen3_235b_a22b_math_grpo",
                 "deepseek-v3": "deepseek_v3_math_grpo", "glm-4.5": "glm45_math_grpo"}


@pytest.mark.parametrize("model", sorted(KNOWN_RECIPES))
def test_plan_before_the_download(model, tmp_path, capsys):
    """`plan --model` takes a known model by name (its released config.json fields, kept in the package) or the
    config.json file alone, and prints the same plan as for a model directory holding that config.json; overrides
    may follow the option."""
    from slimish.cli import main
    from slimish.megatron_bridge.known_models import KNOWN

    path = REPO / "configs" / "recipes" / f"{KNOWN_RECIPES[model]}.yaml"
    (tmp_path / "config.json").write_text(json.dumps(KNOWN[model]))
    outs = []
    for args in (["--model", model.upper()], ["--model", str(tmp_path / "config.json")],
                 [f"model.hf_path={tmp_path}"]):
        assert main(["plan", str(path), *args, "rl.num_steps=7"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and "trainer rank" in outs[0]
    assert main(["plan", str(path), "--model", "no-such-model"]) == 2
    assert "known model: llama-3.1-405b" in capsys.readouterr().err


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


# The lines of `slimish plan`'s memory sections a recipe header quotes: a name and its figure in GB.
FIGURE = re.compile(r"^\s+(weights|grads|optim|activ|logits|ref|critic|KV|total|generate|train|sync|host)\s+([\d.]+)\b")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_header_quotes_what_plan_prints_for_it(name, tmp_path):
    """Each recipe's header quotes the memory lines `slimish plan` prints for it (trainer rank, engine GPU, and the
    colocated phases), figure by figure, and names the command."""
    from slimish.planning.report import plan_text

    text = (REPO / "configs" / "recipes" / f"{name}.yaml").read_text()
    header = [line[1:] for line in text.split("\nrun:")[0].splitlines() if line.startswith("#     ")]
    printed = plan_text(recipe(name, tmp_path), RECIPES[name]).split("\nseconds per step:")[0].splitlines()

    def figures(lines: list[str]) -> list[tuple[str, str]]:
        return [match.groups() for match in map(FIGURE.match, lines) if match]

    assert figures(header) == figures(printed), "regenerate the header's plan lines"
    assert f"slimish plan configs/recipes/{name}.yaml" in text


def test_context_parallelism_divides_a_ranks_tokens(tmp_path):
    """parallel.context_parallel: each rank holds 1/cp of every sequence's activations (the [s, s]-free attention's
    too), and the data-parallel size is what is left of the ranks (TP2 x CP2 of 4 ranks: DP1)."""
    from slimish.planning.memory import layout

    cfg, one = _eight_b(tmp_path, "trainer.recompute=none")
    cfg_cp, two = _eight_b(tmp_path, "trainer.recompute=none", "parallel.context_parallel=2")
    assert two.activations == pytest.approx(one.activations / 2)
    assert layout(cfg).data_parallel == 2 and layout(cfg_cp).data_parallel == 1


def test_the_interleaved_pipeline_holds_more_micro_batches_in_flight():
    """Megatron's interleaved 1F1B (virtual_pipeline v): the first stage's warm-up runs 2 (pp - 1) + (v - 1) pp chunk
    forwards before its first backward, each through 1/v of the stage's layers: PP4 x VPP2 holds 11 chunk forwards
    of 4 layers where 1F1B holds 4 micro-batches of 8 (44 layers' activations against 32)."""
    from slimish.planning.memory import Layout, in_flight_layers

    base = dict(tensor_parallel=1, pipeline_parallel=4, expert_parallel=1, data_parallel=1, sequence_parallel=False)
    assert in_flight_layers(Layout(**base), 8) == 32
    assert in_flight_layers(Layout(**base, virtual_pipeline=2), 8) == 44


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_logits_chunk_holds_what_the_plan_counts(dtype, megatron_world, tmp_path):
    """One chunk of the logprob head (`slimish.trainer.logprobs`: the output layer's logits, the cross entropy over
    them and the entropy beside it, then the backward pass) peaks at dtype + 20 bytes per logit, on the CPU: what
    `trainer_rank`'s logits line counts per chunk element."""
    import torch

    from slimish.planning.memory import DTYPE_BYTES
    from slimish.trainer.logprobs import _logprobs_of, vocab_parallel_entropy

    chunk, vocab, h = 256, 4096, 64
    torch_dtype = getattr(torch, dtype)
    hidden = torch.randn(1, chunk, h, dtype=torch_dtype, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch_dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (1, chunk))

    def step() -> None:  # in `LogprobHead._chunk`'s order: the logprobs (their softmax kept), then the entropy
        logits = hidden @ weight.t()
        logprobs = _logprobs_of(logits, targets, 1.0)
        (logprobs.sum() + 0 * vocab_parallel_entropy(logits).sum()).backward()

    peak = _peak_bytes(lambda t: t.numel() >= chunk * vocab, step)
    assert peak == chunk * vocab * (DTYPE_BYTES[dtype] + 20)
    cfg, mem = _eight_b(tmp_path, f"model.dtype={dtype}")
    assert mem.logits == pytest.approx(cfg.trainer.logprob_chunk_tokens * 151936 / 2 * (DTYPE_BYTES[dtype] + 20))
