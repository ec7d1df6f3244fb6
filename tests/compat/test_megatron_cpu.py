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


LEAN_IMPORT = """
import sys, torch
compile_ = torch.compile
from slimish.compat import megatron_cpu
megatron_cpu.apply()
import megatron.core.jit
from megatron.core.inference.contexts import dynamic_context
print(sorted(name for name in ("flashinfer", "wandb", "torch._dynamo", "torch._inductor") if name in sys.modules))
assert torch.compile is compile_, "torch.compile left replaced"
assert megatron.core.jit.jit_fuser is megatron.core.jit.noop_decorator, "Megatron's jit_fuser still compiles"
assert dynamic_context.HAVE_FLASHINFER is False and dynamic_context.HAVE_WANDB is False
import flashinfer, wandb  # importable again after the window
"""


def test_megatron_is_imported_without_flashinfer_or_torch_compile():
    """`apply()` imports Megatron-Core without imports a CPU trainer never uses, ~6 s of each trainer process's
    start: flashinfer, W&B, and torch._inductor through Megatron's `jit_fuser = torch.compile` (torch's optimizers
    import torch._dynamo later all the same). It leaves `torch.compile` as it was, flashinfer and W&B importable for
    other code, and Megatron's jit_fuser disabled by its own switch. In a fresh interpreter: this one imported them
    long ago."""
    import subprocess
    import sys

    from tests.conftest import REPO

    result = subprocess.run([sys.executable, "-c", LEAN_IMPORT], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]"
