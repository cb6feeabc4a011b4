"""Timing Generate calls as a client sees them, straight to an engine and through the
controller's gateway: what `kvplane bench gateway` and `kvplane bench e2e` both measure.

A pair is one call to an engine and one through the gateway, back to back, in alternating
order, so slow drift in the machine's load hits both sides alike and the difference within a
pair is the gateway's cost. Optionally each round also calls a bare relay
(controller.relay_floor), the three calls in rotating order: what any Python gRPC hop costs
on the machine, so that the gateway's cost can be split into that floor and its own work.
The time to the first response is the first token (or finished) event of the stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvplane.channels import INSECURE
from kvplane.errors import KvplaneError
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 300.0
WARM_UP_PAIRS = 10


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    ttft_ms: float | None
    latency_ms: float
    prompt_tokens: int
    cached_prompt_tokens: int | None


def generate_request(
    request_id: str, model: str, tokens: Sequence[int], max_tokens: int
) -> pb.GenerateRequest:
    """Greedy, EOS ignored: exactly `max_tokens` output tokens."""
    return pb.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=pb.TokenIds(ids=tokens),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


async def timed_generate(
    stub: pb_grpc.OpenEngineAsyncStub, request: pb.GenerateRequest, started: float
) -> Outcome:
    """One Generate; times from `started` (perf_counter seconds). A failed call (an error
    event or status, or no token) is logged and returned with ok=False."""
    first: float | None = None
    usage: pb.Usage | None = None
    ok = True
    try:
        async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            kind = response.WhichOneof("event")
            if kind == "error":
                ok = False
                log.warning("request %s: %s", request.request_id, response.error.message)
            elif first is None and kind in ("token", "finished"):
                first = time.perf_counter()
            if response.HasField("usage"):
                usage = response.usage
    except grpc.aio.AioRpcError as exc:
        log.warning("request %s: %s: %s", request.request_id, exc.code().name, exc.details())
        ok = False
    end = time.perf_counter()
    cached = None
    if usage is not None and usage.HasField("cached_prompt_tokens"):
        cached = usage.cached_prompt_tokens
    return Outcome(
        ok=ok and first is not None,
        ttft_ms=(first - started) * 1000 if first is not None else None,
        latency_ms=(end - started) * 1000,
        prompt_tokens=len(request.token_ids.ids),
        cached_prompt_tokens=cached,
    )


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """mean, p50 and p99 (nearest rank), rounded to 3 decimals."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {
        "mean": round(statistics.fmean(ordered), 3),
        "p50": round(ordered[len(ordered) // 2], 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
    }


async def wait_routable(target: str, num_engines: int, timeout_s: float = 120.0) -> None:
    """Until the controller's Health is READY with every engine in it."""
    deadline = time.monotonic() + timeout_s
    async with INSECURE.aio_channel(target) as channel:
        stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
        while True:
            try:
                reply = await stub.Health(pb.HealthRequest(), timeout=2.0)
                if reply.state == pb.HEALTH_STATE_READY and len(reply.checks) == num_engines:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise KvplaneError(f"the controller at {target} never saw its engines ready")
            await asyncio.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def time_gateway_pairs(
    gateway: str,
    engines: Sequence[str],
    *,
    model: str,
    prompt: Callable[[int], list[int]],
    num_pairs: int,
    max_tokens: int,
    controller_pid: int | None = None,
    relay: str | None = None,
    relay_pid: int | None = None,
) -> dict[str, Any]:
    """`num_pairs` measured pairs after `WARM_UP_PAIRS`; pair i calls engine i mod
    len(engines) directly and the gateway, each with a fresh `prompt(i)` (unique prompts: no
    cache hits). With `controller_pid`, also the controller's CPU per measured gateway
    request (its background polling included, a small share). With `relay` (a bare relay,
    controller.relay_floor, to an engine like these), each round also calls it, the three
    calls in rotating order, and the relay's added latency (and with `relay_pid` its CPU) is
    reported beside the gateway's."""
    targets = {"direct": list(engines), "gateway": [gateway]}
    if relay is not None:
        targets["relay"] = [relay]
    channels = {
        side: [INSECURE.aio_channel(a) for a in addresses] for side, addresses in targets.items()
    }
    stubs: dict[str, list[pb_grpc.OpenEngineAsyncStub]] = {
        side: [pb_grpc.OpenEngineStub(c) for c in side_channels]
        for side, side_channels in channels.items()
    }
    sides = list(stubs)
    samples: dict[str, list[Outcome]] = {side: [] for side in sides}
    pids = {
        name: pid
        for name, pid in (("controller", controller_pid), ("relay", relay_pid))
        if pid is not None
    }
    cpu_started: dict[str, float] = {}
    try:
        for i in range(num_pairs + WARM_UP_PAIRS):
            if i == WARM_UP_PAIRS:
                cpu_started = {name: cpu_seconds(pid) for name, pid in pids.items()}
            for side in sides[i % len(sides) :] + sides[: i % len(sides)]:
                stub = stubs[side][i % len(stubs[side])]
                request = generate_request(f"gw-{side}-{i}", model, prompt(i), max_tokens)
                outcome = await timed_generate(stub, request, time.perf_counter())
                if not outcome.ok:
                    raise KvplaneError(f"gateway timing: a {side} request failed")
                if i >= WARM_UP_PAIRS:
                    samples[side].append(outcome)
        cpu = {name: cpu_seconds(pids[name]) - started for name, started in cpu_started.items()}
    finally:
        for side_channels in channels.values():
            for channel in side_channels:
                await channel.close()
    doc: dict[str, Any] = {"pairs": num_pairs}
    for side, outcomes in samples.items():
        doc[side] = {
            "first_response_ms": latency_summary([o.ttft_ms or 0.0 for o in outcomes]),
            "request_ms": latency_summary([o.latency_ms for o in outcomes]),
        }
    doc["added_ms"] = _added(doc, samples, "gateway")
    if relay is not None:
        doc["relay_added_ms"] = _added(doc, samples, "relay")
    for name, seconds in cpu.items():
        doc[f"{name}_cpu_ms_per_request"] = round(seconds * 1000 / max(1, num_pairs), 3)
    return doc


def _added(doc: dict[str, Any], samples: dict[str, list[Outcome]], side: str) -> dict[str, float]:
    """What `side` adds to the time to the first response over calling the engine directly:
    the difference of the p50s and p99s, and the median of the per-round differences."""
    first = {name: doc[name]["first_response_ms"] for name in ("direct", side)}
    added = {key: round(first[side][key] - first["direct"][key], 3) for key in ("p50", "p99")}
    paired = sorted(
        (s.ttft_ms or 0.0) - (d.ttft_ms or 0.0)
        for d, s in zip(samples["direct"], samples[side], strict=True)
    )
    added["paired_median"] = round(paired[len(paired) // 2], 3) if paired else 0.0
    return added
