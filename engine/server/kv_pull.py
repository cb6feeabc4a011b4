"""A DECODE engine's side of the `kvplane-pull` KV transfer (engine/server/kv_transfer.py has
the protocol and the PREFILL side): `KvSessionPuller` checks a `KvSessionRef`, pulls the session
from the prefill engine that holds it and checks what arrives against the request; once the
request is accepted it releases the session there. `decode_request` is what the decode engine
runs of a request given a session; `PulledSession.importer`, what its engine thread runs just
before adding it (the blocks enter the prefix cache, so admission finds them as prefix hits; with
no room in the pool then, the engine holds them, up to `kv_transfer.max_held_kv_bytes`, and
imports them as it admits the request).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import grpc
from google.protobuf import struct_pb2

from engine.config import KvTransferConfig
from engine.core.api import EngineRequest, KvBlockBytes
from engine.core.errors import InvalidRequestError
from engine.server.errors import KvSessionNotFoundError, KvSessionRefusedError, KvTransferError
from engine.server.kv_transfer import (
    PROTOCOL,
    TRANSFER_BACKEND,
    KvNamespace,
    blocks_per_chunk,
    check_fit,
)
from engine.server.metrics import ImportOutcome
from engine.start_files import peer_channels
from kvplane.channels import ClientChannels, Redialling
from kvplane.config import join_host_port, parse_dial_target
from kvplane.errors import KvplaneError
from kvplane_api.v1 import kv_transfer_pb2 as kt
from kvplane_api.v1 import kv_transfer_pb2_grpc as kt_grpc
from openengine.v1 import openengine_pb2 as pb

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore

log = logging.getLogger(__name__)

# gRPC refuses messages above 4 MiB by default; one run of blocks (or one block of a large
# model) may be bigger.
_MIN_RECEIVE_BYTES = 4 << 20
_MAX_SESSION_ID_CHARS = 1024
# Channels to prefill engines kept open while no call uses them, the least recently used
# closed first: prefill engines come and go (a planner starts them on new ports), and a ref
# may name any endpoint, so one channel per address for the engine's life grew without bound.
MAX_IDLE_PEERS = 32


def decode_request(request: EngineRequest) -> EngineRequest:
    """A DECODE engine's request given a KV session: its prefill engine already returned the
    prompt logprobs (the gateway relays them), and computing them again would forbid the very
    prefix hits the session provides."""
    if request.sampling.prompt_logprobs is None:
        return request
    sampling = dataclasses.replace(request.sampling, prompt_logprobs=None, prompt_logprob_start=0)
    return dataclasses.replace(request, sampling=sampling)


@dataclass(frozen=True, slots=True)
class PulledSession:
    """A session's KV as received: `blocks[i]` holds full block i of `token_ids` (a view into
    the message that brought it: the blocks are copied once, into the cache)."""

    token_ids: tuple[int, ...]
    blocks: list[KvBlockBytes]

    def importer(
        self,
        request: EngineRequest,
        *,
        max_held_bytes: int,
        on_outcome: Callable[[ImportOutcome], object] | None = None,
    ) -> Callable[[EngineCore], object]:
        """What the engine thread runs just before adding `request` (EngineLoop.submit's
        `before`): the blocks enter the prefix cache under the request's namespace, or wait
        for the request's admission (`EngineCore.import_or_hold_kv_blocks`); `on_outcome`
        hears which (in the engine thread), or "failed" if the import raised."""

        def import_blocks(core: EngineCore) -> None:
            try:
                outcome: ImportOutcome = core.import_or_hold_kv_blocks(
                    request, self.blocks, max_held_bytes=max_held_bytes
                )
            except BaseException:
                outcome = "failed"
                raise
            finally:
                if on_outcome is not None:
                    on_outcome(outcome)

        return import_blocks


class KvSessionPuller:
    """A DECODE engine's side of the transfer: checks a `KvSessionRef` and pulls it. Channels
    to prefill engines are kept per address, at most `MAX_IDLE_PEERS` of them unused, and
    closed by `close`."""

    def __init__(
        self,
        *,
        block_size: int,
        kv_layout: str,
        kv_block_bytes: int,
        channels: ClientChannels,
        timeout_s: float,
        max_held_bytes: int = 0,
    ) -> None:
        """`max_held_bytes`: `kv_transfer.max_held_kv_bytes`, for the importers' use."""
        self._block_size = block_size
        self._kv_layout = kv_layout
        self._block_bytes = kv_block_bytes
        self._blocks_per_chunk = blocks_per_chunk(kv_block_bytes)
        receive = max(_MIN_RECEIVE_BYTES, self._blocks_per_chunk * kv_block_bytes + (1 << 20))
        self._channel_options = channels.with_options(("grpc.max_receive_message_length", receive))
        self._timeout_s = timeout_s
        self.max_held_bytes = max_held_bytes
        # address -> its channel, the least recently used first.
        self._peers: collections.OrderedDict[str, Redialling[kt_grpc.KvTransferAsyncStub]]
        self._peers = collections.OrderedDict()
        self._calls = collections.Counter[str]()  # address -> calls on its channel now
        self._releases: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(
        cls, config: KvTransferConfig, *, block_size: int, kv_layout: str, kv_block_bytes: int
    ) -> KvSessionPuller:
        return cls(
            block_size=block_size,
            kv_layout=kv_layout,
            kv_block_bytes=kv_block_bytes,
            channels=peer_channels(config),
            timeout_s=config.pull_timeout_s,
            max_held_bytes=config.max_held_kv_bytes,
        )

    @property
    def num_peer_channels(self) -> int:
        """Channels open to prefill engines now."""
        return len(self._peers)

    def check(self, ref: pb.KvSessionRef) -> str:
        """The address to pull `ref` from; refuses, before any transfer, a session this engine
        cannot use."""
        if ref.transfer_backend != TRANSFER_BACKEND:
            raise KvSessionRefusedError(
                f"this engine attaches KV sessions of transfer_backend {TRANSFER_BACKEND!r} "
                f"only, not {ref.transfer_backend!r}"
            )
        if not ref.session_id:
            raise InvalidRequestError("kv.session.session_id is empty")
        if len(ref.session_id) > _MAX_SESSION_ID_CHARS:
            # Statuses quote the id: a huge one would overflow gRPC's metadata limit.
            raise InvalidRequestError(
                f"kv.session.session_id has {len(ref.session_id)} characters, more than "
                f"{_MAX_SESSION_ID_CHARS}"
            )
        endpoint = next((e for e in ref.endpoints if e.protocol == PROTOCOL), None)
        if endpoint is None or not _dialable(endpoint.host, endpoint.port):
            protocols = sorted({e.protocol for e in ref.endpoints})
            raise KvSessionRefusedError(
                f"the KV session names no {PROTOCOL!r} endpoint (host and port) to pull from; "
                f"its endpoints' protocols: {protocols}"
            )
        attributes = ref.attributes_struct.fields
        check_fit(
            block_size=_attribute(attributes, "block_size", "number_value"),
            kv_layout=_attribute(attributes, "kv_layout", "string_value"),
            token_ids=None,
            want_block_size=self._block_size,
            want_layout=self._kv_layout,
            prompt=(),
        )
        return join_host_port(endpoint.host, endpoint.port)

    async def pull(self, ref: pb.KvSessionRef, request: EngineRequest) -> PulledSession:
        """Pull the session for `request`: its tokens must be a prefix of the request's
        prompt, its namespace the request's."""
        target = self.check(ref)
        async with self._peer(target) as peer:
            return await self._pull(peer, target, ref, request)

    async def _pull(
        self,
        peer: Redialling[kt_grpc.KvTransferAsyncStub],
        target: str,
        ref: pb.KvSessionRef,
        request: EngineRequest,
    ) -> PulledSession:
        namespace = KvNamespace.of(request)
        prompt_token_ids = request.prompt_token_ids
        pull_request = kt.PullKvSessionRequest(
            session_id=ref.session_id,
            block_size=self._block_size,
            kv_layout=self._kv_layout,
            prompt_token_ids=prompt_token_ids,
            lora_name=namespace.lora_name,
            cache_salt=namespace.cache_salt,
            max_blocks_per_chunk=self._blocks_per_chunk,
        )
        call = peer.stub.PullKvSession(pull_request, timeout=self._timeout_s)
        where = f"KV session {ref.session_id!r} at {target}"
        try:
            return await self._receive(call, prompt_token_ids, where)
        except grpc.aio.AioRpcError as exc:
            await peer.after_failure()
            raise _pull_error(exc, where) from None
        finally:
            call.cancel()  # a no-op once it ended; else the prefill engine keeps the session

    async def _receive(
        self, call: AsyncIterable[kt.KvSessionChunk], prompt: Sequence[int], where: str
    ) -> PulledSession:
        header: kt.KvSessionHeader | None = None
        blocks: list[KvBlockBytes] = []
        block_bytes = self._block_bytes
        async for chunk in call:
            which = chunk.WhichOneof("chunk")
            if header is None:
                if which != "header":
                    raise KvTransferError(f"{where}: the stream did not start with its header")
                header = chunk.header
                self._check_header(header, prompt, where)
                continue
            run = chunk.block
            num_blocks = run.num_blocks or 1  # 0: a prefill engine before runs, one block
            if which != "block" or run.index != len(blocks):
                raise KvTransferError(f"{where}: unexpected chunk after {len(blocks)} blocks")
            if num_blocks > self._blocks_per_chunk or run.index + num_blocks > header.num_blocks:
                raise KvTransferError(
                    f"{where}: a run of {num_blocks} blocks from block {run.index}, past the "
                    f"session's {header.num_blocks} blocks or more than the "
                    f"{self._blocks_per_chunk} asked for"
                )
            data = run.data  # each read of the field copies it
            if len(data) != num_blocks * block_bytes:
                raise KvTransferError(
                    f"{where}: blocks {run.index}..{run.index + num_blocks - 1} have "
                    f"{len(data)} bytes, expected {num_blocks} x {block_bytes}"
                )
            view = memoryview(data)
            blocks.extend(view[i * block_bytes : (i + 1) * block_bytes] for i in range(num_blocks))
        if header is None or len(blocks) != header.num_blocks:
            expected = header.num_blocks if header is not None else "?"
            raise KvTransferError(
                f"{where}: the stream ended after {len(blocks)} of {expected} blocks"
            )
        return PulledSession(tuple(header.token_ids), blocks)

    def _check_header(self, header: kt.KvSessionHeader, prompt: Sequence[int], where: str) -> None:
        num_tokens = len(header.token_ids)
        if num_tokens != header.num_blocks * header.block_size:
            raise KvTransferError(
                f"{where}: {num_tokens} tokens for {header.num_blocks} blocks of "
                f"{header.block_size}"
            )
        try:
            check_fit(
                block_size=header.block_size,
                kv_layout=header.kv_layout,
                token_ids=header.token_ids,
                want_block_size=self._block_size,
                want_layout=self._kv_layout,
                prompt=prompt,
            )
        except KvSessionRefusedError as exc:
            raise KvSessionRefusedError(f"{where}: {exc}") from None

    def release(self, ref: pb.KvSessionRef) -> None:
        """Tell the prefill engine, in the background, that the session's request was
        accepted here: it releases the session at once rather than after `PULLED_GRACE_S`.
        A failure only costs the prefill engine that wait (logged at debug level)."""
        target = self.check(ref)

        async def release() -> None:
            try:
                async with self._peer(target) as peer:
                    await peer.stub.ReleaseKvSession(
                        kt.ReleaseKvSessionRequest(session_id=ref.session_id),
                        timeout=self._timeout_s,
                    )
            except grpc.aio.AioRpcError as exc:
                log.debug("releasing KV session %s at %s failed: %s: %s", ref.session_id,
                          target, exc.code().name, exc.details())  # fmt: skip

        task = asyncio.create_task(release(), name=f"release KV session {ref.session_id}")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    @asynccontextmanager
    async def _peer(self, target: str) -> AsyncIterator[Redialling[kt_grpc.KvTransferAsyncStub]]:
        """The channel to the prefill engine at `target` for a call; once it ended, the
        least recently used channels beyond `MAX_IDLE_PEERS` unused are closed."""
        peer = self._peers.get(target)
        if peer is None:
            # A pull under way when peer_tls is renewed ends on the old channel (its timeout
            # bounds it); the next is made on a channel dialled with the new files.
            peer = self._peers[target] = Redialling(
                self._channel_options, target, kt_grpc.KvTransferStub
            )
        self._peers.move_to_end(target)
        self._calls[target] += 1
        try:
            yield peer
        finally:
            self._calls[target] -= 1
            if not self._calls[target]:
                del self._calls[target]
            await self._close_idle_peers()

    async def _close_idle_peers(self) -> None:
        while True:  # looked at again after each close: a call may have taken one meanwhile
            idle = [address for address in self._peers if address not in self._calls]
            if len(idle) <= MAX_IDLE_PEERS:
                return
            await self._peers.pop(idle[0]).close()

    async def close(self) -> None:
        if self._releases:  # the prefill engines' sessions would otherwise wait out their grace
            await asyncio.wait(set(self._releases), timeout=1.0)
        peers, self._peers = list(self._peers.values()), collections.OrderedDict()
        for peer in peers:
            await peer.close()


