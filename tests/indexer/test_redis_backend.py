"""The Redis backend beyond the shared conformance suite (which runs it on one node and on a
3-node cluster): answers identical to the memory backend on random histories, failure
behaviour with a redis-server killed and restarted, and several processes sharing one index."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from indexer.backend import IndexBackend
from indexer.batch import Action, ActionType, Batch, CacheSpec, Tier
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import (
    ABI_SUFFIX,
    IndexBackendError,
    IndexUnavailableError,
    LeaseLostError,
    LeaseState,
    RedisBackend,
    open_redis_backend,
)
from indexer.validation import IndexRequestError
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.errors import ConfigError
from tests.indexer.backend_views import observe
from tests.polling import eventually
from tests.redis_servers import RedisClusterNodes, RedisServer
from tests.tcp_forwarder import TcpForwarder

WORKERS = ("w0", "w1", "w2")
SPECS = (
    None,
    CacheSpec(1, 1, 0, 0b110, 0, 0),
    CacheSpec(0, 3, 32, 0b110, 0b010, 0),
    CacheSpec(1, 5, 0, 0b110, 0, 0b100),
    CacheSpec(0, 7, 16, 0b010, 0b110, 0b100),
    CacheSpec(2, 1, 0, 0b110, 0, 0),
    # Components resident on SSD too: the router's disk view (`any_tier_blocks`) counts them.
    CacheSpec(1, 3, 16, 0b1110, 0b1010, 0),
    # Present but empty (no components: fails closed); unknown component and tier bits, and
    # uint32's extremes, which the seed's fields may carry.
    CacheSpec(),
    CacheSpec(1, 9 | 0x8000_0000, 0, 0xFFFF_FFFF, 0, 0),
    CacheSpec(0, 0xFFFF_FFFF, 0xFFFF_FFFF, 0b110, 0xFFFF_FFFF, 0b10),
)
MAX_U32 = 0xFFFF_FFFF
keys = st.integers(-3, 5).map(lambda k: k * 0x0101_0101_0101_0101)
tiers = st.sampled_from(list(Tier))


@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(ActionType)))
    tier = draw(tiers)
    if kind == ActionType.CLEAR_ALL_AT_TIER:
        return Action(kind, tier)
    hashes = tuple(draw(st.lists(keys, min_size=1, max_size=5)))
    copies = draw(st.booleans())
    if kind == ActionType.REVOKE:
        return Action(kind, tier, hashes, copies=copies)
    n = len(hashes)  # a hash may repeat down the chain: taken (validate_batch)
    # Any component set, FULL-less ones and bits no component has included: stored as sent.
    masks = draw(
        st.one_of(
            st.just(()), st.lists(st.integers(0, 15) | st.just(MAX_U32), min_size=n, max_size=n)
        )
    )
    sizes = draw(
        st.one_of(
            st.just(()), st.lists(st.sampled_from([0, 16, 32, 50, MAX_U32]), min_size=n, max_size=n)
        )
    )
    parent = draw(st.one_of(st.none(), keys))
    if parent == hashes[0]:
        parent = None  # refused: one of BAD_ACTIONS
    return Action(kind, tier, hashes, tuple(masks), tuple(sizes), parent, copies)


# Actions each backend must refuse, with the whole batch around them (validate_batch).
BAD_ACTIONS = (
    Action(ActionType.REPORT, Tier.HBM, ()),
    Action(ActionType.REVOKE, Tier.DRAM, ()),
    Action(ActionType.REPORT, Tier.HBM, (1, 2), component_masks=(1,)),
    Action(ActionType.REPORT, Tier.HBM, (1, 2), block_sizes=(16, 16, 16)),
    Action(ActionType.REPORT, Tier.HBM, (3, 4), parent=3),
    Action(cast(ActionType, 0), Tier.HBM, (1,)),  # ACTION_UNKNOWN
    Action(ActionType.CLEAR_ALL_AT_TIER, cast(Tier, 0)),  # TIER_UNKNOWN
)
BAD = frozenset(BAD_ACTIONS)


@st.composite
def operations(draw: st.DrawFn) -> tuple[object, ...]:
    what = draw(st.sampled_from(["apply", "apply", "apply", "apply", "remove", "hit", "sweep"]))
    worker = draw(st.sampled_from(WORKERS))
    if what == "remove":
        # Renamed: the worker's later batches come under a new name (a replaced pod), which
        # takes a freed id; otherwise it returns under its old name.
        return ("remove", worker, draw(st.booleans()))
    if what == "sweep":
        return ("sweep",)
    if what == "hit":
        return ("hit", tuple(draw(st.lists(keys, min_size=1, max_size=6))))
    batch = Batch(
        worker,
        tuple(draw(st.lists(actions(), max_size=4))),
        draw(st.sampled_from(["", f"addr-{worker}"])),
        cache_spec=draw(st.sampled_from(SPECS)),
    )
    if draw(st.integers(0, 5)) == 0:
        # One bad action anywhere in it: the whole batch is refused (address and spec too).
        at = draw(st.integers(0, len(batch.actions)))
        bad = draw(st.sampled_from(BAD_ACTIONS))
        batch = batch._replace(actions=(*batch.actions[:at], bad, *batch.actions[at:]))
    return ("apply", batch)


@pytest.mark.timeout(300)
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(operations(), max_size=16),
    queries=st.lists(st.lists(keys, min_size=1, max_size=6), min_size=1, max_size=3),
)
def test_redis_answers_like_memory(
    redis_server: RedisServer, ops: list[tuple[object, ...]], queries: list[list[int]]
) -> None:
    refused: dict[str, list[str]] = {"memory": [], "redis": []}  # each backend's refusals

    async def run() -> tuple[list[object], list[object]]:
        redis_server.flushall()
        memory = MemoryBackend()
        shared = await open_redis_backend(redis_server.url, buckets=8)
        names = {worker: worker for worker in WORKERS}  # the name each worker goes by now
        try:
            for n, op in enumerate(ops):
                for backend in (memory, shared):
                    if op[0] == "apply":
                        assert isinstance(op[1], Batch)
                        batch = op[1]._replace(worker_id=names[op[1].worker_id])
                        try:
                            await backend.apply(batch)
                        except IndexRequestError as exc:
                            refused[backend.name].append(f"{exc.kind.name}: {exc}")
                    elif op[0] == "sweep":
                        if isinstance(backend, RedisBackend):
                            await backend.sweep()
                    elif op[0] == "remove":
                        assert isinstance(op[1], str)
                        await backend.remove_worker(names[op[1]])
                    else:
                        assert isinstance(op[1], tuple)
                        await backend.match(op[1], True)
                if op[0] == "remove" and op[2]:
                    assert isinstance(op[1], str)
                    names[op[1]] = f"{op[1]}-{n}"
            return await observe(memory, queries), await observe(shared, queries)
        finally:
            await shared.close()

    expected, actual = asyncio.run(run())
    assert actual == expected
    assert refused["redis"] == refused["memory"]
    batches = [op[-1] for op in ops if op[0] == "apply"]
    bad_batches = [b for b in batches if isinstance(b, Batch) and set(b.actions) & BAD]
    assert len(refused["memory"]) == len(bad_batches)  # those refused, and only those


# ---------------------------------------------------------------- failures


def _history(n: int) -> list[Batch]:
    """A deterministic ingestion history: chains reported, revoked, cleared; w0 busier."""
    rng = random.Random(7)
    batches = []
    for _ in range(n):
        worker = "w0" if rng.random() < 0.8 else "w1"
        start = rng.randrange(40)
        chain = tuple(range(start, start + rng.randrange(1, 6)))
        roll = rng.random()
        if roll < 0.65:
            action = Action(ActionType.REPORT, Tier.HBM, chain, block_sizes=(16,) * len(chain))
        elif roll < 0.95:
            action = Action(ActionType.REVOKE, Tier.HBM, chain)
        else:
            action = Action(ActionType.CLEAR_ALL_AT_TIER, Tier.HBM)
        batches.append(Batch(worker, (action,), f"addr-{worker}"))
    return batches


async def _resync(backend: RedisBackend, truth: MemoryBackend) -> None:
    """What a source does when asked: clear the worker, then send its snapshot."""
    for worker_id in sorted(backend.take_resync_requests()):
        await backend.remove_worker(worker_id)
        async for batch in truth.snapshot(worker_id):
            await backend.apply(batch)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outage", ["killed", "restarted with its data"])
async def test_redis_outage_during_ingestion(tmp_path: Path, outage: str) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    backend = await open_redis_backend(
        server.url, buckets=16, max_buffered_batches=40, maintenance_interval_s=0.05
    )
    truth = MemoryBackend()
    errors: list[str] = []
    asked: set[str] = set()
    asked_while_down: list[str] = []

    def on_resync(worker_id: str) -> None:
        asked.add(worker_id)
        if not backend.healthy:  # a resync then would only be buffered again
            asked_while_down.append(worker_id)

    backend.add_resync_listener(on_resync)

    async def settled() -> bool:
        await _resync(backend, truth)
        return backend.healthy

    history = _history(300)
    try:
        for i, batch in enumerate(history):
            if i == 100:
                if outage == "killed":
                    server.kill()
                else:
                    server.client().shutdown(save=True)
                    server.stop()
                with pytest.raises(IndexUnavailableError) as info:
                    await backend.match_prefix([1, 2], 0)
                errors.append(str(info.value))
            if i == 200:
                server.start()
                await eventually(settled, 30, "the backend to recover")
            await truth.apply(batch)
            try:
                await backend.apply(batch)
            except IndexUnavailableError as exc:
                errors.append(str(exc))
            await _resync(backend, truth)
        await eventually(settled, 30, "the backend to settle")
        assert f"Redis at 127.0.0.1:{server.port}" in errors[0]
        assert any("will be resynced" in e for e in errors), errors  # the buffer overflowed
        # w0 overflowed the buffer; w1's batches waited in it, unless Redis lost them too.
        assert asked == ({"w0", "w1"} if outage == "killed" else {"w0"})
        assert asked_while_down == []
        for hashes in ([k] for k in range(48)):
            assert await backend.match(hashes, False) == await truth.match(hashes, False)
        expected = dataclasses.replace(await truth.stats(), backend="redis")
        assert await backend.stats() == expected
    finally:
        await backend.close()
        server.stop()


# ---------------------------------------------------------------- processes

KVPLANE = str(Path(sys.executable).parent / "kvplane")


class Indexer:
    """A `kvplane indexer serve` child process on port 0 (the port comes from --port-file)."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def spawn(self) -> None:
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (self.workdir / "serve.log").open("ab") as log:
            self.process = subprocess.Popen(
                [KVPLANE, "indexer", "serve", "--config", str(self.config), "--listen",
                 "127.0.0.1:0", "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip

    async def start(self) -> None:
        self.spawn()
        port_file = self.workdir / "port"
        process = self.process
        assert process is not None

        async def up() -> bool:
            assert process.poll() is None, (self.workdir / "serve.log").read_text()
            return port_file.exists()

        await eventually(up, 30, "the indexer's port file")
        self.port = int(port_file.read_text())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(20)
        self.process = None

    def stub(self, channel: grpc.aio.Channel) -> kv_grpc.KVIndexerAsyncStub:
        return kv_grpc.KVIndexerStub(channel)


def _report(worker: str, hashes: list[int]) -> kv.ApplyExternalKvBatchRequest:
    action = kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=hashes)
    return kv.ApplyExternalKvBatchRequest(
        worker_id=worker, worker_address=f"addr-{worker}", actions=[action]
    )


async def _prefix(stub: kv_grpc.KVIndexerAsyncStub, hashes: list[int]) -> list[tuple[str, int]]:
    reply = await stub.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=hashes))
    return [(m.worker_id, m.matched_prefix_blocks) for m in reply.matches]


