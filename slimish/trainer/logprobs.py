"""Per-token log-probabilities and entropy from (vocab-parallel) logits, in fp32, with memory bounded by a chunk.

`LogprobHead` takes the output layer out of the model's forward: the model returns its last hidden states, and the
head applies the output layer to `chunk_tokens` positions at a time, turning each chunk's logits into logprobs (and
entropy) before the next chunk's exist. Under autograd each chunk is checkpointed, so its logits are recomputed in
the backward pass instead of kept: peak memory is one chunk's [tokens, vocab / tp], not sequence x vocabulary.
Nothing gathers the vocabulary: every reduction over it is an all-reduce over the tensor-parallel group.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from slimish.collectives import all_reduce


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # One fresh contiguous tensor whatever the dtype and layout (the CE kernel works in place on its input); x / 1.0
    # is x exactly, so temperature 1 changes no bit.
    return -vocab_parallel_cross_entropy((logits.float() / temperature).contiguous(), targets.contiguous())


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log p_T(tokens[:, i+1] | tokens[:, :i+1]) for logits [B, S, V/tp] and tokens [B, S] -> [B, S-1], where
    p_T = softmax(logits / temperature).

    `temperature` is the sampling temperature of the policy that generated the tokens: SGLang samples from, and
    returns the logprobs of, softmax(logits / T) (`sglang/srt/layers/sampler.py`), so every RL logprob (old, new,
    reference, parity) must be of that same distribution. SFT uses 1.

    Uses Megatron's vocab-parallel cross entropy, which is exact at any TP size (it all-reduces the softmax
    normaliser across the vocab shards); at TP=1 it equals log_softmax + gather.
    """
    return _logprobs_of(logits[:, :-1, :], tokens[:, 1:], temperature)


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the whole vocabulary, from this rank's vocab shard
    [..., V/tp] -> [...]: the max, the normaliser and sum(p * logit) are all-reduced over the tensor-parallel group.
    No gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with torch.no_grad():
        scaled = logits.float() / temperature
        top = scaled.max(dim=-1, keepdim=True).values
        group = parallel_state.get_tensor_model_parallel_group() if dist.is_initialized() else None
        shards = parallel_state.get_tensor_model_parallel_world_size() if group is not None else 1
        if shards > 1:
            top = all_reduce(top, group=group, op="max")
        shifted = scaled - top
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
        if shards > 1:
            sums = all_reduce(sums, group=group)
        return sums[0].log() - sums[1] / sums[0]


def whole_sequence(hidden: torch.Tensor, config) -> torch.Tensor:
    """The last hidden states [s, b, h] whole on every tensor-parallel rank: under sequence parallelism the model
    ends with 1/tp of the sequence on each rank ([s/tp, b, h]), gathered here. Its backward keeps each rank's slice
    of the gradient, which must therefore be the same on every tensor-parallel rank: as it is behind the output
    layer's own input (all-reduced over TP) and behind a head replicated on every rank (the critic's)."""
    if not config.sequence_parallel:
        return hidden
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)


def unwrap_gpt_model(model):
    while hasattr(model, "module"):  # Megatron DDP / Float16Module wrappers
        model = model.module
    return model


class LogprobHead:
    """Installed on a GPTModel (or its wrapper): from then on the model's forward returns its last hidden states
    [B, S, H] on the last pipeline stage instead of logits, and `logprobs` turns those into per-token logprobs.
    Other stages are unchanged (they have no output layer)."""

    def __init__(self, model, *, chunk_tokens: int):
        gpt = unwrap_gpt_model(model)
        self.chunk_tokens = chunk_tokens
        self._layer = gpt.output_layer if gpt.post_process else None
        self._weight = None  # what GPTModel passes as the output weight (the embedding's when they are tied)
        self._config = gpt.config
        if self._layer is not None:
            self._apply = self._layer.forward
            self._layer.forward = self._keep_hidden
            # The head applies the layer to chunks of the whole sequence (`whole_sequence`), not to this rank's
            # sequence-parallel slice: the layer's own gather (and its reduce-scatter backward) would be a second.
            self._layer.sequence_parallel = False

    def _keep_hidden(self, hidden, weight=None, runtime_gather_output=None):
        self._weight = weight
        return whole_sequence(hidden, self._config), None

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
        logits, _ = self._apply(hidden.transpose(0, 1), weight=self._weight)  # [c, B, H] -> [c, B, V/tp]
        logits = logits.transpose(0, 1)
        logprobs = _logprobs_of(logits, targets, temperature)
        return logprobs, (vocab_parallel_entropy(logits, temperature) if entropy else None)

    def logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                 entropy: bool = False, shard=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, S-1] logprobs of tokens[:, 1:] as `token_logprobs` gives them, [B, S-1] entropy or None) from the
        hidden states [B, S, H] the model returned, `chunk_tokens` tokens (at least one position) at a time. Under
        context parallelism (`shard`: `slimish.trainer.context_parallel.ContextShard`) `hidden` holds this rank's
        positions only: each predicts the row's next token, and the results are gathered whole over the group."""
        if shard is None:
            return self._positions(hidden, tokens[:, 1:], temperature, entropy, positions=tokens.shape[1] - 1)
        # Position p predicts token p + 1; the row's last position predicts nothing (its value is cut off below).
        targets = shard.take(torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1))
        logprobs, entropies = self._positions(hidden, targets, temperature, entropy, positions=targets.shape[1])
        return (shard.gather(logprobs)[:, :-1],
                shard.gather(entropies)[:, :-1] if entropies is not None else None)

    def _positions(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, *,
                   positions: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropies) of `targets` [B, positions] at hidden[:, :positions], chunk by chunk."""
        batch = hidden.shape[0]
        step = max(1, self.chunk_tokens // batch)
        logprobs, entropies = [], []
        for start in range(0, positions, step):
            end = min(start + step, positions)
            args = (hidden[:, start:end], targets[:, start:end], temperature, entropy)
            if torch.is_grad_enabled() and hidden.requires_grad:
                lp, ent = checkpoint(self._chunk, *args, use_reentrant=False)
            else:
                lp, ent = self._chunk(*args)
            logprobs.append(lp)
            entropies.append(ent)
        return torch.cat(logprobs, dim=1), (torch.cat(entropies, dim=1) if entropy else None)
