"""What a CPU engine process finds when it imports `flashinfer` (`sglang_cpu.server_env` puts this folder on the
PYTHONPATH of SGLang processes where CUDA is absent): nothing. FlashInfer's kernels are CUDA's; SGLang's CPU paths
never call them, and SGLang imports it only where it may be missing (sgl_kernel's `try: import flashinfer.norm`,
SGLang's own `is_flashinfer_available()`, false without CUDA anyway). Its import, with CUTLASS's Python DSL behind
it, is among the slowest of a CPU engine's start. A GPU engine imports FlashInfer as before.
The trainer's processes hide it likewise during Megatron-Core's import (slimish.compat.megatron_cpu)."""

raise ImportError("FlashInfer is hidden from CPU engine processes (slimish.compat.sglang_cpu.server_env)")
