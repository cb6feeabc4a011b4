"""`kvplane bench index`: kvplane's index against NVIDIA Dynamo's Rust RadixTree, the KVIndexer
gRPC service, and memory per placement (BENCHMARKS.md section 1).

Both indexes run in this process on the same data, and both start from bytes. Dynamo gets its
cheapest input: events pre-serialised as JSON bytes, which `apply_event` parses in Rust.
kvplane gets its real ingestion path, exactly as the ApplyExternalKvBatch servicer runs it:
pre-serialised `ApplyExternalKvBatchRequest` bytes parsed by protobuf (`FromString`),
converted by `indexer.kv_wire.batch_from_proto`, then `IndexBackend.apply` (which validates
before changing anything). The `core` figures apply the same events as already-built `Batch`
objects (the index alone). Dynamo hands work to a Rust thread, so every
timed Dynamo region ends with a `find_matches` call that waits for the queue to drain. Block
hashes are content-derived and equal on both sides (`block_hash == tokens_hash`), the setting
in which Dynamo 1.6.1 accepts the same block on several workers. Dynamo is optional: when
`dynamo.llm` cannot be imported its figures are reported as absent.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import multiprocessing
import os
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import uvloop
import xxhash

from indexer.backend import IndexBackend
from indexer.backends import REDIS_SCHEMES, open_backend, shown_url
from indexer.batch import Action, ActionType, Batch, BlockKey, Tier
from indexer.index import PrefixIndex
from indexer.kv_wire import batch_from_proto
from indexer.memory_backend import MemoryBackend
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

NUM_WORKERS = 16
CHAIN_BLOCKS = 64
MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[1].parent
    / "shared/data/traces/mooncake-fast25/conversation_trace.jsonl"
)


@dataclass(frozen=True)
class Scale:
    one_block_events: int = 100_000
    chain_events: int = 1_000
    match_queries: int = 10_000
    remove_blocks: int = 100_000
    mooncake_requests: int | None = None  # None: the whole trace
    memory_blocks: int = 1_000_000
    service_blocks: int = 1_000_000
    service_seconds: float = 10.0
    repeats: int = 3
    # 64-block chains the prefix-match workload is set up with (its queries cycle over them).
    match_chains: int = 1_000


FULL_SCALE = Scale()
QUICK_SCALE = Scale(10_000, 200, 2_000, 10_000, 2_000, 100_000, 100_000, 2.0, 3)


def key_of(*parts: int) -> BlockKey:
    """A random-looking, non-negative 63-bit block key (valid for both indexes)."""
    return xxhash.xxh3_64_intdigest(b":".join(b"%d" % p for p in parts)) >> 1


def chain(seed: int, length: int) -> list[BlockKey]:
    return [key_of(seed, i) for i in range(length)]


# ---------------------------------------------------------------------- the two sides


def report_bytes(worker: str, parent: BlockKey | None, hashes: Sequence[BlockKey]) -> bytes:
    action = kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=hashes)
    if parent is not None:
        action.parent_block_hash = parent
    return kv.ApplyExternalKvBatchRequest(
        worker_id=worker, worker_address=f"{worker}:8000", actions=[action]
    ).SerializeToString()


def dynamo_bytes(event_id: int, parent: BlockKey | None, hashes: Sequence[BlockKey]) -> bytes:
    blocks = [{"block_hash": h, "tokens_hash": h} for h in hashes]
    event = {"event_id": event_id, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}
    return json.dumps(event).encode()


@dataclass(frozen=True)
class StoreEvent:
    worker: int
    parent: BlockKey | None
    hashes: tuple[BlockKey, ...]


class KvplaneSide:
    """Applies pre-serialised ApplyExternalKvBatchRequests through the backend interface."""

    def __init__(self, backend: IndexBackend) -> None:
        self.backend = backend

    @staticmethod
    def encode(events: Sequence[StoreEvent]) -> list[bytes]:
        return [report_bytes(f"w{e.worker}", e.parent, e.hashes) for e in events]

    async def apply_all(self, payloads: Sequence[bytes]) -> None:
        parse = kv.ApplyExternalKvBatchRequest.FromString
        from_proto = batch_from_proto
        apply = self.backend.apply
        for payload in payloads:  # as the servicer does: apply validates
            await apply(from_proto(parse(payload)))

    async def apply_batches(self, batches: Sequence[Batch]) -> None:
        apply = self.backend.apply
        for batch in batches:
            await apply(batch)

    async def match_all(self, queries: Sequence[Sequence[BlockKey]]) -> int:
        match = self.backend.match_prefix
        total = 0
        for query in queries:
            total += (await match(query, 0)).best_prefix_blocks
        return total

    async def remove(self, worker: int) -> None:
        await self.backend.remove_worker(f"w{worker}")


class DynamoSide:
    def __init__(self) -> None:
        from dynamo.llm import RadixTree

        self.tree = RadixTree()
        self._barrier_key: BlockKey = 0

    @staticmethod
    def encode(events: Sequence[StoreEvent]) -> list[tuple[int, bytes]]:
        return [(e.worker, dynamo_bytes(i, e.parent, e.hashes)) for i, e in enumerate(events)]

    def barrier(self) -> None:
        """Wait until the tree's worker thread has processed everything sent so far."""
        self.tree.find_matches([self._barrier_key])

    def apply_all(self, payloads: Sequence[tuple[int, bytes]]) -> None:
        apply = self.tree.apply_event
        for worker, payload in payloads:
            apply(worker, payload)
        self.barrier()

    def match_all(self, queries: Sequence[Sequence[BlockKey]]) -> int:
        find = self.tree.find_matches
        total = 0
        for query in queries:
            scores = find(list(query)).scores
            total += max(scores.values(), default=0)
        return total

    def remove(self, worker: int) -> None:
        self.tree.remove_worker(worker)
        self.barrier()


