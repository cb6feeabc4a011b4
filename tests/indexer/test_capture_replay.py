"""The real vLLM 0.32.0 capture, replayed through a real ZMQ PUB and a real replay ROUTER (serving
the captured replay replies) into a running ZMQ source of the indexer.

Oracles come from the capture itself (`vllm_capture.LiveModel`, written independently of the
translator): the indexed set equals what vLLM holds live, with copies, after every checkpoint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from functools import partial

import grpc
import pytest
import zmq.asyncio

from indexer.batch import Tier, to_sfixed64
from indexer.engine_events import BlockStored
from indexer.index import PrefixIndex
from indexer.memory_backend import MemoryBackend
from indexer.servicer import index_services
from indexer.sources.zmq import ZmqSource, ZmqSourceSettings
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from indexer.vllm_hash import block_hashes
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.config import ServerConfig
from kvplane.server import create_server
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from tests.indexer.fake_kv_publisher import FakeKvPublisher, running
from tests.indexer.vllm_capture import (
    BLOCK_SIZE,
    TOPIC,
    CapturedMessage,
    LiveModel,
    final_live,
    live_messages,
    replay_replies,
    requests,
)

pytestmark = pytest.mark.timeout(120)
WAIT_S = 20.0
CLEAR_SEQ = 56  # the batch carrying AllBlocksCleared


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def _replay_frames() -> dict[int, list[bytes]]:
    """The captured replay replies (seq -> [topic, seq, payload]): what the ROUTER serves."""
    out = {}
    for frames in replay_replies():
        seq = int.from_bytes(frames[2], "big")
        if seq != (1 << 64) - 1:
            out[seq] = frames[1:]
    return out


REPLAY = _replay_frames()


def _handled(source: ZmqSource, seq: int) -> bool:
    """Whether `source` has handled the message numbered `seq`."""
    return source.last_seq == seq


def _source(
    publisher: FakeKvPublisher,
    context: zmq.asyncio.Context,
    backend: MemoryBackend,
    *,
    worker_id: str = "w0",
    mode: HashMode = HashMode.ENGINE,
    topic: str = "kv@",
    rebuild_at_start: bool = False,
) -> ZmqSource:
    translator = WorkerTranslator(
        TranslateOptions(worker_id, "10.0.0.1:8000", hash_mode=mode, default_block_size=32)
    )
    settings = ZmqSourceSettings(
        endpoint=publisher.endpoint,
        replay_endpoint=publisher.replay_endpoint,
        topic=topic,
        replay_timeout_s=5.0,
        # Most tests here follow the first-message rules; the rebuild at start has its own.
        rebuild_at_start=rebuild_at_start,
    )
    return ZmqSource(settings, translator, backend, context=context)


def _indexed(index: PrefixIndex, worker_id: str = "w0") -> dict[int, int]:
    return {p.key: p.copies for p in index.placements(worker_id)}


def _model_through(seq: int) -> LiveModel:
    model = LiveModel()
    for message in live_messages():
        if message.seq <= seq:
            model.apply(message.events)
    return model


async def _publish(
    publisher: FakeKvPublisher,
    messages: Iterable[CapturedMessage],
    source: ZmqSource,
    *,
    drop: range = range(0),
    until: int | None = None,
) -> None:
    for message in messages:
        if until is not None and message.seq > until:
            break
        await publisher.publish(
            message.frames,
            live=message.seq not in drop,
            replay_frames=REPLAY[message.seq],
        )
    last = until if until is not None else live_messages()[-1].seq
    await source.wait_until(lambda: source.last_seq == last, WAIT_S)


def _assert_matches_vllm(source: ZmqSource, index: PrefixIndex, seq: int) -> None:
    model = _model_through(seq)
    assert set(_indexed(index)) == set(model.live())
    # Copies are counted by the source (the KVIndexer API has none): the same hash live in
    # two physical blocks needs two removals.
    assert source.translator.live_keys(Tier.HBM) == model.live()


async def test_a_source_started_beside_an_idle_engine_indexes_its_replay_buffer_at_once(
    context: zmq.asyncio.Context,
) -> None:
    """An indexer (or controller) restarted while the engine publishes nothing: the blocks the
    engine announced before are indexed from its replay without waiting for its next batch,
    and stale entries of the earlier run are gone."""
    index = PrefixIndex()
    backend = MemoryBackend(index)
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    for message in live_messages()[:CLEAR_SEQ]:  # published before this source ran
        await publisher.publish(message.frames, live=False, replay_frames=REPLAY[message.seq])
    stale = WorkerTranslator(TranslateOptions("w0", "10.0.0.1:8000"))
    for batch in stale.translate([BlockStored(block_hashes=(12345,), medium="GPU")]):
        await backend.apply(batch)
    source = _source(publisher, context, backend, rebuild_at_start=True)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.last_seq == CLEAR_SEQ - 1, WAIT_S)
            _assert_matches_vllm(source, index, CLEAR_SEQ - 1)
            # The stream then goes on from there, the replayed batches not applied twice.
            await publisher.wait_subscribed()
            await _publish(publisher, live_messages()[CLEAR_SEQ:], source)
    finally:
        await publisher.close()
    # The start's rebuild; then the first live message, the first on the SUB's connection, is
    # checked against the replay as any new connection's is (docs/indexer.md).
    assert publisher.replay_requests == [0, CLEAR_SEQ - 1]
    assert source.counters.num_gaps == source.counters.num_resyncs == 0
    assert set(_indexed(index)) == set(final_live().live())


async def test_capture_replayed_live_ends_with_exactly_vllms_live_blocks(
    context: zmq.asyncio.Context,
) -> None:
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    source = _source(publisher, context, MemoryBackend(index))
    try:
        async with running(source.run()):
            assert await publisher.wait_subscribed() == b"kv@"
            messages = live_messages()
            await _publish(publisher, messages, source, until=CLEAR_SEQ - 1)
            before_clear = _model_through(CLEAR_SEQ - 1)
            assert len(before_clear.live()) == 46  # re-announcements are not copies
            assert sum(before_clear.live().values()) == 46
            _assert_matches_vllm(source, index, CLEAR_SEQ - 1)
            await _publish(publisher, messages[CLEAR_SEQ:], source)
    finally:
        await publisher.close()
    final = final_live()
    assert set(_indexed(index)) == set(final.live())
    assert len(final.live()) == 8  # AllBlocksCleared, then the P7 requests' blocks
    assert source.counters.num_messages == 60
    assert source.counters.num_gaps == source.counters.num_bad_messages == 0
    assert publisher.replay_requests == []


@pytest.mark.parametrize("with_topic", [True, False], ids=["topic", "no-topic"])
async def test_a_gap_is_healed_by_replay(context: zmq.asyncio.Context, with_topic: bool) -> None:
    index = PrefixIndex()
    publisher = FakeKvPublisher(context, replay_with_topic=with_topic)
    publisher.start_replay()
    source = _source(publisher, context, MemoryBackend(index))
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            messages = live_messages()
            await _publish(publisher, messages, source, drop=range(20, 25), until=CLEAR_SEQ - 1)
            _assert_matches_vllm(source, index, CLEAR_SEQ - 1)
            await _publish(publisher, messages[CLEAR_SEQ:], source)
    finally:
        await publisher.close()
    # One replay, from the last applied seq (19, checked byte for byte) through the gap.
    assert publisher.replay_requests == [19]
    assert source.counters.num_gaps == 1
    assert source.counters.num_resets == 1  # only the first message's clear: no rebuild
    assert source.counters.num_replayed_messages >= 5
    assert set(_indexed(index)) == set(final_live().live())


async def test_a_gap_replay_cannot_cover_clears_and_rebuilds_without_stale_entries(
    context: zmq.asyncio.Context,
) -> None:
    index = PrefixIndex()
    # The replay buffer keeps 3 batches: by seq 25 it no longer reaches back to seq 20.
    publisher = FakeKvPublisher(context, buffer_steps=3)
    publisher.start_replay()
    source = _source(publisher, context, MemoryBackend(index))
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            messages = live_messages()
            await _publish(publisher, messages, source, drop=range(20, 25), until=CLEAR_SEQ - 1)
            # Rebuilt from seq 25 on: some live blocks may be missing, none may be stale.
            assert set(_indexed(index)) <= set(_model_through(CLEAR_SEQ - 1).live())
            await _publish(publisher, messages[CLEAR_SEQ:], source)
    finally:
        await publisher.close()
    # Seq 19 is no longer buffered: rebuilt from that replay's batches (the whole buffer).
    assert publisher.replay_requests == [19]
    assert source.counters.num_resets == 2  # the first message's clear, then the rebuild
    assert set(_indexed(index)) == set(final_live().live())


def _lost_removal_seq(through: int) -> int:
    """The first captured batch (before `through`) that removes blocks still gone at
    `through`: losing it in a replay would leave them indexed."""
    gone = set(_model_through(through).live())
    for message in live_messages()[:through]:
        removed = {
            to_sfixed64(h)
            for event in message.events
            if event["type"] == "BlockRemoved"
            for h in event["block_hashes"]
        }
        if removed and not removed & gone:
            return message.seq
    raise AssertionError("the capture has no such removal")


async def test_a_replay_that_lost_a_batch_at_the_routers_high_water_mark_asks_for_it_again(
    context: zmq.asyncio.Context,
) -> None:
    """vLLM's replay ROUTER sends its whole buffer in one loop and drops what its high-water
    mark cannot take, the end marker still coming last (measured: a 10,000-batch buffer lost
    some on loopback). The source asks for the hole again instead of applying the replay
    without the lost batch, whose removals would otherwise leave evicted blocks indexed."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    last = CLEAR_SEQ - 1
    lost = _lost_removal_seq(last)
    for message in live_messages()[:CLEAR_SEQ]:  # published before this source ran
        await publisher.publish(message.frames, live=False, replay_frames=REPLAY[message.seq])
    publisher.lose_in_replays(lost, times=1)
    source = _source(publisher, context, MemoryBackend(index), rebuild_at_start=True)
    try:
        async with running(source.run()):
            await source.wait_until(lambda: source.last_seq == last, WAIT_S)
    finally:
        await publisher.close()
    _assert_matches_vllm(source, index, last)
    assert publisher.replay_requests == [0, lost]
    assert source.counters.num_gaps == 0


