"""What the planner core decides: scale a pool up, drain an engine, remove a drained one.

Every decision carries a `Reason`, the decision log's vocabulary. An actuator applies them in
order: `ScalePool` starts engines until the pool counts `num_engines` (starting + serving),
`DrainEngine` calls the engine's Drain (the controller stops routing to it; requests still
running by `deadline_s` may be aborted), `RemoveEngine` stops an engine the core saw drained.
Scale-down is always Drain then Remove, so no request is cut by a scale-down decision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from planner.core.observations import Observations


class Reason(enum.StrEnum):
    BELOW_MIN = "below_min"  # the pool has fewer engines than its minimum
    FORECAST_NEEDS_MORE = "forecast_needs_more"  # forecast load needs more at the SLA
    SLA_AT_RISK = "sla_at_risk"  # queued prefill work already exceeds the TTFT target
    OVERPROVISIONED = "overprovisioned"  # fewer engines meet the SLA, for a while
    ABOVE_MAX = "above_max"  # the pool has more engines than its maximum
    QUEUE_ABOVE_TARGET = "queue_above_target"  # threshold autoscaler (the benchmark's peer)
    QUEUE_BELOW_TARGET = "queue_below_target"  # threshold autoscaler (the benchmark's peer)
    DRAINED = "drained"  # a draining engine holds no request any more


@dataclass(frozen=True, slots=True)
class ScalePool:
    """Start engines until the pool counts `num_engines` (starting and serving)."""

    pool: str
    num_engines: int  # the pool's size asked for, not a number to add
    reason: Reason


@dataclass(frozen=True, slots=True)
class DrainEngine:
    """Stop routing to the engine; what still runs at `deadline_s` may be aborted."""

    engine_id: str
    pool: str
    deadline_s: float  # on the caller's clock, like the `now_s` given to decide()
    reason: Reason


@dataclass(frozen=True, slots=True)
class RemoveEngine:
    """Stop the engine: it is drained (DRAINING, no request left)."""

    engine_id: str
    pool: str
    reason: Reason


Decision = ScalePool | DrainEngine | RemoveEngine


class Policy(Protocol):
    """Anything that decides: the kvplane core (`planner.core.planner.Planner`), the
    benchmark's peers."""

    def decide(self, observations: Observations, now_s: float) -> list[Decision]: ...
