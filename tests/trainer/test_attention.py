"""The trainer's attentions (`slimish.trainer.attention`): SDPA gives what Megatron's local attention gives (logits and
gradients, padded and packed rows, grouped-query, MoE and multi-latent attention), holds no [s, s] tensor, and the
attention asked for is the one built, or a one-line error naming the fix."""

from __future__ import annotations

import pytest
import torch

from slimish.megatron_bridge.bridge import load_hf_weights
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.trainer import attention as attentions

FAMILIES = ["qwen3", "llama", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def model_paths(tiny_models, tiny_moe_models):
    return {**tiny_models, **tiny_moe_models}


def _model(path, attention: str):
    from slimish.trainer.model import build_gpt_model

    arch = architecture_from_hf(read_hf_config(path))
    model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1, attention=attention)
    load_hf_weights(model, path, arch)
    return model


def _packed(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


def _logits_and_grads(model, tokens, positions, packed_seq_params=None):
    """Logits of one forward and the gradient of their (fixed-weighted) sum by parameter name."""
    model.zero_grad()
    logits = model(tokens, positions, None, packed_seq_params=packed_seq_params)
    weights = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_gives_the_local_attentions_logits_and_gradients(family, model_paths, megatron_world):
    """Padded rows of several lengths and one packed row of three samples: the same logits and gradients (fp32,
    reduction-order noise only) from the SDPA and the local (S x S) attention."""
    models = {name: _model(model_paths[family], name) for name in ("sdpa", "local")}
    assert {type(m.decoder.layers[0].self_attention.core_attention).__name__ for m in models.values()} == \
        {"SdpaAttention", "PackedDotProductAttention" if family != "deepseek_v3" else "PackedMLADotProductAttention"}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (3, 29), generator=gen)
    positions = torch.arange(29).expand(3, 29)
    lengths = [7, 19, 12]
    row = torch.randint(0, 300, (1, sum(lengths)), generator=gen)
    row_positions = torch.cat([torch.arange(n) for n in lengths])[None]
    for inputs in ((tokens, positions), (row, row_positions, _packed(lengths))):
        sdpa, local = (_logits_and_grads(models[name], *inputs) for name in ("sdpa", "local"))
        torch.testing.assert_close(sdpa[0], local[0], atol=2e-5, rtol=0)
        assert sdpa[1].keys() == local[1].keys() and sdpa[1]
        for name in sdpa[1]:
            torch.testing.assert_close(sdpa[1][name], local[1][name], atol=2e-5, rtol=1e-4, msg=name)


def test_packed_sdpa_is_each_sample_alone(model_paths, megatron_world):
    model = _model(model_paths["qwen3"], "sdpa").eval()
    lengths = [5, 11, 3]
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 300, (1, n), generator=gen) for n in lengths]
    with torch.no_grad():
        alone = torch.cat([model(t, torch.arange(t.shape[1])[None], None) for t in samples], 1)
        packed = model(torch.cat(samples, 1), torch.cat([torch.arange(n) for n in lengths])[None], None,
                       packed_seq_params=_packed(lengths))
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


