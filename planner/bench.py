"""`kvplane bench planner`: the planner against static provisioning and a queue-length
threshold autoscaler, on an Azure trace replayed in virtual time (planner.replay).

Policies, all over the same trace, engines, SLA targets and start-up delay:
- `static`: a fixed fleet at the peak-needed size, the smallest count whose replay meets the
  SLA for `goal` of the requests (found by replaying: doubling, then bisection).
- `kvplane`: the planner core (planner.core) deciding every `tick_s`.
- `threshold`: HPA-style scaling on queued requests per engine with a 300 s scale-down
  stabilisation (planner.core.threshold).
The autoscaled fleets start at `initial_engines` (by default the static size when `static`
runs: autoscaling switched on over a fleet provisioned for the peak; else `min_engines`).

Bad arguments (a missing or malformed trace, an option out of range) are usage errors, exit
code 2, as in every bench command (`kvplane.cli_common.usage_error_for`); never a traceback.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from kvplane.cli_common import (
    OutputFormat,
    OutputOption,
    emit,
    load_command_config,
    policy_list,
    usage_error_for,
)
from kvplane.errors import KvplaneError
from planner.azure_trace import TraceRow, load_azure_trace
from planner.config import PlannerConfig, PoolConfig, SlaTargets
from planner.core.decisions import Policy
from planner.core.planner import Planner
from planner.core.threshold import ThresholdAutoscaler, ThresholdSettings
from planner.replay import FleetSettings, NoScaling, PolicyResult, fits, replay

log = logging.getLogger(__name__)

POLICY_NAMES = ("kvplane", "static", "threshold")
# Beside the checkout, as every replaying benchmark's default trace, wherever it is run from.
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/azure-llm-2023/conv.csv"


@dataclass(frozen=True, slots=True)
class BenchSettings:
    fleet: FleetSettings
    sla: SlaTargets
    planner: PlannerConfig  # its sla and pools are replaced by `sla` and the bounds below
    min_engines: int = 1
    max_engines: int = 32
    initial_engines: int | None = None
    goal: float = 0.99  # share of requests meeting both targets that static must reach
    tick_s: float = 5.0
    threshold: ThresholdSettings = field(default_factory=ThresholdSettings)
    threshold_tick_s: float = 15.0  # HPA's sync period


def policy_names(text: str) -> list[str]:
    with usage_error_for("--policies"):
        return policy_list(text, POLICY_NAMES)


def run_planner_bench(
    rows: list[TraceRow], trace_name: str, settings: BenchSettings, policies: list[str]
) -> dict[str, Any]:
    """The benchmark's JSON document: settings and one row per policy."""
    fleet = settings.fleet
    replayed = [row for row in rows if fits(row, fleet)]
    if not replayed:
        # Like `bench route` and `bench sim`: the run has nothing to replay (exit 1).
        raise KvplaneError(f"no request of {trace_name} fits one engine's KV cache")
    doc: dict[str, Any] = {
        "trace": trace_name,
        "num_requests": len(replayed),
        "num_left_out": len(rows) - len(replayed),
        "span_s": round(replayed[-1].arrival_s / fleet.speedup, 1),
        "speedup": fleet.speedup,
        "sla": {"ttft_ms": settings.sla.ttft_ms, "itl_ms": settings.sla.itl_ms},
        "goal": settings.goal,
        "engine": {
            "block_size": fleet.block_size,
            "blocks_per_engine": fleet.blocks_per_engine,
            "max_num_seqs": fleet.max_num_seqs,
            "max_num_batched_tokens": fleet.max_num_batched_tokens,
        },
        "startup_s": fleet.startup_s,
        "policies": {},
    }
    initial = settings.initial_engines
    if "static" in policies:
        static, tried = _static_search(replayed, settings)
        doc["policies"]["static"] = static.to_json() | {"sizes_tried": tried}
        if initial is None:
            initial = static.initial_engines
    initial = settings.min_engines if initial is None else initial
    initial = max(settings.min_engines, min(settings.max_engines, initial))
    for name in policies:
        if name == "static":
            continue
        started = time.monotonic()
        tick_s = settings.threshold_tick_s if name == "threshold" else settings.tick_s
        result = replay(
            replayed,
            name,
            _make_policy(name, settings),
            engines=initial,
            tick_s=tick_s,
            settings=fleet,
            sla=settings.sla,
        )
        log.debug("%s replayed in %.1fs", name, time.monotonic() - started)
        doc["policies"][name] = result.to_json()
    doc["policies"] = {name: doc["policies"][name] for name in policies}
    return doc


