"""The seed's prefix rule for a worker with a cache spec (WIRE.md section 2,
MatchExternalKvPrefix: FULL / SWA / MAMBA), pure.

Shared by the memory index (both prefix views) and the Redis backend's token-level view; the
Redis backend's MatchExternalKvPrefix runs the same rule inside Redis (`kvp_prefix` in
`redis_functions.lua`), and the conformance suite holds the two to the same answers.
"""

from __future__ import annotations

from collections.abc import Iterable

from indexer.batch import CacheSpec, Component, Tier

# Tiers a prefix may be served from, as a (1 << Tier) mask: HBM | DRAM (never SSD in v1).
SERVABLE_TIER_MASK = (1 << Tier.HBM) | (1 << Tier.DRAM)
# Tiers kvplane's own router counts a prefix on (`match_prefix_by_tier`'s `any_tier_blocks`):
# the servable ones and disk (SSD), which an engine loads back at a cost (the seed's
# KVIndexer RPCs keep SERVABLE_TIER_MASK).
ROUTABLE_TIER_MASK = SERVABLE_TIER_MASK | (1 << Tier.SSD)

_FULL, _SWA, _MAMBA = int(Component.FULL), int(Component.SWA), int(Component.MAMBA)


def spec_is_valid(spec: CacheSpec) -> bool:
    """A spec the prefix rule can use; an invalid spec makes every prefix 0."""
    if spec.components == 0 or spec.version > 1:
        return False
    return not (spec.components & _SWA and spec.swa_window_tokens == 0)


def resident_components(
    spec: CacheSpec, placements: Iterable[tuple[int, int]], tiers: int = SERVABLE_TIER_MASK
) -> int:
    """The components of one block the rule may use, from the worker's (tier, component mask)
    placements of it: a component counts at a tier of `tiers` (a (1 << Tier) mask; the seed's
    servable set by default) in its own tier mask."""
    full_tiers = spec.full_tier_mask & tiers
    swa_tiers = spec.swa_tier_mask & tiers
    mamba_tiers = spec.mamba_tier_mask & tiers
    resident = 0
    for tier, mask in placements:
        tier_bit = 1 << tier
        if full_tiers & tier_bit:
            resident |= mask & _FULL
        if swa_tiers & tier_bit:
            resident |= mask & _SWA
        if mamba_tiers & tier_bit:
            resident |= mask & _MAMBA
    return resident


def spec_prefix_blocks(spec: CacheSpec, blocks: Iterable[tuple[int, int]]) -> int:
    """Prefix blocks by the component rule, from (resident components, tokens) per query block
    in order. Stops reading `blocks` at the first block without FULL (so a lazy iterable is
    read no further than the rule needs). An invalid spec gives 0."""
    if not spec_is_valid(spec):
        return 0
    has_swa = bool(spec.components & _SWA)
    has_mamba = bool(spec.components & _MAMBA)
    window = spec.swa_window_tokens
    best = 0
    run = 0  # tokens of the SWA run ending at this block
    head_unbroken = True  # SWA resident on every block so far
    for i, (resident, tokens) in enumerate(blocks):
        if not resident & _FULL:
            break
        boundary_ok = True
        if has_swa:
            if resident & _SWA:
                run += tokens
                boundary_ok = head_unbroken or run >= window
            else:
                run = 0
                head_unbroken = False
                boundary_ok = False
        if has_mamba and not resident & _MAMBA:
            boundary_ok = False
        if boundary_ok:
            best = i + 1
    return best
