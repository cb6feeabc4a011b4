"""The router core: each policy's documented behaviour, cost terms, ties, busy filtering,
in-flight accounting and the shared-system-prompt spread."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from typing import Any

import pytest

from controller.remote_index import keep_best_hit
from controller.router import (
    POLICY_NAMES,
    AllEnginesBusyError,
    BusyThresholds,
    Candidate,
    InFlight,
    KvplaneWeights,
    LoadSnapshot,
    NoEngineAvailableError,
    PrefixHit,
    Reason,
    Router,
    RouteRequest,
    make_policy,
)
from controller.router.peers import DynamoCost, LlmdLongestPrefix, SglangCacheAware
from controller.router.policies import KvplanePolicy

BS = 128


def request(rid: str = "r", blocks: int = 4, extra: int = 5, keys_from: int = 0) -> RouteRequest:
    keys = tuple(range(keys_from, keys_from + blocks))
    return RouteRequest(rid, blocks * BS + extra, BS, keys)


def cand(eid: str, device: int = 0, host: int = 0, **load: Any) -> Candidate:
    return Candidate(eid, hit=PrefixHit(device, host), load=LoadSnapshot(**load))


def test_kvplane_cost_terms_are_prefill_queue_and_decode() -> None:
    weights = KvplaneWeights(
        overlap_weight=2.0,
        host_weight=0.25,
        decode_weight=10.0,
        queue_knee=0,
        pass_tokens=0,
        backlog_tokens=0,
    )
    policy = KvplanePolicy(weights)
    req = request(blocks=4, extra=5)  # 69 tokens, at most 4 cacheable blocks
    rows = policy.costs(
        req,
        [
            Candidate("a", hit=PrefixHit(3, 1), inflight=InFlight(requests=2, prefill_tokens=100)),
            Candidate("b", load=LoadSnapshot(running_requests=1, waiting_tokens=7)),
        ],
    )
    a, b = rows
    assert (a.cached_tokens, a.host_cached_tokens) == (3 * BS, BS)
    assert a.prefill_cost == pytest.approx(2.0 * (5 + 0.25 * BS))
    assert (a.queue_cost, a.decode_cost) == (100.0, 20.0)
    assert a.total == pytest.approx(a.prefill_cost + 100.0 + 20.0)
    assert (b.cached_tokens, b.queue_cost, b.decode_cost) == (0, 7.0, 10.0)
    assert b.prefill_cost == 2.0 * (4 * BS + 5)


def test_overlap_weight_follows_cache_pressure() -> None:
    """From `idle_overlap_weight` with empty caches to `overlap_weight` with full ones."""
    policy = KvplanePolicy(KvplaneWeights(overlap_weight=5.0, idle_overlap_weight=9.0))
    req = request(blocks=8, extra=1)
    full = [Candidate(e, total_kv_blocks=100, cached_blocks=100) for e in "ab"]
    roomy = [Candidate(e, total_kv_blocks=100, cached_blocks=25) for e in "ab"]
    assert policy.costs(req, full)[0].prefill_cost == pytest.approx(5.0 * (8 * BS + 1))
    assert policy.costs(req, roomy)[0].prefill_cost == pytest.approx(8.0 * (8 * BS + 1))
    unknown = [Candidate(e) for e in "ab"]
    assert policy.costs(req, unknown)[0].prefill_cost == pytest.approx(5.0 * (8 * BS + 1))


def roomy(eid: str, device: int = 0, **load: Any) -> Candidate:
    """An engine whose cache is empty of data (cache pressure 0)."""
    return Candidate(
        eid, hit=PrefixHit(device), load=LoadSnapshot(**load), total_kv_blocks=10_000,
        cached_blocks=0,
    )  # fmt: skip


def test_a_long_queue_costs_more_than_its_length_while_caches_have_room() -> None:
    policy = KvplanePolicy(KvplaneWeights(queue_knee=1000, pass_tokens=0))
    rows = policy.costs(request(), [roomy("a", waiting_tokens=1000), roomy("b", waiting_tokens=10)])
    assert rows[0].queue_cost == pytest.approx(2000.0)
    assert rows[1].queue_cost == pytest.approx(10.1)
    # With full caches (unknown = full) the queue costs its length.
    rows = policy.costs(request(), [cand("a", waiting_tokens=1000), cand("b")])
    assert rows[0].queue_cost == pytest.approx(1000.0)


def test_a_request_behind_a_huge_prefill_leaves_its_prefix() -> None:
    """Queueing behind a prompt of 100k tokens costs more than recomputing an 8k-token prefix
    on an idle engine (with a linear queue cost it would stay and wait). Patience off: this
    is the cost alone."""
    req = RouteRequest("r", 64 * BS + 5, BS, tuple(range(64)))
    holder = roomy("a", 64, queued_requests=1, waiting_tokens=100_000)
    idle = roomy("b")
    weights = KvplaneWeights(idle_overlap_weight=30.0, queue_knee=50_000, patience_tokens=0)
    linear = Router(KvplanePolicy(dataclasses.replace(weights, queue_knee=0)))
    assert linear.explain(req, [holder, idle], random.Random(0), 0).engine_id == "a"
    knee = Router(KvplanePolicy(weights))
    assert knee.explain(req, [holder, idle], random.Random(0), 0).engine_id == "b"


def test_no_cached_prefix_is_worth_a_wait_past_patience() -> None:
    """A conversation with a 40k-token prefix cached stays on its engine behind a long queue,
    until the wait there (queue + uncached tokens) is more than `patience_tokens` longer than
    recomputing the whole prompt on an idle engine; the overlap weight alone would keep it."""
    req = RouteRequest("r", 320 * BS + 5, BS, tuple(range(320)))  # all but 5 tokens cached
    idle = roomy("b")
    patient = Router(KvplanePolicy(KvplaneWeights(patience_tokens=60_000)))
    unbounded = Router(KvplanePolicy(KvplaneWeights(patience_tokens=0)))
    within = [roomy("a", 320, queued_requests=1, waiting_tokens=100_000), idle]
    assert patient.explain(req, within, random.Random(0), 0).engine_id == "a"
    past = [roomy("a", 320, queued_requests=1, waiting_tokens=101_000), idle]
    d = patient.explain(req, past, random.Random(0), 0)
    assert (d.engine_id, d.reason) == ("b", Reason.PATIENCE)
    assert d.costs[0].total is not None and d.costs[1].total is not None
    assert d.costs[0].total < d.costs[1].total  # the cost alone still prefers the holder
    assert unbounded.explain(req, past, random.Random(0), 0).engine_id == "a"
    # A backlogged fleet (every queue at least backlog_tokens) waits whatever the choice, and
    # recomputing a prefix only adds to it: patience does not apply.
    backlogged = [cand("a", 320, waiting_tokens=400_000), cand("b", waiting_tokens=250_000)]
    assert patient.explain(req, backlogged, random.Random(0), 0).engine_id == "a"


@pytest.mark.parametrize(
    ("hit", "within", "past"),
    [
        # On disk, loading costs 0.75 of computing: its 40,960 tokens wait as 30,720.
        (PrefixHit(disk_blocks=320), 70_000, 90_000),
        # On host memory, at 0.25: as 10,240.
        (PrefixHit(host_blocks=320), 90_000, 95_000),
    ],
    ids=["disk", "host"],
)
def test_a_prefix_loaded_from_disk_or_host_memory_is_no_wait_saved_past_patience(
    hit: PrefixHit, within: int, past: int
) -> None:
    """The engine holding the 40k-token prompt on disk (or host memory) behind a queue: its
    prefill wait is the queue and then the prompt's load at `disk_weight` (`host_weight`)
    of computing it, which the cost counts too; past `patience_tokens` (60,000) longer than
    computing the prompt on an idle engine it is not chosen. Before, the wait counted a
    prefix on disk as held at no cost: the engine was chosen with a queue 90,000 tokens
    long and 30,720 tokens to load, 79,760 tokens longer than the idle engine's wait."""
    req = RouteRequest("r", 320 * BS + 5, BS, tuple(range(320)))
    idle = roomy("b")

    def holder(waiting: int) -> Candidate:
        return roomy("a", queued_requests=1, waiting_tokens=waiting)._replace(hit=hit)

    patient = Router(KvplanePolicy(KvplaneWeights(patience_tokens=60_000)))
    unbounded = Router(KvplanePolicy(KvplaneWeights(patience_tokens=0)))
    assert patient.explain(req, [holder(within), idle], random.Random(0), 0).engine_id == "a"
    d = patient.explain(req, [holder(past), idle], random.Random(0), 0)
    assert (d.engine_id, d.reason) == ("b", Reason.PATIENCE)
    assert unbounded.explain(req, [holder(past), idle], random.Random(0), 0).engine_id == "a"


