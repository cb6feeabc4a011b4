"""Builders of planner observations for the planner's tests."""

from __future__ import annotations

from planner.core.observations import (
    EngineLoad,
    EngineObservation,
    EngineRole,
    EngineState,
    ForwardPasses,
)

TOTAL_BLOCKS = 1000
BLOCK_SIZE = 16


def engine(
    engine_id: str,
    state: EngineState = EngineState.SERVING,
    *,
    running: int = 0,
    queued: int = 0,
    waiting_tokens: int = 0,
    used_blocks: int = 0,
    pool: str = "default",
    kv_sessions: int = 0,
    role: EngineRole | None = None,
) -> EngineObservation:
    load = EngineLoad(
        running,
        queued,
        waiting_tokens,
        used_blocks,
        TOTAL_BLOCKS,
        BLOCK_SIZE,
        active_kv_sessions=kv_sessions,
    )
    return EngineObservation(engine_id, pool, state, load, role)


def passes(engine_id: str, *, num: int = 100, prefill_tokens: int = 0) -> ForwardPasses:
    """`num` passes that took what the default priors predict for an empty cache."""
    duration_ms = num * 15.0 + 0.02 * prefill_tokens
    return ForwardPasses(engine_id, num, duration_ms / 1000.0, prefill_tokens, num)
