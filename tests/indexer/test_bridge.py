"""The bridge on real sockets: ZMQ PUB -> bridge -> ApplyExternalKvBatch on a real KVIndexer
server. The SGLang test vectors (WIRE.md section 1), medium policy, splitting, retries, and the
probe that finds a target that lost the worker's blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq.asyncio

from indexer.batch import Action, ActionType, Batch, Component, Tier
from indexer.bridge import BridgeSettings, KvIndexerSink, build_bridge, follow
from indexer.index import PrefixIndex
from indexer.memory_backend import MemoryBackend
from indexer.servicer import KvIndexerServicer, index_services
from indexer.sources.zmq import ZmqSource
from indexer.translate import MediumMap
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.channels import ClientChannels
from kvplane.config import AuthConfig, ClientTlsConfig, ServerConfig, TlsConfig
from kvplane.errors import ConfigError
from kvplane.server import Service, bearer_token_metadata, create_server
from tests.indexer.fake_kv_publisher import FakeKvPublisher, running
from tests.indexer.hybrid_events import EventForm, hybrid_payload
from tests.indexer.test_zmq_decode import VECTOR_1, VECTOR_2, VECTOR_3
from tests.ipv6_loopback import needs_ipv6_loopback
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0
HBM, DRAM, SSD = kv.TIER_HBM, kv.TIER_DRAM, kv.TIER_SSD
CLEAR_ALL = [
    kv.ExternalKvAction(type=kv.ACTION_CLEAR_ALL_AT_TIER, tier=t) for t in (HBM, DRAM, SSD)
]


class RecordingServicer(KvIndexerServicer):
    """kvplane's KVIndexer, recording every ApplyExternalKvBatch it receives; the first
    `unavailable` calls fail with UNAVAILABLE (an indexer that is briefly down). MatchExternalKv
    calls (the bridge's probes) are counted; the first ones go as `probe_answers` says: a status
    to fail with (an indexer too slow to answer, or unreachable), or None to answer that
    nothing is held (a read lagging the applies), while the state stays intact. An apply is
    answered `apply_delay_s` after it changed the index (a target slow to answer). While
    `refusing` is set, the applies it holds for are refused with its status, unchanged, and
    kept in `refused` (a target that would refuse them again)."""

    def __init__(
        self,
        servicer: KvIndexerServicer,
        unavailable: int = 0,
        probe_answers: tuple[grpc.StatusCode | None, ...] = (),
    ) -> None:
        super().__init__(servicer.backend, servicer.limiter)
        self.received: list[kv.ApplyExternalKvBatchRequest] = []
        self.unavailable = unavailable
        self.arrived = asyncio.Condition()
        self.num_matches = 0
        self.apply_delay_s = 0.0
        self.probe_answers = list(probe_answers)
        self.refusing: tuple[grpc.StatusCode, Callable[[kv.ApplyExternalKvBatchRequest], bool]]
        self.refusing = (grpc.StatusCode.OK, lambda _request: False)
        self.refused: list[kv.ApplyExternalKvBatchRequest] = []

    async def MatchExternalKv(
        self, request: kv.MatchExternalKvRequest, context: Any
    ) -> kv.MatchExternalKvResponse:
        self.num_matches += 1
        if self.probe_answers:
            code = self.probe_answers.pop(0)
            if code is None:
                return kv.MatchExternalKvResponse()
            await context.abort(code, "not now")
        return await super().MatchExternalKv(request, context)

    async def ApplyExternalKvBatch(
        self, request: kv.ApplyExternalKvBatchRequest, context: Any
    ) -> kv.ApplyExternalKvBatchResponse:
        if self.unavailable:
            self.unavailable -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        code, refuses = self.refusing
        if refuses(request):
            async with self.arrived:
                self.refused.append(request)
                self.arrived.notify_all()
            await context.abort(code, "refused")
        response = await super().ApplyExternalKvBatch(request, context)
        async with self.arrived:
            self.received.append(request)
            self.arrived.notify_all()
        await asyncio.sleep(self.apply_delay_s)
        return response

    async def wait_for(self, count: int) -> list[kv.ApplyExternalKvBatchRequest]:
        async with asyncio.timeout(WAIT_S), self.arrived:
            await self.arrived.wait_for(lambda: len(self.received) >= count)
        return self.received

    async def wait_for_seq(self, seq: int) -> None:
        """Until a batch of `seq` arrived (its answer may still be pending): a count of
        batches would not say which, when how many clears come first is a race."""
        async with asyncio.timeout(WAIT_S), self.arrived:
            await self.arrived.wait_for(lambda: any(r.seq == seq for r in self.received))


@dataclass
class Rig:
    index: PrefixIndex
    recorder: RecordingServicer
    target: str


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def _rig(
    *,
    unavailable: int = 0,
    listen: str = "127.0.0.1:0",
    tls: TlsConfig | None = None,
    auth: AuthConfig | None = None,
    index: PrefixIndex | None = None,
    probe_answers: tuple[grpc.StatusCode | None, ...] = (),
) -> tuple[Rig, grpc.aio.Server]:
    """A KVIndexer server over `index` (a new, empty one by default)."""
    index = PrefixIndex() if index is None else index
    _, servicer, _ = index_services(
        MemoryBackend(index), default_block_size=16, max_concurrent_prefix_queries=4
    )
    recorder = RecordingServicer(servicer, unavailable, probe_answers)
    service = Service(
        "kv_indexer.v1.KVIndexer",
        lambda server: kv_grpc.add_KVIndexerServicer_to_server(recorder, server),
        frozenset({"ApplyExternalKvBatch"}),
    )
    server, port = await create_server(ServerConfig(listen=listen, tls=tls, auth=auth), [service])
    return Rig(index, recorder, f"127.0.0.1:{port}"), server


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"sglang", seq.to_bytes(8, "big"), payload]


def _request(seq: int, *actions: kv.ExternalKvAction) -> kv.ApplyExternalKvBatchRequest:
    return kv.ApplyExternalKvBatchRequest(
        worker_id="sgl-0", seq=seq, actions=actions, worker_address="10.0.0.9:30000"
    )


async def _bridge_run(
    context: zmq.asyncio.Context, rig: Rig, publisher: FakeKvPublisher, **kwargs: Any
) -> Any:
    settings = BridgeSettings(
        endpoint=publisher.endpoint,
        target=rig.target,
        worker_id="sgl-0",
        worker_address="10.0.0.9:30000",
        **kwargs,
    )
    return build_bridge(settings, context=context)


async def test_sglang_vectors_through_the_bridge(context: zmq.asyncio.Context) -> None:
    rig, server = await _rig()
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(context, rig, publisher)
    marker = msgpack.packb([9.0, [["BlockRemoved", [555], "GPU"]], None])
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_frames(0, VECTOR_1))
            await publisher.send(_frames(1, VECTOR_2))
            await publisher.send(_frames(2, VECTOR_3))
            await publisher.send(_frames(3, marker))
            received = await rig.recorder.wait_for(4)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert received == [
        _request(0, *CLEAR_ALL),  # the first message clears what an earlier run left
        _request(
            0,
            kv.ExternalKvAction(
                type=kv.ACTION_REPORT,
                tier=HBM,
                hashes=[1234567890123, -987654321],
                block_sizes=[4, 4],
                parent_block_hash=42,
            ),
            kv.ExternalKvAction(type=kv.ACTION_REVOKE, tier=SSD, hashes=[100, 200]),
            *CLEAR_ALL,  # AllBlocksCleared: one CLEAR per configured tier, in place
        ),
        _request(
            1, kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=HBM, hashes=[111], block_sizes=[2])
        ),
        # Vector 3 (nil media) produced no call at all; the next one is the marker.
        _request(3, kv.ExternalKvAction(type=kv.ACTION_REVOKE, tier=HBM, hashes=[555])),
    ]
    assert {p.key for p in rig.index.placements("sgl-0")} == {111}
    assert source.translator.counters.num_skipped_medium == 2


async def _bridged_masks(
    context: zmq.asyncio.Context, form: EventForm, **options: Any
) -> dict[int, int]:
    """The component mask of each block the target holds once the hybrid stream in `form`
    went through a bridge with `options` (BridgeSettings fields)."""
    rig, server = await _rig()
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(context, rig, publisher, **options)
    marker = msgpack.packb([9.0, [["BlockRemoved", [555], "GPU"]], None])
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_frames(0, hybrid_payload(form)))
            await publisher.send(_frames(1, marker))  # its REVOKE comes after the stream's
            await rig.recorder.wait_for_seq(1)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    return {p.key: p.component_mask for p in rig.index.placements("sgl-0")}


async def test_a_hybrid_models_array_events_keep_their_groups_only_with_array_tail_vllm(
    context: zmq.asyncio.Context,
) -> None:
    """`--array-tail vllm`: the groups of the array form (past index 7) reach the target as
    the map form's do: block 2, evicted from the sliding-window group only, keeps FULL. By
    default they are engine-specific and ignored: both groups' stores read as group 0's (a
    plain model's blocks, no component masks), and the eviction, whose group BlockRemoved
    carries before index 7, finds nothing of block 2 in group 1 to remove."""
    full, swa = Component.FULL, Component.SWA
    as_maps = await _bridged_masks(context, "map")  # maps are read by name
    assert as_maps == {1: full | swa, 2: full, 3: full | swa}
    assert await _bridged_masks(context, "array", array_tail="vllm") == as_maps
    assert await _bridged_masks(context, "array") == {1: 0, 2: 0, 3: 0}


async def test_the_bridge_dials_an_indexer_serving_mutual_tls(
    context: zmq.asyncio.Context, pki: Path
) -> None:
    tls = TlsConfig(
        cert_file=pki / "server.pem", key_file=pki / "server.key", client_ca_file=pki / "ca.pem"
    )
    rig, server = await _rig(tls=tls)
    channels = ClientChannels.load(
        ClientTlsConfig(
            ca_file=pki / "ca.pem", cert_file=pki / "client.pem", key_file=pki / "client.key"
        )
    )
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(context, rig, publisher, channels=channels)
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_frames(0, VECTOR_2))
            received = await rig.recorder.wait_for(2)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert received[1] == _request(
        0, kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=HBM, hashes=[111], block_sizes=[2])
    )
    assert sink.num_retries == 0 and sink.num_rejected == 0


async def test_a_bridge_whose_token_the_indexer_refuses_stops(
    context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Every batch would be refused alike: the bridge stops with one error (the CLI exits 1)
    rather than run on dropping each batch."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    rig, server = await _rig(auth=AuthConfig(token_file=token_file))
    publisher = FakeKvPublisher(context)
    wrong = ClientChannels().with_metadata(bearer_token_metadata("wrong"))
    source, sink = await _bridge_run(context, rig, publisher, channels=wrong)
    try:
        run = asyncio.ensure_future(source.run())
        await publisher.wait_subscribed()
        await publisher.send(_frames(0, VECTOR_2))
        with pytest.raises(
            ConfigError, match=r"refuses the bridge: UNAUTHENTICATED: .*--token-file"
        ):
            await asyncio.wait_for(run, WAIT_S)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert rig.recorder.received == []


async def test_configured_nil_medium_and_clear_tiers(context: zmq.asyncio.Context) -> None:
    rig, server = await _rig()
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(
        context, rig, publisher, media=MediumMap(nil=Tier.DRAM), clear_tiers=(Tier.HBM,)
    )
    cleared = msgpack.packb([1.0, [["AllBlocksCleared"]], None])
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_frames(0, VECTOR_3))
            await publisher.send(_frames(1, cleared))
            received = await rig.recorder.wait_for(3)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert received[1:] == [
        _request(
            0,
            kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=DRAM, hashes=[1], block_sizes=[2]),
            kv.ExternalKvAction(type=kv.ACTION_REVOKE, tier=DRAM, hashes=[2]),
        ),
        _request(1, kv.ExternalKvAction(type=kv.ACTION_CLEAR_ALL_AT_TIER, tier=HBM)),
    ]


async def test_oversized_batches_are_split_with_the_same_seq_and_retried_when_unavailable(
    context: zmq.asyncio.Context,
) -> None:
    rig, server = await _rig(unavailable=2)
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(context, rig, publisher)
    removals = [["BlockRemoved", [i + 1], "GPU" if i % 2 else "CPU"] for i in range(300)]
    big_store = [["BlockStored", list(range(1, 20_001)), None, None, 16, None, "GPU"]]
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.send(_frames(0, msgpack.packb([0.0, removals, None])))
            await publisher.send(_frames(1, msgpack.packb([1.0, big_store, None])))
            received = await rig.recorder.wait_for(5)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert [(r.seq, len(r.actions)) for r in received] == [
        (0, 3),
        (0, 256),
        (0, 44),
        (1, 1),
        (1, 1),
    ]
    assert [len(r.actions[0].hashes) for r in received[3:]] == [16_384, 3_616]
    assert received[4].actions[0].parent_block_hash == 16_384
    assert sink.num_retries == 2 and sink.num_rejected == 0
    assert len(list(rig.index.placements("sgl-0"))) == 20_000


async def _best_prefix(target: str, hashes: list[int]) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        response = await kv_grpc.KVIndexerStub(channel).MatchExternalKvPrefix(
            kv.MatchExternalKvPrefixRequest(hashes=hashes), timeout=5, wait_for_ready=True
        )
    return response.best_prefix_blocks


def _stored(seq: int, hashes: list[int], parent: int | None) -> list[bytes]:
    event = ["BlockStored", hashes, parent, [1] * 4 * len(hashes), 4, None, "GPU"]
    return _frames(seq, msgpack.packb([float(seq), [event], None]))


def _stored_actions(hashes: list[int], parent: int | None) -> list[kv.ExternalKvAction]:
    """What the bridge sends the target for `_stored(seq, hashes, parent)`."""
    report = kv.ExternalKvAction(
        type=kv.ACTION_REPORT, tier=HBM, hashes=hashes, block_sizes=[4] * len(hashes)
    )
    if parent is not None:
        report.parent_block_hash = parent
    return [report]


async def test_a_target_that_restarts_empty_is_rebuilt_from_the_replay(
    context: zmq.asyncio.Context,
) -> None:
    """The target goes down after applying seq 0 and comes back on its address, empty, while
    the bridge retries seq 1: once seq 1 gets through, the bridge clears the worker and
    rebuilds it from the publisher's replay, so the target ends with exactly the publisher's
    blocks, each batch applied once after that clear."""
    rig, server = await _rig()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source, sink = await _bridge_run(
        context, rig, publisher, replay_endpoint=publisher.replay_endpoint
    )
    before = rig
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, [11, 12], None))
            # Seq 0 applied and answered (however many clears came first: see below).
            await eventually(
                lambda: (
                    _keys(before.index) == {11, 12}
                    and sink.num_sent == len(before.recorder.received)
                ),
                WAIT_S,
            )
            await server.stop(None)  # the indexer goes down ...
            await publisher.publish(_stored(1, [13], 12))  # ... while the engine goes on
            await eventually(lambda: sink.num_retries > 0, WAIT_S)  # seq 1 held, retried
            # ... and comes back on the same address, empty.
            rig, server = await _rig(listen=rig.target)
            await eventually(lambda: _keys(rig.index) == {11, 12, 13}, WAIT_S)
            best = await _best_prefix(rig.target, [11, 12, 13])
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert best == 3  # the blocks indexed before the restart are back, as one prefix
    assert source.counters.num_resyncs == 1
    assert publisher.replay_requests == [0, 0]  # the start's rebuild, then the resync
    # Before the restart, one clear, then seq 0 once. The start's replay races the publish of
    # seq 0: either it brought seq 0 (seq 0 from the replay, its live copy dropped as a
    # duplicate), or it came back empty before seq 0 was published, which clears at once, and
    # seq 0, the first message, applies without clearing again (a worker the source cleared
    # and has written nothing to since: docs/indexer.md, the `resets` metric).
    assert before.recorder.received == [
        _request(0, *CLEAR_ALL),
        _request(0, *_stored_actions([11, 12], None)),
    ]
    assert source.counters.num_duplicates in {0, 1}
    # After it: the held seq 1, then the resync's clear and the replay of seqs 0 and 1.
    assert rig.recorder.received == [
        _request(1, *_stored_actions([13], 12)),
        _request(1, *CLEAR_ALL),
        _request(0, *_stored_actions([11, 12], None)),
        _request(1, *_stored_actions([13], 12)),
    ]


@needs_ipv6_loopback
async def test_the_bridge_follows_a_publisher_on_ipv6_from_its_replay_then_live(
    context: zmq.asyncio.Context,
) -> None:
    """A publisher bound to IPv6 addresses only (`tcp://[::1]`): the bridge rebuilds the
    worker from its replay before any message, then follows the live stream."""
    rig, server = await _rig()
    publisher = FakeKvPublisher(context, endpoint="tcp://[::1]:*", replay_endpoint="tcp://[::1]:*")
    publisher.start_replay()
    await publisher.publish(_stored(0, [11, 12], None), live=False)  # sent before it started
    source, sink = await _bridge_run(
        context, rig, publisher, replay_endpoint=publisher.replay_endpoint
    )
    try:
        async with running(source.run()):
            await eventually(lambda: _keys(rig.index) == {11, 12}, WAIT_S, "the replay")
            await publisher.wait_subscribed()
            await publisher.publish(_stored(1, [13], 12))
            await eventually(lambda: _keys(rig.index) == {11, 12, 13}, WAIT_S, "seq 1 live")
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert publisher.endpoint.startswith("tcp://[::1]:")
    assert publisher.replay_endpoint.startswith("tcp://[::1]:")
    assert source.counters.num_replay_failures == 0


# -- the probe -----------------------------------------------------------------------------------

PROBE_S = 0.05


def _keys(index: PrefixIndex) -> set[int]:
    return {p.key for p in index.placements("sgl-0")}


def _removed(seq: int, hashes: list[int]) -> list[bytes]:
    return _frames(seq, msgpack.packb([float(seq), [["BlockRemoved", hashes, "GPU"]], None]))


@contextlib.asynccontextmanager
async def _probed(
    context: zmq.asyncio.Context, rig: Rig, server: grpc.aio.Server
) -> AsyncIterator[tuple[FakeKvPublisher, ZmqSource, KvIndexerSink]]:
    """A bridge from a new publisher (with a replay endpoint) to `rig`'s target, probing it
    every PROBE_S, subscribed; the publisher, the bridge and `server` stopped at the end."""
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source, sink = await _bridge_run(
        context, rig, publisher, replay_endpoint=publisher.replay_endpoint
    )
    try:
        async with running(follow(source, sink, probe_interval_s=PROBE_S)):
            await publisher.wait_subscribed()
            yield publisher, source, sink
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)


async def test_a_target_that_restarts_empty_while_the_engine_is_idle_is_rebuilt(
    context: zmq.asyncio.Context,
) -> None:
    """No apply fails (nothing is published), yet the probe finds the canary missing and the
    worker is rebuilt from the publisher's replay."""
    rig, server = await _rig()
    async with _probed(context, rig, server) as (publisher, source, sink):
        await publisher.publish(_stored(0, [11, 12], None))
        await publisher.publish(_stored(1, [13], 12))
        await eventually(lambda: _keys(rig.index) == {11, 12, 13}, WAIT_S)
        await server.stop(None)
        rig, back = await _rig(listen=rig.target)  # back on the same address, empty
        try:
            await eventually(lambda: _keys(rig.index) == {11, 12, 13}, WAIT_S)
            best = await _best_prefix(rig.target, [11, 12, 13])
        finally:
            await back.stop(None)
    assert best == 3
    assert sink.num_losses_found == 1 and source.counters.num_resyncs == 1
    assert publisher.replay_requests == [0, 0]  # the start's rebuild, then the resync
    assert [r.seq for r in rig.recorder.received] == [1, 0, 1]  # a clear, then the replay
    assert rig.recorder.received[0].actions == CLEAR_ALL


async def test_without_a_replay_a_lost_worker_is_cleared_and_rebuilt_by_the_next_event(
    context: zmq.asyncio.Context,
) -> None:
    """The documented behaviour without --replay-endpoint: the probe finds the loss and clears
    the worker once; the next event rebuilds it from that event on (older blocks stay missing,
    never stale)."""
    rig, server = await _rig()
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(context, rig, publisher)
    try:
        async with running(follow(source, sink, probe_interval_s=PROBE_S)):
            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, [11, 12], None))
            await eventually(lambda: _keys(rig.index) == {11, 12}, WAIT_S)
            await server.stop(None)
            rig, server = await _rig(listen=rig.target)
            cleared = list(await rig.recorder.wait_for(1))
            await publisher.publish(_stored(1, [13], 12))
            await eventually(lambda: _keys(rig.index) == {13}, WAIT_S)
            probes = rig.recorder.num_matches
            # 13 is the canary
            await eventually(lambda: rig.recorder.num_matches >= probes + 3, WAIT_S)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert cleared == [_request(0, *CLEAR_ALL)]
    assert sink.num_losses_found == 1 and source.counters.num_resyncs == 1


