"""vLLM-compatible hashes recompute every block hash of the real vLLM 0.32.0 capture."""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import cbor2
import msgpack
import pytest

from indexer.vllm_hash import (
    VllmHashAlgo,
    block_digests,
    block_hashes,
    digest_to_int,
    none_hash,
)

CAPTURE = Path(__file__).resolve().parents[2].parent / "shared/data/vllm-0.32.0-kv-events"
BLOCK_SIZE = 32  # run_meta.json


def stored_events() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for line in (CAPTURE / "vllm_kv_events.jsonl").read_text().splitlines():
        frames = [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        _ts, batch_events, _rank = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        events.extend(e for e in batch_events if e["type"] == "BlockStored")
    return events


def requests() -> list[dict[str, Any]]:
    lines = (CAPTURE / "requests.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "prompt_token_ids" in r]


def test_every_stored_hash_recomputes_from_request_tokens() -> None:
    computed: set[int] = set()
    for request in requests():
        tokens = request["prompt_token_ids"] + request["output_token_ids"]
        computed.update(block_hashes(tokens, BLOCK_SIZE, cache_salt=request["cache_salt"]))
    stored = {h for event in stored_events() for h in event["block_hashes"]}
    assert len(stored) == 142
    assert stored <= computed
    assert any(h >= 1 << 63 for h in stored)  # unsigned values above 2**63 occur


def test_every_block_stored_event_recomputes_from_its_own_tokens() -> None:
    digests: dict[int, bytes] = {}  # published int -> full digest, for chaining
    num_blocks = 0
    for event in stored_events():
        parent = event["parent_block_hash"]
        extra = event["extra_keys"] or [None]
        # The event shows the salt bare (["tenant-A"]); the hash input is ("cache_salt", salt).
        salt = extra[0][0] if parent is None and extra[0] else None
        got = block_digests(
            event["token_ids"],
            event["block_size"],
            parent=None if parent is None else digests[parent],
            cache_salt=salt,
        )
        assert [digest_to_int(d) for d in got] == event["block_hashes"]
        digests.update((digest_to_int(d), d) for d in got)
        num_blocks += len(got)
    assert num_blocks == 157


def test_none_hash_seed_is_a_parameter() -> None:
    default = none_hash(VllmHashAlgo.SHA256)
    assert default == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert none_hash(VllmHashAlgo.SHA256, "0") != default
    cbor = none_hash(VllmHashAlgo.SHA256_CBOR, "42")
    assert cbor == hashlib.sha256(cbor2.dumps("42", canonical=True)).digest()
    tokens = list(range(64))
    seeded = block_hashes(tokens, 32, python_hash_seed="0")
    assert seeded != block_hashes(tokens, 32)
    assert block_hashes(tokens, 32, python_hash_seed="0") == seeded


@pytest.mark.parametrize("algo", list(VllmHashAlgo))
def test_chaining_uses_the_full_parent_digest(algo: VllmHashAlgo) -> None:
    tokens = list(range(100))
    digests = block_digests(tokens, 32, algo=algo)
    assert len(digests) == 3  # full blocks only
    assert all(len(d) == 32 for d in digests)
    assert block_digests(tokens[32:], 32, algo=algo, parent=digests[0]) == digests[1:]
    salted = block_digests(tokens, 32, algo=algo, cache_salt="t")
    assert all(a != b for a, b in zip(salted, digests, strict=True))
    assert block_digests(tokens[32:], 32, algo=algo, parent=salted[0], cache_salt="t") == salted[1:]
    other = VllmHashAlgo.SHA256 if algo is VllmHashAlgo.SHA256_CBOR else VllmHashAlgo.SHA256_CBOR
    assert block_digests(tokens, 32, algo=other)[0] != digests[0]
