"""Routing policies: each turns (request, candidates, randomness) into a Decision.

`kvplane` (the default) scores every engine by the prefill work it would do for the request,
its queue and its decode load; the cache-blind baselines (`round_robin`, `random`,
`least_loaded`, `power_of_two`) are here for comparison and for fleets without KV events. The
peers' documented policies live in `controller.router.peers`.

A policy only chooses; the `Router` applies session affinity first and, for a policy whose
`filters_busy` is true (only `kvplane`), skips busy engines. Two more attributes say what the
router adds to the candidates: `credits_pending_prefixes` (blocks just routed count as cached;
every policy but `dynamo_cost`) and `counts_active_blocks` (refcounted active blocks, and how
many active requests share a prompt's prefix: `dynamo_cost`, and `kvplane` for its memory and
hot prefix terms).
Randomness is always the `random.Random` passed in, so a seeded run is reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from controller.router.model import Candidate, Decision, EngineCost, PrefixHit, Reason, RouteRequest


class Policy(Protocol):
    name: str
    # Whether the Router skips busy engines (`BusyThresholds`) before this policy chooses. A
    # re-implementation of another system's policy says False unless that system filters so.
    filters_busy: bool
    # Whether blocks the router has just sent to an engine, which its KV events have not
    # announced yet, count as cached there (`PendingPrefixes`). A system whose overlap comes
    # from engine events alone (Dynamo's radix tree) says False.
    credits_pending_prefixes: bool
    # Whether the router refcounts each engine's active block keys for this policy
    # (`InFlight.active_blocks`, `Candidate.active_overlap_blocks`); others do not pay for it.
    counts_active_blocks: bool

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        """Pick one of `candidates` (never empty)."""
        ...

    def observe(self, request: RouteRequest, engine_id: str, now_s: float) -> None:
        """The request was sent to `engine_id` (policies with their own state learn here)."""
        ...

    def hit_worth(self, hit: PrefixHit, cacheable: int) -> float:
        """What `hit` is worth to this policy, in blocks, as it weighs the tiers, for a prompt
        that can be served `cacheable` blocks from cache (`RouteRequest.max_cacheable_blocks`:
        a policy that scores the blocks served weighs no block past them; one that scores
        every block held, all of them): of two hits, the one it would route to (all else
        equal) is worth more. An engine whose data-parallel ranks are indexed one by one is
        routed as holding its worthiest rank's hit (`controller.remote_index.keep_best_hit`)."""
        ...

    def forget_engine(self, engine_id: str) -> None: ...


class _Stateless:
    filters_busy = False  # the blind baselines see every engine, as in their real systems
    credits_pending_prefixes = True  # it sets the predicted cache (and the queue figure)
    counts_active_blocks = False

    def observe(self, request: RouteRequest, engine_id: str, now_s: float) -> None:
        return None

    def forget_engine(self, engine_id: str) -> None:
        return None

    def hit_worth(self, hit: PrefixHit, cacheable: int) -> float:
        """Every block served alike: the cache a blind policy reads is the decision's predicted
        cached tokens, which count all tiers (`decision_for`)."""
        return hit.blocks_within(cacheable)


def blind_costs(request: RouteRequest, candidates: Sequence[Candidate]) -> tuple[EngineCost, ...]:
    """Cost rows for cache-blind policies: the cache each engine would have served, no total."""
    rows = []
    cacheable = request.max_cacheable_blocks
    for c in candidates:
        device, host, disk = request.cached_tokens(c.hit, cacheable)
        rows.append(
            EngineCost(
                engine_id=c.engine_id,
                cached_tokens=device,
                host_cached_tokens=host,
                prefill_cost=float(request.num_prompt_tokens - device - host - disk),
                queue_cost=float(c.pending_prefill_tokens),
                decode_cost=float(c.active_requests),
                total=None,
                disk_cached_tokens=disk,
            )
        )
    return tuple(rows)


def decision_for(
    policy: str,
    request: RouteRequest,
    chosen: Candidate,
    reason: Reason,
    costs: tuple[EngineCost, ...],
) -> Decision:
    return Decision(chosen.engine_id, reason, policy, sum(request.cached_tokens(chosen.hit)), costs)


