"""The versions every install path asks for are the lock's: `setup.py` (a GPU install from it, Python 3.12 included,
gets the stack the CPU suite ran on), the GPU lock (the CPU lock's pins plus Transformer Engine, in the range the
pinned megatron-core declares) and the container recipe (the official SGLang image of the locked sglang release,
built for the CUDA of the locked torch); `tools/check_stack.py`, which the container build and `make venv-gpu` run,
passes on this venv and names a mismatch."""

from __future__ import annotations

import importlib.util
import re
from email.parser import Parser
from importlib.metadata import distribution

import torch
from packaging.requirements import Requirement

from tests.conftest import REPO

STACK = ("torch", "megatron-core", "sglang", "sglang-router")


def _check_stack():
    spec = importlib.util.spec_from_file_location("check_stack", REPO / "tools/check_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins(path: str) -> dict[str, str]:
    return _check_stack().pins(REPO / path)


def test_setup_pins_the_stack_to_the_locked_releases():
    setup, lock = (REPO / "setup.py").read_text(), _pins("requirements/cpu-lock.txt")
    for name in STACK:
        assert f'"{name}=={lock[name]}"' in setup, name


def test_the_gpu_lock_is_the_cpu_lock_plus_transformer_engine_in_megatron_cores_range():
    text = (REPO / "requirements/gpu-lock.txt").read_text()
    assert "-r cpu-lock.txt" in text.splitlines()
    gpu = _pins("requirements/gpu-lock.txt")
    assert set(gpu) == {"transformer-engine"}, "the GPU lock re-pins nothing of the CPU lock"
    metadata = Parser().parsestr(distribution("megatron-core").read_text("METADATA"))
    declared = [Requirement(r) for r in metadata.get_all("Requires-Dist") if r.startswith("transformer-engine")]
    assert declared and all(req.specifier.contains(gpu["transformer-engine"], prereleases=True) for req in declared)
    assert distribution("megatron-core").version == _pins("requirements/cpu-lock.txt")["megatron-core"]


def test_the_container_starts_from_the_sglang_image_of_the_locked_release_and_cuda():
    dockerfile = (REPO / "docker/Dockerfile").read_text()
    [image] = re.findall(r"^ARG SGLANG_IMAGE=(\S+)$", dockerfile, flags=re.M)
    release, cuda = re.fullmatch(r"lmsysorg/sglang:v([0-9.]+)-cu(\d+)", image).groups()
    assert release == _pins("requirements/cpu-lock.txt")["sglang"], image
    # The locked torch is the CUDA build this venv holds (sglang pins it with CUDA 13 wheels).
    assert cuda == torch.version.cuda.replace(".", ""), (image, torch.version.cuda)
    assert "FROM ${SGLANG_IMAGE}" in dockerfile
    assert "-r requirements/gpu-lock.txt" in dockerfile and "tools/check_stack.py" in dockerfile
    assert re.search(r"^\.venv/$", (REPO / ".dockerignore").read_text(), flags=re.M), "the host venv stays out"


def test_check_stack_passes_here_and_names_a_mismatch(tmp_path):
    check_stack = _check_stack()
    bad, good = check_stack.mismatches(REPO)
    assert not bad and {phrase.split()[0] for phrase in good} == set(STACK), (bad, good)

    (tmp_path / "requirements").mkdir()
    lock = (REPO / "requirements/cpu-lock.txt").read_text().replace("\nsglang==0.5.23\n", "\nsglang==0.5.22\n")
    (tmp_path / "requirements/cpu-lock.txt").write_text(lock)
    (tmp_path / "requirements/gpu-lock.txt").write_text("-r cpu-lock.txt\n")
    bad, _ = check_stack.mismatches(tmp_path)
    assert bad == ["sglang 0.5.23 is installed, the lock pins 0.5.22"], bad


def test_gpu_installs_fetch_flashinfers_prebuilt_kernels_for_the_locked_release():
    """`make venv-gpu` and the container install FlashInfer's prebuilt kernels (`python -m flashinfer
    download-kernels`: its cubins and JIT cache, from FlashInfer's own wheel index, which this machine may not reach,
    so the command is not run here) so GPU engines do not compile them with nvcc at first use. The command fetches
    the kernels of the installed flashinfer-python, which is the locked one."""
    from importlib.metadata import version

    makefile, dockerfile = (REPO / "Makefile").read_text(), (REPO / "docker/Dockerfile").read_text()
    venv_gpu = makefile.split("\nvenv-gpu:", 1)[1].split("\n\n", 1)[0]
    assert "-m flashinfer download-kernels" in venv_gpu and "-m flashinfer download-kernels" in dockerfile
    assert version("flashinfer-python") == _pins("requirements/cpu-lock.txt")["flashinfer-python"]