def _make_policy(name: str, settings: BenchSettings) -> Policy:
    pool = PoolConfig(min_engines=settings.min_engines, max_engines=settings.max_engines)
    if name == "kvplane":
        config = settings.planner.model_copy(update={"sla": settings.sla, "pools": (pool,)})
        return Planner(config)
    if name == "threshold":
        return ThresholdAutoscaler(pool, settings.threshold)
    return NoScaling()


def _static_search(rows: list[TraceRow], settings: BenchSettings) -> tuple[PolicyResult, list[int]]:
    """The smallest fixed fleet meeting the goal (or the largest allowed, if none does)."""
    results: dict[int, PolicyResult] = {}

    def run(count: int) -> PolicyResult:
        if count not in results:
            results[count] = replay(
                rows,
                "static",
                NoScaling(),
                engines=count,
                tick_s=settings.tick_s,
                settings=settings.fleet,
                sla=settings.sla,
            )
        return results[count]

    def meets(count: int) -> bool:
        return run(count).sla_attainment >= settings.goal

    low, high = settings.min_engines - 1, max(settings.min_engines, 4)
    while not meets(high):  # doubling: `low` always fails (or is below the minimum)
        low = high
        if high >= settings.max_engines:
            return run(high), sorted(results)
        high = min(settings.max_engines, 2 * high)
    while high - low > 1:  # bisection: `high` meets the goal
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    return run(high), sorted(results)


def render_table(doc: dict[str, Any]) -> str:
    sla = doc["sla"]
    engine = doc["engine"]
    lines = [
        f"trace {doc['trace']}: {doc['num_requests']} requests over {doc['span_s']:.0f} s "
        f"(speedup {doc['speedup']}), SLA TTFT {sla['ttft_ms']:.0f} ms / ITL {sla['itl_ms']:.0f}"
        f" ms, engines of {engine['blocks_per_engine']} x {engine['block_size']}-token blocks, "
        f"start-up {doc['startup_s']:.0f} s"
        + (f" ({doc['num_left_out']} too long, left out)" if doc["num_left_out"] else ""),
        f"{'policy':<11}{'SLA':>7}{'TTFT ok':>8}{'ITL ok':>7}{'TTFT p50':>9}{'p99':>9}"
        f"{'ITL mean':>9}{'p99':>7}{'engine-s':>10}{'max':>5}{'events':>7}{'failed':>7}",
    ]
    for name, row in doc["policies"].items():
        lines.append(
            f"{name:<11}{row['sla_attainment']:>7.3f}{row['ttft_attainment']:>8.3f}"
            f"{row['itl_attainment']:>7.3f}{row['ttft_ms']['p50']:>9.0f}{row['ttft_ms']['p99']:>9.0f}"
            f"{row['itl_ms']['mean']:>9.1f}{row['itl_ms']['p99']:>7.1f}"
            f"{row['engine_seconds']:>10.0f}{row['max_engines']:>5}{row['num_scale_events']:>7}"
            f"{row['num_failed']:>7}"
        )
    return "\n".join(lines)


def _check_positive(flags: dict[str, float | None], *, zero_ok: frozenset[str]) -> None:
    """Every given flag is a finite number above 0 (or at least 0, for those in `zero_ok`)."""
    for name, value in flags.items():
        if value is None:
            continue
        low_ok = value >= 0 if name in zero_ok else value > 0
        if not (math.isfinite(value) and low_ok):
            kind = "non-negative" if name in zero_ok else "positive"
            raise typer.BadParameter(f"must be a {kind} number, got {value}", param_hint=name)


