"""Config loading, dotted overrides, validation messages and the check-config CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from slimish.config import ConfigError, load_config, save_config
from tests.conftest import REPO


@pytest.fixture()
def base(task_assets) -> list[str]:
    return [f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}", "eval.every=0",
            f"sft.data_path={task_assets['sft']}", "reward.fn=slimish.tasks.echo_digit.reward"]


def test_yaml_plus_overrides_are_typed(base, tmp_path):
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml",
                      base + ["rollout.samples_per_prompt=4", "trainer.optimizer.lr=1e-4", "rollout.top_p=1"])
    assert cfg.rollout.samples_per_prompt == 4
    assert cfg.trainer.optimizer.lr == pytest.approx(1e-4)
    assert isinstance(cfg.rollout.top_p, float)
    save_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg


def test_yaml_1_1_words_stay_strings(base):
    """`off`, `no`, `yes` are booleans in YAML 1.1 (PyYAML's default), strings here; 1e-4 is a float."""
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", base + ["rollout.partial.mode=off", "run.name=no",
                                                                     "trainer.loss.tis_cap=2e0"])
    assert (cfg.rollout.partial.mode, cfg.run.name, cfg.trainer.loss.tis_cap) == ("off", "no", 2.0)


BAD_CASES = [
    # (override, key named in the error, a fragment of the explanation)
    ("rollout.samplez_per_prompt=4", "rollout.samplez_per_prompt", "did you mean 'rollout.samples_per_prompt'"),
    ("nosuchsection.x=1", "nosuchsection", "allowed keys here"),
    ("rollout.samples_per_prompt=four", "rollout.samples_per_prompt", "expected an int"),
    ("rollout.samples_per_prompt=2.5", "rollout.samples_per_prompt", "expected an int"),
    ("trainer.optimizer.lr=fast", "trainer.optimizer.lr", "expected a float"),
    ("data.shuffle=maybe", "data.shuffle", "expected a bool"),
    ("model.dtype=float8", "model.dtype", "allowed values: 'float32', 'bfloat16'"),
    ("trainer.loss.advantage_estimator=ppo_gae", "trainer.loss.advantage_estimator", "allowed values: 'grpo'"),
    ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt", "needs >= 2 samples"),
    ("trainer.num_minibatches=3", "trainer.num_minibatches", "must divide"),
    ("rollout.top_p=0.9", "rollout.top_p", "only 1.0 is supported"),
    ("rollout.temperature=0", "rollout.temperature", "must be > 0"),
    ("trainer.loss.clip_eps_high=1.5", "trainer.loss.clip_eps_high", "(0, 1)"),
    ("rollout.router.port=65536", "rollout.router.port", "a TCP port is 1..65535 (0 = a free one"),
    ("rollout.engine.base_port=-1", "rollout.engine.base_port", "got -1; a TCP port is 1..65535"),
    ("rollout.engine.base_port=65535", "rollout.engine.base_port", "would run past 65535"),
    ("parallel.num_trainer_ranks=3", "parallel.num_trainer_ranks", "split evenly"),
    ("parallel.tensor_parallel=2", "parallel.num_trainer_ranks", "multiple of tensor_parallel"),
    ("reward.fn=slimish.tasks.echo_digit.no_such_fn", "reward.fn", "has no attribute"),
    ("reward.fn=no_such_module.fn", "reward.fn", "cannot import module"),
    ("rollout.partial.mode=async", "rollout.partial.mode", "allowed values: 'off', 'abort', 'retract'"),
    ("rollout.partial.over_sampling=4", "rollout.partial.over_sampling", "'abort' or 'retract'"),
    ("rollout.partial.max_staleness=-1", "rollout.partial.max_staleness", ">= 0"),
    ("rollout.overlong.mode=dapo", "rollout.overlong.mode", "allowed values: 'train', 'filter', 'penalty'"),
    ("rollout.overlong.mode=penalty", "rollout.overlong.buffer_tokens", "must be in 1..rollout.max_new_tokens (8)"),
    ("rollout.dynamic_sampling.max_extra_groups=-1", "rollout.dynamic_sampling.max_extra_groups", ">= 0"),
    ("trainer.loss.tis_cap=-2", "trainer.loss.tis_cap", ">= 0"),
    ("model.hf_path=/nonexistent", "model.hf_path", "has no config.json"),
    ("weight_sync.bucket_mb=0", "weight_sync.bucket_mb", "must be > 0"),
    ("parallel.pipeline_parallel=2", "parallel.num_trainer_ranks", "multiple of tensor_parallel * pipeline"),
    ("parallel.expert_parallel=2", "parallel.expert_parallel", "needs a mixture-of-experts model"),
    ("parallel.expert_tensor_parallel=2", "parallel.expert_tensor_parallel", "needs a mixture-of-experts model"),
    ("rollout.engine=3", "rollout.engine", "expected a mapping"),
    ("checkpoint.save_every=-1", "checkpoint.save_every", "must be >= 0"),
    ("checkpoint.keep_last=-2", "checkpoint.keep_last", "must be >= 0"),
    ("checkpoint.resume=/nonexistent/step_3", "checkpoint.resume", "not a complete checkpoint"),
    ("checkpoint.resume=", "checkpoint.resume", "must be 'auto', 'never' or a checkpoint directory"),
    ("reward.weights=[1, 2]", "reward.weights", "got 2 weights for 1 reward terms"),
    ("reward.fns=[no_such_module.fn]", "reward.fns[0]", "cannot import module"),
    ("run.phase_hook=tests.e2e.hooks.no_such_fn", "run.phase_hook", "has no attribute"),
    ("reward.url=localhost:8000", "reward.url", "expected an http:// or https:// URL"),
    ("trainer.loss.mis_high=0.9", "trainer.loss.mis_high", "must hold 1"),
    ("plan.mfu=0", "plan.mfu", "must be > 0"),
    ("trainer.optimizer.lr_warmup_steps=-1", "trainer.optimizer.lr_warmup_steps", "must be >= 0"),
    ("trainer.optimizer.lr_decay_style=step", "trainer.optimizer.lr_decay_style",
     "allowed values: 'constant', 'linear', 'cosine'"),
    ("trainer.optimizer.min_lr_ratio=1.5", "trainer.optimizer.min_lr_ratio", "must be in [0, 1]"),
    ("rollout.engine.attach=[http://127.0.0.1:31000]", "rollout.engine.num_engines",
     "is 2, but rollout.engine.attach lists 1 engines: set num_engines=1"),
    ("rollout.engine.attach=[127.0.0.1:31000, http://127.0.0.1:31001]", "rollout.engine.attach",
     "'127.0.0.1:31000' is not an engine URL (http://HOST:PORT)"),
    ("rollout.engine.attach=[http://127.0.0.1:31000, http://127.0.0.1:31001]", "rollout.engine.attach_key_file",
     "is required with rollout.engine.attach"),
    # Not finite (on main at a706c6e each passed check-config with exit 0)
    ("trainer.optimizer.lr=.nan", "trainer.optimizer.lr", "must be a finite number, got nan"),
    ("trainer.optimizer.lr=.inf", "trainer.optimizer.lr", "must be a finite number, got inf"),
    ("rollout.temperature=.nan", "rollout.temperature", "must be a finite number, got nan"),
    ("reward.timeout_s=.inf", "reward.timeout_s", "must be a finite number, got inf"),
    ("trainer.max_skipped_steps=-1", "trainer.max_skipped_steps", "must be >= 0"),
    # Memory knobs
    ("trainer.recompute=partial", "trainer.recompute", "allowed values: 'none', 'full', 'selective'"),
    ("trainer.recompute_modules=[mlp]", "trainer.recompute_modules", "read only with trainer.recompute=selective"),
    ("trainer.recompute_modules=[moe_act]", "trainer.recompute_modules[0]", "allowed values: 'core_attn'"),
    ("trainer.optimizer.adam=apex", "trainer.optimizer.adam", "allowed values: 'auto', 'torch', 'te_fused'"),
    ("trainer.optimizer.cpu_offload=half", "trainer.optimizer.cpu_offload", "expected a bool or a float, got str"),
    ("trainer.optimizer.cpu_offload=1.5", "trainer.optimizer.cpu_offload", "must be in [0, 1], got 1.5"),
    ("trainer.optimizer.cpu_offload=-0.5", "trainer.optimizer.cpu_offload", "must be in [0, 1], got -0.5"),
    ("trainer.optimizer.cpu_offload=true", "trainer.optimizer.cpu_offload",
     "needs Megatron's distributed optimizer, which the CPU offload is built into: set "
     "trainer.optimizer.distributed=true"),
]


