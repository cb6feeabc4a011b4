"""The pure prefix index: kv_indexer.v1's placement semantics over a radix tree of block keys.

Contract (WIRE.md section 2 is normative; this module implements it exactly):

- `PrefixIndex.apply(batch)` applies one ordered batch atomically (it validates first, so a
  bad batch changes nothing). Every batch, empty ones included, overwrites the worker's address
  and cache spec. REPORT sets the (worker, tier, key) placement's component mask (a replace) and
  the block's token count when > 0; REVOKE removes a placement; CLEAR_ALL_AT_TIER removes the
  worker's placements at one tier. With `Action.copies` set, REPORT adds a physical copy and
  REVOKE drops one, the placement leaving with its last copy (kvplane's ZMQ ingestion).
- `match` (MatchExternalKv), `match_prefix` (MatchExternalKvPrefix), `match_prefix_by_tier`
  (kvplane's token-level view), `hit_counts`, `remove_worker`, `snapshot` (parent-first
  batches that rebuild the index when applied), `stats`.

No I/O, no clock, no asyncio: backends and services wrap it.

Layout, chosen for speed and memory (about 200 bytes per indexed (worker, block) placement):
workers are interned to small integers `w`; each block is one slotted `_Node` in a key -> node
dict, holding `workers` (bit `1 << w` set while worker w holds the block on any tier) and `tiers`
(bit `1 << (3w + tier - 1)` per placement), so a prefix match for every legacy worker at once is
an AND of `workers` along the chain. Rare data lives in sparse side tables keyed by block key:
non-zero component masks, copy counts above one, hit counters, orphaned children. Each worker
keeps the set of keys it holds (CLEAR and worker removal touch only its own blocks).

Tree invariants: `node.parent` is the parent key last reported (None = root; a REPORT without a
parent never erases a known one). A node is listed in its parent node's `children` when the
parent is indexed, else in `_orphans[parent]`; a node whose last placement goes is deleted
and its children become orphans (they keep their parent key, which may be reported again).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from indexer.backend import (
    IndexStats,
    PrefixMatch,
    PrefixResult,
    TierPlacements,
    TierPrefix,
    TokenPrefixMatch,
    WorkerPlacements,
    WorkerStats,
)
from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec, Component, Tier
from kvplane.errors import KvplaneError

MAX_ACTIONS_PER_BATCH = 256
MAX_HASHES_PER_REQUEST = 16_384
# Tiers a prefix may be served from, as a (1 << Tier) mask: HBM | DRAM (never SSD in v1).
SERVABLE_TIER_MASK = (1 << Tier.HBM) | (1 << Tier.DRAM)
_TIERS = (Tier.HBM, Tier.DRAM, Tier.SSD)
_SLOTS_PER_WORKER = 3  # one placement bit per tier
# Component bits as plain ints (IntFlag arithmetic is slow on the hot path).
_FULL, _SWA, _MAMBA = int(Component.FULL), int(Component.SWA), int(Component.MAMBA)


class ValidationKind(enum.Enum):
    """How an adapter reports a rejected request: the gRPC code it maps to."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"


