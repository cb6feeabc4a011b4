"""The facts `../shared/data/README.md` verified on the real vLLM 0.32.0 capture, each read
through kvplane's own decoder and translator (the oracles the other capture tests build on).

Asserted elsewhere: the event and block counts (`test_zmq_decode`), every block hash
recomputed from its tokens, values above 2**63 included (`test_vllm_hash`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

from indexer.batch import ActionType, Tier, to_sfixed64
from indexer.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineHash,
)
from indexer.translate import KeyedBlock, TranslateOptions, WorkerTranslator
from indexer.vllm_hash import block_hashes
from indexer.zmq_decode import decode_frames, decode_payload, decode_replay_reply
from tests.indexer.vllm_capture import CAPTURE, TOPIC, live_messages, replay_replies

END_MARKER = [b"", b"", b"\xff" * 8, b""]


def _decoded() -> list[tuple[int, float, tuple[EngineEvent, ...]]]:
    """(seq, receive time, events) of every live message, as the decoder reads them."""
    out = []
    for message in live_messages():
        frames = decode_frames(message.frames)
        out.append((frames.seq, message.recv_time_unix, decode_payload(frames.payload).events))
    return out


def _markers() -> dict[str, float]:
    lines = (CAPTURE / "requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["marker"]: r["time_unix"] for r in records if "marker" in r}


def _clearing_seq(decoded: list[tuple[int, float, tuple[EngineEvent, ...]]]) -> int:
    """The seq of the one message carrying AllBlocksCleared."""
    (seq,) = [s for s, _recv, ev in decoded if any(isinstance(e, AllBlocksCleared) for e in ev)]
    return seq


def _translator() -> WorkerTranslator:
    return WorkerTranslator(TranslateOptions("vllm-0", "10.0.0.1:8000"))


def _revoked(translator: WorkerTranslator, events: list[EngineEvent]) -> set[int]:
    return {
        key
        for batch in translator.translate(events)
        for action in batch.actions
        if action.type is ActionType.REVOKE
        for key in action.hashes
    }


def _reported(translator: WorkerTranslator, events: list[EngineEvent]) -> set[int]:
    return {
        key
        for batch in translator.translate(events)
        for action in batch.actions
        if action.type is ActionType.REPORT
        for key in action.hashes
    }


def test_sixty_messages_one_topic_no_gap_and_the_replay_is_byte_identical() -> None:
    live = [decode_frames(m.frames) for m in live_messages()]
    assert [m.seq for m in live] == list(range(60))
    assert {m.topic for m in live} == {TOPIC}
    replies = replay_replies()
    # The legacy replay: [b"", topic, seq, payload] per batch, the very live bytes, in order,
    # then the end marker.
    assert replies[-1] == END_MARKER
    assert decode_replay_reply(replies[-1]) is None
    assert replies[:-1] == [[b"", *m.frames] for m in live_messages()]
    assert [decode_replay_reply(frames) for frames in replies[:-1]] == live


def test_one_hash_live_in_two_physical_blocks_is_removed_twice() -> None:
    """vLLM stored a hash it already held (a second physical block, with its parent) and later
    removed it twice: the block stays indexed until the second removal."""
    translator = _translator()
    held: Counter[EngineHash] = Counter()
    doubled: set[EngineHash] = set()
    for _seq, _recv, events in _decoded():
        for event in events:
            if isinstance(event, BlockStored) and event.parent_block_hash is not None:
                doubled.update(h for h in event.block_hashes if held[h] > 0)
                held.update(event.block_hashes)
            elif isinstance(event, BlockStored):
                held.update(h for h in event.block_hashes if held[h] == 0)
            elif isinstance(event, BlockRemoved):
                held.subtract(event.block_hashes)
        if doubled:
            break
    (doubled_hash,) = doubled  # the first such store
    key = to_sfixed64(doubled_hash)
    removals: list[tuple[int, int]] = []  # (seq, event index) of each removal of that hash
    before_removals: list[EngineEvent] = []
    for seq, _recv, events in _decoded():
        for i, event in enumerate(events):
            if isinstance(event, BlockRemoved) and doubled_hash in event.block_hashes:
                removals.append((seq, i))
            elif not removals:
                before_removals.append(event)
    assert len(removals) == 2
    translator.translate(before_removals)
    assert translator.live_keys(Tier.HBM)[key] == 2
    (seq, first), (_, second) = removals
    removing = list(_decoded()[seq][2])
    assert key not in _revoked(translator, removing[first : first + 1])
    assert translator.live_keys(Tier.HBM)[key] == 1
    assert key in _revoked(translator, removing[first + 1 : second + 1])


def test_full_report_mode_re_announces_cached_blocks_with_a_nil_parent() -> None:
    """In the `kv_cache_report_mode="full"` phase vLLM sent a BlockStored with a nil parent
    listing blocks it already held: no REPORT, no new copy, and each such block still leaves
    the index at its one removal."""
    p4_start, p5_start = _markers()["P4_start"], _markers()["P5_start"]
    translator = _translator()
    re_announced: set[int] = set()
    decoded = _decoded()
    for _seq, recv, events in decoded[: _clearing_seq(decoded)]:
        for event in events:
            live = translator.live_keys(Tier.HBM)
            keys = (
                [to_sfixed64(h) for h in event.block_hashes]
                if isinstance(event, BlockStored)
                else []
            )
            if (
                isinstance(event, BlockStored)
                and event.parent_block_hash is None
                and keys
                and all(k in live for k in keys)
            ):
                assert p4_start <= recv < p5_start
                assert not _reported(translator, [event])
                assert all(translator.live_keys(Tier.HBM)[k] == live[k] for k in keys)
                re_announced.update(keys)
            else:
                translator.translate([event])
    assert len(re_announced) == 5
    # Before the AllBlocksCleared, each has left the index at its one removal.
    assert not re_announced & set(translator.live_keys())


def test_all_blocks_cleared_comes_one_step_late_without_per_block_removals() -> None:
    """`reset_prefix_cache()` returned at once, but vLLM published nothing until its next
    scheduler step, a request after the reset: AllBlocksCleared then leads that step's batch,
    with no BlockRemoved for the blocks it drops. The translator clears every tier, in place,
    before the step's new blocks, and holds only those afterwards."""
    markers = _markers()
    decoded = _decoded()
    seq, recv, events = decoded[_clearing_seq(decoded)]
    assert recv > markers["P7_start"] > markers["P6_reset_prefix_cache_done"]
    previous_recv = decoded[seq - 1][1]
    assert previous_recv < markers["P6_reset_prefix_cache_call"]  # nothing in between
    assert [type(e) for e in events] == [AllBlocksCleared, BlockStored]
    translator = _translator()
    for _seq, _recv, earlier in decoded[:seq]:
        translator.translate(earlier)
    assert translator.live_keys()
    (batch,) = translator.translate(events)
    assert [(a.type, a.tier) for a in batch.actions] == [
        (ActionType.CLEAR_ALL_AT_TIER, Tier.HBM),
        (ActionType.CLEAR_ALL_AT_TIER, Tier.DRAM),
        (ActionType.CLEAR_ALL_AT_TIER, Tier.SSD),
        (ActionType.REPORT, Tier.HBM),
    ]
    stored = events[1]
    assert isinstance(stored, BlockStored)
    assert set(translator.live_keys()) == {to_sfixed64(h) for h in stored.block_hashes}


