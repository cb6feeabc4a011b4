"""Which engines serving a model can take a Generate, by what each one's GetModelInfo told
(the registry's `ModelFacts`, read with its identity: nothing is asked per request). Engines
of one model may differ in limits and options (a long-context engine beside short ones, one
with guided decoding beside one without): a request past one engine's limit, or using an
option it reports unsupported, is routed among those that take it; past every engine's
limit, it is refused before any engine is asked, INVALID_ARGUMENT (as an engine refuses it),
naming the limit and the largest the fleet has (an option every engine lacks, or a limit of
engines that are all alike, is left to the engine to refuse, in its own words). What the
fleet takes is what the engines finishing a Generate on the request's path take: on the
aggregated path (taken while an aggregated engine is routable) the aggregated engines'
(and those telling no role, which routing takes for any), else the aggregated and decode
engines' (a prefill engine's limits bound its own hop only, since prefill engines alone
serve none).

What is checked (`ROUTED_LIMITS`, `ROUTED_OPTIONS`): the context (a prompt's tokens and the
output it must produce, one token or `min_tokens`, within `max_context_length`, as an
engine checks it), the KV cache (`KV_CACHE_LIMIT`: the prompt and that output but its last
token within the engine's whole cache, `total_kv_blocks` blocks of `kv_block_size`, as an
engine refuses a prompt that "does not fit the KV cache"; a kvplane engine reports a context
no longer than its cache holds, another engine may not), both only where the gateway knows
the prompt's tokens (token ids, or a text prompt with a tokenizer; else, on a disaggregated
fleet, the decode engine is chosen by the prompt's tokens the prefill engine told at its
handoff: `Eligibility.with_prompt`, so a prompt is never handed to a decode engine too small
for it; and where an engine refuses such a prompt INVALID_ARGUMENT, maybe for its length,
it goes to one taking a longer context: `Eligibility.past_refusal`; its `min_tokens` alone
is judged all the same, a context the prompt can only lengthen), the number of
outputs, the logprob candidates, and the options a request uses (text or token input,
logprobs, read as the engine reads them: `kvplane.logprobs_asked`, their candidates'
selection mode, where an engine lists its modes, guided decoding,
priority, stop in output, cache salt, prefix cache bypass).
Every hop's engine is checked alike, but for the output a prefill engine's hop produces:
the prompt and one token, whatever `min_tokens` asks, and for the prompt logprobs a decode
engine is never asked where decode engines never prefill a prompt themselves
(`RequestNeeds.on_hop_of`; the fleet's largest prompt logprobs are then those of the engines
computing a prompt, `bounds_of`). An engine
that does not report a limit or an option may take any. `max_output_tokens` is not: an
engine caps an output at its context (LENGTH). An OpenEngine Generate and a `vllm.Generate`
are read alike (`needs_of`: each API's fields read into `_Asks`, judged by one set of rules,
`_needs`).

A pooling task (Embed, Classify, Score) is routed alike by its longest input, where the
gateway knows its tokens (token ids, or text it tokenises), to an engine with the task whose
context takes it (`takes_input`, the engine's own check: each input within its model's
length); past every such engine's, refused INVALID_ARGUMENT naming the largest
(`largest_input_context`). Where the engines with the task tell one context, no input is
read (the engine refuses one past it). One whose text input is not tokenised here, refused
INVALID_ARGUMENT, goes to an engine taking a longer input, as a Generate's prompt does
(`past_input_refusal`, the same rule as `past_refusal`).

Cheap on the routing path: each model's bounds over its engines (`_Bounds`) are kept until
the registry changes; where its engines are alike (none would be chosen over another) a
request is not even read, and one within the smallest limits using no option an engine
lacks passes with no look at its candidates."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from controller.model_info import (
    CAPABILITY_FLAGS,
    REQUEST_LIMITS,
    SELECTION_OPTIONS,
    selection_option,
)
from controller.registry import EngineRecord, ModelFacts, Registry, RegistryMemo, Role
from controller.router import Candidate
from kvplane.errors import KvplaneError
from kvplane.logprobs_asked import KINDS, openengine_asks, vllm_asks
from openengine.v1 import openengine_pb2 as pb
from vllm_grpc import vllm_grpc_pb2 as vpb

CONTEXT_LIMIT = "max_context_length"
# ModelInfo's limits (REQUEST_LIMITS) that routing honours per engine: the context and
# generation's. Not `max_output_tokens` (an engine caps an output at its context), nor a
# pooling task's (a pooling task is routed by its inputs' context only: `takes_input`).
ROUTED_LIMITS = tuple(
    path for path in REQUEST_LIMITS if path == CONTEXT_LIMIT or path.startswith("generation.")
)
# ModelInfo's flags (CAPABILITY_FLAGS) of the request options routing honours per engine:
# the input kinds and generation's options (not multimodal input, nor a pooling task's).
# And the logprobs' candidate selection modes (SELECTION_OPTIONS), read from the lists of them
# GetModelInfo gives.
ROUTED_OPTIONS = (
    *(
        flag
        for flag in CAPABILITY_FLAGS
        if flag in ("supports_text_input", "supports_token_ids_input")
        or flag.startswith("generation.")
    ),
    *SELECTION_OPTIONS,
)


# The KV cache a request needs, in tokens, against an engine's whole cache (GetModelInfo's
# `total_kv_blocks` of `kv_block_size` tokens; unknown where either is not reported): not a
# ModelInfo field, so not of ROUTED_LIMITS (what GetModelInfo advertises), but checked as
# they are.
KV_CACHE_LIMIT = "kv_cache_tokens"


def limits_of(facts: ModelFacts) -> dict[str, int]:
    """The limits of the engine of `facts` routing honours, by path: what it reports and its
    KV cache (`KV_CACHE_LIMIT`) where it tells its size."""
    limits = dict(facts.limits)
    if facts.total_kv_blocks is not None and facts.block_size is not None:
        limits[KV_CACHE_LIMIT] = facts.total_kv_blocks * facts.block_size
    return limits


def longest_context(facts: ModelFacts) -> int | None:
    """The longest context (a prompt and the output it must produce) the engine of `facts`
    takes: its `max_context_length`, but no more than its whole KV cache holds (a request's
    KV is its context less its last token, `KV_CACHE_LIMIT`); None where it tells neither."""
    limits = limits_of(facts)
    ends = [limits[CONTEXT_LIMIT]] if CONTEXT_LIMIT in limits else []
    if KV_CACHE_LIMIT in limits:
        ends.append(limits[KV_CACHE_LIMIT] + 1)
    return min(ends) if ends else None


def input_context(facts: ModelFacts) -> int | None:
    """The longest pooling task input (Embed, Classify, Score), in tokens, the engine of
    `facts` takes, as it checks one (engine/server/pooling_tasks.py: each input within its
    model's length; an input has no output token and enters no KV cache): its context (None:
    not told, it may take any). A generating engine's context bound by its KV cache
    (`total_kv_blocks` x `kv_block_size` + 1, engine/server/info.py) says nothing of its
    model's length, which bounds its pooling inputs: not told either."""
    context = dict(facts.limits).get(CONTEXT_LIMIT)
    if (
        context is not None
        and facts.generates
        and facts.total_kv_blocks is not None
        and facts.block_size is not None
        and context == facts.total_kv_blocks * facts.block_size + 1
    ):
        return None
    return context


