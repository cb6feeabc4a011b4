"""End to end: a `kvplane indexer serve` process on a real redis-server follows a real ZMQ
publisher (the vLLM 0.32.0 capture, with a replay ROUTER); redis-server is killed during
ingestion and comes back, and the indexer, never restarted, serves exactly the publisher's
live blocks again: its source rebuilt the worker from the replay when the backend asked.

The oracle is `vllm_capture.LiveModel` (written from the capture's documented facts, not from
the translator). Checkpoints stop before the capture's AllBlocksCleared (seq 56), which would
otherwise hide a missing rebuild.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq.asyncio

from controller.config import ControllerConfig
from controller.service import Controller
from indexer.backend import PrefixMatch, PrefixResult
from indexer.batch import Action, ActionType, Batch, Tier
from indexer.index import PrefixIndex
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import RedisBackend, open_redis_backend
from indexer.redis_client import IndexUnavailableError
from indexer.sources.openengine import OpenEngineSource, OpenEngineSourceSettings
from indexer.sources.resync import connect_resync
from indexer.sources.zmq import ZmqSource, ZmqSourceSettings
from indexer.translate import TranslateOptions, WorkerTranslator
from indexer.writer_lease import RENEWALS_PER_TERM
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.config import load_config
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.indexer.fake_kv_publisher import FakeKvPublisher, running
from tests.indexer.vllm_capture import LiveModel, live_messages, signed
from tests.partial_servicers import PartialOpenEngine
from tests.polling import eventually
from tests.redis_servers import RedisServer, free_port

KVPLANE = str(Path(sys.executable).parent / "kvplane")
MESSAGES = {m.seq: m for m in live_messages()}
ALL_HASHES = sorted(
    {signed(h) for m in MESSAGES.values() for e in m.events for h in e.get("block_hashes", ())}
)
WAIT_S = 30.0


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def _model_through(seq: int) -> set[int]:
    model = LiveModel()
    for s in range(seq + 1):
        model.apply(MESSAGES[s].events)
    return set(model.live())


async def _indexed(stub: kv_grpc.KVIndexerAsyncStub) -> set[int] | None:
    """Every block the index places on w0 (None while the index is unavailable)."""
    try:
        reply = await stub.MatchExternalKv(kv.MatchExternalKvRequest(hashes=ALL_HASHES))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return None
    assert {m.worker_id for m in reply.matches} <= {"w0"}
    return {h for m in reply.matches for t in m.hashes_by_tier for h in t.hashes}


class Run:
    """One indexer process following one publisher, on one redis-server."""

    def __init__(
        self,
        tmp_path: Path,
        publisher: FakeKvPublisher,
        max_buffered: int,
        writer_lease_s: float = 10.0,
    ) -> None:
        self.redis = RedisServer(tmp_path / "redis")
        self.publisher = publisher
        self.workdir = tmp_path
        self.max_buffered = max_buffered
        self.writer_lease_s = writer_lease_s
        self.metrics_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.published = -1

    @property
    def log(self) -> str:
        return (self.workdir / "serve.log").read_text()

    async def start(self) -> int:
        self.redis.start()
        config = self.workdir / "indexer.yaml"
        config.write_text(
            f"backend: {self.redis.url}\n"
            f"redis: {{buckets: 64, max_buffered_batches: {self.max_buffered}}}\n"
            f"writer_lease_s: {self.writer_lease_s}\n"
            f"metrics_listen: 127.0.0.1:{self.metrics_port}\n"
            "sources:\n"
            "  - {kind: zmq, worker_id: w0, worker_address: 10.0.0.1:8000, topic: 'kv@',"
            f" endpoint: '{self.publisher.endpoint}',"
            f" replay_endpoint: '{self.publisher.replay_endpoint}'}}\n"
        )
        port_file = self.workdir / "port"
        process = self.spawn(config, port_file)

        async def up() -> bool:
            assert process.poll() is None, self.log
            return port_file.exists()

        await eventually(up, WAIT_S, "the indexer's port file")
        await self.publisher.wait_subscribed()
        return int(port_file.read_text())

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[kv_grpc.KVIndexerAsyncStub]:
        """The indexer started and the capture's first 20 batches indexed: its stub."""
        port = await self.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_grpc.KVIndexerStub(channel)
            await self.publish_through(19)
            await self.expect(stub, 19, "the first 20 batches")
            yield stub

    def spawn(self, config: Path, port_file: Path) -> subprocess.Popen[bytes]:
        with (self.workdir / "serve.log").open("ab") as log:
            self.process = subprocess.Popen(
                [KVPLANE, "indexer", "serve", "--config", str(config), "--listen",
                 "127.0.0.1:0", "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        return self.process

    async def publish_through(self, seq: int) -> None:
        for s in range(self.published + 1, seq + 1):
            await self.publisher.publish(MESSAGES[s].frames)
        self.published = seq

    async def expect(self, stub: kv_grpc.KVIndexerAsyncStub, seq: int, what: str) -> None:
        """Wait until the index holds exactly the publisher's live blocks after `seq`."""
        expected = _model_through(seq)

        async def exact() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log
            return await _indexed(stub) == expected

        await eventually(exact, WAIT_S, what)

    def metric(self, name: str) -> float | None:
        """A sample of the indexer's /metrics (None: not there)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            body: str = reply.read().decode()
        values = [
            float(line.split()[-1]) for line in body.splitlines() if line.startswith(f"{name} ")
        ]
        return values[0] if values else None

    async def size_shown(self, seq: int, what: str) -> None:
        """Wait until /metrics gives the index's size as the publisher's live blocks after
        `seq`, all on w0 (refreshed every few seconds)."""
        blocks = len(_model_through(seq))

        async def shown() -> bool:
            return self.metric("kvplane_indexer_index_blocks") == blocks

        await eventually(shown, WAIT_S, what)
        assert self.metric("kvplane_indexer_index_workers") == 1
        assert (self.metric("kvplane_indexer_index_placements") or 0) >= blocks

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(20)
        self.redis.stop()


async def _scenario(
    tmp_path: Path, context: zmq.asyncio.Context, *, max_buffered: int, keep_data: bool
) -> str:
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    run = Run(tmp_path, publisher, max_buffered)
    try:
        async with run.serving() as stub:
            if keep_data:
                run.redis.client().shutdown(save=True)
                run.redis.stop()
            else:
                run.redis.kill()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=[1]))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"Redis at 127.0.0.1:{run.redis.port}" in str(info.value.details())

            # Ingestion goes on while Redis is down: the backend buffers (or overflows).
            await run.publish_through(34)
            sign = "will be resynced" if max_buffered < 10 else "buffering batches"

            async def noticed() -> bool:
                return sign in run.log

            await eventually(noticed, WAIT_S, f"the indexer's log to say {sign!r}")
            run.redis.start()  # without its data unless keep_data
            # No further message: the source rebuilds the worker as soon as it is asked.
            await run.expect(stub, 34, "the resync after Redis came back")
            await run.publish_through(55)
            await run.expect(stub, 55, "live ingestion after the resync")
        return run.log
    finally:
        run.stop()
        await publisher.close()


@pytest.mark.timeout(90)
async def test_redis_restarted_empty_during_ingestion(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    log = await _scenario(tmp_path, context, max_buffered=10_000, keep_data=False)
    assert "lost the index; resyncing 1 worker(s)" in log
    assert "worker w0: the index asked for a resync" in log


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep_data", [True, False], ids=["with-data", "empty"])
async def test_buffer_overflow_during_an_outage(
    tmp_path: Path, context: zmq.asyncio.Context, keep_data: bool
) -> None:
    log = await _scenario(tmp_path, context, max_buffered=2, keep_data=keep_data)
    # With its data kept, only the overflow resyncs w0.
    assert ("lost the index" in log) is not keep_data
    assert "worker w0: the index asked for a resync" in log


@pytest.mark.timeout(90)
@pytest.mark.parametrize("past_the_lease", [False, True], ids=["lease-kept", "past-its-term"])
async def test_redis_out_of_memory_during_ingestion(
    tmp_path: Path, context: zmq.asyncio.Context, past_the_lease: bool
) -> None:
    """Redis at its maxmemory (noeviction) refuses the indexer's batches, the engine's
    BlockRemoved among them: the index answers UNAVAILABLE, saying why, never the removed
    blocks; once the cap is raised it holds exactly the publisher's live blocks again, with
    no restart. The writer lease is renewed at maxmemory too, past its term: the source
    keeps it, and the worker is not rebuilt."""
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    run = Run(tmp_path, publisher, 10_000, writer_lease_s=2.0 if past_the_lease else 30.0)
    try:
        async with run.serving() as stub:
            await run.size_shown(19, "the index's size on /metrics")
            run.redis.command("CONFIG", "SET", "maxmemory", 1)  # far below what Redis uses
            await run.publish_through(34)  # seq 20: BlockRemoved

            async def refused() -> bool:
                return "is out of memory and refuses the index's writes" in run.log

            await eventually(refused, WAIT_S, "the indexer to find Redis out of memory")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.MatchExternalKv(kv.MatchExternalKvRequest(hashes=ALL_HASHES))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "is out of memory and refuses writes" in str(info.value.details())
            assert run.metric("kvplane_indexer_index_reachable") == 0
            # Its size is not shown meanwhile, rather than the last one read frozen.
            for name in ("blocks", "placements", "workers"):
                assert run.metric(f"kvplane_indexer_index_{name}") is None
            if past_the_lease:
                lease = "kvplane:{default:0}:l:w0"
                holder = run.redis.command("GET", lease)
                seen = {"left_ms": int(run.redis.command("PTTL", lease)), "renewals": 0}

                def renewed_past_its_term() -> bool:
                    assert run.redis.command("GET", lease) == holder  # never expired
                    left_ms = int(run.redis.command("PTTL", lease))
                    seen["renewals"] += left_ms > seen["left_ms"]  # its expiry pushed back
                    seen["left_ms"] = left_ms
                    return seen["renewals"] > 2 * RENEWALS_PER_TERM  # two terms' worth

                await eventually(renewed_past_its_term, WAIT_S, "the lease to be renewed")
            run.redis.command("CONFIG", "SET", "maxmemory", 0)
            await run.expect(stub, 34, "the index once Redis takes writes again")
            assert run.metric("kvplane_indexer_index_reachable") == 1
            await run.size_shown(34, "the index's size on /metrics again")
            await run.publish_through(55)
            await run.expect(stub, 55, "live ingestion afterwards")
        assert "takes the index's writes again" in run.log
        assert run.log.count("resubscribing from a snapshot") == 1  # kept throughout
    finally:
        run.stop()
        await publisher.close()


@pytest.mark.timeout(60)
async def test_controller_opens_redis_with_the_indexers_options(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The controller's `index.redis` block is the indexer's `redis:` block."""
    redis_server.flushall()
    config = load_config(
        ControllerConfig,
        None,
        {"index": {"backend": redis_server.url, "redis": {"key_prefix": "ctl", "model": "m7"}}},
    )
    controller = Controller(config)
    await controller.start()
    try:
        assert controller.index is not None
        # (The controller writes a worker only under its engine's writer lease.)
        holder = controller.fleet.lease_holder
        assert isinstance(controller.index, RedisBackend)  # `index.backend` names a redis
        await controller.index.hold_lease("w0", holder, 10.0)
        await controller.index.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (5,)),)))
    finally:
        await controller.close()
    keys = [k.decode() for k in redis_server.client().scan_iter()]
    assert keys and all(k.startswith("ctl:{m7:0}:") for k in keys), keys


