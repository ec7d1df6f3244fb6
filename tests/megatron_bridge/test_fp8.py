"""Block-scaled FP8 checkpoints (DeepSeek-V3's release format) read as bf16, checked bit for bit against SGLang's own
dequantisation (`block_quant_dequant`): the reader (whole tensors and row blocks that start and end inside a scale
block), the bridge's load into Megatron-Core, `convert` to torch_dist and back, `convert dequantize`, and the
one-line refusals (other quantization methods; an FP8 `model.hf_path` for a job)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimish.megatron_bridge.hf_config import UnsupportedConfig, architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import HFCheckpoint
from tests.megatron_bridge.parity import assert_same_checkpoint

# Blocks that leave partial blocks at the bottom and right of most weights (64 / 24, 96 / 40, ...), and the real one
# (every tiny weight is one partial block).
BLOCKS = {"odd": (24, 40), "deepseek": (128, 128)}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3 quantizes every linear layer's weight but the router's; embeddings, norms and lm_head stay bf16."""
    return tensor.dim() == 2 and not any(part in name for part in ("embed_tokens", "lm_head", "mlp.gate.weight"))


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block): each block scaled so its largest entry is FP8's max."""
    (n, k), (bn, bk) = weight.shape, block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * bn, cols * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per block size: an FP8 DeepSeek-V3 (MoE, MLA, one dense layer) and its bf16 reference, dequantized by
    SGLang's `block_quant_dequant`."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("fp8")
    source = build_tiny_model(root / "source", corpus=echo_digit.corpus(), family="deepseek_v3")
    tensors = load_file(source / "model.safetensors")
    out = {}
    for label, block in BLOCKS.items():
        fp8_dir, ref_dir = root / f"fp8_{label}", root / f"ref_{label}"
        stored, reference, quantized = {}, {}, 0
        for name, tensor in tensors.items():
            tensor = tensor.to(torch.bfloat16)
            if _quantized(name, tensor):
                q, scale = quantize(tensor, block)
                stored[name], stored[name + "_scale_inv"] = q, scale
                reference[name] = block_quant_dequant(q, scale, list(block), torch.bfloat16)
                quantized += 1
            else:
                stored[name] = reference[name] = tensor
        assert quantized > 20
        config = json.loads((source / "config.json").read_text())
        for directory, weights, cfg in [
            (fp8_dir, stored, {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                 "activation_scheme": "dynamic",
                                                                 "weight_block_size": list(block)}}),
            (ref_dir, reference, config)]:
            directory.mkdir()
            save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
            for side in source.iterdir():
                if side.suffix in (".json", ".txt", ".jinja") and side.name != "config.json":
                    (directory / side.name).write_bytes(side.read_bytes())
            (directory / "config.json").write_text(json.dumps(cfg, indent=2))
        out[label] = {"fp8": fp8_dir, "ref": ref_dir}
    return out


@pytest.mark.parametrize("label", list(BLOCKS))
def test_reader_matches_sglang_dequantisation(checkpoints, label):
    fp8, ref = HFCheckpoint(checkpoints[label]["fp8"]), HFCheckpoint(checkpoints[label]["ref"])
    assert sorted(fp8.names()) == sorted(ref.names()), "scales are not listed"
    for name in ref.names():
        got = fp8.get(name)
        assert fp8.dtype(name) == got.dtype == ref.dtype(name) and fp8.nbytes(name) == ref.nbytes(name), name
        assert torch.equal(got, ref.get(name)), name
    # Row blocks starting and ending inside a scale block, read into a given buffer too.
    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert fp8.quantized(name)
    whole = ref.get(name)
    for start, stop in [(0, 1), (5, 30), (23, 25), (47, 96), (96, 96)]:
        assert torch.equal(fp8.get(name, rows=(start, stop)), whole[start:stop])
        buffer = torch.empty((stop - start, whole.shape[1]), dtype=torch.bfloat16)
        assert fp8.get(name, rows=(start, stop), out=buffer) is buffer and torch.equal(buffer, whole[start:stop])
    # Column slices (a row-parallel weight's share, as the slice reads take it), with and without rows.
    name = "model.layers.0.self_attn.o_proj.weight"
    assert fp8.quantized(name)
    whole = ref.get(name)
    half = whole.shape[1] // 2
    for rows, cols in [(None, (0, half)), (None, (half, whole.shape[1])), ((3, 29), (7, half + 5))]:
        expected = whole[slice(*rows) if rows else slice(None), cols[0]:cols[1]]
        assert torch.equal(fp8.get(name, rows=rows, cols=cols), expected), (rows, cols)
        buffer = torch.empty(expected.shape, dtype=torch.bfloat16)
        assert fp8.get(name, rows=rows, cols=cols, out=buffer) is buffer and torch.equal(buffer, expected)


def test_bridge_loads_fp8_as_its_dequantisation(checkpoints, megatron_world):
    from slimish.megatron_bridge.bridge import export_hf_tensors
    from tests.megatron_bridge.parity import megatron_from_hf

    model, arch = megatron_from_hf(checkpoints["odd"]["fp8"])
    ref = HFCheckpoint(checkpoints["odd"]["ref"])
    exported = dict(export_hf_tensors(model, arch))
    assert set(exported) == set(ref.names())
    for name, tensor in exported.items():
        assert torch.equal(tensor.to(torch.bfloat16), ref.get(name)), name


def test_convert_dequantizes(checkpoints, tmp_path):
    from slimish.cli import main

    fp8, ref = checkpoints["odd"]["fp8"], checkpoints["odd"]["ref"]
    assert main(["convert", "hf-to-megatron", "--hf", str(fp8), "--out", str(tmp_path / "dist"), "--tp", "2"]) == 0
    assert main(["convert", "megatron-to-hf", "--megatron", str(tmp_path / "dist"), "--hf-config", str(fp8),
                 "--out", str(tmp_path / "back")]) == 0
    assert_same_checkpoint(tmp_path / "back", ref)
    assert main(["convert", "dequantize", "--hf", str(fp8), "--out", str(tmp_path / "bf16")]) == 0
    assert_same_checkpoint(tmp_path / "bf16", ref)
    for out in ("back", "bf16"):
        assert "quantization_config" not in read_hf_config(tmp_path / out)
    assert main(["convert", "dequantize", "--hf", str(ref), "--out", str(tmp_path / "again")]) == 2


@pytest.mark.parametrize("quant", [{"quant_method": "awq", "bits": 4}, {"quant_method": "fp8"},
                                   {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}])
def test_other_quantizations_are_refused_in_one_line(checkpoints, quant):
    cfg = {**read_hf_config(checkpoints["odd"]["ref"]), "quantization_config": quant}
    with pytest.raises(UnsupportedConfig, match="bf16 copy") as err:
        architecture_from_hf(cfg)
    assert err.value.field == "quantization_config" and "\n" not in str(err.value)


def test_job_on_fp8_weights_is_told_to_dequantize(checkpoints):
    from slimish.config.errors import ConfigError
    from slimish.config.validate import _check_model

    _check_model(str(checkpoints["odd"]["ref"]))
    with pytest.raises(ConfigError, match="slimish convert dequantize"):
        _check_model(str(checkpoints["odd"]["fp8"]))