@pytest.mark.parametrize("override,key,fragment", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_config_names_key_and_allowed(base, override, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/quickstart_cpu.yaml", base + [override])
    assert err.value.key == key
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"config key '{key}'")


PORT_CASES = [
    # (overrides, key named in the error, a fragment of the explanation); 0 (the default) = a free port at the start
    (["rollout.engine.base_port=31000", "rollout.router.port=31001"], "rollout.router.port",
     "collides with the engine ports 31000-31001"),
    (["rollout.router.port=30000", "weight_sync.master_port=30000"], "weight_sync.master_port",
     "port 30000 is also rollout.router.port"),
    (["rollout.router.port=30000", "rollout.router.prometheus_port=30000"], "rollout.router.prometheus_port",
     "is also rollout.router.port"),
    (["rollout.engine.base_port=31000", "rollout.router.port=31002", "weight_sync.master_port=29650"], None, None),
]


def _loads_or_names(base, overrides, key, fragment):
    """The quickstart config with `overrides` loads (key None), or is refused naming `key` with `fragment`."""
    if key is None:
        return load_config(REPO / "configs/quickstart_cpu.yaml", base + overrides)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/quickstart_cpu.yaml", base + overrides)
    assert err.value.key == key and fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides,key,fragment", PORT_CASES, ids=[" ".join(c[0]) for c in PORT_CASES])
def test_ports_are_in_range_and_distinct(base, overrides, key, fragment):
    _loads_or_names(base, overrides, key, fragment)


RL_MODE_CASES = [
    # (overrides, key named in the error, a fragment of the explanation)
    (["rl.mode=async"], "rl.mode", "set rollout.partial.mode=retract"),
    (["rl.sync_every=2"], "rl.sync_every", "only rl.mode 'async'"),
    (["rl.mode=async", "rollout.partial.mode=retract", "rl.sync_every=0"], "rl.sync_every", "must be > 0"),
    (["rl.mode=async", "rollout.partial.mode=retract", "rl.sync_every=3", "rollout.partial.max_staleness=2"],
     "rollout.partial.max_staleness", "up to 3 version(s) old: use >= 3"),
    (["rl.mode=one_step_off", "rollout.partial.mode=abort", "rollout.partial.max_staleness=0"], None, None),
    (["rl.mode=one_step_off"], None, None),
    (["rl.mode=async", "rollout.partial.mode=retract", "rl.sync_every=2"], None, None),
]


@pytest.mark.parametrize("overrides,key,fragment", RL_MODE_CASES, ids=[" ".join(c[0]) for c in RL_MODE_CASES])
def test_rl_mode_checks(base, overrides, key, fragment):
    cfg = _loads_or_names(base, overrides, key, fragment)
    if key is None:
        assert cfg.rl.mode == overrides[0][8:]


EXPERT_LAYOUT_CASES = [
    # (overrides on the tiny Qwen3-MoE model, key named in the error or None, a fragment of the explanation).
    # Megatron's initialize_model_parallel needs num_trainer_ranks to be a multiple of ETP x EP x PP.
    (["parallel.num_trainer_ranks=2", "parallel.expert_parallel=2", "parallel.expert_tensor_parallel=2"],
     "parallel.expert_tensor_parallel", "multiple of expert_tensor_parallel * expert_parallel * pipeline_parallel = "
                                        "2 * 2 * 1 = 4"),
    (["parallel.num_trainer_ranks=2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
      "parallel.expert_parallel=4"], "parallel.expert_parallel", "must divide the data-parallel size"),
    (["parallel.expert_tensor_parallel=3"], "parallel.expert_tensor_parallel", "divide each expert's 32 hidden"),
    (["parallel.expert_tensor_parallel=-1"], "parallel.expert_tensor_parallel", "must be >= 0"),
    # TP2 with each expert whole, split over two expert-parallel ranks; TP2 with each expert whole on both (EDP2)
    (["parallel.num_trainer_ranks=2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
      "parallel.expert_tensor_parallel=1", "parallel.expert_parallel=2"], None, None),
    (["parallel.num_trainer_ranks=2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
      "parallel.expert_tensor_parallel=1"], None, None),
]


@pytest.mark.parametrize("overrides,key,fragment", EXPERT_LAYOUT_CASES,
                         ids=[" ".join(c[0]) for c in EXPERT_LAYOUT_CASES])
def test_expert_layouts_megatron_refuses_name_the_key(base, tiny_moe_models, overrides, key, fragment):
    """A layout whose expert groups Megatron cannot lay over the trainer's ranks is one line naming the key."""
    moe = [f"model.hf_path={tiny_moe_models['qwen3_moe']}"]
    if key is None:
        cfg = _loads_or_names(base, moe + overrides, key, fragment)
        assert cfg.parallel.expert_tensor_parallel == 1
        return
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/quickstart_cpu.yaml", base + moe + overrides)
    assert err.value.key == key and fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


LR_SCHEDULE_CASES = [
    # (overrides, key named in the error or None, a fragment of the explanation); the quickstart runs 30 steps
    (["trainer.optimizer.lr_decay_style=cosine", "trainer.optimizer.lr_warmup_steps=30"],
     "trainer.optimizer.lr_warmup_steps", "rl.num_steps x trainer.num_minibatches (30)"),
    (["trainer.optimizer.lr_decay_style=linear", "trainer.optimizer.lr_warmup_steps=5",
      "trainer.optimizer.lr_decay_steps=5"], "trainer.optimizer.lr_warmup_steps", "lr_decay_steps (5)"),
    (["trainer.optimizer.lr_warmup_steps=100"], None, None),  # constant after it: a long warm-up is only slow
    (["trainer.optimizer.lr_decay_style=linear", "trainer.optimizer.lr_warmup_steps=29"], None, None),
]


@pytest.mark.parametrize("overrides,key,fragment", LR_SCHEDULE_CASES,
                         ids=[" ".join(c[0]) for c in LR_SCHEDULE_CASES])
def test_lr_schedule_checks(base, overrides, key, fragment):
    _loads_or_names(base, overrides, key, fragment)


MEMORY_CASES = [
    (["trainer.recompute=selective", "trainer.recompute_modules=[]"], "trainer.recompute_modules", "is empty"),
    (["trainer.recompute=selective", "trainer.recompute_modules=[core_attn,mla_up_proj]"],
     "trainer.recompute_modules", "mla_up_proj recomputes multi-latent attention's up projections"),
    (["trainer.recompute=selective", "trainer.recompute_modules=[core_attn,layernorm,mlp]"], None, None),
    (["trainer.optimizer.cpu_offload=0.5", "trainer.optimizer.distributed=true"], "trainer.optimizer.cpu_offload",
     "needs model.dtype=bfloat16 (got float32): Megatron-Core 0.16 offloads the fp32 main weights"),
    (["trainer.optimizer.cpu_offload=true", "trainer.optimizer.distributed=true", "model.dtype=bfloat16"], None,
     None),
    (["trainer.optimizer.cpu_offload=0", "trainer.optimizer.cpu_offload_overlap=false"], None, None),
]


@pytest.mark.parametrize("overrides,key,fragment", MEMORY_CASES, ids=[" ".join(c[0]) for c in MEMORY_CASES])
def test_memory_knobs(base, overrides, key, fragment):
    _loads_or_names(base, overrides, key, fragment)


def test_cpu_offload_is_a_bool_or_a_fraction(base):
    """trainer.optimizer.cpu_offload keeps what was given (true, or 0.25; an int is a float) and reads as the share
    offloaded."""
    from slimish.config.validate import offload_fraction

    on = ["trainer.optimizer.distributed=true", "model.dtype=bfloat16"]
    for given, kept, share in (("true", True, 1.0), ("false", False, 0.0), ("0.25", 0.25, 0.25), ("1", 1.0, 1.0)):
        cfg = load_config(REPO / "configs/quickstart_cpu.yaml", base + on + [f"trainer.optimizer.cpu_offload={given}"])
        assert cfg.trainer.optimizer.cpu_offload == kept and type(cfg.trainer.optimizer.cpu_offload) is type(kept)
        assert offload_fraction(cfg.trainer.optimizer.cpu_offload) == share


def test_pipeline_parallel_is_allowed(base):
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml",
                      base + ["parallel.pipeline_parallel=2", "parallel.num_trainer_ranks=2"])
    assert cfg.parallel.pipeline_parallel == 2


