"""OpenEngine protobuf <-> the engine core's dataclasses (the adapter ring's translation).

`engine_request_from_proto` validates everything a Generate request can get wrong before
acceptance and raises the domain errors of `engine.server.errors` (the servicer's table turns
them into statuses). `GenerateStreamEncoder` turns the core's per-step `RequestOutput`
deltas into GenerateResponse events with the seed's rules: `output_index` always present,
deltas only, one GenerationFinished per output, Usage only on the final response; on a PREFILL
engine, no tokens and a terminal PrefillReady instead of GenerationFinished.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.core.api import (
    Candidate,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuideKind,
    LogprobRequest,
    RequestOutput,
    SamplingDefaults,
    SamplingParams,
    StopKind,
    StopMatch,
    TokenLogprob,
    Usage,
)
from engine.core.errors import InvalidRequestError
from engine.server.errors import (
    ERROR_KIND_CODES,
    FeatureDisabledError,
    ModelNotFoundError,
    RoleMismatchError,
    UnsupportedOptionError,
)
from engine.server.info import LORA_DISABLED_MESSAGE, POOLING_ONLY_MESSAGE, ServedModel
from kvplane.logprobs_asked import contradiction, openengine_asks
from kvplane.tokenize import tokenize_off_loop
from openengine.v1 import openengine_pb2 as pb

TokenText = Callable[[int], str]
Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class EngineContext:
    """What request conversion needs to know about the engine it runs on."""

    model: ServedModel
    role: pb.EngineRole.ValueType
    data_parallel_rank: int
    encode: Encode | None  # None: no tokenizer, text prompts are refused
    # The model's values for the sampling options a request leaves unset (both front ends).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


# OpenEngine's own defaults of the options a request leaves absent, where the model sets none.
OPENENGINE_DEFAULTS = SamplingParams()


def _candidates(selection: pb.CandidateTokenSelection) -> LogprobRequest:
    which = selection.WhichOneof("selection")
    if which == "top_n":
        if selection.top_n == 0:
            raise InvalidRequestError("candidate top_n must be > 0")
        return LogprobRequest(top_n=selection.top_n)
    if which == "token_ids":
        if not selection.token_ids.ids:
            raise InvalidRequestError("candidate token_ids must not be empty")
        return LogprobRequest(token_ids=tuple(selection.token_ids.ids))
    if which == "all":
        return LogprobRequest(all_candidates=True)
    return LogprobRequest()


def _logprob_request(response: pb.ResponseOptions, kind: str) -> LogprobRequest | None:
    """What a request's `response` options ask of its `kind` ("prompt" or "output")
    logprobs, read as the controller routes it (`kvplane.logprobs_asked`): None for none;
    candidates contradicting an explicit false flag are refused."""
    contradicted = contradiction(response, kind)
    if contradicted is not None:
        raise InvalidRequestError(contradicted)
    if not openengine_asks(response, kind):
        return None
    return _candidates(getattr(response, f"{kind}_candidates"))


def _sampling(request: pb.GenerateRequest, defaults: SamplingDefaults) -> SamplingParams:
    """The request's options; an absent one takes the model's default, else OpenEngine's
    (the seed: absent means the engine's default, an explicit zero or false is a value)."""
    s, stop, resp = request.sampling, request.stopping, request.response
    default = defaults.over(OPENENGINE_DEFAULTS)
    stop_texts = tuple(c.stop_text for c in stop.conditions if c.HasField("stop_text"))
    stop_ids = tuple(c.stop_token_id for c in stop.conditions if c.HasField("stop_token_id"))
    if any(c.WhichOneof("condition") is None for c in stop.conditions):
        raise InvalidRequestError("a stop condition sets neither stop_text nor stop_token_id")
    top_k = default.top_k
    if s.HasField("top_k"):
        # 0 and -1 are the engines' spelling of "no top-k": explicit, so over the model's.
        top_k = None if s.top_k in (0, -1) else s.top_k
    max_tokens = stop.max_tokens if stop.HasField("max_tokens") else default.max_tokens
    min_tokens = stop.min_tokens if stop.HasField("min_tokens") else default.min_tokens
    if not stop.HasField("max_tokens") and max_tokens is not None and min_tokens > max_tokens:
        # The core's message would name a max_tokens the client never set.
        raise InvalidRequestError(
            f"min_tokens {min_tokens} exceeds the model's default max_tokens {max_tokens} "
            "(max_new_tokens in its generation_config.json): set max_tokens"
        )
    prompt_lp = _logprob_request(resp, "prompt")
    output_lp = _logprob_request(resp, "output")
    params = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else default.temperature,
        top_p=s.top_p if s.HasField("top_p") else default.top_p,
        top_k=top_k,
        min_p=s.min_p if s.HasField("min_p") else default.min_p,
        frequency_penalty=s.frequency_penalty
        if s.HasField("frequency_penalty")
        else default.frequency_penalty,
        presence_penalty=s.presence_penalty
        if s.HasField("presence_penalty")
        else default.presence_penalty,
        repetition_penalty=s.repetition_penalty
        if s.HasField("repetition_penalty")
        else default.repetition_penalty,
        seed=s.seed if s.HasField("seed") else default.seed,
        num_sequences=s.num_sequences if s.HasField("num_sequences") else default.num_sequences,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop_texts,
        stop_token_ids=stop_ids,
        ignore_eos=stop.ignore_eos,
        include_stop_in_output=stop.include_stop_in_output,
        logprobs=output_lp,
        prompt_logprobs=prompt_lp,
        prompt_logprob_start=resp.prompt_logprob_start,
    )
    params.validate()
    return params


