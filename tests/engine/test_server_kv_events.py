"""KV events and runtime events through a real engine: SubscribeKvEvents (snapshot, live,
resume), agreement with the block manager, GetKvEventSources and the ZMQ publisher consumed
by a real SUB socket and DEALER replay."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import grpc
import msgpack
import pytest
import zmq
import zmq.asyncio

from engine.config import KvEventsConfig
from engine.server.zmq_publisher import END_OF_REPLAY_SEQ
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.sources.openengine import decode_event, zmq_source_settings
from indexer.sources.zmq import ZmqSource
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from indexer.zmq_decode import decode_frames, decode_payload
from kvplane.config import join_host_port
from kvplane.zmq_ip import set_ip_version
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    generate_request,
    rpc_error,
    running_engine,
    sim_config,
)
from tests.ipv6_loopback import needs_ipv6_loopback
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)


def _key(h: pb.KvBlockHash) -> int:
    assert h.encoding == "int64" and len(h.value) == 8
    return int.from_bytes(h.value, "big", signed=True)


def _apply(cached: dict[int, int], batch: pb.KvEventBatch) -> None:
    """A consumer's naive model: key -> live copies."""
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            assert len(stored.token_ids) == len(stored.block_hashes) * stored.block_size
            for h in stored.block_hashes:
                cached[_key(h)] = cached.get(_key(h), 0) + 1
        elif kind == "block_removed":
            for h in event.block_removed.block_hashes:
                key = _key(h)
                if key in cached:
                    cached[key] -= 1
                    if cached[key] == 0:
                        del cached[key]
        else:
            cached.clear()


async def _engine_cached_keys(engine: Engine) -> set[int]:
    future = engine.app.service.engine_loop.call(lambda core: core.block_manager.cached_keys())
    keys = await asyncio.wrap_future(future)
    return {k if k < 2**63 else k - 2**64 for k in keys}


async def _next(stream: Any) -> pb.SubscribeKvEventsResponse:
    response: pb.SubscribeKvEventsResponse = await asyncio.wait_for(stream.read(), timeout=10)
    assert response.WhichOneof("event") == "batch"
    return response


async def test_snapshot_live_and_resume_agree_with_the_block_manager() -> None:
    async with running_engine(sim_config(num_kv_blocks=16)) as engine:
        stub = engine.stub
        await collect(stub, generate_request(list(range(10, 30)), max_tokens=4))

        stream = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
        snapshot = (await _next(stream)).batch
        assert snapshot.sequence_number == engine.app.service.kv_log.last_sequence_number
        assert snapshot.events[0].WhichOneof("event") == "all_blocks_cleared"
        order = [_key(e.block_stored.block_hashes[0]) for e in snapshot.events[1:]]
        num_children = 0  # events whose parent is in the snapshot: the check below is not empty
        for index, event in enumerate(snapshot.events[1:]):
            stored = event.block_stored
            if stored.HasField("parent_block_hash") and _key(stored.parent_block_hash) in order:
                assert order.index(_key(stored.parent_block_hash)) < index  # parents first
                num_children += 1
        assert num_children > 0
        cached: dict[int, int] = {}
        _apply(cached, snapshot)
        assert set(cached) == await _engine_cached_keys(engine)

        # Live: more work, including evictions (16 blocks only), keeps the model in step.
        live: list[pb.KvEventBatch] = []
        for start in (100, 200, 300):
            await collect(stub, generate_request(list(range(start, start + 24)), max_tokens=4))
            target = engine.app.service.kv_log.last_sequence_number
            while not live or live[-1].sequence_number < target:
                live.append((await _next(stream)).batch)
        stream.cancel()
        numbers = [b.sequence_number for b in live]
        assert numbers == list(range(snapshot.sequence_number + 1, numbers[-1] + 1))
        for batch in live:
            _apply(cached, batch)
        assert any(e.WhichOneof("event") == "block_removed" for b in live for e in b.events)
        assert set(cached) == await _engine_cached_keys(engine)

        # Resume from a sequence number still buffered: the very same batches again.
        resumed = stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(start_sequence_number=numbers[0])
        )
        again = [(await _next(resumed)).batch for _ in numbers]
        resumed.cancel()
        assert again == live


