"""tools/gpu_battery.sh, the script a lent GPU machine runs: its dry run on the CPU (DRY=1) starts every part and each
reaches its last line, its logs fit what a device call sends back (8 files), ONLY= selects parts, and the size check
refuses a tree over the 64 MiB a call carries. The battery itself runs only on a GPU (docs/gpu.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tools/gpu_battery.sh"
LAST_LINES = {"env.txt": "transformer_engine: ", "attention.log": "sdpa_vs_local_peak_8k=",
              "long.log": "long_packed_step tokens=",
              "nccl.log": "nccl_weight_group=ok", "copies.log": "fresh_vs_reused=",
              "moe.log": "test_a_moe_step_on_the_gpu_is_the_cpu_step[deepseek_v3]", "tests_gpu.log": "collected"}


def battery(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OUT": str(tmp_path), **env})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("battery")
    return out, battery(out, "run", DRY="1")


def test_the_dry_run_starts_every_part(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (out / "summary.txt").read_text().split("\n")
    assert [line.split()[0] for line in summary if line] == ["env", "moe", "attention", "long", "nccl", "copies",
                                                                 "tests_gpu"]
    assert all("rc=0" in line for line in summary if line)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir()), files  # what a device call sends back
    for name, text in LAST_LINES.items():
        assert text in (out / name).read_text(), name
    assert "pinned_vs_pageable_h2d=" in (out / "copies.log").read_text()
    assert "max |local - sdpa|" in (out / "attention.log").read_text()


def test_the_attention_candidate_computes_what_the_trainer_does(dry_run):
    """The dry run compares the trainer's local attention with SDPA at its smallest size, padded and packed: the
    same numbers (fp32 on the CPU), so what the GPU measures is the same computation."""
    out, _ = dry_run
    diffs = [float(line.rsplit("=", 1)[1]) for line in (out / "attention.log").read_text().splitlines()
             if "max |local - sdpa|" in line]
    assert len(diffs) == 2 and max(diffs) < 1e-5, diffs


def test_only_runs_the_parts_named(tmp_path):
    result = battery(tmp_path, "run", DRY="1", ONLY="nccl")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["summary.txt", "nccl.log"] or \
        sorted(p.name for p in tmp_path.iterdir()) == ["nccl.log", "summary.txt"]


def test_the_size_check_refuses_more_than_a_call_carries(tmp_path):
    """`size` (and so `prepare`) counts what a device call carries and fails past the limit with one line: here the
    limit lowered to 1 MiB, which the repository alone passes; at 64 MiB the same tree passes."""
    refused = battery(tmp_path, "size", LIMIT_MIB="1")
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith("over the 1 MiB a device call carries: remove what is not needed")
    assert len(refused.stderr.strip().splitlines()) == 1
    accepted = battery(tmp_path, "size")
    assert accepted.returncode == 0 and "of the 64 MiB limit" in accepted.stdout
