"""The planner core's rules, one scenario each: bounds, scale-up, pending capacity, cooldown,
hysteresis and stabilised scale-down, drain before remove, least loaded drained first."""

from __future__ import annotations

import pytest

from planner.config import CapacityConfig, PlannerConfig, PoolConfig, ScalingConfig, SlaTargets
from planner.core.actions import drain_order
from planner.core.decisions import Decision, DrainEngine, Reason, RemoveEngine, ScalePool
from planner.core.observations import (
    EngineLoad,
    EngineObservation,
    EngineRole,
    EngineState,
    ForwardPasses,
    Observations,
)
from planner.core.planner import Planner, PoolEstimate
from tests.planner.planner_obs import TOTAL_BLOCKS, engine, passes

STARTING, SERVING, DRAINING = EngineState.STARTING, EngineState.SERVING, EngineState.DRAINING
IDLE_LOAD = EngineLoad(0, 0, 0, 0, TOTAL_BLOCKS)


# The rules are tested on the load as measured (no smoothing, no trend): what a tick sees is
# what the planner sizes for.
AS_MEASURED = CapacityConfig(level_alpha=1.0, trend_beta=0.0)


def make_planner(
    min_engines: int = 1, max_engines: int = 10, itl_ms: float = 40, **scaling: float
) -> Planner:
    return Planner(
        PlannerConfig(
            sla=SlaTargets(ttft_ms=1000, itl_ms=itl_ms),
            pools=(PoolConfig(min_engines=min_engines, max_engines=max_engines),),
            scaling=ScalingConfig(**scaling),
            capacity=AS_MEASURED,
        )
    )


def busy(engine_id: str, state: EngineState = SERVING, waiting: int = 16_000) -> EngineObservation:
    """An engine whose KV cache is 90% used with a cache's worth of prompts queued."""
    return engine(engine_id, state, running=20, queued=10, waiting_tokens=waiting, used_blocks=900)


def idle(engine_id: str, state: EngineState = SERVING, running: int = 0) -> EngineObservation:
    return engine(engine_id, state, running=running, used_blocks=10 * running)


def tick(
    planner: Planner, now_s: float, *engines: EngineObservation, with_passes: bool = True
) -> list[Decision]:
    batches = tuple(passes(e.engine_id) for e in engines if with_passes and e.state is SERVING)
    return planner.decide(Observations(tuple(engines), batches), now_s)


def test_below_min_scales_up_to_min() -> None:
    planner = make_planner(min_engines=2)
    assert tick(planner, 0, idle("a")) == [ScalePool("default", 2, Reason.BELOW_MIN)]


def test_above_max_drains_the_least_loaded_excess() -> None:
    planner = make_planner(max_engines=2)
    engines = (idle("a", running=5), idle("b", running=1), idle("c", running=3))
    assert tick(planner, 100, *engines) == [
        DrainEngine("b", "default", 100 + 300, Reason.ABOVE_MAX)
    ]


def test_first_tick_only_observes() -> None:
    planner = make_planner()
    assert tick(planner, 0, busy("a")) == []


def test_heavy_load_scales_up_at_once_to_the_sized_need() -> None:
    planner = make_planner()
    tick(planner, 0, busy("a"), busy("b"))
    decisions = tick(planner, 5, busy("a"), busy("b"))
    assert len(decisions) == 1
    (up,) = decisions
    assert isinstance(up, ScalePool) and up.reason is Reason.FORECAST_NEEDS_MORE
    # KV demand alone: 2 x (0.9 used + 1.0 queued) / 0.6 = 6.3 engines.
    assert up.num_engines >= 7
    need = planner.need("default")
    assert need is not None and need.kv == pytest.approx(2 * 1.9 / 0.6)


def prompts(planner: Planner, now_s: float, tokens_per_s: float, running: int = 10) -> None:
    """One tick of an engine with an empty cache that computed `tokens_per_s` prompt tokens a
    second over the last 5 s in 100 passes, one 2,000-token prompt a pass at 40,000 a second,
    with `running` requests decoding: each request decodes for `running` passes a prompt."""
    tokens = int(tokens_per_s * 5)
    batch = passes("a", prefill_tokens=tokens)
    busy_engine = engine("a", running=running)
    planner.decide(Observations((busy_engine,), (batch,)), now_s)


