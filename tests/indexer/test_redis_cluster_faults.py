"""The `redis+cluster://` backend through a cluster operator's faults, on a private 3-node
Redis Cluster per test (real redis-server processes): a node of another partition down while
this partition's node restarts empty, and the partition's slot moved to another node while
batches keep coming. Each ends with the index answering exactly what the memory backend
answers for the same batches (or, after a data loss, with the lost workers asked to resync).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq.asyncio
from redis.exceptions import TimeoutError as RedisTimeoutError

from indexer.backend import WorkerPlacements
from indexer.batch import Action, ActionType, Batch, Tier
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import IndexUnavailableError, RedisBackend, open_redis_backend
from indexer.redis_client import RedisOptions, connect
from tests.indexer.fake_kv_publisher import FakeKvPublisher
from tests.indexer.test_redis_resync import Run
from tests.polling import eventually
from tests.redis_servers import RedisClusterNodes, SlotMove

WAIT_S = 30.0
ALL_KEYS = list(range(1, 200))


def _meta_key(model: str) -> str:
    return f"kvplane:{{{model}:0}}:m"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """Without full coverage required, as an operator runs a cluster whose partitions must
    not all stop when one primary is down (Redis's default stops every node)."""
    nodes = RedisClusterNodes(tmp_path, extra_args=("--cluster-require-full-coverage", "no"))
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
async def opened() -> AsyncIterator[list[RedisBackend]]:
    backends: list[RedisBackend] = []
    yield backends
    for backend in backends:
        await backend.close()


async def _open(cluster: RedisClusterNodes, model: str, opened: list[RedisBackend]) -> RedisBackend:
    backend = await open_redis_backend(cluster.url, model=model, buckets=16)
    opened.append(backend)
    return backend


def _report(worker: str, *keys: int) -> Batch:
    return Batch(worker, (Action(ActionType.REPORT, Tier.HBM, keys),), "10.0.0.1:8000")


def _revoke(worker: str, *keys: int) -> Batch:
    return Batch(worker, (Action(ActionType.REVOKE, Tier.HBM, keys),), "10.0.0.1:8000")


def _held(matches: list[WorkerPlacements]) -> dict[str, set[int]]:
    return {m.worker_id: {h for t in m.by_tier for h in t.hashes} for m in matches}


async def _answers(backend: RedisBackend) -> dict[str, set[int]] | None:
    """What the index places, by worker (None while it is unavailable)."""
    try:
        return _held(await backend.match(ALL_KEYS, False))
    except IndexUnavailableError:
        return None


async def _resynced(backend: RedisBackend, live: dict[str, tuple[int, ...]]) -> None:
    """Wait for the backend to ask for these workers' resync, then rebuild them as their
    sources do when asked (clear, then what the engine holds; tests/indexer/test_redis_resync.py
    runs real sources)."""
    asked: set[str] = set()

    async def resync_asked() -> bool:
        await _answers(backend)  # a query readies the backend once its check found the loss
        asked.update(backend.take_resync_requests())
        return asked == set(live)

    await eventually(resync_asked, WAIT_S, f"resync requests for {sorted(live)}")
    for worker, keys in live.items():
        clear = Action(ActionType.CLEAR_ALL_AT_TIER, Tier.HBM)
        await backend.apply(Batch(worker, (clear,), "10.0.0.1:8000"))
        await backend.apply(_report(worker, *keys))


@pytest.mark.timeout(60)
async def test_a_call_a_silent_node_lets_time_out_is_sent_once(cluster: RedisClusterNodes) -> None:
    """Over `redis+cluster://` as on a single Redis (tests/indexer/test_redis_backend.py), a
    call the node of its slot lets time out (a stopped node, a host gone without a reset) fails
    after one `timeout_s` and reaches the node once. Before, the cluster client sent it again
    after reading the slot table anew (the node still owning the slot), on another of the
    node's pooled connections: the call waited twice the timeout, and a write ran twice once
    the node answered again."""
    client, _ = connect(cluster.url, RedisOptions(timeout_s=0.3))
    key = "kvplane-test:count"
    try:
        await client.set(key, 0)
        # Concurrent calls leave the node several pooled connections, as a busy one has.
        await asyncio.gather(*(client.get(key) for _ in range(4)))
        node = cluster.node_of(key)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError):
                await client.incr(key)
        finally:
            node.proc.send_signal(signal.SIGCONT)
        assert node.command("GET", key) == b"1"  # (what it was sent ran before this GET)
    finally:
        await client.aclose()


