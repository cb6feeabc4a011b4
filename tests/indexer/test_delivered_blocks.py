"""What the bridge probes of the blocks it delivered (`indexer.delivered_blocks`): the canary,
its replacement by a block held from before, the rotating sample, two misses in a row."""

from __future__ import annotations

from indexer.batch import Action, ActionType, Batch, Tier
from indexer.delivered_blocks import DeliveredBlocks

HBM, DRAM = Tier.HBM, Tier.DRAM


def _report(tier: Tier, *keys: int) -> Action:
    return Action(ActionType.REPORT, tier, keys)


def _revoke(tier: Tier, *keys: int) -> Action:
    return Action(ActionType.REVOKE, tier, keys)


def _clear(tier: Tier) -> Action:
    return Action(ActionType.CLEAR_ALL_AT_TIER, tier)


def _delivered(*actions: Action) -> DeliveredBlocks:
    delivered = DeliveredBlocks()
    delivered.applied(Batch("w0", actions))
    return delivered


def test_the_canary_is_a_delivered_block_until_revoked_or_cleared_at_its_tier() -> None:
    delivered = _delivered(_report(HBM, 11, 12))
    assert delivered.canary == (HBM, 11)
    # Newer blocks do not move it; removals elsewhere do not touch it.
    delivered.applied(
        Batch("w0", (_report(HBM, 13), _revoke(HBM, 12), _revoke(DRAM, 11), _clear(Tier.SSD)))
    )
    assert delivered.canary == (HBM, 11)
    assert sorted(p for p in [(HBM, 11), (HBM, 12), (HBM, 13)] if p in delivered) == [
        (HBM, 11),
        (HBM, 13),
    ]
    delivered.applied(Batch("w0", (_clear(HBM),)))
    assert delivered.canary is None and len(delivered) == 0


def test_a_revoked_canary_is_replaced_at_once_by_a_block_held_from_before() -> None:
    """Not by a block of the batch that revoked it: after a loss, that block is one the emptied
    target took, and would hide the loss."""
    delivered = _delivered(_report(HBM, 11, 12), _report(DRAM, 20))
    delivered.applied(Batch("w0", (_report(HBM, 13), _revoke(HBM, 11))))
    assert delivered.canary == (HBM, 12)
    delivered.applied(Batch("w0", (_report(HBM, 14), _clear(HBM))))
    assert delivered.canary == (DRAM, 20)  # another tier's, held from before
    # Only when nothing from before is held does a block of the batch become it.
    delivered.applied(Batch("w0", (_report(HBM, 15), _revoke(DRAM, 20))))
    assert delivered.canary == (HBM, 15)


def test_the_sample_asks_about_every_held_block_in_turn() -> None:
    delivered = _delivered(_report(HBM, *range(100, 140)))  # 40 blocks, 16 a probe
    asked = [delivered.to_ask(16) for _ in range(3)]
    assert all(a[0] == (HBM, 100) for a in asked)  # the canary, every time
    assert {p for a in asked for p in a} == {(HBM, k) for k in range(100, 140)}
    assert all(len(set(a)) == len(a) <= 17 for a in asked)
    # Blocks delivered since join the turn; revoked ones leave it.
    delivered.applied(Batch("w0", (_report(DRAM, 7), _revoke(HBM, *range(101, 130)))))
    later = {p for _ in range(2) for p in delivered.to_ask(16)}
    assert later == {(HBM, 100), *((HBM, k) for k in range(130, 140)), (DRAM, 7)}


def test_a_block_is_lost_once_missing_from_two_answers_in_a_row() -> None:
    delivered = _delivered(_report(HBM, 11, 12, 13))
    asked = delivered.to_ask(16)
    assert delivered.answered(asked, {(HBM, 11), (HBM, 13)}) == []  # 12 missing: maybe a lag
    asked = delivered.to_ask(1)
    assert (HBM, 12) in asked  # asked again, whatever the turn
    assert delivered.answered(asked, {(HBM, 11), (HBM, 12)}) == []  # it was a lag
    asked = delivered.to_ask(16)
    assert delivered.answered(asked, {(HBM, 11)}) == []
    assert delivered.answered(delivered.to_ask(16), {(HBM, 11)}) == [(HBM, 12), (HBM, 13)]
    # A suspect revoked before the next probe is not asked about again.
    delivered = _delivered(_report(HBM, 11, 12))
    assert delivered.answered(delivered.to_ask(16), {(HBM, 11)}) == []
    delivered.applied(Batch("w0", (_revoke(HBM, 12),)))
    asked = delivered.to_ask(16)
    assert asked == [(HBM, 11)]
    assert delivered.answered(asked, {(HBM, 11)}) == []
    delivered.forget()
    assert delivered.to_ask(16) == [] and delivered.canary is None
