"""The offline replay on a short synthetic trace: a load step that needs more engines than the
fleet starts with. Deterministic (virtual time, no randomness): the same input gives the same
result, figure for figure."""

from __future__ import annotations

from typing import Any

from planner.azure_trace import TraceRow
from planner.config import PlannerConfig, PoolConfig, ScalingConfig, SlaTargets
from planner.core.decisions import Decision, DrainEngine, Reason
from planner.core.observations import Observations
from planner.core.planner import Planner
from planner.core.threshold import ThresholdAutoscaler, ThresholdSettings
from planner.replay import FleetSettings, NoScaling, replay

SLA = SlaTargets(ttft_ms=1000, itl_ms=40)
FLEET = FleetSettings(blocks_per_engine=256, startup_s=10)


def step_trace() -> list[TraceRow]:
    """60 s at 1 request/s, then 60 s at 6 requests/s, then 300 s at 1 request/s."""
    rows: list[TraceRow] = []
    t = 0.0
    for duration_s, rate in ((60, 1.0), (60, 6.0), (300, 1.0)):
        end = t + duration_s
        while t < end:
            rows.append(TraceRow(t, 500 + len(rows) % 7 * 100, 60 + len(rows) % 5 * 20))
            t += 1.0 / rate
    return rows


def planner() -> Planner:
    # A short window, so that the 300 s tail sees the scale-down too.
    scaling = ScalingConfig(scale_down_stabilisation_s=60)
    pools = (PoolConfig(min_engines=1, max_engines=8),)
    return Planner(PlannerConfig(sla=SLA, pools=pools, scaling=scaling))


def run_kvplane() -> dict[str, Any]:
    result = replay(
        step_trace(), "kvplane", planner(), engines=1, tick_s=5, settings=FLEET, sla=SLA
    )
    return result.to_json()


def test_replay_is_deterministic() -> None:
    assert run_kvplane() == run_kvplane()


def test_planner_scales_up_for_the_step_and_back_down() -> None:
    row = run_kvplane()
    assert row["num_requests"] == len(step_trace())
    assert row["num_failed"] == 0
    assert row["max_engines"] > 1
    assert row["num_scale_ups"] >= 1 and row["num_drains"] >= 1


def test_static_counts_every_engine_for_the_whole_replay() -> None:
    result = replay(
        step_trace(), "static", NoScaling(), engines=3, tick_s=5, settings=FLEET, sla=SLA
    )
    assert result.max_engines == 3 and result.num_scale_ups == result.num_drains == 0
    last_arrival = step_trace()[-1].arrival_s
    assert result.engine_seconds >= 3 * last_arrival


def test_threshold_peer_runs_through_the_same_actuator() -> None:
    policy = ThresholdAutoscaler(
        PoolConfig(min_engines=1, max_engines=8), ThresholdSettings(target_queued_per_engine=1)
    )
    result = replay(
        step_trace(), "threshold", policy, engines=1, tick_s=15, settings=FLEET, sla=SLA
    )
    assert result.num_failed == 0
    assert result.num_requests == len(step_trace())


def test_a_drain_deadline_aborts_what_is_left() -> None:
    """A policy that drains the only long request's engine with a deadline it cannot meet:
    the request is aborted and counted as failed; the engine is removed once empty."""
    from planner.core.decisions import RemoveEngine, ScalePool
    from planner.core.observations import EngineState

    class DrainFirst:
        def decide(self, observations: Observations, now_s: float) -> list[Decision]:
            first = next((e for e in observations.engines if e.engine_id == "e0"), None)
            if now_s == 0:
                return [ScalePool("default", 2, Reason.BELOW_MIN)]
            if first is None:
                return []
            if first.state is EngineState.SERVING and now_s >= 5:
                return [DrainEngine("e0", "default", now_s + 1, Reason.OVERPROVISIONED)]
            if first.is_drained:
                return [RemoveEngine("e0", "default", Reason.DRAINED)]
            return []

    rows = [TraceRow(0.0, 100, 2000), TraceRow(20.0, 100, 10)]
    fleet = FleetSettings(blocks_per_engine=256, startup_s=1)
    result = replay(rows, "drain", DrainFirst(), engines=1, tick_s=5, settings=fleet, sla=SLA)
    assert result.num_failed == 1  # the long one, cut at the deadline
    assert result.num_drains == 1
    assert result.num_requests == 2


def test_of_two_idle_engines_the_one_holding_cached_prefixes_is_kept() -> None:
    """The replay gives the planner each engine's cached blocks, as the controller's index
    would (`indexed_blocks`), so it drains as live does: four short requests one after the
    other all go to e0 (the router's tie goes to the first engine), which keeps their prompts'
    blocks cached; at the next tick both engines are idle, equal in requests, KV in use and
    queued prefill, and the pool needs one: e1, holding no cached prefix, is drained, not e0
    (the engine id alone, as when the replay said 0 blocks for every engine)."""
    seen: list[Observations] = []
    decided: list[Decision] = []
    core = Planner(
        PlannerConfig(
            sla=SLA,
            pools=(PoolConfig(min_engines=1, max_engines=2),),
            scaling=ScalingConfig(scale_down_stabilisation_s=0, scale_down_cooldown_s=0),
        )
    )

    class Recorded:
        def decide(self, observations: Observations, now_s: float) -> list[Decision]:
            seen.append(observations)
            decisions = core.decide(observations, now_s)
            decided.extend(decisions)
            return decisions

    rows = [TraceRow(float(t), 100, 2) for t in (0, 1, 2, 3)] + [TraceRow(20.0, 100, 2)]
    replay(rows, "kvplane", Recorded(), engines=2, tick_s=5, settings=FLEET, sla=SLA)
    drains = [d for d in decided if isinstance(d, DrainEngine)]
    assert [(d.engine_id, d.reason) for d in drains] == [("e1", Reason.OVERPROVISIONED)]
    at_drain = {e.engine_id: e for e in seen[1].engines}
    # Four prompts of 100 tokens: 6 full 16-token blocks each, cached on e0.
    assert at_drain["e0"].indexed_blocks == 4 * 6
    assert at_drain["e1"].indexed_blocks == 0
    assert at_drain["e0"].load == at_drain["e1"].load
