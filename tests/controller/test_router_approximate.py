"""Engines without KV events (`kv_events: approximate`): the router predicts their caches from
its own routing (`PendingPrefixes`), for `approximate_ttl_s` after the last route through each
block, within the engine's KV capacity, until the engine restarts or leaves; engines whose
events it follows (or `none` ones) keep only the short-lived claims."""

from __future__ import annotations

import random

from controller.router import Candidate, PrefixHit, Router, RouteRequest, make_policy
from controller.router.replicas import PeerRoutes

BS = 16


def prompt(rid: str, keys: range) -> RouteRequest:
    return RouteRequest(rid, len(keys) * BS + 3, BS, tuple(keys))


def engine(eid: str, *, predicted: bool = True, capacity: int | None = None) -> Candidate:
    return Candidate(eid, total_kv_blocks=capacity, block_size=BS, predicts_cache=predicted)


def served(router: Router, request: RouteRequest, candidates: list[Candidate], at: float) -> str:
    """Route `request`, then let it run to its end: only the prediction holds its blocks."""
    decision = router.route(request, candidates, random.Random(0), at)
    router.first_token(request.request_id)
    router.finish(request.request_id)
    return decision.engine_id


def predicted(router: Router, candidate: Candidate, keys: range, at: float) -> int:
    """The blocks of `keys` the router credits `candidate` with at `at`."""
    (view,) = router.with_inflight([candidate], prompt("probe", keys), at)
    return view.hit.device_blocks


def synced_routers() -> tuple[Router, Router, PeerRoutes]:
    """Two replicas' routers, the first's routes published to the second (as at 0 s)."""
    routers = [
        Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
        for _ in range(2)
    ]
    peer = PeerRoutes(routers[1])
    routers[0].publish_to(lambda event: peer.apply("replica-0", event, 0.0))
    return routers[0], routers[1], peer


def test_a_routed_prompt_stays_predicted_for_the_ttl_after_its_last_route() -> None:
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    a = engine("a")
    served(router, prompt("first", range(4)), [a], at=0.0)
    assert predicted(router, a, range(4), at=100.0) == 4  # long past pending_ttl_s
    # A later request through the same prefix refreshes its blocks, not the others.
    served(router, prompt("again", range(2)), [a], at=100.0)
    assert predicted(router, a, range(4), at=150.0) == 2
    assert predicted(router, a, range(4), at=219.0) == 2
    assert predicted(router, a, range(4), at=221.0) == 0


def test_the_next_prompt_goes_where_its_prefix_was_routed() -> None:
    """The point of it: a conversation's next turn, minutes later, finds its prefix."""
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    fleet = [engine("a"), engine("b"), engine("c")]
    first = served(router, prompt("turn-1", range(8)), fleet, at=0.0)
    decision = router.route(prompt("turn-2", range(10)), fleet, random.Random(1), 60.0)
    assert decision.engine_id == first
    assert decision.predicted_cached_tokens == 8 * BS


def test_past_its_capacity_the_least_recently_routed_blocks_are_dropped_first() -> None:
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    a = engine("a", capacity=6)
    served(router, prompt("old", range(4)), [a], at=0.0)
    served(router, prompt("new", range(10, 14)), [a], at=1.0)
    # Two blocks over: the older prompt's tail goes (its head stays a usable prefix).
    assert predicted(router, a, range(4), at=2.0) == 2
    assert predicted(router, a, range(10, 14), at=2.0) == 4
    # Routing the old prefix again makes it the most recent: the new prompt's tail goes.
    served(router, prompt("old-again", range(4)), [a], at=3.0)
    assert predicted(router, a, range(4), at=4.0) == 4
    assert predicted(router, a, range(10, 14), at=4.0) == 2


def test_an_engine_of_unknown_capacity_is_not_bounded() -> None:
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    a = engine("a", capacity=None)
    for n in range(50):
        served(router, prompt(f"p{n}", range(n * 100, n * 100 + 100)), [a], at=float(n))
    assert predicted(router, a, range(100), at=60.0) == 100


