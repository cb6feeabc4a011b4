"""Engine events -> index batches: tiers, key spaces, copies, clears, coalescing, splitting."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.batch import Action, ActionType, Batch, CacheSpec, Component, Tier
from indexer.cache_groups import CacheGroup
from indexer.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineHash,
)
from indexer.index import PrefixIndex, validate_batch
from indexer.keys import block_keys
from indexer.translate import (
    BRIDGE_MEDIUM_MAP,
    HashMode,
    MediumMap,
    TranslateOptions,
    WorkerTranslator,
    read_extra_keys,
    split_actions,
)
from indexer.vllm_hash import block_digests, digest_to_int
from indexer.zmq_decode import decode_payload
from tests.indexer.hybrid_events import hybrid_payload
from tests.indexer.test_zmq_decode import VECTOR_1, VECTOR_2, VECTOR_3
from tests.indexer.vllm_capture import BLOCK_SIZE, NUM_GPU_BLOCKS, LiveModel, live_messages, signed

REPORT, REVOKE, CLEAR = ActionType.REPORT, ActionType.REVOKE, ActionType.CLEAR_ALL_AT_TIER
FULL, SWA, MAMBA = Component.FULL, Component.SWA, Component.MAMBA


def _translator(**kwargs: object) -> WorkerTranslator:
    return WorkerTranslator(TranslateOptions("w0", "10.0.0.1:8000", **kwargs))  # type: ignore[arg-type]


def _actions(batches: list[Batch]) -> list[Action]:
    return [a for b in batches for a in b.actions]


def test_vector_1_report_revoke_and_one_clear_per_configured_tier() -> None:
    batches = _translator(media=BRIDGE_MEDIUM_MAP).translate(decode_payload(VECTOR_1).events, seq=9)
    assert [b.seq for b in batches] == [9]
    assert batches[0].worker_address == "10.0.0.1:8000"
    assert _actions(batches) == [
        Action(REPORT, Tier.HBM, (1234567890123, -987654321), (), (4, 4), 42),
        Action(REVOKE, Tier.SSD, (100, 200)),
        Action(CLEAR, Tier.HBM),
        Action(CLEAR, Tier.DRAM),
        Action(CLEAR, Tier.SSD),
    ]
    only_hbm = _translator(clear_tiers=(Tier.HBM,)).translate(decode_payload(VECTOR_1).events)
    assert [a.tier for a in _actions(only_hbm) if a.type is CLEAR] == [Tier.HBM]


def test_vector_2_nested_tokens_report() -> None:
    batches = _translator(media=BRIDGE_MEDIUM_MAP).translate(decode_payload(VECTOR_2).events)
    assert _actions(batches) == [Action(REPORT, Tier.HBM, (111,), (), (2,), None)]


def test_vector_3_nil_medium_skipped_by_the_bridge_and_hbm_by_default() -> None:
    bridge = _translator(media=BRIDGE_MEDIUM_MAP)
    assert bridge.translate(decode_payload(VECTOR_3).events) == []
    assert bridge.counters.num_skipped_medium == 2
    own = _translator().translate(decode_payload(VECTOR_3).events)
    assert _actions(own) == [
        Action(REPORT, Tier.HBM, (1,), (), (2,), None),
        Action(REVOKE, Tier.HBM, (2,)),
    ]


def test_media_to_tiers_and_external_is_configurable() -> None:
    events = [
        BlockStored((1,), medium="CPU"),
        BlockStored((2,), medium="CPU_PINNED"),
        BlockStored((3,), medium="STORAGE"),
        BlockStored((4,), medium="EXTERNAL"),
        BlockStored((5,), medium="NVME_OF_THE_FUTURE"),
    ]
    translator = _translator()
    tiers = [a.tier for a in _actions(translator.translate(events))]
    assert tiers == [Tier.DRAM, Tier.DRAM, Tier.SSD]
    assert translator.counters.num_skipped_medium == 2
    external = _translator(media=MediumMap(external=Tier.SSD)).translate(events[3:4])
    assert _actions(external)[0].tier is Tier.SSD


def test_hashes_are_normalised_to_sfixed64() -> None:
    digest = bytes(range(24)) + (-2).to_bytes(8, "big", signed=True)
    events = [BlockStored(((1 << 64) - 1, 1 << 63, digest), medium="GPU")]
    (action,) = _actions(_translator().translate(events))
    assert action.hashes == (-1, -(1 << 63), -2)


def _with_digest_hashes(events: list[dict[str, Any]], digests: dict[int, bytes]) -> list[object]:
    """The capture's events as vLLM sends them with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0:
    every block hash (and parent) the full 32-byte digest, recomputed from the tokens;
    `digests` (published int -> digest) grows as BlockStored events chain."""
    out: list[object] = []
    for raw in events:
        event = dict(raw)
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            extra = event["extra_keys"] or [None]
            salt = extra[0][0] if parent is None and extra[0] else None
            chained = None if parent is None else digests[parent]
            computed = block_digests(
                event["token_ids"], BLOCK_SIZE, parent=chained, cache_salt=salt
            )
            digests.update((digest_to_int(d), d) for d in computed)
            event["parent_block_hash"] = chained
        if "block_hashes" in event:
            event["block_hashes"] = [digests[h] for h in event["block_hashes"]]
        out.append(event)
    return out


def test_digest_hashes_index_the_same_keys_as_their_integer_form() -> None:
    """WIRE.md: a raw 32-byte digest goes into the sfixed64 space as its last 8 bytes, an
    unsigned integer as its two's complement; vLLM's integer is those same 8 bytes. The real
    capture re-sent with digests gives the very same batches, in both key spaces."""
    digests: dict[int, bytes] = {}
    for mode in HashMode:
        as_ints, as_digests = _translator(hash_mode=mode), _translator(hash_mode=mode)
        for message in live_messages():
            payload = msgpack.unpackb(message.frames[2], raw=False)
            payload[1] = _with_digest_hashes(payload[1], digests)
            int_batches = as_ints.translate(decode_payload(message.frames[2]).events)
            digest_events = decode_payload(msgpack.packb(payload, use_bin_type=True)).events
            assert not any(
                isinstance(h, int)
                for e in digest_events
                if not isinstance(e, AllBlocksCleared)
                for h in e.block_hashes
            )
            assert as_digests.translate(digest_events) == int_batches
        assert as_digests.live_keys() == as_ints.live_keys()
        assert as_digests.counters.num_unresolved == 0


def test_the_same_hash_live_twice_is_revoked_with_its_last_copy() -> None:
    translator = _translator()
    first = translator.translate([BlockStored((10, 11), medium="GPU")])
    second = translator.translate([BlockStored((11,), parent_block_hash=10, medium="GPU")])
    assert _actions(first) == [Action(REPORT, Tier.HBM, (10, 11), (), (), None)]
    assert second == []  # a second physical copy: already indexed
    assert translator.live_keys() == {10: 1, 11: 2}
    assert translator.translate([BlockRemoved((11,), medium="GPU")]) == []
    assert _actions(translator.translate([BlockRemoved((11,), medium="GPU")])) == [
        Action(REVOKE, Tier.HBM, (11,))
    ]


def test_full_mode_reannouncement_is_not_a_new_copy() -> None:
    translator = _translator()
    translator.translate([BlockStored((10, 11), medium="GPU")])
    assert translator.translate([BlockStored((10, 11, 12), medium="GPU")]) == [
        Batch("w0", (Action(REPORT, Tier.HBM, (12,), (), (), 11),), "10.0.0.1:8000")
    ]
    assert translator.live_keys() == {10: 1, 11: 1, 12: 1}
    revoke = translator.translate([BlockRemoved((10, 11), medium="GPU")])
    assert _actions(revoke) == [Action(REVOKE, Tier.HBM, (10, 11))]


def test_a_hybrid_models_groups_report_component_masks_and_a_cache_spec() -> None:
    """A hybrid model (full attention + sliding window) stores each block in both KV cache
    groups and evicts it from each on its own. Each placement carries the components of the
    groups holding it: the sliding-window group evicting a block leaves it FULL only (not
    unindexed: its second store, with a nil parent, is another group's copy, not a full-mode
    re-announcement), and the batches carry the worker's spec (vLLM's window of 4 tokens: a
    hit needs the 3 tokens before the boundary)."""
    translator = _translator()
    stored = translator.translate(
        [
            BlockStored((10, 11), medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored(
                (10, 11),
                medium="GPU",
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=4,
            ),
        ]
    )
    assert _actions(stored) == [
        Action(REPORT, Tier.HBM, (10, 11), (), (), None),  # legacy until a second kind shows
        Action(REPORT, Tier.HBM, (10, 11), (FULL, FULL), (), None),  # restated under the spec
        Action(REPORT, Tier.HBM, (10, 11), (FULL | SWA, FULL | SWA), (), None),
    ]
    spec = CacheSpec(1, FULL | SWA, 3, 0b110, 0b110, 0)
    assert {b.cache_spec for b in stored} == {spec}
    evicted = translator.translate([BlockRemoved((10,), medium="GPU", group_idx=1)])
    assert _actions(evicted) == [Action(REPORT, Tier.HBM, (10,), (FULL,), (), None)]
    assert evicted[0].cache_spec == spec
    assert translator.live_keys() == {10: 1, 11: 2}
    revoke = translator.translate(
        [
            BlockRemoved((10, 11), medium="GPU", group_idx=0),
            BlockRemoved((11,), medium="GPU", group_idx=1),
        ]
    )
    assert _actions(revoke) == [
        Action(REVOKE, Tier.HBM, (10,)),
        Action(REPORT, Tier.HBM, (11,), (SWA,), (), 10),  # no full-attention copy...
        Action(REVOKE, Tier.HBM, (11,)),  # ...and then no copy at all
    ]


def test_group_kinds_map_to_components_and_unknown_kinds_fail_closed() -> None:
    """Every group of a component must hold a block for the component to be resident (vLLM
    looks a hit up in all groups of one kind together); Mamba and linear attention are MAMBA;
    a kind this code does not know (or none, on a hybrid stream) is needed on every block,
    like full attention; a worker without full attention has FULL wherever a block is."""
    cases = [
        ((("full_attention", None), ("mamba", None)), {0}, FULL),
        ((("full_attention", None), ("mamba", None)), {1}, MAMBA),
        ((("mla_attention", None), ("sliding_window_mla", 8)), {0, 1}, FULL | SWA),
        ((("sliding_window", 8), ("sliding_window", 8)), {0}, FULL),
        ((("sliding_window", 8), ("sliding_window", 8)), {0, 1}, FULL | SWA),
        ((("full_attention", None), ("chunked_local_attention", None)), {0}, 0),
        ((("full_attention", None), ("chunked_local_attention", None)), {0, 1}, FULL),
        ((("full_attention", None), ("sliding_window", 8), (None, None)), {0, 1}, SWA),
    ]
    for kinds, holders, mask in cases:
        translator = _translator()
        index = PrefixIndex()
        for group, (kind, window) in enumerate(kinds):
            stored = BlockStored(
                (1,) if group in holders else (2,),
                medium="GPU",
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
            for batch in translator.translate([stored]):
                index.apply(batch)
        masks = {p.key: p.component_mask for p in index.placements("w0")}
        assert masks[1] == mask, (kinds, holders)


def test_a_plain_stream_stays_legacy_and_configured_groups_make_it_hybrid_at_once() -> None:
    """No kinds, or one full-attention group (the real capture's): legacy placements, no spec.
    Groups configured on the source give the spec from the first batch."""
    for kind in (None, "full_attention"):
        translator = _translator()
        (batch,) = translator.translate(
            [BlockStored((1, 2), medium="GPU", block_size=4, kv_cache_spec_kind=kind)]
        )
        assert batch.cache_spec is None
        assert batch.actions == (Action(REPORT, Tier.HBM, (1, 2), (), (4, 4), None),)
    configured = _translator(
        kv_cache_groups=(CacheGroup("full_attention"), CacheGroup("sliding_window", 1024))
    )
    (batch,) = configured.translate([BlockStored((1, 2), medium="GPU", block_size=4)])
    assert batch.cache_spec == CacheSpec(1, FULL | SWA, 1023, 0b110, 0b110, 0)
    assert batch.actions == (Action(REPORT, Tier.HBM, (1, 2), (FULL, FULL), (4, 4), None),)


def test_a_removal_of_an_unknown_hash_is_passed_on_in_engine_mode() -> None:
    assert _actions(_translator().translate([BlockRemoved((77,), medium="GPU")])) == [
        Action(REVOKE, Tier.HBM, (77,))
    ]


def test_clear_scoped_to_a_medium_and_reset() -> None:
    translator = _translator()
    translator.translate([BlockStored((1,), medium="GPU"), BlockStored((2,), medium="CPU")])
    cleared = translator.translate([AllBlocksCleared(medium="CPU")])
    assert _actions(cleared) == [Action(CLEAR, Tier.DRAM)]
    assert translator.live_keys() == {1: 1}
    reset = translator.reset(seq=5)
    assert reset.seq == 5
    assert [a.tier for a in reset.actions] == [Tier.HBM, Tier.DRAM, Tier.SSD]
    assert translator.num_live_blocks == 0


def test_coalescing_keeps_order_and_parent_links() -> None:
    events: list[EngineEvent] = [
        BlockStored((1, 2), medium="GPU", block_size=4),
        BlockStored((3,), parent_block_hash=2, medium="GPU", block_size=4),  # chains: merges
        BlockStored((9,), parent_block_hash=5, medium="GPU", block_size=4),  # does not chain
        BlockStored((4,), parent_block_hash=3, medium="CPU", block_size=4),  # other tier
        BlockRemoved((1,), medium="GPU"),
        BlockRemoved((2,), medium="GPU"),
        BlockRemoved((4,), medium="CPU"),
    ]
    assert _actions(_translator().translate(events)) == [
        Action(REPORT, Tier.HBM, (1, 2, 3), (), (4, 4, 4), None),
        Action(REPORT, Tier.HBM, (9,), (), (4,), 5),
        Action(REPORT, Tier.DRAM, (4,), (), (4,), 3),
        Action(REVOKE, Tier.HBM, (1, 2)),
        Action(REVOKE, Tier.DRAM, (4,)),
    ]


def test_stores_that_chain_into_a_loop_are_not_merged_into_one_report() -> None:
    """A merged REPORT never closes a parent cycle (SGLang's indexer refuses one that does), so
    the coalescing stops at a store of the run's own parent. (A block of the run again is
    live at that tier: a copy, no REPORT.)"""
    events: list[EngineEvent] = [
        BlockStored((5, 6), parent_block_hash=7, medium="GPU"),
        BlockStored((7,), parent_block_hash=6, medium="GPU"),  # the run's own parent
    ]
    batches = _translator().translate(events)
    assert _actions(batches) == [
        Action(REPORT, Tier.HBM, (5, 6), (), (), 7),
        Action(REPORT, Tier.HBM, (7,), (), (), 6),
    ]
    for batch in batches:
        validate_batch(batch)


def test_restated_masks_of_a_looping_chain_are_not_merged_into_one_report() -> None:
    """A store that states a block of its own run again (2 -> 1 -> 2: block 2 the child of
    its child) takes no REPORT then (2 is live), but a hybrid model's masks restated after it
    (group 0 named: the full-attention bit moves) re-report 2 under its parent 1 right after
    the run 2, 1: merged, that REPORT was (2, 1, 2), which the index refuses (a parent cycle),
    with the rest of its batch. The restatement starts a REPORT of its own, which it takes."""
    events: list[EngineEvent] = [
        BlockStored(
            (2, 1, 2),
            medium="GPU",
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=64,
        ),
        BlockStored((1,), medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
    ]
    batches = _translator().translate(events)
    assert _actions(batches) == [
        Action(REPORT, Tier.HBM, (2, 1), (FULL | SWA, FULL | SWA), (), None),
        Action(REPORT, Tier.HBM, (2,), (SWA,), (), 1),
        Action(REPORT, Tier.HBM, (1,), (SWA,), (), 2),
        Action(REPORT, Tier.HBM, (1,), (FULL | SWA,), (), 2),
    ]
    index = PrefixIndex()
    for batch in batches:
        index.apply(batch)
    assert {p.key: p.component_mask for p in index.placements("w0")} == {1: FULL | SWA, 2: SWA}


def test_oversized_batches_split_within_the_seed_limits_with_the_same_seq() -> None:
    translator = _translator()
    big = translator.translate([BlockStored(tuple(range(1, 40_001)), medium="GPU")], seq=3)
    assert len(big) == 3 and {b.seq for b in big} == {3}
    for batch in big:
        validate_batch(batch)
    hashes = [h for b in big for a in b.actions for h in a.hashes]
    assert hashes == list(range(1, 40_001))
    parents = [a.parent for b in big for a in b.actions]
    assert parents == [None, 16_384, 32_768]
    many = [BlockRemoved((i,), medium="GPU" if i % 2 else "CPU") for i in range(300)]
    split = _translator().translate(many, seq=4)
    assert [len(b.actions) for b in split] == [256, 44]
    chunks = split_actions([Action(REVOKE, Tier.HBM, (1,))] * 3, max_actions=2)
    assert [len(c) for c in chunks] == [2, 1]


def test_canonical_mode_keys_tokens_and_resolves_removals_by_engine_hash() -> None:
    translator = _translator(hash_mode=HashMode.CANONICAL, default_block_size=2)
    tokens = (5, 6, 7, 8, 9, 10)
    keys = block_keys(tokens, 2, cache_salt="tenant-A")
    stored = translator.translate(
        [
            BlockStored((100, 101), token_ids=tokens[:4], extra_keys=(("tenant-A",), None)),
            BlockStored((102,), parent_block_hash=101, token_ids=tokens[4:], block_size=2),
        ]
    )
    assert _actions(stored) == [Action(REPORT, Tier.HBM, tuple(keys), (), (2, 2, 2), None)]
    removed = translator.translate([BlockRemoved((102, 100))])
    assert _actions(removed) == [Action(REVOKE, Tier.HBM, (keys[2], keys[0]))]
    # Unresolvable: no tokens, unknown parent, unknown removal.
    skipped = translator.translate(
        [
            BlockStored((200,)),
            BlockStored((201,), parent_block_hash=999, token_ids=(1, 2)),
            BlockRemoved((555,)),
        ]
    )
    assert skipped == []
    assert translator.counters.num_unresolved == 3
    translator.translate([AllBlocksCleared()])
    assert translator.num_live_blocks == 0


def test_new_blocks_around_live_ones_chain_from_the_block_before_them() -> None:
    """Canonical keys of an event's blocks not live yet, a run of them before and after one
    that is: each run chained from the block before it, as hashing one block at a time."""
    translator = _translator(hash_mode=HashMode.CANONICAL, default_block_size=2)
    tokens = tuple(range(20, 32))
    first = block_keys(tokens[:4], 2)
    translator.translate([BlockStored((1, 2), token_ids=tokens[:4])])
    # 5 and 6 before the live 2, 7 and 8 after it, with a multimodal item on block 7.
    event = BlockStored(
        (5, 6, 2, 7, 8),
        token_ids=tokens[2:12],
        extra_keys=(None, None, None, (("img", 0),), None),
    )
    before = block_keys(tokens[2:6], 2)
    after = block_keys(tokens[8:12], 2, mm_hashes=[["img"], None], parent=first[1])
    assert [k for a in _actions(translator.translate([event])) for k in a.hashes] == [
        *before,
        *after,
    ]


def test_a_live_first_block_keys_the_new_ones_after_it_whatever_its_parent() -> None:
    """The event's parent keys its first block only: with that block live (a second copy),
    the new blocks after it chain from its key, even once the parent is gone from the
    worker (before, the whole event went unresolved and block 3 unindexed)."""
    translator = _translator(hash_mode=HashMode.CANONICAL, default_block_size=2)
    tokens = tuple(range(40, 46))
    keys = block_keys(tokens, 2)
    translator.translate([BlockStored((1, 2), token_ids=tokens[:4])])
    translator.translate([BlockRemoved((1,))])
    event = BlockStored((2, 3), parent_block_hash=1, token_ids=tokens[2:])
    assert [k for a in _actions(translator.translate([event])) for k in a.hashes] == [keys[2]]
    assert translator.counters.num_unresolved == 0


def test_a_live_first_block_new_at_a_tier_is_reported_under_its_parent_not_as_a_root() -> None:
    """The same, the event storing at another tier: block 2 is new there, and its REPORT,
    which a bridge's target reads, states the parent block 2 has (key 1), where the event's
    parent is no longer live (before, none: "block 2 is a root")."""
    translator = _translator(hash_mode=HashMode.CANONICAL, default_block_size=2)
    tokens = tuple(range(40, 46))
    keys = block_keys(tokens, 2)
    translator.translate([BlockStored((1, 2), token_ids=tokens[:4], medium="GPU")])
    translator.translate([BlockRemoved((1,), medium="GPU")])
    event = BlockStored((2, 3), parent_block_hash=1, token_ids=tokens[2:], medium="CPU")
    assert _actions(translator.translate([event])) == [
        Action(REPORT, Tier.DRAM, (keys[1], keys[2]), (), (2, 2), keys[0])
    ]


def _canonical_keys(*events: BlockStored) -> list[int]:
    batches = _translator(hash_mode=HashMode.CANONICAL, default_block_size=2).translate(events)
    return [k for a in _actions(batches) for k in a.hashes]


TOKENS = (5, 6, 7, 8, 9, 10)


def test_lora_name_enters_the_namespace_and_an_empty_one_is_none() -> None:
    lora = block_keys(TOKENS, 2, lora_name="ada")
    # vLLM lists the LoRA name among each block's extra keys too: not a key of its own.
    extra = (("ada",), ("ada",), ("ada",))
    assert _canonical_keys(BlockStored((1, 2, 3), token_ids=TOKENS, lora_name="ada")) == lora
    assert (
        _canonical_keys(BlockStored((1, 2, 3), token_ids=TOKENS, lora_name="ada", extra_keys=extra))
        == lora
    )
    # "" on the wire means no LoRA, the same as MatchTokens' "" (never a namespace of its own).
    plain = block_keys(TOKENS, 2)
    assert _canonical_keys(BlockStored((1, 2, 3), token_ids=TOKENS, lora_name="")) == plain


def test_a_multimodal_id_is_never_taken_for_the_cache_salt() -> None:
    # vLLM's (item id, offset in block) pairs, an item on block 0 of an unsalted request.
    stored = BlockStored(
        (1, 2, 3), token_ids=TOKENS, extra_keys=((("img", 1),), (("img", -1),), None)
    )
    expected = block_keys(TOKENS, 2, mm_hashes=[["img"], ["img"], None])
    assert _canonical_keys(stored) == expected
    # Older vLLM published item ids bare: one that starts in block 0 continues into block 1,
    # which a salt never does.
    bare = BlockStored((1, 2, 3), token_ids=TOKENS, extra_keys=(("img",), ("img",), None))
    assert _canonical_keys(bare) == expected
    # Salted (vLLM 0.32's bare salt after the item's pair), with a LoRA name in front.
    salted = BlockStored(
        (1, 2, 3),
        token_ids=TOKENS,
        lora_name="ada",
        extra_keys=(("ada", ("img", 1), "tenant-A"), ("ada", ("img", -1)), ("ada",)),
    )
    assert _canonical_keys(salted) == block_keys(
        TOKENS, 2, lora_name="ada", cache_salt="tenant-A", mm_hashes=[["img"], ["img"], None]
    )


def test_a_bare_string_is_a_salt_only_where_a_request_starts() -> None:
    """A salt is hashed into a request's first block only: on an event continuing a chain
    (a parent), a bare string alone on its first block is a multimodal id."""
    continuing = BlockStored(
        (2,), parent_block_hash=1, token_ids=TOKENS[:2], extra_keys=(("img",),)
    )
    assert read_extra_keys(continuing) == (None, [["img"]])
    starting = BlockStored((1,), token_ids=TOKENS[:2], extra_keys=(("tenant-A",),))
    assert read_extra_keys(starting) == ("tenant-A", [None])


def test_typed_and_tagged_extra_keys_over_the_wire() -> None:
    typed = [
        [
            {"type": "lora", "name": "ada"},
            {"type": "mm", "modality": "image", "hash": "img", "block_offset": 1},
            {"type": "cache_salt", "salt": "s"},
        ],
        [
            {"type": "lora", "name": "ada"},
            {"type": "mm", "modality": "image", "hash": "img", "block_offset": -1},
        ],
        None,
    ]
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2, 3],
        "parent_block_hash": None,
        "token_ids": list(TOKENS),
        "block_size": 2,
        "lora_name": "ada",
        "extra_keys": typed,
    }
    (stored,) = decode_payload(msgpack.packb([0.0, [event], None])).events
    assert isinstance(stored, BlockStored)
    expected = block_keys(
        TOKENS, 2, lora_name="ada", cache_salt="s", mm_hashes=[["img"], ["img"], None]
    )
    assert _canonical_keys(stored) == expected
    tagged = BlockStored(
        (1, 2, 3), token_ids=TOKENS, extra_keys=((("cache_salt", "s"),), None, None)
    )
    assert _canonical_keys(tagged) == block_keys(TOKENS, 2, cache_salt="s")
    # An explicit salt leaves a bare (older vLLM) multimodal id on block 0 a multimodal id.
    both = BlockStored((1, 2, 3), token_ids=TOKENS, extra_keys=(("img", ("cache_salt", "s")),))
    mm_salted = block_keys(TOKENS, 2, cache_salt="s", mm_hashes=[["img"], None, None])
    assert _canonical_keys(both) == mm_salted
    # SGLang sends the salt as a field; prompt-embedding digests keep a key no token query makes.
    assert _canonical_keys(BlockStored((1, 2, 3), token_ids=TOKENS, cache_salt="s")) == block_keys(
        TOKENS, 2, cache_salt="s"
    )
    embeds = BlockStored((1, 2, 3), token_ids=TOKENS, extra_keys=((b"\x01",), None, None))
    assert _canonical_keys(embeds)[0] not in block_keys(TOKENS, 2)


def _replay_capture(mode: HashMode) -> tuple[WorkerTranslator, PrefixIndex, LiveModel]:
    translator = _translator(hash_mode=mode, default_block_size=BLOCK_SIZE)
    index, model = PrefixIndex(), LiveModel()
    for message in live_messages():
        events = decode_payload(message.frames[2]).events
        for batch in translator.translate(events, seq=message.seq):
            index.apply(batch)
        model.apply(message.events)
        # The index holds exactly the blocks vLLM holds, after every message.
        assert len(list(index.placements("w0"))) == len(model.live())
        assert len(model.live()) <= NUM_GPU_BLOCKS
    return translator, index, model


def test_the_real_capture_in_engine_mode_tracks_vllms_live_set_and_copies() -> None:
    translator, index, model = _replay_capture(HashMode.ENGINE)
    assert {p.key for p in index.placements("w0")} == set(model.live())
    assert translator.live_keys(Tier.HBM) == model.live()
    assert all(p.tier is Tier.HBM for p in index.placements("w0"))


def test_the_real_capture_in_canonical_mode_indexes_token_keys() -> None:
    translator, index, model = _replay_capture(HashMode.CANONICAL)
    canonical: dict[int, int] = {}

    def key_of(h: int) -> int:
        if h not in canonical:
            parent = model.parent[h]
            salt = model.salt[h] if parent is None else None
            chained = None if parent is None else key_of(parent)
            (canonical[h],) = block_keys(
                model.tokens[h], BLOCK_SIZE, cache_salt=salt, parent=chained
            )
        return canonical[h]

    expected = {key_of(h) for h in model.live_unsigned()}
    assert {p.key for p in index.placements("w0")} == expected
    assert translator.counters.num_unresolved == 0
    assert signed(next(iter(model.live_unsigned()))) not in expected


_MEDIA = {"GPU": Tier.HBM, "CPU": Tier.DRAM}
_GROUPS = st.integers(0, 1)  # KV cache groups (a hybrid model's full attention, sliding window)


def _not_its_own_parent(event: BlockStored) -> bool:
    """A store that states no block as its own parent: one that does is refused with its
    batch (validate_batch, as SGLang's indexer refuses it), which the models here leave out.
    Other loops are split into REPORTs that the index takes."""
    chain = (event.parent_block_hash, *event.block_hashes)
    return all(a != b for a, b in pairwise(chain))


_event = st.one_of(
    st.builds(
        lambda hashes, parent, medium, group: BlockStored(
            tuple(hashes), parent, medium=medium, group_idx=group
        ),
        st.lists(st.integers(1, 6), min_size=1, max_size=3),
        st.one_of(st.none(), st.integers(1, 6)),
        st.sampled_from(sorted(_MEDIA)),
        _GROUPS,
    ).filter(_not_its_own_parent),
    st.builds(
        lambda hashes, medium, group: BlockRemoved(tuple(hashes), medium=medium, group_idx=group),
        st.lists(st.integers(1, 6), min_size=1, max_size=3),
        st.sampled_from(sorted(_MEDIA)),
        _GROUPS,
    ),
    st.just(AllBlocksCleared()),
)


def _count_copies(copies: dict[tuple[Tier, int, EngineHash], int], events: list[object]) -> None:
    """The naive model: live copies per (tier, group, hash). A store adds one (a root store
    of a block already held is the same copy again), a removal takes one, a clear drops all."""
    for event in events:
        if isinstance(event, BlockStored):
            tier = _MEDIA[event.medium or ""]
            for h in event.block_hashes:
                live = copies.get((tier, event.group_idx, h), 0)
                if not (event.parent_block_hash is None and live):
                    copies[(tier, event.group_idx, h)] = live + 1
        elif isinstance(event, BlockRemoved):
            tier = _MEDIA[event.medium or ""]
            for h in event.block_hashes:
                if copies.get((tier, event.group_idx, h), 0) > 0:
                    copies[(tier, event.group_idx, h)] -= 1
        else:
            copies.clear()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_event, max_size=4), max_size=12))
def test_copies_and_clears_match_a_naive_model(messages: list[list[object]]) -> None:
    translator = _translator()
    index = PrefixIndex()
    copies: dict[tuple[Tier, int, EngineHash], int] = {}  # (tier, group, hash) -> copies
    for seq, events in enumerate(messages):
        for batch in translator.translate(events, seq=seq):  # type: ignore[arg-type]
            validate_batch(batch)
            index.apply(batch)
        _count_copies(copies, events)
        # A block is indexed at a tier while any group holds a copy of it there.
        expected = {(tier, key) for (tier, _group, key), n in copies.items() if n > 0}
        assert {(p.tier, p.key) for p in index.placements("w0")} == expected


_KINDS = {0: "full_attention", 1: "sliding_window"}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_event, max_size=4), max_size=12), st.booleans())
def test_hybrid_component_masks_match_a_naive_model(
    messages: list[list[object]], configured: bool
) -> None:
    """Group 0 full attention, group 1 a sliding window (named by the events, or configured):
    a block is indexed at a tier while any group holds it there, FULL while group 0 does (or
    any group, until group 0 is known: then the worker looks like a sliding-window-only
    model), SWA while group 1 does; legacy (mask 0, no spec) until the stream shows a sliding
    window."""
    groups = (CacheGroup("full_attention"), CacheGroup("sliding_window", 64))
    translator = _translator(kv_cache_groups=groups if configured else ())
    index = PrefixIndex()
    copies: dict[tuple[Tier, int, EngineHash], int] = {}  # (tier, group, hash) -> copies
    hybrid = full_known = configured
    for seq, events in enumerate(messages):
        named = [
            BlockStored(
                e.block_hashes,
                e.parent_block_hash,
                medium=e.medium,
                group_idx=e.group_idx,
                kv_cache_spec_kind=_KINDS[e.group_idx],
                kv_cache_spec_sliding_window=64 if e.group_idx else None,
            )
            if isinstance(e, BlockStored)
            else e
            for e in events
        ]
        for batch in translator.translate(named, seq=seq):  # type: ignore[arg-type]
            validate_batch(batch)
            index.apply(batch)
        stored = {e.group_idx for e in named if isinstance(e, BlockStored)}
        hybrid = hybrid or 1 in stored
        full_known = full_known or 0 in stored
        _count_copies(copies, named)
        expected: dict[tuple[Tier, EngineHash], int] = {}
        for (tier, group, key), n in copies.items():
            if n > 0:
                bit = (FULL if group == 0 or not full_known else 0) | (SWA if group else 0)
                expected[(tier, key)] = expected.get((tier, key), 0) | (bit if hybrid else 0)
        assert {(p.tier, p.key): p.component_mask for p in index.placements("w0")} == expected
        info = index.worker_info("w0")
        if info is not None:
            assert info[1] == (CacheSpec(1, FULL | SWA, 63, 0b110, 0b110, 0) if hybrid else None)


def test_hybrid_streams_in_map_and_array_form_give_the_seeds_prefix() -> None:
    """Through the decoder (the array form's group fields sit past index 7: `array_tail:
    vllm`) into an index: the sliding-window eviction of block 2 leaves its full-attention
    copy, and the seed's rule then reuses only block 1 (the 32-token window before block 3
    is broken), where a plain model's stream would have matched all three."""
    for form in ("map", "array"):
        events = decode_payload(hybrid_payload(form), array_tail="vllm").events
        index = PrefixIndex()
        for batch in _translator().translate(events):
            validate_batch(batch)
            index.apply(batch)
        masks = {p.key: p.component_mask for p in index.placements("w0")}
        assert masks == {1: FULL | SWA, 2: FULL, 3: FULL | SWA}, form
        assert [
            (m.worker_id, m.matched_prefix_blocks) for m in index.match_prefix([1, 2, 3], 0).matches
        ] == [("w0", 1)], form


def test_events_naming_a_group_override_its_configured_kind_until_a_reset() -> None:
    translator = _translator(
        kv_cache_groups=(CacheGroup("full_attention"), CacheGroup("sliding_window", 1024))
    )
    stored = BlockStored(
        (1,),
        medium="GPU",
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
    )
    (batch,) = translator.translate([stored])
    assert batch.cache_spec == CacheSpec(1, FULL | SWA, 63, 0b110, 0b110, 0)
    assert batch.actions == (Action(REPORT, Tier.HBM, (1,), (SWA,), (), None),)
    assert translator.reset().cache_spec == CacheSpec(1, FULL | SWA, 1023, 0b110, 0b110, 0)