def _stored(key: int, parent: int | None = None) -> pb.KvEvent:
    stored = pb.BlockStored(
        block_hashes=[pb.KvBlockHash(value=key.to_bytes(8, "big"), encoding="int64")],
        block_size=4,
        medium=pb.STORAGE_MEDIUM_GPU,
    )
    if parent is not None:
        stored.parent_block_hash.CopyFrom(
            pb.KvBlockHash(value=parent.to_bytes(8, "big"), encoding="int64")
        )
    return pb.KvEvent(block_stored=stored)


def _batch(seq: int, *events: pb.KvEvent) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(batch=pb.KvEventBatch(sequence_number=seq, events=events))


class IdleEngine(PartialOpenEngine):
    """Subscription i streams scripts[i], then stays open with nothing more to say."""

    def __init__(self, scripts: list[list[pb.SubscribeKvEventsResponse]]) -> None:
        self.scripts = scripts
        self.requests: list[tuple[bool, int]] = []

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Any
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        self.requests.append((request.include_snapshot, request.start_sequence_number))
        for response in self.scripts[min(len(self.requests), len(self.scripts)) - 1]:
            yield response
        await asyncio.Event().wait()  # idle until the client cancels


@pytest.mark.timeout(60)
async def test_openengine_source_resubscribes_with_a_snapshot_when_redis_loses_the_index(
    redis_server: RedisServer,
) -> None:
    """Redis flushed under an idle engine's worker: the backend notices (boot token), asks for
    a resync, and the source resubscribes from 0 with include_snapshot; the snapshot restores
    exactly the engine's blocks without any new event."""
    redis_server.flushall()
    snapshot = [_batch(2, pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared()), _stored(10),
                       _stored(11, parent=10))]  # fmt: skip
    first = [_batch(1, _stored(10)), _batch(2, _stored(11, parent=10))]
    engine = IdleEngine([first, snapshot])
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(engine, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=0.05)
    source = OpenEngineSource(
        OpenEngineSourceSettings(target=target),
        WorkerTranslator(TranslateOptions(target, target)),
        backend,
    )
    assert connect_resync(backend, {target: source}.get)

    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
            assert await backend.match_prefix([10, 11], 0) == PrefixResult(
                (PrefixMatch(target, target, 2),), 2, 2
            )
            redis_server.flushall()  # Redis lost the index
            await source.wait_until(lambda: source.counters.num_resyncs == 1, WAIT_S)

            async def restored() -> bool:
                return (await backend.match_prefix([10, 11], 0)).best_prefix_blocks == 2

            await eventually(restored, WAIT_S, "the snapshot to restore the worker")
    finally:
        await backend.close()
        await server.stop(None)
    assert engine.requests == [(True, 0), (True, 0)]
    assert source.counters.num_resets == 2  # the first batch, then the snapshot