def test_short_outputs_beside_prompts_are_sized_by_the_prefill_share_not_the_mean_pass() -> None:
    # 40,000 prompt tokens/s at the priors' 0.02 ms a token: 800 ms of prefill a second. The
    # mean pass fits the 32 ms ITL budget with 1.5 engines (800 x 0.032 / (32 - 15)); a
    # request decoding 10 passes beside the prompts' chunks does not: at most 15% of an
    # engine's time on prompts, 0.8 / 0.15 = 5.3 engines.
    planner = make_planner()
    prompts(planner, 0, 40_000)
    prompts(planner, 5, 40_000)
    need = planner.need("default")
    assert need is not None
    assert need.itl == pytest.approx(0.8 / 0.15)
    assert need.engines == need.itl


def test_long_outputs_tolerate_a_larger_prefill_share() -> None:
    # The same prompts, requests decoding 160 passes (10x `short_output_passes`): the share
    # allowed grows to 0.15 x sqrt(10) = 0.47, 1.7 engines.
    planner = make_planner()
    prompts(planner, 0, 40_000, running=160)
    prompts(planner, 5, 40_000, running=160)
    estimate = planner.estimate("default")
    assert estimate is not None
    assert estimate.need.itl == pytest.approx(0.8 / (0.15 * 10**0.5))
    assert estimate.mean_decode_passes == pytest.approx(160)


def test_a_jump_in_load_is_sized_with_the_forecast_error_as_headroom() -> None:
    # As measured, the forecast is the last tick's rate and its error the last change: a jump
    # from nothing to 40,000 tokens/s is sized for 80,000 (twice the prefill share's 5.3
    # engines); the same load one tick later, forecast exactly, for 40,000.
    planner = make_planner()
    prompts(planner, 0, 0)
    prompts(planner, 5, 0)
    prompts(planner, 10, 40_000)
    jump = planner.estimate("default")
    assert jump is not None
    assert jump.need.itl == pytest.approx(2 * 0.8 / 0.15)
    assert jump.forecast_error_prompt_tokens_per_s == pytest.approx(40_000)
    prompts(planner, 15, 40_000)
    steady = planner.need("default")
    assert steady is not None and steady.itl == pytest.approx(0.8 / 0.15)


