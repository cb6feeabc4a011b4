"""Offline replay through a fleet of sim engines in virtual time."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence

import pytest

from engine.core.api import (
    BlockRemoved,
    BlockStored,
    EngineRequest,
    KvEvent,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.sim_fleet import RequestRecord, SimEngine, SimFleet, TimedRequest, round_robin
from engine.core.sim_runner import TimingModel


def workload(num_requests: int, seed: int = 3) -> list[TimedRequest]:
    rng = random.Random(seed)
    system_prompts = [tuple(rng.randrange(10, 5000) for _ in range(48)) for _ in range(4)]
    requests = []
    now_s = 0.0
    for i in range(num_requests):
        now_s += rng.expovariate(20.0)
        prompt = rng.choice(system_prompts) + tuple(
            rng.randrange(10, 5000) for _ in range(rng.randint(1, 40))
        )
        sampling = SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True)
        requests.append(TimedRequest(now_s, EngineRequest(f"r{i}", prompt, sampling)))
    return requests


def make_fleet(fast_forward: bool = True) -> SimFleet:
    return SimFleet(
        3,
        block_size=16,
        num_blocks=40,
        config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
        fast_forward=fast_forward,
    )


def as_tuple(record: RequestRecord) -> tuple[object, ...]:
    return (
        record.request_id,
        record.engine_index,
        record.first_token_s,
        record.finish_s,
        record.num_cached_tokens,
        record.num_output_tokens,
    )


def test_a_lone_request_takes_the_modelled_time() -> None:
    fleet = SimFleet(2, block_size=16, num_blocks=100)
    request = EngineRequest("r", tuple(range(10, 210)), SamplingParams(max_tokens=3))
    (record,) = fleet.replay([TimedRequest(5.0, request)], round_robin())
    model = TimingModel()
    capacity = 100 * 16
    prefill_s = model.prefill_ms(200) / 1000
    decode_s = (model.decode_ms(201 / capacity) + model.decode_ms(202 / capacity)) / 1000
    assert record.ttft_s == pytest.approx(prefill_s)
    assert record.e2e_s == pytest.approx(prefill_s + decode_s)
    assert record.num_output_tokens == 3


def test_fast_forward_replays_exactly_like_step_by_step() -> None:
    requests = workload(60)
    fast = make_fleet(fast_forward=True).replay(requests, round_robin())
    slow = make_fleet(fast_forward=False).replay(requests, round_robin())
    assert [as_tuple(r) for r in fast] == [as_tuple(r) for r in slow]
    assert all(r.finish_s is not None for r in fast)
    assert sum(r.num_cached_tokens for r in fast) > 0  # shared system prompts were reused


def test_kv_events_per_engine_replay_to_each_block_manager() -> None:
    fleet = make_fleet()
    cached: dict[int, set[int]] = defaultdict(set)

    def on_events(index: int, now_s: float, events: list[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                cached[index].update(event.block_keys)
            elif isinstance(event, BlockRemoved):
                cached[index].difference_update(event.block_keys)
            else:
                cached[index].clear()

    def least_loaded(request: EngineRequest, engines: Sequence[SimEngine]) -> int:
        return min(engines, key=lambda e: e.core.scheduler.num_running).index

    records = fleet.replay(workload(80, seed=5), least_loaded, on_kv_events=on_events)
    assert len(records) == 80
    for engine in fleet.engines:
        assert cached[engine.index] == engine.core.block_manager.cached_keys()
        assert engine.core.load().num_used_blocks == 0


def test_unsorted_arrivals_are_refused() -> None:
    requests = workload(3)
    with pytest.raises(ValueError, match="sorted"):
        make_fleet().replay(list(reversed(requests)), round_robin())