@pytest.mark.timeout(60)
async def test_zmq_source_rebuilds_from_replay_on_request(context: zmq.asyncio.Context) -> None:
    """A resync request rebuilds an idle worker from the replay at once; the live messages
    the replay covered are then dropped as duplicates, and ingestion goes on exactly."""
    index = PrefixIndex()
    backend = MemoryBackend(index)
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source = ZmqSource(
        ZmqSourceSettings(
            endpoint=publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            topic="kv@",
            rebuild_at_start=False,  # the request's rebuild alone (the start's has its tests)
        ),
        WorkerTranslator(TranslateOptions("w0", "10.0.0.1:8000")),
        backend,
        context=context,
    )

    def indexed() -> set[int]:
        return {p.key for p in index.placements("w0")}

    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(20):
                await publisher.publish(MESSAGES[seq].frames)
            await source.wait_until(lambda: source.last_seq == 19, WAIT_S)
            await backend.remove_worker("w0")  # the index lost the worker
            source.request_resync()
            # (The count goes up as the resync starts: wait for what it rebuilt.)
            await source.wait_until(lambda: indexed() == _model_through(19), WAIT_S)
            assert source.counters.num_resyncs == 1
            assert publisher.replay_requests == [0]
            for seq in range(20, 40):
                await publisher.publish(MESSAGES[seq].frames)
            await source.wait_until(lambda: source.last_seq == 39, WAIT_S)
            assert indexed() == _model_through(39)
            assert source.counters.num_gaps == source.counters.num_duplicates == 0
    finally:
        await publisher.close()