def takes_input(facts: ModelFacts, input_tokens: int | None) -> bool:
    """Whether the engine of `facts` takes a pooling task whose longest input has
    `input_tokens` tokens (None: not known, any may)."""
    context = None if input_tokens is None else input_context(facts)
    return context is None or input_tokens is None or input_tokens <= context


def largest_input_context(tasked: Iterable[ModelFacts]) -> int | None:
    """The largest pooling input the engines of `tasked` (those with a task) take, where
    each tells it (`input_context`); None where one does not (it may take any) or there are
    none."""
    contexts = [input_context(f) for f in tasked]
    if not contexts or None in contexts:
        return None
    return max(c for c in contexts if c is not None)


class BeyondFleetError(KvplaneError):
    """A request past a limit of every engine serving its model: INVALID_ARGUMENT, as an
    engine refuses it."""


class RequestNeeds(NamedTuple):
    """What a Generate asks of the engine taking it (a named tuple: one per request)."""

    # (ROUTED_LIMITS path, the least value an engine's limit must have), but the context.
    limits: tuple[tuple[str, int], ...] = ()
    # ROUTED_OPTIONS the request uses.
    options: frozenset[str] = frozenset()
    # The output it must produce at least (`min_tokens`, one token at least): its context is
    # its prompt's tokens and these.
    min_output_tokens: int = 1

    def with_prompt(self, prompt_tokens: int) -> RequestNeeds:
        """With the context and the KV cache its prompt of `prompt_tokens` needs (in place of
        any it had: a prompt of 0 tokens, its output alone, where its length was not known):
        the KV of every output token but the last (a sampled token's KV is computed only to
        sample the next), as an engine checks it."""
        context = prompt_tokens + self.min_output_tokens
        prompt = ((CONTEXT_LIMIT, context), (KV_CACHE_LIMIT, context - 1))
        rest = tuple(limit for limit in self.limits if limit[0] not in _PROMPT_LIMITS)
        return RequestNeeds((*prompt, *rest), self.options, self.min_output_tokens)

    def on_hop_of(self, record: EngineRecord, decode_engines_prefill: bool) -> RequestNeeds:
        """What the engine of `record` must take of it on its own hop: a PREFILL engine
        computes the prompt and samples one token, never sent, whatever output the request
        must produce (engine/server/kv_transfer.py `prefill_request`), so its context and
        KV cache need the prompt and one token alone; a DECODE engine, where decode engines
        never prefill a prompt themselves (not `decode_engines_prefill`: no
        `router.skip_prefill_ratio`), is handed the prompt's KV and never asked its prompt
        logprobs (the prefill engine's hop sends them: `Handoff.with_session`), so it needs
        none of them (`PROMPT_LOGPROBS`); any other engine, all of it."""
        identity = record.identity
        role = None if identity is None else identity.role
        if role is Role.DECODE and not decode_engines_prefill:
            return RequestNeeds(
                tuple(limit for limit in self.limits if limit[0] not in PROMPT_LOGPROBS),
                self.options - PROMPT_LOGPROBS,
                self.min_output_tokens,
            )
        fewer = self.min_output_tokens - 1
        if not fewer or role is not Role.PREFILL:
            return self
        limits = tuple(
            (path, need - fewer) if path in _PROMPT_LIMITS else (path, need)
            for path, need in self.limits
        )
        return RequestNeeds(limits, self.options)