def test_decode_load_weighs_by_the_passes_a_prompt_needs() -> None:
    """Every forward pass that also decodes is slower: a long prompt (many passes) avoids an
    engine with decodes running, a short one does not mind them."""
    router = Router(KvplanePolicy(KvplaneWeights(decode_weight=256, pass_tokens=8192)))
    decoding = cand("a", running_requests=1)
    queued = cand("b", waiting_tokens=400)
    long_prompt = RouteRequest("long", 40_000, BS, ())
    short_prompt = RouteRequest("short", 100, BS, ())
    assert router.explain(long_prompt, [decoding, queued], random.Random(0), 0).engine_id == "b"
    assert router.explain(short_prompt, [decoding, queued], random.Random(0), 0).engine_id == "a"


def test_queued_requests_do_not_count_as_decoding() -> None:
    """Only running requests (at most `pass_decodes`) slow the passes; an overloaded engine's
    queue is already in its waiting tokens."""
    policy = KvplanePolicy(KvplaneWeights(decode_weight=1, pass_tokens=1000, pass_decodes=4))
    req = RouteRequest("r", 1000, BS, ())
    overloaded = cand("a", running_requests=256, queued_requests=5000, waiting_tokens=9000)
    (row,) = policy.costs(req, [overloaded])
    assert row.decode_cost == pytest.approx(5256 + 4 * (9000 + 1000) / 1000)


def test_at_least_one_token_is_recomputed() -> None:
    req = RouteRequest("r", 4 * BS, BS, (1, 2, 3, 4))  # exactly 4 full blocks
    assert req.max_cacheable_blocks == 3
    assert req.cached_tokens(PrefixHit(4, 0)) == (3 * BS, 0, 0)


def test_kvplane_prefers_cached_engine_then_device_over_host() -> None:
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    d = router.explain(
        request(blocks=8), [cand("none"), cand("dev", 8), cand("host", 0, 8)], rng, 0
    )
    assert (d.engine_id, d.reason) == ("dev", Reason.CACHE)
    assert d.predicted_cached_tokens == 8 * BS
    d = router.explain(request(blocks=8), [cand("none"), cand("host", 0, 8)], rng, 0)
    assert d.engine_id == "host"


def on_disk(eid: str, blocks: int) -> Candidate:
    """An engine holding the prompt's first `blocks` blocks on disk (SSD) only."""
    return Candidate(eid, hit=PrefixHit(disk_blocks=blocks))


def test_kvplane_counts_a_prefix_on_disk_between_the_host_tier_and_none() -> None:
    """A prefix an engine would load from disk costs `disk_weight` (0.75) of computing it:
    that engine wins over a cold one and loses to one holding it on the device or the
    host; the decision predicts its disk tokens cached."""
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    req = request(blocks=8)
    d = router.explain(req, [cand("none"), on_disk("disk", 8)], rng, 0)
    assert (d.engine_id, d.reason, d.predicted_cached_tokens) == ("disk", Reason.CACHE, 8 * BS)
    row = {r.engine_id: r for r in d.costs}["disk"]
    assert (row.cached_tokens, row.host_cached_tokens, row.disk_cached_tokens) == (0, 0, 8 * BS)
    for better in (cand("dev", 8), cand("host", 0, 8)):
        d = router.explain(req, [cand("none"), on_disk("disk", 8), better], rng, 0)
        assert d.engine_id == better.engine_id


def test_kvplane_cost_weighs_disk_tokens_at_disk_weight() -> None:
    weights = KvplaneWeights(
        overlap_weight=2.0, disk_weight=0.5, decode_weight=0, pass_tokens=0, backlog_tokens=0
    )
    req = request(blocks=4, extra=5)  # 4 full blocks and 5 tokens
    (row,) = KvplanePolicy(weights).costs(req, [Candidate("a", hit=PrefixHit(1, 1, 2))])
    assert (row.cached_tokens, row.host_cached_tokens, row.disk_cached_tokens) == (
        BS,
        BS,
        2 * BS,
    )
    assert row.prefill_cost == pytest.approx(2.0 * (5 + 0.25 * BS + 0.5 * 2 * BS))
    assert KvplaneWeights().disk_weight == 0.75  # more than host memory, less than computing


def test_a_hit_along_the_tiers_counts_each_block_at_the_slowest_tier_so_far() -> None:
    """`PrefixHit.along` (an index match: runs on HBM, on HBM or DRAM, on any tier)."""
    assert PrefixHit.along(2, 4, 6) == PrefixHit(2, 2, 2)
    assert PrefixHit.along(0, 0, 5) == PrefixHit(0, 0, 5)  # on disk alone
    assert PrefixHit.along(3, 3, 0) == PrefixHit(3, 0, 0)  # an indexer without the field
    assert PrefixHit.along(3, 3, 3) == PrefixHit(3, 0, 0)


def test_cached_tokens_take_device_then_host_then_disk_up_to_the_cacheable_blocks() -> None:
    req = request(blocks=4, extra=0)  # 3 cacheable blocks
    assert req.cached_tokens(PrefixHit(1, 1, 5)) == (BS, BS, BS)
    assert req.cached_tokens(PrefixHit(0, 0, 9)) == (0, 0, 3 * BS)


def test_blocks_routed_past_a_prefix_on_disk_extend_it_on_the_device() -> None:
    """The router's pending blocks continue an indexed prefix whatever its tiers: the
    blocks it sent after the disk ones count as on the device, those stay on disk."""
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0)
    rng = random.Random(0)
    router.route(request("x", blocks=6), [on_disk("a", 2)], rng, 0)
    (view,) = router.with_inflight([on_disk("a", 2)], request("probe", blocks=6), 1.0)
    assert view.hit == PrefixHit(4, 0, 2)


def test_kvplane_leaves_a_cached_engine_whose_queue_is_long() -> None:
    router = Router(make_policy("kvplane"))
    busy_with_cache = cand("a", 4, queued_requests=3, waiting_tokens=100_000)
    d = router.explain(request(blocks=4), [busy_with_cache, cand("b")], random.Random(0), 0)
    assert (d.engine_id, d.reason) == ("b", Reason.LOAD)


