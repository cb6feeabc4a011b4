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

Layout, chosen for speed and memory (about 90 bytes per indexed (worker, block) placement):
workers are interned to small integers `w`; each block is one entry of a key -> int dict whose
bit `3w + tier - 1` marks a placement, so a prefix match for every legacy worker at once reads
those integers along the chain and visits only where they change (see `_legacy_prefix`). Rare
data lives in sparse side tables keyed by block key: non-zero component masks, copy counts
above one, hit counters, known token counts (interned, up to MAX_INTERNED_SIZES distinct
ones). Each worker keeps a log of its REPORTs' hash tuples with their parents (CLEAR and
removal touch only its own keys), compacted when it outgrows twice the worker's blocks plus
`_LOG_SLACK` (and by CLEAR and snapshots).

Tree: the parent links are not stored per block (a second per-block table would cost as much
as the index itself on every store); they are the chain order of the REPORTs in the workers'
logs. Each worker's statement of a block's parent is the latest of its REPORTs of the block
that stated one (inside a REPORT a block's parent is the block before it; a REPORT without a
parent never erases a known one, and a worker's statements go with the block when it loses
it). `parent(key)` is the statement of a worker holding the block; where holders disagree,
which only inconsistent reports can cause since a chained key determines its parent, the
smallest worker id's. Parents, children, subtrees and the parent-first order are views
derived on demand (O(blocks)). A block whose last placement goes is forgotten with its token
count and hit counter.
Removed workers are dropped from every answer at once and purged from the blocks lazily.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, groupby, islice, repeat
from operator import and_, attrgetter

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
from indexer.component_rule import (
    ROUTABLE_TIER_MASK,
    SERVABLE_TIER_MASK,
    resident_components,
    spec_is_valid,
    spec_prefix_blocks,
)
from indexer.validation import (
    MAX_ACTIONS_PER_BATCH,
    MAX_HASHES_PER_REQUEST,
    IndexRequestError,
    ValidationKind,
    validate_action_type,
    validate_batch,
    validate_match,
    validate_prefix_match,
    validate_tier,
)

# The validation rules live in indexer.validation; they are re-exported here, next to the
# semantics they guard, for the adapters that import them from the index.
__all__ = [
    "MAX_ACTIONS_PER_BATCH",
    "MAX_HASHES_PER_REQUEST",
    "PURGE_STEP_BLOCKS",
    "SERVABLE_TIER_MASK",
    "IndexRequestError",
    "Placement",
    "PrefixIndex",
    "ValidationKind",
    "spec_is_valid",
    "validate_action_type",
    "validate_batch",
    "validate_match",
    "validate_prefix_match",
    "validate_tier",
]

_TIERS = (Tier.HBM, Tier.DRAM, Tier.SSD)
_SLOTS_PER_WORKER = 3  # one placement bit per tier
# Removed workers' bits purged per apply call (the rest waits for later calls or `purge`).
PURGE_STEP_BLOCKS = 1024
# Runs of placement values that stop no worker before a prefix scan switches to a running AND
# (see `PrefixIndex._legacy_prefix`).
_QUIET_RUN_LIMIT = 16
# Stale entries a worker's key log may hold beyond twice its live blocks before compaction.
_LOG_SLACK = 4096
# Distinct block token counts interned (one int object shared by every block of that count):
# an engine reports a handful (its block size, partial last blocks), so beyond this many a
# source sends nonsense, and later new counts are stored as they come, not kept for good.
MAX_INTERNED_SIZES = 4096
# Component bits as plain ints (IntFlag arithmetic is slow on the hot path).
_FULL, _SWA, _MAMBA = int(Component.FULL), int(Component.SWA), int(Component.MAMBA)


_REPORT, _REVOKE = int(ActionType.REPORT), int(ActionType.REVOKE)
_HBM, _SSD = int(Tier.HBM), int(Tier.SSD)


_BY_WORKER_ID = attrgetter("worker_id")
_BY_WID = attrgetter("wid")
_BY_MATCHED_BLOCKS = attrgetter("matched_prefix_blocks")


@dataclass(frozen=True, slots=True)
class Placement:
    """One (worker, tier, block) placement, for dumps, tests and admin views."""

    worker_id: str
    tier: Tier
    key: BlockKey
    component_mask: int
    copies: int


class _Keep(enum.Enum):
    """A log entry's parent when its REPORT stated none for a block the worker already held:
    the block keeps the parent stated before. (None: no parent known, for a block new to the
    worker, so a statement from before it last lost the block does not come back.)"""

    KEEP = "keep"


_KEEP = _Keep.KEEP
# One entry of a worker's log: (parent of keys[0], keys in chain order).
_Run = tuple[BlockKey | _Keep | None, Sequence[BlockKey]]


