"""Decode vLLM / SGLang KV-event messages from ZMQ (WIRE.md section 1) into engine events.

Pure: bytes in, `indexer.engine_events` out. The contract:

- live messages are `[topic, seq, payload]` or `[seq, payload]` (topic None: no topic frame,
  unlike an empty one); `seq` is 8 bytes big-endian unsigned; any other frame count or seq
  width is a `FrameError`;
- replay replies are the same behind an empty delimiter frame, and the end marker is
  `[b"", b"", ff*8, b""]` (or without the topic frame);
- the payload is msgpack `[ts, events, data_parallel_rank]` (or a map with those keys); a
  payload that does not decode to that envelope is a `PayloadError` (the message is dropped);
  an envelope array longer than three has its trailing elements ignored (not checked, not
  counted), as vLLM's msgspec structs (`array_like`, unknown fields allowed) decode it: a
  field a newer vLLM appends must not cost whole batches. Fewer than two elements, or a
  wrong type in the first three, is still a `PayloadError`;
- each event is a map with a `"type"` tag or an array with the tag first; unknown tags and
  unknown fields are ignored (an array's elements past its layout too, as vLLM's decoder
  ignores them); an event with a malformed field is skipped and counted, its
  siblings are kept; a value too large for the index's fields (a block_size above uint32)
  makes the event malformed; decoding never raises anything but a `KvEventDecodeError`,
  whatever the input (deep nesting included);
- hashes are ints in [-2**63, 2**64) or non-empty bytes, kept as sent; token ids are flat or
  nested pairs (SGLang's bigram keys: a pair's first element is the block's token).

Positional (array) events: indices 1-6 mean the same for every engine; index >= 7 differs
between engines (vLLM: lora_name, extra_keys, group_idx, spec kind, window; some SGLang
builds: component types or the cache salt), so it is read only with `array_tail="vllm"`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from indexer.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineHash,
    EventBatch,
)
from indexer.validation import MAX_UINT32
from kvplane.errors import KvplaneError
from kvplane.unpack_failure import unpack_failure

# How positional events' fields at index >= 7 are read: as vLLM's, or not at all.
ArrayTail = Literal["ignore", "vllm"]

SEQ_BYTES = 8
END_MARKER_SEQ = (1 << 64) - 1  # ff * 8: the replay end marker's seq
MAX_PAYLOAD_BYTES = 64 << 20
_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_MAX_TOKEN_ID = MAX_UINT32
# Extra keys nested deeper than this are malformed (real ones are a few levels deep).
MAX_EXTRA_KEY_DEPTH = 16


class KvEventDecodeError(KvplaneError):
    """A KV-event message that cannot be decoded; the message is counted and dropped."""


class FrameError(KvEventDecodeError):
    """Wrong number of frames or a malformed seq frame."""


class PayloadError(KvEventDecodeError):
    """The payload is not msgpack or not an EventBatch envelope."""


class EventDecodeError(KvEventDecodeError):
    """One event is malformed; it is skipped and its siblings are kept."""


@dataclass(frozen=True, slots=True)
class ZmqMessage:
    # None: the message had no topic frame (`[seq, payload]`, older vLLM's replay replies),
    # which is not the same as an empty one (a publisher whose topic is "").
    topic: str | None
    seq: int
    payload: bytes


def decode_frames(frames: Sequence[bytes]) -> ZmqMessage:
    """A live PUB message: `[topic, seq, payload]` or `[seq, payload]`."""
    if len(frames) == 3:
        topic, seq, payload = frames
        return ZmqMessage(_decode_topic(topic), _decode_seq(seq), bytes(payload))
    if len(frames) == 2:
        seq, payload = frames
        return ZmqMessage(None, _decode_seq(seq), bytes(payload))
    raise FrameError(f"expected 2 or 3 frames, got {len(frames)}")


def decode_replay_reply(frames: Sequence[bytes]) -> ZmqMessage | None:
    """One replay reply seen by a DEALER: `[b"", topic, seq, payload]` or `[b"", seq,
    payload]`; returns None for the end marker."""
    if not frames or frames[0] != b"":
        raise FrameError("replay reply without the empty delimiter frame")
    rest = frames[1:]
    if len(rest) not in (2, 3):
        raise FrameError(f"expected 3 or 4 replay frames, got {len(frames)}")
    seq = _decode_seq(rest[-2])
    if seq == END_MARKER_SEQ:
        return None
    return decode_frames(rest)


def _decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise FrameError(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def _decode_topic(frame: bytes) -> str:
    return bytes(frame).decode("utf-8", errors="replace")


def engine_array_tail(engine_name: str) -> ArrayTail:
    """The array tail of the events an engine publishes, from the name GetEngineInfo gives it:
    a vLLM engine's ZMQ publisher is vLLM's own, whose positional layout is the one "vllm"
    reads; any other name (SGLang, whose builds disagree from index 7 on, or unknown) "ignore"."""
    return "vllm" if engine_name.strip().lower() == "vllm" else "ignore"


def decode_payload(payload: bytes, *, array_tail: ArrayTail = "ignore") -> EventBatch:
    """A msgpack EventBatch; raises PayloadError when the envelope is unusable."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise PayloadError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
        )
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, ...
        raise PayloadError(f"payload is not msgpack: {unpack_failure(exc)}") from exc
    try:
        ts, raw_events, dp_rank = _envelope(raw)
    except PayloadError:
        raise
    except Exception as exc:  # whatever the input: a bad message, never a source failure
        raise PayloadError(f"unusable EventBatch: {type(exc).__name__}: {exc}") from exc
    events: list[EngineEvent] = []
    num_bad = 0
    unknown: list[str] = []  # the unknown events' tags
    for raw_event in raw_events:
        try:
            event = decode_event(raw_event, array_tail=array_tail)
        except EventDecodeError:
            num_bad += 1
            continue
        if event is None:
            unknown.append(_tag(raw_event)[0])
        else:
            events.append(event)
    return EventBatch(
        ts, tuple(events), dp_rank, num_bad, len(unknown), tuple(dict.fromkeys(unknown))
    )