def test_kvplane_keeps_prefixes_harder_when_the_whole_fleet_is_backlogged() -> None:
    """The same difference in queue length moves a request off its cached prefix when
    another engine is idle, not when even the shortest queue is a backlog."""
    req = RouteRequest("r", 40 * BS, BS, tuple(range(40)))  # 39 cacheable blocks
    policy = KvplanePolicy(KvplaneWeights(queue_knee=0, pass_tokens=0, decode_weight=0))

    def choice(base_queue: int) -> str:
        holder = cand("holder", 39, waiting_tokens=base_queue + 100_000)
        other = cand("other", waiting_tokens=base_queue)
        return policy.choose(req, [holder, other], random.Random(0), 0).engine_id

    assert choice(0) == "other"  # overlap 12: 12 x 4,992 recomputed < 100,000 more queued
    assert choice(200_000) == "holder"  # backlogged: overlap 36 makes it 179,712
    off = KvplanePolicy(KvplaneWeights(queue_knee=0, pass_tokens=0, backlog_tokens=0))
    backlogged = [cand("holder", 39, waiting_tokens=300_000), cand("other", waiting_tokens=200_000)]
    assert off.choose(req, backlogged, random.Random(0), 0).engine_id == "other"


def test_the_polled_queue_leaves_out_what_the_router_knows_is_cached() -> None:
    """GetLoad's waiting tokens count each waiting prompt whole; the cached part of the
    router's own waiting requests comes out, down to its own uncached prefill at least."""
    known = InFlight(requests=2, prefilling=2, prefill_tokens=1_000, prefill_cached_tokens=8_000)
    polled = Candidate("a", load=LoadSnapshot(waiting_tokens=10_000), inflight=known)
    assert polled.pending_prefill_tokens == 2_000
    # Requests already running, or sent since the poll, are not in the polled figure.
    stale = Candidate("a", load=LoadSnapshot(waiting_tokens=3_000), inflight=known)
    assert stale.pending_prefill_tokens == 1_000
    assert Candidate("a", inflight=known).pending_prefill_tokens == 1_000
    assert Candidate("a", load=LoadSnapshot(waiting_tokens=500)).pending_prefill_tokens == 500


def test_predicted_hits_count_as_far_as_they_outlive_the_queue() -> None:
    """A queued request's cached prefix comes out of the polled queue in the share the cache
    keeps while the work ahead passes through it: none once that work fills the cache."""
    known = InFlight(requests=2, prefilling=2, prefill_tokens=1_000, prefill_cached_tokens=8_000)
    polled = LoadSnapshot(waiting_tokens=10_000)
    # A cache of 4 blocks of 1,000 tokens.
    short_queue = Candidate("a", load=polled, inflight=known, total_kv_blocks=4, block_size=1_000)
    assert short_queue.cache_survival == pytest.approx(0.75)
    assert short_queue.pending_prefill_tokens == 10_000 - 6_000
    overloaded = short_queue._replace(inflight=known._replace(prefill_tokens=5_000))
    assert overloaded.cache_survival == 0.0
    assert overloaded.pending_prefill_tokens == 10_000
    assert Candidate("a", load=polled, inflight=known).cache_survival == 1.0  # size unknown


def test_queued_turns_of_cached_conversations_do_not_push_a_request_off_its_prefix() -> None:
    """Two follow-up turns queued on `a` are mostly cached there: the poll shows their whole
    prompts (16k tokens), the real prefill queue is 1k. A third request with an 8-block prefix
    on `a` stays (counting the whole prompts, recomputing its prefix on idle `b` would win)."""
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    for rid, first_key in (("t1", 1000), ("t2", 2000)):
        turn = request(rid, blocks=64, keys_from=first_key)
        d = router.route(turn, [cand("a", 60), cand("b")], rng, 0)
        assert d.engine_id == "a"
    polled_queue = 2 * (64 * BS + 5)
    holder = cand("a", 8, queued_requests=2, waiting_tokens=polled_queue)
    d = router.explain(request("t3", blocks=64), [holder, cand("b")], rng, 0)
    assert (d.engine_id, d.reason) == ("a", Reason.CACHE)
    (row_a,) = [r for r in d.costs if r.engine_id == "a"]
    assert row_a.queue_cost == 2 * (4 * BS + 5)


def test_ties_are_spread_at_random() -> None:
    router = Router(make_policy("kvplane"))
    rng = random.Random(1)
    engines = [cand(f"e{i}", 2) for i in range(4)]
    picks = Counter(router.explain(request(), engines, rng, 0).engine_id for _ in range(200))
    assert set(picks) == {"e0", "e1", "e2", "e3"}
    assert router.explain(request(), engines, rng, 0).reason is Reason.TIE


def test_a_softmax_temperature_weighs_engines_by_their_share_of_the_cost_spread() -> None:
    """`temperature` > 0 samples every engine, each weighed exp(-(total - best) / (worst -
    best) / temperature), as Dynamo's router does: scale-free, so at 1 the cold engines keep
    e^-1 of the cached one's weight however large the gap (the cached one gets 1 / (1 + 2 /
    e) = 58% of the requests), at 0.1 e^-10 (all of them here); equal engines share evenly.
    Every such choice among several engines is a `tie` (the sample decided it)."""

    def picks(temperature: float, engines: list[Candidate]) -> Counter[str]:
        router = Router(KvplanePolicy(KvplaneWeights(temperature=temperature)))
        rng = random.Random(3)
        decisions = [router.explain(request(), engines, rng, 0) for _ in range(1000)]
        assert {d.reason for d in decisions} == {Reason.TIE}
        return Counter(d.engine_id for d in decisions)

    one_cached = [cand("e0", 4), cand("e1"), cand("e2")]
    warm = picks(1.0, one_cached)
    assert 500 <= warm["e0"] <= 650 and min(warm["e1"], warm["e2"]) >= 150, warm
    assert picks(0.1, one_cached) == {"e0": 1000}
    even = picks(1.0, [cand(f"e{i}", 4) for i in range(3)])
    assert min(even.values()) >= 250, even


def test_engines_within_tie_tokens_of_the_best_cost_are_ties() -> None:
    """`tie_tokens` (64): an engine whose cost is 30 tokens above the best one's is a tie and
    shares its requests; one 100 tokens above is not (`tie_ratio` 0)."""
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    engines = [cand("best"), cand("near", waiting_tokens=30), cand("far", waiting_tokens=100)]
    decisions = [router.explain(request(), engines, rng, 0) for _ in range(200)]
    totals = {r.engine_id: r.total or 0.0 for r in decisions[0].costs}
    assert totals["near"] - totals["best"] == 30 and totals["far"] - totals["best"] == 100
    assert Counter(d.engine_id for d in decisions).keys() == {"best", "near"}
    assert {d.reason for d in decisions} == {Reason.TIE}


@pytest.mark.parametrize("name", ["least_loaded", "dynamo_cost", "llmd_longest_prefix"])
def test_equal_engines_share_the_requests_at_random(name: str) -> None:
    """Of engines the policy rates alike (as loaded; as cheap; as long a prefix), each is
    picked at random, never always the first listed; a worse one never."""
    policy = make_policy(name)
    rng = random.Random(0)
    engines = [cand("a", 2, running_requests=1), cand("b", 2, running_requests=1), cand("c")]
    if name == "least_loaded":  # c the busiest
        engines[2] = cand("c", running_requests=2)
    picks = Counter(policy.choose(request(), engines, rng, 0).engine_id for _ in range(100))
    assert picks.keys() == {"a", "b"}, picks


