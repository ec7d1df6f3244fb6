"""Pack samples into micro-batches under a token budget (`trainer.max_tokens_per_micro_batch`).

A packed micro-batch is one row holding several samples back to back (`slimish.trainer.batch.collate_packed`), so no
token is padding and the number of micro-batches follows from the tokens. Every data-parallel rank must run the same
number of micro-batches (Megatron's schedules and the gradient all-reduce assume it): `pack_ranks` packs each rank's
samples into the same count, the smallest that fits the fullest rank.
"""

from __future__ import annotations


def pack(lengths: list[int], budget: int, min_bins: int = 1) -> list[list[int]]:
    """Indices into `lengths` in bins of at most `budget` tokens each, at least `min_bins` of them (non-empty while
    there are as many items). Longest first, each to the least-loaded bin it fits in (opening a bin when none
    fits), so the bins come out even as well as full. A sample longer than the budget gets a bin of its own rather
    than being dropped. Each bin ascending; deterministic, so every rank computes the same packing."""
    bins: list[list[int]] = [[] for _ in range(min(min_bins, len(lengths)))]
    loads = [0] * len(bins)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [b for b in range(len(bins)) if loads[b] + lengths[index] <= budget or not bins[b]]
        if fitting:
            target = min(fitting, key=lambda b: (loads[b], b))
        else:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(index)
        loads[target] += lengths[index]
    return [sorted(b) for b in bins]


def pack_ranks(lengths_per_rank: list[list[int]], budget: int) -> list[list[list[int]]]:
    """`pack` of each rank's lengths into the same number of bins: the least count this greedy finds that packs
    every rank. A rank with fewer samples than that gets empty bins (a micro-batch with nothing to train)."""
    count = 1
    while True:
        packed = [pack(lengths, budget, count) for lengths in lengths_per_rank]
        needed = max(len(bins) for bins in packed)
        if all(len(bins) == needed or len(bins) == len(lengths) for bins, lengths in zip(packed, lengths_per_rank)):
            return [bins + [[] for _ in range(needed - len(bins))] for bins in packed]
        count = needed