# The limits a request's context needs (`RequestNeeds.with_prompt`).
_PROMPT_LIMITS = (CONTEXT_LIMIT, KV_CACHE_LIMIT)
# The limit and the options of a request's prompt logprobs (`supported`, the candidate
# selection modes): needed of the engine computing its prompt, not of a decode engine handed
# its KV (`RequestNeeds.on_hop_of`).
PROMPT_LOGPROBS = frozenset(
    path
    for path in (*ROUTED_LIMITS, *ROUTED_OPTIONS)
    if path.startswith("generation.prompt_logprobs.")
)


NO_NEEDS = RequestNeeds()
# The option of each input kind (an OpenEngine Generate's `input`, a vllm.Generate's `prompt`).
_INPUT_OPTIONS = {
    "prompt": "supports_text_input",
    "text": "supports_text_input",
    "token_ids": "supports_token_ids_input",
}
# The needs of most requests: their input kind only (built once, not per request).
_PLAIN: dict[str | None, RequestNeeds] = {
    None: NO_NEEDS,
    **{kind: RequestNeeds(options=frozenset({o})) for kind, o in _INPUT_OPTIONS.items()},
}


class _Asks(NamedTuple):
    """What a Generate asks of the engine taking it, whichever API it came by (read only
    where its model's engines differ), for the one set of rules (`_needs`)."""

    input: str | None  # its input's kind (`_INPUT_OPTIONS`; None: none given)
    num_sequences: int
    # ("prompt" or "output", how its candidates are selected: of SELECTION_MODES, None for
    # no candidates, the top_n candidates asked: 0 for none) of each logprobs asked
    logprobs: tuple[tuple[str, str | None, int], ...]
    guided: bool
    priority: bool
    stop_in_output: bool
    cache_salt: bool
    bypass_prefix_cache: bool
    min_tokens: int  # the output it must produce at least (0: none asked)


def _needs(asks: _Asks) -> RequestNeeds:
    """The limits and options (of ROUTED_LIMITS, ROUTED_OPTIONS) a request asking `asks`
    needs of an engine."""
    limits: list[tuple[str, int]] = []
    options: set[str] = set()
    if asks.input is not None:
        options.add(_INPUT_OPTIONS[asks.input])
    if asks.num_sequences > 1:
        limits.append(("generation.max_num_sequences", asks.num_sequences))
    for kind, selection, top_n in asks.logprobs:
        options.add(f"generation.{kind}_logprobs.supported")
        if selection is not None:
            options.add(selection_option(kind, selection))
        if top_n:
            limits.append((f"generation.{kind}_logprobs.max_top_n", top_n))
    for asked, option in (
        (asks.guided, "generation.guided_decoding.supported"),
        (asks.priority, "generation.supports_priority"),
        (asks.stop_in_output, "generation.supports_stop_in_output"),
        (asks.cache_salt, "generation.supports_cache_salt"),
        (asks.bypass_prefix_cache, "generation.supports_prefix_cache_bypass"),
    ):
        if asked:
            options.add(option)
    return RequestNeeds(tuple(limits), frozenset(options), max(1, asks.min_tokens))


