"""A hybrid model's KV cache groups, as the seed's components (pure; no I/O).

vLLM publishes BlockStored/BlockRemoved per KV cache group (`group_idx`); a BlockStored also
names the group's kind (`kv_cache_spec_kind`) and, for a sliding window, its size in tokens
(`kv_cache_spec_sliding_window`, vLLM's `SlidingWindowSpec.sliding_window`). `CacheGroups`
learns the groups and answers two questions for the translator:

- `mask(held)`: the component mask of a placement whose block the groups `held` hold at one
  tier. A component is resident when *every* group of its kind holds the block: vLLM looks a
  hit up in all groups of one kind together and takes a block only when each has it. FULL is
  always present on a stored block (the seed's rule), so a worker without full-attention
  groups (a pure sliding-window model) has FULL wherever any group holds the block.
- `spec()`: the worker's `CacheSpec`: the components present, every component servable from
  HBM and DRAM, and the window for the SWA rule.

Kinds (vLLM's `KVCacheSpecKind` values): full_attention, mla_attention, sink_full_attention ->
FULL; sliding_window, sliding_window_mla -> SWA; mamba (vLLM's kind for every state-space and
linear-attention layer: Mamba, GDN, Lightning, short convolutions) -> MAMBA. Any other kind
(chunked_local_attention, cross_attention, "unknown", a kind this code does not know, or no
kind on a hybrid stream) fails closed: it is treated as needed on every block of a prefix,
i.e. folded into FULL's requirement, which is stricter than any rule a group could have.

Window: vLLM reuses a sliding-window prefix when the last `sliding_window - 1` tokens before
the boundary are cached (the token being computed is itself in the window), so
`swa_window_tokens` is `sliding_window - 1` (at least 1), the largest over SWA groups. A
sliding-window group that names no window is treated as an unbounded window: SWA must then be
resident on every block from the head (fail closed).

A stream is *hybrid* once it names a kind that is not full attention; until then (no kinds,
or only full-attention groups) `spec()` is None and every placement is a legacy whole block,
exactly as for a plain model.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from indexer.batch import CacheSpec, Component
from indexer.component_rule import SERVABLE_TIER_MASK

_FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_SWA_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
_MAMBA_KINDS = frozenset({"mamba"})

_UINT32_MAX = (1 << 32) - 1


def component_of_kind(kind: str | None) -> Component:
    """The component a group of `kind` provides; unknown kinds fail closed as FULL (needed on
    every block of a prefix)."""
    if kind in _SWA_KINDS:
        return Component.SWA
    if kind in _MAMBA_KINDS:
        return Component.MAMBA
    return Component.FULL


def is_full_attention(kind: str | None) -> bool:
    return kind in _FULL_KINDS


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One KV cache group: its kind as the engine named it, and its window in tokens."""

    kind: str | None
    sliding_window: int | None = None


class CacheGroups:
    """The KV cache groups of one worker, learned from its events (or configured)."""

    def __init__(self, configured: dict[int, CacheGroup] | None = None) -> None:
        self._configured = dict(configured or {})
        self._groups: dict[int, CacheGroup] = {}
        self._members: dict[Component, frozenset[int]] = {}
        self._spec: CacheSpec | None = None
        self.reset()

    def reset(self) -> None:
        """Back to the configured groups only (a restarted engine names its own again)."""
        self._groups = dict(self._configured)
        self._refresh()

    @property
    def hybrid(self) -> bool:
        return self._spec is not None

    def spec(self) -> CacheSpec | None:
        return self._spec

    def observe(self, group_idx: int, kind: str | None, sliding_window: int | None) -> bool:
        """Record what a BlockStored says of its group; True when that changes the worker's
        components (every placement's mask must then be recomputed)."""
        known = self._groups.get(group_idx)
        group = CacheGroup(kind, sliding_window)
        if known == group or (known is not None and kind is None):
            return False  # an event without a kind tells nothing new of a known group
        self._groups[group_idx] = group
        before = (self._members, self._spec)
        self._refresh()
        return (self._members, self._spec) != before

    def mask(self, held: Set[int]) -> int:
        """The component mask of a placement held by the groups `held` (at one tier)."""
        if not held:
            return 0
        mask = 0
        for component, members in self._members.items():
            if members <= held:
                mask |= component
        if Component.FULL not in self._members:
            mask |= Component.FULL  # no group needs every block: a stored block is FULL
        return int(mask)

    def _refresh(self) -> None:
        kinds = [g.kind for g in self._groups.values()]
        if all(k is None or is_full_attention(k) for k in kinds):
            self._members, self._spec = {}, None  # a plain model: legacy placements
            return
        members: dict[Component, set[int]] = {}
        for idx, group in self._groups.items():
            members.setdefault(component_of_kind(group.kind), set()).add(idx)
        self._members = {c: frozenset(m) for c, m in members.items()}
        components = Component.FULL
        for component in members:
            components |= component
        window = 0
        for group in self._groups.values():
            if component_of_kind(group.kind) is Component.SWA:
                size = group.sliding_window
                needed = _UINT32_MAX if not size else min(max(size - 1, 1), _UINT32_MAX)
                window = max(window, needed)
        self._spec = CacheSpec(
            version=1,
            components=int(components),
            swa_window_tokens=window,
            full_tier_mask=SERVABLE_TIER_MASK,
            swa_tier_mask=SERVABLE_TIER_MASK if components & Component.SWA else 0,
            mamba_tier_mask=SERVABLE_TIER_MASK if components & Component.MAMBA else 0,
        )
