"""The OpenEngine SubscribeKvEvents source against a real in-test grpc.aio OpenEngine server
that streams scripted responses: snapshots, resubscription from the next sequence number,
terminal errors, unrecoverable jumps, and ZMQ discovery through GetKvEventSources (one worker
per advertised data-parallel rank)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq.asyncio

from engine.core.api import BlockStored as EngineBlockStored
from engine.server.service import EngineApp, start_engine
from indexer.batch import Component, Tier
from indexer.config import OpenEngineSourceConfig
from indexer.engine_events import BlockStored
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.service import build_source
from indexer.sources.openengine import (
    MAX_SEQUENCE_NUMBER,
    OpenEngineSource,
    OpenEngineSourceSettings,
)
from indexer.sources.resync import connect_resync
from indexer.sources.zmq import ZmqSource, ZmqSourceSettings
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.engine.engine_server_harness import sim_config
from tests.indexer.fake_kv_publisher import FakeKvPublisher, running
from tests.indexer.hybrid_events import hybrid_payload
from tests.partial_servicers import PartialOpenEngine
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0


def _hash(value: int) -> pb.KvBlockHash:
    return pb.KvBlockHash(value=(value & (2**64 - 1)).to_bytes(8, "big"), encoding="int64")


def _stored(
    *keys: int,
    parent: int | None = None,
    medium: pb.StorageMedium.ValueType = pb.STORAGE_MEDIUM_GPU,
) -> pb.KvEvent:
    stored = pb.BlockStored(block_hashes=[_hash(k) for k in keys], block_size=4, medium=medium)
    if parent is not None:
        stored.parent_block_hash.CopyFrom(_hash(parent))
    return pb.KvEvent(block_stored=stored)


def _removed(*keys: int) -> pb.KvEvent:
    return pb.KvEvent(
        block_removed=pb.BlockRemoved(
            block_hashes=[_hash(k) for k in keys], medium=pb.STORAGE_MEDIUM_GPU
        )
    )


CLEARED = pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())


def _batch(seq: int, *events: pb.KvEvent) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(batch=pb.KvEventBatch(sequence_number=seq, events=events))


class ScriptedEngine(PartialOpenEngine):
    """Each SubscribeKvEvents call plays the next script; the last one stays open."""

    def __init__(self, scripts: list[list[pb.SubscribeKvEventsResponse]]) -> None:
        self.scripts = scripts
        self.requests: list[pb.SubscribeKvEventsRequest] = []
        self.hold = asyncio.Event()

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Any
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        self.requests.append(request)
        index = len(self.requests) - 1
        for response in self.scripts[index] if index < len(self.scripts) else []:
            yield response
        if index >= len(self.scripts) - 1:
            await self.hold.wait()


class ZmqOnlyEngine(PartialOpenEngine):
    """An engine without SubscribeKvEvents that advertises its ZMQ publishers: one, or one per
    data-parallel rank (rank -> publisher), after its (unusable) gRPC source."""

    def __init__(self, publishers: FakeKvPublisher | dict[int, FakeKvPublisher]) -> None:
        self.publishers = publishers

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Any
    ) -> pb.GetKvEventSourcesResponse:
        grpc_source = pb.KvEventSource(transport="grpc", encoding="protobuf")
        if isinstance(self.publishers, FakeKvPublisher):
            return pb.GetKvEventSourcesResponse(sources=[_advert(self.publishers)])
        ranks = [_advert(p, rank) for rank, p in self.publishers.items()]
        return pb.GetKvEventSourcesResponse(sources=[grpc_source, *ranks])


def _advert(publisher: FakeKvPublisher, rank: int | None = None) -> pb.KvEventSource:
    host, port = publisher.endpoint.removeprefix("tcp://").rsplit(":", 1)
    return pb.KvEventSource(
        transport="zmq",
        endpoint_addr=pb.KvEndpoint(host=host, port=int(port), protocol="tcp"),
        topic="kv@",
        replay_endpoint=publisher.replay_endpoint.removeprefix("tcp://"),
        data_parallel_rank=rank,
        encoding="msgpack",
    )


async def _serve(servicer: pb_grpc.OpenEngineServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _source(target: str, index: PrefixIndex) -> OpenEngineSource:
    translator = WorkerTranslator(TranslateOptions(target, target))
    settings = OpenEngineSourceSettings(target=target, backoff_initial_s=0.01, backoff_max_s=0.05)
    return OpenEngineSource(settings, translator, MemoryBackend(index))


def _keys(index: PrefixIndex, worker: str) -> dict[int, Tier]:
    return {p.key: p.tier for p in index.placements(worker)}


async def _follow(
    engine: ScriptedEngine, until: Callable[[OpenEngineSource], bool]
) -> tuple[OpenEngineSource, PrefixIndex, str]:
    """Serve `engine`, follow it into a fresh index until `until(source)`, stop; returns the
    source, the index and the engine's address (its worker)."""
    server, target = await _serve(engine)
    index = PrefixIndex()
    source = _source(target, index)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: until(source), WAIT_S)
    finally:
        engine.hold.set()
        await server.stop(None)
    return source, index, target