def needs_of(request: pb.GenerateRequest | vpb.GenerateRequest) -> RequestNeeds:
    """What a Generate asks, an OpenEngine one or a `vllm.Generate` (its context:
    `RequestNeeds.with_prompt`, once its prompt's tokens are known). A request using no
    option but its input (most) is told at a glance."""
    if isinstance(request, vpb.GenerateRequest):
        return _vllm_needs(request)
    sampling, stopping, kv = request.sampling, request.stopping, request.kv
    if not (
        request.HasField("response")
        or request.HasField("guided")
        or request.HasField("priority")
        or sampling.num_sequences > 1
        or stopping.min_tokens
        or stopping.include_stop_in_output
        or kv.bypass_prefix_cache
        or kv.HasField("cache_salt")
    ):
        return _PLAIN[request.WhichOneof("input")]
    return _needs(
        _Asks(
            input=request.WhichOneof("input"),
            num_sequences=sampling.num_sequences,
            logprobs=_logprobs_asked(
                request.response, openengine_asks, "selection", lambda _: True
            ),
            guided=request.HasField("guided") and request.guided.WhichOneof("guide") is not None,
            priority=request.HasField("priority"),
            stop_in_output=stopping.include_stop_in_output,
            cache_salt=kv.HasField("cache_salt"),
            bypass_prefix_cache=kv.bypass_prefix_cache,
            min_tokens=stopping.min_tokens,
        )
    )


def _logprobs_asked(
    response: Any, asks: Callable[[Any, str], bool], selection: str, selects: Callable[[Any], bool]
) -> tuple[tuple[str, str | None, int], ...]:
    """("prompt" or "output", how its candidates are selected, the top_n candidates asked: 0
    for none) of each logprobs a request's `response` options ask for, as the engine reads
    its API's (`asks`, of `kvplane.logprobs_asked`; `selection` the oneof of its candidates'
    selection; `selects` whether a selection set asks candidates: a vLLM `top_n` of 0, an
    empty `token_ids` or `all` false does not)."""
    asked = []
    for kind in KINDS:
        if asks(response, kind):
            candidates = getattr(response, f"{kind}_candidates")
            which = candidates.WhichOneof(selection) if selects(candidates) else None
            asked.append((kind, which, candidates.top_n if which == "top_n" else 0))
    return tuple(asked)


def _vllm_selects(candidates: vpb.CandidateTokens) -> bool:
    """Whether a `vllm.Generate`'s candidate selection asks any candidates, as the engine
    reads it (engine/server/vllm_servicer.py: a `top_n` of 0, no `token_ids`, `all` false
    ask none)."""
    return bool(candidates.top_n or candidates.token_ids.ids or candidates.all)


def _vllm_needs(request: vpb.GenerateRequest) -> RequestNeeds:
    """`needs_of` a `vllm.Generate`: at a glance where it asks nothing but its input (no
    response options, structured output, priority, sequences, minimum, stop in output, salt
    or cache bypass), else by reading it whole (`_vllm_asks`)."""
    sampling, stopping, kv = request.sampling, request.stopping, request.kv
    if not (
        request.HasField("response")
        or request.decoding.WhichOneof("structured_output")
        or request.priority
        or sampling.num_sequences > 1
        or stopping.min_new_tokens
        or stopping.include_stop_strings
        or kv.bypass_prefix_cache
        or kv.cache_salt
    ):
        return _PLAIN[request.WhichOneof("prompt")]
    return _needs(_vllm_asks(request))


def _vllm_asks(request: vpb.GenerateRequest) -> _Asks:
    """What a `vllm.Generate` asks, as the engine reads it (engine/server/vllm_servicer.py:
    `num_sequences` 0 is 1; candidates only with their logprobs, a `top_n` of 0 none;
    `json_object` false no structured output; `priority` 0 none; an empty `cache_salt`
    none)."""
    decoding = request.decoding
    structured = decoding.WhichOneof("structured_output")
    return _Asks(
        input=request.WhichOneof("prompt"),
        num_sequences=request.sampling.num_sequences,
        logprobs=_logprobs_asked(request.response, vllm_asks, "select", _vllm_selects),
        guided=structured is not None and (structured != "json_object" or decoding.json_object),
        priority=request.priority != 0,
        stop_in_output=request.stopping.include_stop_strings,
        cache_salt=bool(request.kv.cache_salt),
        bypass_prefix_cache=request.kv.bypass_prefix_cache,
        min_tokens=request.stopping.min_new_tokens,
    )


