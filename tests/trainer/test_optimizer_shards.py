"""`slimish.trainer.optimizer_shards.boxes`: a flat range of a row-major tensor as regular boxes."""

from __future__ import annotations

import math

import pytest
import torch

from slimish.trainer.optimizer_shards import boxes


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3)])
def test_every_flat_range_is_covered_in_order_by_at_most_2_ndim_minus_1_boxes(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start in range(numel):
        for end in range(start + 1, numel + 1):
            found = boxes(start, end, shape)
            covered = [i for offset, size in found
                       for i in index[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(-1).tolist()]
            assert covered == list(range(start, end)), (start, end, found)
            assert len(found) <= 2 * len(shape) - 1


def test_an_empty_range_is_no_box():
    assert boxes(3, 3, (2, 4)) == []
