"""The shared index on a real redis-server that reaches its `maxmemory` (docs/redis.md,
"Failure behaviour" and "Redis configuration").

Under `noeviction` (Redis's default) Redis refuses every function that could grow the index
at its start. The writing process buffers its batches and its queries wait; a process that
only reads stops answering once its maintenance probe is refused (another process may hold a
removal buffered behind a report: no answer may show the block as if it had gone); both say
that Redis is out of memory, and both answer exactly again, without a restart, once Redis
takes writes. The removals (REVOKE, CLEAR, a worker removed) that may go ahead of what is
buffered before them with the in-order result are applied meanwhile, those in batches that
also report included (an engine step's), so that an index that filled Redis shrinks back
under the cap by itself and the buffered reports follow; a writer under leases keeps them
meanwhile (renewed with kvp_renew), so that its removals are not fenced past a lease's term.
A policy that lets Redis evict the index's own keys (`allkeys-*`) is warned of at start-up;
a Redis that refuses CONFIG (as managed ones often do) is served without a word.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from indexer.backend import IndexBackend
from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec, Tier
from indexer.early_removals import early_removals
from indexer.index import Placement
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import (
    IndexUnavailableError,
    LeaseState,
    RedisBackend,
    open_redis_backend,
)
from tests.indexer.backend_views import observe, worker_keys
from tests.indexer.redis_refusals import (
    WORKER,
    batch,
    held,
    refuses_saying,
    why_unavailable,
    writer_and_reader,
)
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(60)
OUT_OF_MEMORY = "is out of memory and refuses writes"
EVICTING = "may evict the index's keys"


async def test_redis_out_of_memory_fails_closed_and_recovers_by_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    server = RedisServer(tmp_path / "redis")
    server.start()
    async with writer_and_reader(server) as (writer, reader):
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", 1)  # far below what Redis uses

        # The engine stored block 4, then evicted block 1: Redis refuses the report, buffered
        # and acknowledged, so neither process may answer any more.
        await writer.apply(batch(ActionType.REPORT, (4,)))
        assert not writer.healthy and writer.num_buffered_batches == 1
        assert OUT_OF_MEMORY in await why_unavailable(writer)
        # The removal of a block the buffered report does not name is applied even now, as is
        # another worker's, with nothing of its worker buffered.
        await writer.apply(batch(ActionType.REVOKE, (1,)))
        await writer.apply(batch(ActionType.REVOKE, (11,), "w1"))

        async def released() -> bool:
            return (
                writer.num_buffered_batches == 1
                and await worker_keys(reader, "w1") == {12}
                and await worker_keys(reader, WORKER) == {2, 3}
            )

        await eventually(released, 30, "the removals to be applied at maxmemory")

        await eventually(
            lambda: refuses_saying(reader, OUT_OF_MEMORY),
            30,
            "the reading process to stop answering",
        )
        assert OUT_OF_MEMORY in await why_unavailable(reader)
        assert reader.unavailable is not None and OUT_OF_MEMORY in reader.unavailable
        assert writer.num_buffered_batches == 1  # still refused

        server.command("CONFIG", "SET", "maxmemory", 0)  # the operator raises the cap

        async def recovered() -> bool:  # (the reader finds out at its next maintenance call)
            return writer.healthy and reader.unavailable is None

        await eventually(recovered, 30, "the writing process to replay its buffer")
        assert await held(writer, [1, 2, 3, 4]) == [(WORKER, (2, 3, 4))]
        assert await held(reader, [1, 2, 3, 4, 11, 12]) == [(WORKER, (2, 3, 4)), ("w1", (12,))]
        assert reader.unavailable is None and writer.unavailable is None
        messages = [r.getMessage() for r in caplog.records]
        said = [m for m in messages if "is out of memory and refuses the index's writes" in m]
        assert len(said) == 2  # once per process, not once per refused call
        assert "raise its maxmemory or free memory" in said[0]
        assert sum("takes the index's writes again" in m for m in messages) == 2


async def test_removals_shrink_a_full_redis_and_the_buffered_reports_follow(
    tmp_path: Path,
) -> None:
    """Redis fills up under the index (`noeviction`): a report is refused and buffered; then
    the engines evict blocks, clear a tier and a worker goes, through this process and
    through one started while Redis is full. Those apply at maxmemory and free memory, the
    index falls back under the cap by itself and the buffered report follows: the index
    then holds what the memory backend given the same batches holds, with no operator."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    writer = await open_redis_backend(server.url, buckets=256, maintenance_interval_s=0.05)
    expected = MemoryBackend()
    late: RedisBackend | None = None

    async def apply(backend: RedisBackend, batch: Batch) -> None:
        await backend.apply(batch)
        await expected.apply(batch)

    try:
        for first in range(1, 20_001, 500):  # w0: 20,000 blocks, the bulk of the index
            await apply(writer, batch(ActionType.REPORT, tuple(range(first, first + 500))))
        for worker in ("w2", "w3"):
            await apply(writer, batch(ActionType.REPORT, tuple(range(30_001, 32_001)), worker))
        await apply(writer, batch(ActionType.REPORT, (40_001, 40_002), "w4"))
        used = await writer.used_memory_bytes()
        cap = used - 200_000
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", cap)

        await apply(writer, batch(ActionType.REPORT, (50_001, 50_002, 50_003), "w1"))
        assert writer.num_buffered_batches == 1  # refused: it would grow the index
        assert OUT_OF_MEMORY in await why_unavailable(writer)

        # A process started now (FUNCTION LOAD refused) clears w2's tier; this one evicts
        # w0's blocks but the first 100, and removes w3.
        late = await open_redis_backend(server.url, buckets=256, maintenance_interval_s=0.05)
        assert OUT_OF_MEMORY in await why_unavailable(late)
        await apply(
            late, Batch("w2", (Action(ActionType.CLEAR_ALL_AT_TIER, Tier.HBM, ()),), "addr-w2")
        )
        for first in range(101, 20_001, 500):
            keys = tuple(range(first, min(first + 500, 20_001)))
            await apply(writer, batch(ActionType.REVOKE, keys))
        await writer.remove_worker("w3")
        await expected.remove_worker("w3")

        async def recovered() -> bool:
            return writer.healthy and writer.unavailable is None and late.unavailable is None

        await eventually(recovered, 30, "the index to shrink under the cap and recover")
        freed = used - await writer.used_memory_bytes()
        assert freed > 200_000, f"{freed} bytes freed"
        queries = [[1, 2, 3], [101], [30_001, 30_002], [40_001, 40_002], [50_001, 50_002, 50_003]]
        assert await observe(writer, queries) == await observe(expected, queries)
        assert await observe(late, queries) == await observe(expected, queries)
    finally:
        await writer.close()
        if late is not None:
            await late.close()
        server.stop()