@pytest.mark.timeout(120)
async def test_indexer_processes_share_one_redis(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    config = tmp_path / "indexer.yaml"
    config.write_text(f"backend: {server.url}\nredis:\n  buckets: 64\n  model: m1\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = Indexer(config, tmp_path / "a"), Indexer(config, tmp_path / "b")
    try:
        await a.start()
        await b.start()
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as channel_a,
            grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as channel_b,
        ):
            await a.stub(channel_a).ApplyExternalKvBatch(_report("w0", [11, 12, 13]))
            assert await _prefix(b.stub(channel_b), [11, 12, 13, 14]) == [("w0", 3)]

        # A restarted indexer process loses nothing that Redis holds.
        a.stop()
        await a.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as channel_a:
            assert await _prefix(a.stub(channel_a), [11, 12]) == [("w0", 2)]

        # Redis down: a clear UNAVAILABLE, no crash; Redis back: both recover by themselves.
        server.kill()
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as channel_a,
            grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as channel_b,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _prefix(b.stub(channel_b), [11])
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"Redis at 127.0.0.1:{server.port}" in str(info.value.details())
            server.start()

            async def answers() -> bool:
                try:
                    await a.stub(channel_a).ApplyExternalKvBatch(_report("w1", [21, 22]))
                    return await _prefix(b.stub(channel_b), [21, 22]) == [("w1", 2)]
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    return False

            await eventually(answers, 30, "both indexers to answer again")
            assert a.process is not None and b.process is not None
            assert a.process.poll() is None and b.process.poll() is None
    finally:
        a.stop()
        b.stop()
        server.stop()


@pytest.mark.timeout(60)
async def test_an_indexer_started_while_redis_is_down_serves_and_recovers(tmp_path: Path) -> None:
    """Down is not misconfigured (those stop `serve`: test_indexer_cli.py): the indexer
    serves, answers UNAVAILABLE, and takes batches once Redis is up."""
    server = RedisServer(tmp_path / "redis")  # not started: nothing listens on its port yet
    config = tmp_path / "indexer.yaml"
    config.write_text(f"backend: {server.url}\nredis:\n  buckets: 64\n")
    indexer = Indexer(config, tmp_path)
    try:
        await indexer.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{indexer.port}") as channel:
            stub = indexer.stub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _prefix(stub, [11])
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            server.start()

            async def answers() -> bool:
                try:
                    await stub.ApplyExternalKvBatch(_report("w0", [11, 12]))
                    return await _prefix(stub, [11, 12]) == [("w0", 2)]
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    return False

            await eventually(answers, 30, "the indexer to take batches")
    finally:
        indexer.stop()
        server.stop()


@pytest.mark.timeout(60)
async def test_password_file(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", extra_args=("--requirepass", "s3cret"))
    server.start()
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    good = await open_redis_backend(server.url, buckets=16, password_file=secret)
    try:
        await good.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (1, 2)),), "a0"))
        assert (await good.match_prefix([1, 2], 0)).best_prefix_blocks == 2
        # No password where Redis asks for one: no retry cures it, so the backend does not
        # open (an indexer stops at start-up with this one line).
        with pytest.raises(ConfigError, match=r"Redis at 127\.0\.0\.1.* refused the credentials"):
            await open_redis_backend(server.url, buckets=16)
    finally:
        await good.close()
        server.stop()


