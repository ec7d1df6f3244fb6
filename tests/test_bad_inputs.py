"""A wide set of bad inputs to `slimish check-config` (and `train`, which reads its config the same way before it
starts anything): each is answered with one line, `error: ...` naming what to fix, exit status 2, no traceback.
Numbers, ports, layouts the model cannot take, dataset rows, model directories, run names, engine arguments,
hooks (imported in a process of their own, so that one that exits or hangs at import is reported, never run here)
and config files that are not a YAML mapping."""

from __future__ import annotations

import json
import shutil

import pytest

from slimish.cli import main
from tests.conftest import REPO

CONFIG = str(REPO / "configs/quickstart_cpu.yaml")

HOOK_MODULES = {
    "bad_no_args": "def reward():\n    return []\n",
    "bad_syntax": "def reward(completions, **kwargs)\n    return []\n",
    "bad_raises": "raise RuntimeError('no reward service configured')\n",
    "bad_exits_zero": "import sys\nsys.exit(0)\n",
    "bad_exits_three": "import os\nos._exit(3)\n",
    "bad_not_callable": "reward = 5\n",
    "bad_sync_program": "def program(sample, client):\n    return sample\n",
    "bad_program_arity": "async def program(sample):\n    return sample\n",
    "bad_phase": "def phase(phase):\n    pass\n",
    "good_columns": "def reward(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n",
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory, task_assets):
    """The files the cases point at: broken datasets, model directories, config files and hook modules."""
    root = tmp_path_factory.mktemp("bad")
    files = {}

    def write(name: str, text: str | bytes):
        path = root / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        files[name] = str(path)

    write("empty.jsonl", "")
    write("noprompt.jsonl", json.dumps({"question": "say 7", "label": "7"}) + "\n")
    write("intprompt.jsonl", json.dumps({"prompt": 5, "label": "7"}) + "\n")
    write("badjson.jsonl", '{"prompt": "say 7"}\n{"prompt": \n')
    write("listrow.jsonl", json.dumps(["say 7", "7"]) + "\n")
    write("garbage.parquet", b"not parquet at all")
    write("sft_noresponse.jsonl", json.dumps({"prompt": "say 7"}) + "\n")
    write("a_file", "not a directory")
    (root / "plain_dir").mkdir()
    files["plain_dir"] = str(root / "plain_dir")
    notok = root / "model_without_tokenizer"
    shutil.copytree(task_assets["model"], notok)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        (notok / name).unlink(missing_ok=True)
    files["model_without_tokenizer"] = str(notok)
    noweights = root / "model_without_weights"
    shutil.copytree(task_assets["model"], noweights)
    for path in noweights.glob("*.safetensors"):
        path.unlink()
    files["model_without_weights"] = str(noweights)
    write("list.yaml", "- run\n- model\n")
    write("scalar.yaml", "42\n")
    write("latin1.yaml", "run:\n  name: caf\xe9\n".encode("latin-1"))
    write("invalid.yaml", "run: [unclosed\n")
    write("dupkey.yaml", "run:\n  name: a\nrun:\n  name: b\n")
    (root / "config_dir.yaml").mkdir()
    files["config_dir.yaml"] = str(root / "config_dir.yaml")
    hooks = root / "hooks"
    hooks.mkdir()
    for name, text in HOOK_MODULES.items():
        (hooks / f"{name}.py").write_text(text)
    files["hooks"] = str(hooks)
    return files


def _base(task_assets) -> list[str]:
    return [f"model.hf_path={task_assets['model']}", f"data.path={task_assets['train']}",
            f"sft.data_path={task_assets['sft']}", f"eval.data_path={task_assets['eval']}"]


