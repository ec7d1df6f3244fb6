"""The value model of PPO: the same Megatron stack built from the same HF checkpoint, with a value head in place of
the output layer, its own optimizer and learning rate (`trainer.critic`), and its own checkpoint.

Values follow the logprobs' convention: index i of a [B, S-1] tensor is the value of the prefix tokens[:, :i+1],
the state in which tokens[:, i+1] is generated, so a response token's value and logprob share an index.
"""

from __future__ import annotations

import torch

from slimish.trainer.batch import MicroBatch
from slimish.trainer.device import host_tensor, module_device
from slimish.trainer.logprobs import unwrap_gpt_model, whole_sequence
from slimish.trainer.roles import TrainedRole
from slimish.trainer.schedule import optimizer_step, run_schedule


class ValueHead:
    """Installed on a GPTModel: the model returns its last hidden states on the last pipeline stage, and a linear
    map (hidden -> 1), registered on the model as `value_head` so that DDP and the optimizer own it, gives values.
    The output layer is kept (the HF checkpoint loads strictly) but frozen and unused."""

    def __init__(self, model):
        gpt = unwrap_gpt_model(model)
        self.linear = None
        if gpt.post_process:
            gpt.output_layer.requires_grad_(False)
            gpt.output_layer.forward = lambda hidden, weight=None, runtime_gather_output=None: (
                whole_sequence(hidden, gpt.config), None)
            gpt.value_head = torch.nn.Linear(gpt.config.hidden_size, 1, dtype=gpt.config.params_dtype,
                                             device=module_device(gpt))
            torch.nn.init.zeros_(gpt.value_head.weight)  # values start at 0 (the bias learns the mean return)
            torch.nn.init.zeros_(gpt.value_head.bias)
            self.linear = gpt.value_head

    def values(self, hidden: torch.Tensor, shard=None) -> torch.Tensor:
        """[B, S, H] hidden states -> [B, S-1] fp32 values (the last position predicts nothing). Under context
        parallelism (`shard`) `hidden` holds this rank's positions: their values are gathered whole."""
        if shard is None:
            return self.linear(hidden[:, :-1]).squeeze(-1).float()
        return shard.gather(self.linear(hidden).squeeze(-1).float())[:, :-1]


def value_loss(values, old_values, returns, mask, *, clip: float, denom: float):
    """PPO's clipped value loss, 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2), summed over the
    trained tokens and divided by `denom`; and the fraction of tokens where the clipped term was the larger."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss, clipped_loss = (values - returns).square(), (clipped - returns).square()
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        clip_frac = ((clipped_loss > unclipped_loss).to(values.dtype) * mask).sum() / denom
    return loss, {"value_loss": loss.detach(), "value_clip_frac": clip_frac}


class Critic(TrainedRole):
    """PPO's value model: `build()` loaded by `load_weights`, the value head installed, trained at
    trainer.critic.lr with the policy's optimizer settings."""

    def __init__(self, cfg, build, load_weights, *, total_steps: int):
        self.cfg = cfg
        chunks = build()
        load_weights(chunks)
        self.head = ValueHead(chunks[-1])  # before the optimizer is built: it trains the head too
        super().__init__(chunks, cfg.trainer.optimizer, lr=cfg.trainer.critic.lr, total_steps=total_steps)

    def values(self, microbatches: list[MicroBatch]) -> list[torch.Tensor]:
        """[B, S-1] values per micro-batch (empty off the last stage)."""
        def collect(mb, hidden):
            return hidden.new_zeros(()), {"values": host_tensor(self.head.values(hidden, mb.shard))}

        with torch.no_grad():
            return [out["values"] for out in run_schedule(self.models, microbatches, collect, forward_only=True)]

    def train(self, microbatches: list[MicroBatch], *, denom: float, scale: float) -> tuple[list[dict], float]:
        """One optimizer step on the micro-batches' `returns` and `old_values` (loss over loss_mask tokens)."""
        clip = self.cfg.trainer.critic.value_clip

        def loss_fn(mb, hidden):
            loss, metrics = value_loss(self.head.values(hidden, mb.shard), mb.old_values, mb.returns,
                                       mb.loss_mask, clip=clip, denom=denom)
            return loss * scale, metrics

        return optimizer_step(self.models, self.optimizer, microbatches, loss_fn, self.lr_schedule)