async def test_snapshot_then_resubscribe_from_the_next_sequence_number() -> None:
    engine = ScriptedEngine(
        [
            # First subscription: a snapshot (seq 5), one live batch, then the stream ends.
            [
                _batch(5, CLEARED, _stored(1), _stored(2, parent=1)),
                _batch(6, _removed(1), _stored(-3, parent=2, medium=pb.STORAGE_MEDIUM_CPU_PINNED)),
            ],
            # Second: a terminal EngineError.
            [
                pb.SubscribeKvEventsResponse(
                    error=pb.EngineError(code=pb.ERROR_CODE_OVERLOADED, message="overrun")
                )
            ],
            # Third: the engine replays from 7, as asked.
            [_batch(7, _stored(4, parent=2))],
        ]
    )
    source, index, target = await _follow(engine, lambda source: source.last_seq == 7)
    assert [(r.include_snapshot, r.start_sequence_number) for r in engine.requests] == [
        (True, 0),
        (True, 7),
        (True, 7),
    ]
    assert _keys(index, target) == {2: Tier.HBM, -3: Tier.DRAM, 4: Tier.HBM}
    prefix = index.match_prefix([2, 4], 0)
    assert [(m.worker_address, m.matched_prefix_blocks) for m in prefix.matches] == [(target, 2)]
    assert source.counters.num_resets == 1  # only the first batch (the snapshot)


async def test_an_unexpected_sequence_number_clears_the_worker_before_applying() -> None:
    engine = ScriptedEngine(
        [
            [_batch(1, _stored(10)), _batch(2, _stored(11, parent=10))],
            # The engine restarted (or no longer buffers 3): a snapshot numbered 1 arrives.
            [_batch(1, CLEARED, _stored(20))],
        ]
    )
    source, index, target = await _follow(engine, lambda source: source.counters.num_resets == 2)
    assert engine.requests[1].start_sequence_number == 3
    assert _keys(index, target) == {20: Tier.HBM}
    assert source.counters.num_gaps == 1


async def test_a_storage_medium_this_build_does_not_know_is_skipped_not_taken_for_gpu() -> None:
    """A newer engine's StorageMedium value (9 here) is an unknown medium: its store and its
    removal are skipped and counted, as an unknown ZMQ medium is, never read as UNSPECIFIED
    (which the indexer's sources put at HBM)."""
    unknown = pb.StorageMedium.ValueType(9)  # a number the proto gives no medium
    removed_elsewhere = _removed(1)
    removed_elsewhere.block_removed.medium = unknown
    engine = ScriptedEngine(
        [[_batch(1, _stored(1), _stored(2, medium=unknown), removed_elsewhere)]]
    )
    source, index, target = await _follow(engine, lambda source: source.last_seq == 1)
    assert _keys(index, target) == {1: Tier.HBM}
    assert source.translator.counters.num_skipped_medium == 2


