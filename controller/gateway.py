"""The gateway: `openengine.v1.OpenEngine` served for the whole fleet.

- Generate: routed; the chosen engine's stream is relayed unchanged. If the engine fails
  before anything was relayed (a non-OK status such as UNAVAILABLE, or a retryable terminal
  EngineError), the request is retried once on another engine; a failure after that is one
  terminal EngineError (seed: no event may follow it). First token and end of stream release
  the router's in-flight accounting; the engine-reported `cached_prompt_tokens` is recorded
  against the router's prediction.
- Embed / Classify / Score: sent to the least loaded routable engine serving the model.
- Abort: a request id goes to the engine holding it; `all_requests` and KV sessions fan out.
- LoadLora / UnloadLora / ListLoras: fan out to every reachable engine; a failure anywhere is
  reported with every engine's outcome.
- GetLoad: the fleet's sums, with per-engine detail in `attributes`.
- Health, GetEngineInfo, GetModelInfo: the fleet's view.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from controller.registry import EngineRecord, EngineState
from controller.router import NoEngineAvailableError
from controller.service import Controller, PromptInput
from kvplane import __version__
from kvplane.server import abort_with
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DRAIN_PROGRESS_INTERVAL_S = 0.5
SCHEMA_REVISION = 1
MINIMUM_CLIENT_REVISION = 1
SCHEMA_RELEASE = "openengine-v1-r1+seed.94b72b7dabd1ee94"

# Statuses after which the same request may succeed on another engine.
_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
    }
)
_HEALTH_PB = {
    EngineState.UNKNOWN: pb.HEALTH_STATE_NOT_READY,
    EngineState.STARTING: pb.HEALTH_STATE_STARTING,
    EngineState.READY: pb.HEALTH_STATE_READY,
    EngineState.DEGRADED: pb.HEALTH_STATE_DEGRADED,
    EngineState.DRAINING: pb.HEALTH_STATE_DRAINING,
    EngineState.NOT_READY: pb.HEALTH_STATE_NOT_READY,
    EngineState.UNREACHABLE: pb.HEALTH_STATE_NOT_READY,
    EngineState.INCOMPATIBLE: pb.HEALTH_STATE_NOT_READY,
}

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]


class _Retry(Exception):
    """The engine failed before anything was relayed; try another one."""


class GatewayServicer(pb_grpc.OpenEngineServicer):
    def __init__(self, controller: Controller, instance_id: str | None = None) -> None:
        self.controller = controller
        self.instance_id = instance_id or f"controller-{uuid.uuid4().hex[:8]}"
        # request id -> address of the engine serving it now.
        self._holding: dict[str, str] = {}
        self.draining = False

    # ---- generation ----

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        c = self.controller
        started = time.perf_counter()
        if not request.request_id:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if self.draining:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, "the controller is draining")
        which = request.WhichOneof("input")
        key = c.config.router.session_metadata_key
        query = PromptInput(
            request_id=request.request_id,
            prompt=request.prompt if which == "prompt" else None,
            # A slice copies the repeated field in one call; iterating it (`tuple(ids)`) takes
            # one call per token, about half again as long for a typical prompt.
            token_ids=tuple(request.token_ids.ids[:]) if which == "token_ids" else None,
            model=request.model,
            lora_name=request.lora_name,
            cache_salt=request.kv.cache_salt if request.kv.HasField("cache_salt") else "",
            session_key=request.metadata.get(key) if key else None,
        )
        try:
            plan = await c.plan(query)
        except Exception:
            log.exception("request %s: routing failed", request.request_id)
            await abort_with(context, grpc.StatusCode.INTERNAL, "routing failed; see the log")
        tried: set[str] = set()
        for attempt in range(2):
            try:
                decision = c.route(plan, frozenset(tried))
            except NoEngineAvailableError as exc:
                c.metrics.count_request("no_engine")
                await abort_with(context, grpc.StatusCode.UNAVAILABLE, str(exc))
            if attempt == 0:
                c.metrics.route_seconds.observe(time.perf_counter() - started)
            else:
                c.metrics.retries.inc()
            tried.add(decision.engine_id)
            self._holding[request.request_id] = decision.engine_id
            relayed = False
            call = c.fleet.stub(decision.engine_id).Generate(request)
            try:
                async for response in call:
                    kind = response.WhichOneof("event")
                    if (
                        not relayed
                        and kind == "error"
                        and response.error.retryable
                        and attempt == 0
                    ):
                        raise _Retry(response.error.message)
                    if not relayed:
                        c.metrics.first_response_seconds.observe(time.perf_counter() - started)
                    if kind in ("token", "finished", "prefill_ready"):
                        c.router.first_token(request.request_id)
                    if response.HasField("usage"):
                        self._record_usage(decision.predicted_cached_tokens, response.usage)
                    relayed = True
                    yield response
                c.metrics.count_request("ok")
                c.metrics.request_seconds.observe(time.perf_counter() - started)
                return
            except _Retry as exc:
                log.info(
                    "request %s: engine %s refused (%s); retrying",
                    request.request_id,
                    decision.engine_id,
                    exc,
                )
                continue
            except grpc.aio.AioRpcError as exc:
                if not relayed and attempt == 0 and exc.code() in _RETRYABLE:
                    log.info(
                        "request %s: engine %s failed before the first response (%s); "
                        "retrying elsewhere",
                        request.request_id,
                        decision.engine_id,
                        exc.code().name,
                    )
                    continue
                c.metrics.count_request("engine_error")
                if not relayed:
                    await abort_with(context, exc.code(), exc.details() or exc.code().name)
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    error=pb.EngineError(
                        code=pb.ERROR_CODE_INTERNAL,
                        message=f"engine {decision.engine_id} failed mid-stream: "
                        f"{exc.code().name}: {exc.details()}",
                        retryable=False,
                    ),
                )
                return
            finally:
                if not call.done():
                    call.cancel()
                c.router.finish(request.request_id)
                if self._holding.get(request.request_id) == decision.engine_id:
                    del self._holding[request.request_id]
        c.metrics.count_request("engine_error")
        await abort_with(context, grpc.StatusCode.UNAVAILABLE, "no engine could take the request")

    def _record_usage(self, predicted: int, usage: pb.Usage) -> None:
        m = self.controller.metrics
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.predicted_cached_tokens.inc(predicted)
        if usage.HasField("cached_prompt_tokens"):
            m.actual_cached_tokens.inc(usage.cached_prompt_tokens)
            m.cached_tokens_abs_error.inc(abs(predicted - usage.cached_prompt_tokens))

    # ---- non-generative tasks ----

    async def _task(
        self,
        task_context: pb.TaskRequestContext,
        call: Callable[[pb_grpc.OpenEngineAsyncStub], Awaitable[T]],
        context: Context,
    ) -> T:
        c = self.controller
        records = c.fleet.registry.routable(task_context.model or None)
        if not records:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, "no engine serves this model")
        record = min(
            records, key=lambda r: (r.load.running_requests or 0) + (r.load.queued_requests or 0)
        )
        self._holding[task_context.request_id] = record.address
        try:
            return await call(c.fleet.stub(record.address))
        except grpc.aio.AioRpcError as exc:
            await abort_with(context, exc.code(), exc.details() or exc.code().name)
        finally:
            self._holding.pop(task_context.request_id, None)

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        return await self._task(request.context, lambda s: s.Embed(request), context)

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        return await self._task(request.context, lambda s: s.Classify(request), context)

    async def Score(self, request: pb.ScoreRequest, context: Context) -> pb.ScoreResponse:
        return await self._task(request.context, lambda s: s.Score(request), context)

    # ---- lifecycle ----

    def _reachable(self) -> list[EngineRecord]:
        return [
            r
            for r in self.controller.fleet.registry.records()
            if r.identity is not None
            and r.state not in (EngineState.UNREACHABLE, EngineState.INCOMPATIBLE)
        ]

    async def _fan_out(
        self, call: Callable[[pb_grpc.OpenEngineAsyncStub], Awaitable[T]]
    ) -> list[tuple[EngineRecord, T | grpc.aio.AioRpcError]]:
        records = self._reachable()

        async def one(record: EngineRecord) -> T | grpc.aio.AioRpcError:
            try:
                return await call(self.controller.fleet.stub(record.address))
            except grpc.aio.AioRpcError as exc:
                return exc

        results = await asyncio.gather(*(one(r) for r in records))
        return list(zip(records, results, strict=True))

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        target = request.WhichOneof("target")
        if target is None:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "set one abort target")
        if target == "request_id":
            address = self._holding.get(request.request_id)
            if address is None:
                await abort_with(
                    context,
                    grpc.StatusCode.NOT_FOUND,
                    f"no request {request.request_id!r} in flight",
                )
            try:
                reply: pb.AbortResponse = await self.controller.fleet.stub(address).Abort(request)
            except grpc.aio.AioRpcError as exc:
                await abort_with(context, exc.code(), exc.details() or exc.code().name)
            return reply
        results = await self._fan_out(lambda s: s.Abort(request))
        ok = [r for _, r in results if isinstance(r, pb.AbortResponse)]
        aborted = [r for r in ok if r.status == pb.ABORT_STATUS_ABORTED]
        if target == "kv_session" and not ok:
            await abort_with(context, grpc.StatusCode.NOT_FOUND, "no engine holds that KV session")
        status = pb.ABORT_STATUS_ABORTED if aborted or not ok else pb.ABORT_STATUS_ALREADY_FINISHED
        return pb.AbortResponse(status=status, message=_outcomes(results))

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context) -> pb.LoadLoraResponse:
        results = await self._fan_out(lambda s: s.LoadLora(request))
        await self._fail_if_any(results, context)
        replies = [r for _, r in results if isinstance(r, pb.LoadLoraResponse)]
        return pb.LoadLoraResponse(
            adapter=request.adapter,
            already_loaded=bool(replies) and all(r.already_loaded for r in replies),
        )

    async def UnloadLora(
        self, request: pb.UnloadLoraRequest, context: Context
    ) -> pb.UnloadLoraResponse:
        results = await self._fan_out(lambda s: s.UnloadLora(request))
        await self._fail_if_any(results, context)
        replies = [r for _, r in results if isinstance(r, pb.UnloadLoraResponse)]
        adapter = replies[0].adapter if replies else pb.LoraAdapter(lora_name=request.lora_name)
        return pb.UnloadLoraResponse(adapter=adapter)

    async def ListLoras(
        self, request: pb.ListLorasRequest, context: Context
    ) -> pb.ListLorasResponse:
        results = await self._fan_out(lambda s: s.ListLoras(request))
        seen: dict[tuple[int, str, str], pb.LoraAdapter] = {}
        for _, reply in results:
            if isinstance(reply, pb.ListLorasResponse):
                for a in reply.adapters:
                    seen.setdefault((a.lora_id, a.lora_name, a.source_path), a)
        return pb.ListLorasResponse(adapters=sorted(seen.values(), key=lambda a: a.lora_id))

    async def _fail_if_any(self, results: list[tuple[EngineRecord, Any]], context: Context) -> None:
        if not results:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, "no engine is reachable")
        errors = [r for _, r in results if isinstance(r, grpc.aio.AioRpcError)]
        if errors:
            await abort_with(context, errors[0].code(), _outcomes(results))

    async def Drain(
        self, request: pb.DrainRequest, context: Context
    ) -> AsyncIterator[pb.DrainResponse]:
        """Drain the gateway itself: refuse new requests, report the requests it relays until
        none is left (or the deadline passes; then abort them if asked). Engines keep running;
        drain an engine with the admin API."""
        self.draining = self.draining or request.stop_accepting_new_requests
        deadline_s = (
            time.monotonic() + request.deadline_ms / 1000.0
            if request.HasField("deadline_ms")
            else None
        )
        yield pb.DrainResponse(state=pb.DRAIN_STATE_STARTED, in_flight_requests=len(self._holding))
        while self._holding:
            if deadline_s is not None and time.monotonic() >= deadline_s:
                if request.abort_after_deadline:
                    await self._fan_out(
                        lambda s: s.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
                    )
                break
            yield pb.DrainResponse(
                state=pb.DRAIN_STATE_IN_PROGRESS, in_flight_requests=len(self._holding)
            )
            await asyncio.sleep(DRAIN_PROGRESS_INTERVAL_S)
        yield pb.DrainResponse(state=pb.DRAIN_STATE_COMPLETE, in_flight_requests=len(self._holding))

    async def GetKvConnectorInfo(
        self, request: pb.GetKvConnectorInfoRequest, context: Context
    ) -> pb.KvConnectorInfo:
        await abort_with(context, grpc.StatusCode.UNIMPLEMENTED, "ask an engine, not the fleet")

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Context
    ) -> pb.GetKvEventSourcesResponse:
        await abort_with(context, grpc.StatusCode.UNIMPLEMENTED, "ask an engine, not the fleet")

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        await abort_with(context, grpc.StatusCode.UNIMPLEMENTED, "subscribe to an engine")
        yield pb.SubscribeKvEventsResponse()  # pragma: no cover - makes this a generator

    async def SubscribeRuntimeEvents(
        self, request: pb.SubscribeRuntimeEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
        await abort_with(context, grpc.StatusCode.UNIMPLEMENTED, "subscribe to an engine")
        yield pb.SubscribeRuntimeEventsResponse()  # pragma: no cover

    # ---- state ----

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> pb.LoadInfo:
        records = self.controller.fleet.registry.records()
        reply = pb.LoadInfo(instance_id=self.instance_id, timestamp_unix_nanos=time.time_ns())
        totals = {
            "running_requests": 0,
            "queued_requests": 0,
            "used_kv_blocks": 0,
            "total_kv_blocks": 0,
            "waiting_tokens": 0,
        }
        for r in records:
            load = r.load
            for name in totals:
                value = getattr(load, name)
                if value is not None:
                    totals[name] += value
            inflight = self.controller.router.inflight.of(r.address).requests
            reply.attributes[f"engine.{r.address}"] = (
                f"instance={r.engine_id} state={r.state.value} cordoned={r.cordoned} "
                f"running={_text(load.running_requests)} queued={_text(load.queued_requests)} "
                f"kv={_text(load.used_kv_blocks)}/{_text(load.total_kv_blocks)} inflight={inflight}"
            )
        reply.running_requests = totals["running_requests"]
        reply.queued_requests = totals["queued_requests"]
        reply.used_kv_blocks = totals["used_kv_blocks"]
        reply.total_kv_blocks = totals["total_kv_blocks"]
        reply.waiting_tokens = totals["waiting_tokens"]
        reply.attributes["engines"] = str(len(records))
        reply.attributes["routable_engines"] = str(sum(r.routable for r in records))
        return reply

    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        records = self.controller.fleet.registry.records()
        checks = [
            pb.HealthCheck(
                name=f"engine:{r.address}",
                state=_HEALTH_PB[r.state],
                message=("cordoned " if r.cordoned else "") + r.last_error,
            )
            for r in records
        ]
        routable = sum(r.routable for r in records)
        if routable == 0:
            state = pb.HEALTH_STATE_NOT_READY
        elif routable < len(records):
            state = pb.HEALTH_STATE_DEGRADED
        else:
            state = pb.HEALTH_STATE_READY
        return pb.HealthResponse(state=state, checks=checks)

    async def GetEngineInfo(
        self, request: pb.GetEngineInfoRequest, context: Context
    ) -> pb.EngineInfo:
        models: list[str] = []
        for r in self.controller.fleet.registry.records():
            if r.identity is not None:
                models.extend(m for m in r.identity.models if m not in models)
        return pb.EngineInfo(
            engine_name="kvplane-controller",
            engine_version=__version__,
            role=pb.ENGINE_ROLE_AGGREGATED,
            instance_id=self.instance_id,
            supported_models=models,
            schema_revision=SCHEMA_REVISION,
            minimum_client_revision=MINIMUM_CLIENT_REVISION,
            schema_release=SCHEMA_RELEASE,
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.ModelInfo:
        for r in self.controller.fleet.registry.routable(request.model or None):
            try:
                reply: pb.ModelInfo = await self.controller.fleet.stub(r.address).GetModelInfo(
                    request, timeout=self.controller.config.health.rpc_timeout_s
                )
            except grpc.aio.AioRpcError:
                continue
            return reply
        await abort_with(context, grpc.StatusCode.NOT_FOUND, f"no engine serves {request.model!r}")


def _text(value: int | None) -> str:
    return "?" if value is None else str(value)


def _outcomes(results: list[tuple[EngineRecord, Any]]) -> str:
    parts = []
    for record, result in results:
        if isinstance(result, grpc.aio.AioRpcError):
            parts.append(f"{record.address}: {result.code().name}: {result.details()}")
        else:
            parts.append(f"{record.address}: ok")
    return "; ".join(parts)