# (overrides, fragments the one error line must hold); "{name}" is a file of the `bad` fixture.
CASES = [
    # numbers: finite, >= 0, > 0 where 0 means nothing, fractions in range
    (["trainer.optimizer.lr=.nan"], ["'trainer.optimizer.lr'", "finite"]),
    (["trainer.optimizer.lr=.inf"], ["'trainer.optimizer.lr'", "finite"]),
    (["rollout.temperature=.inf"], ["'rollout.temperature'", "finite"]),
    (["sft.lr=-1"], ["'sft.lr'", "> 0"]),
    (["trainer.optimizer.lr=-1e-3"], ["'trainer.optimizer.lr'", "must be > 0, got -0.001"]),
    (["rollout.temperature=-1"], ["'rollout.temperature'", "must be > 0"]),
    (["rollout.top_p=-1"], ["'rollout.top_p'", "only 1.0"]),
    (["trainer.micro_batch_size=-1"], ["'trainer.micro_batch_size'", "must be > 0"]),
    (["rollout.partial.max_staleness=-1"], ["'rollout.partial.max_staleness'", ">= 0"]),
    (["sft.lr=0"], ["'sft.lr'", "> 0"]),
    (["trainer.critic.lr=.nan"], ["'trainer.critic.lr'", "finite"]),
    (["reward.timeout_s=-5"], ["'reward.timeout_s'", ">= 0"]),
    (["reward.workers=-1"], ["'reward.workers'", ">= 0"]),
    (["rollout.request_timeout_s=0"], ["'rollout.request_timeout_s'", "> 0"]),
    (["rollout.engine.hang_timeout_s=0"], ["'rollout.engine.hang_timeout_s'", "> 0"]),
    (["ray.placement_timeout_s=0"], ["'ray.placement_timeout_s'", "> 0"]),
    (["checkpoint.signal_grace_s=0"], ["'checkpoint.signal_grace_s'", "> 0"]),
    (["checkpoint.signal_grace_s=-.inf"], ["'checkpoint.signal_grace_s'", "finite"]),
    (["trainer.optimizer.adam_beta1=1"], ["'trainer.optimizer.adam_beta1'", "[0, 1)"]),
    (["trainer.critic.gamma=1.5"], ["'trainer.critic.gamma'", "[0, 1]"]),
    (["weight_sync.bucket_mb=.nan"], ["'weight_sync.bucket_mb'", "finite"]),
    (["reward.weights=[1.0, .nan]", "reward.fns=[slimish.tasks.echo_digit.reward]"], ["'reward.weights[1]'", "finite"]),
    (["sft.steps=2", "sft.batch_size=0"], ["'sft.batch_size'", "> 0"]),
    (["rollout.engine.max_total_tokens=8"], ["'rollout.engine.max_total_tokens'", "KV cache"]),
    (["rollout.max_new_tokens=100000"], ["'rollout.max_new_tokens'", "512 positions"]),
    # ports: 0 (a free one) or 1..65535, distinct
    (["rollout.router.port=65536"], ["'rollout.router.port'", "1..65535"]),
    (["weight_sync.master_port=-1"], ["'weight_sync.master_port'", "1..65535 (0 = a free one"]),
    (["rollout.engine.base_port=65535"], ["'rollout.engine.base_port'", "past 65535"]),
    (["rollout.engine.base_port=31000", "rollout.router.port=31001"], ["'rollout.router.port'", "collides"]),
    (["rollout.router.port=30000", "weight_sync.master_port=30000"], ["'weight_sync.master_port'", "is also"]),
    # layouts the model (4 heads, 2 KV heads, 2 layers, 512 positions) cannot take
    (["parallel.tensor_parallel=3", "parallel.num_trainer_ranks=3"], ["'parallel.tensor_parallel'", "4 attention"]),
    (["parallel.tensor_parallel=4", "parallel.num_trainer_ranks=4"], ["'parallel.tensor_parallel'", "2 KV heads"]),
    (["parallel.pipeline_parallel=3", "parallel.num_trainer_ranks=3"], ["'parallel.pipeline_parallel'", "2 layers",
                                                                        "first_stage_layers"]),
    (["parallel.virtual_pipeline=0"], ["'parallel.virtual_pipeline'", "> 0"]),
    (["parallel.context_parallel=-2"], ["'parallel.context_parallel'", "> 0"]),
    (["parallel.context_parallel=2", "parallel.num_trainer_ranks=3"], ["'parallel.num_trainer_ranks'",
                                                                       "context_parallel"]),
    (["parallel.context_parallel=2", "parallel.num_trainer_ranks=2", "trainer.attention=local"],
     ["'trainer.attention'", "refuses context parallelism"]),
    (["parallel.pipeline_parallel=2", "parallel.num_trainer_ranks=2", "parallel.virtual_pipeline=2"],
     ["'parallel.virtual_pipeline'", "needs pipeline_parallel > 2"]),
    (["parallel.pipeline_parallel=2", "parallel.num_trainer_ranks=2", "parallel.first_stage_layers=2"],
     ["'parallel.first_stage_layers'", "0 layers after 2 on the first / last stage over 1 stage"]),
    (["rollout.engine.tensor_parallel=3"], ["'rollout.engine.tensor_parallel'", "4 attention heads"]),
    # datasets, read as the job reads them
    (["data.path={empty.jsonl}"], ["'data.path'", "no rows"]),
    (["data.path={noprompt.jsonl}"], ["'data.path'", "has no key 'prompt'", "noprompt.jsonl:1"]),
    (["data.path={intprompt.jsonl}"], ["'data.path'", "neither text nor a list of chat messages"]),
    (["data.path={badjson.jsonl}"], ["'data.path'", "badjson.jsonl:2: not valid JSON"]),
    (["data.path={listrow.jsonl}"], ["'data.path'", "JSON object"]),
    (["data.path={garbage.parquet}"], ["'data.path'", "not a readable Parquet file"]),
    (["data.path={plain_dir}"], ["'data.path'", "not a dataset saved with save_to_disk"]),
    (["data.prompt_key=question"], ["'data.path'", "has no key 'question'"]),
    (["data.prompt_key=''"], ["'data.prompt_key'", "is required"]),
    (["eval.every=1", "eval.data_path={empty.jsonl}"], ["'eval.data_path'", "no rows"]),
    (["sft.steps=2", "sft.data_path={sft_noresponse.jsonl}"], ["'sft.data_path'", '"response"']),
    # model directories
    (["model.hf_path={model_without_tokenizer}"], ["'model.hf_path'", "no tokenizer"]),
    (["model.hf_path={model_without_weights}"], ["'model.hf_path'", "model.safetensors"]),
    (["model.hf_path={a_file}"], ["'model.hf_path'", "is a file: give the model's directory"]),
    # run names and the output directory
    (["run.name=/"], ["'run.name'", "plain name"]),
    (["run.name=.."], ["'run.name'", "plain name"]),
    (["run.name=../x"], ["'run.name'", "plain name"]),
    (["run.name=a/b"], ["'run.name'", "plain name"]),
    (["run.name=''"], ["'run.name'", "plain name"]),
    (["run.output_dir={a_file}"], ["'run.output_dir'", "is a file"]),
    (["run.output_dir=''"], ["'run.output_dir'", "is required"]),
    # engine arguments, through SGLang's own parser; none that opens a listener or puts a key on the command line
    (["rollout.engine.extra_args=[--host, 0.0.0.0]"], ["'rollout.engine.extra_args'", "--host"]),
    (["rollout.engine.extra_args=[--host=0.0.0.0]"], ["'rollout.engine.extra_args'", "--host"]),
    (["rollout.engine.extra_args=[--api-key, k]"], ["'rollout.engine.extra_args'", "--api-key", "readable"]),
    (["rollout.engine.extra_args=[--admin-api-key, k]"], ["'rollout.engine.extra_args'", "--admin-api-key"]),
    (["rollout.engine.extra_args=[--port, '1234']"], ["'rollout.engine.extra_args'", "--port"]),
    (["rollout.engine.extra_args=[--no-such-flag]"], ["'rollout.engine.extra_args'", "no option '--no-such-flag'"]),
    (["rollout.engine.extra_args=[--chunked-prefill-size, lots]"], ["'rollout.engine.extra_args'", "parser"]),
    (["reward.url=http://"], ["'reward.url'", "with a host"]),
    # hooks, imported in a process of their own
    (["reward.fn=bad_no_args.reward"], ["'reward.fn'", "cannot be called as a reward hook"]),
    (["reward.fn=bad_syntax.reward"], ["'reward.fn'", "syntax error"]),
    (["reward.fn=bad_raises.reward"], ["'reward.fn'", "raised at import", "no reward service configured"]),
    (["reward.fn=bad_exits_zero.reward"], ["'reward.fn'", "exit status 0"]),
    (["reward.fn=bad_exits_three.reward"], ["'reward.fn'", "exit status 3"]),
    (["reward.fn=bad_not_callable.reward"], ["'reward.fn'", "is not callable"]),
    (["reward.fn=bad_no_args.missing"], ["'reward.fn'", "has no attribute 'missing'"]),
    (["reward.fns=[bad_no_args.reward]"], ["'reward.fns[0]'", "cannot be called"]),
    (["rollout.generate_fn=bad_sync_program.program"], ["'rollout.generate_fn'", "not an async function"]),
    (["rollout.generate_fn=bad_program_arity.program"], ["'rollout.generate_fn'", "cannot be called as a program"]),
    (["run.phase_hook=bad_phase.phase"], ["'run.phase_hook'", "cannot be called as a phase hook"]),
    # types
    (["rollout.stop=[1, 2]"], ["'rollout.stop[0]'", "expected a string"]),
    (["reward.weights=[a]", "reward.fns=[]"], ["'reward.weights[0]'", "expected a float"]),
    (["rollout.samples_per_prompt"], ["must look like section.key=value"]),
    (["rollout..temperature=1"], ["'rollout..temperature=1'", "no empty part"]),
    (["=5"], ["'=5'", "must look like section.key=value"]),
]


