"""The ZMQ source on real sockets: malformed input is counted and skipped while the server
keeps serving; reconnects; a publisher restart on the same port, or hidden behind a gap or a
replayed range, told as a sequence break; a failing sink."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import msgpack
import pytest
import zmq
import zmq.asyncio

from indexer.batch import ActionType, Batch
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.servicer import index_services
from indexer.sources.link import Link
from indexer.sources.zmq import ZmqSource, ZmqSourceSettings
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.backoff import Backoff
from kvplane.config import ServerConfig
from kvplane.server import create_server
from kvplane.zmq_heartbeat import DEFAULT_HEARTBEAT, Heartbeat
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from tests.indexer.backend_factories import FACTORIES
from tests.indexer.fake_kv_publisher import TWO_FRAME_PREFIX, FakeKvPublisher, running
from tests.logged_errors import errors_logged
from tests.polling import eventually
from tests.processes import DEFAULT_SIGNALS
from tests.redis_servers import restartable_port

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0
TOPIC = b"kv@test"


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _stored(*hashes: int, parent: int | None = None) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "medium": "GPU",
    }


def _message(seq: int, *events: object) -> list[bytes]:
    return [TOPIC, _seq(seq), msgpack.packb([float(seq), list(events), None])]


def _source(
    endpoint: str,
    context: zmq.asyncio.Context,
    sink: object,
    *,
    replay: str | None = None,
    topic: str = "kv@",
    bind: bool = False,
    replay_timeout_s: float = 5.0,
    rebuild_at_start: bool = False,
    backoff_s: tuple[float, float] = (0.05, 0.2),
    receive_queue_bytes: int | None = None,  # None: the default
    replay_bytes: int | None = None,  # None: the default
    heartbeat: Heartbeat = DEFAULT_HEARTBEAT,
) -> ZmqSource:
    translator = WorkerTranslator(TranslateOptions("w0", "10.0.0.1:8000"))
    settings = ZmqSourceSettings(
        endpoint=endpoint,
        replay_endpoint=replay,
        topic=topic,
        bind=bind,
        replay_timeout_s=replay_timeout_s,
        backoff_initial_s=backoff_s[0],
        backoff_max_s=backoff_s[1],
        # Most tests follow the first-message rules; the rebuild at start has its own.
        rebuild_at_start=rebuild_at_start,
        heartbeat=heartbeat,
    )
    if receive_queue_bytes is not None:
        settings = dataclasses.replace(settings, receive_queue_bytes=receive_queue_bytes)
    if replay_bytes is not None:
        settings = dataclasses.replace(settings, replay_bytes=replay_bytes)
    return ZmqSource(settings, translator, sink, context=context)  # type: ignore[arg-type]


def _replaying(
    context: zmq.asyncio.Context, *, buffer_steps: int | None = None, serving: bool = True
) -> tuple[PrefixIndex, FakeKvPublisher, ZmqSource]:
    """A publisher with a replay socket (serving replays, unless not yet: `start_replay`),
    and a source following it into a fresh index."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context, buffer_steps=buffer_steps)
    if serving:
        publisher.start_replay()
    source = _source(
        publisher.endpoint, context, MemoryBackend(index), replay=publisher.replay_endpoint
    )
    return index, publisher, source


def _starting_source(
    publisher: FakeKvPublisher,
    context: zmq.asyncio.Context,
    index: PrefixIndex,
    replay_timeout_s: float = 5.0,
    replay_bytes: int | None = None,
) -> ZmqSource:
    """A source on the publisher that rebuilds from its replay at start, into `index`."""
    return _source(
        publisher.endpoint,
        context,
        MemoryBackend(index),
        replay=publisher.replay_endpoint,
        replay_timeout_s=replay_timeout_s,
        rebuild_at_start=True,
        replay_bytes=replay_bytes,
    )


def _keys(index: PrefixIndex) -> set[int]:
    return {p.key for p in index.placements("w0")}


async def test_malformed_messages_are_counted_and_skipped_and_the_server_keeps_serving(
    context: zmq.asyncio.Context,
) -> None:
    index = PrefixIndex()
    backend = MemoryBackend(index)
    services, _, _ = index_services(backend, default_block_size=16, max_concurrent_prefix_queries=4)
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    publisher = FakeKvPublisher(context)
    source = _source(publisher.endpoint, context, backend)
    huge_array = b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff"
    try:
        async with running(source.run()), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await publisher.wait_subscribed()
            await publisher.send(_message(0, _stored(1)))
            await publisher.send([TOPIC, _seq(1), msgpack.packb([1.0, [_stored(9)], None])[:-3]])
            await publisher.send([TOPIC, _seq(2), msgpack.packb(["ts", {"events": 1}, "x"])])
            await publisher.send([TOPIC, _seq(3), huge_array])
            await publisher.send(
                _message(
                    4,
                    {"type": "FutureEvent", "block_hashes": [7]},
                    {"type": "BlockStored", "block_hashes": "not a list"},
                    _stored(2, parent=1),
                    ["BlockStored", [3], 2, None, None, None, "GPU"],
                )
            )
            await publisher.send([TOPIC + b"-one-frame"])
            await publisher.send([TOPIC, b"a", b"b", b"c", b"d"])
            await publisher.send([TOPIC, b"\x00\x05", b"payload"])
            await publisher.send(_message(5, _stored(4, parent=3)))
            await source.wait_until(lambda: source.last_seq == 5, WAIT_S)
            counters = source.counters
            assert counters.num_messages == 9
            assert counters.num_bad_messages == 6  # 3 payloads, 3 frame layouts
            assert counters.num_bad_events == 1
            assert counters.num_unknown_events == 1
            assert counters.num_gaps == 0  # a malformed payload still consumed its seq
            assert _keys(index) == {1, 2, 3, 4}
            stub = kv_grpc.KVIndexerStub(ch)
            prefix = await stub.MatchExternalKvPrefix(
                kv.MatchExternalKvPrefixRequest(hashes=[1, 2, 3, 4, 9])
            )
            assert prefix.best_prefix_blocks == 4
            assert [m.worker_address for m in prefix.matches] == ["10.0.0.1:8000"]
    finally:
        await publisher.close()
        await server.stop(None)


@contextlib.asynccontextmanager
async def _binding_source(
    context: zmq.asyncio.Context,
) -> AsyncIterator[tuple[str, PrefixIndex, ZmqSource]]:
    """A source bound to a free port, listening, with its endpoint and index."""
    probe = context.socket(zmq.PUB)
    probe.bind("tcp://127.0.0.1:*")
    endpoint = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    probe.close(linger=0)
    index = PrefixIndex()
    source = _source(endpoint, context, MemoryBackend(index), bind=True)
    async with running(source.run()):
        # Connecting before the bind could self-connect on loopback and steal the port.
        await asyncio.wait_for(source.ready.wait(), WAIT_S)
        yield endpoint, index, source


async def _publish_blocks_10_to_12(publisher: FakeKvPublisher, source: ZmqSource) -> None:
    await publisher.wait_subscribed()
    for seq in range(3):
        parent = None if seq == 0 else 9 + seq
        await publisher.send(_message(seq, _stored(10 + seq, parent=parent)))
    await source.wait_until(lambda: source.last_seq == 2, WAIT_S)


async def test_a_binding_source_and_a_publisher_restart_clear_the_worker(
    context: zmq.asyncio.Context,
) -> None:
    async with _binding_source(context) as (endpoint, index, source):
        # The publisher connects to the source (vLLM with a non-wildcard endpoint).
        first = FakeKvPublisher(context, endpoint=endpoint, connect=True)
        try:
            await _publish_blocks_10_to_12(first, source)
            assert _keys(index) == {10, 11, 12}
        finally:
            await first.close()
        # Its connection gone, the publisher's blocks go with it.
        await source.wait_until(lambda: not _keys(index), WAIT_S)
        # The engine restarts: a new publisher process, seq from 0 again.
        second = FakeKvPublisher(context, endpoint=endpoint, connect=True)
        try:
            await second.wait_subscribed()
            await second.send(_message(0, _stored(20)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            assert _keys(index) == {20}
        finally:
            await second.close()


async def test_a_stray_connection_to_a_binding_source_leaves_the_publisher_indexed(
    context: zmq.asyncio.Context,
) -> None:
    """A port scan or a TCP liveness probe on the bound port is no publisher leaving."""
    async with _binding_source(context) as (endpoint, index, source):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        publisher = FakeKvPublisher(context, endpoint=endpoint, connect=True)
        try:
            await _publish_blocks_10_to_12(publisher, source)
            for _ in range(3):  # connects, says nothing, hangs up
                _, writer = await asyncio.open_connection(host, int(port))
                writer.close()
                await writer.wait_closed()
            await asyncio.sleep(0.5)  # the source has seen the strays come and go
            await publisher.send(_message(3, _stored(13, parent=12)))
            await source.wait_until(lambda: source.last_seq == 3, WAIT_S)
            assert _keys(index) == {10, 11, 12, 13}
        finally:
            await publisher.close()
        # The publisher's own end still clears its blocks.
        await source.wait_until(lambda: not _keys(index), WAIT_S)


class FlakySink:
    """A sink that fails once, on its `fail_on`-th apply."""

    def __init__(self, backend: MemoryBackend, fail_on: int) -> None:
        self.backend = backend
        self.fail_on = fail_on
        self.calls = 0

    async def apply(self, batch: Batch) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise ConnectionError("index unavailable")
        await self.backend.apply(batch)


async def test_a_failing_sink_restarts_the_source_and_rebuilds_from_replay(
    context: zmq.asyncio.Context,
) -> None:
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    # Apply 1 is the first message's clear, 2 is seq 0, 3 (seq 1) fails.
    sink = FlakySink(MemoryBackend(index), fail_on=3)
    source = _source(publisher.endpoint, context, sink, replay=publisher.replay_endpoint)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(1)))
            await publisher.publish(_message(1, _stored(2, parent=1)))
            await source.wait_until(lambda: source.counters.num_restarts == 1, WAIT_S)
            await publisher.wait_subscribed()  # the restarted loop subscribes again
            await publisher.publish(_message(2, {"type": "BlockRemoved", "block_hashes": [1]}))
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {2}
    assert publisher.replay_requests == [0]
    assert source.counters.num_resets == 2