async def test_a_live_batch_after_a_gap_is_followed_by_a_snapshot_subscription() -> None:
    """Batch 3 never came (not a snapshot: no AllBlocksCleared first): the worker is cleared
    and batch 4 applied, never stale, then the source resubscribes from 0 with a snapshot,
    which brings back what the clear dropped."""
    engine = ScriptedEngine(
        [
            [_batch(1, _stored(10)), _batch(2, _stored(11, parent=10)), _batch(4, _stored(13))],
            [_batch(4, CLEARED, _stored(10), _stored(11, parent=10), _stored(12), _stored(13))],
        ]
    )
    source, index, target = await _follow(engine, lambda source: source.counters.num_resets == 3)
    assert [(r.include_snapshot, r.start_sequence_number) for r in engine.requests] == [
        (True, 0),
        (True, 0),
    ]
    assert _keys(index, target) == {10: Tier.HBM, 11: Tier.HBM, 12: Tier.HBM, 13: Tier.HBM}
    assert (source.counters.num_gaps, source.counters.num_resyncs) == (1, 1)


async def test_a_stream_that_breaks_sequence_at_every_subscription_is_resubscribed_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine whose every subscription goes out of sequence (10, then 5): the first gap
    resubscribes at once, as above; one after it with no batch in sequence between them waits
    the reconnect backoff, saying so. It resubscribed at once every time: about 500
    subscriptions a second, each clearing the worker and waking the controller's identity
    poll."""
    broken = [_batch(10, _stored(1)), _batch(5, _stored(2))]
    engine = ScriptedEngine([broken, broken, broken])
    server, target = await _serve(engine)
    source = _source(target, PrefixIndex())
    try:
        async with running(source.run()):
            await eventually(lambda: len(engine.requests) == 4, WAIT_S, "a 4th subscription")
    finally:
        engine.hold.set()
        await server.stop(None)
    counters = source.counters
    # The 2nd and 3rd resubscriptions waited the backoff; the 1st went at once.
    assert (counters.num_gaps, counters.num_resyncs, counters.num_restarts) == (3, 3, 2)
    again = f"worker {target}: its stream broke sequence again before a batch in sequence"
    assert sum(r.getMessage().startswith(again) for r in caplog.records) == 2


async def _first_zmq_message(
    source: OpenEngineSource, server: grpc.aio.Server, publisher: FakeKvPublisher, payload: bytes
) -> ZmqSource:
    """Run `source` until the ZMQ source it discovers (one) has applied `payload`, sent as seq
    0; then stop the engine, the publisher and its context. Returns that ZMQ source."""
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send([b"kv@x", (0).to_bytes(8, "big"), payload])
            (zmq_source,) = source.zmq_sources  # it subscribed above
            await zmq_source.wait_until(lambda: zmq_source.last_seq == 0, WAIT_S)
    finally:
        await server.stop(None)
        await publisher.close()
        publisher.context.destroy(linger=0)
    return zmq_source


async def test_falls_back_to_a_discovered_zmq_source_when_subscribe_is_unimplemented() -> None:
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    server, target = await _serve(ZmqOnlyEngine(publisher))
    index = PrefixIndex()
    source = _source(target, index)
    payload = msgpack.packb([0.0, [["BlockStored", [77], None, None, None, None, "GPU"]], None])
    zmq_source = await _first_zmq_message(source, server, publisher, payload)
    assert _keys(index, target) == {77: Tier.HBM}
    assert zmq_source.settings.replay_endpoint == publisher.replay_endpoint
    assert zmq_source.worker_id == target  # a single source keeps the engine's worker id


async def test_a_configured_array_tail_reaches_the_discovered_zmq_source() -> None:
    """An indexer's openengine source with `array_tail: vllm` reads the array events of the
    ZMQ source it discovers past index 7: a hybrid model's groups give its masks."""
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    server, target = await _serve(ZmqOnlyEngine(publisher))
    index = PrefixIndex()
    config = OpenEngineSourceConfig(kind="openengine", target=target, array_tail="vllm")
    source = build_source(config, MemoryBackend(index), 16)
    assert isinstance(source, OpenEngineSource)
    await _first_zmq_message(source, server, publisher, hybrid_payload("array"))
    full, swa = Component.FULL, Component.SWA
    masks = {p.key: p.component_mask for p in index.placements(target)}
    assert masks == {1: full | swa, 2: full, 3: full | swa}