async def test_resume_outside_the_buffer_is_out_of_range() -> None:
    config = sim_config(kv_events=KvEventsConfig(buffer_steps=2))
    async with running_engine(config) as engine:
        for start in (0, 100, 200, 300):
            await collect(engine.stub, generate_request(list(range(start, start + 8))))
        kv_log = engine.app.service.kv_log
        last = kv_log.last_sequence_number
        assert last > kv_log.first_sequence_number + 2
        # The first batch, long evicted from a ring of 2.
        request = pb.SubscribeKvEventsRequest(start_sequence_number=kv_log.first_sequence_number)
        error = await rpc_error(lambda: engine.stub.SubscribeKvEvents(request).read())
        assert error.code() == grpc.StatusCode.OUT_OF_RANGE
        # With include_snapshot the snapshot stands in for what is gone.
        request.include_snapshot = True
        stream = engine.stub.SubscribeKvEvents(request)
        assert (await _next(stream)).batch.sequence_number == last
        stream.cancel()


async def test_a_subscriber_that_falls_behind_ends_with_one_overloaded_error() -> None:
    """After acceptance a failure is the final response, an EngineError, and the stream ends
    OK (the seed). A subscriber that stops reading (its channel's flow-control window kept
    small) while the engine publishes far more than the 2-batch ring holds: the batches it
    still gets are consecutive, then one retryable OVERLOADED error, nothing after it."""
    config = sim_config(
        kv_events=KvEventsConfig(buffer_steps=2),
        num_kv_blocks=4096,
        max_model_len=4096,
        max_num_batched_tokens=4096,
    )
    async with running_engine(config) as engine:
        # No BDP probing: the window stays at HTTP/2's 64 KiB while the client does not read.
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{engine.app.port}", options=[("grpc.http2.bdp_probe", 0)]
        )
        stub = pb_grpc.OpenEngineStub(channel)
        stream = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
        snapshot = (await _next(stream)).batch  # accepted
        for i in range(60):  # each a new 1000-token prompt: 250 blocks stored, ~10 KB a batch
            prompt = [(i * 7919 + j * 31 + (j * j) % 17) % 1000 for j in range(1000)]
            await collect(engine.stub, generate_request(prompt, max_tokens=1))
        rest: list[pb.SubscribeKvEventsResponse] = []
        while (response := await asyncio.wait_for(stream.read(), timeout=10)) != grpc.aio.EOF:
            assert isinstance(response, pb.SubscribeKvEventsResponse)
            rest.append(response)
        code = await stream.code()
        await channel.close()
    assert code == grpc.StatusCode.OK
    kinds = [r.WhichOneof("event") for r in rest]
    assert kinds[-1] == "error" and "error" not in kinds[:-1]
    error = rest[-1].error
    assert (error.code, error.retryable) == (pb.ERROR_CODE_OVERLOADED, True)
    numbers = [snapshot.sequence_number, *(r.batch.sequence_number for r in rest[:-1])]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))


async def test_batches_carry_the_engines_data_parallel_rank() -> None:
    """DP-rank attribution (the seed): every batch names the engine's rank; a subscription
    asking only for other ranks is refused before acceptance, one naming it is served, and
    the advertised sources carry the rank."""
    config = sim_config(kv_events=KvEventsConfig(data_parallel_rank=2))
    async with running_engine(config) as engine:
        stub = engine.stub
        others = pb.SubscribeKvEventsRequest(data_parallel_ranks=[0, 1], include_snapshot=True)
        error = await rpc_error(lambda: stub.SubscribeKvEvents(others).read())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        mine = pb.SubscribeKvEventsRequest(data_parallel_ranks=[1, 2], include_snapshot=True)
        stream = stub.SubscribeKvEvents(mine)
        snapshot = (await _next(stream)).batch
        await collect(stub, generate_request(list(range(10, 30))))
        live = (await _next(stream)).batch
        stream.cancel()
        assert (snapshot.data_parallel_rank, live.data_parallel_rank) == (2, 2)
        assert (
            live.timestamp_unix_nanos > 0 and live.sequence_number == snapshot.sequence_number + 1
        )
        sources = await stub.GetKvEventSources(pb.GetKvEventSourcesRequest(data_parallel_ranks=[2]))
        assert [s.data_parallel_rank for s in sources.sources] == [2]
        assert sources.sources[0].HasField("data_parallel_rank")


