"""A colocated engine's CUDA_VISIBLE_DEVICES (`slimish.engines.server.visible_devices`): its own GPU first (SGLang runs
on device 0), then the GPU of the trainer rank that sends it weights by CUDA IPC when that rank is on its node, so
that the engine can open the sender's buffer on the sender's device."""

from __future__ import annotations

from slimish.engines.server import visible_devices

SENDER = {"node": "10.0.0.1", "cuda_visible_devices": "0"}


def test_an_engine_on_another_gpu_of_the_senders_node_also_sees_the_senders_gpu():
    assert visible_devices("3", sender=SENDER, node="10.0.0.1") == "3,0"


def test_the_senders_own_engine_and_engines_elsewhere_are_left_as_ray_placed_them():
    assert visible_devices("0", sender=SENDER, node="10.0.0.1") == "0"
    assert visible_devices("3", sender=SENDER, node="10.0.0.2") == "3"
    assert visible_devices("3", sender=None, node="10.0.0.1") == "3"
    assert visible_devices(None, sender=SENDER, node="10.0.0.1") is None, "no GPUs (CPU): nothing to add"


def test_an_engine_does_not_inherit_the_trainers_settings(monkeypatch):
    """launch/train.sbatch exports CUDA_DEVICE_MAX_CONNECTIONS=1 to every Ray process for Megatron's overlap; an
    engine's server starts without it (and without any of `TRAINER_ONLY_ENV`), with the rest of the environment."""
    from slimish.engines.server import TRAINER_ONLY_ENV, engine_env

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    env = engine_env()
    assert not any(name in env for name in TRAINER_ONLY_ENV)
    assert env["NCCL_DEBUG"] == "WARN"