def _dialable(host: str, port: int) -> bool:
    """Whether an endpoint is an address to pull from, by the rules of every kvplane client
    (`parse_dial_target`: no port 0 or above 65535, no whitespace or control characters)."""
    if not 0 < port <= 65535:  # join_host_port would write any int
        return False
    try:
        parse_dial_target(join_host_port(host, port))
    except ValueError:
        return False
    return True


def _attribute(
    attributes: Mapping[str, struct_pb2.Value],
    name: str,
    kind: Literal["number_value", "string_value"],
) -> Any:
    """A session attribute of the kind it must have; None when absent."""
    if name not in attributes:
        return None
    value = attributes[name]
    if value.WhichOneof("kind") != kind:
        expected = "a number" if kind == "number_value" else "a string"
        raise InvalidRequestError(f"kv.session.attributes_struct.{name} must be {expected}")
    return getattr(value, kind)


def _pull_error(exc: grpc.aio.AioRpcError, where: str) -> KvplaneError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        return KvSessionNotFoundError(f"{where}: not found ({details})")
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # the prefill engine's check_fit
        return KvSessionRefusedError(f"{where}: {details}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return KvSessionRefusedError(
            f"{where}: the prefill engine refused the pull, {code.name}: {details} "
            "(kv_transfer.peer_token_file holds the token this engine presents)"
        )
    return KvTransferError(f"{where}: pull failed, {code.name}: {details}")
