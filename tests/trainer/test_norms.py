"""With apex importable (NGC PyTorch containers ship NVIDIA apex), Megatron-Core's local spec makes the block's final
norm apex's FusedLayerNorm, which refuses RMSNorm: the model's norms are chosen explicitly, so a stand-in `apex`
package on the path changes nothing. (The `apex` on the package index is an unrelated package: it never enters a
lock.)"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO, free_port

BUILD = """
import sys
from slimish.trainer.parallel import ParallelLayout, init_parallel
init_parallel(ParallelLayout(rank=0, world_size=1), master_addr="127.0.0.1", master_port=int(sys.argv[2]),
              backend="gloo", seed=1)  # also the CPU shim, before Megatron-Core is imported
import apex
assert apex.__file__.startswith(sys.argv[3]), apex.__file__  # the stand-in, not a real apex
from megatron.core.models.gpt import gpt_layer_specs
assert gpt_layer_specs.HAVE_APEX  # what a container with apex gives
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.trainer.model import build_gpt_model
model = build_gpt_model(architecture_from_hf(read_hf_config(sys.argv[1])), tensor_parallel=1, pipeline_parallel=1)
norms = {type(m).__name__ for m in model.modules() if "norm" in type(m).__name__.lower()}
print(sorted(norms))
assert norms == {"RMSNorm"}, norms
"""


def test_an_importable_apex_changes_no_norm(tiny_models, tmp_path):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text('"""A stand-in for NVIDIA apex: importable, nothing in it."""\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", BUILD, str(tiny_models["qwen3"]), str(free_port()), str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "['RMSNorm']" in result.stdout
