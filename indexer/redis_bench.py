"""Redis-specific figures of `kvplane bench index --backend redis://...` (or redis+cluster://):
batch apply throughput from one process, prefix lookup latency (64-block queries over 16
workers), and Redis memory per (worker, block) placement from INFO memory at 1M blocks.

Each run writes into its own fresh partitions (a random model name under key prefix
`kvplane-bench`) and deletes them at the end, so it can run against a Redis that serves a
real index. docs/benchmarks/redis.md records results.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import Sequence
from typing import Any

import xxhash

from indexer.batch import Action, ActionType, Batch, BlockKey, Tier
from indexer.redis_backend import RedisBackend, open_redis_backend

CHAIN_BLOCKS = 64
NUM_WORKERS = 16
BLOCK_TOKENS = 16
IN_FLIGHT = 8  # concurrent applies from the one process


def _chain(seed: int) -> list[BlockKey]:
    return [xxhash.xxh3_64_intdigest(b"%d:%d" % (seed, i)) >> 1 for i in range(CHAIN_BLOCKS)]


def _report(worker: int, keys: Sequence[BlockKey]) -> Batch:
    action = Action(
        ActionType.REPORT, Tier.HBM, tuple(keys), block_sizes=(BLOCK_TOKENS,) * len(keys)
    )
    return Batch(f"w{worker}", (action,), f"10.0.0.{worker}:8000")


async def _apply_all(backend: RedisBackend, batches: list[Batch]) -> float:
    """Apply `batches` with IN_FLIGHT concurrent callers; block events per second."""
    events = sum(len(a.hashes) for b in batches for a in b.actions)
    next_index = 0

    async def caller() -> None:
        nonlocal next_index
        while next_index < len(batches):
            batch = batches[next_index]
            next_index += 1
            await backend.apply(batch)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(IN_FLIGHT)))
    return events / (time.perf_counter() - start)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def redis_figures(url: str, *, quick: bool = False) -> dict[str, Any]:
    """Every Redis figure, as JSON; partitions it creates are dropped afterwards."""
    num_blocks = 100_000 if quick else 1_000_000
    num_query_chains = 50 if quick else 200
    num_queries = 2_000 if quick else 10_000
    run = secrets.token_hex(4)
    bulk = await open_redis_backend(url, key_prefix="kvplane-bench", model=f"bulk-{run}")
    shared = await open_redis_backend(url, key_prefix="kvplane-bench", model=f"shared-{run}")
    fenced = await open_redis_backend(url, key_prefix="kvplane-bench", model=f"fenced-{run}")
    try:
        # 1M blocks as 64-block chains round-robin over 16 workers, one placement each.
        before = await bulk.used_memory_bytes()
        batches = [_report(c % NUM_WORKERS, _chain(c)) for c in range(num_blocks // CHAIN_BLOCKS)]
        _, usec_before = await bulk.function_stats("fcall")
        apply_events_s = await _apply_all(bulk, batches)
        _, usec_after = await bulk.function_stats("fcall")
        apply_server_s = (usec_after - usec_before) / 1e6
        await bulk.sweep()
        after = await bulk.used_memory_bytes()
        placements = (await bulk.stats()).num_placements

        # The same batches written as a controller's sources write them: each worker's under
        # its writer lease, checked inside Redis with every apply (`fence_writes`).
        holder = f"bench/{run}"
        fenced.fence_writes(holder, lambda worker_id: worker_id)
        for worker in range(NUM_WORKERS):
            await fenced.hold_lease(f"w{worker}", holder, 3600.0)
        fenced_events_s = await _apply_all(
            fenced, [batch._replace(under_lease=True) for batch in batches]
        )

        # Query chains held by all 16 workers, worker w holding the first 64 - 2w blocks.
        chains = [_chain(10**9 + c) for c in range(num_query_chains)]
        shared_batches = [
            _report(w, keys[: CHAIN_BLOCKS - 2 * w]) for keys in chains for w in range(NUM_WORKERS)
        ]
        shared_events_s = await _apply_all(shared, shared_batches)
        latencies_ms = []
        calls_before, usec_before = await shared.function_stats("fcall_ro")
        for i in range(num_queries):
            keys = chains[i % len(chains)]
            start = time.perf_counter()
            result = await shared.match_prefix(keys, 0)
            latencies_ms.append((time.perf_counter() - start) * 1e3)
            assert len(result.matches) == NUM_WORKERS and result.best_prefix_blocks == CHAIN_BLOCKS
        calls_after, usec_after = await shared.function_stats("fcall_ro")
        server_us = (usec_after - usec_before) / max(calls_after - calls_before, 1)
        return {
            "apply_block_events_s": round(apply_events_s),
            "apply_block_events_s_shared_blocks": round(shared_events_s),
            # The same applies, each fenced by its worker's writer lease (a controller's).
            "apply_block_events_s_under_lease": round(fenced_events_s),
            "apply_in_flight": IN_FLIGHT,
            # Block events per second of Redis's own time in kvp_apply (INFO commandstats).
            "apply_server_block_events_s": round(
                len(batches) * CHAIN_BLOCKS / max(apply_server_s, 1e-9)
            ),
            "prefix_p50_ms": round(_percentile(latencies_ms, 0.50), 3),
            "prefix_p99_ms": round(_percentile(latencies_ms, 0.99), 3),
            "prefix_mean_ms": round(statistics.fmean(latencies_ms), 3),
            # Inside Redis (INFO commandstats), without client and network time.
            "prefix_server_mean_ms": round(server_us / 1e3, 3),
            "prefix_queries": num_queries,
            "memory_bytes_per_placement": round((after - before) / placements, 1),
            "memory_placements": placements,
        }
    finally:
        for backend in (bulk, shared, fenced):
            await backend.drop_partition()
            await backend.close()


def render_redis(figures: dict[str, Any]) -> str:
    return (
        "redis: apply {apply_block_events_s:,} block events/s ({apply_in_flight} in flight; "
        "{apply_server_block_events_s:,}/s of Redis time; "
        "{apply_block_events_s_under_lease:,}/s fenced by writer leases); "
        "prefix (64 blocks, 16 workers) p50 {prefix_p50_ms} ms, p99 {prefix_p99_ms} ms "
        "(in Redis: mean {prefix_server_mean_ms} ms); "
        "{memory_bytes_per_placement} bytes per placement (INFO memory, "
        "{memory_placements:,} placements)".format(**figures)
    )
