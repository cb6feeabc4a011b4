"""The index core against a naive model of WIRE.md section 2 (plus copies), driven by a
hypothesis state machine: random stores, revokes, clears, copies, specs, addresses, worker
removals, and every query kind checked after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec, Tier
from indexer.index import IndexRequestError, PrefixIndex

TIERS = (Tier.HBM, Tier.DRAM, Tier.SSD)
SERVABLE = (1 << Tier.HBM) | (1 << Tier.DRAM)
# The tiers kvplane's router counts a prefix on (`any_tier_blocks`): disk too.
ROUTABLE = SERVABLE | (1 << Tier.SSD)
FULL, SWA, MAMBA = 1, 2, 4
# One tier of a worker in a MatchExternalKv answer: tier, hashes, their masks and sizes.
TierRow = tuple[Tier, list[BlockKey], list[int], list[int]]

workers = st.sampled_from(["a", "b", "c"])
tiers = st.sampled_from(TIERS)
keys = st.integers(min_value=-3, max_value=5)
specs = st.sampled_from(
    [
        None,
        CacheSpec(components=FULL, full_tier_mask=6),
        CacheSpec(components=FULL, full_tier_mask=2),
        CacheSpec(components=FULL | SWA, swa_window_tokens=24, full_tier_mask=6, swa_tier_mask=6),
        CacheSpec(components=FULL | MAMBA, full_tier_mask=6, mamba_tier_mask=2),
        CacheSpec(
            components=FULL | SWA | MAMBA,
            swa_window_tokens=8,
            full_tier_mask=14,
            swa_tier_mask=2,
            mamba_tier_mask=4,
        ),
        CacheSpec(components=0, full_tier_mask=6),
        CacheSpec(version=2, components=FULL, full_tier_mask=6),
    ]
)


@dataclass
class Model:
    """Placements as a plain dict, prefix rule written straight from WIRE.md."""

    placements: dict[tuple[str, Tier, BlockKey], list[int]] = field(default_factory=dict)
    sizes: dict[BlockKey, int] = field(default_factory=dict)
    hits: dict[BlockKey, int] = field(default_factory=dict)
    info: dict[str, tuple[str, CacheSpec | None]] = field(default_factory=dict)
    # Per worker: block -> the parent its REPORTs last stated while the worker held it.
    stated: dict[str, dict[BlockKey, BlockKey]] = field(default_factory=dict)

    def holds(self, key: BlockKey) -> bool:
        return any(k == key for (_, _, k) in self.placements)

    def forget_if_gone(self, key: BlockKey) -> None:
        if not self.holds(key):
            self.sizes.pop(key, None)
            self.hits.pop(key, None)

    def apply(self, batch: Batch) -> None:
        wid = batch.worker_id
        self.info[wid] = (batch.worker_address, batch.cache_spec)
        for a in batch.actions:
            if a.type == ActionType.REPORT:
                held = {k for (w, _, k) in self.placements if w == wid}
                stated = self.stated.setdefault(wid, {})
                for i, key in enumerate(a.hashes):
                    parent = a.hashes[i - 1] if i else a.parent
                    if parent is not None:
                        stated[key] = parent
                    elif key not in held:  # new to the worker: nothing stated before counts
                        stated.pop(key, None)
                    mask = a.component_masks[i] if a.component_masks else 0
                    entry = self.placements.get((wid, a.tier, key))
                    if entry is None:
                        self.placements[(wid, a.tier, key)] = [mask, 1]
                    else:
                        entry[0] = mask
                        entry[1] += 1 if a.copies else 0
                    if a.block_sizes and a.block_sizes[i]:
                        self.sizes[key] = a.block_sizes[i]
            elif a.type == ActionType.REVOKE:
                for key in a.hashes:
                    entry = self.placements.get((wid, a.tier, key))
                    if entry is None:
                        continue
                    if a.copies and entry[1] > 1:
                        entry[1] -= 1
                        continue
                    del self.placements[(wid, a.tier, key)]
                    self.forget_if_gone(key)
            else:
                for w, t, key in list(self.placements):
                    if w == wid and t == a.tier:
                        del self.placements[(w, t, key)]
                        self.forget_if_gone(key)

    def remove_worker(self, wid: str) -> int:
        gone = [p for p in self.placements if p[0] == wid]
        for p in gone:
            del self.placements[p]
            self.forget_if_gone(p[2])
        self.info.pop(wid, None)
        self.stated.pop(wid, None)
        return len(gone)

    def parent(self, key: BlockKey) -> BlockKey | None:
        """The parent stated by the holders; where they disagree, the smallest worker id's."""
        for wid in sorted({w for (w, _, k) in self.placements if k == key}):
            parent = self.stated.get(wid, {}).get(key)
            if parent is not None:
                return parent
        return None

    def tiers_of(self, wid: str, key: BlockKey) -> dict[Tier, int]:
        return {
            t: self.placements[(wid, t, key)][0] for t in TIERS if (wid, t, key) in self.placements
        }

    def available(
        self, wid: str, key: BlockKey, tier_mask: int, component: int, tiers: int
    ) -> bool:
        return any(
            mask & component and (tier_mask & tiers) >> t & 1
            for t, mask in self.tiers_of(wid, key).items()
        )

    def prefix(self, wid: str, hashes: list[BlockKey], tiers: int = SERVABLE) -> int:
        """MatchExternalKvPrefix's rule; `tiers`: where a component may be resident (the
        seed's servable set; ROUTABLE for the router's disk view)."""
        spec = self.info[wid][1]
        if spec is None:
            # Leading blocks held on any tier; 0 with component data on any block of the
            # window, past the first gap too.
            n, gap = 0, False
            for key in hashes:
                held = self.tiers_of(wid, key)
                if any(held.values()):
                    return 0
                gap = gap or not held
                if not gap:
                    n += 1
            return n
        if spec.components == 0 or spec.version > 1:
            return 0
        if spec.components & SWA and not spec.swa_window_tokens:
            return 0
        best, run, head = 0, 0, True
        for i, key in enumerate(hashes):
            if not self.available(wid, key, spec.full_tier_mask, FULL, tiers):
                break
            ok = True
            if spec.components & SWA:
                if self.available(wid, key, spec.swa_tier_mask, SWA, tiers):
                    run += self.sizes.get(key, 0)
                    ok = head or run >= spec.swa_window_tokens
                else:
                    run, head, ok = 0, False, False
            if spec.components & MAMBA:
                ok = ok and self.available(wid, key, spec.mamba_tier_mask, MAMBA, tiers)
            if ok:
                best = i + 1
        return best

    def match(self, hashes: list[BlockKey]) -> list[tuple[str, str, list[TierRow]]]:
        """MatchExternalKv as WIRE.md states it: distinct hashes in first-seen order; workers
        in first-seen order (those first seen on one hash by worker id); per worker its tiers
        ascending, each with its hashes in query order and their masks and sizes aligned."""
        distinct = list(dict.fromkeys(hashes))
        order: list[str] = []
        for key in distinct:
            order.extend(sorted({w for (w, _, k) in self.placements if k == key} - set(order)))
        out = []
        for wid in order:
            rows = []
            for tier in TIERS:
                if held := [k for k in distinct if (wid, tier, k) in self.placements]:
                    masks = [self.placements[(wid, tier, k)][0] for k in held]
                    rows.append((tier, held, masks, [self.sizes.get(k, 0) for k in held]))
            out.append((wid, self.info[wid][0], rows))
        return out

    def match_prefix(self, hashes: list[BlockKey], max_blocks: int) -> list[tuple[str, int]]:
        limit = hashes[: max_blocks or len(hashes)]
        out = []
        for wid, (address, _spec) in self.info.items():
            if address and limit and self.tiers_of(wid, limit[0]):
                n = self.prefix(wid, limit)
                if n:
                    out.append((wid, n))
        return sorted(out, key=lambda p: (-p[1], p[0]))

    def by_tier(
        self, hashes: list[BlockKey]
    ) -> list[tuple[str, int, int, list[tuple[Tier, int]], int, int]]:
        out = []
        for wid in self.info:
            if not hashes or not self.tiers_of(wid, hashes[0]):
                continue

            def run(pred: object, wid: str = wid) -> int:
                n = 0
                for key in hashes:
                    held = self.tiers_of(wid, key)
                    if not held or not pred(held):  # type: ignore[operator]
                        break
                    n += 1
                return n

            # No more than its MatchExternalKvPrefix answer: the component rule with a spec,
            # the legacy rule (0 on component data, fail closed) without one.
            most = self.prefix(wid, hashes)
            servable = min(run(lambda h: Tier.HBM in h or Tier.DRAM in h), most)
            per_tier = [(t, n) for t in TIERS if (n := min(run(lambda h, t=t: t in h), most))]
            tokens = sum(self.sizes.get(k, 0) for k in hashes[:servable])
            # On any tier, disk included, capped by the same rule with SSD a resident tier
            # (the legacy rule counts every tier already); never below the servable run.
            reach = min(run(lambda h: True), self.prefix(wid, hashes, ROUTABLE))
            any_tier = max(reach, servable)
            any_tokens = sum(self.sizes.get(k, 0) for k in hashes[:any_tier])
            out.append((wid, servable, tokens, per_tier, any_tier, any_tokens))
        return sorted(out, key=lambda m: (-m[1], m[0]))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Purge removed workers one block per apply, so queries meet half-purged states.
        self.index = PrefixIndex(purge_step_blocks=1)
        self.model = Model()

    def _apply(self, batch: Batch) -> None:
        self.index.apply(batch)
        self.model.apply(batch)

    def _address(self, wid: str) -> str:
        return self.model.info.get(wid, (f"addr-{wid}", None))[0]

    def _spec(self, wid: str) -> CacheSpec | None:
        return self.model.info.get(wid, ("", None))[1]

    @rule(
        wid=workers,
        tier=tiers,
        # Hashes may repeat down a chain (loops), though not back to back (a block its own
        # parent: the snapshot states it as a root).
        chain=st.lists(keys, min_size=1, max_size=4).filter(
            lambda c: all(a != b for a, b in pairwise(c))
        ),
        masks=st.booleans(),
        mask_values=st.lists(st.integers(0, 7), min_size=4, max_size=4),
        sizes=st.sampled_from([(), (8,), (16,)]),
        parent=st.none() | keys,
        copies=st.booleans(),
    )
    def report(  # noqa: PLR0917 - hypothesis passes rule arguments by name
        self,
        wid: str,
        tier: Tier,
        chain: list[BlockKey],
        masks: bool,
        mask_values: list[int],
        sizes: tuple[int, ...],
        parent: BlockKey | None,
        copies: bool,
    ) -> None:
        action = Action(
            ActionType.REPORT,
            tier,
            tuple(chain),
            tuple(mask_values[: len(chain)]) if masks else (),
            sizes * len(chain) if sizes else (),
            parent,
            copies,
        )
        batch = Batch(wid, (action,), self._address(wid), 0, self._spec(wid))
        if parent == chain[0]:  # its head block its own parent: refused, nothing changes
            with pytest.raises(IndexRequestError, match="parent"):
                self.index.apply(batch)
            return
        self._apply(batch)

    @rule(
        wid=workers, tier=tiers, hashes=st.lists(keys, min_size=1, max_size=4), copies=st.booleans()
    )
    def revoke(self, wid: str, tier: Tier, hashes: list[BlockKey], copies: bool) -> None:
        action = Action(ActionType.REVOKE, tier, tuple(hashes), copies=copies)
        self._apply(Batch(wid, (action,), self._address(wid), 0, self._spec(wid)))

    @rule(wid=workers, tier=tiers)
    def clear(self, wid: str, tier: Tier) -> None:
        action = Action(ActionType.CLEAR_ALL_AT_TIER, tier)
        self._apply(Batch(wid, (action,), self._address(wid), 0, self._spec(wid)))

    @rule(wid=workers, spec=specs, address=st.sampled_from(["", "x:1", "y:2"]))
    def refresh(self, wid: str, spec: CacheSpec | None, address: str) -> None:
        self._apply(Batch(wid, (), address, 0, spec))

    @rule(wid=workers)
    def remove_worker(self, wid: str) -> None:
        assert self.index.remove_worker(wid) == self.model.remove_worker(wid)

    @rule(hashes=st.lists(keys, min_size=1, max_size=6), count=st.booleans())
    def match(self, hashes: list[BlockKey], count: bool) -> None:
        got = [
            (
                wp.worker_id,
                wp.address,
                [
                    (tp.tier, list(tp.hashes), list(tp.component_masks), list(tp.block_sizes))
                    for tp in wp.by_tier
                ],
            )
            for wp in self.index.match(hashes, count)
        ]
        assert got == self.model.match(hashes)
        if count:
            for key in set(hashes):
                if self.model.holds(key):
                    self.model.hits[key] = self.model.hits.get(key, 0) + 1

    @rule(hashes=st.lists(keys, min_size=1, max_size=6), max_blocks=st.integers(0, 3))
    def match_prefix(self, hashes: list[BlockKey], max_blocks: int) -> None:
        result = self.index.match_prefix(hashes, max_blocks)
        got = [(m.worker_id, m.matched_prefix_blocks) for m in result.matches]
        want = self.model.match_prefix(hashes, max_blocks)
        assert got == want
        assert [m.worker_address for m in result.matches] == [
            self.model.info[wid][0] for wid, _ in want
        ]
        if not self.model.holds(hashes[0]):  # WIRE.md: a first-block miss reads one block
            assert result.blocks_read == 1
        assert result.best_prefix_blocks == (want[0][1] if want else 0)

    @rule(hashes=st.lists(keys, min_size=1, max_size=6))
    def match_by_tier(self, hashes: list[BlockKey]) -> None:
        got = [
            (
                m.worker_id,
                m.matched_blocks,
                m.matched_tokens,
                [(t.tier, t.matched_blocks) for t in m.tiers],
                m.any_tier_blocks,
                m.any_tier_tokens,
            )
            for m in self.index.match_prefix_by_tier(hashes, 0)
        ]
        assert got == self.model.by_tier(hashes)

    @rule()
    def snapshot_round_trip(self) -> None:
        rebuilt = PrefixIndex()
        for batch in self.index.snapshot():
            rebuilt.apply(batch)
        assert list(rebuilt.placements()) == list(self.index.placements())
        assert rebuilt.stats() == self.index.stats()
        for key in range(-3, 6):
            assert rebuilt.block_size(key) == self.index.block_size(key)
            assert rebuilt.parent(key) == self.index.parent(key)

    @rule(budget=st.integers(0, 2))
    def purge(self, budget: int) -> None:
        self.index.purge(budget)

    @rule()
    def whole_index_views(self) -> None:
        got = {
            (p.worker_id, p.tier, p.key): [p.component_mask, p.copies]
            for p in self.index.placements()
        }
        assert got == self.model.placements
        stats = self.index.stats()
        assert stats.num_placements == len(self.model.placements)
        assert stats.num_blocks == len({key for (_, _, key) in self.model.placements})
        for key in range(-3, 6):
            assert self.index.parent(key) == self.model.parent(key)
            # The indexed blocks naming `key` as parent, while `key` itself is indexed.
            children = [k for k in range(-3, 6) if self.model.parent(k) == key]
            assert self.index.children(key) == (children if self.model.holds(key) else [])

    @invariant()
    def same_state(self) -> None:
        # Only views that never purge, so removed workers' leftovers must stay invisible.
        every_key = list(range(-3, 6))
        got = {
            (wp.worker_id, tp.tier, k): m
            for wp in self.index.match(every_key, False)
            for tp in wp.by_tier
            for k, m in zip(tp.hashes, tp.component_masks, strict=True)
        }
        assert got == {p: e[0] for p, e in self.model.placements.items()}
        assert self.index.hit_counts(every_key) == sorted(self.model.hits.items())
        for key in every_key:
            assert self.index.block_size(key) == self.model.sizes.get(key, 0)
            assert self.index.parent(key) == self.model.parent(key)
        assert self.index.num_placements == len(self.model.placements)
        assert set(self.index.worker_ids()) == set(self.model.info)


IndexMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexAgainstModel = IndexMachine.TestCase
