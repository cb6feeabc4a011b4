"""`kvplane bench route`: routing quality on a Mooncake-format trace, every policy side by
side over the same simulated fleet (controller.replay), optionally with Dynamo's own mocker
replay as peer rows (`--peer dynamo`, needs `pip install ai-dynamo-runtime==1.6.1`)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.config import ControllerConfig
from controller.replay import CacheKnowledge, ReplaySettings, fits, oracle_hit_ratio, replay
from controller.router import APPROXIMATE_TTL_S, POLICY_NAMES
from engine.core.mooncake_trace import TraceRequest, load_trace
from kvplane.cli_common import (
    OutputFormat,
    OutputOption,
    TraceBlockSizeOption,
    TraceSpeedupOption,
    emit,
    load_command_config,
    policy_list,
    usage_error_for,
)
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

DYNAMO_RUNS = 10  # its kv_router breaks ties at random: average ten runs


class Peer(enum.StrEnum):
    dynamo = "dynamo"


def policy_names(text: str) -> list[str]:
    """`--policies`: router policies (`policy_list`); anything else is a usage error."""
    with usage_error_for("--policies"):
        return policy_list(text, POLICY_NAMES)


def run_route_bench(
    trace_path: Path,
    trace: list[TraceRequest],
    settings: ReplaySettings,
    policies: list[str],
    dynamo: Any = None,
) -> dict[str, Any]:
    """The benchmark's JSON document (see the issue for its shape): `trace` is the one read
    from `trace_path`; `dynamo` is Dynamo's core (`_dynamo_core()`) to add its rows, or
    None."""
    replayed = [row for row in trace if fits(row, settings)]
    if not replayed:
        raise KvplaneError(
            f"no request of {trace_path} fits one engine's KV cache "
            f"({settings.blocks_per_worker} blocks of {settings.block_size} tokens)"
        )
    left_out = len(trace) - len(replayed)
    if left_out:
        log.warning(
            "%d requests longer than one engine's KV cache were left out (of the replays and "
            "of the oracle)",
            left_out,
        )
    result: dict[str, Any] = {
        "trace": trace_path.name,
        "workers": settings.workers,
        "blocks_per_worker": settings.blocks_per_worker,
        "block_size": settings.block_size,
        "speedup": settings.speedup,
        "seed": settings.seed,
        "router_replicas": settings.router_replicas,
        "replica_sync": settings.replica_sync,
        "kv_events": settings.kv_events.value,
        "num_requests": len(replayed),
        "num_left_out": left_out,
        # Over the requests replayed: a bound on what the policies reach.
        "oracle_hit_ratio": round(oracle_hit_ratio(replayed, settings.block_size), 4),
        "policies": {},
    }
    if settings.kv_events is CacheKnowledge.approximate:
        result["approximate_ttl_s"] = settings.approximate_ttl_s
    if settings.kvplane_weights is not None and "kvplane" in policies:
        result["kvplane_weights"] = dataclasses.asdict(settings.kvplane_weights)
    for name in policies:
        started = time.monotonic()
        outcome = replay(trace, name, settings)
        log.debug("%s replayed in %.1fs", name, time.monotonic() - started)
        result["policies"][name] = outcome.to_json()
    if dynamo is not None:
        result["policies"].update(_dynamo_rows(dynamo, trace_path, settings))
    return result


def _dynamo_core() -> Any:
    # Dynamo logs every routing decision at INFO unless told otherwise.
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo import _core
    except ImportError as exc:
        raise KvplaneError(
            "--peer dynamo needs Dynamo's mocker: pip install ai-dynamo-runtime==1.6.1"
        ) from exc
    return _core


# Dynamo's rows: its KV router as shipped; tuned as ../shared/BENCHMARKS.md found it does
# better on these traces (cached blocks credited 4x, prefill load scaled 4x); and its round
# robin. Both KV router rows are the peer. The KV router breaks ties at random.
_DYNAMO_ROWS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "dynamo_kv_router": ("kv_router", None),
    "dynamo_kv_router_tuned": (
        "kv_router",
        {"overlap_score_credit": 4.0, "prefill_load_scale": 4.0},
    ),
    "dynamo_round_robin": ("round_robin", None),
}
# With `--kv-events approximate`: its KV router without KV events (its approximate indexer,
# which predicts each worker's cache from its own routing, blocks expiring 120 s after it
# routed them), and its round robin.
_DYNAMO_APPROXIMATE_ROWS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "dynamo_kv_router_approx": ("kv_router", {"use_kv_events": False}),
    "dynamo_round_robin": ("round_robin", None),
}


def _dynamo_rows(core: Any, trace_path: Path, settings: ReplaySettings) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    approximate = settings.kv_events is CacheKnowledge.approximate
    for name, (mode, tuning) in (_DYNAMO_APPROXIMATE_ROWS if approximate else _DYNAMO_ROWS).items():
        runs = []
        for _ in range(DYNAMO_RUNS if mode == "kv_router" else 1):
            report = core.run_mocker_trace_replay(
                [str(trace_path)],
                extra_engine_args={
                    "engine": {
                        "block_size": settings.block_size,
                        "num_gpu_blocks": settings.blocks_per_worker,
                    }
                },
                router_config=core.KvRouterConfig(**tuning) if tuning else None,
                num_workers=settings.workers,
                router_mode=mode,
                trace_block_size=settings.block_size,
                trace_format="mooncake",
                replay_mode="offline",
                arrival_speedup_ratio=settings.speedup,
            )
            runs.append(dict(report.summary))
        # Like for like: our reuse counts each request's cache hits at its first admission.
        # Dynamo's `prefix_cache_reused_ratio` also counts the hits of every re-admission
        # after a preemption, so it exceeds ours wherever requests are preempted.
        rows[name] = {
            "hit_ratio": _mean_of(runs, "first_admission_prefix_cache_reused_ratio"),
            "prefix_cache_reused_ratio": _mean_of(runs, "prefix_cache_reused_ratio"),
            "ttft_ms": {
                "mean": _mean_of(runs, "mean_ttft_ms", 1),
                "p50": _mean_of(runs, "median_ttft_ms", 1),
                "p99": _mean_of(runs, "p99_ttft_ms", 1),
            },
            # Ours is each request's (finish - first token) / (output tokens - 1), averaged
            # over requests: Dynamo's TPOT (its `mean_itl_ms` averages every token gap).
            "itl_ms": {"mean": _mean_of(runs, "mean_tpot_ms", 2)},
            "throughput_rps": _mean_of(runs, "request_throughput_rps", 3),
            # Dynamo's summary has no per-worker busy time: no "imbalance".
            "runs": len(runs),
        }
    return rows


def _mean_of(runs: list[dict[str, float]], field: str, digits: int = 4) -> float:
    return round(statistics.fmean(run[field] for run in runs), digits)


def render_table(doc: dict[str, Any]) -> str:
    lines = [
        f"trace {doc['trace']}: {doc['workers']} workers x {doc['blocks_per_worker']} blocks "
        f"of {doc['block_size']} tokens, speedup {doc['speedup']}, seed {doc['seed']}, "
        + (
            f"{doc['router_replicas']} router replicas"
            f"{' in sync' if doc.get('replica_sync') else ''}, "
            if doc.get("router_replicas", 1) > 1
            else ""
        )
        + (
            "no KV events (caches predicted from routing, "
            f"approximate_ttl_s {doc.get('approximate_ttl_s', APPROXIMATE_TTL_S):g}), "
            if doc.get("kv_events") == CacheKnowledge.approximate
            else ""
        )
        + f"oracle reuse {doc['oracle_hit_ratio']:.3f}"
        + (
            f" ({doc['num_left_out']} requests longer than one engine's KV cache left out)"
            if doc.get("num_left_out")
            else ""
        ),
        f"{'policy':<21}{'reuse':>8}{'ttft mean':>11}{'p50':>10}{'p99':>10}"
        f"{'itl mean':>10}{'imbal.':>8}{'req/s':>8}",
    ]
    for name, row in doc["policies"].items():
        ttft = row.get("ttft_ms", {})
        itl = row.get("itl_ms", {}).get("mean")
        imbalance = row.get("imbalance")
        rps = row.get("throughput_rps")
        lines.append(
            f"{name:<21}{_cell(row['hit_ratio'], 8, 3)}{_cell(ttft.get('mean', 0), 11, 1)}"
            f"{_cell(ttft.get('p50'), 10, 1)}{_cell(ttft.get('p99'), 10, 1)}"
            f"{_cell(itl, 10, 2)}{_cell(imbalance, 8, 3)}{_cell(rps, 8, 2)}"
        )
    return "\n".join(lines)


def _cell(value: float | None, width: int, digits: int) -> str:
    """A right-aligned column, always one space from the one before: a value wider than its
    column (a saturated replay's TTFT of minutes) widens its row rather than running into
    its neighbour."""
    text = "-" if value is None else f"{value:.{digits}f}"
    return f" {text:>{width - 1}}"


def bench_route(
    *,
    trace: Annotated[Path, typer.Option("--trace", help="Mooncake-format JSONL trace.")],
    workers: Annotated[int, typer.Option(min=1, help="Simulated engines.")] = 8,
    blocks_per_worker: Annotated[int, typer.Option(min=1, help="KV blocks per engine.")] = 2048,
    block_size: TraceBlockSizeOption = 512,
    speedup: TraceSpeedupOption = 1.0,
    policies: Annotated[
        str, typer.Option(help="Comma-separated policies (default: all).")
    ] = ",".join(POLICY_NAMES),
    peer: Annotated[Peer | None, typer.Option(help="Also run a peer's own replay.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the router's randomness.")] = 0,
    router_replicas: Annotated[
        int,
        typer.Option(
            min=1,
            help="Controller replicas sharing the index, each with its own in-flight "
            "accounting; arrivals go to them in turn.",
        ),
    ] = 1,
    replica_sync: Annotated[
        bool,
        typer.Option(
            "--replica-sync",
            help="The replicas apply each other's accounting as they route (router.replica_sync).",
        ),
    ] = False,
    kv_events: Annotated[
        CacheKnowledge,
        typer.Option(
            "--kv-events",
            help="How the router learns the engines' caches: their KV events, or none "
            "(approximate: it predicts them from its own routing, as for engines with "
            "kv_events: approximate; --peer dynamo then runs Dynamo's KV router without "
            "KV events).",
        ),
    ] = CacheKnowledge.events,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="A controller config file: the kvplane policy uses its router settings, "
            "and with --kv-events approximate every policy its router.approximate_ttl_s.",
        ),
    ] = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Routing quality on a real trace: reuse, TTFT, ITL, imbalance per policy."""
    router = load_command_config(ControllerConfig, config).router if config else None
    settings = ReplaySettings(
        workers=workers,
        blocks_per_worker=blocks_per_worker,
        block_size=block_size,
        speedup=speedup,
        seed=seed,
        router_replicas=router_replicas,
        replica_sync=replica_sync,
        kvplane_weights=router.weights() if router else None,
        kv_events=kv_events,
        approximate_ttl_s=router.approximate_ttl_s if router else APPROXIMATE_TTL_S,
    )
    names = policy_names(policies)
    # A missing peer fails now, not after minutes of replays.
    dynamo = _dynamo_core() if peer is Peer.dynamo else None
    with usage_error_for("--trace"):
        rows = load_trace(trace)
    doc = run_route_bench(trace, rows, settings, names, dynamo)
    emit(doc, output, render_table)
