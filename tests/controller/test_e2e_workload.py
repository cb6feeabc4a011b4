"""The end-to-end benchmark's workload: conversations kept whole, hash ids as fixed token
blocks, arrivals at the asked rate."""

from __future__ import annotations

import pytest

from controller.e2e_workload import (
    WorkloadSettings,
    build_workload,
    conversation_ids,
    oracle_cached_ratio,
)
from engine.core.mooncake_trace import TraceRequest


def _row(t_ms: float, *hash_ids: int, length: int | None = None) -> TraceRequest:
    return TraceRequest(t_ms, length or 512 * len(hash_ids), 10, hash_ids)


TRACE = [
    _row(0, 0, 1, 2),  # conversation A
    _row(1000, 0, 5, 6),  # conversation B (shares only the system block 0)
    _row(2000, 0, 1, 2, 3, 4),  # A, second turn
    _row(3000, 0, 7),  # C
    _row(4000, 0, 5, 6, 8, length=512 * 3 + 100),  # B, second turn (last block partial)
]


def test_turns_join_their_conversation_and_a_shared_system_block_does_not() -> None:
    assert conversation_ids(TRACE) == [0, 1, 0, 3, 1]


def test_equal_hash_prefixes_are_equal_token_prefixes_and_lengths_scale() -> None:
    settings = WorkloadSettings(num_requests=5, rate_rps=2.0, block_tokens=4, seed=0)
    requests = build_workload(TRACE, settings, vocab_size=100)
    assert [len(r.token_ids) for r in requests] == [12, 12, 20, 8, 13]
    first, second = requests[0].token_ids, requests[2].token_ids
    assert second[:12] == first
    assert requests[1].token_ids[:4] == first[:4]  # block 0
    assert requests[1].token_ids[4:8] != first[4:8]
    assert all(4 <= t < 100 for r in requests for t in r.token_ids)
    # Arrivals keep the trace's spacing, scaled to the mean rate: 5 requests in 2 s.
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0, 1.5, 2.0]
    # Turn 2 of A reuses 3 blocks of 4, turn 2 of B reuses 3 and the block 0s are shared:
    # cached tokens 0 + 4 + 12 + 4 + 12 = 32 of 65.
    assert abs(oracle_cached_ratio(requests, block_size=4) - 32 / 65) < 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_whole_conversations_are_drawn_and_prompts_are_capped(seed: int) -> None:
    settings = WorkloadSettings(
        num_requests=3, rate_rps=1.0, block_tokens=4, max_prompt_tokens=10, seed=seed
    )
    requests = build_workload(TRACE, settings, vocab_size=100)
    assert len(requests) == 3
    conversation_of = conversation_ids(TRACE)
    drawn = {r.trace_index for r in requests}
    # Drawn whole and cut only at the end: every drawn turn comes with its earlier turns.
    for r in requests:
        earlier = {i for i in range(r.trace_index) if conversation_of[i] == r.conversation}
        assert earlier <= drawn
    assert max(len(r.token_ids) for r in requests) <= 10
    assert sorted(r.arrival_s for r in requests) == [r.arrival_s for r in requests]
