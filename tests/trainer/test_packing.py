"""The packing planner and packed micro-batches: budgets hold, every sample once, the same micro-batch count on every
data-parallel rank, and a packed row tells the model where each sample starts."""

from __future__ import annotations

import random

import pytest
import torch

from slimish.trainer.batch import collate, collate_packed
from slimish.trainer.packing import pack, pack_ranks
from tests.kit.samples import sample


def test_bins_hold_the_budget_and_every_index_once():
    rng = random.Random(0)
    lengths = [min(int(rng.lognormvariate(5.0, 1.0)) + 1, 900) for _ in range(64)]
    bins = pack(lengths, 1000)
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert all(sum(lengths[i] for i in b) <= 1000 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 1000) + 1, "near the least count the tokens allow"
    assert pack(lengths, 1000) == bins, "deterministic: every rank computes the same packing"


def test_a_sample_over_the_budget_gets_a_bin_of_its_own():
    assert pack([5, 30, 4], 10) == [[1], [0, 2]]


def test_at_least_min_bins_and_evenly_loaded():
    bins = pack([4, 4, 4, 4], 100, min_bins=2)
    assert [len(b) for b in bins] == [2, 2]


def test_every_rank_gets_the_same_count_even_with_fewer_samples_than_it():
    per_rank = pack_ranks([[9, 9, 9], [2, 2, 2]], 10)  # rank 0 needs 3 micro-batches, rank 1 fits in one
    assert [len(bins) for bins in per_rank] == [3, 3]
    assert all(bins for bins in per_rank[1]), "rank 1 spreads its samples over the 3 rather than idling"
    assert pack_ranks([[9, 9, 9], [2]], 10)[1] == [[0], [], []]  # a micro-batch with nothing in it


def _sample(prompt, response, train=None):
    return sample(prompt_ids=prompt, response_ids=response, loss_mask=train or 1)


def test_a_packed_row_describes_its_samples_to_the_model():
    samples = [_sample([5, 6], [7, 8, 9]), _sample([1, 2, 3], [4], train=[1])]
    mb = collate_packed(samples, pad_id=0, per_token={"rollout_logprobs": [[-1.0, -2.0, -3.0], [-4.0]]})
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert mb.cu_seqlens == [0, 5, 9] and mb.rows == [0, 0] and mb.spans == [(1, 4), (7, 8)]
    params = mb.packed_seq_params()  # what tells the model's attention and RoPE where each sample starts
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 9] and params.max_seqlen_q == 5
    assert mb.loss_mask.tolist() == [[0, 1, 1, 1, 0, 0, 0, 1]]
    assert mb.rollout_logprobs.tolist() == [[0, -1, -2, -3, 0, 0, 0, -4]]
    assert mb.scatter([torch.full((3,), 0.5), torch.full((1,), -2.0)]).tolist() == [[0, 0.5, 0.5, 0.5, 0, 0, 0, -2.0]]
    torch.testing.assert_close(mb.sequence_weights(), torch.tensor([[0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 0, 1.0]]))
    assert mb.trained_samples() == 2


def test_padded_and_packed_batches_map_samples_alike():
    samples = [_sample([5, 6], [7, 8, 9]), _sample([1, 2, 3], [4])]
    padded, packed = collate(samples, pad_id=0), collate_packed(samples, pad_id=0)
    assert padded.packed_seq_params() is None and padded.rows == [0, 1] and padded.spans == [(1, 4), (2, 3)]
    def responses(mb):
        return [mb.loss_mask[row, start:end].tolist() for row, (start, end) in zip(mb.rows, mb.spans)]

    assert responses(padded) == responses(packed) == [[1, 1, 1], [1]]


def test_no_samples_is_one_padding_token_that_trains_nothing():
    mb = collate_packed([], pad_id=0)
    assert mb.tokens.shape == (1, 1) and mb.loss_mask.numel() == 0 and mb.trained_samples() == 0
    assert mb.cu_seqlens == [0, 1]


def test_a_padded_batch_holds_no_mask_and_pins_every_tensor():
    """No [S, S] mask is built (every attention is causal: `slimish.trainer.attention`), and every tensor handed to
    the copy to a GPU has memory of its own: pinning refuses one whose elements share memory (first seen on an
    H200, where an expanded causal mask failed every padded step in `pin_memory`)."""
    samples = [_sample([5, 6], [7, 8, 9]), _sample([1, 2, 3], [4]), _sample([1], [2])]
    mb = collate(samples, pad_id=0)
    copied = []

    def copy(tensor):
        assert torch._debug_has_internal_overlap(tensor) == 0, "elements sharing memory: pin_memory refuses this"
        copied.append(tensor.numel())
        return tensor.clone()

    moved = mb.apply(copy)
    assert sorted(copied) == sorted([mb.tokens.numel(), mb.position_ids.numel(), mb.loss_mask.numel()])
    for name in ("tokens", "position_ids", "loss_mask"):
        assert torch.equal(getattr(moved, name), getattr(mb, name)), name


def test_packed_bounds_stay_on_the_host_unless_asked():
    """The local and SDPA attentions and Megatron's unfused RoPE read a packed row's bounds each layer: on the host
    that is no device sync. Transformer Engine's attention is given them on its device."""
    mb = collate_packed([_sample([5, 6], [7, 8, 9]), _sample([1, 2, 3], [4])], pad_id=0)
    assert mb.packed_seq_params().cu_seqlens_q.device.type == "cpu"
    assert mb.packed_seq_params(torch.device("meta")).cu_seqlens_kv.device.type == "meta"


def test_context_parallel_ranks_hold_balanced_chunks_of_every_sequence():
    """Megatron's load balancing: each sequence in 2 x cp chunks, rank r holding chunks r and 2 cp - 1 - r."""
    from slimish.trainer.context_parallel import ContextShard, local_positions

    assert local_positions([0, 8], 2, 0) == [0, 1, 6, 7] and local_positions([0, 8], 2, 1) == [2, 3, 4, 5]
    assert local_positions([0, 4, 12], 2, 1) == [1, 2, 6, 7, 8, 9]
    shards = [ContextShard.of([0, 4, 12], size=2, rank=r, group=None, device="cpu") for r in range(2)]
    row = torch.arange(12)[None] * 10
    gathered = torch.cat([s.take(row) for s in shards], dim=1).index_select(1, shards[0].order)
    assert torch.equal(gathered, row), "the ranks' shares, gathered rank after rank, put back in row order"
    with pytest.raises(ValueError, match="does not split into 2 x 2 chunks"):
        local_positions([0, 6], 2, 0)


def test_packed_sequences_are_padded_for_context_parallelism():
    """Each sequence padded to a multiple of 2 x cp after its sample (trained on by nothing), bounds at the padded
    ends; a row padded for sequence parallelism only gets a padding segment of its own."""
    samples = [_sample([5, 6], [7, 8, 9]), _sample([1, 2, 3], [4])]
    mb = collate_packed(samples, pad_id=0, sequence_multiple=4)
    assert mb.cu_seqlens == [0, 8, 12] and mb.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0, 1, 2, 3, 4]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert mb.spans == [(1, 4), (10, 11)] and mb.loss_mask.sum() == 4
    row = collate_packed(samples, pad_id=0, multiple_of=4)
    assert row.cu_seqlens == [0, 5, 9, 12] and row.spans == [(1, 4), (7, 8)]
    assert collate(samples, pad_id=0, multiple_of=4).tokens.shape == (2, 8)
