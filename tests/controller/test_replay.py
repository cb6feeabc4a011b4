"""The trace replay: the simulated engine's timing and cache, the replay's metrics, and the
`kvplane bench route` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.replay import ReplaySettings, load_trace, oracle_hit_ratio, replay
from controller.sim_engine import Note, SimEngine, SimEngineConfig, SimRequest, TimingModel
from kvplane.cli import app

TRACES = (
    Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "mooncake-fast25"
)
TIMING = TimingModel()


def sim_request(
    rid: str, keys: tuple[int, ...], prompt: int, output: int, at: float = 0.0
) -> SimRequest:
    return SimRequest(rid, at, prompt, output, keys)


def test_one_request_takes_prefill_then_decode_passes() -> None:
    engine = SimEngine("w", SimEngineConfig(num_blocks=64, block_size=16))
    req = sim_request("a", tuple(range(62)), 1000, 3)
    engine.add(req, 0.0)
    engine.run_to_completion()
    assert req.first_token_ms == pytest.approx(TIMING.prefill_ms(1000))
    # Two decode passes; u = context tokens / (64 blocks x 16 tokens).
    decode = TIMING.decode_ms(1001 / 1024) + TIMING.decode_ms(1002 / 1024)
    assert req.finish_ms == pytest.approx(TIMING.prefill_ms(1000) + decode)
    assert [n for n, _, _ in engine.notes] == [Note.FIRST_TOKEN, Note.FINISHED]
    assert req.cached_tokens == 0


def test_long_prompt_is_prefilled_in_chunks() -> None:
    engine = SimEngine("w", SimEngineConfig(num_blocks=2048, block_size=16))
    req = sim_request("a", (), 20_000, 1)
    engine.add(req, 0.0)
    engine.run_to_completion()
    expected = 2 * TIMING.prefill_ms(8192) + TIMING.prefill_ms(20_000 - 2 * 8192)
    assert req.first_token_ms == pytest.approx(expected)
    assert engine.num_passes == 3


def test_prefix_cache_full_blocks_and_one_token_recomputed() -> None:
    engine = SimEngine("w", SimEngineConfig(num_blocks=64, block_size=16))
    first = sim_request("a", (1, 2, 3, 4), 64, 2)
    engine.add(first, 0.0)
    engine.run_to_completion()
    assert engine.prefix_blocks((1, 2, 3, 4)) == 4
    again = sim_request("b", (1, 2, 3, 4), 64, 2, at=1000.0)  # all 4 blocks cached
    engine.add(again, 1000.0)
    engine.run_to_completion()
    assert again.cached_tokens == 48  # the last block is recomputed
    longer = sim_request("c", (1, 2, 9), 50, 2, at=2000.0)
    engine.add(longer, 2000.0)
    engine.run_to_completion()
    assert longer.cached_tokens == 32


def test_lru_evicts_the_oldest_unreferenced_blocks_tail_first() -> None:
    engine = SimEngine("w", SimEngineConfig(num_blocks=8, block_size=16))
    for i, keys in enumerate([(1, 2, 3), (4, 5, 6)]):
        req = sim_request(f"r{i}", keys, 49, 1, at=float(i))
        engine.add(req, float(i))
        engine.run_to_completion()
    # 2 x 4 blocks (3 full + 1 partial each) fill the cache; the partial ones were freed.
    assert engine.cached_blocks == 6
    third = sim_request("r2", (7, 8, 9), 49, 1, at=10.0)
    engine.add(third, 10.0)
    engine.run_to_completion()
    # Room for 4 blocks: 2 were free, then the oldest request's tail (3, then 2) went.
    assert engine.prefix_blocks((1, 2, 3)) == 1
    assert engine.prefix_blocks((4, 5, 6)) == 3


def test_preemption_by_recompute_when_the_cache_runs_out() -> None:
    engine = SimEngine("w", SimEngineConfig(num_blocks=10, block_size=16))
    reqs = [sim_request(f"r{i}", (), 60, 40) for i in range(2)]
    for req in reqs:
        engine.add(req, 0.0)
    engine.run_to_completion()
    assert all(r.finish_ms is not None and r.num_generated == 40 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) >= 1


def test_oracle_bounds_match_the_published_figures() -> None:
    synthetic = load_trace(TRACES / "synthetic_trace.jsonl")
    assert oracle_hit_ratio(synthetic, 512) == pytest.approx(0.650, abs=0.001)


@pytest.mark.timeout(120)
def test_round_robin_reproduces_dynamos_mocker() -> None:
    """The simulator's fidelity: round robin on the synthetic trace lands on the figures
    Dynamo's mocker publishes for the same setup (reuse 0.112, TTFT mean 301 / p99 1,435 ms)."""
    trace = load_trace(TRACES / "synthetic_trace.jsonl")
    result = replay(trace, "round_robin", ReplaySettings())
    assert result.hit_ratio == pytest.approx(0.112, abs=0.003)
    assert result.ttft_ms["mean"] == pytest.approx(301, rel=0.03)
    assert result.ttft_ms["p99"] == pytest.approx(1435, rel=0.03)
    assert result.num_requests == 3993


def _write_trace(path: Path) -> Path:
    rows = []
    for i in range(60):
        conversation = i % 7
        turn = i // 7
        prefix = [1000 * conversation + t for t in range(turn + 2)]
        rows.append(
            {
                "timestamp": i * 300,
                "input_length": len(prefix) * 512 + 100,
                "output_length": 20,
                "hash_ids": [*prefix, 999_000 + i],
            }
        )
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_kvplane_keeps_conversations_where_their_prefix_lives(tmp_path: Path) -> None:
    trace = load_trace(_write_trace(tmp_path / "t.jsonl"))
    settings = ReplaySettings(workers=3, blocks_per_worker=256)
    kv = replay(trace, "kvplane", settings)
    rr = replay(trace, "round_robin", settings)
    assert kv.hit_ratio > rr.hit_ratio
    assert kv.hit_ratio > 0.8 * oracle_hit_ratio(trace, 512)


def test_bench_route_cli_json(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "route",
            "--trace",
            str(trace),
            "--workers",
            "3",
            "--blocks-per-worker",
            "64",
            "--policies",
            "kvplane,round_robin",
            "--output",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert {
        "trace",
        "workers",
        "blocks_per_worker",
        "block_size",
        "speedup",
        "oracle_hit_ratio",
    } <= set(doc)
    assert set(doc["policies"]) == {"kvplane", "round_robin"}
    row = doc["policies"]["kvplane"]
    assert {"hit_ratio", "ttft_ms", "itl_ms", "imbalance", "throughput_rps"} <= set(row)
    assert set(row["ttft_ms"]) == {"mean", "p50", "p99"}
    table = CliRunner().invoke(
        app, ["bench", "route", "--trace", str(trace), "--policies", "random"]
    )
    assert table.exit_code == 0 and "random" in table.output