class SlowSink:
    """An index slower than its publisher (a slow Redis): each batch takes `delay_s`."""

    def __init__(self, backend: MemoryBackend, delay_s: float) -> None:
        self.backend = backend
        self.delay_s = delay_s

    async def apply(self, batch: Batch) -> None:
        await asyncio.sleep(self.delay_s)
        await self.backend.apply(batch)


async def test_a_publisher_faster_than_the_index_fills_the_queue_to_its_bytes_only(
    context: zmq.asyncio.Context,
) -> None:
    """A burst of large batches (some 100 KB each: a long prompt's blocks) to a slow index.
    The receive queue holds at most `receive_queue_bytes` of them and drops the oldest past
    that (before, the SUB queued 100,000 messages whatever their size: some 10 GB of such
    batches); the drops are gaps, healed from the replay, and once the publisher stops the
    index holds exactly what the engine does: no block missing, none stale."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    bound = 1024 * 1024  # some 10 batches
    source = _source(
        publisher.endpoint,
        context,
        SlowSink(MemoryBackend(index), delay_s=0.002),
        replay=publisher.replay_endpoint,
        receive_queue_bytes=bound,
    )
    padding = b"\x00" * 100_000  # a field this version does not know, ignored
    cached: set[int] = set()
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(200):
                events: list[object] = [{**_stored(seq), "padding": padding}]
                cached.add(seq)
                if seq % 7 == 6:  # the engine evicts an older block now and then
                    events.append({"type": "BlockRemoved", "block_hashes": [seq - 3]})
                    cached.discard(seq - 3)
                await publisher.publish(_message(seq, *events))
            await source.wait_until(lambda: source.last_seq == 199, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_queue_drops > 0  # the queue was full...
    assert source.receive_queue.peak_bytes <= bound  # ...at its bound in bytes, never past it
    assert source.counters.num_gaps > 0 and source.counters.num_bad_messages == 0
    assert _keys(index) == cached


class ResyncingSink:
    """An index that loses the worker (asks its source for a resync, as a restarted Redis
    does) while it applies its `lose_on`-th batch."""

    def __init__(self, backend: MemoryBackend, lose_on: int) -> None:
        self.backend = backend
        self.lose_on = lose_on
        self.calls = 0
        self.source: ZmqSource | None = None

    async def apply(self, batch: Batch) -> None:
        self.calls += 1
        await self.backend.apply(batch)
        if self.calls == self.lose_on and self.source is not None:
            self.source.request_resync()


async def test_live_copies_of_the_start_replay_are_duplicates_after_a_second_resync(
    context: zmq.asyncio.Context,
) -> None:
    """Seq 0 is published while the source waits for its start replay, so the replay holds
    it and its live copy is still queued when the index asks for a resync. The second replay
    holds it again: the live copy is a duplicate, not an engine restart (which would clear
    the worker a third time)."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)  # its replay socket does not answer yet
    sink = ResyncingSink(MemoryBackend(index), lose_on=2)  # 1: the start's clear, 2: seq 0
    source = _source(
        publisher.endpoint,
        context,
        sink,
        replay=publisher.replay_endpoint,
        rebuild_at_start=True,
    )
    sink.source = source
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(1)))  # queued behind the start replay
            publisher.start_replay()
            await source.wait_until(lambda: source.counters.num_duplicates == 1, WAIT_S)
            await publisher.publish(_message(1, _stored(2, parent=1)))
            await source.wait_until(lambda: source.last_seq == 1, WAIT_S)
    finally:
        await publisher.close()
    assert publisher.replay_requests == [0, 0]  # the start's and the resync's
    assert (source.counters.num_resyncs, source.counters.num_resets) == (1, 2)
    assert _keys(index) == {1, 2}


async def test_a_batch_with_a_newer_vllms_trailing_field_is_applied_not_dropped(
    context: zmq.asyncio.Context,
) -> None:
    """An EventBatch array with a 4th element (a field a newer vLLM appends) is read as vLLM
    reads it: the first three elements, the rest ignored; it is no bad message."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(publisher.endpoint, context, MemoryBackend(index))
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_message(0, _stored(1)))
            newer = msgpack.packb([1.0, [_stored(2, parent=1)], 0, {"future": 1}])
            await publisher.send([TOPIC, _seq(1), newer])
            await source.wait_until(lambda: source.last_seq == 1, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_bad_messages == 0
    assert _keys(index) == {1, 2}


async def test_two_frame_messages_without_a_topic(context: zmq.asyncio.Context) -> None:
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(publisher.endpoint, context, MemoryBackend(index), topic="")
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_message(0, _stored(1))[1:])
            await publisher.send(_message(1, _stored(2, parent=1))[1:])
            await source.wait_until(lambda: source.last_seq == 1, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {1, 2}


async def test_a_source_with_a_topic_receives_two_frame_messages_too(
    context: zmq.asyncio.Context,
) -> None:
    """A 2-frame message has no topic frame (ZMQ's prefix filter sees its seq): a source with
    a topic still receives it, beside its topic's 3-frame messages, and no other topic's."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(publisher.endpoint, context, MemoryBackend(index), topic="kv@")
    try:
        async with running(source.run()):
            await publisher.wait_subscribed(topic=b"kv@")
            await publisher.wait_subscribed(topic=b"\x00")
            await publisher.send(_message(0, _stored(1))[1:])
            # Other topics, one sharing the 2-frame prefix: not this source's.
            await publisher.send([b"other", *_message(1, _stored(8, parent=1))[1:]])
            await publisher.send([b"\x00other", *_message(1, _stored(9, parent=1))[1:]])
            await publisher.send(_message(1, _stored(2, parent=1)))
            await publisher.send(_message(2, _stored(3, parent=2))[1:])
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {1, 2, 3}
    assert (source.counters.num_gaps, source.counters.num_resets) == (0, 1)  # the first's


async def test_a_lora_block_named_by_lora_id_only_is_not_indexed_as_the_base_models(
    context: zmq.asyncio.Context,
) -> None:
    """Older vLLM names a LoRA adapter's blocks by `lora_id` alone (positional events, no
    `lora_name`). Canonical keys must carry the adapter's name: keyed from the tokens alone,
    the LoRA's block would answer a base-model prompt that the engine cannot serve from it.
    It is skipped and counted; its base-model sibling is indexed."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    translator = WorkerTranslator(
        TranslateOptions("w0", "10.0.0.1:8000", hash_mode=HashMode.CANONICAL)
    )
    settings = ZmqSourceSettings(endpoint=publisher.endpoint, topic="kv@", rebuild_at_start=False)
    source = ZmqSource(settings, translator, MemoryBackend(index), context=context)
    lora_tokens, base_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    # vLLM <= 0.10: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]
    events = [
        ["BlockStored", [101], None, lora_tokens, 4, 7, "GPU"],
        ["BlockStored", [202], None, base_tokens, 4, None, "GPU"],
    ]
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_message(0, *events))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == set(block_keys(base_tokens, 4))
    assert translator.counters.num_unresolved == 1
    assert source.counters.num_bad_events == 0


@pytest.mark.parametrize("published", ["kv@gpu-0@Llama-3", ""])
async def test_a_topic_the_publisher_never_sends_is_told_by_the_replay_once(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture, published: str
) -> None:
    """The SUB's topic filter runs at the publisher, so a mistyped `topic` brings nothing
    live and nothing counted: the replay, which answers whatever the topic, says it. Once:
    here the start's replay answers before the SUB reaches the PUB, so the SUB's connection
    asks the replay again, and both hold batches under another topic only (before, each
    warned: twice at start). vLLM's default topic "" is such a topic too: its replies' empty
    topic frame is not the absent one of older vLLM's replies (before, the replay indexed
    block 1 for good, and nothing warned)."""
    endpoint = f"tcp://127.0.0.1:{restartable_port()}"  # nobody listening there yet
    index = PrefixIndex()
    publisher = FakeKvPublisher(context, endpoint=endpoint, pub_now=False)
    publisher.start_replay()
    await publisher.publish(
        [published.encode(), _seq(0), msgpack.packb([0.0, [_stored(1)], 0])], live=False
    )
    source = _source(
        endpoint,
        context,
        MemoryBackend(index),
        replay=publisher.replay_endpoint,
        topic="kv@gpu-0@llama",
        rebuild_at_start=True,
    )
    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.counters.num_replays >= 1, WAIT_S)
            assert _keys(index) == set()
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed(topic=TWO_FRAME_PREFIX)
            # A message without a topic frame, taken whatever the topic: once it is applied,
            # the replays its connection and its rebuild ask for have answered.
            # (Sent only: in the replay buffer it would be a batch under the source's topic.)
            await publisher.send([_seq(1), msgpack.packb([1.0, [_stored(7)], 0])])
            await source.wait_until(lambda: 7 in _keys(index), WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {7}
    assert len(publisher.replay_requests) >= 2  # the start's, then the connection's
    warned = [r.getMessage() for r in caplog.records if "is `topic` right?" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"under topic {published!r} only" in warned[0], warned
    assert "'kv@gpu-0@llama'" in warned[0], warned


def _rank_message(seq: int, rank: int, *events: object) -> list[bytes]:
    return [TOPIC, _seq(seq), msgpack.packb([float(seq), list(events), rank])]


@contextlib.asynccontextmanager
async def _rank1_with_rank0s_replay(
    context: zmq.asyncio.Context, index: PrefixIndex, *, rebuild_at_start: bool
) -> AsyncIterator[tuple[FakeKvPublisher, ZmqSource]]:
    """Rank 1's publisher and a source running on its PUB with the replay endpoint of rank
    0's publisher, whose replay buffer holds its seqs 0-3 (blocks 1-4)."""
    rank0 = FakeKvPublisher(context)
    rank0.start_replay()
    for seq in range(4):
        await rank0.publish(_rank_message(seq, 0, _stored(seq + 1)), live=False)
    rank1 = FakeKvPublisher(context)
    sink, replay = MemoryBackend(index), rank0.replay_endpoint
    source = _source(
        rank1.endpoint, context, sink, replay=replay, rebuild_at_start=rebuild_at_start
    )
    try:
        async with running(source.run()):
            yield rank1, source
    finally:
        await rank0.close()
        await rank1.close()


