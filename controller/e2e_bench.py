"""`kvplane bench e2e`: a real local fleet, end to end, KV-aware routing against round robin.

For each router policy a fresh fleet is started as child processes (`kvplane.up.fleet.Fleet`):
`--engines` torch engines (`kvplane engine serve`, one torch thread each) behind
`kvplane controller serve`, so every run starts with cold caches. By default the policies'
fleets run side by side: all at once, each pinned to its own equal share of the machine's
CPUs (two CPUs, two policies: a core each), their workloads sent by one client at the same
instants, so that the machine's drift (other tenants, frequency) hits every policy alike;
which fleet gets which CPUs rotates with the round. `--sequential` runs one fleet after the
other on every CPU instead (the order reversed every other round). Each engine gets two tiny
requests directly (first-call warm-up, kept out of the figures); then the workload
(`controller.e2e_workload`: the conversation trace scaled to this fleet) is sent through the
controller open loop, every request at its arrival time whatever the fleet is doing. Per
policy: TTFT (first token event - scheduled arrival) mean/p50/p99, the engine-reported
`usage.cached_prompt_tokens` against all prompt tokens, and per engine (its `/metrics`):
requests, prompt and cached tokens, busy seconds (sum of step times), imbalance.

On the first policy's fleet of the first round, after every workload (engines idle), the
gateway's added latency:
`--gateway-requests` pairs of tiny requests (unique prompts, one output token), each pair one
call straight to an engine (rotating) and one through the controller, alternated so that load
drift hits both alike; the first 10 pairs are warm-up. Added = gateway percentile - direct
percentile of the time to the first response, plus the median of the per-pair differences and
the controller's own planning and routing time (`kvplane_controller_route_seconds`).

`--model`: `random-LxH` (a random Llama written to a temporary directory by
`engine.torch_runner.bench.write_random_llama`), `builtin` (the tiny builtin checkpoint) or a
model directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controller.bench import policy_names
from controller.config import KvEventsMode
from controller.e2e_workload import (
    FIRST_TOKEN_ID,
    WorkloadRequest,
    WorkloadSettings,
    build_workload,
    describe,
)
from controller.gateway_timing import (
    Outcome,
    generate_request,
    latency_summary,
    time_gateway_pairs,
    timed_generate,
    wait_routable,
)
from controller.replay import CacheKnowledge
from engine.core.mooncake_trace import TraceRequest, load_trace
from kvplane.channels import INSECURE
from kvplane.cli_common import OutputFormat, OutputOption, emit, finite_number, usage_error_for
from kvplane.errors import KvplaneError
from openengine.v1 import openengine_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvplane.up.config import FleetConfig
    from kvplane.up.fleet import Fleet

log = logging.getLogger(__name__)

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared/data/traces/mooncake-fast25/conversation_trace.jsonl"
)


@dataclass(frozen=True, slots=True)
class E2eSettings:
    workload: WorkloadSettings
    model: str = "random-8x512"
    engines: int = 4
    policies: tuple[str, ...] = ("kvplane", "round_robin")
    engine_block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_batched_tokens: int = 2048  # the engine's token budget per forward pass
    torch_threads: int = 1
    gateway_requests: int = 300
    gateway_prompt_tokens: int = 16
    # Rounds of the whole policy list, each on fresh fleets, the order reversed every other
    # round: one round's ratio moves with the machine (engines time-share its CPUs).
    rounds: int = 1
    # Every policy's fleet at once, each pinned to its own share of the CPUs, driven by one
    # client: the machine's drift hits all policies alike (the rate is each fleet's). Off:
    # one fleet after the other, each on every CPU.
    side_by_side: bool = True
    # How every fleet's controller learns its engines' caches: their KV events (over
    # SubscribeKvEvents), or none (`kv_events: approximate` on every engine: the router
    # predicts each cache from its own routing, as for engines that publish no events).
    kv_events: CacheKnowledge = CacheKnowledge.events


# ---- the fleet ----


def _fleet_config(
    model_dir: Path, policy: str, settings: E2eSettings, cpus: list[int] | None
) -> FleetConfig:
    from kvplane.up.config import FleetConfig  # the fleet launcher, loaded when a run starts

    engines = [
        {
            "name": f"engine-{i}",
            "kind": "engine",
            "config": {
                "model": str(model_dir),
                "instance_id": f"e2e-engine-{i}",
                "num_threads": settings.torch_threads,
                "block_size": settings.engine_block_size,
                "num_kv_blocks": settings.num_kv_blocks,
                "max_num_batched_tokens": settings.max_num_batched_tokens,
                "shutdown_grace_s": 1.0,
                "metrics_listen": "127.0.0.1:0",  # per-engine work, read after the run
            },
            "cpus": cpus,
        }
        for i in range(settings.engines)
    ]
    controller = {
        "name": "controller",
        "kind": "controller",
        "config": {
            "router": {"policy": policy, "seed": settings.workload.seed},
            "engines": [
                {"address": f"${{engine-{i}}}", "kv_events": _engine_kv_events(settings)}
                for i in range(settings.engines)
            ],
            "shutdown_grace_s": 1.0,
        },
        "cpus": cpus,
    }
    return FleetConfig.model_validate({"members": [*engines, controller]})


def _engine_kv_events(settings: E2eSettings) -> str:
    """The controller config's `kv_events` of every engine for `--kv-events` (a plain string:
    the config is written out as YAML)."""
    if settings.kv_events is CacheKnowledge.approximate:
        return KvEventsMode.approximate.value
    return KvEventsMode.grpc.value


async def _warm_up(addresses: Sequence[str], model: str, vocab_size: int) -> None:
    rng = random.Random(-1)
    for address in addresses:
        async with INSECURE.aio_channel(address) as channel:
            stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
            for i in range(2):
                tokens = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(64)]
                outcome = await timed_generate(
                    stub,
                    generate_request(f"warmup-{address}-{i}", model, tokens, 2),
                    time.perf_counter(),
                )
                if not outcome.ok:
                    raise KvplaneError(f"warm-up request to {address} failed")


# ---- the workload ----


async def _drive(
    target: str, model: str, workload: Sequence[WorkloadRequest], policy: str
) -> list[Outcome]:
    """Send every request at its arrival time (open loop); wait for all of them."""
    async with INSECURE.aio_channel(target) as channel:
        stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
        start = time.perf_counter()
        tasks = []
        for request in workload:
            due = start + request.arrival_s
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            message = generate_request(
                f"e2e-{policy}-{request.index}", model, request.token_ids, request.max_tokens
            )
            # TTFT counts from the scheduled arrival: a late send is the client's queueing.
            tasks.append(asyncio.ensure_future(timed_generate(stub, message, due)))
        return list(await asyncio.gather(*tasks))


def _summarise(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_prompt_tokens or 0 for o in done)
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "ttft_ms": {
            k: round(v, 1) for k, v in latency_summary([o.ttft_ms or 0 for o in done]).items()
        },
        "latency_ms": {
            k: round(v, 1) for k, v in latency_summary([o.latency_ms for o in done]).items()
        },
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "reported_cached_tokens": sum(o.cached_prompt_tokens is not None for o in done),
        "wall_s": round(wall_s, 2),
    }


_ENGINE_TOTALS = {
    "kvplane_engine_requests_total": "requests",
    "kvplane_engine_prompt_tokens_total": "prompt_tokens",
    "kvplane_engine_cached_prompt_tokens_total": "cached_prompt_tokens",
    "kvplane_engine_step_seconds_sum": "busy_s",
    "kvplane_engine_step_seconds_count": "steps",
}
_CONTROLLER_TOTALS = {
    "kvplane_controller_route_seconds_sum": "route_s",
    "kvplane_controller_route_seconds_count": "routed",
}


def _scrape(address: str, wanted: dict[str, str]) -> dict[str, float]:
    """Sums of the `wanted` samples (name -> key) on a process's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5.0) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return totals