@pytest.mark.timeout(60)
async def test_a_redis_that_lost_its_data_resyncs_only_the_workers_this_process_wrote(
    redis_server: RedisServer,
) -> None:
    """w0 was written before the flush and lost its block: it is asked to resync. w1's first
    batch is the write that finds the loss (the upkeep is too slow to notice first): it is
    written to the emptied partition, lost nothing, and is not asked."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=3600)
    asked: list[str] = []
    backend.add_resync_listener(asked.append)
    try:
        await backend.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (10,)),)))
        redis_server.flushall()  # Redis lost the index
        await backend.apply(Batch("w1", (Action(ActionType.REPORT, Tier.HBM, (11,)),)))
        placements = await backend.match([10, 11], False)
        held = {p.worker_id: {h for t in p.by_tier for h in t.hashes} for p in placements}
    finally:
        await backend.close()
    assert asked == ["w0"]
    assert held == {"w1": {11}}


async def _lose_the_index_under_w0(backend: RedisBackend, redis_server: RedisServer) -> None:
    """Worker w0 written, then Redis loses the index, found by the next write (w1's first)."""
    await backend.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (100,)),)))
    redis_server.flushall()
    await backend.apply(Batch("w1", (Action(ActionType.REPORT, Tier.HBM, (101,)),)))


