"""The sim runner: timing-model figures, virtual and scaled time, KV events that replay to the
block manager's cached set, and prefix hits reported as cached tokens."""

from __future__ import annotations

import random

import pytest

from engine.core.api import (
    BlockRemoved,
    BlockStored,
    EngineRequest,
    KvEvent,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.engine_core import EngineCore
from engine.core.sim_runner import SimRunner, TimingModel, VirtualClock
from indexer.keys import block_keys


def test_timing_model_matches_dynamo_mocker_figures() -> None:
    model = TimingModel()
    assert model.prefill_ms(1000) == pytest.approx(32.1058589, abs=1e-6)
    assert model.prefill_ms(8192) == pytest.approx(
        4.209989e-7 * 8192**2 + 0.01518344 * 8192 + 16.50142
    )
    assert model.decode_ms(0.5) == pytest.approx(26.31)
    assert model.decode_ms(0.0) == pytest.approx(5.74)
    assert model.decode_ms(3.0) == pytest.approx(model.decode_ms(1.0)) == pytest.approx(34.01)
    floor = TimingModel(decode_ms_coeffs=(0.0, 0.0, -5.0))
    assert floor.decode_ms(0.2) == 1.0
    # Mixed pass = P + D; pure decode has no prefill constant; empty pass costs nothing.
    assert model.forward_ms(1000, 3, 0.5) == pytest.approx(32.1058589 + 26.31)
    assert model.forward_ms(0, 3, 0.5) == pytest.approx(26.31)
    assert model.forward_ms(0, 0, 0.0) == 0.0


def test_virtual_clock_advances_by_the_modelled_durations() -> None:
    clock = VirtualClock(100.0)
    runner = SimRunner(block_size=16, num_blocks=100, clock=clock)
    core = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=8192), clock=clock)
    core.add_request(EngineRequest("r", tuple(range(10, 410)), SamplingParams(max_tokens=3)))
    durations = []
    while core.has_work():
        stats = core.step().stats
        assert stats is not None
        durations.append(stats.duration_s)
    model = TimingModel()
    capacity = 100 * 16
    assert durations[0] == pytest.approx(model.prefill_ms(400) / 1000)
    assert durations[1] == pytest.approx(model.decode_ms(401 / capacity) / 1000)
    assert durations[2] == pytest.approx(model.decode_ms(402 / capacity) / 1000)
    assert clock.now() == pytest.approx(100.0 + sum(durations))


def test_time_scale_scales_real_sleeps() -> None:
    slept: list[float] = []
    runner = SimRunner(time_scale=0.25, sleep=slept.append)
    core = EngineCore(runner)
    core.add_request(EngineRequest("r", tuple(range(10, 110)), SamplingParams(max_tokens=2)))
    while core.has_work():
        core.step()
    model = TimingModel()
    assert slept[0] == pytest.approx(model.prefill_ms(100) / 1000 * 0.25)
    assert len(slept) == 2
    idle: list[float] = []
    fast = EngineCore(SimRunner(time_scale=0, sleep=idle.append))
    fast.add_request(EngineRequest("r", (5, 6, 7), SamplingParams(max_tokens=4)))
    while fast.has_work():
        fast.step()
    assert idle == []


def replay(events: list[KvEvent], cached: set[int]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_keys)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_keys)
        else:
            cached.clear()