@pytest.mark.parametrize("engines", [3, 8])
@pytest.mark.parametrize(("prefix_blocks", "tail_blocks"), [(2, 6), (4, 1), (8, 1), (16, 1)])
@pytest.mark.parametrize("caches", ["unknown", "roomy"])
def test_shared_system_prefix_never_collapses_onto_one_engine(
    engines: int, prefix_blocks: int, tail_blocks: int, caches: str
) -> None:
    """Every prompt starts with the same system prefix, which only e0 holds at first: a short
    one before a long user part, or a long one (up to 16 blocks) before a one-block question.
    Engines learn the prefix as they serve it; nothing finishes (a burst). Whatever the burst
    (30, 60, 90 requests), every engine serves some and none more than half: a hot prefix is
    worth replicating even where caches have room ("roomy": the overlap weight is
    `idle_overlap_weight`), since the requests in flight that share it amortise its prefill
    (`KvplaneWeights.hot_prefix_requests`). Unknown cache sizes read as full caches."""
    for name in ("kvplane", "dynamo_cost", "least_loaded", "round_robin", "power_of_two"):
        router = Router(make_policy(name))
        rng = random.Random(7)
        holders = {"e0"}
        picks: Counter[str] = Counter()
        for i in range(90):
            tail = range(10 * i, 10 * i + tail_blocks)
            keys = (*range(1000, 1000 + prefix_blocks), *tail)
            req = RouteRequest(f"r{i}", len(keys) * BS + 3, BS, keys)
            fleet = [
                cand(f"e{k}", prefix_blocks if f"e{k}" in holders else 0) for k in range(engines)
            ]
            if caches == "roomy":
                fleet = [
                    c._replace(total_kv_blocks=10_000, block_size=BS, cached_blocks=100)
                    for c in fleet
                ]
            d = router.route(req, fleet, rng, float(i))
            holders.add(d.engine_id)
            picks[d.engine_id] += 1
            if i + 1 in (30, 60, 90):
                assert len(picks) == engines, (name, i + 1, picks)
                assert max(picks.values()) <= (i + 1) // 2, (name, i + 1, picks)


def test_a_hot_prefix_costs_the_overlap_weight_over_the_requests_sharing_it() -> None:
    """An engine holds a 16-block prefix that `sharers` of its active requests hold too:
    recomputing it elsewhere costs the overlap weight divided by their number, from two up.
    One sharer (a conversation's previous turn, most often) changes nothing, nor do sharers
    of only part of what the holder caches (its own earlier turns, which none of them hold),
    nor any number while the fleet is backlogged."""
    policy = KvplanePolicy(KvplaneWeights(overlap_weight=12.0, backlog_tokens=0))
    req = request(blocks=17, extra=3)  # 16 shared blocks, one of its own

    def elsewhere(cached: int, active: int, sharers: int) -> float:
        holder = cand("holder", cached)._replace(
            active_overlap_blocks=active, active_prefix_sharers=sharers
        )
        rows = policy.costs(req, [holder, cand("cold")])
        return rows[1].prefill_cost

    full = 12.0 * (17 * BS + 3)
    assert elsewhere(16, 16, 0) == elsewhere(16, 16, 1) == full
    assert elsewhere(16, 16, 2) == full / 2
    assert elsewhere(16, 16, 6) == full / 6
    assert elsewhere(16, 16, 100) == 1.0 * (17 * BS + 3)  # still computed: at least 1
    assert elsewhere(16, 8, 6) == full  # the holder caches more than they hold
    # The decision says by how many it divided (what `admin route` shows), 0 when it did not.
    rng = random.Random(0)
    hot = cand("holder", 16)._replace(active_overlap_blocks=16, active_prefix_sharers=6)
    assert policy.choose(req, [hot, cand("cold")], rng, 0).hot_prefix_sharers == 6
    lone = hot._replace(active_prefix_sharers=1)
    assert policy.choose(req, [lone, cand("cold")], rng, 0).hot_prefix_sharers == 0
    holder = cand("holder", 16)._replace(active_overlap_blocks=16, active_prefix_sharers=6)
    off = KvplanePolicy(KvplaneWeights(overlap_weight=12.0, hot_prefix_requests=0))
    assert off.costs(req, [holder, cand("cold")])[1].prefill_cost == full
    # Nor while the fleet is backlogged (every queue at least `backlog_tokens`).
    backlogged = KvplanePolicy(KvplaneWeights(overlap_weight=12.0, backlog_overlap_weight=0))
    queued = [c._replace(load=LoadSnapshot(waiting_tokens=200_000)) for c in (holder, cand("cold"))]
    assert backlogged.costs(req, queued)[1].prefill_cost == full


def test_inflight_accounting_charges_at_once_and_releases() -> None:
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    req = request("x", blocks=4, extra=5)
    d = router.route(req, [cand("a", 2), cand("b")], rng, 0)
    assert d.engine_id == "a"
    assert router.inflight.of("a") == InFlight(
        requests=1,
        prefilling=1,
        prefill_tokens=2 * BS + 5,
        prefill_cached_tokens=2 * BS,
        active_blocks=4,
    )
    router.first_token("x")
    router.first_token("x")
    assert router.inflight.of("a") == InFlight(requests=1, active_blocks=4)
    router.finish("x")
    router.finish("x")
    assert router.inflight.of("a") == InFlight()
    assert router.inflight.engine_of("x") is None


def test_pending_blocks_are_held_for_the_ttl_and_until_the_first_token() -> None:
    """Blocks just routed count as held before the engine announces them: for `pending_ttl_s`,
    and however long the request waits for its first token (behind a long queue)."""
    router = Router(make_policy("kvplane"), pending_ttl_s=10.0)
    rng = random.Random(0)
    assert router.route(request("x", blocks=4), [cand("a"), cand("b", 1)], rng, 0).engine_id == "b"
    router.route(request("y", blocks=2), [cand("a"), cand("b", 1)], rng, 1)

    def held(now_s: float) -> int:
        view = router.with_inflight([cand("a"), cand("b")], request("probe", blocks=4), now_s)
        return next(c.hit.device_blocks for c in view if c.engine_id == "b")

    assert held(5.0) == 4
    assert held(60.0) == 4  # both still queued: no event can have announced the blocks
    router.first_token("x")
    assert held(9.0) == 4  # within the ttl regardless
    assert held(60.0) == 2  # y, still queued, holds its two blocks
    router.finish("y")
    assert held(60.0) == 0  # from here the engine's KV events tell the truth
    router.route(request("z", blocks=4), [cand("a", 4), cand("b")], rng, 100)
    router.forget_engine("a")
    view = router.with_inflight([cand("a")], request("probe", blocks=4), 200.0)
    assert view[0].hit.device_blocks == 0


@pytest.mark.parametrize("name", ["kvplane", "dynamo_cost", "round_robin"])
def test_a_request_that_reads_no_cache_sees_none_and_still_charges_its_blocks(name: str) -> None:
    """`kv.bypass_prefix_cache`: an engine holding the whole prefix (indexed, and pending
    from a request just routed) is no better than the others, and 0 cached tokens are
    predicted; the blocks it computes are credited to its engine as any cold prompt's."""
    router = Router(make_policy(name), pending_ttl_s=10.0)
    rng = random.Random(0)
    bypass = request("bypass", blocks=4)._replace(reads_cache=False)
    decision = router.route(bypass, [cand("a", 4), cand("b")], rng, 0)
    assert decision.predicted_cached_tokens == 0
    assert decision.reason != Reason.CACHE
    assert all(row.cached_tokens == row.host_cached_tokens == 0 for row in decision.costs)
    view = router.with_inflight([cand("a", 4), cand("b")], bypass, 1.0)
    assert [c.hit for c in view] == [PrefixHit(), PrefixHit()]
    # Its own blocks: pending on its engine, for a prompt that reads the cache.
    view = router.with_inflight([cand("a"), cand("b")], request("next", blocks=4), 1.0)
    credited = {c.engine_id: c.hit.device_blocks for c in view}
    assert credited[decision.engine_id] == (4 if router.policy.credits_pending_prefixes else 0)