async def _engine_stats(fleet: Fleet) -> dict[str, Any]:
    """Per engine (warm-up included): requests, prompt/cached tokens, busy seconds, steps; and
    the imbalance, max / mean busy time."""
    rows: dict[str, Any] = {}
    for member in fleet.members:
        address = member.find_metrics_address() if member.kind == "engine" else None
        if address is None:
            continue
        try:
            totals = await asyncio.to_thread(_scrape, address, _ENGINE_TOTALS)
        except OSError as exc:
            log.warning("metrics of %s: %s", member.name, exc)
            continue
        rows[member.name] = {k: round(v, 2) for k, v in totals.items()}
    busy = [r["busy_s"] for r in rows.values()]
    mean_busy = statistics.fmean(busy) if busy else 0.0
    return {
        "engines": rows,
        "imbalance": round(max(busy) / mean_busy, 3) if mean_busy > 0 else None,
    }


async def _controller_totals(metrics_address: str | None) -> dict[str, float]:
    if metrics_address is None:
        return {}
    try:
        return await asyncio.to_thread(_scrape, metrics_address, _CONTROLLER_TOTALS)
    except OSError as exc:
        log.warning("controller metrics: %s", exc)
        return {}


# ---- the gateway's added latency ----


async def _gateway_overhead(
    controller: str, engines: Sequence[str], model: str, vocab_size: int, settings: E2eSettings
) -> dict[str, Any]:
    """`--gateway-requests` pairs of unique random prompts, one output token each."""
    rng = random.Random(settings.workload.seed + 1)
    doc = await time_gateway_pairs(
        controller,
        engines,
        model=model,
        prompt=lambda _: [
            rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(settings.gateway_prompt_tokens)
        ],
        num_pairs=settings.gateway_requests,
        max_tokens=1,
    )
    doc["prompt_tokens"] = settings.gateway_prompt_tokens
    return doc