def predicted_hit_tokens(prompt: tuple[int, ...], cached: set[int], block_size: int) -> int:
    """What an index built from the events predicts (the last prompt token is never a hit)."""
    hits = 0
    for key in block_keys(prompt, block_size)[: (len(prompt) - 1) // block_size]:
        if key not in cached:
            break
        hits += block_size
    return hits


def test_kv_events_replay_to_the_cached_set_and_predict_hits() -> None:
    rng = random.Random(7)
    block_size = 4
    core = EngineCore(
        SimRunner(block_size=block_size, num_blocks=40, time_scale=0),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
    )
    prefixes = [tuple(rng.randrange(10, 900) for _ in range(12)) for _ in range(3)]
    cached: set[int] = set()
    saw_removal = False
    for i in range(40):
        prompt = rng.choice(prefixes) + tuple(
            rng.randrange(10, 900) for _ in range(rng.randint(1, 9))
        )
        replay(core.take_kv_events(), cached)
        # On an idle engine the index's prediction must be exact.
        idle = not core.has_work()
        expected = predicted_hit_tokens(prompt, cached, block_size) if idle else None
        request_id = f"r{i}"
        core.add_request(
            EngineRequest(request_id, prompt, SamplingParams(max_tokens=rng.randint(1, 8)))
        )
        final: RequestOutput | None = None
        for _ in range(rng.randint(1, 6)):
            for out in core.step().outputs:
                if out.request_id == request_id and out.usage is not None:
                    final = out
            events = core.take_kv_events()
            saw_removal |= any(isinstance(e, BlockRemoved) for e in events)
            replay(events, cached)
            assert cached == core.block_manager.cached_keys()
        if final is not None and expected is not None:
            assert final.usage is not None
            assert final.usage.cached_prompt_tokens == expected
    while core.has_work():
        core.step()
    replay(core.take_kv_events(), cached)
    assert cached == core.block_manager.cached_keys()
    assert saw_removal  # the pool is small enough that LRU eviction happened


def test_prefix_hit_is_reported_as_cached_tokens_and_costs_less() -> None:
    clock = VirtualClock()
    core = EngineCore(SimRunner(block_size=16, num_blocks=64, clock=clock), clock=clock)
    prompt = tuple(range(100, 200))  # 100 tokens: 6 full blocks
    outputs: list[RequestOutput] = []
    stats = []
    for request_id in ("cold", "warm"):
        core.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=2)))
        while core.has_work():
            result = core.step()
            outputs += result.outputs
            stats.append(result.stats)
    usage = {o.request_id: o.usage for o in outputs if o.usage is not None}
    assert usage["cold"] is not None and usage["cold"].cached_prompt_tokens == 0
    assert usage["warm"] is not None and usage["warm"].cached_prompt_tokens == 96
    warm_prefill = stats[2]
    assert warm_prefill is not None
    assert warm_prefill.num_cached_tokens == 96
    assert warm_prefill.num_prefill_tokens == 4
    assert warm_prefill.duration_s == pytest.approx(TimingModel().prefill_ms(4) / 1000)
    assert [o.new_token_ids for o in outputs if o.request_id == "warm"] == [
        o.new_token_ids for o in outputs if o.request_id == "cold"
    ]


def test_dummy_tokens_avoid_eos_unless_asked() -> None:
    runner = SimRunner(vocab_size=40, token_id_floor=0, eos_token_ids=frozenset({2}), time_scale=0)
    core = EngineCore(runner)
    core.add_request(EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=300)))
    tokens: list[int] = []
    while core.has_work():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert len(tokens) == 300 and 2 not in tokens


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_logprobs_are_assembled_across_chunks_once(start: int) -> None:
    core = EngineCore(
        SimRunner(block_size=4, num_blocks=64, time_scale=0),
        SchedulerConfig(max_num_batched_tokens=8),
    )
    prompt = tuple(range(50, 80))
    warm = EngineRequest("warm", prompt, SamplingParams(max_tokens=1))
    sampling = SamplingParams(
        max_tokens=3,
        logprobs=LogprobRequest(top_n=1),
        prompt_logprobs=LogprobRequest(top_n=1),
        prompt_logprob_start=start,
    )
    outputs: list[RequestOutput] = []
    for request in (warm, EngineRequest("r", prompt, sampling)):
        core.add_request(request)
        while core.has_work():
            outputs += [o for o in core.step().outputs if o.request_id == "r"]
    with_prompt = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is outputs[0]
    entries = with_prompt[0].prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) - start
    for position, entry in enumerate(entries, start):
        if position == 0:
            assert entry is None  # the first prompt token has no conditional probability
        else:
            assert entry is not None and entry.token_id == prompt[position]
    # Output logprobs align with the emitted tokens.
    for out in outputs:
        assert out.logprobs is not None
        assert [lp.token_id for lp in out.logprobs] == list(out.new_token_ids)
    # Prompt logprobs need every position computed: no prefix reuse for this request.
    final = outputs[-1]
    assert final.usage is not None and final.usage.cached_prompt_tokens == 0