async def test_runtime_events_report_forward_passes_batches_and_queue() -> None:
    async with running_engine() as engine:
        everything = engine.stub.SubscribeRuntimeEvents(pb.SubscribeRuntimeEventsRequest())
        only_queue = engine.stub.SubscribeRuntimeEvents(
            pb.SubscribeRuntimeEventsRequest(types=[pb.RUNTIME_EVENT_TYPE_QUEUE])
        )
        hub = engine.app.service.runtime_events

        async def subscribed() -> bool:
            return hub.num_subscribers == 2

        await eventually(subscribed, what="runtime event subscribers")
        await collect(engine.stub, generate_request(list(range(40)), max_tokens=3))
        kinds: dict[int, pb.RuntimeEvent] = {}
        while len(kinds) < 3:
            response: Any = await asyncio.wait_for(everything.read(), timeout=10)
            event = response.runtime_event
            kinds.setdefault(event.type, event)
        # The first pass of an idle engine with an empty cache: the whole 40-token prompt.
        forward = kinds[pb.RUNTIME_EVENT_TYPE_FORWARD_PASS].attributes
        assert {k: int(forward[k]) for k in forward if k != "duration_ms"} == {
            "batch_size": 1,
            "num_scheduled_tokens": 40,
            "num_prefill_tokens": 40,
            "num_decode_sequences": 0,
            "num_cached_tokens": 0,
            "num_preempted": 0,
        }
        assert float(forward["duration_ms"]) >= 0.0
        assert dict(kinds[pb.RUNTIME_EVENT_TYPE_BATCH].attributes) == {
            "batch_size": "1",
            "prefill_sequences": "1",
            "decode_sequences": "0",
            "prefill_tokens": "40",
            "decode_tokens": "0",
        }
        queued: Any = await asyncio.wait_for(only_queue.read(), timeout=10)
        assert queued.runtime_event.type == pb.RUNTIME_EVENT_TYPE_QUEUE
        assert "running_requests" in queued.runtime_event.attributes
        everything.cancel()
        only_queue.cancel()


async def test_runtime_event_ids_are_never_reused_by_an_engine_restarted_as_the_same_instance() -> (
    None
):
    """Each engine process names its events apart: two subscriptions to one see the same id
    for the same event (a planner moving its stream tells where the two overlap by it), and
    the process that follows, started with the same `instance_id`, gives none of the first's
    ids. Both gave `fixed-1`, `fixed-2`, ... to other events."""

    async def event_ids() -> tuple[list[str], list[str]]:
        async with running_engine(sim_config(instance_id="fixed")) as engine:
            streams = [
                engine.stub.SubscribeRuntimeEvents(pb.SubscribeRuntimeEventsRequest())
                for _ in range(2)
            ]
            hub = engine.app.service.runtime_events

            async def subscribed() -> bool:
                return hub.num_subscribers == 2

            await eventually(subscribed, what="runtime event subscribers")
            await collect(engine.stub, generate_request([1, 2, 3], max_tokens=3))
            seen: list[list[str]] = []
            for stream in streams:
                responses: list[Any] = [
                    await asyncio.wait_for(stream.read(), timeout=10) for _ in range(6)
                ]
                seen.append([r.runtime_event.event_id for r in responses])
                stream.cancel()
        return seen[0], seen[1]

    first, also_first = await event_ids()
    assert first == also_first and len(set(first)) == len(first)
    assert all(i.startswith("fixed-") for i in first)
    restarted, _ = await event_ids()
    assert not set(first) & set(restarted), (first, restarted)


async def test_a_runtime_event_subscriber_that_falls_behind_ends_with_one_overloaded_error() -> (
    None
):
    """As for KV events: a subscriber 4096 events behind (it stopped reading, its channel's
    window kept small) gets what was queued, then one retryable OVERLOADED error, then OK."""
    config = sim_config(max_model_len=4096, num_kv_blocks=1024)
    async with running_engine(config) as engine:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{engine.app.port}", options=[("grpc.http2.bdp_probe", 0)]
        )
        stub = pb_grpc.OpenEngineStub(channel)
        stream = stub.SubscribeRuntimeEvents(pb.SubscribeRuntimeEventsRequest())
        hub = engine.app.service.runtime_events

        async def subscribed() -> bool:
            return hub.num_subscribers == 1

        await eventually(subscribed, what="the runtime event subscription")
        # 3,000 decode steps: two events each (FORWARD_PASS, BATCH), far past the 4096 queued.
        await collect(engine.stub, generate_request([1, 2, 3], max_tokens=3000))
        rest = await asyncio.wait_for(_read_all(stream), timeout=30)
        code = await stream.code()
        await channel.close()
    assert code == grpc.StatusCode.OK
    kinds = [r.WhichOneof("event") for r in rest]
    assert kinds[-1] == "error" and "error" not in kinds[:-1]
    assert len(rest) > 4096  # what was queued still came first
    error = rest[-1].error
    assert (error.code, error.retryable) == (pb.ERROR_CODE_OVERLOADED, True)


