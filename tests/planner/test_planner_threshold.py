"""The benchmark's peer, a queue-length threshold autoscaler, follows HPA's rules: no change
while the queue per engine is within `tolerance` of its target, and a scale-down only to the
largest size recommended over `scale_down_stabilisation_s`."""

from __future__ import annotations

from planner.config import PoolConfig
from planner.core.decisions import Decision, DrainEngine, Reason, ScalePool
from planner.core.observations import Observations
from planner.core.threshold import ThresholdAutoscaler, ThresholdSettings
from tests.planner.planner_obs import engine


def tick(peer: ThresholdAutoscaler, now_s: float, *queued: int) -> list[Decision]:
    """One tick of engines e0, e1, ... serving, each with `queued` requests queued."""
    engines = tuple(engine(f"e{i}", queued=q) for i, q in enumerate(queued))
    return peer.decide(Observations(engines), now_s)


def test_a_queue_within_the_tolerance_of_its_target_changes_nothing() -> None:
    peer = ThresholdAutoscaler(PoolConfig(max_engines=20), ThresholdSettings())
    # 21 queued over 10 engines at 2 each: 5% above the target, within HPA's 10%.
    assert tick(peer, 0, *[3] + [2] * 9) == []
    # 23: 15% above it, scaled up to ceil(23 / 2).
    assert tick(peer, 5, *[3, 3, 3] + [2] * 7) == [
        ScalePool("default", 12, Reason.QUEUE_ABOVE_TARGET)
    ]


def test_a_scale_down_waits_for_the_largest_size_recommended_over_its_window() -> None:
    peer = ThresholdAutoscaler(
        PoolConfig(max_engines=8), ThresholdSettings(scale_down_stabilisation_s=300)
    )
    assert tick(peer, 0, 2, 2, 2, 2) == []  # at the target: 4 engines
    # The queues empty: 1 engine recommended, but 4 were within the window.
    for now_s in range(10, 300, 10):
        assert tick(peer, now_s, 0, 0, 0, 0) == []
    assert tick(peer, 301, 0, 0, 0, 0) == [
        DrainEngine(f"e{i}", "default", 301 + 300, Reason.QUEUE_BELOW_TARGET) for i in range(3)
    ]
