"""The real vLLM 0.32.0 KV-event capture (../shared/data/vllm-0.32.0-kv-events/) and an
independent model of what vLLM holds live, for the event-source tests.

The model is deliberately written from the capture's documented facts, not from
`indexer.translate`: per hash a count of physical copies; BlockStored adds one copy per hash,
except that a nil-parent store of a hash already live is a `kv_cache_report_mode="full"`
re-announcement (not a new copy); BlockRemoved drops one copy; AllBlocksCleared drops all.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

CAPTURE = Path(__file__).resolve().parents[3] / "shared" / "data" / "vllm-0.32.0-kv-events"
TOPIC = "kv@cpu-0@tiny-llama"
BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 48
_U64 = 1 << 64


def signed(value: int) -> int:
    return value - _U64 if value >= 1 << 63 else value


@dataclass(frozen=True)
class CapturedMessage:
    seq: int
    recv_time_unix: float
    frames: list[bytes]  # [topic, seq, payload]

    @property
    def events(self) -> list[dict[str, Any]]:
        return list(msgpack.unpackb(self.frames[2], raw=False)[1])


def live_messages() -> list[CapturedMessage]:
    out = []
    for line in (CAPTURE / "vllm_kv_events.jsonl").read_text().splitlines():
        record = json.loads(line)
        frames = [base64.b64decode(f) for f in record["frames_b64"]]
        out.append(
            CapturedMessage(int.from_bytes(frames[1], "big"), record["recv_time_unix"], frames)
        )
    return out


def replay_replies() -> list[list[bytes]]:
    """The replay ROUTER's replies as the DEALER saw them ([b"", topic, seq, payload]), the
    end marker last."""
    out = []
    for line in (CAPTURE / "vllm_kv_events_replay.jsonl").read_text().splitlines():
        out.append([base64.b64decode(f) for f in json.loads(line)["frames_b64"]])
    return out


def requests() -> list[dict[str, Any]]:
    lines = (CAPTURE / "requests.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "req_seq" in r]


class LiveModel:
    """What vLLM holds live: copies per (unsigned) hash, plus each hash's tokens and parent."""

    def __init__(self) -> None:
        self.copies: Counter[int] = Counter()
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.parent: dict[int, int | None] = {}
        self.salt: dict[int, str | None] = {}

    def apply(self, events: list[dict[str, Any]], *, strict: bool = True) -> None:
        """`strict` False: a model started mid-stream, where a removal of a block stored
        before its start (which it does not hold) is ignored."""
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                parent = event.get("parent_block_hash")
                extra = event.get("extra_keys") or []
                for i, h in enumerate(event["block_hashes"]):
                    if not (parent is None and self.copies[h] > 0):
                        self.copies[h] += 1
                    self.tokens[h] = tuple(
                        event["token_ids"][i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    )
                    self.parent.setdefault(h, parent if i == 0 else event["block_hashes"][i - 1])
                    salt = extra[0][0] if i == 0 and extra and extra[0] else None
                    self.salt.setdefault(h, salt)
            elif kind == "BlockRemoved":
                for h in event["block_hashes"]:
                    if not strict and not self.copies[h]:
                        continue
                    assert self.copies[h] > 0, "a removal of a block the model does not hold"
                    self.copies[h] -= 1
            elif kind == "AllBlocksCleared":
                self.copies.clear()

    def live(self) -> dict[int, int]:
        """Live hashes (in the seed's signed space) -> copies."""
        return {signed(h): n for h, n in self.copies.items() if n > 0}

    def live_unsigned(self) -> set[int]:
        return {h for h, n in self.copies.items() if n > 0}


def final_live() -> LiveModel:
    model = LiveModel()
    for message in live_messages():
        model.apply(message.events)
    return model