async def test_zmq_publisher_feeds_a_real_sub_and_replays_over_dealer() -> None:
    config = sim_config(
        listen="0.0.0.0:0",
        kv_events=KvEventsConfig(
            zmq_enabled=True,
            endpoint="tcp://*:*",
            replay_endpoint="tcp://*:*",
            advertised_host="127.0.0.1",
            data_parallel_rank=3,
        ),
    )
    async with running_engine(config) as engine:
        sources = (await engine.stub.GetKvEventSources(pb.GetKvEventSourcesRequest())).sources
        by_transport = {s.transport: s for s in sources}
        zmq_source = by_transport["zmq"]
        assert zmq_source.endpoint_addr.host == "127.0.0.1"  # never a bind wildcard
        assert zmq_source.encoding == "msgpack"
        assert zmq_source.data_parallel_rank == 3
        assert zmq_source.topic == f"kv@127.0.0.1:{engine.app.port}@sim"
        assert zmq_source.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert by_transport["grpc"].endpoint_addr.port == engine.app.port
        none = await engine.stub.GetKvEventSources(
            pb.GetKvEventSourcesRequest(data_parallel_ranks=[5])
        )
        assert list(none.sources) == []

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{zmq_source.endpoint_addr.port}")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(zmq_source.replay_endpoint)
        try:
            # PUB drops until the subscription propagates: send work until something arrives.
            live: list[list[bytes]] = []
            start = 0
            while not live:
                await collect(engine.stub, generate_request(list(range(start, start + 8))))
                start += 50
                if await sub.poll(timeout=100):
                    live.append(await sub.recv_multipart())
            salted = generate_request(list(range(10, 30)), kv=pb.KvOptions(cache_salt="tenant-a"))
            await collect(engine.stub, salted)
            kv_log = engine.app.service.kv_log
            last_seq = kv_log.last_sequence_number - kv_log.first_sequence_number  # ZMQ: from 0
            while int.from_bytes(live[-1][1], "big") < last_seq:
                assert await sub.poll(timeout=5000)
                live.append(await sub.recv_multipart())
            topic, _seq, payload = live[-1]
            assert topic == zmq_source.topic.encode()
            _ts, events, rank = msgpack.unpackb(payload)
            assert rank == 3 and events[0]["type"] == "BlockStored"
            assert list(events[0])[:2] == ["type", "block_hashes"]

            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed: dict[int, list[bytes]] = {}
            while True:
                assert await dealer.poll(timeout=5000)
                frames = await dealer.recv_multipart()
                if frames[2] == END_OF_REPLAY_SEQ:
                    break
                replayed[int.from_bytes(frames[2], "big")] = frames[1:]
            assert sorted(replayed) == list(range(last_seq + 1))
            for frames in live:
                assert replayed[int.from_bytes(frames[1], "big")] == frames

            # kvplane's own ZMQ decoder and translator consume it unchanged, and rebuild the
            # engine's cached set (salted blocks included).
            translator = WorkerTranslator(
                TranslateOptions(worker_id="engine", hash_mode=HashMode.CANONICAL)
            )
            for seq in sorted(replayed):
                message = decode_frames(replayed[seq])
                assert (message.topic, message.seq) == (zmq_source.topic, seq)
                batch = decode_payload(message.payload)
                assert batch.num_bad_events == 0 and batch.num_unknown_events == 0
                translator.translate(batch.events, seq=seq)
            assert translator.counters.num_unresolved == 0
            assert {_signed(k) for k in translator.live_keys()} == await _engine_cached_keys(engine)
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)
            ctx.term()


def _signed(key: int) -> int:
    return key - 2**64 if key >= 2**63 else key


