"""Over random observation streams, whatever the load: the planner removes only engines it
saw drained, drains only serving engines, never the last one serving, and its decisions keep
every pool within its min/max (starting + serving engines, once applied); and the prompt
tokens it measures add up to those computed, every tick counted once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.config import PlannerConfig, PoolConfig, ScalingConfig
from planner.core.actions import provisioned
from planner.core.decisions import DrainEngine, RemoveEngine, ScalePool
from planner.core.observations import EngineObservation, EngineState, Observations
from planner.core.planner import Planner
from planner.core.threshold import ThresholdAutoscaler, ThresholdSettings
from tests.planner.planner_obs import TOTAL_BLOCKS, engine, passes


@dataclass
class _Engine:
    engine_id: str
    state: EngineState
    requests: int = 0
    ticks_to_ready: int = 0


# One tick of the world: (load per engine 0..1, ticks a new engine takes, requests a
# draining engine finishes).
# One tick: the load, engines started, requests finished, waiting tokens.
Tick = tuple[float, int, int, int]
ticks = st.lists(
    st.tuples(st.floats(0.0, 1.0), st.integers(0, 3), st.integers(0, 4), st.integers(0, 60_000)),
    min_size=1,
    max_size=40,
)


def _observe(fleet: list[_Engine], load: float, waiting: int) -> tuple[EngineObservation, ...]:
    return tuple(
        engine(
            e.engine_id,
            e.state,
            running=e.requests,
            queued=1 if waiting and e.state is EngineState.SERVING else 0,
            waiting_tokens=waiting if e.state is EngineState.SERVING else 0,
            used_blocks=int(load * TOTAL_BLOCKS) if e.requests else 0,
        )
        for e in fleet
    )


def _run(policy: Planner | ThresholdAutoscaler, stream: list[Tick], min_n: int, max_n: int) -> None:
    fleet = [_Engine("e0", EngineState.SERVING, 5)]
    names = iter(f"e{i}" for i in range(1, 10_000))
    for step, (load, start_ticks, finished, waiting) in enumerate(stream):
        now_s = step * 5.0
        observed = _observe(fleet, load, waiting)
        batches = tuple(passes(e.engine_id, prefill_tokens=waiting) for e in observed)
        decisions = policy.decide(Observations(observed, batches), now_s)
        by_id = {e.engine_id: e for e in observed}
        for decision in decisions:
            if isinstance(decision, RemoveEngine):
                seen = by_id[decision.engine_id]
                assert seen.state is EngineState.DRAINING and seen.load.num_requests == 0
                fleet = [e for e in fleet if e.engine_id != decision.engine_id]
            elif isinstance(decision, DrainEngine):
                assert by_id[decision.engine_id].state is EngineState.SERVING
                assert decision.deadline_s > now_s
                next(
                    e for e in fleet if e.engine_id == decision.engine_id
                ).state = EngineState.DRAINING
            elif isinstance(decision, ScalePool):
                assert min_n <= decision.num_engines <= max_n
                while sum(e.state is not EngineState.DRAINING for e in fleet) < (
                    decision.num_engines
                ):
                    fleet.append(_Engine(next(names), EngineState.STARTING, 0, start_ticks))
        size = provisioned(_observe(fleet, 0.0, 0))
        assert min_n <= size <= max_n
        if any(e.state is EngineState.SERVING for e in observed):
            assert any(e.state is EngineState.SERVING for e in fleet)
        # The world moves: engines start, serving ones take requests, draining ones finish.
        for e in fleet:
            if e.state is EngineState.STARTING:
                e.ticks_to_ready -= 1
                if e.ticks_to_ready <= 0:
                    e.state = EngineState.SERVING
            elif e.state is EngineState.SERVING:
                e.requests = int(load * 40)
            else:
                e.requests = max(0, e.requests - finished)


@settings(max_examples=60, deadline=None)
@given(stream=ticks, min_n=st.integers(1, 3), spread=st.integers(0, 6))
def test_planner_removes_only_drained_engines_and_keeps_bounds(
    stream: list[Tick], min_n: int, spread: int
) -> None:
    max_n = min_n + spread
    config = PlannerConfig(
        pools=(PoolConfig(min_engines=min_n, max_engines=max_n),),
        scaling=ScalingConfig(
            scale_up_cooldown_s=0, scale_down_cooldown_s=0, scale_down_stabilisation_s=10
        ),
    )
    _run(Planner(config), stream, min_n, max_n)


@settings(max_examples=30, deadline=None)
@given(stream=ticks, min_n=st.integers(1, 3), spread=st.integers(0, 6))
def test_threshold_peer_obeys_the_same_rules(stream: list[Tick], min_n: int, spread: int) -> None:
    max_n = min_n + spread
    pool = PoolConfig(min_engines=min_n, max_engines=max_n)
    settings_ = ThresholdSettings(scale_down_stabilisation_s=10)
    _run(ThresholdAutoscaler(pool, settings_), stream, min_n, max_n)


@settings(max_examples=60, deadline=None)
@given(
    stream=st.lists(
        st.tuples(
            st.integers(0, 5),  # engines serving (the pool's bounds are 2..3)
            st.integers(0, 1),  # engines starting
            st.integers(0, 20_000),  # prompt tokens each serving engine computed
            st.floats(1.0, 30.0),  # seconds since the previous tick
        ),
        min_size=2,
        max_size=30,
    )
)
def test_the_measured_prompt_rate_accounts_for_every_token_computed(
    stream: list[tuple[int, int, int, float]],
) -> None:
    """With no queued prompts, the prompt-token rate measured each tick, times the tick's
    length, adds up to the prompt tokens the engines computed: none is lost or counted twice,
    whether the pool is within its bounds that tick, below its minimum or above its maximum
    (engines lost, adopted), or has engines starting."""
    planner = Planner(PlannerConfig(pools=(PoolConfig(min_engines=2, max_engines=3),)))
    now_s = 0.0
    measured = computed = 0.0
    for step, (num_serving, num_starting, tokens, elapsed_s) in enumerate(stream):
        now_s += elapsed_s
        serving = [engine(f"s{i}") for i in range(num_serving)]
        starting = [engine(f"n{i}", EngineState.STARTING) for i in range(num_starting)]
        batches = tuple(passes(e.engine_id, prefill_tokens=tokens) for e in serving)
        planner.decide(Observations((*serving, *starting), batches), now_s)
        if step == 0:
            continue  # the first tick has no rate yet: what it computed is not measured
        computed += tokens * num_serving
        estimate = planner.estimate("default")
        assert estimate is not None
        measured += estimate.prompt_tokens_per_s * elapsed_s
    assert measured == pytest.approx(computed)