def test_a_tick_below_the_minimum_still_measures_the_load() -> None:
    """One engine of two lost (a crash): that tick scales back up to the minimum, and its
    passes still count. The load is 2,000 prompt tokens a second throughout; a tick that
    dropped them would have the next measure 1,000 (one tick's tokens over two ticks) and
    forecast a fall that is not there."""
    planner = make_planner(min_engines=2)

    def measured(now_s: float, *engines: EngineObservation) -> float:
        serving = [e for e in engines if e.state is SERVING]
        batches = tuple(passes(e.engine_id, prefill_tokens=10_000 // len(serving)) for e in serving)
        planner.decide(Observations(engines, batches), now_s)
        estimate = planner.estimate("default")
        assert estimate is not None
        return estimate.prompt_tokens_per_s

    tick(planner, 0, idle("a"), idle("b"))
    assert measured(5, idle("a"), idle("b")) == pytest.approx(2_000)
    assert measured(10, idle("a")) == pytest.approx(2_000)  # b lost: below the minimum
    assert measured(15, idle("a"), idle("c", STARTING)) == pytest.approx(2_000)


def test_queued_prefill_beyond_the_ttft_target_is_an_sla_risk() -> None:
    planner = make_planner()
    tick(planner, 0, busy("a", waiting=80_000))
    (up,) = tick(planner, 5, busy("a", waiting=80_000))
    assert isinstance(up, ScalePool) and up.reason is Reason.SLA_AT_RISK


# An aggregated engine's load: 10 requests running, 20 prompts of 3,000 tokens queued (GetLoad's
# waiting tokens count them whole), its KV 1% used (a large cache: KV does not bind here).
PROMPTS_QUEUED = EngineLoad(
    running_requests=10,
    queued_requests=20,
    waiting_prefill_tokens=20 * 3_000,
    used_kv_blocks=1_000,
    total_kv_blocks=100_000,
)


def scaling_down_at_once() -> Planner:
    """A planner of a pool of at most 4 engines with no scale-down window nor cooldown."""
    return Planner(
        PlannerConfig(
            pools=(PoolConfig(max_engines=4),),
            scaling=ScalingConfig(scale_down_stabilisation_s=0, scale_down_cooldown_s=0),
            capacity=AS_MEASURED,
        )
    )


def two_aggregated_engines_ticked(hits_reported: bool) -> list[Decision]:
    """The decisions of two ticks of a pool (at most 4 engines, no scale-down window nor
    cooldown) of two aggregated engines with `PROMPTS_QUEUED`, each admitting 20 prompts of
    3,000 tokens a tick of which the prefix cache held 2,250 (said in FORWARD_PASS's
    num_cached_tokens when `hits_reported`), computing the other 750 in 140 passes timed as
    the priors predict."""
    planner = scaling_down_at_once()
    engines = tuple(
        EngineObservation(name, "default", SERVING, PROMPTS_QUEUED, EngineRole.AGGREGATED)
        for name in ("a", "b")
    )
    computed, cached = 20 * 750, 20 * 2_250 if hits_reported else 0
    duration_s = (140 * (15.0 + 40.0 * 0.01) + 0.02 * computed) / 1000.0
    batches = tuple(
        ForwardPasses(e.engine_id, 140, duration_s, computed, 20, cached) for e in engines
    )
    return [d for now_s in (0, 5) for d in planner.decide(Observations(engines, batches), now_s)]


def test_an_aggregated_pool_s_queued_prompts_count_only_what_the_cache_lacks() -> None:
    """GetLoad's waiting tokens count a queued prompt whole: the engine finds its cached
    prefix only when it admits it. Two engines, each with 20 prompts of 3,000 tokens queued,
    whose admitted prompts had 2,250 of their 3,000 tokens cached (a shared system prompt):
    the pool computes a quarter of what it admits, so of the 60,000 queued tokens 15,000,
    0.3 s at 0.02 ms a token, within the 1 s TTFT target. Counted whole, 1.2 s: an SLA at
    risk that held off the scale-down of a pool that needs one engine (6,000 prompt tokens
    computed a second: 0.12 of one engine's time)."""
    assert two_aggregated_engines_ticked(hits_reported=True) == [
        DrainEngine("a", "default", 5 + 300, Reason.OVERPROVISIONED)
    ]


def test_queued_prompts_count_whole_while_the_engines_report_no_cache_hits() -> None:
    """The same engines, their FORWARD_PASS events without num_cached_tokens (GetLoad has no
    count of the queued tokens cached either): nothing says what the cache will spare, so
    their 60,000 queued tokens count whole, 1.2 s of prefill, over the TTFT target (an SLA at
    risk), and the pool is kept."""
    assert two_aggregated_engines_ticked(hits_reported=False) == []


def test_the_first_cache_hits_told_are_no_drop_in_the_prompt_tokens_arriving() -> None:
    """Two aggregated engines with `PROMPTS_QUEUED` (60,000 tokens queued, unchanged), their
    first tick without passes, their second admitting 20 prompts each of which the cache held
    three quarters: the prompt tokens arriving are those computed, 30,000 in 5 s, 6,000 a
    second (the queue did not grow). The queue was measured whole at the first tick and at a
    quarter at the second, a fall of 45,000 tokens taken for a queue draining: no prompt
    tokens arriving at all."""
    planner = Planner(PlannerConfig(pools=(PoolConfig(max_engines=4),), capacity=AS_MEASURED))
    engines = tuple(
        EngineObservation(name, "default", SERVING, PROMPTS_QUEUED, EngineRole.AGGREGATED)
        for name in ("a", "b")
    )
    planner.decide(Observations(engines, ()), 0)
    batches = tuple(ForwardPasses(e.engine_id, 140, 3.0, 20 * 750, 20, 20 * 2_250) for e in engines)
    planner.decide(Observations(engines, batches), 5)
    estimate = planner.estimate("default")
    assert estimate is not None
    assert estimate.prompt_tokens_per_s == pytest.approx(6_000)


# One engine of 1,000 blocks of 16 tokens (16,000 tokens of KV), 400 blocks in use (0.4 of its
# cache) and 4 prompts of 2,000 tokens queued (8,000 waiting tokens: 0.5 of its cache whole).
KV_BOUND_LOAD = EngineLoad(
    running_requests=8,
    queued_requests=4,
    waiting_prefill_tokens=4 * 2_000,
    used_kv_blocks=400,
    total_kv_blocks=1_000,
)


def kv_bound_pool_ticked(role: EngineRole) -> tuple[list[Decision], PoolEstimate]:
    """Two ticks of a pool (at most 4 engines; an ITL target of 100 ms, so that the KV bound
    is the one that binds) of one engine of `role` with `KV_BOUND_LOAD`, admitting 4 prompts
    of 2,000 tokens a tick of which the prefix cache held 1,500 (FORWARD_PASS's
    num_cached_tokens), computing the other 500 in 100 passes timed as the priors predict."""
    planner = Planner(
        PlannerConfig(
            sla=SlaTargets(ttft_ms=1000, itl_ms=100),
            pools=(PoolConfig(max_engines=4),),
            capacity=AS_MEASURED,
        )
    )
    engines = (EngineObservation("a", "default", SERVING, KV_BOUND_LOAD, role),)
    duration_s = (100 * (15.0 + 40.0 * 0.4) + 0.02 * 2_000) / 1000.0
    batches = (ForwardPasses("a", 100, duration_s, 4 * 500, 4, 4 * 1_500),)
    decisions = [
        d for now_s in (0, 5) for d in planner.decide(Observations(engines, batches), now_s)
    ]
    estimate = planner.estimate("default")
    assert estimate is not None
    return decisions, estimate


def test_queued_prompts_take_into_use_only_the_kv_their_cached_prefix_does_not_hold() -> None:
    """An aggregated engine 0.4 used, whose admitted prompts had three quarters of their tokens
    cached (a shared system prompt its running requests hold, in its used blocks already):
    of its 8,000 queued tokens a quarter, 2,000, take new blocks, so its KV demand is
    (6,400 + 2,000) / 16,000 = 0.525, 0.875 of an engine at the 0.6 `max_kv_usage`: one
    engine. Counted whole, 0.9, 1.5 engines: a second engine started for KV the queued
    prompts share with the running ones."""
    decisions, estimate = kv_bound_pool_ticked(EngineRole.AGGREGATED)
    assert estimate.kv_demand == pytest.approx(0.525)
    assert estimate.need.kv == pytest.approx(0.875)
    assert decisions == []


def test_idle_ticks_leave_the_share_computed_as_it_was_and_a_restart_measures_it_anew() -> None:
    """The share of admitted prompt tokens computed is over the ticks that admitted any: an
    hour of ticks with no pass (nothing admitted, the prompts still queued) leaves it at a
    quarter, the KV demand at 0.525 (`test_queued_prompts_take_into_use_only_...`), and
    never divides by zero. A planner restarted knows no share until a pass is reported: the
    queued prompts count whole, 0.9."""
    config = PlannerConfig(
        sla=SlaTargets(ttft_ms=1000, itl_ms=100),
        pools=(PoolConfig(max_engines=4),),
        capacity=AS_MEASURED,
    )
    engines = (EngineObservation("a", "default", SERVING, KV_BOUND_LOAD, EngineRole.AGGREGATED),)
    duration_s = (100 * (15.0 + 40.0 * 0.4) + 0.02 * 2_000) / 1000.0
    batches = (ForwardPasses("a", 100, duration_s, 4 * 500, 4, 4 * 1_500),)
    planner = Planner(config)
    for now_s in range(0, 3_600, 30):
        planner.decide(Observations(engines, batches if now_s < 60 else ()), now_s)
        estimate = planner.estimate("default")
        assert estimate is None or estimate.kv_demand == pytest.approx(0.525)
    restarted = Planner(config)
    for now_s in (3_600, 3_605):
        restarted.decide(Observations(engines, ()), now_s)
    estimate = restarted.estimate("default")
    assert estimate is not None and estimate.kv_demand == pytest.approx(0.9)


def test_a_decode_engine_s_queued_prompts_take_their_pulled_kv_into_use_whole() -> None:
    """The same load on a decode engine: its queued prompts' KV, pulled from a prefill engine,
    waits in its prefix cache as evictable blocks, found as hits at admission and taken into
    use then, none of it in its used blocks yet: the 8,000 queued tokens count whole, KV
    demand (6,400 + 8,000) / 16,000 = 0.9, 1.5 engines at the 0.6 `max_kv_usage`: two."""
    decisions, estimate = kv_bound_pool_ticked(EngineRole.DECODE)
    assert estimate.kv_demand == pytest.approx(0.9)
    assert decisions == [ScalePool("default", 2, Reason.FORECAST_NEEDS_MORE)]


def test_the_share_of_prompt_tokens_computed_is_weighted_by_the_tokens() -> None:
    """Two aggregated engines (a pool that needs one: no scale-down window nor cooldown), each
    with 160,000 prompt tokens queued. Each admits 9,980 prompt tokens at the first tick, 2,480
    of them computed (7,500 cached), then one 16-token prompt, computed. The share computed,
    each tick's tokens weighing 0.8 of the next's: (0.8 x 4,960 + 32) / (0.8 x 19,960 + 32) =
    4,000 / 16,000 = 0.25, so each engine's queued prefill is 40,000 tokens, 0.8 s at 0.02 ms
    a token, within the 1 s TTFT target: one engine drained. A mean of the ticks' shares gave
    the short prompts a fifth of the weight: 0.248 + 0.2 x (1 - 0.248) = 0.40, 1.28 s of
    queued prefill, an SLA at risk that held off the scale-down."""
    planner = scaling_down_at_once()
    load = EngineLoad(10, 50, 160_000, 1_000, 100_000)
    engines = tuple(
        EngineObservation(name, "default", SERVING, load, EngineRole.AGGREGATED)
        for name in ("a", "b")
    )

    def admitted(num_passes: int, computed: int, cached: int) -> tuple[ForwardPasses, ...]:
        duration_s = (num_passes * (15.0 + 40.0 * 0.01) + 0.02 * computed) / 1000.0
        return tuple(
            ForwardPasses(e.engine_id, num_passes, duration_s, computed, 1, cached) for e in engines
        )

    assert planner.decide(Observations(engines, admitted(10, 2_480, 7_500)), 0) == []
    assert planner.decide(Observations(engines, admitted(1, 16, 0)), 5) == [
        DrainEngine("a", "default", 5 + 300, Reason.OVERPROVISIONED)
    ]


def test_no_scale_up_while_earlier_capacity_is_starting() -> None:
    planner = make_planner()
    tick(planner, 0, busy("a"), busy("b"), idle("c", STARTING))
    assert tick(planner, 5, busy("a"), busy("b"), idle("c", STARTING)) == []
    # Once it serves, the same load does scale up.
    (up,) = tick(planner, 10, busy("a"), busy("b"), busy("c"))
    assert isinstance(up, ScalePool) and up.num_engines > 3


def test_scale_up_cooldown() -> None:
    planner = make_planner(scale_up_cooldown_s=30)
    tick(planner, 0, busy("a"))
    (up,) = tick(planner, 5, busy("a"))
    assert isinstance(up, ScalePool)
    serving = [busy(f"e{i}") for i in range(up.num_engines)]
    # Ready within the cooldown and still overloaded: held back until it has passed.
    assert tick(planner, 20, *serving) == []
    assert isinstance(tick(planner, 40, *serving)[0], ScalePool)


def test_hysteresis_keeps_a_fleet_whose_need_is_just_below_its_size() -> None:
    # A lax ITL target: the KV need decides. 3 engines at 55% KV: need = 3 x 0.55 / 0.6
    # = 2.75 -> 3 (no scale-up); with 20% headroom 3.3 -> 4 (no scale-down either).
    planner = make_planner(itl_ms=1000, scale_down_stabilisation_s=0, scale_down_cooldown_s=0)
    engines = [engine(f"e{i}", running=10, used_blocks=550) for i in range(3)]
    for now_s in (0, 5, 10, 15, 20):
        assert tick(planner, now_s, *engines) == []
    need = planner.need("default")
    assert need is not None and need.engines == pytest.approx(2.75)


def test_scale_down_waits_for_the_stabilisation_window() -> None:
    planner = make_planner(scale_down_stabilisation_s=60, scale_down_cooldown_s=0)
    engines = [idle("a", running=3), idle("b", running=1), idle("c", running=2)]
    decisions = {}
    for now_s in range(0, 70, 5):
        decisions[now_s] = tick(planner, now_s, *engines)
    # The window starts with the fleet as found (3 engines): nothing until it has rolled.
    assert all(not d for t, d in decisions.items() if t < 65)
    assert decisions[65] == [
        DrainEngine("b", "default", 65 + 300, Reason.OVERPROVISIONED),
        DrainEngine("c", "default", 65 + 300, Reason.OVERPROVISIONED),
    ]


def test_scale_down_cooldown_after_a_scale_up() -> None:
    planner = make_planner(
        scale_down_stabilisation_s=0, scale_down_cooldown_s=100, scale_up_cooldown_s=0
    )
    tick(planner, 0, busy("a"))
    assert isinstance(tick(planner, 5, busy("a"))[0], ScalePool)
    quiet = [idle("a"), idle("b")]
    assert tick(planner, 50, *quiet) == []
    assert tick(planner, 104, *quiet) == []
    assert tick(planner, 105, *quiet) == [DrainEngine("a", "default", 405, Reason.OVERPROVISIONED)]


def test_a_scale_up_holds_its_size_for_the_whole_window() -> None:
    planner = make_planner(
        scale_down_stabilisation_s=100, scale_down_cooldown_s=10, scale_up_cooldown_s=0
    )
    tick(planner, 0, busy("a"))
    (up,) = tick(planner, 5, busy("a"))
    assert isinstance(up, ScalePool)
    quiet = [idle(f"e{i}") for i in range(up.num_engines)]
    # The load is gone at once; the cooldown passes, the window has not.
    assert all(tick(planner, t, *quiet) == [] for t in range(10, 105, 5))
    (first, *_) = tick(planner, 110, *quiet)
    assert isinstance(first, DrainEngine) and first.reason is Reason.OVERPROVISIONED


def test_no_scale_down_while_capacity_is_starting() -> None:
    planner = make_planner(scale_down_stabilisation_s=0, scale_down_cooldown_s=0)
    engines = [idle("a"), idle("b"), idle("c", STARTING)]
    for now_s in (0, 5, 10):
        assert tick(planner, now_s, *engines) == []
    # The same idle pool once c serves is scaled down: what the start held back.
    serving = [idle("a"), idle("b"), idle("c")]
    decisions = [d for now_s in (15, 20, 25) for d in tick(planner, now_s, *serving)]
    assert any(isinstance(d, DrainEngine) for d in decisions), decisions


def test_drain_then_remove_only_once_drained() -> None:
    planner = make_planner(min_engines=1)
    assert tick(planner, 0, idle("a"), idle("b", DRAINING, running=2)) == []
    assert tick(planner, 5, idle("a"), idle("b", DRAINING, running=1)) == []
    assert tick(planner, 10, idle("a"), idle("b", DRAINING)) == [
        RemoveEngine("b", "default", Reason.DRAINED)
    ]


def test_a_draining_prefill_engine_is_removed_only_once_its_kv_sessions_are_pulled() -> None:
    """A prefill engine that holds no request but KV sessions no decode engine has pulled yet
    is not drained (its own Drain completes only once they are gone): removing and stopping
    it then loses the prompts' KV under the decode engines about to pull it (the planner
    soak's prefill pool, docs/soak.md)."""
    planner = make_planner(min_engines=1)
    handed_over = engine("p", DRAINING, kv_sessions=3)
    assert tick(planner, 0, idle("a"), handed_over) == []
    assert tick(planner, 5, idle("a"), engine("p", DRAINING)) == [
        RemoveEngine("p", "default", Reason.DRAINED)
    ]


def test_a_pool_below_its_minimum_under_heavy_load_scales_up_to_the_need() -> None:
    """Two engines, the minimum, then one lost while the other is heavily loaded: the pool
    is scaled up to what the load needs, not to the minimum alone, which would leave it short
    for a whole start-up time (no scale-up is decided while engines start)."""
    planner = make_planner(min_engines=2)
    tick(planner, 0, idle("a"), idle("b"))
    assert tick(planner, 5, idle("a"), idle("b")) == []
    (up,) = tick(planner, 10, busy("a"))
    estimate = planner.estimate("default")
    assert estimate is not None
    # KV demand alone: 0.9 used + 1.0 queued, over 0.6: 4 engines.
    assert estimate.engines_wanted >= 4
    assert up == ScalePool("default", estimate.engines_wanted, Reason.BELOW_MIN)
    # Capacity already pending (an engine starting): up to the minimum only, as before.
    pending = make_planner(min_engines=3)
    tick(pending, 0, idle("a"), idle("b"), idle("c"))
    tick(pending, 5, idle("a"), idle("b"), idle("c"))
    assert tick(pending, 10, busy("a"), idle("d", STARTING)) == [
        ScalePool("default", 3, Reason.BELOW_MIN)
    ]


def test_draining_engines_do_not_count_towards_the_pool() -> None:
    planner = make_planner(min_engines=2)
    assert tick(planner, 0, idle("a"), idle("b", DRAINING, running=1)) == [
        ScalePool("default", 2, Reason.BELOW_MIN)
    ]


def test_engines_of_unconfigured_pools_are_left_alone() -> None:
    planner = make_planner(max_engines=1)
    engines = [engine("x", pool="other"), engine("y", pool="other"), idle("a")]
    assert tick(planner, 0, *engines) == []
    assert tick(planner, 5, engine("x", DRAINING, pool="other"), idle("a")) == []


def observe(planner: Planner, now_s: float, *engines: EngineObservation) -> None:
    """A standby's tick (`Planner.observe`) of `engines`, each with its passes."""
    batches = tuple(passes(e.engine_id) for e in engines if e.state is SERVING)
    planner.observe(Observations(tuple(engines), batches), now_s)


def test_a_standby_taking_over_scales_up_at_its_first_decision_from_the_load_it_observed() -> None:
    """A standby's core learns from the ticks it observes (the leader's fleet, heavily
    loaded), deciding nothing; its first `decide`, as leader, scales up to the sized need at
    once, where a planner that observed nothing only measures at its first tick."""
    warm, cold = make_planner(), make_planner()
    for now_s in (0, 5, 10):
        observe(warm, now_s, busy("a"), busy("b"))
    need = warm.need("default")
    assert need is not None and need.kv == pytest.approx(2 * 1.9 / 0.6)
    (up,) = tick(warm, 15, busy("a"), busy("b"))
    assert up == ScalePool("default", 7, Reason.FORECAST_NEEDS_MORE)
    assert tick(cold, 15, busy("a"), busy("b")) == []


def test_a_standby_taking_over_scales_down_only_after_the_cooldown_from_its_takeover() -> None:
    """The leader it replaces may have scaled just before: the scale-down cooldown runs from
    the takeover, as from a planner's first tick, however long the standby observed an idle
    fleet; and again from a second takeover (it stood by again meanwhile)."""
    planner = make_planner(scale_down_stabilisation_s=0, scale_down_cooldown_s=60)
    engines = (idle("a", running=3), idle("b", running=1), idle("c", running=2))
    for now_s in range(0, 300, 5):
        observe(planner, now_s, *engines)
    assert tick(planner, 300, *engines) == []  # the takeover
    assert tick(planner, 355, *engines) == []
    assert tick(planner, 361, *engines) == [
        DrainEngine("b", "default", 361 + 300, Reason.OVERPROVISIONED),
        DrainEngine("c", "default", 361 + 300, Reason.OVERPROVISIONED),
    ]
    for now_s in range(400, 500, 5):
        observe(planner, now_s, *engines)
    assert tick(planner, 500, *engines) == []  # the second takeover
    assert tick(planner, 559, *engines) == []
    assert tick(planner, 561, *engines) != []


def test_a_fleet_sized_right_for_a_while_scales_up_at_once_when_the_load_comes() -> None:
    """Ticks whose need rounds to the fleet's size are no scale-up: they do not start the
    scale-up cooldown, so the first tick that needs more engines asks for them at once."""
    planner = make_planner(itl_ms=1000, scale_up_cooldown_s=30)
    # 3 engines at 55% KV: need 2.75 -> 3, the fleet's size.
    sized_right = [engine(f"e{i}", running=10, used_blocks=550) for i in range(3)]
    for now_s in (0, 5, 10, 15, 20):
        assert tick(planner, now_s, *sized_right) == []
    (up,) = tick(planner, 25, busy("e0"), busy("e1"), busy("e2"))
    assert isinstance(up, ScalePool) and up.num_engines > 3


def test_scale_down_keeps_its_headroom_above_the_need() -> None:
    """4 engines whose need is exactly 3 (KV: 4 x 0.45 / 0.6) stay 4: with the 20% headroom
    a scale-down keeps, 3 engines would be 3.6 -> 4, so draining one would have the next
    rise in load scale it up again."""
    planner = make_planner(itl_ms=1000, scale_down_stabilisation_s=0, scale_down_cooldown_s=0)
    engines = [engine(f"e{i}", running=10, used_blocks=450) for i in range(4)]
    for now_s in range(0, 60, 5):
        assert tick(planner, now_s, *engines) == []
    need = planner.need("default")
    assert need is not None and need.engines == pytest.approx(3.0)


def test_a_pool_above_its_maximum_keeps_its_only_serving_engine_while_others_start() -> None:
    """Lowered to one engine while one serves and another starts: neither is drained (the
    starting one is not serving yet; draining the serving one would leave requests nowhere
    to go); the excess is drained once the new one serves."""
    planner = make_planner(max_engines=1)
    assert tick(planner, 0, idle("a", running=2), idle("b", STARTING)) == []
    assert tick(planner, 5, idle("a", running=2), idle("b")) == [
        DrainEngine("b", "default", 5 + 300, Reason.ABOVE_MAX)
    ]


def test_the_engines_drained_first_hold_the_least_work_then_the_least_cached_prefix() -> None:
    """The drain order: fewest requests (running and queued alike), then least KV in use,
    then fewest queued prompt tokens, then fewest blocks in the controller's index, then the
    engine id."""
    least_prefix = EngineObservation("a-prefix", "default", SERVING, IDLE_LOAD, indexed_blocks=1)
    more_prefix = EngineObservation("b-prefix", "default", SERVING, IDLE_LOAD, indexed_blocks=9)
    engines = [
        engine("queued", queued=2, waiting_tokens=100),
        engine("running", running=1, used_blocks=100),
        engine("more-kv", running=1, used_blocks=200),
        engine("waiting", queued=1, used_blocks=100, waiting_tokens=5_000),
        more_prefix,
        least_prefix,
        engine("z-tie"),
        engine("y-tie"),
    ]
    assert [e.engine_id for e in drain_order(engines)] == [
        "y-tie",
        "z-tie",
        "a-prefix",
        "b-prefix",
        "running",
        "waiting",
        "more-kv",
        "queued",
    ]


def test_a_draining_engine_with_requests_only_queued_is_not_removed() -> None:
    planner = make_planner()
    queued_only = engine("b", DRAINING, queued=2, waiting_tokens=1_000)
    assert tick(planner, 0, idle("a"), queued_only) == []
    assert tick(planner, 5, idle("a"), engine("b", DRAINING)) == [
        RemoveEngine("b", "default", Reason.DRAINED)
    ]


def test_a_draining_engine_s_queue_is_no_sla_risk_of_its_pool() -> None:
    """An engine drained (by hand, say) with a long prompt queue takes no new request: its
    queue, beyond the TTFT target, holds off no scale-down of the serving engines."""
    planner = scaling_down_at_once()
    leaving = EngineObservation(
        "d", "default", DRAINING, EngineLoad(0, 20, 80_000, 0, 1_000_000), EngineRole.AGGREGATED
    )
    engines = (idle("a"), idle("b"), idle("c"), leaving)
    assert tick(planner, 0, *engines) == []
    assert tick(planner, 5, *engines) == [
        DrainEngine("a", "default", 5 + 300, Reason.OVERPROVISIONED),
        DrainEngine("b", "default", 5 + 300, Reason.OVERPROVISIONED),
    ]
