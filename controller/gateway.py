"""The gateway: `openengine.v1.OpenEngine` served for the whole fleet.

- Generate: routed and relayed by the Relay (controller/relay.py), the path vllm.Generate
  shares, never to an engine that serves the request's model for pooling only (each
  model's own GetModelInfo, `EngineIdentity.facts_of`), nor to one whose GetModelInfo says
  it does not take the request (controller.eligibility: INVALID_ARGUMENT for one past every
  engine's limit, naming the limit and the largest): FAILED_PRECONDITION for a request
  carrying `kv.session` (the gateway is AGGREGATED), NOT_FOUND for a model no engine serves,
  INVALID_ARGUMENT for a request naming none when the engines serve different models to
  such a request (`Registry.default_model`),
  FAILED_PRECONDITION for one only pooling-only engines serve,
  ALREADY_EXISTS for the id of a request running through the gateway; the chosen engine's
  stream is relayed unchanged, the engine and the router's decision in the trailing
  metadata (`kvplane-route`, controller/route_report.py); if the engine fails before
  anything was relayed (a retryable status such as UNAVAILABLE, or a retryable terminal
  EngineError), the request is retried once on another engine (an engine refusing what it
  cannot serve, a LoRA adapter it no longer holds or a prompt maybe past its context, has
  it re-routed without spending that retry: Relay.retries_elsewhere, the rule of every
  path); a failure after that is one terminal EngineError (seed: no event may follow it).
- Embed / Classify / Score: INVALID_ARGUMENT without the request id or model the seed
  requires; else the least loaded routable engine serving the model whose GetModelInfo for
  that model says it supports the task, holding the LoRA adapter the request names (none
  holds it: the LoRA refusals of a Generate; an engine refusing it NOT_FOUND because it no
  longer holds the adapter: re-routed as a Generate is, Relay.adapter_left; an engine
  refusing it INVALID_ARGUMENT where the tokens of a text input are not known here, maybe
  for its length: re-routed to one taking a longer input, as a Generate is,
  Relay.past_refusal); none:
  FAILED_PRECONDITION (the seed's UNSUPPORTED task), NOT_FOUND for a model no engine
  serves, UNAVAILABLE while the capable engines take no traffic. An engine failing the task
  with a retryable status has it retried once on another capable engine, as a Generate
  failing before its first response, a re-route past a refusal spending no retry
  (Relay.retries_elsewhere); the failure the client gets names the engine, as a
  Generate's does (relay.pass_status), but an engine's abort (the status CANCELLED) passes
  in the engine's words. An Abort of a task its engine has not accepted yet (no reply: the
  engine answers NOT_FOUND, or does not answer) cancels the call there and ends the task as
  an engine ends an aborted one (CANCELLED), as a Generate;
  so does an Abort between two engines (its first failed it, the next not yet called).
- Abort: a request id (from either front end, or of a task) goes to the engine holding it,
  unless no engine can abort it now (being planned, or handed over by its prefill engine
  before a decode engine holds it): the relay ends it, ABORTED (and so when its prefill
  engine answers ALREADY_FINISHED for a handoff the gateway has not read yet:
  Relay.ended_at), its stream as an engine ends an aborted request (each output finished
  CANCELLED, status OK); an engine's answer that the request ended releases it from the
  router's accounting, though its client may not have read everything yet; one of the last
  requests that ended is ALREADY_FINISHED (as an engine answers), an id never seen NOT_FOUND;
  `all_requests` ends the requests no engine can abort here and fans out, as KV sessions
  do, and also to every engine holding a relayed stream, reachable or not (a stopped one is
  reported, DEADLINE_EXCEEDED); every engine refusing alike is their status, UNAVAILABLE when
  no engine could be reached; `all_requests` fails when any engine did not abort
  (UNAVAILABLE while one did not answer, else the first refusal), its outcomes reported all
  the same (seed: ABORTED and ALREADY_FINISHED say the target ended; there is no "partly").
- LoadLora / UnloadLora / ListLoras: fan out to every reachable engine that does not say
  `supports_lora: false` (the others are reported as skipped), or to the one engine the
  request metadata `kvplane-engine` names (a LoadLora: or to the engines serving the model
  `kvplane-model` names, or with both to that engine for that model; without either,
  INVALID_ARGUMENT when the LoRA-capable engines serve different base models); the call
  succeeds only if every asked engine did (UnloadLora: NOT_FOUND from an engine means it
  never had the adapter; NOT_FOUND only when none had it); FAILED_PRECONDITION when no
  engine supports LoRA. Every engine's outcome, and the adapters it holds, ride in the
  trailing metadata (EngineOutcome) and in the message of a failure. What each engine
  answered updates the registry's record of the adapters it holds, which routing of LoRA
  requests reads (an UnloadLora takes the adapter out of it before asking). One LoRA call
  at a time (`Fleet.lora_changes`), and a LoadLora's or UnloadLora's call to an engine
  after the engine's LoRA change in progress (`Fleet.lora_change_to`); LoadLora and
  UnloadLora update the fleet's LoRA intent (controller.lora_intent, also rebuilt from
  what the engines hold), and a load under a name it holds with another adapter, or for
  another base model than one it holds it for (a fleet-wide load's; a load on one engine's,
  that engine's base model unless the load named one), on the fleet or on one engine, is
  ALREADY_EXISTS before any engine is asked; one of such a name on a controller fronted as
  an engine naming no model (it would pick a model of its own) is INVALID_ARGUMENT.
- GetLoad: the fleet's sums (a figure no engine reports is absent, not 0), with per-engine
  detail in `attributes`; the KV block counts only where every engine reporting them has one
  block size (a fleet serving models of 16- and 32-token blocks: absent), the KV in tokens
  (`used_kv_tokens`, `total_kv_tokens`) and the block sizes (`kv_block_size`) in
  `attributes`, where a controller fronted as an engine whose fleet mixes block sizes
  tells its KV (its tokens count there, its block sizes too); `kvplane-fleet-view` in
  `attributes` is the version of the fleet view GetEngineInfo/GetModelInfo tell
  (`controller.fleet_view`), which a controller fronting this one follows.
- Health, GetEngineInfo: the fleet's view; Health's model, role and inference probe are
  answered as an engine answers them (the probe: every engine taking traffic runs its own).
  GetModelInfo: a routable engine serving the model answers, with the fleet's limits,
  options, block size and model name (`fleet_facts`), the pooling tasks and LoRA support
  other engines serving it have (its refusal passes, unless it is one another
  engine may not have, such as UNAVAILABLE); INVALID_ARGUMENT without a model, NOT_FOUND
  for a model no engine serves, UNAVAILABLE while no engine serving it can answer.
- "A model no engine serves" (NOT_FOUND) is said only of a fleet that has engines: one with
  none at all (a controller just restarted, before its planner registers its engines again)
  cannot tell, and every call naming a model is UNAVAILABLE, worth retrying (Health: a
  NOT_READY `model` check).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NamedTuple, NoReturn, TypeVar

import grpc
from google.protobuf.descriptor import FieldDescriptor

from controller.eligibility import (
    CONTEXT_LIMIT,
    ROUTED_OPTIONS,
    input_context,
    largest_input_context,
    takes_input,
)
from controller.fleet import KV_BLOCK_SIZE_ATTRIBUTE, KV_TOKEN_ATTRIBUTES, Fleet
from controller.fleet_view import FLEET_VIEW_KEY, fleet_facts, fleet_view
from controller.hops import FRONTS_METADATA_KEY
from controller.lora_intent import LoraSpec
from controller.metrics import Reroute
from controller.model_info import (
    CAPABILITY_FLAGS,
    SELECTION_MODES,
    field_holder,
    selection_option,
)
from controller.outcomes import (
    ENGINE_METADATA_KEY,
    MODEL_METADATA_KEY,
    lora_model_metadata,
    outcome_metadata,
)
from controller.registry import (
    CONTROLLER_ENGINE_NAME,
    POLL_FAILED_STATES,
    EmptyEngineRefError,
    EngineRecord,
    EngineState,
    LoraRoutingError,
    ModelFacts,
    ModelRequiredError,
    NoEngineRegisteredError,
    RegistryMemo,
    Role,
    UnknownEngineError,
    UnknownModelError,
)
from controller.relay import (
    RETRYABLE,
    GoneHolder,
    InBandError,
    Relay,
    Usage,
    engine_failure,
    gateway_failure,
    naming_engine,
    pass_status,
)
from controller.router import AllEnginesBusyError, LoadSnapshot, NoEngineAvailableError
from controller.service import Controller, PromptInput
from controller.statuses import status_of
from kvplane import __version__
from kvplane.enum_names import enum_name
from kvplane.error_codes import status_form
from kvplane.errors import KvplaneError
from kvplane.logprobs_asked import KINDS
from kvplane.server import abort_with
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DRAIN_PROGRESS_INTERVAL_S = 0.5
# How often a drain looks at the in-flight requests (a change is reported at once).
DRAIN_POLL_S = 0.05
# How long a drain past its deadline waits for the requests it aborted to end.
DRAIN_ABORT_GRACE_S = 5.0
# How long an engine may take to answer a Health with an inference probe: a little longer than
# the bundled engine gives its own probe (30 s), so that its verdict comes back.
INFERENCE_PROBE_TIMEOUT_S = 35.0
# The role the gateway serves (GetEngineInfo): it accepts normal generation requests.
GATEWAY_ROLE = pb.ENGINE_ROLE_AGGREGATED
SCHEMA_REVISION = 1
MINIMUM_CLIENT_REVISION = 1
SCHEMA_RELEASE = "openengine-v1-r1+seed.94b72b7dabd1ee94"
# Trailing metadata key of the per-engine outcomes of a fanned-out call (one JSON object per
# engine: engine, instance_id, outcome, detail, adapters).

# Events that carry output: the prefill is over.
_OUTPUT_EVENTS = frozenset({"token", "finished", "prefill_ready"})
_HEALTH_PB = {
    EngineState.UNKNOWN: pb.HEALTH_STATE_NOT_READY,
    EngineState.STARTING: pb.HEALTH_STATE_STARTING,
    EngineState.READY: pb.HEALTH_STATE_READY,
    EngineState.DEGRADED: pb.HEALTH_STATE_DEGRADED,
    EngineState.DRAINING: pb.HEALTH_STATE_DRAINING,
    EngineState.NOT_READY: pb.HEALTH_STATE_NOT_READY,
    EngineState.UNREACHABLE: pb.HEALTH_STATE_NOT_READY,
    EngineState.FAILING: pb.HEALTH_STATE_NOT_READY,
    EngineState.INCOMPATIBLE: pb.HEALTH_STATE_NOT_READY,
    EngineState.EJECTED: pb.HEALTH_STATE_NOT_READY,  # takes no traffic for now
    EngineState.HELD_DOWN: pb.HEALTH_STATE_NOT_READY,  # flapped: takes no traffic for now
}

# The LoadInfo figures GetLoad sums over the fleet (the registry keeps these of each engine).
_SUMMED_LOAD = (
    "running_requests",
    "queued_requests",
    "active_kv_sessions",
    "used_kv_blocks",
    "total_kv_blocks",
    "running_tokens",
    "waiting_tokens",
)
# The figures of them counted in KV blocks: summed only over engines of one block size.
_KV_BLOCK_FIELDS = tuple(KV_TOKEN_ATTRIBUTES)
# The largest value each of them holds on the wire (uint32 or uint64): a sum past it (an
# engine reporting nonsense, 2^64 - 1 blocks in use) is sent as that, not as a failed GetLoad.
_UINT64_MAX = (1 << 64) - 1
_LOAD_FIELD_MAX = {
    name: (1 << 32) - 1 if field.type == FieldDescriptor.TYPE_UINT32 else _UINT64_MAX
    for name, field in pb.LoadInfo.DESCRIPTOR.fields_by_name.items()
    if name in _SUMMED_LOAD
}

# Statuses of an engine call that did not reach the engine, or got no answer in time.
_UNREACHED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# How an engine's Abort fails for a request whose call it has not answered yet, which the
# gateway then ends itself (`Relay.abort_unaccepted`): the engine does not know the request
# (the call is on its way), or does not answer (stopped, wedged, gone; the call's cancel
# frees the request there if it ever runs, as a client leaving does). Without this a request
# at the handoff to a stopped decode engine ran on (its KV session pinned on the prefill
# engine) until `abandon_streams_after_s` or the client's deadline, its Abort UNAVAILABLE.
_UNACCEPTED = frozenset({grpc.StatusCode.NOT_FOUND}) | _UNREACHED

# An engine's Abort answers that say the target ended there (seed: there is no "partly").
_ENDED = frozenset({pb.ABORT_STATUS_ABORTED, pb.ABORT_STATUS_ALREADY_FINISHED})
# How many times an Abort by id follows a request that moves on while its engine answers (a
# retry, a run again and a decode hop each move it once).
_ABORT_ROUNDS = 4
# How an operator has engines take LoRA adapters, told with a LoRA call no engine could take.
_LORA_HOW = (
    "to use adapters, start engines with LoRA on (the bundled engine's lora.enabled: true, "
    "vLLM's --enable-lora)"
)

# In-band codes that name the request's KV session (a status cannot say whose NOT_FOUND it is).
_SESSION_ERRORS = frozenset({pb.ERROR_CODE_KV_SESSION_NOT_FOUND, pb.ERROR_CODE_KV_TRANSFER_FAILED})

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]


class _OpenEngineGenerate:
    """OpenEngine Generate as the relay sees it: an accepted request that fails says so with
    one terminal EngineError (an in-band error), and a failure after output ends the stream
    with an EngineError of the gateway's own."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def call(
        self, engine: str, request: pb.GenerateRequest
    ) -> grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
        return self._fleet.stub(engine).Generate(request)

    def error(self, response: pb.GenerateResponse) -> InBandError | None:
        if response.WhichOneof("event") != "error":
            return None
        error = response.error
        return InBandError(
            error.message or enum_name(pb.ErrorCode.DESCRIPTOR, error.code),
            error.retryable,
            engine_fault=error.code == pb.ERROR_CODE_INTERNAL,
            not_found=error.code == pb.ERROR_CODE_MODEL_NOT_FOUND,
            overloaded=error.code == pb.ERROR_CODE_OVERLOADED,
            status=status_form(error.code, error.retryable),
            about_session=error.code in _SESSION_ERRORS,
        )

    def has_output(self, response: pb.GenerateResponse) -> bool:
        return response.WhichOneof("event") in _OUTPUT_EVENTS

    def usage(self, response: pb.GenerateResponse) -> Usage | None:
        if not response.HasField("usage"):
            return None
        usage = response.usage
        cached = usage.cached_prompt_tokens if usage.HasField("cached_prompt_tokens") else None
        return Usage(usage.prompt_tokens, cached)

    def num_outputs(self, request: pb.GenerateRequest) -> int:
        sampling = request.sampling
        return sampling.num_sequences if sampling.HasField("num_sequences") else 1

    def outputs_ended(self, request: pb.GenerateRequest, response: pb.GenerateResponse) -> int:
        event = response.WhichOneof("event")
        if event == "prefill_ready":  # request-scoped: it ends a prefill-only request
            return self.num_outputs(request)
        return 1 if event == "finished" else 0

    def error_response(
        self, request: pb.GenerateRequest, message: str, retryable: bool
    ) -> pb.GenerateResponse:
        """A terminal EngineError of the gateway's own."""
        return pb.GenerateResponse(
            request_id=request.request_id,
            error=pb.EngineError(code=pb.ERROR_CODE_INTERNAL, message=message, retryable=retryable),
        )

    def aborted(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        """As an engine ends a request aborted before its prefill (status OK): each output
        finished CANCELLED, the last with the Usage of its prompt when sent as token ids (no
        completion token, nothing read from the cache). A text prompt's tokens are the
        engine's to count, so Usage is left out then."""
        usage = None
        if request.WhichOneof("input") == "token_ids":
            num_prompt_tokens = len(request.token_ids.ids)
            usage = pb.Usage(
                prompt_tokens=num_prompt_tokens,
                total_tokens=num_prompt_tokens,
                cached_prompt_tokens=0,
            )
        return self._cancelled(request, usage)

    # The handoff of a disaggregated fleet (seed: "Disaggregated serving and KV API").

    def session(self, response: pb.GenerateResponse) -> pb.KvSessionRef | None:
        if response.WhichOneof("event") != "prefill_ready":
            return None
        return response.prefill_ready.kv_session

    def prompt_tokens(self, response: pb.GenerateResponse) -> int | None:
        return response.usage.prompt_tokens if response.HasField("usage") else None

    def with_session(
        self, request: pb.GenerateRequest, session: pb.KvSessionRef
    ) -> pb.GenerateRequest:
        # The prefill hop computed the prompt and relayed its logprobs: asked again, a decode
        # engine would recompute the prompt, or send them twice.
        decode = self.without_prompt_output(request)
        decode.kv.session.CopyFrom(session)
        return decode

    def without_prompt_output(self, request: pb.GenerateRequest) -> pb.GenerateRequest:
        again = pb.GenerateRequest()
        again.CopyFrom(request)
        again.response.ClearField("return_prompt_logprobs")
        again.response.ClearField("prompt_candidates")
        return again

    async def holder_gone(self, engine: str, instance_id: str | None) -> GoneHolder | None:
        """Whether the engine no longer holds the KV sessions it handed over, asked with
        GetEngineInfo within `health.rpc_timeout_s`: it does not answer (its process dead or
        stopped), or left the fleet; or it answers as another process than `instance_id`
        (the one that handed the session over; None: not known), restarted at its address.
        None: the same instance answers, whatever else it says, and so its sessions are there
        as far as this can tell: a process restarted under an `instance_id` set in its config
        answers as the old one (nothing else in the seed's answers tells a new process), and
        is found out by the session's release (NOT_FOUND: `Relay._judge`)."""
        try:
            info = await self._fleet.stub(engine).GetEngineInfo(
                pb.GetEngineInfoRequest(), timeout=self._fleet.config.health.rpc_timeout_s
            )
        except KeyError:  # removed from the fleet, its sessions with it
            return GoneHolder("left the fleet")
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
            if engine_failure(caught, engine, self._fleet).code() in _UNREACHED:
                return GoneHolder("does not answer")
            return None
        # As the registry names an engine (`EngineIdentity.instance_id`).
        now = info.instance_id or engine
        if instance_id is not None and now != instance_id:
            return GoneHolder(f"restarted (instance {instance_id}, now {now})", restarted=True)
        return None

    async def holder_draining(self, engine: str) -> bool:
        """Whether the engine answers Health DRAINING. One that cannot say now (gone since,
        or out of the fleet) is not draining: its session did not end by a drain asked of a
        live engine, and the request's run again will find it gone."""
        try:
            reply = await self._fleet.stub(engine).Health(
                pb.HealthRequest(), timeout=self._fleet.config.health.rpc_timeout_s
            )
        except (KeyError, grpc.aio.AioRpcError):
            return False
        return reply.state == pb.HEALTH_STATE_DRAINING

    def finished(self, response: pb.GenerateResponse) -> bool:
        return response.WhichOneof("event") == "finished"

    def cancelled(
        self, request: pb.GenerateRequest, handover: pb.GenerateResponse
    ) -> list[pb.GenerateResponse]:
        return self._cancelled(request, handover.usage if handover.HasField("usage") else None)

    def _cancelled(
        self, request: pb.GenerateRequest, usage: pb.Usage | None
    ) -> list[pb.GenerateResponse]:
        """The events that end an aborted request on an engine: each output finished
        CANCELLED ("aborted"), the last carrying `usage` (seed: Usage rides on the final
        response)."""
        events = [
            pb.GenerateResponse(
                request_id=request.request_id,
                finished=pb.GenerationFinished(
                    output_index=index, reason=pb.FINISH_REASON_CANCELLED, message="aborted"
                ),
            )
            for index in range(self.num_outputs(request))
        ]
        if usage is not None:
            events[-1].usage.CopyFrom(usage)
        return events

    async def release(self, engine: str, session: pb.KvSessionRef) -> bool:
        # Within `health.rpc_timeout_s`, as the other calls that read nothing: a holder that
        # does not answer must not hold up the request (its release goes unanswered).
        reply = await self._fleet.stub(engine).Abort(
            pb.AbortRequest(kv_session=session), timeout=self._fleet.config.health.rpc_timeout_s
        )
        return reply.status == pb.ABORT_STATUS_ALREADY_FINISHED


class EngineOutcome(NamedTuple):
    """What one engine answered to a fanned-out call (Abort, LoRA), as the gateway reports
    it: in the message text and, one JSON object per engine, in the trailing metadata under
    controller.outcomes (the seed's replies have no per-engine field)."""

    record: EngineRecord
    # "ok", "skipped" (not asked), "not_loaded" (UnloadLora: NOT_FOUND there), or the
    # engine's gRPC status name.
    outcome: str
    detail: str = ""
    # LoRA: the adapters the engine holds (ListLoras) or loaded (LoadLora).
    adapters: tuple[str, ...] | None = None

    @classmethod
    def of(cls, record: EngineRecord, result: object, fleet: Fleet) -> EngineOutcome:
        """An engine's answer; a failure's detail as `Fleet.engine_failure_details` words it
        (naming the controller's setting it most likely comes from)."""
        if isinstance(result, grpc.aio.AioRpcError):
            code = result.code()
            return cls(
                record, code.name, fleet.engine_failure_details(code, result.details() or "")
            )
        return cls(record, "ok")

    def text(self) -> str:
        out = f"{self.record.address}: {self.outcome}"
        if self.detail:
            out += f" ({self.detail})"
        if self.adapters is not None:
            out += f" [{', '.join(self.adapters)}]"
        return out

    def entry(self) -> dict[str, Any]:
        """The engine's entry in the trailing metadata (controller.outcomes)."""
        entry: dict[str, Any] = {
            "engine": self.record.address,
            "instance_id": self.record.engine_id,
            "outcome": self.outcome,
        }
        if self.detail:
            entry["detail"] = self.detail
        if self.adapters is not None:
            entry["adapters"] = list(self.adapters)
        return entry


def fleet_health_state(
    controller: Controller, records: list[EngineRecord], *, generating: bool = False
) -> pb.HealthState.ValueType:
    """The state of the fleet `records` are of, as the gateway's Health answers it: DRAINING
    from the moment the controller stops accepting new requests (a drain, a shutdown),
    whatever its engines' state; else, while no engine is routable, STARTING while one is
    still being read (not reached yet, or its identity being read) or says it is starting,
    NOT_READY otherwise (none registered, or none that takes traffic); READY when every one
    is, DEGRADED when some are. With `generating`, of the engines a Generate needs only, as
    routing takes them (`Registry.routable(generating=True)`, `Controller.disaggregated`): an
    aggregated engine, or a decode engine (which prefills by itself when no prefill engine is
    up). A pooling-only engine, none of whose models generates, is left out (one whose models
    are not known yet may generate), and so is a prefill engine: prefill engines alone serve
    no Generate. The vLLM front end's `grpc.health.v1` status follows that
    (`VllmGatewayServicer.report_health`), Health itself the whole fleet (it serves Embed,
    Classify and Score too)."""
    if controller.draining:
        return pb.HEALTH_STATE_DRAINING
    if generating:
        records = [
            r
            for r in records
            if r.identity is None or (r.identity.generates and r.identity.role is not Role.PREFILL)
        ]
    routable = sum(r.routable for r in records)
    if routable == 0:
        # As an engine loading its model: none can serve yet, but one may soon.
        if any(r.state in _STARTING_STATES for r in records):
            return pb.HEALTH_STATE_STARTING
        return pb.HEALTH_STATE_NOT_READY
    if routable < len(records):
        return pb.HEALTH_STATE_DEGRADED
    return pb.HEALTH_STATE_READY


class GatewayServicer(pb_grpc.OpenEngineServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.instance_id = controller.instance_id
        # Shared with the vllm.Generate front end (app.py): one set of in-flight requests.
        self.relay = Relay(controller)
        self._generate = _OpenEngineGenerate(controller.fleet)
        # Whether a pooling task's inputs are read to route it, by (model, task)
        # (`_reads_inputs`): asked by every pooling request.
        self._reads_inputs_memo = RegistryMemo(controller.fleet.registry, self._scan_reads_inputs)

    # ---- generation ----

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.perf_counter()
        if not request.request_id:
            self.controller.metrics.count_request("invalid", time.perf_counter() - started)
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request.kv.HasField("session"):
            # Seed: a role mismatch is refused before acceptance. The gateway is AGGREGATED
            # (GetEngineInfo); the handoff to a decode engine is its own, never a client's.
            self.controller.metrics.count_request("invalid", time.perf_counter() - started)
            await abort_with(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "kv.session is for a DECODE engine; the gateway is AGGREGATED (it hands "
                "requests over to decode engines itself)",
            )
        which = request.WhichOneof("input")
        key = self.controller.config.router.session_metadata_key
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
            bypass_prefix_cache=request.kv.bypass_prefix_cache,
            generate_request=request,
        )
        stream = self.relay.generate(
            self._generate, request, query, context, handoff=self._generate
        )
        async for response in stream:
            yield response

    # ---- non-generative tasks ----

    async def _task(
        self,
        task: str,
        task_context: pb.TaskRequestContext,
        call: Callable[[pb_grpc.OpenEngineAsyncStub], grpc.aio.UnaryUnaryCall[Any, T]],
        context: Context,
        inputs: Iterable[pb.TaskInput],
    ) -> T:
        """`inputs`: the request's: the longest for each routed engine's context to take
        (`controller.eligibility.takes_input`), a text one for an engine that takes text
        (`_capable`)."""
        if not task_context.request_id or not task_context.model:
            # The seed requires both, whatever the task's support: refused as an engine does.
            await abort_with(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "context.request_id and context.model are required",
            )
        if self.controller.draining:  # as a draining engine refuses a pooling task
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, "the controller is draining")
        inputs = tuple(inputs)
        longest, unmeasured = await self._longest_input(task, task_context.model, inputs)
        text = any(item.WhichOneof("input") == "text" for item in inputs)
        engine = (await self._task_engine(task, task_context, context, longest, text)).address
        relay, fleet = self.relay, self.controller.fleet
        request_id = task_context.request_id
        if not relay.admit(request_id):
            await abort_with(
                context, grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is running"
            )
        tried: set[str] = set()
        # Its one retry, once spent (a re-route past a refusal spends none): the engine that
        # failed it and how. With no engine left after a re-route, the client's answer.
        failed: tuple[str, grpc.aio.AioRpcError] | None = None
        try:
            # A task is one unary call without side effects, nothing relayed before its reply:
            # moved on as a Generate failing before its first response is, by the same rule
            # (Relay.retries_elsewhere): re-routed past a refusal of a LoRA adapter its engine
            # no longer holds (Relay.adapter_left) or, its length not known here, maybe of its
            # length (Relay.past_refusal), and retried once after an engine failure.
            while True:
                tried.add(engine)
                relay.holding[request_id] = engine
                try:
                    reply = await relay.unary(request_id, call(fleet.stub(engine)))
                except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
                    failure = engine_failure(caught, engine, fleet)
                    if request_id in relay.aborted_unrouted:  # its call cancelled for it
                        await _end_aborted_task(request_id, context)
                    # Between two engines from now on: an Abort is the gateway's to carry out
                    # (Relay.abort_unrouted), as a Generate's between its attempts.
                    relay.let_go(request_id, engine)
                    await relay.report_failure(engine, failure)
                    adapter_left = failure.code() == grpc.StatusCode.NOT_FOUND and (
                        await relay.adapter_left(request_id, task_context.lora_name, engine)
                    )
                    if request_id in relay.aborted_unrouted:  # aborted meanwhile
                        await _end_aborted_task(request_id, context)
                    described = f"{failure.code().name}: {failure.details()}"
                    # An input's length unknown here, maybe past this engine's context: to
                    # an engine taking a longer input, where there is one.
                    try:
                        past = relay.past_refusal(
                            request_id,
                            engine,
                            failure,
                            described,
                            unmeasured=unmeasured,
                            longer=functools.partial(
                                self._past_refusal, task, task_context, engine, text
                            ),
                        )
                    except NoEngineAvailableError as exc:
                        await abort_with(context, grpc.StatusCode.UNAVAILABLE, str(exc))
                    reroute: Reroute | None = None
                    if past is not None:  # its input that long at least, from now on
                        longest, reroute = past, "context"
                    elif adapter_left:
                        reroute = "lora_adapter"
                    elif relay.retries_elsewhere(
                        request_id,
                        engine,
                        described,
                        retryable=failure.code() in RETRYABLE,
                        retried=failed is not None,
                    ):
                        failed = engine, failure
                    else:
                        break
                    # Never shed (the request was admitted); with no other capable engine,
                    # the client gets the failure of the engine that failed it (which could
                    # serve it), else this engine's refusal, or the fleet's LoRA status when
                    # its adapter left, as a Generate does.
                    other = min(self._capable(task, task_context, longest, text, tried),
                                key=_queue_depth, default=None)  # fmt: skip
                    if other is None:
                        if failed is not None:
                            engine, failure = failed
                        elif adapter_left:
                            await self._refuse_lora(task, task_context, context)
                        break
                    self.controller.metrics.count_move(reroute)
                    engine = other.address
                    continue
                if request_id in relay.aborted_unrouted:  # the reply came as it was aborted
                    await _end_aborted_task(request_id, context)
                await relay.report(engine, None)
                return reply
            # As a Generate's failure passes: naming the engine, unless it refused the request
            # (or aborted it: the engine's words).
            await pass_status(context, failure, engine, self.controller.fleet)
        finally:
            relay.holding.pop(request_id, None)
            # Its engine ran it: Abort of its id is ALREADY_FINISHED now, as the engine
            # answers (seed: task ids share generation's namespace and abort semantics).
            relay.finished.add(request_id)
            relay.release(request_id)

    def _capable(
        self,
        task: str,
        task_context: pb.TaskRequestContext,
        longest: int | None,
        text: bool,
        tried: set[str] | None = None,
    ) -> list[EngineRecord]:
        """The routable engines serving the request's model that have `task`, hold its LoRA
        adapter and take its longest input, of `longest` tokens (None: not known), but those
        in `tried`; with `text` (a text input), those that take text (GetModelInfo's
        `supports_text_input`: an engine with no tokenizer refuses it) where any does, tried
        or not (where none does, whichever takes it refuses it, in its own words; a retry does
        not go to one with no tokenizer)."""
        model = task_context.model
        registry = self.controller.fleet.registry
        routable = registry.routable(model, lora_name=task_context.lora_name)
        capable = [
            r
            for r in routable
            if _has_task(r, model, task)
            and r.identity is not None
            and takes_input(r.identity.facts_of(model), longest)
        ]
        if text and any(_takes_text(r, model) for r in capable):
            capable = [r for r in capable if _takes_text(r, model)]
        return [r for r in capable if r.address not in (tried or ())]

    async def _longest_input(
        self, task: str, model: str, inputs: Iterable[pb.TaskInput]
    ) -> tuple[int | None, bool]:
        """The tokens of the longest of `inputs` where routing needs them (the engines with
        `task` take inputs of different lengths: `input_context`) and knows them: token ids,
        or text the controller tokenises (`Controller.tokenize_all`: all of it in one call,
        off the event loop when long together; text it does not, with no tokenizer or past
        `tokenize_max_chars` together, is left out: the longest known is one an engine must
        take). None: not needed or not known. And whether a text input was left out so
        (unmeasured: an engine's refusal may be of its length, `_past_refusal`)."""
        if not self._reads_inputs(model, task):
            return None, False  # every engine takes what any takes: it refuses the rest itself
        c = self.controller
        longest, texts = 0, []
        for item in inputs:
            which = item.WhichOneof("input")
            if which == "token_ids":
                longest = max(longest, len(item.token_ids.ids))
            elif which == "text":
                texts.append(item.text)
        # One call for all: a batch of short texts is tokenised off the event loop too.
        tokenized = await c.tokenize_all(texts, c.tokenizer_name(model)) if texts else None
        longest = max([longest, *(len(tokens) for tokens in tokenized or ())])
        return longest or None, bool(texts) and tokenized is None

    def _reads_inputs(self, model: str, task: str) -> bool:
        """Whether the engines serving `model` with `task` (routable or not) take inputs of
        different lengths (`input_context`), so that routing reads a request's. Kept until
        the registry changes: with engines alike, a request costs no scan of them."""
        return self._reads_inputs_memo.get((model, task))

    def _scan_reads_inputs(self, key: tuple[str, str]) -> bool:
        """`_reads_inputs` of (model, task), from every engine."""
        model, task = key
        serving = self.controller.fleet.registry.may_serve_records(model)
        return len({input_context(f) for f in _tasked_facts(serving, model, task)}) > 1

    def _past_refusal(
        self,
        task: str,
        task_context: pb.TaskRequestContext,
        refused_by: str,
        text: bool,
    ) -> int | None:
        """After `refused_by` refused a pooling task INVALID_ARGUMENT, the tokens of a text
        input not known here (`Relay.past_refusal`): the input length it must be routed as,
        one token past that engine's (`Eligibility.past_input_refusal`), where an engine with
        the task takes it; None where none does. NoEngineAvailableError when only engines
        taking no traffic do, naming each engine's state (`_states`); not when the routable
        ones that do were tried (one failed the task: its failure is the answer), as for a
        Generate (`Controller.past_refusal`)."""
        model = task_context.model
        serving = self.controller.fleet.registry.may_serve_records(model)
        past = self.controller.eligibility.past_input_refusal(
            model, refused_by, _tasked_facts(serving, model, task)
        )
        if past is None:
            return None
        if not self._capable(task, task_context, past, text):
            raise NoEngineAvailableError(self._states(task, task_context, past))
        return past

    def _states(self, task: str, task_context: pb.TaskRequestContext, longest: int | None) -> str:
        """Why no engine with `task` takes the request now, its longest input of `longest`
        tokens: each engine serving its model and its state, or what it lacks."""
        model, lora_name = task_context.model, task_context.lora_name

        def state_of(r: EngineRecord) -> str:
            # (An engine not reached yet may have the task: its state, as for a Generate.)
            if r.identity is None:
                return r.availability
            if not _has_task(r, model, task):
                return f"no {task}"
            if not takes_input(facts := r.identity.facts_of(model), longest):
                return f"{CONTEXT_LIMIT} {input_context(facts)} < {longest}"
            if lora_name and not r.holds_lora(lora_name):
                return f"without LoRA adapter {lora_name!r}"
            return r.availability

        registry = self.controller.fleet.registry
        return f"no {task} engine takes traffic now: {registry.engine_states(model, state_of)}"

    async def _task_engine(
        self,
        task: str,
        task_context: pb.TaskRequestContext,
        context: Context,
        longest: int | None,
        text: bool,
    ) -> EngineRecord:
        """The least loaded routable engine serving the request's model whose GetModelInfo
        says it supports `task`, and that holds the LoRA adapter the request names (seed:
        `lora_name` selects a loaded adapter). None: the LoRA refusals a Generate gets
        (UNAVAILABLE, FAILED_PRECONDITION, NOT_FOUND; registry.check_lora) among the
        engines with the task; UNAVAILABLE while a capable engine exists but takes no
        traffic, FAILED_PRECONDITION when engines serve the model but none has the task
        (seed: UNSUPPORTED task), NOT_FOUND when no engine serves the model;
        INVALID_ARGUMENT when its longest input, of `longest` tokens, is past every engine's
        with the task (`largest_input_context`; as an engine refuses it); with
        `router.reject_when_all_busy`, RESOURCE_EXHAUSTED when every capable one is busy,
        as for a generation."""
        c = self.controller
        model = task_context.model
        capable = self._capable(task, task_context, longest, text)
        if not capable and task_context.lora_name:
            # (Loaded through another controller replica since this one listed the engines'
            # adapters, perhaps: `Fleet.relist_loras`.)
            await c.fleet.relist_loras()
            capable = self._capable(task, task_context, longest, text)
        if capable:
            if c.sheds_load:
                try:
                    c.router.refuse_if_all_busy([c.fleet.candidate(r) for r in capable])
                except AllEnginesBusyError as exc:
                    await abort_with(context, status_of(exc), str(exc))
            return min(capable, key=_queue_depth)
        serving = self.controller.fleet.registry.may_serve_records(model)
        tasked = _tasked_facts(serving, model, task)
        largest = largest_input_context(tasked)
        if longest is not None and largest is not None and longest > largest:
            await abort_with(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request's longest input has {longest} tokens; the largest "
                f"{CONTEXT_LIMIT} any engine serving model {model!r} with {task} takes is "
                f"{largest}",
            )
        await self._refuse_lora(task, task_context, context)
        if tasked:
            await abort_with(
                context, grpc.StatusCode.UNAVAILABLE, self._states(task, task_context, longest)
            )
        if serving:
            await abort_with(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no engine serving {model} supports {task}",
            )
        await _require_model(self.controller, model, context)
        await abort_with(
            context,
            grpc.StatusCode.UNAVAILABLE,
            f"no engine serving {model} is known yet",
        )

    async def _refuse_lora(
        self, task: str, task_context: pb.TaskRequestContext, context: Context
    ) -> None:
        """End the call with the LoRA status a Generate gets when no routable engine with
        `task` holds the adapter the request names (registry.check_lora); return when the
        request names none, or such an engine exists."""
        if not task_context.lora_name:
            return
        try:
            self.controller.fleet.registry.check_lora(
                task_context.lora_name, task_context.model, task=task
            )
        except LoraRoutingError as exc:
            await abort_with(context, status_of(exc), str(exc))

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        return await self._task(
            "embed", request.context, lambda s: s.Embed(request), context, request.inputs
        )

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        return await self._task(
            "classify", request.context, lambda s: s.Classify(request), context, request.inputs
        )

    async def Score(self, request: pb.ScoreRequest, context: Context) -> pb.ScoreResponse:
        inputs = [i for g in request.groups for i in (g.query, *g.candidates)]
        return await self._task(
            "score", request.context, lambda s: s.Score(request), context, inputs
        )

    # ---- lifecycle ----

    def _reachable(self, *, failing: bool = False) -> list[EngineRecord]:
        """The engines a fan-out goes to: known, compatible, and whose polls succeed (a FAILING
        one, answering its polls with errors, is left out as an UNREACHABLE one is, unless
        `failing`: it answers, and an Abort of every request must reach the streams it may
        still run)."""
        left_out = {EngineState.UNREACHABLE} if failing else POLL_FAILED_STATES
        return [
            r
            for r in self.controller.fleet.registry.records()
            if r.identity is not None
            and r.state not in left_out
            and r.state is not EngineState.INCOMPATIBLE
        ]

    async def _fan_out(
        self,
        records: list[EngineRecord],
        call: Callable[[pb_grpc.OpenEngineAsyncStub, float], Awaitable[T]],
        timeout_s: float,
        *,
        lora_changes: bool = False,
    ) -> list[tuple[EngineRecord, T | grpc.aio.AioRpcError]]:
        """`call(stub, timeout_s)` on every engine of `records` at once. `lora_changes`: each
        call is a LoRA change, sent once the engine's LoRA change in progress ended; the
        wait and the call share `timeout_s` (`Fleet.lora_change_to`), the call getting what
        the wait left."""
        fleet = self.controller.fleet

        async def one(record: EngineRecord) -> T | grpc.aio.AioRpcError:
            try:
                if not lora_changes:
                    return await call(fleet.stub(record.address), timeout_s)
                async with fleet.lora_change_to(record.address, timeout_s) as left_s:
                    return await call(fleet.stub(record.address), left_s)
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
                return engine_failure(caught, record.address, self.controller.fleet)

        results = await asyncio.gather(*(one(r) for r in records))
        return list(zip(records, results, strict=True))

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        target = request.WhichOneof("target")
        if target is None:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "set one abort target")
        if target == "request_id":
            if not request.request_id:
                await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
            # The request may move on while its engine answers (its call failed before any
            # output and it is retried elsewhere, its prefill handed it over and its decode
            # engine took it): that engine's NOT_FOUND, UNAVAILABLE or ALREADY_FINISHED is then
            # of an attempt that ended, so the Abort goes round again, to where it went.
            admission = self.relay.admission(request.request_id)
            rounds_left = _ABORT_ROUNDS
            while (
                reply := await self._abort_request(
                    request, context, admission, again=rounds_left > 1
                )
            ) is None:
                rounds_left -= 1
            return reply
        if target == "kv_session" and not request.kv_session.session_id:
            # Malformed whoever holds sessions (an empty fleet too): as an engine refuses it.
            await abort_with(
                context, grpc.StatusCode.INVALID_ARGUMENT, "kv_session.session_id is empty"
            )
        # Every request also means those still being planned here, which no engine holds yet:
        # they end before any engine is called, as one aborted by id does.
        unrouted = self.relay.abort_all_unrouted() if target == "all_requests" else 0
        # An engine whose polls go unanswered (stopped, wedged) is out of the fan-out, yet
        # the streams relayed to it run on once it is back (until `abandon_streams_after_s`,
        # if ever): it is asked too, so that its silence is reported among the outcomes
        # (DEADLINE_EXCEEDED) instead of passing for nothing left to abort there.
        holders = set(self.relay.holding.values()) if target == "all_requests" else set()
        records = self._reachable(failing=True)
        unasked_holders = holders - {r.address for r in records}
        records += [
            r for r in self.controller.fleet.registry.records() if r.address in unasked_holders
        ]
        # Each engine bounded as above: a hung one is reported (DEADLINE_EXCEEDED) among the
        # outcomes instead of holding the whole fan-out.
        results = await self._fan_out(
            records,
            lambda s, timeout_s: s.Abort(request, timeout=timeout_s),
            self.controller.config.health.rpc_timeout_s,
        )
        outcomes = [
            EngineOutcome.of(record, result, self.controller.fleet) for record, result in results
        ]
        context.set_trailing_metadata(outcome_metadata([o.entry() for o in outcomes]))
        summary = _summary(outcomes)
        # The requests an engine that did not answer has not answered either (at the handoff
        # to a stopped decode engine, say) end here, as an Abort of their id ends them.
        silent = {
            record.address
            for record, result in results
            if isinstance(result, grpc.aio.AioRpcError) and result.code() in _UNREACHED
        }
        unaccepted = self.relay.abort_all_unaccepted(silent) if target == "all_requests" else 0
        if target == "all_requests":
            self.relay.all_ended_at(
                {
                    record.address
                    for record, result in results
                    if isinstance(result, pb.AbortResponse) and result.status in _ENDED
                }
            )
        answered = [r for _, r in results if isinstance(r, pb.AbortResponse)]
        if not answered:
            # Every engine refusing alike is the answer (NOT_FOUND: no engine holds that KV
            # session; UNAUTHENTICATED: the controller lacks the engines' token;
            # UNIMPLEMENTED: no engine supports abort); else none could be asked.
            codes = {r.code() for _, r in results if isinstance(r, grpc.aio.AioRpcError)}
            if len(codes) == 1 and (code := codes.pop()) not in _UNREACHED:
                await abort_with(context, code, summary)
            # None asked: the fleet's engines are all out of reach (each with its state), or
            # there are none.
            registry = self.controller.fleet.registry
            fleet = registry.engine_states("") if registry.records() else "the fleet has no engine"
            await abort_with(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"no engine could be reached: {summary or fleet}",
            )
        aborted = unrouted + unaccepted > 0 or any(
            r.status == pb.ABORT_STATUS_ABORTED for r in answered
        )
        status = pb.ABORT_STATUS_ABORTED if aborted else pb.ABORT_STATUS_ALREADY_FINISHED
        if unrouted:
            summary += f"; gateway: {unrouted} aborted before they were routed"
        if unaccepted:
            summary += f"; gateway: {unaccepted} aborted before their engine accepted them"
        failed = [
            (record, result)
            for record, result in results
            if isinstance(result, grpc.aio.AioRpcError)
        ]
        if target == "all_requests" and failed:
            # Seed: Abort answers ABORTED or ALREADY_FINISHED, both meaning the target was
            # ended, and a failure as a status; there is no "partly". An engine that did not
            # abort (stopped, wedged, refusing) may still run requests, so every request was
            # not aborted: the call fails, its outcomes still reported (trailing metadata,
            # message). Safe to repeat: an engine answers an Abort of what it already ended
            # ALREADY_FINISHED. A KV session is held by one engine: the others' NOT_FOUND is
            # no failure of its Abort.
            # UNAVAILABLE while an engine did not answer (again once it is back), as an
            # Abort of a request id that engine holds; else the first refusal, as a LoRA
            # fan-out fails.
            first_code = failed[0][1].code()
            unreached = any(result.code() in _UNREACHED for _, result in failed)
            names = ", ".join(record.address for record, _ in failed)
            await abort_with(
                context,
                grpc.StatusCode.UNAVAILABLE if unreached else first_code,
                f"not every request was aborted: {names} did not abort theirs: {summary}",
            )
        return pb.AbortResponse(status=status, message=summary)

    async def _abort_request(
        self, request: pb.AbortRequest, context: Context, admission: int | None, *, again: bool
    ) -> pb.AbortResponse | None:
        """Abort by id: the request's engine asked, or the gateway ending it itself. None
        (with `again`) when the request moved on to another engine while its engine answered
        that it no longer had it: to be asked again. `admission` (`Relay.admission` as the
        Abort came) is the request asked about: if it ended while its engine answered, and a
        later request took its id, the engine's answer is returned as it is, the gateway doing
        nothing to the later request (neither following it nor ending it)."""
        address = self.relay.holding.get(request.request_id)
        if self.relay.abort_unrouted(request.request_id):
            # No engine can abort it now: its prefill engine finished its part (it would
            # answer ALREADY_FINISHED), or no engine holds it yet.
            message = (
                "aborted at the handoff to a decode engine"
                if request.request_id in self.relay.handed_over
                else "aborted before it was routed"
            )
            return pb.AbortResponse(status=pb.ABORT_STATUS_ABORTED, message=message)
        if address is None:
            if request.request_id in self.relay.finished:
                return pb.AbortResponse(
                    status=pb.ABORT_STATUS_ALREADY_FINISHED, message="the request ended"
                )
            await abort_with(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"no request {request.request_id!r} in flight",
            )
        # Bounded: an engine that hangs (stopped, wedged) would otherwise hold the
        # operator's Abort until their own deadline, with no word of which engine.
        timeout_s = self.controller.config.health.rpc_timeout_s
        try:
            reply: pb.AbortResponse = await self.controller.fleet.stub(address).Abort(
                request, timeout=timeout_s
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
            failure = engine_failure(caught, address, self.controller.fleet)
            ours = self.relay.admission(request.request_id) == admission
            if (
                ours
                and failure.code() in _UNACCEPTED
                and self.relay.abort_unaccepted(request.request_id, address)
            ):  # routed there, not accepted yet: the gateway ends it
                return pb.AbortResponse(
                    status=pb.ABORT_STATUS_ABORTED,
                    message="aborted before its engine accepted it",
                )
            if again and ours and self.relay.moved_on(request.request_id, address):
                return None
            if failure.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                await abort_with(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"engine {address} holding request {request.request_id!r} did not "
                    f"answer the Abort within {timeout_s:g} s",
                )
            await abort_with(
                context,
                failure.code(),
                naming_engine(failure, address, "Abort", self.controller.fleet),
            )
        if self.relay.admission(request.request_id) != admission:
            return reply  # it ended meanwhile, and a later request took its id: that one runs on
        if (
            reply.status in _ENDED
            and self.relay.ended_at(request.request_id, address)
            and reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
        ):  # its prefill engine handed it over: the gateway ends it there
            return pb.AbortResponse(
                status=pb.ABORT_STATUS_ABORTED,
                message="aborted at the handoff to a decode engine",
            )
        if (
            again
            and reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
            and self.relay.moved_on(request.request_id, address)
        ):
            return None
        return reply

    async def _lora_engines(self, context: Context, model: str | None) -> list[EngineRecord]:
        """The engines a LoRA call is for: the one its request metadata names
        (`kvplane-engine`, controller.outcomes), else every reachable engine (serving
        `model`, when one is named: `_lora_model`)."""
        reachable = self._reachable()
        if model is not None:
            reachable = [r for r in reachable if r.identity and model in r.identity.models]
        wanted = _metadata_value(context, ENGINE_METADATA_KEY)
        if wanted is None:
            if not reachable:
                serving = "" if model is None else f" serving model {model!r}"
                await abort_with(
                    context, grpc.StatusCode.UNAVAILABLE, f"no engine{serving} is reachable"
                )
            return reachable
        try:
            record = self.controller.fleet.registry.get(wanted)
        except (UnknownEngineError, EmptyEngineRefError) as exc:
            await abort_with(context, status_of(exc), str(exc))
        if not any(r is record for r in reachable):
            await abort_with(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"engine {wanted} takes no LoRA call now ({record.state.value})",
            )
        return [record]

    async def _lora_fan_out(
        self,
        context: Context,
        call: Callable[[pb_grpc.OpenEngineAsyncStub, float], Awaitable[T]],
        held: Callable[[T], tuple[str, ...] | None],
        learn: Callable[[str, T], None],
        *,
        on_absent: Callable[[str], None] | None = None,
        unloading: str | None = None,
        model: str | None = None,
        changes: bool = False,
    ) -> list[T]:
        """Call every engine the call is for (`_lora_engines`) that may support LoRA
        (GetModelInfo did not say `supports_lora: false`); report every engine's outcome
        (EngineOutcome) and fail unless all asked engines succeeded; `call(stub, timeout_s)`
        is given how long the engine has (`_lora_timeout_s`). `held` names the
        adapters a reply shows on its engine; `learn(address, reply)` records in the
        registry what a successful reply changed there (the router sends a LoRA request only
        to engines holding its adapter), before any failure ends the call. With `on_absent`
        (UnloadLora), NOT_FOUND means the engine does not have the adapter: `on_absent` is
        told, and the call is NOT_FOUND only when no asked engine had it. `unloading` (the
        adapter UnloadLora takes out of the whole fleet): an engine out of the fan-out that
        holds it (stopped, wedged, cut off: it keeps the adapter, and its traffic once back)
        fails the call, UNAVAILABLE, instead of passing unmentioned; the asked engines
        holding it leave its routing before they are asked (back on one whose unload fails),
        so no request naming it is sent to an engine that is unloading it. `model`: the
        engines serving it only (a LoadLora's `kvplane-model`). `changes` (LoadLora,
        UnloadLora): each engine's call is sent once its LoRA change in progress (the fleet
        service restoring its adapters, say) ended, so the engine gets them in order; the
        wait counts against its `lora_timeout_s`."""
        engines = await self._lora_engines(context, model)
        asked = [r for r in engines if r.identity is None or r.identity.supports_lora is not False]
        outcomes = {
            r.address: EngineOutcome(r, "skipped", "supports_lora is false")
            for r in engines
            if r not in asked
        }
        registry = self.controller.fleet.registry
        # Out of routing before the engines are asked: a request routed to an engine while
        # its UnloadLora is on the way would land after it and be refused there.
        withdrawn = {r.address for r in asked if unloading and r.holds_lora(unloading)}
        for address in withdrawn:
            registry.on_lora_unloaded(address, unloading or "")
        replies: list[T] = []
        failures: list[grpc.aio.AioRpcError] = []
        timeout_s = self._lora_timeout_s(context, listing=not changes)
        for record, result in await self._fan_out(asked, call, timeout_s, lora_changes=changes):
            if isinstance(result, grpc.aio.AioRpcError):
                outcome = EngineOutcome.of(record, result, self.controller.fleet)
                if on_absent is not None and result.code() == grpc.StatusCode.NOT_FOUND:
                    on_absent(record.address)
                    outcome = outcome._replace(outcome="not_loaded")
                else:
                    failures.append(result)
                    if record.address in withdrawn:  # not unloaded: it serves it still
                        registry.on_lora_loaded(record.address, unloading or "")
                outcomes[record.address] = outcome
            else:
                learn(record.address, result)
                replies.append(result)
                outcomes[record.address] = EngineOutcome(record, "ok", adapters=held(result))
        if unloading is not None and _metadata_value(context, ENGINE_METADATA_KEY) is None:
            asked_addresses = {r.address for r in engines}
            for record in registry.records():
                if record.address not in asked_addresses and unloading in (
                    record.lora_adapters or ()
                ):
                    failure = gateway_failure(
                        grpc.StatusCode.UNAVAILABLE,
                        f"not unloaded there: it holds the adapter and does not answer its "
                        f"polls ({record.state.value})",
                    )
                    failures.append(failure)
                    outcomes[record.address] = EngineOutcome.of(
                        record, failure, self.controller.fleet
                    )
                    engines.append(record)
        ordered = [outcomes[r.address] for r in engines]
        context.set_trailing_metadata(outcome_metadata([o.entry() for o in ordered]))
        summary = _summary(ordered)
        if not asked:
            named = _metadata_value(context, ENGINE_METADATA_KEY) is not None
            refusal = (
                "the engine named does not support LoRA"
                if named
                else "no engine in the fleet supports LoRA"
            )
            await abort_with(
                context, grpc.StatusCode.FAILED_PRECONDITION, f"{refusal}: {summary}; {_LORA_HOW}"
            )
        if failures:
            await abort_with(context, failures[0].code(), summary)
        if not replies:
            await abort_with(context, grpc.StatusCode.NOT_FOUND, summary)
        return replies

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context) -> pb.LoadLoraResponse:
        fleet = self.controller.fleet
        spec = LoraSpec(
            request.adapter.lora_id, request.adapter.lora_name, request.adapter.source_path
        )
        on_one = await self._named_engine_address(context)
        named_model = await self._lora_model(context, on_one)
        # One change at a time: two loads racing for one name would each win on some engines.
        async with fleet.lora_changes:
            await self.controller.membership.catch_up()  # the other replicas' LoRA changes
            model = named_model
            if on_one is None and named_model is None:
                try:
                    model = self._fleet_lora_model()
                except ModelRequiredError as exc:
                    await abort_with(context, status_of(exc), str(exc))
            known = fleet.lora_intent.conflict(spec)
            if known is not None:
                await abort_with(
                    context,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"LoRA adapter {spec} conflicts with {known}, loaded through this "
                    "controller or found on its engines: one name is one adapter across the "
                    "fleet (unload it first)",
                )
            # The model the adapter goes to: the fleet's, or the one engine's (its base
            # model; a controller fronted as an engine picks one of its own where none is
            # named, so a name held for a model must be loaded there naming it).
            target_model = model if on_one is None else named_model or self._base_model(on_one)
            known_model = fleet.lora_intent.model_conflict(
                spec.lora_name, target_model, self._held_base_model
            )
            if on_one is not None and target_model is None and known_model is not None:
                # That engine would pick a model of its own: not necessarily this one.
                await abort_with(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"name a model (lora load --model {known_model}, `kvplane-model` "
                    f"metadata): LoRA adapter {spec} is loaded for model {known_model!r}, "
                    f"and engine {fleet.registry.get(on_one).engine_id} has no one base "
                    "model (a controller fronted as an engine serves several)",
                )
            if known_model is not None:
                await abort_with(
                    context,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"LoRA adapter {spec} is loaded for model {known_model!r}: one name is one "
                    "adapter, trained for one base model (unload it first)",
                )

            def loaded(address: str, reply: pb.LoadLoraResponse) -> None:
                fleet.registry.on_lora_loaded(address, reply.adapter.lora_name)
                fleet.lora_intent.loaded(spec, on_one, model)

            try:
                replies = await self._lora_fan_out(
                    context,
                    lambda s, timeout_s: s.LoadLora(
                        request, timeout=timeout_s, metadata=lora_model_metadata(named_model)
                    ),
                    lambda r: (r.adapter.lora_name,),
                    loaded,
                    model=named_model,
                    changes=True,
                )
            finally:  # (whatever some engines answered: the intent as it now stands)
                await self.controller.membership.share_lora(spec.lora_name)
        return pb.LoadLoraResponse(
            adapter=replies[0].adapter, already_loaded=all(r.already_loaded for r in replies)
        )

    async def UnloadLora(
        self, request: pb.UnloadLoraRequest, context: Context
    ) -> pb.UnloadLoraResponse:
        fleet = self.controller.fleet

        def unloaded(address: str, *_: object) -> None:
            fleet.registry.on_lora_unloaded(address, request.lora_name)
            fleet.lora_intent.unload_confirmed(request.lora_name, address)

        async with fleet.lora_changes:
            # Forgotten whatever the engines answer: the operator wants it gone (an engine
            # that keeps it for now is reported, and the fleet service unloads it there
            # once it answers its polls again: Fleet._reapply_unloads).
            on_one = await self._named_engine_address(context)
            await self.controller.membership.catch_up()  # the other replicas' LoRA changes
            addresses = [r.address for r in fleet.registry.records()]
            held = fleet.lora_intent.shared(request.lora_name) is not None
            fleet.lora_intent.unloaded(request.lora_name, on_one, addresses)
            try:
                replies = await self._lora_fan_out(
                    context,
                    lambda s, timeout_s: s.UnloadLora(request, timeout=timeout_s),
                    lambda r: None,
                    unloaded,
                    on_absent=unloaded,
                    unloading=request.lora_name,
                    changes=True,
                )
            finally:
                await self.controller.membership.share_lora(request.lora_name, unloaded=held)
        return pb.UnloadLoraResponse(adapter=replies[0].adapter)

    def _lora_timeout_s(self, context: Context, *, listing: bool = False) -> float:
        """How long each engine has to answer a LoRA call: `lora_timeout_s` for a change (it
        reads weights), `health.rpc_timeout_s` for a listing, less when the client's
        deadline comes sooner. Bounded, as LoRA calls run one at a time: a wedged engine
        would hold up every later one."""
        config = self.controller.config
        limit_s = config.health.rpc_timeout_s if listing else config.lora_timeout_s
        remaining_s = context.time_remaining()
        return limit_s if remaining_s is None else min(limit_s, remaining_s)

    async def _lora_model(self, context: Context, on_one: str | None) -> str | None:
        """The model a LoadLora's `kvplane-model` metadata names (None: none named):
        INVALID_ARGUMENT when it is empty, or when `kvplane-engine` names an engine (at
        `on_one`) that does not serve it; NOT_FOUND for a model no engine serves. With an
        engine named, it is passed on to that engine: a controller fronted as an engine
        serves several base models, and refuses a load naming none."""
        model = _metadata_value(context, MODEL_METADATA_KEY)
        if model is None:
            return None
        if not model:
            await abort_with(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"{MODEL_METADATA_KEY} must name a model"
            )
        try:
            self.controller.check_model(model)
        except KvplaneError as exc:
            await abort_with(context, status_of(exc), str(exc))
        if on_one is not None:
            record = self.controller.fleet.registry.get(on_one)
            # (One not read yet takes no LoRA call: `_lora_engines` says so.)
            if record.identity is not None and model not in record.identity.models:
                await abort_with(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"engine {record.engine_id} does not serve model {model!r}",
                )
        return model

    def _base_model(self, address: str) -> str | None:
        """The base model of the engine at `address` (EngineIdentity.base_model; None: not
        read yet, or a controller fronted as an engine)."""
        identity = self.controller.fleet.registry.get(address).identity
        return identity.base_model if identity is not None else None

    def _held_base_model(self, address: str) -> str | None:
        """The base model of the engine at `address` holding an adapter of its own (None: not
        read, a controller fronted as an engine, or no longer in the fleet)."""
        try:
            return self._base_model(address)
        except UnknownEngineError:
            return None

    def _fleet_lora_model(self) -> str | None:
        """The model a fleet-wide load naming none is for: the one base model the
        LoRA-capable engines serve (None while none is known). ModelRequiredError when they
        serve several: the adapter would be attached to models it was not trained for (a
        torch engine refuses it, or serves a wrong adapter), as a request naming no model
        is refused where the engines' default models differ."""
        models = self.controller.fleet.registry.base_models(lora=True)
        if len(models) > 1:
            raise ModelRequiredError(
                "name a model (lora load --model, `kvplane-model` metadata): the LoRA-capable "
                f"engines of this fleet serve different base models ({', '.join(models)}), "
                "and an adapter is trained for one"
            )
        return next(iter(models), None)

    async def _named_engine_address(self, context: Context) -> str | None:
        """The address of the engine a LoRA call's `kvplane-engine` metadata names (NOT_FOUND
        for one not in the fleet, INVALID_ARGUMENT for an empty name, as `_lora_engines`
        answers); None for the whole fleet."""
        wanted = _metadata_value(context, ENGINE_METADATA_KEY)
        if wanted is None:
            return None
        try:
            return self.controller.fleet.registry.get(wanted).address
        except (UnknownEngineError, EmptyEngineRefError) as exc:
            await abort_with(context, status_of(exc), str(exc))

    async def ListLoras(
        self, request: pb.ListLorasRequest, context: Context
    ) -> pb.ListLorasResponse:
        fleet = self.controller.fleet
        registry = fleet.registry

        def learn(address: str, reply: pb.ListLorasResponse, listed_at: int) -> None:
            # Not when the fleet service changed the engine's adapters meanwhile (a restore,
            # a re-applied unload, which run off `lora_changes`): `Fleet.learn_loras`.
            fleet.learn_loras(address, frozenset(a.lora_name for a in reply.adapters), listed_at)

        # Not while a load or unload runs: a listing from before it would undo what it
        # taught the router.
        async with fleet.lora_changes:
            listed_at = {r.address: fleet.lora_task_changes(r.address) for r in registry.records()}
            replies = await self._lora_fan_out(
                context,
                lambda s, timeout_s: s.ListLoras(request, timeout=timeout_s),
                lambda r: tuple(a.lora_name for a in r.adapters),
                lambda address, r: learn(address, r, listed_at.get(address, -1)),
            )
        union: dict[tuple[int, str, str], pb.LoraAdapter] = {}
        for reply in replies:
            for a in reply.adapters:
                union.setdefault((a.lora_id, a.lora_name, a.source_path), a)
        return pb.ListLorasResponse(adapters=sorted(union.values(), key=lambda a: a.lora_id))

    async def Drain(
        self, request: pb.DrainRequest, context: Context
    ) -> AsyncIterator[pb.DrainResponse]:
        """Drain the gateway itself, as an engine drains: refuse new requests (until the
        controller restarts: nothing undoes a drain), report the requests it relays (on every
        change, and every progress interval) until none is left, then COMPLETE. Past the
        deadline, without `abort_after_deadline`: one terminal EngineError (DRAINING), the
        requests keep running; with it: abort the requests this gateway relays, then COMPLETE
        once they have ended or their engines said they ended (`_unended`: a client that
        stops reading holds the gateway's relay, not the drain), the same error if some
        outlive DRAIN_ABORT_GRACE_S. Engines keep running; drain an engine with the admin
        API."""
        # Every request admitted here counts, from its planning on: one still being planned
        # when the drain starts is routed afterwards.
        in_flight_ids = self.relay.running
        if request.stop_accepting_new_requests:
            self.controller.stop_accepting()
        now = time.monotonic()
        deadline = now + request.deadline_ms / 1000.0 if request.HasField("deadline_ms") else None
        yield _drain_state(pb.DRAIN_STATE_STARTED, len(in_flight_ids))
        reported, reported_at = len(in_flight_ids), now
        aborted: set[tuple[str, str]] = set()  # (request id, engine) told to abort
        ended: set[tuple[str, str]] = set()  # (request id, engine) the engine said ended
        aborts_end: float | None = None  # when waiting for the aborted requests gives up
        while True:
            now = time.monotonic()
            # Once it aborted them, what the drain waits for is the engines' work (`_unended`),
            # as an engine's drain does: not clients that stopped reading.
            in_flight = len(in_flight_ids) if aborts_end is None else self._unended(ended)
            if not in_flight:
                break
            if deadline is not None and now >= deadline:
                if not request.abort_after_deadline:
                    message = f"deadline passed, requests in flight: {in_flight}"
                    yield _drain_failed(in_flight, message)
                    return
                if aborts_end is None:
                    aborts_end = now + DRAIN_ABORT_GRACE_S
                elif now >= aborts_end:
                    message = (
                        f"requests still in flight {DRAIN_ABORT_GRACE_S:g} s after they were "
                        f"aborted: {in_flight}"
                    )
                    yield _drain_failed(in_flight, message)
                    return
                await self._abort_relayed(aborted, ended)
            if in_flight != reported or now - reported_at >= DRAIN_PROGRESS_INTERVAL_S:
                reported, reported_at = in_flight, now
                yield _drain_state(pb.DRAIN_STATE_IN_PROGRESS, in_flight)
            await asyncio.sleep(DRAIN_POLL_S)
        yield _drain_state(pb.DRAIN_STATE_COMPLETE, 0)

    async def _abort_relayed(
        self, aborted: set[tuple[str, str]], ended: set[tuple[str, str]]
    ) -> None:
        """Abort each request this gateway relays at the engine serving it, unless `aborted`
        says it was already told (a retry may move a request to another engine), and those
        still being planned here. Only these: Abort(all_requests) would also end other
        clients' requests sent straight to the engines. `ended` gains those whose engine
        answered that the request ended there (ABORTED or ALREADY_FINISHED)."""
        self.relay.abort_all_unrouted()
        fresh = list(set(self.relay.holding.items()) - aborted)
        aborted.update(fresh)
        answers = await asyncio.gather(*(self._abort_at(engine, rid) for rid, engine in fresh))
        ended.update(held for held, answer in zip(fresh, answers, strict=True) if answer)

    def _unended(self, ended: set[tuple[str, str]]) -> int:
        """How many of the requests this gateway relays a drain past its aborting deadline
        still waits for: not those whose engine said they ended (`ended`), nor those the
        gateway ended itself before an engine took them (Relay.aborted_unrouted). A client
        that stops reading its stream (its flow-control window full, never cancelling)
        keeps the gateway's relay of it open for as long as it likes, its engine's work
        over; it must not hold the drain, as it does not hold an engine's."""
        relay = self.relay
        return sum(
            (request_id, relay.holding.get(request_id, "")) not in ended
            and request_id not in relay.aborted_unrouted
            for request_id in relay.running
        )

    async def _abort_at(self, engine: str, request_id: str) -> bool:
        """Abort the request at `engine`; whether the engine said it ended there (seed:
        ABORTED and ALREADY_FINISHED both say the target ended)."""
        try:
            stub = self.controller.fleet.stub(engine)
        except KeyError:  # the engine left the fleet: the request fails with it
            return False
        try:
            reply = await stub.Abort(
                pb.AbortRequest(request_id=request_id), timeout=DRAIN_ABORT_GRACE_S
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
            exc = engine_failure(caught, engine, self.controller.fleet)
            log.warning("drain: aborting request %s on %s failed: %s: %s",
                        request_id, engine, exc.code().name, exc.details())  # fmt: skip
            return False
        if reply.status not in _ENDED:
            return False
        self.relay.ended_at(request_id, engine)
        return True

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
        # Each figure is the sum over the engines that report it, and absent when none does
        # (seed: absent is unavailable, a present zero a measured zero).
        totals: dict[str, int | None] = dict.fromkeys(_SUMMED_LOAD)
        kv_tokens: dict[str, int | None] = dict.fromkeys(_KV_BLOCK_FIELDS)
        block_sizes: set[int] = set()
        in_tokens_only = False  # an engine told its KV in tokens only
        for r in records:
            load = r.load
            size = self._block_size_of(r)
            for name, total in totals.items():
                value = getattr(load, name)
                if value is not None:
                    totals[name] = (total or 0) + value
            engine_tokens, sizes, told_in_tokens = _kv_tokens(load, size)
            in_tokens_only |= told_in_tokens
            for name, count in engine_tokens.items():
                kv_tokens[name] = (kv_tokens[name] or 0) + count
                block_sizes.update(sizes)
            kv = f"kv={_text(load.used_kv_blocks)}/{_text(load.total_kv_blocks)}"
            if told_in_tokens:
                kv += f" kv_tokens={_text(load.used_kv_tokens)}/{_text(load.total_kv_tokens)}"
            inflight = self.controller.router.inflight.of(r.address).requests
            reply.attributes[f"engine.{r.address}"] = (
                f"instance={r.engine_id} role={r.role.value} state={r.state.value} "
                f"cordoned={r.cordoned} "
                f"running={_text(load.running_requests)} queued={_text(load.queued_requests)} "
                f"{kv} block_size={','.join(str(s) for s in sorted(sizes))} inflight={inflight}"
            )
        if len(block_sizes) > 1 or in_tokens_only:
            # Blocks of 16 and of 32 tokens do not add up to a count of anything: the KV
            # figures go in tokens (attributes: the seed's LoadInfo counts KV in blocks only).
            for name in _KV_BLOCK_FIELDS:
                totals[name] = None
        for name, tokens in kv_tokens.items():
            if tokens is not None:
                reply.attributes[KV_TOKEN_ATTRIBUTES[name]] = str(tokens)
        if block_sizes:
            reply.attributes[KV_BLOCK_SIZE_ATTRIBUTE] = ",".join(
                str(s) for s in sorted(block_sizes)
            )
        for name, total in totals.items():
            if total is not None:
                setattr(reply, name, min(total, _LOAD_FIELD_MAX[name]))
        reply.attributes["engines"] = str(len(records))
        reply.attributes["routable_engines"] = str(sum(r.routable for r in records))
        # A controller fronting this one reads its identity again when this moves.
        reply.attributes[FLEET_VIEW_KEY] = self._fleet_view()
        return reply

    def _fleet_view(self) -> str:
        """The version of what the fleet tells of itself (`fleet_view`), its facts as
        routing judges them."""
        prefill = self.controller.eligibility.decode_engines_prefill
        return fleet_view(self.controller.fleet.registry, prefill)

    def _block_size_of(self, record: EngineRecord) -> int:
        """The tokens one of the engine's KV blocks holds: its models' block size, else the
        config's default (what the router hashes its prompts in)."""
        identity = record.identity
        if identity is not None and identity.block_size:
            return identity.block_size
        return self.controller.config.default_block_size

    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        """One check per engine, the fleet's state (`fleet_health_state`), and what the request
        asks as an engine answers it: with a `model`, the state and checks of the engines
        serving it only (a readiness probe naming the model learns whether it is served);
        NOT_FOUND for a model no engine serves (while the fleet has no engine at all, which
        cannot tell, a NOT_READY `model` check instead: a readiness probe naming the model is
        told "not yet", not "never"), a `role` check
        (the gateway is AGGREGATED; another role fails it), and with
        `include_inference_probe` an `inference_probe` check (`_inference_probe`). A failed
        role or probe makes the state NOT_READY, as on an engine. A shared or remote index
        has a `kv_index` check (`_index_check`): one that does not answer makes a READY
        fleet DEGRADED (it serves, routed by load, without cache knowledge)."""
        checks = []
        if request.model:
            try:
                self.controller.check_model(request.model)
            except NoEngineRegisteredError as exc:
                checks.append(
                    pb.HealthCheck(name="model", state=pb.HEALTH_STATE_NOT_READY, message=str(exc))
                )
            except UnknownModelError as exc:
                await abort_with(context, status_of(exc), str(exc))
        registry = self.controller.fleet.registry
        # Named, a model is what the answer is of, as an engine's is of the model it serves:
        # the engines that serve it, or may (not read yet); none, the whole fleet.
        records = registry.may_serve_records(request.model) if request.model else registry.records()
        checks.extend(
            pb.HealthCheck(
                name=f"engine:{r.address}",
                state=_HEALTH_PB[r.state],
                message=_check_message(r, self.controller.fleet.error_of(r)),
            )
            for r in records
        )
        state = fleet_health_state(self.controller, records)
        index = self._index_check()
        if index is not None:
            checks.append(index)
            state = _degraded_by(index, state)
        failed = False
        if request.role != pb.ENGINE_ROLE_UNSPECIFIED:
            failed = request.role != GATEWAY_ROLE
            checks.append(
                pb.HealthCheck(
                    name="role",
                    state=pb.HEALTH_STATE_NOT_READY if failed else pb.HEALTH_STATE_READY,
                    message=pb.EngineRole.Name(GATEWAY_ROLE),
                )
            )
        if request.include_inference_probe:
            probe = await self._inference_probe(request.model)
            checks.append(probe)
            failed = failed or probe.state == pb.HEALTH_STATE_NOT_READY
            state = _degraded_by(probe, state)
        if failed:
            state = pb.HEALTH_STATE_NOT_READY
        return pb.HealthResponse(state=state, checks=checks)

    def _index_check(self) -> pb.HealthCheck | None:
        """`kv_index`: READY naming the shared Redis or remote indexer while it answers,
        DEGRADED with its address and error while it does not, as its client last found
        (`Controller.reachable_index`: Health asks the index nothing), and DEGRADED while the
        remote indexer reports keying a worker otherwise than the controller asks
        (`Controller.index_keying_mismatch`: it answers, and matches nothing there). None for
        the embedded index, which cannot be unreachable."""
        index = self.controller.reachable_index()
        if index is None:
            return None
        problem = index.unavailable or self.controller.index_keying_mismatch()
        if problem is None:
            return pb.HealthCheck(
                name="kv_index", state=pb.HEALTH_STATE_READY, message=index.described
            )
        return pb.HealthCheck(
            name="kv_index", state=pb.HEALTH_STATE_DEGRADED, message=" ".join(problem.split())
        )

    async def _inference_probe(self, model: str) -> pb.HealthCheck:
        """The seed's inference probe for a fleet: every engine that takes traffic for
        `model` (empty: any model) runs its own, as its role and runner do it. READY when
        every one passed, DEGRADED when some did (the fleet still serves), NOT_READY when
        none did or no engine takes traffic; the message has each engine's result."""
        records = self.controller.fleet.registry.routable(model or None)
        if not records:
            return pb.HealthCheck(
                name="inference_probe",
                state=pb.HEALTH_STATE_NOT_READY,
                message=f"no engine serving {model or 'a model'} takes traffic now",
            )
        probe = pb.HealthRequest(include_inference_probe=True, model=model)
        results = await self._fan_out(
            records,
            lambda s, timeout_s: s.Health(probe, timeout=timeout_s),
            INFERENCE_PROBE_TIMEOUT_S,
        )
        passed, results_text = 0, []
        for record, result in results:
            if isinstance(result, grpc.aio.AioRpcError):
                outcome = f"{result.code().name}: {result.details()}"
            else:
                check = next((c for c in result.checks if c.name == "inference_probe"), None)
                if check is None:
                    outcome = "no inference_probe check"
                else:
                    passed += check.state == pb.HEALTH_STATE_READY
                    outcome = check.message or enum_name(pb.HealthState.DESCRIPTOR, check.state)
            results_text.append(f"{record.address}: {outcome}")
        if passed == len(records):
            state = pb.HEALTH_STATE_READY
        else:
            state = pb.HEALTH_STATE_DEGRADED if passed else pb.HEALTH_STATE_NOT_READY
        return pb.HealthCheck(name="inference_probe", state=state, message="; ".join(results_text))

    async def GetEngineInfo(
        self, request: pb.GetEngineInfoRequest, context: Context
    ) -> pb.EngineInfo:
        models: list[str] = []
        records = self.controller.fleet.registry.records()
        for r in records:
            # Not an incompatible engine's: the fleet does not serve them (GetModelInfo and
            # Generate answer NOT_FOUND for a model only such engines name).
            if r.identity is not None and r.state is not EngineState.INCOMPATIBLE:
                models.extend(m for m in r.identity.models if m not in models)
        # Which controllers this one fronts: a controller about to front it refuses to if it
        # is among them (a ring of controllers, `controller.hops`).
        fronted = sorted(self.controller.fleet.registry.fronted_controller_ids())
        # And the fleet view this answer is of: GetLoad's telling it moved is compared with it.
        view = (FLEET_VIEW_KEY, self._fleet_view())
        context.set_trailing_metadata([(FRONTS_METADATA_KEY, i) for i in fronted] + [view])
        return pb.EngineInfo(
            engine_name=CONTROLLER_ENGINE_NAME,
            engine_version=__version__,
            role=GATEWAY_ROLE,
            instance_id=self.instance_id,
            supported_models=models,
            schema_revision=SCHEMA_REVISION,
            minimum_client_revision=MINIMUM_CLIENT_REVISION,
            schema_release=SCHEMA_RELEASE,
        )

    async def _model_info(
        self, record: EngineRecord, request: pb.GetModelInfoRequest
    ) -> pb.ModelInfo:
        """The engine's GetModelInfo; raises its failure (an engine that left: UNAVAILABLE)."""
        try:
            reply: pb.ModelInfo = await self.controller.fleet.stub(record.address).GetModelInfo(
                request, timeout=self.controller.config.health.rpc_timeout_s
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
            raise engine_failure(caught, record.address, self.controller.fleet) from None
        return reply

    async def _add_served_elsewhere(
        self,
        reply: pb.ModelInfo,
        answered: EngineRecord,
        fleet: ModelFacts,
        request: pb.GetModelInfoRequest,
    ) -> None:
        """What the fleet serves for the model though the answering engine does not, which
        the seed has clients use only when ModelInfo advertises it: LoRA (`supports_lora`:
        a Generate naming an adapter goes to a generating engine holding it, the LoRA calls
        fan out to the engines that support LoRA), and each pooling task (Embed, Classify
        and Score go to an engine that has it), advertised with the capability of an engine
        that has it (a routable one first; one out of routing but reached next; `supported`
        alone when none answers). As `fleet` (`fleet_facts`) says: of every read engine,
        routable or not, as the fleet view counts them, so that the answer moves only with
        the view (a controller fronting this one reads it again then: a task advertised only
        while its engine was routable was lost upstairs for good by a read while it was out)."""
        if fleet.supports_lora:
            reply.supports_lora = True
        # Not an unreachable engine (it would hold the answer up), nor an incompatible one
        # (the fleet does not serve its models).
        asked = sorted(
            (r for r in self.controller.fleet.registry.records() if r.state not in _NOT_ASKED),
            key=lambda r: not r.routable,
        )
        for task in sorted(fleet.tasks):
            capability = getattr(reply.tasks, task)
            if capability.supported:
                continue
            for other in asked:
                if other is answered or not _has_task(other, request.model, task):
                    continue
                try:
                    info = await self._model_info(other, request)
                except grpc.aio.AioRpcError:
                    continue  # another engine with the task may answer
                if getattr(info.tasks, task).supported:
                    capability.CopyFrom(getattr(info.tasks, task))
                    break
            else:
                capability.Clear()  # (the answering engine's words of a task it lacks)
                capability.supported = True

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.ModelInfo:
        if not request.model:  # as an engine answers
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        await _require_model(self.controller, request.model, context)
        registry = self.controller.fleet.registry
        records = registry.routable(request.model)
        fleet = fleet_facts(
            registry.may_serve_records(request.model),
            request.model,
            self.controller.eligibility.decode_engines_prefill,
        )
        # A generating engine answers where one serves the model: a pooling-only one's answer
        # has no `generation`, which says the model is not generated (a controller fronting
        # this one, reading it, would refuse the model's Generates until its view moved).
        # Where one does is the read engines' to say: one not read yet (never reached) may
        # serve any model, and would have every pooling-only model refused while it is away;
        # the fleet view moves when one generating the model is read.
        generating = fleet.generates
        answering = [r for r in records if _generates(r, request.model)] if generating else records
        refusals = []
        for r in answering:
            try:
                reply = await self._model_info(r, request)
            except grpc.aio.AioRpcError as failure:
                if failure.code() in RETRYABLE:  # this engine cannot answer now; the next may
                    refusals.append(f"{r.engine_id} {failure.code().name}: {failure.details()}")
                    continue
                await abort_with(context, failure.code(), failure.details() or failure.code().name)
            await self._add_served_elsewhere(reply, r, fleet, request)
            _as_the_fleets(reply, fleet, request.model)
            return reply
        states = registry.generating_states if generating else registry.engine_states
        why = "; ".join(refusals) if refusals else states(request.model)
        await abort_with(
            context,
            grpc.StatusCode.UNAVAILABLE,
            f"no engine serving {request.model!r} can answer now: {why}",
        )


def _as_the_fleets(reply: pb.ModelInfo, fleet: ModelFacts, model: str) -> None:
    """Make the answering engine's ModelInfo the fleet's (`fleet`: `fleet_facts`, of the
    engines serving the model): its request limits the smallest, so that one within them is
    not refused wherever it goes, as on one engine (seed: ModelInfo advertises limits for the
    request options), but those routing honours per engine (controller.eligibility), the
    largest; a request option supported only when none of them says it is not, or, routing
    honouring it, when one does not; its capacity, `total_kv_blocks` and
    `max_running_requests`, their sum (absent when none reports it, or KV blocks of
    several sizes, as GetLoad's). The fleet view (`fleet_view`) is a digest of the same
    facts: a controller fronting this one reads them again when they move."""
    for path, limit in fleet.limits:
        holder, name = field_holder(reply, path)
        if holder is not None:
            setattr(holder, name, limit)
    # A request option one refuses is not advertised: it would be refused there. One that
    # routing honours (ROUTED_OPTIONS) is, while an engine does not refuse it.
    for flag in CAPABILITY_FLAGS:
        holder, name = field_holder(reply, flag)
        if holder is None:
            continue
        if flag in fleet.unsupported:
            setattr(holder, name, False)
        elif flag in ROUTED_OPTIONS and holder.HasField(name) and not getattr(holder, name):
            setattr(holder, name, True)
    # Likewise the logprobs' candidate selection modes (routing honours them: ROUTED_OPTIONS):
    # each but those every engine lists its modes without, where an engine lists them.
    if reply.HasField("generation"):
        for kind in KINDS:
            capabilities = getattr(reply.generation, f"{kind}_logprobs")
            served = [
                mode
                for selection, mode in SELECTION_MODES.items()
                if selection_option(kind, selection) not in fleet.unsupported
            ]
            if capabilities.candidate_selection_modes or len(served) < len(SELECTION_MODES):
                capabilities.candidate_selection_modes[:] = served
    # Not the answering engine's, where engines differ: the block size they share (absent
    # when they differ, as GetLoad's `kv_block_size` lists them), the model's name they
    # share (the name asked for when they differ: every one serves it).
    if fleet.block_size is None:
        reply.ClearField("kv_block_size")
    else:
        reply.kv_block_size = fleet.block_size
    reply.served_model_name = fleet.served_name or model
    for capacity in ("max_running_requests", "total_kv_blocks"):
        summed = getattr(fleet, capacity)
        if summed is None:
            reply.ClearField(capacity)
        else:
            setattr(reply, capacity, min(summed, _UINT64_MAX))


async def _end_aborted_task(request_id: str, context: Context) -> NoReturn:
    """End a pooling task that the gateway aborted itself (its engine had not accepted it:
    `Relay.abort_unaccepted`) as an engine ends an aborted task: the status CANCELLED, in the
    bundled engine's words."""
    await abort_with(context, grpc.StatusCode.CANCELLED, f"request {request_id!r} was aborted")


async def _require_model(controller: Controller, model: str, context: Context) -> None:
    """NOT_FOUND for a model no engine of the fleet serves, UNAVAILABLE while the fleet has no
    engine at all (Controller.check_model)."""
    try:
        controller.check_model(model)
    except (UnknownModelError, NoEngineRegisteredError) as exc:
        await abort_with(context, status_of(exc), str(exc))


def _degraded_by(
    check: pb.HealthCheck, state: pb.HealthState.ValueType
) -> pb.HealthState.ValueType:
    """A DEGRADED check makes a READY fleet DEGRADED (it still serves); other states stay."""
    if check.state == pb.HEALTH_STATE_DEGRADED and state == pb.HEALTH_STATE_READY:
        return pb.HEALTH_STATE_DEGRADED
    return state


def _check_message(record: EngineRecord, error: str) -> str:
    """An engine's check message: its `error` (`Fleet.error_of`), after its cordon and, where
    HealthState has no word for its state (NOT_READY stands for unknown, unreachable,
    failing, incompatible), the state itself: an operator tells a dead engine from one
    answering with errors. The cordon is its own part ("cordoned; unreachable: ..."): it is
    the operator's doing, the rest the engine's."""
    detail = error
    if record.state is not EngineState.NOT_READY and _HEALTH_PB[record.state] == (
        pb.HEALTH_STATE_NOT_READY
    ):
        detail = record.state.value + (f": {detail}" if detail else "")
    return "; ".join(part for part in ("cordoned" if record.cordoned else "", detail) if part)


def _drain_state(state: pb.DrainState.ValueType, in_flight: int) -> pb.DrainResponse:
    return pb.DrainResponse(state=state, in_flight_requests=in_flight)


def _drain_failed(in_flight: int, message: str) -> pb.DrainResponse:
    """The terminal EngineError of a drain the deadline ended, as an engine's (seed: a
    failure after the drain is accepted is one terminal EngineError)."""
    error = pb.EngineError(code=pb.ERROR_CODE_DRAINING, message=message, retryable=True)
    return pb.DrainResponse(error=error, in_flight_requests=in_flight, message=message)


def _text(value: int | None) -> str:
    return "?" if value is None else str(value)


def _summary(outcomes: list[EngineOutcome]) -> str:
    return "; ".join(o.text() for o in outcomes)


def _kv_tokens(load: LoadSnapshot, block_size: int) -> tuple[dict[str, int], tuple[int, ...], bool]:
    """An engine's KV figures in tokens, by the block count each stands for (those it
    reports: its blocks times `block_size`, its block size), the block sizes they are of,
    and whether it told them in tokens only: a controller fronted as an engine whose fleet
    mixes block sizes, whose blocks are not told (its attributes, KV_TOKEN_ATTRIBUTES)."""
    tokens: dict[str, int] = {}
    in_tokens = False
    for name, attribute in KV_TOKEN_ATTRIBUTES.items():
        blocks = getattr(load, name)
        told = getattr(load, attribute)
        if blocks is not None:
            tokens[name] = blocks * block_size
        elif told is not None:
            tokens[name] = told
            in_tokens = True
    sizes = (load.kv_block_sizes or (block_size,)) if in_tokens else (block_size,)
    return tokens, sizes, in_tokens


def _queue_depth(record: EngineRecord) -> int:
    return (record.load.running_requests or 0) + (record.load.queued_requests or 0)


# An engine on its way to serving: not read yet, or starting by its own word.
_STARTING_STATES = frozenset({EngineState.UNKNOWN, EngineState.STARTING})
# The engines GetModelInfo does not ask for a task the answering engine lacks.
_NOT_ASKED = frozenset({EngineState.UNREACHABLE, EngineState.INCOMPATIBLE})


def _has_task(record: EngineRecord, model: str, task: str) -> bool:
    """Whether the engine's GetModelInfo for `model` says it supports `task`."""
    return record.identity is not None and task in record.identity.facts_of(model).tasks


def _takes_text(record: EngineRecord, model: str) -> bool:
    """Whether the engine's GetModelInfo for `model` does not say it refuses text input
    (`supports_text_input` false: it has no tokenizer)."""
    return (
        record.identity is not None
        and "supports_text_input" not in record.identity.facts_of(model).unsupported
    )


def _tasked_facts(records: Iterable[EngineRecord], model: str, task: str) -> list[ModelFacts]:
    """The facts of `model` on each of `records` whose GetModelInfo says it supports `task`."""
    return [
        r.identity.facts_of(model)
        for r in records
        if r.identity is not None and task in r.identity.facts_of(model).tasks
    ]


def _generates(record: EngineRecord, model: str) -> bool:
    """Whether the engine generates for `model` (unknown: it may)."""
    return record.identity is None or record.identity.facts_of(model).generates


def _metadata_value(context: Context, key: str) -> str | None:
    """The value of request metadata `key` (gRPC metadata keys are lower case), if sent."""
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None
