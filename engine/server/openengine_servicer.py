"""`openengine.v1.OpenEngine` over the engine service: every RPC of the seed.

Error phases (seed, "Standard errors"): anything wrong before acceptance is a non-OK status
from `engine.server.errors`' table and no event; once a Generate, Drain or subscription is
accepted, a failure is exactly one terminal `EngineError` event and the stream ends OK.
Embed/Classify/Score run on a torch model's pooler (`engine.server.pooling_tasks`); a unary
task's failure, accepted or not, is its status. LoRA adapters: `engine.server.lora_service`.
Features this engine lacks are refused before acceptance and advertised as unsupported: the
tasks without a pooler (the sim runner) or Classify without a classification head (once their
required context fields are there) and LoRA when `lora.enabled` is off -> FAILED_PRECONDITION,
guided decoding and media -> INVALID_ARGUMENT (unsupported explicit options), a KV session on
an engine that is not DECODE -> FAILED_PRECONDITION. A request carrying fields outside the
schema (an option of a newer OpenEngine revision, which protobuf would drop unseen) is
INVALID_ARGUMENT naming them, before the servicer runs (`STRICT_METHODS`): every RPC but
GetEngineInfo, the revision handshake every client must be able to make.

Roles: a PREFILL engine's Generate ends with PrefillReady naming a KV session; a DECODE
engine's Generate with `kv.session` pulls that session before acceptance
(`engine.server.kv_transfer`), and one aborted meanwhile ends as a request aborted before its
prefill does (each output finished CANCELLED, status OK); Abort(kv_session) releases a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from engine.core.api import EngineRequest
from engine.core.lora import LoraAdapter
from engine.server.engine_service import AbortOutcome, DrainPhase, EngineService, RequestStream
from engine.server.errors import (
    DrainingError,
    FeatureDisabledError,
    KvSessionNotFoundError,
    ModelNotFoundError,
    RequestAbortedError,
    engine_error_for,
    grpc_status_for,
    public_message,
)
from engine.server.info import (
    LORA_DISABLED_MESSAGE,
    engine_info,
    kv_connector_info,
    load_info,
    model_info,
)
from engine.server.kv_event_log import SubscriberOverrunError
from engine.server.kv_pull import KvSessionPuller, decode_request
from engine.server.kv_transfer import KvNamespace, prefill_request
from engine.server.kv_wire import to_proto_batch
from engine.server.lora_service import LoraService
from engine.server.openengine_convert import (
    EngineContext,
    GenerateStreamEncoder,
    engine_request_from_proto,
    unconverted_from_proto,
)
from engine.server.pooling_tasks import PoolingTasks, check_task_context
from kvplane.errors import KvplaneError
from kvplane.server import Service, abort_with
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

R = TypeVar("R")

Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME = "openengine.v1.OpenEngine"
MUTATING_METHODS = frozenset({"Drain", "Abort", "LoadLora", "UnloadLora"})
# The RPCs that refuse fields outside their request's schema (kvplane.request_decoding): an
# option of a newer revision, silently dropped, would change what the call does, and the seed
# has an explicit option the engine does not support refused (INVALID_ARGUMENT). All but
# GetEngineInfo, whose answer (`schema_revision`) is how a client of any revision learns
# whether it may talk to this engine at all (seed: clients fail closed outside their range).
STRICT_METHODS = frozenset(
    name
    for name in pb.DESCRIPTOR.services_by_name["OpenEngine"].methods_by_name
    if name != "GetEngineInfo"
)

# How an event subscription ends when the engine shuts down: a terminal EngineError
# (DRAINING, retryable: a new process may follow), so that a subscriber tells it from a
# stream cut short.
_SHUTTING_DOWN = DrainingError("the engine is shutting down")

_DRAIN_STATE = {
    DrainPhase.STARTED: pb.DRAIN_STATE_STARTED,
    DrainPhase.IN_PROGRESS: pb.DRAIN_STATE_IN_PROGRESS,
    DrainPhase.COMPLETE: pb.DRAIN_STATE_COMPLETE,
}


async def refuse(context: Context, exc: Exception) -> NoReturn:
    """Fail an RPC before acceptance with the table's status (a traceback only in our log)."""
    if not isinstance(exc, KvplaneError):
        log.exception("unexpected error before acceptance", exc_info=exc)
    await abort_with(context, grpc_status_for(exc), public_message(exc))