# ---- one round: each policy on a fresh fleet ----


@dataclass(slots=True)
class _RunningFleet:
    policy: str
    fleet: Fleet
    controller: str
    engines: list[str]
    cpus: list[int] | None  # None: every CPU


@contextlib.asynccontextmanager
async def _fleet_for(
    policy: str, *, model_dir: Path, vocab_size: int, settings: E2eSettings, cpus: list[int] | None
) -> AsyncIterator[_RunningFleet]:
    """A fresh fleet routing by `policy` (pinned to `cpus` when given), warmed up; stopped on
    exit."""
    from kvplane.up.fleet import Fleet

    with tempfile.TemporaryDirectory(prefix="kvplane-e2e-") as tmp:
        fleet = Fleet(_fleet_config(model_dir, policy, settings, cpus), Path(tmp))
        try:
            started = time.monotonic()
            await fleet.start()
            controller = fleet.member("controller").address
            engines = [m.address for m in fleet.members if m.kind == "engine"]
            assert controller is not None and all(engines)  # start() waited for them
            running = _RunningFleet(policy, fleet, controller, [a for a in engines if a], cpus)
            await wait_routable(controller, len(engines))
            await _warm_up(running.engines, model_dir.name, vocab_size)
            log.info("%s: fleet ready in %.1fs (cpus %s)", policy, time.monotonic() - started, cpus)
            yield running
        finally:
            await fleet.stop()


async def _run_workload(
    running: _RunningFleet, model: str, workload: Sequence[WorkloadRequest]
) -> dict[str, Any]:
    load_before = os.getloadavg()
    started = time.monotonic()
    outcomes = await _drive(running.controller, model, workload, running.policy)
    row = _summarise(outcomes, time.monotonic() - started)
    row["cpus"] = running.cpus
    row["load_average"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
    }
    row["per_engine"] = await _engine_stats(running.fleet)
    log.info("%s: %s", running.policy, json.dumps(row))
    return row


