"""The benchmark's peer: a queue-length threshold autoscaler, as HPA or KEDA run one.

It scales on the fleet's queued (waiting) requests against a target per engine, with HPA's
rules: desired = ceil(queued / target) (unready engines count as holding none), no change
while queued / (engines x target) is within `tolerance` of 1, scale-up at once, scale-down
only to the largest size recommended during the last `scale_down_stabilisation_s` (300 s, HPA's
default). It acts through `planner.core.actions` like the kvplane core (drain the least loaded,
remove once drained), so the two differ only in how they size.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from planner.config import DEFAULT_DRAIN_DEADLINE_S, PoolConfig
from planner.core.actions import provisioned, removals, resize
from planner.core.decisions import Decision, Reason
from planner.core.observations import EngineObservation, EngineState, Observations


@dataclass(frozen=True, slots=True)
class ThresholdSettings:
    target_queued_per_engine: float = 2.0  # the HPA metric's target (average value)
    tolerance: float = 0.1  # HPA's default: no change within 10% of the target
    scale_down_stabilisation_s: float = 300.0  # HPA's default scale-down window
    drain_deadline_s: float = DEFAULT_DRAIN_DEADLINE_S  # as the kvplane core's


class ThresholdAutoscaler:
    def __init__(self, pool: PoolConfig, settings: ThresholdSettings) -> None:
        self.pool = pool
        self.settings = settings
        self._recommended: deque[tuple[float, int]] = deque()

    def decide(self, observations: Observations, now_s: float) -> list[Decision]:
        engines = observations.in_pool(self.pool.name)
        decisions = removals(engines)
        current = provisioned(engines)
        queued = sum(e.load.queued_requests for e in engines if e.state is EngineState.SERVING)
        target = self.settings.target_queued_per_engine
        ratio = queued / (current * target) if current else math.inf
        desired = (
            current if abs(ratio - 1.0) <= self.settings.tolerance else math.ceil(queued / target)
        )
        desired = max(self.pool.min_engines, min(self.pool.max_engines, desired))
        window = self._recommended
        if not window:  # taking over a fleet: as if it had been recommended so far
            window.append((now_s, current))
        window.append((now_s, desired))
        while window[0][0] < now_s - self.settings.scale_down_stabilisation_s:
            window.popleft()
        if desired > current:
            # HPA's default scale-up limit: +4 engines or +100%, whichever is more, per tick.
            desired = min(desired, max(current + 4, 2 * current))
            reason = (
                Reason.BELOW_MIN if current < self.pool.min_engines else (Reason.QUEUE_ABOVE_TARGET)
            )
            return [*decisions, *self._resize(engines, desired, reason, now_s)]
        stabilised = max(recommended for _, recommended in window)
        if stabilised < current:
            reason = (
                Reason.ABOVE_MAX if current > self.pool.max_engines else (Reason.QUEUE_BELOW_TARGET)
            )
            return [*decisions, *self._resize(engines, stabilised, reason, now_s)]
        return decisions

    def _resize(
        self, engines: list[EngineObservation], target: int, reason: Reason, now_s: float
    ) -> list[Decision]:
        return resize(
            self.pool.name,
            engines,
            target=target,
            reason=reason,
            now_s=now_s,
            drain_deadline_s=self.settings.drain_deadline_s,
        )