def test_the_prediction_is_cleared_when_the_engine_restarts_or_leaves() -> None:
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    a = engine("a")
    served(router, prompt("first", range(4)), [a], at=0.0)
    router.forget_engine("a")  # a new process of it, or removed: its cache starts empty
    assert predicted(router, a, range(4), at=1.0) == 0


def test_engines_with_kv_events_or_none_keep_only_the_short_claims() -> None:
    """`kv_events: none` stays cache-blind past `pending_ttl_s` (it may run without prefix
    caching); an engine whose events are followed has the index tell the truth."""
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    blind = engine("blind", predicted=False)
    served(router, prompt("first", range(4)), [blind], at=0.0)
    assert predicted(router, blind, range(4), at=5.0) == 4
    assert predicted(router, blind, range(4), at=11.0) == 0
    indexed = Candidate("indexed", hit=PrefixHit(2))
    served(router, prompt("second", range(4)), [indexed], at=20.0)
    (view,) = router.with_inflight([indexed], prompt("probe", range(4)), 31.0)
    assert view.hit == PrefixHit(2)  # what the index says, nothing of the router's


def test_a_policy_that_credits_no_routed_prompt_predicts_nothing() -> None:
    """`dynamo_cost` reads its overlap from KV events alone (`credits_pending_prefixes`)."""
    router = Router(make_policy("dynamo_cost"), pending_ttl_s=10.0, approximate_ttl_s=120.0)
    a = engine("a")
    served(router, prompt("first", range(4)), [a], at=0.0)
    assert predicted(router, a, range(4), at=1.0) == 0


def test_a_peer_replicas_routes_feed_the_prediction() -> None:
    """With `router.replica_sync`, a peer's route to an engine this replica predicts counts
    as its own would."""
    routers = synced_routers()[:2]
    a = engine("a")
    predicted(routers[1], a, range(0), at=0.0)  # it has seen the engine among its candidates
    served(routers[0], prompt("first", range(4)), [a], at=0.0)
    assert predicted(routers[1], a, range(4), at=100.0) == 4


def test_a_peer_replicas_route_is_a_prediction_before_this_replica_routes_there() -> None:
    """The fleet tells each replica's router which engines it predicts as they are registered
    (`Router.predict_cache`), and again once a new process of one is met (`forget_engine`
    forgot it): a peer's route there is a prediction from the first, not a `pending_ttl_s`
    claim that the replica forgets before it ever routes there itself."""
    *routers, peer = synced_routers()
    fleet = [engine("a"), engine("b")]
    for router in routers:
        for c in fleet:
            router.predict_cache(c.engine_id, c.capacity_blocks)
    first = served(routers[0], prompt("first", range(4)), fleet, at=0.0)
    # Past pending_ttl_s, within approximate_ttl_s: the peer's route still counts.
    decision = routers[1].route(prompt("again", range(4)), fleet, random.Random(1), 100.0)
    assert (decision.engine_id, decision.predicted_cached_tokens) == (first, 4 * BS)
    # A new process of the engine: forgotten, then told again.
    holder = next(c for c in fleet if c.engine_id == first)
    for router in routers:
        router.forget_engine(first)
        router.predict_cache(first, holder.capacity_blocks)
    routers[0].publish_to(lambda event: peer.apply("replica-0", event, 200.0))
    served(routers[0], prompt("after", range(20, 24)), [holder], at=200.0)
    assert predicted(routers[1], holder, range(20, 24), at=300.0) == 4


def test_claims_a_peer_sent_before_the_engine_was_known_become_predictions() -> None:
    """A joining replica may get its peers' snapshot before its fleet meets the engine (and
    tells its router that it predicts that engine's cache): the peers' routes there become
    predictions once it is told, lasting `approximate_ttl_s` from the route, not the short
    `pending_ttl_s` they were taken in with."""
    sender, joiner, _ = synced_routers()
    a = engine("a")
    sender.predict_cache("a", None)
    served(sender, prompt("first", range(4)), [a], at=0.0)
    joiner.predict_cache("a", None)  # the fleet met the engine at 5 s
    assert predicted(joiner, a, range(4), at=100.0) == 4
    assert predicted(joiner, a, range(4), at=121.0) == 0  # 120 s after the route