def _resolved(items: list[str], bad: dict) -> list[str]:
    out = []
    for item in items:
        for name, path in bad.items():
            item = item.replace("{" + name + "}", path)
        out.append(item)
    return out


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("overrides,fragments", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_check_config_answers_a_bad_input_in_one_line(capsys, monkeypatch, task_assets, bad, overrides, fragments):
    monkeypatch.syspath_prepend(bad["hooks"])
    line = _one_line_error(capsys, ["check-config", CONFIG, *_base(task_assets), *_resolved(overrides, bad)])
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.parametrize("name,fragment", [
    ("config_dir.yaml", "is a directory"), ("list.yaml", "holds a YAML list"), ("scalar.yaml", "holds a YAML int"),
    ("latin1.yaml", "not UTF-8"), ("invalid.yaml", "not valid YAML"), ("dupkey.yaml", "'run' appears twice"),
])
@pytest.mark.parametrize("command", ["check-config", "train"])
def test_a_config_file_that_is_not_a_yaml_mapping_is_one_line(capsys, bad, name, fragment, command):
    line = _one_line_error(capsys, [command, bad[name]])
    assert fragment in line and "'<file>'" in line, line


def test_a_reward_hook_that_takes_dataset_columns_by_name_passes(capsys, monkeypatch, task_assets, bad):
    """The signature check leaves room for dataset columns: `reward(completions, solution, **kwargs)` is fine."""
    monkeypatch.syspath_prepend(bad["hooks"])
    assert main(["check-config", CONFIG, *_base(task_assets), "reward.fn=good_columns.reward"]) == 0, \
        capsys.readouterr().err