async def test_a_slow_lagging_or_unreachable_target_that_kept_its_state_is_not_resynced(
    context: zmq.asyncio.Context,
) -> None:
    """Probes that fail (DEADLINE_EXCEEDED, UNAVAILABLE, the server down) tell nothing, and one
    miss that the next answer contradicts is a lagging read: no resync, however many intervals
    they last."""
    index = PrefixIndex()
    late, down = grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE
    codes = (late, down, None, late, down, late)
    rig, server = await _rig(index=index, probe_answers=codes)
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source, sink = await _bridge_run(
        context, rig, publisher, replay_endpoint=publisher.replay_endpoint
    )
    try:
        async with running(follow(source, sink, probe_interval_s=PROBE_S)):
            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, [11, 12], None))
            await eventually(lambda: _keys(index) == {11, 12}, WAIT_S)
            await eventually(lambda: rig.recorder.num_matches >= len(codes) + 2, WAIT_S)
            await server.stop(None)
            probes = sink.num_probes
            # each fails: nobody listens
            await eventually(lambda: sink.num_probes >= probes + 3, WAIT_S)
            rig, server = await _rig(listen=rig.target, index=index)  # back, state intact
            await eventually(lambda: rig.recorder.num_matches >= 3, WAIT_S)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert sink.num_losses_found == 0 and source.counters.num_resyncs == 0
    assert rig.recorder.received == []  # no clear, no replay
    assert publisher.replay_requests == [0]  # the start's rebuild only