@pytest.mark.parametrize("at_start", [True, False], ids=["start-replay", "first-message"])
async def test_a_replay_hole_that_stays_unfilled_leaves_blocks_missing_never_stale(
    context: zmq.asyncio.Context, at_start: bool
) -> None:
    """A batch every replay loses (the ROUTER keeps dropping it): the worker is rebuilt from
    the batches after it only, as from a buffer trimmed there, whether the rebuild runs at
    start or at the first message (its seq not 0)."""
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    last = CLEAR_SEQ - 1
    lost = _lost_removal_seq(last)
    messages = live_messages()
    replayed_only = messages[:last] if not at_start else messages[: last + 1]
    for message in replayed_only:
        await publisher.publish(message.frames, live=False, replay_frames=REPLAY[message.seq])
    publisher.lose_in_replays(lost)
    source = _source(publisher, context, MemoryBackend(index), rebuild_at_start=at_start)
    try:
        async with running(source.run()):
            if not at_start:  # the first message rebuilds the worker from the replay
                await publisher.wait_subscribed()
                await _publish(publisher, messages[last:], source, until=last)
            await source.wait_until(lambda: source.last_seq == last, WAIT_S)
    finally:
        await publisher.close()
    indexed = set(_indexed(index))
    assert indexed <= set(_model_through(last).live())  # nothing the engine evicted
    assert publisher.replay_requests == [0, lost]
    # Exactly what the batches after the lost one stored and did not remove.
    after = LiveModel()
    for message in messages[lost + 1 : last + 1]:
        after.apply(message.events, strict=False)
    assert indexed == set(after.live())
    assert source.counters.num_gaps == 1