def unmet(facts: ModelFacts, needs: RequestNeeds) -> str | None:
    """The first limit or option of `needs` the engine of `facts` does not take (None: it
    takes the request)."""
    reported = limits_of(facts)
    for path, need in needs.limits:
        limit = reported.get(path)
        if limit is not None and need > limit:
            return path
    return next((o for o in sorted(needs.options) if o in facts.unsupported), None)


class _Bounds(NamedTuple):
    """A model's limits and options over the engines generating it."""

    # each ROUTED_LIMITS path (and KV_CACHE_LIMIT) some engine reports: the smallest
    smallest: dict[str, int]
    # Where every engine finishing a Generate (`generating_facts`) reports it: the largest
    # (of `PROMPT_LOGPROBS`, where every engine computing a prompt does).
    largest: dict[str, int]
    # Of the limits a prompt needs (CONTEXT_LIMIT, KV_CACHE_LIMIT), where every prompt is
    # computed on a prefill engine (`PathEngines.prefilling`) and every one reports it: the
    # largest, which a prompt and one token must fit.
    largest_prefill: dict[str, int]
    lacked_by_one: frozenset[str]  # ROUTED_OPTIONS some engine reports unsupported
    # ROUTED_OPTIONS every engine finishing a Generate reports unsupported (of
    # `PROMPT_LOGPROBS`, every engine computing a prompt).
    lacked_by_all: frozenset[str]
    # Every engine reports the same limits and lacks the same options: none is chosen over
    # another, and a request past them is refused by whichever engine it goes to.
    alike: bool


class PathEngines(NamedTuple):
    """The facts of a model on the engines of one path of a request (`path_engines`)."""

    serving: list[ModelFacts]  # every engine generating it
    # Those finishing a Generate themselves (no prefill engine): what the fleet takes.
    finishing: list[ModelFacts]
    # Those computing a prompt: what the fleet takes of its prompt logprobs.
    prompting: list[ModelFacts]
    # Where every engine computing a prompt is a prefill engine (decode engines never
    # prefill: no `router.skip_prefill_ratio`), those: every prompt must fit one of them, by
    # its own hop (the prompt and one token, `RequestNeeds.on_hop_of`); else none.
    prefilling: list[ModelFacts]

    def taking(self, path: str) -> list[ModelFacts]:
        """The engines whose limit or option at `path` (of ROUTED_LIMITS, ROUTED_OPTIONS) is
        what the fleet takes: those computing a prompt for `PROMPT_LOGPROBS`, else those
        finishing a Generate."""
        return self.prompting if path in PROMPT_LOGPROBS else self.finishing


def path_engines(
    serving: Iterable[EngineRecord],
    model: str | None,
    role: Role | None,
    decode_engines_prefill: bool,
) -> PathEngines:
    """The facts of `model` on the read engines of `serving` (`generating_facts`) of `role`
    (None: every role), by what each does on a request's path: where decode engines never
    prefill a prompt (not `decode_engines_prefill`: no `router.skip_prefill_ratio`), a
    decode engine computes no prompt (`RequestNeeds.on_hop_of`), the others all do (and
    where none of those finishes a Generate, they are the `prefilling` engines every prompt
    must fit); else those finishing a Generate compute its prompt."""
    records = list(serving)
    finishing = generating_facts(records, model, finishing=True, role=role)
    prompting = finishing
    prefilling: list[ModelFacts] = []
    if not decode_engines_prefill:
        computing = [r for r in records if r.identity is None or r.identity.role is not Role.DECODE]
        prompting = generating_facts(computing, model, role=role)
        if len(generating_facts(computing, model, finishing=True, role=role)) == 0:
            prefilling = prompting
    return PathEngines(
        generating_facts(records, model, role=role), finishing, prompting, prefilling
    )


