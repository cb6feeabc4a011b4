"""The end-to-end benchmark's workload: a Mooncake conversation trace scaled to a small fleet.

`build_workload(trace, settings, vocab_size)` is pure (no I/O, randomness seeded):

1. **Conversations.** A row continues the conversation of the earliest row it shares at least
   `CONVERSATION_MIN_SHARED` leading hash ids with (every row of the conversation trace shares
   hash id 0, a one-block system prompt, so one shared block says nothing); other rows start
   one.
2. **Subset.** Whole conversations are drawn at random (seeded) until `num_requests` rows are
   taken; the rows keep their trace order and the last ones are cut to `num_requests`.
   Drawing whole conversations keeps the trace's reuse structure (later turns repeat earlier
   turns' blocks) in a few hundred requests, where a contiguous slice would lose most of it
   (turns are minutes apart; a slice of a few hundred rows spans under two minutes).
3. **Time.** Arrivals keep the trace's relative spacing, compressed so the mean rate is
   `rate_rps` (open loop: a request is sent at its time whatever the fleet does).
4. **Tokens.** Hash id h becomes a fixed block of `block_tokens` token ids, pseudo-random in
   `[FIRST_TOKEN_ID, vocab_size)` and seeded by h, so equal hash-id prefixes are equal token
   prefixes and distinct hash ids never collide (the trace's ids exceed a small vocabulary, so
   `trace_prompt_tokens`'s "h repeated" blocks cannot be used on a real model). The prompt is
   `input_length x block_tokens / 512` tokens (a 512-token trace block becomes
   `block_tokens`), cut to `max_prompt_tokens`.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.mooncake_trace import TraceRequest
from kvplane.errors import KvplaneError

TRACE_BLOCK_TOKENS = 512
CONVERSATION_MIN_SHARED = 2
FIRST_TOKEN_ID = 4  # below: special tokens (pad, bos, eos, ...)


@dataclass(frozen=True, slots=True)
class WorkloadSettings:
    num_requests: int
    rate_rps: float
    block_tokens: int = 16
    max_prompt_tokens: int = 1024
    output_tokens: int = 2
    seed: int = 0


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    index: int
    trace_index: int  # the row of the trace it comes from
    arrival_s: float
    conversation: int  # the trace row that started its conversation
    token_ids: tuple[int, ...]
    max_tokens: int


def conversation_ids(trace: Sequence[TraceRequest]) -> list[int]:
    """Each row's conversation: the index of the first row of its conversation."""
    # Trie of hash-id prefixes: (parent node, hash id) -> node; node -> conversation.
    nodes: dict[tuple[int, int], int] = {}
    owner: list[int] = []
    result: list[int] = []
    for index, row in enumerate(trace):
        parent = -1  # the root (a dict key, never exposed)
        path: list[int] = []
        for h in row.hash_ids:
            node = nodes.get((parent, h))
            if node is None:
                break
            path.append(node)
            parent = node
        conversation = owner[path[-1]] if len(path) >= CONVERSATION_MIN_SHARED else index
        result.append(conversation)
        parent = -1
        for h in row.hash_ids:
            node = nodes.get((parent, h))
            if node is None:
                node = len(owner)
                nodes[(parent, h)] = node
                owner.append(conversation)
            parent = node
    return result


def build_workload(
    trace: Sequence[TraceRequest], settings: WorkloadSettings, vocab_size: int
) -> list[WorkloadRequest]:
    if vocab_size <= FIRST_TOKEN_ID + 1:
        raise KvplaneError(f"vocabulary of {vocab_size} tokens is too small")
    if not trace:
        raise KvplaneError("the trace is empty")
    rows = _draw_conversations(trace, settings)
    start_ms = rows[0][2].arrival_ms
    span_ms = rows[-1][2].arrival_ms - start_ms
    wanted_span_s = (len(rows) - 1) / settings.rate_rps
    scale = wanted_span_s / (span_ms / 1000.0) if span_ms > 0 else 0.0
    blocks: dict[int, tuple[int, ...]] = {}
    requests = []
    for index, (trace_index, conversation, row) in enumerate(rows):
        arrival_s = (row.arrival_ms - start_ms) / 1000.0 * scale
        if span_ms <= 0:  # all rows at one instant: spread them evenly
            arrival_s = index / settings.rate_rps
        requests.append(
            WorkloadRequest(
                index=index,
                trace_index=trace_index,
                arrival_s=arrival_s,
                conversation=conversation,
                token_ids=_prompt(row, settings, vocab_size, blocks),
                max_tokens=settings.output_tokens,
            )
        )
    return requests


def _draw_conversations(
    trace: Sequence[TraceRequest], settings: WorkloadSettings
) -> list[tuple[int, int, TraceRequest]]:
    """(trace index, conversation, row) of the drawn rows, in trace order."""
    conversation_of = conversation_ids(trace)
    members: dict[int, list[int]] = {}
    for index, conversation in enumerate(conversation_of):
        members.setdefault(conversation, []).append(index)
    order = sorted(members)
    random.Random(settings.seed).shuffle(order)
    chosen: list[int] = []
    for conversation in order:
        if len(chosen) >= settings.num_requests:
            break
        chosen.extend(members[conversation])
    chosen.sort()  # trace order; the latest rows are the ones cut
    return [(i, conversation_of[i], trace[i]) for i in chosen[: settings.num_requests]]


def _prompt(
    row: TraceRequest,
    settings: WorkloadSettings,
    vocab_size: int,
    blocks: dict[int, tuple[int, ...]],
) -> tuple[int, ...]:
    length = max(1, round(row.input_length * settings.block_tokens / TRACE_BLOCK_TOKENS))
    length = min(length, settings.max_prompt_tokens, len(row.hash_ids) * settings.block_tokens)
    tokens: list[int] = []
    for h in row.hash_ids:
        if len(tokens) >= length:
            break
        block = blocks.get(h)
        if block is None:
            rng = random.Random(h * 7_919 + 17)
            block = blocks[h] = tuple(
                rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(settings.block_tokens)
            )
        tokens.extend(block)
    return tuple(tokens[:length])


def oracle_cached_ratio(requests: Sequence[WorkloadRequest], block_size: int) -> float:
    """Prompt tokens one shared unlimited prefix cache would serve (full `block_size` blocks of
    a prefix seen before, at least one token recomputed) / all prompt tokens: the ceiling of
    the engines' reported cached tokens."""
    seen: set[tuple[int, ...]] = set()
    cached = total = 0
    for request in requests:
        tokens = request.token_ids
        total += len(tokens)
        num_full = len(tokens) // block_size
        hits = 0
        while hits < num_full and tokens[: (hits + 1) * block_size] in seen:
            hits += 1
        cached += min(hits * block_size, len(tokens) - 1)
        seen.update(tokens[: (i + 1) * block_size] for i in range(num_full))
    return cached / total if total else 0.0


def describe(requests: Sequence[WorkloadRequest], block_size: int) -> dict[str, object]:
    """The workload's shape, for the benchmark's document."""
    lengths = [len(r.token_ids) for r in requests]
    return {
        "requests": len(requests),
        "conversations": len({r.conversation for r in requests}),
        "multi_turn_requests": len(requests) - len({r.conversation for r in requests}),
        "prompt_tokens": {
            "mean": round(statistics.fmean(lengths), 1),
            "p50": sorted(lengths)[len(lengths) // 2],
            "max": max(lengths),
        },
        "duration_s": round(requests[-1].arrival_s, 2),
        "oracle_cached_ratio": round(oracle_cached_ratio(requests, block_size), 4),
    }