def dynamo_available() -> bool:
    try:
        from dynamo.llm import RadixTree  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------- workloads


def one_block_events(n: int) -> list[StoreEvent]:
    """n one-block events, round-robin over the workers, each extending its worker's chain."""
    events = []
    last: list[BlockKey | None] = [None] * NUM_WORKERS
    for i in range(n):
        w = i % NUM_WORKERS
        key = key_of(1, w, i // NUM_WORKERS)
        events.append(StoreEvent(w, last[w], (key,)))
        last[w] = key
    return events


def chain_events(n: int, base: int = 2) -> list[StoreEvent]:
    return [
        StoreEvent(i % NUM_WORKERS, None, tuple(chain(base * 10**7 + i, CHAIN_BLOCKS)))
        for i in range(n)
    ]


def shared_chain_setup(num_chains: int) -> tuple[list[StoreEvent], list[list[BlockKey]]]:
    """Chains of 64 blocks, each held by 4 of the 16 workers to depths of 16..64 blocks."""
    events = []
    chains = [chain(3 * 10**7 + c, CHAIN_BLOCKS) for c in range(num_chains)]
    for c, keys in enumerate(chains):
        for j in range(4):
            w = (c + 5 * j) % NUM_WORKERS
            depth = 16 + (c * 7 + w * 13) % (CHAIN_BLOCKS - 15)
            events.append(StoreEvent(w, None, tuple(keys[:depth])))
    return events, chains


def remove_setup(num_blocks: int) -> list[StoreEvent]:
    """Worker 0 holds `num_blocks` blocks; worker 1 shares the first half of them."""
    events = []
    for c in range(num_blocks // CHAIN_BLOCKS):
        keys = tuple(chain(4 * 10**7 + c, CHAIN_BLOCKS))
        events.append(StoreEvent(0, None, keys))
        if c < num_blocks // CHAIN_BLOCKS // 2:
            events.append(StoreEvent(1, None, keys))
    return events


def mooncake_events(limit: int | None) -> tuple[list[StoreEvent], list[list[BlockKey]]]:
    """The conversation trace, round-robin over 8 workers: each request stores the blocks its
    worker does not hold yet (no eviction), as one event continuing from its cached prefix."""
    held: list[set[int]] = [set() for _ in range(8)]
    events, queries = [], []
    with MOONCAKE_TRACE.open() as trace:
        for i, line in enumerate(trace):
            if limit is not None and i >= limit:
                break
            ids = [h + 1 for h in json.loads(line)["hash_ids"]]  # +1: keep 0 out of play
            if not ids:
                continue
            w = i % 8
            queries.append(ids)
            cached = 0
            while cached < len(ids) and ids[cached] in held[w]:
                cached += 1
            if cached < len(ids):
                parent = ids[cached - 1] if cached else None
                events.append(StoreEvent(w, parent, tuple(ids[cached:])))
                held[w].update(ids[cached:])
    return events, queries


# ---------------------------------------------------------------------- timing


@dataclass
class Figures:
    kvplane_ops_s: float
    dynamo_ops_s: float | None
    ops: int
    unit: str
    # Store workloads: kvplane from already-decoded Batch objects (the index alone).
    kvplane_core_ops_s: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        ratio = self.kvplane_ops_s / self.dynamo_ops_s if self.dynamo_ops_s else None
        core = self.kvplane_core_ops_s
        return {
            "kvplane_ops_s": round(self.kvplane_ops_s, 1),
            "kvplane_core_ops_s": None if core is None else round(core, 1),
            "core_ratio": None
            if core is None or not self.dynamo_ops_s
            else round(core / self.dynamo_ops_s, 3),
            "dynamo_ops_s": None if self.dynamo_ops_s is None else round(self.dynamo_ops_s, 1),
            "ratio": None if ratio is None else round(ratio, 3),
            "ops": self.ops,
            "unit": self.unit,
            **self.extra,
        }


async def _time_async(run: Callable[[], Awaitable[object]]) -> float:
    gc.collect()
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


def _time_sync(run: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


class IndexBench:
    def __init__(self, backend_url: str, scale: Scale, with_dynamo: bool) -> None:
        self.backend_url = backend_url
        self.scale = scale
        self.with_dynamo = with_dynamo

    async def _fresh(self) -> IndexBackend:
        return await open_bench_backend(self.backend_url)

    async def store(self, events: list[StoreEvent], unit: str) -> Figures:
        kv_payloads = KvplaneSide.encode(events)
        dyn_payloads = DynamoSide.encode(events) if self.with_dynamo else []
        batches = [
            Batch(f"w{e.worker}", (Action(ActionType.REPORT, Tier.HBM, e.hashes, parent=e.parent),))
            for e in events
        ]
        kv_times: list[float] = []
        core_times: list[float] = []
        dyn_times: list[float] = []
        for _ in range(self.scale.repeats):
            for target, run in ((kv_times, "wire"), (core_times, "core")):
                backend = await self._fresh()
                try:
                    side = KvplaneSide(backend)
                    if run == "wire":
                        target.append(await _time_async(partial(side.apply_all, kv_payloads)))
                    else:
                        target.append(await _time_async(partial(side.apply_batches, batches)))
                finally:
                    await discard(backend)
            if self.with_dynamo:
                dyn = DynamoSide()
                dyn_times.append(_time_sync(partial(dyn.apply_all, dyn_payloads)))
        figures = _figures(len(events), unit, kv_times, dyn_times)
        figures.kvplane_core_ops_s = len(events) / statistics.median(core_times)
        return figures

    async def match(
        self, setup: list[StoreEvent], queries: list[list[BlockKey]], unit: str
    ) -> Figures:
        backend = await self._fresh()
        try:
            side = KvplaneSide(backend)
            await side.apply_all(KvplaneSide.encode(setup))
            dyn = None
            if self.with_dynamo:
                dyn = DynamoSide()
                dyn.apply_all(DynamoSide.encode(setup))
                kv_total, dyn_total = (
                    await side.match_all(queries[:50]),
                    dyn.match_all(queries[:50]),
                )
                if kv_total != dyn_total:
                    log.warning("kvplane and dynamo disagree: %d vs %d", kv_total, dyn_total)
            kv_times, dyn_times = [], []
            for _ in range(self.scale.repeats):
                kv_times.append(await _time_async(partial(side.match_all, queries)))
                if dyn is not None:
                    dyn_times.append(_time_sync(partial(dyn.match_all, queries)))
        finally:
            await discard(backend)
        return _figures(len(queries), unit, kv_times, dyn_times)

    async def remove(self, setup: list[StoreEvent]) -> Figures:
        """Removal as the caller sees it. kvplane's memory backend removes a worker in O(1)
        and purges its bits from the blocks afterwards; that purge is timed separately."""
        num_blocks = sum(len(e.hashes) for e in setup if e.worker == 0)
        kv_times, purge_times, dyn_times = [], [], []
        for _ in range(self.scale.repeats):
            backend = await self._fresh()
            try:
                side = KvplaneSide(backend)
                await side.apply_all(KvplaneSide.encode(setup))
                kv_times.append(await _time_async(partial(side.remove, 0)))
                if isinstance(backend, MemoryBackend):
                    purge_times.append(_time_sync(backend.index.purge))
            finally:
                await discard(backend)
            if self.with_dynamo:
                dyn = DynamoSide()
                dyn.apply_all(DynamoSide.encode(setup))
                dyn_times.append(_time_sync(partial(dyn.remove, 0)))
        figures = _figures(num_blocks, "blocks removed", kv_times, dyn_times)
        if purge_times:
            purge_s = statistics.median(purge_times)
            figures.extra["kvplane_purge_s"] = round(purge_s, 4)
            if dyn_times:
                dyn_s = statistics.median(dyn_times)
                figures.extra["ratio_with_purge"] = round(
                    dyn_s / (statistics.median(kv_times) + purge_s), 3
                )
        return figures

    async def workloads(self) -> dict[str, Figures]:
        s = self.scale
        out: dict[str, Figures] = {}
        out["store_1_block_events"] = await self.store(
            one_block_events(s.one_block_events), "events"
        )
        out["store_64_block_events"] = await self.store(chain_events(s.chain_events), "events")
        setup, chains = shared_chain_setup(s.match_chains)
        queries = [chains[i % len(chains)] for i in range(s.match_queries)]
        out["match_64_block_prefixes"] = await self.match(setup, queries, "queries")
        out["remove_worker"] = await self.remove(remove_setup(s.remove_blocks))
        events, trace_queries = mooncake_events(s.mooncake_requests)
        out["mooncake_store"] = await self.store(events, "events")
        out["mooncake_match"] = await self.match(events, trace_queries, "queries")
        return out


_bench_partitions = itertools.count()


async def open_bench_backend(url: str) -> IndexBackend:
    """A fresh, empty backend. A shared (Redis) backend gets a partition of its own, so the
    benchmark never reads or overwrites an index someone uses."""
    if url.startswith(REDIS_SCHEMES):
        from indexer.redis_backend import RedisBackend

        model = f"kvplane-bench-{os.getpid()}-{next(_bench_partitions)}"
        backend = await open_backend(url, model=model)
        # The backend waits out a Redis that does not answer (buffering what it is sent): a
        # benchmark would time that buffer, then fail deleting its partition (a traceback).
        if isinstance(backend, RedisBackend) and not backend.healthy:
            await backend.close()
            raise KvplaneError(f"cannot benchmark {shown_url(url)}: Redis does not answer there")
        return backend
    return await open_backend(url)


async def discard(backend: IndexBackend) -> None:
    """Empty a benchmark backend and close it: a Redis one's partition is deleted key by key
    (removing its workers leaves the block keys behind: a run left ~476k keys), so a shared
    Redis keeps no benchmark data."""
    from indexer.redis_backend import RedisBackend

    if isinstance(backend, RedisBackend):
        await backend.drop_partition()
    await backend.close()


def _figures(ops: int, unit: str, kv_times: list[float], dyn_times: list[float]) -> Figures:
    kv_s = statistics.median(kv_times)
    dyn_s = statistics.median(dyn_times) if dyn_times else None
    return Figures(ops / kv_s, ops / dyn_s if dyn_s else None, ops, unit)


# ---------------------------------------------------------------------- memory


def _chains_for(num_blocks: int, seed: int) -> Iterator[tuple[int, list[BlockKey]]]:
    for c in range(num_blocks // CHAIN_BLOCKS):
        yield c % NUM_WORKERS, chain(seed + c, CHAIN_BLOCKS)


def bytes_per_placement(num_blocks: int) -> dict[str, float]:
    """tracemalloc'd growth of a fresh core while indexing `num_blocks` blocks as 64-block
    chains over 16 workers, one placement each (keys created inside the traced region, so
    the key integers the index keeps are counted)."""
    gc.collect()
    tracemalloc.start()
    try:
        index = PrefixIndex()
        before = tracemalloc.get_traced_memory()[0]
        for w, keys in _chains_for(num_blocks, 5 * 10**7):
            index.apply(Batch(f"w{w}", (Action(ActionType.REPORT, Tier.HBM, tuple(keys)),)))
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    placements = index.num_placements
    return {
        "bytes_per_placement": round((after - before) / placements, 1),
        "placements": placements,
    }


# ---------------------------------------------------------------------- service


async def service_figures(
    backend_url: str, num_blocks: int, seconds: float, qps: float = 1_000.0
) -> dict[str, float] | None:
    """MatchExternalKvPrefix over real gRPC on loopback: the server runs in this process on
    `backend_url` holding `num_blocks` blocks (64-block chains over 16 workers); a client
    process measures latency at an offered `qps` (open loop), then closed-loop throughput with
    8 concurrent callers. None when this build has no KVIndexer servicer."""
    try:
        from indexer.servicer import index_services
    except ImportError:
        return None
    from kvplane.config import ServerConfig
    from kvplane.server import create_server

    backend = await open_bench_backend(backend_url)
    server = None
    try:
        chains: list[list[BlockKey]] = []
        for w, keys in _chains_for(num_blocks, 6 * 10**7):
            batch = Batch(f"w{w}", (Action(ActionType.REPORT, Tier.HBM, tuple(keys)),), f"w{w}:1")
            await backend.apply(batch)
            if len(chains) < 4096:
                chains.append(keys)
        services, _, _ = index_services(
            backend, default_block_size=16, max_concurrent_prefix_queries=1024
        )
        server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
        figures = await asyncio.get_running_loop().run_in_executor(
            None, _run_client_process, port, chains, seconds, qps
        )
    finally:
        if server is not None:
            await server.stop(None)
        await discard(backend)
    return {**figures, "offered_qps": qps, "indexed_blocks": num_blocks}


def _run_client_process(
    port: int, chains: list[list[BlockKey]], seconds: float, qps: float
) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        figures: dict[str, float] = pool.apply(_client_main, (port, chains, seconds, qps))
    return figures


def _client_main(
    port: int, chains: list[list[BlockKey]], seconds: float, qps: float
) -> dict[str, float]:
    # The load generator must not compete with the server it measures: when this process
    # was pinned (taskset, as for the Dynamo comparison), the client uses every other CPU.
    cpus = set(range(os.cpu_count() or 1))
    others = cpus - os.sched_getaffinity(0)
    if others:
        os.sched_setaffinity(0, others)
    return uvloop.run(_client(port, chains, seconds, qps))


async def _client(
    port: int, chains: list[list[BlockKey]], seconds: float, qps: float
) -> dict[str, float]:
    from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
    from kvplane.channels import INSECURE

    async with INSECURE.aio_channel(f"127.0.0.1:{port}") as channel:
        stub = kv_grpc.KVIndexerStub(channel)
        requests = [kv.MatchExternalKvPrefixRequest(hashes=c) for c in chains]
        for request in requests[:200]:  # warm up
            await stub.MatchExternalKvPrefix(request)
        latencies, failures = await _open_loop(stub, requests, seconds, qps)
        max_qps = await _closed_loop(stub, requests, min(seconds, 3.0), callers=8)
    latencies.sort()
    return {
        "match_p50_ms": round(1e3 * latencies[len(latencies) // 2], 3),
        "match_p99_ms": round(1e3 * latencies[int(len(latencies) * 0.99)], 3),
        "match_qps": round(len(latencies) / seconds, 1),
        "match_failed": len(failures),
        "max_qps_8_callers": round(max_qps, 1),
    }


async def _open_loop(
    stub: Any, requests: list[Any], seconds: float, qps: float
) -> tuple[list[float], list[float]]:
    """Latencies of the calls that succeeded and of those that failed (never retried)."""
    import grpc

    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    failures: list[float] = []

    async def one(request: Any) -> None:
        start = time.perf_counter()
        try:
            await stub.MatchExternalKvPrefix(request)
        except grpc.aio.AioRpcError:
            failures.append(time.perf_counter() - start)
        else:
            latencies.append(time.perf_counter() - start)

    tasks = []
    start = loop.time()
    for i in range(int(seconds * qps)):
        delay = start + i / qps - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(requests[i % len(requests)])))
    await asyncio.gather(*tasks)
    return latencies, failures


async def _closed_loop(stub: Any, requests: list[Any], seconds: float, callers: int) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def caller(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() < deadline:
            await stub.MatchExternalKvPrefix(requests[i % len(requests)])
            done += 1
            i += callers

    start = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return done / (time.perf_counter() - start)


# ---------------------------------------------------------------------- entry point


async def run_index_bench(
    backend_url: str = "memory", quick: bool = False, scale: Scale | None = None
) -> dict[str, Any]:
    """Every figure of `kvplane bench index`, as the JSON document the CLI prints. `scale`
    overrides the full or quick sizes (the smoke test runs a tiny one)."""
    if scale is None:
        scale = QUICK_SCALE if quick else FULL_SCALE
    with_dynamo = dynamo_available()
    bench = IndexBench(backend_url, scale, with_dynamo)
    workloads = await bench.workloads()
    memory = bytes_per_placement(scale.memory_blocks) if backend_url == "memory" else None
    service = await service_figures(backend_url, scale.service_blocks, scale.service_seconds)
    redis = None
    if backend_url.startswith(REDIS_SCHEMES):  # Redis's own figures (indexer/redis_bench.py)
        from indexer.redis_bench import redis_figures

        redis = await redis_figures(backend_url, quick=quick)
    return {
        "workloads": {name: f.as_json() for name, f in workloads.items()},
        "service": service,
        "memory": memory,
        "redis": redis,
        "dynamo": "ai-dynamo-runtime 1.6.1" if with_dynamo else "absent",
        "backend": shown_url(backend_url),
        "quick": quick,
    }


def render_table(result: dict[str, Any]) -> str:
    dynamo = result["dynamo"]
    if dynamo == "absent":  # say how to have the comparison the benchmark is for
        dynamo += " (pip install ai-dynamo-runtime==1.6.1 to compare)"
    lines = [
        f"backend: {result['backend']}   dynamo: {dynamo}",
        f"{'workload':<26}{'kvplane ops/s':>15}{'dynamo ops/s':>15}{'ratio':>7}"
        f"{'core ops/s':>13}{'ratio':>7}  unit",
    ]
    for name, f in result["workloads"].items():
        dyn = "absent" if f["dynamo_ops_s"] is None else f"{f['dynamo_ops_s']:,.0f}"
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}"
        core = "-" if f["kvplane_core_ops_s"] is None else f"{f['kvplane_core_ops_s']:,.0f}"
        core_ratio = "-" if f["core_ratio"] is None else f"{f['core_ratio']:.2f}"
        lines.append(
            f"{name:<26}{f['kvplane_ops_s']:>15,.0f}{dyn:>15}{ratio:>7}{core:>13}{core_ratio:>7}"
            f"  {f['unit']}/s"
        )
    service = result["service"]
    if service is None:
        lines.append("service: not measured (indexer.servicer not available)")
    else:
        lines.append(
            "service MatchExternalKvPrefix: p50 {match_p50_ms} ms, p99 {match_p99_ms} ms at "
            "{match_qps} qps (offered {offered_qps}); {max_qps_8_callers} qps with 8 callers; "
            "{indexed_blocks} blocks".format(**service)
        )
    if result.get("redis") is not None:
        from indexer.redis_bench import render_redis

        lines.append(render_redis(result["redis"]))
    memory = result["memory"]
    if memory is not None:
        lines.append(
            f"memory: {memory['bytes_per_placement']} bytes per placement "
            f"({memory['placements']:,} placements)"
        )
    return "\n".join(lines)