async def test_a_writer_under_leases_keeps_them_at_maxmemory(tmp_path: Path) -> None:
    """At maxmemory a lease's holder keeps renewing it (kvp_renew: it only rewrites the
    lease key), past the term it took it for, so that its removals under the lease still
    apply and free memory instead of being fenced once the term is over; a restarted process
    of a replica takes its lease over, and a holder releases its own. Taking a lease nobody
    holds, and handing a resync over to another holder, wait for Redis to take writes."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    writer = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    writer.fence_writes("a/1", lambda worker: "e0")  # every worker's engine: e0
    lease = "kvplane:{default:0}:l:e0"

    def leased(kind: ActionType, keys: tuple[BlockKey, ...], worker: str) -> Batch:
        return batch(kind, keys, worker)._replace(under_lease=True)

    try:
        assert await writer.hold_lease("e0", "a/1", 5.0) is LeaseState.TAKEN
        assert await writer.hold_lease("e1", "b/1", 30.0) is LeaseState.TAKEN
        await writer.apply(leased(ActionType.REPORT, (1, 2, 3), WORKER))
        await writer.apply(leased(ActionType.REPORT, (11, 12), "w1"))
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", 1)  # far below what Redis uses
        await writer.apply(leased(ActionType.REPORT, (4,), WORKER))  # refused: buffered
        assert OUT_OF_MEMORY in await why_unavailable(writer)

        # Kept, for longer than the term it was taken for.
        assert await writer.hold_lease("e0", "a/1", 600.0) is LeaseState.KEPT
        assert int(server.command("PTTL", lease)) > 5_000
        assert await writer.hold_lease("e0", "c/1", 600.0) is LeaseState.HELD_ELSEWHERE
        # So a removal under it (of a worker with nothing buffered) is applied, not fenced.
        await writer.apply(leased(ActionType.REVOKE, (11,), "w1"))

        # Applied, and not left in the buffer (only the refused report of 4 is): eventually,
        # as a call whose reply Redis refused is settled from its write mark after it ran.
        async def released() -> bool:
            return await worker_keys(writer, "w1") == {12} and writer.num_buffered_batches == 1

        await eventually(released, 30, "w1's removal to be applied at maxmemory")

        assert await writer.hold_lease("e1", "b/2", 30.0) is LeaseState.TAKEN  # b restarted
        assert server.command("GET", "kvplane:{default:0}:l:e1") == b"b/2"
        await writer.release_lease("e1", "b/2")
        assert not server.command("EXISTS", "kvplane:{default:0}:l:e1")
        with pytest.raises(IndexUnavailableError, match=OUT_OF_MEMORY):
            await writer.hold_lease("e1", "b/2", 30.0)  # nobody holds it: a new key
        with pytest.raises(IndexUnavailableError, match=OUT_OF_MEMORY):
            await writer.ask_resync("e0", "c/1", 30.0, only_if_stream_lost=False)
        assert not server.command("EXISTS", "kvplane:{default:0}:l:e1")
        assert not server.command("EXISTS", "kvplane:{default:0}:r:e0")

        server.command("CONFIG", "SET", "maxmemory", 0)

        async def recovered() -> bool:
            return writer.healthy and writer.unavailable is None

        await eventually(recovered, 30, "the writing process to replay its buffer")
        assert await held(writer, [1, 2, 3, 4, 11, 12]) == [
            (WORKER, (1, 2, 3, 4)),
            ("w1", (12,)),
        ]
        assert await writer.hold_lease("e0", "a/1", 30.0) is LeaseState.KEPT
    finally:
        await writer.close()
        server.stop()


@pytest.mark.parametrize(
    ("policy", "warned"),
    [
        ("allkeys-lru", True),
        ("allkeys-lfu", True),
        ("allkeys-random", True),
        ("noeviction", False),
        ("volatile-lru", False),  # only keys with an expiry: the writer leases
    ],
)
async def test_a_policy_that_evicts_the_index_is_warned_of_at_start(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, policy: str, warned: bool
) -> None:
    caplog.set_level(logging.WARNING, logger="indexer.redis_backend")
    redis_server.flushall()
    redis_server.command("CONFIG", "SET", "maxmemory-policy", policy)
    try:
        backend = await open_redis_backend(redis_server.url, buckets=16)
        await backend.close()
    finally:
        redis_server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    warnings = [r.getMessage() for r in caplog.records if EVICTING in r.getMessage()]
    assert len(warnings) == int(warned)
    if warned:
        assert f"maxmemory-policy {policy}" in warnings[0]
        assert "set maxmemory-policy noeviction" in warnings[0]


async def test_a_redis_that_refuses_config_is_served_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    server = RedisServer(
        tmp_path / "redis",
        extra_args=("--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""),
    )
    server.start()
    backend = await open_redis_backend(server.url, buckets=16)
    try:
        await backend.apply(batch(ActionType.REPORT, (1, 2)))
        assert await held(backend, [1, 2]) == [(WORKER, (1, 2))]
        assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    finally:
        await backend.close()
        server.stop()


def _step(stored: tuple[BlockKey, ...], evicted: tuple[BlockKey, ...], worker: str) -> Batch:
    """One engine step's batch, as vLLM publishes it: the blocks stored, then those evicted."""
    actions = [Action(ActionType.REPORT, Tier.HBM, stored, block_sizes=(16,) * len(stored))]
    if evicted:
        actions.append(Action(ActionType.REVOKE, Tier.HBM, evicted))
    return Batch(worker, tuple(actions), f"addr-{worker}")


