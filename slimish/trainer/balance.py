"""Token-balanced splits of a step's samples over data-parallel ranks.

Every rank must run the same number of micro-batches (Megatron's schedules and the gradient all-reduce assume it),
so each rank gets the same number of samples; within that, the samples' token counts are balanced so that no rank
straggles with the long responses. The loss needs nothing from the split: its normaliser is the whole minibatch's
(`TrainerWorker.train`), so the gradient is the same whatever rank a sample lands on.
"""

from __future__ import annotations


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices into `lengths` in `parts` lists of len(lengths) / parts each (it must divide), with sums as even as
    a greedy assignment makes them: longest first, each to the lightest part that still has room (LPT with a
    cardinality bound). Each list ascending; ties go to the lower part, so every rank computes the same split."""
    if parts <= 0 or len(lengths) % parts:
        raise ValueError(f"{len(lengths)} items do not split evenly into {parts} parts")
    room = len(lengths) // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(parts) if len(members[p]) < room), key=lambda p: (loads[p], p))
        members[part].append(index)
        loads[part] += lengths[index]
    return [sorted(m) for m in members]


def imbalance(loads: list[int]) -> float:
    """max / mean of per-rank token loads (1.0 = perfectly even; 1.0 for no tokens at all)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0
