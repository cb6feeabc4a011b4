"""Parent links: derived from the chain order of each worker's REPORTs (not stored per block),
with the rules the index module states."""

from __future__ import annotations

import pytest

from indexer.batch import Action, ActionType, Batch, BlockKey, Tier
from indexer.index import PrefixIndex


def report(
    index: PrefixIndex, worker: str, keys: list[BlockKey], parent: BlockKey | None = None
) -> None:
    action = Action(ActionType.REPORT, Tier.HBM, tuple(keys), parent=parent)
    index.apply(Batch(worker, (action,), f"{worker}:1"))


def revoke(index: PrefixIndex, worker: str, keys: list[BlockKey]) -> None:
    index.apply(Batch(worker, (Action(ActionType.REVOKE, Tier.HBM, tuple(keys)),), f"{worker}:1"))


def test_a_chain_links_each_block_to_the_one_before_and_its_head_to_the_stated_parent() -> None:
    index = PrefixIndex()
    report(index, "w", [1, 2, 3])
    report(index, "w", [4, 5], parent=2)
    assert [index.parent(k) for k in (1, 2, 3, 4, 5)] == [None, 1, 2, 2, 4]
    assert index.children(2) == [3, 4]
    assert index.subtree_blocks(2) == 4
    assert index.parent_first_order() == [1, 2, 3, 4, 5]


def test_a_report_without_a_parent_keeps_the_one_stated_while_the_worker_held_the_block() -> None:
    index = PrefixIndex()
    report(index, "w", [1, 2])
    report(index, "w", [2, 9])  # restates block 2 without its parent
    assert index.parent(2) == 1
    assert index.parent(9) == 2


def test_a_parent_stated_before_the_worker_lost_the_block_does_not_come_back() -> None:
    index = PrefixIndex()
    report(index, "w", [1, 2])
    revoke(index, "w", [2])  # block 2 leaves the index
    report(index, "w", [2])  # new again, stored with no parent
    assert index.parent(2) is None
    report(index, "v", [1, 2])
    revoke(index, "w", [2])
    report(index, "w", [2])  # back on w (v still holds it and states parent 1)
    assert index.parent(2) == 1
    revoke(index, "v", [2])  # only w's statement is left: none
    assert index.parent(2) is None
    report(index, "x", [1, 2])
    report(index, "y", [2, 3])
    revoke(index, "x", [2])  # y holds block 2 (and stated no parent for it)
    report(index, "x", [2])  # x stores it again, with no parent
    assert index.parent(2) is None


def test_holders_that_disagree_give_the_smallest_worker_ids_parent() -> None:
    index = PrefixIndex()
    report(index, "b", [7], parent=1)
    report(index, "a", [7], parent=2)
    assert index.parent(7) == 2
    revoke(index, "a", [7])
    assert index.parent(7) == 1


def test_log_compaction_keeps_every_parent_and_bounds_the_log() -> None:
    index = PrefixIndex()
    chains = [list(range(100 * c + 1, 100 * c + 65)) for c in range(4)]
    for c, keys in enumerate(chains):
        report(index, "w", keys, parent=None if c == 0 else chains[c - 1][-1])
    before = {k: index.parent(k) for keys in chains for k in keys}
    for _ in range(200):  # re-announcements grow the log until it is compacted
        report(index, "w", chains[1][:40], parent=chains[0][-1])
    worker = index._workers["w"]
    assert worker.log_len <= 2 * worker.num_blocks + 4096
    assert len(worker.log) < 200
    assert {k: index.parent(k) for keys in chains for k in keys} == before


def test_snapshot_rebuilds_the_parents() -> None:
    index = PrefixIndex()
    report(index, "w", [1, 2, 3])
    report(index, "w", [4], parent=2)
    report(index, "v", [4, 5], parent=8)
    rebuilt = PrefixIndex()
    for batch in index.snapshot():
        rebuilt.apply(batch)
    assert [rebuilt.parent(k) for k in range(1, 6)] == [index.parent(k) for k in range(1, 6)]
    assert [index.parent(k) for k in range(1, 6)] == [None, 1, 2, 8, 4]


def test_chains_stored_a_block_at_a_time_compact_into_one_log_entry_each() -> None:
    index = PrefixIndex()
    chains = [[1000 * c + i for i in range(1, 51)] for c in range(8)]
    for i in range(50):  # eight requests' chains, interleaved block by block
        for keys in chains:
            report(index, "w", [keys[i]], parent=keys[i - 1] if i else None)
    list(index.snapshot())  # compacts the log
    assert len(index._workers["w"].log) == 8
    assert [index.parent(keys[-1]) for keys in chains] == [keys[-2] for keys in chains]


def test_a_cycle_closed_across_batches_survives_a_snapshot_round_trip() -> None:
    """REPORTs of two batches can close a parent cycle, and the snapshot states it in two
    REPORTs, split at the parent (none states its head as its own parent, which
    validate_batch refuses), so a rebuild takes it and holds every parent as stated."""
    index = PrefixIndex()
    report(index, "w", [1, 2, 3])
    report(index, "w", [1], parent=3)  # 1 -> 3 -> 2 -> 1
    rebuilt = PrefixIndex()
    for batch in index.snapshot():
        rebuilt.apply(batch)
    assert [rebuilt.parent(k) for k in (1, 2, 3)] == [index.parent(k) for k in (1, 2, 3)]
    assert [index.parent(k) for k in (1, 2, 3)] == [3, 1, 2]


@pytest.mark.parametrize(
    ("keys", "parent"),
    [([5, 6, 6], None), ([5, 6], 6), ([5, 6, 8, 5], None), ([5, 6, 6, 7], 4), ([5, 5], None)],
    ids=["repeat", "parent-down-the-chain", "loop", "repeat-mid-chain", "repeated-head"],
)
def test_a_report_looping_down_its_chain_survives_a_snapshot_round_trip(
    keys: list[BlockKey], parent: BlockKey | None
) -> None:
    """A REPORT whose chain loops further down is taken (docs/indexer.md); its snapshot
    states no head as its own parent (validate_batch refuses that), so a rebuild takes it and
    holds the same blocks."""
    index = PrefixIndex()
    report(index, "w", keys, parent=parent)
    snapshot = list(index.snapshot())
    assert all(a.parent != a.hashes[0] for batch in snapshot for a in batch.actions)
    rebuilt = PrefixIndex()
    for batch in snapshot:
        rebuilt.apply(batch)
    distinct = list(dict.fromkeys(keys))
    assert rebuilt.match_prefix(distinct, 0) == index.match_prefix(distinct, 0)
    assert [m.matched_prefix_blocks for m in rebuilt.match_prefix(distinct, 0).matches] == [
        len(distinct)
    ]
