"""Trace replay: the real router core over simulated engines in virtual time.

`replay(trace, policy_name, settings)` feeds a Mooncake-format trace (one JSON object a line:
timestamp ms, input_length, output_length, hash_ids of 512-token chained blocks) open loop at
trace time / speedup through `controller.router.Router` and N `SimEngine`s (sim_engine.py has
the engine model and its timing). The router sees what it would see live: each engine's
computed blocks (what its KV events announce), a GetLoad snapshot refreshed every
`load_poll_ms`, and its own in-flight accounting, released at first token and at finish.

Before routing a request that arrives at t, every engine runs the passes that start before t
(their effects become visible up to one pass early; the same for every policy).

Metrics follow the issue's definitions: reuse = prompt tokens served from cache / all prompt
tokens (full blocks only, at least one token recomputed), TTFT = first token - arrival, ITL =
(finish - first token) / (output tokens - 1), imbalance = max / mean engine busy time.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.router import (
    Candidate,
    KvplaneWeights,
    LoadSnapshot,
    PrefixHit,
    Router,
    RouteRequest,
    make_policy,
)
from controller.sim_engine import Note, SimEngine, SimEngineConfig, SimRequest
from kvplane.errors import KvplaneError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path) -> list[TraceRequest]:
    """Parse a Mooncake-format JSONL trace; raises KvplaneError on a malformed line."""
    requests = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise KvplaneError(f"cannot read trace {path}: {exc.strerror}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            requests.append(
                TraceRequest(
                    float(row["timestamp"]),
                    int(row["input_length"]),
                    max(int(row["output_length"]), 1),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise KvplaneError(f"{path}:{number}: not a Mooncake trace row ({exc})") from exc
    requests.sort(key=lambda r: r.arrival_ms)
    return requests


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    workers: int = 8
    blocks_per_worker: int = 2048
    block_size: int = 512
    speedup: float = 1.0
    seed: int = 0
    load_poll_ms: float = 500.0
    kvplane_weights: KvplaneWeights | None = None


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    hit_ratio: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    imbalance: float
    throughput_rps: float
    num_requests: int
    num_preemptions: int
    decisions: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "hit_ratio": round(self.hit_ratio, 4),
            "ttft_ms": {k: round(v, 1) for k, v in self.ttft_ms.items()},
            "itl_ms": {k: round(v, 2) for k, v in self.itl_ms.items()},
            "imbalance": round(self.imbalance, 3),
            "throughput_rps": round(self.throughput_rps, 3),
            "num_requests": self.num_requests,
            "num_preemptions": self.num_preemptions,
            "decisions": dict(sorted(self.decisions.items())),
        }


def full_block_keys(request: TraceRequest, block_size: int) -> tuple[int, ...]:
    return request.hash_ids[: request.input_length // block_size]


def oracle_hit_ratio(trace: Sequence[TraceRequest], block_size: int) -> float:
    """Reuse with one shared unlimited cache (the bound for any router), same definition."""
    seen: set[int] = set()
    cached = total = 0
    for r in trace:
        keys = full_block_keys(r, block_size)
        limit = min(len(keys), (r.input_length - 1) // block_size)
        n = 0
        while n < limit and keys[n] in seen:
            n += 1
        cached += n * block_size
        total += r.input_length
        seen.update(keys)
    return cached / total if total else 0.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def replay(
    trace: Sequence[TraceRequest], policy_name: str, settings: ReplaySettings
) -> PolicyResult:
    rng = random.Random(settings.seed)
    weights = settings.kvplane_weights if policy_name == "kvplane" else None
    router = Router(make_policy(policy_name, weights))
    engine_config = SimEngineConfig(
        num_blocks=settings.blocks_per_worker, block_size=settings.block_size
    )
    engines = [SimEngine(f"w{i}", engine_config) for i in range(settings.workers)]
    loads: dict[str, LoadSnapshot] = {}
    cached: dict[str, int] = {}
    last_poll_ms: float | None = None
    requests: list[SimRequest] = []
    decisions: Counter[str] = Counter()
    for number, row in enumerate(trace):
        now_ms = row.arrival_ms / settings.speedup
        for engine in engines:
            engine.advance_until(now_ms)
            for note, request_id, _t in engine.notes:
                if note is Note.FIRST_TOKEN:
                    router.first_token(request_id)
                else:
                    router.finish(request_id)
            engine.notes.clear()
        if last_poll_ms is None or now_ms - last_poll_ms >= settings.load_poll_ms:
            last_poll_ms = now_ms
            loads = {e.engine_id: _load_of(e) for e in engines}
            # What the index would tell: blocks placed on each engine (same poll cadence).
            cached = {e.engine_id: e.cached_blocks for e in engines}
        keys = full_block_keys(row, settings.block_size)
        candidates = [
            Candidate(
                e.engine_id,
                hit=PrefixHit(device_blocks=e.prefix_blocks(keys)),
                load=loads[e.engine_id],
                total_kv_blocks=settings.blocks_per_worker,
                cached_blocks=cached[e.engine_id],
            )
            for e in engines
        ]
        request_id = f"r{number}"
        route = RouteRequest(request_id, row.input_length, settings.block_size, keys)
        decision = router.route(route, candidates, rng, now_ms / 1000.0)
        decisions[decision.reason.value] += 1
        sim = SimRequest(request_id, now_ms, row.input_length, row.output_length, keys)
        requests.append(sim)
        engines[int(decision.engine_id[1:])].add(sim, now_ms)
    for engine in engines:
        engine.run_to_completion()
    return _summarise(policy_name, requests, engines, decisions)


def _load_of(engine: SimEngine) -> LoadSnapshot:
    return LoadSnapshot(
        running_requests=len(engine.running),
        queued_requests=len(engine.waiting),
        used_kv_blocks=engine.used_blocks,
        total_kv_blocks=engine.config.num_blocks,
        waiting_tokens=engine.waiting_tokens(),
    )


def _summarise(
    policy: str, requests: list[SimRequest], engines: list[SimEngine], decisions: Counter[str]
) -> PolicyResult:
    total_prompt = sum(r.num_prompt_tokens for r in requests)
    cached = sum(r.cached_tokens or 0 for r in requests)
    ttfts = [r.first_token_ms - r.arrival_ms for r in requests if r.first_token_ms is not None]
    itls = [
        (r.finish_ms - r.first_token_ms) / (r.num_output_tokens - 1)
        for r in requests
        if r.finish_ms is not None and r.first_token_ms is not None and r.num_output_tokens > 1
    ]
    busy = [e.busy_ms for e in engines]
    mean_busy = statistics.fmean(busy) if busy else 0.0
    start = min((r.arrival_ms for r in requests), default=0.0)
    end = max((r.finish_ms or 0.0 for r in requests), default=0.0)
    return PolicyResult(
        policy=policy,
        hit_ratio=cached / total_prompt if total_prompt else 0.0,
        ttft_ms={
            "mean": statistics.fmean(ttfts) if ttfts else 0.0,
            "p50": _percentile(ttfts, 0.5),
            "p99": _percentile(ttfts, 0.99),
        },
        itl_ms={"mean": statistics.fmean(itls) if itls else 0.0},
        imbalance=max(busy) / mean_busy if mean_busy else 1.0,
        throughput_rps=len(requests) / ((end - start) / 1000.0) if end > start else 0.0,
        num_requests=len(requests),
        num_preemptions=sum(r.num_preemptions for r in requests),
        decisions=dict(decisions),
    )
