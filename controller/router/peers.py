"""Faithful re-implementations of the peers' documented routing policies, for side-by-side
comparison with `kvplane` on the same traces and fleets (written from their documentation
and descriptions; for details the documentation leaves open, Dynamo's source was read, not
copied: docs/benchmarks/routing.md names the files).

- `sglang_cache_aware` (SGLang's router, cache-aware policy): the router keeps its own
  approximate prefix tree per worker from the prompts it routed (not engine events). If the
  load is imbalanced (max - min > 64 and max > 1.5 x min, load = the router's in-flight
  requests) it takes the least loaded worker; otherwise the worker with the longest match if
  the match covers more than 30% of the prompt, else the worker with the smallest tree.
- `dynamo_cost` (NVIDIA Dynamo's KV router, default selector): cost = overlap_weight x
  potential prefill blocks + potential decode blocks; temperature 0: the minimum, ties at
  random. Potential prefill blocks = (the worker's in-flight prefill tokens + the prompt's
  tokens not cached there) / block size, the cache as the engines' KV events show it (no credit
  for blocks still being computed: `credits_pending_prefixes` False); potential decode blocks =
  the distinct full blocks of the worker's active requests (each shared block once) + the
  prompt's full blocks not already active there. Only device blocks count as cached (later
  Dynamo releases also credit host and disk hits, 0.75 and 0.25 of a device hit; this row
  keeps the selector it was measured as).
- `llmd_longest_prefix` (llm-d's precise prefix-cache scorer): the longest consecutive cached
  prefix, each block weighted by where it lives (device 1.0, host 0.8; its documented
  configuration weighs those two backends only, so blocks on disk add nothing); ties at
  random.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from controller.router.model import Candidate, Decision, EngineCost, PrefixHit, Reason, RouteRequest
from controller.router.policies import blind_costs, decision_for


@dataclass(frozen=True, slots=True)
class SglangSettings:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # Per-worker tree size bound (tokens); least recently used blocks go first.
    max_tree_tokens: int = 1 << 24


class _ApproxTree:
    """One worker's approximate tree. Keys are chained block keys, so the set of keys is the
    tree; an OrderedDict in access order gives LRU eviction. A walk touches children before
    parents, so a parent is never older than its child and leaves go first."""

    def __init__(self) -> None:
        self.keys: OrderedDict[int, None] = OrderedDict()

    def match(self, block_keys: Sequence[int]) -> int:
        n = 0
        for key in block_keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, block_keys: Sequence[int], max_blocks: int) -> None:
        for key in reversed(block_keys):
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > max_blocks:
            self.keys.popitem(last=False)


class SglangCacheAware:
    name = "sglang_cache_aware"
    filters_busy = False  # its real system has no such filter
    credits_pending_prefixes = True  # only the decision's predicted cache reads it
    counts_active_blocks = False

    def __init__(self, settings: SglangSettings | None = None) -> None:
        self.settings = settings or SglangSettings()
        self._trees: dict[str, _ApproxTree] = {}

    def _tree(self, engine_id: str) -> _ApproxTree:
        return self._trees.setdefault(engine_id, _ApproxTree())

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        s = self.settings
        costs = blind_costs(request, candidates)
        loads = [c.inflight.requests for c in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > s.balance_abs_threshold and hi > lo * s.balance_rel_threshold:
            chosen = candidates[loads.index(lo)]
            return decision_for(self.name, request, chosen, Reason.BALANCE, costs)
        matched = [self._tree(c.engine_id).match(request.block_keys) for c in candidates]
        best = max(matched)
        rate = best * request.block_size / max(request.num_prompt_tokens, 1)
        if best > 0 and rate > s.cache_threshold:
            chosen = candidates[matched.index(best)]
            return decision_for(self.name, request, chosen, Reason.CACHE, costs)
        sizes = [len(self._tree(c.engine_id).keys) for c in candidates]
        chosen = candidates[sizes.index(min(sizes))]
        return decision_for(self.name, request, chosen, Reason.LOAD, costs)

    def observe(self, request: RouteRequest, engine_id: str, now_s: float) -> None:
        max_blocks = max(1, self.settings.max_tree_tokens // max(request.block_size, 1))
        self._tree(engine_id).insert(request.block_keys, max_blocks)

    def forget_engine(self, engine_id: str) -> None:
        self._trees.pop(engine_id, None)

    def hit_worth(self, hit: PrefixHit, cacheable: int) -> float:
        """Every block served alike: it routes by its own tree, and reads the index's hit only
        for the decision's predicted cached tokens, which count all tiers."""
        return hit.blocks_within(cacheable)