@pytest.mark.timeout(120)
async def test_a_node_restarted_empty_recovers_while_another_partitions_node_is_down(
    cluster: RedisClusterNodes, opened: list[RedisBackend]
) -> None:
    """Readying a partition (after its node came back empty) loaded the functions on every
    primary, so a primary of another model being down kept this model UNAVAILABLE until that
    node came back too."""
    by_node: dict[int, str] = {}  # port -> the first model whose meta key it holds
    for i in range(100):
        by_node.setdefault(cluster.node_of(_meta_key(f"m{i}")).port, f"m{i}")
    mine, other = list(by_node.values())[:2]
    backend = await _open(cluster, mine, opened)
    neighbour = await _open(cluster, other, opened)
    await backend.apply(_report("w0", 1, 2, 3))
    await neighbour.apply(_report("w0", 4, 5))

    cluster.node_of(_meta_key(other)).kill()
    with pytest.raises(IndexUnavailableError, match="did not answer") as info:
        await neighbour.match([4], False)
    assert "\n" not in str(info.value)
    assert _held(await backend.match(ALL_KEYS, False)) == {"w0": {1, 2, 3}}

    node = cluster.node_of(_meta_key(mine))
    node.kill()
    node.start()  # without its data (no persistence)

    async def recovered() -> bool:
        return await _answers(backend) == {}

    await eventually(recovered, WAIT_S, "the restarted partition to answer again")
    await eventually(lambda: backend.healthy, WAIT_S, "the backend to be healthy")
    assert backend.take_resync_requests() == {"w0"}
    await backend.apply(_report("w0", 1, 2, 3))
    assert _held(await backend.match(ALL_KEYS, False)) == {"w0": {1, 2, 3}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("meta_first", [True, False], ids=["meta-key-first", "meta-key-last"])
async def test_partition_slot_moved_to_another_node_during_ingestion(
    cluster: RedisClusterNodes, opened: list[RedisBackend], meta_first: bool
) -> None:
    """A slot moves key by key. Before: with the meta key moved first, calls went to the new
    node (ASK) and wrote bucket keys it did not hold yet (their MIGRATE then failed, BUSYKEY);
    with it moved last, calls on the old node failed on the keys already gone (a script error,
    not an outage: the batches were lost, and the index kept revoked blocks)."""
    backend = await _open(cluster, "m0", opened)
    memory = MemoryBackend()

    async def apply(batch: Batch) -> None:
        await memory.apply(batch)
        await backend.apply(batch)

    for i in range(0, 120, 4):
        await apply(_report(f"w{i % 3}", i + 1, i + 2, i + 3, i + 4))

    meta = _meta_key("m0")
    target = next(n for n in cluster.nodes if n is not cluster.node_of(meta))
    move = SlotMove(cluster, meta, target)
    move.begin()
    keys = move.keys_left()
    assert meta.encode() in keys and len(keys) > 10
    move.migrate([meta.encode()] if meta_first else [k for k in keys if k != meta.encode()])

    # Half moved: queries fail clearly, batches are taken (buffered until the move is done).
    with pytest.raises(IndexUnavailableError, match="being moved to another node") as info:
        await backend.match(ALL_KEYS, False)
    assert "\n" not in str(info.value)
    await apply(_revoke("w0", 1, 2, 3, 4, 13))
    await apply(_report("w1", 150, 151))
    await apply(_revoke("w2", 9, 10))
    assert not backend.healthy

    move.finish()
    expected = _held(await memory.match(ALL_KEYS, False))

    async def exact() -> bool:
        return backend.healthy and await _answers(backend) == expected

    await eventually(exact, WAIT_S, "the index to answer as the memory backend after the move")
    assert backend.take_resync_requests() == frozenset()
    await apply(_revoke("w1", 150))
    assert _held(await backend.match(ALL_KEYS, False)) == _held(await memory.match(ALL_KEYS, False))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replica_behind", [False, True], ids=["in-sync", "replica-behind"])
async def test_primary_killed_and_its_replica_promoted(
    replicated_cluster: RedisClusterNodes, opened: list[RedisBackend], replica_behind: bool
) -> None:
    """The client follows the new primary, which has the functions (replicated). Replication
    is asynchronous: a replica promoted before the last writes reached it kept the boot
    token, so before, its older data (revoked blocks back, reported ones missing) was served
    as the index and nothing was resynced."""
    backend = await _open(replicated_cluster, "m0", opened)
    memory = MemoryBackend()
    for batch in (_report("w0", 1, 2, 3, 4), _report("w1", 5, 6)):
        await memory.apply(batch)
        await backend.apply(batch)
    primary = replicated_cluster.node_of(_meta_key("m0"))
    replica = replicated_cluster.replica_of(primary)
    assert primary.command("WAIT", 1, 10_000) == 1

    if replica_behind:
        assert replica.proc is not None
        # The writes below are acknowledged and never replicated: the replica is stopped and
        # its link cut (so they are not even waiting in its socket).
        replica.proc.send_signal(signal.SIGSTOP)
        primary.client().client_kill_filter(_type="replica")
    try:
        await memory.apply(_revoke("w0", 1, 2))
        await backend.apply(_revoke("w0", 1, 2))
        await memory.apply(_report("w0", 7))
        await backend.apply(_report("w0", 7))
    finally:
        if replica_behind:
            primary.kill()
            assert replica.proc is not None  # stopped above, not ended
            replica.proc.send_signal(signal.SIGCONT)
    replicated_cluster.fail_over(primary, replica)
    assert replica.command("FUNCTION", "LIST")

    if replica_behind:
        await _resynced(backend, {"w0": (3, 4, 7), "w1": (5, 6)})
    expected = _held(await memory.match(ALL_KEYS, False))

    async def exact() -> bool:
        return await _answers(backend) == expected and backend.healthy

    await eventually(exact, WAIT_S, "the index on the new primary to answer as the memory backend")
    assert backend.take_resync_requests() == frozenset()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("snapshot_behind", [False, True], ids=["all-its-data", "older-snapshot"])
async def test_partition_node_restarted_with_its_data(
    cluster: RedisClusterNodes, opened: list[RedisBackend], snapshot_behind: bool
) -> None:
    """A node restarted from its RDB file: saved at shutdown, it has every write (nothing to
    resync); saved before the last writes (a periodic snapshot, or an AOF without its last
    second), it has the boot token but older data, which before was served as the index."""
    backend = await _open(cluster, "m0", opened)
    memory = MemoryBackend()

    async def apply(batch: Batch) -> None:
        await memory.apply(batch)
        await backend.apply(batch)

    await apply(_report("w0", 1, 2, 3, 4))
    await apply(_report("w1", 5, 6))
    node = cluster.node_of(_meta_key("m0"))
    if snapshot_behind:
        node.client().save()
    await apply(_revoke("w0", 1, 2))
    await apply(_report("w0", 7))
    if snapshot_behind:
        node.kill()
    else:
        node.client().shutdown(save=True)
        node.stop()
    with pytest.raises(IndexUnavailableError, match="did not answer") as info:
        await backend.match([1], False)
    assert "\n" not in str(info.value)
    node.start()
    cluster.wait_ok()

    if snapshot_behind:
        await _resynced(backend, {"w0": (3, 4, 7), "w1": (5, 6)})
    expected = _held(await memory.match(ALL_KEYS, False))

    async def exact() -> bool:
        return await _answers(backend) == expected and backend.healthy

    await eventually(exact, WAIT_S, "the index to answer as the memory backend")
    assert backend.take_resync_requests() == frozenset()


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.mark.timeout(120)
async def test_indexer_serve_rebuilds_from_the_replay_after_a_failover_lost_writes(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    """End to end: `kvplane indexer serve` follows a real ZMQ publisher (the vLLM capture,
    with replay) into a replicated cluster; the partition's primary dies with the last
    batches acknowledged but never replicated. The indexer, never restarted, finds the loss
    and its source rebuilds the worker from the replay: the index holds exactly the
    publisher's live blocks again, and after more ingestion."""
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    run = Run(tmp_path, publisher, max_buffered=10_000)
    cluster = RedisClusterNodes(tmp_path / "cluster", replicas=1)
    run.redis = cluster  # type: ignore[assignment]  # start, url and stop, as Run uses them
    try:
        async with run.serving() as stub:
            primary = cluster.node_of(_meta_key("default"))
            replica = cluster.replica_of(primary)
            assert primary.command("WAIT", 1, 10_000) == 1
            assert replica.proc is not None
            replica.proc.send_signal(signal.SIGSTOP)
            try:
                primary.client().client_kill_filter(_type="replica")
                await run.publish_through(34)
                await run.expect(stub, 34, "batches the replica never got")
            finally:
                primary.kill()
                replica.proc.send_signal(signal.SIGCONT)
            cluster.fail_over(primary, replica)
            await run.expect(stub, 34, "the resync after the failover")
            await run.publish_through(55)
            await run.expect(stub, 55, "live ingestion after the resync")
        assert "lost some acknowledged writes" in run.log
        assert "worker w0: the index asked for a resync" in run.log
    finally:
        run.stop()
        await publisher.close()
