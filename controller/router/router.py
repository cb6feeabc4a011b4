"""The router: the same pure code decides in the gateway and in the trace replay.

`Router.route(request, candidates, rng, now_s)` takes the routable engines (the caller has
already dropped unhealthy, draining and cordoned ones and filled in each engine's cached prefix
and last polled load), adds its own in-flight accounting (and, for the policies that take them,
pending prefixes and active blocks: `Policy.credits_pending_prefixes`,
`Policy.counts_active_blocks`), filters busy engines for the policies that ask for it
(`Policy.filters_busy`), honours session affinity, lets the policy choose, and charges the
chosen engine at once. The caller reports `first_token` and `finish` as the stream
progresses. Asked to (`reject_when_all_busy`, the gateway's load shedding), it refuses a
request whose every candidate is busy instead (AllEnginesBusyError), charging no one.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from controller.router.inflight import InFlightTracker
from controller.router.model import (
    Candidate,
    Decision,
    EngineCost,
    PrefixHit,
    Reason,
    RouteRequest,
)
from controller.router.policies import Policy, blind_costs, decision_for, least_loaded_of
from controller.router.replicas import Finished, FirstToken, Routed, RouteEvent
from kvplane.errors import KvplaneError


class NoEngineAvailableError(KvplaneError):
    """No engine can take the request (none registered, all unhealthy, draining or cordoned)."""


class AllEnginesBusyError(KvplaneError):
    """Every engine that could take the request is busy (`BusyThresholds.is_busy`) and the
    caller asked to refuse it rather than queue it there (`router.reject_when_all_busy`):
    load shedding, the client should retry later. Not a NoEngineAvailableError: engines are
    up, the fleet is full, and clients tell the two apart (RESOURCE_EXHAUSTED, not
    UNAVAILABLE)."""


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """When an engine counts as busy, and when skipping busy engines is worth it (only the
    `kvplane` policy has them skipped: `Policy.filters_busy`).

    An engine is busy when its KV cache is `kv_usage` full (blocks held by running requests:
    a new request would wait for memory, or preempt one) or `queued_requests` requests are
    queued on it; None disables a check. Busy engines are skipped only while at most
    `max_busy_fraction` of the candidates are busy (at least one engine may always be): a lone
    full engine is a hot spot worth avoiding, but when several are full the fullness is the
    fleet's state under a backlog, not the engine's. Skipping whichever engines happened to be
    full at their last poll then only scatters conversations away from their cached prefixes,
    so the policy's cost (queue included) chooses among them all. (Measured on the Mooncake
    traces, docs/benchmarks/routing.md: one engine in eight keeps the filter's gain where a
    single engine fills up and removes its loss under overload.)"""

    kv_usage: float | None = 0.97
    queued_requests: int | None = None
    max_busy_fraction: float = 0.125

    def is_busy(self, c: Candidate) -> bool:
        usage = c.kv_usage
        if self.kv_usage is not None and usage is not None and usage >= self.kv_usage:
            return True
        return self.queued_requests is not None and c.queued_requests >= self.queued_requests

    def all_busy(self, candidates: Sequence[Candidate]) -> bool:
        """Whether every candidate (at least one) is busy, however many there are: the test
        of load shedding, where `max_busy_fraction` (a choice among engines) has no say."""
        return bool(candidates) and all(self.is_busy(c) for c in candidates)

    def refusal(self, engines: str = "engine") -> AllEnginesBusyError:
        """The error of a request refused because every `engines` is busy, saying why."""
        checks = []
        if self.kv_usage is not None:
            checks.append(f"KV usage >= {self.kv_usage * 100:g}%")
        if self.queued_requests is not None:
            checks.append(f"queued requests >= {self.queued_requests}")
        return AllEnginesBusyError(f"every {engines} is busy ({' or '.join(checks)}): retry later")

    def busy_ids(self, candidates: Sequence[Candidate]) -> set[str]:
        """The engines to skip: the busy ones, unless too many are busy (then none)."""
        busy = {c.engine_id for c in candidates if self.is_busy(c)}
        if len(busy) > max(1, math.floor(self.max_busy_fraction * len(candidates))):
            return set()
        return busy


@dataclass(frozen=True, slots=True)
class DisaggDecision:
    """The first hop of a disaggregated request: a prefill engine, or (exactly one of the
    two) the decode engine when it prefills the prompt itself."""

    prefill: Decision | None
    decode: Decision | None


# How long an engine's predicted cache (`kv_events: approximate`) keeps a block after the last
# request routed through it. Past the traces' reuse distances: the engine's KV capacity, not
# the clock, is what drops predictions then, as its LRU drops blocks (docs/benchmarks/
# routing.md, "Engines without KV events": 120 s, Dynamo's approximate router's default, kept
# 0.20 of the conversation trace's 0.27 reuse, 600 s all of it).
APPROXIMATE_TTL_S = 600.0


class PendingPrefixes:
    """Blocks the router has just sent to an engine and the engine has not announced yet, and
    the predicted caches of engines that announce nothing.

    The index learns a prompt's blocks only after the engine computed them, so a burst of
    prompts sharing a new prefix would otherwise be spread over several engines and computed
    (and stored) several times. Each routed prompt's blocks count as held by its engine for
    `ttl_s`, and in any case until the request's first token: before it the engine cannot
    have announced them (behind a long queue that is minutes, and the next turn of a
    conversation must still find its prefix), after it the engine's KV events tell the truth.
    Only policies whose `credits_pending_prefixes` is true are given (and charge) these claims.

    An engine whose cache the router predicts (`kv_events: approximate`: it publishes no KV
    events, `predict`) has the same claims last `approximate_ttl_s` from the last request
    routed through each block (a hit refreshes them, as Dynamo's approximate indexer), and
    at most its KV capacity of them: past it the least recently routed blocks go first, as
    the engine's LRU evicts (llm-d's approximate scorer and SGLang's approximate trees bound
    theirs so). A prompt's blocks are claimed tail first, so that its head is the most
    recently routed: the engine frees a request's blocks so too, and a prediction keeps
    whole prefixes rather than tails without their head.
    """

    def __init__(self, ttl_s: float, approximate_ttl_s: float = APPROXIMATE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.approximate_ttl_s = approximate_ttl_s
        # engine -> key -> expiry, in the order the keys were last claimed (their expiry's,
        # each engine's claims lasting one ttl): purges and capacity take from the front.
        self._expiry: dict[str, OrderedDict[int, float]] = {}
        # Claims of requests still waiting for their first token: engine -> key -> count.
        self._held: dict[str, dict[int, int]] = {}
        self._open: dict[str, tuple[str, Sequence[int]]] = {}
        # Engines whose cache is predicted: engine -> its capacity in blocks (None: unknown).
        self._predicted: dict[str, int | None] = {}
        self._next_purge_s = 0.0

    def predict(self, engine_id: str, capacity_blocks: int | None) -> None:
        """The engine's cache is predicted (`Router.predict_cache`), `capacity_blocks`
        bounding it (None: unknown, unbounded): its claims from now on, a peer replica's
        routes there included (`Router.charge_peer`), are predictions. Until `forget`.

        Claims it already has (a peer's snapshot can come before the fleet meets the engine
        and tells the router) become predictions too: each lasts `approximate_ttl_s` from
        its route, not `ttl_s`."""
        table = self._expiry.get(engine_id)
        if table and engine_id not in self._predicted:
            longer = self.approximate_ttl_s - self.ttl_s
            for key in table:
                table[key] += longer
        self._predicted[engine_id] = capacity_blocks

    def add(self, engine_id: str, request_id: str, block_keys: Sequence[int], now_s: float) -> None:
        predicted = engine_id in self._predicted
        ttl_s = self.approximate_ttl_s if predicted else self.ttl_s
        if ttl_s <= 0 or not block_keys:
            return
        self.release(request_id)
        self._open[request_id] = (engine_id, block_keys)
        table = self._expiry.setdefault(engine_id, OrderedDict())
        held = self._held.setdefault(engine_id, {})
        expiry = now_s + ttl_s
        for key in reversed(block_keys):
            table[key] = expiry
            table.move_to_end(key)
            held[key] = held.get(key, 0) + 1
        capacity = self._predicted.get(engine_id) if predicted else None
        if capacity is not None:
            while len(table) > capacity:
                table.popitem(last=False)
        if now_s >= self._next_purge_s:
            self._purge(now_s)

    def release(self, request_id: str) -> None:
        """The request's first token (or its end): its blocks are computed, or never will be."""
        claim = self._open.pop(request_id, None)
        if claim is None:
            return
        engine_id, block_keys = claim
        held = self._held.get(engine_id)
        if held is None:
            return
        for key in block_keys:
            count = held.get(key, 0) - 1
            if count > 0:
                held[key] = count
            else:
                held.pop(key, None)
        if not held:
            del self._held[engine_id]

    def extend(self, engine_id: str, block_keys: Sequence[int], start: int, now_s: float) -> int:
        """How far the held prefix reaches past `start` blocks with pending blocks."""
        table = self._expiry.get(engine_id)
        held = self._held.get(engine_id)
        if not table and not held:
            return start  # the common case: nothing pending on this engine
        expiry: Mapping[int, float] = table or {}
        held = held or {}
        n = start
        for key in block_keys[start:]:
            if key not in held and expiry.get(key, -1.0) < now_s:
                break
            n += 1
        return n

    def forget(self, engine_id: str) -> None:
        """The engine left, or a new process of it came (its cache starts empty)."""
        self._expiry.pop(engine_id, None)
        self._predicted.pop(engine_id, None)
        self._held.pop(engine_id, None)
        for request_id in [r for r, (e, _) in self._open.items() if e == engine_id]:
            del self._open[request_id]

    def _purge(self, now_s: float) -> None:
        self._next_purge_s = now_s + min(self.ttl_s, self.approximate_ttl_s)
        for engine_id, table in list(self._expiry.items()):
            while table:
                key, expiry = next(iter(table.items()))
                if expiry >= now_s:
                    break
                del table[key]
            if not table:
                del self._expiry[engine_id]


