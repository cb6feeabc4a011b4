"""One conformance suite for every index backend: kv_indexer.v1's semantics (WIRE.md section 2)
plus kvplane's extensions (copies, worker removal, snapshots, the per-tier token view).

Runs once per backend registered in backend_factories.FACTORIES (fixture `backend`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from indexer.backend import IndexBackend, PrefixResult, TierPlacements, WorkerPlacements
from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec, Tier
from indexer.memory_backend import MemoryBackend
from indexer.validation import MAX_HASHES_PER_REQUEST, validate_batch

HBM, DRAM, SSD = Tier.HBM, Tier.DRAM, Tier.SSD
FULL, SWA, MAMBA = 1, 2, 4
HBM_MASK, DRAM_MASK, SSD_MASK = 1 << HBM, 1 << DRAM, 1 << SSD


def report(
    tier: Tier,
    hashes: Sequence[BlockKey],
    masks: Sequence[int] = (),
    sizes: Sequence[int] = (),
    *,
    parent: BlockKey | None = None,
    copies: bool = False,
) -> Action:
    return Action(
        ActionType.REPORT, tier, tuple(hashes), tuple(masks), tuple(sizes), parent, copies
    )


def revoke(tier: Tier, hashes: Sequence[BlockKey], copies: bool = False) -> Action:
    return Action(ActionType.REVOKE, tier, tuple(hashes), copies=copies)


def clear(tier: Tier) -> Action:
    return Action(ActionType.CLEAR_ALL_AT_TIER, tier)


async def apply(
    backend: IndexBackend,
    worker: str,
    *actions: Action,
    address: str | None = None,
    spec: CacheSpec | None = None,
) -> None:
    await backend.apply(
        Batch(worker, tuple(actions), f"addr-{worker}" if address is None else address, 0, spec)
    )


def prefix_pairs(result: PrefixResult) -> list[tuple[str, int]]:
    return [(m.worker_id, m.matched_prefix_blocks) for m in result.matches]


async def prefix_of(backend: IndexBackend, worker: str, hashes: Sequence[BlockKey]) -> int:
    result = await backend.match_prefix(hashes, 0)
    return dict(prefix_pairs(result)).get(worker, 0)


def tiers_of(placements: list[WorkerPlacements], worker: str) -> dict[Tier, TierPlacements]:
    for wp in placements:
        if wp.worker_id == worker:
            return {tp.tier: tp for tp in wp.by_tier}
    return {}


# ---------------------------------------------------------------- apply


async def test_actions_apply_in_order(backend: IndexBackend) -> None:
    await apply(backend, "w", revoke(HBM, [1]), report(HBM, [1]))
    await apply(backend, "v", report(HBM, [1]), revoke(HBM, [1]))
    matched = await backend.match([1], False)
    assert [wp.worker_id for wp in matched] == ["w"]


async def test_report_replaces_the_mask_and_keeps_known_sizes(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2], masks=[3, 1], sizes=[16, 16]))
    await apply(backend, "w", report(HBM, [1, 2], masks=[1, 0], sizes=[0, 8]))
    hbm = tiers_of(await backend.match([1, 2], False), "w")[HBM]
    assert hbm.hashes == (1, 2)
    assert hbm.component_masks == (1, 0)
    assert hbm.block_sizes == (16, 8)
    # Empty masks replace too (every hash a legacy whole block); empty sizes keep them.
    await apply(backend, "w", report(HBM, [1, 2]))
    hbm = tiers_of(await backend.match([1, 2], False), "w")[HBM]
    assert (hbm.component_masks, hbm.block_sizes) == ((0, 0), (16, 8))


async def test_block_size_is_per_block_not_per_worker(backend: IndexBackend) -> None:
    await apply(backend, "a", report(HBM, [1], sizes=[16]))
    await apply(backend, "b", report(DRAM, [1]))
    assert tiers_of(await backend.match([1], False), "b")[DRAM].block_sizes == (16,)


async def test_one_block_at_two_tiers_is_two_placements(backend: IndexBackend) -> None:
    await apply(backend, "w", report(DRAM, [1]), report(HBM, [1]))
    stats = await backend.stats()
    assert (stats.num_blocks, stats.num_placements) == (1, 2)
    assert list(tiers_of(await backend.match([1], False), "w")) == [HBM, DRAM]


async def test_revoke_of_unknown_placement_is_a_no_op(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1], sizes=[16]), revoke(DRAM, [1]), revoke(HBM, [99]))
    await apply(backend, "v", revoke(HBM, [1]))  # another worker's placement is not v's
    assert (await backend.stats()).num_placements == 1
    await backend.match([1], True)
    assert tiers_of(await backend.match([1], False), "w")[HBM].block_sizes == (16,)
    assert await backend.hit_counts([1]) == [(1, 1)]


async def test_clear_removes_one_tier_of_one_worker(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2]), report(DRAM, [1]))
    await apply(backend, "v", report(HBM, [1]))
    await apply(backend, "w", clear(HBM))
    matched = await backend.match([1, 2], False)
    assert list(tiers_of(matched, "w")) == [DRAM]
    assert list(tiers_of(matched, "v")) == [HBM]
    assert (await backend.stats()).num_placements == 2


async def test_clear_forgets_the_blocks_it_leaves_without_placements(
    backend: IndexBackend,
) -> None:
    """As after a REVOKE of the last placement: the hit counter and token count go with the
    block, so a later REPORT starts it afresh; a block still held elsewhere keeps both."""
    await apply(backend, "w", report(HBM, [1, 2], sizes=[16, 16]))
    await apply(backend, "v", report(DRAM, [2]))
    await backend.match([1, 2], True)
    await apply(backend, "w", clear(HBM))
    assert await backend.match([1], True) == []
    assert await backend.hit_counts([1, 2]) == [(2, 1)]
    await apply(backend, "x", report(SSD, [1, 2]))
    assert await backend.hit_counts([1, 2]) == [(2, 1)]
    assert tiers_of(await backend.match([1, 2], False), "x")[SSD].block_sizes == (0, 16)


async def test_prefixes_never_count_what_a_clear_or_a_removal_dropped(
    backend: IndexBackend,
) -> None:
    """The worker still holds the first block, so it is scanned on: the later blocks it lost
    to a CLEAR (or with its removal, before it came back) must not count for it."""
    await apply(backend, "w", report(DRAM, [1]), report(HBM, [2, 3]))
    await apply(backend, "w", clear(HBM))
    assert await prefix_of(backend, "w", [1, 2, 3]) == 1
    await apply(backend, "v", report(HBM, [1, 2, 3]))
    await backend.remove_worker("v")
    await apply(backend, "v", report(HBM, [1]))
    assert await prefix_of(backend, "v", [1, 2, 3]) == 1
    view = await backend.match_prefix_by_tier([1, 2, 3], 0)
    assert [(m.worker_id, m.matched_blocks) for m in view] == [("v", 1), ("w", 1)]


async def test_a_report_after_a_clear_in_one_batch_stays(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2]), clear(HBM), report(HBM, [2, 3]))
    assert tiers_of(await backend.match([1, 2, 3], False), "w")[HBM].hashes == (2, 3)
    assert (await backend.stats()).num_placements == 2
    assert await prefix_of(backend, "w", [2, 3]) == 2


async def test_every_batch_overwrites_address_and_spec(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2]))
    assert prefix_pairs(await backend.match_prefix([1, 2], 0)) == [("w", 2)]
    await apply(backend, "w", address="")  # an empty batch refreshes address and spec
    assert prefix_pairs(await backend.match_prefix([1, 2], 0)) == []
    matched = await backend.match([1], False)
    assert [(wp.worker_id, wp.address) for wp in matched] == [("w", "")]
    await apply(backend, "w", address="10.0.0.1:8000")
    result = await backend.match_prefix([1, 2], 0)
    assert [(m.worker_address, m.matched_prefix_blocks) for m in result.matches] == [
        ("10.0.0.1:8000", 2)
    ]
    # A spec with no FULL data on the blocks makes the same placements count 0 ...
    await apply(backend, "w", spec=CacheSpec(components=FULL, full_tier_mask=HBM_MASK))
    assert await prefix_of(backend, "w", [1, 2]) == 0
    # ... and the next batch without a spec makes the worker legacy again.
    await apply(backend, "w")
    assert await prefix_of(backend, "w", [1, 2]) == 2


async def test_reapplying_a_batch_is_idempotent(backend: IndexBackend) -> None:
    batch = Batch("w", (report(HBM, [1, 2], masks=[1, 1], sizes=[4, 4]),), "a", 7)
    await backend.apply(batch)
    first = await backend.match([1, 2], False)
    await backend.apply(batch)
    assert await backend.match([1, 2], False) == first
    assert (await backend.stats()).num_placements == 2


async def test_readers_never_see_half_a_batch(backend: IndexBackend) -> None:
    """A batch is atomic to readers: while batches move a chain between HBM and DRAM (REVOKE
    then REPORT), concurrent prefix queries always find the whole chain, never the gap between
    the two actions. (The in-process memory backend never yields, so only the served and
    Redis backends interleave here.)"""
    chain = list(range(100, 108))
    await apply(backend, "w", report(HBM, chain))

    async def move() -> None:
        for i in range(40):
            src, dst = (HBM, DRAM) if i % 2 == 0 else (DRAM, HBM)
            await apply(backend, "w", revoke(src, chain), report(dst, chain))

    async def read() -> list[int]:
        return [await prefix_of(backend, "w", chain) for _ in range(40)]

    _, *seen = await asyncio.gather(move(), read(), read(), read())
    assert {n for answers in seen for n in answers} == {len(chain)}


async def test_seq_is_observability_only(backend: IndexBackend) -> None:
    """No deduplication or fencing: a batch with a lower seq than one applied before (an
    engine restarted, a bridge resent) is applied all the same."""
    await backend.apply(Batch("w", (report(HBM, [1, 2]),), "a", 10))
    await backend.apply(Batch("w", (revoke(HBM, [2]),), "a", 3))
    await backend.apply(Batch("w", (report(HBM, [3], parent=1),), "a", 3))
    matched = await backend.match([1, 2, 3], False)
    assert tiers_of(matched, "w")[HBM].hashes == (1, 3)


# ---------------------------------------------------------------- MatchExternalKv and hits


async def test_match_order_dedup_and_alignment(backend: IndexBackend) -> None:
    await apply(backend, "b", report(DRAM, [2], masks=[1], sizes=[8]), report(HBM, [3]))
    await apply(backend, "a", report(HBM, [3, 2], masks=[1, 3], sizes=[0, 8]))
    matched = await backend.match([2, 9, 2, 3], False)
    assert [wp.worker_id for wp in matched] == ["a", "b"]  # both first seen on 2: by id
    a, b = tiers_of(matched, "a"), tiers_of(matched, "b")
    assert (a[HBM].hashes, a[HBM].component_masks, a[HBM].block_sizes) == ((2, 3), (3, 1), (8, 0))
    assert list(b) == [HBM, DRAM]
    assert (b[HBM].hashes, b[DRAM].hashes, b[DRAM].component_masks) == ((3,), (2,), (1,))
    matched = await backend.match([3, 2], False)
    assert [wp.worker_id for wp in matched] == ["a", "b"]
    await apply(backend, "c", report(SSD, [9]))
    assert [wp.worker_id for wp in await backend.match([9, 2], False)] == ["c", "a", "b"]


async def test_hits_count_distinct_matched_hashes_only(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2]))
    await apply(backend, "v", report(HBM, [1]))
    assert await backend.hit_counts([1, 2]) == []  # applies never touch counters
    await backend.match([1, 1, 2, 3], True)
    await backend.match([1], True)
    await backend.match([1, 2], False)
    assert await backend.hit_counts([3, 2, 1, 2]) == [(2, 1), (1, 2)]


async def test_hit_counter_lives_while_the_block_has_placements(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1]), report(DRAM, [1]))
    await apply(backend, "v", report(HBM, [2]))
    await backend.match([1, 2], True)
    await apply(backend, "w", revoke(HBM, [1]))  # partial revoke keeps it
    assert await backend.hit_counts([1]) == [(1, 1)]
    await apply(backend, "w", revoke(DRAM, [1]))
    assert await backend.hit_counts([1, 2]) == [(2, 1)]
    await apply(backend, "w", report(HBM, [1]))
    assert await backend.hit_counts([1]) == []


# ---------------------------------------------------------------- MatchExternalKvPrefix


async def test_prefix_first_block_miss(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [2, 3]))
    result = await backend.match_prefix([1, 2, 3], 0)
    assert (result.matches, result.best_prefix_blocks, result.blocks_read) == ((), 0, 1)


async def test_legacy_prefix_spans_tiers_up_to_the_first_gap(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1]), report(DRAM, [2]), report(SSD, [3]))
    await apply(backend, "w", report(HBM, [5]))
    assert await prefix_of(backend, "w", [1, 2, 3, 4, 5]) == 3


async def test_legacy_worker_with_component_data_fails_closed(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2, 3], masks=[0, 1, 0]))
    await apply(backend, "v", report(HBM, [1, 2, 3]))
    assert prefix_pairs(await backend.match_prefix([1, 2, 3], 0)) == [("v", 3)]
    # A mask past the worker's first gap poisons it too (SGLang's indexer scans the whole
    # window), whichever tier holds it and however far the other workers' runs go.
    await apply(backend, "x", report(HBM, [1]), report(DRAM, [3], masks=[1]))
    assert await prefix_of(backend, "x", [1, 2, 3]) == 0
    await apply(backend, "u", report(HBM, [1, 2, 3]), report(HBM, [9], masks=[1]))
    assert await prefix_of(backend, "u", [1, 2, 3, 4, 9]) == 0
    # One whose component data was revoked is legacy again, the index's answer its run.
    await apply(backend, "x", revoke(DRAM, [3]))
    assert await prefix_of(backend, "x", [1, 2, 3]) == 1
    # Any non-zero mask is component detail, bits this revision does not define included.
    await apply(backend, "z", report(HBM, [1, 2], masks=[0, 1 << 8]))
    assert await prefix_of(backend, "z", [1, 2]) == 0
    # Nor does one past max_blocks: the scan ends there.
    await apply(backend, "y", report(HBM, [1, 2]), report(HBM, [3], masks=[1]))
    assert dict(prefix_pairs(await backend.match_prefix([1, 2, 3], 2)))["y"] == 2


async def test_max_blocks_caps_the_prefix(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2, 3, 4]))
    result = await backend.match_prefix([1, 2, 3, 4], 2)
    assert prefix_pairs(result) == [("w", 2)]
    assert result.best_prefix_blocks == 2
    assert prefix_pairs(await backend.match_prefix([1, 2, 3, 4], 9)) == [("w", 4)]


async def test_prefix_output_order_and_exclusions(backend: IndexBackend) -> None:
    await apply(backend, "c", report(HBM, [1, 2]))
    await apply(backend, "b", report(HBM, [1, 2, 3]))
    await apply(backend, "a", report(HBM, [1, 2]))
    await apply(backend, "hidden", report(HBM, [1, 2, 3, 4]), address="")
    await apply(backend, "nothing", report(HBM, [2, 3]))
    result = await backend.match_prefix([1, 2, 3, 4], 0)
    assert prefix_pairs(result) == [("b", 3), ("a", 2), ("c", 2)]
    # The best is the first answer's: a longer prefix without an address is no answer.
    assert result.best_prefix_blocks == 3
    assert [m.worker_address for m in result.matches] == ["addr-b", "addr-a", "addr-c"]


async def test_invalid_specs_match_nothing(backend: IndexBackend) -> None:
    invalid = [
        CacheSpec(components=0, full_tier_mask=HBM_MASK),
        CacheSpec(version=2, components=FULL, full_tier_mask=HBM_MASK),
        CacheSpec(components=FULL | SWA, full_tier_mask=HBM_MASK, swa_tier_mask=HBM_MASK),
    ]
    for i, spec in enumerate(invalid):
        await apply(backend, f"w{i}", report(HBM, [1, 2], masks=[3, 3], sizes=[4, 4]), spec=spec)
        # Without component detail too: an invalid spec is not "no spec" (which would match).
        await apply(backend, f"plain{i}", report(HBM, [1, 2]), spec=spec)
    await apply(
        backend,
        "ok",
        report(HBM, [1, 2], masks=[1, 1]),
        spec=CacheSpec(version=1, components=FULL, full_tier_mask=HBM_MASK),
    )
    assert prefix_pairs(await backend.match_prefix([1, 2], 0)) == [("ok", 2)]


async def test_legacy_placements_do_not_provide_full_under_a_spec(backend: IndexBackend) -> None:
    spec = CacheSpec(components=FULL, full_tier_mask=HBM_MASK | DRAM_MASK)
    await apply(backend, "w", report(HBM, [1, 2, 3], masks=[1, 0, 1]), spec=spec)
    assert await prefix_of(backend, "w", [1, 2, 3]) == 1


async def test_masks_are_taken_as_sent(backend: IndexBackend) -> None:
    """The seed's "FULL is always present on a stored block" is the sender's promise: a mask
    without FULL is stored as sent (not refused, FULL not added) and ends the prefix there;
    bits that name no component, in a mask or a spec, are kept and read by no rule."""
    spec = CacheSpec(
        components=FULL | SWA | 1 << 8,
        swa_window_tokens=16,
        full_tier_mask=HBM_MASK | 1,
        swa_tier_mask=HBM_MASK | 1 << 9,
    )
    masks = [3 | 1 << 8, 3 | 1 << 31, SWA, 3]
    await apply(backend, "w", report(HBM, [1, 2, 3, 4], masks=masks, sizes=[16] * 4), spec=spec)
    assert tiers_of(await backend.match([1, 2, 3, 4], False), "w")[HBM].component_masks == tuple(
        masks
    )
    assert await prefix_of(backend, "w", [1, 2, 3, 4]) == 2


async def test_fact_swa_gap_with_window_100(backend: IndexBackend) -> None:
    spec = CacheSpec(
        components=FULL | SWA,
        swa_window_tokens=100,
        full_tier_mask=HBM_MASK,
        swa_tier_mask=HBM_MASK,
    )
    await apply(backend, "w", report(HBM, [1, 2, 3, 4, 5], [3, 3, 3, 1, 3], [50] * 5), spec=spec)
    assert await prefix_of(backend, "w", [1, 2, 3, 4, 5]) == 3


async def test_fact_swa_head_run_shorter_than_window(backend: IndexBackend) -> None:
    spec = CacheSpec(
        components=FULL | SWA,
        swa_window_tokens=1000,
        full_tier_mask=HBM_MASK,
        swa_tier_mask=HBM_MASK,
    )
    await apply(backend, "w", report(HBM, [1, 2], [3, 3], [16, 16]), spec=spec)
    assert await prefix_of(backend, "w", [1, 2]) == 2


async def test_swa_window_refilled_after_a_gap(backend: IndexBackend) -> None:
    spec = CacheSpec(
        components=FULL | SWA,
        swa_window_tokens=100,
        full_tier_mask=HBM_MASK,
        swa_tier_mask=HBM_MASK,
    )
    masks = [3, 1, 3, 3, 3]
    await apply(backend, "w", report(HBM, [1, 2, 3, 4, 5], masks, [50] * 5), spec=spec)
    assert await prefix_of(backend, "w", [1, 2, 3, 4, 5]) == 5  # run 100 again at index 3
    assert await prefix_of(backend, "w", [1, 2, 3]) == 1


async def test_fact_mamba_only_on_the_boundary_block(backend: IndexBackend) -> None:
    spec = CacheSpec(components=FULL | MAMBA, full_tier_mask=HBM_MASK, mamba_tier_mask=HBM_MASK)
    await apply(backend, "w", report(HBM, [1, 2, 3, 4, 5], masks=[1, 1, 1, 5, 1]), spec=spec)
    assert await prefix_of(backend, "w", [1, 2, 3, 4, 5]) == 4
    assert await prefix_of(backend, "w", [1, 2]) == 0


async def test_swa_and_mamba_both_gate_the_boundary(backend: IndexBackend) -> None:
    """With both, a boundary needs MAMBA there and the SWA window (or head run) ending there:
    block 0 (head run, MAMBA) and block 5 (window of 32 refilled by blocks 4-5, MAMBA)."""
    spec = CacheSpec(
        components=FULL | SWA | MAMBA,
        swa_window_tokens=32,
        full_tier_mask=HBM_MASK,
        swa_tier_mask=HBM_MASK,
        mamba_tier_mask=HBM_MASK,
    )
    all_three = FULL | SWA | MAMBA
    masks = [all_three, FULL | SWA, FULL | SWA, FULL, all_three, all_three]
    await apply(backend, "w", report(HBM, range(1, 7), masks, [16] * 6), spec=spec)
    assert await prefix_of(backend, "w", range(1, 7)) == 6
    assert await prefix_of(backend, "w", range(1, 6)) == 1


async def test_fact_full_on_hbm_then_dram_is_contiguous(backend: IndexBackend) -> None:
    spec = CacheSpec(components=FULL, full_tier_mask=HBM_MASK | DRAM_MASK)
    await apply(
        backend, "w", report(HBM, [1, 2], masks=[1, 1]), report(DRAM, [3, 4], [1, 1]), spec=spec
    )
    assert await prefix_of(backend, "w", [1, 2, 3, 4]) == 4
    hbm_only = CacheSpec(components=FULL, full_tier_mask=HBM_MASK)
    await apply(backend, "w", spec=hbm_only)
    assert await prefix_of(backend, "w", [1, 2, 3, 4]) == 2


async def test_fact_ssd_only_matches_nothing(backend: IndexBackend) -> None:
    spec = CacheSpec(components=FULL, full_tier_mask=HBM_MASK | DRAM_MASK | SSD_MASK)
    await apply(backend, "w", report(SSD, [1, 2], masks=[1, 1]), spec=spec)
    result = await backend.match_prefix([1, 2], 0)
    assert (result.matches, result.best_prefix_blocks) == ((), 0)


async def test_swa_tier_mask_is_its_own(backend: IndexBackend) -> None:
    spec = CacheSpec(
        components=FULL | SWA,
        swa_window_tokens=32,
        full_tier_mask=HBM_MASK | DRAM_MASK,
        swa_tier_mask=HBM_MASK,
    )
    await apply(backend, "w", report(HBM, [1], [3], [16]), report(DRAM, [2, 3], [3, 3], [16, 16]))
    await apply(backend, "w", spec=spec)
    # SWA on DRAM does not count: the head run stops after block 0.
    assert await prefix_of(backend, "w", [1, 2, 3]) == 1


async def test_mamba_tier_mask_is_its_own(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2], [1, 1]), report(DRAM, [2], [MAMBA]))
    full_on_both = HBM_MASK | DRAM_MASK
    spec = CacheSpec(components=FULL | MAMBA, full_tier_mask=full_on_both, mamba_tier_mask=HBM_MASK)
    await apply(backend, "w", spec=spec)
    assert await prefix_of(backend, "w", [1, 2]) == 0  # MAMBA on DRAM is not servable for it
    spec = CacheSpec(components=FULL | MAMBA, full_tier_mask=HBM_MASK, mamba_tier_mask=DRAM_MASK)
    await apply(backend, "w", spec=spec)
    assert await prefix_of(backend, "w", [1, 2]) == 2  # FULL from HBM, MAMBA from DRAM


async def test_spec_fields_of_absent_components_are_ignored(backend: IndexBackend) -> None:
    """swa_window_tokens is "used only when SWA is present"; so are the SWA and MAMBA tier
    masks for a worker whose cache holds neither: a FULL-only worker matches by FULL alone."""
    spec = CacheSpec(
        components=FULL,
        swa_window_tokens=64,
        full_tier_mask=HBM_MASK,
        swa_tier_mask=SSD_MASK,
        mamba_tier_mask=SSD_MASK,
    )
    await apply(backend, "w", report(HBM, [1, 2, 3], [1, 1, 1], [16] * 3), spec=spec)
    assert await prefix_of(backend, "w", [1, 2, 3]) == 3


# ---------------------------------------------------------------- kvplane extensions


async def test_copies_leave_with_the_last_copy(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2], copies=True), report(HBM, [1], copies=True))
    await apply(backend, "w", report(HBM, [1]))  # a plain re-announcement is not a new copy
    await apply(backend, "w", revoke(HBM, [1, 2], copies=True))
    assert await prefix_of(backend, "w", [1]) == 1
    assert await prefix_of(backend, "w", [2]) == 0
    await apply(backend, "w", revoke(HBM, [1], copies=True))
    assert await prefix_of(backend, "w", [1]) == 0
    assert (await backend.stats()).num_placements == 0


async def test_copies_are_counted_per_placement(backend: IndexBackend) -> None:
    # Block 1 has two copies at w's DRAM and at v's HBM; w's single HBM copy is its own.
    await apply(backend, "w", report(HBM, [1]), *[report(DRAM, [1], copies=True)] * 2)
    await apply(backend, "v", *[report(HBM, [1], copies=True)] * 2)
    await apply(backend, "w", revoke(HBM, [1], copies=True))  # its last copy at HBM
    assert set(tiers_of(await backend.match([1], False), "w")) == {DRAM}
    assert set(tiers_of(await backend.match([1], False), "v")) == {HBM}
    await apply(backend, "w", revoke(DRAM, [1], copies=True))
    await apply(backend, "v", revoke(HBM, [1], copies=True))
    assert (await backend.stats()).num_placements == 2
    await apply(backend, "w", revoke(DRAM, [1], copies=True))
    assert [wp.worker_id for wp in await backend.match([1], False)] == ["v"]


async def test_plain_revoke_removes_every_copy(backend: IndexBackend) -> None:
    await apply(backend, "w", *[report(HBM, [1], copies=True)] * 3)
    await apply(backend, "w", revoke(HBM, [1]))
    assert await backend.match([1], False) == []
    await apply(backend, "w", report(HBM, [1], copies=True))
    await apply(backend, "w", revoke(HBM, [1], copies=True))
    assert await backend.match([1], False) == []


async def test_remove_worker(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2]), report(DRAM, [2]), report(HBM, [3], copies=True))
    await apply(backend, "w", report(HBM, [3], copies=True))
    await apply(backend, "v", report(HBM, [1]))
    await backend.match([1, 2], True)
    assert await backend.remove_worker("w") == 4
    assert await backend.remove_worker("w") == 0
    stats = await backend.stats()
    assert [ws.worker_id for ws in stats.workers] == ["v"]
    assert (stats.num_blocks, stats.num_placements) == (1, 1)
    assert prefix_pairs(await backend.match_prefix([1, 2], 0)) == [("v", 1)]
    assert await backend.hit_counts([1, 2]) == [(1, 1)]
    await apply(backend, "w", report(HBM, [2]))  # a removed worker can come back
    assert [wp.worker_id for wp in await backend.match([2], False)] == ["w"]
    assert await backend.hit_counts([2]) == []


async def test_stats_per_worker(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2]), report(DRAM, [2]))
    await apply(backend, "v", address="")
    stats = await backend.stats()
    assert stats.backend == backend.name
    assert [
        (s.worker_id, s.worker_address, s.num_blocks, s.num_placements) for s in stats.workers
    ] == [
        ("v", "", 0, 0),
        ("w", "addr-w", 2, 3),
    ]


async def test_prefix_by_tier_token_view(backend: IndexBackend) -> None:
    await apply(backend, "w", report(HBM, [1, 2], sizes=[16, 16]), report(DRAM, [3], sizes=[8]))
    await apply(backend, "w", report(SSD, [1, 2, 3, 4]))
    await apply(backend, "v", report(DRAM, [1]), address="")
    view = await backend.match_prefix_by_tier([1, 2, 3, 4, 5], 0)
    assert [(m.worker_id, m.matched_blocks, m.matched_tokens) for m in view] == [
        ("w", 3, 40),
        ("v", 1, 16),
    ]
    assert [(t.tier, t.matched_blocks, t.matched_tokens) for t in view[0].tiers] == [
        (HBM, 2, 32),
        (SSD, 4, 40),
    ]
    capped = await backend.match_prefix_by_tier([1, 2, 3, 4, 5], 1)
    assert [(m.worker_id, m.matched_blocks) for m in capped] == [("v", 1), ("w", 1)]
    assert await backend.match_prefix_by_tier([9, 1], 0) == []


async def test_prefix_by_tier_continues_a_prefix_on_disk(backend: IndexBackend) -> None:
    """`any_tier_blocks`: leading blocks held on some tier, SSD included (kvplane's router
    counts the ones past the servable run as loaded from disk); the servable answer and the
    seed's MatchExternalKvPrefix rule stay as they were. A worker with a cache spec counts a
    component on SSD only where its tier mask names SSD; a legacy worker fails closed on
    component data there too."""
    await apply(
        backend,
        "mixed",
        report(HBM, [1, 4], sizes=[16, 16]),
        report(DRAM, [2], sizes=[16]),
        report(SSD, [3, 5], sizes=[16, 8]),
    )
    await apply(backend, "disk", report(SSD, [1, 2, 3]))
    await apply(backend, "device", report(HBM, [1, 2]))
    ssd_spec = CacheSpec(components=FULL, full_tier_mask=HBM_MASK | DRAM_MASK | SSD_MASK)
    await apply(backend, "spec_ssd", report(HBM, [1], [FULL]), report(SSD, [2, 3], [FULL] * 2),
                spec=ssd_spec)  # fmt: skip
    no_ssd = CacheSpec(components=FULL, full_tier_mask=HBM_MASK | DRAM_MASK)
    await apply(backend, "spec_no_ssd", report(HBM, [1], [FULL]), report(SSD, [2], [FULL]),
                spec=no_ssd)  # fmt: skip
    await apply(backend, "masked", report(HBM, [1]), report(SSD, [2], masks=[FULL]))
    view = await backend.match_prefix_by_tier([1, 2, 3, 4, 5, 6], 0)
    got = {m.worker_id: (m.matched_blocks, m.any_tier_blocks, m.any_tier_tokens) for m in view}
    assert got == {
        "mixed": (2, 5, 72),  # HBM, DRAM, then SSD, HBM, SSD
        "disk": (0, 3, 48),  # the sizes are the blocks' (reported by "mixed")
        "device": (2, 2, 32),
        "spec_ssd": (1, 3, 48),
        "spec_no_ssd": (1, 1, 16),
        "masked": (0, 0, 0),
    }
    assert await prefix_of(backend, "mixed", [1, 2, 3, 4, 5]) == 5  # legacy: any tier
    assert await prefix_of(backend, "spec_ssd", [1, 2, 3]) == 1  # the seed: SSD never
    capped = await backend.match_prefix_by_tier([1, 2, 3, 4, 5, 6], 4)
    assert {m.worker_id: m.any_tier_blocks for m in capped}["mixed"] == 4


async def test_prefix_by_tier_token_view_follows_a_workers_component_rule(
    backend: IndexBackend,
) -> None:
    """A hybrid worker whose sliding-window copy of block 3 was evicted holds blocks 1-4 in
    full, but reuses only what the component rule gives: 2 blocks (the window of 32 tokens
    is refilled only at block 5, which it lacks). The token view says no more, on every
    tier; a legacy worker beside it is unaffected."""
    spec = CacheSpec(
        1, FULL | SWA, swa_window_tokens=32, full_tier_mask=HBM_MASK | DRAM_MASK,
        swa_tier_mask=HBM_MASK | DRAM_MASK,
    )  # fmt: skip
    masks = [FULL | SWA, FULL | SWA, FULL, FULL | SWA]
    await apply(backend, "hybrid", report(HBM, [1, 2, 3, 4], masks, [16] * 4), spec=spec)
    await apply(backend, "plain", report(HBM, [1, 2, 3, 4], sizes=[16] * 4))
    view = await backend.match_prefix_by_tier([1, 2, 3, 4], 0)
    assert [(m.worker_id, m.matched_blocks, m.matched_tokens) for m in view] == [
        ("plain", 4, 64),
        ("hybrid", 2, 32),
    ]
    assert [(t.tier, t.matched_blocks) for t in view[1].tiers] == [(HBM, 2)]
    assert await prefix_of(backend, "hybrid", [1, 2, 3, 4]) == 2


async def test_prefix_by_tier_token_view_fails_closed_as_the_legacy_rule_does(
    backend: IndexBackend,
) -> None:
    """A worker without a cache spec that reports component data on a block of its prefix
    gets 0 from MatchExternalKvPrefix (the seed's legacy rule fails closed); the token view
    (MatchTokens, the controller's routing) gives it no more, on any tier. A mask past the
    worker's first gap poisons it too, as SGLang's indexer scans the whole window; one past
    max_blocks poisons nothing; one on a block held only on SSD does, as the seed's scan reads
    SSD."""
    await apply(backend, "masked", report(HBM, [1, 2, 3], masks=[0, FULL, 0]))
    await apply(backend, "plain", report(HBM, [1, 2, 3]))
    await apply(backend, "past_gap", report(HBM, [1]), report(HBM, [3], masks=[FULL]))
    await apply(backend, "on_ssd", report(HBM, [1, 2]), report(SSD, [3], masks=[FULL]))
    view = await backend.match_prefix_by_tier([1, 2, 3], 0)
    assert [(m.worker_id, m.matched_blocks, [t.tier for t in m.tiers]) for m in view] == [
        ("plain", 3, [HBM]),
        ("masked", 0, []),
        ("on_ssd", 0, []),
        ("past_gap", 0, []),
    ]
    assert prefix_pairs(await backend.match_prefix([1, 2, 3], 0)) == [("plain", 3)]
    capped = await backend.match_prefix_by_tier([1, 2, 3], 2)
    assert [(m.worker_id, m.matched_blocks) for m in capped] == [
        ("on_ssd", 2),
        ("plain", 2),
        ("past_gap", 1),
        ("masked", 0),
    ]


async def test_snapshot_round_trip(backend: IndexBackend) -> None:
    spec = CacheSpec(components=FULL | SWA, swa_window_tokens=32, full_tier_mask=6, swa_tier_mask=2)
    await apply(backend, "w", report(HBM, [1, 2, 3], [3, 3, 1], [16, 16, 16]), spec=spec)
    await apply(backend, "w", report(HBM, [4, 5], parent=2), report(DRAM, [2, 3], parent=1))
    await apply(backend, "w", report(HBM, [5], copies=True), report(HBM, [5], copies=True))
    await apply(backend, "v", report(SSD, [7], sizes=[16], parent=5), address="")
    await apply(backend, "idle", address="x")
    batches = [batch async for batch in backend.snapshot()]
    rebuilt = MemoryBackend()
    for batch in batches:
        await rebuilt.apply(batch)
    keys = [1, 2, 3, 4, 5, 7]
    assert await rebuilt.match(keys, False) == await backend.match(keys, False)
    assert (await rebuilt.stats()).workers == (await backend.stats()).workers
    for query in ([1, 2, 3], [1, 2, 4, 5], [7], [2, 3]):
        assert await rebuilt.match_prefix(query, 0) == await backend.match_prefix(query, 0)
    assert await rebuilt.match_prefix_by_tier(keys, 0) == await backend.match_prefix_by_tier(
        keys, 0
    )
    # Block 5's three copies came along: it leaves with the third copy-aware revoke.
    for expected in (["w"], ["w"], []):
        await rebuilt.apply(Batch("w", (revoke(HBM, [5], copies=True),), "addr-w", 0, spec))
        assert [wp.worker_id for wp in await rebuilt.match([5], False)] == expected
    one = [batch async for batch in backend.snapshot("v")]
    assert [b.worker_id for b in one] == ["v"]
    assert all(a.parent is None or a.parent == 5 for b in one for a in b.actions)
    # A REPORT without parent_block_hash states a root: only block 1 has none.
    roots = [
        a.hashes[0]
        async for b in backend.snapshot("w")
        for a in b.actions
        if a.parent is None and not a.copies
    ]
    assert roots == [1]


async def test_a_report_links_each_block_to_the_one_before_it(backend: IndexBackend) -> None:
    # A REPORT states its head's parent; every later block is the child of the one before it
    # (a REPORT without a parent keeps the parents stated before).
    await apply(backend, "w", report(HBM, [1, 2, 3]), report(DRAM, [2, 3]))
    await apply(backend, "w", report(HBM, [4, 5], parent=3))
    rebuilt = MemoryBackend()
    async for batch in backend.snapshot():
        await rebuilt.apply(batch)
    assert [rebuilt.index.parent(k) for k in (1, 2, 3, 4, 5)] == [None, 1, 2, 3, 4]


async def test_a_snapshot_keeps_to_the_wire_limits(backend: IndexBackend) -> None:
    # 300 roots (a REPORT each in a snapshot) and a chain longer than one REPORT may carry:
    # the snapshot is cut into batches a receiver takes, and they rebuild the worker.
    roots = list(range(1, 301))
    await apply(backend, "w", *(report(HBM, [k]) for k in roots[:150]))
    await apply(backend, "w", *(report(HBM, [k]) for k in roots[150:]))
    chain = list(range(1000, 1000 + MAX_HASHES_PER_REQUEST + 16))
    await apply(backend, "w", report(DRAM, chain[:MAX_HASHES_PER_REQUEST]))
    await apply(backend, "w", report(DRAM, chain[MAX_HASHES_PER_REQUEST:], parent=chain[-17]))
    batches = [batch async for batch in backend.snapshot()]
    rebuilt = MemoryBackend()
    for batch in batches:
        validate_batch(batch)  # as the receiving indexer checks it
        await rebuilt.apply(batch)
    assert (await rebuilt.stats()).workers == (await backend.stats()).workers
    assert rebuilt.index.parent(chain[-16]) == chain[-17]
    tail = chain[-40:]
    assert await rebuilt.match_prefix(tail, 0) == await backend.match_prefix(tail, 0)


async def test_prefixes_through_fragmented_placements(backend: IndexBackend) -> None:
    # Block by block the placements keep changing (b holds every other block, a has DRAM
    # copies of every third), so a scan sees a new value at almost every block.
    keys = list(range(5000, 5300))
    await apply(backend, "a", report(HBM, keys[:250]), report(HBM, keys[251:]))
    await apply(backend, "a", report(DRAM, keys[::3]))
    await apply(backend, "b", *(report(HBM, [k]) for k in keys[::2][:150]))
    await apply(backend, "c", report(HBM, keys[:200]))
    result = await backend.match_prefix(keys, 0)
    assert prefix_pairs(result) == [("a", 250), ("c", 200), ("b", 1)]
    assert result.blocks_read == 251
    # a lacks block 250 on every tier; with a DRAM copy of it, a holds the whole chain.
    await apply(backend, "a", report(DRAM, [keys[250]]))
    assert prefix_pairs(await backend.match_prefix(keys, 0)) == [("a", 300), ("c", 200), ("b", 1)]


async def test_long_prefixes_across_scan_chunks(backend: IndexBackend) -> None:
    keys = list(range(1000, 1300))
    await apply(backend, "a", report(HBM, keys[:150]), report(HBM, keys[150:], parent=keys[149]))
    await apply(backend, "b", report(HBM, keys[:100]), report(DRAM, keys[100:150]))
    await apply(backend, "c", report(HBM, keys[:64]), report(HBM, keys[65:]))
    await apply(backend, "d", report(HBM, keys[:257]), report(SSD, keys[257:270]))
    result = await backend.match_prefix(keys, 0)
    assert prefix_pairs(result) == [("a", 300), ("d", 270), ("b", 150), ("c", 64)]
    assert prefix_pairs(await backend.match_prefix(keys, 200)) == [
        ("a", 200),
        ("d", 200),
        ("b", 150),
        ("c", 64),
    ]