async def _measure_gateway(
    running: _RunningFleet, model: str, vocab_size: int, settings: E2eSettings
) -> dict[str, Any]:
    metrics = running.fleet.member("controller").find_metrics_address()
    before = await _controller_totals(metrics)
    gateway = await _gateway_overhead(
        running.controller, running.engines, model, vocab_size, settings
    )
    after = await _controller_totals(metrics)
    routed = after.get("routed", 0.0) - before.get("routed", 0.0)
    if routed > 0:  # the controller's own time to plan and route one request
        route_ms = (after["route_s"] - before["route_s"]) / routed * 1000
        gateway["controller_route_ms_mean"] = round(route_ms, 3)
    gateway["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return gateway


def _cpu_groups(count: int) -> list[list[int]]:
    """This process's CPUs split into `count` equal groups (side by side: one per policy)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        raise KvplaneError(
            f"side by side needs a CPU per policy ({count} policies, {len(cpus)} CPUs); "
            "use --sequential"
        )
    size = len(cpus) // count
    return [cpus[i * size : (i + 1) * size] for i in range(count)]


async def _run_round(
    number: int,
    *,
    model_dir: Path,
    vocab_size: int,
    workload: Sequence[WorkloadRequest],
    settings: E2eSettings,
) -> dict[str, Any]:
    """One round: every policy on a fresh fleet, one after the other (the order reversed
    every other round) or, side by side, all at once, each fleet on its own CPUs (which fleet
    gets which CPUs rotates with the round). The gateway is timed in round 0 on the first
    policy's fleet once every workload is done."""
    measure_gateway = number == 0 and settings.gateway_requests > 0
    model = model_dir.name
    rows: dict[str, Any] = {}
    if settings.side_by_side:
        order = settings.policies
        groups = _cpu_groups(len(order))
        cpus = {p: groups[(i + number) % len(groups)] for i, p in enumerate(order)}
        async with contextlib.AsyncExitStack() as stack:
            fleets = [
                await stack.enter_async_context(
                    _fleet_for(
                        p, model_dir=model_dir, vocab_size=vocab_size, settings=settings,
                        cpus=cpus[p],
                    )
                )
                for p in order
            ]  # fmt: skip
            results = await asyncio.gather(*(_run_workload(f, model, workload) for f in fleets))
            rows = {running.policy: row for running, row in zip(fleets, results, strict=True)}
            if measure_gateway:
                rows[order[0]]["gateway"] = await _measure_gateway(
                    fleets[0], model, vocab_size, settings
                )
    else:
        order = settings.policies if number % 2 == 0 else settings.policies[::-1]
        for i, policy in enumerate(order):
            async with _fleet_for(
                policy, model_dir=model_dir, vocab_size=vocab_size, settings=settings, cpus=None
            ) as running:
                rows[policy] = await _run_workload(running, model, workload)
                if measure_gateway and i == 0:
                    rows[policy]["gateway"] = await _measure_gateway(
                        running, model, vocab_size, settings
                    )
    return {
        "order": list(order),
        "policies": {p: rows[p] for p in settings.policies},
        "ttft_mean_ratio_round_robin_to_kvplane": _ttft_ratio(rows),
    }


def _resolve_model(model: str, scratch: Path) -> Path:
    if model == "builtin":
        from engine.torch_runner.builtin_model import ensure_builtin_model  # torch-free

        return ensure_builtin_model()
    # torch-free at import; a random model imports torch when written
    from engine.torch_runner.bench import resolve_model

    return resolve_model(model, scratch)


def _check_model(model: str) -> None:
    """`--model`: `builtin` or what `bench engine` takes; a usage error otherwise."""
    from engine.torch_runner.bench import check_model

    if model != "builtin":
        with usage_error_for("--model"):
            check_model(model)


async def run_e2e_bench(
    trace_path: Path, trace: list[TraceRequest], settings: E2eSettings
) -> dict[str, Any]:
    """The benchmark's JSON document: `trace` is the one read from `trace_path`."""
    if settings.side_by_side:
        _cpu_groups(len(settings.policies))  # enough CPUs? Said before a model is built.
    with tempfile.TemporaryDirectory(prefix="kvplane-e2e-model-") as scratch:
        model_dir = await asyncio.to_thread(_resolve_model, settings.model, Path(scratch))
        config = json.loads((model_dir / "config.json").read_text())
        vocab_size = int(config["vocab_size"])
        workload = build_workload(trace, settings.workload, vocab_size)
        doc: dict[str, Any] = {
            "model": settings.model,
            "model_shape": {
                "layers": config.get("num_hidden_layers"),
                "hidden_size": config.get("hidden_size"),
                "vocab_size": vocab_size,
            },
            "engines": settings.engines,
            "torch_threads": settings.torch_threads,
            "engine_block_size": settings.engine_block_size,
            "num_kv_blocks": settings.num_kv_blocks,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "rate_rps": settings.workload.rate_rps,
            "side_by_side": settings.side_by_side,
            "kv_events": settings.kv_events.value,
            "trace": trace_path.name,
            "workload": {
                **asdict(settings.workload),
                **describe(workload, settings.engine_block_size),
            },
            "cpus": os.cpu_count(),
            "policies": {},
        }
        rounds = [
            await _run_round(
                number,
                model_dir=model_dir,
                vocab_size=vocab_size,
                workload=workload,
                settings=settings,
            )
            for number in range(settings.rounds)
        ]
    doc["policies"] = rounds[0]["policies"]
    ratios = [r["ttft_mean_ratio_round_robin_to_kvplane"] for r in rounds]
    if all(r is not None for r in ratios):
        doc["ttft_mean_ratio_round_robin_to_kvplane"] = round(statistics.median(ratios), 3)
    if settings.rounds > 1:
        doc["rounds"] = rounds
    gateway = next((r["gateway"] for r in doc["policies"].values() if "gateway" in r), None)
    if gateway is not None:
        doc["gateway"] = gateway
    return doc


def _ttft_ratio(rows: dict[str, Any]) -> float | None:
    """Round robin's mean TTFT over kvplane's in one round (None without both)."""
    if "kvplane" not in rows or "round_robin" not in rows or not rows["kvplane"]["ttft_ms"]["mean"]:
        return None
    ratio: float = rows["round_robin"]["ttft_ms"]["mean"] / rows["kvplane"]["ttft_ms"]["mean"]
    return round(ratio, 2)


def render_table(doc: dict[str, Any]) -> str:
    w = doc["workload"]
    lines = [
        f"{doc['engines']} engines ({doc['model']}, {doc['torch_threads']} torch thread each), "
        f"{w['requests']} requests from {doc['trace']} ({w['conversations']} conversations, "
        f"prompts mean {w['prompt_tokens']['mean']:.0f} tokens) at {doc['rate_rps']} req/s "
        f"to each fleet, oracle cached ratio {w['oracle_cached_ratio']:.3f}; fleets "
        + ("side by side, each on its own CPUs" if doc["side_by_side"] else "one after the other")
        + (
            "; no KV events (caches predicted from routing)"
            if doc.get("kv_events") == CacheKnowledge.approximate
            else ""
        ),
        f"{'round':<7}{'policy':<14}{'cpus':>6}{'done':>6}{'ttft mean':>11}{'p50':>9}{'p99':>9}"
        f"{'cached tokens':>15}{'ratio':>8}{'imbal.':>8}{'load avg':>10}",
    ]
    rounds = doc.get("rounds") or [{"order": list(doc["policies"]), "policies": doc["policies"]}]
    for number, one in enumerate(rounds, 1):
        for name in one["order"]:
            row = one["policies"][name]
            t = row["ttft_ms"]
            lines.append(
                f"{number:<7}{name:<14}{_cpus(row.get('cpus')):>6}{row['completed']:>6}"
                f"{t['mean']:>11.1f}{t['p50']:>9.1f}"
                f"{t['p99']:>9.1f}{row['cached_prompt_tokens']:>15}{row['cached_ratio']:>8.3f}"
                f"{_cell(row['per_engine'].get('imbalance'))}"
                f"{row['load_average']['after'][0]:>10.2f}"
            )
    if "ttft_mean_ratio_round_robin_to_kvplane" in doc:
        line = (
            f"mean TTFT round_robin / kvplane: x{doc['ttft_mean_ratio_round_robin_to_kvplane']:.2f}"
        )
        if len(rounds) > 1:
            each = ", ".join(f"x{r['ttft_mean_ratio_round_robin_to_kvplane']:.2f}" for r in rounds)
            line += f" (the median of the rounds' {each})"
        lines.append(line)
    if "gateway" in doc:
        g = doc["gateway"]
        d, gw = g["direct"]["first_response_ms"], g["gateway"]["first_response_ms"]
        lines.append(
            f"gateway, {g['pairs']} pairs of {g['prompt_tokens']}-token requests: first response "
            f"direct p50 {d['p50']:.2f} ms p99 {d['p99']:.2f} ms, through the controller "
            f"p50 {gw['p50']:.2f} ms p99 {gw['p99']:.2f} ms; added p50 "
            f"{g['added_ms']['p50']:.2f} ms p99 {g['added_ms']['p99']:.2f} ms "
            f"(median of paired differences {g['added_ms']['paired_median']:.2f} ms; "
            f"routing inside the controller {g.get('controller_route_ms_mean', 0):.2f} ms; "
            f"load average {g['load_average'][0]:.2f})"
        )
    return "\n".join(lines)


def _cpus(cpus: list[int] | None) -> str:
    return "all" if cpus is None else ",".join(map(str, cpus))


def _cell(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>8.2f}"


def bench_e2e(
    *,
    requests: Annotated[
        int, typer.Option("--requests", min=1, help="Requests drawn from the trace (per fleet).")
    ] = 240,
    rate: Annotated[
        float,
        typer.Option(
            "--rate",
            min=0.01,
            callback=finite_number,
            help="Mean arrivals per s (to each fleet).",
        ),
    ] = 4.5,
    engines: Annotated[int, typer.Option(min=1, help="Engines of each fleet.")] = 4,
    model: Annotated[
        str, typer.Option(help="random-LxH (e.g. random-8x512), builtin, or a model directory.")
    ] = "random-8x512",
    trace: Annotated[Path, typer.Option(help="Mooncake-format JSONL trace.")] = DEFAULT_TRACE,
    policies: Annotated[str, typer.Option(help="Comma-separated router policies.")] = (
        "kvplane,round_robin"
    ),
    block_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens per trace hash id (a 512-token trace block).")
    ] = 16,
    max_prompt_tokens: Annotated[
        int, typer.Option(min=1, help="Longer prompts are cut to this many tokens.")
    ] = 1024,
    output_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 2,
    kv_blocks: Annotated[int, typer.Option(min=1, help="KV blocks per engine.")] = 2048,
    max_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Engines' token budget per forward pass.")
    ] = 2048,
    gateway_requests: Annotated[
        int, typer.Option(min=0, help="Direct/gateway pairs for the added latency (0: skip).")
    ] = 300,
    seed: Annotated[
        int,
        typer.Option(help="Seed of the requests drawn, the routers and the gateway pairs."),
    ] = 0,
    rounds: Annotated[
        int,
        typer.Option(
            min=1, help="Rounds of every policy on fresh fleets (order reversed every other)."
        ),
    ] = 1,
    side_by_side: Annotated[
        bool,
        typer.Option(
            "--side-by-side/--sequential",
            help="Every policy's fleet at once, each pinned to its own share of the CPUs; "
            "or one after the other on all of them.",
        ),
    ] = True,
    kv_events: Annotated[
        CacheKnowledge,
        typer.Option(
            "--kv-events",
            help="How each fleet's controller learns its engines' caches: their KV events, "
            "or none (approximate: every engine kv_events: approximate, the router predicts "
            "their caches from its own routing).",
        ),
    ] = CacheKnowledge.events,
    output: OutputOption = OutputFormat.table,
) -> None:
    """A real local fleet end to end, per router policy.

    TTFT and cached tokens on a workload from the conversation trace, and the gateway's added
    latency."""
    settings = E2eSettings(
        model=model,
        engines=engines,
        policies=tuple(policy_names(policies)),
        workload=WorkloadSettings(
            num_requests=requests,
            rate_rps=rate,
            block_tokens=block_tokens,
            max_prompt_tokens=max_prompt_tokens,
            output_tokens=output_tokens,
            seed=seed,
        ),
        num_kv_blocks=kv_blocks,
        max_num_batched_tokens=max_batched_tokens,
        gateway_requests=gateway_requests,
        rounds=rounds,
        side_by_side=side_by_side,
        kv_events=kv_events,
    )
    _check_model(model)
    with usage_error_for("--trace"):
        rows = load_trace(trace)
    emit(asyncio.run(run_e2e_bench(trace, rows, settings)), output, render_table)
