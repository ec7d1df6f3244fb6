"""A process given GPUs it cannot use is told why in one line (slimish.cuda_facts). Each cause is given as the facts a
node would report (a stand-in only for the node: a driver, its version, the environment); the collection itself runs
on this machine as it is: a CUDA build of torch and no NVIDIA driver."""

from __future__ import annotations

import dataclasses

import pytest

from slimish import cuda_facts
from slimish.errors import UserError

WORKING = cuda_facts.CudaFacts(node="gpu-7", cuda_visible_devices="0", torch_version="2.14.1+cu130",
                               torch_cuda="13.0", driver_loaded=True, driver_version="580.65.06",
                               driver_cuda="13.0", device_count=1, torch_warning=None)


def problem(**changes) -> str | None:
    return cuda_facts.problem(dataclasses.replace(WORKING, **changes), gpus=1, holder="trainer rank 3", node="n2")


def test_a_usable_gpu_is_no_problem():
    assert problem() is None
    assert cuda_facts.problem(WORKING, gpus=2, holder="engine 0") is not None  # an engine of TP2 needs both


@pytest.mark.parametrize("changes, says", [
    ({"torch_cuda": None, "torch_version": "2.14.1+cpu", "device_count": 0},
     "torch 2.14.1+cpu is a CPU-only build: install the GPU stack (make venv-gpu"),
    ({"cuda_visible_devices": "", "device_count": 0}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ({"cuda_visible_devices": "-1", "device_count": 0}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
    ({"driver_loaded": False, "driver_version": None, "driver_cuda": None, "device_count": 0},
     "no NVIDIA driver is installed (libcuda.so.1 does not load)"),
    ({"driver_version": "535.104.05", "driver_cuda": "12.2", "device_count": 0,
      "torch_warning": "CUDA initialization: The NVIDIA driver on your system is too old (found version 12020)."},
     "NVIDIA driver 535.104.05 supports CUDA up to 12.2 and torch 2.14.1+cu130 needs CUDA 13.0: install driver R580 "
     "or newer, or cuda-compat-13-0 on LD_LIBRARY_PATH"),
    ({"cuda_visible_devices": "5", "device_count": 0,
      "torch_warning": "CUDA initialization: CUDA driver initialization failed, you might not have a CUDA gpu."},
     "torch sees 0 usable GPU(s) with CUDA_VISIBLE_DEVICES='5' (torch: CUDA initialization: CUDA driver "
     "initialization failed, you might not have a CUDA gpu.): check nvidia-smi on that node"),
])
def test_each_cause_is_one_line_naming_it(changes, says):
    line = problem(**changes)
    assert line.startswith("trainer rank 3 holds 1 GPU from Ray on n2, but "), line
    assert says in line and "\n" not in line, line


def test_the_facts_of_this_machine_name_the_missing_driver():
    facts = cuda_facts.collect()
    assert facts.torch_cuda and not facts.driver_loaded and facts.device_count == 0, facts
    assert "no NVIDIA driver is installed" in cuda_facts.problem(facts, gpus=1, holder="engine 0")


def test_nccl_without_cuda_is_a_user_error():
    from slimish.collectives import resolve_backend

    assert resolve_backend("auto") == "gloo"
    with pytest.raises(UserError, match=r"^parallel.backend is nccl, but on .* no NVIDIA driver is installed .*; "
                                        r"or set parallel.backend=gloo$"):
        resolve_backend("nccl")


def test_the_node_check_says_why_in_one_line(capsys):
    from slimish.cli import main

    assert main(["check-gpu"]) == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("cuda unusable on ") and "no NVIDIA driver is installed" in line, line


@pytest.mark.parametrize("text", [
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version: 12.2\n",
    # the open kernel module, as an H200 node printed it (the first reading here took "for" for the version)
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
    "GCC version:  gcc version 15.3.0 (GCC) \n"])
def test_the_driver_version_is_read_from_either_kernel_module(text):
    assert cuda_facts.kernel_module_version(text) == text.split("  ")[1].strip()
