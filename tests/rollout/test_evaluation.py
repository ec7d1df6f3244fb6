"""pass@k of evaluation during training, against hand computations (the e2e RL test runs evaluation for real)."""

from __future__ import annotations

import pytest

from slimish.rollout.evaluation import pass_at


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0), (4, 4, 1, 1.0), (4, 1, 1, 0.25), (4, 3, 1, 0.75),
    (4, 1, 4, 1.0), (4, 0, 4, 0.0),
    (4, 2, 2, 1 - 1 / 6),   # 1 - C(2,2)/C(4,2): both drawn fail in 1 of the 6 pairs
    (5, 1, 2, 1 - 6 / 10),  # 1 - C(4,2)/C(5,2)
    (3, 2, 2, 1.0),         # only one failing sample: any two drawn include a pass
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at(n, c, k) == pytest.approx(expected)