@pytest.mark.timeout(60)
async def test_a_second_loss_does_not_resync_a_worker_not_written_since_the_first(
    redis_server: RedisServer,
) -> None:
    """w0 (a worker fed through ApplyExternalKvBatch, no source here to rebuild it) lost its
    blocks with the first loss and was asked to resync; nothing has written it since, so a
    second loss (Redis restarted again) has nothing of it to lose. It was asked again at every
    loss, one more warning each that no source of this process feeds it."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=3600)
    asked: list[str] = []
    backend.add_resync_listener(asked.append)
    try:
        await _lose_the_index_under_w0(backend, redis_server)
        assert asked == ["w0"]
        redis_server.flushall()  # w1's block lost; w0 had none
        await backend.apply(Batch("w2", (Action(ActionType.REPORT, Tier.HBM, (102,)),)))
    finally:
        await backend.close()
    assert asked == ["w0", "w1"]


@pytest.mark.timeout(60)
async def test_a_redis_back_with_older_data_loses_a_departed_publishers_blocks_again(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    """A ZMQ source without a replay endpoint cleared its worker when its publisher went away
    (an engine killed). Redis then came back from a snapshot taken before that clear: the
    departed engine's blocks are back, and the backend asks the source to resync. The
    source did nothing ("the next message clears and rebuilds"), but a departed publisher
    sends no next message: its blocks stayed in the index for good."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    backend = await open_redis_backend(redis.url, buckets=16, maintenance_interval_s=3600)
    publisher = FakeKvPublisher(context)
    source = ZmqSource(
        ZmqSourceSettings(endpoint=publisher.endpoint, topic="kv@"),
        WorkerTranslator(TranslateOptions("w0", "10.0.0.1:8000")),
        backend,
        context=context,
    )
    connect_resync(backend, {"w0": source}.get)

    async def indexed() -> set[int]:
        return {
            h for p in await backend.match(ALL_HASHES, False) if p.worker_id == "w0"
            for t in p.by_tier for h in t.hashes
        }  # fmt: skip

    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(10):
                await publisher.publish(MESSAGES[seq].frames)
            await source.wait_until(lambda: source.last_seq == 9, WAIT_S)
            assert await indexed() == _model_through(9) != set()
            redis.client().save()  # the snapshot Redis comes back from
            publisher.close_pub()  # the engine is gone: its blocks are cleared
            await source.wait_until(lambda: not source.link.up, WAIT_S)
            assert await indexed() == set()
            redis.kill()
            redis.start()
            assert await indexed() == _model_through(9)  # back from the snapshot
            # The next write (another worker's) finds the writes Redis lost.
            await backend.apply(Batch("w1", (Action(ActionType.REPORT, Tier.HBM, (1,)),)))
            await source.wait_until(lambda: source.counters.num_resyncs == 1, WAIT_S)

            async def cleared() -> bool:
                return not await indexed()

            # (The count goes up as the resync starts: wait for its clear.)
            await eventually(cleared, WAIT_S, "the departed engine's blocks cleared again")
    finally:
        await publisher.close()
        await backend.close()
        redis.stop()


