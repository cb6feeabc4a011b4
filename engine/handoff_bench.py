"""`kvplane bench handoff`: what a prefill/decode handoff costs on the bundled engine.

Three torch engines in this process, on the same checkpoint: an AGGREGATED one, a PREFILL one
and a DECODE one (real gRPC servers on loopback). For each prompt length, fresh random prompts
(nothing cached anywhere) go

- to the aggregated engine: its time to the first token (TTFT), then the same prompt again
  (its prefix now cached there: the floor of any handoff, which also computes the prompt's
  last partial block and the first token);
- to the prefill engine (time to `PrefillReady`), then with the session to the decode engine
  (time to the first token: the pull of the session's blocks over `kvplane.v1.KvTransfer`,
  their import into the decode engine's prefix cache, the prompt's last partial block and
  the first token). Their sum is the disaggregated TTFT.

The requests run one at a time, so each figure is the path's own cost, not queueing. The
handoff's bytes are the pulled blocks (the decode engine's `cached_prompt_tokens`) times the
runner's bytes per block (every layer's K and V). Importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer

from kvplane.channels import INSECURE
from kvplane.cli_common import OutputFormat, OutputOption, emit
from kvplane.errors import KvplaneError
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

# Prompts are random ids from here to the end of the model's vocabulary: clear of the
# special tokens (0-2) of the random checkpoint and of the builtin model.
FIRST_TOKEN_ID = 3


@dataclass(frozen=True, slots=True)
class HandoffBenchSettings:
    prompt_tokens: tuple[int, ...] = (256, 1024, 3072)
    rounds: int = 5
    dtype: str = "float32"
    threads: int | None = 1
    block_size: int = 16
    num_blocks: int = 4096
    seed: int = 0


def _request(request_id: str, prompt: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=1, ignore_eos=True),
    )


async def _generate(
    stub: pb_grpc.OpenEngineAsyncStub, request: pb.GenerateRequest
) -> AsyncIterator[pb.GenerateResponse]:
    """The request's responses; an engine refusing it (a prompt too long for the model, ...)
    is one line from `kvplane`, not a traceback."""
    try:
        async for response in stub.Generate(request):
            yield response
    except grpc.aio.AioRpcError as exc:
        raise KvplaneError(f"{request.request_id}: {exc.code().name}: {exc.details()}") from None


async def _first_token_ms(
    stub: pb_grpc.OpenEngineAsyncStub, request: pb.GenerateRequest
) -> tuple[float, pb.GenerateResponse]:
    """Milliseconds to the first token, and the final response."""
    started = time.perf_counter()
    first_ms: float | None = None
    last = pb.GenerateResponse()
    async for response in _generate(stub, request):
        if first_ms is None and response.HasField("token"):
            first_ms = (time.perf_counter() - started) * 1000
        if response.HasField("error"):
            raise KvplaneError(f"{request.request_id}: {response.error.message}")
        last = response
    if first_ms is None:
        raise KvplaneError(f"{request.request_id}: no token")
    return first_ms, last


async def _prefill_ms(
    stub: pb_grpc.OpenEngineAsyncStub, request: pb.GenerateRequest
) -> tuple[float, pb.KvSessionRef]:
    """Milliseconds to PrefillReady, and its session."""
    started = time.perf_counter()
    async for response in _generate(stub, request):
        if response.HasField("prefill_ready"):
            return (time.perf_counter() - started) * 1000, response.prefill_ready.kv_session
        if response.HasField("error"):
            raise KvplaneError(f"{request.request_id}: {response.error.message}")
    raise KvplaneError(f"{request.request_id}: the prefill ended without a KV session")


async def _measure(model_dir: Path, settings: HandoffBenchSettings) -> dict[str, Any]:
    from engine.config import EngineConfig, EngineRoleName
    from engine.server.service import EngineApp, start_engine

    common: dict[str, Any] = {
        "model": str(model_dir),
        "listen": "127.0.0.1:0",
        "dtype": settings.dtype,
        "num_threads": settings.threads,
        "block_size": settings.block_size,
        "num_kv_blocks": settings.num_blocks,
        "shutdown_grace_s": 0.5,
        "seed": settings.seed,
    }
    apps: list[EngineApp] = []
    channels: list[grpc.aio.Channel] = []
    try:
        for role in (EngineRoleName.aggregated, EngineRoleName.prefill, EngineRoleName.decode):
            config = EngineConfig(**common, role=role, instance_id=role.value)
            apps.append(await start_engine(config))
            channels.append(INSECURE.aio_channel(f"127.0.0.1:{apps[-1].port}"))
        aggregated, prefill, decode = (pb_grpc.OpenEngineStub(c) for c in channels)
        block_bytes = apps[2].service.engine_loop.core.runner.kv_block_bytes
        last_token_id = apps[0].service.model.vocab_size - 1
        rng = random.Random(settings.seed)
        rows = []
        for length in settings.prompt_tokens:
            samples: dict[str, list[float]] = {
                "aggregated": [],
                "cached": [],
                "prefill": [],
                "handoff": [],
            }
            moved_blocks = 0
            for round_index in range(settings.rounds + 1):  # round 0 warms up, not counted
                prompts = [
                    [rng.randint(FIRST_TOKEN_ID, last_token_id) for _ in range(length)]
                    for _ in range(2)
                ]
                rid = f"{length}-{round_index}"
                alone_ms, _ = await _first_token_ms(aggregated, _request(f"a-{rid}", prompts[0]))
                cached_ms, _ = await _first_token_ms(aggregated, _request(f"c-{rid}", prompts[0]))
                prefill_ms, session = await _prefill_ms(prefill, _request(f"p-{rid}", prompts[1]))
                handed = _request(f"d-{rid}", prompts[1])
                handed.kv.session.CopyFrom(session)
                handoff_ms, last = await _first_token_ms(decode, handed)
                if round_index == 0:
                    continue
                samples["aggregated"].append(alone_ms)
                samples["cached"].append(cached_ms)
                samples["prefill"].append(prefill_ms)
                samples["handoff"].append(handoff_ms)
                moved_blocks = last.usage.cached_prompt_tokens // settings.block_size
            medians = {k: statistics.median(v) for k, v in samples.items()}
            moved_bytes = moved_blocks * block_bytes
            rows.append(
                {
                    "prompt_tokens": length,
                    "aggregated_ttft_ms": medians["aggregated"],
                    "cached_ttft_ms": medians["cached"],
                    "prefill_ms": medians["prefill"],
                    "handoff_ms": medians["handoff"],
                    "disaggregated_ttft_ms": medians["prefill"] + medians["handoff"],
                    "moved_blocks": moved_blocks,
                    "moved_mib": moved_bytes / 2**20,
                    "handoff_mib_per_s": moved_bytes / 2**20 / (medians["handoff"] / 1000),
                }
            )
        return {"block_bytes": block_bytes, "rows": rows}
    finally:
        for channel in channels:
            await channel.close()
        for app in apps:
            await app.close()


def run_handoff_bench(model: str, settings: HandoffBenchSettings) -> dict[str, Any]:
    """The benchmark's JSON document."""
    from engine.torch_runner.bench import resolve_model

    with tempfile.TemporaryDirectory(prefix="kvplane-bench-") as scratch:
        model_dir = resolve_model(model, Path(scratch))
        measured = asyncio.run(_measure(model_dir, settings))
    return {"model": model, "settings": asdict(settings), **measured}


