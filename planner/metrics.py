"""The live planner's Prometheus metrics, served on the side port (`live.metrics_listen`).

Updated by the tick loop (`planner.live`), so a scrape reads the fleet as of the last tick:
engines per pool and state (and those not answering GetLoad), the core's sizing of each pool
(its inputs, the learned pass-cost model, the engines needed by each SLA constraint), the
decisions by kind and reason, engines lost (exited, or not answering), the actuator's failures
by operation, and the tick's duration; whether this planner leads (read at each scrape) and the
leader election's transitions it saw. A standby (leader election) exports no gauge of the
fleet: only the leader reports the fleet it acts on. Label values come from the config
(pools), the core's vocabularies (states, kinds, reasons) or this module's (causes,
operations): never from an engine's address.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from planner.core.decisions import Decision, DrainEngine, ScalePool
from planner.core.observations import EngineObservation, EngineState
from planner.core.planner import PoolEstimate

# Why an engine was lost: its process exited on its own, or it stopped answering GetLoad.
LossCause = Literal["exited", "unresponsive"]
# What the live planner asked of its actuator.
Operation = Literal["start", "sync", "drain", "stop", "kill"]

# Ticks take a few ms (one GetLoad round) up to seconds (a GetLoad that times out, a drain the
# controller is slow to take); the actuator's starts and removals run beside them.
_TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def decision_kind(decision: Decision) -> str:
    if isinstance(decision, ScalePool):
        return "scale_pool"
    if isinstance(decision, DrainEngine):
        return "drain"
    return "remove"


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._pools: set[str] = set()  # every pool seen, so an emptied one reads 0
        self.engines = Gauge(
            "kvplane_planner_engines",
            "Engines of the pool by state (starting, serving, draining)",
            ["pool", "state"],
            registry=r,
        )
        self.engines_not_answering = Gauge(
            "kvplane_planner_engines_not_answering",
            "Engines of the pool whose last GetLoad failed or timed out (counted in engines as "
            "they were; lost after live.lost_after_failed_polls ticks in a row)",
            ["pool"],
            registry=r,
        )
        self.engines_wanted = Gauge(
            "kvplane_planner_engines_wanted",
            "The core's sizing of the pool rounded up within its bounds (what a scale-up asks)",
            ["pool"],
            registry=r,
        )
        self.engines_needed = Gauge(
            "kvplane_planner_engines_needed",
            "Engines (fractional) each SLA constraint needs for the forecast load (itl, ttft, kv)",
            ["pool", "constraint"],
            registry=r,
        )
        self.prompt_tokens_per_second = Gauge(
            "kvplane_planner_prompt_tokens_per_second",
            "Prompt tokens arriving per second, measured over the last tick",
            ["pool"],
            registry=r,
        )
        self.forecast_prompt_tokens_per_second = Gauge(
            "kvplane_planner_forecast_prompt_tokens_per_second",
            "Prompt tokens arriving per second, forecast capacity.forecast_horizon_s ahead",
            ["pool"],
            registry=r,
        )
        self.forecast_error_prompt_tokens_per_second = Gauge(
            "kvplane_planner_forecast_error_prompt_tokens_per_second",
            "Mean absolute error of the one-tick-ahead prompt-rate forecast (the need is sized "
            "for the forecast plus capacity.forecast_error_headroom of these)",
            ["pool"],
            registry=r,
        )
        # In engines' worth of KV cache (each engine's demand is a fraction of its own cache,
        # past 1 when saturated): the unit of engines_needed{constraint="kv"}.
        self.kv_demand_engines = Gauge(
            "kvplane_planner_kv_demand_engines",
            "KV in use plus queued prompts, summed over engines, in engines' worth of KV cache "
            "(1: one engine's cache full)",
            ["pool"],
            registry=r,
        )
        self.forecast_kv_demand_engines = Gauge(
            "kvplane_planner_forecast_kv_demand_engines",
            "KV demand, in engines' worth of KV cache, forecast capacity.forecast_horizon_s ahead",
            ["pool"],
            registry=r,
        )
        self.mean_prompt_tokens = Gauge(
            "kvplane_planner_mean_prompt_tokens",
            "Running mean of the prompt tokens per prefill sequence",
            ["pool"],
            registry=r,
        )
        self.mean_decode_passes = Gauge(
            "kvplane_planner_mean_decode_passes",
            "Running mean of the passes a request decodes for (sizes the short-output bound)",
            ["pool"],
            registry=r,
        )
        self.pass_fixed_seconds = Gauge(
            "kvplane_planner_pass_cost_fixed_seconds",
            "Learned pass-cost model: the fixed time of a forward pass",
            ["pool"],
            registry=r,
        )
        self.pass_prefill_seconds_per_token = Gauge(
            "kvplane_planner_pass_cost_prefill_seconds_per_token",
            "Learned pass-cost model: the time a prompt token adds to a pass",
            ["pool"],
            registry=r,
        )
        self.pass_kv_seconds = Gauge(
            "kvplane_planner_pass_cost_kv_seconds",
            "Learned pass-cost model: the time a full KV cache adds to a pass",
            ["pool"],
            registry=r,
        )
        self.forward_passes = Counter(
            "kvplane_planner_forward_passes",
            "FORWARD_PASS runtime events received from the pool's engines",
            ["pool"],
            registry=r,
        )
        self.decisions = Counter(
            "kvplane_planner_decisions",
            "Decisions of the core by kind (scale_pool, drain, remove) and reason",
            ["pool", "kind", "reason"],
            registry=r,
        )
        self.engines_lost = Counter(
            "kvplane_planner_engines_lost",
            "Engines taken out because their process exited or they stopped answering GetLoad",
            ["pool", "cause"],
            registry=r,
        )
        self.actuator_failures = Counter(
            "kvplane_planner_actuator_failures",
            "Actuator calls that failed, by operation",
            ["operation"],
            registry=r,
        )
        self.leader = Gauge(
            "kvplane_planner_leader",
            "1 while this planner may act (it leads, or runs without "
            "live.kubernetes.leader_election); 0 while it stands by as a candidate",
            registry=r,
        )
        self.leader_transitions = Counter(
            "kvplane_planner_leader_transitions",
            "Takeovers of the leader election's Lease this planner saw (its leaseTransitions' "
            "increments since the planner started, its own takeovers included)",
            registry=r,
        )
        self.tick_seconds = Histogram(
            "kvplane_planner_tick_seconds",
            "Duration of one tick: observe, decide, hand the actions to the actuator",
            buckets=_TICK_BUCKETS,
            registry=r,
        )
        # The fleet as the leader acts on it: exported by the leader only (`on_standing_by`).
        self._fleet_gauges = (
            self.engines,
            self.engines_not_answering,
            self.engines_wanted,
            self.engines_needed,
            self.prompt_tokens_per_second,
            self.forecast_prompt_tokens_per_second,
            self.forecast_error_prompt_tokens_per_second,
            self.kv_demand_engines,
            self.forecast_kv_demand_engines,
            self.mean_prompt_tokens,
            self.mean_decode_passes,
            self.pass_fixed_seconds,
            self.pass_prefill_seconds_per_token,
            self.pass_kv_seconds,
        )

    def on_engines(self, engines: Iterable[EngineObservation]) -> None:
        counts: dict[tuple[str, EngineState], int] = {}
        for engine in engines:
            self._pools.add(engine.pool)
            key = (engine.pool, engine.state)
            counts[key] = counts.get(key, 0) + 1
        for pool in self._pools:
            for state in EngineState:
                self.engines.labels(pool, state.value).set(counts.get((pool, state), 0))

    def on_not_answering(self, pools: Iterable[str]) -> None:
        """`pools`: the pool of each engine whose last GetLoad went unanswered (after
        `on_engines`, which names the pools that read 0)."""
        counts = collections.Counter(pools)
        for pool in self._pools | set(counts):
            self.engines_not_answering.labels(pool).set(counts[pool])

    def on_estimate(self, pool: str, estimate: PoolEstimate) -> None:
        self.engines_wanted.labels(pool).set(estimate.engines_wanted)
        need = estimate.need
        for constraint, engines in (("itl", need.itl), ("ttft", need.ttft), ("kv", need.kv)):
            self.engines_needed.labels(pool, constraint).set(engines)
        self.prompt_tokens_per_second.labels(pool).set(estimate.prompt_tokens_per_s)
        self.forecast_prompt_tokens_per_second.labels(pool).set(
            estimate.forecast_prompt_tokens_per_s
        )
        self.kv_demand_engines.labels(pool).set(estimate.kv_demand)
        self.forecast_kv_demand_engines.labels(pool).set(estimate.forecast_kv_demand)
        self.forecast_error_prompt_tokens_per_second.labels(pool).set(
            estimate.forecast_error_prompt_tokens_per_s
        )
        self.mean_prompt_tokens.labels(pool).set(estimate.mean_prompt_tokens)
        self.mean_decode_passes.labels(pool).set(estimate.mean_decode_passes)
        cost = estimate.cost
        self.pass_fixed_seconds.labels(pool).set(cost.fixed_ms / 1000.0)
        self.pass_prefill_seconds_per_token.labels(pool).set(cost.prefill_ms_per_token / 1000.0)
        self.pass_kv_seconds.labels(pool).set(cost.kv_ms / 1000.0)

    def on_leading(self, leading: Callable[[], bool]) -> None:
        """`kvplane_planner_leader` reads `leading()` at each scrape: a leader whose renewals
        fail reads 0 from its renew deadline on, not from its next tick."""
        self.leader.set_function(lambda: float(leading()))

    def on_standing_by(self) -> None:
        """A term as leader ended: the fleet's gauges (engines, the sizing) go until the next
        term's first tick, as a Kubernetes controller's non-leader replicas report nothing of
        the work they do not do. A standby observes the fleet but acts on nothing; summed
        over the planners, its gauges would count the fleet twice. Its counters stay."""
        for gauge in self._fleet_gauges:
            gauge.clear()

    def on_leader_transitions(self, count: int) -> None:
        self.leader_transitions.inc(count)

    def on_decision(self, decision: Decision) -> None:
        kind = decision_kind(decision)
        self.decisions.labels(decision.pool, kind, decision.reason.value).inc()

    def on_lost(self, pool: str, cause: LossCause) -> None:
        self.engines_lost.labels(pool, cause).inc()

    def on_failure(self, operation: Operation) -> None:
        self.actuator_failures.labels(operation).inc()
