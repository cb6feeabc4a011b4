"""The planner's pure core: `Planner.decide(observations, now_s) -> [Decision]`.

No I/O, no clock, no randomness: the caller passes the time (wall in live mode, virtual in the
replay), so one core runs live, in dry-run and offline. The core keeps a little state between
ticks (the load forecast, the learned cost model, cooldown times, the scale-down window).

Each tick, per configured pool (engines of other pools are left alone):
1. Remove every engine seen drained (DRAINING, no request left): never one that still holds a
   request; scale-down is always Drain first (`planner.core.actions`).
2. Bounds: fewer engines than `min_engines` (starting + serving) -> scale up to it, or to
   the sized need (step 4) if that is more and nothing is starting (BELOW_MIN); more than
   `max_engines` -> drain the least loaded excess (ABOVE_MAX). Steps 3 and 4 run on such a
   tick too (their decisions do not): else its passes would be lost, and the next tick would
   spread one tick's prompt tokens over two.
3. Learn: fit the pass-cost model to the passes reported since the last tick; measure the
   prompt-token arrival rate (prompt tokens computed + growth of the queued prefill backlog,
   per second; the backlog is what the engines will compute of their queued prompts:
   `_prefill_backlog`, its growth at this tick's share computed) and feed the forecast;
   keep running means of the prompt length and of the passes a request decodes for, and the
   share of admitted prompt tokens computed (not found cached), weighted by the tokens.
4. Size (`planner.core.capacity`): engines needed at the SLA targets for the forecast load
   plus `forecast_error_headroom` times the forecast's mean absolute error, by the bounds of
   the pool's role (`planner.core.roles`: what its engines report, else its configured role;
   engines that disagree: aggregated, logged once).
5. Scale up when the need exceeds the engines provisioned, unless engines are still starting
   (their capacity is pending: asking again would double-count the same need) or the last
   scale-up is younger than `scale_up_cooldown_s`. The reason is SLA_AT_RISK when some engine's
   queued prefill work (`_prefill_backlog`) already exceeds the TTFT target, else
   FORECAST_NEEDS_MORE.
6. Scale down (hysteresis) only to the largest size asked for during the last
   `scale_down_stabilisation_s` (a scale-up's target included), computed with
   `scale_down_headroom` extra room, when nothing is starting, no SLA is at risk and no
   scaling decision is younger than `scale_down_cooldown_s`; the serving engines whose drain
   costs least are drained (OVERPROVISIONED; `planner.core.actions.drain_order`).

A standby (a planner that does not lead: `planner.leader_election`) calls `observe` instead:
steps 3 and 4 only, so that the leader it replaces hands over no cold forecast or cost model.
The first `decide` after it is a takeover: the leader may have scaled meanwhile, so the
scale-down cooldown and window start then, as at a planner's first tick; a scale-up the
observed load needs is decided at once.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

from planner.config import PlannerConfig, PoolConfig
from planner.core.actions import has_pending, provisioned, removals, resize
from planner.core.capacity import CostModel, Need, PassCost, engines_needed
from planner.core.decisions import Decision, Reason
from planner.core.forecast import HoltForecast
from planner.core.observations import (
    EngineObservation,
    EngineRole,
    EngineState,
    ForwardPasses,
    Observations,
)
from planner.core.roles import PoolRole, pool_role

log = logging.getLogger(__name__)

# Weight of a tick's measured mean prompt length (and decode length) in its running mean;
# 1 - it, what a tick's tokens weigh in `_TokenShare` against the next's.
_PROMPT_ALPHA = 0.2


@dataclass(slots=True)
class _TokenShare:
    """A share of tokens over the ticks that measured any, weighted by their tokens: the
    parts and the wholes summed, each earlier tick's worth 1 - `_PROMPT_ALPHA` of the next's
    (the running means' window), so that a tick of one short prompt moves it as little as
    its tokens weigh."""

    part: float = 0.0
    whole: float = 0.0

    def add(self, part: float, whole: float) -> None:
        keep = 1.0 - _PROMPT_ALPHA
        self.part = keep * self.part + part
        self.whole = keep * self.whole + whole

    @property
    def share(self) -> float | None:
        """None until a tick measured any token."""
        return self.part / self.whole if self.whole else None


@dataclass(frozen=True, slots=True)
class PoolEstimate:
    """What a tick's sizing of one pool saw and concluded (for the decision log and metrics)."""

    prompt_tokens_per_s: float  # measured since the previous tick
    kv_demand: float  # summed over the engines, in engines' worth of cache
    forecast_prompt_tokens_per_s: float  # `forecast_horizon_s` ahead
    # The forecast's mean absolute error; the need is sized for the forecast plus
    # `forecast_error_headroom` of these.
    forecast_error_prompt_tokens_per_s: float
    forecast_kv_demand: float
    mean_prompt_tokens: float
    mean_decode_passes: float  # passes a request decodes for (sizes the short-output bound)
    role: EngineRole  # the role sized for: which bounds apply
    cost: PassCost  # the learned pass-cost model
    need: Need
    # The need rounded up within the pool's bounds: the size a scale-up asks for (a
    # scale-down goes no lower than the largest such size, with headroom, over its window).
    engines_wanted: int


@dataclass(slots=True)
class _PoolState:
    cost: CostModel
    forecast: HoltForecast  # prompt tokens arriving per second
    kv_forecast: HoltForecast  # KV demand summed over the engines (in engines' caches)
    last_tick_s: float | None = None
    last_queued_tokens: float = 0.0  # `_queued_tokens` summed over the engines
    mean_prompt_tokens: float | None = None
    mean_decode_passes: float | None = None
    # Of the prompt tokens the pool's engines admitted, the share they computed (the rest
    # the prefix cache held), weighted by the tokens.
    computed: _TokenShare = field(default_factory=_TokenShare)
    last_up_s: float | None = None
    last_scale_s: float | None = None
    # (time, engines wanted with the scale-down headroom) over the stabilisation window.
    wanted: deque[tuple[float, int]] = field(default_factory=deque)
    last_estimate: PoolEstimate | None = None
    role: PoolRole | None = None  # the last tick's (a warning is logged when it changes)
    # False until the first `decide` (or the first after an `observe`): it starts the
    # scale-down cooldown and window.
    deciding: bool = False


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        cap = config.capacity
        self._pools = {
            pool.name: _PoolState(
                CostModel(cap),
                HoltForecast(cap.level_alpha, cap.trend_beta),
                HoltForecast(cap.level_alpha, cap.trend_beta),
            )
            for pool in config.pools
        }

    def need(self, pool: str) -> Need | None:
        """The last tick's sizing of `pool` (for the decision log and tests)."""
        estimate = self._pools[pool].last_estimate
        return None if estimate is None else estimate.need

    def estimate(self, pool: str) -> PoolEstimate | None:
        """The last sizing of `pool`: its inputs and the need; None before the second tick
        (no rate yet). A pool outside its bounds is sized all the same (the bounds decide)."""
        return self._pools[pool].last_estimate

    def decide(self, observations: Observations, now_s: float) -> list[Decision]:
        decisions: list[Decision] = []
        for pool, engines, passes in self._by_pool(observations):
            decisions.extend(self._decide_pool(pool, engines, passes, now_s))
        return decisions

    def observe(self, observations: Observations, now_s: float) -> None:
        """A standby's tick: learn from `observations` (the cost model, the forecasts, the
        running means, the estimate) as `decide` does, deciding nothing."""
        for pool, engines, passes in self._by_pool(observations):
            state = self._pools[pool.name]
            self._learn_and_size(pool, state, engines, passes, now_s)
            state.deciding = False

    def _by_pool(
        self, observations: Observations
    ) -> list[tuple[PoolConfig, list[EngineObservation], list[ForwardPasses]]]:
        """Each configured pool with its engines and their passes (other pools' are left)."""
        passes_by_engine: dict[str, list[ForwardPasses]] = {}
        for batch in observations.passes:
            passes_by_engine.setdefault(batch.engine_id, []).append(batch)
        by_pool = []
        for pool in self.config.pools:
            engines = observations.in_pool(pool.name)
            passes = [b for e in engines for b in passes_by_engine.get(e.engine_id, ())]
            by_pool.append((pool, engines, passes))
        return by_pool

    def _decide_pool(
        self,
        pool: PoolConfig,
        engines: list[EngineObservation],
        passes: list[ForwardPasses],
        now_s: float,
    ) -> list[Decision]:
        state = self._pools[pool.name]
        scaling = self.config.scaling
        decisions = removals(engines)
        current = provisioned(engines)
        # Every tick, the bounds' included: a tick that did not learn would drop its passes,
        # and the next would spread the prompt tokens of one tick over two.
        estimate = self._learn_and_size(pool, state, engines, passes, now_s)
        if current < pool.min_engines:
            # Up to the sized need if that is more (and no earlier capacity is pending): the
            # engines started now are pending until they serve, and no other scale-up is
            # decided meanwhile.
            target = pool.min_engines
            if estimate is not None and not has_pending(engines):
                target = max(target, estimate.engines_wanted)
            state.last_up_s = state.last_scale_s = now_s
            state.wanted.append((now_s, target))
            return [*decisions, *self._resize(pool, engines, target, Reason.BELOW_MIN, now_s)]
        if current > pool.max_engines:
            state.last_scale_s = now_s
            return [
                *decisions,
                *self._resize(pool, engines, pool.max_engines, Reason.ABOVE_MAX, now_s),
            ]
        if estimate is None or not state.deciding:
            # The first tick, or a takeover: the planner takes over the fleet as it is; the
            # cooldown and the window start now (no scale-down before they have seen it).
            # Without a rate yet (not observed before) nothing more is decided.
            state.deciding = True
            state.last_scale_s = now_s
            state.wanted.append((now_s, current))
            if estimate is None:
                return decisions
        pending = has_pending(engines)
        at_risk = self._sla_at_risk(state, engines)
        up = estimate.engines_wanted
        if up > current:
            cooling = state.last_up_s is not None and now_s - state.last_up_s < (
                scaling.scale_up_cooldown_s
            )
            if pending or cooling:
                return decisions
            state.last_up_s = state.last_scale_s = now_s
            state.wanted.append((now_s, up))  # the window remembers the size asked for
            reason = Reason.SLA_AT_RISK if at_risk else Reason.FORECAST_NEEDS_MORE
            return [*decisions, *self._resize(pool, engines, up, reason, now_s)]
        # Scale-down: the largest size (with headroom) asked for over the window.
        window = state.wanted
        with_headroom = estimate.need.engines * (1.0 + scaling.scale_down_headroom)
        window.append((now_s, _clamp(with_headroom, pool)))
        while window and window[0][0] < now_s - scaling.scale_down_stabilisation_s:
            window.popleft()
        down = max(wanted for _, wanted in window)
        recently = state.last_scale_s is not None and now_s - state.last_scale_s < (
            scaling.scale_down_cooldown_s
        )
        if down < current and not pending and not at_risk and not recently:
            state.last_scale_s = now_s
            return [*decisions, *self._resize(pool, engines, down, Reason.OVERPROVISIONED, now_s)]
        return decisions

    def _resize(
        self,
        pool: PoolConfig,
        engines: list[EngineObservation],
        target: int,
        reason: Reason,
        now_s: float,
    ) -> list[Decision]:
        deadline_s = self.config.scaling.drain_deadline_s
        return resize(
            pool.name,
            engines,
            target=target,
            reason=reason,
            now_s=now_s,
            drain_deadline_s=deadline_s,
        )

    def _learn_and_size(
        self,
        pool: PoolConfig,
        state: _PoolState,
        engines: list[EngineObservation],
        passes: list[ForwardPasses],
        now_s: float,
    ) -> PoolEstimate | None:
        """Steps 3 and 4 of the module docstring; None on the first tick (no rate yet)."""
        usage = {e.engine_id: e.load.kv_usage for e in engines}
        running = {e.engine_id: e.load.running_requests for e in engines}
        computed_tokens = cached_tokens = prefill_seqs = decoded_tokens = 0
        for batch in passes:
            state.cost.observe(
                now_s,
                batch.num_passes,
                batch.duration_s * 1000.0,
                batch.num_prefill_tokens,
                usage.get(batch.engine_id, 0.0),
            )
            computed_tokens += batch.num_prefill_tokens
            cached_tokens += batch.num_cached_tokens
            prefill_seqs += batch.num_prefill_sequences
            # Each running request gets a token a pass (the tick's running count stands for
            # the passes': an estimate the running mean smooths).
            decoded_tokens += batch.num_passes * running.get(batch.engine_id, 0)
        if prefill_seqs:
            # Per prefill sequence: a prompt split into chunks counts once per chunk, so the
            # decode length leans short (the strict side of the short-output bound).
            state.mean_prompt_tokens = _running_mean(
                state.mean_prompt_tokens, computed_tokens / prefill_seqs
            )
            state.mean_decode_passes = _running_mean(
                state.mean_decode_passes, decoded_tokens / prefill_seqs
            )
        if computed_tokens + cached_tokens:
            state.computed.add(computed_tokens, computed_tokens + cached_tokens)
        role = self._role(pool, state, engines)
        active = [e for e in engines if e.state is not EngineState.STARTING]
        queued = sum(_queued_tokens(e, role, state) for e in active)
        last_s, state.last_tick_s = state.last_tick_s, now_s
        last_queued, state.last_queued_tokens = state.last_queued_tokens, queued
        if last_s is None or now_s <= last_s:
            return None
        # The backlog's growth at this tick's share of it computed at both ends: a share that
        # moved (the first cache hits told) is no queue filling or draining.
        growth = (queued - last_queued) * _computed_share(role, state)
        arrivals = max(0.0, (computed_tokens + growth) / (now_s - last_s))
        kv_demand = sum(e.load.kv_demand(_computed_share(role, state)) for e in active)
        state.forecast.update(arrivals, now_s)
        state.kv_forecast.update(kv_demand, now_s)
        cap = self.config.capacity
        horizon_s = cap.forecast_horizon_s
        cost = state.cost.cost()
        forecast_rate = state.forecast.forecast(horizon_s)
        forecast_kv = state.kv_forecast.forecast(horizon_s)
        forecast_error = state.forecast.mean_abs_error
        mean_prompt_tokens = state.mean_prompt_tokens or 0.0
        mean_decode_passes = state.mean_decode_passes or 0.0
        need = engines_needed(
            cost,
            prompt_tokens_per_s=forecast_rate + cap.forecast_error_headroom * forecast_error,
            kv_usage_sum=forecast_kv,
            mean_prompt_tokens=mean_prompt_tokens,
            sla=self.config.sla,
            config=cap,
            decode_passes=mean_decode_passes,
            role=role,
        )
        estimate = PoolEstimate(
            prompt_tokens_per_s=arrivals,
            kv_demand=kv_demand,
            forecast_prompt_tokens_per_s=forecast_rate,
            forecast_error_prompt_tokens_per_s=forecast_error,
            forecast_kv_demand=forecast_kv,
            mean_prompt_tokens=mean_prompt_tokens,
            mean_decode_passes=mean_decode_passes,
            role=role,
            cost=cost,
            need=need,
            engines_wanted=_clamp(need.engines, pool),
        )
        state.last_estimate = estimate
        return estimate

    @staticmethod
    def _role(pool: PoolConfig, state: _PoolState, engines: list[EngineObservation]) -> EngineRole:
        """The role `pool` is sized as this tick; its warning is logged when it changes (an
        engine of another role joining the pool is said once, not every tick)."""
        role = pool_role(pool.name, pool.role, engines)
        if role != state.role and role.warning is not None:
            log.warning("%s", role.warning)
        state.role = role
        return role.role

    def _sla_at_risk(self, state: _PoolState, engines: list[EngineObservation]) -> bool:
        """Some serving engine's queued prefill alone would take longer than the TTFT target."""
        per_token_ms = state.cost.cost().prefill_ms_per_token
        limit_ms = self.config.sla.ttft_ms
        role = EngineRole.AGGREGATED if state.role is None else state.role.role
        return any(
            _prefill_backlog(e, role, state) * per_token_ms > limit_ms
            for e in engines
            if e.state is EngineState.SERVING
        )


def _prefill_backlog(engine: EngineObservation, role: EngineRole, state: _PoolState) -> float:
    """Prompt tokens `engine` will compute for its queued requests: `_queued_tokens`, of which
    `_computed_share`."""
    return _queued_tokens(engine, role, state) * _computed_share(role, state)


def _queued_tokens(engine: EngineObservation, role: EngineRole, state: _PoolState) -> float:
    """Prompt tokens of `engine`'s queued requests it has no KV for. GetLoad's waiting tokens
    count each queued prompt whole: the engine finds a prompt's cached prefix only when it
    admits it, and GetLoad has no count of the queued tokens cached. A decode engine's queued
    prompts come with their KV pulled from a prefill engine (in its prefix cache), so it
    computes only what that KV lacks: its queued requests times the prompt tokens its pool
    computes per request (the running mean), at most the waiting tokens (all of them until
    the mean is measured, or while the engine does not report its request counts: its
    queued_requests is then no count)."""
    waiting = engine.load.waiting_prefill_tokens
    if role is not EngineRole.DECODE:
        return waiting
    if state.mean_prompt_tokens is None or not engine.load.requests_known:
        return waiting
    return min(waiting, engine.load.queued_requests * state.mean_prompt_tokens)


def _computed_share(role: EngineRole, state: _PoolState) -> float:
    """Of `_queued_tokens`, the share the engines of a pool of `role` will compute, and of
    their waiting tokens, the share that takes KV blocks not in use now (`EngineLoad.kv_demand`).

    A decode engine's are all computed, and its queued prompts' pulled KV waits in its prefix
    cache as evictable blocks (or in host memory), taken into use whole at admission. Any
    other engine computes of its queued prompts the share its pool computed of the prompt
    tokens it admitted (the rest was cached: FORWARD_PASS's num_cached_tokens): an estimate,
    the queued prompts' hits taken to be those of the admitted ones (all of them until a pass
    is reported, or while no engine reports its hits). The hits take no new block where
    running requests hold them (a shared prefix: in the engine's used blocks already); hits
    on evictable blocks (a finished turn's, a preempted sequence's own) are taken into use
    uncounted, but under KV pressure such blocks are mostly the ones evicted, and the
    prompts then compute them: the share measured at admission rises."""
    share = state.computed.share
    if role is EngineRole.DECODE or share is None:
        return 1.0
    return share


def _running_mean(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + _PROMPT_ALPHA * (sample - previous)


def _clamp(engines: float, pool: PoolConfig) -> int:
    if math.isinf(engines):
        return pool.max_engines
    return max(pool.min_engines, min(pool.max_engines, math.ceil(engines - 1e-9)))
