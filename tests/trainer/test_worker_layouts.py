"""The trainer at TP2, DP2 and PP2 (two gloo processes; DP2 also with Megatron's distributed optimizer, TP2 also with
full and selective activation recomputation; each also with packed micro-batches and chunked logits) computes the
same logprobs and takes the same GRPO step as at one rank: logprobs before and after the step agree within fp32
reduction-order noise, and rank 0's whole-model export (what weight sync sends) matches the one-rank trainer's
weights after the step. In bf16 the same holds within bf16 precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc import run_world

SCRIPT = Path(__file__).with_name("worker_rank.py")


# Adam's first step moves a weight by ~lr whatever the size of its gradient (m / sqrt(v) = sign(g) when eps is far
# below |g|), so an element whose gradient is ~0 moves by up to lr in a direction set by reduction-order noise: one
# such element of o_proj ended 0.004 apart between TP2 and one rank (PPO, on one CPU kind and not another), its
# logprobs 5e-4 apart. With eps 1e-5, well below a typical |g| (~3e-3) but far above that noise, the comparisons test
# the trainer's arithmetic rather than Adam's normalisation of rounding noise.
ADAM_EPS = "trainer.optimizer.adam_eps=1e-5"


def _run(task_assets, out: Path, *, world_size: int, tp: int, pp: int = 1, dtype: str = "float32",
         overrides: tuple[str, ...] = (), extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
         timeout: float = 300.0) -> list[dict]:
    """Every rank's results of worker_rank.py at this layout (`extra`: its further options; `env`: for the ranks)."""
    run_world(SCRIPT, world_size=world_size, env=env, timeout=timeout,
              args=["--tp", str(tp), "--pp", str(pp), "--dtype", dtype, "--hf", task_assets["model"],
                    "--data", task_assets["train"], "--out", str(out), *extra,
                    *(a for o in (ADAM_EPS, *overrides) for a in ("--set", o))])
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def reference(task_assets, tmp_path_factory):
    return _run(task_assets, tmp_path_factory.mktemp("tp1"), world_size=1, tp=1)[0]


DISTRIBUTED_OPTIMIZER = ("trainer.optimizer.distributed=true",)
RECOMPUTE = ("trainer.recompute=full",)
# Megatron's selective recompute: the core attention of every layer checkpointed (its default module)
SELECTIVE = ("trainer.recompute=selective",)
# Rows of two or three samples under a 14-token budget, logits 3 tokens at a time: against the padded one-rank run.
PACKED = ("trainer.max_tokens_per_micro_batch=14", "trainer.logprob_chunk_tokens=3")
# Megatron's sequence parallelism: rows padded to an even length, each TP rank holding half of the sequence between
# the attention and MLP blocks (norm weight gradients all-reduced over TP).
SEQUENCE_PARALLEL = ("parallel.sequence_parallel=true",)
# Context parallelism: every sequence cut into 4 load-balanced chunks, 2 per rank (keys and values all-gathered).
CONTEXT_PARALLEL = ("parallel.context_parallel=2",)


@pytest.mark.parametrize("tp,pp,overrides", [(2, 1, ()), (1, 1, ()), (1, 2, ()), (1, 1, DISTRIBUTED_OPTIMIZER),
                                             (2, 1, RECOMPUTE), (2, 1, PACKED), (1, 2, PACKED), (1, 1, PACKED),
                                             (2, 1, PACKED + RECOMPUTE), (2, 1, SEQUENCE_PARALLEL),
                                             (2, 1, PACKED + SEQUENCE_PARALLEL), (1, 1, CONTEXT_PARALLEL),
                                             (1, 1, PACKED + CONTEXT_PARALLEL), (2, 1, SELECTIVE),
                                             (1, 1, PACKED + CONTEXT_PARALLEL + SELECTIVE)],
                         ids=["tp2", "dp2", "pp2", "dp2-distributed-optimizer", "tp2-recompute", "tp2-packed",
                              "pp2-packed", "dp2-packed", "tp2-packed-recompute", "tp2-sp", "tp2-packed-sp", "cp2",
                              "cp2-packed", "tp2-selective-recompute", "cp2-packed-selective-recompute"])
