"""The router core's vocabulary: what it is asked, what it knows about each engine, and what
it answers. All immutable; proto types never reach this far (the gateway and the replay build
these from GetLoad, the index and their own bookkeeping).

What a routed request builds (`RouteRequest`, and per engine `PrefixHit`, `InFlight`,
`Candidate`, `EngineCost`, then the `Decision`) are named tuples rather than frozen
dataclasses: a request builds a dozen of them before the engine is called, and a tuple is
built about three times faster (a frozen dataclass sets each field through
`object.__setattr__`). Use `value._replace(...)` for an altered copy. `LoadSnapshot`, built
once per poll, stays a frozen, slotted dataclass.

The router reads `Candidate`'s load properties of every engine for every request, so they
take the larger or smaller of two numbers with a conditional expression, written as
`max`/`min` decide (`b if b > a else a` is `max(a, b)`, ties and all): on CPython 3.11 a call
of the builtins costs more than the rest of such a property (docs/benchmarks/fleet_scale.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class Reason(enum.StrEnum):
    """Why an engine was chosen (a Prometheus label and the admin `route` explanation)."""

    CACHE = "cache"  # the cached prefix decided it
    LOAD = "load"  # no useful cache anywhere: the least loaded engine won
    TIE = "tie"  # several engines within the tie tolerance: spread at random
    SESSION = "session"  # session affinity
    BALANCE = "balance"  # a peer policy's load-balancing branch
    POLICY = "policy"  # a cache-blind policy (round robin, random, ...)
    ONLY = "only"  # one candidate
    ALL_BUSY = "all_busy"  # every engine was busy; the least loaded was taken
    PATIENCE = "patience"  # the cheapest engine's wait was past `patience_tokens`
    # Every engine was busy and the request was refused (`router.reject_when_all_busy`): a
    # route_decisions_total label only, no Decision carries it.
    OVERLOADED = "overloaded"


class Hop(enum.StrEnum):
    """Which hop of its request a decision places (a Prometheus label and the admin `route`
    explanation): how a disaggregated fleet's requests split between the prefill hop and
    decode engines prefilling prompts themselves reads without knowing the engines' roles."""

    AGGREGATED = "aggregated"  # an aggregated engine: the request's one hop
    PREFILL = "prefill"  # a prefill engine, whose KV session a decode engine then takes
    DECODE = "decode"  # a decode engine taking the prefill engine's KV session
    # A decode engine prefilling the prompt itself (no prefill hop: it holds
    # `skip_prefill_ratio` of the prompt, or no prefill engine takes traffic).
    DECODE_PREFILL = "decode_prefill"
    NONE = "none"  # the request was refused (reason `overloaded`): no hop placed


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The last GetLoad of one engine. None = the engine did not report that value.

    `used_kv_tokens`, `total_kv_tokens`, `kv_block_sizes`: the KV in tokens and the block
    sizes a controller fronted as an engine reports in its attributes; the one way its KV
    is told when its fleet mixes block sizes (its block counts are then absent)."""

    running_requests: int | None = None
    queued_requests: int | None = None
    active_kv_sessions: int | None = None
    used_kv_blocks: int | None = None
    total_kv_blocks: int | None = None
    running_tokens: int | None = None
    waiting_tokens: int | None = None
    used_kv_tokens: int | None = None
    total_kv_tokens: int | None = None
    kv_block_sizes: tuple[int, ...] = ()


class InFlight(NamedTuple):
    """The router's own accounting for one engine, updated the instant it routes.

    `prefill_tokens`: uncached prompt tokens of requests still waiting for their first token
    (the prefill queue this router put there); `prefill_cached_tokens`: the prompt tokens of
    those same requests that the router expects the engine to serve from its cache;
    `active_blocks`: distinct full prompt blocks its active requests hold (a block that several
    share counts once), counted only when the policy reads it (`Policy.counts_active_blocks`),
    else 0.
    """

    requests: int = 0
    prefilling: int = 0
    prefill_tokens: int = 0
    prefill_cached_tokens: int = 0
    active_blocks: int = 0


class PrefixHit(NamedTuple):
    """How many leading blocks of the prompt an engine holds, tier by tier along the prefix:
    contiguously on the device tier (HBM); how many more follow on the device or host tier
    (DRAM) before the first block on neither; and how many more after those follow on any
    tier, disk (SSD) included, before the first miss. So a block is counted at the slowest
    tier the prefix has needed up to it: device, device, host, device, disk, host gives 2
    device, 2 host and 2 disk blocks.

    The fourth block there counts though vLLM would serve it only if its offload store held
    it too: past its GPU prefix, vLLM asks its KV connector for the blocks that continue it in
    the store (the OffloadingConnector's lookup from the first block not on the GPU), not the
    GPU again. The index's runs (`along`) cannot tell that walk, and the store keeps every
    block vLLM computes, so a block still on the GPU is rarely missing from it (docs/
    controller.md, "The router")."""

    device_blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0

    def blocks(self) -> int:
        """The leading blocks held, whatever their tier (every block alike)."""
        return self.device_blocks + self.host_blocks + self.disk_blocks

    def within(self, limit: int) -> PrefixHit:
        """The hit's first `limit` blocks, tier by tier: what of it a prompt that can be
        served `limit` blocks from cache is served (`RouteRequest.max_cacheable_blocks`)."""
        device = min(self.device_blocks, limit)
        host = min(self.host_blocks, limit - device)
        return PrefixHit(device, host, min(self.disk_blocks, limit - device - host))

    def blocks_within(self, limit: int) -> int:
        """How many of the hit's blocks a prompt that can be served `limit` blocks from cache
        is served, whatever their tier (`within`, every block alike)."""
        return min(self.blocks(), limit)

    @staticmethod
    def along(device_blocks: int, servable_blocks: int, any_tier_blocks: int) -> PrefixHit:
        """The hit of an index match (`TokenPrefixMatch`, the MatchTokens reply): its leading
        blocks on HBM, on HBM or DRAM (`matched_blocks`) and on any tier (`any_tier_blocks`;
        0 from an indexer older than the field)."""
        return PrefixHit(
            device_blocks,
            max(servable_blocks - device_blocks, 0),
            max(any_tier_blocks - max(servable_blocks, device_blocks), 0),
        )


class Candidate(NamedTuple):
    """One routable engine as the router sees it at decision time."""

    engine_id: str
    hit: PrefixHit = PrefixHit()
    load: LoadSnapshot = LoadSnapshot()
    inflight: InFlight = InFlight()
    # Capacity in blocks (GetModelInfo.total_kv_blocks; a fronted controller's live GetLoad
    # sum: `controller.fleet._capacity`) and tokens per block; None when unknown.
    total_kv_blocks: int | None = None
    block_size: int | None = None
    # Blocks the index places on the engine (cached, in use or not); None when unknown.
    cached_blocks: int | None = None
    # How many of the request's blocks the engine's active requests already hold (see
    # `InFlight.active_blocks`); None unless the policy counts active blocks, or when the
    # router has no active request there (none to hold them: read as 0).
    active_overlap_blocks: int | None = None
    # How many of the engine's active requests hold all of those blocks: requests in flight
    # there that share the request's prefix that far (None when `active_overlap_blocks` is).
    active_prefix_sharers: int | None = None
    # The engine publishes no KV events and the router predicts its cache from its own
    # routing (`kv_events: approximate`: `controller.router.router.PendingPrefixes`).
    predicts_cache: bool = False

    def as_routed(
        self,
        hit: PrefixHit,
        inflight: InFlight,
        active_overlap_blocks: int | None,
        active_prefix_sharers: int | None,
    ) -> Candidate:
        """This candidate with the router's own knowledge (`Router.with_inflight`): what
        `_replace` of those four fields gives, spelled out, since the router makes one per
        engine for every request and `_replace` (generic, by keyword) cost about as much as
        the rest of that scan at hundreds of engines. Unpacking `self` fails loudly if a field
        is added here and not below."""
        engine_id, _, load, _, total_kv_blocks, block_size, cached_blocks, _, _, predicts = self
        return Candidate(
            engine_id,
            hit,
            load,
            inflight,
            total_kv_blocks,
            block_size,
            cached_blocks,
            active_overlap_blocks,
            active_prefix_sharers,
            predicts,
        )

    @property
    def active_requests(self) -> int:
        """Requests on the engine: the larger of the polled count and the router's own (the
        poll lags, the router's count misses other routers' traffic)."""
        polled = (self.load.running_requests or 0) + (self.load.queued_requests or 0)
        own = self.inflight.requests
        return own if own > polled else polled  # max(polled, own)

    @property
    def queued_requests(self) -> int:
        return max(self.load.queued_requests or 0, self.inflight.prefilling)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens the engine still has to prefill before a new request's.

        GetLoad's `waiting_tokens` counts every waiting prompt whole: the engine looks up its
        cache only when it admits a request, so a follow-up turn queued behind others counts
        its cached conversation too. The router knows how much of each request it sent should
        be cached, so that part comes out of the polled figure, as far as it will still be
        cached at admission (`cache_survival`). The router's own uncached in-flight prefill
        is the floor (the poll lags, and the correction may also take out requests already
        running or sent after the poll, which the polled figure does not hold).

        An engine with no cached prompt of the router's queued (most of a large fleet at any
        moment) keeps the polled figure as it is, without working out `cache_survival`: the
        router reads this of every engine for every request."""
        inflight = self.inflight
        polled = self.load.waiting_tokens or 0
        if inflight.prefill_cached_tokens:
            polled -= round(self.cache_survival * inflight.prefill_cached_tokens)
        own = inflight.prefill_tokens
        return own if own > polled else polled  # max(polled, own)

    @property
    def capacity_blocks(self) -> int | None:
        """The engine's KV capacity in blocks: `total_kv_blocks`, else its last GetLoad's."""
        return self.total_kv_blocks or self.load.total_kv_blocks

    @property
    def cache_survival(self) -> float:
        """The share of a queued request's cached prefix the engine should still hold when it
        admits the request (1.0 when the cache size is unknown). Everything queued ahead is
        computed first and passes through the cache, evicting the least recently used blocks:
        a prefix outlives a queue that is short against the cache, not one that fills it (under
        overload most predicted hits are gone by admission)."""
        total = self.capacity_blocks
        if not total or not self.block_size:
            return 1.0
        return max(0.0, 1.0 - self.inflight.prefill_tokens / (total * self.block_size))

    @property
    def cache_pressure(self) -> float:
        """How full the engine's cache is with data (1.0 when unknown): storing a prefix twice
        only costs room that something else would have used when the cache is full."""
        total = self.capacity_blocks
        if not total or self.cached_blocks is None:
            return 1.0
        full = self.cached_blocks / total
        return full if full < 1.0 else 1.0  # min(1.0, full)

    @property
    def kv_usage(self) -> float | None:
        total = self.load.total_kv_blocks or self.total_kv_blocks
        if not total or self.load.used_kv_blocks is None:
            return None
        return self.load.used_kv_blocks / total


