"""Where the trainer's models start (`slimish.megatron_bridge.initial_weights`), on two gloo ranks at TP2, PP2, EP2:
each rank reads about its share of the HF checkpoint (bytes the reader requested, and the process's rchar), the
reference model copies the policy's weights instead of reading them again, and the first step's logprobs are those
of whole reads; a job started from a torch_dist checkpoint converted at TP1 (model.megatron_path) computes the
same logprobs as one started from HF. A wrong model.megatron_path is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimish.config import ConfigError, load_config
from slimish.megatron_bridge.convert import hf_to_megatron
from slimish.megatron_bridge.hf_io import HFCheckpoint
from tests.trainer.test_worker_layouts import _run

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


@pytest.fixture(scope="module")
def converted(task_assets, tmp_path_factory) -> Path:
    """The task's model as `slimish convert hf-to-megatron` writes it (at TP1: full tensors)."""
    return hf_to_megatron(hf_dir=task_assets["model"], out_dir=tmp_path_factory.mktemp("megatron") / "ckpt",
                          progress=False)


@pytest.fixture(scope="module")
def converted_tp2(task_assets, tmp_path_factory) -> Path:
    """The same, converted with `--tp 2`: its chunks cut at the TP2 slices."""
    return hf_to_megatron(hf_dir=task_assets["model"], out_dir=tmp_path_factory.mktemp("megatron") / "ckpt",
                          tensor_parallel=2, progress=False)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def starts(request, task_assets, converted, converted_tp2, tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """(layout, {"slices" | "whole" | "megatron" [| "megatron_tp2"]: every rank's results}) of the same step at TP2
    or PP2, the models started from HF slice reads, from whole HF reads, from the checkpoint converted at TP1, and
    at TP2 from the one converted with --tp 2."""
    tp, pp = LAYOUTS[request.param]
    runs = {"slices": ((), ()), "whole": ((), ("--whole-reads",)),
            "megatron": ((f"model.megatron_path={converted}",), ())}
    if request.param == "tp2":
        runs["megatron_tp2"] = ((f"model.megatron_path={converted_tp2}",), ())
    return request.param, {name: _run(task_assets, tmp_path_factory.mktemp(f"{request.param}-{name}"), world_size=2,
                                      tp=tp, pp=pp, overrides=overrides, extra=extra)
                           for name, (overrides, extra) in runs.items()}


def _total_bytes(model: str) -> int:
    ckpt = HFCheckpoint(model)
    return sum(ckpt.nbytes(name) for name in ckpt.names())


def test_each_rank_reads_about_its_share(starts, task_assets):
    """TP2: each rank reads half of every split tensor (and all of the small norms): just over half the checkpoint,
    where a whole read took all of it. PP2: each stage reads its own layers (the last also the tied embedding, for
    its output layer). The reference model (KL penalty) reads nothing: it copies the policy's weights. The process's
    rchar counts at least the requested bytes (it counts every read), less than the whole reads' rchar."""
    layout, runs = starts
    total = _total_bytes(task_assets["model"])
    for slices, whole in zip(runs["slices"], runs["whole"]):
        policy, reference = slices["weights_read"]["roles"]
        assert reference["source"] == "shared" and reference["requested"] is None
        assert policy["source"] == "hf" and policy["fallbacks"] == 0
        assert whole["weights_read"]["roles"][0]["requested"] == (total if layout == "tp2" else
                                                                  policy["requested"])
        assert policy["rchar"] >= policy["requested"]
        if layout == "tp2":
            assert total / 2 <= policy["requested"] <= 0.55 * total, (policy["requested"], total)
            assert policy["rchar"] < whole["weights_read"]["roles"][0]["rchar"]
        else:
            assert policy["requested"] < 0.8 * total, (policy["requested"], total)
    if layout == "pp2":
        shares = [rank["weights_read"]["requested"] for rank in runs["slices"]]
        assert total <= sum(shares) < 1.3 * total, (shares, total)  # the tied embedding read by both stages


@pytest.mark.parametrize("starts", ["tp2"], indirect=True)
def test_a_checkpoint_converted_at_the_jobs_tp_is_read_a_slice_per_rank(starts, task_assets):
    """torch's DCP reads every stored chunk a rank's slice overlaps whole: from chunks cut at TP1 each TP2 rank reads
    whole row-parallel tensors (and gate/up twice): 1.3x the model here; from `convert --tp 2`'s, about its half.
    rchar (the process's reads over the load) also counts the checkpoint's metadata and Megatron's own reads, the
    same in both starts and larger than this tiny model: the difference is what the cut saves."""
    _, runs = starts
    total = _total_bytes(task_assets["model"])
    for at_tp1, at_tp2 in zip(runs["megatron"], runs["megatron_tp2"]):
        tp1_rchar, tp2_rchar = (run["weights_read"]["roles"][0]["rchar"] for run in (at_tp1, at_tp2))
        assert tp1_rchar - tp2_rchar >= 0.7 * total, (tp1_rchar, tp2_rchar, total)


def test_slice_reads_and_a_converted_checkpoint_give_the_whole_reads_logprobs(starts):
    """The first step's logprobs (before and after it) and the exported weights are those of whole reads, bit for
    bit: from slices, and from the torch_dist checkpoint converted at TP1 and resharded by Megatron's loader."""
    _, runs = starts
    for name in ("slices", "megatron", "megatron_tp2")[:len(runs) - 1]:
        for got, expected in zip(runs[name], runs["whole"]):
            for key in ("before", "after"):
                if expected[key] is None:  # a pipeline stage before the last
                    assert got[key] is None
                    continue
                assert torch.equal(got[key], expected[key]), (name, key)
            assert got["state"].keys() == expected["state"].keys()
            assert all(torch.equal(got["state"][n], expected["state"][n]) for n in expected["state"]), name
    for rank in runs["megatron"] + runs.get("megatron_tp2", []):
        roles = rank["weights_read"]["roles"]
        assert [role["source"] for role in roles] == ["megatron", "shared"]
        assert rank["weights_read"]["source"].endswith("ckpt")


def test_a_wrong_megatron_path_is_one_line(task_assets, tiny_models, tmp_path):
    """A missing directory, and a checkpoint of another model (llama's, for the qwen3 model), each in one line naming
    the key and what to do."""
    base = ["eval.every=0", f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}",
            f"sft.data_path={task_assets['sft']}"]
    with pytest.raises(ConfigError, match="model.megatron_path.*does not exist") as missing:
        load_config(REPO / "configs/quickstart_cpu.yaml", [*base, f"model.megatron_path={tmp_path / 'none'}"])
    other = hf_to_megatron(hf_dir=tiny_models["llama"], out_dir=tmp_path / "llama", progress=False)
    with pytest.raises(ConfigError, match="holds another model than") as wrong:
        load_config(REPO / "configs/quickstart_cpu.yaml", [*base, f"model.megatron_path={other}"])
    for error in (missing, wrong):
        assert "\n" not in str(error.value) and "slimish convert hf-to-megatron" in str(error.value)


