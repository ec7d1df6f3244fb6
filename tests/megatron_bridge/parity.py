"""In-process (one rank, TP1) Megatron model from an HF checkpoint, its logits difference to HF, and the bit-exact
checks shared by the bridge tests."""

from __future__ import annotations

import json
import os

import torch

from slimish.megatron_bridge import dense
from slimish.megatron_bridge.bridge import export_hf_tensors, load_hf_weights
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import HFCheckpoint


def megatron_from_hf(path, attention: str = "auto"):
    """(GPTModel in eval mode filled from `path`, its Architecture), with trainer.attention `attention`; needs the
    `megatron_world` fixture."""
    from slimish.trainer.model import build_gpt_model

    arch = architecture_from_hf(read_hf_config(path))
    model = build_gpt_model(arch, tensor_parallel=1, pipeline_parallel=1, attention=attention)
    load_hf_weights(model, path, arch)
    return model.eval(), arch


def max_logits_diff_vs_hf(path, *, batch: int = 3, seq: int = 40) -> float:
    """max |Megatron logits - HF logits| in fp32 on fixed random tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, _ = megatron_from_hf(path)
    tokens = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(tokens, torch.arange(seq).expand(batch, seq), None)
    assert got.shape == expected.shape
    return record((got - expected).abs().max().item())


def max_packed_vs_alone_diff(path, lengths=(7, 19, 12)) -> float:
    """max |logits of samples packed in one row (THD: `PackedSeqParams`) - logits of each sample alone|, fp32."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model, _ = megatron_from_hf(path)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 300, (1, n), generator=gen) for n in lengths]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = torch.cat([model(t, torch.arange(t.shape[1])[None], None) for t in samples], 1)
        packed = model(torch.cat(samples, dim=1), positions, None, packed_seq_params=params)
    assert packed.shape == alone.shape
    return record((packed - alone).abs().max().item())


def record(diff: float) -> float:
    """Append {test, max_abs_diff} to $SLIMISH_PARITY_LOG (a jsonl file) when set: the figures for a report."""
    if os.environ.get("SLIMISH_PARITY_LOG"):
        with open(os.environ["SLIMISH_PARITY_LOG"], "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "max_abs_diff": diff}) + "\n")
    return diff


def assert_export_round_trip(path) -> None:
    """Every Megatron weight (parameters and weight buffers) has exactly one rule, and the TP1 model filled from
    `path` exports every HF tensor of it exactly once, bit-exact."""
    model, arch = megatron_from_hf(path)
    weights = {dense.canonical_megatron_name(n) for n, _ in model.named_parameters()}
    weights |= {n for n, _ in model.named_buffers() if n.endswith("router.expert_bias")}
    assert weights == {r.megatron for r in dense.model_rules(arch)}
    ckpt = HFCheckpoint(path)
    exported = dict(export_hf_tensors(model, arch))
    assert set(exported) == set(ckpt.names()), "every HF tensor is exported exactly once"
    for name, tensor in exported.items():
        assert torch.equal(tensor, ckpt.get(name)), name


def assert_same_checkpoint(got, expected) -> None:
    """Two HF checkpoint directories hold the same tensor names, dtypes and bits."""
    a, b = HFCheckpoint(got), HFCheckpoint(expected)
    assert sorted(a.names()) == sorted(b.names())
    for name in b.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
