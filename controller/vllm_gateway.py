"""The gateway's `vllm.Generate` surface, for clients of vLLM's gRPC front end: the same
path as OpenEngine Generate (controller/relay.py: routing, the one retry, Abort by request id
through OpenEngine, Drain, metrics, the `kvplane-route` trailing metadata naming the engine).
The chosen engine's own `vllm.Generate` service (served on the same port as its OpenEngine
service) answers; the response is relayed unchanged.

What this API changes on the way:
- It has no in-band error event: after something was relayed, an engine failure passes
  through as the engine's status. A vLLM server's stream begins with a response carrying
  `prompt_info` alone: the relay holds it until the first output (`has_output`), so an
  engine failing before its first token is retried elsewhere.
- A request without `request_id` gets one (`vllm-<hex>`) before routing, so that the router's
  in-flight accounting and Abort can tell it from other requests.
- The session key (config `router.session_metadata_key`) is read from the call's gRPC
  metadata: the request has no metadata map.
- `truncate_prompt_tokens`: the engine keeps the prompt's last N tokens, so the router
  matches those against the index (a prompt as sent would share no prefix with them).
- The engines it may go to are those that take what it asks, as for an OpenEngine Generate
  (controller.eligibility's `needs_of` reads either API by the same rules: its sequences,
  logprob candidates, options, `min_new_tokens` within the context and the KV cache).
- The response has no cached-token count: usage records the prompt tokens only
  (`prompt_info.num_prompt_tokens`), not the router's prediction against the engine's.
- A request aborted before any engine accepted it (while planned, say) ends as the bundled
  engine ends one aborted before its prefill, `finish_info` ABORTED with status OK, the first
  sequence's end carrying `prompt_info` in the same response (`aborted`).
- This proto has no health of its own: `grpc.health.v1` answers for `vllm.Generate` what the
  gateway's OpenEngine Health judges of the fleet's engines that generate
  (`fleet_health_state(generating=True)`): SERVING while one of them is routable,
  NOT_SERVING while none is (none registered, none taking traffic, or only pooling-only
  engines, which cannot Generate, or prefill engines, which need a decode engine) and from
  the moment the controller stops accepting new requests, by a drain or at its shutdown
  (`report_health`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health

from controller.fleet import SERVING_STATES
from controller.gateway import fleet_health_state
from controller.relay import InBandError, Relay, Usage
from controller.service import Controller, PromptInput
from kvplane.prompt_truncation import kept_prompt
from kvplane.server import ServiceHealth
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["Generate"].full_name


class _UnaryCall:
    """A unary call seen as a stream of one response, the shape the relay iterates."""

    def __init__(self, call: grpc.aio.UnaryUnaryCall[Any, vpb.GenerateResponse]) -> None:
        self._call = call

    def __aiter__(self) -> AsyncIterator[vpb.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[vpb.GenerateResponse]:
        yield await self._call

    def cancel(self) -> bool:
        return self._call.cancel()

    def done(self) -> bool:
        return self._call.done()


class _VllmGenerate:
    """vllm.Generate (unary) or GenerateStream as the relay sees it."""

    def __init__(self, stub: Callable[[str], vpb_grpc.GenerateAsyncStub], unary: bool) -> None:
        self._stub = stub
        self._unary = unary

    def call(
        self, engine: str, request: vpb.GenerateRequest
    ) -> _UnaryCall | grpc.aio.UnaryStreamCall[vpb.GenerateRequest, vpb.GenerateResponse]:
        stub = self._stub(engine)
        if self._unary:
            return _UnaryCall(stub.Generate(request))
        return stub.GenerateStream(request)

    def error(self, response: vpb.GenerateResponse) -> InBandError | None:
        return None  # no error event: every failure is a status

    def has_output(self, response: vpb.GenerateResponse) -> bool:
        return response.HasField("outputs")

    def usage(self, response: vpb.GenerateResponse) -> Usage | None:
        if not response.HasField("prompt_info"):
            return None
        return Usage(response.prompt_info.num_prompt_tokens, None)

    def num_outputs(self, request: vpb.GenerateRequest) -> int:
        return request.sampling.num_sequences or 1  # the seed: 0 means 1

    def outputs_ended(self, request: vpb.GenerateRequest, response: vpb.GenerateResponse) -> int:
        # FinishInfo is only in a sequence's final output (the seed's comment).
        return 1 if response.outputs.HasField("finish_info") else 0

    def error_response(self, request: vpb.GenerateRequest, message: str, retryable: bool) -> None:
        """vllm.Generate has no in-band error event: a failure passes as a status."""
        return None

    def aborted(self, request: vpb.GenerateRequest) -> list[vpb.GenerateResponse]:
        """As the bundled engine ends a request aborted before its prefill (status OK): each
        sequence (the one of a unary call) finished ABORTED with no token, the first of them
        with `prompt_info` in the same response (the tests compare the two). Its prompt is
        counted only when sent as token ids (and kept as the engine keeps it,
        `truncate_prompt_tokens`): a text prompt's tokens are the engine's to count, so
        `prompt_info` is left out then."""
        aborted = vpb.FinishInfo(finish_reason=vpb.FinishInfo.ABORTED)
        ending = [
            vpb.GenerateResponse(outputs=vpb.SequenceOutput(index=index, finish_info=aborted))
            for index in range(1 if self._unary else self.num_outputs(request))
        ]
        if request.WhichOneof("prompt") == "token_ids":
            kept = kept_prompt(request.token_ids.ids, request.truncate_prompt_tokens)
            info = ending[0].prompt_info
            info.num_prompt_tokens = len(kept)
            if request.response.prompt_token_ids:
                info.token_ids.extend(kept)
        return ending


class VllmGatewayServicer(vpb_grpc.GenerateServicer):
    def __init__(self, controller: Controller, relay: Relay) -> None:
        """`relay`: the OpenEngine gateway's (GatewayServicer.relay), so that both front ends
        share one set of in-flight requests."""
        self.controller = controller
        self.relay = relay
        self._unary = _VllmGenerate(self._stub, unary=True)
        self._stream = _VllmGenerate(self._stub, unary=False)
        self._health: ServiceHealth | None = None

    async def report_health(self, health_servicer: health.aio.HealthServicer) -> None:
        """Keep `grpc.health.v1`'s status for `vllm.Generate` on `health_servicer` to what
        the fleet's OpenEngine Health says of its engines that generate
        (`fleet_health_state(generating=True)`): SERVING while READY or DEGRADED,
        NOT_SERVING while no engine that can take a Generate is routable (pooling-only
        engines cannot, prefill engines not without a decode engine) and once the
        controller stops accepting new requests (a drain or a shutdown: for good). Set now,
        before the server starts (a probe never sees SERVING with no engine), then again
        after each change of the fleet's routing or the drain, for Check and Watch alike.
        The empty name stays SERVING while the process runs."""
        self._health = ServiceHealth(health_servicer, SERVICE_NAME, self._fleet_generates)
        self.controller.fleet.registry.on_change(self._health.changed)
        self.controller.on_draining(self._health.changed)
        await self._health.update()

    def _fleet_generates(self) -> bool:
        records = self.controller.fleet.registry.records()
        state = fleet_health_state(self.controller, records, generating=True)
        return state in SERVING_STATES

    async def update_health(self) -> None:
        assert self._health is not None  # set by report_health
        await self._health.update()

    def _stub(self, address: str) -> vpb_grpc.GenerateAsyncStub:
        """Over the fleet's channel to the engine: an engine that left the fleet is a
        KeyError (the relay's "engine left"), and its calls end when the fleet closes it."""
        return vpb_grpc.GenerateStub(self.controller.fleet.channel(address))

    async def Generate(
        self, request: vpb.GenerateRequest, context: Context
    ) -> vpb.GenerateResponse:
        request, query = self._query(request, context)
        last: vpb.GenerateResponse | None = None
        async for response in self.relay.generate(self._unary, request, query, context):
            last = response
        assert last is not None  # the relay yields the reply or aborts the call
        return last

    async def GenerateStream(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        request, query = self._query(request, context)
        async for response in self.relay.generate(self._stream, request, query, context):
            yield response

    def _query(
        self, request: vpb.GenerateRequest, context: Context
    ) -> tuple[vpb.GenerateRequest, PromptInput]:
        """The request as it goes to the engine (with a request id) and its routing input."""
        if not request.request_id:
            named = vpb.GenerateRequest()
            named.CopyFrom(request)
            named.request_id = f"vllm-{uuid.uuid4().hex}"
            request = named
        key = self.controller.config.router.session_metadata_key
        session_key = None
        if key:
            wanted = key.lower()  # gRPC metadata keys are lower case
            session_key = next(
                (str(v) for k, v in context.invocation_metadata() or () if k == wanted), None
            )
        which = request.WhichOneof("prompt")
        return request, PromptInput(
            request_id=request.request_id,
            prompt=request.text if which == "text" else None,
            token_ids=tuple(request.token_ids.ids[:]) if which == "token_ids" else None,
            model=request.model,
            cache_salt=request.kv.cache_salt,
            session_key=session_key,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            bypass_prefix_cache=request.kv.bypass_prefix_cache,
            generate_request=request,
        )