def bounds_of(engines: PathEngines) -> _Bounds:
    """The bounds over the engines serving a model on a path (`path_engines`): the smallest
    of every one, and the largest and the options lacked by all of those each limit or
    option is taken by (`PathEngines.taking`)."""
    serving = engines.serving
    smallest: dict[str, int] = {}
    largest: dict[str, int] = {}
    reported = [limits_of(f) for f in serving]
    for path in (*ROUTED_LIMITS, KV_CACHE_LIMIT):
        values = [limits[path] for limits in reported if path in limits]
        if values:
            smallest[path] = min(values)
        taking = engines.taking(path)
        ends = [limits[path] for limits in map(limits_of, taking) if path in limits]
        if ends and len(ends) == len(taking):
            largest[path] = max(ends)
    prefill_limits = [limits_of(f) for f in engines.prefilling]
    largest_prefill = {
        path: max(limits[path] for limits in prefill_limits)
        for path in _PROMPT_LIMITS
        if prefill_limits and all(path in limits for limits in prefill_limits)
    }
    lacked_by_one = frozenset().union(*(f.unsupported for f in serving)) & set(ROUTED_OPTIONS)
    lacked_by_all = (_lacked_by_all(engines.finishing) - PROMPT_LOGPROBS) | (
        _lacked_by_all(engines.prompting) & PROMPT_LOGPROBS
    )
    kinds = {
        (
            frozenset((p, v) for p, v in limits.items() if p in smallest),
            f.unsupported & lacked_by_one,
        )
        for f, limits in zip(serving, reported, strict=True)
    }
    return _Bounds(
        smallest, largest, largest_prefill, lacked_by_one, lacked_by_all, alike=len(kinds) <= 1
    )


def _lacked_by_all(engines: list[ModelFacts]) -> frozenset[str]:
    """ROUTED_OPTIONS every one of `engines` reports unsupported (none: none)."""
    lacked = [f.unsupported.intersection(ROUTED_OPTIONS) for f in engines]
    return frozenset.intersection(*lacked) if lacked else frozenset()


def generating_facts(
    serving: Iterable[EngineRecord],
    model: str | None,
    finishing: bool = False,
    role: Role | None = None,
) -> list[ModelFacts]:
    """The facts of `model` on each read engine of `serving` (those that may serve it,
    routable or not: `Registry.may_serve_records`) that generates it, of `role` (None: any;
    an engine telling no role is of any, as routing takes it: `EngineIdentity.plays`); with
    `finishing`, of those that finish a Generate themselves, its output theirs: not a
    PREFILL engine (prefill engines alone serve no Generate: a request past every decode
    engine's context is served by none, whatever the prefill engines take)."""
    return [
        facts
        for r in serving
        if r.identity is not None
        and r.identity.plays(role)
        and not (finishing and r.identity.role is Role.PREFILL)
        and (facts := r.identity.facts_of(model)).generates
    ]


def lack_of(
    record: EngineRecord, model: str | None, needs: RequestNeeds, decode_engines_prefill: bool
) -> str | None:
    """What the engine of `record` lacks for a request of `needs` on its hop ("max_context_length
    1024 < 8192", "generation.supports_priority false"; `RequestNeeds.on_hop_of`); None where
    it takes it (`unmet`), or its identity is not read."""
    if record.identity is None:
        return None
    facts = record.identity.facts_of(model)
    hop = needs.on_hop_of(record, decode_engines_prefill)
    path = unmet(facts, hop)
    if path is None:
        return None
    need = dict(hop.limits).get(path)
    return f"{path} {limits_of(facts).get(path)} < {need}" if need is not None else f"{path} false"


def _lacks(
    records: Iterable[EngineRecord],
    model: str | None,
    needs: RequestNeeds,
    decode_engines_prefill: bool,
) -> list[str]:
    """What each of `records` lacks for a request of `needs` ("small max_context_length 1024
    < 8192"), of those that lack anything."""
    return [
        f"{record.engine_id} {lack}"
        for record in records
        if (lack := lack_of(record, model, needs, decode_engines_prefill)) is not None
    ]


def _past_context(
    refused_by: EngineRecord | None,
    model: str | None,
    context_of: Callable[[ModelFacts], int | None],
) -> int | None:
    """The least context a request the engine of `refused_by` refused, its length not known
    here, needs where the refusal may be of its length: one token past that engine's
    (`context_of` its facts of `model`); None where it tells none (or is gone)."""
    if refused_by is None or refused_by.identity is None:
        return None
    context = context_of(refused_by.identity.facts_of(model))
    return None if context is None else context + 1


