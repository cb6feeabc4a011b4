"""Turning a pool's target size into decisions, with the rules every policy obeys.

Shared by the kvplane core and the benchmark's threshold peer, so that both act the same way
and differ only in how they size: scale up by asking for more engines; scale down by draining
the least loaded serving engines (never a starting one); remove an engine only once the core
has seen it drained (DRAINING and holding no request).
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.core.decisions import Decision, DrainEngine, Reason, RemoveEngine, ScalePool
from planner.core.observations import EngineObservation, EngineState


def provisioned(engines: Iterable[EngineObservation]) -> int:
    """Engines that count as the pool's size: starting or serving (draining ones are leaving)."""
    return sum(1 for e in engines if e.state is not EngineState.DRAINING)


def has_pending(engines: Iterable[EngineObservation]) -> bool:
    return any(e.state is EngineState.STARTING for e in engines)


def removals(engines: Iterable[EngineObservation]) -> list[Decision]:
    return [RemoveEngine(e.engine_id, e.pool, Reason.DRAINED) for e in engines if e.is_drained]


def drain_order(engines: Iterable[EngineObservation]) -> list[EngineObservation]:
    """Serving engines, those whose drain costs least first: the least work in flight
    (requests, then KV in use, then queued prefill: what the drain waits for, or aborts),
    then the least cached prefix (the blocks the controller's index places on it: lost to
    the fleet with the engine); the id breaks ties so the order is deterministic."""
    serving = [e for e in engines if e.state is EngineState.SERVING]
    return sorted(
        serving,
        key=lambda e: (
            e.load.num_requests,
            e.load.used_kv_blocks,
            e.load.waiting_prefill_tokens,
            e.indexed_blocks,
            e.engine_id,
        ),
    )


def resize(
    pool: str,
    engines: list[EngineObservation],
    *,
    target: int,
    reason: Reason,
    now_s: float,
    drain_deadline_s: float,
) -> list[Decision]:
    """Decisions that take `pool` from its provisioned size to `target`: one ScalePool up, or
    drains of the least loaded serving engines down. One serving engine always stays (while
    others start, draining them all would leave requests nowhere to go)."""
    current = provisioned(engines)
    if target > current:
        return [ScalePool(pool, target, reason)]
    order = drain_order(engines)
    victims = order[: min(current - target, len(order) - 1)]
    return [DrainEngine(e.engine_id, pool, now_s + drain_deadline_s, reason) for e in victims]
