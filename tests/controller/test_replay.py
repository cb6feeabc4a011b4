"""The trace replay (the router core over the engine's SimFleet): trace blocks as cache keys,
fidelity to Dynamo's mocker, the replay's metrics, and the `kvplane bench route` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controller.bench import render_table
from controller.replay import ReplaySettings, oracle_hit_ratio, replay
from engine.core.mooncake_trace import TraceRequest, load_trace
from engine.core.sim_runner import TimingModel
from kvplane.cli import app

TRACES = (
    Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "mooncake-fast25"
)
TIMING = TimingModel()


def _row(at_ms: float, hash_ids: list[int], input_length: int, output: int = 4) -> TraceRequest:
    return TraceRequest(at_ms, input_length, output, tuple(hash_ids))


def test_trace_blocks_hit_where_the_trace_shares_them() -> None:
    """One worker: a repeated prefix is served from the engine's cache, full blocks only, the
    last prompt token always recomputed; a different first block shares nothing."""
    trace = [
        _row(0, [1, 2, 3], 1300),
        _row(10_000, [1, 2, 4], 1100),  # shares blocks 1, 2
        _row(20_000, [1, 2], 1024),  # block-aligned: its last block is recomputed
        _row(30_000, [9, 2], 1000),  # chained ids: same 2, other parent -> no hit
    ]
    result = replay(trace, "round_robin", ReplaySettings(workers=1, blocks_per_worker=64))
    cached = 2 * 512 + 512
    assert result.hit_ratio == pytest.approx(cached / (1300 + 1100 + 1024 + 1000))
    assert result.num_requests == 4
    # Alone on the engine: TTFT is one prefill pass over the uncached tokens.
    uncached = [1300, 1100 - 1024, 1024 - 512, 1000]
    expected = sum(TIMING.prefill_ms(n) for n in uncached) / 4
    assert result.ttft_ms["mean"] == pytest.approx(expected)
    assert result.ttft_ms["p99"] == pytest.approx(TIMING.prefill_ms(1300))


def test_requests_too_long_for_one_engine_are_left_out() -> None:
    trace = [_row(0, [1], 100), _row(1, list(range(10, 30)), 20 * 512)]
    result = replay(trace, "round_robin", ReplaySettings(workers=2, blocks_per_worker=8))
    assert result.num_requests == 1


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


def test_without_kv_events_the_replay_predicts_caches_from_its_routing(tmp_path: Path) -> None:
    """`--kv-events approximate`: the router reads no engine's KV events, only its own routes
    (as for engines with `kv_events: approximate`), and kvplane still reuses more than a
    round robin on a slice of the conversation trace."""
    rows = (TRACES / "conversation_trace.jsonl").read_text().splitlines()[:300]
    trace = tmp_path / "conversation.jsonl"
    trace.write_text("\n".join(rows) + "\n")
    args = ["bench", "route", "--trace", str(trace), "--policies", "kvplane,round_robin"]
    result = CliRunner().invoke(app, [*args, "--kv-events", "approximate", "--output", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["kv_events"] == "approximate"
    assert doc["policies"]["kvplane"]["hit_ratio"] > doc["policies"]["round_robin"]["hit_ratio"]
    table = CliRunner().invoke(app, [*args, "--kv-events", "approximate"])
    assert "no KV events (caches predicted from routing, approximate_ttl_s 600)" in table.output
    events = json.loads(CliRunner().invoke(app, [*args, "--output", "json"]).output)
    assert events["kv_events"] == "events" and "approximate_ttl_s" not in events
    # A controller config's router.approximate_ttl_s is the replay's.
    config = tmp_path / "controller.yaml"
    config.write_text("router: {approximate_ttl_s: 120}\n")
    longer = CliRunner().invoke(
        app, [*args, "--kv-events", "approximate", "--config", str(config), "--output", "json"]
    )
    assert json.loads(longer.output)["approximate_ttl_s"] == 120


def test_bench_route_table_keeps_columns_apart_for_minutes_of_ttft() -> None:
    """A saturated replay's TTFTs run to minutes (six digits of ms and more): each figure
    stays a column of its own, not digits run into its neighbour's."""
    ttft = {"mean": 117109.9, "p50": 138451.2, "p99": 12345678.9}
    doc = {
        "trace": "t.jsonl", "workers": 2, "blocks_per_worker": 64, "block_size": 512,
        "speedup": 1.0, "seed": 0, "oracle_hit_ratio": 0.05,
        "policies": {
            "llmd_longest_prefix": {
                "hit_ratio": 0.05, "ttft_ms": ttft, "itl_ms": {"mean": 33.34},
                "imbalance": 2.0, "throughput_rps": 0.2,
            }
        },
    }  # fmt: skip
    header, row = render_table(doc).splitlines()[1:]
    assert len(header.split()) == 10  # "ttft mean" and "itl mean": two words each
    assert row.split() == [
        "llmd_longest_prefix", "0.050", "117109.9", "138451.2", "12345678.9", "33.34",
        "2.000", "0.20",
    ]  # fmt: skip