def cacheable_blocks(num_prompt_tokens: int, block_size: int, num_block_keys: int) -> int:
    """How many of a prompt's `num_block_keys` full blocks can be served from cache: its last
    token is always computed (the engine needs its logits), so never the block holding it."""
    if num_prompt_tokens <= 0:
        return 0
    return min(num_block_keys, (num_prompt_tokens - 1) // block_size)


class RouteRequest(NamedTuple):
    """A request to place: its prompt length, its canonical block keys (full blocks only) and
    optionally a session key for affinity."""

    request_id: str
    num_prompt_tokens: int
    block_size: int
    block_keys: tuple[int, ...] = ()
    session_key: str | None = None
    # False: the engine will not read its prefix cache for it (OpenEngine
    # `kv.bypass_prefix_cache`), though it stores the blocks it computes as for any prompt.
    # Then no engine holds any of its prefix as far as routing goes: it is placed by load,
    # with 0 cached tokens predicted, and still charges its engine with its blocks.
    reads_cache: bool = True

    @property
    def max_cacheable_blocks(self) -> int:
        """Full blocks that can be served from cache (`cacheable_blocks`), none for a request
        that reads no cache."""
        if not self.reads_cache:
            return 0
        return cacheable_blocks(self.num_prompt_tokens, self.block_size, len(self.block_keys))

    def cached_tokens(self, hit: PrefixHit, limit: int | None = None) -> tuple[int, int, int]:
        """(device, host, disk) prompt tokens an engine with `hit` serves from its cache.
        `limit`: `max_cacheable_blocks`, read once by a caller that asks for every engine of a
        fleet (a property that computes: at hundreds of engines, reading it for each one
        showed)."""
        if not (hit.device_blocks or hit.host_blocks or hit.disk_blocks):
            return 0, 0, 0  # a prompt the engine holds none of (most engines of a large fleet)
        if limit is None:
            limit = self.max_cacheable_blocks
        device, host, disk = hit.within(limit)
        size = self.block_size
        return device * size, host * size, disk * size


class EngineCost(NamedTuple):
    """One engine's terms in a decision (lower total is better; `None` for cache-blind
    policies that compute no cost)."""

    engine_id: str
    cached_tokens: int
    host_cached_tokens: int
    prefill_cost: float
    queue_cost: float
    decode_cost: float
    total: float | None
    busy: bool = False  # skipped as busy (the policy did not consider it)
    # Prompt-token equivalents for the KV the engine cannot hold (`KvplaneWeights.memory_weight`).
    memory_cost: float = 0.0
    # Prompt tokens it would load from disk (SSD), past its device and host tiers.
    disk_cached_tokens: int = 0


class Decision(NamedTuple):
    engine_id: str
    reason: Reason
    policy: str
    # Prompt tokens the chosen engine is expected to serve from its cache (device + host +
    # disk).
    predicted_cached_tokens: int
    costs: tuple[EngineCost, ...] = ()
    # How many requests in flight share the prompt's cached prefix, when the policy found it
    # hot and divided its overlap weight by them (`KvplaneWeights.hot_prefix_requests`);
    # 0 otherwise. What `admin route` shows to say why a cold engine's prefill costs less.
    hot_prefix_sharers: int = 0