async def test_a_replay_endpoint_of_another_data_parallel_rank_never_fills_the_worker(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's rank r publishes on the endpoint's port + r and replays on the replay port + r:
    a source on rank 1's PUB whose replay endpoint was left at rank 0's. The gap's replay
    (rank 0's batches) is another stream: its batches are dropped and counted, not indexed as
    rank 1's blocks; the worker holds what rank 1 published since."""
    index = PrefixIndex()
    async with _rank1_with_rank0s_replay(context, index, rebuild_at_start=False) as (rank1, source):
        await rank1.wait_subscribed()
        await rank1.publish(_rank_message(0, 1, _stored(11)))
        await rank1.publish(_rank_message(1, 1, _stored(12)))
        await rank1.publish(_rank_message(2, 1, _stored(13)), live=False)  # a gap
        await rank1.publish(_rank_message(3, 1, _stored(14)))
        await source.wait_until(lambda: source.last_seq == 3, WAIT_S)
    # The gap's replay did not match rank 1's seq 1: cleared, and none of rank 0's blocks.
    assert _keys(index) == {14}
    assert source.counters.num_bad_messages == 3  # rank 0's seqs 0-2, before the trigger
    assert any("data-parallel rank 0" in r.getMessage() for r in caplog.records)


async def test_another_ranks_replay_at_start_is_cleared_by_the_first_live_batch(
    context: zmq.asyncio.Context,
) -> None:
    """The same misconfiguration, found at start: the rebuild from the replay runs before any
    live batch says which rank the stream is, so rank 0's blocks fill the worker; the first
    live batch (rank 1's, checked as a new connection's first) clears them, and the replay
    brings none back."""
    index = PrefixIndex()
    async with _rank1_with_rank0s_replay(context, index, rebuild_at_start=True) as (rank1, source):
        await source.wait_until(lambda: source.last_seq == 3, WAIT_S)
        assert _keys(index) == {1, 2, 3, 4}  # rank 0's, not yet known to be another's
        await rank1.wait_subscribed()
        await rank1.publish(_rank_message(4, 1, _stored(15)))
        await source.wait_until(lambda: source.last_seq == 4, WAIT_S)
    assert _keys(index) == {15}


async def test_an_unreachable_replay_endpoint_fails_the_replay_and_rebuilds(
    context: zmq.asyncio.Context,
) -> None:
    probe = context.socket(zmq.ROUTER)
    probe.bind("tcp://127.0.0.1:*")
    nobody = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    probe.close(linger=0)
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(
        publisher.endpoint, context, MemoryBackend(index), replay=nobody, replay_timeout_s=0.2
    )
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_message(0, _stored(1)))
            await publisher.send(_message(3, _stored(2)))  # seqs 1 and 2 were lost
            await source.wait_until(lambda: source.last_seq == 3, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_gaps == 1
    # From seq 0 (the last applied, to check the gap) only: asking again at once to rebuild
    # doubled the stall (2 * replay_timeout_s) of every gap on a replay that never answers.
    assert source.counters.num_replay_failures == 1
    assert _keys(index) == {2}  # cleared: block 1 may be stale after the lost batches


async def test_a_source_started_before_its_publisher_rebuilds_from_the_replay_once_connected(
    context: zmq.asyncio.Context,
) -> None:
    """The publisher is not up when the source starts (a writer lease taken over while the
    engine restarts), so the start's replay fails; the engine then comes up and publishes
    before the SUB's reconnect reaches it, then goes idle. Its first connection rebuilds the
    worker from the replay, as any reconnection does (found by the indexer soak, seed 6,
    docs/soak.md: before, the worker stayed empty until the engine's next batch)."""
    # Two free ports, nobody listening yet (below the ephemeral range: the SUB's own attempts
    # to connect must not take the port it connects to, `restartable_port`).
    endpoint, replay = (f"tcp://127.0.0.1:{restartable_port()}" for _ in range(2))
    index = PrefixIndex()
    source = _source(
        endpoint,
        context,
        MemoryBackend(index),
        replay=replay,
        replay_timeout_s=0.2,
        rebuild_at_start=True,
    )
    publisher: FakeKvPublisher | None = None
    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.counters.num_replay_failures >= 1, WAIT_S)
            publisher = FakeKvPublisher(context, endpoint=endpoint, replay_endpoint=replay)
            publisher.start_replay()
            await publisher.publish(_message(0, _stored(1, 2)), live=False)  # before the SUB
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
    finally:
        if publisher is not None:
            await publisher.close()
    assert source.counters.num_resyncs == 0  # a rebuild of its own, not one the index asked


async def test_an_empty_replay_at_start_is_retried_when_the_sub_connects(
    context: zmq.asyncio.Context,
) -> None:
    """The engine's replay ROUTER is up and answers the start's replay, empty, before the
    engine's first batch and before the SUB's connection reaches its PUB; the engine then
    publishes (the SUB misses it) and goes idle. The SUB's connection rebuilds the worker from
    the replay (found by the indexer soak, seed 13, docs/soak.md: before, the worker stayed
    empty until the engine's next batch, as when the start's replay failed)."""
    endpoint = f"tcp://127.0.0.1:{restartable_port()}"  # nobody listening there yet
    publisher = FakeKvPublisher(context, endpoint=endpoint, pub_now=False)
    publisher.start_replay()
    index = PrefixIndex()
    source = _source(
        endpoint,
        context,
        MemoryBackend(index),
        replay=publisher.replay_endpoint,
        rebuild_at_start=True,
    )
    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.counters.num_replays >= 1, WAIT_S)
            assert publisher.replay_requests == [0] and not source.counters.num_replay_failures
            await publisher.publish(_message(0, _stored(1, 2)), live=False)  # before the SUB
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_resyncs == 0  # a rebuild of its own, not one the index asked


async def test_a_failed_replay_at_start_is_retried_while_the_sub_is_connected(
    context: zmq.asyncio.Context,
) -> None:
    """A writer followed an engine into the shared index and lost its lease while the engine
    restarted; the new holder's source starts as the new process comes up: its PUB accepts the
    SUB at once, but its replay ROUTER does not answer yet, so the start's replay fails while
    the SUB is connected. The engine publishes before the SUB's connection reaches it, goes
    idle, and its ROUTER then answers. The failed replay is retried (with backoff) while
    nothing has been applied: the worker is cleared of the old process's blocks and rebuilt
    with no further message (before, both waited for the engine's next batch)."""
    index, old_engine, first = _replaying(context)
    publisher = FakeKvPublisher(context)  # its ROUTER bound, silent until `start_replay`
    try:
        async with running(first.run()):
            await old_engine.wait_subscribed()
            await old_engine.publish(_message(0, _stored(9)))
            await first.wait_until(lambda: first.last_seq == 0, WAIT_S)
        assert _keys(index) == {9}
        await old_engine.close()
        await publisher.publish(_message(0, _stored(1, 2)), live=False)  # before the SUB
        source = _starting_source(publisher, context, index, replay_timeout_s=0.2)
        async with running(source.run()):
            await publisher.wait_subscribed()
            await source.wait_until(
                lambda: source.counters.num_replay_failures >= 1 and source.link.up, WAIT_S
            )
            assert _keys(index) == {9}
            publisher.start_replay()
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
    finally:
        await old_engine.close()
        await publisher.close()
    assert source.counters.num_resyncs == 0  # a rebuild of its own, not one the index asked


async def test_an_empty_replay_at_start_clears_what_an_earlier_process_left(
    context: zmq.asyncio.Context,
) -> None:
    """A writer followed the engine into the shared index and lost its lease while the
    engine was killed; the new holder's source starts once the engine is back, idle, its
    replay buffer empty. What the index holds of the worker is the old process's: cleared at
    once, not left stale until the engine publishes again, which an idle engine never does
    (found by the indexer soak, seed 18, docs/soak.md)."""
    index, publisher, first = _replaying(context)
    try:
        async with running(first.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(1, 2)))
            await first.wait_until(lambda: first.last_seq == 0, WAIT_S)
        assert _keys(index) == {1, 2}
        await publisher.restart()  # a new engine process: nothing published, nothing buffered
        source = _starting_source(publisher, context, index)
        async with running(source.run()):
            await source.wait_until(lambda: _keys(index) == set(), WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_replay_failures == 0


async def test_a_healthy_start_beside_an_engine_yet_to_publish_clears_the_worker_once(
    context: zmq.asyncio.Context,
) -> None:
    """`resets` is 1 on a healthy run (docs/indexer.md): the source starts beside an engine
    that has published nothing, so the start's replay comes back empty and clears the worker;
    the engine's first batch then cleared it a second time, and a publisher restart (its
    disconnect, the empty replay at its reconnection, its first batch) three times. A worker
    this source cleared and has written nothing to since is not cleared again."""
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    index = PrefixIndex()
    source = _starting_source(publisher, context, index)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            # The empty replay has cleared the worker.
            await eventually(lambda: source.counters.num_resets == 1, WAIT_S)
            await publisher.publish(_message(0, _stored(1, 2)))
            await publisher.publish(_message(1, _stored(3, parent=2)))
            await source.wait_until(lambda: source.last_seq == 1, WAIT_S)
            assert _keys(index) == {1, 2, 3}
            assert source.counters.num_resets == 1
            await publisher.restart()  # a new process, nothing published yet
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == set(), WAIT_S)
            await publisher.publish(_message(0, _stored(4)))
            await source.wait_until(lambda: _keys(index) == {4}, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_resets == 2  # the start's, then the disconnect's


async def test_an_engine_restarted_before_its_first_batch_is_rebuilt_at_its_reconnection(
    context: zmq.asyncio.Context,
) -> None:
    """The source follows an engine that has published nothing (its start's replay empty,
    nothing applied); the engine restarts, and the new process publishes before the SUB's
    reconnect reaches it, then goes idle. The reconnection rebuilds the worker from the replay,
    as after a publisher that had published (found by tests/indexer/
    test_zmq_intake_property.py: before, the worker missed that batch until the engine's next
    one)."""
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    index = PrefixIndex()
    source = _starting_source(publisher, context, index)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await source.wait_until(
                lambda: source.link.up and source.counters.num_resets == 1, WAIT_S
            )
            publisher.close_pub()  # the engine gone
            await source.wait_until(lambda: not source.link.up, WAIT_S)
            publisher.buffer.clear()  # a new process, which publishes before the SUB reaches it
            await publisher.publish(_message(0, _stored(1, 2)), live=False)
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_resyncs == 0  # a rebuild of its own, not one the index asked


async def test_a_batch_published_between_the_start_replay_and_the_subs_connection_is_indexed(
    context: zmq.asyncio.Context,
) -> None:
    """The source starts as the engine comes up: the engine's replay ROUTER answers the
    start's replay with its first batch, the engine publishes its next one before the SUB's
    connection reaches its PUB (the SUB misses it) and goes idle. The connection checks the
    stream against the replay at once: the missed batch is indexed with no later batch to
    show the gap (found by tests/indexer/test_zmq_intake_property.py: before, the check
    waited for the connection's first message, and the worker lacked the batch until the
    engine's next one)."""
    endpoint = f"tcp://127.0.0.1:{restartable_port()}"  # nobody listening there yet
    publisher = FakeKvPublisher(context, endpoint=endpoint, pub_now=False)
    publisher.start_replay()
    await publisher.publish(_message(0, _stored(1, 2)), live=False)
    index = PrefixIndex()
    source = _starting_source(publisher, context, index)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
            await publisher.publish(_message(1, _stored(3, parent=2)), live=False)  # missed
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == {1, 2, 3}, WAIT_S)
    finally:
        await publisher.close()
    assert publisher.replay_requests == [0, 0]  # the start's, then the connection's check
    assert (source.counters.num_resets, source.counters.num_resyncs) == (1, 0)
    # Counted as the connection's heal (before, nowhere), not as a gap: no message showed one.
    assert (source.counters.num_connection_heals, source.counters.num_gaps) == (1, 0)