@pytest.mark.parametrize("socket_type", [zmq.REQ, zmq.DEALER], ids=["req", "dealer"])
async def test_the_engines_replay_answers_newer_vllms_msgpack_request(socket_type: int) -> None:
    """A real engine's replay socket answers WIRE.md's newer request form with one message:
    its replayed batches (the live bytes) or, asked for, a snapshot from which kvplane's own
    decoder and translator rebuild exactly the engine's cached set."""
    config = sim_config(
        kv_events=KvEventsConfig(
            zmq_enabled=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
        )
    )
    async with running_engine(config) as engine:
        await collect(engine.stub, generate_request(list(range(100, 120))))
        await collect(engine.stub, generate_request([*range(100, 110), 7, 8, 9]))
        sources = (await engine.stub.GetKvEventSources(pb.GetKvEventSourcesRequest())).sources
        advert = next(s for s in sources if s.transport == "zmq")
        kv_log = engine.app.service.kv_log
        epoch = kv_log.first_sequence_number
        next_seq = kv_log.last_sequence_number - epoch + 1
        ctx = zmq.asyncio.Context()
        client = ctx.socket(socket_type)
        client.connect(advert.replay_endpoint)

        async def ask(**request: object) -> dict[str, Any]:
            packed = msgpack.packb(request)
            delimiter = [b""] if socket_type == zmq.DEALER else []
            await client.send_multipart([*delimiter, packed])
            assert await client.poll(timeout=5000)
            frames = await client.recv_multipart()
            assert frames[: len(delimiter)] == delimiter and len(frames) == len(delimiter) + 1
            reply: dict[str, Any] = msgpack.unpackb(frames[-1], raw=False)
            assert (reply["publisher_epoch"], reply["next_seq"]) == (epoch, next_seq)
            return reply

        try:
            replay = await ask(publisher_epoch=epoch, start_seq=0, force_snapshot=False)
            assert replay["snapshot"] is None
            assert [seq for seq, _ in replay["replayed_batches"]] == list(range(next_seq))
            translator = WorkerTranslator(
                TranslateOptions(worker_id="engine", hash_mode=HashMode.CANONICAL)
            )
            for seq, payload in replay["replayed_batches"]:
                translator.translate(decode_payload(payload).events, seq=seq)
            cached = await _engine_cached_keys(engine)
            assert cached and {_signed(k) for k in translator.live_keys()} == cached

            snapshot = await ask(publisher_epoch=epoch, start_seq=0, force_snapshot=True)
            assert snapshot["replayed_batches"] == []
            batch = decode_payload(snapshot["snapshot"])
            assert batch.num_bad_events == 0 and batch.num_unknown_events == 0
            rebuilt = WorkerTranslator(
                TranslateOptions(worker_id="engine", hash_mode=HashMode.CANONICAL)
            )
            rebuilt.translate(batch.events, seq=next_seq - 1)
            assert rebuilt.counters.num_unresolved == 0
            assert {_signed(k) for k in rebuilt.live_keys()} == cached
        finally:
            client.close(linger=0)
            ctx.term()


@needs_ipv6_loopback
@pytest.mark.parametrize(
    ("endpoint", "advertised_host"),
    [("tcp://[::1]:*", None), ("tcp://*:*", "::1")],
    ids=["ipv6-address", "wildcard-dual-stack"],
)
async def test_an_engine_publishing_over_ipv6_is_indexed_from_its_replay_then_live(
    endpoint: str, advertised_host: str | None
) -> None:
    """The engine's ZMQ endpoints on an IPv6 address, or on `*` (both IP versions) advertised
    at one: a source following the advertised endpoints (as the controller's `kv_events: zmq`
    and the indexer's OpenEngine discovery do) rebuilds the worker from the replay at start,
    then follows the live stream, and indexes what the engine caches."""
    kv_events = KvEventsConfig(
        zmq_enabled=True,
        endpoint=endpoint,
        replay_endpoint=endpoint,
        advertised_host=advertised_host,
    )
    async with running_engine(sim_config(kv_events=kv_events)) as engine:
        await collect(engine.stub, generate_request(list(range(100, 120))))  # no subscriber yet
        sources = (await engine.stub.GetKvEventSources(pb.GetKvEventSourcesRequest())).sources
        advert = next(s for s in sources if s.transport == "zmq")
        settings = zmq_source_settings(advert, array_tail="vllm")
        assert settings.endpoint == f"tcp://[::1]:{advert.endpoint_addr.port}"
        assert (settings.replay_endpoint or "").startswith("tcp://[::1]:")
        index = PrefixIndex()
        translator = WorkerTranslator(
            TranslateOptions(worker_id="engine", hash_mode=HashMode.CANONICAL)
        )
        source = ZmqSource(settings, translator, MemoryBackend(index))

        def indexed() -> set[int]:
            return {_signed(p.key) for p in index.placements("engine")}

        task = asyncio.create_task(source.run())
        try:
            cached = await _engine_cached_keys(engine)
            assert cached  # what only the replay can tell
            await eventually(lambda: indexed() == cached, 20, "the replay at start")
            # PUB drops until the subscription propagates: send work until a message arrives.
            start = 200
            while source.counters.num_messages == 0:
                await collect(engine.stub, generate_request(list(range(start, start + 8))))
                start += 50
                with contextlib.suppress(TimeoutError):
                    await source.wait_until(lambda: source.counters.num_messages > 0, 0.1)
            cached = await _engine_cached_keys(engine)
            await eventually(lambda: indexed() == cached, 20, "the live stream")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert source.counters.num_replay_failures == 0
    assert source.counters.num_bad_messages == 0