@pytest.mark.timeout(90)
async def test_a_cluster_urls_credentials_are_sent_and_never_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`redis+cluster://:PASSWORD@HOST:PORT,...` (credentials in the URL, as redis-py takes a
    redis:// URL's): they were read as part of the first node's host, so never sent (the
    cluster refused the backend), and named, password and all, in every connection error the
    indexer logs."""
    cluster = RedisClusterNodes(tmp_path / "cluster", extra_args=("--requirepass", "hunter2"))
    cluster.start()
    url = cluster.url.replace("redis+cluster://", "redis+cluster://:hunter2@")
    try:
        backend = await open_redis_backend(url, buckets=16)
        try:
            await backend.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (1, 2)),), "a0"))
            assert (await backend.match_prefix([1, 2], 0)).best_prefix_blocks == 2
        finally:
            await backend.close()
    finally:
        cluster.stop()
    caplog.clear()  # the cluster gone, the backend opens waiting for it, with a warning
    unanswered = await open_redis_backend(url, buckets=16)
    await unanswered.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and not [w for w in warnings if "hunter2" in w], warnings


@pytest.mark.timeout(60)
async def test_cleared_and_removed_placements_are_swept(redis_server: RedisServer) -> None:
    """CLEAR and worker removal are O(1) epoch bumps; the sweeper (run in the background by
    the maintenance task, here called directly) then deletes the dead records in bounded
    chunks until no block key is left."""
    redis_server.flushall()
    backend = await open_redis_backend(
        redis_server.url, buckets=64, sweep_chunk_buckets=4, maintenance_interval_s=3600
    )
    client = redis_server.client()

    def block_fields() -> int:
        return sum(int(client.hlen(k)) for k in client.scan_iter(match="*:b:*"))

    async def swept() -> bool:
        return block_fields() == 0 and not list(client.scan_iter(match="*:h:*"))

    try:
        keys = list(range(1, 301))
        await backend.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, tuple(keys)),), "a"))
        await backend.apply(Batch("w1", (Action(ActionType.REPORT, Tier.DRAM, (7, 8)),), "b"))
        await backend.match(keys, True)  # hit counters for every block
        await backend.apply(Batch("w1", (Action(ActionType.CLEAR_ALL_AT_TIER, Tier.DRAM),), "b"))
        assert await backend.remove_worker("w0") == 300
        assert block_fields() == 300  # nothing deleted yet: dead records wait for the sweeper
        assert (await backend.stats()).num_blocks == 0
        await backend.sweep()
        assert await swept()
    finally:
        await backend.close()


async def test_a_closed_process_leaves_no_write_mark_behind(redis_server: RedisServer) -> None:
    """Each process writing to a partition keeps a mark of its latest write in the meta hash
    (check_boot), and the outcome of its latest call that refused a batch (record_outcome):
    closed, it deletes its own, so processes started and stopped one after another (restarts,
    rolling upgrades) do not grow the hash by a field or two each; a process still running
    keeps its mark."""
    redis_server.flushall()
    client = redis_server.client()

    def marks() -> list[bytes]:
        fields = [f for k in client.scan_iter(match="*:m") for f in client.hkeys(k)]
        assert all(isinstance(f, bytes) for f in fields)  # the client does not decode
        return [f for f in fields if isinstance(f, bytes) and f[:3] in (b"lw:", b"lo:")]

    running = await open_redis_backend(redis_server.url, buckets=8)
    try:
        await running.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (1,)),), "a"))
        for n in range(3):
            backend = await open_redis_backend(redis_server.url, buckets=8)
            backend.fence_writes("nobody's lease", str)
            await backend.apply(Batch("w1", (Action(ActionType.REPORT, Tier.HBM, (n + 2,)),), "b"))
            assert len(marks()) == 2
            with pytest.raises(LeaseLostError):  # refused: its outcome is kept too
                await backend.apply(_leased_batch("w1", n + 2))
            assert len(marks()) == 3
            await backend.close()
            assert len(marks()) == 1
        await running.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (9,)),), "a"))
        assert len(marks()) == 1
    finally:
        await running.close()
    assert marks() == []


@pytest.mark.timeout(60)
async def test_concurrent_applies_keep_their_order(redis_server: RedisServer) -> None:
    """Batches applied concurrently share calls (group commit) yet apply in submission order."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16)
    memory = MemoryBackend()
    history = _history(400)
    try:
        await asyncio.gather(*(backend.apply(batch) for batch in history))
        for batch in history:
            await memory.apply(batch)
        for key in range(48):
            assert await backend.match([key], False) == await memory.match([key], False)
        assert await backend.stats() == dataclasses.replace(await memory.stats(), backend="redis")
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_writes_fenced_by_a_writer_lease_land_only_from_its_holder(
    redis_server: RedisServer,
) -> None:
    """Two replicas' backends fenced by writer leases (`fence_writes`) and an indexer's,
    unfenced: only the lease's holder writes the worker under the lease (its sources' batches,
    in one group with other workers' batches, and removals); the other's are refused and
    change nothing; once the holder gives the lease up and the other takes it, the roles swap
    (the former holder's late release leaves the new holder's lease alone);
    unconditional applies (seed 004's KVIndexer, from either kind of process) land whoever
    holds it."""
    redis_server.flushall()
    first, second, indexer = [await open_redis_backend(redis_server.url) for _ in range(3)]
    first.fence_writes("first", str)
    second.fence_writes("second", str)
    try:
        assert await first.hold_lease("w", "first", 30) is LeaseState.TAKEN
        assert await first.hold_lease("w", "first", 30) is LeaseState.KEPT
        assert await second.hold_lease("w", "second", 30) is LeaseState.HELD_ELSEWHERE
        await first.apply(_leased_batch("w", 1))
        assert await first.hold_lease("v", "first", 30) is LeaseState.TAKEN
        results = await asyncio.gather(
            second.apply(_leased_batch("w", 2)),
            second.apply(_leased_batch("v", 3)),  # shares the call: refused alone
            return_exceptions=True,
        )
        assert all(isinstance(r, LeaseLostError) for r in results), results
        assert await second.remove_worker("w") == 0
        assert [await _holders(indexer, k) for k in (1, 2, 3)] == [["w"], [], []]
        await indexer.apply(_stored_batch("w", 4))  # unconditional
        await second.apply(_stored_batch("w", 7))  # unconditional too, though fenced

        await first.release_lease("w", "first")
        assert await second.hold_lease("w", "second", 30) is LeaseState.TAKEN
        await first.release_lease("w", "first")  # late (it stops): not its lease any more
        assert await second.hold_lease("w", "second", 30) is LeaseState.KEPT
        with pytest.raises(LeaseLostError):
            await first.apply(_leased_batch("w", 5))
        assert await first.remove_worker("w") == 0
        await second.apply(_leased_batch("w", 6))
        assert [await _holders(indexer, k) for k in (1, 4, 5, 6, 7)] == [
            ["w"],
            ["w"],
            [],
            ["w"],
            ["w"],
        ]
        assert await second.remove_worker("w") == 4
    finally:
        for backend in (first, second, indexer):
            await backend.close()