def _planner_config(path: Path | None, startup_s: float, tick_s: float) -> PlannerConfig:
    """The kvplane policy's knobs: a config file's, or the defaults with the forecast horizon
    set to the engines' start-up time (how long capacity asked for now takes to serve)."""
    config = load_command_config(PlannerConfig, path) if path else PlannerConfig()
    capacity = config.capacity
    if path is None:
        capacity = capacity.model_copy(update={"forecast_horizon_s": startup_s})
    scaling = config.scaling.model_copy(update={"tick_s": tick_s})
    return config.model_copy(update={"capacity": capacity, "scaling": scaling})


def bench_planner(
    *,
    trace: Annotated[Path, typer.Option("--trace", help="Azure-format CSV trace.")] = DEFAULT_TRACE,
    speedup: Annotated[float, typer.Option(help="Replay trace time this much faster.")] = 1.0,
    ttft_ms: Annotated[float, typer.Option(help="SLA target: time to first token.")] = 1000.0,
    itl_ms: Annotated[float, typer.Option(help="SLA target: mean inter-token latency.")] = 40.0,
    startup_s: Annotated[float, typer.Option(help="A new engine serves this long after.")] = 30.0,
    policies: Annotated[str, typer.Option(help="Comma-separated: kvplane, static, threshold.")] = (
        ",".join(POLICY_NAMES)
    ),
    goal: Annotated[
        float, typer.Option(help="Share of requests meeting the SLA that static must reach.")
    ] = 0.99,
    blocks_per_engine: Annotated[int, typer.Option(help="KV blocks of one sim engine.")] = 1024,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of a pass.")] = 2048,
    min_engines: Annotated[int, typer.Option(help="Autoscalers' minimum.")] = 1,
    max_engines: Annotated[int, typer.Option(help="Autoscalers' (and static's) maximum.")] = 32,
    initial_engines: Annotated[
        int | None, typer.Option(help="Autoscaled fleets' size at the start (default: static's).")
    ] = None,
    tick_s: Annotated[float, typer.Option(help="The planner's tick.")] = 5.0,
    queue_target: Annotated[
        float, typer.Option(help="Threshold autoscaler: queued requests per engine.")
    ] = 2.0,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N rows.")] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="A planner config file for the kvplane policy's knobs."),
    ] = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """The planner vs static provisioning vs a queue-length autoscaler: SLA and engine-seconds."""
    names = policy_names(policies)
    _check_positive(
        {
            "--speedup": speedup,
            "--ttft-ms": ttft_ms,
            "--itl-ms": itl_ms,
            "--startup-s": startup_s,
            "--tick-s": tick_s,
            "--queue-target": queue_target,
            "--blocks-per-engine": blocks_per_engine,
            "--block-size": block_size,
            "--max-num-batched-tokens": max_num_batched_tokens,
            "--min-engines": min_engines,
            "--max-engines": max_engines,
            "--limit": limit,
            "--initial-engines": initial_engines,
        },
        zero_ok=frozenset({"--startup-s"}),
    )
    if not 0 < goal <= 1:
        raise typer.BadParameter(f"must be in (0, 1], got {goal}", param_hint="--goal")
    if max_engines < min_engines:
        raise typer.BadParameter(
            f"{max_engines} is below --min-engines {min_engines}", param_hint="--max-engines"
        )
    engine = FleetSettings(block_size, blocks_per_engine, 256, max_num_batched_tokens)
    settings = BenchSettings(
        fleet=replace(engine, startup_s=startup_s, speedup=speedup),
        sla=SlaTargets(ttft_ms=ttft_ms, itl_ms=itl_ms),
        planner=_planner_config(config, startup_s, tick_s),
        min_engines=min_engines,
        max_engines=max_engines,
        initial_engines=initial_engines,
        goal=goal,
        tick_s=tick_s,
        threshold=ThresholdSettings(target_queued_per_engine=queue_target),
    )
    with usage_error_for("--trace"):
        rows = load_azure_trace(trace, limit)
    emit(run_planner_bench(rows, trace.name, settings, names), output, render_table)