class DynamoCost:
    name = "dynamo_cost"
    filters_busy = False  # its real system has no such filter
    credits_pending_prefixes = False  # its overlap comes from KV events alone
    counts_active_blocks = True  # its decode term refcounts active blocks by hash

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        """Rows: `prefill_cost` = weighted uncached prompt blocks, `queue_cost` = weighted
        in-flight prefill blocks, `decode_cost` = potential decode blocks. The new prompt's
        uncached tokens are its tokens less every device block the index matched (Dynamo
        subtracts the whole overlap, without keeping a last token to compute), and blocks are
        fractional (tokens / block size)."""
        bs = request.block_size
        w = self.overlap_weight
        prompt_blocks = len(request.block_keys)
        rows = []
        for c in candidates:
            uncached = max(request.num_prompt_tokens - c.hit.device_blocks * bs, 0)
            prefill = w * uncached / bs
            queue = w * c.inflight.prefill_tokens / bs
            already_active = c.active_overlap_blocks or 0
            decode = float(c.inflight.active_blocks + prompt_blocks - already_active)
            device = request.cached_tokens(c.hit)[0]
            rows.append(
                EngineCost(c.engine_id, device, 0, prefill, queue, decode, prefill + queue + decode)
            )
        best = min(r.total or 0.0 for r in rows)
        tied = [i for i, r in enumerate(rows) if r.total == best]
        index = tied[0] if len(tied) == 1 else rng.choice(tied)
        chosen = rows[index]
        reason = Reason.CACHE if chosen.cached_tokens > 0 else Reason.LOAD
        return Decision(chosen.engine_id, reason, self.name, chosen.cached_tokens, tuple(rows))

    def observe(self, request: RouteRequest, engine_id: str, now_s: float) -> None:
        return None

    def forget_engine(self, engine_id: str) -> None:
        return None

    def hit_worth(self, hit: PrefixHit, cacheable: int) -> float:
        """Its device blocks, every one held (the cap or not): the only ones this selector
        counts as cached, all subtracted from the prompt (`choose`)."""
        return hit.device_blocks


class LlmdLongestPrefix:
    name = "llmd_longest_prefix"
    filters_busy = False  # its real system has no such filter
    credits_pending_prefixes = True  # as in every row measured for it so far
    counts_active_blocks = False

    def __init__(self, device_weight: float = 1.0, host_weight: float = 0.8) -> None:
        self.device_weight = device_weight
        self.host_weight = host_weight

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        now_s: float,
    ) -> Decision:
        query = max(len(request.block_keys), 1)
        scores = []
        for c in candidates:
            scores.append(min(self._weighed(c.hit) / query, 1.0))
        best = max(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        chosen = candidates[tied[0] if len(tied) == 1 else rng.choice(tied)]
        reason = Reason.TIE if len(tied) > 1 else Reason.CACHE if best > 0 else Reason.LOAD
        return decision_for(self.name, request, chosen, reason, blind_costs(request, candidates))

    def observe(self, request: RouteRequest, engine_id: str, now_s: float) -> None:
        return None

    def forget_engine(self, engine_id: str) -> None:
        return None

    def hit_worth(self, hit: PrefixHit, cacheable: int) -> float:
        """Its score (`_weighed`), of every block held, the cap or not."""
        return self._weighed(hit)

    def _weighed(self, hit: PrefixHit) -> float:
        """Its blocks weighted by where they live (disk blocks add nothing)."""
        return hit.device_blocks * self.device_weight + hit.host_blocks * self.host_weight
