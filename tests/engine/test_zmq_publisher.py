"""The vLLM-compatible ZMQ KV-event publisher: vLLM 0.32's bytes, a real SUB and DEALER replay."""

from __future__ import annotations

import base64
import json
import socket
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


@pytest.mark.timeout(30)
async def test_live_sub_and_dealer_replay() -> None:
    # The log numbers from its time-based base; the ZMQ seq counts from 0 as vLLM's does.
    log = KvEventLog(buffer_steps=100)
    publisher = ZmqKvPublisher(
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@test@sim",
        hwm=1000,
        buffer_steps=100,
        first_sequence_number=log.first_sequence_number,
    )

    def last_zmq_seq() -> int:
        return log.last_sequence_number - log.first_sequence_number

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

        # Any other request (newer vLLM's msgpack one) is answered with just the end marker,
        # as vLLM 0.32 answers it, and the socket goes on serving.
        newer = msgpack.packb({"publisher_epoch": 0, "start_seq": 0, "force_snapshot": False})
        await dealer.send_multipart([b"", newer])
        assert await dealer.poll(timeout=5000)
        assert await dealer.recv_multipart() == [b"", b"", END_OF_REPLAY_SEQ, b""]
        await dealer.send_multipart([b"", last_zmq_seq().to_bytes(8, "big")])
        assert await dealer.poll(timeout=5000)
        assert (await dealer.recv_multipart())[2] == last_zmq_seq().to_bytes(8, "big")
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        await publisher.close()


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