def test_a_burst_is_spread_before_any_poll() -> None:
    """The polled load says every engine is idle; the router's own accounting spreads a burst."""
    router = Router(make_policy("kvplane"))
    rng = random.Random(3)
    engines = [cand(f"e{i}") for i in range(4)]
    picks = Counter(
        router.route(request(f"r{i}", keys_from=100 * i), engines, rng, 0).engine_id
        for i in range(40)
    )
    assert sorted(picks.values()) == [10, 10, 10, 10]


def test_busy_engines_are_filtered_unless_all_are_busy() -> None:
    busy = BusyThresholds(kv_usage=0.95, queued_requests=8, max_busy_fraction=1.0)
    router = Router(make_policy("kvplane"), busy=busy)
    rng = random.Random(0)
    full = cand("full", 4, used_kv_blocks=99, total_kv_blocks=100)
    queued = cand("queued", 4, queued_requests=8)
    d = router.explain(request(), [full, queued, cand("cold")], rng, 0)
    assert d.engine_id == "cold"
    assert {r.engine_id for r in d.costs if r.busy} == {"full", "queued"}
    d = router.explain(request(), [full, queued], rng, 0)
    assert (d.engine_id, d.reason) == ("full", Reason.ALL_BUSY)
    # Busy from the threshold on: exactly 95% full is busy.
    assert busy.is_busy(cand("edge", used_kv_blocks=95, total_kv_blocks=100))
    assert not busy.is_busy(cand("under", used_kv_blocks=94, total_kv_blocks=100))


def test_busy_engines_are_skipped_only_while_few_of_them_are_busy() -> None:
    """A lone full engine is skipped; when more of the fleet is full (a backlog everywhere)
    the cost chooses among all, and the cached engine keeps its conversation. (The filter
    alone: the memory term would also send the request away from the full engine.)"""
    policy = KvplanePolicy(KvplaneWeights(memory_weight=0))
    router = Router(policy)  # default: one busy engine in eight may be skipped
    rng = random.Random(0)
    cached = cand("cached", 4, used_kv_blocks=100, total_kv_blocks=100)

    def fleet(full: int) -> list[Candidate]:
        engines = [cached]
        engines += [
            cand(f"full{i}", used_kv_blocks=99, total_kv_blocks=100) for i in range(full - 1)
        ]
        return engines + [
            cand(f"room{i}", used_kv_blocks=10, total_kv_blocks=100) for i in range(8 - full)
        ]

    d = router.explain(request(), fleet(1), rng, 0)
    assert d.engine_id.startswith("room")
    assert {r.engine_id for r in d.costs if r.busy} == {"cached"}
    d = router.explain(request(), fleet(2), rng, 0)
    assert (d.engine_id, d.reason) == ("cached", Reason.CACHE)
    assert not any(r.busy for r in d.costs)
    quarter = Router(policy, busy=BusyThresholds(max_busy_fraction=0.25))
    assert quarter.explain(request(), fleet(2), rng, 0).engine_id.startswith("room")
    assert quarter.explain(request(), fleet(3), rng, 0).engine_id == "cached"
    d = router.explain(request(), [cached, cand("room")], rng, 0)
    assert d.engine_id == "room"  # in a small fleet one busy engine may still be skipped


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_only_the_kvplane_policy_skips_busy_engines(name: str) -> None:
    """The peers' and the baselines' real systems have no such filter: they see every engine,
    and the explanation marks none busy."""
    router = Router(make_policy(name), busy=BusyThresholds(kv_usage=0.5, max_busy_fraction=1.0))
    full = cand("full", 4, used_kv_blocks=99, total_kv_blocks=100)
    d = router.explain(request(), [full], random.Random(0), 0)
    skips = name == "kvplane"
    assert router.policy.filters_busy is skips
    assert d.reason == (Reason.ALL_BUSY if skips else Reason.ONLY)
    d = router.explain(request(), [full, cand("cold")], random.Random(0), 0)
    assert any(r.busy for r in d.costs) is skips


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_asked_to_reject_when_all_busy_every_policy_refuses_charging_no_one(name: str) -> None:
    """Load shedding is the caller's guard, not a policy's trait: whatever the policy, a
    request whose every candidate is busy (however many: `max_busy_fraction` has no say) is
    refused before anything is charged or the policy sees it; one engine with room takes it.
    Not asked, every policy routes as it always did."""
    router = Router(make_policy(name), busy=BusyThresholds(kv_usage=0.9, queued_requests=3))
    rng = random.Random(0)
    full = cand("full", 4, used_kv_blocks=95, total_kv_blocks=100)
    queued = cand("queued", queued_requests=3)
    with pytest.raises(AllEnginesBusyError) as err:
        router.route(request("x"), [full, queued], rng, 0, reject_when_all_busy=True)
    assert (
        str(err.value)
        == "every engine is busy (KV usage >= 90% or queued requests >= 3): retry later"
    )
    with pytest.raises(AllEnginesBusyError):
        router.explain(request("x"), [full, queued], rng, 0, reject_when_all_busy=True)
    assert router.inflight.engine_of("x") is None
    assert router.inflight.of("full") == router.inflight.of("queued") == InFlight()
    d = router.route(request("y"), [full, queued, cand("room")], rng, 0, reject_when_all_busy=True)
    assert router.inflight.engine_of("y") == d.engine_id
    d = router.route(request("z"), [full, queued], rng, 0)
    assert d.engine_id in {"full", "queued"}


def test_the_routers_own_in_flight_requests_make_an_engine_busy() -> None:
    """Requests the router just sent and the engine has not started count as queued before
    the next poll shows them: a burst is refused once it filled the queues."""
    router = Router(make_policy("round_robin"), busy=BusyThresholds(queued_requests=1))
    rng = random.Random(0)
    router.route(request("a"), [cand("e")], rng, 0, reject_when_all_busy=True)
    with pytest.raises(AllEnginesBusyError, match=r"queued requests >= 1\)"):
        router.route(request("b"), [cand("e")], rng, 0, reject_when_all_busy=True)
    router.first_token("a")  # no longer queued there
    assert router.route(request("b"), [cand("e")], rng, 0, reject_when_all_busy=True)
    # So too for the hop of a disaggregated request: "a" waits on the prefill engine p.
    disagg = Router(make_policy("kvplane"), busy=BusyThresholds(queued_requests=1))
    roles = [cand("p")], [cand("d")]
    disagg.route_disaggregated(request("a"), *roles, rng, 0, reject_when_all_busy=True)
    with pytest.raises(AllEnginesBusyError, match=r"^every prefill engine is busy"):
        disagg.route_disaggregated(request("b"), *roles, rng, 0, reject_when_all_busy=True)


def test_disaggregated_rejection_judges_each_role_the_request_needs_now() -> None:
    """Every request ends on a decode engine: all of them busy refuses it. All prefill
    engines busy refuses a request that would hop there, not one the decode engine prefills
    itself (it holds the prompt). Nothing is charged for a refused request."""
    router = Router(make_policy("kvplane"), busy=BusyThresholds(kv_usage=0.9))
    rng = random.Random(0)
    busy = {"used_kv_blocks": 95, "total_kv_blocks": 100}
    prefill, busy_prefill = [cand("p0")], [cand("p0", **busy), cand("p1", **busy)]
    decode, busy_decode = [cand("d0")], [cand("d0", **busy)]
    with pytest.raises(AllEnginesBusyError, match=r"^every decode engine is busy"):
        router.route_disaggregated(
            request("x", blocks=10), prefill, busy_decode, rng, 0, reject_when_all_busy=True
        )
    with pytest.raises(AllEnginesBusyError, match=r"^every prefill engine is busy"):
        router.route_disaggregated(
            request("x", blocks=10), busy_prefill, decode, rng, 0, reject_when_all_busy=True
        )
    assert router.inflight.engine_of("x") is None
    cached = [cand("d0", 10)]  # holds the whole prompt: prefills it itself
    d = router.route_disaggregated(
        request("y", blocks=10, extra=1), busy_prefill, cached, rng, 0, reject_when_all_busy=True
    )
    assert d.decode is not None and d.decode.engine_id == "d0"
    d = router.route_disaggregated(request("z", blocks=10), busy_prefill, busy_decode, rng, 0)
    assert d.prefill is not None  # not asked: the least loaded busy prefill engine, as ever


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(NoEngineAvailableError):
        Router(make_policy("kvplane")).route(request(), [], random.Random(0), 0)


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    assert {make_policy(n).name for n in POLICY_NAMES} == set(POLICY_NAMES)