class _Worker:
    __slots__ = (
        "address",
        "all_bits",
        "bit",
        "idx",
        "log",
        "log_len",
        "num_blocks",
        "num_placements",
        "prefix_matches",
        "purge_keys",
        "spec",
        "tier_bits",
        "wid",
    )

    def __init__(self, wid: str, idx: int) -> None:
        self.wid = wid
        self.idx = idx
        base = _SLOTS_PER_WORKER * idx
        self.bit = 1 << base  # the worker's HBM slot: its bit in "any tier" masks
        # tier_bits[t] is the placement bit for Tier t (index 0 unused).
        self.tier_bits = (0, 1 << base, 1 << (base + 1), 1 << (base + 2))
        self.all_bits = 7 << base
        self.address = ""
        self.spec: CacheSpec | None = None
        # Its REPORTs in order, as (parent, the REPORT's own hash tuple): appending one is O(1)
        # where a set would take one insert per block, and the chain order in each entry is
        # the parent links, kept for nothing more. Stale and repeated entries are filtered by
        # the placement bits and compacted away when the log outgrows twice the live blocks.
        self.log: list[_Run] = []
        self.log_len = 0
        self.num_blocks = 0  # keys it holds on at least one tier
        self.purge_keys: Iterator[BlockKey] = iter(())  # after removal: what is left to purge
        # Immutable PrefixMatch answers by matched blocks, reused while the address holds.
        self.prefix_matches: dict[int, PrefixMatch] = {}
        self.num_placements = 0


def _bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _stop(ended: dict[int, int], slots: int, position: int) -> None:
    """Record that the workers whose HBM-slot bits are in `slots` hold `position` blocks."""
    if slots & (slots - 1):
        for slot in _bits(slots):
            ended[slot] = position
    else:  # one worker (the usual case): no generator
        ended[slots.bit_length() - 1] = position


def _any_tier(tiers: int) -> int:
    """Placement bits folded onto each worker's HBM slot: "holds it on some tier"."""
    return tiers | tiers >> 1 | tiers >> 2


def _stated_parents(log: list[_Run]) -> dict[BlockKey, BlockKey | None]:
    """Every key of a log -> the parent the latest entry gave it (None: unknown), in order of
    first appearance."""
    stated: dict[BlockKey, BlockKey | None] = {}
    for parent, keys in log:
        if parent is _KEEP:
            stated.setdefault(keys[0], None)
        else:
            stated[keys[0]] = parent
        if len(keys) > 1:
            stated.update(zip(keys[1:], keys, strict=False))  # (child, parent) pairs
    return stated


def _runs(stated: dict[BlockKey, BlockKey | None]) -> list[_Run]:
    """Log entries that state these parents: chains, each key appended to the run that ends
    with its parent (so chains stored a block at a time, interleaved with other requests'
    chains, still compact into one entry each)."""
    heads: list[BlockKey | None] = []
    chains: list[list[BlockKey]] = []
    open_runs: dict[BlockKey, list[BlockKey]] = {}  # last key of a run -> the run
    for key, parent in stated.items():
        run = open_runs.pop(parent, None) if parent is not None else None
        if run is None:
            run = [key]
            heads.append(parent)
            chains.append(run)
        else:
            run.append(key)
        open_runs[key] = run
    return [(head, tuple(run)) for head, run in zip(heads, chains, strict=True)]


