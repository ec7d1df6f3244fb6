"""Every CLI subcommand answers bad input with one line, `error: <what is wrong and what to do>`, and exit status 2:
no traceback, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import save_file

from slimish.cli import main
from slimish.errors import UserError, find_user_error
from tests.conftest import REPO


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    """The tiny qwen3 model as a Megatron checkpoint."""
    out = tmp_path_factory.mktemp("cli") / "megatron"
    assert main(["convert", "hf-to-megatron", "--hf", str(tiny_models["qwen3"]), "--out", str(out)]) == 0
    return out


def _model_copy(tiny_models, tmp_path, name="model", **changes):
    """A copy of the tiny qwen3 model whose config.json has `changes`."""
    model = tmp_path / name
    shutil.copytree(tiny_models["qwen3"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def _fails(capsys, argv, *fragments):
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "B/s" not in line]
    assert len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    return err[0]


def test_hf_to_megatron_missing_input(capsys, tmp_path):
    _fails(capsys, ["convert", "hf-to-megatron", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
           "--hf", "does not exist", "Hugging Face model directory")
    assert not (tmp_path / "o").exists()


def test_hf_to_megatron_corrupt_safetensors(capsys, tiny_models, tmp_path):
    model = _model_copy(tiny_models, tmp_path)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails(capsys, ["convert", "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "o")],
           "model.safetensors", "truncated", "copy or export it again")


def test_hf_to_megatron_unsupported_model_type(capsys, tiny_models, tmp_path):
    model = _model_copy(tiny_models, tmp_path, model_type="gpt2")
    _fails(capsys, ["convert", "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "o")],
           "model_type", "gpt2", "supported families")


def test_hf_to_megatron_weights_of_another_config(capsys, tiny_models, tmp_path):
    model = _model_copy(tiny_models, tmp_path, intermediate_size=256)
    _fails(capsys, ["convert", "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "o")],
           "gate_proj.weight has shape (128, 64)", "implies (256, 64)", "pass the matching config.json")


def test_hf_to_megatron_layout_that_does_not_split(capsys, tiny_models, tmp_path):
    _fails(capsys, ["convert", "hf-to-megatron", "--hf", str(tiny_models["qwen3"]), "--out", str(tmp_path / "o"),
                    "--tp", "3"], "num_attention_heads=4 does not split over 3 ranks")


def test_unwritable_output(capsys, tiny_models, tmp_path):
    (tmp_path / "a_file").write_text("")
    _fails(capsys, ["convert", "hf-to-megatron", "--hf", str(tiny_models["qwen3"]), "--out",
                    str(tmp_path / "a_file" / "out")], "--out", "cannot write there", "writable directory")
    _fails(capsys, ["make-tiny", "--out", str(tmp_path / "a_file" / "tiny")], "--out", "cannot write there")


def test_megatron_to_hf_not_a_checkpoint(capsys, tiny_models, tmp_path):
    _fails(capsys, ["convert", "megatron-to-hf", "--megatron", str(tiny_models["qwen3"]), "--hf-config",
                    str(tiny_models["qwen3"]), "--out", str(tmp_path / "o")], "--megatron", "no metadata.json")


def test_megatron_to_hf_checkpoint_of_another_model(capsys, converted, tiny_models, tmp_path):
    """The qwen3 checkpoint with llama's config (no qk-norm), more layers, or a wider MLP: refused, nothing written."""
    out = tmp_path / "o"
    argv = ["convert", "megatron-to-hf", "--megatron", str(converted), "--out", str(out), "--hf-config"]
    _fails(capsys, [*argv, str(tiny_models["llama"])], "does not describe", "k_layernorm")
    _fails(capsys, [*argv, str(_model_copy(tiny_models, tmp_path, "deeper", num_hidden_layers=4))],
           "has 2 layers", "says 4", "pass the config of the model that was converted")
    _fails(capsys, [*argv, str(_model_copy(tiny_models, tmp_path, "wider", intermediate_size=256))],
           "implies (256, 64)")
    assert not out.exists()
    _fails(capsys, [*argv, str(tmp_path / "nope")], "--hf-config", "does not exist")


def test_config_errors(capsys, tiny_models, tmp_path):
    _fails(capsys, ["check-config", str(tmp_path / "nope.yaml")], "config file not found")
    _fails(capsys, ["train", "--config", str(tmp_path / "nope.yaml")], "config file not found")
    config = str(REPO / "configs/quickstart_cpu.yaml")
    _fails(capsys, ["check-config", config, "rollout.top_p=0.9"], "rollout.top_p")
    damaged = _model_copy(tiny_models, tmp_path)
    save_file({}, damaged / "model.safetensors")
    (damaged / "model.safetensors").write_bytes(b"\x00" * 4)
    _fails(capsys, ["check-config", config, f"model.hf_path={damaged}"], "model.hf_path", "model.safetensors")
    incomplete = _model_copy(tiny_models, tmp_path, "incomplete")
    fields = json.loads((incomplete / "config.json").read_text())
    del fields["hidden_size"]
    (incomplete / "config.json").write_text(json.dumps(fields))
    _fails(capsys, ["check-config", config, f"model.hf_path={incomplete}"], "model.hf_path", "'hidden_size'",
           "missing")


def test_train_takes_its_config_positionally_or_as_an_option(capsys, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    _fails(capsys, ["train", missing], "config file not found", missing)
    _fails(capsys, ["train", missing, "rl.num_steps=2"], "config file not found")
    _fails(capsys, ["train", "rl.num_steps=2", "--config", missing], "config file not found")
    _fails(capsys, ["train"], "no config file")
    _fails(capsys, ["train", "rl.num_steps=2"], "looks like an override")


def test_relative_paths_in_errors_are_shown_resolved(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs/quickstart_cpu.yaml")
    _fails(capsys, ["check-config", config, "model.hf_path=artifacts/tiny/model"], "'artifacts/tiny/model'",
           f"relative to the current directory: {tmp_path / 'artifacts/tiny/model'}")


def test_version_and_the_config_reference(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("slimish ")
    assert main(["config", "trainer"]) == 0
    listed = capsys.readouterr().out
    assert "trainer.optimizer.lr_warmup_steps  (int, default 0)" in listed.splitlines()
    assert all(line.startswith(("trainer.", "    ")) for line in listed.splitlines())
    _fails(capsys, ["config", "trainr"], "no config section 'trainr'", "trainer")


def test_user_errors_are_found_behind_other_errors():
    """A UserError raised in a Ray actor reaches the driver as a RayTaskError carrying it as `cause`."""
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError("setup", "Traceback ...", UserError("model.hf_path: bad"))
    assert str(find_user_error(wrapped)) == "model.hf_path: bad"
    try:
        try:
            raise UserError("the real reason")
        except UserError as exc:
            raise RuntimeError("while starting") from exc
    except RuntimeError as exc:
        assert str(find_user_error(exc)) == "the real reason"
    assert find_user_error(RuntimeError("a bug")) is None


def test_make_tiny_100m_is_a_model_of_at_least_100m_parameters():
    """`slimish make-tiny --size 100m` (the one-GPU acceptance job's model), counted as Megatron builds it, without
    building it (`slimish.planning.params`)."""
    from transformers import AutoConfig

    from slimish.planning.params import count_params
    from slimish.tasks.tiny_model import SIZES, TINY_SHAPES

    config = AutoConfig.for_model("qwen3", vocab_size=320, tie_word_embeddings=False,
                                  **{**TINY_SHAPES, **SIZES["100m"]}).to_dict()
    assert 100e6 <= count_params(config).total <= 110e6
