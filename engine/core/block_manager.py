"""Paged KV cache bookkeeping: a block pool with reference counts, per-sequence block tables and
prefix caching by chained block keys. Pure Python, no tensors.

Invariants (checked by `check_invariants`, kept on every change):
- every block is either free (ref count 0, on the free list) or used (ref count > 0, not on it);
  `num_free_blocks + num_used_blocks == num_blocks`;
- a block's ref count equals the number of block tables that hold it;
- `_cached` maps each cached key to exactly one block, whose `_keys[block]` is that key; a block
  on the free list may still hold a key (an evictable cached block);
- a standby copy (`_standby`) is a used block without a key whose KV is that of a cached key
  (see Duplicates);
- a key stays cached while a sequence holds a copy of it: a table's first `num_cached_blocks`
  blocks each hold their key, cached or standing by for it;
- the KV events recorded so far (those held for scheduled blocks included), replayed in order,
  give exactly the keys of `_cached`.

Free list. An O(1) doubly linked list over block ids (arrays `_prev`/`_next`, sentinel at index
`num_blocks`), so that a prefix hit can take a cached block out of the middle in O(1).
Allocation pops from the head. A freed block without a key goes to the head (reused first, it
holds nothing worth keeping); a freed cached block goes to the tail, so the head side holds the
least recently used cached blocks: popping the head is LRU eviction. A sequence's blocks are
freed last-first, so a prefix's tail is evicted before its head.

Keys. Full blocks get kvplane's canonical chained key `indexer.keys.block_keys(tokens,
block_size, lora_name=, cache_salt=, parent=)`, so the engine and the index agree on what a block
is. A hit is checked against the stored token ids, parent key and namespace, so a key
collision can never serve the wrong KV; the check is made once per stored block and token list
(`_Lookup`: admission asks about the same list repeatedly, and a waiting head at every step).

Duplicates. Two sequences that compute the same block at once both hold its KV; the first
scheduled to fill it caches it, the second copy stays private (one BlockStored per key, as the
index counts blocks, not copies) but stands by: were the cached copy evicted while the second
is still held, the second takes the key over, with no event, and the key stays cached. vLLM
caches both copies (block tables are append-only there too) and keeps the hash until its last
copy goes; without the standby, the key would be lost while a running sequence still holds its
KV, and that sequence's next blocks would be stored under a parent no longer cached
(unreachable by any prefix match).

Scheduled blocks. As vLLM v1 (`allocate_slots` caches the full blocks a scheduled chunk
covers), the scheduler caches a block as soon as it schedules the chunk that fills it
(`cache_blocks(scheduled=True)`), before its KV is written: a sequence admitted later in the
same step (another request with the same prefix, another output of the same request) takes it
as a prefix hit, and reads it in the same forward pass, whose every layer writes the step's
keys and values before attention reads them. Nothing but that pass may write those blocks:
their writers hold them until it runs (so none of them is evicted: later allocations of the
step evict only unreferenced blocks). Their BlockStored events are held until the pass has
run (`commit_scheduled`), with every event recorded after them, so the events stay in order
and never announce KV that is not written; if the pass fails (`discard_scheduled`), the
blocks leave the cache unannounced (with the KV imported in the step on top of them), and
the sequences that took them as hits are told to compute them.

Full prompt hits. The runner needs the logits of the last prompt token, so a hit never covers
it: at most `(num_prompt_tokens - 1) // block_size` blocks are reused (a block-aligned prompt
recomputes its whole last block, as vLLM does, instead of writing into a shared block).

Slot layout of one sequence (block_size 4, 2 cached blocks hit, 3 new tokens this step):

    block table:  [ b7 ][ b2 ][ b9 ]
    positions:     0..3  4..7  8..11
                   hit   hit   new: slots 8, 9, 10 written this step, 11 free
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.api import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    KvEvent,
    Medium,
)
from indexer.keys import block_keys


@dataclass(frozen=True, slots=True)
class _Namespace:
    lora_name: str | None
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class _CachedBlock:
    """What a cached block holds, checked before its first hit by a token list (`_Lookup`)."""

    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    namespace: _Namespace


@dataclass(slots=True, eq=False)
class _Lookup:
    """The last token list admission asked about (see `BlockManager._lookup_for`).

    `keys`: its full blocks' keys. `verified[i]`: the content object of a cached block already
    found to hold block i (tokens, parent key, namespace). Contents are immutable and made
    anew whenever a block is stored, so `contents[block] is verified[i]` proves the match
    without comparing tokens again. `hits`: the last answer, valid while the prefix cache is
    at version `hits_version` and the list has `hits_num_tokens` tokens."""

    token_ids: Sequence[int]
    namespace: _Namespace
    keys: list[BlockKey]
    verified: list[_CachedBlock] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    hits_version: int = -1
    hits_num_tokens: int = -1


@dataclass(slots=True)
class _Table:
    """One sequence's blocks. `block_keys[i]` is the key of full block i once known; the first
    `num_cached_blocks` blocks are in the prefix cache (hit or stored by this sequence)."""

    namespace: _Namespace
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    num_cached_blocks: int = 0


class BlockManager:
    """Block pool + block tables + prefix cache. Not thread-safe (the engine thread owns it)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        medium: Medium = Medium.GPU,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.medium = medium
        self._ref_counts = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._contents: list[_CachedBlock | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._tables: dict[int, _Table] = {}
        self._events: list[KvEvent] = []
        # While the step being scheduled has cached blocks its forward pass is still to write
        # (`cache_blocks(scheduled=True)`): those blocks, and every event recorded since the
        # first of them, in order, flagged when it is their BlockStored (see Scheduled blocks).
        self._scheduled: list[int] = []
        self._held_events: list[tuple[KvEvent, bool]] = []
        self._lookup: _Lookup | None = None
        self._cache_version = 0  # bumped whenever a key enters, leaves or moves in `_cached`
        # Private copies of cached keys, held by the sequences that computed them second: key ->
        # {block: what it holds}, oldest first, and block -> key.
        self._standby: dict[BlockKey, dict[int, _CachedBlock]] = {}
        self._standby_key: dict[int, BlockKey] = {}
        # Doubly linked free list; index `num_blocks` is the sentinel.
        sentinel = num_blocks
        self._next: list[int] = [*range(1, num_blocks + 1), 0]
        self._prev: list[int] = [sentinel, *range(num_blocks)]
        self._num_free = num_blocks

    # ---------------------------------------------------------------- sizes

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- free list

    def _unlink(self, block_id: int) -> None:
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._num_free -= 1

    def _link_after(self, anchor: int, block_id: int) -> None:
        nxt = self._next[anchor]
        self._prev[block_id], self._next[block_id] = anchor, nxt
        self._next[anchor] = block_id
        self._prev[nxt] = block_id
        self._num_free += 1

    def _pop_free(self, evicted: list[BlockKey]) -> int:
        block_id = self._next[self.num_blocks]
        self._unlink(block_id)
        key = self._keys[block_id]
        if key is not None:  # evict the least recently used cached block
            self._cache_version += 1
            self._keys[block_id] = None
            self._contents[block_id] = None
            if not self._take_over(key):
                del self._cached[key]
                evicted.append(key)
        return block_id

    def _take_over(self, key: BlockKey) -> bool:
        """Let the oldest standby copy of `key` (if any) be its cached block."""
        standby = self._standby.get(key)
        if not standby:
            return False
        block_id = next(iter(standby))
        content = standby.pop(block_id)
        if not standby:
            del self._standby[key]
        del self._standby_key[block_id]
        self._cached[key] = block_id
        self._keys[block_id] = key
        self._contents[block_id] = content
        return True

    def _drop_standby(self, block_id: int) -> None:
        key = self._standby_key.pop(block_id)
        standby = self._standby[key]
        del standby[block_id]
        if not standby:
            del self._standby[key]

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._standby_key:  # its holder is gone: it holds nothing worth keeping
                self._drop_standby(block_id)
            sentinel = self.num_blocks
            anchor = self._prev[sentinel] if self._keys[block_id] is not None else sentinel
            self._link_after(anchor, block_id)

    # ---------------------------------------------------------------- prefix cache

    def compute_keys(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        parent: BlockKey | None = None,
    ) -> list[BlockKey]:
        """Canonical keys of the full blocks of `token_ids` (continuing a chain from `parent`)."""
        if len(token_ids) < self.block_size:
            return []
        return block_keys(
            token_ids,  # block_keys hashes whole blocks only
            self.block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            parent=parent,
        )

    def _lookup_for(self, token_ids: Sequence[int], namespace: _Namespace) -> _Lookup:
        """The memo of `token_ids` (made anew for another list or namespace). Admission asks
        about the same list up to three times per attempt (count hits, can_allocate, allocate)
        and a waiting head again at every step until it fits. Token lists are append-only, so
        the same list with the same number of full blocks has the same keys, and its verified
        blocks stay verified as it grows."""
        num_full = len(token_ids) // self.block_size
        memo = self._lookup
        if memo is None or memo.token_ids is not token_ids or memo.namespace != namespace:
            keys = self.compute_keys(token_ids, namespace.lora_name, namespace.cache_salt)
            memo = self._lookup = _Lookup(token_ids, namespace, keys)
        elif len(memo.keys) != num_full:
            memo.keys = self.compute_keys(token_ids, namespace.lora_name, namespace.cache_salt)
        return memo

    def _find_hits(self, lookup: _Lookup) -> list[int]:
        """Block ids of the leading cached blocks of the lookup's token list (read only). A hit
        is served only if the cached block holds these very tokens, parent key and namespace
        (compared in full once per stored block, see `_Lookup`), so a key collision never
        serves someone else's KV. Asked again while the cache has not changed, the answer is
        the last one."""
        token_ids, keys, verified = lookup.token_ids, lookup.keys, lookup.verified
        if lookup.hits_version == self._cache_version and lookup.hits_num_tokens == len(token_ids):
            return lookup.hits
        size = self.block_size
        max_blocks = min(len(keys), (len(token_ids) - 1) // size)
        cached, contents = self._cached, self._contents
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = cached.get(keys[i])
            if block_id is None:
                break
            content = contents[block_id]
            assert content is not None  # a cached block always has its content
            if i >= len(verified) or verified[i] is not content:
                if (
                    content.parent_key != (keys[i - 1] if i else None)
                    or content.namespace != lookup.namespace
                    or content.token_ids != tuple(token_ids[i * size : (i + 1) * size])
                ):
                    break  # a key collision: never serve someone else's KV
                if i < len(verified):
                    verified[i] = content
                else:
                    verified.append(content)
            hits.append(block_id)
        lookup.hits, lookup.hits_version = hits, self._cache_version
        lookup.hits_num_tokens = len(token_ids)
        return hits

    def count_hit_tokens(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """How many prompt tokens a new sequence would find cached (the cache is left as it is;
        only the lookup memo is refreshed)."""
        if not self.enable_prefix_caching:
            return 0
        lookup = self._lookup_for(token_ids, _Namespace(lora_name, cache_salt))
        return len(self._find_hits(lookup)) * self.block_size

    # ---------------------------------------------------------------- paired verbs

    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        use_cache: bool = True,
    ) -> bool:
        """Whether `allocate` can give a new sequence slots for its first `num_tokens` tokens
        (after its prefix hits)."""
        hits = self._hits_for(token_ids, lora_name, cache_salt, use_cache)[1]
        num_hit_free = sum(1 for b in hits if self._ref_counts[b] == 0)
        num_new = max(0, self.blocks_for(num_tokens) - len(hits))
        return num_new + num_hit_free <= self._num_free

    def _hits_for(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
        use_cache: bool,
    ) -> tuple[list[BlockKey], list[int]]:
        if not self.enable_prefix_caching:
            return [], []
        lookup = self._lookup_for(token_ids, _Namespace(lora_name, cache_salt))
        return lookup.keys, self._find_hits(lookup) if use_cache else []

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_tokens: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        use_cache: bool = True,
    ) -> int:
        """Give a new sequence its prefix hits plus slots for its first `num_tokens` tokens
        (hits included). Returns the number of cached tokens (a multiple of block_size).
        Call `can_allocate` first; raises MemoryError when the pool is short."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        keys, hits = self._hits_for(token_ids, lora_name, cache_salt, use_cache)
        num_hit_free = sum(1 for b in hits if self._ref_counts[b] == 0)
        if max(0, self.blocks_for(num_tokens) - len(hits)) + num_hit_free > self._num_free:
            raise MemoryError("not enough free KV blocks")
        # A copy: the table's keys grow as its blocks fill, the memo's must not.
        table = _Table(_Namespace(lora_name, cache_salt), block_keys=list(keys))
        for block_id in hits:
            if self._ref_counts[block_id] == 0:
                self._unlink(block_id)
            self._ref_counts[block_id] += 1
            table.block_ids.append(block_id)
        table.num_cached_blocks = len(hits)
        self._tables[seq_id] = table
        self._grow(table, max(num_tokens, len(hits) * self.block_size))
        return len(hits) * self.block_size

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the sequence's table can grow to hold `num_tokens` tokens in all."""
        table = self._tables[seq_id]
        return self.blocks_for(num_tokens) - len(table.block_ids) <= self._num_free

    def append(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's table to hold `num_tokens` tokens in all."""
        if not self.can_append(seq_id, num_tokens):
            raise MemoryError("not enough free KV blocks")
        self._grow(self._tables[seq_id], num_tokens)

    def _grow(self, table: _Table, num_tokens: int) -> None:
        evicted: list[BlockKey] = []
        while len(table.block_ids) < self.blocks_for(num_tokens):
            block_id = self._pop_free(evicted)
            self._ref_counts[block_id] = 1
            table.block_ids.append(block_id)
        if evicted:
            self._record(BlockRemoved(tuple(evicted), self.medium))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's table; its cached blocks stay cached (evictable), the others are
        free at once. Unknown ids are ignored (freeing twice is harmless)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        for block_id in reversed(table.block_ids):
            self._release(block_id)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's physical block ids (a live list: read, never modify)."""
        return self._tables[seq_id].block_ids

    def cache_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_tokens: int, *, scheduled: bool = False
    ) -> None:
        """Cache the full blocks of `token_ids[:num_tokens]`: every newly full block gets its
        key and enters the prefix cache (one BlockStored for the run of new blocks). Their KV
        is written already (an import), or, `scheduled`, by the forward pass of the step being
        scheduled: they are prefix hits at once, their events are held until that pass has
        run (`commit_scheduled`, or `discard_scheduled` when it fails; see Scheduled blocks)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        num_full = min(num_tokens // self.block_size, len(table.block_ids))
        if num_full <= table.num_cached_blocks:
            return
        size = self.block_size
        ns = table.namespace
        if len(table.block_keys) < num_full:
            start = len(table.block_keys)
            parent = table.block_keys[-1] if table.block_keys else None
            table.block_keys.extend(
                self.compute_keys(
                    token_ids[start * size : num_full * size], ns.lora_name, ns.cache_salt, parent
                )
            )
        stored: list[int] = []
        for i in range(table.num_cached_blocks, num_full):
            block_id = table.block_ids[i]
            key = table.block_keys[i]
            parent = table.block_keys[i - 1] if i > 0 else None
            content = _CachedBlock(parent, tuple(token_ids[i * size : (i + 1) * size]), ns)
            if scheduled:
                self._scheduled.append(block_id)
            if key in self._cached:
                # Another sequence computed the same block first: this copy stays private, a
                # standby for the cached one (see Duplicates).
                self._standby.setdefault(key, {})[block_id] = content
                self._standby_key[block_id] = key
                continue
            self._cached[key] = block_id
            self._cache_version += 1
            self._keys[block_id] = key
            self._contents[block_id] = content
            stored.append(i)
        table.num_cached_blocks = num_full
        self._record_stored(table, stored, scheduled)

    def _record_stored(self, table: _Table, indexes: list[int], scheduled: bool) -> None:
        """One BlockStored per run of consecutive block indexes."""
        run: list[int] = []
        for i in indexes:
            if run and i != run[-1] + 1:
                self._record(self._stored_event(table, run), scheduled)
                run = []
            run.append(i)
        if run:
            self._record(self._stored_event(table, run), scheduled)

    def _record(self, event: KvEvent, scheduled: bool = False) -> None:
        """Record an event; `scheduled`: the BlockStored of scheduled blocks. Held, with every
        later one, while scheduled blocks await their forward pass (events stay in order)."""
        if scheduled or self._held_events:
            self._held_events.append((event, scheduled))
        else:
            self._events.append(event)

    def commit_scheduled(self) -> None:
        """The step's forward pass has run: the KV of its scheduled blocks is written, and their
        events (and those held behind them) can be taken."""
        self._events.extend(event for event, _ in self._held_events)
        self._held_events.clear()
        self._scheduled.clear()

    def discard_scheduled(self) -> dict[int, int]:
        """The step's forward pass did not run (it raised): its scheduled blocks hold no KV.
        They leave the prefix cache, with no event (their BlockStored was never taken; a key
        cached before, whose cached copy was evicted this step for a scheduled standby, is
        taken over by a written standby or removed), and scheduled standbys are dropped. So
        does KV imported this step on top of them (an import takes scheduled blocks as hits):
        no prefix reaches it any more, and its BlockStored would name a parent never
        announced. Returns, for each table that holds one among its cached blocks, how many
        of its tokens stay cached (the blocks before the first such): a sequence that took
        them as prefix hits must compute them again."""
        blocks, self._scheduled = self._scheduled, []
        held, self._held_events = self._held_events, []
        # The keys whose BlockStored is dropped, and the events still to be taken.
        unannounced: set[BlockKey] = set()
        for event, scheduled in held:
            if isinstance(event, BlockStored) and (scheduled or event.parent_key in unannounced):
                unannounced.update(event.block_keys)
            elif isinstance(event, BlockRemoved) and not unannounced.isdisjoint(event.block_keys):
                # An imported block evicted in this step: neither its store nor its removal.
                announced = tuple(k for k in event.block_keys if k not in unannounced)
                unannounced.difference_update(event.block_keys)
                if announced:
                    self._events.append(BlockRemoved(announced, event.medium))
            else:
                self._events.append(event)
        scheduled_blocks = set(blocks)
        blocks.extend(  # the imported blocks among them
            imported
            for key in unannounced
            if (imported := self._cached.get(key)) is not None and imported not in scheduled_blocks
        )
        for block_id in blocks:  # first, so that none of them takes a key over below
            if block_id in self._standby_key:
                self._drop_standby(block_id)
        removed: list[BlockKey] = []
        for block_id in blocks:
            key = self._keys[block_id]
            if key is None:
                continue
            del self._cached[key]
            self._keys[block_id] = None
            self._contents[block_id] = None
            if not self._take_over(key) and key not in unannounced:
                removed.append(key)
            if self._ref_counts[block_id] == 0:  # its writer is gone: it holds nothing now
                self._unlink(block_id)
                self._link_after(self.num_blocks, block_id)
        self._cache_version += 1
        if removed:
            self._record(BlockRemoved(tuple(removed), self.medium))
        discarded = set(blocks)
        kept: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            for i in range(table.num_cached_blocks):
                if table.block_ids[i] in discarded:
                    table.num_cached_blocks = i
                    kept[seq_id] = i * self.block_size
                    break
        return kept

    def _stored_event(self, table: _Table, indexes: list[int]) -> BlockStored:
        first = indexes[0]
        ns = table.namespace
        tokens: list[int] = []
        for i in indexes:
            content = self._contents[table.block_ids[i]]
            assert content is not None
            tokens.extend(content.token_ids)
        extra: list[tuple[str, ...] | None] = [None] * len(indexes)
        if first == 0 and ns.cache_salt is not None:
            extra[0] = ("cache_salt", ns.cache_salt)
        return BlockStored(
            block_keys=tuple(table.block_keys[i] for i in indexes),
            parent_key=table.block_keys[first - 1] if first > 0 else None,
            token_ids=tuple(tokens),
            block_size=self.block_size,
            medium=self.medium,
            lora_name=ns.lora_name,
            extra_keys=tuple(extra),
        )

    # ---------------------------------------------------------------- events and resets

    def take_events(self) -> list[KvEvent]:
        """The events recorded so far, but those held for scheduled blocks (see Scheduled
        blocks)."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key (AllBlocksCleared). Refused (False) while any block is used:
        running sequences would keep chaining from keys the index no longer has."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        self._cache_version += 1
        self._keys = [None] * self.num_blocks
        self._contents = [None] * self.num_blocks
        self._record(AllBlocksCleared(self.medium))
        return True

    def drop_lora_blocks(self, lora_name: str) -> int:
        """Forget every cached block of the `lora_name` namespace (one BlockRemoved); returns
        how many. For a LoRA name about to serve other weights: KV computed with the old
        adapter must never be hit. The caller ensures no running sequence uses the name (it
        would chain new blocks from dropped keys); a block still held (a KV session's scratch
        table, which never grows) stays with its holder, uncached."""
        for block_id, key in list(self._standby_key.items()):
            if self._standby[key][block_id].namespace.lora_name == lora_name:
                self._drop_standby(block_id)
        dropped: list[BlockKey] = []
        for key, block_id in list(self._cached.items()):
            content = self._contents[block_id]
            if content is None or content.namespace.lora_name != lora_name:
                continue
            del self._cached[key]
            self._keys[block_id] = None
            self._contents[block_id] = None
            dropped.append(key)
            if self._ref_counts[block_id] == 0:  # it holds nothing now: reused first
                self._unlink(block_id)
                self._link_after(self.num_blocks, block_id)
        if dropped:
            self._cache_version += 1
            self._record(BlockRemoved(tuple(dropped), self.medium))
            for table in self._tables.values():
                if table.namespace.lora_name == lora_name:
                    table.num_cached_blocks = 0  # its holder keeps them, uncached
        return len(dropped)

    def snapshot(self) -> list[BlockStored]:
        """The cached set as one-block BlockStored events, parents before children."""
        by_key: dict[BlockKey, BlockStored] = {}
        for key, block_id in self._cached.items():
            content = self._contents[block_id]
            assert content is not None
            extra: tuple[str, ...] | None = None
            if content.parent_key is None and content.namespace.cache_salt is not None:
                extra = ("cache_salt", content.namespace.cache_salt)
            by_key[key] = BlockStored(
                block_keys=(key,),
                parent_key=content.parent_key,
                token_ids=content.token_ids,
                block_size=self.block_size,
                medium=self.medium,
                lora_name=content.namespace.lora_name,
                extra_keys=(extra,),
            )
        ordered: list[BlockStored] = []
        done: set[BlockKey] = set()

        def visit(key: BlockKey) -> None:
            stack = [key]
            parent = by_key[key].parent_key
            while parent is not None and parent in by_key and parent not in done:
                stack.append(parent)
                parent = by_key[parent].parent_key
            for k in reversed(stack):
                if k not in done:
                    done.add(k)
                    ordered.append(by_key[k])

        for key in by_key:
            visit(key)
        return ordered

    def cached_keys(self) -> set[BlockKey]:
        return set(self._cached)

    def check_invariants(self) -> None:
        """Raise AssertionError if a structural invariant is broken (tests call this)."""
        on_list: set[int] = set()
        node = self._next[self.num_blocks]
        while node != self.num_blocks:
            assert node not in on_list, "free list has a cycle"
            on_list.add(node)
            node = self._next[node]
        assert len(on_list) == self._num_free
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table.block_ids:
                holders[block_id] += 1
        for block_id in range(self.num_blocks):
            assert holders[block_id] == self._ref_counts[block_id], f"refcount of {block_id}"
            assert (block_id in on_list) == (self._ref_counts[block_id] == 0)
        for key, block_id in self._cached.items():
            assert self._keys[block_id] == key
        assert sum(k is not None for k in self._keys) == len(self._cached)
        for block_id, key in self._standby_key.items():
            assert block_id in self._standby[key], f"standby {block_id} not under its key"
            assert self._ref_counts[block_id] > 0 and self._keys[block_id] is None
            assert key in self._cached, f"standby {block_id} of a key not cached"
        assert sum(map(len, self._standby.values())) == len(self._standby_key)
        for block_id in self._scheduled:
            assert self._keys[block_id] is not None or block_id in self._standby_key
        assert self._scheduled or not self._held_events, "events held for no scheduled block"
        # What the standbys are for: a key stays cached while a sequence holds a copy of it,
        # the cached block or a standby of the key (for the one the sequence holds there).
        for table in self._tables.values():
            for i in range(table.num_cached_blocks):
                block_id, key = table.block_ids[i], table.block_keys[i]
                assert key in self._cached, f"key of held block {block_id} not cached"
                held = self._keys[block_id] or self._standby_key[block_id]
                assert held == key, f"block {block_id} holds another key than its table's"
