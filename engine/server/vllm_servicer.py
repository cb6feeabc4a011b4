"""`vllm.Generate` (vLLM's Rust front end's proto) over the same engine service.

Both RPCs run the request exactly like OpenEngine's Generate. Unset options take the model's
default (its generation_config.json, `EngineContext.sampling_defaults`), else the proto's:
`temperature` absent -> the model's, else 0 (greedy); 0 for top_k/top_p/min_p/
repetition_penalty -> the model's, else "off"; `max_new_tokens` 0 -> the model's
`max_new_tokens`, else 20; `num_sequences` 0 -> 1; `seed` -1 -> none (as vLLM). Penalties of
presence and frequency have no model default (0 is none).
`priority` is vLLM's (a lower value is handled earlier), the opposite of OpenEngine's.
Structured output maps to the engine's guided decoding as OpenEngine's `guided` does (`json`
is a JSON schema, `grammar` an EBNF grammar; `structural_tag` is refused, INVALID_ARGUMENT).
`logit_bias` and `allowed_token_ids` are vLLM's (an id outside the vocabulary
INVALID_ARGUMENT). Unsupported options (KV transfer params) are refused before acceptance like
in OpenEngine, never silently ignored; so, first of all, is any field outside
the seed's schema (today's vLLM proto adds `lora_name`, `session_id`, ...): both methods are
strict (`kvplane.request_decoding`). This proto has no error event: a
failure after acceptance ends the stream with gRPC INTERNAL. Logprobs are sent only when
asked for (`output_logprobs`, `prompt_logprobs`); a candidate selection without them is
ignored, as vLLM's server does. A prompt position without a logprob (the first prompt
token) reports logprob 0.0 and rank 0 (as vLLM's server), so that the arrays stay aligned
with `token_ids`.

Streaming: the first response carries `prompt_info` (with prompt logprobs asked for, the
first one that has them, or the first to end a sequence: a request aborted before its prefill
has none); each response carries one
SequenceOutput delta; a sequence's last one carries `finish_info`. As in vLLM's output, a
matched stop token (EOS, a stop id) is sent in `token_ids` (with its logprob) whether or not
`include_stop_strings` is set (which decides only whether its text is in `text`), so the
chunks' `num_tokens` add up to `finish_info.num_output_tokens`. Unary Generate collects
everything into one response and so supports one sequence only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health

from engine.core.api import (
    Candidate,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
    StopKind,
    TokenLogprob,
)
from engine.core.errors import InvalidRequestError
from engine.server.engine_service import EngineService
from engine.server.errors import (
    FeatureDisabledError,
    ModelNotFoundError,
    RoleMismatchError,
    grpc_status_for_kind,
)
from engine.server.info import POOLING_ONLY_MESSAGE
from engine.server.openengine_convert import (
    EngineContext,
    given_prompt,
    guided_from_proto,
    unconverted_request,
)
from engine.server.openengine_servicer import refuse
from kvplane.logprobs_asked import vllm_asks
from kvplane.prompt_truncation import kept_prompt
from kvplane.server import Service, ServiceHealth, abort_with
from openengine.v1 import openengine_pb2 as oe
from vllm_grpc import vllm_grpc_pb2 as pb
from vllm_grpc import vllm_grpc_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME = "vllm.Generate"
DEFAULT_MAX_NEW_TOKENS = 20
# This proto's own defaults of what a request leaves unset, where the model sets none.
VLLM_DEFAULTS = SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_NEW_TOKENS)
MODEL_MAX_NEW_TOKENS = ": the model's max_new_tokens, in its generation_config.json"

_FINISH = {
    FinishReason.STOP: pb.FinishInfo.STOP,
    FinishReason.LENGTH: pb.FinishInfo.LENGTH,
    FinishReason.CANCELLED: pb.FinishInfo.ABORTED,
}


def _candidates(select: pb.CandidateTokens) -> LogprobRequest:
    which = select.WhichOneof("select")
    if which == "top_n" and select.top_n > 0:
        return LogprobRequest(top_n=select.top_n)
    if which == "token_ids" and select.token_ids.ids:
        return LogprobRequest(token_ids=tuple(select.token_ids.ids))
    if which == "all" and select.all:
        return LogprobRequest(all_candidates=True)
    return LogprobRequest()


def _logprobs(response: pb.ResponseOptions, kind: str) -> LogprobRequest | None:
    """Candidates are extras of the logprobs, as in vLLM's server: without `output_logprobs`
    (`prompt_logprobs`) a candidate selection is ignored and neither is computed or sent
    (`kvplane.logprobs_asked`, the controller's reading too)."""
    if not vllm_asks(response, kind):
        return None
    return _candidates(getattr(response, f"{kind}_candidates"))


def _structured_output(dec: pb.DecodingParameters, ctx: EngineContext) -> GuidedDecoding | None:
    """vLLM's structured output as OpenEngine's `guided` (the same checks and refusals)."""
    which = dec.WhichOneof("structured_output")
    if which is None:
        return None
    guided = oe.GuidedDecoding()
    if which == "json":
        guided.json_schema = dec.json
    elif which == "choice":
        guided.choice.choices.extend(dec.choice.choices)
    elif which == "json_object" and dec.json_object:
        guided.json_object.SetInParent()
    elif which == "json_object":
        return None  # json_object = false: no constraint
    elif which == "grammar":
        guided.ebnf_grammar = dec.grammar
    else:
        setattr(guided, which, getattr(dec, which))  # regex, structural_tag: same names
    return guided_from_proto(oe.GenerateRequest(guided=guided), ctx)


def generate_refusal(ctx: EngineContext) -> FeatureDisabledError | RoleMismatchError | None:
    """Why this engine refuses every vllm.Generate (None: it takes them): a pooling-only
    model, or a disaggregated role."""
    if not ctx.model.generates:
        return FeatureDisabledError(POOLING_ONLY_MESSAGE)
    if ctx.role != oe.ENGINE_ROLE_AGGREGATED:
        return RoleMismatchError("vllm.Generate runs on an AGGREGATED engine only")
    return None


async def engine_request_from_vllm(
    request: pb.GenerateRequest, ctx: EngineContext
) -> EngineRequest:
    if not ctx.model.serves(request.model):
        raise ModelNotFoundError(f"model {request.model!r} is not served here")
    refusal = generate_refusal(ctx)
    if refusal is not None:
        raise refusal
    dec = request.decoding
    if request.kv.HasField("kv_transfer_params") and request.kv.kv_transfer_params.fields:
        raise RoleMismatchError(
            "vLLM's kv_transfer_params are not supported: KV moves between engines through "
            "OpenEngine's kv.session"
        )
    prompt = await given_prompt(
        request.WhichOneof("prompt"), request.token_ids.ids, request.text, ctx, text_field="text"
    )
    prompt = list(kept_prompt(prompt, request.truncate_prompt_tokens))
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    s, stop, resp = request.sampling, request.stopping, request.response
    default = ctx.sampling_defaults.over(VLLM_DEFAULTS)
    max_new_tokens = stop.max_new_tokens or default.max_tokens or DEFAULT_MAX_NEW_TOKENS
    if stop.min_new_tokens > max_new_tokens:
        # In this proto's names (the core's check would say min_tokens/max_tokens), and
        # naming the default a client that set no maximum may not know.
        source = "" if ctx.sampling_defaults.max_tokens is None else MODEL_MAX_NEW_TOKENS
        unset = "" if stop.max_new_tokens else f" (0 means {max_new_tokens}{source})"
        raise InvalidRequestError(
            f"min_new_tokens {stop.min_new_tokens} exceeds max_new_tokens "
            f"{stop.max_new_tokens}{unset}"
        )
    params = SamplingParams(
        temperature=request.temperature if request.HasField("temperature") else default.temperature,
        # "0 means default": the model's, else off.
        top_p=s.top_p or default.top_p,
        top_k=s.top_k or default.top_k,
        min_p=s.min_p or default.min_p,
        frequency_penalty=dec.frequency_penalty,
        presence_penalty=dec.presence_penalty,
        repetition_penalty=dec.repetition_penalty or default.repetition_penalty,
        # vLLM's SamplingParams reads seed -1 as no seed.
        seed=s.seed if s.HasField("seed") and s.seed != -1 else None,
        num_sequences=s.num_sequences or 1,
        max_tokens=max_new_tokens,
        min_tokens=stop.min_new_tokens,
        stop=tuple(stop.stop_strings),
        stop_token_ids=tuple(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        include_stop_in_output=stop.include_stop_strings,
        emit_stop_token=True,
        logprobs=_logprobs(resp, "output"),
        prompt_logprobs=_logprobs(resp, "prompt"),
        logit_bias=tuple(sorted(dec.logit_bias.items())),
        allowed_token_ids=tuple(dec.allowed_token_ids) or None,  # empty: unset
    )
    params.validate()
    engine_request = EngineRequest(
        request_id=request.request_id or f"vllm-{uuid.uuid4().hex}",
        prompt_token_ids=tuple(prompt),
        sampling=params,
        priority=-request.priority,  # vLLM's: lower is handled earlier; the core's: larger
        cache_salt=request.kv.cache_salt or None,
        bypass_prefix_cache=request.kv.bypass_prefix_cache,
        guided=_structured_output(dec, ctx),
    )
    ctx.model.check_request(engine_request)
    return engine_request


def _candidate_info(candidates: Sequence[Candidate]) -> pb.CandidateTokenInfo:
    return pb.CandidateTokenInfo(
        tokens=[
            pb.CandidateTokenInfo.TokenInfo(id=c.token_id, logprob=c.logprob, rank=c.rank or 0)
            for c in candidates
        ]
    )


@dataclass
class _SequenceState:
    num_output_tokens: int = 0


@dataclass
class VllmStreamEncoder:
    """RequestOutputs -> vllm GenerateResponses (see the module docstring)."""

    request: pb.GenerateRequest
    engine_request: EngineRequest
    sequences: dict[int, _SequenceState] = field(default_factory=dict)
    prompt_sent: bool = False

    def prompt_info(self, prompt_logprobs: Sequence[TokenLogprob | None] | None) -> pb.PromptInfo:
        resp = self.request.response
        prompt = self.engine_request.prompt_token_ids
        info = pb.PromptInfo(num_prompt_tokens=len(prompt))
        if resp.prompt_token_ids:
            info.token_ids.extend(prompt)
        if prompt_logprobs is not None:
            for entry in prompt_logprobs:
                # No logprob (the first position): 0.0 with rank 0, as vLLM's server sends it
                # (a real position's rank is >= 1), so that a sum over the arrays stays finite.
                info.logprobs.append(0.0 if entry is None else entry.logprob)
                info.ranks.append(0 if entry is None else entry.rank)
                if resp.HasField("prompt_candidates"):
                    info.candidate_tokens.append(
                        _candidate_info(() if entry is None else entry.candidates)
                    )
        return info

    def encode(self, output: RequestOutput) -> pb.GenerateResponse:
        resp = self.request.response
        state = self.sequences.setdefault(output.output_index, _SequenceState())
        state.num_output_tokens += len(output.new_token_ids)
        seq = pb.SequenceOutput(index=output.output_index, num_tokens=len(output.new_token_ids))
        if not resp.HasField("output_text") or resp.output_text:
            seq.text = output.new_text
        if resp.output_token_ids:
            seq.token_ids.extend(output.new_token_ids)
        if output.logprobs is not None:
            seq.logprobs.extend(lp.logprob for lp in output.logprobs)
            seq.ranks.extend(lp.rank for lp in output.logprobs)
            if resp.HasField("output_candidates"):
                seq.candidate_tokens.extend(
                    _candidate_info(lp.candidates) for lp in output.logprobs
                )
        if output.finish_reason is not None and output.finish_reason is not FinishReason.ERROR:
            match = output.stop_match
            # Every generated token was emitted (`emit_stop_token`), so the chunks add up.
            finish = pb.FinishInfo(
                num_output_tokens=state.num_output_tokens,
                finish_reason=_FINISH[output.finish_reason],
            )
            if match is not None and output.finish_reason is FinishReason.STOP:
                if match.kind is StopKind.STOP_TEXT:
                    finish.stop_string = match.text or ""
                elif match.kind is StopKind.EOS:
                    finish.eos_token_id = match.token_id or 0
                else:
                    finish.stop_token_id = match.token_id or 0
            seq.finish_info.CopyFrom(finish)
        response = pb.GenerateResponse(outputs=seq)
        if not self.prompt_sent and (
            self.engine_request.sampling.prompt_logprobs is None
            or output.prompt_logprobs is not None
            or output.finish_reason is not None  # ended (aborted) before its prefill
        ):
            self.prompt_sent = True
            response.prompt_info.CopyFrom(self.prompt_info(output.prompt_logprobs))
        return response


class VllmGenerateServicer(pb_grpc.GenerateServicer):
    def __init__(self, service: EngineService, ctx: EngineContext) -> None:
        self._service = service
        self._ctx = ctx
        self._health: ServiceHealth | None = None

    async def report_health(self, health_servicer: health.aio.HealthServicer) -> None:
        """Keep `grpc.health.v1`'s status for `vllm.Generate` on `health_servicer` to whether
        the engine takes new Generate requests now (`EngineService.serving`; a pooling-only
        or disaggregated engine never does: `generate_refusal`), as vLLM's server turns its
        service NOT_SERVING when its engine fails or shuts down: this proto has no health of
        its own for a client to read. Set now, before the server starts
        (`Service.reports_own_health`): NOT_SERVING until the engine thread runs
        (`update_health` once it does), so a probe never reads SERVING while OpenEngine
        Health is not READY yet; then NOT_SERVING, for good, once it takes no new requests (a
        drain, a shutdown, its engine thread ended). The empty name stays SERVING while the
        process runs."""
        self._health = ServiceHealth(health_servicer, SERVICE_NAME, self._takes_generate)
        self._service.on_serving_changed(self._health.changed)
        await self._health.update()

    def _takes_generate(self) -> bool:
        return self._service.serving and generate_refusal(self._ctx) is None

    async def update_health(self) -> None:
        assert self._health is not None  # set by report_health
        await self._health.update()

    def service(self) -> Service:
        return Service(
            SERVICE_NAME,
            lambda server: pb_grpc.add_GenerateServicer_to_server(self, server),
            strict_methods=frozenset({"Generate", "GenerateStream"}),
            reports_own_health=True,
        )

    async def _run(
        self, request: pb.GenerateRequest, context: Context, *, single: bool
    ) -> AsyncIterator[pb.GenerateResponse]:
        async def conversion() -> EngineRequest:
            engine_request = await engine_request_from_vllm(request, self._ctx)
            if single and engine_request.sampling.num_sequences > 1:
                raise InvalidRequestError("unary Generate returns one sequence: use GenerateStream")
            return engine_request

        def unconverted() -> EngineRequest:
            # The token ids sent, as the engine keeps them (none for a text prompt: never taken).
            sent = request.token_ids.ids if request.WhichOneof("prompt") == "token_ids" else ()
            prompt = kept_prompt(sent, request.truncate_prompt_tokens)
            num_sequences = 1 if single else request.sampling.num_sequences or 1
            return unconverted_request(request.request_id, prompt, num_sequences, self._ctx)

        try:
            engine_request, aborted = await self._service.convert(
                request.request_id, conversion, unconverted
            )
            if not aborted:
                stream = self._service.submit(engine_request)
        except Exception as exc:
            await refuse(context, exc)
        encoder = VllmStreamEncoder(request, engine_request)
        if aborted:  # aborted while converted: the core never had it
            for output in self._service.aborted_before_prefill(engine_request):
                yield encoder.encode(output)
            return
        try:
            async for output in stream.outputs():
                if output.finish_reason is FinishReason.ERROR:
                    await abort_with(
                        context,
                        grpc_status_for_kind(output.error),
                        output.message or "generation failed",
                    )
                yield encoder.encode(output)
        finally:
            if not stream.done:
                self._service.cancel_nowait(engine_request.request_id)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self._run(request, context, single=False):
            yield response

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        merged = pb.GenerateResponse()
        seq = merged.outputs
        async for response in self._run(request, context, single=True):
            if response.HasField("prompt_info"):
                merged.prompt_info.CopyFrom(response.prompt_info)
            part = response.outputs
            seq.text += part.text
            seq.num_tokens += part.num_tokens
            seq.token_ids.extend(part.token_ids)
            seq.logprobs.extend(part.logprobs)
            seq.ranks.extend(part.ranks)
            seq.candidate_tokens.extend(part.candidate_tokens)
            if part.HasField("finish_info"):
                seq.finish_info.CopyFrom(part.finish_info)
        return merged