async def test_an_engine_restart_seq_reset_clears_the_worker(context: zmq.asyncio.Context) -> None:
    index = PrefixIndex()
    publisher = FakeKvPublisher(context)
    source = _source(publisher, context, MemoryBackend(index))
    messages = live_messages()
    try:
        async with running(source.run()):
            await publisher.wait_subscribed()
            await _publish(publisher, messages, source, until=30)
            assert set(_indexed(index)) == set(_model_through(30).live())
            # The engine restarts: its seq starts at 0 again and its cache is empty.
            publisher.buffer.clear()
            await publisher.publish(messages[0].frames)
            await source.wait_until(lambda: source.counters.num_resets == 2, WAIT_S)
            assert set(_indexed(index)) == set(_model_through(0).live())
            await _publish(publisher, messages[1:], source, until=12)
            assert set(_indexed(index)) == set(_model_through(12).live())
    finally:
        await publisher.close()


async def test_matching_each_prompt_before_it_was_sent_predicts_vllms_cached_tokens(
    context: zmq.asyncio.Context,
) -> None:
    """Token-level matching in both key spaces (MatchTokens canonical and vLLM sha256, and
    MatchExternalKvPrefix with vLLM's hashes), each request's prompt just before it was
    sent, against the `num_cached_tokens` vLLM reported. docs/indexer.md explains the
    misses: requests submitted together whose shared prefix was computed by a sibling in the
    same engine step (the events come after the submission)."""
    index = PrefixIndex()
    backend = MemoryBackend(index)
    services, _, _ = index_services(
        backend, default_block_size=BLOCK_SIZE, max_concurrent_prefix_queries=8
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    publisher = FakeKvPublisher(context)
    canonical = _source(publisher, context, backend, worker_id="canon", mode=HashMode.CANONICAL)
    engine = _source(publisher, context, backend, worker_id="engine")
    messages = live_messages()
    outcomes = []
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            running(canonical.run()),
            running(engine.run()),
        ):
            await publisher.wait_subscribed()
            await publisher.wait_subscribed()
            kv_index = api_grpc.KvIndexStub(channel)
            kv_indexer = kv_grpc.KVIndexerStub(channel)
            sent = 0
            for request in requests():
                batch = [
                    m for m in messages[sent:] if m.recv_time_unix < request["submit_time_unix"]
                ]
                for message in batch:
                    await publisher.publish(message.frames, replay_frames=REPLAY[message.seq])
                sent += len(batch)
                if batch:
                    last = batch[-1].seq
                    for source in (canonical, engine):
                        await source.wait_until(partial(_handled, source, last), WAIT_S)
                # vLLM never counts the last prompt token as cached.
                prompt = request["prompt_token_ids"][:-1]
                by_tokens = await kv_index.MatchTokens(
                    api.MatchTokensRequest(
                        token_ids=prompt,
                        block_size=BLOCK_SIZE,
                        cache_salt=request["cache_salt"] or "",
                    )
                )
                # The same prompt in vLLM's own key space (sha256, default seed: the capture's
                # settings) finds the worker indexed with `hash: engine`.
                by_vllm_tokens = await kv_index.MatchTokens(
                    api.MatchTokensRequest(
                        token_ids=prompt,
                        block_size=BLOCK_SIZE,
                        cache_salt=request["cache_salt"] or "",
                        key_space=api.KEY_SPACE_VLLM_SHA256,
                    )
                )
                vllm_hashes = [
                    to_sfixed64(h)
                    for h in block_hashes(prompt, BLOCK_SIZE, cache_salt=request["cache_salt"])
                ]
                assert list(by_vllm_tokens.block_keys) == vllm_hashes
                by_hashes = await kv_indexer.MatchExternalKvPrefix(
                    kv.MatchExternalKvPrefixRequest(hashes=vllm_hashes)
                )
                tokens = by_tokens.matches[0].matched_tokens if by_tokens.matches else 0
                engine_tokens = (
                    by_vllm_tokens.matches[0].matched_tokens if by_vllm_tokens.matches else 0
                )
                blocks = by_hashes.best_prefix_blocks
                assert [m.worker_id for m in by_tokens.matches] in ([], ["canon"])
                assert [m.worker_id for m in by_vllm_tokens.matches] in ([], ["engine"])
                assert [m.worker_id for m in by_hashes.matches] in ([], ["engine"])
                assert engine_tokens == blocks * BLOCK_SIZE
                outcomes.append((request, tokens, engine_tokens))
    finally:
        await publisher.close()
        await server.stop(None)
    agree = [r for r, tokens, _ in outcomes if tokens == r["num_cached_tokens"]]
    # Both key spaces agree on every request (so the hits below hold for the engine worker too).
    assert all(tokens == by_engine for _, tokens, by_engine in outcomes)
    assert len(outcomes) == 30
    assert len(agree) / len(outcomes) >= 25 / 30
    for request, tokens, _ in outcomes:
        if tokens != request["num_cached_tokens"]:
            assert request["batch_members"] > 1 and tokens < request["num_cached_tokens"]
    # The cases that must hit: repeats, extensions, full report mode, after the reset.
    by_seq = {r["req_seq"]: tokens for r, tokens, _ in outcomes}
    assert by_seq[6] == 160 and by_seq[11] == 160 and by_seq[29] == 128
    # Salted tenants never match unsalted prefixes (and were not cached by vLLM either).
    assert by_seq[9] == by_seq[10] == 0
    assert TOPIC.startswith("kv@")
