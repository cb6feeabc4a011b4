"""A disaggregated fleet's pools are sized by their role: a prefill pool by TTFT and KV only
(its engines never decode), a decode pool by ITL, KV and the little prompt work its own
engines do; the role is what the engines report, else the pool's configured one, and a pool
whose engines disagree is sized as aggregated (and said)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from planner.config import CapacityConfig, PlannerConfig, PoolConfig, ScalingConfig, SlaTargets
from planner.core.decisions import Decision, DrainEngine, Reason, ScalePool
from planner.core.observations import (
    EngineLoad,
    EngineObservation,
    EngineRole,
    EngineState,
    ForwardPasses,
    Observations,
)
from planner.core.planner import Planner
from tests.planner.planner_obs import TOTAL_BLOCKS, engine

PREFILL, DECODE, AGGREGATED = EngineRole.PREFILL, EngineRole.DECODE, EngineRole.AGGREGATED
SERVING = EngineState.SERVING
# As in test_planner_core: sized on the load as measured (no smoothing, no trend).
AS_MEASURED = CapacityConfig(level_alpha=1.0, trend_beta=0.0)
TICK_S = 5.0


def make_planner(pool: str, role: EngineRole | None = None, max_engines: int = 16) -> Planner:
    return Planner(
        PlannerConfig(
            sla=SlaTargets(ttft_ms=1000, itl_ms=40),
            pools=(PoolConfig(name=pool, max_engines=max_engines, role=role),),
            capacity=AS_MEASURED,
        )
    )


@dataclass(frozen=True)
class EngineTick:
    """What each engine of a pool shows in a 5 s tick: its load at the tick, and its passes
    since the last, timed as the default priors predict (15 ms a pass, 0.02 ms a prompt
    token, 40 ms at a full cache), so the learned cost stays the priors."""

    running: int
    used_blocks: int
    passes: int
    prefill_tokens: int
    prefill_sequences: int
    kv_sessions: int = 0

    def passes_of(self, engine_id: str) -> ForwardPasses:
        usage = self.used_blocks / TOTAL_BLOCKS
        duration_ms = self.passes * (15.0 + 40.0 * usage) + 0.02 * self.prefill_tokens
        return ForwardPasses(
            engine_id,
            self.passes,
            duration_ms / 1000.0,
            self.prefill_tokens,
            self.prefill_sequences,
        )


def pool_tick(
    planner: Planner, now_s: float, pool: str, roles: dict[str, EngineRole | None], each: EngineTick
) -> list[Decision]:
    """One tick of the engines `roles` names (with the role each reports), each showing `each`."""
    engines = [
        engine(
            engine_id,
            running=each.running,
            used_blocks=each.used_blocks,
            kv_sessions=each.kv_sessions,
            pool=pool,
            role=role,
        )
        for engine_id, role in roles.items()
    ]
    batches = [each.passes_of(engine_id) for engine_id in roles]
    return planner.decide(Observations(tuple(engines), tuple(batches)), now_s)


# A prefill engine's tick at 20,000 prompt tokens/s: 50 prompts of 2,000 tokens, one a pass;
# nothing decodes (the prompt being computed is its only running request) and its KV is 2%
# used (the prompt and two KV sessions no decode engine has pulled yet).
PREFILL_TICK = EngineTick(
    running=1,
    used_blocks=20,
    passes=50,
    prefill_tokens=100_000,
    prefill_sequences=50,
    kv_sessions=2,
)


def prefill_tick(
    planner: Planner, now_s: float, roles: Sequence[EngineRole | None]
) -> list[Decision]:
    """Five prefill engines, 100,000 prompt tokens/s in all."""
    engines = {f"p{i}": role for i, role in enumerate(roles)}
    return pool_tick(planner, now_s, "prefill", engines, PREFILL_TICK)


def test_a_prefill_pool_is_sized_by_ttft_not_by_the_itl_bounds() -> None:
    # 100,000 prompt tokens/s at 0.02 ms a token: 2.0 s of prefill a second. A 2,000-token
    # prompt's prefill takes 15 + 40 = 55 ms, against half the 1,000 ms TTFT target: engines
    # may spend 1 - 55/500 = 89% of their time on prompts, ceil(2.0 / 0.89) = 3 engines. Sized
    # as aggregated engines (short outputs beside prompts: at most 15% on prompts), the same
    # pool asked for ceil(2.0 / 0.15) = 14 of its 16.
    planner = make_planner("prefill")
    prefill_tick(planner, 0, [PREFILL] * 5)
    decisions = prefill_tick(planner, TICK_S, [PREFILL] * 5)
    estimate = planner.estimate("prefill")
    assert estimate is not None and estimate.role is PREFILL
    assert estimate.need.ttft == pytest.approx(2.0 / 0.89)
    assert estimate.need.itl == 0
    assert estimate.need.kv == pytest.approx(5 * 0.02 / 0.6)
    assert estimate.engines_wanted == 3
    assert decisions == []  # the five engines there are more than enough


def test_a_prefill_pool_configured_as_such_is_sized_so_before_its_engines_report() -> None:
    planner = make_planner("prefill", role=PREFILL)
    prefill_tick(planner, 0, [None] * 5)
    prefill_tick(planner, TICK_S, [None] * 5)
    estimate = planner.estimate("prefill")
    assert estimate is not None and estimate.role is PREFILL
    assert estimate.engines_wanted == 3


def test_a_pool_whose_engines_disagree_is_sized_as_aggregated_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    planner = make_planner("prefill", role=PREFILL)
    mixed = [PREFILL, PREFILL, DECODE, PREFILL, PREFILL]
    with caplog.at_level(logging.WARNING, logger="planner.core.planner"):
        prefill_tick(planner, 0, mixed)
        decisions = prefill_tick(planner, TICK_S, mixed)
        prefill_tick(planner, 2 * TICK_S, mixed)
    estimate = planner.estimate("prefill")
    assert estimate is not None and estimate.role is AGGREGATED
    assert estimate.need.itl == pytest.approx(2.0 / 0.15)  # the aggregated bounds, all of them
    assert decisions == [ScalePool("prefill", 14, Reason.FORECAST_NEEDS_MORE)]
    assert [r.getMessage() for r in caplog.records] == [
        "pool prefill: its engines report different roles (decode, prefill): sized as aggregated"
    ]


def test_what_the_engines_report_wins_over_the_configured_role(
    caplog: pytest.LogCaptureFixture,
) -> None:
    planner = make_planner("prefill", role=DECODE)
    with caplog.at_level(logging.WARNING, logger="planner.core.planner"):
        prefill_tick(planner, 0, [PREFILL] * 5)
        prefill_tick(planner, TICK_S, [PREFILL] * 5)
    estimate = planner.estimate("prefill")
    assert estimate is not None and estimate.role is PREFILL
    assert estimate.engines_wanted == 3
    assert [r.getMessage() for r in caplog.records] == [
        "pool prefill: configured as decode but its engines report prefill: sized as prefill"
    ]


def test_a_pool_of_engines_that_report_no_role_is_sized_as_aggregated() -> None:
    planner = make_planner("prefill")
    prefill_tick(planner, 0, [None] * 5)
    prefill_tick(planner, TICK_S, [None] * 5)
    estimate = planner.estimate("prefill")
    assert estimate is not None and estimate.role is AGGREGATED
    assert estimate.engines_wanted == 14


# A decode engine's tick: 40 requests decoding, its KV cache half full, 140 passes and 20 new
# requests, of each prompt computing only the last partial block (8 tokens: the rest was
# pulled from a prefill engine).
DECODE_TICK = EngineTick(
    running=40, used_blocks=500, passes=140, prefill_tokens=160, prefill_sequences=20
)


def decode_tick(planner: Planner, now_s: float) -> list[Decision]:
    """Four decode engines."""
    return pool_tick(planner, now_s, "decode", {f"d{i}": DECODE for i in range(4)}, DECODE_TICK)


def test_a_decode_pool_is_sized_by_its_decode_passes_and_kv() -> None:
    # 4 engines x 160 tokens / 5 s = 128 prompt tokens/s: 2.56 ms of prefill a second. A pass
    # takes 15 ms + 40 ms x 2.0 caches' worth of KV / N + the prompts: within 0.8 x 40 = 32 ms
    # with N = (40 x 2.0 + 2.56 x 0.032) / (32 - 15) = 4.71 engines, 5; KV alone 2.0 / 0.6 =
    # 3.3; TTFT only for the 8-token prompt tails these engines compute: almost nothing.
    planner = make_planner("decode")
    decode_tick(planner, 0)
    decisions = decode_tick(planner, TICK_S)
    estimate = planner.estimate("decode")
    assert estimate is not None and estimate.role is DECODE
    assert estimate.mean_prompt_tokens == pytest.approx(8)
    assert estimate.need.itl == pytest.approx((40 * 2.0 + 2.56 * 0.032) / (32 - 15))
    assert estimate.need.kv == pytest.approx(2.0 / 0.6)
    assert estimate.need.ttft < 0.01
    assert decisions == [ScalePool("decode", 5, Reason.FORECAST_NEEDS_MORE)]


# A decode engine's load: 20 prompts of 3,000 tokens queued, its KV 1% used.
DECODE_TOTAL_BLOCKS = 100_000
PULLED_QUEUED = EngineLoad(
    running_requests=10,
    queued_requests=20,
    waiting_prefill_tokens=20 * 3_000,
    used_kv_blocks=1_000,
    total_kv_blocks=DECODE_TOTAL_BLOCKS,
)


def two_decode_engines_ticked(load: EngineLoad) -> list[Decision]:
    """The decisions of two ticks of a decode pool (at most 4 engines, no scale-down window
    nor cooldown) of two engines with `load`, each computing 140 passes a tick, timed as the
    priors predict, 20 prompts' 8-token tails among them."""
    planner = Planner(
        PlannerConfig(
            sla=SlaTargets(ttft_ms=1000, itl_ms=40),
            pools=(PoolConfig(name="decode", max_engines=4, role=DECODE),),
            scaling=ScalingConfig(scale_down_stabilisation_s=0, scale_down_cooldown_s=0),
            capacity=AS_MEASURED,
        )
    )
    engines = tuple(EngineObservation(f"d{i}", "decode", SERVING, load, DECODE) for i in (0, 1))
    usage = load.used_kv_blocks / DECODE_TOTAL_BLOCKS
    duration_s = (140 * (15.0 + 40.0 * usage) + 0.02 * 160) / 1000.0
    batches = tuple(ForwardPasses(e.engine_id, 140, duration_s, 160, 20) for e in engines)
    return [
        d for now_s in (0, TICK_S) for d in planner.decide(Observations(engines, batches), now_s)
    ]


