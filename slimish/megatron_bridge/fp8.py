"""Block-scaled FP8 checkpoints (DeepSeek-V3's official release, GLM-4.5-FP8): read as bf16.

The format: config.json's `quantization_config` is {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [bn, bk]}; each quantized weight `X.weight` (float8_e4m3fn, shape [n, k]) has a
float32 `X.weight_scale_inv` of shape [ceil(n / bn), ceil(k / bk)], one factor per block (the last row and column of
blocks may be partial). The stored value times its block's factor is the weight:

    w = (w_fp8.float() * scale_inv expanded over bn x bk blocks, cropped to [n, k]).to(bfloat16)

which is what SGLang's `block_quant_dequant` computes (tests/megatron_bridge/test_fp8.py checks it bit for bit).
Weights not quantized (norms, embeddings, the router, the output layer) are stored in bf16 and read as they are.
"""

from __future__ import annotations

import math

import torch

from slimish.megatron_bridge.errors import UnsupportedConfig

SCALE_SUFFIX = "_scale_inv"
DTYPE = torch.bfloat16  # what a dequantized weight is read as (the dtype the checkpoint was trained in)


def block_size(cfg: dict) -> tuple[int, int] | None:
    """The (rows, columns) of a scale block of config.json `cfg`, or None for an unquantized model. Any other
    quantization is an `UnsupportedConfig` saying what to do."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?")
    block = quant.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        what = f"{method} without weight_block_size" if method == "fp8" else method
        raise UnsupportedConfig("quantization_config", what, "only block-scaled FP8 (weight_block_size, as DeepSeek-V3 "
                                "ships) is dequantized on load; write a bf16 copy of the checkpoint first (e.g. "
                                "with transformers' dequantize) and point at it")
    if quant.get("fmt", "e4m3") != "e4m3" or quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedConfig("quantization_config", quant, "only e4m3 FP8 with dynamic activation scales is read; "
                                "write a bf16 copy of the checkpoint first and point at it")
    return int(block[0]), int(block[1])


def scale_rows(rows: tuple[int, int], block_rows: int) -> tuple[int, int]:
    """The rows of the scale tensor that cover weight rows [start, stop)."""
    start, stop = rows
    return start // block_rows, math.ceil(stop / block_rows)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, first_row: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 of the FP8 `weight` (rows first_row.. of the full tensor) given the scale rows that cover it (from
    `scale_rows`); written into `out` if given. Works block row by block row so the float32 temporaries stay one
    block row tall (a 7168 x 18432 expert-stacked weight is not expanded in float32 whole)."""
    bn, bk = block
    n, k = weight.shape
    out = torch.empty((n, k), dtype=DTYPE, device=weight.device) if out is None else out
    offset = first_row % bn  # the rows of the first scale row that lie before `weight`
    row, scale_row = 0, 0
    while row < n:
        take = min(bn - offset if row == 0 else bn, n - row)
        factors = scale_inv[scale_row].repeat_interleave(bk)[:k]
        out[row:row + take] = (weight[row:row + take].float() * factors).to(DTYPE)
        row, scale_row = row + take, scale_row + 1
    return out
