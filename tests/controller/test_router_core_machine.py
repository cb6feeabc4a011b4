"""The router core's bookkeeping against a naive model (hypothesis stateful), driven as the
gateway and the replay drive it: `route` (the engines out of routing, or not serving the
model, left out of the candidates; busy ones by their load snapshot and the router's own
queue), first tokens (one per streamed chunk, as the relay reports them), finishes (twice, as
an abort and the stream's end both do), the decode hop of a disaggregated request, retries
of an id in flight, engines leaving (`forget_engine`), and peer replicas' events
(`PeerRoutes`), over 3 engines, 4 request ids reused all the time and prompts of chained block
keys over a 2-symbol alphabet (so that prefixes collide), for every policy.

After every step: each engine's `InFlight` (requests, prefilling, prefill and cached prefill
tokens, distinct active blocks where the policy counts them) is the model's, and
`active_prefix` of every prompt the naive walk's; the events the router published, applied to
a mirror replica, give it the same accounting of this router's own requests, each first
token published once."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from controller.router import (
    POLICY_NAMES,
    AllEnginesBusyError,
    BusyThresholds,
    Candidate,
    InFlight,
    LoadSnapshot,
    NoEngineAvailableError,
    PrefixHit,
    Router,
    RouteRequest,
    make_policy,
)
from controller.router.replicas import Finished, FirstToken, PeerRoutes, Routed, RouteEvent
from controller.router.router import SessionRoute

ENGINES = ("e1", "e2", "e3")
REQUEST_IDS = ("r0", "r1", "r2", "r3")
ORIGINS = ("peer-a", "peer-b")
SESSIONS = ("s0", "s1")
BS = 4
TOTAL_KV_BLOCKS = 10
# Every prompt of 0 to 3 blocks over 2 symbols, its blocks keyed by their whole prefix (as
# the gateway's chained hashes are): 14 keys, prompts sharing their leading ones.
PROMPTS = [p for n in range(4) for p in itertools.product((0, 1), repeat=n)]
_KEY = {p: k for k, p in enumerate(p for p in PROMPTS if p)}


def keys_of(prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_KEY[prompt[: i + 1]] for i in range(len(prompt)))


@dataclass
class Req:
    """The model of one request in flight."""

    engine: str
    prefill_tokens: int
    cached_tokens: int
    keys: tuple[int, ...]
    prefilling: bool = True


prompts = st.sampled_from(PROMPTS)
engines = st.sampled_from(ENGINES)
request_ids = st.sampled_from(REQUEST_IDS)
# One engine's part of a candidate list: in it at all (routable, serving the model), its
# indexed hit (device blocks), the KV blocks its last GetLoad says used and requests queued.
engine_views = st.tuples(
    st.booleans(), st.integers(0, 3), st.integers(0, TOTAL_KV_BLOCKS), st.integers(0, 2)
)
views = st.tuples(engine_views, engine_views, engine_views)


class RouterCore(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)
        self.now_s = 0.0
        self.own: dict[str, Req] = {}  # this router's requests in flight
        self.peer: dict[str, Req] = {}  # peers' requests, by their name here
        self.sessions: dict[str, SessionRoute] = {}
        self.events: list[RouteEvent] = []
        self.first_tokens_published: dict[str, int] = {}

    @initialize(
        policy=st.sampled_from(POLICY_NAMES),
        queued_requests=st.sampled_from([None, 1, 2]),
        pending_ttl_s=st.sampled_from([0.0, 10.0]),
    )
    def start(self, policy: str, queued_requests: int | None, pending_ttl_s: float) -> None:
        self.busy = BusyThresholds(queued_requests=queued_requests)
        self.router = Router(make_policy(policy), busy=self.busy, pending_ttl_s=pending_ttl_s)
        self.router.publish_to(self.events.append)
        self.peers = PeerRoutes(self.router)
        # A peer replica applying this router's events (`controller.replica_sync`).
        self.mirror = Router(make_policy(policy))
        self.mirror_peers = PeerRoutes(self.mirror)
        self.counts_blocks = self.router.policy.counts_active_blocks

    # ---- the gateway's and the replay's calls ----

    @rule(
        rid=request_ids,
        prompt=prompts,
        extra=st.integers(1, BS),
        view=views,
        session=st.sampled_from((None, *SESSIONS)),
        shed=st.booleans(),
    )
    def route(
        self,
        *,
        rid: str,
        prompt: tuple[int, ...],
        extra: int,
        view: tuple[tuple[bool, int, int, int], ...],
        session: str | None,
        shed: bool,
    ) -> None:
        self.now_s += 1.0
        keys = keys_of(prompt)
        request = RouteRequest(rid, len(keys) * BS + extra, BS, keys, session_key=session)
        candidates = [
            Candidate(
                engine,
                hit=PrefixHit(min(hit, len(keys))),
                load=LoadSnapshot(
                    used_kv_blocks=used, total_kv_blocks=TOTAL_KV_BLOCKS, queued_requests=queued
                ),
                total_kv_blocks=TOTAL_KV_BLOCKS,
                block_size=BS,
            )
            for engine, (included, hit, used, queued) in zip(ENGINES, view, strict=True)
            if included
        ]
        busy = {c.engine_id for c in candidates if self._busy(c)}
        before = self._accounting()
        if not candidates:
            with pytest.raises(NoEngineAvailableError):
                self.router.route(request, candidates, self.rng, self.now_s)
            assert self._accounting() == before  # nothing charged
            return
        if shed and len(busy) == len(candidates):
            with pytest.raises(AllEnginesBusyError):
                self.router.route(
                    request, candidates, self.rng, self.now_s, reject_when_all_busy=True
                )
            assert self._accounting() == before
            return
        decision = self.router.route(
            request, candidates, self.rng, self.now_s, reject_when_all_busy=shed
        )
        chosen = decision.engine_id
        ids = [c.engine_id for c in candidates]
        assert chosen in ids, f"{chosen} is not a candidate ({ids})"
        # `kvplane` skips a lone busy engine among several (`BusyThresholds.busy_ids`: at most
        # one in eight, at least one, of them busy); every other policy sees all of them.
        skipped = busy if self.router.policy.filters_busy and len(busy) == 1 < len(ids) else set()
        assert chosen not in skipped, f"{chosen} is busy"
        free = [e for e in ids if e not in skipped]
        known = self.sessions.get(session) if session else None
        if known is not None and known.engine_id in free:
            assert chosen == known.engine_id, f"session {session} left {known.engine_id}"
        cacheable = (request.num_prompt_tokens - 1) // BS
        assert 0 <= decision.predicted_cached_tokens <= cacheable * BS
        self.own[rid] = Req(
            chosen,
            request.num_prompt_tokens - decision.predicted_cached_tokens,
            decision.predicted_cached_tokens,
            keys,
        )
        if session:
            self.sessions[session] = SessionRoute(chosen, (known.version if known else 0) + 1)

    @precondition(lambda self: self.own)
    @rule(data=st.data(), engine=engines, prefilled=st.booleans())
    def route_decode(self, data: st.DataObject, engine: str, prefilled: bool) -> None:
        """The decode hop of a disaggregated request in flight: the same id, moved to a
        decode engine (here the only candidate)."""
        rid = data.draw(st.sampled_from(sorted(self.own)))
        keys = self.own[rid].keys
        request = RouteRequest(rid, len(keys) * BS + 1, BS, keys)
        decision = self.router.route_decode(request, [Candidate(engine)], self.rng, prefilled)
        assert decision.engine_id == engine
        cached = request.num_prompt_tokens if prefilled else 0
        self.own[rid] = Req(engine, request.num_prompt_tokens - cached, cached, keys)

    @rule(rid=request_ids)
    def first_token(self, rid: str) -> None:
        self.router.first_token(rid)
        if rid in self.own:
            self.own[rid].prefilling = False

    @rule(rid=request_ids)
    def finish(self, rid: str) -> None:
        self.router.finish(rid)
        self.own.pop(rid, None)

    @rule(engine=engines)
    def engine_gone(self, engine: str) -> None:
        dropped = self.router.forget_engine(engine)
        expected = [n for m in (self.own, self.peer) for n, r in m.items() if r.engine == engine]
        assert sorted(dropped) == sorted(expected)
        self.own = {n: r for n, r in self.own.items() if r.engine != engine}
        self.peer = {n: r for n, r in self.peer.items() if r.engine != engine}
        self.sessions = {k: s for k, s in self.sessions.items() if s.engine_id != engine}
        assert self.router.inflight.of(engine) == InFlight()
        assert self.router.inflight.request_ids(engine) == []
        for prompt in PROMPTS:
            assert self.router.inflight.active_prefix(engine, keys_of(prompt)) == (0, 0)

    # ---- peer replicas' requests, charged in the same accounting ----

    @rule(
        origin=st.sampled_from(ORIGINS),
        rid=request_ids,
        engine=engines,
        prompt=prompts,
        cached=st.integers(0, 8),
        session=st.sampled_from((None, *SESSIONS)),
        version=st.integers(1, 3),
    )
    def peer_routed(
        self,
        *,
        origin: str,
        rid: str,
        engine: str,
        prompt: tuple[int, ...],
        cached: int,
        session: str | None,
        version: int,
    ) -> None:
        keys = keys_of(prompt)
        routed = Routed(rid, engine, len(keys) * BS + 1, cached, keys, True, session, version)
        self.peers.apply(origin, routed, self.now_s)
        self.peer[f"{origin}\x00{rid}"] = Req(engine, routed.prefill_tokens, cached, keys)
        if session:
            route = SessionRoute(engine, version)
            if route.supersedes(self.sessions.get(session)):
                self.sessions[session] = route

    @rule(origin=st.sampled_from(ORIGINS), rid=request_ids)
    def peer_first_token(self, origin: str, rid: str) -> None:
        self.peers.apply(origin, FirstToken(rid), self.now_s)
        name = f"{origin}\x00{rid}"
        if name in self.peer:
            self.peer[name].prefilling = False

    @rule(origin=st.sampled_from(ORIGINS), rid=request_ids)
    def peer_finished(self, origin: str, rid: str) -> None:
        self.peers.apply(origin, Finished(rid), self.now_s)
        self.peer.pop(f"{origin}\x00{rid}", None)

    @rule(origin=st.sampled_from(ORIGINS))
    def peer_gone(self, origin: str) -> None:
        self.peers.forget(origin)
        prefix = f"{origin}\x00"
        self.peer = {n: r for n, r in self.peer.items() if not n.startswith(prefix)}

    # ---- what must hold ----

    def _busy(self, c: Candidate) -> bool:
        """Busy as a naive reading of `BusyThresholds`: KV 97% used, or (where set) that many
        requests queued by the poll or still prefilling by the router's own count."""
        if c.load.used_kv_blocks is not None and c.load.used_kv_blocks / TOTAL_KV_BLOCKS >= 0.97:
            return True
        limit = self.busy.queued_requests
        prefilling = sum(r.prefilling for r in self._on(c.engine_id))
        return limit is not None and max(c.load.queued_requests or 0, prefilling) >= limit

    def _on(self, engine: str, own_only: bool = False) -> list[Req]:
        requests = [*self.own.values()] + ([] if own_only else [*self.peer.values()])
        return [r for r in requests if r.engine == engine]

    def _expected(self, engine: str, own_only: bool = False) -> InFlight:
        mine = self._on(engine, own_only)
        prefilling = [r for r in mine if r.prefilling]
        return InFlight(
            requests=len(mine),
            prefilling=len(prefilling),
            prefill_tokens=sum(r.prefill_tokens for r in prefilling),
            prefill_cached_tokens=sum(r.cached_tokens for r in prefilling),
            active_blocks=len({k for r in mine for k in r.keys}) if self.counts_blocks else 0,
        )

    def _accounting(self) -> tuple[InFlight, ...]:
        return tuple(self.router.inflight.of(e) for e in ENGINES)

    @invariant()
    def accounting_matches_the_model(self) -> None:
        tracker = self.router.inflight
        for engine in ENGINES:
            assert tracker.of(engine) == self._expected(engine)
            held = [r.keys for r in self._on(engine)] if self.counts_blocks else []
            for prompt in PROMPTS:
                keys = keys_of(prompt)
                overlap = 0
                while overlap < len(keys) and any(keys[overlap] in h for h in held):
                    overlap += 1
                sharers = sum(set(keys[:overlap]) <= set(h) for h in held) if overlap else 0
                assert tracker.active_prefix(engine, keys) == (overlap, sharers), prompt
        assert len(tracker) == len(self.own) + len(self.peer)
        for name, req in [*self.own.items(), *self.peer.items()]:
            assert tracker.engine_of(name) == req.engine
            assert tracker.is_prefilling(name) == req.prefilling
        for rid in REQUEST_IDS:
            if rid not in self.own:
                assert tracker.engine_of(rid) is None
        for session in SESSIONS:
            assert self.router.session_route(session) == self.sessions.get(session)

    @invariant()
    def a_peer_sees_this_routers_requests(self) -> None:
        """The published events, applied to a mirror replica, charge it with exactly this
        router's own requests; a request's first token is published once per route."""
        for event in self.events:
            if isinstance(event, FirstToken):
                count = self.first_tokens_published.get(event.request_id, 0) + 1
                assert count == 1, f"{event.request_id}: first token published {count} times"
                self.first_tokens_published[event.request_id] = count
            else:
                self.first_tokens_published.pop(event.request_id, None)
            self.mirror_peers.apply("me", event, self.now_s)
        self.events.clear()
        for engine in ENGINES:
            assert self.mirror.inflight.of(engine) == self._expected(engine, own_only=True)
        # ... as a snapshot of them (`own_routes`) would.
        snapshot = Router(make_policy(self.router.policy.name))
        PeerRoutes(snapshot).replace("me", self.router.own_routes(), self.now_s)
        for engine in ENGINES:
            assert snapshot.inflight.of(engine) == self._expected(engine, own_only=True)


RouterCore.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRouterCore = RouterCore.TestCase
