"""The admin API (`kvplane.v1.Admin`): the fleet's engines, cordons, drains, and the router's
decision explained. A thin adapter over `Controller`; domain errors map to status codes in
one table (controller/statuses.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from controller.config import KvEventsMode
from controller.eligibility import lack_of
from controller.registry import EngineRecord, Role
from controller.relay import engine_failure, naming_engine
from controller.router import Decision, Hop
from controller.service import Controller, Plan, PromptInput, blocks_by_engine
from controller.statuses import status_of
from kvplane.config import parse_dial_target
from kvplane.errors import KvplaneError
from kvplane.server import abort_with
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb

Context = grpc.aio.ServicerContext[Any, Any]

# What the bearer token guards without `protect_reads`: the calls that change the fleet, and
# CheckAccess, which asks whether a caller may make them.
GUARDED_METHODS = frozenset(
    {"RegisterEngine", "RemoveEngine", "Cordon", "Uncordon", "DrainEngine", "CheckAccess"}
)
# Every call refuses fields outside its request's schema (kvplane.request_decoding): an option
# of a newer CLI or planner (a rolling upgrade) that this controller would drop unseen would
# change the fleet (an engine registered or drained otherwise than asked) or the answer (a
# route explained for another request).
STRICT_METHODS = frozenset(apb.DESCRIPTOR.services_by_name["Admin"].methods_by_name)


class AdminServicer(apb_grpc.AdminServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def _indexed_blocks(self) -> dict[str, int]:
        # The workers are still worth listing without the index.
        return blocks_by_engine(await self.controller.try_index_stats())

    def worker_info(self, record: EngineRecord, indexed: dict[str, int]) -> apb.WorkerInfo:
        info = apb.WorkerInfo(
            address=record.address,
            instance_id=record.engine_id,
            state=record.state.value,
            cordoned=record.cordoned,
            routable=record.routable,
            kv_events=record.kv_events,
            source=record.source,
            owner=record.owner,
            indexed_blocks=indexed.get(record.address, 0),
            inflight_requests=self.controller.router.inflight.of(record.address).requests,
            last_error=self.controller.fleet.error_of(record),
        )
        following = self.controller.fleet.event_following(record)
        info.kv_events_state = following.state.value
        info.kv_events_reason = following.reason
        if following.since_unix_s is not None:
            info.kv_events_since_unix_s = following.since_unix_s
        if following.last_event_unix_s is not None:
            info.last_kv_event_unix_s = following.last_event_unix_s
        info.role = record.role.value
        identity = record.identity
        if identity is not None:
            info.engine_name = identity.engine_name
            info.engine_version = identity.engine_version
            info.pooling_only = not identity.generates
            info.models.extend(identity.models)
            if identity.block_size is not None:
                info.block_size = identity.block_size
            if identity.total_kv_blocks is not None:
                info.total_kv_blocks = identity.total_kv_blocks
        load = record.load
        if load.running_requests is not None:
            info.running_requests = load.running_requests
        if load.queued_requests is not None:
            info.queued_requests = load.queued_requests
        if load.used_kv_blocks is not None:
            info.used_kv_blocks = load.used_kv_blocks
        return info

    async def ListWorkers(
        self, request: apb.ListWorkersRequest, context: Context
    ) -> apb.ListWorkersResponse:
        indexed = await self._indexed_blocks()
        records = self.controller.fleet.registry.records()
        return apb.ListWorkersResponse(
            workers=[self.worker_info(r, indexed) for r in records],
            policy=self.controller.router.policy.name,
            index_blocks=sum(indexed.values()),
        )

    async def CheckAccess(
        self, request: apb.CheckAccessRequest, context: Context
    ) -> apb.CheckAccessResponse:
        # Reached only past the bearer-token interceptor (GUARDED_METHODS): answering is the
        # whole answer.
        return apb.CheckAccessResponse()

    async def RegisterEngine(
        self, request: apb.RegisterEngineRequest, context: Context
    ) -> apb.WorkerInfo:
        mode = request.kv_events or KvEventsMode.grpc.value
        if mode not in {m.value for m in KvEventsMode}:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, f"kv_events {mode!r}?")
        try:
            parse_dial_target(request.address)
            record = await self.controller.membership.register(request.address, mode, request.owner)
        except ValueError as exc:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        return self.worker_info(record, {})

    async def RemoveEngine(self, request: apb.EngineRef, context: Context) -> apb.WorkerInfo:
        try:
            record = await self.controller.membership.remove(request.engine)
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        info = self.worker_info(record, {})
        info.routable = False  # (its record, as it was when it left the fleet)
        return info

    async def _cordon(self, request: apb.EngineRef, context: Context, on: bool) -> apb.WorkerInfo:
        try:
            record = await self.controller.membership.set_cordoned(request.engine, on)
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        return self.worker_info(record, await self._indexed_blocks())

    async def Cordon(self, request: apb.EngineRef, context: Context) -> apb.WorkerInfo:
        return await self._cordon(request, context, True)

    async def Uncordon(self, request: apb.EngineRef, context: Context) -> apb.WorkerInfo:
        return await self._cordon(request, context, False)

    async def DrainEngine(
        self, request: apb.DrainEngineRequest, context: Context
    ) -> AsyncIterator[pb.DrainResponse]:
        fleet = self.controller.fleet
        try:
            record = await self.controller.membership.find(request.engine)
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        # Out of routing now, not at the next health poll; the other replicas told.
        await fleet.request_drain(record.address)
        shared = await self.controller.membership.record_drain(record)

        async def withdraw() -> None:
            """The engine did not take the drain: its next health answer decides, on every
            replica."""
            fleet.registry.withdraw_drain(record.address)
            await self.controller.membership.withdraw_drain(record.address, shared)

        drain = pb.DrainRequest(
            stop_accepting_new_requests=True, abort_after_deadline=request.abort_after_deadline
        )
        if request.HasField("deadline_ms"):
            drain.deadline_ms = request.deadline_ms
        try:
            stub = fleet.stub(record.address)
        except KeyError:  # removed while the drain was recorded
            await abort_with(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"engine {request.engine!r} was removed from the fleet",
            )
        call = stub.Drain(drain)
        timeout_s = self.controller.config.health.rpc_timeout_s
        started = False
        try:
            # An engine answers STARTED at once; one that does not within a poll's timeout is
            # hung (stopped, wedged) and would hold the operator's drain forever.
            async with asyncio.timeout(timeout_s):
                event = await call.read()
            started = True
            while isinstance(event, pb.DrainResponse):  # (grpc.aio.EOF ends the stream)
                yield event
                event = await call.read()
        except TimeoutError:
            call.cancel()
            # It may still take the drain when it wakes: its next health answer decides.
            await withdraw()
            await abort_with(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"engine {record.address} did not answer the Drain within {timeout_s:g} s",
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
            # (Cancelled with this call not cancelled: the fleet closed the engine's channel,
            # it left or was unreachable too long; the drain goes on at the engine, out of
            # the controller's sight.)
            failure = engine_failure(caught, record.address, fleet)
            if not started:  # the engine did not take it
                await withdraw()
            await abort_with(
                context, failure.code(), naming_engine(failure, record.address, "Drain", fleet)
            )

    async def _plan(
        self,
        request: apb.PromptQuery,
        context: Context,
        role: Role | None = Role.AGGREGATED,
        *,
        cordoned: bool = False,
        bypass_prefix_cache: bool = False,
    ) -> Plan:
        which = request.WhichOneof("input")
        if which is None:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "give a prompt or tokens")
        query = PromptInput(
            request_id="admin-route",
            prompt=request.prompt if which == "prompt" else None,
            token_ids=tuple(request.token_ids.ids) if which == "token_ids" else None,
            model=request.model,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            session_key=request.session_key or None,
            bypass_prefix_cache=bypass_prefix_cache,
        )
        try:
            plan = await self.controller.plan(query, role, cordoned=cordoned)
        except KvplaneError as exc:  # a LoRA adapter no routable engine holds
            await abort_with(context, status_of(exc), str(exc))
        if plan.tokenized and plan.request.num_prompt_tokens == 0:
            # As an engine refuses it: no token ids, or a text that tokenizes to none (a
            # tokenizer that adds a start token makes "" one token, which engines take).
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        return plan

    async def Route(self, request: apb.PromptQuery, context: Context) -> apb.RouteExplanation:
        """The decision a request would get; in a disaggregated fleet, its first hop: the
        prefill engine, or the decode engine when it would prefill the prompt itself (it
        holds `router.skip_prefill_ratio` of it; after a prefill, the decode engine is chosen
        by load at the handoff). Refused as
        Generate is: NOT_FOUND for a model no engine serves, FAILED_PRECONDITION for one
        only pooling-only engines serve, UNAVAILABLE while none of those that serve it takes
        traffic, and RESOURCE_EXHAUSTED when every engine is busy and the gateway sheds load
        (`router.reject_when_all_busy`: what the request would get). Not refused while the
        controller drains: a drain stops new traffic, and an explanation sends nothing (it is
        what an operator asks of a draining fleet: where would this have gone). With
        `bypass_prefix_cache`, the decision of a request that reads no cached prefix."""
        disaggregated = self.controller.disaggregated(request.model)
        try:
            self.controller.check_model(request.model, generating=True)
            plan = await self._plan(
                request,
                context,
                None if disaggregated else Role.AGGREGATED,
                bypass_prefix_cache=request.bypass_prefix_cache,
            )
            if disaggregated:  # a LoRA adapter no decode engine holds: refused as Generate is
                self.controller.check_disaggregated_lora(plan)
            decision = self.controller.explain(plan, disaggregated)
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        reply = self._explanation(plan, decision)
        if disaggregated:
            # Which hop this is: a prefill engine's, or a decode engine prefilling the
            # prompt itself (it holds router.skip_prefill_ratio of it).
            on_prefill = self._role(decision.engine_id) is Role.PREFILL
            reply.hop = Hop.PREFILL if on_prefill else Hop.DECODE_PREFILL
        return reply

    def _instance(self, address: str) -> str:
        record = self.controller.fleet.registry.by_engine_id(address)
        return record.engine_id if record is not None else address

    def _role(self, address: str) -> Role:
        record = self.controller.fleet.registry.by_engine_id(address)
        return record.role if record is not None else Role.UNKNOWN

    def _explanation(self, plan: Plan, decision: Decision) -> apb.RouteExplanation:
        reply = apb.RouteExplanation(
            engine=decision.engine_id,
            instance_id=self._instance(decision.engine_id),
            reason=decision.reason.value,
            policy=decision.policy,
            predicted_cached_tokens=decision.predicted_cached_tokens,
            num_prompt_tokens=plan.request.num_prompt_tokens,
            block_size=plan.request.block_size,
            tokenized=plan.tokenized,
            index_error=plan.view.index_error or "",
            hot_prefix_sharers=decision.hot_prefix_sharers,
        )
        predicted = {c.engine_id for c in plan.view.candidates if c.predicts_cache}
        for row in decision.costs:
            cost = apb.EngineCost(
                engine=row.engine_id,
                instance_id=self._instance(row.engine_id),
                cached_tokens=row.cached_tokens,
                host_cached_tokens=row.host_cached_tokens,
                disk_cached_tokens=row.disk_cached_tokens,
                prefill_cost=row.prefill_cost,
                queue_cost=row.queue_cost,
                decode_cost=row.decode_cost,
                memory_cost=row.memory_cost,
                busy=row.busy,
                predicted=row.engine_id in predicted,
            )
            if row.total is not None:
                cost.total = row.total
            reply.costs.append(cost)
        return reply

    async def Match(self, request: apb.PromptQuery, context: Context) -> apb.MatchResponse:
        """Every engine's cached prefix, whatever its role, cordoned ones included (what an
        operator checks before uncordoning), and after them those that take traffic but not
        this prompt (naming what they lack, as routing's refusals do: "max_context_length
        128 < 301"; every one, for a prompt past all their limits, which Route refuses) and
        those out of routing for their state (draining, unreachable, ...:
        what the index holds of them), each engine the router would not choose naming why
        (`out_of_routing`), but one removed while the index answered (it left the fleet);
        NOT_FOUND for a model no engine serves and
        FAILED_PRECONDITION for one only pooling-only engines serve (which cache no
        prompt), as Route (rather than no engine holding anything of it).
        `bypass_prefix_cache` is ignored: it changes which cache a request reads, not what
        the engines hold. An engine without KV events (`kv_events: approximate`) shows the
        prefix the router predicts there (`predicted`)."""
        try:
            self.controller.check_model(request.model, generating=True)
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        plan = await self._plan(request, context, role=None, cordoned=True)
        reply = apb.MatchResponse(
            num_prompt_tokens=plan.request.num_prompt_tokens,
            block_size=plan.request.block_size,
            num_blocks=len(plan.request.block_keys),
            tokenized=plan.tokenized,
            index_error=plan.view.index_error or "",
        )
        # An engine without KV events (`kv_events: approximate`) holds what the router
        # predicts from the prompts it routed there, as it credits them in a decision.
        router = self.controller.router
        registry = self.controller.fleet.registry
        # Not an engine removed while the index answered: it left the fleet (and the router,
        # which must not be told of it again).
        listed = [
            (c, record)
            for c in (*plan.view.candidates, *plan.view.out_of_routing)
            if (record := registry.by_engine_id(c.engine_id)) is not None
        ]
        view = router.with_inflight([c for c, _ in listed], plan.request, self.controller.clock())
        for (c, record), routed in zip(listed, view, strict=True):
            hit = routed.hit if c.predicts_cache else c.hit
            reply.matches.append(
                apb.EngineMatch(
                    engine=c.engine_id,
                    instance_id=record.engine_id,
                    device_blocks=hit.device_blocks,
                    host_blocks=hit.host_blocks,
                    disk_blocks=hit.disk_blocks,
                    cached_tokens=sum(plan.request.cached_tokens(hit)),
                    predicted=c.predicts_cache,
                    role=record.role.value,
                    out_of_routing=record.availability
                    if not record.routable
                    else lack_of(
                        record,
                        plan.model or None,
                        plan.needs,
                        self.controller.eligibility.decode_engines_prefill,
                    )
                    or "",
                )
            )
        return reply