@pytest.mark.timeout(60)
async def test_a_renewal_keeps_the_lease_a_whole_term_more(redis_server: RedisServer) -> None:
    """Each renewal of its holder pushes the lease's expiry a term further (a holder that
    keeps renewing is never found without it, nor its lease taken by another replica)."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url)
    try:
        assert await backend.hold_lease("w", "a/1", 1) is LeaseState.TAKEN
        assert await backend.hold_lease("w", "a/1", 600) is LeaseState.KEPT
        keys = [k for k in redis_server.command("KEYS", "*") if k.endswith(b":l:w")]
        assert len(keys) == 1, keys
        assert int(redis_server.command("PTTL", keys[0])) > 1000
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_resync_asked_of_a_replica_without_the_lease_reaches_its_holder(
    redis_server: RedisServer,
) -> None:
    """`ask_resync` (ResyncEngine on an indexer replica): with the lease held elsewhere it is
    recorded for the holder, whose next renewal says so once ("all" is not lowered to "only
    if the stream is lost" by a later ask); the asker holding it, or nobody, it is the
    asker's to do (the lease taken if free); a take-over forgets a pending one (the taker
    rebuilds anyway)."""
    redis_server.flushall()
    first, second = [await open_redis_backend(redis_server.url) for _ in range(2)]
    try:
        assert await second.ask_resync("w", "b/2", 30, only_if_stream_lost=False) == (
            LeaseState.TAKEN,
            "",
        )
        await second.release_lease("w", "b/2")
        assert await first.hold_lease("w", "a/1", 30) is LeaseState.TAKEN
        assert await first.ask_resync("w", "a/1", 30, only_if_stream_lost=False) == (
            LeaseState.KEPT,
            "",
        )
        assert await first.hold_lease("w", "a/1", 30) is LeaseState.KEPT

        assert await second.ask_resync("w", "b/2", 30, only_if_stream_lost=True) == (
            LeaseState.HELD_ELSEWHERE,
            "a/1",
        )
        assert await first.hold_lease("w", "a/1", 30) is LeaseState.KEPT_RESYNC_IF_STREAM_LOST
        assert await first.hold_lease("w", "a/1", 30) is LeaseState.KEPT

        await second.ask_resync("w", "b/2", 30, only_if_stream_lost=False)
        await second.ask_resync("w", "b/2", 30, only_if_stream_lost=True)
        assert await second.hold_lease("w", "b/2", 30) is LeaseState.HELD_ELSEWHERE
        assert await first.hold_lease("w", "a/1", 30) is LeaseState.KEPT_RESYNC_ASKED
        assert await first.hold_lease("w", "a/1", 30) is LeaseState.KEPT

        await second.ask_resync("w", "b/2", 30, only_if_stream_lost=False)
        assert await first.hold_lease("w", "a/3", 30) is LeaseState.TAKEN  # a/ restarted
        assert await first.hold_lease("w", "a/3", 30) is LeaseState.KEPT
    finally:
        for backend in (first, second):
            await backend.close()


# A batch that passes validation yet cannot be sent to Redis (a hash that is not an int: the
# wire cannot carry one, an in-process caller can): it must fail alone, never the batches
# sharing its call, the group-commit task or the recovery after an outage.
UNSENDABLE = Batch("bad", (Action(ActionType.REPORT, Tier.HBM, (7.5,)),))  # type: ignore[arg-type]


def _stored_batch(worker: str, key: int) -> Batch:
    return Batch(worker, (Action(ActionType.REPORT, Tier.HBM, (key,)),), f"addr-{worker}")


def _leased_batch(worker: str, key: int) -> Batch:
    """A source's batch, written under its engine's writer lease (`LeasedSink`)."""
    return _stored_batch(worker, key)._replace(under_lease=True)


async def _holders(backend: IndexBackend, key: int) -> list[str]:
    return [w.worker_id for w in await backend.match([key], False)]


@pytest.mark.timeout(60)
async def test_a_batch_redis_cannot_take_fails_alone(redis_server: RedisServer) -> None:
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16)
    try:
        results = await asyncio.gather(
            backend.apply(_stored_batch("w0", 1)),
            backend.apply(UNSENDABLE),
            backend.apply(_stored_batch("w1", 2)),
            return_exceptions=True,
        )
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], IndexBackendError)
        assert backend.healthy
        await backend.apply(_stored_batch("w2", 3))  # later writes land
        assert [await _holders(backend, k) for k in (1, 2, 3, 7)] == [["w0"], ["w1"], ["w2"], []]
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_buffered_batch_redis_cannot_take_does_not_stall_the_recovery(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    backend = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    asked: list[str] = []
    backend.add_resync_listener(asked.append)
    try:
        await backend.apply(_stored_batch("w0", 1))
        server.client().shutdown(save=True)  # comes back with its data: the buffer is replayed
        server.stop()
        await backend.apply(_stored_batch("w0", 2))  # Redis down: buffered
        await backend.apply(UNSENDABLE)
        await backend.apply(_stored_batch("w1", 3))
        assert backend.num_buffered_batches == 3
        server.start()

        async def recovered() -> bool:
            return backend.healthy

        await eventually(recovered, 30, "the backend to recover")
        await backend.apply(_stored_batch("w2", 4))
        holders = [await _holders(backend, k) for k in (1, 2, 3, 4, 7)]
        assert holders == [["w0"], ["w0"], ["w1"], ["w2"], []]
        assert asked == [UNSENDABLE.worker_id]  # its source must rebuild what was refused
    finally:
        await backend.close()
        server.stop()


@pytest.mark.timeout(60)
async def test_queries_wait_for_the_batches_buffered_in_an_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis is back but the buffer is not replayed yet: a query then would miss placements
    whose applies were acknowledged, so it is UNAVAILABLE until the replay is done."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    backend = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    replaying = asyncio.Event()
    release = asyncio.Event()
    replay_head = backend._replay_head

    async def held_replay(head: list[Batch]) -> list[str | None]:
        replaying.set()
        await release.wait()
        return await replay_head(head)

    monkeypatch.setattr(backend, "_replay_head", held_replay)
    try:
        await backend.apply(_stored_batch("w0", 1))
        server.client().shutdown(save=True)  # comes back with its data
        server.stop()
        await backend.apply(_stored_batch("w0", 2))  # acknowledged, buffered
        server.start()
        async with asyncio.timeout(30):
            await replaying.wait()  # Redis answers; the buffered batch is not applied yet
        for query in (
            backend.match([2], False),
            backend.match_prefix([1, 2], 0),
            backend.match_prefix_by_tier([1, 2], 0),
            backend.hit_counts([2]),
        ):
            with pytest.raises(IndexUnavailableError, match="1 buffered batches not applied"):
                await query
        release.set()

        async def recovered() -> bool:
            return backend.healthy

        await eventually(recovered, 30, "the backend to recover")
        assert [await _holders(backend, k) for k in (1, 2)] == [["w0"], ["w0"]]
    finally:
        release.set()
        await backend.close()
        server.stop()


@pytest.mark.timeout(60)
async def test_a_query_while_redis_is_down_says_it_is_down(tmp_path: Path) -> None:
    """While the recovery cannot reach Redis, a query's error says Redis did not answer (and
    what waits for it), not that it is recovering: an operator looks at Redis, not at us."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    backend = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    errors: list[str] = []

    async def says_down() -> bool:
        try:
            await backend.match_prefix([1], 0)
        except IndexUnavailableError as exc:
            errors.append(str(exc))
        return bool(errors) and "did not answer" in errors[-1]

    try:
        await backend.apply(_stored_batch("w0", 1))
        server.kill()
        await backend.apply(_stored_batch("w0", 2))  # acknowledged, buffered
        await eventually(says_down, 30, "a query to say Redis is down")
        assert errors[-1].startswith(
            f"shared index unavailable: Redis at 127.0.0.1:{server.port} did not answer ("
        )
        assert errors[-1].endswith("; 1 buffered batches not applied yet")
    finally:
        await backend.close()
        server.stop()