class SessionRoute(NamedTuple):
    """Where a session's requests go: the engine of its latest route, the `version`-th the
    router knows of. Replicas in sync (`controller.router.replicas`) learn each other's routes
    in any order, and a snapshot brings back routes known already (of requests still in
    flight, and the sessions its sender knows), so a route replaces the known one only when
    it is later: a higher version (each route of a
    session counts one past the version its router knew), the engine id breaking a tie (two
    replicas routing the session at once). Every replica that heard the same routes then
    sticks the session to the same engine, whatever order they came in."""

    engine_id: str
    version: int

    def supersedes(self, other: SessionRoute | None) -> bool:
        return other is None or (self.version, self.engine_id) > (other.version, other.engine_id)


class Router:
    def __init__(
        self,
        policy: Policy,
        *,
        busy: BusyThresholds | None = None,
        session_capacity: int = 100_000,
        skip_prefill_ratio: float = 0.9,
        pending_ttl_s: float = 10.0,
        approximate_ttl_s: float = APPROXIMATE_TTL_S,
    ) -> None:
        self.policy = policy
        self.busy = busy or BusyThresholds()
        self.inflight = InFlightTracker(count_blocks=policy.counts_active_blocks)
        self.pending = PendingPrefixes(pending_ttl_s, approximate_ttl_s)
        self.skip_prefill_ratio = skip_prefill_ratio
        self._session_capacity = session_capacity
        self._sessions: OrderedDict[str, SessionRoute] = OrderedDict()
        # Told of every charge, first token and finish of this router's own requests (the
        # replicas' sync, `controller.replica_sync`); then `_routed` keeps each charge until
        # the request finishes, for `own_routes`.
        self._on_event: Callable[[RouteEvent], None] | None = None
        self._routed: dict[str, Routed] = {}

    def with_inflight(
        self,
        candidates: Sequence[Candidate],
        request: RouteRequest | None = None,
        now_s: float = 0.0,
    ) -> list[Candidate]:
        """Candidates with the router's own knowledge added: in-flight accounting, and (given
        the request) blocks it sent there that the index does not show yet, or that an engine
        whose cache it predicts holds by its routing (`PendingPrefixes`; for policies that
        credit them), and how many of its blocks are active there (for policies that count
        them); for a request that reads no cache (`RouteRequest.reads_cache`), no engine
        holds any of it."""
        if request is None:
            return [c._replace(inflight=self.inflight.of(c.engine_id)) for c in candidates]
        keys = request.block_keys
        credit = self.policy.credits_pending_prefixes
        count = self.inflight.count_blocks
        if not request.reads_cache:
            # It will reuse nothing an engine holds, indexed, pending or active: every policy
            # sees a cold prompt (its blocks are still charged where it goes: `route`).
            return [
                c._replace(hit=PrefixHit(), inflight=self.inflight.of(c.engine_id))
                for c in candidates
            ]
        out = []
        for c in candidates:
            hit = c.hit
            if credit:
                if c.predicts_cache:
                    # Its capacity as of now (a GetLoad may tell it only after the fleet told
                    # the router of the engine; the replay has no fleet to tell it).
                    self.predict_cache(c.engine_id, c.capacity_blocks)
                held = hit.device_blocks + hit.host_blocks + hit.disk_blocks
                reach = self.pending.extend(c.engine_id, keys, held, now_s)
                if reach > held:
                    # Pending blocks will be on the device once computed.
                    hit = hit._replace(device_blocks=hit.device_blocks + reach - held)
            inflight = self.inflight.of(c.engine_id)
            if (
                not inflight.requests
                and hit is c.hit
                and c.active_overlap_blocks is None
                and c.inflight == inflight
            ):
                # Nothing of the router's on the engine, nor pending there (most of a large
                # fleet): the candidate as it came, no active request to overlap (None, read
                # as 0), rather than a copy of it for every engine on every request.
                out.append(c)
                continue
            if count:
                overlap, sharers = self.inflight.active_prefix(c.engine_id, keys)
                out.append(c.as_routed(hit, inflight, overlap, sharers))
            else:
                out.append(c.as_routed(hit, inflight, None, None))
        return out

    def explain(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
        *,
        reject_when_all_busy: bool = False,
    ) -> Decision:
        """What `route` would decide, without charging anyone (the admin `route` command).
        Stateful policies still advance (a round robin turns), as a real request would."""
        return self._decide(request, candidates, rng, now_s, reject_when_all_busy)

    def route(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
        *,
        reject_when_all_busy: bool = False,
    ) -> Decision:
        """The engine for `request`, charged with it. With `reject_when_all_busy` (the
        gateway's load shedding, whatever the policy), AllEnginesBusyError when every
        candidate is busy, before anything is charged or the policy sees the request."""
        decision = self._decide(request, candidates, rng, now_s, reject_when_all_busy)
        self._charge(request, decision, claim_prefix_at=now_s, sticks_session=True)
        self.policy.observe(request, decision.engine_id, now_s)
        return decision

    def session_route(self, session_key: str) -> SessionRoute | None:
        """Where the session's requests go (None: it has no engine yet, or was forgotten)."""
        return self._sessions.get(session_key)

    def recent_sessions(self, limit: int) -> list[tuple[str, SessionRoute]]:
        """The `limit` sessions routed (or learnt) last, oldest first: what a replica's
        snapshot tells a peer that joins (`controller.router.replica_protocol`), in the order
        that keeps them the most recent there too."""
        if limit <= 0:
            return []
        return list(itertools.islice(reversed(self._sessions.items()), limit))[::-1]

    def learn_session(self, session_key: str, route: SessionRoute) -> None:
        """A session a peer replica knows: its requests go to the route's engine here too,
        unless a later route of it is known (`SessionRoute.supersedes`)."""
        self._stick(session_key, route)

    def first_token(self, request_id: str) -> None:
        """The request's first token, reported again with every later chunk that has output
        (the relay's stream): its peers are told of it once per route, not once per chunk."""
        first = self.inflight.is_prefilling(request_id)
        self.release_prefill(request_id)
        if first and self._on_event is not None and request_id in self._routed:
            self._on_event(FirstToken(request_id))

    def finish(self, request_id: str) -> None:
        self.release(request_id)
        if self._on_event is not None and self._routed.pop(request_id, None) is not None:
            self._on_event(Finished(request_id))

    def release_prefill(self, request_id: str) -> None:
        """The request's prompt is computed: its prefill and pending blocks are off."""
        self.inflight.first_token(request_id)
        self.pending.release(request_id)

    def release(self, request_id: str) -> None:
        """The request ended: nothing of it is charged any more."""
        self.inflight.finish(request_id)
        self.pending.release(request_id)

    def publish_to(self, on_event: Callable[[RouteEvent], None] | None) -> None:
        """Tell `on_event` of every charge, first token and finish of this router's own
        requests from now on (None: stop)."""
        self._on_event = on_event
        if on_event is None:
            self._routed.clear()

    def own_routes(self) -> list[RouteEvent]:
        """This router's requests in flight since `publish_to`, as events that rebuild their
        accounting on a peer: each charge, and its first token when it came."""
        events: list[RouteEvent] = []
        for request_id, routed in self._routed.items():
            events.append(routed)
            if not self.inflight.is_prefilling(request_id):
                events.append(FirstToken(request_id))
        return events

    def charge_peer(self, request_id: str, routed: Routed, now_s: float) -> None:
        """A peer replica's request, charged as this router charges its own (under
        `request_id`, a name unique here; `controller.router.replicas.PeerRoutes`), its
        session, if any, stuck to its engine here too (unless a later route of it is known)."""
        self._begin(request_id, routed, now_s)

    def predict_cache(self, engine_id: str, capacity_blocks: int | None) -> None:
        """The engine publishes no KV events (`kv_events: approximate`): the router predicts
        its cache from the routes there, its own and its peer replicas' (`charge_peer`), within
        `capacity_blocks` (None: unknown, unbounded). Told by the fleet whenever it meets a
        process of the engine (the first one included; `forget_engine` forgot the earlier
        one's), so that a peer's route there before any decision of this router's own is a
        prediction, not a `pending_ttl_s` claim; and by every candidate list, which keeps its
        capacity current."""
        self.pending.predict(engine_id, capacity_blocks)

    def forget_engine(self, engine_id: str) -> list[str]:
        """The engine left the fleet: drop its accounting, sessions and policy state."""
        self.policy.forget_engine(engine_id)
        self.pending.forget(engine_id)
        for key in [k for k, s in self._sessions.items() if s.engine_id == engine_id]:
            del self._sessions[key]
        dropped = self.inflight.drop_engine(engine_id)
        for request_id in dropped:  # peers release them too, and no snapshot brings them back
            if self._routed.pop(request_id, None) is not None and self._on_event is not None:
                self._on_event(Finished(request_id))
        return dropped

    def route_disaggregated(
        self,
        request: RouteRequest,
        prefill_candidates: Sequence[Candidate],
        decode_candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
        *,
        reject_when_all_busy: bool = False,
        charge: bool = True,
    ) -> DisaggDecision:
        """The first hop of a request to a disaggregated fleet. The decode engine it would get
        (by load; of equally loaded ones, the one holding most of the prompt) prefills the
        prompt itself when it already holds `skip_prefill_ratio` of it, or when no prefill
        engine is up and decode engines may prefill (`skip_prefill_ratio` at most 1): then
        `decode` is that decision and `prefill` None. Otherwise `prefill` is a prefill engine
        chosen by the policy (overlap + load) and `decode` None: the decode engine is chosen
        when the prefill hands over (`route_decode`), by the load then. The engine of the hop
        is charged in flight.

        With `reject_when_all_busy`, AllEnginesBusyError before anything is charged when
        every decode engine is busy (every request ends on one, whatever its first hop), or
        when the request would hop to a prefill engine and every prefill engine is busy: each
        role the request needs now is judged among its own engines, as the router places
        them. The decode engine of a prefilled request is never refused at the handoff (the
        prefill is done; `route_decode`). Without `charge`, the same decision charged to no
        one (the admin `route` command)."""
        if not decode_candidates:
            raise NoEngineAvailableError("no decode engine available")
        if reject_when_all_busy:
            self.refuse_if_all_busy(decode_candidates, "decode engine")
        decode_view = self.with_inflight(decode_candidates)
        # Of the decode engines equally least loaded, the one holding most of the prompt: if
        # any of them holds enough of it to prefill it itself, that one does.
        chosen = least_loaded_of(
            decode_view, rng, then=lambda c: -sum(request.cached_tokens(c.hit))
        )
        cached_fraction = sum(request.cached_tokens(chosen.hit)) / max(request.num_prompt_tokens, 1)
        if cached_fraction < self.skip_prefill_ratio:
            if prefill_candidates:
                if reject_when_all_busy:
                    self.refuse_if_all_busy(prefill_candidates, "prefill engine")
                hop = self.route if charge else self.explain
                return DisaggDecision(hop(request, prefill_candidates, rng, now_s), None)
            if not self.decode_engines_prefill:
                raise NoEngineAvailableError("no prefill engine available")
        decision = _decode_decision(request, chosen, decode_view, prefilled=False)
        if charge:
            self._charge(request, decision)
        return DisaggDecision(None, decision)

    @property
    def decode_engines_prefill(self) -> bool:
        """Whether a decode engine may prefill a prompt itself (`skip_prefill_ratio` at most
        1); above 1 decode engines only take a KV session."""
        return self.skip_prefill_ratio <= 1

    def route_prefill_again(
        self,
        request: RouteRequest,
        prefill_candidates: Sequence[Candidate],
        decode_candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        """The retry of a prefill hop whose engine failed before answering: another prefill
        engine by the policy, or, with none left, the decode engine by load prefilling the
        prompt itself where decode engines may, as the first hop falls back when no prefill
        engine is up (`route_disaggregated`). Charged in flight."""
        if prefill_candidates or not self.decode_engines_prefill:
            return self.route(request, prefill_candidates, rng, now_s)
        return self.route_decode(request, decode_candidates, rng, prefilled=False)

    def refuse_if_all_busy(self, candidates: Sequence[Candidate], engines: str = "engine") -> None:
        """Raise AllEnginesBusyError when every candidate (the router's in-flight requests
        included) is busy; `engines` names them in the message."""
        if self.busy.all_busy(self.with_inflight(candidates)):
            raise self.busy.refusal(engines)

    def route_decode(
        self,
        request: RouteRequest,
        decode_candidates: Sequence[Candidate],
        rng: random.Random,
        prefilled: bool = True,
    ) -> Decision:
        """The decode engine, by load (own in-flight included), charged with the request: its
        decode only when the KV comes from a prefill engine (`prefilled`), else the prefill of
        what it lacks too."""
        if not decode_candidates:
            raise NoEngineAvailableError("no decode engine available")
        view = self.with_inflight(decode_candidates)
        decision = _decode_decision(request, least_loaded_of(view, rng), view, prefilled)
        self._charge(request, decision)
        return decision

    def _charge(
        self,
        request: RouteRequest,
        decision: Decision,
        claim_prefix_at: float | None = None,
        sticks_session: bool = False,
    ) -> None:
        """The decision's engine takes the request in flight: its uncached prefill queued; for
        a hop that reads the cache (`claim_prefix_at` its time), its blocks pending there
        (`PendingPrefixes`, for the policies that credit them); and, for a hop the policy
        chose (`sticks_session`), the request's session, if any, sticks to it."""
        cached = min(decision.predicted_cached_tokens, request.num_prompt_tokens)
        session_key = request.session_key if sticks_session else None
        session_version = 0
        if session_key:
            known = self._sessions.get(session_key)
            session_version = (known.version if known else 0) + 1
        routed = Routed(
            request.request_id,
            decision.engine_id,
            request.num_prompt_tokens - cached,
            cached,
            request.block_keys,
            claims_prefix=claim_prefix_at is not None,
            session_key=session_key or None,
            session_version=session_version,
        )
        self._begin(request.request_id, routed, claim_prefix_at)
        if self._on_event is not None:
            self._routed[request.request_id] = routed
            self._on_event(routed)

    def _begin(self, request_id: str, routed: Routed, now_s: float | None) -> None:
        self.inflight.begin(
            request_id,
            routed.engine_id,
            routed.prefill_tokens,
            routed.cached_tokens,
            routed.block_keys,
        )
        if routed.claims_prefix and now_s is not None and self.policy.credits_pending_prefixes:
            self.pending.add(routed.engine_id, request_id, routed.block_keys, now_s)
        if routed.session_key:
            self._stick(routed.session_key, SessionRoute(routed.engine_id, routed.session_version))

    def _stick(self, session_key: str, route: SessionRoute) -> None:
        """The session's requests go to the route's engine from now on, unless a later route
        of it is known (`SessionRoute.supersedes`); the table keeps the `session_capacity`
        sessions routed last."""
        if not route.supersedes(self._sessions.get(session_key)):
            return
        self._sessions[session_key] = route
        self._sessions.move_to_end(session_key)
        while len(self._sessions) > self._session_capacity:
            self._sessions.popitem(last=False)

    def _decide(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
        reject_when_all_busy: bool = False,
    ) -> Decision:
        if not candidates:
            raise NoEngineAvailableError("no engine available to route to")
        view = self.with_inflight(candidates, request, now_s)
        # A guard of the caller's (load shedding), not a policy's trait: whatever the policy,
        # before it sees the request (a round robin does not turn for a refused request).
        if reject_when_all_busy and self.busy.all_busy(view):
            raise self.busy.refusal()
        # Only policies that include the filter in their behaviour get it: the peers' and the
        # blind baselines' real systems have none, and their rows must be theirs.
        busy_ids = self.busy.busy_ids(view) if self.policy.filters_busy else set()
        free = [c for c in view if c.engine_id not in busy_ids] if busy_ids else view

        def without_policy(chosen: Candidate, reason: Reason) -> Decision:
            costs = _mark_busy(blind_costs(request, view), busy_ids)
            return decision_for(self.policy.name, request, chosen, reason, costs)

        if not free:
            return without_policy(least_loaded_of(view, rng), Reason.ALL_BUSY)
        if request.session_key:
            session = self._sessions.get(request.session_key)
            engine_id = session.engine_id if session else None
            sticky = next((c for c in free if c.engine_id == engine_id), None)
            if sticky is not None:
                return without_policy(sticky, Reason.SESSION)
        if len(free) == 1:
            return without_policy(free[0], Reason.ONLY)
        decision = self.policy.choose(request, free, rng, now_s)
        if not busy_ids:
            return decision
        busy_rows = [r for r in blind_costs(request, view) if r.engine_id in busy_ids]
        return decision._replace(costs=decision.costs + _mark_busy(tuple(busy_rows), busy_ids))


def _decode_decision(
    request: RouteRequest, chosen: Candidate, view: Sequence[Candidate], prefilled: bool
) -> Decision:
    """A decode engine chosen by load: what it has cached of the prompt, or all of it when
    the KV comes from a prefill engine (`prefilled`)."""
    cached = request.num_prompt_tokens if prefilled else sum(request.cached_tokens(chosen.hit))
    return Decision(
        chosen.engine_id, Reason.LOAD, "least_loaded", cached, blind_costs(request, view)
    )


def _mark_busy(rows: tuple[EngineCost, ...], busy_ids: set[str]) -> tuple[EngineCost, ...]:
    return tuple(r._replace(busy=r.engine_id in busy_ids) for r in rows)
