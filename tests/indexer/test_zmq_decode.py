"""Decoding vLLM / SGLang ZMQ KV-event messages (WIRE.md section 1)."""

from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.engine_events import AllBlocksCleared, BlockRemoved, BlockStored
from indexer.zmq_decode import (
    FrameError,
    PayloadError,
    decode_frames,
    decode_payload,
    decode_replay_reply,
)

CAPTURE = Path(__file__).resolve().parents[3] / "shared" / "data" / "vllm-0.32.0-kv-events"

VECTOR_1 = bytes.fromhex(
    "93cb405edd2f1a9fbe779397ab426c6f636b53746f72656492cf0000011f71fb04cbd2c521974f2a940a141e28"
    "0407a347505593ac426c6f636b52656d6f7665649264ccc8a44449534b91b0416c6c426c6f636b73436c6561"
    "72656402"
)
VECTOR_2 = bytes.fromhex(
    "93cb3ff80000000000009197ab426c6f636b53746f726564916fc092920a1492141e02c0a347505503"
)
VECTOR_3 = bytes.fromhex(
    "93cb00000000000000009297ab426c6f636b53746f7265649101c092050602c0c093ac426c6f636b52656d6f76"
    "65649102c0c0"
)
SEQ7 = (7).to_bytes(8, "big")


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def test_sglang_vector_1_positional_events() -> None:
    batch = decode_payload(VECTOR_1)
    assert batch.ts == 123.456
    assert batch.data_parallel_rank == 2
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=(1234567890123, -987654321),
        parent_block_hash=42,
        token_ids=(10, 20, 30, 40),
        block_size=4,
        lora_id=7,
        medium="GPU",
    )
    assert removed == BlockRemoved(block_hashes=(100, 200), medium="DISK")
    assert cleared == AllBlocksCleared()


def test_sglang_vector_2_nested_token_pairs() -> None:
    batch = decode_payload(VECTOR_2)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (111,)
    assert stored.parent_block_hash is None
    assert stored.token_ids == (10, 20)  # bigram pairs: each pair's first token
    assert stored.block_size == 2
    assert batch.data_parallel_rank == 3


def test_sglang_vector_3_nil_media() -> None:
    batch = decode_payload(VECTOR_3)
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.medium is None
    assert isinstance(removed, BlockRemoved) and removed.medium is None
    assert batch.data_parallel_rank is None


