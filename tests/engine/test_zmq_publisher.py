"""The vLLM-compatible ZMQ KV-event publisher: vLLM 0.32's bytes, a real SUB and DEALER replay."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from engine.core.api import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KvEvent, Medium
from engine.server.kv_event_log import KvEventBatchRecord, KvEventLog
from engine.server.kv_wire import encode_msgpack_batch
from engine.server.zmq_publisher import (
    END_OF_REPLAY_SEQ,
    ZmqKvPublisher,
    rank_endpoint,
    routable_host_port,
)

CAPTURE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/vllm-0.32.0-kv-events/vllm_kv_events.jsonl"
)


def _capture_frames() -> list[list[bytes]]:
    lines = CAPTURE.read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]


def _domain_event(raw: dict[str, Any]) -> KvEvent:
    if raw["type"] == "BlockStored":
        parent = raw["parent_block_hash"]
        return BlockStored(
            block_keys=tuple(BlockKey(k) for k in raw["block_hashes"]),
            parent_key=None if parent is None else BlockKey(parent),
            token_ids=tuple(raw["token_ids"]),
            block_size=raw["block_size"],
            medium=Medium(raw["medium"]),
            lora_name=raw["lora_name"],
            extra_keys=tuple(None if e is None else tuple(e) for e in raw["extra_keys"]),
        )
    if raw["type"] == "BlockRemoved":
        return BlockRemoved(
            block_keys=tuple(BlockKey(k) for k in raw["block_hashes"]),
            medium=Medium(raw["medium"]),
        )
    return AllBlocksCleared()


def test_payloads_are_byte_identical_to_vllm_0_32() -> None:
    frames = _capture_frames()
    assert len(frames) == 60
    for _topic, seq, payload in frames:
        ts, raw_events, rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        record = KvEventBatchRecord(
            sequence_number=int.from_bytes(seq, "big") + 1,
            timestamp_unix_ns=round(ts * 1e9),
            events=tuple(_domain_event(e) for e in raw_events),
        )
        ours = encode_msgpack_batch(record, rank)
        # [0x93, 0xcb, 8 bytes of float64 ts, events..., rank]: all but the ts bytes identical.
        assert ours[:2] == payload[:2] == b"\x93\xcb"
        assert ours[10:] == payload[10:]
        assert msgpack.unpackb(ours)[0] == pytest.approx(ts, abs=1e-6)


def test_negative_keys_go_out_unsigned() -> None:
    record = KvEventBatchRecord(1, 0, (BlockRemoved(block_keys=(BlockKey(-1), BlockKey(5))),))
    _ts, events, rank = msgpack.unpackb(encode_msgpack_batch(record, 3))
    assert events == [
        {"type": "BlockRemoved", "block_hashes": [2**64 - 1, 5], "medium": "GPU", "group_idx": 0}
    ]
    assert rank == 3


def test_routable_address_never_a_wildcard() -> None:
    assert routable_host_port("tcp://0.0.0.0:5557", "10.1.2.3") == ("10.1.2.3", 5557)
    assert routable_host_port("tcp://[::]:6000", "h") == ("h", 6000)
    assert routable_host_port("tcp://127.0.0.1:41000", "h") == ("127.0.0.1", 41000)


def _stored(key: int, parent: int | None) -> BlockStored:
    return BlockStored(
        block_keys=(BlockKey(key),),
        parent_key=None if parent is None else BlockKey(parent),
        token_ids=(key, key + 1),
        block_size=2,
    )


def _loopback_publisher(
    log: KvEventLog, *, buffer_steps: int, data_parallel_rank: int = 0
) -> ZmqKvPublisher:
    """A publisher of `log`'s batches on free loopback ports."""
    return ZmqKvPublisher(
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@test@sim",
        hwm=1000,
        buffer_steps=buffer_steps,
        first_sequence_number=log.first_sequence_number,
        data_parallel_rank=data_parallel_rank,
        snapshot=log.snapshot,
    )


@contextlib.asynccontextmanager
async def _serving(
    log: KvEventLog, publisher: ZmqKvPublisher
) -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    """`publisher` started on `log`'s batches, a SUB (topic `kv@`) and a replay DEALER
    connected to it; all closed afterwards."""
    await publisher.start()
    log.add_listener(publisher.publish_batch)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.bound_endpoint)
    dealer = ctx.socket(zmq.DEALER)
    assert publisher.bound_replay_endpoint is not None
    dealer.connect(publisher.bound_replay_endpoint)
    try:
        yield sub, dealer
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        await publisher.close()