def check_unsupported(request: pb.GenerateRequest, ctx: EngineContext) -> None:
    """Refuse, before acceptance, what this engine does not implement yet."""
    if not ctx.model.generates:  # first: nothing else matters on a pooling-only engine
        raise FeatureDisabledError(POOLING_ONLY_MESSAGE)
    if request.media:
        raise UnsupportedOptionError("media inputs are not supported by this engine")
    if request.lora_name and not ctx.model.supports_lora:
        raise FeatureDisabledError(LORA_DISABLED_MESSAGE)
    # A DECODE engine takes requests with a session and, like vLLM's decode instances,
    # without one (it prefills them itself).
    if request.kv.HasField("session") and ctx.role != pb.ENGINE_ROLE_DECODE:
        role = pb.EngineRole.Name(ctx.role).removeprefix("ENGINE_ROLE_")
        raise RoleMismatchError(f"kv.session is for a DECODE engine; this engine is {role}")


_GUIDED_BACKENDS = ("", "kvplane")


def guided_from_proto(request: pb.GenerateRequest, ctx: EngineContext) -> GuidedDecoding | None:
    """The request's constraint; the core validates its content (pattern, schema, choices)."""
    if not request.HasField("guided"):
        return None
    guided = request.guided
    if not ctx.model.has_tokenizer:
        raise UnsupportedOptionError("guided decoding needs a tokenizer; this engine has none")
    if guided.backend not in _GUIDED_BACKENDS:
        raise UnsupportedOptionError(
            f"guided backend {guided.backend!r}: this engine has only 'kvplane' (or leave it empty)"
        )
    which = guided.WhichOneof("guide")
    if which == "regex":
        return GuidedDecoding(GuideKind.REGEX, guided.regex)
    if which == "json_schema":
        return GuidedDecoding(GuideKind.JSON_SCHEMA, guided.json_schema)
    if which == "choice":
        return GuidedDecoding(GuideKind.CHOICE, choices=tuple(guided.choice.choices))
    if which == "json_object":
        return GuidedDecoding(GuideKind.JSON_OBJECT)
    if which == "ebnf_grammar":
        return GuidedDecoding(GuideKind.EBNF_GRAMMAR, guided.ebnf_grammar)
    supported = "json_schema, regex, choice, json_object, ebnf_grammar"
    if which is None:
        raise InvalidRequestError(f"guided: set one of {supported}")
    raise UnsupportedOptionError(f"guided {which} is not supported; supported modes: {supported}")


async def given_prompt(
    which: str | None, token_ids: Iterable[int], text: str, ctx: EngineContext, *, text_field: str
) -> list[int]:
    """A Generate request's prompt, OpenEngine's or vllm.Generate's (`which`: the set field of
    its prompt oneof, whose text field is `text_field`): the token ids as given, or the text
    tokenised (in a worker thread when long) by an engine with a tokenizer; an engine without
    one refuses text."""
    if which == "token_ids":
        return list(token_ids)
    if which == text_field:
        if ctx.encode is None:
            raise UnsupportedOptionError("this engine has no tokenizer: send token_ids")
        return await tokenize_off_loop(ctx.encode, text)
    raise InvalidRequestError(f"set {text_field} or token_ids")


