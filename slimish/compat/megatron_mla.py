"""What makes Megatron-Core 0.16's local (non-Transformer-Engine) multi-latent-attention layer spec buildable.

Two defects, neither about the maths and neither CPU-specific (the trainer always uses the local spec):
- `MLASelfAttention` builds its core attention with `k_channels` / `v_channels` keywords, which only
  TEDotProductAttention accepts; the local `DotProductAttention` raises TypeError. `MLADotProductAttention` takes
  them: the scores are scaled by the `softmax_scale` MLA passes, and the output width per head is
  config.kv_channels, which must be `v_channels` (the bridge sets kv_channels = v_head_dim).
- Without Transformer Engine, megatron.core.extensions.transformer_engine still defines `TELinear` as a MagicMock
  subclass and multi_latent_attention imports it with HAVE_TE=True, so its `isinstance(linear_proj, TELinear)`
  raises. Its HAVE_TE is set to the extension module's real value.
"""

from __future__ import annotations

import copy
import functools


@functools.cache
def _mla_dot_product_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"MLA v_head_dim={v_channels} must equal kv_channels={config.kv_channels}")
            if kwargs.get("softmax_scale") is None and k_channels is not None:
                raise ValueError("MLA core attention needs an explicit softmax_scale")
            super().__init__(config, *args, **kwargs)

    return MLADotProductAttention


def _fix_te_flag() -> None:
    import megatron.core.extensions.transformer_engine as te_extension
    import megatron.core.transformer.multi_latent_attention as mla

    if not te_extension.HAVE_TE:
        mla.HAVE_TE = False


def local_mla_block_spec(block_spec):
    """A copy of a local-spec decoder block spec whose MLA layers use `MLADotProductAttention`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    _fix_te_flag()
    block_spec = copy.deepcopy(block_spec)
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = _mla_dot_product_attention()
    return block_spec