def test_real_vllm_capture_decodes_completely() -> None:
    num_stored = num_removed = num_cleared = num_blocks = 0
    for line in (CAPTURE / "vllm_kv_events.jsonl").read_text().splitlines():
        frames = [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        message = decode_frames(frames)
        assert message.topic == "kv@cpu-0@tiny-llama"
        batch = decode_payload(message.payload)
        assert batch.num_bad_events == batch.num_unknown_events == 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                num_stored += 1
                num_blocks += len(event.block_hashes)
                assert len(event.token_ids) == 32 * len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                num_removed += 1
            else:
                num_cleared += 1
    assert (num_stored, num_blocks, num_removed, num_cleared) == (57, 157, 98, 1)


def test_unsigned_hashes_above_2_63_stay_unsigned_and_bytes_hashes_are_kept() -> None:
    big = (1 << 64) - 5
    digest = bytes(range(32))
    payload = _pack(
        [
            1.0,
            [
                {"type": "BlockStored", "block_hashes": [big], "parent_block_hash": None},
                {"type": "BlockRemoved", "block_hashes": [digest, -3]},
            ],
            None,
        ]
    )
    stored, removed = decode_payload(payload).events
    assert isinstance(stored, BlockStored) and stored.block_hashes == (big,)
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == (digest, -3)


def test_map_envelope_and_unknown_fields_and_types_are_ignored() -> None:
    payload = _pack(
        {
            "ts": 2.0,
            "events": [
                {"type": "BlockStored", "block_hashes": [1], "future_field": {"x": 1}},
                {"type": "SomethingNew", "block_hashes": [2]},
                ["AnotherNewThing", 1, 2],
                {"type": "AllBlocksCleared", "medium": "cpu"},
            ],
            "data_parallel_rank": 1,
            "extra": "ignored",
        }
    )
    batch = decode_payload(payload)
    assert batch.events == (BlockStored(block_hashes=(1,)), AllBlocksCleared(medium="CPU"))
    assert batch.num_unknown_events == 2
    assert batch.unknown_types == ("SomethingNew", "AnotherNewThing")  # named in the log
    assert batch.num_bad_events == 0


def test_a_bad_event_is_skipped_and_its_siblings_kept() -> None:
    good = ["BlockRemoved", [5], "GPU"]
    bad_events = [
        ["BlockStored", "not-a-list"],
        ["BlockStored", [1.5]],
        ["BlockStored", [b""]],
        ["BlockStored", [1], None, [-1], 1],
        ["BlockStored", [1], None, [1], 0],
        ["BlockRemoved", [True]],
        {"type": 7},
        {"no_type": 1},
        42,
        [],
        ["BlockStored", [1], None, None, None, None, 5],
        ["BlockStored", [1], None, None, None, 1.5],  # lora_id
    ]
    batch = decode_payload(_pack([0.0, [good, *bad_events, good], None]))
    assert batch.events == (BlockRemoved((5,), "GPU"), BlockRemoved((5,), "GPU"))
    assert batch.num_bad_events == len(bad_events)


def test_lora_id_is_kept_as_vllms_int_or_a_string_id_and_empty_is_none() -> None:
    events = [
        ["BlockStored", [1], None, [], 1, 7],
        {"type": "BlockStored", "block_hashes": [2], "lora_id": "adapter-uuid"},
        {"type": "BlockStored", "block_hashes": [3], "lora_id": ""},
    ]
    batch = decode_payload(_pack([0.0, events, None]))
    assert [e.lora_id for e in batch.events if isinstance(e, BlockStored)] == [
        7,
        "adapter-uuid",
        None,
    ]


def test_array_tail_is_engine_specific_unless_asked_for() -> None:
    event = ["BlockStored", [1], None, [1, 2], 2, None, "GPU", "salt-or-lora", [["s"]], 1]
    payload = _pack([0.0, [event], None])
    (plain,) = decode_payload(payload).events
    assert isinstance(plain, BlockStored)
    assert plain.lora_name is None and plain.extra_keys == () and plain.group_idx == 0
    (vllm,) = decode_payload(payload, array_tail="vllm").events
    assert isinstance(vllm, BlockStored)
    assert vllm.lora_name == "salt-or-lora"
    assert vllm.extra_keys == (("s",),)
    assert vllm.group_idx == 1


def test_trailing_elements_of_a_batch_or_event_array_are_ignored_as_vllm_ignores_them() -> None:
    """vLLM decodes its EventBatch and events with msgspec `array_like` structs, which skip
    array elements past their fields: a field a newer vLLM appends must not drop the batch."""
    events = [
        ["BlockRemoved", [5], "GPU", 0, "a future field", {"and": "another"}],
        ["AllBlocksCleared", "GPU", "future"],
    ]
    for trailing in (["future"], [{"x": [1, 2]}, None, 3.5]):
        batch = decode_payload(_pack([2.0, events, 3, *trailing]))
        assert (batch.ts, batch.data_parallel_rank) == (2.0, 3)
        assert batch.events == (BlockRemoved((5,), "GPU"), AllBlocksCleared(medium="GPU"))
        assert (batch.num_bad_events, batch.num_unknown_events) == (0, 0)
    # The first three elements are still checked.
    for payload in (_pack([1.0, [], "rank", "future"]), _pack(["ts", [], None, "future"])):
        with pytest.raises(PayloadError):
            decode_payload(payload)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93\xcb\x40",  # truncated
        VECTOR_1[:-7],
        b"\xc1",  # never-used msgpack byte
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4 billion entries
        _pack("just a string"),
        _pack([1.0]),
        _pack(["ts", [], None]),
        _pack([1.0, "events", None]),
        _pack([1.0, [], "rank"]),
        _pack({"ts": 1.0}),
        _pack([float("nan"), [], None]),
        msgpack.packb(msgpack.ExtType(42, b"xx")),
    ],
)
def test_malformed_payloads_raise_payload_error(payload: bytes) -> None:
    with pytest.raises(PayloadError):
        decode_payload(payload)


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), -float("inf")])
def test_a_timestamp_that_is_not_finite_is_named_so(ts: float) -> None:
    with pytest.raises(PayloadError, match=f"EventBatch ts must be finite, got {ts}"):
        decode_payload(_pack([ts, [], None]))


def test_frames() -> None:
    assert decode_frames([b"kv@a", SEQ7, b"p"]).topic == "kv@a"
    message = decode_frames([SEQ7, b"p"])
    assert (message.topic, message.seq, message.payload) == (None, 7, b"p")
    assert decode_frames([b"", SEQ7, b"p"]).topic == ""  # an empty topic is not no topic
    for frames in ([b"x"], [b"a", b"b", b"c", b"d", b"e"], [], [b"t", b"short", b"p"]):
        with pytest.raises(FrameError):
            decode_frames(frames)


def test_replay_replies_with_and_without_topic_and_the_end_marker() -> None:
    with_topic = decode_replay_reply([b"", b"kv@a", SEQ7, b"p"])
    without_topic = decode_replay_reply([b"", SEQ7, b"p"])
    assert with_topic is not None and without_topic is not None
    assert (with_topic.seq, with_topic.topic) == (7, "kv@a")
    assert (without_topic.seq, without_topic.topic) == (7, None)
    empty_topic = decode_replay_reply([b"", b"", SEQ7, b"p"])
    assert empty_topic is not None and empty_topic.topic == ""
    assert decode_replay_reply([b"", b"", b"\xff" * 8, b""]) is None
    assert decode_replay_reply([b"", b"\xff" * 8, b""]) is None
    with pytest.raises(FrameError):
        decode_replay_reply([b"x", SEQ7, b"p"])
    with pytest.raises(FrameError):
        decode_replay_reply([b""])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape_as_other_errors(data: bytes) -> None:
    with contextlib.suppress(PayloadError):
        decode_payload(data)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=5),
            st.lists(st.integers(-5, 2**64 - 1), max_size=3),
            st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2),
        ),
        max_size=12,
    )
)
def test_fuzzed_positional_events_decode_or_are_counted(fields: list[object]) -> None:
    batch = decode_payload(_pack([0.0, [["BlockStored", *fields]], None]))
    assert len(batch.events) + batch.num_bad_events == 1