def test_every_plain_prompts_root_block_is_keyed_as_its_tokens_hash_alone() -> None:
    """What a `root_block` in GetIndexStats `keyings` rests on: every block the capture stored
    with a nil parent and no extra key (its full-mode re-announcements included) is its
    request's first, so vLLM's hash of its tokens alone, with the engine's seed (the default
    here), is its key, and the translator keeps it as the worker's root block."""
    translator = _translator()
    roots = 0
    for _seq, _recv, events in _decoded():
        for event in events:
            translator.translate([event])
            if not isinstance(event, BlockStored) or event.parent_block_hash is not None:
                continue
            if any(event.extra_keys):
                continue  # a salted prompt: its root is not its tokens' alone
            size = event.block_size or 0
            tokens = event.token_ids[:size]
            assert block_hashes(tokens, size)[0] == event.block_hashes[0]
            assert translator.root_block.block == KeyedBlock(
                tokens, to_sfixed64(event.block_hashes[0])
            )
            roots += 1
    assert roots > 10
    translator.reset()  # a new engine process, perhaps with another seed
    assert translator.root_block.block is None


def test_a_root_block_is_plain_whatever_the_later_blocks_extra_keys() -> None:
    """Only a block's own extra keys enter its key: a prompt whose multimodal item lies past
    its first block (a system prompt, then an image) has a root block keyed as its tokens
    alone, and the translator takes it (checking the first block's extra keys, in O(1));
    one whose first block holds an item is not taken. Before, any extra key in the event
    left the root block unseen, and the check cost a pass over every block of the event."""
    (stored,) = [e for _seq, _recv, events in _decoded()[:1] for e in events]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    size = stored.block_size or 0
    tokens = stored.token_ids[:size]
    assert block_hashes(tokens, size)[0] == stored.block_hashes[0]
    image_later = replace(stored, extra_keys=(None, ("mm-1",), *stored.extra_keys[2:]))
    translator = _translator()
    translator.translate([image_later])
    assert translator.root_block.block == KeyedBlock(tokens, to_sfixed64(stored.block_hashes[0]))
    image_first = replace(stored, extra_keys=(("mm-1",), *stored.extra_keys[1:]))
    translator = _translator()
    translator.translate([image_first])
    assert translator.root_block.block is None