def test_a_decode_pool_s_queued_prompts_pulled_whole_do_not_hold_off_its_scale_down() -> None:
    """GetLoad's waiting tokens count a queued prompt whole; a decode engine pulled its KV
    and computes only the 8-token tail. Two such engines, each with 20 prompts of 3,000
    tokens queued: 60,000 tokens x 0.02 ms would be 1.2 s of prefill, over the 1 s TTFT
    target (an SLA at risk, no scale-down), while they compute 20 x 8 tokens, 3.2 ms. The
    pool needs one engine (its KV 5% used, 8-token tails), so one is drained."""
    assert two_decode_engines_ticked(PULLED_QUEUED) == [
        DrainEngine("d0", "decode", TICK_S + 300, Reason.OVERPROVISIONED)
    ]


def test_an_uncounted_decode_engine_s_queued_prefill_is_its_waiting_tokens() -> None:
    """A decode engine whose GetLoad has no request counts (`requests_known` False: its
    queued_requests is a stale 0, not a count) has its waiting tokens as its queued prefill,
    not none: the same engines as above, their 60,000 tokens x 0.02 ms, 1.2 s of prefill,
    over the 1 s TTFT target, so the pool is not scaled down (the tails' estimate needs the
    number of queued requests)."""
    uncounted = replace(PULLED_QUEUED, running_requests=0, queued_requests=0)
    assert two_decode_engines_ticked(replace(uncounted, requests_known=False)) == []
