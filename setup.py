"""slimish: RL post-training native to Megatron-Core (training) and SGLang (rollout).

CPU development stack: `make test` / `make quickstart` install the pinned requirements/cpu-lock.txt first.
GPU clusters: `pip install -e .` on top of a CUDA torch + sglang + megatron-core install (Transformer Engine is not
used: the model is built from Megatron-Core's local layer spec on every device).
"""

from setuptools import find_packages, setup

setup(
    name="slimish",
    version="0.1.0",
    description="RL post-training framework native to Megatron-Core and SGLang",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["slimish", "slimish.*"]),
    python_requires=">=3.11",
    install_requires=[
        # The stack the suite runs on, exactly the lock's (tests/test_pins.py): sglang pins torch, its CUDA 13 build;
        # megatron-core 0.17+ needs Python >= 3.12 (docs/cpu-notes.md), where an unpinned install would take a
        # release none of slimish's Megatron workarounds were derived from.
        "torch==2.14.1",
        "megatron-core==0.16.1",
        "sglang==0.5.23",
        "sglang-router==0.3.2",
        "ray[default]>=2.59",  # token authentication on by default for a local Ray
        "pyyaml",
        "httpx",
        "nvidia-ml-py",
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "tensorboard",
        "tqdm",
        "psutil",
        "math-verify",  # the math-answer reward hook (slimish.tasks.math_answer)
        "matplotlib",  # slimish report
        "datasets",  # Parquet / saved datasets as prompt data
        "pyarrow",
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "ruff"],
    },
    entry_points={"console_scripts": ["slimish=slimish.cli:main"],
                  # loaded by SGLang early in each of its processes; changes nothing on a GPU engine
                  "sglang.srt.plugins": ["slimish_cpu_engine=slimish.compat.sglang_plugin:register"]},
)
