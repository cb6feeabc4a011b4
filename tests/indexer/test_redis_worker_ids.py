"""The Redis backend's worker ids (16-bit, in every placement record): a removed worker's id
goes to a later new worker, so a partition whose workers come and go under new names (pod names
and addresses in Kubernetes) never runs out of them, and a new worker never inherits a record
of the worker that held its id before (docs/redis.md, "Layout")."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from indexer.backend import IndexBackend, WorkerStats
from indexer.batch import Action, ActionType, Batch, Tier
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import ABI_SUFFIX, RedisBackend, open_redis_backend
from tests.indexer.backend_views import observe
from tests.indexer.served_backend import ServedBackend
from tests.redis_servers import RedisServer

# The partition of the default key prefix and model (docs/redis.md, "Layout").
PARTITION = "kvplane:{default:0}"
KEYS = list(range(1, 21))


def _id_of(server: RedisServer, worker: str) -> bytes | None:
    """The id the partition gave `worker` (only to check which id a test exercises)."""
    return server.client().hget(f"{PARTITION}:wi", worker)  # type: ignore[return-value]


def _report(worker: str, tier: Tier, hashes: Sequence[int], copies: bool = False) -> Batch:
    action = Action(ActionType.REPORT, tier, tuple(hashes), block_sizes=(16,) * len(hashes))
    if copies:
        action = Action(ActionType.REPORT, tier, tuple(hashes), copies=True)
    return Batch(worker, (action,), f"addr-{worker}")


async def _snapshot_keys(backend: IndexBackend) -> dict[str, set[int]]:
    """The block keys each worker's snapshot batches report."""
    keys: dict[str, set[int]] = {}
    async for batch in backend.snapshot():
        keys.setdefault(batch.worker_id, set()).update(h for a in batch.actions for h in a.hashes)
    return keys


async def _holders(backend: IndexBackend, key: int) -> list[str]:
    return [w.worker_id for w in await backend.match([key], False)]


@pytest.mark.timeout(60)
async def test_a_new_worker_on_a_removed_workers_id_inherits_none_of_its_blocks(
    redis_server: RedisServer,
) -> None:
    """Worker a holds blocks (two tiers, an extra copy, hit counters) and is removed; b, the
    next new worker, takes a's id before the sweeper dropped a's records. b's matches,
    prefixes, hit counts, stats and snapshot show none of a's blocks, and once b stores some
    of the same keys, every count starts afresh, exactly as on the memory backend. A worker
    removed and registered again under its old name is a new worker the same way."""
    redis_server.flushall()
    memory = MemoryBackend()
    shared = await open_redis_backend(redis_server.url, buckets=8, maintenance_interval_s=3600)

    async def both(*batches: Batch, remove: str | None = None) -> None:
        if remove is not None:
            assert await shared.remove_worker(remove) == await memory.remove_worker(remove)
        for batch in batches:
            for backend in (memory, shared):
                await backend.apply(batch)

    async def same_answers() -> None:
        assert await observe(shared, [KEYS, KEYS[:5], [7]]) == await observe(
            memory, [KEYS, KEYS[:5], [7]]
        )

    try:
        await both(
            _report("a", Tier.HBM, KEYS),
            _report("a", Tier.DRAM, (7, 8)),
            _report("a", Tier.HBM, (3,), copies=True),
        )
        for backend in (memory, shared):
            await backend.match(KEYS[:5], True)
        id_of_a = _id_of(redis_server, "a")
        await both(Batch("b", (), "addr-b"), remove="a")
        assert _id_of(redis_server, "b") == id_of_a  # the case under test: a's id, unswept

        assert await shared.match(KEYS, False) == []
        assert (await shared.match_prefix(KEYS, 0)).matches == ()
        assert await shared.match_prefix_by_tier(KEYS, 0) == []
        assert await shared.hit_counts(KEYS) == []
        stats = await shared.stats()
        assert (stats.num_blocks, stats.workers) == (0, (WorkerStats("b", "addr-b", 0, 0),))
        assert await _snapshot_keys(shared) == {"b": set()}
        await same_answers()

        await both(_report("b", Tier.HBM, KEYS[:5]), _report("b", Tier.HBM, (3,), copies=True))
        await shared.match(KEYS[:2], True)
        await memory.match(KEYS[:2], True)
        assert await _holders(shared, 7) == []
        assert await _holders(shared, 3) == ["b"]
        assert await shared.hit_counts(KEYS) == [(1, 1), (2, 1)]  # a's hits are gone
        stats = await shared.stats()
        assert (stats.num_blocks, stats.workers) == (5, (WorkerStats("b", "addr-b", 5, 5),))
        await same_answers()

        # The old name comes back: a new worker too, on a free id, holding nothing of before.
        await both(_report("a", Tier.SSD, (9,)), remove="b")
        assert await _holders(shared, 3) == []
        assert await _holders(shared, 9) == ["a"]
        await same_answers()
    finally:
        await shared.close()