def render_table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"prefill/decode handoff, {result['model']}, {s['dtype']}, {s['threads']} torch "
        f"thread(s) per engine, median of {s['rounds']} rounds, "
        f"{result['block_bytes']:,} bytes per block of {s['block_size']} tokens",
        f"{'prompt':>7} {'aggregated':>11} {'cached':>9} {'prefill':>9} {'handoff':>9} "
        f"{'disagg':>9} {'blocks':>7} {'MiB':>8} {'MiB/s':>8}",
    ]
    for row in result["rows"]:
        lines.append(
            f"{row['prompt_tokens']:>7} {row['aggregated_ttft_ms']:>9.1f}ms "
            f"{row['cached_ttft_ms']:>7.1f}ms {row['prefill_ms']:>7.1f}ms "
            f"{row['handoff_ms']:>7.1f}ms "
            f"{row['disaggregated_ttft_ms']:>7.1f}ms {row['moved_blocks']:>7} "
            f"{row['moved_mib']:>8.2f} {row['handoff_mib_per_s']:>8.1f}"
        )
    return "\n".join(lines)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 2:
        raise typer.BadParameter(
            f"expected comma-separated integers of at least 2, got {text!r}",
            param_hint="--prompt-tokens",
        )
    return lengths


def bench_handoff(
    *,
    model: Annotated[
        str, typer.Option(help="HF model directory, or random-LxH (e.g. random-8x512).")
    ] = "random-8x512",
    prompt_tokens: Annotated[
        str, typer.Option(help="Comma-separated prompt lengths (tokens).")
    ] = "256,1024,3072",
    rounds: Annotated[int, typer.Option(min=1, help="Measured rounds per length.")] = 5,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    threads: Annotated[int, typer.Option(min=1, help="torch threads per engine.")] = 1,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Disaggregated serving on the bundled engine.

    Prefill, KV pull and first token, against one aggregated engine."""
    from engine.torch_runner.bench import check_arguments

    settings = HandoffBenchSettings(
        prompt_tokens=_lengths(prompt_tokens), rounds=rounds, dtype=dtype, threads=threads
    )
    check_arguments(model, dtype)  # before any engine starts
    emit(run_handoff_bench(model, settings), output, render_table)
