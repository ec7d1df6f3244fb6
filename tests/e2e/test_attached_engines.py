"""Attached engines (`rollout.engine.attach`): what a job does to a running engine before it uses it, on the
session's shared engines. The jobs that attach to them are in test_resume, test_partial_rollout and test_rl_loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimish.engines.servers import reset_attached
from slimish.errors import UserError
from slimish.weight_sync.buckets import Bucket
from slimish.weight_sync.checksums import tensor_checksum
from slimish.weight_sync.tensor import flattened_metadata, serialize

NAME = "model.norm.weight"  # one HF tensor, one engine parameter (no fusing, no vocabulary padding)


def test_a_reset_gives_back_an_engine_as_freshly_started(attached, task_assets):
    """An engine left by an earlier job with other weights, another weight version and paused is, after the reset,
    serving the checkpoint's weights (SGLang's checksum of every parameter) at version "0" and generating."""
    from safetensors.torch import load_file

    url, key = attached.urls[0], attached.key
    client = attached.client(url)
    checkpoint = next(t for path in sorted(Path(task_assets["model"]).glob("*.safetensors"))
                      for name, t in load_file(path).items() if name == NAME)
    try:
        reset_attached(url, model_path=task_assets["model"], api_key=key)
        [fresh] = client.weight_checksums()
        assert fresh[NAME] == tensor_checksum(checkpoint)
        changed = checkpoint + 0.5  # an earlier job's weights
        client.begin_weight_update()
        client.update_weights_from_tensor(
            serialized=[serialize({"flattened_tensor": changed.contiguous().view(-1).view(torch.uint8),
                                    "metadata": flattened_metadata(Bucket(names=[NAME], tensors=[changed]))})],
            load_format="flattened_bucket", weight_version="7", flush_cache=True)
        client.end_weight_update()
        assert client.weight_checksums()[0][NAME] == tensor_checksum(changed)
        client.pause_generation(mode="in_place")

        reset_attached(url, model_path=task_assets["model"], api_key=key)

        assert client.weight_version() == "0"
        assert client.weight_checksums() == [fresh]
        assert client.probe("/health_generate", timeout_s=60) is None, "generating again: not paused"
    finally:
        client.continue_generation()
        client.close()


def test_an_engine_that_cannot_be_attached_is_one_line_naming_why(attached, task_assets, tmp_path):
    url, key = attached.urls[0], attached.key
    with pytest.raises(UserError, match=r"^rollout.engine.attach: http://127.0.0.1:9 does not answer .*: start it"):
        reset_attached("http://127.0.0.1:9", model_path=task_assets["model"], api_key=key)
    with pytest.raises(UserError, match=rf"^rollout.engine.attach: {url} refused .*HTTP 401"):
        reset_attached(url, model_path=task_assets["model"], api_key="not-the-key")
    other = tmp_path / "other_model"
    other.mkdir()
    with pytest.raises(UserError, match=rf"^rollout.engine.attach: {url} serves .*, not model.hf_path {other}: "):
        reset_attached(url, model_path=str(other), api_key=key)


def test_a_shared_engine_left_paused_fails_the_check_and_is_mended(attached):
    """What the shared engines' check does after a test that left one paused (a failed job whose hook froze it): it
    fails naming the engine, and the engine is generating again for the tests that follow."""
    url = attached.urls[1]
    client = attached.client(url)
    try:
        client.pause_generation(mode="in_place")
    finally:
        client.close()
    with pytest.raises(AssertionError, match=rf"shared engine {url} gave no answer .* after the test \(mended\)"):
        attached.check_engines("after the test", probe_timeout_s=5)
    assert attached.problems() == {}