def _envelope(raw: object) -> tuple[float, list[Any], int | None]:
    if isinstance(raw, Mapping):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        # Elements past the third (a newer vLLM's fields) are ignored, as vLLM's own msgspec
        # decoder ignores them (module docstring).
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) >= 3 else None
    else:
        raise PayloadError("payload is not an EventBatch [ts, events, data_parallel_rank]")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise PayloadError(f"EventBatch ts must be a number, got {type(ts).__name__}")
    if not math.isfinite(ts):
        raise PayloadError(f"EventBatch ts must be finite, got {ts}")
    if not isinstance(events, list):
        raise PayloadError(f"EventBatch events must be an array, got {type(events).__name__}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise PayloadError("EventBatch data_parallel_rank must be an int or nil")
    return float(ts), events, dp_rank


# Positional layouts: index -> field name. Indices >= 7 are engine-specific (module docstring).
_STORED_FIELDS = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("type", "block_hashes", "medium", "group_idx")
_CLEARED_FIELDS = ("type", "medium")
_SHARED_POSITIONS = 7


def decode_event(raw: object, *, array_tail: ArrayTail = "ignore") -> EngineEvent | None:
    """One event; None for an unknown tag; raises EventDecodeError (only) when malformed."""
    try:
        return _decode_event(raw, array_tail)
    except EventDecodeError:
        raise
    except Exception as exc:  # whatever the input: a bad event, its siblings are kept
        raise EventDecodeError(f"malformed event: {type(exc).__name__}: {exc}") from exc


def _tag(raw: object) -> tuple[str, Mapping[Any, Any]]:
    """An event's type tag, and its fields when it is a map (an array's are read by layout)."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        fields: Mapping[Any, Any] = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = {}
    else:
        raise EventDecodeError(f"event must be a map or a non-empty array, got {raw!r:.60}")
    if not isinstance(tag, str):
        raise EventDecodeError(f"event tag must be a string, got {type(tag).__name__}")
    return tag, fields


def _decode_event(raw: object, array_tail: ArrayTail) -> EngineEvent | None:
    tag, fields = _tag(raw)
    decoder = _DECODERS.get(tag)
    if decoder is None:
        return None
    layout, decode = decoder
    if isinstance(raw, list):
        limit = len(raw) if array_tail == "vllm" else min(len(raw), _SHARED_POSITIONS)
        fields = dict(zip(layout[:limit], raw[:limit], strict=False))
    try:
        return decode(fields)
    except Exception as exc:
        raise EventDecodeError(f"malformed {tag}: {type(exc).__name__}: {exc}") from exc


def _stored(f: Mapping[Any, Any]) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    block_size = _opt_int(f.get("block_size"), "block_size", minimum=1, maximum=MAX_UINT32)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=_token_ids(f.get("token_ids")),
        block_size=block_size,
        medium=_medium(f.get("medium")),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        lora_id=_lora_id(f.get("lora_id")),
        extra_keys=_extra_keys(f.get("extra_keys")),
        cache_salt=_opt_str(f.get("cache_salt"), "cache_salt"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx", minimum=0) or 0,
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window", minimum=0
        ),
    )


def _removed(f: Mapping[Any, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f.get("block_hashes")),
        medium=_medium(f.get("medium")),
        group_idx=_opt_int(f.get("group_idx"), "group_idx", minimum=0) or 0,
    )


def _cleared(f: Mapping[Any, Any]) -> AllBlocksCleared:
    return AllBlocksCleared(medium=_medium(f.get("medium")))


_DECODERS: dict[str, tuple[tuple[str, ...], Callable[[Mapping[Any, Any]], EngineEvent]]] = {
    "BlockStored": (_STORED_FIELDS, _stored),
    "BlockRemoved": (_REMOVED_FIELDS, _removed),
    "AllBlocksCleared": (_CLEARED_FIELDS, _cleared),
}


def _hash(value: object) -> EngineHash:
    if isinstance(value, bytes):
        if not value:
            raise ValueError("empty byte hash")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"block hash must be int or bytes, got {type(value).__name__}")
    if not _I64_MIN <= value < _U64:
        raise ValueError(f"block hash {value} is outside 64 bits")
    return value


def _hashes(value: object) -> tuple[EngineHash, ...]:
    if not isinstance(value, list):
        raise TypeError(f"block_hashes must be an array, got {type(value).__name__}")
    return tuple(_hash(v) for v in value)


def _token_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_TOKEN_ID:
        raise ValueError(f"token id must be a uint32, got {value!r:.40}")
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise TypeError(f"token_ids must be an array, got {type(value).__name__}")
    if value and isinstance(value[0], list):
        # Bigram keys (t_i, t_i+1): the block holds t_i.
        out = []
        for pair in value:
            if not isinstance(pair, list) or not pair:
                raise TypeError("nested token_ids must all be non-empty arrays")
            out.append(_token_id(pair[0]))
        return tuple(out)
    return tuple(_token_id(v) for v in value)


def _medium(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"medium must be a string or nil, got {type(value).__name__}")
    return value.upper()


def _lora_id(value: object) -> int | str | None:
    """vLLM's int adapter id, or a string one (SGLang names its adapters by string ids);
    "" is none."""
    if value is None or value == "":
        return None
    if isinstance(value, str) or type(value) is int:
        return value
    raise TypeError(f"lora_id must be an int, a string or nil, got {type(value).__name__}")


def _opt_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{name} must be a string or nil, got {type(value).__name__}")


def _opt_int(value: object, name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        upto = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be an int >= {minimum}{upto}, got {value!r:.40}")
    return value


def _frozen(value: object, depth: int = 0) -> object:
    """`value` with its lists and maps as (sorted) tuples, hashable; depth-limited, so that a
    hostile nesting is a malformed event rather than a RecursionError."""
    if depth > MAX_EXTRA_KEY_DEPTH:
        raise ValueError(f"extra_keys nested deeper than {MAX_EXTRA_KEY_DEPTH} levels")
    if isinstance(value, list | tuple):
        return tuple(_frozen(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        items = ((str(k), _frozen(v, depth + 1)) for k, v in value.items())
        return tuple(sorted(items, key=repr))
    return value


def _extra_keys(value: object) -> tuple[tuple[object, ...] | None, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise TypeError(f"extra_keys must be an array, got {type(value).__name__}")
    out: list[tuple[object, ...] | None] = []
    for entry in value:
        if entry is None:
            out.append(None)
        elif isinstance(entry, list):
            out.append(tuple(_frozen(v) for v in entry))
        else:
            raise TypeError("each extra_keys entry must be an array or nil")
    return tuple(out)