def test_session_affinity_keeps_a_session_on_its_engine() -> None:
    router = Router(make_policy("round_robin"))
    rng = random.Random(0)
    engines = [cand("a"), cand("b"), cand("c")]
    first = router.route(RouteRequest("1", 40, BS, session_key="s"), engines, rng, 0)
    again = [
        router.route(RouteRequest(f"x{i}", 40, BS, session_key="s"), engines, rng, 0)
        for i in range(5)
    ]
    assert {d.engine_id for d in again} == {first.engine_id}
    assert {d.reason for d in again} == {Reason.SESSION}
    router.forget_engine(first.engine_id)
    moved = router.route(
        RouteRequest("y", 40, BS, session_key="s"),
        [c for c in engines if c.engine_id != first.engine_id],
        rng,
        0,
    )
    assert moved.engine_id != first.engine_id


def test_round_robin_least_loaded_power_of_two_random() -> None:
    rng = random.Random(0)
    engines = [
        cand("a", running_requests=5),
        cand("b", running_requests=1),
        cand("c", running_requests=3),
    ]
    rr = make_policy("round_robin")
    assert [rr.choose(request(), engines, rng, 0).engine_id for _ in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]
    assert make_policy("least_loaded").choose(request(), engines, rng, 0).engine_id == "b"
    p2 = make_policy("power_of_two")
    for _ in range(50):
        assert p2.choose(request(), engines, rng, 0).engine_id != "a"  # never the worse of a pair
    rnd = make_policy("random")
    assert {rnd.choose(request(), engines, rng, 0).engine_id for _ in range(60)} == {"a", "b", "c"}


def test_sglang_cache_aware_branches() -> None:
    rng = random.Random(0)
    policy = SglangCacheAware()
    a, b = cand("a"), cand("b")
    warm = request("w", blocks=10, keys_from=0)
    policy.observe(warm, "a", 0)
    # Match above 30% of the prompt: the matching worker.
    assert policy.choose(request(blocks=10, keys_from=0), [b, a], rng, 0).engine_id == "a"
    # A 2-of-10 block match is under the threshold: the smallest tree (b is empty).
    partial = RouteRequest("p", 10 * BS, BS, (0, 1, *range(500, 508)))
    d = policy.choose(partial, [a, b], rng, 0)
    assert (d.engine_id, d.reason) == ("b", Reason.LOAD)
    # Imbalanced (100 vs 10 in flight: > 64 apart and > 1.5x): the least loaded, cache ignored.
    loaded_a = Candidate("a", inflight=InFlight(requests=100))
    light_b = Candidate("b", inflight=InFlight(requests=10))
    d = policy.choose(request(blocks=10), [loaded_a, light_b], rng, 0)
    assert (d.engine_id, d.reason) == ("b", Reason.BALANCE)
    # 100 vs 40 is not imbalanced by the absolute threshold (60 <= 64): cache wins.
    assert (
        policy.choose(
            request(blocks=10), [loaded_a, Candidate("b", inflight=InFlight(requests=40))], rng, 0
        ).engine_id
        == "a"
    )


def test_sglang_cache_aware_thresholds_are_its_documented_ones() -> None:
    """A match over 30% of the prompt goes to its worker, one of exactly 30% does not; the
    load is imbalanced when max - min > 64 and max > 1.5 x min: 210 vs 140 in flight (70
    apart, exactly 1.5x) is not, 211 vs 140 is."""
    rng = random.Random(0)
    policy = SglangCacheAware()
    policy.observe(request("w", blocks=10), "a", 0)
    policy.observe(request("o", blocks=2, keys_from=900), "b", 0)  # b's tree is smaller
    a, b = cand("a"), cand("b")

    def prompt_matching(blocks: int) -> RouteRequest:
        return RouteRequest("p", 10 * BS, BS, (*range(blocks), *range(500, 510 - blocks)))

    assert policy.choose(prompt_matching(4), [b, a], rng, 0).engine_id == "a"  # 40%
    d = policy.choose(prompt_matching(3), [a, b], rng, 0)  # 30%: the smallest tree
    assert (d.engine_id, d.reason) == ("b", Reason.LOAD)

    def loaded(a_requests: int, b_requests: int) -> list[Candidate]:
        return [
            Candidate("a", inflight=InFlight(requests=a_requests)),
            Candidate("b", inflight=InFlight(requests=b_requests)),
        ]

    balanced = policy.choose(request(blocks=10), loaded(210, 140), rng, 0)
    assert (balanced.engine_id, balanced.reason) == ("a", Reason.CACHE)
    imbalanced = policy.choose(request(blocks=10), loaded(211, 140), rng, 0)
    assert (imbalanced.engine_id, imbalanced.reason) == ("b", Reason.BALANCE)


def test_active_blocks_are_refcounted_from_route_to_finish() -> None:
    """Two requests sharing a prefix on one engine hold the shared blocks once; each finish
    releases only what no other active request holds; a dropped engine forgets its blocks."""
    router = Router(make_policy("dynamo_cost"))
    rng = random.Random(0)
    router.route(request("x", blocks=4), [cand("a")], rng, 0)  # keys 0..3
    router.route(request("y", blocks=6), [cand("a")], rng, 0)  # keys 0..5
    assert router.inflight.of("a").active_blocks == 6
    # 3 of the prompt's blocks are active there, and both requests hold all three.
    assert router.inflight.active_prefix("a", (0, 1, 2, 7, 8)) == (3, 2)
    assert router.inflight.active_prefix("a", (0, 1, 2, 3, 4, 9)) == (5, 1)  # only y holds 4
    # The prompt's leading active blocks: past its first block not active there, none counts
    # (with chained keys a later one cannot be active; these are not chained).
    assert router.inflight.active_prefix("a", (0, 1, 7, 3, 4)) == (2, 2)
    router.first_token("y")  # the prefill ends, the blocks stay active until the finish
    assert router.inflight.of("a").active_blocks == 6
    router.finish("y")
    assert router.inflight.of("a").active_blocks == 4  # x still holds 0..3
    router.finish("y")
    assert router.inflight.of("a").active_blocks == 4
    router.finish("x")
    assert router.inflight.of("a") == InFlight()
    assert router.inflight.active_prefix("a", (0, 1, 2, 3)) == (0, 0)
    router.route(request("z", blocks=3), [cand("b")], rng, 0)
    router.forget_engine("b")
    assert router.inflight.of("b") == InFlight()
    assert router.inflight.active_prefix("b", (0, 1, 2)) == (0, 0)
    router.route(request("w", blocks=2), [cand("b")], rng, 0)
    assert router.inflight.of("b").active_blocks == 2


