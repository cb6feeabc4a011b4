"""`plan_batches`: pooling inputs split into forwards within the token budget, in order."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.pooling import plan_batches


def test_examples() -> None:
    assert plan_batches([], 8) == []
    assert plan_batches([3, 5, 1], 8) == [range(0, 2), range(2, 3)]
    assert plan_batches([20, 2, 2], 8) == [range(0, 1), range(1, 3)]  # too long: alone
    assert plan_batches([2, 20, 2], 8) == [range(0, 1), range(1, 2), range(2, 3)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 64))
def test_batches_cover_every_input_in_order_within_the_budget(
    lengths: list[int], budget: int
) -> None:
    batches = plan_batches(lengths, budget)
    assert [i for batch in batches for i in batch] == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= budget
    # Greedy: the next input would not have fit in the batch before it.
    for before, after in itertools.pairwise(batches):
        assert sum(lengths[i] for i in before) + lengths[after[0]] > budget