async def engine_request_from_proto(
    request: pb.GenerateRequest, ctx: EngineContext
) -> EngineRequest:
    """Validate and translate; raises before anything is accepted. A long text prompt is
    tokenised in a worker thread (`kvplane.tokenize`)."""
    if not ctx.model.serves(request.model):
        raise ModelNotFoundError(f"model {request.model!r} is not served here")
    check_unsupported(request, ctx)
    prompt = await given_prompt(
        request.WhichOneof("input"), request.token_ids.ids, request.prompt, ctx, text_field="prompt"
    )
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    kv = request.kv
    if kv.HasField("data_parallel_rank") and kv.data_parallel_rank != ctx.data_parallel_rank:
        raise InvalidRequestError(
            f"kv.data_parallel_rank {kv.data_parallel_rank} is not served here "
            f"(rank {ctx.data_parallel_rank})"
        )
    sampling = _sampling(request, ctx.sampling_defaults)
    if sampling.prompt_logprob_start >= len(prompt) and sampling.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprob_start is past the end of the prompt")
    engine_request = EngineRequest(
        request_id=request.request_id or f"req-{uuid.uuid4().hex}",
        prompt_token_ids=tuple(prompt),
        sampling=sampling,
        priority=request.priority if request.HasField("priority") else 0,
        lora_name=request.lora_name or None,
        # An empty salt is no namespace, as the block keys (and the indexer) take it.
        cache_salt=kv.cache_salt or None,
        bypass_prefix_cache=kv.bypass_prefix_cache,
        guided=guided_from_proto(request, ctx),
    )
    ctx.model.check_request(engine_request)
    return engine_request


def unconverted_request(
    request_id: str, prompt_token_ids: Sequence[int], num_sequences: int, ctx: EngineContext
) -> EngineRequest:
    """A request of either front end whose conversion failed after an Abort, as far as it is
    known without it, to end it aborted (`EngineService.convert`): its prompt the token ids
    sent (none for a text prompt: never taken), its outputs as many as asked for where this
    engine could run that many (`max_num_seqs`), else one."""
    if not 1 <= num_sequences <= ctx.model.max_num_seqs:
        num_sequences = 1
    return EngineRequest(
        request_id, tuple(prompt_token_ids), SamplingParams(num_sequences=num_sequences)
    )


def unconverted_from_proto(request: pb.GenerateRequest, ctx: EngineContext) -> EngineRequest:
    """`unconverted_request` of an OpenEngine Generate (an absent `num_sequences` is one)."""
    sampling = request.sampling
    return unconverted_request(
        request.request_id,
        request.token_ids.ids if request.WhichOneof("input") == "token_ids" else (),
        sampling.num_sequences if sampling.HasField("num_sequences") else 1,
        ctx,
    )


# ------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def _candidate_proto(c: Candidate, token_text: TokenText) -> pb.LogProb:
    out = pb.LogProb(token_id=c.token_id, logprob=c.logprob, token=token_text(c.token_id))
    if c.rank is not None:
        out.rank = c.rank
    return out


def token_info(token_id: int, lp: TokenLogprob | None, token_text: TokenText) -> pb.TokenInfo:
    info = pb.TokenInfo(token_id=token_id, token=token_text(token_id))
    if lp is not None:
        info.logprob = lp.logprob
        info.rank = lp.rank
        info.candidates.extend(_candidate_proto(c, token_text) for c in lp.candidates)
    return info


def _stop_match(match: StopMatch) -> pb.StopMatch:
    if match.kind is StopKind.STOP_TEXT:
        return pb.StopMatch(stop_text=match.text or "")
    if match.kind is StopKind.EOS:
        return pb.StopMatch(eos_token_id=match.token_id or 0)
    return pb.StopMatch(stop_token_id=match.token_id or 0)


def usage_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_prompt_tokens=min(usage.cached_prompt_tokens, usage.prompt_tokens),
    )