async def test_a_target_that_is_no_openengine_server_is_one_line_per_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """UNIMPLEMENTED for SubscribeKvEvents and GetKvEventSources alike (a server of something
    else): a warning per attempt, no traceback, and the source keeps retrying (an engine may
    take the address later)."""
    server, target = await _serve(PartialOpenEngine())  # implements nothing
    source = _source(target, PrefixIndex())
    try:
        async with running(source.run()):
            async with asyncio.timeout(WAIT_S):
                while source.counters.num_restarts < 3:  # noqa: ASYNC110 - no event to await
                    await asyncio.sleep(0.01)
    finally:
        await server.stop(None)
    records = [r for r in caplog.records if r.name == "indexer.sources.openengine"]
    assert records and all(r.exc_info is None for r in records)
    neither = f"openengine source {target} serves neither SubscribeKvEvents nor GetKvEventSources"
    assert sum(r.getMessage().startswith(neither) for r in records) >= 3


class TokenGuardedZmqOnlyEngine(PartialOpenEngine):
    """An engine without SubscribeKvEvents whose GetKvEventSources asks for a bearer token
    (as an engine run with `auth.protect_reads` does)."""

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Any
    ) -> pb.GetKvEventSourcesResponse:
        if dict(context.invocation_metadata()).get("authorization") != "Bearer engine-token":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        return pb.GetKvEventSourcesResponse()


async def test_a_refused_discovery_names_the_token_setting_as_a_refused_subscription_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GetKvEventSources refused for its token (SubscribeKvEvents unimplemented): the retry's
    warning says which setting of the source to give or check, in the words of a refused
    subscription's warning, the token itself in no line."""
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-engine-token\n")
    server, target = await _serve(TokenGuardedZmqOnlyEngine())
    without, with_wrong = (
        build_source(
            OpenEngineSourceConfig(kind="openengine", target=target, token_file=token_file),
            MemoryBackend(PrefixIndex()),
            16,
        )
        for token_file in (None, wrong)
    )
    refused = (
        f"openengine source {target}: GetKvEventSources: UNAUTHENTICATED: missing or invalid "
        "bearer token"
    )
    expected = [
        f"{refused} (a server requiring a token? give the source's token_file); retrying in",
        f"{refused} (not the server's token? check the source's token_file); retrying in",
    ]

    def warned() -> bool:
        lines = [r.getMessage() for r in caplog.records]
        return all(any(line.startswith(start) for line in lines) for start in expected)

    try:
        async with running(without.run()), running(with_wrong.run()):
            await eventually(warned)
    finally:
        await server.stop(None)
    assert not [r for r in caplog.records if "not-the-engine-token" in r.getMessage()]


def _zmq_batch(seq: int, *stored: int) -> list[bytes]:
    events = [["BlockStored", [key], None, None, None, None, "GPU"] for key in stored]
    return [b"kv@x", seq.to_bytes(8, "big"), msgpack.packb([float(seq), events, None])]


