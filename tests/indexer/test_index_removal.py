"""Worker removal is immediate for readers and purged lazily behind them."""

from __future__ import annotations

from indexer.batch import Action, ActionType, Batch, Tier
from indexer.index import PrefixIndex


def store(index: PrefixIndex, worker: str, keys: list[int], tier: Tier = Tier.HBM) -> None:
    index.apply(Batch(worker, (Action(ActionType.REPORT, tier, tuple(keys)),), f"{worker}:1"))


def test_removed_worker_vanishes_at_once_and_is_purged_over_later_applies() -> None:
    index = PrefixIndex(purge_step_blocks=10)
    keys = list(range(1, 101))
    store(index, "gone", keys)
    store(index, "gone", keys[:50], Tier.DRAM)
    store(index, "kept", keys[:30])
    index.match([4, 60], True)
    assert index.remove_worker("gone") == 150
    # Nothing of it is visible, though no block has been purged yet.
    result = index.match_prefix(keys, 0)
    assert [(m.worker_id, m.matched_prefix_blocks) for m in result.matches] == [("kept", 30)]
    assert [wp.worker_id for wp in index.match(keys, False)] == ["kept"]
    assert index.block_size(99) == 0 and index.parent(99) is None
    assert index.num_placements == 30
    by_tier = index.match_prefix_by_tier(keys, 0)
    assert [(m.worker_id, m.matched_blocks) for m in by_tier] == [("kept", 30)]
    # A newcomer storing one of its blocks starts fresh (no stale hit counter or placement).
    store(index, "new", [60])
    assert index.hit_counts([60, 4]) == [(4, 1)]
    assert {p.worker_id for p in index.placements()} == {"kept", "new"}
    for _ in range(20):  # each apply purges ten of its blocks
        store(index, "kept", [1])
    assert index.purge(0)  # nothing left
    stats = index.stats()
    assert (stats.num_blocks, stats.num_placements) == (31, 31)
    # Its slot is reused by the next new worker, with no stale bits.
    store(index, "again", [100])
    assert [wp.worker_id for wp in index.match([100, 20], False)] == ["again", "kept"]


def test_a_worker_removed_and_back_before_the_purge() -> None:
    index = PrefixIndex(purge_step_blocks=1)
    store(index, "w", [1, 2, 3])
    index.remove_worker("w")
    store(index, "w", [2, 3])  # a new incarnation: only what it reports again
    assert [(p.key, p.tier) for p in index.placements("w")] == [(2, Tier.HBM), (3, Tier.HBM)]
    assert index.match_prefix([1, 2], 0).matches == ()