async def test_a_redis_that_stops_answering_is_not_waited_for_by_every_query(
    tmp_path: Path,
) -> None:
    """A Redis that stops answering without closing its connections (SIGSTOP, as a wedged
    process or a host gone without a reset): once a call found it silent, queries fail at
    once, saying so, instead of each waiting its own timeout one after another behind the
    readying lock (a controller's every request paid seconds, more the more requests there
    were); at most one asks it again per pause; once it answers, so do the queries."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    assert server.proc is not None
    backend = await open_redis_backend(
        server.url, buckets=16, timeout_s=0.2, maintenance_interval_s=0.05
    )
    try:
        await backend.apply(_stored_batch("w0", 1))
        server.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(IndexUnavailableError):
            await backend.match_prefix([1], 0)  # this one (or the upkeep's call) finds it silent
        queries = await asyncio.gather(
            *(backend.match_prefix([1], 0) for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(q, IndexUnavailableError) for q in queries), queries
        not_asked = [q for q in queries if "is not answering; asked again within" in str(q)]
        assert len(not_asked) >= 4, queries  # one may be the pause's single new try
        server.proc.send_signal(signal.SIGCONT)

        async def answers() -> bool:
            try:
                await backend.match_prefix([1], 0)
            except IndexUnavailableError:
                return False
            return True

        await eventually(answers, 30, "queries to be answered once Redis answers")
    finally:
        server.proc.send_signal(signal.SIGCONT)
        await backend.close()
        server.stop()


async def test_a_call_redis_lets_time_out_is_sent_once(redis_server: RedisServer) -> None:
    """A call Redis does not answer within `timeout_s` (a wedged Redis, a host gone without a
    reset) fails after that one timeout, as `redis.timeout_s` says: it is not sent again on a
    new connection, which made every such call wait twice the timeout (a controller's request
    4 s with the default 2 s) and sent a write to Redis twice."""
    redis_server.flushall()
    forwarder = await TcpForwarder.start(f"127.0.0.1:{redis_server.port}")
    url = forwarder.endpoint.replace("tcp://", "redis://")
    backend = await open_redis_backend(url, buckets=8, timeout_s=0.2, maintenance_interval_s=60)
    try:
        await backend.match_prefix([1], 0)
        forwarder.silence(new_ones=True)
        opened = forwarder.tunnels
        with pytest.raises(IndexUnavailableError, match="did not answer"):
            await backend.match_prefix([1], 0)
        assert forwarder.tunnels == opened  # sent once, on the connection it had
    finally:
        await backend.close()
        await forwarder.cut()
        redis_server.flushall()  # (its 8 buckets are not the next test's)


@pytest.mark.timeout(60)
async def test_close_ends_maintenance_cancelled_inside_a_redis_call(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py can turn a cancellation that lands inside a command into a ConnectionError
    (seen under load: close() then waited for the maintenance task forever, the loop having
    caught the error and gone back to sleep). Here a sweep does the same, as redis-py did."""
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=0.01)
    in_sweep = asyncio.Event()

    async def sweep_turning_cancellation_into_a_connection_error() -> None:
        in_sweep.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None

    monkeypatch.setattr(backend, "sweep", sweep_turning_cancellation_into_a_connection_error)
    await asyncio.wait_for(in_sweep.wait(), 10)
    await asyncio.wait_for(backend.close(), 10)