class IndexRequestError(KvplaneError):
    """A request that breaks kv_indexer.v1's validation rules; nothing was changed."""

    def __init__(self, kind: ValidationKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _invalid(message: str) -> IndexRequestError:
    return IndexRequestError(ValidationKind.INVALID_ARGUMENT, message)


def validate_tier(value: int) -> Tier:
    """A wire tier as a `Tier`; TIER_UNKNOWN (0) and unknown values are INVALID_ARGUMENT."""
    if value not in (1, 2, 3):
        raise _invalid(f"tier must be HBM, DRAM or SSD, got {value}")
    return Tier(value)


def validate_action_type(value: int) -> ActionType:
    """A wire action type; ACTION_UNKNOWN (0) and unknown values are INVALID_ARGUMENT."""
    if value not in (1, 2, 3):
        raise _invalid(f"action type must be REPORT, REVOKE or CLEAR_ALL_AT_TIER, got {value}")
    return ActionType(value)


def validate_batch(batch: Batch) -> None:
    """ApplyExternalKvBatch's rules, checked before any state changes (WIRE.md section 2)."""
    if not batch.worker_id:
        raise _invalid("worker_id must not be empty")
    if len(batch.actions) > MAX_ACTIONS_PER_BATCH:
        raise IndexRequestError(
            ValidationKind.RESOURCE_EXHAUSTED,
            f"{len(batch.actions)} actions in one batch; at most {MAX_ACTIONS_PER_BATCH}",
        )
    num_hashes = 0
    for i, action in enumerate(batch.actions):
        validate_action_type(action.type)
        validate_tier(action.tier)
        if action.type == ActionType.CLEAR_ALL_AT_TIER:
            continue
        n = len(action.hashes)
        if n == 0:
            raise _invalid(f"action {i}: REPORT/REVOKE needs at least one hash")
        if action.component_masks and len(action.component_masks) != n:
            raise _invalid(f"action {i}: {len(action.component_masks)} component_masks for {n}")
        if action.block_sizes and len(action.block_sizes) != n:
            raise _invalid(f"action {i}: {len(action.block_sizes)} block_sizes for {n} hashes")
        num_hashes += n
    if num_hashes > MAX_HASHES_PER_REQUEST:
        raise IndexRequestError(
            ValidationKind.RESOURCE_EXHAUSTED,
            f"{num_hashes} hashes in one batch; at most {MAX_HASHES_PER_REQUEST}",
        )


def validate_match(hashes: Sequence[BlockKey]) -> None:
    """MatchExternalKv and GetExternalKvHitCounts: 1..16,384 hashes."""
    if not hashes:
        raise _invalid("hashes must not be empty")
    if len(hashes) > MAX_HASHES_PER_REQUEST:
        raise IndexRequestError(
            ValidationKind.RESOURCE_EXHAUSTED,
            f"{len(hashes)} hashes in one request; at most {MAX_HASHES_PER_REQUEST}",
        )


def validate_prefix_match(hashes: Sequence[BlockKey]) -> None:
    """MatchExternalKvPrefix: at least one hash, no length cap (only `max_blocks`)."""
    if not hashes:
        raise _invalid("hashes must not be empty")


def spec_is_valid(spec: CacheSpec) -> bool:
    """A spec the prefix rule can use; an invalid spec makes every prefix 0."""
    if spec.components == 0 or spec.version > 1:
        return False
    return not (spec.components & _SWA and spec.swa_window_tokens == 0)


@dataclass(frozen=True, slots=True)
class Placement:
    """One (worker, tier, block) placement, for dumps, tests and admin views."""

    worker_id: str
    tier: Tier
    key: BlockKey
    component_mask: int
    copies: int


class _Node:
    """One indexed block. `children` is None, one child key, or a set of child keys (most
    chains have one child, so no set is allocated for them)."""

    __slots__ = ("children", "parent", "size", "tiers", "workers")

    def __init__(self, parent: BlockKey | None, workers: int, tiers: int) -> None:
        self.parent = parent
        self.children: BlockKey | set[BlockKey] | None = None
        self.size = 0
        self.workers = workers
        self.tiers = tiers


class _Worker:
    __slots__ = ("address", "bit", "blocks", "idx", "num_placements", "spec", "tier_bits", "wid")

    def __init__(self, wid: str, idx: int) -> None:
        self.wid = wid
        self.idx = idx
        self.bit = 1 << idx
        base = _SLOTS_PER_WORKER * idx
        # tier_bits[t] is the placement bit for Tier t (index 0 unused).
        self.tier_bits = (0, 1 << base, 1 << (base + 1), 1 << (base + 2))
        self.address = ""
        self.spec: CacheSpec | None = None
        self.blocks: set[BlockKey] = set()
        self.num_placements = 0


def _add_child(
    children: BlockKey | set[BlockKey] | None, child: BlockKey
) -> BlockKey | set[BlockKey]:
    if children is None or children == child:
        return child
    if isinstance(children, set):
        children.add(child)
        return children
    return {children, child}


def _remove_child(
    children: BlockKey | set[BlockKey] | None, child: BlockKey
) -> BlockKey | set[BlockKey] | None:
    if isinstance(children, set):
        children.discard(child)
        if len(children) > 1:
            return children
        return next(iter(children), None)
    return None if children == child else children


def _iter_children(children: BlockKey | set[BlockKey] | None) -> Iterable[BlockKey]:
    if children is None:
        return ()
    if isinstance(children, set):
        return children
    return (children,)


def _bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """The index. Not thread-safe: one owner (a backend) serialises calls."""

    def __init__(self) -> None:
        self._nodes: dict[BlockKey, _Node] = {}
        self._orphans: dict[BlockKey, BlockKey | set[BlockKey]] = {}
        # Sparse side tables: block key -> {placement slot: value}.
        self._component_masks: dict[BlockKey, dict[int, int]] = {}
        self._copies: dict[BlockKey, dict[int, int]] = {}  # only counts >= 2
        self._hits: dict[BlockKey, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._by_idx: dict[int, _Worker] = {}
        self._free_idx: list[int] = []
        self._addressed = 0  # bits of workers with a non-empty address
        self._legacy = 0  # bits of workers without a cache spec
        self._num_placements = 0
        self._sizes: dict[int, int] = {}  # interned token counts (one int object per value)

    # ------------------------------------------------------------------ apply

    def apply(self, batch: Batch) -> None:
        """Apply one batch, in order, atomically (validated first; raises IndexRequestError)."""
        validate_batch(batch)
        worker = self._worker(batch.worker_id)
        self._set_worker_info(worker, batch.worker_address, batch.cache_spec)
        for action in batch.actions:
            if action.type == ActionType.REPORT:
                self._report(worker, action)
            elif action.type == ActionType.REVOKE:
                self._revoke(worker, action)
            else:
                self._clear_tier(worker, Tier(action.tier))

    def _worker(self, wid: str) -> _Worker:
        worker = self._workers.get(wid)
        if worker is None:
            idx = self._free_idx.pop() if self._free_idx else len(self._by_idx)
            worker = _Worker(wid, idx)
            self._workers[wid] = worker
            self._by_idx[idx] = worker
            self._legacy |= worker.bit
        return worker

    def _set_worker_info(self, worker: _Worker, address: str, spec: CacheSpec | None) -> None:
        worker.address = address
        worker.spec = spec
        bit = worker.bit
        self._addressed = self._addressed | bit if address else self._addressed & ~bit
        self._legacy = self._legacy | bit if spec is None else self._legacy & ~bit

    def _report(self, worker: _Worker, action: Action) -> None:
        nodes = self._nodes
        wbit = worker.bit
        tier = action.tier
        tbit = worker.tier_bits[tier]
        slot = tbit.bit_length() - 1
        masks = action.component_masks
        sizes = action.block_sizes
        copies = action.copies
        parent = action.parent
        blocks = worker.blocks
        for i, key in enumerate(action.hashes):
            node = nodes.get(key)
            if node is None:
                node = _Node(parent, wbit, tbit)
                nodes[key] = node
                self._link_new(key, node)
                blocks.add(key)
                worker.num_placements += 1
                self._num_placements += 1
            else:
                if parent is not None and node.parent != parent:
                    self._relink(key, node, parent)
                if node.tiers & tbit:
                    if copies:
                        per_key = self._copies.setdefault(key, {})
                        per_key[slot] = per_key.get(slot, 1) + 1
                else:
                    if not node.workers & wbit:
                        node.workers |= wbit
                        blocks.add(key)
                    node.tiers |= tbit
                    worker.num_placements += 1
                    self._num_placements += 1
            mask = masks[i] if masks else 0
            if mask:
                self._component_masks.setdefault(key, {})[slot] = mask
            elif key in self._component_masks:
                self._drop_side(self._component_masks, key, slot)
            if sizes:
                size = sizes[i]
                if size:
                    node.size = self._sizes.setdefault(size, size)
            parent = key

    def _revoke(self, worker: _Worker, action: Action) -> None:
        nodes = self._nodes
        tbit = worker.tier_bits[action.tier]
        slot = tbit.bit_length() - 1
        for key in action.hashes:
            node = nodes.get(key)
            if node is None or not node.tiers & tbit:
                continue
            if key in self._copies:
                per_key = self._copies[key]
                count = per_key.get(slot, 1)
                if action.copies and count > 1:
                    if count > 2:
                        per_key[slot] = count - 1
                    else:
                        self._drop_side(self._copies, key, slot)
                    continue
                self._drop_side(self._copies, key, slot)
            self._drop_placement(worker, key, node, tbit)

    def _clear_tier(self, worker: _Worker, tier: Tier) -> None:
        tbit = worker.tier_bits[tier]
        slot = tbit.bit_length() - 1
        nodes = self._nodes
        for key in [k for k in worker.blocks if nodes[k].tiers & tbit]:
            if key in self._copies:
                self._drop_side(self._copies, key, slot)
            self._drop_placement(worker, key, nodes[key], tbit)

    def _drop_placement(self, worker: _Worker, key: BlockKey, node: _Node, tbit: int) -> None:
        """Remove one placement (its copy count already settled by the caller)."""
        tiers = node.tiers ^ tbit
        node.tiers = tiers
        worker.num_placements -= 1
        self._num_placements -= 1
        if key in self._component_masks:
            self._drop_side(self._component_masks, key, tbit.bit_length() - 1)
        if not tiers & (worker.tier_bits[1] | worker.tier_bits[2] | worker.tier_bits[3]):
            node.workers ^= worker.bit
            worker.blocks.discard(key)
        if not tiers:
            self._delete_node(key, node)

    @staticmethod
    def _drop_side(table: dict[BlockKey, dict[int, int]], key: BlockKey, slot: int) -> None:
        per_key = table.get(key)
        if per_key is not None and per_key.pop(slot, None) is not None and not per_key:
            del table[key]

    # ------------------------------------------------------------------ tree links

    def _link_new(self, key: BlockKey, node: _Node) -> None:
        if node.parent is not None:
            self._attach(key, node.parent)
        if self._orphans:
            adopted = self._orphans.pop(key, None)
            if adopted is not None:
                node.children = adopted

    def _attach(self, key: BlockKey, parent: BlockKey) -> None:
        parent_node = self._nodes.get(parent)
        if parent_node is not None:
            parent_node.children = _add_child(parent_node.children, key)
        else:
            self._orphans[parent] = _add_child(self._orphans.get(parent), key)

    def _detach(self, key: BlockKey, parent: BlockKey) -> None:
        parent_node = self._nodes.get(parent)
        if parent_node is not None:
            parent_node.children = _remove_child(parent_node.children, key)
            return
        rest = _remove_child(self._orphans.get(parent), key)
        if rest is None:
            self._orphans.pop(parent, None)
        else:
            self._orphans[parent] = rest

    def _relink(self, key: BlockKey, node: _Node, parent: BlockKey) -> None:
        if node.parent is not None:
            self._detach(key, node.parent)
        node.parent = parent
        self._attach(key, parent)

    def _delete_node(self, key: BlockKey, node: _Node) -> None:
        if node.parent is not None:
            self._detach(key, node.parent)  # first: the parent may be this very node
        del self._nodes[key]
        self._hits.pop(key, None)
        if node.children is not None:
            self._orphans[key] = node.children

    # ------------------------------------------------------------------ workers

    def remove_worker(self, worker_id: str) -> int:
        """Drop every placement of `worker_id` and forget the worker; placements removed."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return 0
        removed = worker.num_placements
        nodes = self._nodes
        for key in list(worker.blocks):
            node = nodes[key]
            for tier in _TIERS:
                tbit = worker.tier_bits[tier]
                if node.tiers & tbit:
                    slot = tbit.bit_length() - 1
                    if key in self._copies:
                        self._drop_side(self._copies, key, slot)
                    self._drop_placement(worker, key, node, tbit)
        del self._by_idx[worker.idx]
        self._free_idx.append(worker.idx)
        self._addressed &= ~worker.bit
        self._legacy &= ~worker.bit
        return removed

    def worker_ids(self) -> list[str]:
        return sorted(self._workers)

    # ------------------------------------------------------------------ queries

    def match(self, hashes: Sequence[BlockKey], count_as_hit: bool) -> list[WorkerPlacements]:
        """MatchExternalKv: per worker (first-seen order; workers first seen on the same hash
        by worker id) its placements among the distinct hashes, ascending by tier."""
        nodes = self._nodes
        seen: set[BlockKey] = set()
        order: list[_Worker] = []
        rows: dict[int, dict[int, tuple[list[BlockKey], list[int], list[int]]]] = {}
        seen_workers = 0
        for key in hashes:
            if key in seen:
                continue
            seen.add(key)
            node = nodes.get(key)
            if node is None:
                continue
            if count_as_hit:
                self._hits[key] = self._hits.get(key, 0) + 1
            new = node.workers & ~seen_workers
            if new:
                seen_workers |= new
                order.extend(sorted((self._by_idx[i] for i in _bits(new)), key=lambda w: w.wid))
            masks = self._component_masks.get(key)
            for idx in _bits(node.workers):
                worker = self._by_idx[idx]
                per_tier = rows.setdefault(idx, {})
                for tier in _TIERS:
                    tbit = worker.tier_bits[tier]
                    if node.tiers & tbit:
                        row = per_tier.setdefault(tier, ([], [], []))
                        row[0].append(key)
                        row[1].append(masks.get(tbit.bit_length() - 1, 0) if masks else 0)
                        row[2].append(node.size)
        return [
            WorkerPlacements(
                worker.wid,
                worker.address,
                tuple(
                    TierPlacements(Tier(tier), tuple(r[0]), tuple(r[1]), tuple(r[2]))
                    for tier, r in sorted(rows[worker.idx].items())
                ),
            )
            for worker in order
        ]

    def hit_counts(self, hashes: Sequence[BlockKey]) -> list[tuple[BlockKey, int]]:
        """GetExternalKvHitCounts: distinct hashes, first-seen order, only those counted."""
        out: list[tuple[BlockKey, int]] = []
        seen: set[BlockKey] = set()
        for key in hashes:
            if key in seen:
                continue
            seen.add(key)
            count = self._hits.get(key)
            if count is not None:
                out.append((key, count))
        return out

    def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult:
        """MatchExternalKvPrefix (WIRE.md section 2). Ties in `matched_prefix_blocks` are
        ordered by worker id so every backend answers byte-identically."""
        limit = len(hashes) if max_blocks == 0 else min(len(hashes), max_blocks)
        if limit == 0:
            return PrefixResult((), 0, 0)
        nodes = self._nodes
        first = nodes.get(hashes[0])
        if first is None:
            return PrefixResult((), 0, 1)
        candidates = first.workers & self._addressed
        found: list[tuple[int, int]] = []  # (worker idx, matched blocks)
        blocks_read = 1
        legacy = candidates & self._legacy
        if legacy:
            blocks_read, poisoned = self._legacy_prefix(hashes, limit, legacy, found)
            if poisoned:
                found = [(idx, n) for idx, n in found if not poisoned >> idx & 1]
        for idx in _bits(candidates & ~self._legacy):
            matched, read = self._spec_prefix(self._by_idx[idx], hashes, limit)
            blocks_read = max(blocks_read, read)
            if matched:
                found.append((idx, matched))
        if not found:
            return PrefixResult((), 0, blocks_read)
        by_idx = self._by_idx
        ranked = sorted(
            (PrefixMatch(by_idx[idx].wid, by_idx[idx].address, n) for idx, n in found),
            key=lambda m: (-m.matched_prefix_blocks, m.worker_id),
        )
        return PrefixResult(tuple(ranked), ranked[0].matched_prefix_blocks, blocks_read)

    def _legacy_prefix(
        self, hashes: Sequence[BlockKey], limit: int, alive: int, found: list[tuple[int, int]]
    ) -> tuple[int, int]:
        """The legacy rule for every worker in `alive` at once: an AND of worker bits along
        the chain. Appends (idx, blocks) for prefixes > 0; returns (blocks read, bits of
        workers failed closed by a non-zero component mask)."""
        get = self._nodes.get
        component_masks = self._component_masks
        poisoned = 0
        i = 0
        while i < limit:
            key = hashes[i]
            node = get(key)
            held = alive & node.workers if node is not None else 0
            if held != alive:
                gone = alive ^ held
                if i:
                    found.extend((idx, i) for idx in _bits(gone))
                alive = held
                if not alive:
                    return i + 1, poisoned
            if component_masks and key in component_masks:
                poisoned |= self._holders_with_components(component_masks[key], alive)
            i += 1
        found.extend((idx, i) for idx in _bits(alive))
        return i, poisoned

    @staticmethod
    def _holders_with_components(masks: dict[int, int], alive: int) -> int:
        bits = 0
        for slot, mask in masks.items():
            idx = slot // _SLOTS_PER_WORKER
            if mask and alive >> idx & 1:
                bits |= 1 << idx
        return bits

    def _available(self, worker: _Worker, key: BlockKey, node: _Node, tiers: int, c: int) -> bool:
        """Component `c` resident on `node` at a tier in the (1 << Tier) mask `tiers`."""
        masks = self._component_masks.get(key)
        if masks is None:
            return False
        for tier in _TIERS:
            tbit = worker.tier_bits[tier]
            if tiers >> tier & 1 and node.tiers & tbit and masks.get(tbit.bit_length() - 1, 0) & c:
                return True
        return False

    def _spec_prefix(
        self, worker: _Worker, hashes: Sequence[BlockKey], limit: int
    ) -> tuple[int, int]:
        """The component rule for one worker with a cache spec: (prefix blocks, blocks read)."""
        spec = worker.spec
        assert spec is not None  # only called for spec workers
        if not spec_is_valid(spec):
            return 0, 1
        full_tiers = spec.full_tier_mask & SERVABLE_TIER_MASK
        swa_tiers = spec.swa_tier_mask & SERVABLE_TIER_MASK
        mamba_tiers = spec.mamba_tier_mask & SERVABLE_TIER_MASK
        has_swa = bool(spec.components & _SWA)
        has_mamba = bool(spec.components & _MAMBA)
        window = spec.swa_window_tokens
        best = 0
        run = 0
        head_unbroken = True
        for i in range(limit):
            key = hashes[i]
            node = self._nodes.get(key)
            if node is None or not node.workers & worker.bit:
                return best, i + 1
            if not self._available(worker, key, node, full_tiers, _FULL):
                return best, i + 1
            boundary_ok = True
            if has_swa:
                if self._available(worker, key, node, swa_tiers, _SWA):
                    run += node.size
                    boundary_ok = head_unbroken or run >= window
                else:
                    run = 0
                    head_unbroken = False
                    boundary_ok = False
            if has_mamba:
                boundary_ok = boundary_ok and self._available(
                    worker, key, node, mamba_tiers, _MAMBA
                )
            if boundary_ok:
                best = i + 1
        return best, limit

    def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        """kvplane's token-level view, for every worker holding hashes[0] on any tier (address
        or not, spec or not: component detail is ignored here): `matched_blocks` = leading
        blocks each held on HBM or DRAM; per tier, leading blocks held on that tier alone
        (listed when > 0). Tokens sum the blocks' known sizes. Sorted by matched_blocks
        descending, then worker id."""
        limit = len(hashes) if max_blocks == 0 else min(len(hashes), max_blocks)
        get = self._nodes.get
        first = get(hashes[0]) if limit else None
        if first is None:
            return []
        # Placement bits of every candidate, per tier and "servable" (mapped onto the HBM bit).
        hbm_bits = sum(w.tier_bits[1] for w in self._workers.values())
        alive_tiers = first.tiers
        alive_servable = (first.tiers | first.tiers >> 1) & hbm_bits
        ends: dict[int, int] = {}  # placement bit index -> contiguous blocks
        cum_tokens = [0]
        i = 0
        while i < limit and (alive_tiers or alive_servable):
            node = get(hashes[i])
            tiers = node.tiers if node is not None else 0
            servable = (tiers | tiers >> 1) & hbm_bits
            for gone_mask, bias in ((alive_tiers & ~tiers, 0), (alive_servable & ~servable, 1)):
                for b in _bits(gone_mask):
                    ends[b * 2 + bias] = i
            alive_tiers &= tiers
            alive_servable &= servable
            cum_tokens.append(cum_tokens[-1] + (node.size if node is not None else 0))
            i += 1
        for b in _bits(alive_tiers):
            ends[b * 2] = i
        for b in _bits(alive_servable):
            ends[b * 2 + 1] = i
        out: list[TokenPrefixMatch] = []
        for idx in _bits(first.workers):
            worker = self._by_idx[idx]
            base = idx * _SLOTS_PER_WORKER
            per_tier = tuple(
                TierPrefix(tier, n, cum_tokens[n])
                for tier in _TIERS
                if (n := ends.get((base + tier - 1) * 2, 0))
            )
            matched = ends.get(base * 2 + 1, 0)
            out.append(
                TokenPrefixMatch(worker.wid, worker.address, matched, cum_tokens[matched], per_tier)
            )
        out.sort(key=lambda m: (-m.matched_blocks, m.worker_id))
        return out

    # ------------------------------------------------------------------ views

    def placements(self, worker_id: str | None = None) -> Iterator[Placement]:
        """Every placement (or one worker's), by worker id then key then tier."""
        workers = sorted(self._workers.values(), key=lambda w: w.wid)
        for worker in workers:
            if worker_id is not None and worker.wid != worker_id:
                continue
            for key in sorted(worker.blocks):
                node = self._nodes[key]
                masks = self._component_masks.get(key, {})
                copies = self._copies.get(key, {})
                for tier in _TIERS:
                    tbit = worker.tier_bits[tier]
                    if node.tiers & tbit:
                        slot = tbit.bit_length() - 1
                        yield Placement(
                            worker.wid, tier, key, masks.get(slot, 0), copies.get(slot, 1)
                        )

    def block_size(self, key: BlockKey) -> int:
        """The block's known token count (0 when unknown or not indexed)."""
        node = self._nodes.get(key)
        return node.size if node is not None else 0

    def parent(self, key: BlockKey) -> BlockKey | None:
        node = self._nodes.get(key)
        return node.parent if node is not None else None

    def children(self, key: BlockKey) -> list[BlockKey]:
        node = self._nodes.get(key)
        return sorted(_iter_children(node.children)) if node is not None else []

    def subtree_blocks(self, key: BlockKey) -> int:
        """Indexed blocks in the subtree rooted at `key` (itself included)."""
        if key not in self._nodes:
            return 0
        seen: set[BlockKey] = set()
        stack = [key]
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(_iter_children(self._nodes[current].children))
        return len(seen)

    def worker_info(self, worker_id: str) -> tuple[str, CacheSpec | None] | None:
        """(address, cache spec) of a known worker, else None."""
        worker = self._workers.get(worker_id)
        return None if worker is None else (worker.address, worker.spec)

    def stats(self, backend: str = "memory") -> IndexStats:
        return IndexStats(
            backend=backend,
            num_blocks=len(self._nodes),
            num_placements=self._num_placements,
            workers=tuple(
                WorkerStats(w.wid, w.address, len(w.blocks), w.num_placements)
                for w in sorted(self._workers.values(), key=lambda w: w.wid)
            ),
        )

    @property
    def num_blocks(self) -> int:
        return len(self._nodes)

    @property
    def num_placements(self) -> int:
        return self._num_placements

    # ------------------------------------------------------------------ snapshot

    def parent_first_order(self) -> list[BlockKey]:
        """Every indexed key, each after its indexed parent (pre-order from the roots, so a
        chain's blocks are adjacent)."""
        nodes = self._nodes
        order: list[BlockKey] = []
        visited: set[BlockKey] = set()
        roots = [k for k, n in nodes.items() if n.parent is None or n.parent not in nodes]
        # A parent cycle (possible only with inconsistent reports) has no root: visit it last.
        for start in [*roots, *nodes]:
            if start in visited:
                continue
            stack = [start]
            while stack:
                key = stack.pop()
                if key in visited:
                    continue
                visited.add(key)
                order.append(key)
                children = nodes[key].children
                if isinstance(children, set):
                    stack.extend(sorted(children, reverse=True))
                elif children is not None:
                    stack.append(children)
        return order

    def snapshot(self, worker_id: str | None = None) -> Iterator[Batch]:
        """Batches that rebuild the index (or one worker) when applied to an empty index:
        per worker (by id), REPORT chains in parent-first order within the wire limits, then
        one REPORT(copies) per extra physical copy. Hit counters are not part of it."""
        rank = {key: i for i, key in enumerate(self.parent_first_order())}
        for worker in sorted(self._workers.values(), key=lambda w: w.wid):
            if worker_id is None or worker.wid == worker_id:
                yield from self._worker_snapshot(worker, rank)

    def _worker_snapshot(self, worker: _Worker, rank: dict[BlockKey, int]) -> Iterator[Batch]:
        actions: list[Action] = []
        extra_copies: list[Action] = []
        for tier in _TIERS:
            tbit = worker.tier_bits[tier]
            slot = tbit.bit_length() - 1
            keys = sorted(
                (k for k in worker.blocks if self._nodes[k].tiers & tbit), key=rank.__getitem__
            )
            chain: list[BlockKey] = []
            for key in keys:
                node = self._nodes[key]
                if chain and (node.parent != chain[-1] or len(chain) >= MAX_HASHES_PER_REQUEST):
                    actions.append(self._report_action(tier, slot, chain))
                    chain = []
                chain.append(key)
                count = self._copies.get(key, {}).get(slot, 1)
                if count > 1:  # a REPORT is a replace: each copy restates the mask
                    mask = self._component_masks.get(key, {}).get(slot, 0)
                    copy = Action(ActionType.REPORT, tier, (key,), (mask,), copies=True)
                    extra_copies.extend([copy] * (count - 1))
            if chain:
                actions.append(self._report_action(tier, slot, chain))
        actions.extend(extra_copies)
        yield from _chunk_batch(worker.wid, worker.address, worker.spec, actions)

    def _report_action(self, tier: Tier, slot: int, chain: list[BlockKey]) -> Action:
        masks = tuple(self._component_masks.get(k, {}).get(slot, 0) for k in chain)
        sizes = tuple(self._nodes[k].size for k in chain)
        return Action(
            ActionType.REPORT,
            tier,
            tuple(chain),
            component_masks=masks if any(masks) else (),
            block_sizes=sizes if any(sizes) else (),
            parent=self._nodes[chain[0]].parent,
        )


def _chunk_batch(
    wid: str, address: str, spec: CacheSpec | None, actions: list[Action]
) -> Iterator[Batch]:
    """Split `actions` into wire-valid batches (<= 256 actions, <= 16,384 hashes); a worker
    without placements still gets one empty batch carrying its address and spec."""
    chunk: list[Action] = []
    num_hashes = 0
    for action in actions:
        n = len(action.hashes)
        if chunk and (
            len(chunk) >= MAX_ACTIONS_PER_BATCH or num_hashes + n > MAX_HASHES_PER_REQUEST
        ):
            yield Batch(wid, tuple(chunk), address, cache_spec=spec)
            chunk, num_hashes = [], 0
        chunk.append(action)
        num_hashes += n
    if chunk or not actions:
        yield Batch(wid, tuple(chunk), address, cache_spec=spec)