async def test_kvplane_indexer_predicts_the_engines_own_prefix_hits() -> None:
    """Events -> kvplane's indexer translator; at every point its live keys equal the block
    manager's, and its prediction for the next prompt equals the engine's cached tokens."""
    block_size = 4
    translator = WorkerTranslator(
        TranslateOptions(worker_id="engine", hash_mode=HashMode.CANONICAL)
    )
    base = list(range(10, 34))
    workload: list[tuple[list[int], str | None]] = [
        (base, None),
        ([*base, 1, 2, 3, 4, 5], None),  # extends: all of base's blocks hit
        (base[:13], None),  # a shorter prefix
        (base, "tenant-a"),  # salted: a namespace of its own
        (base, "tenant-a"),
        *[(list(range(s, s + 28)), None) for s in (100, 200, 300)],  # evicts (16 blocks)
        (base, None),
        ([*base[:8], 999, 998, 997, 996, 995], None),  # diverges after two blocks
    ]
    async with running_engine(sim_config(num_kv_blocks=16)) as engine:
        stream = engine.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
        next_seq = (await _next(stream)).batch.sequence_number + 1
        predicted: list[int] = []
        for prompt, salt in workload:
            keys = block_keys(prompt, block_size, cache_salt=salt)
            live = set(translator.live_keys())
            hits = 0
            for key in keys[: (len(prompt) - 1) // block_size]:
                if key not in live:
                    break
                hits += 1
            request = generate_request(prompt, max_tokens=3)
            if salt is not None:
                request.kv.cache_salt = salt
            responses = await collect(engine.stub, request)
            assert responses[-1].usage.cached_prompt_tokens == hits * block_size, prompt
            predicted.append(hits)
            while next_seq <= engine.app.service.kv_log.last_sequence_number:
                batch = (await _next(stream)).batch
                assert batch.sequence_number == next_seq
                next_seq += 1
                events = [e for e in map(decode_event, batch.events) if e is not None]
                translator.translate(events, seq=batch.sequence_number)
            assert {_signed(k) for k in translator.live_keys()} == await _engine_cached_keys(engine)
        stream.cancel()
        # The workload exercises hits, misses, a namespace and eviction.
        assert predicted[:5] == [0, 6, 3, 0, 5]  # a prompt never hits on its last token
        assert predicted[8] < 5  # base was evicted by the three unrelated prompts
        assert predicted[9] > 0  # ...and then cached again


def _host(
    routes: dict[socket.AddressFamily, str], named: list[tuple[socket.AddressFamily, str]]
) -> dict[str, Any]:
    """A machine's view of its own addresses, for `own_address`: routed ones by IP version
    (absent: no route of that version) and what the host name resolves to."""
    return {"route_address": routes.get, "host_name_addresses": lambda: named}


V4, V6 = socket.AF_INET, socket.AF_INET6
DUAL_STACK = _host({V4: "10.1.2.3", V6: "fd00::7"}, [(V4, "127.0.1.1")])
IPV6_ONLY = _host({V6: "2001:db8:5::9"}, [(V4, "127.0.1.1")])
UNROUTED = _host({}, [(V4, "127.0.1.1"), (V6, "fd00::1:2")])


@pytest.mark.parametrize(
    ("wildcard", "machine", "expected"),
    [
        ("0.0.0.0", DUAL_STACK, "10.1.2.3"),
        ("*", DUAL_STACK, "10.1.2.3"),
        ("::", DUAL_STACK, "fd00::7"),
        ("0.0.0.0", IPV6_ONLY, "2001:db8:5::9"),
        ("::", IPV6_ONLY, "2001:db8:5::9"),
        ("::", UNROUTED, "fd00::1:2"),
        ("0.0.0.0", UNROUTED, "127.0.1.1"),
        ("::", _host({}, []), "::1"),
        ("*", _host({}, []), "127.0.0.1"),
    ],
)
def test_an_engine_on_every_interface_advertises_an_address_of_the_ip_version_it_listens_on(
    wildcard: str, machine: dict[str, Any], expected: str
) -> None:
    """On a wildcard, the address advertised is the routed one (not what the host name
    resolves to: 127.0.1.1 with Debian's hosts file), of the wildcard's IP version first (`::`
    IPv6, `*` and 0.0.0.0 IPv4), then the other one (an IPv6-only host); with no route, the
    host name's address, in the same order; else loopback."""
    from engine.server.service import own_address

    assert own_address(wildcard, **machine) == expected


def test_a_loopback_advertised_address_is_warned_about_and_a_configured_one_wins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from engine.server.service import advertised_host, own_address

    assert own_address("0.0.0.0", **DUAL_STACK) == "10.1.2.3"
    assert not caplog.records
    assert own_address("::", **_host({}, [(V6, "::1")])) == "::1"
    assert "only this machine can reach" in caplog.text
    assert "kv_events.advertised_host" in caplog.text
    configured = sim_config(listen="[::]:0", kv_events=KvEventsConfig(advertised_host="h1"))
    assert advertised_host(configured) == "h1"
    assert advertised_host(sim_config(listen="[fd00::3]:0")) == "fd00::3"


@pytest.mark.parametrize(
    ("bound", "host", "machine", "expected"),
    [
        # IPv4 only: an IPv6 host (the gRPC wildcard's, or the listen address) is replaced.
        ("tcp://0.0.0.0:5557", "fd00::7", DUAL_STACK, "10.1.2.3"),
        ("tcp://0.0.0.0:5557", "fd00::3", UNROUTED, "127.0.1.1"),
        # ... never by an IPv6 one, not even on an IPv6-only machine: the host name's IPv4
        # address, here loopback (warned), else 127.0.0.1.
        ("tcp://0.0.0.0:5557", "2001:db8:5::9", IPV6_ONLY, "127.0.1.1"),
        ("tcp://0.0.0.0:5557", "2001:db8:5::9", _host({V6: "2001:db8:5::9"}, []), "127.0.0.1"),
        ("tcp://0.0.0.0:5557", "10.9.9.9", DUAL_STACK, "10.9.9.9"),
        ("tcp://0.0.0.0:5557", "engine-0.svc", DUAL_STACK, "engine-0.svc"),
        # Dual stack (`*` binds [::]) or a specific address: the host as it is.
        ("tcp://[::]:5557", "fd00::7", DUAL_STACK, "fd00::7"),
        ("tcp://[::]:5557", "10.1.2.3", DUAL_STACK, "10.1.2.3"),
        ("tcp://127.0.0.1:5557", "fd00::7", DUAL_STACK, "fd00::7"),
    ],
)
def test_a_zmq_endpoint_is_advertised_at_an_address_of_the_ip_version_it_binds(
    bound: str, host: str, machine: dict[str, Any], expected: str
) -> None:
    """The host the engine advertises for gRPC (dual stack) is kept for a ZMQ endpoint unless
    that socket listens on IPv4 only (0.0.0.0) and the host is an IPv6 address: then this
    machine's IPv4 address."""
    from engine.server.service import zmq_advertised_host

    assert zmq_advertised_host(bound, host, **machine) == expected


@needs_ipv6_loopback
async def test_zmq_on_the_ipv4_wildcard_is_advertised_at_ipv4_under_grpc_on_the_ipv6_one() -> None:
    """gRPC on [::] is advertised at an IPv6 address; the ZMQ endpoints on 0.0.0.0 (IPv4 only)
    at an IPv4 one, where a client following the advert reaches them: the replay answers."""
    kv_events = KvEventsConfig(
        zmq_enabled=True, endpoint="tcp://0.0.0.0:*", replay_endpoint="tcp://0.0.0.0:*"
    )
    async with running_engine(sim_config(listen="[::]:0", kv_events=kv_events)) as engine:
        await collect(engine.stub, generate_request(list(range(100, 120))))
        sources = (await engine.stub.GetKvEventSources(pb.GetKvEventSourcesRequest())).sources
        by_transport = {s.transport: s for s in sources}
        assert ipaddress.ip_address(by_transport["grpc"].endpoint_addr.host).version == 6
        settings = zmq_source_settings(by_transport["zmq"], array_tail="vllm")
        for endpoint in (settings.endpoint, settings.replay_endpoint or ""):
            host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
            assert ipaddress.ip_address(host).version == 4, endpoint
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        set_ip_version(dealer, settings.replay_endpoint or "")
        dealer.connect(settings.replay_endpoint or "")
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            frames: list[bytes] = []
            while not frames or frames[2] != END_OF_REPLAY_SEQ:
                assert await dealer.poll(timeout=5000)
                frames = await dealer.recv_multipart()
        finally:
            dealer.close(linger=0)
            ctx.term()


@needs_ipv6_loopback
async def test_an_engine_on_the_ipv6_wildcard_advertises_an_ipv6_address_a_client_dials() -> None:
    """Listening on [::], GetKvEventSources gives an IPv6 address (whatever this machine's
    is): dialed as [host]:port, it reaches the same engine."""
    async with running_engine(sim_config(listen="[::]:0")) as engine:
        sources = (await engine.stub.GetKvEventSources(pb.GetKvEventSourcesRequest())).sources
        advert = next(s for s in sources if s.transport == "grpc").endpoint_addr
        assert ipaddress.ip_address(advert.host).version == 6
        assert advert.port == engine.app.port
        async with grpc.aio.insecure_channel(join_host_port(advert.host, advert.port)) as channel:
            dialed = pb_grpc.OpenEngineStub(channel)
            again = await dialed.GetKvEventSources(pb.GetKvEventSourcesRequest(), timeout=10)
        assert list(again.sources) == list(sources)


async def _read_all(stream: Any) -> list[Any]:
    return [response async for response in stream]


def _kv_events(engine: Engine) -> tuple[Any, Callable[[], bool]]:
    stream = engine.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
    return stream, lambda: True  # the snapshot comes first, whenever it is accepted


def _runtime_events(engine: Engine) -> tuple[Any, Callable[[], bool]]:
    stream = engine.stub.SubscribeRuntimeEvents(pb.SubscribeRuntimeEventsRequest())
    hub = engine.app.service.runtime_events
    return stream, lambda: hub.num_subscribers == 1  # events from then on


@pytest.mark.parametrize("subscribe", [_kv_events, _runtime_events], ids=["kv", "runtime"])
async def test_a_subscription_ends_with_a_retryable_draining_error_at_shutdown(
    subscribe: Callable[[Engine], tuple[Any, Callable[[], bool]]],
) -> None:
    """A subscriber tells the engine shutting down from a stream cut short: after what the
    engine gave it, a terminal DRAINING error, retryable (a new process may follow), then OK
    (the seed: an EngineError terminates a KV-event or runtime-event subscription)."""
    async with running_engine(sim_config(num_kv_blocks=16)) as engine:
        stream, accepted = subscribe(engine)

        async def subscribed() -> bool:
            return accepted()

        await eventually(subscribed, what="the subscription to be accepted")
        await collect(engine.stub, generate_request([1, 2, 3], max_tokens=2))
        assert (await asyncio.wait_for(stream.read(), timeout=10)).WhichOneof("event") != "error"
        await engine.app.close_engine()  # the gRPC server still serves the stream's end
        rest = []
        while (response := await asyncio.wait_for(stream.read(), timeout=10)) != grpc.aio.EOF:
            rest.append(response)
        assert await stream.code() == grpc.StatusCode.OK
        # A subscription that arrives during the shutdown ends the same way, at once.
        late_stream, _ = subscribe(engine)
        late = await asyncio.wait_for(_read_all(late_stream), timeout=10)
    assert rest and rest[-1].WhichOneof("event") == "error"
    assert all(r.WhichOneof("event") != "error" for r in rest[:-1])
    assert late and late[-1].WhichOneof("event") == "error"
    for error in (rest[-1].error, late[-1].error):
        assert (error.code, error.retryable) == (pb.ERROR_CODE_DRAINING, True)
        assert error.message == "the engine is shutting down"