def test_only_policies_that_read_active_blocks_pay_for_them() -> None:
    blind = KvplanePolicy(KvplaneWeights(memory_weight=0, hot_prefix_requests=0))
    for policy in (make_policy("least_loaded"), blind):
        router = Router(policy)
        rng = random.Random(0)
        router.route(request("x", blocks=4), [cand("a")], rng, 0)
        assert router.inflight.of("a").active_blocks == 0
        assert router.inflight.active_prefix("a", (0, 1, 2, 3)) == (0, 0)
        view = router.with_inflight([cand("a")], request("probe"), 0)
        assert view[0].active_overlap_blocks is None
    counting = [n for n in POLICY_NAMES if make_policy(n).counts_active_blocks]
    assert counting == ["kvplane", "dynamo_cost"]  # kvplane's memory and hot prefix terms
    for weights in (KvplaneWeights(memory_weight=0), KvplaneWeights(hot_prefix_requests=0)):
        assert KvplanePolicy(weights).counts_active_blocks


def sized(eid: str, device: int = 0, *, used: int, total: int = 10, **inflight: int) -> Candidate:
    """An engine of `total` blocks with `used` of them held by running requests (polled)."""
    return Candidate(
        eid,
        hit=PrefixHit(device),
        load=LoadSnapshot(used_kv_blocks=used, total_kv_blocks=total),
        inflight=InFlight(**inflight),
        total_kv_blocks=total,
        block_size=BS,
    )


def test_each_token_of_kv_an_engine_lacks_for_the_prompt_costs_memory_weight() -> None:
    """The prompt needs all its blocks (5 here) next to what the engine's requests hold: the
    polled blocks in use or the router's own count of its requests' blocks, whichever is more;
    blocks of the prompt already active there count once."""
    policy = KvplanePolicy(KvplaneWeights(memory_weight=16.0))
    req = request(blocks=4, extra=5)  # 5 blocks of KV
    rows = policy.costs(
        req,
        [
            sized("fits", used=5),
            sized("short", used=8),  # 13 of 10 blocks: 3 short
            sized("router_knows_more", used=2, active_blocks=9),  # 14: the poll lags
            Candidate(
                "shares", load=LoadSnapshot(used_kv_blocks=8, total_kv_blocks=10), block_size=BS
            )._replace(active_overlap_blocks=2),  # 2 of the prompt's blocks are running there
            Candidate(
                "unpolled", total_kv_blocks=10, block_size=BS, inflight=InFlight(active_blocks=7)
            ),
            Candidate("unknown_size", inflight=InFlight(active_blocks=7)),
        ],
    )
    memory = {r.engine_id: r.memory_cost for r in rows}
    assert memory == {
        "fits": 0.0,
        "short": 16.0 * 3 * BS,
        "router_knows_more": 16.0 * 4 * BS,
        "shares": 16.0 * 1 * BS,
        "unpolled": 16.0 * 2 * BS,  # no GetLoad figure: the router's own count
        "unknown_size": 0.0,
    }
    for r in rows:
        assert r.total == pytest.approx(
            r.prefill_cost + r.queue_cost + r.decode_cost + r.memory_cost
        )


def test_a_long_prompt_goes_to_an_engine_that_can_hold_it() -> None:
    """A cached block is not worth running out of memory (waiting for it, or preempting a
    running request that then computes its prompt again); without the term the cache wins."""
    req = request(blocks=8, extra=5)  # 9 blocks of KV
    full = sized("full", 1, used=6)  # holds the first block; 15 of 10 blocks
    free = sized("free", used=0)
    rng = random.Random(0)
    assert KvplanePolicy().choose(req, [full, free], rng, 0).engine_id == "free"
    off = KvplanePolicy(KvplaneWeights(memory_weight=0))
    assert off.choose(req, [full, free], rng, 0).engine_id == "full"


def test_the_router_counts_the_blocks_it_sent_before_any_poll() -> None:
    """A long prompt routed a moment ago holds its blocks until it finishes, whatever the
    last poll said; its first token ends its prefill queue, not its memory."""
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    engines = [sized("a", used=0), sized("b", used=0)]
    first = router.route(request("x", blocks=8), engines, rng, 0).engine_id
    router.first_token("x")
    other = "b" if first == "a" else "a"
    second = router.explain(request("y", blocks=8, keys_from=100), engines, rng, 0)
    costs = {r.engine_id: r.memory_cost for r in second.costs}
    assert costs == {first: 16.0 * 7 * BS, other: 0.0}  # 9 + 9 blocks in 10
    assert second.engine_id == other
    router.finish("x")
    again = router.explain(request("y", blocks=8, keys_from=100), engines, rng, 0)
    assert all(r.memory_cost == 0 for r in again.costs)


def test_a_backlogged_fleet_pays_no_memory_cost() -> None:
    """When every queue is a backlog every engine is full: the cache and the queues decide."""
    policy = KvplanePolicy()
    req = request(blocks=8, extra=5)
    backlog = 300_000
    engines = [
        sized("a", 1, used=9)._replace(
            load=LoadSnapshot(used_kv_blocks=9, total_kv_blocks=10, waiting_tokens=backlog)
        ),
        sized("b", used=0)._replace(
            load=LoadSnapshot(used_kv_blocks=0, total_kv_blocks=10, waiting_tokens=backlog)
        ),
    ]
    rows = policy.costs(req, engines)
    assert [r.memory_cost for r in rows] == [0.0, 0.0]
    engines[1] = engines[1]._replace(load=LoadSnapshot(used_kv_blocks=0, total_kv_blocks=10))
    assert policy.costs(req, engines)[0].memory_cost > 0


def test_dynamo_cost_terms_on_a_worked_example() -> None:
    """cost = overlap_weight x (in-flight prefill + uncached prompt tokens) / block size
    + (distinct active blocks + the prompt's full blocks not active there)."""
    router = Router(make_policy("dynamo_cost"))
    rng = random.Random(0)
    router.route(request("x", blocks=4), [cand("a")], rng, 0)  # keys 0..3, 4 x 128 + 5 tokens
    router.route(request("y", blocks=6), [cand("a")], rng, 0)  # keys 0..5, 6 x 128 + 5 tokens
    router.first_token("x")  # only y's 773 tokens still prefill on a
    z = RouteRequest("z", 5 * BS + 5, BS, (0, 1, 2, 7, 8))  # 645 tokens
    d = router.explain(z, [cand("a", 3), cand("b")], rng, 0)
    rows = {r.engine_id: r for r in d.costs}
    a, b = rows["a"], rows["b"]
    assert a.prefill_cost == pytest.approx((645 - 3 * BS) / BS)  # 2.039 blocks uncached
    assert a.queue_cost == pytest.approx(773 / BS)
    assert a.decode_cost == 6 + (5 - 3)  # 0..5 active once each; 7 and 8 are new there
    assert a.total == pytest.approx(261 / BS + 773 / BS + 8)  # 16.08
    assert (b.prefill_cost, b.queue_cost, b.decode_cost) == (645 / BS, 0.0, 5.0)
    assert b.total == pytest.approx(10.039, abs=1e-3)
    assert (d.engine_id, d.reason, d.predicted_cached_tokens) == ("b", Reason.LOAD, 0)
    assert a.cached_tokens == 3 * BS
    heavy = Router(DynamoCost(overlap_weight=4.0))
    rows = {r.engine_id: r for r in heavy.explain(z, [cand("a", 3), cand("b")], rng, 0).costs}
    assert rows["a"].total == pytest.approx(4.0 * 261 / BS + 5)
    assert rows["b"].total == pytest.approx(4.0 * 645 / BS + 5)
    heavy.route(request("w", blocks=4), [cand("a")], rng, 0)  # 517 tokens to prefill on a
    rows = {r.engine_id: r for r in heavy.explain(z, [cand("a", 3), cand("b")], rng, 0).costs}
    assert rows["a"].queue_cost == pytest.approx(4.0 * 517 / BS)  # weighed as its prefill


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_only_dynamo_cost_goes_without_the_pending_prefix_credit(name: str) -> None:
    """Dynamo's overlap comes from the engines' KV events alone: blocks routed to an engine
    and not yet announced count as cached there for every other policy, not for it."""
    router = Router(make_policy(name), pending_ttl_s=10.0)
    rng = random.Random(0)
    router.route(request("x", blocks=4), [cand("a")], rng, 0)
    view = router.with_inflight([cand("a"), cand("b")], request("probe", blocks=4), 1.0)
    credited = name != "dynamo_cost"
    assert router.policy.credits_pending_prefixes is credited
    assert view[0].hit.device_blocks == (4 if credited else 0)
    assert view[1].hit.device_blocks == 0