class OpenEngineServicer(pb_grpc.OpenEngineServicer):
    def __init__(
        self,
        service: EngineService,
        ctx: EngineContext,
        *,
        instance_id: str,
        token_text: Callable[[int], str],
        kv_puller: KvSessionPuller | None = None,
        probe_timeout_s: float = 30.0,
        tasks: PoolingTasks | None = None,
        lora: LoraService | None = None,
    ) -> None:
        """`kv_puller`: a DECODE engine's; a PREFILL engine's sessions are the service's.
        `tasks`: Embed/Classify/Score (a torch model's); None refuses them. `lora`: None when
        LoRA is off."""
        self._service = service
        self._ctx = ctx
        self._instance_id = instance_id
        self._token_text = token_text
        self._kv_puller = kv_puller
        self._probe_timeout_s = probe_timeout_s
        self._tasks = tasks
        self._lora = lora
        # Filled in once the servers are bound (their real addresses are known only then).
        self.kv_event_sources: list[pb.KvEventSource] = []
        self.kv_connector = kv_connector_info(ctx.role, [])

    def service(self) -> Service:
        return Service(
            SERVICE_NAME,
            lambda server: pb_grpc.add_OpenEngineServicer_to_server(self, server),
            MUTATING_METHODS,
            STRICT_METHODS,
        )

    def _check_model(self, model: str) -> None:
        if not self._ctx.model.serves(model):
            raise ModelNotFoundError(f"model {model!r} is not served here")

    # ---------------------------------------------------------------- generation

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        sessions = self._service.kv_sessions
        session_id: str | None = None
        try:
            engine_request, aborted = await self._service.convert(
                request.request_id,
                lambda: engine_request_from_proto(request, self._ctx),
                lambda: unconverted_from_proto(request, self._ctx),
            )
            if aborted:
                stream = None  # aborted while it was converted: the core never has it
                if request.kv.HasField("session") and self._kv_puller is not None:
                    # A DECODE engine's request needs its session no longer, as one aborted
                    # during its pull (a ref it could not pull from names none to release).
                    with contextlib.suppress(KvplaneError):
                        self._kv_puller.release(request.kv.session)
            elif request.kv.HasField("session") and self._kv_puller is not None:
                stream = await self._pull_and_submit(
                    self._kv_puller, request.kv.session, engine_request
                )
                if stream is not None:
                    engine_request = stream.request
            else:
                if sessions is not None:
                    session_id = sessions.open(KvNamespace.of(engine_request))
                    engine_request = prefill_request(engine_request, session_id)
                stream = self._service.submit(engine_request)
        except Exception as exc:
            if sessions is not None and session_id is not None:
                sessions.discard(session_id)
            await refuse(context, exc)
        kv_session = None
        if sessions is not None and session_id is not None:
            kv_session = sessions.session_ref(session_id, len(engine_request.prompt_token_ids))
        sampling = engine_request.sampling
        encoder = GenerateStreamEncoder(
            engine_request.request_id,
            engine_request.prompt_token_ids,
            sampling.num_sequences,
            sampling.prompt_logprob_start,
            self._token_text,
            kv_session=kv_session,
        )
        if stream is None:  # aborted while converted, or while it pulled its KV session
            for output in self._service.aborted_before_prefill(engine_request):
                for event in encoder.encode(output):
                    yield event
            return
        try:
            async for output in stream.outputs():
                for event in encoder.encode(output):
                    if session_id is not None and event.HasField("prefill_ready"):
                        assert sessions is not None
                        sessions.ready(session_id)
                    yield event
                if encoder.done:
                    break
        except Exception:  # accepted: a failure is one terminal EngineError, then OK
            log.exception("generation %s failed", engine_request.request_id)
            if not encoder.done:
                yield encoder.error_event(pb.ERROR_CODE_INTERNAL, "internal engine error")
        finally:
            if not stream.done:  # client gone or stream failed: stop the work
                self._service.cancel_nowait(engine_request.request_id)
            if sessions is not None and session_id is not None:
                sessions.discard(session_id)  # a no-op once PrefillReady handed it over

    async def _pull_and_submit(
        self, puller: KvSessionPuller, session: pb.KvSessionRef, engine_request: EngineRequest
    ) -> RequestStream | None:
        """A DECODE engine's request with a KV session: admitted first (everything `submit`
        would refuse is refused before the pull; from then on it is in flight), then pulled,
        then submitted with the blocks imported just before it. None: Abort (or a drain's
        deadline) ended it first, so the core never had it. Pulled, the request needs the
        session no longer, whatever comes after (accepted, aborted, or failing after the engine
        thread took it, which stops it there): the prefill engine is told to release it."""
        handle = self._service.begin_pull(engine_request)
        pull = asyncio.ensure_future(puller.pull(session, engine_request))
        try:
            pulled = await self._service.unless_aborted(handle, pull)
        except BaseException as exc:
            pull.cancel()  # aborted (or the client gone): stop the transfer at once
            self._service.abandon_pull(handle, exc)
            if not isinstance(exc, RequestAbortedError):
                raise  # the client gone (another puller may take it) or the pull failed
            puller.release(session)
            return None
        try:
            decoding = decode_request(engine_request)
            metrics = self._service.metrics
            importer = pulled.importer(
                decoding,
                max_held_bytes=puller.max_held_bytes,
                on_outcome=None if metrics is None else metrics.on_kv_import,
            )
            return self._service.end_pull(handle, decoding, importer, num_blocks=len(pulled.blocks))
        except RequestAbortedError:  # aborted as the pull ended
            return None
        finally:
            puller.release(session)

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        return await self._task(request.context, "embedding", PoolingTasks.embed, request, context)

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        return await self._task(
            request.context, "classification", PoolingTasks.classify, request, context
        )

    async def Score(self, request: pb.ScoreRequest, context: Context) -> pb.ScoreResponse:
        return await self._task(request.context, "scoring", PoolingTasks.score, request, context)

    async def _task(
        self,
        task_context: pb.TaskRequestContext,
        what: str,
        run: Callable[[PoolingTasks, Any], Awaitable[R]],
        request: Any,
        context: Context,
    ) -> R:
        try:
            check_task_context(task_context, self._ctx)
            if self._tasks is None:
                raise FeatureDisabledError(f"{what} is not supported by this engine's model")
            return await run(self._tasks, request)
        except Exception as exc:  # unary: accepted or not, a failure is the status
            await refuse(context, exc)

    # ---------------------------------------------------------------- metadata

    async def GetEngineInfo(
        self, request: pb.GetEngineInfoRequest, context: Context
    ) -> pb.EngineInfo:
        return engine_info(
            self._ctx.model,
            role=self._ctx.role,
            instance_id=self._instance_id,
            data_parallel_rank=self._ctx.data_parallel_rank,
            kv_connector=self.kv_connector,
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.ModelInfo:
        if not request.model:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        try:
            self._check_model(request.model)
        except KvplaneError as exc:
            await refuse(context, exc)
        return model_info(self._ctx.model)

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> pb.LoadInfo:
        return load_info(
            self._service.load(),
            instance_id=self._instance_id,
            timestamp_unix_ns=time.time_ns(),
            data_parallel_rank=self._ctx.data_parallel_rank,
            include_per_rank=request.include_per_rank,
            running_tasks=self._service.num_running_tasks,
            waiting_tasks=self._service.num_waiting_tasks,
        )

    # ---------------------------------------------------------------- health and lifecycle

    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        try:
            self._check_model(request.model)
        except KvplaneError as exc:
            await refuse(context, exc)
        ready, not_ready = pb.HEALTH_STATE_READY, pb.HEALTH_STATE_NOT_READY
        running = self._service.engine_running
        checks = [
            pb.HealthCheck(name="grpc", state=ready),
            pb.HealthCheck(
                name="scheduler",
                state=ready if running else not_ready,
                message="" if running else "the engine thread is not running",
            ),
            pb.HealthCheck(name="model", state=ready, message=self._ctx.model.name),
        ]
        healthy = running
        if self.kv_connector.enabled:
            checks.append(
                pb.HealthCheck(
                    name="kv_connector",
                    state=ready,
                    message=f"{self.kv_connector.transfer_backend}, open KV sessions: "
                    f"{self._service.num_open_kv_sessions}",
                )
            )
        if request.role != pb.ENGINE_ROLE_UNSPECIFIED:
            role_ok = request.role == self._ctx.role
            healthy = healthy and role_ok
            checks.append(
                pb.HealthCheck(
                    name="role",
                    state=ready if role_ok else not_ready,
                    message=pb.EngineRole.Name(self._ctx.role),
                )
            )
        if request.include_inference_probe:
            problem = (
                await self._service.probe(self._probe_timeout_s)
                if running
                else "the engine thread is not running"
            )
            healthy = healthy and not problem
            checks.append(
                pb.HealthCheck(
                    name="inference_probe",
                    state=not_ready if problem else ready,
                    message=problem
                    or ("generated 1 token" if self._ctx.model.generates else "pooled 1 token"),
                )
            )
        if not healthy:
            state = not_ready
        elif self._service.draining:
            state = pb.HEALTH_STATE_DRAINING
        else:
            state = ready
        return pb.HealthResponse(state=state, checks=checks)

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        target = request.WhichOneof("target")
        try:
            if target == "request_id":
                if not request.request_id:
                    await abort_with(
                        context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"
                    )
                outcome = await self._service.abort(request.request_id)
                if outcome is AbortOutcome.ABORTED:
                    return pb.AbortResponse(status=pb.ABORT_STATUS_ABORTED, message="aborted")
                return pb.AbortResponse(
                    status=pb.ABORT_STATUS_ALREADY_FINISHED, message="already finished"
                )
            if target == "kv_session":
                session_id = request.kv_session.session_id
                if not session_id:
                    await abort_with(
                        context, grpc.StatusCode.INVALID_ARGUMENT, "kv_session.session_id is empty"
                    )
                if self._service.kv_sessions is None:
                    raise KvSessionNotFoundError(
                        f"no KV session {session_id!r} on this engine (not a PREFILL engine)"
                    )
                if self._service.kv_sessions.abort(session_id):
                    return pb.AbortResponse(status=pb.ABORT_STATUS_ABORTED, message="released")
                return pb.AbortResponse(
                    status=pb.ABORT_STATUS_ALREADY_FINISHED, message="already released"
                )
            if target == "all_requests":
                aborted = await self._service.abort_all()
                return pb.AbortResponse(
                    status=pb.ABORT_STATUS_ABORTED, message=f"aborted {len(aborted)} requests"
                )
        except KvplaneError as exc:
            await refuse(context, exc)
        await abort_with(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            "set exactly one abort target: request_id, kv_session or all_requests",
        )

    async def Drain(
        self, request: pb.DrainRequest, context: Context
    ) -> AsyncIterator[pb.DrainResponse]:
        deadline_s = request.deadline_ms / 1000.0 if request.HasField("deadline_ms") else None
        progress = self._service.drain(
            stop_accepting=request.stop_accepting_new_requests,
            deadline_s=deadline_s,
            abort_after_deadline=request.abort_after_deadline,
        )
        try:
            async for step in progress:
                if step.phase is DrainPhase.DEADLINE_EXCEEDED:
                    yield pb.DrainResponse(
                        error=pb.EngineError(
                            code=pb.ERROR_CODE_DRAINING, message=step.message, retryable=True
                        ),
                        in_flight_requests=step.in_flight_requests,
                        open_kv_sessions=step.open_kv_sessions,
                        message=step.message,
                    )
                    return
                yield pb.DrainResponse(
                    state=_DRAIN_STATE[step.phase],
                    in_flight_requests=step.in_flight_requests,
                    open_kv_sessions=step.open_kv_sessions,
                    message=step.message,
                )
        except Exception as exc:
            log.exception("drain failed")
            yield pb.DrainResponse(error=engine_error_for(exc))

    # ---------------------------------------------------------------- LoRA

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context) -> pb.LoadLoraResponse:
        a = request.adapter
        try:
            adapter = LoraAdapter(a.lora_id, a.lora_name, a.source_path)
            already_loaded = await self._lora_service().load(adapter)
        except Exception as exc:
            await refuse(context, exc)
        return pb.LoadLoraResponse(adapter=_lora_proto(adapter), already_loaded=already_loaded)

    async def UnloadLora(
        self, request: pb.UnloadLoraRequest, context: Context
    ) -> pb.UnloadLoraResponse:
        try:
            adapter = await self._lora_service().unload(request.lora_name)
        except Exception as exc:
            await refuse(context, exc)
        return pb.UnloadLoraResponse(adapter=_lora_proto(adapter))

    async def ListLoras(
        self, request: pb.ListLorasRequest, context: Context
    ) -> pb.ListLorasResponse:
        try:
            adapters = self._lora_service().list()
        except KvplaneError as exc:
            await refuse(context, exc)
        return pb.ListLorasResponse(adapters=[_lora_proto(a) for a in adapters])

    def _lora_service(self) -> LoraService:
        if self._lora is None:
            raise FeatureDisabledError(LORA_DISABLED_MESSAGE)
        return self._lora

    # ---------------------------------------------------------------- KV

    async def GetKvConnectorInfo(
        self, request: pb.GetKvConnectorInfoRequest, context: Context
    ) -> pb.KvConnectorInfo:
        return self.kv_connector

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Context
    ) -> pb.GetKvEventSourcesResponse:
        wanted = set(request.data_parallel_ranks)
        sources = [
            s
            for s in self.kv_event_sources
            if not wanted or (s.HasField("data_parallel_rank") and s.data_parallel_rank in wanted)
        ]
        return pb.GetKvEventSourcesResponse(sources=sources)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        rank = self._ctx.data_parallel_rank
        try:
            if request.data_parallel_ranks and rank not in request.data_parallel_ranks:
                await abort_with(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"this engine serves data-parallel rank {rank} only",
                )
            batches = self._service.kv_log.subscribe(
                start_sequence_number=request.start_sequence_number,
                include_snapshot=request.include_snapshot,
            )
        except KvplaneError as exc:
            await refuse(context, exc)
        try:
            async for batch in batches:
                yield pb.SubscribeKvEventsResponse(batch=to_proto_batch(batch, rank))
        except SubscriberOverrunError as exc:
            yield pb.SubscribeKvEventsResponse(error=engine_error_for(exc))
        except Exception as exc:
            log.exception("KV event subscription failed")
            yield pb.SubscribeKvEventsResponse(error=engine_error_for(exc))
        else:
            # The log ends only when the engine shuts down: say so, so that a subscriber
            # tells it from a stream cut short (retryable: a new process may follow).
            yield pb.SubscribeKvEventsResponse(error=engine_error_for(_SHUTTING_DOWN))

    async def SubscribeRuntimeEvents(
        self, request: pb.SubscribeRuntimeEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
        types = [t for t in request.types if t != pb.RUNTIME_EVENT_TYPE_UNSPECIFIED]
        events = self._service.runtime_events.subscribe(types)
        try:
            async for event in events:
                yield pb.SubscribeRuntimeEventsResponse(runtime_event=event)
        except SubscriberOverrunError as exc:
            yield pb.SubscribeRuntimeEventsResponse(error=engine_error_for(exc))
        except Exception as exc:
            log.exception("runtime event subscription failed")
            yield pb.SubscribeRuntimeEventsResponse(error=engine_error_for(exc))
        else:  # the hub ends subscriptions only at shutdown: as the KV event stream says it
            yield pb.SubscribeRuntimeEventsResponse(error=engine_error_for(_SHUTTING_DOWN))
        finally:
            await events.aclose()  # type: ignore[attr-defined]


def _lora_proto(adapter: LoraAdapter) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_id=adapter.lora_id, lora_name=adapter.name, source_path=adapter.path)