class Eligibility:
    """The engines that can take a request, among a model's candidates (see the module doc)."""

    def __init__(self, registry: Registry, *, decode_engines_prefill: bool) -> None:
        self.registry = registry
        # Whether a decode engine may prefill a prompt itself (`Router.decode_engines_prefill`):
        # then it computes the prompt logprobs a request asks, else never (`on_hop_of`).
        self.decode_engines_prefill = decode_engines_prefill
        # Per model and path (`_of`): the aggregated path's, and every role's.
        self._bounds = RegistryMemo(registry, self._bounds_of)

    def _of(self, model: str | None, role: Role | None) -> _Bounds:
        """The bounds over the engines of `model` a request on the path of `role` may go to
        (`Controller.plan`'s): Role.AGGREGATED, aggregated engines alone, and those telling
        no role, which routing takes for any (a request goes there while one is routable,
        never to a decode engine: a limit only a decode engine has is none of its path's);
        None, every role (a disaggregated request, taken while no aggregated engine is
        routable: one that would take it is out of routing)."""
        return self._bounds.get((model, role))

    def _bounds_of(self, path: tuple[str | None, Role | None]) -> _Bounds:
        """`_of` (model, role), from every engine."""
        model, role = path
        serving = self.registry.may_serve_records(model)
        return bounds_of(path_engines(serving, model, role, self.decode_engines_prefill))

    def candidates(
        self,
        model: str | None,
        role: Role | None,
        candidates: tuple[Candidate, ...],
        request: pb.GenerateRequest | vpb.GenerateRequest | None,
        prompt_tokens: int | None,
        *,
        refuse_beyond: bool = True,
    ) -> tuple[tuple[Candidate, ...], RequestNeeds]:
        """Those of `candidates` (engines serving `model`, on the path of `role`: `_of`)
        that take the request (`request`: an OpenEngine Generate or a vllm.Generate, None for
        neither; `prompt_tokens`: its prompt's tokens, None when not known: then the context
        and KV cache of its `min_tokens` alone are judged), and what it needs (NO_NEEDS where
        the path's engines are alike: it is not read then).
        BeyondFleetError when it is past a limit of every engine of the path generating the
        model, routable or not (one that takes it but takes no traffic now leaves none: the
        caller's UNAVAILABLE). An option every such engine lacks does not count: any engine
        refuses it, in its own words (`this engine has no tokenizer: send token_ids`).
        Without `refuse_beyond` (admin `match`, which lists each engine with the limit it
        lacks), no candidate then, rather than the error."""
        bounds = self._of(model, role)
        if bounds.alike:
            return candidates, NO_NEEDS
        needs = NO_NEEDS if request is None else needs_of(request)
        if prompt_tokens is not None:
            needs = needs.with_prompt(prompt_tokens)
        elif needs.min_output_tokens > 1:
            needs = needs.with_prompt(0)  # the output it must produce: what is known of it
        return self._taking(model, bounds, candidates, needs, refuse_beyond=refuse_beyond)

    def past_refusal(
        self,
        model: str | None,
        role: Role | None,
        candidates: tuple[Candidate, ...],
        needs: RequestNeeds,
        refused_by: str,
    ) -> tuple[tuple[Candidate, ...], RequestNeeds] | None:
        """After the engine `refused_by` refused a request of `needs` INVALID_ARGUMENT, its
        prompt's tokens not known here (a text prompt not tokenised): where that may be the
        prompt's length, past the engine's `longest_context`, those of `candidates` that take
        a longer context than it, and the needs that says (a context of one token more, at
        least). None where it cannot help: the path's engines alike (any would refuse it
        alike), the engine telling no limit, or no engine of the path taking a longer
        context (the refusal stands: its own words name the largest limit)."""
        bounds = self._of(model, role)
        if bounds.alike:
            return None
        record = self.registry.by_engine_id(refused_by)
        past = _past_context(record, model, longest_context)
        if past is None or record is None:
            return None
        # The least prompt past it, by what its own hop took (a prefill engine's: the prompt
        # and one token, `RequestNeeds.on_hop_of`).
        needs = needs.with_prompt(
            past - needs.on_hop_of(record, self.decode_engines_prefill).min_output_tokens
        )
        try:
            return self._taking(model, bounds, candidates, needs)
        except BeyondFleetError:
            return None

    def past_input_refusal(
        self, model: str, refused_by: str, tasked: Iterable[ModelFacts]
    ) -> int | None:
        """`past_refusal` of a pooling task (Embed, Classify, Score) the engine `refused_by`
        refused INVALID_ARGUMENT, the tokens of some text input not known here: the input
        length it must be routed as, one token past that engine's (`input_context`), where
        one of the engines with the task (`tasked`, their facts) takes it; None where none
        does, or that engine tells no context (the refusal stands)."""
        past = _past_context(self.registry.by_engine_id(refused_by), model, input_context)
        largest = largest_input_context(tasked)
        if past is None or (largest is not None and past > largest):
            return None
        return past

    def with_prompt(
        self,
        model: str | None,
        candidates: tuple[Candidate, ...],
        needs: RequestNeeds,
        prompt_tokens: int,
    ) -> tuple[Candidate, ...]:
        """Those of `candidates` that take a request of `needs` (its plan's, which did not
        know its prompt's tokens: a text prompt not tokenised here) whose prompt is
        `prompt_tokens` long, as a prefill engine told at its handoff: a decode engine whose
        context or KV cache cannot hold it is not chosen. BeyondFleetError as `candidates`,
        and when none of `candidates` takes it, naming what each lacks."""
        bounds = self._of(model, None)
        if bounds.alike:
            return candidates
        needs = needs.with_prompt(prompt_tokens)
        taking = self._taking(model, bounds, candidates, needs)[0]
        if candidates and not taking:
            records = (self.registry.by_engine_id(c.engine_id) for c in candidates)
            read = (r for r in records if r is not None)
            told = _lacks(read, model, needs, self.decode_engines_prefill)
            raise BeyondFleetError(
                f"no decode engine takes the prompt of {prompt_tokens} tokens: {', '.join(told)}"
            )
        return taking

    def _taking(
        self,
        model: str | None,
        bounds: _Bounds,
        candidates: tuple[Candidate, ...],
        needs: RequestNeeds,
        *,
        refuse_beyond: bool = True,
    ) -> tuple[tuple[Candidate, ...], RequestNeeds]:
        smallest = bounds.smallest
        for path, need in needs.limits:
            if need > smallest.get(path, need):
                break
        else:
            if not needs.options & bounds.lacked_by_one:
                return candidates, needs  # every engine takes it
        if refuse_beyond:
            self._refuse_beyond(model, bounds, needs)
        needs = needs._replace(options=needs.options - bounds.lacked_by_all)
        out = []
        for candidate in candidates:
            record = self.registry.by_engine_id(candidate.engine_id)
            if record is None or record.identity is None:
                continue
            if (
                unmet(
                    record.identity.facts_of(model),
                    needs.on_hop_of(record, self.decode_engines_prefill),
                )
                is None
            ):
                out.append(candidate)
        return tuple(out), needs

    def lacking(
        self, model: str | None, role: Role | None, needs: RequestNeeds, lora_name: str = ""
    ) -> str:
        """What each engine of `role` (None: any) taking traffic for `model` (holding the
        LoRA adapter `lora_name`, when one is named) lacks for a request of `needs` ("": none
        lacks anything): why routing found none to take it, though one not taking traffic
        now would. Those that take it but do not hold the adapter are named as such: the
        adapter narrowed the candidates to those that do not take it."""
        routable = self.registry.routable(model, role, generating=True)
        holding = [r for r in routable if not lora_name or r.holds_lora(lora_name)]
        told = _lacks(holding, model, needs, self.decode_engines_prefill)
        if not told:
            return ""
        adapter = f" with LoRA adapter {lora_name!r}" if lora_name else ""
        why = f"those taking traffic{adapter} do not take the request: " + ", ".join(told)
        without = [
            r.engine_id
            for r in routable
            if r not in holding
            and r.identity is not None
            and unmet(r.identity.facts_of(model), needs.on_hop_of(r, self.decode_engines_prefill))
            is None
        ]
        if without:
            why += f"; it would go to {', '.join(without)}, which do not hold {lora_name!r}"
        return why

    @staticmethod
    def _refuse_beyond(model: str | None, bounds: _Bounds, needs: RequestNeeds) -> None:
        named = f"model {model!r}" if model else "the default model"
        for path, need in needs.limits:
            largest = bounds.largest.get(path)
            if largest is not None and need > largest:
                raise BeyondFleetError(
                    f"the request needs {path} {need}; the largest any engine serving "
                    f"{named} takes is {largest}"
                )
        # Its prompt, on a prefill engine's hop (the prompt and one token).
        fewer = needs.min_output_tokens - 1
        for path, need in needs.limits:
            largest = bounds.largest_prefill.get(path)
            if largest is not None and need - fewer > largest:
                raise BeyondFleetError(
                    f"the request's prompt needs {path} {need - fewer} of a prefill engine "
                    f"(its prompt and one token); the largest any prefill engine serving "
                    f"{named} takes is {largest} (decode engines never prefill a prompt here: "
                    "no router.skip_prefill_ratio)"
                )