@pytest.mark.timeout(30)
async def test_live_sub_and_dealer_replay() -> None:
    # The log numbers from its time-based base; the ZMQ seq counts from 0 as vLLM's does.
    log = KvEventLog(buffer_steps=100)
    publisher = _loopback_publisher(log, buffer_steps=100)

    def last_zmq_seq() -> int:
        return log.last_sequence_number - log.first_sequence_number

    async with _serving(log, publisher) as (sub, dealer):
        # PUB drops messages until the subscription has propagated: publish until one arrives.
        live: list[list[bytes]] = []
        parent: int | None = None
        key = 1
        while not live:
            log.append([_stored(key, parent)])
            parent, key = key, key + 1
            if await sub.poll(timeout=50):
                live.append(await sub.recv_multipart())
        log.append([BlockRemoved(block_keys=(BlockKey(1),))])
        log.append([AllBlocksCleared()])
        while int.from_bytes(live[-1][1], "big") < last_zmq_seq():
            assert await sub.poll(timeout=5000)
            live.append(await sub.recv_multipart())
        seqs = [int.from_bytes(frames[1], "big") for frames in live]
        assert seqs == list(range(seqs[0], last_zmq_seq() + 1))
        assert all(frames[0] == b"kv@test@sim" for frames in live)
        assert msgpack.unpackb(live[-1][2])[1] == [{"type": "AllBlocksCleared"}]

        # Replay from 0: every batch ever published, the same bytes, then the end marker.
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[list[bytes]] = []
        while True:
            assert await dealer.poll(timeout=5000)
            frames = await dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY_SEQ:
                assert frames == [b"", b"", END_OF_REPLAY_SEQ, b""]
                break
            replayed.append(frames)
        assert [int.from_bytes(f[2], "big") for f in replayed] == list(range(last_zmq_seq() + 1))
        by_seq = {int.from_bytes(f[2], "big"): f[1:] for f in replayed}
        for frames in live:
            assert by_seq[int.from_bytes(frames[1], "big")] == frames

        # Replay from the middle starts there.
        start = last_zmq_seq() - 1
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert await dealer.poll(timeout=5000)
            frames = await dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY_SEQ:
                break
            got.append(int.from_bytes(frames[2], "big"))
        assert got == [start, start + 1]

        # A request of neither form is answered with just the end marker, and the socket goes
        # on serving.
        await dealer.send_multipart([b"", b"\xc1 not a replay request"])
        assert await dealer.poll(timeout=5000)
        assert await dealer.recv_multipart() == [b"", b"", END_OF_REPLAY_SEQ, b""]
        await dealer.send_multipart([b"", last_zmq_seq().to_bytes(8, "big")])
        assert await dealer.poll(timeout=5000)
        assert (await dealer.recv_multipart())[2] == last_zmq_seq().to_bytes(8, "big")


def _free_tcp_port() -> int:
    # A plain socket: it releases the port when closed (a ZMQ socket's I/O thread does later).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(30)
async def test_a_data_parallel_rank_binds_vllms_offset_endpoints(tmp_path: Path) -> None:
    """As vLLM's publisher, rank r binds the configured TCP port + r (so every rank of one
    engine can share a configuration, the default `tcp://*:5557` included) and an ipc name
    followed by `_dp<r>`; its batches name the rank."""
    port = _free_tcp_port()
    publisher = ZmqKvPublisher(
        endpoint=f"tcp://127.0.0.1:{port - 2}",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv@rank2",
        hwm=1000,
        buffer_steps=10,
        first_sequence_number=1,
        data_parallel_rank=2,
        snapshot=KvEventLog(10, first_sequence_number=1).snapshot,
    )
    await publisher.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert publisher.bound_endpoint == f"tcp://127.0.0.1:{port}"
        assert publisher.bound_replay_endpoint == f"ipc://{tmp_path}/replay_dp2"
        publisher.publish_batch(KvEventBatchRecord(1, 0, (AllBlocksCleared(),)))
        dealer.connect(f"ipc://{tmp_path}/replay_dp2")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert await dealer.poll(timeout=5000)
        _empty, topic, seq, payload = await dealer.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv@rank2", 0)
        assert msgpack.unpackb(payload)[2] == 2
    finally:
        dealer.close(linger=0)
        ctx.term()
        await publisher.close()
    # Rank 0 and a port ZMQ picks are bound as they are.
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"


async def _ask(socket: zmq.asyncio.Socket, request: dict[str, Any]) -> dict[str, Any]:
    """One msgpack replay request and its one reply (a DEALER's behind the empty frame)."""
    packed = msgpack.packb(request)
    if socket.type == zmq.DEALER:
        await socket.send_multipart([b"", packed])
    else:
        await socket.send(packed)
    assert await socket.poll(timeout=5000)
    frames = await socket.recv_multipart()
    if socket.type == zmq.DEALER:
        assert frames[0] == b""
        frames = frames[1:]
    assert len(frames) == 1
    reply: dict[str, Any] = msgpack.unpackb(frames[0], raw=False)
    assert sorted(reply) == ["next_seq", "publisher_epoch", "replayed_batches", "snapshot"]
    return reply


