"""The Megatron-Core CPU shim: Megatron's own grad clipping runs on CPU tensors, and only Megatron sees CUDA type
names (every other caller of `Tensor.type()` gets torch's answer)."""

from __future__ import annotations

import pytest
import torch

from slimish.compat import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim applies only without CUDA")


def test_megatron_clips_cpu_grads_and_others_see_true_type_names():
    megatron_cpu.apply()
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for param in params:
        param.grad = torch.full((3,), 2.0)
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    for param in params:
        assert torch.allclose(param.grad, torch.full((3,), 0.5), atol=1e-6)

    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64
