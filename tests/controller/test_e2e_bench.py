"""`kvplane bench e2e` end to end at a tiny size: real engine and controller processes, every
request completed, the document's shape. No timing is asserted (that is the benchmark's job)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controller.e2e_bench import E2eSettings, _fleet_config
from controller.e2e_workload import WorkloadSettings
from controller.replay import CacheKnowledge
from kvplane.cli import app

TRACE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/traces/mooncake-fast25/conversation_trace.jsonl"
)


def _run_tiny_bench(num_requests: int, *options: str) -> dict[str, Any]:
    """`kvplane bench e2e` on two engines of the builtin model with short prompts, plus
    `options`: its JSON document."""
    result = CliRunner().invoke(
        app,
        [
            "bench", "e2e",
            "--model", "builtin",
            "--engines", "2",
            "--trace", str(TRACE),
            "--requests", str(num_requests),
            "--rate", "5",
            "--block-tokens", "4",
            "--max-prompt-tokens", "96",
            "--kv-blocks", "128",
            *options,
            "-o", "json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["--sequential", "--side-by-side"])
def test_bench_e2e_runs_both_policies_on_a_real_fleet(mode: str) -> None:
    """Two rounds: sequential, the second in the other order; side by side, both fleets at
    once on their own CPUs, swapped in the second. Each round's ratio, their median."""
    num_requests = 6
    doc = _run_tiny_bench(num_requests, "--gateway-requests", "3", "--rounds", "2", mode)
    assert doc["engines"] == 2
    assert doc["workload"]["requests"] == num_requests
    assert set(doc["policies"]) == {"kvplane", "round_robin"}
    rounds = doc["rounds"]
    cpus = [{p: row["cpus"] for p, row in r["policies"].items()} for r in rounds]
    if mode == "--sequential":
        assert not doc["side_by_side"]
        assert [r["order"] for r in rounds] == [
            ["kvplane", "round_robin"],
            ["round_robin", "kvplane"],
        ]
        assert cpus == [{"kvplane": None, "round_robin": None}] * 2  # every CPU
    else:
        assert doc["side_by_side"]
        kvplane_cpus, round_robin_cpus = cpus[0]["kvplane"], cpus[0]["round_robin"]
        assert kvplane_cpus and round_robin_cpus
        assert not set(kvplane_cpus) & set(round_robin_cpus)
        assert cpus[1] == {"kvplane": round_robin_cpus, "round_robin": kvplane_cpus}
    assert rounds[0]["policies"] == doc["policies"]  # the first round's rows, gateway included
    assert "gateway" not in rounds[1]["policies"]["round_robin"]  # measured once
    ratios = []
    for one in rounds:
        rows = one["policies"]
        ratio = rows["round_robin"]["ttft_ms"]["mean"] / rows["kvplane"]["ttft_ms"]["mean"]
        assert one["ttft_mean_ratio_round_robin_to_kvplane"] == round(ratio, 2)
        ratios.append(one["ttft_mean_ratio_round_robin_to_kvplane"])
    assert doc["ttft_mean_ratio_round_robin_to_kvplane"] == pytest.approx(sum(ratios) / 2)
    for row in (r for one in rounds for r in one["policies"].values()):
        assert row["completed"] == num_requests and row["failed"] == 0
        assert row["reported_cached_tokens"] == num_requests  # usage came with every stream
        assert row["prompt_tokens"] > 0
        assert 0 <= row["cached_prompt_tokens"] <= row["prompt_tokens"]
        assert set(row["ttft_ms"]) == {"mean", "p50", "p99"}
        assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        engines = row["per_engine"]["engines"]
        assert len(engines) == 2
        # Every request reached an engine (the warm-up adds two per engine).
        assert sum(e["requests"] for e in engines.values()) == num_requests + 2 * 2
        assert all(e["steps"] > 0 and e["busy_s"] > 0 for e in engines.values())
    gateway = doc["gateway"]
    assert gateway["pairs"] == 3
    assert set(gateway["added_ms"]) == {"p50", "p99", "paired_median"}
    for side in ("direct", "gateway"):
        assert gateway[side]["first_response_ms"]["p50"] > 0


@pytest.mark.timeout(180)
def test_bench_e2e_without_kv_events_predicts_caches_from_routing() -> None:
    """`--kv-events approximate`: every fleet's controller follows no KV events, yet the
    `kvplane` router sends a conversation's later turns to the engine it sent the earlier
    ones, so its engines still serve cached prompt tokens."""
    num_requests = 10  # two of them later turns of a conversation
    doc = _run_tiny_bench(num_requests, "--gateway-requests", "0", "--kv-events", "approximate")
    assert doc["kv_events"] == "approximate"
    assert doc["workload"]["multi_turn_requests"] > 0
    for row in doc["policies"].values():
        assert row["completed"] == num_requests and row["failed"] == 0
    kvplane = doc["policies"]["kvplane"]
    assert kvplane["cached_prompt_tokens"] > 0
    engines = kvplane["per_engine"]["engines"].values()
    assert sum(e["cached_prompt_tokens"] for e in engines) >= kvplane["cached_prompt_tokens"]


@pytest.mark.parametrize(
    ("knowledge", "engine_kv_events"),
    [(CacheKnowledge.events, "grpc"), (CacheKnowledge.approximate, "approximate")],
)
def test_bench_e2e_controller_config_follows_kv_events_or_none(
    knowledge: CacheKnowledge, engine_kv_events: str
) -> None:
    """The controller config the bench writes for each fleet: with `--kv-events approximate`
    no engine's KV events are followed."""
    settings = E2eSettings(
        workload=WorkloadSettings(num_requests=1, rate_rps=1.0), engines=3, kv_events=knowledge
    )
    fleet = _fleet_config(Path("model"), "kvplane", settings, None)
    (controller,) = (m for m in fleet.members if m.kind == "controller")
    entries = controller.config["engines"]
    assert len(entries) == 3
    assert {entry["kv_events"] for entry in entries} == {engine_kv_events}


def test_bench_e2e_rejects_an_unknown_kv_events_mode() -> None:
    # (Wide enough that Typer's error box does not wrap the message.)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["bench", "e2e", "--trace", str(TRACE), "--kv-events", "zmq", "-o", "json"]
    )
    assert result.exit_code == 2
    assert "Invalid value for --kv-events: Value error, 'zmq' is not one of" in result.output
    assert "Traceback" not in result.output