async def test_a_new_process_behind_the_start_replay_is_rebuilt_at_the_subs_connection(
    context: zmq.asyncio.Context,
) -> None:
    """The start's replay reads an engine process's buffer before the SUB's connection
    reaches its PUB; that process is replaced by a new one (on the same ports), which
    publishes before the SUB's connection and goes idle. The connection's check finds
    another batch at the last applied seq: the worker is rebuilt from the new process's
    buffer, the old process's blocks gone, with no later batch."""
    endpoint = f"tcp://127.0.0.1:{restartable_port()}"  # nobody listening there yet
    publisher = FakeKvPublisher(context, endpoint=endpoint, pub_now=False)
    publisher.start_replay()
    await publisher.publish(_message(0, _stored(1, 2)), live=False)
    index = PrefixIndex()
    breaks: list[int] = []
    source = _starting_source(publisher, context, index)
    source.on_sequence_break = lambda: breaks.append(1)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
            publisher.buffer.clear()  # a new process, publishing before the SUB reaches it
            await publisher.publish(_message(0, _stored(7)), live=False)
            await publisher.publish(_message(1, _stored(8, parent=7)), live=False)
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == {7, 8}, WAIT_S)
    finally:
        await publisher.close()
    assert publisher.replay_requests == [0, 0, 0]  # the start's, the check's, the rebuild's
    assert breaks == [1]  # a sequence break: another process
    assert source.counters.num_resyncs == 0


# An engine's seq 1, storing block 3 after blocks 1 and 2 (seq 0).
SEQ_1 = _message(1, _stored(3, parent=2))


@contextlib.asynccontextmanager
async def _started_before_the_pub_is_up(
    context: zmq.asyncio.Context,
    index: PrefixIndex,
    breaks: list[int],
    *,
    replay_timeout_s: float = 5.0,
) -> AsyncIterator[tuple[FakeKvPublisher, ZmqSource]]:
    """An engine whose replay ROUTER holds seq 0 and 1 (blocks 1 and 2, then 3) and whose PUB
    is not up yet (`open_pub_when_free`), and a source running on it into `index` (its
    sequence breaks appended to `breaks`), once its start's replay has applied both."""
    endpoint = f"tcp://127.0.0.1:{restartable_port()}"  # nobody listening there yet
    publisher = FakeKvPublisher(context, endpoint=endpoint, pub_now=False)
    publisher.start_replay()
    await publisher.publish(_message(0, _stored(1, 2)), live=False)
    await publisher.publish(SEQ_1, live=False)
    source = _starting_source(publisher, context, index, replay_timeout_s=replay_timeout_s)
    source.on_sequence_break = lambda: breaks.append(1)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: _keys(index) == {1, 2, 3}, WAIT_S)
            yield publisher, source
    finally:
        await publisher.close()


async def test_a_live_copy_of_a_start_replay_batch_read_after_the_connections_check_is_a_duplicate(
    context: zmq.asyncio.Context,
) -> None:
    """The start's replay applied seq 0 and 1; the SUB's connection is checked against the
    replay (nothing new), and only then is a live copy of seq 1 read (published as the SUB
    connected, still on its way while the check ran). It is a duplicate, not an engine
    restart: the worker keeps its blocks, no sequence break (before, the check forgot what
    the start's replay had applied, and the copy cleared the worker as a seq reset)."""
    index = PrefixIndex()
    breaks: list[int] = []
    async with _started_before_the_pub_is_up(context, index, breaks) as (publisher, source):
        await publisher.open_pub_when_free()
        await publisher.wait_subscribed()
        # The check's replay (seq 1 alone) answered and handled.
        await source.wait_until(lambda: source.counters.num_replayed_messages == 3, WAIT_S)
        await publisher.send(SEQ_1)  # the live copy, read after the check
        await publisher.publish(_message(2, _stored(4, parent=3)))
        await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
        assert publisher.replay_requests == [0, 1]  # the start's, the connection's check
    assert _keys(index) == {1, 2, 3, 4}
    assert source.counters.num_duplicates == 1
    assert source.counters.num_connection_heals == 0  # (the check found nothing missed)
    assert (source.counters.num_resets, breaks) == (1, [])


async def test_a_live_copy_of_a_replayed_batch_after_a_failed_connection_check_is_a_duplicate(
    context: zmq.asyncio.Context,
) -> None:
    """The start's replay applied seq 0 and 1, then the replay stops answering: the SUB's
    connection cannot be checked. The first live message is a copy of seq 1 (the same bytes:
    the same process, and the SUB connected before it was sent): a duplicate, which the
    worker's blocks survive, with no sequence break (before, a failed check rebuilt the
    worker from that old batch alone)."""
    index = PrefixIndex()
    breaks: list[int] = []
    started = _started_before_the_pub_is_up(context, index, breaks, replay_timeout_s=0.2)
    async with started as (publisher, source):
        await publisher.stop_replay()
        await publisher.open_pub_when_free()
        await publisher.wait_subscribed()
        await source.wait_until(lambda: source.counters.num_replay_failures >= 1, WAIT_S)
        await publisher.send(SEQ_1)  # the live copy
        await publisher.publish(_message(2, _stored(4, parent=3)))
        await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
    assert _keys(index) == {1, 2, 3, 4}
    assert source.counters.num_duplicates == 1
    assert (source.counters.num_resets, breaks) == (1, [])


async def test_a_restart_while_the_connections_check_replays_is_one_sequence_break(
    context: zmq.asyncio.Context,
) -> None:
    """The SUB connects to an engine process whose replay ROUTER is slow: while the
    connection's check waits for its replay, the process is replaced by a new one (on the
    same ports), which answers the check. The worker is cleared at the old connection's end
    and rebuilt once from the new process's buffer, one sequence break told (before, the
    check rebuilt the worker from the new process, then the end read after it cleared and
    rebuilt it again: two breaks, two rebuilds)."""
    index = PrefixIndex()
    breaks: list[int] = []
    rebuilt = [0, 1, 0]  # the start's replay, the check's, the rebuild's
    async with _started_before_the_pub_is_up(context, index, breaks) as (publisher, source):
        await publisher.stop_replay()  # the check's request waits
        await publisher.open_pub_when_free()
        await publisher.wait_subscribed()
        await eventually(lambda: source.counters.num_replays == 2, WAIT_S)
        await publisher.restart()  # the new process
        await publisher.publish(_message(0, _stored(7)), live=False)
        await publisher.wait_subscribed()  # the SUB's new connection
        publisher.start_replay()  # the new process answers the check
        await source.wait_until(
            lambda: publisher.replay_requests == rebuilt and _keys(index) == {7}, WAIT_S
        )
        await publisher.publish(_message(1, _stored(8, parent=7)))
        await source.wait_until(lambda: _keys(index) == {7, 8}, WAIT_S)
        assert publisher.replay_requests == rebuilt  # (no second rebuild)
    assert breaks == [1]
    assert source.counters.num_resets == 2  # at the start, at the old connection's end


class _LinkAskingAResync(Link):
    """A source's link that, the first time it goes up (the SUB's connection acted on, its
    check still to make), has the index ask the source for a resync: an index that loses the
    worker at that very moment, made deterministic."""

    def __init__(self, source: ZmqSource) -> None:
        super().__init__(source.link.reason)
        self.source: ZmqSource | None = source

    def went_up(self) -> None:
        super().went_up()
        if self.source is not None:
            self.source.request_resync()
            self.source = None


