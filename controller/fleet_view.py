"""What a controller's gateway tells of its fleet to a controller fronting it as an engine:
each model's facts over the engines serving it (`fleet_facts`: what GetModelInfo answers
with: the smallest request limits, or the largest where routing honours each engine's, the
options all take, the summed capacity, ...), and
the version of that view (`fleet_view`: the models the fleet serves, each one's summarised
facts and its engines' own, the controllers it fronts), as a short digest sent in
GetLoad's `attributes` and in GetEngineInfo's trailing metadata under `FLEET_VIEW_KEY`. It
moves only when that view does, not with load or health: an upper controller reads the
identity again when it moves (`Fleet._poll`), so an engine of a new model joining the
lower fleet, the last engine of a model leaving it, or an engine like the others joining
it (the summed capacity moves) reaches the upper's routing at its next GetLoad poll."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import fields

from controller.eligibility import (
    CONTEXT_LIMIT,
    ROUTED_LIMITS,
    ROUTED_OPTIONS,
    PathEngines,
    bounds_of,
    largest_input_context,
    longest_context,
    path_engines,
)
from controller.registry import (
    EngineIdentity,
    EngineRecord,
    EngineState,
    ModelFacts,
    Registry,
    Role,
)

FLEET_VIEW_KEY = "kvplane-fleet-view"


def fleet_view(registry: Registry, decode_engines_prefill: bool) -> str:
    """The digest of what the fleet's engines (those read and not incompatible, as
    GetEngineInfo lists them) tell of themselves, one by one (any of them may answer
    GetModelInfo) and summed up per model (`fleet_facts`: an engine like the others joining
    moves the sums only; `decode_engines_prefill` as routing's)."""
    read = [
        r.identity
        for r in registry.records()
        if r.identity is not None and r.state is not EngineState.INCOMPATIBLE
    ]
    described = sorted({_described(identity) for identity in read})
    models = sorted({m for identity in read for m in identity.models})
    serving = registry.may_serve_records
    summed = [
        f"fleet {model}:{_facts_text(fleet_facts(serving(model), model, decode_engines_prefill))}"
        for model in models
    ]
    return hashlib.sha256("\n".join(described + summed).encode()).hexdigest()[:16]


def fleet_facts(
    records: Iterable[EngineRecord], model: str, decode_engines_prefill: bool
) -> ModelFacts:
    """The fleet's facts of `model` over the read engines of `records` (those that may serve
    it, routable or not: `Registry.may_serve_records`; a request may be routed to any of
    them), as the gateway's GetModelInfo answers
    them: each request limit (REQUEST_LIMITS) the smallest any reports, so that a request
    within them is not refused wherever it goes, but one routing honours per engine
    (controller.eligibility) the largest of the engines routing asks it of, on the path it
    takes (`_routed_path`: the aggregated engines' where one serves the model; of the prompt
    logprobs, those computing a prompt: not a decode engine where decode engines never
    prefill, not `decode_engines_prefill`; `PathEngines.taking`; then the context no more
    than the largest a prefill engine takes, `PathEngines.prefilling`), the context of each no
    more than its KV cache holds (`_served`; for a model with pooling tasks, the smaller of
    the largest a Generate and the largest a pooling task's input is routed to); a request
    option (CAPABILITY_FLAGS, a candidate selection mode: SELECTION_OPTIONS) unsupported
    when one says so (a pooling task's, of those with the task: `ModelFacts.constrains`),
    one routing honours when every engine routing asks it of says so; the model's name
    (`served_name`) while they agree on one; the capacity, `total_kv_blocks` and
    `max_running_requests`, their sum (KV blocks only while they are of one size, else
    None); the block size while they agree on one; the pooling tasks any has; generated
    when any generates it; LoRA supported when an engine generating it says so (False when
    every one says not). None where none reports it."""
    records = list(records)
    serving = [r.identity.facts_of(model) for r in records if r.identity is not None]
    # Where routing honours an engine's limit or option (ROUTED_LIMITS, ROUTED_OPTIONS: a
    # Generate goes only to an engine that takes it), the largest any engine routing asks it
    # of takes (one finishing a Generate, not a prefill engine: alone, it serves none; of the
    # prompt logprobs, one computing a prompt), and an option unsupported only when every
    # such engine says so: as routing judges a request on the path it takes (`_routed_path`).
    engines = _routed_path(records, model or None, decode_engines_prefill)
    routed = bounds_of(engines)
    limits: dict[str, int] = {}
    for facts in serving:
        for path, limit in facts.limits:
            if facts.constrains(path) and (path not in limits or limit < limits[path]):
                limits[path] = limit
    smallest_context = limits.get(CONTEXT_LIMIT)
    # An engine's context as far as its KV cache holds it (`_served`): a controller
    # fronting this one sees the summed cache, not one engine's, and would send it a prompt
    # that no single engine here holds.
    for path in ROUTED_LIMITS:
        largest = _largest(map(_served, engines.taking(path)), path)
        if largest is not None:
            limits[path] = largest
    tasked = [f for f in serving if f.tasks]
    if tasked and smallest_context is not None:
        # A pooling task is routed by its longest input too (`takes_input`): the largest
        # input the engines with a task take (the smallest context where one does not tell
        # its own), and the smaller of that and a Generate's where the model does both.
        pooled = largest_input_context(tasked) or smallest_context
        generated = _largest(map(_served, engines.finishing), CONTEXT_LIMIT)
        limits[CONTEXT_LIMIT] = pooled if generated is None else min(pooled, generated)
    # Where every prompt is computed on a prefill engine (`PathEngines.prefilling`), within
    # the largest context of theirs too: routing refuses a prompt past every one of them,
    # whatever the decode engines take (one telling none may take any).
    prefilling = [_served(f) for f in engines.prefilling]
    if prefilling and CONTEXT_LIMIT in limits and all(CONTEXT_LIMIT in p for p in prefilling):
        prefilled = max(p[CONTEXT_LIMIT] for p in prefilling)
        limits[CONTEXT_LIMIT] = min(limits[CONTEXT_LIMIT], prefilled)
    names = {f.served_name for f in serving if f.served_name}
    seats = [f.max_running_requests for f in serving if f.max_running_requests is not None]
    kv = [f.total_kv_blocks for f in serving if f.total_kv_blocks is not None]
    kv_sizes = {f.block_size for f in serving if f.total_kv_blocks is not None}
    sizes = {f.block_size for f in serving if f.block_size is not None}
    lora = {f.supports_lora for f in serving if f.generates}
    return ModelFacts(
        block_size=next(iter(sizes)) if len(sizes) == 1 else None,
        total_kv_blocks=sum(kv) if kv and len(kv_sizes) == 1 else None,
        supports_lora=True if True in lora else (False if lora == {False} else None),
        tasks=frozenset().union(*(f.tasks for f in serving)),
        generates=any(f.generates for f in serving),
        limits=tuple(sorted(limits.items())),
        max_running_requests=sum(seats) if seats else None,
        unsupported=frozenset(
            flag
            for f in serving
            for flag in f.unsupported
            if f.constrains(flag) and (flag not in ROUTED_OPTIONS or flag in routed.lacked_by_all)
        ),
        served_name=next(iter(names)) if len(names) == 1 else "",
    )


def _routed_path(
    records: list[EngineRecord], model: str | None, decode_engines_prefill: bool
) -> PathEngines:
    """The engines of `model` (`path_engines`) on the path routing takes its requests on
    while its engines are up (`Controller.disaggregated`): the aggregated path's where an
    engine generating it plays an aggregated role (a decode engine's larger limits are none
    of it: routing refuses a request past the aggregated engines'), else every role's."""
    aggregated = path_engines(records, model, Role.AGGREGATED, decode_engines_prefill)
    if aggregated.finishing:
        return aggregated
    return path_engines(records, model, None, decode_engines_prefill)


def _served(facts: ModelFacts) -> dict[str, int]:
    """The limits of the engine of `facts`, by path, its context the longest it serves
    (`CONTEXT_LIMIT`, where it reports it or its KV cache: `longest_context`)."""
    longest = longest_context(facts)
    return dict(facts.limits) if longest is None else {**dict(facts.limits), CONTEXT_LIMIT: longest}


def _largest(served: Iterable[dict[str, int]], path: str) -> int | None:
    """The largest limit at `path` of any of `served` (None: none has it)."""
    return max((limits[path] for limits in served if path in limits), default=None)


def _described(identity: EngineIdentity) -> str:
    """One engine's part of the view, in a canonical text."""
    parts = [f"{model}:{_facts_text(identity.facts_of(model))}" for model in identity.models]
    if identity.is_controller:
        fronted = sorted(identity.fronted_controller_ids | {identity.instance_id})
        parts.append("fronts:" + ",".join(fronted))
    return " ".join(parts)


def _facts_text(facts: ModelFacts) -> str:
    """Every fact of one model, in a canonical text (no set order in it): a fact added to
    ModelFacts is part of the view without more ado."""
    values = (getattr(facts, f.name) for f in fields(facts))
    return ":".join(str(sorted(v)) if isinstance(v, frozenset) else str(v) for v in values)