# Another kvplane version's library, as a process of it loads it beside this one in a rolling
# upgrade: the functions' names without this version's suffix, each answering that it is not
# this version's (were the names shared, its REPLACE would swap them under this process).
OTHER_VERSION_LIBRARY = "#!lua name=kvplane\n" + "".join(
    f"redis.register_function{{ function_name = '{name}', callback = function() "
    "return redis.error_reply('another kvplane version') end }\n"
    for name in (
        "kvp_apply", "kvp_lease", "kvp_match", "kvp_remove", "kvp_sweep", "kvp_boot",
        "kvp_match_ro", "kvp_hits", "kvp_prefix", "kvp_scan", "kvp_workers", "kvp_dump",
    )
)  # fmt: skip


async def test_another_kvplane_versions_library_beside_this_one_changes_nothing(
    redis_server: RedisServer,
) -> None:
    """A rolling upgrade: a process of another kvplane version loads its library (REPLACE)
    after this one started: this process's calls go to its own library all along."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url)
    try:
        await backend.apply(_stored_batch("w", 1))
        redis_server.client().function_load(OTHER_VERSION_LIBRARY, replace=True)
        await backend.apply(_stored_batch("w", 2))
        assert [await _holders(backend, k) for k in (1, 2)] == [["w"], ["w"]]
        listed = redis_server.client().function_list()  # per library: [name, value, ...]
        libraries = {dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"] for lib in listed}
        assert libraries == {b"kvplane", b"kvplane" + ABI_SUFFIX.encode()}
    finally:
        await backend.close()


@pytest.mark.timeout(60)
async def test_a_block_an_older_version_stored_as_its_own_parent_is_dumped_as_a_root(
    redis_server: RedisServer,
) -> None:
    """A process of a version before REPORTs stating a block as its own parent were refused
    (library v5) stored one in the shared partition. This version's dump of the worker
    (DumpIndex, a resync's snapshot) stated it as such, and its own check then refused the
    whole dump; the block is stated as a root instead, as the index now takes it."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url)
    looping = Action(ActionType.REPORT, Tier.HBM, (1, 2), parent=1)  # 1's parent: 1
    try:
        await backend.apply(Batch("w", (Action(ActionType.REPORT, Tier.HBM, (5,)),), "addr-w"))
        await backend._apply_grouped(Batch("w", (looping,), "addr-w"))  # as v5 wrote it
        dumped = [batch async for batch in backend.snapshot("w")]
    finally:
        await backend.close()
    memory = MemoryBackend()
    for batch in dumped:
        await memory.apply(batch)
    assert [p.key for p in memory.index.placements("w")] == [1, 2, 5]
    assert [memory.index.parent(k) for k in (1, 2, 5)] == [None, 1, None]


def _copy(kind: ActionType, key: int) -> Batch:
    """One more (REPORT) or one fewer (REVOKE) physical copy of block `key` on w0."""
    return Batch("w0", (Action(kind, Tier.HBM, (key,), copies=True),), "addr-w0")


# A kvp_apply call on the wire (not the library's source, which FUNCTION LOAD sends).
KVP_APPLY_CALL = f"\r\nkvp_apply{ABI_SUFFIX}\r\n".encode()
# The empty kvp_release that claims the mark of a call whose reply was lost (`_settle_held`).
KVP_RELEASE_CALL = f"\r\nkvp_release{ABI_SUFFIX}\r\n".encode()


@contextlib.asynccontextmanager
async def _behind_forwarder(
    redis_server: RedisServer,
) -> AsyncIterator[tuple[TcpForwarder, RedisBackend]]:
    """A backend reaching `redis_server` through a forwarder that can lose its calls."""
    redis_server.flushall()
    forwarder = await TcpForwarder.start(f"127.0.0.1:{redis_server.port}")
    try:
        backend = await open_redis_backend(
            forwarder.endpoint.replace("tcp://", "redis://"), buckets=8, maintenance_interval_s=0.05
        )
        try:
            yield forwarder, backend
        finally:
            await backend.close()
    finally:
        await forwarder.cut()


async def _assert_applied_once(backend: RedisBackend, history: list[Batch]) -> None:
    """Once recovered, `backend` holds what the memory backend does given each batch once."""
    await eventually(lambda: backend.healthy, 30, "the backend to recover")
    memory = MemoryBackend()
    for batch in history:
        await memory.apply(batch)
    assert await backend.match([1], False) == await memory.match([1], False)
    assert [b async for b in backend.snapshot("w0")] == [b async for b in memory.snapshot("w0")]


@pytest.mark.timeout(60)
async def test_a_write_whose_reply_was_lost_is_not_applied_twice(
    redis_server: RedisServer,
) -> None:
    """A write that Redis ran but whose reply never came back (the connection dropped in
    between; redis-py's resend of it is refused as already run) is settled by its write mark
    before the buffered batches are replayed: a copies REPORT or REVOKE applied twice would
    count one copy too many or too few. Lost once as the batch is first written, then again
    as the recovery replays one buffered meanwhile: the copy count is the memory backend's
    given each batch once."""
    history = [
        _copy(ActionType.REPORT, 1),
        _copy(ActionType.REPORT, 1),  # its reply is lost
        _copy(ActionType.REPORT, 1),  # buffered; its replay's reply is lost
        _copy(ActionType.REVOKE, 1),
    ]
    async with _behind_forwarder(redis_server) as (forwarder, backend):
        await backend.apply(history[0])
        lost = forwarder.lose_next_reply(KVP_APPLY_CALL)
        await backend.apply(history[1])  # buffered, as Redis seemed away
        assert lost.is_set()
        lost_again = forwarder.lose_next_reply(KVP_APPLY_CALL)
        await backend.apply(history[2])
        await eventually(lambda: backend.healthy, 30, "the backend to recover")
        assert lost_again.is_set()
        await backend.apply(history[3])
        await _assert_applied_once(backend, history)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claim_reply_lost", [False, True])
async def test_a_write_that_never_reached_redis_is_replayed_once(
    redis_server: RedisServer, claim_reply_lost: bool
) -> None:
    """The other outcome of a call whose reply never came: its request never reached Redis
    (sent, and redis-py's resend, each on a connection that dropped). Settling finds it did
    not run and claims its mark; the batch is replayed, once. Also in a double fault: the
    reply of that claim lost too (redis-py's resend of the claim refused as stale): the
    claim ran, not the call, and settling reads that back instead of taking the call for
    run (before, the batch was dropped)."""
    history = [_copy(ActionType.REPORT, 1), _copy(ActionType.REPORT, 1)]
    async with _behind_forwarder(redis_server) as (forwarder, backend):
        await backend.apply(history[0])
        lost = forwarder.lose_next_request(KVP_APPLY_CALL, times=2)
        await backend.apply(history[1])  # buffered, as Redis seemed away
        assert lost.is_set()
        if claim_reply_lost:
            claim_lost = forwarder.lose_next_reply(KVP_RELEASE_CALL)
        await _assert_applied_once(backend, history)
        if claim_reply_lost:
            assert claim_lost.is_set()


@pytest.mark.timeout(60)
async def test_batches_refused_in_a_call_whose_reply_was_lost_are_handled_as_refused(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that ran although its reply was lost still tells what each of its batches did
    (Redis keeps the outcome of a call that refused one, for its process to read back): a
    batch fenced by a writer lease another replica holds is dropped and logged, and one Redis
    refused for want of a worker id is dropped and its worker resynced, as when the reply
    of a buffered batch's replay arrives; the batch that applied is not replayed. Before,
    each batch of such a call counted as applied: no resync was asked."""
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    async with _behind_forwarder(redis_server) as (forwarder, backend):
        asked: list[str] = []
        backend.add_resync_listener(asked.append)
        backend.fence_writes("a/1", str)
        assert await backend.hold_lease("w0", "a/1", 30) is LeaseState.TAKEN
        assert await backend.hold_lease("w1", "b/1", 30) is LeaseState.TAKEN  # another's
        await backend.apply(_leased_batch("w0", 1))
        client = redis_server.client()
        (meta,) = client.scan_iter(match="*:m")
        client.hset(meta, "nw", 65535)  # every worker id is given out: w2 gets none
        lost = forwarder.lose_next_reply(KVP_APPLY_CALL)
        await asyncio.gather(  # one call, buffered as Redis seemed away
            backend.apply(_leased_batch("w0", 2)),
            backend.apply(_leased_batch("w1", 3)),
            backend.apply(_stored_batch("w2", 4)),
        )
        assert lost.is_set()
        await eventually(lambda: backend.healthy, 30, "the backend to recover")
        assert [await _holders(backend, k) for k in (1, 2, 3, 4)] == [["w0"], ["w0"], [], []]
        assert asked == ["w2"]
        assert "buffered batch of w1 not applied: KVP_FENCED" in caplog.text
        assert "buffered batch of w2 refused: KVP_WORKERS" in caplog.text


@pytest.mark.timeout(60)
async def test_buffered_batches_fenced_at_their_replay_are_logged_once_per_worker(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica's buffered batches of an engine whose writer lease another replica took
    meanwhile are dropped at their replay, with one log line for the engine that counts them
    (before, one line per batch: a controller replica whose Redis paused for a lease's term
    logged hundreds, one per KV-event batch its engines sent meanwhile)."""
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    async with _behind_forwarder(redis_server) as (forwarder, backend):
        backend.fence_writes("a/1", str)
        assert await backend.hold_lease("w1", "b/1", 30) is LeaseState.TAKEN  # another's
        lost = forwarder.lose_next_request(KVP_APPLY_CALL, times=2)
        await asyncio.gather(*(backend.apply(_leased_batch("w1", k)) for k in (1, 2, 3)))
        assert lost.is_set()  # buffered: the call never reached Redis
        await eventually(lambda: backend.healthy, 30, "the backend to recover")
        assert [await _holders(backend, k) for k in (1, 2, 3)] == [[], [], []]
        fenced = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
        assert len(fenced) == 1, fenced
        assert fenced[0].startswith("buffered batch of w1 not applied: KVP_FENCED"), fenced
        assert fenced[0].endswith("(3 batches)"), fenced


@pytest.mark.timeout(60)
async def test_removals_left_for_kvp_apply_in_a_release_whose_reply_was_lost_stay_buffered(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """At maxmemory a buffered removal of a worker whose address changed is sent with
    kvp_release, which leaves it for kvp_apply (KVP_GROWS: applying it would store the new
    address). That call's reply lost, settling reads back that it left the removal: the batch
    stays buffered and applies once Redis takes writes. Before, every early removal of such
    a call counted as applied: the REVOKE was dropped, the block and the old address kept."""
    history = [
        Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (1,)),), "addr-a"),
        Batch("w0", (Action(ActionType.REVOKE, Tier.HBM, (1,)),), "addr-b"),
    ]
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    async with _behind_forwarder(redis_server) as (forwarder, backend):
        try:
            await backend.apply(history[0])
            redis_server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
            redis_server.command("CONFIG", "SET", "maxmemory", 1)
            lost = forwarder.lose_next_reply(KVP_RELEASE_CALL)
            await backend.apply(history[1])  # refused at maxmemory: buffered
            await eventually(lost.is_set, 30, "the release's reply to be lost")
            await eventually(
                lambda: "ran the call whose reply was lost" in caplog.text, 30, "the settling"
            )
            assert backend.num_buffered_batches == 1
        finally:
            redis_server.command("CONFIG", "SET", "maxmemory", 0)
        await eventually(lambda: backend.healthy and backend.unavailable is None, 30, "recovery")
        memory = MemoryBackend()
        for batch in history:
            await memory.apply(batch)
        assert await backend.match([1], False) == await memory.match([1], False) == []
        assert (await backend.stats()).workers == (await memory.stats()).workers