async def test_a_resync_asked_as_the_sub_connects_leaves_the_connection_checked(
    context: zmq.asyncio.Context,
) -> None:
    """The start's replay applied seq 0 and 1 of an engine process, which is replaced (on the
    same ports) before the SUB's connection reaches it; the new process publishes its seq 0.
    The index asks for a resync as the connection is acted on, before its check. The check is
    made first: the new process is told as a sequence break, and the first live message is
    applied with no replay (before, the resync took the check's place: no break was told, and
    the check was left to the first message, a replay for nothing). The check's rebuild, from
    a replay made after the index asked, serves the resync: the worker is rebuilt once (before,
    the resync's own replay cleared and rebuilt it a second time)."""
    index = PrefixIndex()
    breaks: list[int] = []
    async with _started_before_the_pub_is_up(context, index, breaks) as (publisher, source):
        source.link = _LinkAskingAResync(source)
        publisher.buffer.clear()  # a new process, publishing before the SUB reaches it
        await publisher.publish(_message(0, _stored(7)), live=False)
        await publisher.open_pub_when_free()
        await publisher.wait_subscribed()
        await source.wait_until(lambda: source.counters.num_resyncs == 1, WAIT_S)
        # (Applied live, or by the resync's replay and then a duplicate: either way after it.)
        await publisher.publish(_message(1, _stored(8, parent=7)))
        await source.wait_until(lambda: _keys(index) == {7, 8}, WAIT_S)
        # The start's, the check's (seq 1 no longer held), its rebuild's (the resync's too).
        assert publisher.replay_requests == [0, 1, 0]
    assert breaks == [1]
    assert source.counters.num_resyncs == 1
    assert source.counters.num_resets == 2  # at the start, at the check's rebuild


async def test_a_resync_asked_as_the_sub_connects_does_not_replay_again_after_the_checks_failed(
    context: zmq.asyncio.Context,
) -> None:
    """The start's replay applied seq 0 and 1, then the engine's replay ROUTER stops
    answering; the index asks for a resync as the SUB's connection is acted on. The check's
    replay fails (one stall of `replay_timeout_s`); the resync clears the worker and leaves
    its rebuild to the retry (with the backoff) or the first message, without a second replay
    at once (before, it asked again and stalled the source twice as long, on a ROUTER that
    had just not answered, as a failed resync alone never did)."""
    index = PrefixIndex()
    breaks: list[int] = []
    failures_at_the_clear: list[int] = []

    def cleared() -> bool:
        if source.counters.num_resyncs == 1 and _keys(index) == set():
            failures_at_the_clear.append(source.counters.num_replay_failures)
            return True
        return False

    started = _started_before_the_pub_is_up(context, index, breaks, replay_timeout_s=0.5)
    async with started as (publisher, source):
        source.link = _LinkAskingAResync(source)
        await publisher.stop_replay()
        await publisher.open_pub_when_free()
        await publisher.wait_subscribed()
        await source.wait_until(cleared, WAIT_S)
        publisher.start_replay()  # the retry rebuilds the worker
        await source.wait_until(lambda: _keys(index) == {1, 2, 3}, WAIT_S)
    assert failures_at_the_clear == [1]  # the check's alone
    assert breaks == []


async def _resync_while_the_replay_fails(
    publisher: FakeKvPublisher, source: ZmqSource, index: PrefixIndex
) -> None:
    """The publisher's first batch indexed, its replay ROUTER stops answering, and the index
    asks for a resync."""
    await publisher.wait_subscribed()
    await publisher.publish(_message(0, _stored(1)))
    await source.wait_until(lambda: _keys(index) == {1}, WAIT_S)
    await publisher.stop_replay()
    source.request_resync()


async def test_a_resync_retried_after_its_replay_failed_is_logged_as_one(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The index asks for a resync while the engine's replay ROUTER does not answer: the
    resync's replay fails, and is retried (the SUB is connected) until the ROUTER answers,
    which rebuilds the worker. The retries are logged as the index's resync retried (before,
    as "the publisher is back": a reconnection that never happened), and the resync counts
    once."""
    caplog.set_level(logging.DEBUG, logger="indexer.sources.zmq")  # (where retries log)
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    sink = MemoryBackend(index)
    source = _source(
        publisher.endpoint, context, sink, replay=publisher.replay_endpoint, replay_timeout_s=0.2
    )
    try:
        async with running(source.run()):
            await _resync_while_the_replay_fails(publisher, source, index)
            # The resync's replay failed (the worker cleared), and a retry's.
            await eventually(lambda: source.counters.num_replay_failures >= 2, WAIT_S)
            assert _keys(index) == set()
            publisher.start_replay()
            await source.wait_until(lambda: _keys(index) == {1}, WAIT_S)
    finally:
        await publisher.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "indexer.sources.zmq"]
    assert any("the index's resync is retried" in line for line in logged)
    assert not any("the publisher is back" in line for line in logged)
    assert source.counters.num_resyncs == 1


class _RecordedBackoff(Backoff):
    """A backoff that records each wait the source asks of it."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        super().__init__(initial_s, max_s)
        self.taken: list[float] = []

    def take(self) -> float:
        delay = super().take()
        self.taken.append(delay)
        return delay


async def test_a_replay_that_answers_starts_the_retry_backoff_from_its_shortest_wait(
    context: zmq.asyncio.Context,
) -> None:
    """The index asks for a resync while the engine's replay ROUTER does not answer: the
    retries wait longer each time until the ROUTER answers. A later resync whose replay fails
    again is retried after the shortest wait (before, only a new connection reset the
    backoff: a replay that answered did not, and that first retry waited as long as the last
    of the episode before, up to `backoff_max_s`; tests/indexer/test_zmq_intake_property.py
    found it)."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source = _source(
        publisher.endpoint,
        context,
        MemoryBackend(index),
        replay=publisher.replay_endpoint,
        replay_timeout_s=0.2,
        backoff_s=(0.05, 60.0),
    )
    backoff = source.replay_backoff = _RecordedBackoff(0.05, 60.0)
    try:
        async with running(source.run()):
            await _resync_while_the_replay_fails(publisher, source, index)
            await eventually(lambda: len(backoff.taken) >= 3, WAIT_S)
            publisher.start_replay()  # a retry answers: the worker is rebuilt
            await source.wait_until(lambda: _keys(index) == {1}, WAIT_S)
            episode = len(backoff.taken)
            await publisher.stop_replay()
            source.request_resync()
            await eventually(lambda: len(backoff.taken) > episode, WAIT_S)
    finally:
        await publisher.close()
    assert backoff.taken[:3] == [0.05, 0.1, 0.2]  # (the first episode: doubling)
    assert backoff.taken[episode] == 0.05


async def test_a_resync_asked_while_the_publisher_is_away_leaves_the_rebuild_to_its_connection(
    context: zmq.asyncio.Context,
) -> None:
    """The publisher's connection ends (the worker cleared until it is back), and the index
    asks for a resync meanwhile, while the engine's next process, its replay ROUTER up on the
    same port before its PUB, holds seq 0; it then publishes seq 1 before the SUB's connection
    reaches its PUB, and goes idle. The resync clears the worker and leaves its rebuild to the
    publisher's connection, whose replay holds both (before, the resync rebuilt the worker
    from the replay while the publisher was away, which had the connection skip its rebuild
    as done: seq 1 stayed missing until the engine's next batch). A resync asked as the SUB
    connects came to this too: the connection's check, made first, read the publisher's end
    as its replay answered, and the resync after it rebuilt while the publisher was away."""
    index, publisher, source = _replaying(context)
    breaks: list[int] = []
    source.on_sequence_break = lambda: breaks.append(1)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(1, 2)))
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
            publisher.close_pub()  # the engine's process gone
            await source.wait_until(lambda: not source.link.up, WAIT_S)
            publisher.buffer.clear()  # its next process, its PUB not up yet
            await publisher.publish(_message(0, _stored(7)), live=False)
            source.request_resync()
            await source.wait_until(lambda: source.counters.num_resyncs == 1, WAIT_S)
            assert _keys(index) == set()  # (no rebuild while the publisher is away)
            await publisher.publish(_message(1, _stored(8, parent=7)), live=False)  # missed
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed()
            await source.wait_until(lambda: _keys(index) == {7, 8}, WAIT_S)
    finally:
        await publisher.close()
    assert breaks == [1]  # the publisher back: maybe another process


async def test_a_restart_hidden_behind_a_gap_clears_the_old_processs_blocks(
    context: zmq.asyncio.Context,
) -> None:
    """The SUB misses a restarted engine's first batches and the new process's seq has
    already passed the old expected one: it looks like a gap the replay covers, but the
    replayed batch at the last applied seq is not the one applied."""
    index, publisher, source = _replaying(context)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(3):  # the old process
                await publisher.publish(_message(seq, _stored(100 + seq)))
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
            assert _keys(index) == {100, 101, 102}
            # A new process, a new replay buffer, seq from 0; the SUB misses seqs 0-4.
            publisher.buffer.clear()
            for seq in range(5):
                await publisher.publish(_message(seq, _stored(200 + seq)), live=False)
            await publisher.publish(_message(5, _stored(205)))
            await source.wait_until(lambda: source.last_seq == 5, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {200, 201, 202, 203, 204, 205}
    assert source.counters.num_gaps == 1
    assert source.counters.num_resets == 2  # the first message's clear, then the restart's
    assert publisher.replay_requests == [2, 0]  # the check of seq 2, then the rebuild


async def test_a_seq_reset_is_a_sequence_break_a_first_message_or_a_resync_is_not(
    context: zmq.asyncio.Context,
) -> None:
    """`on_sequence_break` (what has the controller read a restarted engine's identity again)
    is told of a publisher that started its seqs over, not of the clears that a source's own
    start or a resync request causes: those are no sign of a new process."""
    index, publisher, source = _replaying(context)
    breaks: list[int | None] = []
    source.on_sequence_break = lambda: breaks.append(source.last_seq)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(3):  # the first message clears the worker too
                await publisher.publish(_message(seq, _stored(100 + seq)))
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
            source.request_resync()
            await source.wait_until(lambda: source.counters.num_resyncs == 1, WAIT_S)
            assert breaks == []
            # A new process, a new replay buffer, seq from 0 again.
            publisher.buffer.clear()
            await publisher.publish(_message(0, _stored(200)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {200}
    assert breaks == [0]  # told once the new process's batch is in


async def test_a_restart_inside_a_just_replayed_range_is_not_taken_for_a_duplicate(
    context: zmq.asyncio.Context,
) -> None:
    index, publisher, source = _replaying(context)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(100)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            # Seq 1 is lost and seq 3 is buffered before seq 2 arrives: the gap's replay
            # applies 1 to 3, and a live seq 3 would then be a duplicate.
            await publisher.publish(_message(1, _stored(101)), live=False)
            publisher.buffer[3] = _message(3, _stored(103))
            await publisher.publish(_message(2, _stored(102)))
            await source.wait_until(lambda: source.last_seq == 3, WAIT_S)
            assert _keys(index) == {100, 101, 102, 103}
            # The engine restarts before sending seq 3 live; the SUB misses the new 0-2.
            publisher.buffer.clear()
            for seq in range(3):
                await publisher.publish(_message(seq, _stored(200 + seq)), live=False)
            await publisher.publish(_message(3, _stored(203)))
            await source.wait_until(lambda: source.counters.num_resets == 2, WAIT_S)
            await publisher.publish(_message(4, _stored(204)))
            await source.wait_until(lambda: source.last_seq == 4, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {200, 201, 202, 203, 204}
    assert source.counters.num_duplicates == 1  # only seq 2, which the replay applied
    assert publisher.replay_requests == [0, 0]


async def test_a_restart_that_resumes_at_the_expected_seq_is_told_by_the_new_connection(
    context: zmq.asyncio.Context,
) -> None:
    """The first seq the SUB gets from the new process is exactly the one the old process
    would have sent next: neither a gap nor a seq reset; the old connection's end and the new
    one tell."""
    index, publisher, source = _replaying(context)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(3):
                await publisher.publish(_message(seq, _stored(100 + seq)))
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
            await publisher.restart()
            await publisher.wait_subscribed()  # the SUB reconnected
            for seq in range(3):  # missed: sent before the SUB was back
                await publisher.publish(_message(seq, _stored(200 + seq)), live=False)
            await publisher.publish(_message(3, _stored(203)))
            await source.wait_until(lambda: source.last_seq == 3, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == {200, 201, 202, 203}
    assert source.counters.num_gaps == 0
    # The disconnection told the restart: the worker is rebuilt from seq 0, seq 2 never
    # needs checking (whether the rebuild came before the new process buffered anything, and
    # then its first live message rebuilt it again, is a race of the test's own).
    assert set(publisher.replay_requests) == {0}


def _poisoned_message(seq: int) -> list[bytes]:
    """Three events: extra_keys nested 900 deep (valid msgpack, beyond Python's recursion
    limit if walked recursively), a block_size beyond uint32, and a good sibling (201)."""
    deep = msgpack.packb({**_stored(200), "extra_keys": None})[:-1] + b"\x91" * 900 + b"\xc0"
    too_big = {**_stored(100), "block_size": 1 << 33}
    events = b"\x93" + deep + msgpack.packb(too_big) + msgpack.packb(_stored(201))
    payload = b"\x93" + msgpack.packb(float(seq)) + events + b"\xc0"
    assert len(msgpack.unpackb(payload)[1]) == 3
    return [TOPIC, _seq(seq), payload]


@contextlib.asynccontextmanager
async def _served_source(
    context: zmq.asyncio.Context, backend_name: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[FakeKvPublisher, ZmqSource, grpc.aio.Channel]]:
    """A publisher with a replay, a source following it into a `backend_name` index, and a
    channel to that index's gRPC services, all running for the block."""
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    async with FACTORIES[backend_name](request) as backend:
        services, _, _ = index_services(
            backend, default_block_size=16, max_concurrent_prefix_queries=4
        )
        server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
        source = _source(publisher.endpoint, context, backend, replay=publisher.replay_endpoint)
        try:
            async with running(source.run()), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                yield publisher, source, ch
        finally:
            await publisher.close()
            await server.stop(None)


@pytest.mark.parametrize("backend_name", ["memory", "redis"])
async def test_poison_events_are_skipped_and_the_source_and_index_keep_working(
    context: zmq.asyncio.Context, backend_name: str, request: pytest.FixtureRequest
) -> None:
    async with _served_source(context, backend_name, request) as (publisher, source, ch):
        await publisher.wait_subscribed()
        await publisher.publish(_message(0, _stored(1)))
        await publisher.publish(_poisoned_message(1))
        await publisher.publish(_message(2, _stored(300)))
        await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
        assert source.counters.num_bad_events == 2
        assert source.counters.num_restarts == 0
        assert source.counters.num_resets == 1  # only the first message's clear
        stub = kv_grpc.KVIndexerStub(ch)
        # Later writes, of another worker too, land and are answered.
        report = kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=[9])
        await stub.ApplyExternalKvBatch(
            kv.ApplyExternalKvBatchRequest(worker_id="w9", actions=[report])
        )
        reply = await stub.MatchExternalKv(
            kv.MatchExternalKvRequest(hashes=[1, 100, 200, 201, 300, 9])
        )
        held = {(m.worker_id, h) for m in reply.matches for t in m.hashes_by_tier for h in t.hashes}
        assert held == {("w0", 1), ("w0", 201), ("w0", 300), ("w9", 9)}
        dump = api_grpc.KvIndexStub(ch).DumpIndex(api.DumpIndexRequest())
        assert {b.worker_id async for b in dump} == {"w0", "w9"}


