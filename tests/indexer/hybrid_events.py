"""vLLM's KV events of a hybrid model (a full-attention and a sliding-window KV cache group),
in vLLM's map form or its positional array form (WIRE.md section 1), for the decoder, bridge
and controller tests. In the array form the group fields sit past index 7, where engines
disagree: they are read only with `array_tail: vllm`."""

from __future__ import annotations

from typing import Literal

import msgpack

EventForm = Literal["map", "array"]
# The tokens of blocks 1-3 (16 tokens each).
HYBRID_TOKEN_IDS = tuple(range(48))
HYBRID_BLOCK_SIZE = 16


def hybrid_payload(form: EventForm) -> bytes:
    """vLLM's events for a Gemma-like model: blocks 1-3 stored in a full-attention group and
    a sliding-window group (window 33 tokens), then block 2 evicted from the window's group."""
    fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
    tail = ("medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
    events: list[object] = []
    for group, kind, window in ((0, "full_attention", None), (1, "sliding_window", 33)):
        values = (
            [1, 2, 3],
            None,
            list(HYBRID_TOKEN_IDS),
            HYBRID_BLOCK_SIZE,
            None,
            "GPU",
            None,
            None,
            group,
            kind,
        )
        stored = dict(zip(fields + tail, values, strict=True))
        stored["kv_cache_spec_sliding_window"] = window
        if form == "map":
            events.append({"type": "BlockStored", **stored})
        else:
            events.append(["BlockStored", *stored.values()])
    removed = {"block_hashes": [2], "medium": "GPU", "group_idx": 1}
    events.append(
        {"type": "BlockRemoved", **removed}
        if form == "map"
        else ["BlockRemoved", *removed.values()]
    )
    packed = msgpack.packb([1.0, events, None])
    assert isinstance(packed, bytes)
    return packed