async def test_engine_steps_that_store_and_evict_shrink_a_full_redis(tmp_path: Path) -> None:
    """Redis is full; the engines go on serving, each step storing a few blocks and evicting
    more (one batch each, as vLLM's). Every batch stores, so none may apply whole, but each
    one's evictions free memory at once: the index falls back under the cap, the stored
    blocks follow, and the index holds what the memory backend given the same batches does,
    with no operator (before, nothing freed memory and the index stayed refused for good)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    writer = await open_redis_backend(server.url, buckets=256, maintenance_interval_s=0.05)
    expected = MemoryBackend()

    async def apply(b: Batch) -> None:
        await writer.apply(b)
        await expected.apply(b)

    try:
        for worker, base in (("w0", 0), ("w1", 100_000)):  # 10,000 blocks each
            for first in range(base + 1, base + 10_001, 500):
                await apply(_step(tuple(range(first, first + 500)), (), worker))
        used = await writer.used_memory_bytes()
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", used - 100_000)

        # 40 steps per engine: 4 blocks stored, 200 evicted, oldest first.
        for step in range(40):
            for worker, base in (("w0", 0), ("w1", 100_000)):
                stored = tuple(range(base + 50_001 + 4 * step, base + 50_005 + 4 * step))
                evicted = tuple(range(base + 1 + 200 * step, base + 201 + 200 * step))
                await apply(_step(stored, evicted, worker))
        assert not writer.healthy
        assert OUT_OF_MEMORY in await why_unavailable(writer)

        async def recovered() -> bool:
            return writer.healthy and writer.unavailable is None

        await eventually(recovered, 30, "the evictions to free memory and the index recover")
        assert used - await writer.used_memory_bytes() > 100_000
        queries = [[1, 2], [8_001, 8_002], [50_001, 50_002, 50_160], [100_001], [150_157]]
        assert await observe(writer, queries) == await observe(expected, queries)
        assert len(await worker_keys(writer, "w0")) == 2_000 + 160
    finally:
        await writer.close()
        server.stop()


def _random_batch(rng: random.Random, worker: str) -> Batch:
    """A batch of 1 to 4 random actions over 30 blocks and two tiers: chains reported (some
    with token counts, masks, a parent, as new copies), blocks revoked (some one copy), tiers
    cleared; now and then under another address."""
    actions = []
    for _ in range(rng.randint(1, 4)):
        tier = rng.choice((Tier.HBM, Tier.DRAM))
        keys = tuple(rng.sample(range(1, 31), rng.randint(1, 3)))
        roll = rng.random()
        if roll < 0.5:
            masks = tuple(rng.randint(0, 3) for _ in keys) if rng.random() < 0.3 else ()
            sizes = (16,) * len(keys) if rng.random() < 0.5 else ()
            parent = rng.choice((None, rng.randint(1, 30)))
            if parent in keys:  # a REPORT's chain may not loop (validate_batch refuses it)
                parent = None
            copies = rng.random() < 0.3
            actions.append(Action(ActionType.REPORT, tier, keys, masks, sizes, parent, copies))
        elif roll < 0.93:
            actions.append(Action(ActionType.REVOKE, tier, keys, copies=rng.random() < 0.3))
        else:
            actions.append(Action(ActionType.CLEAR_ALL_AT_TIER, tier))
    address = f"addr-{worker}" + ("-moved" if rng.random() < 0.1 else "")
    return Batch(worker, tuple(actions), address)


async def _placements(backend: IndexBackend) -> list[Placement]:
    """Every placement, read the way a process may while Redis is full: from a snapshot."""
    rebuilt = MemoryBackend()
    async for b in backend.snapshot():
        await rebuilt.apply(b)
    return sorted(rebuilt.index.placements(), key=lambda p: (p.worker_id, p.tier, p.key))


def _released_at_maxmemory(before: MemoryBackend, buffered: list[Batch]) -> MemoryBackend:
    """`before` with what a full Redis applies of `buffered`: the removals that may go early,
    each batch's under its worker's address and spec as Redis has them (kvp_release leaves a
    batch that would store others, and its worker's later ones)."""
    index = before.index
    held: set[str] = set()
    for split in early_removals(buffered):
        worker = split.early.worker_id
        as_redis_has_it = index.worker_info(worker)
        if worker in held or as_redis_has_it != (
            split.early.worker_address,
            split.early.cache_spec,
        ):
            held.add(worker)
            continue
        index.apply(split.early)
    return before


@pytest.mark.parametrize("seed", range(8))
async def test_released_removals_leave_the_in_order_index(tmp_path: Path, seed: int) -> None:
    """Random batches of three workers mixing reports and removals, Redis full part-way and
    given memory again later: at the cap Redis holds exactly the removals that may go early
    applied, and once it takes writes again the index is what the memory backend given the
    same batches in order holds, to the last copy, mask, token count, hit count and address.
    (Removals that waited only for their own worker's reports would leave other hit counts
    and token counts than in order on half of these seeds.)"""
    rng = random.Random(seed)
    workers = ("w0", "w1", "w2")
    server = RedisServer(tmp_path / "redis")
    server.start()
    writer = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    expected = MemoryBackend()
    at_cap = MemoryBackend()
    try:
        for _ in range(40):
            b = _random_batch(rng, rng.choice(workers))
            for backend in (writer, expected, at_cap):
                await backend.apply(b)
        for backend in (writer, expected):  # hit counts, kept by blocks that stay
            await backend.match(list(range(1, 31)), True)
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", 1)
        buffered = [_random_batch(rng, rng.choice(workers)) for _ in range(60)]
        for b in buffered:
            await writer.apply(b)
            await expected.apply(b)
        assert not writer.healthy
        released = _released_at_maxmemory(at_cap, buffered)

        async def removals_released() -> bool:
            return await _placements(writer) == await _placements(released)

        await eventually(removals_released, 30, "the removals to be applied at maxmemory")
        assert OUT_OF_MEMORY in await why_unavailable(writer)

        server.command("CONFIG", "SET", "maxmemory", 0)
        for _ in range(10):
            b = _random_batch(rng, rng.choice(workers))
            await writer.apply(b)
            await expected.apply(b)

        async def recovered() -> bool:
            return writer.healthy and writer.unavailable is None

        await eventually(recovered, 30, "the writing process to replay its buffer")
        queries = [list(range(1, 31)), list(range(30, 0, -1)), [5, 6, 7]]
        assert await observe(writer, queries) == await observe(expected, queries)
    finally:
        await writer.close()
        server.stop()


@pytest.mark.parametrize("changed", ["address", "spec"])
async def test_a_removal_released_early_keeps_its_batchs_worker_info_for_the_replay(
    tmp_path: Path, changed: str
) -> None:
    """At maxmemory a worker's REPORT under a new address (or cache spec) is buffered, then a
    removal under the one Redis has: the removal applies at once, and its batch stays
    buffered without it, so that once Redis takes writes again the worker ends under the
    address and spec its last batch gave, as in order, not the buffered REPORT's."""
    old = Batch("w9", (), "10.0.0.1:1", cache_spec=CacheSpec(version=1))
    new = old._replace(worker_address="10.0.0.2:1") if changed == "address" else old
    new = new._replace(cache_spec=CacheSpec(version=2)) if changed == "spec" else new
    server = RedisServer(tmp_path / "redis")
    server.start()
    async with writer_and_reader(server) as (writer, _reader):
        await writer.apply(old._replace(actions=(Action(ActionType.REPORT, Tier.HBM, (1, 2)),)))
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", 1)
        await writer.apply(new._replace(actions=(Action(ActionType.REPORT, Tier.HBM, (3,)),)))
        await writer.apply(old._replace(actions=(Action(ActionType.REVOKE, Tier.HBM, (1,)),)))

        async def released() -> bool:
            return await worker_keys(writer, "w9") == {2}

        await eventually(released, 30, "the removal to be applied at maxmemory")
        server.command("CONFIG", "SET", "maxmemory", 0)

        async def recovered() -> bool:
            return writer.healthy and writer.num_buffered_batches == 0

        await eventually(recovered, 30, "the writing process to replay its buffer")
        (last, *_) = [b async for b in writer.snapshot("w9")]
    assert (last.worker_address, last.cache_spec) == (old.worker_address, old.cache_spec)
    assert {k for a in last.actions for k in a.hashes} == {2, 3}