class ResyncRecorder:
    """An index backend's resync hook, fired by hand (as the Redis backend would)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[str], None]] = []

    def add_resync_listener(self, callback: Callable[[str], None]) -> None:
        self.listeners.append(callback)


async def test_follows_every_advertised_rank_as_a_worker_of_its_own() -> None:
    """Two data-parallel ranks, two sequence streams: each feeds `<target>/dp<rank>` with the
    engine's address, a restart of one clears only its own worker, and a resync request for
    one rank's worker replays only that rank."""
    context = zmq.asyncio.Context()
    rank0, rank1 = FakeKvPublisher(context), FakeKvPublisher(context)
    rank0.start_replay()
    rank1.start_replay()
    server, target = await _serve(ZmqOnlyEngine({0: rank0, 1: rank1}))
    index = PrefixIndex()
    source = _source(target, index)
    # An earlier run indexed this engine as one worker: nothing feeds that id any more.
    stale = WorkerTranslator(TranslateOptions(target, target))
    for batch in stale.translate([BlockStored(block_hashes=(5,), medium="GPU")]):
        await source.sink.apply(batch)
    resync = ResyncRecorder()
    assert connect_resync(resync, {target: source}.get)
    try:
        async with running(source.run()):
            await rank0.wait_subscribed()
            await rank1.wait_subscribed()
            ranks = {s.worker_id: s for s in source.zmq_sources}
            dp0, dp1 = ranks[f"{target}/dp0"], ranks[f"{target}/dp1"]
            await rank0.publish(_zmq_batch(0, 10))
            await rank1.publish(_zmq_batch(0, 20))
            await rank1.publish(_zmq_batch(1, 21))
            await dp0.wait_until(lambda: dp0.last_seq == 0, WAIT_S)
            await dp1.wait_until(lambda: dp1.last_seq == 1, WAIT_S)
            assert _keys(index, f"{target}/dp0") == {10: Tier.HBM}
            assert _keys(index, f"{target}/dp1") == {20: Tier.HBM, 21: Tier.HBM}
            assert _keys(index, target) == {}
            # Rank 1 restarts (its seq starts at 0 again); rank 0 goes on.
            rank1.buffer.clear()
            await rank1.publish(_zmq_batch(0, 30))
            await rank0.publish(_zmq_batch(1, 11))
            await dp1.wait_until(lambda: dp1.last_seq == 0, WAIT_S)
            await dp0.wait_until(lambda: dp0.last_seq == 1, WAIT_S)
            (fire,) = resync.listeners
            fire(f"{target}/dp1")  # the backend lost rank 1's entries
            # Until rank 1's replay was answered (the count goes up as the resync starts).
            await dp1.wait_until(lambda: len(rank1.replay_requests) == 2, WAIT_S)
            assert source.counters.num_resyncs == 1
    finally:
        await server.stop(None)
        await rank0.close()
        await rank1.close()
        context.destroy(linger=0)
    assert _keys(index, f"{target}/dp0") == {10: Tier.HBM, 11: Tier.HBM}
    assert _keys(index, f"{target}/dp1") == {30: Tier.HBM}
    # Each rank rebuilt from its replay as it started; rank 1 again at the resync.
    assert (rank0.replay_requests, rank1.replay_requests) == ([0], [0, 0])
    prefix = index.match_prefix([10, 11], 0)
    assert [(m.worker_id, m.worker_address) for m in prefix.matches] == [(f"{target}/dp0", target)]


class AdvertisingEngine(PartialOpenEngine):
    """An engine without SubscribeKvEvents that advertises exactly `adverts`."""

    def __init__(self, adverts: list[pb.KvEventSource]) -> None:
        self.adverts = adverts

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Any
    ) -> pb.GetKvEventSourcesResponse:
        return pb.GetKvEventSourcesResponse(sources=self.adverts)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "*"])