class GenerateStreamEncoder:
    """Turns one request's RequestOutputs into GenerateResponse events, enforcing the seed.

    Tracks which outputs have finished so nothing follows a GenerationFinished for its index,
    and `done` once every output has finished (or an error ended the request).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_outputs: int,
        prompt_logprob_start: int,
        token_text: TokenText,
        *,
        kv_session: pb.KvSessionRef | None = None,
    ) -> None:
        """`kv_session` (a PREFILL engine's request): tokens are not sent, and the request's
        normal end is PrefillReady carrying this session (when the core holds it)."""
        self._request_id = request_id
        self._kv_session = kv_session
        self._prompt = prompt_token_ids
        self._num_outputs = num_outputs
        self._prompt_start = prompt_logprob_start
        self._token_text = token_text
        self._finished: set[int] = set()
        self._prompt_sent = False
        self._last_usage: Usage | None = None
        self._error_message: str | None = None
        self._error_code: pb.ErrorCode.ValueType = pb.ERROR_CODE_INTERNAL
        self.done = False

    def encode(self, output: RequestOutput) -> list[pb.GenerateResponse]:
        if self.done or output.output_index in self._finished:
            return []
        if output.usage is not None:
            self._last_usage = output.usage
        events: list[pb.GenerateResponse] = []
        if output.prompt_logprobs is not None and not self._prompt_sent:
            self._prompt_sent = True
            events.append(self._prompt_event(output.prompt_logprobs))
        if output.finish_reason is FinishReason.ERROR or self._error_message is not None:
            # The runner failed: every unfinished output ends with ERROR in the same step, the
            # last one carrying usage. One EngineError (with that usage) stands for them all.
            if self._error_message is None:
                self._error_message = output.message or "generation failed"
                self._error_code = ERROR_KIND_CODES[output.error]
            if output.usage is not None:
                events.append(self.error_event(self._error_code, self._error_message))
            return events
        if self._kv_session is not None:
            if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                events.append(self._prefill_ready_event(output))
            elif output.finish_reason is not None:
                events.append(self._finished_event(output))
            return events
        if output.new_token_ids or output.new_text:
            lps: Sequence[TokenLogprob] = output.logprobs or ()
            tokens = [
                token_info(t, lps[i] if i < len(lps) else None, self._token_text)
                for i, t in enumerate(output.new_token_ids)
            ]
            events.append(
                pb.GenerateResponse(
                    request_id=self._request_id,
                    token=pb.TokenOutput(
                        output_index=output.output_index, tokens=tokens, text=output.new_text
                    ),
                )
            )
        if output.finish_reason is not None:
            events.append(self._finished_event(output))
        return events

    def _prompt_event(self, entries: Sequence[TokenLogprob | None]) -> pb.GenerateResponse:
        tokens = []
        for offset, lp in enumerate(entries):
            position = self._prompt_start + offset
            token_id = self._prompt[position] if position < len(self._prompt) else 0
            tokens.append(token_info(token_id, lp, self._token_text))
        return pb.GenerateResponse(
            request_id=self._request_id, prompt=pb.PromptOutput(tokens=tokens)
        )

    def _finished_event(self, output: RequestOutput) -> pb.GenerateResponse:
        assert output.finish_reason is not None
        self._finished.add(output.output_index)
        finished = pb.GenerationFinished(
            output_index=output.output_index,
            reason=_FINISH[output.finish_reason],
            message=output.message,
        )
        if output.stop_match is not None and output.finish_reason is FinishReason.STOP:
            finished.stop_match.CopyFrom(_stop_match(output.stop_match))
        response = pb.GenerateResponse(request_id=self._request_id, finished=finished)
        if len(self._finished) >= self._num_outputs:
            self.done = True
            if self._last_usage is not None:
                response.usage.CopyFrom(usage_proto(self._last_usage))
        return response

    def _prefill_ready_event(self, output: RequestOutput) -> pb.GenerateResponse:
        """The prefill's end: its KV session, with the Usage of the prompt (the token the pass
        sampled is not the client's: completion_tokens 0)."""
        assert self._kv_session is not None
        if not output.held_kv_session:
            # The prompt was never computed in full, or its adapter's name serves other weights
            # now (the core's message says so): retried unchanged, it can succeed.
            message = output.message or "the prompt's KV could not be held"
            return self.error_event(pb.ERROR_CODE_KV_TRANSFER_FAILED, message, retryable=True)
        self.done = True
        usage = self._last_usage
        response = pb.GenerateResponse(
            request_id=self._request_id,
            prefill_ready=pb.PrefillReady(kv_session=self._kv_session),
        )
        if usage is not None:
            prompt_only = Usage(usage.prompt_tokens, 0, usage.cached_prompt_tokens)
            response.usage.CopyFrom(usage_proto(prompt_only))
        return response

    def error_event(
        self, code: pb.ErrorCode.ValueType, message: str, *, retryable: bool = False
    ) -> pb.GenerateResponse:
        """The terminal EngineError (Usage so far attached when known)."""
        self.done = True
        response = pb.GenerateResponse(
            request_id=self._request_id,
            error=pb.EngineError(code=code, message=message, retryable=retryable),
        )
        if self._last_usage is not None:
            response.usage.CopyFrom(usage_proto(self._last_usage))
        return response
