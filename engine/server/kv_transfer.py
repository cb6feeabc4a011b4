"""KV transfer between engines: kvplane's `kvplane-pull` backend (the DECODE engine pulls).

The seed's handoff ("Disaggregated serving and KV API"): a PREFILL engine's Generate ends with
PrefillReady carrying a `KvSessionRef`; the same request with `kv.session` set goes to a DECODE
engine, which attaches the session and generates. Here:

- PREFILL: `prefill_request` turns the request into a one-token pass whose sampled token is
  dropped, under a fresh session id (`KvSessionStore.open`); when the prompt is computed the
  engine core holds the session's blocks (ref-counted, never evicted) and the stream ends with
  PrefillReady (`KvSessionStore.session_ref`). `KvTransferServicer` serves
  `kvplane.v1.KvTransfer/PullKvSession` on the engine's gRPC port (behind the bearer token when
  the engine has `auth:`: pulls hand the session's KV over) and `ReleaseKvSession`.
- DECODE (engine/server/kv_pull.py): `KvSessionPuller` checks the ref (backend, a `grpc`
  endpoint, block size and layout when the ref's attributes name them), pulls the session and
  checks what arrives against the request; the engine thread then imports the blocks into the
  prefix cache in the same command that adds the request (`PulledSession.importer`,
  `EngineCore.import_or_hold_kv_blocks`), so admission finds them as ordinary prefix hits.

This module holds the protocol's shared parts (`KvNamespace`, `check_fit`,
`blocks_per_chunk`) and the PREFILL side.

Wire: one `KvSessionHeader` (the tokens the KV covers, whole blocks, never the block holding
the prompt's last token; block size; `kv_layout`; number of blocks), then the blocks in order
as runs: each `KvBlockData` holds `num_blocks` consecutive blocks from `index`, each the
runner's `kv_block_bytes` (zero for the sim runner), the runs adjacent, none past the header's
count. A run holds at most what the puller asked for (`max_blocks_per_chunk`; 0, as pullers
before runs send: one block a message). Runs of about `CHUNK_BYTES` stream faster than a
message per block (docs/benchmarks/engine.md, "Prefill/decode handoff").

Session lifetime (PREFILL engine): PREFILLING (its request runs: not pullable, no TTL) ->
READY (PrefillReady sent; `session_ttl_s` starts) -> PULLING (one pull at a time, no TTL) ->
READY again -> released, the blocks left in the prefix cache, evictable as any. Released when
the puller says it has what it needs (`ReleaseKvSession`, which a DECODE engine sends once its
request is accepted), on `Abort(kv_session)`, at the TTL,
`PULLED_GRACE_S` after a pull that sent every block, when a drain's deadline passes with
`abort_after_deadline`, or with the engine. A release or an abort takes effect at once, even
during a pull (which then fails NOT_FOUND at its next read of the blocks): waiting for the pull
to end would let a puller that stops reading (and never cancels) hold the blocks, and a
drain's deadline, for as long as it likes. A pull does not consume the session: a decode
engine that fails or dies after pulling, before its request is accepted, leaves it to the
gateway's retry on another decode engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from engine.core.api import EngineRequest, SamplingParams
from engine.core.engine_loop import EngineLoop
from engine.core.errors import EngineStoppedError
from engine.server.errors import (
    KvSessionNotFoundError,
    KvSessionRefusedError,
    grpc_status_for,
    public_message,
)
from kvplane.errors import KvplaneError
from kvplane.server import Service, abort_with
from kvplane_api.v1 import kv_transfer_pb2 as kt
from kvplane_api.v1 import kv_transfer_pb2_grpc as kt_grpc
from openengine.v1 import openengine_pb2 as pb

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore

log = logging.getLogger(__name__)

TRANSFER_BACKEND = "kvplane-pull"
PROTOCOL = "grpc"
SERVICE_NAME = "kvplane.v1.KvTransfer"
MUTATING_METHODS = frozenset({"PullKvSession", "ReleaseKvSession"})
# How long a session whose blocks were all sent waits for its puller's ReleaseKvSession (or a
# retry's pull) before it is released anyway (never longer than the TTL would have).
PULLED_GRACE_S = 10.0
# Blocks copied out per engine-thread command: a long session must not hold steps up.
_READ_BATCH_BYTES = 16 << 20
# The size of one message's run of blocks (at least one block). Measured on loopback with 256
# KiB blocks: 1 MiB messages streamed ~1.5x faster than 256 KiB ones and ~1.7x faster than
# 4 MiB ones (larger messages cost more in gRPC's own buffers than they save in calls).
CHUNK_BYTES = 1 << 20
# Sessions that ended (released, expired, aborted) remembered so that Abort(kv_session) of
# one answers ALREADY_FINISHED, the seed's idempotent outcome, and not NOT_FOUND.
_ENDED_MEMORY = 10_000


def blocks_per_chunk(kv_block_bytes: int) -> int:
    """How many blocks of `kv_block_bytes` one message carries: `CHUNK_BYTES` of them, at
    least one (every block for the sim runner's empty blocks)."""
    return max(1, CHUNK_BYTES // max(1, kv_block_bytes))


# ------------------------------------------------------------------------------------------
# Requests of each role
# ------------------------------------------------------------------------------------------


def prefill_request(request: EngineRequest, session_id: str) -> EngineRequest:
    """A PREFILL engine's pass: compute the prompt (and its prompt logprobs, if asked), sample
    one greedy token that is never sent, and hold the KV under `session_id`. The client's
    sampling is for the decode engine."""
    sampling = request.sampling
    return dataclasses.replace(
        request,
        sampling=SamplingParams(
            temperature=0.0,
            max_tokens=1,
            ignore_eos=True,
            prompt_logprobs=sampling.prompt_logprobs,
            prompt_logprob_start=sampling.prompt_logprob_start,
        ),
        kv_session_id=session_id,
    )


@dataclass(frozen=True, slots=True)
class KvNamespace:
    """What KV is computed under besides its tokens: the LoRA adapter and the cache salt
    ("" for none), the namespace of the block keys. A session's KV serves only a request of
    its own namespace: imported under another, it would be hit as that namespace's KV."""

    lora_name: str = ""
    cache_salt: str = ""

    @classmethod
    def of(cls, request: EngineRequest) -> KvNamespace:
        return cls(request.lora_name or "", request.cache_salt or "")


def check_fit(
    *,
    block_size: float | None,
    kv_layout: str | None,
    token_ids: Sequence[int] | None,
    want_block_size: int,
    want_layout: str,
    prompt: Sequence[int],
    namespace: KvNamespace | None = None,
    want_namespace: KvNamespace | None = None,
) -> None:
    """Refuse (KvSessionRefusedError) a session whose blocks an engine with `want_block_size`
    and `want_layout` cannot use for `prompt` in `want_namespace`; a None part is not known
    yet, not checked. The prefill engine checks before it sends anything (it alone knows the
    session's namespace), the decode engine again on what it got."""
    if block_size is not None and block_size != want_block_size:
        raise KvSessionRefusedError(
            f"the KV session has blocks of {block_size:g} tokens; the decode engine's are "
            f"{want_block_size}"
        )
    if kv_layout is not None and kv_layout != want_layout:
        raise KvSessionRefusedError(
            f"the KV session's layout {kv_layout!r} differs from the decode engine's "
            f"{want_layout!r}"
        )
    if token_ids is not None and (
        len(token_ids) > len(prompt) or list(token_ids) != list(prompt[: len(token_ids)])
    ):
        raise KvSessionRefusedError(
            f"the KV session holds the KV of {len(token_ids)} tokens that are not a prefix of "
            f"the request's prompt ({len(prompt)} tokens)"
        )
    if namespace is not None and want_namespace is not None and namespace != want_namespace:
        differences = []
        if namespace.lora_name != want_namespace.lora_name:
            differences.append(
                f"LoRA adapter {namespace.lora_name or None!r} (the request's: "
                f"{want_namespace.lora_name or None!r})"
            )
        if namespace.cache_salt != want_namespace.cache_salt:
            differences.append("another cache salt than the request's")
        raise KvSessionRefusedError(
            "the KV session was computed with "
            + " and ".join(differences)
            + "; KV is reused only within its LoRA adapter and cache salt"
        )


# ------------------------------------------------------------------------------------------
# PREFILL: the sessions and the pull service
# ------------------------------------------------------------------------------------------


class _State(enum.Enum):
    PREFILLING = "prefilling"
    READY = "ready"
    PULLING = "pulling"


@dataclass(slots=True)
class _Session:
    state: _State
    namespace: KvNamespace
    deadline_s: float = 0.0  # READY: released at this time
    pull_ended: asyncio.Event | None = None  # PULLING: set when that pull ends


class KvSessionStore:
    """A PREFILL engine's sessions (the asyncio side; the core holds their blocks). Create
    inside the running event loop; `close` ends its TTL sweeper."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        *,
        ttl_s: float,
        block_size: int,
        kv_layout: str,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine_loop = engine_loop
        self._ttl_s = ttl_s
        self._block_size = block_size
        self._kv_layout = kv_layout
        self._on_change = on_change
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # handed over, then ended
        # What PrefillReady names, filled in once the server is bound.
        self.endpoints: list[pb.KvEndpoint] = []
        self.data_parallel_rank = 0
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-session-ttl")

    @property
    def num_open(self) -> int:
        """Sessions handed over (READY or PULLING): what Drain reports. GetLoad reports the
        sessions whose blocks the core holds (`LoadSnapshot.num_kv_sessions`): the same ones,
        from the instant the prefill finishes until the core lets go of the blocks."""
        return sum(1 for s in self._sessions.values() if s.state is not _State.PREFILLING)

    def open(self, namespace: KvNamespace) -> str:
        """A new session for a prefill about to be submitted in `namespace`."""
        session_id = f"kvs-{uuid.uuid4().hex}"
        self._sessions[session_id] = _Session(_State.PREFILLING, namespace)
        return session_id

    def session_ref(self, session_id: str, num_prompt_tokens: int) -> pb.KvSessionRef:
        """What PrefillReady carries: where to pull the session from, and what it holds."""
        ref = pb.KvSessionRef(
            session_id=session_id,
            transfer_backend=TRANSFER_BACKEND,
            endpoints=self.endpoints,
            dp_rank=self.data_parallel_rank,
        )
        ref.attributes_struct.update(
            {
                "block_size": self._block_size,
                "num_prompt_tokens": num_prompt_tokens,
                "kv_layout": self._kv_layout,
            }
        )
        return ref

    def ready(self, session_id: str) -> None:
        """The core holds the session and PrefillReady is on its way: the TTL starts."""
        session = self._sessions.get(session_id)
        if session is not None and session.state is _State.PREFILLING:
            session.state = _State.READY
            session.deadline_s = self._clock() + self._ttl_s
            self._on_change()

    def discard(self, session_id: str) -> None:
        """The prefill ended without handing the session over (cancelled, failed, the client
        gone): release whatever the core may hold. A session already handed over is kept."""
        session = self._sessions.get(session_id)
        if session is not None and session.state is _State.PREFILLING:
            del self._sessions[session_id]
            self._release(session_id)

    def abort(self, session_id: str) -> bool:
        """Abort(kv_session), or the puller's ReleaseKvSession: release it at once (a pull in
        progress fails at its next read). False: it had ended already;
        KvSessionNotFoundError for a session never handed over here."""
        session = self._sessions.get(session_id)
        if session is None or session.state is _State.PREFILLING:
            if session is None and session_id in self._ended:
                return False
            raise KvSessionNotFoundError(f"no KV session {session_id!r} on this engine")
        self._drop(session_id)
        return True

    async def claim(self, session_id: str) -> KvNamespace:
        """Start a pull; returns the session's namespace. A session being pulled is waited
        for (then pulled again unless that pull's puller released it). NOT_FOUND unless it is
        then READY."""
        session = self._sessions.get(session_id)
        while session is not None and session.pull_ended is not None:
            await session.pull_ended.wait()
            session = self._sessions.get(session_id)
        if session is None or session.state is not _State.READY:
            raise KvSessionNotFoundError(
                f"no KV session {session_id!r} ready to pull on this engine (unknown, "
                "expired, released or already pulled)"
            )
        session.state = _State.PULLING
        session.pull_ended = asyncio.Event()
        return session.namespace

    def end_pull(self, session_id: str, *, complete: bool) -> None:
        """A pull ended: released when its TTL passed meanwhile, else READY again: for its
        puller's ReleaseKvSession or another attempt, within the TTL, and within
        `PULLED_GRACE_S` when it sent everything. Nothing to do when the session was released
        or aborted during the pull (`_drop` woke the pulls waiting for this one)."""
        session = self._sessions.get(session_id)
        if session is None or session.pull_ended is None:
            return
        session.pull_ended.set()
        session.pull_ended = None
        now = self._clock()
        if session.deadline_s <= now:
            self._drop(session_id)
            return
        session.state = _State.READY
        if complete:
            session.deadline_s = min(session.deadline_s, now + PULLED_GRACE_S)

    def release_all(self) -> None:
        """A drain's deadline passed: let go of every session handed over (pulls in
        progress included)."""
        for session_id, session in list(self._sessions.items()):
            if session.state is not _State.PREFILLING:
                self._drop(session_id)

    def release_lora(self, lora_name: str) -> None:
        """`lora_name` was loaded afresh: the core let go of the sessions computed with its
        earlier load (`EngineCore.load_lora`), so they are no work left for Drain to wait for
        (nor pullable)."""
        for session_id, session in list(self._sessions.items()):
            if session.state is not _State.PREFILLING and session.namespace.lora_name == lora_name:
                self._drop(session_id)

    def expire(self) -> None:
        now = self._clock()
        for session_id, session in list(self._sessions.items()):
            if session.state is _State.READY and session.deadline_s <= now:
                log.info("KV session %s expired unreleased; releasing its blocks", session_id)
                self._drop(session_id)

    async def _sweep(self) -> None:
        # A quarter of the TTL, between 10 ms (a tiny TTL must not spin the loop) and 1 s.
        interval_s = min(1.0, max(0.01, self._ttl_s / 4))
        while True:
            await asyncio.sleep(interval_s)
            self.expire()

    async def close(self) -> None:
        self._sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweeper

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id)
        if session.pull_ended is not None:  # pulls waiting for this one find it gone
            session.pull_ended.set()
        self._ended[session_id] = None
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        self._release(session_id)
        self._on_change()

    def _release(self, session_id: str) -> None:
        # Fire and forget: a stopped engine thread has let go of everything anyway.
        self._engine_loop.call(functools.partial(_release_in_core, session_id=session_id))


def _release_in_core(core: EngineCore, *, session_id: str) -> bool:
    return core.release_kv_session(session_id)


def _session_tokens(core: EngineCore, *, session_id: str) -> tuple[int, ...] | None:
    return core.kv_session_tokens(session_id)


def _read_runs(
    core: EngineCore, *, session_id: str, first: int, count: int, run_blocks: int
) -> list[bytes] | None:
    """`count` blocks from `first`, one bytes string per run of `run_blocks` blocks; None when
    the session was released meanwhile (its blocks may be reused: never read them)."""
    if core.kv_session_tokens(session_id) is None:
        return None
    end = first + count
    return [
        core.read_kv_session(session_id, start, min(run_blocks, end - start))
        for start in range(first, end, run_blocks)
    ]


class KvTransferServicer(kt_grpc.KvTransferServicer):
    """`kvplane.v1.KvTransfer` on every engine's port; only a PREFILL engine holds sessions
    (elsewhere every pull is NOT_FOUND)."""

    def __init__(
        self,
        sessions: KvSessionStore | None,
        engine_loop: EngineLoop,
        *,
        block_size: int,
        kv_layout: str,
        kv_block_bytes: int,
    ) -> None:
        self._sessions = sessions
        self._engine_loop = engine_loop
        self._block_size = block_size
        self._kv_layout = kv_layout
        self._blocks_per_read = max(1, _READ_BATCH_BYTES // max(1, kv_block_bytes))
        self._blocks_per_chunk = blocks_per_chunk(kv_block_bytes)

    def service(self) -> Service:
        return Service(
            SERVICE_NAME,
            lambda server: kt_grpc.add_KvTransferServicer_to_server(self, server),
            MUTATING_METHODS,
        )

    async def PullKvSession(
        self, request: kt.PullKvSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[kt.KvSessionChunk]:
        session_id, sessions = request.session_id, self._sessions
        try:
            if sessions is None:
                raise KvSessionNotFoundError("only a PREFILL engine holds KV sessions")
            namespace = await sessions.claim(session_id)
        except KvplaneError as exc:
            await abort_with(context, grpc_status_for(exc), public_message(exc))
        complete = False
        try:
            tokens = await self._call(
                context, functools.partial(_session_tokens, session_id=session_id)
            )
            if tokens is None:  # released or aborted since the claim
                sessions.abort(session_id)  # a no-op then; never leave one the core lost
                await abort_with(context, grpc.StatusCode.NOT_FOUND, "the KV session is gone")
            try:  # what the puller cannot use stays pullable: nothing was sent
                check_fit(
                    block_size=self._block_size,
                    kv_layout=self._kv_layout,
                    token_ids=tokens,
                    want_block_size=request.block_size or self._block_size,
                    want_layout=request.kv_layout or self._kv_layout,
                    prompt=request.prompt_token_ids if request.prompt_token_ids else tokens,
                    namespace=namespace,
                    want_namespace=KvNamespace(request.lora_name, request.cache_salt),
                )
            except KvSessionRefusedError as exc:
                await abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            num_blocks = len(tokens) // self._block_size
            yield kt.KvSessionChunk(
                header=kt.KvSessionHeader(
                    token_ids=tokens,
                    block_size=self._block_size,
                    kv_layout=self._kv_layout,
                    num_blocks=num_blocks,
                )
            )
            # A puller before runs asks for none (0): one block a message, as it expects.
            run_blocks = min(max(1, request.max_blocks_per_chunk), self._blocks_per_chunk)
            async for run in self._runs(context, session_id, num_blocks, run_blocks):
                yield kt.KvSessionChunk(block=run)
            complete = True
        finally:  # the client gone or the stream failed: the session stays pullable
            sessions.end_pull(session_id, complete=complete)

    async def _runs(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        session_id: str,
        num_blocks: int,
        run_blocks: int,
    ) -> AsyncIterator[kt.KvBlockData]:
        """The session's blocks in runs of `run_blocks`, read from the engine thread a batch
        (about `_READ_BATCH_BYTES`) at a time. (Reading the next batch while one is sent did
        not measurably help on 2 CPUs: the copies and the stream contend for the same cores.)"""
        batch_blocks = run_blocks * max(1, self._blocks_per_read // run_blocks)
        for first in range(0, num_blocks, batch_blocks):
            count = min(batch_blocks, num_blocks - first)
            read = functools.partial(
                _read_runs, session_id=session_id, first=first, count=count, run_blocks=run_blocks
            )
            runs = await self._call(context, read)
            if runs is None:
                await abort_with(
                    context,
                    grpc.StatusCode.NOT_FOUND,
                    f"the KV session {session_id!r} was released or aborted during the pull",
                )
            for index, data in zip(range(first, first + count, run_blocks), runs, strict=True):
                yield kt.KvBlockData(
                    index=index, num_blocks=min(run_blocks, first + count - index), data=data
                )

    async def ReleaseKvSession(
        self, request: kt.ReleaseKvSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kt.ReleaseKvSessionResponse:
        try:
            if self._sessions is None:
                raise KvSessionNotFoundError("only a PREFILL engine holds KV sessions")
            self._sessions.abort(request.session_id)
        except KvplaneError as exc:
            await abort_with(context, grpc_status_for(exc), public_message(exc))
        return kt.ReleaseKvSessionResponse()

    async def _call(
        self, context: grpc.aio.ServicerContext[Any, Any], fn: Callable[[EngineCore], Any]
    ) -> Any:
        try:
            return await asyncio.wrap_future(self._engine_loop.call(fn))
        except EngineStoppedError as exc:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, str(exc))
