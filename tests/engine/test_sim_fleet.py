"""Offline replay through a fleet of sim engines in virtual time."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.core.api import (
    BlockRemoved,
    BlockStored,
    EngineRequest,
    KvEvent,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.sim_fleet import (
    Progress,
    RequestRecord,
    SimEngine,
    SimFleet,
    TimedRequest,
    round_robin,
    trace_prompt_tokens,
)
from engine.core.sim_runner import TimingModel
from kvplane.cli import app


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


def test_progress_notes_reach_the_router_before_later_arrivals() -> None:
    """A router callback sees each first token and finish that happened before the arrival it
    routes (what a live router's in-flight accounting would have seen), stamped like the
    records; `fleet.now_s` is the arrival time."""
    fleet = make_fleet()
    notes: list[tuple[str, Progress, float]] = []
    seen_at_route: dict[str, int] = {}
    route_times: list[float] = []
    rr = round_robin()

    def on_progress(index: int, request_id: str, what: Progress, now_s: float) -> None:
        notes.append((request_id, what, now_s))

    def route(request: EngineRequest, engines: Sequence[SimEngine]) -> int:
        seen_at_route[request.request_id] = len(notes)
        route_times.append(fleet.now_s)
        return rr(request, engines)

    requests = workload(60)
    records = fleet.replay(requests, route, on_progress=on_progress)
    assert route_times == [r.arrival_s for r in requests]
    by_id = {r.request_id: r for r in records}
    assert len(notes) == 2 * len(records)
    for request_id, what, now_s in notes:
        record = by_id[request_id]
        expected = record.first_token_s if what is Progress.FIRST_TOKEN else record.finish_s
        assert now_s == expected
    for request in requests:
        # Every note delivered before this arrival was routed is from a step that started
        # before it; every step that ended at or before it had been delivered.
        before = notes[: seen_at_route[request.request.request_id]]
        ended = [n for n in notes if n[2] <= request.arrival_s]
        assert set(ended) <= set(before)
    firsts = [n[0] for n in notes if n[1] is Progress.FIRST_TOKEN]
    assert sorted(firsts) == sorted(by_id)
    assert sum(e.busy_s for e in fleet.engines) > 0


def test_preemptions_are_counted_per_engine() -> None:
    fleet = SimFleet(
        1,
        block_size=16,
        num_blocks=10,
        config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
    )
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    requests = [
        TimedRequest(0.0, EngineRequest(f"r{i}", tuple(range(10 + i, 70 + i)), sampling))
        for i in range(2)
    ]
    records = fleet.replay(requests, round_robin())
    assert all(r.num_output_tokens == 40 for r in records)
    assert fleet.engines[0].num_preemptions >= 1


def test_trace_rows_become_blocks_of_their_hash_ids() -> None:
    tokens = trace_prompt_tokens([7, 8, 9], 10, 4, filler=1000)
    assert tokens == (7, 7, 7, 7, 8, 8, 8, 8, 9, 9)
    assert trace_prompt_tokens([7], 6, 4, filler=1000) == (7, 7, 7, 7, 1000, 1000)


def test_bench_sim_cli_replays_the_first_requests_of_a_trace(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 100 * i,
            "input_length": 2 * 512 + 10,
            "output_length": 5,
            "hash_ids": [1, 2, 100 + i],  # a shared two-block prefix, a private tail
        }
        for i in range(12)
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["bench", "sim", "--trace", str(trace), "--requests", "10", "--engines", "2"]
    result = CliRunner().invoke(app, [*args, "--output", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["requests"] == 10 and doc["engines"] == 2
    assert doc["output_tokens"] == 50
    # Each engine computes the prefix once; later requests hit its two blocks.
    assert doc["hit_ratio"] == pytest.approx(8 * 1024 / (10 * 1034), abs=1e-4)
    assert doc["ttft_ms"]["p99"] > 0 and doc["wall_s"] >= 0
    table = CliRunner().invoke(app, [*args, "--output", "table"])
    assert table.exit_code == 0 and "10 requests" in table.output


def test_bench_sim_says_what_it_left_out_and_refuses_when_nothing_fits(tmp_path: Path) -> None:
    """A request longer than one engine's cache cannot run: the table says how many were
    left out, and when none is left the command fails (it reported zeros, exit 0)."""
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 100, "output_length": 2, "hash_ids": [3]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["bench", "sim", "--trace", str(trace), "--engines", "1"]
    one_block = CliRunner().invoke(app, [*args, "--blocks-per-engine", "1"])
    assert one_block.exit_code == 0, one_block.output
    assert "1 requests of trace.jsonl" in one_block.output
    assert "1 longer than one engine's KV cache left out" in one_block.output
    tiny = CliRunner().invoke(app, [*args, "--blocks-per-engine", "1", "--block-size", "16"])
    assert tiny.exit_code == 1
    assert str(tiny.exception).startswith(f"no request of {trace} fits one engine's KV cache")


def test_bench_sim_refuses_an_infinite_speedup(tmp_path: Path) -> None:
    """click's `min=` lets `inf` through, and the JSON would then carry `Infinity`."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2}))
    result = CliRunner().invoke(app, ["bench", "sim", "--trace", str(trace), "--speedup", "inf"])
    assert result.exit_code == 2
    assert "inf is not a finite number" in result.output