async def test_an_advertised_bind_wildcard_is_never_dialled(
    wildcard: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The seed: an endpoint_addr is a connectable host:port, never a bind wildcard. Rank 0
    advertises one (dialling 0.0.0.0 would reach whatever publisher listens on that port of
    the indexer's own machine): it is refused with a warning, and rank 1 is followed."""
    context = zmq.asyncio.Context()
    local, rank1 = FakeKvPublisher(context), FakeKvPublisher(context)
    local.start_replay()
    rank1.start_replay()
    misadvertised = _advert(local, 0)
    misadvertised.endpoint_addr.host = wildcard
    server, target = await _serve(AdvertisingEngine([misadvertised, _advert(rank1, 1)]))
    index = PrefixIndex()
    source = _source(target, index)
    try:
        async with running(source.run()):
            await rank1.wait_subscribed()
            await rank1.publish(_zmq_batch(0, 21))
            (followed,) = source.zmq_sources
            await followed.wait_until(lambda: followed.last_seq == 0, WAIT_S)
    finally:
        await server.stop(None)
        await local.close()
        await rank1.close()
        context.destroy(linger=0)
    assert followed.worker_id == f"{target}/dp1"
    assert _keys(index, f"{target}/dp1") == {21: Tier.HBM}
    refusals = [r.getMessage() for r in caplog.records if "bind wildcard" in r.getMessage()]
    assert refusals and all(f"{target}/dp0" in message for message in refusals)


async def test_against_a_real_sim_engine_subprocess(tmp_path: Path) -> None:
    """`kvplane engine serve --model sim` publishes on SubscribeKvEvents and on its vLLM-style
    ZMQ socket (found through GetKvEventSources); fed by either, the index (canonical keys
    from the events' tokens) predicts the engine's own cached_prompt_tokens."""
    config = tmp_path / "engine.yaml"
    config.write_text(
        "model: sim\nblock_size: 16\nnum_kv_blocks: 256\nsim:\n  time_scale: 0\n"
        "kv_events:\n  zmq_enabled: true\n  endpoint: tcp://127.0.0.1:*\n"
        "  replay_endpoint: tcp://127.0.0.1:*\n"
    )
    port_file = tmp_path / "port"
    kvplane = str(Path(sys.executable).parent / "kvplane")
    with (tmp_path / "engine.log").open("wb") as log:
        engine = await asyncio.create_subprocess_exec(
            kvplane,
            "engine",
            "serve",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        async with asyncio.timeout(WAIT_S):
            while not port_file.exists():  # another process: no event to await
                assert engine.returncode is None, (tmp_path / "engine.log").read_text()
                await asyncio.sleep(0.02)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        index = PrefixIndex()
        backend = MemoryBackend(index)
        grpc_source = OpenEngineSource(
            OpenEngineSourceSettings(target=target, backoff_initial_s=0.05),
            _canonical("grpc"),
            backend,
        )
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            advertised = await stub.GetKvEventSources(pb.GetKvEventSourcesRequest())
        (zmq_advert,) = [s for s in advertised.sources if s.transport == "zmq"]
        zmq_source = ZmqSource(
            ZmqSourceSettings(
                endpoint=f"tcp://{zmq_advert.endpoint_addr.host}:{zmq_advert.endpoint_addr.port}",
                replay_endpoint=zmq_advert.replay_endpoint,
                topic=zmq_advert.topic,
            ),
            _canonical("zmq"),
            backend,
        )
        prompt_a = list(range(1, 101))  # 6 full blocks + 4 tokens
        prompt_b = [*prompt_a, *range(500, 540)]
        keys_b = block_keys(prompt_b[:-1], 16)

        def predicted() -> dict[str, int]:
            return {m.worker_id: m.matched_tokens for m in index.match_prefix_by_tier(keys_b, 0)}

        async with (
            running(grpc_source.run()),
            running(zmq_source.run()),
            grpc.aio.insecure_channel(target) as channel,
        ):
            await grpc_source.wait_until(lambda: grpc_source.last_seq is not None, WAIT_S)
            stub = pb_grpc.OpenEngineStub(channel)
            await _until_subscribed(stub, zmq_source)
            cached_a = await _generate(stub, "a", prompt_a)
            await grpc_source.wait_until(lambda: predicted().get("grpc", 0) >= 96, WAIT_S)
            await zmq_source.wait_until(lambda: predicted().get("zmq", 0) >= 96, WAIT_S)
            prediction = predicted()
            cached_b = await _generate(stub, "b", prompt_b)
        assert cached_a == 0
        assert prediction == {"grpc": cached_b, "zmq": cached_b} and cached_b == 96
        for counters in (grpc_source.counters, zmq_source.counters):
            assert counters.num_events > 0 and counters.num_bad_events == 0
            assert counters.num_bad_messages == 0
    finally:
        engine.send_signal(signal.SIGTERM)
        await asyncio.wait_for(engine.wait(), 20)


async def test_follows_a_real_engine_restarted_under_the_same_instance_id() -> None:
    """A real engine restarted on the same address with the same configured instance_id has
    published more KV-event batches than the old process by the time the source comes back
    and resubscribes from the old process's last + 1 (with a snapshot). Every process numbers
    from its own base, so the new process never buffers that number: the source gets the
    snapshot, clears the worker, and ends with exactly the new process's blocks. (Were both
    to number from 1, the new process would replay its own batches from there as the old
    stream's continuation: the old blocks would stay and the new first batches be lost.)"""
    old = await start_engine(sim_config(instance_id="e-1", num_kv_blocks=256))
    port = old.port
    target = f"127.0.0.1:{port}"
    index = PrefixIndex()
    source = _source(target, index)
    engines = [old]  # those still to close
    try:
        async with running(source.run()), grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            for i in range(2):
                await _generate(stub, f"old-{i}", list(range(100 * i + 1, 100 * i + 41)))
            old_log = old.service.kv_log
            await source.wait_until(lambda: source.last_seq == old_log.last_sequence_number, WAIT_S)
        old_keys = _engine_keys(old)
        assert old_keys and set(_keys(index, target)) == old_keys
        old_batches = old_log.last_sequence_number - old_log.first_sequence_number + 1
        resume_from = old_log.last_sequence_number + 1
        engines.remove(old)
        await old.close()

        # The source is away (cancelled above, its last_seq kept) while the engine restarts
        # and publishes more batches than the old process did.
        new = await start_engine(
            sim_config(listen=f"127.0.0.1:{port}", instance_id="e-1", num_kv_blocks=256)
        )
        engines.append(new)
        new_log = new.service.kv_log
        assert new_log.first_sequence_number > resume_from
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            i = 0
            while new_log.last_sequence_number - new_log.first_sequence_number < old_batches:
                # A first token of its own: no block shared with the old or another prompt.
                await _generate(stub, f"new-{i}", [900 + i, *range(500, 539)])
                i += 1
        new_keys = _engine_keys(new)
        assert new_keys and not new_keys & old_keys

        gaps, resets = source.counters.num_gaps, source.counters.num_resets
        async with running(source.run()):
            await source.wait_until(lambda: source.last_seq == new_log.last_sequence_number, WAIT_S)
        assert set(_keys(index, target)) == new_keys
        # One snapshot, out of sequence: cleared and rebuilt, no resync for missing batches.
        assert (source.counters.num_gaps, source.counters.num_resets) == (gaps + 1, resets + 1)
        assert source.counters.num_resyncs == 0
    finally:
        for engine in engines:
            await engine.close()


def _engine_keys(engine: EngineApp) -> set[int]:
    """The block keys the engine has announced as cached, as the index holds them (signed)."""
    return {
        key if key < 2**63 else key - 2**64
        for event in engine.service.kv_log.snapshot().events
        if isinstance(event, EngineBlockStored)
        for key in event.block_keys
    }


async def _until_subscribed(stub: pb_grpc.OpenEngineAsyncStub, source: ZmqSource) -> None:
    """A SUB misses what is published before its subscription reaches the PUB: send prompts
    sharing no block with the test's until the source has seen a batch."""
    for attempt in range(20):
        await _generate(
            stub, f"warm-up-{attempt}", list(range(2000 + 32 * attempt, 2032 + 32 * attempt))
        )
        with contextlib.suppress(TimeoutError):
            await source.wait_until(lambda: source.last_seq is not None, 1.0)
            return
    raise AssertionError("the ZMQ source never received a batch")


def _canonical(worker_id: str) -> WorkerTranslator:
    options = TranslateOptions(worker_id, worker_id, hash_mode=HashMode.CANONICAL)
    return WorkerTranslator(options)


async def _generate(stub: pb_grpc.OpenEngineAsyncStub, request_id: str, prompt: list[int]) -> int:
    request = pb.GenerateRequest(
        request_id=request_id,
        model="sim",
        token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingOptions(max_tokens=2),
    )
    cached = None
    async for response in stub.Generate(request):
        assert response.WhichOneof("event") != "error", response
        if response.HasField("usage"):
            cached = response.usage.cached_prompt_tokens
    assert cached is not None
    return cached


async def test_a_restarted_engine_replaying_without_a_snapshot_leaves_none_of_its_old_blocks() -> (
    None
):
    """The engine restarted between two subscriptions and, instead of a snapshot, replays its
    new process's batches from its first (no AllBlocksCleared before them): batch 1 where 3
    was expected still clears the worker, and so does the replay from 0 that the gap asks
    for, so none of the old process's blocks (10, 11) stays to attract requests."""
    engine = ScriptedEngine(
        [
            [_batch(1, _stored(10)), _batch(2, _stored(11, parent=10))],
            [_batch(1, _stored(20))],  # the new process's first batch
            [_batch(1, _stored(20))],  # its replay from 0, asked for by the gap
        ]
    )
    _, index, target = await _follow(engine, lambda source: source.counters.num_resets == 3)
    assert [r.start_sequence_number for r in engine.requests] == [0, 3, 0]
    assert _keys(index, target) == {20: Tier.HBM}


async def test_each_advertised_rank_feeds_the_worker_of_its_own_rank_number() -> None:
    """An engine following only ranks 2 and 3 (its `data_parallel_ranks`) advertises those two:
    their blocks go to `<target>/dp2` and `<target>/dp3`, the ids a router gives those ranks,
    not to the workers of ranks 0 and 1 by their place in the list."""
    context = zmq.asyncio.Context()
    rank2, rank3 = FakeKvPublisher(context), FakeKvPublisher(context)
    server, target = await _serve(ZmqOnlyEngine({2: rank2, 3: rank3}))
    index = PrefixIndex()
    source = _source(target, index)
    try:
        async with running(source.run()):
            await rank2.wait_subscribed()
            await rank3.wait_subscribed()
            await rank2.publish(_zmq_batch(0, 12))
            await rank3.publish(_zmq_batch(0, 13))
            await eventually(
                lambda: [s.last_seq for s in source.zmq_sources] == [0, 0],
                WAIT_S,
                "each rank's first batch",
            )
    finally:
        await server.stop(None)
        await rank2.close()
        await rank3.close()
        context.destroy(linger=0)
    assert _keys(index, f"{target}/dp2") == {12: Tier.HBM}
    assert _keys(index, f"{target}/dp3") == {13: Tier.HBM}
    assert _keys(index, f"{target}/dp0") == _keys(index, f"{target}/dp1") == {}


async def test_a_gap_after_batches_in_sequence_resubscribes_at_once_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gap; the snapshot subscription it asks for goes on in sequence, then has a gap of
    its own: the batch in sequence between them ended the run of gaps, so the second gap
    resubscribes at once too (no reconnect backoff, no "broke sequence again" warning)."""
    engine = ScriptedEngine(
        [
            [_batch(1, _stored(10)), _batch(3, _stored(12))],  # 2 went missing
            [_batch(3, CLEARED, _stored(10), _stored(12)), _batch(4, _stored(13)), _batch(6)],
            [_batch(6, CLEARED, _stored(10), _stored(12), _stored(13))],
        ]
    )
    source, index, target = await _follow(
        engine, lambda source: len(engine.requests) == 3 and source.last_seq == 6
    )
    assert [r.start_sequence_number for r in engine.requests] == [0, 0, 0]
    assert (source.counters.num_gaps, source.counters.num_resyncs) == (2, 2)
    assert source.counters.num_restarts == 0  # neither resubscription waited a backoff
    assert not any("broke sequence again" in r.getMessage() for r in caplog.records)
    assert _keys(index, target) == {10: Tier.HBM, 12: Tier.HBM, 13: Tier.HBM}


async def test_a_resync_request_resubscribes_at_once_while_the_engine_is_idle() -> None:
    """The index lost the worker's entries (`request_resync`) while the engine sends nothing:
    the open subscription is ended at once and a new one asks for a snapshot (from 0), without
    waiting for the engine's next batch. A break in the stream's sequence this is not: the
    clear is the source's own (`on_sequence_break` is not told, neither of the first batch)."""
    engine = ScriptedEngine([[_batch(1, _stored(10))]])  # then the stream stays open, idle
    server, target = await _serve(engine)
    source = _source(target, PrefixIndex())
    breaks: list[int | None] = []
    source.on_sequence_break = lambda: breaks.append(source.last_seq)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.last_seq == 1, WAIT_S)
            source.request_resync()
            await eventually(lambda: len(engine.requests) == 2, WAIT_S, "a resubscription")
    finally:
        engine.hold.set()
        await server.stop(None)
    assert [(r.include_snapshot, r.start_sequence_number) for r in engine.requests] == [
        (True, 0),
        (True, 0),
    ]
    assert source.counters.num_resyncs == 1
    assert breaks == []


async def test_after_the_largest_sequence_number_the_source_starts_over_from_a_snapshot() -> None:
    """A batch numbered 2^64 - 1 has no next number to resume from: the next subscription
    asks for a snapshot from 0 (which clears and rebuilds) instead of failing to build its
    request, every retry, with the worker frozen."""
    engine = ScriptedEngine(
        [
            [_batch(MAX_SEQUENCE_NUMBER, _stored(1))],
            [_batch(0, CLEARED, _stored(2))],
        ]
    )
    _, index, target = await _follow(engine, lambda source: source.last_seq == 0)
    assert [r.start_sequence_number for r in engine.requests] == [0, 0]
    assert _keys(index, target) == {2: Tier.HBM}