def test_check_config_cli_exit_codes(base, tmp_path):
    cmd = [sys.executable, "-m", "slimish.cli", "check-config", str(REPO / "configs/quickstart_cpu.yaml")]
    ok = subprocess.run(cmd + base, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(cmd + base + ["rollout.max_new_tokens=-1"], capture_output=True, text=True)
    assert bad.returncode != 0
    assert "rollout.max_new_tokens" in bad.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout: [unclosed")
    res = subprocess.run([sys.executable, "-m", "slimish.cli", "check-config", str(broken)], capture_output=True,
                         text=True)
    assert res.returncode != 0 and "not valid YAML" in res.stderr


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path, base):
    """Every shipped config is valid apart from paths that only exist on a cluster."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    load_config(path, base)


COLOCATED = ["placement.colocate=true", "weight_sync.transport=tensor", "rollout.engine.num_engines=1"]
COLOCATE_CASES = [
    # (overrides on top of a valid colocated layout, key named in the error, a fragment of the explanation)
    (["weight_sync.transport=broadcast"], "weight_sync.transport", "NCCL refuses a group with two ranks on one GPU"),
    (["rl.mode=one_step_off"], "rl.mode", "must be idle while the trainer trains"),
    (["rollout.partial.mode=retract"], "rollout.partial.mode", "generates the next step's groups while the trainer"),
    (["rollout.engine.num_engines=2"], "rollout.engine.num_engines",
     "2 engine(s) of 1 GPU(s) for 1 trainer rank(s); colocated, every GPU holds one trainer rank and one engine rank: "
     "set rollout.engine.num_engines=1"),
    (["rollout.engine.tensor_parallel=2"], "rollout.engine.tensor_parallel", "colocated engines are one GPU each"),
    (["rollout.engine.attach=[http://127.0.0.1:31000]", "rollout.engine.attach_key_file=/etc/hostname"],
     "placement.colocate", "attached engines run outside the job"),
]


@pytest.mark.parametrize("overrides,key,fragment", COLOCATE_CASES, ids=[c[1] for c in COLOCATE_CASES])
def test_layouts_that_cannot_colocate_are_refused(base, overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/quickstart_cpu.yaml", base + COLOCATED + overrides)
    assert err.value.key == key
    assert fragment in str(err.value)


def test_a_colocated_layout_loads(base):
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", base + COLOCATED)
    assert cfg.placement.colocate and cfg.weight_sync.transport == "tensor"
    for transport in ("disk", "tensor"):
        load_config(REPO / "configs/quickstart_cpu.yaml", base + COLOCATED + [f"weight_sync.transport={transport}"])


def test_sft_batch_must_split_over_data_parallel_ranks(base):
    with pytest.raises(ConfigError, match="sft.batch_size.*must split evenly over 2 data-parallel ranks, got 63"):
        load_config(REPO / "configs/quickstart_cpu.yaml", base + ["parallel.num_trainer_ranks=2", "sft.batch_size=63"])


def test_attached_engines_need_their_key_file(base):
    attach = ["rollout.engine.attach=[http://127.0.0.1:31000, http://127.0.0.1:31001]"]
    with pytest.raises(ConfigError, match="rollout.engine.attach_key_file': '/nonexistent/key' does not exist"):
        load_config(REPO / "configs/quickstart_cpu.yaml",
                    base + attach + ["rollout.engine.attach_key_file=/nonexistent/key"])