@pytest.mark.timeout(60)
async def test_a_redis_that_lost_its_data_resyncs_no_worker_removed_before(
    redis_server: RedisServer,
) -> None:
    """Engines come and go (a planner scaling, restarts at new ports): each written and
    then removed leaves nothing in Redis to lose, so a loss asks only the one still there to
    resync, not every worker this process ever wrote (it remembered them all)."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=3600)
    asked: list[str] = []
    backend.add_resync_listener(asked.append)
    try:
        for i in range(20):
            await backend.apply(Batch(f"gone{i}", (Action(ActionType.REPORT, Tier.HBM, (i,)),)))
            await backend.remove_worker(f"gone{i}")
        await _lose_the_index_under_w0(backend, redis_server)
    finally:
        await backend.close()
    assert asked == ["w0"]


@pytest.mark.timeout(60)
async def test_a_worker_removed_while_its_last_batch_is_applied_is_not_resynced_after_a_loss(
    redis_server: RedisServer,
) -> None:
    """An engine leaves as its last KV events are being written: the removal, made once that
    write ran, leaves nothing of the worker in Redis, so a later loss does not ask it to
    resync (the write's reply, arriving after the removal began, made it known again)."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=3600)
    asked: list[str] = []
    backend.add_resync_listener(asked.append)
    try:
        redis_server.command("CLIENT", "PAUSE", 60_000, "WRITE")  # the write stays in flight
        try:
            last = asyncio.create_task(
                backend.apply(Batch("gone", (Action(ActionType.REPORT, Tier.HBM, (1,)),)))
            )
            await eventually(backend._marks_lock.locked)  # the write was sent
            removal = asyncio.create_task(backend.remove_worker("gone"))
            await asyncio.sleep(0)  # the removal begins: it waits for the write
        finally:
            redis_server.command("CLIENT", "UNPAUSE")
        await last
        assert await removal == 1
        await _lose_the_index_under_w0(backend, redis_server)
    finally:
        await backend.close()
    assert asked == ["w0"]


@pytest.mark.timeout(60)
async def test_a_worker_removed_while_its_write_failed_stays_removed_after_the_outage(
    redis_server: RedisServer,
) -> None:
    """An engine leaves as its last KV events are being written, and Redis goes down under
    that write: the write (buffered when it failed, after the removal had dropped the worker's
    buffered batches) is not replayed after the removal, which would put the engine that left
    back in the index, placing blocks on it for good."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=3600)
    try:
        await backend.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (100,)),)))
        redis_server.command("CLIENT", "PAUSE", 60_000, "WRITE")  # the write stays in flight
        last = asyncio.create_task(
            backend.apply(Batch("gone", (Action(ActionType.REPORT, Tier.HBM, (1,)),)))
        )
        await eventually(backend._marks_lock.locked)  # the write was sent
        removal = asyncio.create_task(backend.remove_worker("gone"))
        await asyncio.sleep(0)  # the removal begins: it waits for the write
        redis_server.kill()  # the write's reply is lost
        await last  # buffered
        with pytest.raises(IndexUnavailableError):
            await removal  # queued
        redis_server.start()
        await eventually(lambda: backend.healthy, 30, "the buffered batches replayed")
        placed = {p.worker_id for p in await backend.match([1], count_as_hit=False)}
    finally:
        await backend.close()
    assert placed == set()


@pytest.mark.timeout(60)
async def test_a_worker_removed_while_its_batch_waits_for_the_call_in_flight_stays_removed(
    redis_server: RedisServer,
) -> None:
    """An engine leaves while its last batch waits for the group commit in flight (another
    worker's): that batch is not sent after the removal, which would put the engine that left
    back in the index."""
    redis_server.flushall()
    backend = await open_redis_backend(redis_server.url, buckets=16, maintenance_interval_s=3600)
    try:
        redis_server.command("CLIENT", "PAUSE", 60_000, "WRITE")  # the write stays in flight
        try:
            other = asyncio.create_task(
                backend.apply(Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (100,)),)))
            )
            await eventually(backend._marks_lock.locked)  # w0's write was sent
            last = asyncio.create_task(
                backend.apply(Batch("gone", (Action(ActionType.REPORT, Tier.HBM, (1,)),)))
            )
            await asyncio.sleep(0)  # it waits for w0's call
            removal = asyncio.create_task(backend.remove_worker("gone"))
            await asyncio.sleep(0)  # the removal begins: it waits for w0's call
        finally:
            redis_server.command("CLIENT", "UNPAUSE")
        await asyncio.gather(other, last, removal)
        placed = {p.worker_id for p in await backend.match([1, 100], count_as_hit=False)}
    finally:
        await backend.close()
    assert placed == {"w0"}
