"""The controller process's service layer: the fleet, the router, the index and the metrics,
and the one path every routed request takes (tokenise -> keys -> index match -> route).

`Controller.start()` opens the index, starts polling every configured engine and a task that
refreshes the index-size metrics; `close()` cancels all of it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from controller.config import ControllerConfig
from controller.eligibility import NO_NEEDS, Eligibility, RequestNeeds
from controller.fleet import BLIND_WARNING_INTERVAL_S, Fleet, PromptView, ThrottledWarning
from controller.membership import Membership
from controller.metrics import ControllerMetrics
from controller.registry import (
    EngineRecord,
    EngineState,
    NoEngineRegisteredError,
    Role,
    UnknownModelError,
)
from controller.replica_sync import ReplicaSync, open_replica_sync
from controller.router import (
    AllEnginesBusyError,
    Candidate,
    Decision,
    DisaggDecision,
    Hop,
    NoEngineAvailableError,
    Reason,
    Router,
    RouteRequest,
    make_policy,
)
from controller.tokenizers import ModelTokenizers
from indexer.backend import IndexBackend, IndexStats, ReachableIndex, index_answers
from indexer.backends import open_backend
from indexer.size_gauges import refresh_wait_s
from indexer.sources.resync import connect_resync
from kvplane.prompt_truncation import kept_prompt
from kvplane.tokenize import tokenize_all_off_loop
from openengine.v1 import openengine_pb2 as pb
from vllm_grpc import vllm_grpc_pb2 as vpb

log = logging.getLogger(__name__)

INDEX_STATS_INTERVAL_S = 5.0
STATS_CANCEL_WAIT_S = 1.0


class PromptInput(NamedTuple):
    """A request's prompt and routing context, as the gateways hand it over (a named tuple:
    one is built on every routed request)."""

    request_id: str
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    model: str = ""
    lora_name: str = ""
    cache_salt: str = ""
    session_key: str | None = None
    # vllm.Generate's truncate_prompt_tokens: the engine keeps the last N prompt tokens (0: all),
    # so the router matches those, not the prompt as sent.
    truncate_prompt_tokens: int = 0
    # `kv.bypass_prefix_cache`: the engine reads no cached prefix for it (RouteRequest.reads_cache).
    bypass_prefix_cache: bool = False
    # The Generate it came as, OpenEngine's or vllm.Generate's (None: admin route): what it
    # asks of the engine taking it, read where its model's engines differ
    # (controller.eligibility: only engines that take it are candidates).
    generate_request: pb.GenerateRequest | vpb.GenerateRequest | None = None


class Plan(NamedTuple):
    """A prompt ready to route (a named tuple: one is built on every routed request)."""

    request: RouteRequest
    view: PromptView
    # False: a text prompt with no tokenizer for its model, or longer than
    # `tokenize_max_chars`, so the router could not see the cache.
    tokenized: bool
    model: str = ""  # as the request named it ("": the default model)
    lora_name: str = ""  # the LoRA adapter it names ("": none)
    # What it asks of the engine taking it (its candidates take it: controller.eligibility;
    # NO_NEEDS where its model's engines are alike).
    needs: RequestNeeds = NO_NEEDS
    # The role of the engines it may go to (`Controller.plan`'s; None: any, a disaggregated
    # request's prefill and decode engines).
    role: Role | None = Role.AGGREGATED


def _takes_now(record: EngineRecord | None, lora_name: str) -> bool:
    """Whether the engine of `record` (None: it left) takes requests now, and holds the LoRA
    adapter `lora_name` ("": none named)."""
    return (
        record is not None and record.routable and (not lora_name or record.holds_lora(lora_name))
    )


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        index: IndexBackend | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._own_index = index is None
        self.index = index
        self.rng = rng or random.Random(config.router.seed)
        self.clock = clock
        self.router = Router(
            make_policy(config.router.policy, config.router.weights()),
            busy=config.router.busy(),
            pending_ttl_s=config.router.pending_ttl_s,
            approximate_ttl_s=config.router.approximate_ttl_s,
            skip_prefill_ratio=(
                math.inf
                if config.router.skip_prefill_ratio is None
                else config.router.skip_prefill_ratio
            ),
        )
        # The gateway's GetEngineInfo names it; the fleet refuses an engine that answers with it.
        self.instance_id = f"controller-{uuid.uuid4().hex[:8]}"
        self.fleet = Fleet(
            config,
            index,
            clock=clock,
            on_engine_gone=self._engine_gone,
            on_cache_predicted=self.router.predict_cache,
            hit_worth=self.router.policy.hit_worth,
            on_event_lag=self._event_lag,
            on_implausible_event_stamp=self._implausible_event_stamp,
            instance_id=self.instance_id,
        )
        self.eligibility = Eligibility(
            self.fleet.registry, decode_engines_prefill=self.router.decode_engines_prefill
        )
        self.metrics = ControllerMetrics(
            self.fleet.registry,
            self.fleet.event_counters,
            index_answers=lambda: index_answers(self.reachable_index()),
            index_keying_mismatch=lambda: self.index_keying_mismatch() is not None,
            events_following=self.fleet.event_following,
        )
        self._tokenizers = ModelTokenizers({})
        self._stats_task: asyncio.Task[None] | None = None
        # An index that cannot answer is asked every 5 s and at every ListWorkers (the live
        # status of `kvplane up` lists them every second): one warning at most per interval.
        self._stats_failed = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock, log)
        # Set by the gateway's Drain and at the start of a shutdown (`stop_accepting`), and
        # never cleared: a drained controller refuses new requests (and admin Route explains
        # none) until it restarts, as a drained engine does.
        self.draining = False
        self._on_draining: list[Callable[[], None]] = []
        self.replica_sync: ReplicaSync | None = None
        # RegisterEngine, RemoveEngine and cordons: shared with the other replicas on Redis.
        self.membership = Membership(self.fleet, config)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (`draining`), telling those who asked
        (`on_draining`) once."""
        if self.draining:
            return
        self.draining = True
        for changed in self._on_draining:
            changed()

    def on_draining(self, changed: Callable[[], None]) -> None:
        """Call `changed` when the controller stops accepting new requests."""
        self._on_draining.append(changed)

    async def start(self) -> None:
        self._tokenizers = ModelTokenizers.load(self.config.tokenizers, self.config.tokenizer)
        if self.index is None and self.config.index.remote is None:
            index = self.config.index
            self.index = await open_backend(index.backend, **index.backend_options())
            self.fleet.index = self.index
            # A shared index that dropped or lost an engine's entries: its source rebuilds them.
            connect_resync(self.index, self.fleet.source_of)
        await self.fleet.start()
        await self.membership.start()
        if self.config.router.replica_sync:
            self.replica_sync = open_replica_sync(self.config, self.router, self.instance_id)
            await self.replica_sync.start()
            self.metrics.watch_replica_sync(self.replica_sync)
        self._stats_task = asyncio.create_task(self._refresh_index_stats(), name="index stats")

    async def close(self) -> None:
        if self.replica_sync is not None:
            await self.replica_sync.close()
        if self._stats_task is not None:
            self._stats_task.cancel()
            # A shared backend may finish its current command before it sees the cancel.
            await asyncio.wait([self._stats_task], timeout=STATS_CANCEL_WAIT_S)
        await self.membership.close()
        await self.fleet.close()
        if self._own_index and self.index is not None:
            await self.index.close()

    def _engine_gone(self, address: str) -> None:
        """The engine left the fleet, or a new process of it came: the router forgets it;
        its metrics' series, by its address, go only with the engine (a counter of
        Prometheus' never goes back: a new process's batches are counted on)."""
        self.router.forget_engine(address)
        if all(record.address != address for record in self.fleet.registry.records()):
            self.metrics.forget_engine(address)

    def _event_lag(self, address: str, lag_s: float) -> None:
        self.metrics.observe_event_lag(address, lag_s)

    def _implausible_event_stamp(self, address: str) -> None:
        self.metrics.count_implausible_event_stamp(address)

    async def tokenize(self, prompt: str, model: str = "") -> list[int] | None:
        """`prompt` in `model`'s tokens; None when no tokenizer is configured for it or the
        prompt is longer than `tokenize_max_chars` (routed by load only). A long prompt is
        tokenised in a worker thread (`kvplane.tokenize`)."""
        tokens = await self.tokenize_all((prompt,), model)
        return None if tokens is None else tokens[0]

    async def tokenize_all(self, texts: Sequence[str], model: str = "") -> list[list[int]] | None:
        """Each of `texts` (a pooling task's inputs) in `model`'s tokens; None when no
        tokenizer is configured for it or they are longer together than `tokenize_max_chars`.
        Long together, they are tokenised in one worker thread (`kvplane.tokenize`)."""
        if sum(map(len, texts)) > self.config.tokenize_max_chars:
            return None
        encode = functools.partial(self._tokenizers.encode, model=model)
        tokens = await tokenize_all_off_loop(encode, texts)
        known = [t for t in tokens if t is not None]
        return known if len(known) == len(tokens) else None

    async def plan(
        self, query: PromptInput, role: Role | None = Role.AGGREGATED, *, cordoned: bool = False
    ) -> Plan:
        """The prompt as the router sees it (with `cordoned`, admin `match` only, never a
        routed request: cordoned engines among the candidates, and aside, `out_of_routing`,
        the engines out of routing for their state and those that do not take the prompt)."""
        tokens: Sequence[int] | None = query.token_ids
        tokenized = tokens is not None
        if tokens is None and query.prompt is not None:
            tokens = await self.tokenize(query.prompt, self._tokenizer_name(query))
            tokenized = tokens is not None
        if tokens is not None:
            tokens = kept_prompt(tokens, query.truncate_prompt_tokens)
        view = await self.fleet.prompt_view(
            tokens,
            model=query.model,
            lora_name=query.lora_name,
            cache_salt=query.cache_salt,
            role=role,
            cordoned=cordoned,
        )
        # No tokenizer: a rough size (4 characters a token) keeps the load terms meaningful.
        num_tokens = len(tokens) if tokens is not None else max(1, len(query.prompt or "") // 4)
        # Only the engines that take it (BeyondFleetError: none serving the model can, but
        # to admin `match`, which lists each with what it lacks); its context only where its
        # tokens are known.
        eligible, needs = self.eligibility.candidates(
            query.model or None,
            role,
            view.candidates,
            query.generate_request,
            num_tokens if tokens is not None else None,
            refuse_beyond=not cordoned,
        )
        if eligible is not view.candidates:
            # Admin `match` (`cordoned`) lists those that do not take it too, aside with the
            # engines out of routing: never the router's candidates.
            not_taking = tuple(c for c in view.candidates if c not in eligible) if cordoned else ()
            view = view._replace(
                candidates=eligible, out_of_routing=(*not_taking, *view.out_of_routing)
            )
        request = RouteRequest(
            query.request_id,
            num_tokens,
            view.block_size,
            view.block_keys,
            self._session_of(query),
            reads_cache=not query.bypass_prefix_cache,
        )
        return Plan(request, view, tokenized, query.model, query.lora_name, needs, role)

    def _session_of(self, query: PromptInput) -> str | None:
        """The router's session key of the request: its session per model, a request naming
        no model being the default model's (`Registry.default_model`). A client's session
        (one conversation, one user) may ask two models; each model's turns stick to an
        engine of that model, where its cache is, and a turn of the other model does not move
        them (one key for both had each turn stick the session to the other model's engine,
        so the next turn of the first was routed afresh). A newline cannot occur in a gRPC
        metadata value, so no session of one model reads as another's. ModelRequiredError
        when the engines' default models came to differ since the request's model was
        checked (`check_model`; an engine of another model read while it was planned)."""
        if not query.session_key:
            return query.session_key
        model = self._served_model(query)
        return f"{model}\n{query.session_key}" if model else query.session_key

    def _served_model(self, query: PromptInput) -> str:
        """The model whose engines serve `query`: the one it names, else the fleet's default
        model (`Registry.default_model`; "" while no engine's models are known). A text
        prompt naming no model is tokenised with this model's tokenizer, the one the engine
        that serves it uses (the controller-wide `tokenizer:` split it otherwise, into tokens
        that never match what the engines hold). ModelRequiredError when the engines' default
        models differ (`_session_of`)."""
        return query.model or self.fleet.registry.default_model(generating=True) or ""

    def _tokenizer_name(self, query: PromptInput) -> str:
        """The model name whose tokenizer (`tokenizers:`) splits `query`'s text prompt as the
        engine serving it does (`tokenizer_name` of its model, `_served_model`)."""
        return self.tokenizer_name(self._served_model(query))

    def tokenizer_name(self, model: str) -> str:
        """The model name whose tokenizer (`tokenizers:`) splits text for `model` as its
        engines do: `model`'s own, else, for an alias of a model (`served_model_aliases`), the
        model's it stands for; otherwise `model` (the controller-wide `tokenizer:`)."""
        if self._tokenizers.has_own(model):
            return model
        return self.fleet.registry.served_name(model) or model

    def check_model(self, model: str, *, generating: bool = False) -> None:
        """Raise UnknownModelError when no engine of the fleet serves `model`, whatever its
        health: NOT_FOUND, as an engine answers, where routing would say only that no engine
        is available now (UNAVAILABLE: worth retrying). A fleet with no engine at all cannot
        tell (just started, its planner's engines not registered again yet):
        NoEngineRegisteredError, UNAVAILABLE. No model named is the default model, which an
        empty fleet may still get, and which must be one model: ModelRequiredError
        (INVALID_ARGUMENT) when the engines serve different models to a request naming none
        (`Registry.default_model`). With `generating` (a Generate, or admin
        route/match), also GenerationUnsupportedError when every engine serving it is
        pooling-only: FAILED_PRECONDITION, it will never generate there."""
        registry = self.fleet.registry
        if not model:
            registry.default_model(generating=generating)
        if model and not registry.may_serve(model):
            if len(registry) == 0:
                raise NoEngineRegisteredError(
                    f"no engine is registered yet: model {model!r} may be served once one is "
                    "(retry)"
                )
            raise UnknownModelError(f"no engine serves model {model!r}")
        if generating:
            self.fleet.registry.check_generates(model)

    @property
    def sheds_load(self) -> bool:
        """Whether a new request whose every engine is busy is refused (AllEnginesBusyError,
        `router.reject_when_all_busy`). Only a new request: a retry, or the decode hop after
        a prefill, was admitted already, and refusing it would throw away what it holds."""
        return self.config.router.reject_when_all_busy

    def route(self, plan: Plan, exclude: frozenset[str] = frozenset()) -> Decision:
        # Not the engines that already failed it (a retry), nor those out of routing since
        # the plan was made: its index match may have waited on a shared or remote index
        # while a drain, a cordon, a health answer or a removal came. With no such change
        # since (`Registry.version`; the usual case: a plan takes well under a millisecond
        # with the embedded index), the plan's candidates stand as they are, without a
        # registry lookup for each (at hundreds of engines, 6% of the routing path).
        if not exclude and plan.view.registry_version == self.fleet.registry.version:
            candidates = plan.view.candidates
        else:
            candidates = tuple(
                c
                for c in plan.view.candidates
                if c.engine_id not in exclude and self._routable(c, plan.lora_name)
            )
        if not candidates and plan.lora_name:
            self._check_lora_still_held(plan)
        if not candidates and not exclude:
            raise NoEngineAvailableError(self._why_unavailable(plan))
        with self._counting_refusal():
            decision = self.router.route(
                plan.request,
                candidates,
                self.rng,
                self.clock(),
                reject_when_all_busy=self.sheds_load and not exclude,
            )
        self.metrics.count_decision(decision.policy, decision.reason.value, Hop.AGGREGATED)
        return decision

    def _why_unavailable(self, plan: Plan) -> str:
        """Each engine serving the plan's model and its state, and, of those taking traffic,
        what each lacks for the request (`Eligibility.lacking`)."""
        why = self.fleet.registry.why_unavailable(plan.model)
        model = plan.model or None
        lacking = self.eligibility.lacking(model, plan.role, plan.needs, plan.lora_name)
        return f"{why}; {lacking}" if lacking else why

    def past_refusal(self, plan: Plan, engine: str) -> frozenset[str] | None:
        """After `engine` refused the plan's request INVALID_ARGUMENT before anything was
        relayed, its prompt's tokens not known here (`plan.tokenized` False): where the
        refusal may be for the prompt's length and an engine of its path takes a longer
        context (`Eligibility.past_refusal`), the plan's candidates that do not (excluded
        from its next route: the request goes to one that does); None where none does (the
        refusal stands). NoEngineAvailableError when only engines out of routing now do
        (the plan's candidates may have left routing since), naming what each taking
        traffic lacks."""
        found = self.eligibility.past_refusal(
            plan.model or None, plan.role, plan.view.candidates, plan.needs, engine
        )
        if found is None:
            return None
        taking, needs = found
        if not any(self._routable(c, plan.lora_name) for c in taking):
            raise NoEngineAvailableError(self._why_unavailable(plan._replace(needs=needs)))
        kept = {c.engine_id for c in taking}
        return frozenset(c.engine_id for c in plan.view.candidates if c.engine_id not in kept)

    @contextmanager
    def _counting_refusal(self) -> Iterator[None]:
        """Count a request refused because every engine is busy among the decisions."""
        try:
            yield
        except AllEnginesBusyError:
            self.metrics.count_decision(self.router.policy.name, Reason.OVERLOADED.value, Hop.NONE)
            raise

    # ---- disaggregated fleets (prefill and decode engines) ----

    def disaggregated(self, model: str) -> bool:
        """Whether requests for `model` take the prefill -> decode path: no aggregated engine
        can take them and a decode engine can (plan those with `role=None`)."""
        registry = self.fleet.registry
        return not registry.any_routable(
            model or None, Role.AGGREGATED, generating=True
        ) and registry.any_routable(model or None, Role.DECODE, generating=True)

    def check_disaggregated_lora(self, plan: Plan) -> None:
        """Raise the LoraRoutingError of a request naming a LoRA adapter that no routable
        decode engine holds (its decode runs with the adapter), or no prefill engine when
        decode engines never prefill (no `skip_prefill_ratio`): said before any hop runs, as
        for an aggregated request (NOT_FOUND, FAILED_PRECONDITION or UNAVAILABLE), not as
        "no decode engine available" while decode engines without the adapter are idle."""
        if not plan.lora_name:
            return
        roles = [Role.DECODE] + ([Role.PREFILL] if self.router.skip_prefill_ratio > 1 else [])
        for role in roles:
            if not self._of_role(plan, role):
                self.fleet.registry.check_lora(plan.lora_name, plan.model or None, role)

    def route_disaggregated(self, plan: Plan) -> DisaggDecision:
        """The first hop: a prefill engine by the policy, or the decode engine when it holds
        `router.skip_prefill_ratio` of the prompt (or no prefill engine is up). A LoRA
        adapter no engine of a needed role holds raises (`check_disaggregated_lora`)."""
        self.check_disaggregated_lora(plan)
        with self._counting_refusal():
            placement = self._first_hop(plan, charge=True)
        for decision, hop in (
            (placement.prefill, Hop.PREFILL),
            (placement.decode, Hop.DECODE_PREFILL),
        ):
            if decision is not None:
                self.metrics.count_decision(decision.policy, decision.reason.value, hop)
        return placement

    def _first_hop(self, plan: Plan, *, charge: bool) -> DisaggDecision:
        return self.router.route_disaggregated(
            plan.request,
            self._of_role(plan, Role.PREFILL),
            self._of_role(plan, Role.DECODE),
            self.rng,
            self.clock(),
            reject_when_all_busy=self.sheds_load,
            charge=charge,
        )

    @property
    def prefill_wait_s(self) -> float:
        """How long a disaggregated request may wait for a prefill engine out of routing to
        take traffic again (`router.prefill_wait_s`; by default twice the health poll)."""
        wait_s = self.config.router.prefill_wait_s
        return 2 * self.config.health.poll_interval_s if wait_s is None else wait_s

    def prefill_awaited(
        self, model: str, exclude: frozenset[str] = frozenset(), lora_name: str = ""
    ) -> float:
        """How long a disaggregated request for `model` (naming LoRA adapter `lora_name`, if
        any) that would find no prefill engine (none in `exclude`: addresses, as the router's
        candidates name engines) taking it now, decode engines not prefilling, may wait for
        one by what the registry says now: while one serving the model is in the fleet out of
        routing for a moment (restarting, not READY again yet: `_coming_back_s`), or, for an
        adapter, taking traffic without it, that will hold the adapter (`_will_hold_lora`),
        until the last such is dead as far as its calls are concerned (inf: no such limit);
        0.0 where not worth waiting (one takes the request, or none may come back with the
        adapter: a request naming one loaded on other engines alone is refused at once)."""
        registry = self.fleet.registry
        if self.router.decode_engines_prefill or any(
            r.address not in exclude and (not lora_name or r.holds_lora(lora_name))
            for r in registry.routable(model or None, Role.PREFILL, generating=True)
        ):
            return 0.0  # (the usual case, read from the registry's memo)
        return max(
            (
                self._coming_back_s(r)
                for r in registry.may_serve_records(model or None)
                if r.role is Role.PREFILL
                and r.address not in exclude
                and (not lora_name or self._will_hold_lora(r, lora_name, model))
            ),
            default=0.0,
        )

    def _will_hold_lora(self, record: EngineRecord, lora_name: str, model: str) -> bool:
        """Whether the engine holds LoRA adapter `lora_name`, or will once it takes traffic
        again: the fleet's LoRA intent wants it there (loaded on the fleet for a model it
        serves, or on that engine), so the fleet service loads it on a new process before
        routing requests naming it there (controller.lora_intent); not where this process
        refused that (`EngineRecord.lora_refused`)."""
        if record.holds_lora(lora_name):
            return True
        if lora_name in record.lora_refused:
            return False  # (its restore refused there: not tried again before a new process)
        if record.identity is not None:
            if record.identity.supports_lora is False:
                return False  # (it serves no LoRA: given none)
            models: Collection[str] = record.identity.models
        else:  # not reached yet: it may serve the request's model (`may_serve_records`)
            models = [model] if model else []
        return self.fleet.lora_intent.wants(lora_name, record.address, models)

    def _coming_back_s(self, record: EngineRecord) -> float:
        """How long an engine out of routing may still take traffic again by itself (0.0: it
        will not; inf: no limit): not cordoned, draining (an operator's doing) or
        incompatible, nor unreachable for longer than `health.abandon_streams_after_s`
        (dead, as far as its calls are concerned)."""
        if record.cordoned or record.state in (EngineState.DRAINING, EngineState.INCOMPATIBLE):
            return 0.0
        since_s = record.unreachable_since_s
        limit_s = self.config.health.abandon_streams_after_s
        if since_s is None or not limit_s:
            return math.inf
        return max(0.0, since_s + limit_s - self.clock())

    def route_prefill(self, plan: Plan, exclude: frozenset[str]) -> Decision:
        """Another prefill engine (a retry), not one in `exclude`; with none, a decode engine
        prefilling the prompt itself where decode engines may (`Router.route_prefill_again`)."""
        prefill, decode = (
            [c for c in self._of_role(plan, role) if c.engine_id not in exclude]
            for role in (Role.PREFILL, Role.DECODE)
        )
        decision = self.router.route_prefill_again(
            plan.request, prefill, decode, self.rng, self.clock()
        )
        # With no other prefill engine, a decode engine prefilling the prompt itself.
        on_prefill = any(c.engine_id == decision.engine_id for c in prefill)
        hop = Hop.PREFILL if on_prefill else Hop.DECODE_PREFILL
        self.metrics.count_decision(decision.policy, decision.reason.value, hop)
        return decision

    def route_decode(
        self,
        plan: Plan,
        exclude: frozenset[str],
        prefilled: bool,
        prompt_tokens: int | None = None,
    ) -> Decision:
        """A decode engine by load, not one in `exclude`: at the handoff (`prefilled`: the KV
        comes from the prefill engine), or a retry of a decode engine prefilling itself.
        `prompt_tokens`: the prompt's tokens as the prefill engine told at the handoff, where
        the plan did not know them (a text prompt not tokenised here): only a decode engine
        that takes a prompt that long (`Eligibility.with_prompt`; BeyondFleetError: none
        serving the model does). With none left, a request whose LoRA adapter no routable
        decode engine holds any more gets the fleet's LoRA refusal (`_check_lora_still_held`),
        as at its plan."""
        candidates = tuple(
            c for c in self._of_role(plan, Role.DECODE) if c.engine_id not in exclude
        )
        if not candidates and plan.lora_name:
            self._check_lora_still_held(plan, Role.DECODE)
        if prompt_tokens is not None and not plan.tokenized:
            candidates = self.eligibility.with_prompt(
                plan.model or None, candidates, plan.needs, prompt_tokens
            )
        decision = self.router.route_decode(plan.request, candidates, self.rng, prefilled)
        hop = Hop.DECODE if prefilled else Hop.DECODE_PREFILL
        self.metrics.count_decision(decision.policy, decision.reason.value, hop)
        return decision

    def _of_role(self, plan: Plan, role: Role) -> tuple[Candidate, ...]:
        """The plan's candidates of `role` that still take the request now (a later hop of
        a request runs after the plan: an engine may have been drained or removed since, or
        no longer hold the request's LoRA adapter: an UnloadLora landed, or the engine
        refused the adapter, `Relay.adapter_left`, which a run again as a whole does not ask
        again)."""
        registry = self.fleet.registry
        out = []
        for candidate in plan.view.candidates:
            record = registry.by_engine_id(candidate.engine_id)
            if (
                record is not None
                and record.identity is not None
                and record.identity.role is role
                and _takes_now(record, plan.lora_name)
            ):
                out.append(candidate)
        return tuple(out)

    def _check_lora_still_held(self, plan: Plan, role: Role | None = None) -> None:
        """Raise the LoraRoutingError a request planned now would get when no routable
        engine (of `role`, or any) holds the plan's adapter any more (unloaded since the
        plan was made)."""
        registry = self.fleet.registry
        model = plan.model or None
        if not registry.routable(model, role, lora_name=plan.lora_name, generating=True):
            registry.check_lora(plan.lora_name, model, role)

    def _routable(self, candidate: Candidate, lora_name: str = "") -> bool:
        """Whether the candidate still takes the request (and holds its LoRA adapter: an
        UnloadLora may have landed since the plan was made)."""
        return _takes_now(self.fleet.registry.by_engine_id(candidate.engine_id), lora_name)

    def explain(self, plan: Plan, disaggregated: bool = False) -> Decision:
        """What `route` would decide, charging no one; in a `disaggregated` fleet, the first
        hop's (as `route_disaggregated`: a prefill engine, or the decode engine that would
        prefill the prompt itself). AllEnginesBusyError when the request would be refused
        as every engine it needs is busy; NoEngineAvailableError naming each engine serving
        the model and its state when none takes traffic, as `route` says it to a Generate."""
        if disaggregated:
            placement = self._first_hop(plan, charge=False)
            decision = placement.prefill or placement.decode
            assert decision is not None  # one of the two is the first hop
            return decision
        if not plan.view.candidates:
            raise NoEngineAvailableError(self._why_unavailable(plan))
        return self.router.explain(
            plan.request,
            plan.view.candidates,
            self.rng,
            self.clock(),
            reject_when_all_busy=self.sheds_load,
        )

    async def _refresh_index_stats(self) -> None:
        """Every INDEX_STATS_INTERVAL_S from the start: the index-size gauges, and for a
        remote index the calls that keep its `unavailable` current while no request asks
        (its stats, and one query while it sheds queries: `RemoteIndex.ask_while_shedding`).
        A read of a large shared index is long (it walks and decodes all of it, on this event
        loop: about 5 s for 1M blocks on Redis), so the wait after one grows with it
        (`refresh_wait_s`): routing keeps nine tenths of the loop."""
        while True:
            started = self.clock()
            stats = await self.try_index_stats()
            if self.fleet.remote is not None:
                await self.fleet.remote.ask_while_shedding()
            self.metrics.index_size.record(stats)
            if stats is not None:
                self.fleet.indexed_blocks = blocks_by_engine(stats)
            await asyncio.sleep(refresh_wait_s(self.clock() - started, INDEX_STATS_INTERVAL_S))

    async def try_index_stats(self) -> IndexStats | None:
        """`index_stats`, or None when the index cannot answer (a shared or remote index may
        be down: asked again later), with a throttled warning."""
        try:
            return await self.index_stats()
        except Exception as exc:
            self._stats_failed.warn(f"index stats failed: {exc}")
            return None

    def reachable_index(self) -> ReachableIndex | None:
        """The index the router asks when it lives outside this process (a remote indexer, a
        shared Redis), whose `unavailable` says whether it answers as its client last found
        (a Redis backend's calls and maintenance task, a remote index's matches and the
        index-stats refresh keep it); None for the embedded index, which always answers."""
        index = self.fleet.remote or self.index
        return index if isinstance(index, ReachableIndex) else None

    def index_keying_mismatch(self) -> str | None:
        """Why no prompt can match some worker of the remote indexer, as its last stats
        reported them (`RemoteIndex.keying_mismatch`); None without one, or a remote index."""
        return None if self.fleet.remote is None else self.fleet.remote.keying_mismatch

    async def index_stats(self) -> IndexStats | None:
        """The size of the index the router asks: the embedded or shared one, else the remote
        indexer (its workers named as the fleet's engines); None without either."""
        index = self.index if self.index is not None else self.fleet.remote
        return None if index is None else await index.stats()


def blocks_by_engine(stats: IndexStats | None) -> dict[str, int]:
    """Indexed blocks per engine (an engine indexed rank by rank counts all its ranks)."""
    out: dict[str, int] = {}
    for worker in stats.workers if stats is not None else ():
        out[worker.worker_id] = out.get(worker.worker_id, 0) + worker.num_blocks
    return out