def test_two_rank_layout_matches_one_rank(task_assets, tmp_path, reference, tp, pp, overrides):
    results = _run(task_assets, tmp_path, world_size=2, tp=tp, pp=pp, overrides=overrides)
    assert reference["rows"] == list(range(8))
    if results[0]["dp_size"] == 2:  # the halves hold every sample once; each two 4-token and two 5-token samples
        assert sorted(results[0]["rows"] + results[1]["rows"]) == list(range(8))
        assert results[0]["parity"]["dp_token_imbalance"] == 1.0
    for result in results:
        for key in ("logprob_abs_diff_max", "logprob_abs_diff_mean", "entropy"):  # the whole rollout, every rank
            assert result["parity"][key] == pytest.approx(reference["parity"][key], abs=1e-5), key
        assert result["metrics"]["ppo_kl"] == 0.0
        assert result["metrics"]["pg_loss"] == pytest.approx(reference["metrics"]["pg_loss"], abs=1e-5)
        if result["before"] is None:  # a pipeline stage before the last: no logprobs there
            assert pp > 1
            continue
        rows = result["rows"]  # which of the 8 samples the rank holds (data parallel: a token-balanced half)
        assert torch.allclose(result["before"], reference["before"][rows], atol=1e-5)
        assert torch.allclose(result["after"], reference["after"][rows], atol=1e-4)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-4)
    state, expected = results[0]["state"], reference["state"]
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        # Adam turns reduction-order noise in near-zero grads into rare ~1e-4 differences (an update is ~1e-2).
        diff = (tensor - expected[name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name
    assert all(result["state"] == {} for result in results[1:])


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_selective_recompute_is_the_step_without(task_assets, tmp_path, attention):
    """trainer.recompute=selective with the core attention (torch's SDPA, or Megatron's local DotProductAttention
    on packed rows: `slimish.compat.packed_attention`), the norms and the MLP: each is called again in the backward
    pass (Megatron's checkpoints recompute it), and the step is the one without recompute (the logprobs before it bit
    for bit, after it within fp32 rounding)."""
    base = (f"trainer.attention={attention}", *(PACKED if attention == "local" else ()))
    modules = "trainer.recompute_modules=[core_attn,layernorm,mlp]"
    without = _run(task_assets, tmp_path / "none", world_size=1, tp=1, overrides=base)[0]
    recomputed = _run(task_assets, tmp_path / "selective", world_size=1, tp=1,
                      overrides=base + SELECTIVE + (modules,))[0]
    for module in ("self_attention.core_attention", "mlp", "input_layernorm", "pre_mlp_layernorm"):
        assert recomputed["train_calls"][module] == 2 * without["train_calls"][module] > 0, module
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj"):  # not recomputed
        assert recomputed["train_calls"][module] == without["train_calls"][module] > 0, module
    assert torch.equal(recomputed["before"], without["before"])
    # The recomputed backward sums the same gradients in another order: fp32 rounding apart (measured: 1e-6).
    assert torch.allclose(recomputed["after"], without["after"], atol=1e-5)
    assert recomputed["metrics"]["grad_norm"] == pytest.approx(without["metrics"]["grad_norm"], rel=1e-5)
    assert all((recomputed["state"][name] - t).abs().max() <= 1e-5 for name, t in without["state"].items())



def test_selective_recompute_of_a_moe_model_with_multi_latent_attention(task_assets, tiny_moe_models, tmp_path):
    """DeepSeek-V3 (MLA, routed and shared experts) with trainer.recompute=selective over the core attention, MLA's
    up projections (Megatron's output-discarding checkpoint, TE-free: `slimish.compat.megatron_te_absent`), the
    MoE layers and the norms: each is called again in the backward pass, and the step is the one without."""
    assets = {**task_assets, "model": str(tiny_moe_models["deepseek_v3"])}
    modules = "trainer.recompute_modules=[core_attn,mla_up_proj,moe,layernorm]"
    without = _run(assets, tmp_path / "none", world_size=1, tp=1)[0]
    recomputed = _run(assets, tmp_path / "selective", world_size=1, tp=1, overrides=SELECTIVE + (modules,))[0]
    for module in ("self_attention.core_attention", "self_attention.linear_q_up_proj",
                   "self_attention.linear_kv_up_proj", "mlp.router", "mlp.shared_experts", "pre_mlp_layernorm"):
        assert recomputed["train_calls"][module] == 2 * without["train_calls"][module] > 0, module
    for module in ("self_attention.linear_q_down_proj", "self_attention.linear_proj"):
        assert recomputed["train_calls"][module] == without["train_calls"][module] > 0, module
    assert torch.equal(recomputed["before"], without["before"])
    assert torch.allclose(recomputed["after"], without["after"], atol=1e-5)  # measured: 1e-6
    assert recomputed["metrics"]["grad_norm"] == pytest.approx(without["metrics"]["grad_norm"], rel=1e-5)
    assert all((recomputed["state"][name] - t).abs().max() <= 1e-5 for name, t in without["state"].items())


def test_bf16_at_tp2_tracks_fp32(task_assets, tmp_path, reference):
    """model.dtype=bfloat16: bf16 parameters and activations, Megatron's mixed-precision optimizer (fp32 main
    weights and grads), at TP2: the same step as the fp32 one-rank trainer, within bf16 precision."""
    result = _run(task_assets, tmp_path, world_size=2, tp=2, dtype="bfloat16")[0]
    assert result["metrics"]["ppo_kl"] == 0.0, "same weights, same micro-batches: the ratio is exactly 1"
    assert result["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-2)
    assert torch.allclose(result["before"], reference["before"], atol=2e-2)  # measured: 2e-3
    moved, expected = (result["after"] - result["before"]).sum(1), (reference["after"] - reference["before"]).sum(1)
    assert torch.equal(moved.sign(), expected.sign()) and torch.allclose(moved, expected, rtol=0.25)
    state = result["state"]
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # what weight sync sends
    for name, tensor in state.items():
        # Adam with lr 0.01 moves a weight by about 0.01 whatever its grad: where fp32 and bf16 grads of a weight
        # differ in sign, the weights end 0.02 apart (measured max 0.0201; mean 1e-4).
        # A bf16 weight is also rounded to 8 significant bits: up to 2^-8 of its size apart (norm weights, ~1: 0.004).
        expected = reference["state"][name]
        diff = (tensor.float() - expected).abs()
        assert diff.max() <= 0.025 and diff.mean() <= 1e-3 + 2 ** -8 * expected.abs().mean(), name


ESTIMATOR_RUNS = {"reinforce_plus_plus": ("trainer.loss.advantage_estimator=reinforce_plus_plus",
                                         "trainer.loss.reward_kl_coef=0.5"),
                  "ppo": ("trainer.loss.advantage_estimator=ppo", "trainer.loss.reward_kl_coef=0.5",
                          "trainer.critic.lr=0.01")}


@pytest.mark.parametrize("estimator,tp,pp,layout", [
    ("reinforce_plus_plus", 1, 1, ()), ("reinforce_plus_plus", 1, 2, ()), ("ppo", 2, 1, ()), ("ppo", 1, 2, ()),
    ("ppo", 2, 1, SEQUENCE_PARALLEL + PACKED), ("ppo", 1, 1, CONTEXT_PARALLEL),
    ("reinforce_plus_plus", 1, 1, CONTEXT_PARALLEL + PACKED)],
                         ids=["reinforce_plus_plus-dp2", "reinforce_plus_plus-pp2", "ppo-tp2", "ppo-pp2",
                              "ppo-tp2-packed-sp", "ppo-cp2", "reinforce_plus_plus-cp2-packed"])
def test_estimator_advantages_span_every_rank(task_assets, tmp_path, estimator, tp, pp, layout):
    """REINFORCE++ and PPO whiten their token advantages over the whole step's tokens: at DP2 each rank holds half of
    them (the statistics are all-reduced), at PP2 only the last stage has logprobs (and PPO's values). PPO's critic
    (a value head on the same stack) at TP2 and PP2, and at TP2 with sequence parallelism and packed rows (the
    value head sees the whole sequence, gathered). The advantages, the step (and the critic's) and the logprobs
    after it are those of one rank."""
    overrides = ESTIMATOR_RUNS[estimator]
    one = _run(task_assets, tmp_path / "one", world_size=1, tp=1, overrides=overrides)[0]
    assert len(set(one["advantages"])) > 2, "per-token returns, whitened: the per-sample means differ"
    for result in _run(task_assets, tmp_path / "two", world_size=2, tp=tp, pp=pp, overrides=overrides + layout):
        assert result["advantages"] == pytest.approx(one["advantages"], abs=1e-5)
        for key in ("pg_loss", "value_loss") if estimator == "ppo" else ("pg_loss",):
            assert result["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-5), key
        if result["after"] is not None:
            assert torch.allclose(result["after"], one["after"][result["rows"]], atol=1e-4)


def test_offload_on_the_cpu_moves_nothing(task_assets, tmp_path, reference):
    """On the CPU the trainer's memory is host memory: offload finds nothing on a device, moves nothing, and the run
    is the one without it (the moves themselves: the emulated-GPU tier and tests/gpu)."""
    (result,) = _run(task_assets, tmp_path, world_size=1, tp=1, extra=("--offload",))
    assert result["offload"]["held"] == [0] * 5 and result["offload"]["offload_freed_bytes"] == 0
    assert torch.equal(result["after"], reference["after"])


def test_moe_sequence_parallel_step_is_the_one_rank_step(task_assets, tiny_moe_models, tmp_path):
    """Mixture-of-experts layers (Megatron's token dispatcher gathers the sequence-parallel slices over TP; Megatron
    refuses MoE at TP > 1 without sequence parallelism): TP2 with sequence parallelism and packed rows takes the
    one-rank step. (DeepSeek-V3's multi-latent attention at TP > 1 needs Transformer Engine's spec:
    tests/trainer/test_attention.py.)"""
    assets = {**task_assets, "model": str(tiny_moe_models["qwen3_moe"])}
    (one,) = _run(assets, tmp_path / "one", world_size=1, tp=1, overrides=PACKED)
    for sp in _run(assets, tmp_path / "sp", world_size=2, tp=2, overrides=PACKED + SEQUENCE_PARALLEL):
        assert sp["metrics"]["pg_loss"] == pytest.approx(one["metrics"]["pg_loss"], abs=1e-5)
        assert sp["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
        assert torch.allclose(sp["before"], one["before"], atol=1e-5)
        assert torch.allclose(sp["after"], one["after"], atol=1e-4)
        assert sp["parity"]["entropy"] == pytest.approx(one["parity"]["entropy"], abs=1e-5)


@pytest.mark.parametrize("overrides", [CONTEXT_PARALLEL + SEQUENCE_PARALLEL,
                                       CONTEXT_PARALLEL + SEQUENCE_PARALLEL + PACKED], ids=["padded", "packed"])
def test_cp2_tp2_with_sequence_parallelism_matches_one_rank(task_assets, tmp_path, reference, overrides):
    """Four ranks, CP2 x TP2 with sequence parallelism: every sequence padded to a multiple of 2 x CP x TP = 8
    tokens, cut into 4 chunks over the CP ranks and each rank's share split again over TP between blocks. The
    step, its logprobs and the exported weights are the one-rank trainer's."""
    results = _run(task_assets, tmp_path, world_size=4, tp=2, overrides=overrides)
    for result in results:
        rows = result["rows"]  # packed rows hold the samples in the packer's order
        assert result["dp_size"] == 1 and sorted(rows) == list(range(8))
        assert result["metrics"]["pg_loss"] == pytest.approx(reference["metrics"]["pg_loss"], abs=1e-5)
        assert result["parity"]["entropy"] == pytest.approx(reference["parity"]["entropy"], abs=1e-5)
        assert torch.allclose(result["before"], reference["before"][rows], atol=1e-5)
        assert torch.allclose(result["after"], reference["after"][rows], atol=1e-4)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-4)
    for name, tensor in results[0]["state"].items():
        diff = (tensor - reference["state"][name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name
    assert all(result["state"] == {} for result in results[1:]), "one rank exports"


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_context_parallel_step_is_the_one_rank_step(task_assets, tiny_moe_models, tmp_path, family):
    """Mixture-of-experts layers (each CP rank routes its own share of the tokens) and DeepSeek-V3's multi-latent
    attention (its own RoPE per CP chunk, keys and values of different widths all-gathered) at CP2, packed: the
    one-rank step."""
    assets = {**task_assets, "model": str(tiny_moe_models[family])}
    (one,) = _run(assets, tmp_path / "one", world_size=1, tp=1, overrides=PACKED)
    for cp in _run(assets, tmp_path / "cp", world_size=2, tp=1, overrides=PACKED + CONTEXT_PARALLEL):
        assert cp["metrics"]["pg_loss"] == pytest.approx(one["metrics"]["pg_loss"], abs=1e-5)
        assert cp["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
        for key, atol in (("before", 1e-5), ("after", 1e-4)):
            assert torch.allclose(_by_sample(cp, key), _by_sample(one, key), atol=atol), key


def _by_sample(result: dict, key: str) -> torch.Tensor:
    """A result's per-sample rows in sample order (packed rows hold them in the packer's order)."""
    return result[key][torch.argsort(torch.tensor(result["rows"]))]


def _with_layers(task_assets, tmp_path_factory, layers: int) -> tuple[dict, dict]:
    """The task with a tiny model of `layers` layers, and that model's one-rank step."""
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp(f"layers{layers}") / "model", corpus=echo_digit.corpus(),
                             num_hidden_layers=layers)
    assets = {**task_assets, "model": str(model)}
    return assets, _run(assets, tmp_path_factory.mktemp(f"layers{layers}-one"), world_size=1, tp=1)[0]


@pytest.fixture(scope="module")
def three_layers(task_assets, tmp_path_factory):
    """The task with a three-layer model (two pipeline stages cannot split it evenly), and its one-rank step."""
    return _with_layers(task_assets, tmp_path_factory, 3)


@pytest.mark.parametrize("split", ["parallel.first_stage_layers=2", "parallel.last_stage_layers=2"])
def test_uneven_pipeline_stages_match_one_rank(three_layers, tmp_path, split):
    """Three layers over PP2, two on the first stage (with the embedding) or on the last (with the output layer and
    the loss): the step, its logprobs and the exported weights (every layer once, by its global number) are the
    one-rank trainer's."""
    assets, one = three_layers
    results = _run(assets, tmp_path, world_size=2, tp=1, pp=2, overrides=(split,))
    last = results[1]
    assert last["metrics"]["pg_loss"] == pytest.approx(one["metrics"]["pg_loss"], abs=1e-5)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
    assert torch.allclose(last["before"], one["before"], atol=1e-5)
    assert torch.allclose(last["after"], one["after"], atol=1e-4)
    state = results[0]["state"]
    assert state.keys() == one["state"].keys() and any("layers.2." in name for name in state)
    for name, tensor in state.items():
        diff = (tensor - one["state"][name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name


@pytest.fixture(scope="module")
def six_layers(task_assets, tmp_path_factory):
    """The task with a six-layer model (PP3 x two virtual-pipeline chunks: a layer per chunk), its one-rank step."""
    return _with_layers(task_assets, tmp_path_factory, 6)


VIRTUAL_PIPELINE = ("parallel.virtual_pipeline=2",)


@pytest.mark.parametrize("overrides", [VIRTUAL_PIPELINE, VIRTUAL_PIPELINE + PACKED,
                                       VIRTUAL_PIPELINE + ("trainer.loss.advantage_estimator=ppo",
                                                           "trainer.critic.lr=0.01")],
                         ids=["padded", "packed", "ppo"])
def test_interleaved_pipeline_matches_one_rank(six_layers, tmp_path, overrides):
    """PP3 with two model chunks per rank (Megatron's interleaved 1F1B: rank r holds layers r and r + 3, the output
    layer on the last rank's second chunk; every micro-batch of a schedule padded to one shape): the step, its
    logprobs, PPO's critic and the exported weights (each layer once, from the chunk that holds it) are the one-rank
    trainer's; a checkpoint of the chunks loads back exactly."""
    assets, one = six_layers
    if "ppo" in str(overrides):
        (one,) = _run(assets, tmp_path / "one", world_size=1, tp=1, overrides=overrides[1:])
    more = overrides == VIRTUAL_PIPELINE  # also the export's buckets, a checkpoint saved and loaded, an SFT step
    results = _run(assets, tmp_path, world_size=3, tp=1, pp=3, overrides=overrides,
                   extra=("--more-steps",) if more else ())
    last = results[-1]
    if more:
        assert torch.equal(last["after_load"], last["after"]), "the checkpoint (a model dict per chunk) loads back"
        assert last["sft"]["sft_loss"] > 0
    for key in ("pg_loss", "value_loss") if "ppo" in str(overrides) else ("pg_loss",):
        assert last["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-5), key
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
    for key, atol in (("before", 1e-5), ("after", 1e-4)):
        assert torch.allclose(_by_sample(last, key), _by_sample(one, key), atol=atol), key
    state = results[0]["state"]
    assert state.keys() == one["state"].keys()
    for name, tensor in state.items():
        diff = (tensor - one["state"][name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name


# Expert layouts: (MoE family, world size, TP, overrides, the experts' (ETP, EP, EDP)). ETP1 at TP2: attention split
# over two ranks, each expert whole on both, its tokens half the sequence on each: expert-data-parallel 2 at data
# parallel 1 (the experts' grads all-reduced over the TP group; Megatron 0.16 does it only at EP > 1 unless told:
# `trainer.model._mark_expert_data_parallel`), also with the distributed optimizer. EP2 at TP1 over four ranks: data
# parallel 4, two copies of each expert half (EDP2). TP2 with ETP1 and EP2 over four ranks: DP2, EDP2. ETP2 at TP1:
# each expert split over two data-parallel ranks, which gather each other's tokens (uneven counts: on gloo padded,
# `slimish.compat.megatron_cpu._all_gather`); TP2 x EP2 (ETP = TP) over four ranks the same.
EXPERT_LAYOUTS = {
    "qwen3_moe-tp2-etp1": ("qwen3_moe", 2, 2, SEQUENCE_PARALLEL + ("parallel.expert_tensor_parallel=1",), (1, 1, 2)),
    "qwen3_moe-tp2-etp1-distributed-optimizer": (
        "qwen3_moe", 2, 2, SEQUENCE_PARALLEL + DISTRIBUTED_OPTIMIZER + ("parallel.expert_tensor_parallel=1",),
        (1, 1, 2)),
    "glm4_moe-ep2-edp2": ("glm4_moe", 4, 1, ("parallel.expert_parallel=2",), (1, 2, 2)),
    "glm4_moe-tp2-etp1-ep2": ("glm4_moe", 4, 2, SEQUENCE_PARALLEL + ("parallel.expert_tensor_parallel=1",
                                                                      "parallel.expert_parallel=2"), (1, 2, 2)),
    "qwen3_moe-tp1-etp2": ("qwen3_moe", 2, 1, ("parallel.expert_tensor_parallel=2",), (2, 1, 1)),
    "qwen3_moe-tp2-ep2": ("qwen3_moe", 4, 2, SEQUENCE_PARALLEL + ("parallel.expert_parallel=2",), (2, 2, 1)),
}


@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_expert_layout_step_is_the_one_rank_step(task_assets, tiny_moe_models, tmp_path, layout):
    """Expert tensor parallelism other than TP, and expert data parallelism > 1: the same logprobs, step and
    whole-model export (rank 0's, what weight sync sends: experts gathered over ETP, the rest over TP) as one rank."""
    family, world, tp, overrides, (etp, ep, edp) = EXPERT_LAYOUTS[layout]
    assets = {**task_assets, "model": str(tiny_moe_models[family])}
    (one,) = _run(assets, tmp_path / "one", world_size=1, tp=1)
    results = _run(assets, tmp_path / "layout", world_size=world, tp=tp, overrides=overrides)
    assert sorted(row for result in results[::tp] for row in result["rows"]) == list(range(8))
    for result in results:
        assert result["expert_sizes"] == {"etp": etp, "ep": ep, "edp": edp}
        assert result["metrics"]["pg_loss"] == pytest.approx(one["metrics"]["pg_loss"], abs=1e-5)
        assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
        assert result["parity"]["entropy"] == pytest.approx(one["parity"]["entropy"], abs=1e-5)
        assert torch.allclose(result["before"], one["before"][result["rows"]], atol=1e-5)
        assert torch.allclose(result["after"], one["after"][result["rows"]], atol=1e-4)
    state, expected = results[0]["state"], one["state"]
    assert state.keys() == expected.keys() and any(".mlp.experts." in name for name in state)
    for name, tensor in state.items():
        diff = (tensor - expected[name]).abs()
        assert diff.max() <= 1e-3 and diff.mean() <= 1e-6, name
    assert all(result["state"] == {} for result in results[1:])


def test_context_parallel_sft_step_checkpoint_and_export_match_one_rank(task_assets, tmp_path):
    """CP2, packed: after the RL step, the SFT step's loss, the weight-sync export's buckets and a checkpoint saved
    and loaded are the one-rank trainer's (`worker_rank.more_steps`)."""
    (one,) = _run(task_assets, tmp_path / "one", world_size=1, tp=1, overrides=PACKED, extra=("--more-steps",))
    for cp in _run(task_assets, tmp_path / "cp", world_size=2, tp=1, overrides=PACKED + CONTEXT_PARALLEL,
                   extra=("--more-steps",)):
        assert cp["sft"]["sft_loss"] == pytest.approx(one["sft"]["sft_loss"], rel=1e-5)
        assert torch.equal(cp["after_load"], cp["after"]), "the checkpoint gives back the weights it was saved with"
        assert torch.allclose(_by_sample(cp, "after"), _by_sample(one, "after"), atol=1e-4)
