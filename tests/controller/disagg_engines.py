"""Prefill and decode engines for the gateway's disaggregated tests.

The bundled engine does not move KV between engines yet (a PREFILL or DECODE engine refuses
every request before acceptance), so each of these is a real sim engine behind a thin OpenEngine
server that plays the seed's roles ("Disaggregated serving and KV API"):

- PREFILL: takes no `kv.session`; prefills (the sim engine computes the prompt and one token,
  which is dropped) and ends with the terminal PrefillReady carrying a `KvSessionRef`; Usage
  rides on it. A prefill aborted (Abort by request id) ends with finished(CANCELLED) and no
  PrefillReady; Abort(kv_session) frees a session it opened that no decode engine attached
  (any other engine: NOT_FOUND; with `Sessions.release_answer_lost` it frees it, then fails
  UNAVAILABLE). `prefill_gate`
  holds every prefill until it is set (a test's window to act mid-prefill); `handover_gate`
  holds the stream open after its PrefillReady until it is set (the request is finished on
  the engine then: an Abort of it is ALREADY_FINISHED).
- DECODE: needs `kv.session` naming a session a prefill engine opened and nobody attached yet
  (else FAILED_PRECONDITION for none, NOT_FOUND, or `Sessions.refusal_status`, for an unknown
  one: before acceptance; with
  `Sessions.in_band_refusal`, an unknown one is accepted and refused in-band, one terminal
  EngineError of that code, as an engine that pulls after acceptance does; with
  `Sessions.refuse_open`, an open one is refused so too, left open; with
  `Sessions.refuse_taken`, one is attached, then refused so); the
  "transfer" is the sim engine computing the prompt itself, then it decodes. With
  `accept_local_prefill` it also takes requests without a session and prefills them itself,
  as engines that can prefill locally do. `decode_gate` holds every request with a session
  before acceptance (nothing answered, the session not attached) until it is set.

Everything else (info with the role, model info, health, load, KV events) is the real sim
engine's answer, so the controller indexes and polls them exactly as it does any engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine

Context = grpc.aio.ServicerContext[Any, Any]
RoleEngine = FrontedEngine["RoleServicer"]


@dataclass
class Sessions:
    """KV sessions opened by prefill engines and not yet attached by a decode engine."""

    open: dict[str, str] = field(default_factory=dict)  # session id -> prefill engine
    ids: itertools.count[int] = field(default_factory=itertools.count)
    # Called when a prefill engine opens a session (a test's hook into the handoff).
    on_open: Callable[[], object] | None = None  # what it returns is not read
    # Every session is lost before a decode engine attaches (a failed transfer).
    lost: bool = False
    # Decode engines refuse an unknown session in-band, after acceptance, with an EngineError
    # of this code (KV_SESSION_NOT_FOUND, KV_TRANSFER_FAILED), not with a status; retryable
    # or not as `retryable_refusal` says.
    in_band_refusal: pb.ErrorCode.ValueType | None = None
    # Before acceptance, decode engines refuse an unknown session with this status.
    refusal_status: grpc.StatusCode = grpc.StatusCode.NOT_FOUND
    retryable_refusal: bool = False
    # Every session ends on its prefill engine as it is handed over (its TTL passing, a
    # drain), before `on_open`: a decode engine finds none, and the prefill engine's Abort
    # of it answers ALREADY_FINISHED.
    ended_at_once: bool = False
    ended: dict[str, str] = field(default_factory=dict)  # session id -> prefill engine
    # The sessions an Abort(kv_session) named, in arrival order; while `release_gate` is
    # set and not open, each such Abort waits for it (a test's window to act meanwhile).
    releases: list[str] = field(default_factory=list)
    release_gate: asyncio.Event | None = None
    # The next this many requests with a session that decode engines get are refused as an
    # unknown session is (before acceptance, or in-band), the session left open on its
    # prefill engine: a NOT_FOUND that is not about the session (a decode engine that no
    # longer serves the model, which the controller does not know yet).
    refuse_open: int = 0
    # The next this many requests with a session that decode engines get attach it (its
    # prefill engine then knows it no more: its release is NOT_FOUND), then refuse it as an
    # unknown session is: a decode engine that took the session and failed.
    refuse_taken: int = 0
    # Abort(kv_session) frees a session it opened, then fails UNAVAILABLE (its answer lost
    # on the way): the gateway cannot tell whether the session is still there.
    release_answer_lost: bool = False


class RoleServicer(Forwarding):
    def __init__(
        self,
        name: str,
        role: pb.EngineRole.ValueType,
        inner: pb_grpc.OpenEngineAsyncStub,
        sessions: Sessions,
        accept_local_prefill: bool,
    ) -> None:
        super().__init__(inner)
        self.name = name
        self.role = role
        self.sessions = sessions
        self.accept_local_prefill = accept_local_prefill
        self.port = 0  # set once the front server listens
        # (request id, whether it carried a KV session), in arrival order.
        self.generated: list[tuple[str, bool]] = []
        # request id -> set when it is aborted, for the prefills running here.
        self.prefilling: dict[str, asyncio.Event] = {}
        self.prefill_gate: asyncio.Event | None = None
        self.handover_gate: asyncio.Event | None = None
        self.decode_gate: asyncio.Event | None = None
        # A broken prefill engine: its Generate ends at once, with no event at all.
        self.hands_nothing_over = False

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        info = await self.inner.GetEngineInfo(request)
        info.role = self.role
        return info

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        if request.WhichOneof("target") == "kv_session":
            session_id = request.kv_session.session_id
            self.sessions.releases.append(session_id)
            if self.sessions.release_gate is not None:
                await self.sessions.release_gate.wait()
            if self.sessions.ended.get(session_id) == self.name:
                return pb.AbortResponse(status=pb.ABORT_STATUS_ALREADY_FINISHED)
            if self.sessions.open.get(session_id) != self.name:  # only the engine holding it
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such KV session here")
            del self.sessions.open[session_id]
            if self.sessions.release_answer_lost:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            return pb.AbortResponse(status=pb.ABORT_STATUS_ABORTED)
        aborted = self.prefilling.get(request.request_id)
        if aborted is None:
            try:
                return await self.inner.Abort(request)
            except grpc.aio.AioRpcError as exc:  # the sim engine's refusal, as it answered
                await context.abort(exc.code(), exc.details() or "")
        aborted.set()
        # The sim engine may not have the request yet (held at the gate).
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.inner.Abort(request)
        return pb.AbortResponse(status=pb.ABORT_STATUS_ABORTED)

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        has_session = request.kv.HasField("session")
        self.generated.append((request.request_id, has_session))
        if self.role == pb.ENGINE_ROLE_PREFILL:
            if has_session:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "a PREFILL engine takes no kv.session"
                )
            if self.hands_nothing_over:
                return
            async for response in self._prefill(request):
                yield response
            return
        if has_session:
            if self.decode_gate is not None:
                await self.decode_gate.wait()
            session_id = request.kv.session.session_id
            refused_open = self.sessions.refuse_open > 0
            if refused_open:
                self.sessions.refuse_open -= 1
            refused_taken = not refused_open and self.sessions.refuse_taken > 0
            if refused_taken:
                self.sessions.refuse_taken -= 1
            if (
                refused_open
                or self.sessions.open.pop(session_id, None) is None
                or self.sessions.lost
                or refused_taken
            ):
                code = self.sessions.in_band_refusal
                if code is None:
                    status = self.sessions.refusal_status
                    await context.abort(status, f"no KV session {session_id!r}")
                error = pb.EngineError(
                    code=code,
                    message=f"no KV session {session_id!r}",
                    retryable=self.sessions.retryable_refusal,
                )
                yield pb.GenerateResponse(request_id=request.request_id, error=error)
                return
        elif not self.accept_local_prefill:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "role mismatch: a DECODE engine needs kv.session from a prefill engine",
            )
        local = pb.GenerateRequest()
        local.CopyFrom(request)
        local.kv.ClearField("session")
        async for response in self.inner.Generate(local):
            yield response

    async def _prefill(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        aborted = self.prefilling[request.request_id] = asyncio.Event()
        try:
            async for response in self._prefill_unless_aborted(request, aborted):
                yield response
        finally:
            self.prefilling.pop(request.request_id, None)

    async def _prefill_unless_aborted(
        self, request: pb.GenerateRequest, aborted: asyncio.Event
    ) -> AsyncIterator[pb.GenerateResponse]:
        cancelled = pb.GenerateResponse(
            request_id=request.request_id,
            finished=pb.GenerationFinished(reason=pb.FINISH_REASON_CANCELLED),
        )
        while self.prefill_gate is not None and not self.prefill_gate.is_set():
            if aborted.is_set():
                break
            await asyncio.sleep(0.01)
        if aborted.is_set():
            yield cancelled
            return
        local = pb.GenerateRequest()
        local.CopyFrom(request)
        local.stopping.max_tokens = 1
        usage = pb.Usage()
        async for response in self.inner.Generate(local):
            kind = response.WhichOneof("event")
            if kind == "error":
                yield response  # terminal
                return
            if aborted.is_set():  # the sim engine's own end of the aborted request
                yield cancelled
                return
            if kind == "prompt":
                yield response
            if response.HasField("usage"):
                usage.CopyFrom(response.usage)
        session_id = f"{self.name}-{next(self.sessions.ids)}"
        held = self.sessions.ended if self.sessions.ended_at_once else self.sessions.open
        held[session_id] = self.name
        if self.sessions.on_open is not None:
            self.sessions.on_open()
        usage.completion_tokens = 0
        usage.total_tokens = usage.prompt_tokens
        del self.prefilling[request.request_id]  # handed over: its Abort is the sim engine's
        yield pb.GenerateResponse(
            request_id=request.request_id,
            prefill_ready=pb.PrefillReady(
                kv_session=pb.KvSessionRef(
                    session_id=session_id,
                    transfer_backend="test",
                    endpoints=[pb.KvEndpoint(host="127.0.0.1", port=self.port, protocol="grpc")],
                )
            ),
            usage=usage,
        )
        if self.handover_gate is not None:
            await self.handover_gate.wait()


async def start_role_engine(
    name: str,
    role: pb.EngineRole.ValueType,
    sessions: Sessions,
    accept_local_prefill: bool = False,
    port: int = 0,
) -> RoleEngine:
    """A sim engine playing `role` (instance id `{name}-inner`); its front server's port
    (`port`, 0: any free one) is what the controller sees."""
    engine = await start_fronted_engine(
        f"{name}-inner",
        lambda inner: RoleServicer(name, role, inner, sessions, accept_local_prefill),
        port=port,
    )
    engine.servicer.port = engine.port  # the endpoint its KV sessions name
    return engine


async def restart_role_engine(engine: RoleEngine, name: str) -> RoleEngine:
    """Stop `engine`'s processes, its KV sessions lost with them, and start a new one at its
    address, named `name` (so a new instance id, `{name}-inner`), of the same role."""
    old = engine.servicer
    await engine.close()
    sessions = old.sessions
    for held in (sessions.open, sessions.ended):
        for session_id in [s for s, holder in held.items() if holder == old.name]:
            del held[session_id]
    return await start_role_engine(
        name, old.role, sessions, old.accept_local_prefill, port=engine.port
    )
