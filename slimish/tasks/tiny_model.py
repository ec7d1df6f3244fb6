"""Build a tiny random Hugging Face causal LM (Qwen2/Qwen3/Llama, Qwen3-MoE, GLM-4.5, DeepSeek-V3 family) and its
locally trained tokenizer.

Nothing is downloaded. The tokenizer is trained with `tokenizers` using exactly the pre-tokenizer, normaliser and
decoder that transformers' Qwen2Tokenizer applies on load (transformers 5 ignores those stored in tokenizer.json
for qwen model types), then saved through Qwen2Tokenizer itself and checked to round-trip text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS = "<|endoftext|>"

TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# Larger dense shapes (`slimish make-tiny --size`): "100m" is a Qwen3 of 105M parameters, the smallest model a
# one-GPU acceptance job should move (its weight sync and offload are then real traffic, not noise).
SIZES = {"tiny": {}, "100m": dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=14,
                                  num_attention_heads=12, num_key_value_heads=4, head_dim=64)}
# Extra fields per family: a few small experts, one dense layer before the sparse ones where the family has that.
FAMILY_SHAPES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                     first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True,
                     routed_scaling_factor=2.5),
    # Multi-latent attention (every head its own key/value; head_dim is the rotary width, as transformers sets it).
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, routed_scaling_factor=2.5),
}


def train_tokenizer(corpus: list[str], out_dir: Path, vocab_size: int = 300):
    """Train a byte-level BPE with Qwen2's pre-tokenisation and save it as a Qwen2Tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    state = json.loads(tok.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    hf_tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=EOS, pad_token=EOS, unk_token=EOS)
    hf_tok.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    for text in corpus[:20]:
        ids = reloaded(text)["input_ids"]
        if reloaded.decode(ids) != text:
            raise RuntimeError(f"tokenizer does not round-trip {text!r}: got {reloaded.decode(ids)!r}")
    return reloaded


def tiny_config(family: str = "qwen3", *, vocab_size: int, eos_id: int = 0, init_std: float = 0.02,
                **shape_overrides):
    """The transformers config `build_tiny_model` writes: `TINY_SHAPES`, then the family's `FAMILY_SHAPES`, then
    `shape_overrides` (any config field, e.g. tie_word_embeddings)."""
    from transformers import AutoConfig

    fields = dict(vocab_size=vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, initializer_range=init_std,
                  torch_dtype="float32", **TINY_SHAPES)
    config = AutoConfig.for_model(family, **{**fields, **FAMILY_SHAPES.get(family, {}), **shape_overrides})
    if family == "qwen2":
        config.use_sliding_window = False
    return config


def build_tiny_model(out_dir: str | Path, *, corpus: list[str], family: str = "qwen3", seed: int = 0,
                     init_std: float = 0.02, **shape_overrides) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files to `out_dir`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    vocab_size = -(-len(tokenizer) // 64) * 64  # a multiple of 64 so it splits evenly over TP ranks
    config = tiny_config(family, vocab_size=vocab_size, eos_id=eos_id, init_std=init_std, **shape_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init; make the routing test see it
                buffer.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id).save_pretrained(out_dir)
    return out_dir
