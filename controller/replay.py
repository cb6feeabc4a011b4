"""Trace replay: the real router core over the engine's simulated fleet, in virtual time.

`replay(trace, policy_name, settings)` feeds a Mooncake-format trace (one JSON object a line:
timestamp ms, input_length, output_length, hash_ids of 512-token chained blocks; parsed by
`engine.core.mooncake_trace`) open loop at
trace time / speedup through `controller.router.Router` and N engines of
`engine.core.sim_fleet.SimFleet`: the engine's own block manager, scheduler and sim runner
(timing model = Dynamo's mocker), each on a virtual clock. There is one engine model in
kvplane; this module only turns trace rows into requests and gives the router its live view.

Trace rows become token ids by `sim_fleet.trace_prompt_tokens`: hash id h is a block of
`block_size` tokens all equal to h (the last block cut to input_length), so equal hash-id
prefixes give equal canonical block keys, and the engine's prefix cache hits exactly where the
trace says blocks are shared.

The router sees what it would see live: each engine's cached blocks as its KV events announce
them (BlockStored / BlockRemoved, applied after the step that made them; with
`kv_events=CacheKnowledge.approximate`, none: it predicts each engine's cache from its own
routing, as for engines with `kv_events: approximate`), a GetLoad snapshot
(`EngineCore.load()`) refreshed every `load_poll_ms`, and its own in-flight accounting,
released at first token and at finish. Before a request arriving at t is routed, every engine
has run the passes that start before t (their effects become visible up to one pass early;
the same for every policy).

Metrics follow the issue's definitions: reuse = prompt tokens served from cache / all prompt
tokens (the engine's `cached_prompt_tokens`: full blocks only, at least one token recomputed),
TTFT = first token - arrival, ITL = (finish - first token) / (output tokens - 1), imbalance =
max / mean engine busy time (virtual time in forward passes).
"""

from __future__ import annotations

import enum
import random
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.router import (
    APPROXIMATE_TTL_S,
    Candidate,
    KvplaneWeights,
    LoadSnapshot,
    PrefixHit,
    Router,
    RouteRequest,
    make_policy,
)
from controller.router.replicas import PeerRoutes, RouteEvent
from engine.core.api import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    KvEvent,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.mooncake_trace import FILLER_TOKEN_BASE, TraceRequest
from engine.core.sim_fleet import (
    Progress,
    RequestRecord,
    SimEngine,
    SimFleet,
    TimedRequest,
    trace_prompt_tokens,
)
from indexer.keys import block_keys


class CacheKnowledge(enum.StrEnum):
    """How the replay's router learns the engines' caches (`kvplane bench route --kv-events`)."""

    events = "events"  # their KV events, as `kv_events: grpc` or `zmq` live
    # None: the router predicts each engine's cache from its own routing, as live for
    # `kv_events: approximate` (`router.approximate_ttl_s`, bounded by the engine's capacity).
    approximate = "approximate"


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    workers: int = 8
    blocks_per_worker: int = 2048
    block_size: int = 512
    speedup: float = 1.0
    seed: int = 0
    load_poll_ms: float = 500.0
    # Controller replicas sharing the index and the polled loads, each with its own
    # in-flight accounting; arrivals go to them in turn (a load balancer in front). With
    # `replica_sync` each applies the others' accounting as they route (`router.replica_sync`
    # live; here delivered at once).
    router_replicas: int = 1
    replica_sync: bool = False
    kvplane_weights: KvplaneWeights | None = None
    kv_events: CacheKnowledge = CacheKnowledge.events
    # How long a predicted engine's routed blocks count as cached (`router.approximate_ttl_s`).
    approximate_ttl_s: float = APPROXIMATE_TTL_S
    # The engine's defaults, which are Dynamo's mocker's (vLLM-style scheduling).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


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


def fits(row: TraceRequest, settings: ReplaySettings) -> bool:
    """Whether one engine's KV cache can hold the row (its prompt and one output token): no
    engine could ever admit one that does not, so the replay leaves it out, and so must any
    bound compared with the replay (`oracle_hit_ratio`)."""
    return row.input_length + 1 <= settings.blocks_per_worker * settings.block_size


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