def _group_event(kind: str, group: int, *hashes: int, window: int | None = None) -> object:
    """A vLLM BlockStored of one KV cache group (map form), 16 tokens per block."""
    return {
        **_stored(*hashes),
        "token_ids": list(range(16 * len(hashes))),
        "block_size": 16,
        "group_idx": group,
        "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": window,
    }


def _evicted(group: int, *hashes: int) -> object:
    return {
        "type": "BlockRemoved",
        "block_hashes": list(hashes),
        "medium": "GPU",
        "group_idx": group,
    }


@pytest.mark.parametrize("backend_name", ["memory", "redis"])
async def test_a_hybrid_models_sliding_window_evictions_shorten_its_prefix_matches(
    context: zmq.asyncio.Context, backend_name: str, request: pytest.FixtureRequest
) -> None:
    """A Gemma-like engine (full attention + a 33-token sliding window, so a hit needs the 32
    tokens before its boundary) stores blocks 1-4 in both groups, then its sliding-window
    group evicts block 3, then block 2: MatchExternalKvPrefix drops from 4 to 2 to 1 blocks,
    though the full-attention group still holds all four."""
    async with _served_source(context, backend_name, request) as (publisher, source, ch):
        stub = kv_grpc.KVIndexerStub(ch)

        async def prefix_after(seq: int, *events: object) -> list[tuple[str, str, int]]:
            await publisher.publish(_message(seq, *events))
            await source.wait_until(lambda: source.last_seq == seq, WAIT_S)
            reply = await stub.MatchExternalKvPrefix(
                kv.MatchExternalKvPrefixRequest(hashes=[1, 2, 3, 4])
            )
            return [(m.worker_id, m.worker_address, m.matched_prefix_blocks) for m in reply.matches]

        await publisher.wait_subscribed()
        stored = await prefix_after(
            0,
            _group_event("full_attention", 0, 1, 2, 3, 4),
            _group_event("sliding_window", 1, 1, 2, 3, 4, window=33),
        )
        assert stored == [("w0", "10.0.0.1:8000", 4)]
        assert await prefix_after(1, _evicted(1, 3)) == [("w0", "10.0.0.1:8000", 2)]
        assert await prefix_after(2, _evicted(1, 2)) == [("w0", "10.0.0.1:8000", 1)]
        reply = await stub.MatchExternalKv(kv.MatchExternalKvRequest(hashes=[1, 2, 3, 4]))
        (hbm,) = reply.matches[0].hashes_by_tier
        assert list(hbm.hashes) == [1, 2, 3, 4]  # still held, in full attention
        assert list(hbm.component_masks) == [3, 1, 1, 3]