@pytest.mark.timeout(60)
async def test_a_partition_takes_new_workers_for_ever_while_it_removes_old_ones(
    redis_server: RedisServer,
) -> None:
    """At most 65,535 workers are registered in a partition at once (records address them by
    a 16-bit id): the batch of one more is refused whole over kv_indexer.v1 with
    RESOURCE_EXHAUSTED, a status a client does not retry (a bridge retries UNAVAILABLE without
    end), while the others are served. Removing a worker frees its id: a fleet whose workers
    keep coming under new names passes 65,535 names and goes on."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16)
    served = await ServedBackend.serve(backend)

    async def refused(worker: str) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.apply(_report(worker, Tier.HBM, (1,)))
        return info.value

    try:
        await asyncio.gather(*(backend.apply(Batch(f"w{i}", (), "")) for i in range(65_534)))
        await served.apply(_report("last", Tier.HBM, (1,)))
        error = await refused("one-more")
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == (
            "batch of one-more: more than 65535 registered workers in one partition"
        )
        assert await _holders(served, 1) == ["last"]

        # Pods replaced one by one, each under a new name: 65,735 names in all.
        pods = [f"pod-{i}" for i in range(200)]
        for i, pod in enumerate(pods):
            await served.remove_worker(f"w{i}")
            await served.apply(_report(pod, Tier.HBM, (2,)))
        assert await _holders(served, 2) == sorted(pods)
        assert (await refused("one-more")).code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # Removing frees as many ids as it removes workers, no more.
        await served.remove_worker("last")
        await served.remove_worker("pod-0")
        await served.apply(_report("one-more", Tier.HBM, (1,)))
        await served.apply(_report("and-another", Tier.HBM, (1,)))
        assert (await refused("a-third")).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _holders(served, 1) == ["and-another", "one-more"]
        assert len((await served.stats()).workers) == 65_535
    finally:
        await served.close()
        await backend.close()


@pytest.mark.timeout(60)
async def test_stats_and_snapshots_never_give_a_new_workers_blocks_to_the_removed_one(
    redis_server: RedisServer,
) -> None:
    """Stats and snapshots read the worker table, then the blocks in several calls. Worker a
    is removed and b takes its id between those calls (here: just before the first block
    read): b's blocks must not be reported as a's, whose entry the table still holds."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, dump_chunk_buckets=4)
    other = await open_redis_backend(redis_server.url, buckets=16)  # another indexer process
    calls = backend._client.execute_command
    swaps = 0

    async def replace_a_before_the_first_dump(*args: Any, **options: Any) -> Any:
        nonlocal swaps
        if args[:2] == ("FCALL_RO", "kvp_dump" + ABI_SUFFIX) and args[5] == 0:
            swaps += 1
            await other.remove_worker(f"a{swaps}")
            await other.apply(_report(f"b{swaps}", Tier.HBM, range(101, 121)))
        return await calls(*args, **options)

    try:
        await backend.apply(_report("a1", Tier.HBM, KEYS))
        await backend.apply(_report("a2", Tier.HBM, KEYS))
        ids = [_id_of(redis_server, "a1"), _id_of(redis_server, "a2")]
        # Every call of this indexer goes through the client: the swap runs right before the
        # first block read, after the worker table was read.
        backend._client.execute_command = replace_a_before_the_first_dump  # type: ignore[method-assign]
        stats = await backend.stats()
        assert _id_of(redis_server, "b1") == ids[0]
        assert stats.workers == (
            WorkerStats("a1", "addr-a1", 0, 20),  # (its placements: as the table read them)
            WorkerStats("a2", "addr-a2", 20, 20),
        )
        snapshot = await _snapshot_keys(backend)
        assert _id_of(redis_server, "b2") == ids[1]
        # a2 had nothing left once the blocks were read; b2 came after the table.
        assert snapshot == {"a2": set(), "b1": set(range(101, 121))}
    finally:
        await other.close()
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_partition_written_before_ids_were_freed_frees_its_removed_workers_ids(
    redis_server: RedisServer,
) -> None:
    """A partition that earlier versions filled with 65,535 names, most of them of removed
    workers (interned for good then), takes new workers once an indexer of this version opens
    it; its registered worker keeps its blocks."""
    redis_server.flushall()
    client = redis_server.client()
    client.hset(f"{PARTITION}:wi", mapping={f"gone-{i}": i for i in range(1, 65_536)})
    client.hset(f"{PARTITION}:wi", "kept", 7)
    client.hdel(f"{PARTITION}:wi", "gone-7")
    client.sadd(f"{PARTITION}:ws", 7)
    client.hset(f"{PARTITION}:w:7", mapping={"n": "kept", "a": "addr-kept", "s": ""})
    client.hset(f"{PARTITION}:m", mapping={"nw": 65_535, "nb": 16})
    backend: RedisBackend = await open_redis_backend(redis_server.url, buckets=16)
    try:
        await backend.apply(_report("kept", Tier.HBM, (1,)))
        await backend.apply(_report("new", Tier.HBM, (1,)))
        assert await _holders(backend, 1) == ["kept", "new"]
        assert await backend.remove_worker("gone-1") == 0
    finally:
        await backend.close()