def least_loaded_of(
    candidates: Sequence[Candidate],
    rng: random.Random,
    then: Callable[[Candidate], int] | None = None,
) -> Candidate:
    """Fewest active requests, then least pending prefill, then (given) the lowest `then`;
    remaining ties at random."""
    best = min((c.active_requests, c.pending_prefill_tokens) for c in candidates)
    tied = [c for c in candidates if (c.active_requests, c.pending_prefill_tokens) == best]
    if then is not None and len(tied) > 1:
        lowest = min(map(then, tied))
        tied = [c for c in tied if then(c) == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        # Order by id so that the rotation survives candidates coming and going.
        ordered = sorted(candidates, key=lambda c: c.engine_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return decision_for(
            self.name, request, chosen, Reason.POLICY, blind_costs(request, candidates)
        )


class RandomChoice(_Stateless):
    name = "random"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        chosen = rng.choice(list(candidates))
        return decision_for(
            self.name, request, chosen, Reason.POLICY, blind_costs(request, candidates)
        )


class LeastLoaded(_Stateless):
    name = "least_loaded"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        chosen = least_loaded_of(candidates, rng)
        return decision_for(
            self.name, request, chosen, Reason.LOAD, blind_costs(request, candidates)
        )


class PowerOfTwo(_Stateless):
    name = "power_of_two"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        pair = rng.sample(list(candidates), 2) if len(candidates) > 1 else list(candidates)
        chosen = least_loaded_of(pair, rng)
        return decision_for(
            self.name, request, chosen, Reason.LOAD, blind_costs(request, candidates)
        )


@dataclass(frozen=True, slots=True)
class KvplaneWeights:
    """The `kvplane` cost, in prompt-token equivalents of prefill work (lower is better):

        total = overlap * (uncached + host_weight * host_cached + disk_weight * disk_cached)
              + waiting * (1 + (1 - pressure) * waiting / queue_knee)
              + decode_weight * (active + decoding * (waiting + uncached) / pass_tokens)
              + memory_weight * overflow
        overlap = idle_overlap_weight + (overlap_weight - idle_overlap_weight) * pressure,
                  at least backlog_overlap_weight once the shortest queue reaches backlog_tokens,
                  else divided by `sharers` (at least 1) once they are hot_prefix_requests

    `waiting` = prefill tokens queued on the engine; `active` = its requests; `decoding` = its
    running requests (polled), at most `pass_decodes`; `pressure` = the candidates' mean cache
    pressure (how full their caches are with data, 1 when unknown); `overflow` = the tokens
    by which the KV the engine's requests hold, plus the prompt's, exceeds its capacity.
    `host_cached` and `disk_cached` are the prompt tokens the engine holds past its device
    tier on host memory (DRAM) and then on disk (SSD) (`PrefixHit`); loading them costs
    `host_weight` and `disk_weight` of computing them.

    - `overlap` > 1 makes recomputing a prefix that another engine holds cost more than the
      queueing it would save. With full caches (`overlap_weight`) a prefix stored twice evicts
      something else; with room to spare (`idle_overlap_weight`) a prefix stays where it is for
      every later turn of its conversation, and leaving it only buys a shorter queue.
    - That loss is for a prefix few requests reuse. A hot one, which `sharers` requests in
      flight share (`_hot_prefix_sharers`: all that the engines holding the most of the prompt
      hold), is worth a second copy: computing it once more, and storing it once more, is paid
      once for all the requests that will then find it on either engine. So from
      `hot_prefix_requests` sharers up, the overlap is divided by their number (at least 1:
      the prefill itself is still done). A burst sharing a long system prompt then spreads
      once the holder's load passes about `overlap` / `sharers` times the prompt, instead of
      collapsing onto the holder (30 requests of a 640-token prompt did, on three engines). A
      lone request in flight, most often the previous turn of the same conversation, is no
      sign of a hot prefix (default 2: dividing by 1 + sharers lost reuse on the conversation
      trace); 0 = off. Not while the fleet is backlogged: then every engine is busy, a second
      copy shortens no wait, and its prefill adds to them.
    - The queue costs more than its length while caches have room (`queue_knee` tokens double
      it): a request must not wait behind a huge prefill for the sake of its cache. With full
      caches the knee fades out (moving would evict, and reuse comes first).
    - Each forward pass that also decodes is slower, so decode load weighs by the passes the
      queue and the prompt need (`pass_tokens` per pass; 0 = a flat `decode_weight` per
      request): a long prompt avoids engines that decode, a short one barely minds them. A
      pass pays its decode step once, however many sequences decode (the step reads the KV
      cache in one batch; its time follows the KV it reads, not the count), so by default only
      whether the engine decodes counts (`pass_decodes` 1; `decode_weight` 256 is about one
      decode step in prefill tokens). Queued requests do not decode, so an overloaded engine's
      queue is not counted twice.

    - When every engine has a long prefill queue (the shortest at least `backlog_tokens`),
      the fleet is backlogged: requests wait minutes whatever the choice, and what shortens
      every wait is less work. The overlap is then at least `backlog_overlap_weight`, so a
      conversation stays with its cached prefix rather than recompute it for a slightly
      shorter queue (0 = off). A switch, not a ramp: below it the cost is exactly as without
      it.

    - A request needs KV for its whole prompt while it runs. An engine whose cache cannot
      hold it next to what its requests already hold (the blocks in use at the last poll,
      or the distinct blocks of the requests the router has there, whichever is more; the
      prompt's blocks already active there count once) makes it wait for memory, or preempts
      a running request, which computes its prompt again. Each token past the capacity costs
      `memory_weight` prompt tokens (0 = off): with 512-block engines and 190k-token prompts
      that was most of the synthetic trace's tail at 4x speed. Not while the fleet is
      backlogged: then every engine is full, and the cache and the queues decide.

    - No cached prefix is worth a long wait: an engine whose prefill wait for the request
      (`waiting` + `uncached` + `host_weight` * `host_cached` + `disk_weight` *
      `disk_cached`, in tokens: its queue, then the prompt's work there, loads included) is
      more than `patience_tokens` longer than the quickest engine's is not chosen (0 =
      off). The overlap weight keeps a conversation
      where its prefix is under ordinary queues; this bounds the rare collision with a huge
      cold prefill just sent to the same engine, which sets the TTFT p99. It trades reuse
      for tail latency, the more the tighter it is: at 60,000 tokens reuse fell below the
      never-leave policies' at 4x; at 100,000 (the default) p99 is lower in nine of eleven
      configurations over ten seeds and reuse at most 0.0015 lower, and fewer cells trail the
      best other row at seed 0 and over four seeds (as many over ten, where one reuse cell
      slips; docs/benchmarks/routing.md).
      Not while the fleet is backlogged (see below).

    All tuned on the Mooncake traces (docs/benchmarks/routing.md). Engines within `tie_tokens`
    + `tie_ratio` * best of the best cost are ties, picked at random (or by softmax when
    `temperature` > 0), so equal engines share a hot prefix.
    """

    overlap_weight: float = 12.0
    idle_overlap_weight: float = 30.0
    queue_knee: float = 50_000.0
    pass_tokens: float = 8192.0
    pass_decodes: int = 1
    host_weight: float = 0.25
    # Loading a block from disk costs more than from host memory, less than recomputing it:
    # Dynamo's router credits a disk hit 0.25 of a device hit against 0.75 for a host hit
    # (`disk_cache_hit_weight`, `host_cache_hit_weight`), the 0.25 `host_weight` above; the
    # same ratio here. Not tuned on a trace: the Mooncake traces carry no disk tier.
    disk_weight: float = 0.75
    decode_weight: float = 256.0
    tie_tokens: float = 64.0
    tie_ratio: float = 0.0
    temperature: float = 0.0
    backlog_tokens: float = 200_000.0
    backlog_overlap_weight: float = 36.0
    patience_tokens: float = 100_000.0
    memory_weight: float = 16.0
    hot_prefix_requests: int = 2


class KvplanePolicy(_Stateless):
    name = "kvplane"
    filters_busy = True  # a lone engine whose KV is full is skipped (`BusyThresholds`)
    credits_pending_prefixes = True  # a burst sharing a new prefix stays together

    def __init__(self, weights: KvplaneWeights | None = None) -> None:
        self.weights = weights or KvplaneWeights()
        # The memory term reads the blocks the router's requests hold on each engine, the hot
        # prefix rule how many of them share the prompt's prefix.
        w = self.weights
        self.counts_active_blocks = w.memory_weight > 0 or w.hot_prefix_requests > 0

    def hit_worth(self, hit: PrefixHit, cacheable: int) -> float:
        """The prefill the hit saves: its blocks served, less what loading those past the
        device tier costs (`host_weight`, `disk_weight` of computing them), as `work` in
        `_score`."""
        w = self.weights
        hit = hit.within(cacheable)
        return (
            hit.device_blocks
            + (1.0 - w.host_weight) * hit.host_blocks
            + (1.0 - w.disk_weight) * hit.disk_blocks
        )

    def costs(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[EngineCost]:
        return self._score(request, candidates).rows

    def _score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> _Scores:
        """Every candidate's cost row, and what `choose` reads of them, in two passes over the
        fleet: one for its shared terms (the queues, whose shortest says whether the fleet is
        backlogged, and the mean cache pressure), one for each engine's row. A request costs
        every routable engine, so the per-engine pass is the router's largest cost at hundreds
        of engines (docs/benchmarks/fleet_scale.md): what does not depend on the engine (the
        weights, the request's terms) is read once, before it, and each candidate's
        properties (small functions that compute) once each."""
        w = self.weights
        queues = [float(c.pending_prefill_tokens) for c in candidates]
        pressure = sum(c.cache_pressure for c in candidates) / max(len(candidates), 1)
        overlap = w.idle_overlap_weight + (w.overlap_weight - w.idle_overlap_weight) * pressure
        backlogged = self._backlogged(queues)
        if backlogged:
            # Even the shortest queue is long: the fleet is backlogged, and recomputing a
            # cached prefix only adds to everyone's wait.
            overlap = max(overlap, w.backlog_overlap_weight)
        prompt_tokens = request.num_prompt_tokens
        cacheable = request.max_cacheable_blocks
        hits = [request.cached_tokens(c.hit, cacheable) for c in candidates]
        hot_sharers = 0
        if w.hot_prefix_requests > 0 and overlap > 1.0 and not backlogged:
            sharers = _hot_prefix_sharers(request, candidates, hits)
            if sharers >= w.hot_prefix_requests:
                # A hot prefix: a copy elsewhere is paid once for all the requests sharing it.
                overlap = max(1.0, overlap / sharers)
                hot_sharers = sharers
        memory_weight = 0.0 if backlogged else w.memory_weight
        host_weight, disk_weight = w.host_weight, w.disk_weight
        queue_knee, decode_weight = w.queue_knee, w.decode_weight
        pass_tokens, pass_decodes = w.pass_tokens, w.pass_decodes
        rows: list[EngineCost] = []
        totals: list[float] = []
        waits: list[float] = []
        for c, waiting, (device, host, disk) in zip(candidates, queues, hits, strict=True):
            uncached = prompt_tokens - device - host - disk
            active = c.active_requests  # a property: read once
            # The prompt's work there, in tokens computed: those it computes, and those it
            # loads from host memory or disk at their weights.
            work = uncached + host_weight * host + disk_weight * disk
            prefill = overlap * work
            queue = waiting
            if queue_knee > 0:
                queue *= 1.0 + (1.0 - pressure) * waiting / queue_knee
            decode = decode_weight * active
            if pass_tokens > 0:
                # Every pass of the queue ahead and of this prompt's prefill also decodes.
                running = c.load.running_requests
                decoding = running if running is not None else active - c.queued_requests
                # min(max(decoding, 0), pass_decodes) (the module docstring of `model` says
                # why not the builtins)
                decoding = 0 if decoding < 0 else decoding
                decoding = pass_decodes if pass_decodes < decoding else decoding
                passes = (waiting + uncached) / pass_tokens
                decode += decode_weight * decoding * passes
            memory = memory_weight * _kv_overflow_tokens(request, c) if memory_weight else 0.0
            total = prefill + queue + decode + memory
            rows.append(
                EngineCost(
                    c.engine_id, device, host, prefill, queue, decode, total, False, memory, disk
                )
            )
            totals.append(total)
            # The engine's prefill wait for the request (`_patient`): its queue, then the
            # prompt's work (a prefix it loads from disk is no wait saved whole).
            waits.append(waiting + work)
        return _Scores(rows, totals, waits, backlogged, hot_sharers)

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        w = self.weights
        rows, totals, waits, backlogged, hot_sharers = self._score(request, candidates)
        allowed = self._patient(waits, backlogged)
        # Every engine is allowed but where patience cuts some (rarely).
        allowed_totals = totals if len(allowed) == len(totals) else [totals[i] for i in allowed]
        best = min(allowed_totals)
        if w.temperature > 0:
            index = allowed[_softmax_pick(allowed_totals, w.temperature, rng)]
            tied = 2
        else:
            limit = best + w.tie_tokens + w.tie_ratio * best
            near = [i for i in allowed if totals[i] <= limit]
            tied = len(near)
            index = near[0] if tied == 1 else rng.choice(near)
        row = rows[index]
        cached = row.cached_tokens + row.host_cached_tokens + row.disk_cached_tokens
        if len(candidates) == 1:
            reason = Reason.ONLY
        elif len(allowed) < len(rows) and totals[index] > min(totals):
            reason = Reason.PATIENCE
        elif tied > 1:
            reason = Reason.TIE
        elif cached > 0:
            reason = Reason.CACHE
        else:
            reason = Reason.LOAD
        return Decision(row.engine_id, reason, self.name, cached, tuple(rows), hot_sharers)

    def _backlogged(self, queues: Sequence[float]) -> bool:
        """Even the shortest prefill queue is at least `backlog_tokens` long."""
        return bool(queues) and 0 < self.weights.backlog_tokens <= min(queues)

    def _patient(self, waits: Sequence[float], backlogged: bool) -> list[int]:
        """Indices of the engines whose prefill wait for the request (`_Scores.waits`) is
        within `patience_tokens` of the quickest engine's (all of them when the fleet is
        backlogged: then every wait is long, and recomputing only adds to it)."""
        patience = self.weights.patience_tokens
        if patience <= 0 or backlogged:
            return list(range(len(waits)))
        limit = min(waits) + patience
        return [i for i, wait in enumerate(waits) if wait <= limit]


class _Scores(NamedTuple):
    """What `KvplanePolicy._score` finds, in the candidates' order: each engine's cost row,
    its total (`EngineCost.total`, never None here), its prefill wait for the request (queue
    + uncached prompt tokens + its host and disk tokens at their weights), whether the
    fleet is backlogged, and the requests in flight sharing a hot prefix (0: none, or the
    rule did not apply: `Decision.hot_prefix_sharers`)."""

    rows: list[EngineCost]
    totals: list[float]
    waits: list[float]
    backlogged: bool
    hot_prefix_sharers: int


def _hot_prefix_sharers(
    request: RouteRequest, candidates: Sequence[Candidate], hits: Sequence[tuple[int, int, int]]
) -> int:
    """How many requests in flight share all of the prompt's prefix that the engines holding
    the most of it hold (`hits`: each candidate's device, host and disk tokens of the prompt):
    on each such engine, its active requests that hold all of that prefix. None on an engine
    that caches more of the prompt than its active requests hold: a finished conversation's
    turns, say, which no request in flight shares."""
    best = max((sum(hit) for hit in hits), default=0)
    if not best:
        return 0
    blocks = best // request.block_size
    sharers = 0
    for c, hit in zip(candidates, hits, strict=True):
        if (
            c.active_prefix_sharers
            and sum(hit) == best
            and (c.active_overlap_blocks or 0) >= blocks
        ):
            sharers += c.active_prefix_sharers
    return sharers


def _kv_overflow_tokens(request: RouteRequest, c: Candidate) -> int:
    """Tokens of KV the engine lacks to run the request next to its other requests: the
    blocks they hold (polled, or the router's own count of its requests' distinct blocks if
    larger: the poll lags, and a queued request holds nothing yet) plus the prompt's blocks
    not already active there, less the capacity. 0 when the engine's size is unknown."""
    total = c.capacity_blocks
    size = c.block_size or request.block_size
    if not total or not size:
        return 0
    # max(polled, own) and max(0, lacking), as `controller.router.model` writes them
    polled, own = c.load.used_kv_blocks or 0, c.inflight.active_blocks
    held = own if own > polled else polled
    prompt_blocks = -(-request.num_prompt_tokens // size) - (c.active_overlap_blocks or 0)
    lacking = (held + prompt_blocks - total) * size
    return lacking if lacking > 0 else 0


def _softmax_pick(totals: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Sample an index with probability proportional to exp(-normalised cost / temperature);
    costs are normalised by their spread so the temperature is scale-free."""
    lo, hi = min(totals), max(totals)
    spread = (hi - lo) or 1.0
    weights = [math.exp(-(t - lo) / spread / temperature) for t in totals]
    return rng.choices(range(len(totals)), weights=weights)[0]
