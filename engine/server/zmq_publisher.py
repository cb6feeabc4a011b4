"""A vLLM-compatible ZMQ KV-event publisher: PUB for the live stream, ROUTER for replay.

Live: every batch goes out as `[topic, seq (8-byte big-endian), payload]` on a PUB socket,
`seq` counting from 0 per process like vLLM's (the KV event log's number minus the log's
first number: a vLLM-style consumer detects a restart by the seq going back). PUB never
blocks: at the high-water mark ZMQ drops, and a subscriber that sees a gap asks the replay
socket.

Replay answers both request forms of WIRE.md section 1, told apart as vLLM's publisher tells
them: an 8-byte request is the legacy protocol, anything else a msgpack one.

- Legacy (vLLM 0.32): a DEALER sends `[b"", start_seq]`; the ROUTER answers
  `[b"", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, oldest
  first, then the end marker `[b"", b"", ff*8, b""]`. Replies are the very bytes sent live.
- msgpack (newer vLLM): a DEALER or REQ sends the map `{publisher_epoch, start_seq,
  force_snapshot}` (`start_seq` required, an int >= 0; `publisher_epoch` an int or nil;
  `force_snapshot` a bool, default false; other keys ignored, as vLLM's msgspec decoder
  ignores them); the ROUTER answers with one message, the map
  `{publisher_epoch, next_seq, replayed_batches: [[seq, payload], ...], snapshot}`.
  `publisher_epoch` is this process's: the KV event log's first sequence number (wall-clock
  microseconds at its creation, so a restart changes it). `next_seq` is the seq the next live
  batch will carry. `snapshot` is nil, or the payload of one EventBatch describing the whole
  cached set as of `next_seq - 1` (AllBlocksCleared, then a BlockStored per cached block,
  parents first: the KV event log's snapshot), with `replayed_batches` then empty. The
  snapshot is sent when asked for (`force_snapshot`), when the request's epoch is another
  process's (its seqs mean nothing here), or when the buffer no longer (or not yet) holds
  `start_seq`: the same rule as SubscribeKvEvents' snapshot standing in for a replay it cannot
  serve. The reply is made in one go, between two batches (the publishing path and the
  ROUTER share the event loop), so the snapshot is the cached set as of exactly `next_seq - 1`:
  a client that applies it and then the live batches from `next_seq` on loses none and
  applies none twice.

A request that is neither (not msgpack, not such a map, `start_seq` missing or negative, a
field of another type) is answered with just the end marker.

Both sockets bind (this engine is the server). A `*` host listens on IPv4 and IPv6 alike (vLLM's
on IPv4 only), an IPv6 address (`tcp://[::1]:5557`) on IPv6 (`kvplane.zmq_ip`). A `*` port picks
a free one; `bound_endpoint` and `bound_replay_endpoint` hold the real addresses for
`GetKvEventSources`. As vLLM's, data-parallel rank r binds the configured endpoints offset by r
(`rank_endpoint`), so that every rank of one engine can share one configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import msgpack
import zmq
import zmq.asyncio

from engine.server.kv_event_log import KvEventBatchRecord
from engine.server.kv_wire import encode_msgpack_batch
from kvplane.config import BIND_WILDCARD_HOSTS
from kvplane.errors import ConfigError
from kvplane.zmq_ip import set_ip_version

log = logging.getLogger(__name__)

END_OF_REPLAY_SEQ = b"\xff" * 8


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=False)


class ZmqKvPublisher:
    """Owns the PUB and replay ROUTER sockets and the replay buffer of sent frames."""

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        hwm: int,
        buffer_steps: int,
        first_sequence_number: int,
        data_parallel_rank: int = 0,
        snapshot: Callable[[], KvEventBatchRecord],
    ) -> None:
        """`first_sequence_number`: the KV event log's (`KvEventLog.first_sequence_number`),
        the batch published as ZMQ seq 0, and this publisher's epoch. `snapshot`: the same
        log's (`KvEventLog.snapshot`), for msgpack replay requests it cannot serve from its
        buffer; it must be called on the thread that publishes (the event loop)."""
        self._first_seq = first_sequence_number
        self._snapshot = snapshot
        self._dp_rank = data_parallel_rank
        self._endpoint = rank_endpoint(endpoint, data_parallel_rank)
        self._replay_endpoint = (
            None if replay_endpoint is None else rank_endpoint(replay_endpoint, data_parallel_rank)
        )
        self.topic = topic.encode()
        self._hwm = hwm
        self._sent: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.bound_endpoint = ""
        self.bound_replay_endpoint: str | None = None

    async def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self.bound_endpoint = _bind(pub, self._endpoint)
        self._pub = pub
        if self._replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            # A ROUTER silently drops replies to a peer whose pipe is full: a replay of the
            # whole buffer must never be cut short, so its pipes are unbounded.
            router.setsockopt(zmq.SNDHWM, 0)
            self.bound_replay_endpoint = _bind(router, self._replay_endpoint)
            self._router = router
            self._replay_task = asyncio.create_task(self._serve_replay(), name="zmq-kv-replay")
        log.info(
            "ZMQ KV events on %s (replay %s), topic %r",
            self.bound_endpoint,
            self.bound_replay_endpoint,
            self.topic.decode(),
        )

    def publish_batch(self, batch: KvEventBatchRecord) -> None:
        """A KvEventLog listener: log batch N goes out as ZMQ seq N - first_sequence_number
        (vLLM counts from 0)."""
        seq = batch.sequence_number - self._first_seq
        self.publish(seq, encode_msgpack_batch(batch, self._dp_rank))

    def publish(self, seq: int, payload: bytes) -> None:
        """Send one batch live and keep it for replay. Never blocks."""
        seq_bytes = encode_seq(seq)
        self._sent.append((seq, seq_bytes, payload))
        if self._pub is None:
            return
        try:
            self._pub.send_multipart([self.topic, seq_bytes, payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - PUB drops at HWM instead of raising
            log.warning("ZMQ KV publisher dropped batch %d (queue full)", seq)

    async def _serve_replay(self) -> None:
        """Answer replay requests until the ROUTER closes. One whose answer fails (an error
        building or sending it) is logged with its traceback, and the next is served: no
        request ends replay."""
        assert self._router is not None
        router = self._router
        while True:
            try:
                frames = await router.recv_multipart()
            except zmq.ZMQError:
                if not router.closed:
                    log.exception("ZMQ replay: receiving failed; replay requests go unanswered")
                return
            try:
                await self._answer_replay(router, frames)
            except Exception:
                if router.closed:
                    return
                log.exception("ZMQ replay: answering a request failed; serving the next")

    async def _answer_replay(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """Answer one request received on `router` (module docstring)."""
        if len(frames) < 2:
            return
        identity, request = frames[0], frames[-1]
        if len(request) == 8:
            start_seq = int.from_bytes(request, "big")
            for seq, seq_bytes, payload in list(self._sent):
                if seq >= start_seq:
                    await router.send_multipart([identity, b"", self.topic, seq_bytes, payload])
        else:
            parsed = parse_msgpack_replay_request(request)
            if parsed is not None:
                await router.send_multipart([identity, b"", self._msgpack_reply(parsed)])
                return
            log.warning("ZMQ replay: ignoring a %d-byte request", len(request))
        await router.send_multipart([identity, b"", b"", END_OF_REPLAY_SEQ, b""])

    def _msgpack_reply(self, request: MsgpackReplayRequest) -> bytes:
        """The one message answering a msgpack replay request (module docstring). No await
        from here to the reply's bytes: no batch is published between the snapshot and
        `next_seq`."""
        sent = list(self._sent)
        next_seq = sent[-1][0] + 1 if sent else 0
        oldest = sent[0][0] if sent else next_seq
        wants_snapshot = (
            request.force_snapshot
            or (request.publisher_epoch not in (None, self._first_seq))
            or not oldest <= request.start_seq <= next_seq
        )
        snapshot: bytes | None = None
        replayed: list[tuple[int, bytes]] = []
        if wants_snapshot:
            snapshot = encode_msgpack_batch(self._snapshot(), self._dp_rank)
        else:
            replayed = [(seq, payload) for seq, _, payload in sent if seq >= request.start_seq]
        reply = {
            "publisher_epoch": self._first_seq,
            "next_seq": next_seq,
            "replayed_batches": replayed,
            "snapshot": snapshot,
        }
        packed = msgpack.packb(reply, use_bin_type=True)
        assert isinstance(packed, bytes)
        return packed

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


@dataclass(frozen=True, slots=True)
class MsgpackReplayRequest:
    start_seq: int
    publisher_epoch: int | None = None
    force_snapshot: bool = False


def parse_msgpack_replay_request(request: bytes) -> MsgpackReplayRequest | None:
    """A newer vLLM's replay request, `{publisher_epoch, start_seq, force_snapshot}`; None
    when `request` is not one (not msgpack, not a map, a field of the wrong type)."""
    try:
        fields = msgpack.unpackb(request, raw=False)
    except Exception:  # msgpack raises ValueError, FormatError, StackError, ...
        return None
    if not isinstance(fields, dict):
        return None
    start_seq = fields.get("start_seq")
    epoch = fields.get("publisher_epoch")
    force = fields.get("force_snapshot", False)
    if not _is_int(start_seq) or start_seq < 0:
        return None
    if (epoch is not None and not _is_int(epoch)) or not isinstance(force, bool):
        return None
    return MsgpackReplayRequest(start_seq, epoch, force)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def rank_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Where data-parallel rank r binds `endpoint`, as vLLM's publisher does: a TCP port plus
    r, `_dp<r>` after an ipc or inproc name. Rank 0, and a `*` port, bind it as it is."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        address, _, port = endpoint.rpartition(":")
        return f"{address}:{int(port) + data_parallel_rank}" if port.isdigit() else endpoint
    return f"{endpoint}_dp{data_parallel_rank}"


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind `endpoint` (port `*` picks a free one) and return the address actually bound.
    An IPv6 address binds IPv6, and a `*` host dual stack (`kvplane.zmq_ip`)."""
    try:
        set_ip_version(sock, endpoint)
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)  # an open socket would keep the context's `term` waiting forever
        raise ConfigError(f"cannot bind ZMQ KV events to {endpoint}: {exc}") from exc
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


def routable_host_port(bound_endpoint: str, advertised_host: str) -> tuple[str, int]:
    """`tcp://0.0.0.0:5557` -> (advertised_host, 5557): never a bind wildcard."""
    address = bound_endpoint.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    host = host.strip("[]") if host not in BIND_WILDCARD_HOSTS else ""
    return (host or advertised_host), int(port)