def test_a_run_checkpoint_starts_a_job_at_another_layout(task_assets, tmp_path):
    """model.megatron_path may also name a run's trainer checkpoint (model and optimizer state: the optimizer's is
    left alone): a job at TP2 starts from the weights one rank saved after its step, so its first logprobs are the
    one-rank job's logprobs after that step (within fp32 reduction-order noise)."""
    (one,) = _run(task_assets, tmp_path / "one", world_size=1, tp=1, extra=("--more-steps",))
    started = _run(task_assets, tmp_path / "tp2", world_size=2, tp=2,
                   overrides=(f"model.megatron_path={tmp_path / 'one' / 'checkpoint'}",))
    for result in started:
        assert [role["source"] for role in result["weights_read"]["roles"]] == ["megatron", "shared"]
        assert torch.allclose(result["before"], one["after"], atol=1e-5)
        assert not torch.allclose(result["before"], one["before"], atol=1e-3), "the trained weights, not HF's"


def test_expert_parallel_ranks_read_their_experts_only(task_assets, tiny_moe_models, tmp_path):
    """EP2 (Qwen3-MoE, two ranks, data parallel 2): each rank reads every tensor outside the experts and half the
    experts' bytes, exactly."""
    model = str(tiny_moe_models["qwen3_moe"])
    ckpt = HFCheckpoint(model)
    experts = sum(ckpt.nbytes(name) for name in ckpt.names() if ".mlp.experts." in name)
    rest = _total_bytes(model) - experts
    for result in _run({**task_assets, "model": model}, tmp_path, world_size=2, tp=1,
                       overrides=("parallel.expert_parallel=2",)):
        assert result["expert_sizes"]["ep"] == 2
        assert result["weights_read"]["requested"] == rest + experts // 2