class _RouterView:
    """What the controllers know about the fleet: KV events, polled loads (shared, as an
    index on Redis and the engines' GetLoad are), and each replica's own in-flight."""

    def __init__(self, fleet: SimFleet, routers: list[Router], settings: ReplaySettings) -> None:
        self.fleet = fleet
        self.routers = routers
        self.router_of: dict[str, Router] = {}  # of the requests in flight
        self.num_routed = 0
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.keys: list[set[int]] = [set() for _ in fleet.engines]
        self.loads: list[LoadSnapshot] = []
        self.cached: list[int] = []
        self.last_poll_s: float | None = None
        self.decisions: Counter[str] = Counter()
        self.request_keys: dict[str, list[int]] = {}
        self.predicts = settings.kv_events is CacheKnowledge.approximate

    def on_kv_events(self, index: int, now_s: float, events: list[KvEvent]) -> None:
        if self.predicts:
            return  # the engines publish none the router reads
        keys = self.keys[index]
        for event in events:
            if isinstance(event, BlockStored):
                keys.update(event.block_keys)
            elif isinstance(event, BlockRemoved):
                keys.difference_update(event.block_keys)
            elif isinstance(event, AllBlocksCleared):
                keys.clear()

    def on_progress(self, index: int, request_id: str, what: Progress, now_s: float) -> None:
        if what is Progress.FIRST_TOKEN:
            self.router_of[request_id].first_token(request_id)
        else:
            self.router_of.pop(request_id).finish(request_id)

    def _poll(self, now_s: float) -> None:
        poll_s = self.settings.load_poll_ms / 1000.0
        if self.last_poll_s is not None and now_s - self.last_poll_s < poll_s:
            return
        self.last_poll_s = now_s
        self.loads = []
        for engine in self.fleet.engines:
            load = engine.core.load()
            self.loads.append(
                LoadSnapshot(
                    running_requests=load.num_running,
                    queued_requests=load.num_waiting,
                    used_kv_blocks=load.num_used_blocks,
                    total_kv_blocks=load.num_total_blocks,
                    waiting_tokens=load.waiting_tokens,
                )
            )
        # What the index tells about each engine's cache size (same poll cadence).
        self.cached = [len(keys) for keys in self.keys]

    def route(self, request: EngineRequest, engines: Sequence[SimEngine]) -> int:
        now_s = self.fleet.now_s
        self._poll(now_s)
        keys = self.request_keys.pop(request.request_id)
        candidates = []
        for engine in engines:
            cached = self.keys[engine.index]
            n = 0
            for key in keys:
                if key not in cached:
                    break
                n += 1
            candidates.append(
                Candidate(
                    f"w{engine.index}",
                    hit=PrefixHit(device_blocks=n),
                    load=self.loads[engine.index],
                    total_kv_blocks=self.settings.blocks_per_worker,
                    block_size=self.settings.block_size,
                    # No index tells a predicted engine's cache size (`cache_pressure`).
                    cached_blocks=None if self.predicts else self.cached[engine.index],
                    predicts_cache=self.predicts,
                )
            )
        route = RouteRequest(
            request.request_id,
            len(request.prompt_token_ids),
            self.settings.block_size,
            tuple(keys),
        )
        router = self.routers[self.num_routed % len(self.routers)]
        self.num_routed += 1
        self.router_of[request.request_id] = router
        decision = router.route(route, candidates, self.rng, now_s)
        self.decisions[decision.reason.value] += 1
        return int(decision.engine_id[1:])


def replay(
    trace: Sequence[TraceRequest], policy_name: str, settings: ReplaySettings
) -> PolicyResult:
    weights = settings.kvplane_weights if policy_name == "kvplane" else None
    routers = [
        Router(make_policy(policy_name, weights), approximate_ttl_s=settings.approximate_ttl_s)
        for _ in range(settings.router_replicas)
    ]
    fleet = SimFleet(
        settings.workers,
        block_size=settings.block_size,
        num_blocks=settings.blocks_per_worker,
        max_model_len=1 << 30,
        config=SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        ),
    )
    if settings.replica_sync:
        _sync(routers, fleet)
    view = _RouterView(fleet, routers, settings)
    size = settings.block_size

    def requests() -> Iterator[TimedRequest]:
        for number, row in enumerate(trace):
            if not fits(row, settings):
                continue
            request_id = f"r{number}"
            tokens = trace_prompt_tokens(
                row.hash_ids, row.input_length, size, FILLER_TOKEN_BASE + number
            )
            view.request_keys[request_id] = block_keys(tokens, size)
            sampling = SamplingParams(max_tokens=row.output_length, ignore_eos=True)
            arrival_s = row.arrival_ms / settings.speedup / 1000.0
            yield TimedRequest(arrival_s, EngineRequest(request_id, tokens, sampling))

    records = fleet.replay(
        requests(), view.route, on_kv_events=view.on_kv_events, on_progress=view.on_progress
    )
    return _summarise(policy_name, records, fleet, view.decisions)


def _sync(routers: list[Router], fleet: SimFleet) -> None:
    """Each router's events applied by every other at once, as `controller.replica_sync`
    does live (there, a Redis round trip later)."""
    peers = [PeerRoutes(router) for router in routers]

    def publisher(origin: int) -> Callable[[RouteEvent], None]:
        def deliver(event: RouteEvent) -> None:
            for index, peer in enumerate(peers):
                if index != origin:
                    peer.apply(str(origin), event, fleet.now_s)

        return deliver

    for origin, router in enumerate(routers):
        router.publish_to(publisher(origin))


def _summarise(
    policy: str, records: list[RequestRecord], fleet: SimFleet, decisions: Counter[str]
) -> PolicyResult:
    total_prompt = sum(r.num_prompt_tokens for r in records)
    cached = sum(r.num_cached_tokens for r in records)
    ttfts = [(r.ttft_s or 0.0) * 1000.0 for r in records if r.first_token_s is not None]
    itls = [
        (r.finish_s - r.first_token_s) * 1000.0 / (r.num_output_tokens - 1)
        for r in records
        if r.finish_s is not None and r.first_token_s is not None and r.num_output_tokens > 1
    ]
    busy = [e.busy_s for e in fleet.engines]
    mean_busy = statistics.fmean(busy) if busy else 0.0
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finish_s or 0.0 for r in records), default=0.0)
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
        throughput_rps=len(records) / (end - start) if end > start else 0.0,
        num_requests=len(records),
        num_preemptions=sum(e.num_preemptions for e in fleet.engines),
        decisions=dict(decisions),
    )
