"""The static guards of `tools/check_devices.py` (also run by `make lint`): the tree passes them, and each rule
catches what it is about."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _checker():
    spec = importlib.util.spec_from_file_location("check_devices", REPO / "tools/check_devices.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_passes():
    assert _checker().violations(REPO) == []


def test_a_factory_without_a_device_and_a_collective_outside_the_helper_are_caught(tmp_path):
    (tmp_path / "slimish/trainer").mkdir(parents=True)
    (tmp_path / "slimish/megatron_bridge").mkdir(parents=True)
    (tmp_path / "slimish/trainer/step.py").write_text(
        "import torch\nimport torch.distributed as dist\n"
        "a = torch.zeros(3)\n"                       # caught: no device
        "b = torch.zeros(3, device=a.device)\n"      # fine
        "c = torch.zeros_like(a)\n"                  # fine: *_like
        "d = a.new_zeros(3)\n"                       # fine: new_*
        "dist.all_reduce(a)\n"                       # caught
        "dist.broadcast_object_list([1])\n")         # fine: no tensor of ours
    (tmp_path / "slimish/megatron_bridge/export.py").write_text(
        "import torch\ntorch.distributed.send(torch.ones(1), dst=1)\n")  # caught (a factory there is not checked)
    assert _checker().violations(tmp_path) == [
        "slimish/trainer/step.py:3: torch.zeros(...) names no device",
        "slimish/trainer/step.py:7: dist.all_reduce outside slimish/collectives.py",
        "slimish/megatron_bridge/export.py:2: torch.distributed.send outside slimish/collectives.py",
    ]