@pytest.mark.parametrize("heads, groups, width, v_width", [(4, 4, 32, 32), (4, 2, 32, 32), (4, 4, 48, 32)],
                         ids=["mha", "gqa", "mla-widths"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sdpa_holds_no_s_by_s_tensor(heads, groups, width, v_width, packed, megatron_world):
    """Forward and backward at s = 1024: no op makes a tensor of s x s elements or more (the local attention makes
    heads x s x s scores, and MLA's narrower values would send torch to its S x S math kernel unpadded)."""
    from megatron.core.transformer.enums import AttnMaskType

    seq = 1024
    config = _config(heads, groups, width)
    core = attentions.SdpaAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=width ** -0.5,
                                    k_channels=width, v_channels=v_width)
    shape = (seq, heads, width) if packed else (seq, 1, heads, width)
    query = torch.randn(shape, requires_grad=True)
    key = torch.randn(*shape[:-2], groups, width, requires_grad=True)
    value = torch.randn(*shape[:-2], groups, v_width, requires_grad=True)
    recorder = _LargestTensor()
    with recorder:
        out = core(query, key, value, None, packed_seq_params=_packed([seq // 4, seq // 2, seq // 4]) if packed
                   else None)
        out.sum().backward()
    assert out.shape == (*shape[:-2], heads * v_width)
    assert recorder.largest < seq * seq, f"an op made a tensor of {recorder.largest} elements (s x s = {seq * seq})"


def _config(heads: int, groups: int, width: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * width, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=width, attention_dropout=0.0)


def test_auto_is_sdpa_without_transformer_engine():
    if attentions.transformer_engine_usable():
        pytest.skip("Transformer Engine and a GPU are here: auto is te")
    assert attentions.resolve("auto") == "sdpa"
    assert attentions.resolve("local") == "local"


def test_te_without_transformer_engine_names_the_fix():
    if attentions.transformer_engine_usable():
        pytest.skip("Transformer Engine and a GPU are here")
    with pytest.raises(attentions.AttentionUnavailable, match="trainer.attention=te needs Transformer Engine") as err:
        attentions.resolve("te")
    assert "trainer.attention=sdpa" in str(err.value) and "\n" not in str(err.value)


def test_sdpa_refuses_what_it_cannot_compute(megatron_world):
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(2, 2, 8)
    config.window_size = (16, 0)
    with pytest.raises(attentions.AttentionUnavailable, match="window_size.*use te or local"):
        attentions.SdpaAttention(config, 1, AttnMaskType.causal, "self")


@pytest.mark.parametrize("family, overrides, key, fragment", [
    ("qwen3_moe", ["parallel.tensor_parallel=2"], "parallel.sequence_parallel", "only with sequence parallelism"),
    ("deepseek_v3", ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "trainer.attention=sdpa"],
     "trainer.attention", "only with Transformer Engine's layer spec"),
])
def test_layouts_megatron_cannot_train_are_refused(model_paths, family, overrides, key, fragment):
    """MoE at TP > 1 without sequence parallelism (Megatron refuses it at build time); MLA at TP > 1 on the local
    spec (Megatron-Core 0.16 builds it, and drops part of the rotary key's gradient: at TP2 + SP the kv down
    projection ended a step 0.015 away from the one-rank step's)."""
    from slimish.config import load_config
    from slimish.config.errors import ConfigError

    with pytest.raises(ConfigError, match=fragment) as err:
        load_config(None, [f"model.hf_path={model_paths[family]}", "parallel.num_trainer_ranks=2", *overrides],
                    files=False)
    assert f"'{key}'" in str(err.value)


def test_mla_at_tp2_on_the_local_spec_is_refused_where_the_trainer_starts():
    """`auto` is known only where the trainer runs: its set-up refuses what check-config could not see (forward
    passes, checkpoints and the export at TP2 are right: tests/megatron_bridge run them)."""
    with pytest.raises(attentions.AttentionUnavailable, match="trainer.attention=auto: multi-latent attention"):
        attentions.check_trainable("auto", multi_latent=True, tensor_parallel=2)
    attentions.check_trainable("auto", multi_latent=True, tensor_parallel=1)
    attentions.check_trainable("auto", multi_latent=False, tensor_parallel=8)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_the_te_spec_names_map_to_the_local_names(model_paths, family, megatron_world):
    """trainer.attention=te builds Megatron's Transformer-Engine spec, whose pre-norms are fused into the next linear
    layer. Megatron's own map from the local spec's names to TE's (each layer's `sharded_state_dict_keys_map`, what
    its checkpoints use) gives the names that spec builds; the bridge (`dense.canonical_megatron_name`: loading,
    export, weight sync) maps each back to the local name, and the checkpoint keys are those TE names: one set of
    names for both specs. (TE itself cannot be imported here: the TE build is listed in docs/gpu.md.)"""
    from slimish.megatron_bridge import dense

    model = _model(model_paths[family], "sdpa")
    arch = architecture_from_hf(read_hf_config(model_paths[family]))
    keys_map = model.decoder.layers[0].submodules_config.sharded_state_dict_keys_map
    assert keys_map, "Megatron's local spec names its TE equivalents"
    for name, _ in model.named_parameters():
        te_name = name
        for local, te in keys_map.items():
            te_name = te_name.replace(f".{local}", f".{te}")
        assert dense.canonical_megatron_name(te_name) == name, (name, te_name)
        if te_name != name:  # a fused norm: the checkpoint keys it under TE's name
            stacked = dense.checkpoint_key(name, arch)[0]
            assert stacked.endswith(te_name.split(".", 3)[-1]), (name, stacked)