async def test_a_source_cancelled_while_its_replay_streams_in_stops(
    context: zmq.asyncio.Context,
) -> None:
    """Cancelling a source (the indexer, bridge or controller shutting down) while it reads a
    long replay must end it. While the replies are already queued on its DEALER, the source
    is suspended only at the waits for the next reply, each with that reply in hand: a
    cancellation arriving there must not be lost (`asyncio.wait_for` on Python 3.11 returns
    the reply instead, and the source then follows the publisher on forever). The replies
    here have a 7-byte seq frame, so each is counted as it is read: that shows when the
    source is reading them."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    for n in range(3000):
        publisher.buffer[n] = [TOPIC, n.to_bytes(7, "big"), b"\x90"]
    publisher.start_replay()
    source = _starting_source(publisher, context, index, replay_timeout_s=WAIT_S)
    task = asyncio.ensure_future(source.run())
    try:
        async with asyncio.timeout(WAIT_S):
            while source.counters.num_bad_messages < 100:  # noqa: ASYNC110 - no event to await
                await asyncio.sleep(0)
        task.cancel()
        # A source that lost the cancellation runs on: it is not done when the wait ends.
        await asyncio.wait({task}, timeout=WAIT_S)
        assert task.cancelled()
    finally:
        task.cancel()
        await publisher.close()


async def test_a_replay_that_keeps_failing_warns_less_and_less_often(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine's PUB is up, its replay ROUTER is not answering (dead, or not up yet): the
    start's replay is retried at every backoff, and each failure used to warn, one line every
    5 s for as long as the ROUTER stayed down. A streak warns at its 1st, 2nd, 4th, 8th, ...
    failure (each saying how many in a row), and the replay that answers at last says so."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)  # its ROUTER bound, silent until `start_replay`
    source = _starting_source(publisher, context, index, replay_timeout_s=0.05)
    caplog.set_level(logging.DEBUG, logger="indexer.sources.zmq")
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await source.wait_until(lambda: source.counters.num_replay_failures >= 9, WAIT_S)
            failures = source.counters.num_replay_failures
            warned = [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.WARNING and "replay from" in r.getMessage()
            ]
            assert len(warned) == failures.bit_length()  # at 1, 2, 4, 8, ...
            assert "failed:" in warned[0]
            assert "(8 times in a row)" in warned[3]
            publisher.start_replay()
            await publisher.publish(_message(0, _stored(1, 2)), live=False)
            await source.wait_until(lambda: _keys(index) == {1, 2}, WAIT_S)
    finally:
        await publisher.close()
    assert any("answered after" in r.getMessage() for r in caplog.records)


async def test_a_stream_of_bad_messages_warns_less_and_less_often(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A publisher of another format (or a stray sender) sends nothing but bad messages, and
    a newer engine an unknown kind of event in every batch: each used to warn (or, for the
    unknown events, nothing said so but a counter). Now the 1st, 2nd, 4th, 8th, ... of each
    warn, saying how many so far, and the source keeps applying the good ones."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(publisher.endpoint, context, MemoryBackend(index))
    caplog.set_level(logging.DEBUG, logger="indexer.sources.zmq")
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            for seq in range(100):
                await publisher.send([TOPIC, _seq(seq), b"\xc1 not msgpack"])
            for seq in range(100, 200):
                await publisher.send(_message(seq, {"type": "BlockPinned"}, _stored(seq)))
            await source.wait_until(lambda: source.last_seq == 199, WAIT_S)
    finally:
        await publisher.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    bad = [w for w in warnings if "dropping seq" in w]
    unknown = [w for w in warnings if "unknown events" in w]
    assert (source.counters.num_bad_messages, source.counters.num_unknown_events) == (100, 100)
    assert len(bad) == len(unknown) == (100).bit_length()  # at 1, 2, 4, ..., 64
    assert "(64 bad messages so far)" in bad[-1]
    assert "1 unknown events (of types 'BlockPinned'), skipped (0 and 64 so far)" in unknown[-1]
    assert _keys(index) == set(range(100, 200))


async def test_a_bad_payloads_warning_says_what_is_wrong_with_it(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """msgpack raises FormatError (a byte it never uses, 0xc1) and StackError (nesting too
    deep) without a message: the warning ended in "FormatError: " and told an operator
    nothing. It now says what the exception stands for; the source goes on."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(publisher.endpoint, context, MemoryBackend(index))
    caplog.set_level(logging.DEBUG, logger="indexer.sources.zmq")
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send([TOPIC, _seq(0), b"\xc1\xc1"])
            await publisher.send([TOPIC, _seq(1), b"\x91" * 2000])
            await publisher.send(_message(2, _stored(7)))
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
    finally:
        await publisher.close()
    bad = [r.getMessage() for r in caplog.records if "dropping seq" in r.getMessage()]
    assert len(bad) == 2
    assert "seq 0: payload is not msgpack: FormatError: Invalid msgpack format (1 bad" in bad[0]
    assert "seq 1: payload is not msgpack: StackError: Too nested (2 bad" in bad[1]
    assert _keys(index) == {7}