class PrefixIndex:
    """The index. Not thread-safe: one owner (a backend) serialises calls."""

    def __init__(self, purge_step_blocks: int = PURGE_STEP_BLOCKS) -> None:
        self._purge_step_blocks = purge_step_blocks
        # key -> placement bits (bit 3w + tier - 1 per placement): the only per-block record.
        self._tiers: dict[BlockKey, int] = {}
        self._sizes: dict[BlockKey, int] = {}  # blocks with a known token count
        # Sparse side tables: block key -> {placement slot: value}.
        self._component_masks: dict[BlockKey, dict[int, int]] = {}
        self._copies: dict[BlockKey, dict[int, int]] = {}  # only counts >= 2
        self._hits: dict[BlockKey, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._by_idx: dict[int, _Worker] = {}
        self._free_idx: list[int] = []  # slots of fully purged removed workers
        self._next_idx = 0
        self._addressed = 0  # HBM-slot bits of workers with a non-empty address
        self._legacy = 0  # HBM-slot bits of workers without a cache spec
        self._hbm_slots = 0  # HBM-slot bits of every live worker
        # HBM-slot bits of workers that ever reported a DRAM or SSD placement (never cleared
        # while the worker lives): only they need the per-tier walk in prefix scans.
        self._lower_tier_slots = 0
        # HBM-slot bits of workers that ever reported an SSD placement (never cleared while the
        # worker lives): only they can hold a prefix past their servable run (`any_tier_blocks`).
        self._disk_slots = 0
        # Removed workers whose bits are still in `_tiers`, purged a slice per apply.
        self._dead = 0
        self._pending: list[_Worker] = []
        self._num_placements = 0
        self._size_values: dict[int, int] = {}  # interned token counts (MAX_INTERNED_SIZES)

    # ------------------------------------------------------------------ apply

    def apply(self, batch: Batch) -> None:
        """Apply one batch, in order, atomically (validated first; raises IndexRequestError)."""
        validate_batch(batch)
        if self._pending:
            self.purge(self._purge_step_blocks)
        worker_id, actions, address, _seq, spec, _under_lease = batch
        worker = self._workers.get(worker_id) or self._worker(worker_id)
        if address != worker.address or spec is not worker.spec:
            self._set_worker_info(worker, address, spec)
        for action in actions:
            kind = action.type
            if kind == _REPORT:
                if action.copies:
                    self._report_copies(worker, action)
                else:
                    self._report(worker, action)
            elif kind == _REVOKE:
                self._revoke(worker, action)
            else:
                self._clear_tier(worker, Tier(action.tier))
        if worker.log_len > 2 * worker.num_blocks + _LOG_SLACK:
            self._worker_keys(worker)

    def _worker(self, wid: str) -> _Worker:
        worker = self._workers.get(wid)
        if worker is None:
            if self._free_idx:
                idx = self._free_idx.pop()
            else:
                idx = self._next_idx
                self._next_idx += 1
            worker = _Worker(wid, idx)
            self._workers[wid] = worker
            self._by_idx[idx] = worker
            self._legacy |= worker.bit
            self._hbm_slots |= worker.bit
        return worker

    def _set_worker_info(self, worker: _Worker, address: str, spec: CacheSpec | None) -> None:
        if address == worker.address and spec is worker.spec:
            return
        if address != worker.address:
            worker.prefix_matches.clear()
        worker.address = address
        worker.spec = spec
        bit = worker.bit
        self._addressed = self._addressed | bit if address else self._addressed & ~bit
        self._legacy = self._legacy | bit if spec is None else self._legacy & ~bit

    def _report(self, worker: _Worker, action: Action) -> None:
        """REPORT without copy counting (`action.copies` is not read): set each placement
        (a replace)."""
        _kind, tier, hashes, masks, sizes, parent, _copies = action
        tiers = self._tiers
        tbit = worker.tier_bits[tier]
        if tier != _HBM:
            self._lower_tier_slots |= worker.bit
            if tier == _SSD:
                self._disk_slots |= worker.bit
        n = len(hashes)
        if (hashes[0] not in tiers) if n == 1 else tiers.keys().isdisjoint(hashes):
            # Every block is new (the common cases: a fresh chain, one block extending a
            # chain): bulk inserts at C speed, no per-block Python work.
            if n == 1:
                tiers[hashes[0]] = tbit
                num_new = 1
            else:
                before = len(tiers)
                tiers.update(zip(hashes, repeat(tbit)))
                num_new = len(tiers) - before  # duplicates within `hashes` count once
            worker.log.append((parent, hashes if isinstance(hashes, tuple) else tuple(hashes)))
            worker.log_len += n
            worker.num_blocks += num_new
            worker.num_placements += num_new
            self._num_placements += num_new
            if masks or sizes or self._component_masks:
                self._set_details(hashes, masks, sizes, tbit.bit_length() - 1)
            return
        get = tiers.get
        wbits = worker.all_bits
        dead = self._dead
        # No parent stated for a first block the worker holds already: it keeps its parent.
        head = parent if parent is not None or not get(hashes[0], 0) & wbits else _KEEP
        num_added = 0  # blocks new to the worker (on any tier)
        num_new = 0  # new placements
        for key in hashes:
            t = get(key)
            if t is not None and t & dead:
                t = self._strip_dead(key, t)
            if t is None:
                tiers[key] = tbit
                num_added += 1
                num_new += 1
            elif not t & tbit:
                tiers[key] = t | tbit
                if not t & wbits:
                    num_added += 1
                num_new += 1
        # The whole REPORT is logged: it restates the parents of blocks the worker held.
        worker.log.append((head, hashes if isinstance(hashes, tuple) else tuple(hashes)))
        worker.log_len += n
        worker.num_blocks += num_added
        worker.num_placements += num_new
        self._num_placements += num_new
        if masks or sizes or self._component_masks:
            self._set_details(hashes, masks, sizes, tbit.bit_length() - 1)

    def _report_copies(self, worker: _Worker, action: Action) -> None:
        """REPORT of new physical copies: a new placement has one copy, an existing one
        gains one (its mask and size are restated like a plain REPORT)."""
        slot = worker.tier_bits[action.tier].bit_length() - 1
        existing: list[bool] = []
        seen: set[BlockKey] = set()
        for key in action.hashes:
            t = self._tiers.get(key)
            if t is not None and t & self._dead:
                t = self._strip_dead(key, t)
            existing.append(key in seen or (t is not None and bool(t >> slot & 1)))
            seen.add(key)
        self._report(worker, action)  # counted as new copies below
        for key, had in zip(action.hashes, existing, strict=True):
            if had:
                per_key = self._copies.setdefault(key, {})
                per_key[slot] = per_key.get(slot, 1) + 1

    def _set_details(
        self, hashes: Sequence[BlockKey], masks: Sequence[int], sizes: Sequence[int], slot: int
    ) -> None:
        """The REPORT's component masks (a replace: absent = 0) and known token counts."""
        table = self._component_masks
        if masks:
            for key, mask in zip(hashes, masks, strict=True):
                if mask:
                    table.setdefault(key, {})[slot] = mask
                elif key in table:
                    self._drop_side(table, key, slot)
        elif table:
            for key in hashes:
                if key in table:
                    self._drop_side(table, key, slot)
        if sizes:
            known = self._sizes
            interned = self._size_values
            # Chosen once per REPORT, not per block: the table outgrows the bound by at most
            # one REPORT's counts.
            share = interned.setdefault if len(interned) < MAX_INTERNED_SIZES else interned.get
            for key, size in zip(hashes, sizes, strict=True):
                if size:
                    known[key] = share(size, size)

    def _revoke(self, worker: _Worker, action: Action) -> None:
        get = self._tiers.get
        tbit = worker.tier_bits[action.tier]
        slot = tbit.bit_length() - 1
        for key in action.hashes:
            t = get(key)
            if t is None or not t & tbit:
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
            self._drop_placement(worker, key, t, tbit)

    def _clear_tier(self, worker: _Worker, tier: Tier) -> None:
        tbit = worker.tier_bits[tier]
        slot = tbit.bit_length() - 1
        tiers = self._tiers
        for key in [k for k in self._worker_keys(worker) if tiers[k] & tbit]:
            if key in self._copies:
                self._drop_side(self._copies, key, slot)
            self._drop_placement(worker, key, tiers[key], tbit)

    def _drop_placement(self, worker: _Worker, key: BlockKey, t: int, tbit: int) -> None:
        """Remove one placement (its copy count already settled by the caller)."""
        t ^= tbit
        worker.num_placements -= 1
        self._num_placements -= 1
        if not t & worker.all_bits:
            worker.num_blocks -= 1
        if t & ~self._dead:
            self._tiers[key] = t
            if key in self._component_masks:
                self._drop_side(self._component_masks, key, tbit.bit_length() - 1)
        else:  # no live placement left: the block leaves (dead bits go with it)
            self._delete_block(key)

    def _delete_block(self, key: BlockKey) -> None:
        del self._tiers[key]
        self._sizes.pop(key, None)
        self._hits.pop(key, None)
        self._component_masks.pop(key, None)
        self._copies.pop(key, None)

    def _strip_dead(self, key: BlockKey, t: int) -> int | None:
        """Drop removed workers' bits from one block; None when nothing live is left."""
        dead = t & self._dead
        for table in (self._component_masks, self._copies):
            per_key = table.get(key)
            if per_key is not None:
                for slot in [s for s in per_key if dead >> s & 1]:
                    self._drop_side(table, key, slot)
        t ^= dead
        if t:
            self._tiers[key] = t
            return t
        self._delete_block(key)
        return None

    @staticmethod
    def _drop_side(table: dict[BlockKey, dict[int, int]], key: BlockKey, slot: int) -> None:
        per_key = table.get(key)
        if per_key is not None and per_key.pop(slot, None) is not None and not per_key:
            del table[key]

    def _worker_keys(self, worker: _Worker) -> list[BlockKey]:
        """The keys `worker` holds now, in log order (compacting its log)."""
        return list(self._held_parents(worker))

    def _held_parents(self, worker: _Worker) -> dict[BlockKey, BlockKey | None]:
        """The keys `worker` holds now, in log order, with the parent it stated for each
        (None: unknown); compacts its log as a side effect, into chain runs that keep them."""
        get = self._tiers.get
        bits = worker.all_bits
        held = {k: p for k, p in _stated_parents(worker.log).items() if get(k, 0) & bits}
        worker.log = _runs(held)
        worker.log_len = len(held)
        return held

    # ------------------------------------------------------------------ workers

    def remove_worker(self, worker_id: str) -> int:
        """Drop every placement of `worker_id` and forget the worker; placements removed.

        O(1) for the caller: the worker vanishes from every answer at once, and its bits are
        purged from the blocks later, a slice per `apply` (`purge`), or at once before any
        whole-index view (stats, placements, snapshot)."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return 0
        removed = worker.num_placements
        self._num_placements -= removed
        self._dead |= worker.all_bits
        worker.purge_keys = chain.from_iterable(keys for _parent, keys in worker.log)
        self._pending.append(worker)
        del self._by_idx[worker.idx]
        self._addressed &= ~worker.bit
        self._legacy &= ~worker.bit
        self._hbm_slots &= ~worker.bit
        self._lower_tier_slots &= ~worker.bit
        self._disk_slots &= ~worker.bit
        return removed

    def purge(self, max_blocks: int | None = None) -> bool:
        """Purge removed workers' bits from up to `max_blocks` blocks (all when None);
        True when nothing is left to purge. Their worker slots are reused afterwards."""
        budget = max_blocks
        while self._pending:
            worker = self._pending[0]
            keys = worker.purge_keys
            if budget is None:
                for key in keys:
                    self._purge_key(key, worker)
            else:
                done = 0
                for key in islice(keys, budget):
                    self._purge_key(key, worker)
                    done += 1
                budget -= done
                if budget <= 0:
                    # One key past the budget tells whether this worker is finished.
                    extra = next(keys, None)
                    if extra is not None:
                        self._purge_key(extra, worker)
                        return False
                    self._finish_purge(worker)
                    return not self._pending
            self._finish_purge(worker)
        return True

    def _purge_key(self, key: BlockKey, worker: _Worker) -> None:
        t = self._tiers.get(key)
        if t is not None and t & worker.all_bits:
            self._strip_worker(key, t, worker)

    def _finish_purge(self, worker: _Worker) -> None:
        self._pending.remove(worker)
        self._dead &= ~worker.all_bits
        self._free_idx.append(worker.idx)

    def _strip_worker(self, key: BlockKey, t: int, worker: _Worker) -> None:
        for table in (self._component_masks, self._copies):
            if key in table:
                for tier in _TIERS:
                    self._drop_side(table, key, worker.tier_bits[tier].bit_length() - 1)
        t &= ~worker.all_bits
        if t:
            self._tiers[key] = t
        else:
            self._delete_block(key)

    def worker_ids(self) -> list[str]:
        return sorted(self._workers)

    # ------------------------------------------------------------------ queries

    def match(self, hashes: Sequence[BlockKey], count_as_hit: bool) -> list[WorkerPlacements]:
        """MatchExternalKv: per worker (first-seen order; workers first seen on the same hash
        by worker id) its placements among the distinct hashes, ascending by tier."""
        get = self._tiers.get
        live = ~self._dead
        seen: set[BlockKey] = set()
        order: list[_Worker] = []
        rows: dict[int, dict[int, tuple[list[BlockKey], list[int], list[int]]]] = {}
        seen_workers = 0
        for key in hashes:
            if key in seen:
                continue
            seen.add(key)
            t = get(key)
            if t is None or not t & live:
                continue
            t &= live
            if count_as_hit:
                self._hits[key] = self._hits.get(key, 0) + 1
            holders = _any_tier(t) & self._hbm_slots
            new = holders & ~seen_workers
            if new:
                seen_workers |= new
                fresh = [self._by_idx[b // _SLOTS_PER_WORKER] for b in _bits(new)]
                order.extend(sorted(fresh, key=lambda w: w.wid))
            masks = self._component_masks.get(key)
            size = self._sizes.get(key, 0)
            for slot in _bits(t):
                idx, tier = divmod(slot, _SLOTS_PER_WORKER)
                row = rows.setdefault(idx, {}).setdefault(tier + 1, ([], [], []))
                row[0].append(key)
                row[1].append(masks.get(slot, 0) if masks else 0)
                row[2].append(size)
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
        live = ~self._dead
        for key in hashes:
            if key in seen:
                continue
            seen.add(key)
            count = self._hits.get(key)
            if count is not None and self._tiers[key] & live:
                out.append((key, count))
        return out

    def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult:
        """MatchExternalKvPrefix (WIRE.md section 2). Ties in `matched_prefix_blocks` are
        ordered by worker id so every backend answers byte-identically."""
        limit = len(hashes) if max_blocks == 0 else min(len(hashes), max_blocks)
        if limit == 0:
            return PrefixResult((), 0, 0)
        first = self._tiers.get(hashes[0])
        if first is None:
            return PrefixResult((), 0, 1)
        # Workers holding the first block on some tier; dead workers are never addressed.
        candidates = (first | first >> 1 | first >> 2) & self._addressed
        found: dict[int, int] = {}  # HBM slot of the worker -> matched blocks
        blocks_read = 1
        legacy = candidates & self._legacy
        if legacy:
            found, blocks_read = self._legacy_prefix(hashes, limit, legacy)
        with_spec = candidates & ~self._legacy
        for slot in _bits(with_spec) if with_spec else ():
            worker = self._by_idx[slot // _SLOTS_PER_WORKER]
            matched, read = self._spec_prefix(worker, hashes, limit)
            blocks_read = max(blocks_read, read)
            if matched:
                found[slot] = matched
        if not found:
            return PrefixResult((), 0, blocks_read)
        by_idx = self._by_idx
        ranked = []
        for slot, n in found.items():
            worker = by_idx[slot // _SLOTS_PER_WORKER]
            match = worker.prefix_matches.get(n)
            if match is None:
                match = worker.prefix_matches[n] = PrefixMatch(worker.wid, worker.address, n)
            ranked.append(match)
        if len(ranked) > 1:  # two stable C-keyed sorts: blocks descending, then worker id
            ranked.sort(key=_BY_WORKER_ID)
            ranked.sort(key=_BY_MATCHED_BLOCKS, reverse=True)
        return PrefixResult(tuple(ranked), ranked[0].matched_prefix_blocks, blocks_read)

    def _legacy_prefix(
        self, hashes: Sequence[BlockKey], limit: int, alive: int
    ) -> tuple[dict[int, int], int]:
        """The legacy rule for every worker in `alive` (HBM-slot bits) at once: returns
        ({HBM slot: prefix blocks} for prefixes > 0, blocks read). Workers failed closed by a
        non-zero component mask on any block of the window (past their first gap too) are
        left out.

        Fast path at C speed: the blocks' placement bits are read (`map`) and grouped into runs
        of equal values (`groupby`) in C; along a chain there are few runs (the holders change
        only where one stops), so only each run is visited, in order: the workers its value
        lacks stop at its start, and the scan ends with the last of them. A worker that stops
        is then followed block by block over any tier (DRAM, SSD) from where it left HBM."""
        get = self._tiers.get
        ended: dict[int, int] = {}  # HBM slot -> leading blocks held on HBM
        survivors = alive
        position = 0
        quiet_runs = 0  # runs that stopped nobody
        window = hashes if limit == len(hashes) else hashes[:limit]
        # Lazily, so the scan stops where the last worker does. None: not indexed.
        for value, run in groupby(map(get, window)):  # runs of equal values, in order
            lost = survivors & ~value if value is not None else survivors
            if lost:
                if lost & (lost - 1):
                    _stop(ended, lost, position)
                else:  # one worker (the usual case): no call
                    ended[lost.bit_length() - 1] = position
                survivors ^= lost
                if not survivors:
                    break
            else:
                quiet_runs += 1
                if quiet_runs > _QUIET_RUN_LIMIT:
                    break
            position += len(list(run))
        if survivors and quiet_runs > _QUIET_RUN_LIMIT:
            # Values fragmented by bits the scan ignores (other tiers, other workers): from
            # here a running AND, whose runs are one per stop, costs less than one per change.
            position -= 1  # the AND's first value is `survivors`, before any block
            running = accumulate(
                map(get, islice(window, position + 1, None), repeat(0)), and_, initial=survivors
            )
            for value, run in groupby(running):
                lost = survivors & ~value
                if lost:
                    _stop(ended, lost, position)
                    survivors = value
                    if not survivors:
                        break
                position += len(list(run))
        if survivors:
            for slot in _bits(survivors):
                ended[slot] = limit
        if alive & self._lower_tier_slots:
            for slot, hbm_run in ended.items():
                held = hbm_run
                if held < limit and self._lower_tier_slots >> slot & 1:  # DRAM/SSD beyond HBM?
                    bits = 7 << slot
                    while held < limit and get(hashes[held], 0) & bits:
                        held += 1
                    ended[slot] = held
        blocks_read = min(limit, max(ended.values()) + 1)
        component_masks = self._component_masks
        if component_masks:
            # Component data on any block of the window fails the worker closed, past its
            # first gap too (SGLang's indexer scans a legacy worker to the end of the window).
            for key in component_masks.keys() & set(islice(hashes, limit)):
                for slot, mask in component_masks[key].items():
                    hbm_slot = slot - slot % _SLOTS_PER_WORKER
                    if mask and hbm_slot in ended:
                        ended[hbm_slot] = 0
            ended = {slot: n for slot, n in ended.items() if n}
        return ended, blocks_read

    def _spec_prefix(
        self,
        worker: _Worker,
        hashes: Sequence[BlockKey],
        limit: int,
        tiers: int = SERVABLE_TIER_MASK,
    ) -> tuple[int, int]:
        """The component rule for one worker with a cache spec: (prefix blocks, blocks read);
        `tiers`: the tiers a component may be resident at (the seed's servable set)."""
        spec = worker.spec
        if spec is None or not spec_is_valid(spec):
            return 0, 1
        blocks_read = 0
        get = self._tiers.get
        component_masks = self._component_masks
        sizes = self._sizes
        tier_bits = [(tier, worker.tier_bits[tier]) for tier in _TIERS]

        def blocks() -> Iterator[tuple[int, int]]:
            """(resident components, tokens) per query block, read only as far as the rule
            goes; a block without component data for the worker has none."""
            nonlocal blocks_read
            for key in islice(hashes, limit):
                blocks_read += 1
                t = get(key, 0)
                masks = component_masks.get(key) if t else None
                if masks is None:
                    yield 0, 0
                    continue
                placements = [
                    (tier, masks.get(bit.bit_length() - 1, 0)) for tier, bit in tier_bits if t & bit
                ]
                yield resident_components(spec, placements, tiers), sizes.get(key, 0)

        best = spec_prefix_blocks(spec, blocks())
        return best, max(blocks_read, 1)

    def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        """kvplane's token-level view, for every worker holding hashes[0] on any tier (address
        or not): `matched_blocks` = leading blocks each held on HBM or DRAM; per tier, leading
        blocks held on that tier alone (listed when > 0); `any_tier_blocks` = leading blocks
        each held on some tier, SSD included (so at least `matched_blocks`). Each is capped
        at the worker's MatchExternalKvPrefix answer (the component rule with a cache spec;
        without one the legacy rule, 0 when it fails closed on component data), so no hit is
        ever larger than the seed's rules give; `any_tier_blocks` at that rule's answer with
        SSD counted as a tier components may be resident at (`ROUTABLE_TIER_MASK`; the legacy
        rule counts SSD already). Tokens sum the blocks' known sizes. Sorted by
        matched_blocks descending, then worker id.

        The disk walk runs only for workers that ever reported an SSD placement, from where
        their servable run ends: with no SSD in the index it costs one test."""
        limit = len(hashes) if max_blocks == 0 else min(len(hashes), max_blocks)
        get = self._tiers.get
        first = get(hashes[0]) if limit else None
        if first is None or not first & ~self._dead:
            return []
        hbm_slots = self._hbm_slots
        alive_tiers = first & ~self._dead  # per placement bit: contiguous on that tier
        alive_servable = (first | first >> 1) & hbm_slots  # per worker: on HBM or DRAM
        ends: dict[int, int] = {}  # 2 * bit (+1 for servable) -> contiguous blocks
        cum_tokens = [0]
        sizes = self._sizes
        i = 0
        while i < limit and (alive_tiers or alive_servable):
            key = hashes[i]
            t = get(key, 0)
            servable = (t | t >> 1) & hbm_slots
            for b in _bits(alive_tiers & ~t):
                ends[2 * b] = i
            for b in _bits(alive_servable & ~servable):
                ends[2 * b + 1] = i
            alive_tiers &= t
            alive_servable &= servable
            cum_tokens.append(cum_tokens[-1] + sizes.get(key, 0))
            i += 1
        for b in _bits(alive_tiers):
            ends[2 * b] = i
        for b in _bits(alive_servable):
            ends[2 * b + 1] = i
        holders = _any_tier(first) & hbm_slots
        # Per worker that ever reported SSD: its run on any tier, from its servable run on.
        any_ends: dict[int, int] = {}
        on_disk = holders & self._disk_slots
        if on_disk:
            for slot in _bits(on_disk):
                held, bits = ends.get(2 * slot + 1, 0), 7 << slot
                while held < limit and get(hashes[held], 0) & bits:
                    held += 1
                any_ends[slot] = held
            for n in range(len(cum_tokens), max(any_ends.values()) + 1):
                cum_tokens.append(cum_tokens[-1] + sizes.get(hashes[n - 1], 0))
        # The legacy rule's answers, only where it can fail closed (component data in the
        # index); otherwise a legacy worker's answer is its any-tier run, never below these.
        legacy = holders & self._legacy
        legacy_prefix = (
            self._legacy_prefix(hashes, limit, legacy)[0]
            if legacy and self._component_masks
            else None
        )
        out: list[TokenPrefixMatch] = []
        for slot in _bits(holders):
            worker = self._by_idx[slot // _SLOTS_PER_WORKER]
            # A worker reuses no more than MatchExternalKvPrefix's rule gives it: the component
            # rule with a cache spec, the legacy rule (which fails closed) without one.
            if worker.spec is not None:
                most = self._spec_prefix(worker, hashes, limit)[0]
            else:
                most = limit if legacy_prefix is None else legacy_prefix.get(slot, 0)
            per_tier = tuple(
                TierPrefix(tier, n, cum_tokens[n])
                for tier in _TIERS
                if (n := min(ends.get(2 * (slot + tier - 1), 0), most))
            )
            matched = min(ends.get(2 * slot + 1, 0), most)
            any_tier = matched
            if slot in any_ends:
                if worker.spec is not None:
                    most = self._spec_prefix(worker, hashes, limit, ROUTABLE_TIER_MASK)[0]
                any_tier = max(min(any_ends[slot], most), matched)
            out.append(
                TokenPrefixMatch(
                    worker.wid,
                    worker.address,
                    matched,
                    cum_tokens[matched],
                    per_tier,
                    any_tier,
                    cum_tokens[any_tier],
                )
            )
        out.sort(key=lambda m: (-m.matched_blocks, m.worker_id))
        return out

    # ------------------------------------------------------------------ views

    def placements(self, worker_id: str | None = None) -> Iterator[Placement]:
        """Every placement (or one worker's), by worker id then key then tier."""
        self.purge()
        for worker in sorted(self._workers.values(), key=lambda w: w.wid):
            if worker_id is not None and worker.wid != worker_id:
                continue
            for key in sorted(self._worker_keys(worker)):
                t = self._tiers[key]
                masks = self._component_masks.get(key, {})
                copies = self._copies.get(key, {})
                for tier in _TIERS:
                    tbit = worker.tier_bits[tier]
                    if t & tbit:
                        slot = tbit.bit_length() - 1
                        yield Placement(
                            worker.wid, tier, key, masks.get(slot, 0), copies.get(slot, 1)
                        )

    def _live(self, key: BlockKey) -> bool:
        t = self._tiers.get(key)
        return t is not None and bool(t & ~self._dead)

    def block_size(self, key: BlockKey) -> int:
        """The block's known token count (0 when unknown or not indexed)."""
        return self._sizes.get(key, 0) if self._live(key) else 0

    def parent(self, key: BlockKey) -> BlockKey | None:
        """The block's parent, None when unknown or not indexed (O(blocks): a view)."""
        return self._parent_map().get(key) if self._live(key) else None

    def _parent_map(self) -> dict[BlockKey, BlockKey]:
        """Every indexed block with a known parent -> that parent, from its holders' logs:
        each holder's latest REPORT that stated one. Holders disagree only after
        inconsistent reports (a chained key determines its parent); then the smallest
        worker id's statement wins."""
        parents: dict[BlockKey, BlockKey] = {}
        for worker in sorted(self._workers.values(), key=_BY_WID, reverse=True):
            held = self._held_parents(worker)
            parents.update((k, p) for k, p in held.items() if p is not None)
        return parents

    def _children_map(self, parents: dict[BlockKey, BlockKey]) -> dict[BlockKey, list[BlockKey]]:
        """Indexed parent -> its indexed children."""
        children: dict[BlockKey, list[BlockKey]] = {}
        for key, parent in parents.items():
            if self._live(parent):
                children.setdefault(parent, []).append(key)
        return children

    def children(self, key: BlockKey) -> list[BlockKey]:
        return sorted(self._children_map(self._parent_map()).get(key, ()))

    def subtree_blocks(self, key: BlockKey) -> int:
        """Indexed blocks in the subtree rooted at `key` (itself included)."""
        if not self._live(key):
            return 0
        children = self._children_map(self._parent_map())
        seen: set[BlockKey] = set()
        stack = [key]
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(children.get(current, ()))
        return len(seen)

    def worker_info(self, worker_id: str) -> tuple[str, CacheSpec | None] | None:
        """(address, cache spec) of a known worker, else None."""
        worker = self._workers.get(worker_id)
        return None if worker is None else (worker.address, worker.spec)

    def stats(self, backend: str = "memory") -> IndexStats:
        self.purge()
        return IndexStats(
            backend=backend,
            num_blocks=len(self._tiers),
            num_placements=self._num_placements,
            workers=tuple(
                WorkerStats(w.wid, w.address, w.num_blocks, w.num_placements)
                for w in sorted(self._workers.values(), key=lambda w: w.wid)
            ),
        )

    @property
    def num_blocks(self) -> int:
        self.purge()
        return len(self._tiers)

    @property
    def num_placements(self) -> int:
        return self._num_placements

    # ------------------------------------------------------------------ snapshot

    def parent_first_order(self) -> list[BlockKey]:
        """Every indexed key, each after its indexed parent (pre-order from the roots, so a
        chain's blocks are adjacent)."""
        self.purge()
        parents = self._parent_map()
        children = self._children_map(parents)
        tiers = self._tiers
        order: list[BlockKey] = []
        visited: set[BlockKey] = set()
        roots = [k for k in tiers if parents.get(k) not in tiers]
        # A parent cycle (possible only with inconsistent reports) has no root: visit it last.
        for start in [*roots, *tiers]:
            if start in visited:
                continue
            stack = [start]
            while stack:
                key = stack.pop()
                if key in visited:
                    continue
                visited.add(key)
                order.append(key)
                stack.extend(sorted(children.get(key, ()), reverse=True))
        return order

    def snapshot(self, worker_id: str | None = None) -> Iterator[Batch]:
        """Batches that rebuild the index (or one worker) when applied to an empty index:
        per worker (by id), REPORT chains in parent-first order within the wire limits, then
        one REPORT(copies) per extra physical copy. Hit counters are not part of it."""
        rank = {key: i for i, key in enumerate(self.parent_first_order())}
        for worker in sorted(self._workers.values(), key=_BY_WID):
            if worker_id is None or worker.wid == worker_id:
                yield from self._worker_snapshot(worker, rank)

    def _worker_snapshot(self, worker: _Worker, rank: dict[BlockKey, int]) -> Iterator[Batch]:
        actions: list[Action] = []
        extra_copies: list[Action] = []
        stated = self._held_parents(worker)  # held keys -> parents
        for tier in _TIERS:
            tbit = worker.tier_bits[tier]
            slot = tbit.bit_length() - 1
            keys = sorted((k for k in stated if self._tiers[k] & tbit), key=rank.__getitem__)
            chain: list[BlockKey] = []
            for key in keys:
                parent = stated[key]
                if chain and (parent != chain[-1] or len(chain) >= MAX_HASHES_PER_REQUEST):
                    actions.extend(self._chain_reports(tier, slot, chain, stated[chain[0]]))
                    chain = []
                chain.append(key)
                count = self._copies.get(key, {}).get(slot, 1)
                if count > 1:  # a REPORT is a replace: each copy restates the mask
                    mask = self._component_masks.get(key, {}).get(slot, 0)
                    copy = Action(ActionType.REPORT, tier, (key,), (mask,), copies=True)
                    extra_copies.extend([copy] * (count - 1))
            if chain:
                actions.extend(self._chain_reports(tier, slot, chain, stated[chain[0]]))
        actions.extend(extra_copies)
        yield from _chunk_batch(worker.wid, worker.address, worker.spec, actions)

    def _chain_reports(
        self, tier: Tier, slot: int, chain: list[BlockKey], parent: BlockKey | None
    ) -> list[Action]:
        """REPORTs stating `chain` (its head the child of `parent`). A head held as its own
        parent (a REPORT that repeated a hash) is stated as a root: validate_batch refuses a
        head its own parent, as SGLang's indexer does. Where the parent lies further down the
        chain (a cycle), two REPORTs, split at the parent, so that every parent is stated as
        it is held and a receiver that refuses a looping REPORT (SGLang's) takes them."""
        if parent == chain[0]:
            parent = None
        at = chain.index(parent) if parent in chain else 0
        if not at:
            return [self._report_action(tier, slot, chain, parent)]
        return [
            self._report_action(tier, slot, chain[:at], parent),
            self._report_action(tier, slot, chain[at:], chain[at - 1]),
        ]

    def _report_action(
        self, tier: Tier, slot: int, chain: list[BlockKey], parent: BlockKey | None
    ) -> Action:
        masks = tuple(self._component_masks.get(k, {}).get(slot, 0) for k in chain)
        sizes = tuple(self._sizes.get(k, 0) for k in chain)
        return Action(
            ActionType.REPORT,
            tier,
            tuple(chain),
            component_masks=masks if any(masks) else (),
            block_sizes=sizes if any(sizes) else (),
            parent=parent,
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
