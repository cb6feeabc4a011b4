"""`kvplane bench sim`: how fast the sim runner replays a real trace (BENCHMARKS.md section 3).

Replays the first N requests of a Mooncake-format trace (default: the conversation trace)
through M simulated engines (`engine.core.sim_fleet.SimFleet`: the engine's real block manager
and scheduler, the sim runner's timing model, virtual clocks), routed round robin, arrivals at
trace time / speedup, and reports the wall and CPU time of the replay (trace parsing excluded;
on a shared machine the wall time depends on the load, the CPU time much less) with the
virtual-time results: TTFT mean/p50/p99 and prefix reuse (cached prompt tokens / prompt
tokens). Hash id h becomes a block of `block_size` tokens equal to h
(`sim_fleet.trace_prompt_tokens`). Target: 10,000 requests through 16 engines in under 60 s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from engine.core.api import EngineRequest, SamplingParams, SchedulerConfig
from engine.core.mooncake_trace import FILLER_TOKEN_BASE, TraceRequest, load_trace
from engine.core.sim_fleet import SimFleet, TimedRequest, round_robin, trace_prompt_tokens
from kvplane.cli_common import (
    OutputFormat,
    OutputOption,
    TraceBlockSizeOption,
    TraceSpeedupOption,
    emit,
    usage_error_for,
)
from kvplane.errors import KvplaneError

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "data"
    / "traces"
    / "mooncake-fast25"
    / "conversation_trace.jsonl"
)


@dataclass(frozen=True, slots=True)
class SimBenchSettings:
    num_requests: int = 10_000
    num_engines: int = 16
    blocks_per_engine: int = 2048
    block_size: int = 512
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    speedup: float = 1.0
    fast_forward: bool = True


def timed_requests(rows: list[TraceRequest], settings: SimBenchSettings) -> list[TimedRequest]:
    """A trace's rows as timed engine requests."""
    requests = []
    for number, row in enumerate(rows):
        tokens = trace_prompt_tokens(
            row.hash_ids, row.input_length, settings.block_size, FILLER_TOKEN_BASE + number
        )
        sampling = SamplingParams(max_tokens=row.output_length, ignore_eos=True)
        arrival_s = row.arrival_ms / 1000.0 / settings.speedup
        requests.append(TimedRequest(arrival_s, EngineRequest(f"r{number}", tokens, sampling)))
    return requests


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_sim_bench(
    trace: Path, rows: list[TraceRequest], settings: SimBenchSettings
) -> dict[str, Any]:
    """The benchmark's JSON document: `rows` are those read from `trace`."""
    requests = timed_requests(rows, settings)
    capacity = settings.blocks_per_engine * settings.block_size
    fits = [r for r in requests if len(r.request.prompt_token_ids) + 1 <= capacity]
    if not fits:
        raise KvplaneError(
            f"no request of {trace} fits one engine's KV cache "
            f"({settings.blocks_per_engine} blocks of {settings.block_size} tokens)"
        )
    fleet = SimFleet(
        settings.num_engines,
        block_size=settings.block_size,
        num_blocks=settings.blocks_per_engine,
        max_model_len=1 << 30,
        config=SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        ),
        fast_forward=settings.fast_forward,
    )
    started, started_cpu = time.perf_counter(), time.process_time()
    records = fleet.replay(fits, round_robin())
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - started_cpu
    ttfts = [r.ttft_s * 1000.0 for r in records if r.ttft_s is not None]
    prompt = sum(r.num_prompt_tokens for r in records)
    cached = sum(r.num_cached_tokens for r in records)
    span_s = max((r.finish_s or 0.0 for r in records), default=0.0) - min(
        (r.arrival_s for r in records), default=0.0
    )
    return {
        "trace": trace.name,
        "requests": len(records),
        "left_out": len(requests) - len(fits),
        "engines": settings.num_engines,
        "blocks_per_engine": settings.blocks_per_engine,
        "block_size": settings.block_size,
        "speedup": settings.speedup,
        "fast_forward": settings.fast_forward,
        "wall_s": round(wall_s, 2),
        "cpu_s": round(cpu_s, 2),
        "virtual_s": round(span_s, 1),
        "requests_per_wall_s": round(len(records) / wall_s, 1) if wall_s > 0 else None,
        "forward_passes": sum(e.runner.num_forward_passes for e in fleet.engines),
        "output_tokens": sum(r.num_output_tokens for r in records),
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_ms": {
            "mean": round(statistics.fmean(ttfts), 1) if ttfts else 0.0,
            "p50": round(_percentile(ttfts, 0.5), 1),
            "p99": round(_percentile(ttfts, 0.99), 1),
        },
    }


def render_table(doc: dict[str, Any]) -> str:
    ttft = doc["ttft_ms"]
    return "\n".join(
        [
            f"sim runner: {doc['requests']} requests of {doc['trace']} through {doc['engines']} "
            f"engines x {doc['blocks_per_engine']} blocks of {doc['block_size']} tokens "
            f"(round robin, speedup {doc['speedup']})"
            + (
                f"; {doc['left_out']} longer than one engine's KV cache left out"
                if doc["left_out"]
                else ""
            ),
            f"wall {doc['wall_s']:.2f} s (CPU {doc['cpu_s']:.2f} s) for "
            f"{doc['virtual_s']:.0f} s of virtual time "
            f"({doc['requests_per_wall_s']} requests/s, {doc['forward_passes']} passes)",
            f"TTFT mean {ttft['mean']:.1f} ms, p50 {ttft['p50']:.1f} ms, p99 {ttft['p99']:.1f} "
            f"ms; prefix reuse {doc['hit_ratio']:.3f}",
        ]
    )


def bench_sim(
    *,
    trace: Annotated[Path, typer.Option(help="Mooncake-format JSONL trace.")] = DEFAULT_TRACE,
    requests: Annotated[int, typer.Option(min=1, help="First N requests of the trace.")] = 10_000,
    engines: Annotated[int, typer.Option(min=1, help="Simulated engines (round robin).")] = 16,
    blocks_per_engine: Annotated[int, typer.Option(min=1, help="KV blocks per engine.")] = 2048,
    block_size: TraceBlockSizeOption = 512,
    speedup: TraceSpeedupOption = 1.0,
    fast_forward: Annotated[
        bool, typer.Option(help="Run pure-decode stretches in one call (same results).")
    ] = True,
    output: OutputOption = OutputFormat.table,
) -> None:
    """The sim runner's speed: a trace through many simulated engines in virtual time."""
    settings = SimBenchSettings(
        num_requests=requests,
        num_engines=engines,
        blocks_per_engine=blocks_per_engine,
        block_size=block_size,
        speedup=speedup,
        fast_forward=fast_forward,
    )
    with usage_error_for("--trace"):
        rows = load_trace(trace, limit=requests)
    emit(run_sim_bench(trace, rows, settings), output, render_table)
