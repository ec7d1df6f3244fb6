"""Token-balanced data-parallel splits: every rank the same number of samples, token loads as even as a greedy
longest-first assignment makes them, the same split on every rank."""

from __future__ import annotations

import random

import pytest

from slimish.trainer.balance import balanced_partition, imbalance


def loads(lengths: list[int], parts: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in part) for part in parts]


def test_equal_counts_and_every_index_once():
    lengths = [5, 1, 9, 3, 3, 7, 2, 8]
    parts = balanced_partition(lengths, 4)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert loads(lengths, parts) == [10, 10, 10, 8]  # 9+1, 8+2, 7+3, 5+3
    assert balanced_partition(lengths, 4) == parts, "deterministic: every rank computes the same split"


def test_a_long_tailed_mix_is_far_more_even_than_contiguous_halves():
    rng = random.Random(0)
    lengths = sorted((int(rng.lognormvariate(6.5, 1.0)) for _ in range(64)), reverse=True)  # worst case for slices
    contiguous = imbalance([sum(lengths[:32]), sum(lengths[32:])])
    balanced = imbalance(loads(lengths, balanced_partition(lengths, 2)))
    assert balanced < 1.01 < contiguous


def test_uneven_counts_are_refused_and_no_tokens_is_balanced():
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_partition([1, 2, 3], 2)
    assert imbalance([0, 0]) == 1.0 and imbalance([3, 1]) == 1.5