class _SnapshotFailingOnce:
    """`log`'s snapshot, but the first call raises: no replay request makes the publisher's
    reply fail (each is checked before it is answered), so the failure is injected here."""

    def __init__(self, log: KvEventLog) -> None:
        self._log = log
        self.calls = 0

    def __call__(self) -> KvEventBatchRecord:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("snapshot failed")
        return self._log.snapshot()


@pytest.mark.timeout(30)
async def test_a_replay_request_whose_reply_fails_is_logged_and_the_next_is_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request whose reply raises (here its snapshot) gets no reply and is logged once,
    with its traceback; replay goes on: the next request, of either form, is answered."""
    caplog.set_level(logging.WARNING, logger="engine.server.zmq_publisher")
    log = KvEventLog(buffer_steps=100)
    snapshot = _SnapshotFailingOnce(log)
    publisher = ZmqKvPublisher(
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@test@sim",
        hwm=1000,
        buffer_steps=10,
        first_sequence_number=log.first_sequence_number,
        data_parallel_rank=1,
        snapshot=snapshot,
    )
    async with _serving(log, publisher) as (_sub, dealer):
        log.append([_stored(1, None)])
        await dealer.send_multipart([b"", msgpack.packb({"start_seq": 0, "force_snapshot": True})])
        reply = await _ask(dealer, {"start_seq": 0, "force_snapshot": True})
        assert snapshot.calls == 2 and _snapshot_keys(reply["snapshot"]) == [1]
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert (await dealer.recv_multipart())[2] == (0).to_bytes(8, "big")
        assert (await dealer.recv_multipart())[2] == END_OF_REPLAY_SEQ
    (said,) = caplog.records
    assert said.getMessage() == "ZMQ replay: answering a request failed; serving the next"
    assert said.exc_info is not None and str(said.exc_info[1]) == "snapshot failed"


def _snapshot_keys(payload: bytes) -> list[int]:
    """The keys a snapshot payload stores, checked to start with AllBlocksCleared."""
    _ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert rank == 1
    assert events[0] == {"type": "AllBlocksCleared"}
    return [k for event in events[1:] for k in event["block_hashes"]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("socket_type", [zmq.REQ, zmq.DEALER], ids=["req", "dealer"])
async def test_newer_vllms_msgpack_replay_request_is_answered_with_one_reply(
    socket_type: int,
) -> None:
    """WIRE.md's newer request form, `{publisher_epoch, start_seq, force_snapshot}`, gets one
    message `{publisher_epoch, next_seq, replayed_batches, snapshot}`: the buffered batches
    from start_seq (the bytes sent live) or, when asked, when the epoch is another process's
    or when the buffer no longer holds start_seq, a snapshot of the cached set."""
    log = KvEventLog(buffer_steps=100)
    publisher = _loopback_publisher(log, buffer_steps=3, data_parallel_rank=1)
    await publisher.start()
    log.add_listener(publisher.publish_batch)
    records: list[KvEventBatchRecord] = []
    log.add_listener(records.append)
    epoch = log.first_sequence_number
    ctx = zmq.asyncio.Context()
    client = ctx.socket(socket_type)
    assert publisher.bound_replay_endpoint is not None
    client.connect(publisher.bound_replay_endpoint)
    try:
        # Nothing published yet: nothing to replay, the next live batch is seq 0.
        empty = await _ask(client, {"publisher_epoch": None, "start_seq": 0})
        assert empty == {
            "publisher_epoch": epoch,
            "next_seq": 0,
            "replayed_batches": [],
            "snapshot": None,
        }
        log.append([_stored(1, None)])
        log.append([_stored(2, 1)])
        log.append([BlockRemoved(block_keys=(BlockKey(2),))])
        log.append([_stored(3, 1)])  # seqs 0-3; the buffer of 3 holds 1-3
        sent = {seq: encode_msgpack_batch(record, 1) for seq, record in enumerate(records)}

        covered = await _ask(
            client, {"publisher_epoch": epoch, "start_seq": 2, "force_snapshot": False}
        )
        assert covered["publisher_epoch"] == epoch and covered["next_seq"] == 4
        assert covered["snapshot"] is None
        assert covered["replayed_batches"] == [[2, sent[2]], [3, sent[3]]]
        up_to_date = await _ask(client, {"publisher_epoch": epoch, "start_seq": 4})
        assert (up_to_date["replayed_batches"], up_to_date["snapshot"]) == ([], None)

        for request in (
            {"publisher_epoch": epoch, "start_seq": 2, "force_snapshot": True},  # asked for
            {"publisher_epoch": epoch + 1, "start_seq": 2},  # another process's seqs
            {"publisher_epoch": epoch, "start_seq": 0},  # seq 0 left the buffer
            {"publisher_epoch": None, "start_seq": 9},  # not yet published
        ):
            reply = await _ask(client, request)
            assert (reply["publisher_epoch"], reply["next_seq"]) == (epoch, 4)
            assert reply["replayed_batches"] == []
            assert _snapshot_keys(reply["snapshot"]) == [1, 3]

        # A malformed msgpack request (start_seq missing or negative, a string epoch) is
        # answered with the end marker alone; the socket goes on serving.
        for bad in (
            {"publisher_epoch": 0},
            {"start_seq": -1},
            {"start_seq": 0, "publisher_epoch": "x"},
        ):
            packed = msgpack.packb(bad)
            if socket_type == zmq.DEALER:
                await client.send_multipart([b"", packed])
            else:
                await client.send(packed)
            assert await client.poll(timeout=5000)
            marker = await client.recv_multipart()
            assert marker[-3:] == [b"", END_OF_REPLAY_SEQ, b""]
        again = await _ask(client, {"start_seq": 3})
        assert again["replayed_batches"] == [[3, sent[3]]]
    finally:
        client.close(linger=0)
        ctx.term()
        await publisher.close()


def _apply(keys: set[int], payload: bytes) -> None:
    """A vLLM-style consumer's cached set after one EventBatch payload."""
    _ts, events, _rank = msgpack.unpackb(payload, raw=False)
    for event in events:
        if event["type"] == "AllBlocksCleared":
            keys.clear()
        elif event["type"] == "BlockStored":
            keys.update(event["block_hashes"])
        else:
            keys.difference_update(event["block_hashes"])