async def test_a_revoked_canary_is_not_taken_for_a_lost_worker(
    context: zmq.asyncio.Context,
) -> None:
    """Not even while the target is slow to answer the REVOKE it applied: the probe waits for
    the apply in flight instead of asking for a block the target just dropped."""
    rig, server = await _rig()
    async with _probed(context, rig, server) as (publisher, source, sink):
        await publisher.publish(_stored(0, [11, 12], None))  # 11 becomes the canary
        await eventually(lambda: _keys(rig.index) == {11, 12}, WAIT_S)
        rig.recorder.apply_delay_s = 20 * PROBE_S
        await publisher.publish(_removed(1, [11]))  # ... and goes
        await rig.recorder.wait_for_seq(1)  # applied, its answer delayed
        rig.recorder.apply_delay_s = 0.0
        await publisher.publish(_stored(2, [13], None))
        await eventually(lambda: _keys(rig.index) == {12, 13}, WAIT_S)
        probes = rig.recorder.num_matches
        await eventually(lambda: rig.recorder.num_matches >= probes + 3, WAIT_S)
    assert sink.num_losses_found == 0 and source.counters.num_resyncs == 0
    assert publisher.replay_requests == [0]  # the start's rebuild only
    # Each batch reached the target once, in order, after one clear. The start's replay races
    # the publish of seq 0: either it brought seq 0 (seq 0 from the replay, its live copy
    # dropped as a duplicate), or it came back empty before seq 0 was published, which clears
    # at once, and seq 0, the first message, applies without clearing again (a worker the
    # source cleared and has written nothing to since: docs/indexer.md, the `resets` metric).
    received = rig.recorder.received
    assert received[0] == _request(0, *CLEAR_ALL)
    assert [r.seq for r in received[1:]] == [0, 1, 2]
    assert source.counters.num_duplicates in {0, 1}