async def test_a_bind_that_keeps_failing_logs_less_and_less_often(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A binding source whose port another process holds (a second indexer on the host, a
    stale engine) restarts after every failed bind: each restart logged an error with its
    traceback, one every 5 s for as long as the port stayed taken. A streak logs at its 1st,
    2nd, 4th, 8th, ... failure; once the port is free the source binds and indexes."""
    holder = context.socket(zmq.PUB)
    holder.bind("tcp://127.0.0.1:*")
    endpoint = holder.getsockopt_string(zmq.LAST_ENDPOINT)
    index = PrefixIndex()
    source = _source(endpoint, context, MemoryBackend(index), bind=True)
    caplog.set_level(logging.DEBUG, logger="indexer.sources.zmq")
    publisher: FakeKvPublisher | None = None
    try:
        async with running(source.run()):
            # (no message: `wait_until` is never woken)
            await eventually(lambda: source.counters.num_restarts >= 9, WAIT_S)
            restarts = source.counters.num_restarts
            errors = [r.getMessage() for r in errors_logged(caplog)]
            assert len(errors) == restarts.bit_length()  # at 1, 2, 4, 8, ...
            assert "(8 times in a row)" in errors[3]
            holder.close(linger=0)
            await asyncio.wait_for(source.ready.wait(), WAIT_S)
            publisher = FakeKvPublisher(context, endpoint=endpoint, connect=True)
            await _publish_blocks_10_to_12(publisher, source)
    finally:
        holder.close(linger=0)
        if publisher is not None:
            await publisher.close()
    assert _keys(index) == {10, 11, 12}


async def test_a_peer_of_another_socket_type_does_not_stop_the_source_for_good(
    context: zmq.asyncio.Context,
) -> None:
    """The source's endpoint reaches a ZMQ socket that is no PUB (the replay endpoint's
    ROUTER given for the PUB's, or its port taken by one for a while): libzmq ends the
    connection at the handshake and, a protocol error, never dials again, so the SUB stayed
    unconnected for good, even once a publisher was on that port. The source now restarts
    its SUB with backoff (`restarts`, saying why), and indexes the publisher once it is
    there."""
    router = context.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    index = PrefixIndex()
    source = _source(endpoint, context, MemoryBackend(index))
    publisher: FakeKvPublisher | None = None
    try:
        async with running(source.run()):
            await eventually(lambda: source.counters.num_restarts >= 2, WAIT_S)
            assert "before its ZMTP handshake" in source.link.reason
            router.close(linger=0)
            publisher = FakeKvPublisher(context, endpoint=endpoint, pub_now=False)
            await publisher.open_pub_when_free()
            await _publish_blocks_10_to_12(publisher, source)
    finally:
        router.close(linger=0)
        if publisher is not None:
            await publisher.close()
    assert _keys(index) == {10, 11, 12}


async def test_a_gap_the_buffer_no_longer_covers_is_rebuilt_from_one_replay(
    context: zmq.asyncio.Context,
) -> None:
    """A source fell so far behind (a slow index, a burst) that the publisher dropped its
    messages and trimmed the batches after the last applied one from its replay buffer. The
    replay that checks the gap already brings the whole buffer: the rebuild takes its batches
    from it, where it asked the engine for the same buffer a second time (each such gap cost
    the engine two full replays while the source was the one behind)."""
    index, publisher, source = _replaying(context, buffer_steps=3)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(100)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            for seq in range(1, 6):  # lost live; with seq 6, the buffer keeps seqs 4-6
                await publisher.publish(_message(seq, _stored(100 + seq)), live=False)
            await publisher.publish(_message(6, {"type": "BlockRemoved", "block_hashes": [103]}))
            await source.wait_until(lambda: source.last_seq == 6, WAIT_S)
    finally:
        await publisher.close()
    assert publisher.replay_requests == [0]  # the check of seq 0, which held seqs 4-6
    assert _keys(index) == {104, 105}  # what the buffer held: missing blocks, none stale
    assert source.counters.num_resets == 2  # the first message's clear, then the gap's


async def test_a_replay_that_timed_out_at_a_connection_is_not_asked_again_at_its_first_message(
    context: zmq.asyncio.Context,
) -> None:
    """A replay endpoint that never answers: the publisher's new connection rebuilds the
    worker from the replay, which times out; its first message then rebuilds from itself
    alone, without a second replay (before, every new connection stalled the source twice
    `replay_timeout_s`: at the connection, then at the first message)."""
    silent = context.socket(zmq.ROUTER)  # takes replay requests, answers none
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    # A free port (not a probe socket's just closed: ZMQ's I/O thread frees it soon, not at
    # once, and the source's bind would then fail and wait out its backoff).
    endpoint = f"tcp://127.0.0.1:{restartable_port()}"
    index = PrefixIndex()
    source = _source(
        endpoint,
        context,
        MemoryBackend(index),
        replay=silent.getsockopt_string(zmq.LAST_ENDPOINT),
        bind=True,  # the publishers connect: no reconnect backoff of the source's to wait out
        replay_timeout_s=0.3,
        backoff_s=(60.0, 60.0),  # no retry of the failed replay while the test runs
    )
    try:
        async with running(source.run()):
            await asyncio.wait_for(source.ready.wait(), WAIT_S)
            first = FakeKvPublisher(context, endpoint=endpoint, connect=True)
            try:
                await first.wait_subscribed()
                await first.send(_message(0, _stored(1)))  # seq 0: nothing to replay
                await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            finally:
                await first.close()
            await source.wait_until(lambda: not _keys(index), WAIT_S)  # cleared at its end
            back = FakeKvPublisher(context, endpoint=endpoint, connect=True)
            try:
                await back.wait_subscribed()
                # The connection's rebuild from the replay: it times out.
                await source.wait_until(lambda: source.counters.num_replay_failures == 1, WAIT_S)
                await back.send(_message(5, _stored(6)))
                await source.wait_until(lambda: source.last_seq == 5, WAIT_S)
            finally:
                await back.close()
    finally:
        silent.close(linger=0)
    assert source.counters.num_replay_failures == 1
    assert source.counters.num_replays == 1
    assert _keys(index) == {6}


async def test_a_start_replay_that_failed_as_the_sub_connected_is_asked_again_at_its_first_message(
    context: zmq.asyncio.Context,
) -> None:
    """The engine's PUB accepts the SUB at once, its replay ROUTER answers only later: the
    start's replay fails while the SUB connects, and the engine's next batch is queued by
    then. That batch's rebuild asks the replay again, which now answers with what the engine
    published before the SUB (before, a replay failed before the connection counted as one
    failed on it: the worker was rebuilt from the batch alone, the earlier blocks missing)."""
    publisher = FakeKvPublisher(context)  # its ROUTER bound, silent until `start_replay`
    await publisher.publish(_message(0, _stored(1, 2)), live=False)  # before the SUB
    index = PrefixIndex()
    source = _starting_source(publisher, context, index, replay_timeout_s=2.0)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()  # while the start's replay waits
            await publisher.publish(_message(1, _stored(3, parent=2)))
            await source.wait_until(lambda: source.counters.num_replay_failures >= 1, WAIT_S)
            publisher.start_replay()
            await source.wait_until(lambda: source.last_seq == 1, WAIT_S)
            await source.wait_until(lambda: _keys(index) == {1, 2, 3}, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_replay_failures == 1


async def test_a_lagging_source_rebuilds_up_to_the_newest_batch_the_replay_brought(
    context: zmq.asyncio.Context,
) -> None:
    """The source lags: the batches after the last applied one are gone from the publisher's
    buffer by the time it sees the gap, and newer ones are buffered behind the message that
    showed it. The rebuild applies every batch the replay brought, in order, up to the newest
    (before, only up to that message: the source then caught up batch by batch, or at the
    next gap); their live copies are duplicates."""
    index, publisher, source = _replaying(context, buffer_steps=4, serving=False)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(100)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            for seq in range(1, 5):  # lost live
                await publisher.publish(_message(seq, _stored(100 + seq)), live=False)
            await publisher.publish(_message(5, _stored(105)))  # shows the gap
            await eventually(lambda: source.counters.num_replays == 1, WAIT_S, "the replay")
            # Published while the source waits for the replay; the buffer keeps seqs 5-8.
            newer = [
                _message(6, {"type": "BlockRemoved", "block_hashes": [105]}),
                _message(7, _stored(107)),
                _message(8, _stored(108, parent=107)),
            ]
            for message in newer:
                await publisher.publish(message, live=False)
            publisher.start_replay()
            await source.wait_until(lambda: (source.last_seq or 0) >= 5, WAIT_S)
            assert source.last_seq == 8
            assert _keys(index) == {107, 108}
            for message in newer:  # their live copies, late
                await publisher.send(message)
            await publisher.publish(_message(9, _stored(109, parent=108)))
            await source.wait_until(lambda: source.last_seq == 9, WAIT_S)
    finally:
        await publisher.close()
    assert publisher.replay_requests == [0]
    assert source.counters.num_duplicates == 3
    assert _keys(index) == {107, 108, 109}


async def test_a_stopped_publisher_is_dialled_again_by_zmq_not_by_restarting_the_sub(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A publisher process stopped (SIGSTOP): the heartbeats end its connection, and the
    kernel still accepts the SUB's next ones, whose ZMTP handshake never completes. libzmq
    gives each up at the heartbeat timeout and dials again by itself; the source restarted
    its SUB at each (a failure, counted in `restarts`, as for a peer of another socket type,
    after which libzmq never dials again). Now the SUB is kept, its link down all along
    (`kvplane_indexer_source_up` 0), and the resumed publisher is indexed again from one
    replay."""
    caplog.set_level(logging.INFO, logger="indexer.sources.zmq")
    process = await asyncio.create_subprocess_exec(
        *DEFAULT_SIGNALS,
        sys.executable,
        "-m",
        "tests.indexer.fake_kv_publisher",
        "10",
        "3",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        endpoint, replay = (await asyncio.wait_for(process.stdout.readline(), WAIT_S)).split()
        index = PrefixIndex()
        source = _source(
            endpoint.decode(),
            context,
            MemoryBackend(index),
            replay=replay.decode(),
            rebuild_at_start=True,
            heartbeat=Heartbeat(interval_s=0.1, timeout_s=0.5),
        )
        async with running(source.run()):
            await eventually(lambda: _keys(index) == {10, 11, 12}, WAIT_S, "the blocks indexed")
            process.send_signal(signal.SIGSTOP)
            await eventually(
                lambda: (
                    "did not complete its ZMTP handshake within 0.5 s" in caplog.text
                    and "(2 times in a row)" in caplog.text
                ),
                WAIT_S,
                "two handshakes in a row given up",
            )
            assert source.counters.num_restarts == 0
            assert not source.link.up and "ZMQ dials again" in source.link.reason
            assert _keys(index) == set()  # cleared when the heartbeats ended its connection
            replays = source.counters.num_replays
            process.send_signal(signal.SIGCONT)
            await eventually(
                lambda: source.link.up and _keys(index) == {10, 11, 12},
                WAIT_S,
                "the resumed publisher indexed again",
            )
            assert source.counters.num_replays == replays + 1
            assert source.counters.num_restarts == 0
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        await process.wait()


class GatedSink:
    """An index that, once `gate` is cleared, holds the source's next apply until it is set
    again (`held` is set meanwhile): the source reads no monitor event while it waits."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = asyncio.Event()

    async def apply(self, batch: Batch) -> None:
        if not self.gate.is_set():
            self.held.set()
            await self.gate.wait()
        await self.backend.apply(batch)


async def _server_when_free(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    port: int,
) -> asyncio.Server:
    """A TCP server on a port a ZMQ socket just closed (its I/O thread closes its listener
    soon, not at once)."""
    for _ in range(100):
        try:
            return await asyncio.start_server(handle, host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            await asyncio.sleep(0.01)
    raise RuntimeError(f"{host}:{port} still in use after the ZMQ socket closed")


async def test_a_publisher_back_in_the_read_that_ends_a_silent_handshake_leaves_the_link_up(
    context: zmq.asyncio.Context,
) -> None:
    """While the source waits for a slow index, its publisher leaves, a process that accepts
    connections and says nothing (a stopped one) holds the port until its handshake times
    out, and a publisher takes the port again: one read of the monitor then brings the
    silent handshake's end and the publisher's handshake after it. The end was acted on as
    the last event: the link went down ("ZMQ dials again") and stayed down while the stream
    flowed (`kvplane_indexer_source_up` 0 until some later reconnection). Now the connection
    after it counts: the link is up."""
    index = PrefixIndex()
    sink = GatedSink(MemoryBackend(index))
    publisher = FakeKvPublisher(context)
    heartbeat = Heartbeat(interval_s=0.1, timeout_s=0.5)
    source = _source(publisher.endpoint, context, sink, heartbeat=heartbeat)
    host, port = publisher.endpoint.removeprefix("tcp://").rsplit(":", 1)
    silent_ended = asyncio.Event()

    async def say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(4096):  # the SUB's greeting, then its end at the timeout
            pass
        writer.close()
        silent_ended.set()

    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(1)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            sink.gate.clear()
            await publisher.publish(_message(1, _stored(2, parent=1)))
            await asyncio.wait_for(sink.held.wait(), WAIT_S)
            publisher.close_pub()
            silent = await _server_when_free(say_nothing, host, int(port))
            await asyncio.wait_for(silent_ended.wait(), WAIT_S)
            silent.close()
            await silent.wait_closed()
            await publisher.open_pub_when_free()
            await publisher.wait_subscribed()  # the SUB's handshake succeeded
            sink.gate.set()
            await publisher.publish(_message(2, _stored(3, parent=2)))
            await source.wait_until(lambda: source.last_seq == 2, WAIT_S)
            assert source.link.up, source.link.reason
            assert source.counters.num_restarts == 0
    finally:
        await publisher.close()
    assert _keys(index) == {3}  # cleared at the publisher's end, rebuilt from seq 2


class ClearLosingSink(GatedSink):
    """A `GatedSink` that, once `armed`, loses the worker (asks its source for a resync, as a
    restarted Redis does) while it applies the next clear of it."""

    def __init__(self, backend: MemoryBackend) -> None:
        super().__init__(backend)
        self.armed = False
        self.source: ZmqSource | None = None

    async def apply(self, batch: Batch) -> None:
        await super().apply(batch)
        clear = batch.actions[0].type == ActionType.CLEAR_ALL_AT_TIER
        if self.armed and clear and self.source is not None:
            self.armed = False
            self.source.request_resync()


async def test_a_resync_asked_as_the_publisher_comes_back_counts_as_a_resync(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The index loses the worker (asks for a resync) while it applies the clear the
    publisher's disconnection made, and the publisher is back in the same read of the SUB's
    monitor. The reconnection's rebuild serves the resync: it counts as one (`resyncs`, what
    `kvplane_indexer_source_resyncs_total` exports) and is logged as the index's (before,
    the reconnection's rebuild took it over, uncounted)."""
    index = PrefixIndex()
    sink = ClearLosingSink(MemoryBackend(index))
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source = _source(publisher.endpoint, context, sink, replay=publisher.replay_endpoint)
    sink.source = source
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_message(0, _stored(1)))
            await source.wait_until(lambda: source.last_seq == 0, WAIT_S)
            sink.armed = True
            sink.gate.clear()
            await publisher.publish(_message(1, _stored(2, parent=1)))
            await asyncio.wait_for(sink.held.wait(), WAIT_S)  # the source waits in seq 1's
            await publisher.restart()  # its end and its new connection, read together
            await publisher.publish(_message(0, _stored(5)), live=False)  # before the SUB
            await publisher.wait_subscribed()
            sink.gate.set()
            await source.wait_until(lambda: _keys(index) == {5}, WAIT_S)
    finally:
        await publisher.close()
    assert source.counters.num_resyncs == 1
    assert any("the index asked for a resync" in r.getMessage() for r in caplog.records)


async def test_a_replay_holds_at_most_replay_bytes_of_replies(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """A replay of more large batches (some 100 KB each: a long prompt's blocks) than
    `replay_bytes` holds. Its replies were all held until applied, whatever their size
    (thousands of such batches: gigabytes); now the replay keeps the newest that fit and drops
    the oldest, a hole before them as an unfilled one is (`gaps`, a warning): the worker is
    rebuilt from the newest batches, blocks missing, never stale, and the stream goes on."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    padding = b"\x00" * 100_000  # a field this version does not know, ignored
    for seq in range(50):
        await publisher.publish(_message(seq, {**_stored(seq), "padding": padding}), live=False)
    payload_bytes = len(publisher.buffer[0][2])
    bound = 1024 * 1024  # some 10 batches
    source = _starting_source(publisher, context, index, replay_bytes=bound)
    held = bound // payload_bytes
    try:
        async with running(source.run()):
            await eventually(lambda: source.last_seq == 49, WAIT_S, "the start's replay applied")
            assert _keys(index) == set(range(50 - held, 50))
            assert source.counters.num_gaps == 1
            assert f"dropped its {50 - held} oldest replies" in caplog.text
            await publisher.wait_subscribed()
            await publisher.publish(_message(50, _stored(50)))
            await source.wait_until(lambda: source.last_seq == 50, WAIT_S)
    finally:
        await publisher.close()
    assert _keys(index) == set(range(50 - held, 51))
    assert source.counters.num_resets == 1 and source.counters.num_bad_messages == 0
