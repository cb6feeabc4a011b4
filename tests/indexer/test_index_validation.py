"""kv_indexer.v1's validation rules (WIRE.md section 2), shared by every backend and adapter:
a rejected batch changes nothing."""

from __future__ import annotations

from typing import Any, cast

import pytest

from indexer.batch import Action, ActionType, Batch, CacheSpec, Tier
from indexer.index import (
    MAX_INTERNED_SIZES,
    IndexRequestError,
    PrefixIndex,
    ValidationKind,
    validate_action_type,
    validate_batch,
    validate_match,
    validate_prefix_match,
    validate_tier,
)

INVALID, EXHAUSTED = ValidationKind.INVALID_ARGUMENT, ValidationKind.RESOURCE_EXHAUSTED


def report(hashes: tuple[int, ...], **fields: Any) -> Action:
    return Action(ActionType.REPORT, Tier.HBM, hashes, **fields)


def kind_of(batch: Batch) -> ValidationKind:
    with pytest.raises(IndexRequestError) as info:
        validate_batch(batch)
    return info.value.kind


def test_valid_batches_pass() -> None:
    validate_batch(Batch("w", ()))  # empty: refreshes address and spec
    validate_batch(
        Batch(
            "w",
            (
                report((1, 2), component_masks=(1, 3), block_sizes=(16, 16)),
                Action(ActionType.REVOKE, Tier.SSD, (1,)),
                Action(ActionType.CLEAR_ALL_AT_TIER, Tier.DRAM),
            ),
        )
    )
    validate_batch(Batch("w", tuple(report((i,)) for i in range(256))))
    validate_batch(Batch("w", (report(tuple(range(16_384))),)))


@pytest.mark.parametrize(
    ("batch", "kind"),
    [
        (Batch("", ()), INVALID),
        (Batch("w", tuple(report((i,)) for i in range(257))), EXHAUSTED),
        (Batch("w", (report(tuple(range(16_000))), report(tuple(range(385))))), EXHAUSTED),
        (Batch("w", (report(()),)), INVALID),
        (Batch("w", (Action(ActionType.REVOKE, Tier.HBM, ()),)), INVALID),
        (Batch("w", (report((1, 2), component_masks=(1,)),)), INVALID),
        (Batch("w", (report((1, 2), block_sizes=(1, 2, 3)),)), INVALID),
        (Batch("w", (Action(ActionType.CLEAR_ALL_AT_TIER, cast(Tier, 0)),)), INVALID),
        (Batch("w", (Action(cast(ActionType, 0), Tier.HBM, (1,)),)), INVALID),
        (Batch("w", (Action(ActionType.REPORT, cast(Tier, 0), (1,)),)), INVALID),
    ],
)
def test_invalid_batches(batch: Batch, kind: ValidationKind) -> None:
    assert kind_of(batch) is kind


def test_a_misaligned_action_is_named_with_its_counts() -> None:
    masks = Batch("w", (report((1,)), report((1, 2), component_masks=(1,))))
    sizes = Batch("w", (report((1, 2), block_sizes=(1, 2, 3)),))
    for batch, message in (
        (masks, "action 1: 1 component_masks for 2 hashes"),
        (sizes, "action 0: 3 block_sizes for 2 hashes"),
    ):
        with pytest.raises(IndexRequestError) as info:
            validate_batch(batch)
        assert str(info.value) == message


def test_rejected_batch_changes_nothing() -> None:
    index = PrefixIndex()
    index.apply(Batch("w", (report((1,)),), "a"))
    bad = Batch("w", (Action(ActionType.REVOKE, Tier.HBM, (1,)), report((2, 3), block_sizes=(1,))))
    with pytest.raises(IndexRequestError):
        index.apply(Batch(bad.worker_id, bad.actions, "b", cache_spec=CacheSpec(components=1)))
    assert [(p.worker_id, p.key) for p in index.placements()] == [("w", 1)]
    assert index.worker_info("w") == ("a", None)


def test_ever_new_token_counts_are_kept_but_not_all_interned() -> None:
    """Token counts are checked only as uint32: a misbehaving source may report a new one in
    every REPORT. Each is kept with its block, but the index's table of shared counts stops
    growing at MAX_INTERNED_SIZES instead of keeping every count ever seen."""
    index = PrefixIndex()
    blocks = MAX_INTERNED_SIZES + 100
    for key in range(blocks):
        index.apply(Batch("w", (report((key,), block_sizes=(1_000_000 + key,)),)))
    assert [index.block_size(key) for key in range(blocks)] == [
        1_000_000 + key for key in range(blocks)
    ]
    assert len(index._size_values) == MAX_INTERNED_SIZES


def test_wire_enums() -> None:
    assert validate_tier(3) is Tier.SSD
    assert validate_action_type(3) is ActionType.CLEAR_ALL_AT_TIER
    for bad in (0, 4, -1):
        with pytest.raises(IndexRequestError):
            validate_tier(bad)
        with pytest.raises(IndexRequestError):
            validate_action_type(bad)


def test_match_limits() -> None:
    validate_match([1])
    validate_match(list(range(16_384)))
    validate_prefix_match(list(range(100_000)))  # prefix queries have no length cap
    for check, hashes, kind in [
        (validate_match, [], INVALID),
        (validate_match, list(range(16_385)), EXHAUSTED),
        (validate_prefix_match, [], INVALID),
    ]:
        with pytest.raises(IndexRequestError) as info:
            check(hashes)
        assert info.value.kind is kind


U32, I64 = 1 << 32, 1 << 63


@pytest.mark.parametrize(
    "batch",
    [
        Batch("w", (report((1,), block_sizes=(U32,)),)),
        Batch("w", (report((1, 2), component_masks=(1, -1)),)),
        Batch("w", (), cache_spec=CacheSpec(swa_window_tokens=U32)),
    ],
)
def test_values_beyond_their_wire_width_are_invalid(batch: Batch) -> None:
    """Values from adapters that do not go through the proto (ZMQ) get the proto's ranges:
    uint32 masks, sizes and spec fields (the Redis records' widths too)."""
    assert kind_of(batch) is INVALID
    validate_batch(
        Batch(
            "w",
            (report((I64 - 1, -I64), component_masks=(0, U32 - 1), block_sizes=(U32 - 1, 0)),),
            cache_spec=CacheSpec(version=U32 - 1),
        )
    )


@pytest.mark.parametrize(
    "batch",
    [
        Batch("w", (Action(ActionType.REPORT, Tier.HBM, (1 << 63,)),)),
        Batch("w", (Action(ActionType.REPORT, Tier.HBM, (1,), parent=-(1 << 63) - 1),)),
        Batch("w", (Action(ActionType.REPORT, Tier.HBM, ("x",)),)),  # type: ignore[arg-type]
        Batch(5, (Action(ActionType.REPORT, Tier.HBM, (1,)),)),  # type: ignore[arg-type]
    ],
)
def test_keys_outside_sfixed64_and_non_string_worker_ids_are_invalid(batch: Batch) -> None:
    with pytest.raises(IndexRequestError):
        validate_batch(batch)
