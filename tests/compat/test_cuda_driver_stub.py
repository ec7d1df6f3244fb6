"""The libcuda stand-in is used only where no NVIDIA driver exists, and is not mistaken for one once loaded."""

from __future__ import annotations

import pytest

from slimish.compat import cuda_driver_stub, sglang_cpu


@pytest.mark.skipif(cuda_driver_stub.real_driver_present(), reason="a real NVIDIA driver is installed")
def test_a_loaded_stub_is_not_taken_for_a_driver():
    cuda_driver_stub.preload_if_needed()  # as importing Megatron-Core does in this process
    assert not cuda_driver_stub.real_driver_present()
    assert str(cuda_driver_stub.stub_path()) in sglang_cpu.server_env({}).get("LD_PRELOAD", ""), \
        "SGLang servers started from this process still get the stub"
