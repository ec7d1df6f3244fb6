"""The trainer's model roles: the policy (trained) and the reference model (the frozen initial policy), beside PPO's
critic (`slimish.trainer.critic`). Each owns its Megatron modules, built on the trainer's device
(`slimish.trainer.device`): `chunks`, the rank's model chunks (one, or parallel.virtual_pipeline of them), and for
a trained role `models`, each chunk in Megatron's DDP. Roles take micro-batches in host memory: `run_schedule` moves
one at a time to the device, and what a role returns per token comes back into host memory. `TrainerWorker`
composes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slimish.trainer.batch import MicroBatch
from slimish.trainer.device import host_tensor, module_device
from slimish.trainer.logprobs import LogprobHead
from slimish.trainer.schedule import optimizer_step, run_schedule

# loss(mb, logprobs) -> (loss, metrics): `mb` on the device, `logprobs` [B, S-1] of mb.tokens (last stage only)
LogprobLoss = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


def forward_logprobs(chunks: list, head: LogprobHead, microbatches: list[MicroBatch], *, temperature: float,
                     entropy: bool = False) -> tuple[list[torch.Tensor], list[float]]:
    """Per micro-batch [B, S-1] logprobs in host memory and, when asked, the sum of the entropies over its
    loss-masked tokens (empty lists off the last pipeline stage). No gradient."""
    def collect(mb, hidden):
        logprobs, ent = head.logprobs(hidden, mb.tokens, temperature=temperature, entropy=entropy, shard=mb.shard)
        entropy_sum = (ent * mb.loss_mask).sum() if entropy else hidden.new_zeros(())
        return hidden.new_zeros(()), {"logprobs": host_tensor(logprobs), "entropy_sum": entropy_sum}

    with torch.no_grad():
        outputs = run_schedule(chunks, microbatches, collect, forward_only=True)
    return [out["logprobs"] for out in outputs], [float(out["entropy_sum"]) for out in outputs]


class TrainedRole:
    """A role with an optimizer (the policy, the critic): `chunks` wrapped in Megatron DDP (`models`) with one
    optimizer and LR schedule peaking at `lr` (`slimish.trainer.model.wrap_for_training`), saved and loaded with them
    (`slimish.trainer.checkpoint`). Whatever adds parameters to the chunks is installed before this wraps them."""

    def __init__(self, chunks: list, opt_cfg, *, lr: float, total_steps: int):
        from slimish.trainer.model import wrap_for_training

        self.chunks = chunks
        self.models, self.optimizer, self.lr_schedule = wrap_for_training(chunks, opt_cfg, lr=lr,
                                                                          total_steps=total_steps)

    def save(self, path: str, writes=None) -> None:
        from slimish.trainer import checkpoint

        checkpoint.save(self.chunks, self.optimizer, path, lr_schedule=self.lr_schedule, writes=writes)

    def load(self, path: str) -> None:
        from slimish.trainer import checkpoint

        checkpoint.load(self.chunks, self.optimizer, path, lr_schedule=self.lr_schedule)


class Policy(TrainedRole):
    """The trained model: `build()` loaded by `load_weights`, trained at trainer.optimizer.lr, its output layer
    turned into a chunked logprob head."""

    def __init__(self, build: Callable, load_weights: Callable, opt_cfg, *, total_steps: int, chunk_tokens: int):
        chunks = build()
        load_weights(chunks)
        super().__init__(chunks, opt_cfg, lr=opt_cfg.lr, total_steps=total_steps)
        self.head = LogprobHead(self.chunks[-1], chunk_tokens=chunk_tokens)  # the last chunk ends the model

    @property
    def device(self) -> torch.device:
        return module_device(self.chunks[0])

    def logprobs(self, microbatches: list[MicroBatch], *, temperature: float,
                 entropy: bool = False) -> tuple[list[torch.Tensor], list[float]]:
        return forward_logprobs(self.models, self.head, microbatches, temperature=temperature, entropy=entropy)

    def step(self, microbatches: list[MicroBatch], loss: LogprobLoss, *, temperature: float = 1.0,
             scheduled: bool = True) -> tuple[list[dict], float]:
        """One optimizer step of `loss` over `microbatches`: (per-micro-batch metrics, grad norm). `scheduled`: the
        LR schedule advances first (RL steps); SFT steps keep the lr they were given."""
        def loss_fn(mb, hidden):
            return loss(mb, self.head.logprobs(hidden, mb.tokens, temperature=temperature, shard=mb.shard)[0])

        return optimizer_step(self.models, self.optimizer, microbatches, loss_fn,
                              self.lr_schedule if scheduled else None)

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr


class Reference:
    """The frozen initial policy, for KL penalties: `build()` loaded by `load_weights`, no optimizer, no grads."""

    def __init__(self, build: Callable, load_weights: Callable, *, chunk_tokens: int):
        self.chunks = build()
        load_weights(self.chunks)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
        self.head = LogprobHead(self.chunks[-1], chunk_tokens=chunk_tokens)

    def logprobs(self, microbatches: list[MicroBatch], *, temperature: float) -> list[torch.Tensor]:
        return forward_logprobs(self.chunks, self.head, microbatches, temperature=temperature)[0]