def test_llmd_longest_prefix_weights_host_blocks_at_0_8() -> None:
    policy = LlmdLongestPrefix()
    rng = random.Random(0)
    req = request(blocks=10)
    d = policy.choose(req, [cand("host", 0, 5), cand("dev", 5)], rng, 0)
    assert (d.engine_id, d.reason) == ("dev", Reason.CACHE)  # 5 > 4: no tie
    assert policy.choose(req, [cand("host", 0, 5), cand("dev", 3)], rng, 0).engine_id == "host"
    # Ten host blocks weigh 8: less than nine device blocks, more than seven.
    assert policy.choose(req, [cand("host", 0, 10), cand("dev", 9)], rng, 0).engine_id == "dev"
    assert policy.choose(req, [cand("host", 0, 10), cand("dev", 7)], rng, 0).engine_id == "host"


@pytest.mark.parametrize("name", ["kvplane", "dynamo_cost", "llmd_longest_prefix"])
@pytest.mark.parametrize(
    ("one", "other", "extra"),
    [
        (PrefixHit(1), PrefixHit(0, 4), 5),
        (PrefixHit(2), PrefixHit(0, 0, 4), 5),
        (PrefixHit(1), PrefixHit(0, 0, 8), 5),
        (PrefixHit(6), PrefixHit(2, 6), 0),
    ],
)
def test_an_engine_s_ranks_merge_into_the_hit_its_policy_would_route_to(
    name: str, one: PrefixHit, other: PrefixHit, extra: int
) -> None:
    """An engine indexed rank by rank holds its worthiest rank's hit (`keep_best_hit` with
    the policy's `hit_worth`): the one the policy chooses when the two ranks' hits are two
    idle engines' (1 device block beats 4 host blocks for `dynamo_cost` alone, 8 disk
    blocks for `kvplane` alone). A prompt of exactly 8 blocks (`extra` 0) is served at most
    7 from cache: 6 device blocks beat 2 device and 6 host blocks for `kvplane`, which
    weighs the 7 (the 8th host block saves nothing), not for `llmd_longest_prefix`, whose
    score counts every block held (`LlmdLongestPrefix.choose`)."""
    policy = make_policy(name)
    req = request(blocks=8, extra=extra)
    engines = [Candidate("one", hit=one), Candidate("other", hit=other)]
    chosen = policy.choose(req, engines, random.Random(0), 0).engine_id
    for ranks in ((one, other), (other, one)):
        hits: dict[str, PrefixHit] = {}
        for hit in ranks:
            keep_best_hit(hits, "engine", hit, policy.hit_worth, req.max_cacheable_blocks)
        assert hits["engine"] == (one if chosen == "one" else other)


def test_disaggregated_prefill_then_decode_or_skip() -> None:
    router = Router(make_policy("kvplane"))
    rng = random.Random(0)
    prefill = [cand("p0"), cand("p1", 4)]
    decode = [cand("d0", running_requests=4), cand("d1", running_requests=1)]
    d = router.route_disaggregated(request("x", blocks=10), prefill, decode, rng, 0)
    assert d.prefill is not None and d.prefill.engine_id == "p1"  # overlap + load
    assert d.decode is None  # chosen at the handoff
    assert router.inflight.engine_of("x") == "p1"
    # The handoff: the decode engine by load, owing no prefill (the KV comes with the session).
    handoff = router.route_decode(request("x", blocks=10), decode, rng)
    assert handoff.engine_id == "d1"
    assert router.inflight.engine_of("x") == "d1"
    assert router.inflight.of("d1").prefill_tokens == 0
    cached = [cand("d0", 10, running_requests=4), cand("d1", 10, running_requests=1)]
    d = router.route_disaggregated(request("y", blocks=10, extra=1), prefill, cached, rng, 0)
    assert d.prefill is None and d.decode is not None and d.decode.engine_id == "d1"
    assert d.decode.predicted_cached_tokens == 10 * BS
    # No prefill engine up: the decode engine prefills, whatever it holds.
    d = router.route_disaggregated(request("z", blocks=10), [], decode, rng, 0)
    assert d.prefill is None and d.decode is not None
    # A router that never skips the hop (engines that decode only with a session).
    strict = Router(make_policy("kvplane"), skip_prefill_ratio=math.inf)
    d = strict.route_disaggregated(request("y", blocks=10, extra=1), prefill, cached, rng, 0)
    assert d.prefill is not None
    with pytest.raises(NoEngineAvailableError, match="no prefill engine"):
        strict.route_disaggregated(request("w", blocks=10), [], cached, rng, 0)


def test_of_equally_loaded_decode_engines_the_one_holding_the_prompt_skips_the_hop() -> None:
    """Two idle decode engines, one of which holds the whole prompt (a repeat whose earlier
    request it decoded): the first hop goes to that one, which prefills the prompt itself,
    whatever the random draw; only the load comes before it."""
    prefill = [cand("p0")]
    decode = [cand("d0"), cand("d1", 10)]
    for seed in range(20):
        router = Router(make_policy("kvplane"), skip_prefill_ratio=0.9)
        d = router.route_disaggregated(
            request("x", blocks=10, extra=1), prefill, decode, random.Random(seed), 0
        )
        assert d.prefill is None and d.decode is not None and d.decode.engine_id == "d1"
    busier = [cand("d0"), cand("d1", 10, running_requests=2)]
    d = Router(make_policy("kvplane"), skip_prefill_ratio=0.9).route_disaggregated(
        request("y", blocks=10, extra=1), prefill, busier, random.Random(0), 0
    )
    assert d.prefill is not None and d.prefill.engine_id == "p0"


def test_the_router_view_of_a_candidate_replaces_only_its_own_fields() -> None:
    """`Candidate.as_routed` (the router's hit, in-flight count, active overlap and its
    sharers) keeps every other field of the candidate as it was."""
    load = LoadSnapshot(running_requests=3)
    candidate = Candidate("e", PrefixHit(1, 2), load, InFlight(1), 10, 16, 5, None, None, True)
    routed = candidate.as_routed(PrefixHit(3, 0), InFlight(2, 1), 4, 2)
    assert routed == candidate._replace(
        hit=PrefixHit(3, 0),
        inflight=InFlight(2, 1),
        active_overlap_blocks=4,
        active_prefix_sharers=2,
    )


def test_cached_tokens_with_the_limit_read_once_are_the_same() -> None:
    """A caller may read `max_cacheable_blocks` once for a whole fleet: the same answer."""
    req = request(blocks=4, extra=0)  # 4 full blocks, the last token recomputed: 3 cacheable
    for hit in (PrefixHit(), PrefixHit(2, 5), PrefixHit(9, 0), PrefixHit(0, 9)):
        assert req.cached_tokens(hit, req.max_cacheable_blocks) == req.cached_tokens(hit)
    assert req.cached_tokens(PrefixHit(2, 5)) == (2 * BS, 1 * BS, 0)