@pytest.mark.timeout(30)
async def test_a_snapshot_then_the_live_stream_from_next_seq_is_the_cached_set() -> None:
    """A newer-vLLM consumer that follows the live stream, asks for a snapshot while batches
    keep coming, and then applies the live batches from the reply's `next_seq` on (dropping
    those before it, which the snapshot holds) ends with exactly the publisher's cached set:
    no batch published around the snapshot is lost or applied twice. Unknown request keys
    are ignored (as vLLM's msgspec decoder ignores them), and a `start_seq` beyond anything
    published (up to the largest uint64) gets the snapshot too."""
    log = KvEventLog(buffer_steps=100)
    publisher = _loopback_publisher(log, buffer_steps=2)
    async with _serving(log, publisher) as (sub, client):
        # Until the SUB receives (a PUB drops what it sends before the subscription).
        log.append([_stored(1, None)])
        while not await sub.poll(timeout=50):
            log.append([BlockRemoved(block_keys=(BlockKey(1),)), _stored(1, None)])
        for key in range(2, 6):  # live, unread by the consumer, and past the buffer of 2
            log.append([_stored(key, key - 1)])
        reply = await _ask(
            client, {"publisher_epoch": None, "start_seq": 0, "from_a_newer_vllm": [1, 2]}
        )
        assert reply["replayed_batches"] == [] and reply["snapshot"] is not None
        log.append([_stored(6, 5), BlockRemoved(block_keys=(BlockKey(2),))])
        log.append([AllBlocksCleared(), _stored(7, None)])
        log.append([_stored(8, 7)])
        last_seq = log.last_sequence_number - log.first_sequence_number

        keys: set[int] = set()
        _apply(keys, reply["snapshot"])
        applied: list[int] = []
        while not applied or applied[-1] < last_seq:
            assert await sub.poll(timeout=5000)
            _topic, seq_bytes, payload = await sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= reply["next_seq"]:
                applied.append(seq)
                _apply(keys, payload)
        assert applied == list(range(reply["next_seq"], last_seq + 1))
        assert keys == {7, 8} == set(_mirror_keys(log))

        beyond = await _ask(client, {"start_seq": 2**64 - 1, "force_snapshot": False})
        assert beyond["replayed_batches"] == [] and beyond["next_seq"] == last_seq + 1
        rebuilt: set[int] = set()
        _apply(rebuilt, beyond["snapshot"])
        assert rebuilt == keys


def _mirror_keys(log: KvEventLog) -> list[BlockKey]:
    """The keys the log's own snapshot stores (its cached set)."""
    return [k for e in log.snapshot().events if isinstance(e, BlockStored) for k in e.block_keys]
