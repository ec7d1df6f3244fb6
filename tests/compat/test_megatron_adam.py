"""The Adam Megatron-Core builds is the one trainer.optimizer.adam names (`slimish.compat.megatron_adam`), resolved and
logged by `slimish.trainer.adam`; TE's FusedAdam is stood in for where TE is absent (`tests.kit.fused_adam`).
Megatron building it, and its checkpoints: tests/trainer/test_checkpoint.py."""

from __future__ import annotations

import logging

import pytest
import torch

from slimish.compat import megatron_cpu
from slimish.config.errors import ConfigError
from tests.kit.fused_adam import StandInFusedAdam, keep_megatron_adam, use_stand_in


@pytest.fixture()
def megatron(monkeypatch):
    megatron_cpu.apply()
    import megatron.core.optimizer as optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    keep_megatron_adam(monkeypatch)
    return optimizer, distrib_optimizer


def test_use_sets_every_global_megatron_reads(megatron):
    """Both modules' globals: what get_megatron_optimizer builds, and where the distributed optimizer looks for the
    step count when it saves and loads."""
    from slimish.compat import megatron_adam

    optimizer, distrib = megatron
    assert megatron_adam.use("te_fused", fused_adam=StandInFusedAdam) is StandInFusedAdam
    assert (optimizer.Adam, optimizer.USING_PYTORCH_OPTIMIZER) == (StandInFusedAdam, False)
    assert (distrib.Adam, distrib.HAVE_APEX_OR_TE, distrib.USING_TE_OPTIMIZER, distrib.USING_APEX_OPTIMIZER) == (
        StandInFusedAdam, True, True, False)
    assert megatron_adam.megatron_builds() == megatron_adam.chosen() == "te_fused"
    assert megatron_adam.use("torch") is torch.optim.AdamW
    assert (optimizer.Adam, optimizer.USING_PYTORCH_OPTIMIZER) == (torch.optim.AdamW, True)
    assert (distrib.Adam, distrib.HAVE_APEX_OR_TE, distrib.USING_TE_OPTIMIZER) == (torch.optim.Adam, False, False)
    assert megatron_adam.megatron_builds() == megatron_adam.chosen() == "torch"
    with pytest.raises(ValueError, match="needs Transformer Engine's FusedAdam class"):
        megatron_adam.use("te_fused")
    with pytest.raises(ValueError, match="one of torch, te_fused"):
        megatron_adam.use("apex")


def test_auto_is_torch_without_transformer_engine_and_te_fused_is_refused(megatron):
    from slimish.trainer import adam

    assert adam.te_fused_adam() is None  # no TE, no CUDA here
    assert adam.resolve("auto") == ("torch", None)
    assert adam.resolve("torch") == ("torch", None)
    with pytest.raises(ConfigError, match=r"^config key 'trainer.optimizer.adam': te_fused needs Transformer "
                                          r"Engine's FusedAdam and a CUDA GPU .*set trainer.optimizer.adam=torch"):
        adam.resolve("te_fused")


def test_auto_takes_fused_adam_where_it_imports(megatron, monkeypatch):
    from slimish.trainer import adam

    use_stand_in(monkeypatch)
    assert adam.resolve("auto") == adam.resolve("te_fused") == ("te_fused", StandInFusedAdam)
    assert adam.resolve("torch") == ("torch", None)


def test_the_adam_that_runs_is_logged_once(megatron, monkeypatch, caplog):
    from slimish.compat import megatron_adam
    from slimish.trainer import adam

    monkeypatch.setattr(megatron_adam, "_CHOSEN", None)
    with caplog.at_level(logging.INFO, logger="slimish.trainer.adam"):
        assert adam.install("auto") == "torch"
        assert adam.install("auto") == "torch"  # the critic's optimizer: nothing new to say
        use_stand_in(monkeypatch)
        assert adam.install("te_fused") == "te_fused"
    assert [record.getMessage() for record in caplog.records] == [
        "trainer Adam: torch.optim.AdamW, trainer.optimizer.adam=auto (auto: no Transformer Engine FusedAdam with "
        "CUDA here)",
        "trainer Adam: Transformer Engine's FusedAdam, trainer.optimizer.adam=te_fused"]
