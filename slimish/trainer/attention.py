"""The trainer's core attention: which one runs (`trainer.attention`), and the one that runs without Transformer
Engine, `SdpaAttention`.

Megatron-Core's local `DotProductAttention` materialises every head's [s, s] scores (and an fp32 softmax of them),
so a rank's attention memory grows with the square of the sequence: a GPU ran out of memory at ~7k tokens per
sample. The attentions chosen here grow with s:
  te     Transformer Engine's fused attention through Megatron's TE layer spec (flash / cuDNN kernels, THD-packed
         rows natively), as the field runs Megatron on GPUs;
  sdpa   `SdpaAttention`: torch's `scaled_dot_product_attention` (flash / memory-efficient kernels on a GPU, the
         fused flash kernel on the CPU), the same module on the CPU, the emulated GPU and a GPU;
  local  Megatron's `DotProductAttention` (S x S), kept as the reference the other two are checked against and for
         the benchmark that measures the difference (`bench/attention.py`).
`auto` is `te` where Transformer Engine imports and CUDA is up, `sdpa` otherwise.

Every attention here is causal, which is all a decoder-only GPT trains with: a right-padded row's real tokens never
see its padding, and a packed row's samples (THD, `PackedSeqParams`) each attend to themselves only. The micro-batch's
`attention_mask` is therefore not read by `te` or `sdpa` (collation builds none; `local` builds its causal mask).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from slimish.errors import UserError

ATTENTIONS = ("auto", "te", "sdpa", "local")


class AttentionUnavailable(UserError):
    """The configured trainer.attention cannot run on this install."""


def transformer_engine_usable() -> bool:
    """Transformer Engine imports here and CUDA is up (TE's attention runs on NVIDIA GPUs only)."""
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def resolve(attention: str) -> str:
    """The attention that runs for trainer.attention `attention`: `te`, `sdpa` or `local`. Raises
    `AttentionUnavailable` naming the fix when `te` is asked for where it cannot run."""
    if attention not in ATTENTIONS:
        raise AttentionUnavailable(f"trainer.attention={attention!r}: choose one of {', '.join(ATTENTIONS)}")
    if attention == "auto":
        return "te" if transformer_engine_usable() else "sdpa"
    if attention == "te" and not transformer_engine_usable():
        raise AttentionUnavailable("trainer.attention=te needs Transformer Engine and a CUDA GPU (import "
                                   "transformer_engine failed or no GPU is visible): install it, or set "
                                   "trainer.attention=sdpa")
    return attention


def check_trainable(attention: str, *, multi_latent: bool, tensor_parallel: int) -> None:
    """Raise `AttentionUnavailable` where trainer.attention `attention` builds a model that trains wrongly:
    Megatron-Core 0.16's local multi-latent-attention spec at tensor_parallel > 1
    (`slimish.config.validate.MLA_LOCAL_SPEC_AT_TP`).
    Forward passes, checkpoints and the weight export are right there: only training is refused."""
    if multi_latent and tensor_parallel > 1 and resolve(attention) != "te":
        from slimish.config.validate import MLA_LOCAL_SPEC_AT_TP

        raise AttentionUnavailable(f"trainer.attention={attention}: {MLA_LOCAL_SPEC_AT_TP}")


@functools.cache
def _module_base() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SdpaAttention(_module_base()):
    """Megatron's core-attention interface (a layer spec's `core_attention`) on torch's
    `scaled_dot_product_attention`: causal, no [s, s] tensor held, grouped-query heads shared without copies.

    Takes what `DotProductAttention` takes, plus MLA's `k_channels` / `v_channels` (TEDotProductAttention's keywords:
    the query / key head width differs from the value's). Input [s, b, heads, dim] (padded rows) or [t, heads, dim]
    (a THD-packed row, with `packed_seq_params`); output [s, b, heads * v dim] or [t, heads * v dim]. A packed row's
    sample bounds are read from `packed_seq_params.cu_seqlens_q`: a host tensor costs no device sync (the trainer
    gives one to this attention; `slimish.trainer.batch.MicroBatch.packed_seq_params`), a device tensor one per
    layer. No parameters: checkpoints and the weight export see the same names as with the local attention."""

    takes_context_parallel = False  # `slimish.trainer.context_parallel_attention` does

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        from megatron.core import parallel_state

        refused = {"context_parallel_size": config.context_parallel_size != 1 and not self.takes_context_parallel,
                   "window_size": config.window_size is not None,
                   "softmax_type": config.softmax_type != "vanilla",
                   "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling}
        if any(refused.values()):
            raise AttentionUnavailable(f"trainer.attention=sdpa cannot run this model's attention "
                                       f"({', '.join(k for k, v in refused.items() if v)}): use te or local")
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise AttentionUnavailable("trainer.attention=sdpa takes no attention bias: use te")
        if packed_seq_params is None:  # [s, b, h, d] -> [b, h, s, d] and back
            out = self._attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
        # One call per sample on its own slice of the row: no [t, t] block-diagonal mask, and each sample's
        # numbers are those it gets alone. Bounds on the host: no device sync (see the class docstring).
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        outputs = [self._attend(query[a:b].transpose(0, 1)[None], key[a:b].transpose(0, 1)[None],
                                value[a:b].transpose(0, 1)[None])[0].transpose(0, 1)
                   for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outputs, dim=0).reshape(query.shape[0], -1)

    def _attend(self, query, key, value):
        """[b, heads, sq, dv] causal attention of [b, heads, sq, d] queries over [b, groups, sk, d] keys and
        [b, groups, sk, dv] values; with sk > sq the queries are the last sq of the keys' positions (each attends to
        the keys up to its own: the causal mask aligned to the lower right)."""
        width, v_width = query.shape[-1], value.shape[-1]
        # The fused kernels (flash on the CPU and GPU) take one head width; MLA's values are narrower than its
        # queries (128 vs 192), which would send the call to the S x S math kernel. Zero columns change nothing:
        # values padded to the query width give the same output plus zero columns, cut off after.
        if v_width < width:
            value = F.pad(value, (0, width - v_width))
        elif v_width > width:
            query, key = F.pad(query, (0, v_width - width)), F.pad(key, (0, v_width - width))
        # Queries that are the last of the keys' positions: torch's causal mask is aligned to the upper left, so the
        # missing earlier queries are put in as zeros and their rows dropped after (no mask tensor, the same fused
        # kernel; the zero rows' outputs are discarded, so they add nothing to the keys' and values' gradients).
        missing = key.shape[-2] - query.shape[-2]
        if missing:
            query = F.pad(query, (0, 0, missing, 0))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.softmax_scale,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             enable_gqa=self.groups != self.heads)
        out = out[..., missing:, :]
        return out[..., :v_width] if v_width < width else out


def packed_bounds_device(model) -> torch.device:
    """Where a packed row's sample bounds go for `model`: its device when Transformer Engine's attention runs (its
    kernels read them there), the host otherwise (read there by each layer without a device sync)."""
    from slimish.trainer.batch import HOST
    from slimish.trainer.device import module_device

    if any(type(module).__name__ == "TEDotProductAttention" for module in model.modules()):
        return module_device(model)
    return HOST


def block_spec(spec, attention: str, *, context_parallel: int = 1):
    """A copy of a local-spec decoder block spec whose layers run `attention` (`sdpa` or `local`); `local` also takes
    packed rows and a None mask (`slimish.compat.packed_attention`). With context parallelism `sdpa` all-gathers
    the keys and values over the group (`slimish.trainer.context_parallel_attention`); `local` cannot run it."""
    import copy

    from slimish.compat.packed_attention import local_packed_block_spec

    if attention == "local":
        if context_parallel > 1:
            raise AttentionUnavailable("trainer.attention=local cannot run context parallelism (Megatron's "
                                       "DotProductAttention refuses it): use sdpa or te")
        return local_packed_block_spec(spec)
    core = SdpaAttention
    if context_parallel > 1:
        from slimish.trainer.context_parallel_attention import ContextParallelSdpaAttention as core
    spec = copy.deepcopy(spec)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core
    return spec