def _is_clear(request: kv.ApplyExternalKvBatchRequest) -> bool:
    return any(a.type == kv.ACTION_CLEAR_ALL_AT_TIER for a in request.actions)


async def test_a_clear_the_target_refuses_is_sent_again_at_the_next_clear(
    context: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The target holds a block of the worker from an earlier run (stale) and refuses the
    start's clear with a status that is not transient. The worker is not taken as cleared:
    the next clear (at the SUB's connection, or the first message's rebuild) is sent and
    lands, so the stale block goes (before, it was skipped as a clear of a worker cleared
    already, and the block stayed). Only the clear that landed counts as a reset (the refused
    one was counted too, 2 for one clear). A refused batch of blocks is a bad message, not
    applied."""
    rig, server = await _rig()
    async with grpc.aio.insecure_channel(rig.target) as channel:
        await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(
            _request(0, *_stored_actions([99], None)), timeout=5
        )
    # (The first clear only: the next one must land.)
    rig.recorder.refusing = (
        grpc.StatusCode.INTERNAL,
        lambda request: _is_clear(request) and not rig.recorder.refused,
    )
    publisher = FakeKvPublisher(context)  # its replay holds nothing yet
    publisher.start_replay()
    source, sink = await _bridge_run(
        context, rig, publisher, replay_endpoint=publisher.replay_endpoint
    )
    try:
        async with running(source.run()):
            async with asyncio.timeout(WAIT_S), rig.recorder.arrived:
                await rig.recorder.arrived.wait_for(lambda: len(rig.recorder.refused) == 1)
            rig.recorder.refusing = (
                grpc.StatusCode.FAILED_PRECONDITION,
                lambda request: request.seq == 1 and not _is_clear(request),
            )
            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, [11, 12], None))
            await publisher.publish(_stored(1, [13], 12))  # refused
            await publisher.publish(_stored(2, [14], None))
            await eventually(lambda: 14 in _keys(rig.index), WAIT_S)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert _keys(rig.index) == {11, 12, 14}  # not the stale 99
    assert [r.seq for r in rig.recorder.refused] == [0, 1]
    assert sink.num_rejected == 2
    assert source.counters.num_resets == 1  # the clear that landed
    assert source.counters.num_bad_messages == 1  # seq 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("refused to clear it" in m and "INTERNAL: refused" in m for m in warned), warned
    assert any("dropping seq 1" in m and "FAILED_PRECONDITION" in m for m in warned), warned


async def test_a_bridge_the_indexer_denies_permission_stops(context: zmq.asyncio.Context) -> None:
    """PERMISSION_DENIED (a proxy or an indexer whose policy does not let this bridge write)
    would refuse every batch alike, as a wrong token does: the bridge stops with one error
    instead of running on, dropping each batch as a bad message."""
    rig, server = await _rig()
    rig.recorder.refusing = (grpc.StatusCode.PERMISSION_DENIED, lambda _request: True)
    publisher = FakeKvPublisher(context)
    source, sink = await _bridge_run(context, rig, publisher)
    try:
        run = asyncio.ensure_future(source.run())
        await publisher.wait_subscribed()
        await publisher.send(_frames(0, VECTOR_2))
        with pytest.raises(ConfigError, match=r"refuses the bridge: PERMISSION_DENIED: refused"):
            await asyncio.wait_for(run, WAIT_S)
    finally:
        await publisher.close()
        await sink.close()
        await server.stop(None)
    assert rig.recorder.received == [] and sink.num_rejected == 0


async def test_a_lost_worker_is_found_while_another_worker_holds_the_same_blocks(
    context: zmq.asyncio.Context,
) -> None:
    """Engines of one model give the same prompt the same block hashes: another worker of the
    target holds 11 and 12 too. The target loses this bridge's worker (its entries evicted):
    the probe asks about its own worker's placements, not whoever holds the hashes, so the
    loss is found and the worker rebuilt from the replay."""
    rig, server = await _rig()
    other = (Action(ActionType.REPORT, Tier.HBM, (11, 12)),)
    rig.index.apply(Batch("other-0", other, "10.0.0.8:30000"))
    async with _probed(context, rig, server) as (publisher, source, sink):
        await publisher.publish(_stored(0, [11, 12], None))
        await eventually(lambda: _keys(rig.index) == {11, 12}, WAIT_S)
        rig.index.remove_worker("sgl-0")
        await eventually(lambda: sink.num_losses_found == 1, WAIT_S, "the loss to be found")
        await eventually(lambda: _keys(rig.index) == {11, 12}, WAIT_S, "the rebuild")
    assert source.counters.num_resyncs == 1
    assert {p.key for p in rig.index.placements("other-0")} == {11, 12}


async def test_the_probe_counts_no_hits(context: zmq.asyncio.Context) -> None:
    """The probe's questions are the bridge's own, not requests routed to the blocks: however
    many probes ran, the target's hit counts of the delivered blocks stay 0."""
    rig, server = await _rig()
    async with _probed(context, rig, server) as (publisher, _source, _sink):
        await publisher.publish(_stored(0, [11, 12], None))
        await eventually(lambda: _keys(rig.index) == {11, 12}, WAIT_S)
        probes = rig.recorder.num_matches
        await eventually(lambda: rig.recorder.num_matches >= probes + 3, WAIT_S)
        async with grpc.aio.insecure_channel(rig.target) as channel:
            counts = await kv_grpc.KVIndexerStub(channel).GetExternalKvHitCounts(
                kv.GetExternalKvHitCountsRequest(hashes=[11, 12])
            )
    assert [(e.hash, e.hit_count_total) for e in counts.entries if e.hit_count_total] == []


async def test_a_batch_the_target_refused_is_not_probed_for(
    context: zmq.asyncio.Context,
) -> None:
    """The target refuses one batch (it changed nothing there): the bridge drops it, and its
    blocks are not among those it delivered, so the probe does not find them missing and
    resync a target that lost nothing."""
    rig, server = await _rig()
    rig.recorder.refusing = (grpc.StatusCode.INVALID_ARGUMENT, lambda request: request.seq == 1)
    async with _probed(context, rig, server) as (publisher, source, sink):
        await publisher.publish(_stored(0, [11, 12], None))
        await publisher.publish(_stored(1, [13], 12))  # refused
        await publisher.publish(_stored(2, [14], None))
        await eventually(lambda: _keys(rig.index) == {11, 12, 14}, WAIT_S)
        probes = rig.recorder.num_matches
        await eventually(lambda: rig.recorder.num_matches >= probes + 3, WAIT_S)
    assert [r.seq for r in rig.recorder.refused] == [1]
    assert sink.num_rejected == 1
    assert sink.num_losses_found == 0 and source.counters.num_resyncs == 0
