"""Engine events -> index batches for one worker (pure; one `WorkerTranslator` per source).

What it decides:

- **Tier.** A medium maps to a tier: GPU -> HBM, CPU / CPU_PINNED -> DRAM, DISK / STORAGE ->
  SSD. A nil medium and EXTERNAL have no tier in the seed; `MediumMap` makes that an explicit
  choice (the indexer's own sources default nil -> HBM, since a nil medium on a GPU engine means
  GPU; the bridge defaults to skipping both, like SGLang's bridge). An event whose medium maps
  to no tier is skipped and counted.
- **Key space.** `engine`: the engine's hash in sfixed64 (`to_sfixed64`). `canonical`:
  kvplane's chained key of the block's tokens (`indexer.keys.block_keys`), with an engine-hash
  -> canonical-key map per worker that resolves removals and re-announcements without tokens.
  An event that cannot be keyed (no tokens, an unknown parent of a first block not live
  already, a LoRA's block with its `lora_id` and no `lora_name`) is skipped and counted.
- **Copies.** vLLM can hold the same hash in two physical blocks and then removes it twice, so
  copies are counted per (tier, KV cache group, engine hash): a block is reported when its
  first copy at a tier appears, in any group, and revoked when its last copy there goes.
  `kv_cache_report_mode="full"` re-announces cached blocks as BlockStored with a nil parent: a
  nil-parent store of a hash already live in its group is not a new copy (checked against the
  real capture: counting them as copies leaves more live blocks than the engine's cache
  holds). A hybrid model's groups (full attention, sliding window, ...) store and evict the
  same hashes on their own: one group's eviction leaves the block indexed while another group
  holds it. A removal of a hash never seen is passed on as a REVOKE in engine mode (a no-op
  if absent; it may be a block indexed before this translator started).
- **Components** (hybrid models, `indexer.cache_groups`). Once the events name a group kind
  that is not full attention (or the source configures the groups), each placement is
  reported with the component mask of the groups holding it at its tier (re-reported, a
  replace, whenever a group stores or evicts it and the mask changes; revoked when no group
  holds it there), and every batch carries the worker's cache spec, so that prefix matches
  follow the seed's FULL / SWA / MAMBA rules. When the groups' kinds change, every live
  placement is re-reported with its new mask. A plain model's stream (no kinds, or only
  full-attention groups) gives legacy placements (no masks) and no spec.
- **Clears.** AllBlocksCleared -> one CLEAR_ALL_AT_TIER per configured tier, in place (or only
  its medium's tier when it names one); `reset()` clears every tier and all state (engine
  restart, unrecoverable gap).
- **Shape.** Adjacent REPORTs to one tier merge when they chain (each later block's parent is
  the one before it, so a merge never loses a parent link), except a store of the merged
  chain's own parent or of one of its blocks (a merged REPORT never closes a parent cycle,
  which SGLang's indexer, a bridge's receiver, refuses); adjacent REVOKEs to one tier merge.
  Batches are split at 256 actions / 16,384 hashes (the seed's limits), all with the same seq.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from indexer import keys
from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec, Tier, to_sfixed64
from indexer.cache_groups import CacheGroup, CacheGroups
from indexer.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineHash,
)

MAX_ACTIONS_PER_BATCH = 256
MAX_HASHES_PER_BATCH = 16_384
ALL_TIERS = (Tier.HBM, Tier.DRAM, Tier.SSD)


class HashMode(enum.StrEnum):
    ENGINE = "engine"
    CANONICAL = "canonical"


_KNOWN_MEDIA: dict[str, Tier] = {
    "GPU": Tier.HBM,
    "CPU": Tier.DRAM,
    "CPU_PINNED": Tier.DRAM,
    "DISK": Tier.SSD,
    "STORAGE": Tier.SSD,
}


@dataclass(frozen=True, slots=True)
class MediumMap:
    """Where a nil medium and EXTERNAL go (None = skip the event). Unknown media are skipped."""

    nil: Tier | None = Tier.HBM
    external: Tier | None = None

    def tier(self, medium: str | None) -> Tier | None:
        if medium is None:
            return self.nil
        if medium == "EXTERNAL":
            return self.external
        return _KNOWN_MEDIA.get(medium)


BRIDGE_MEDIUM_MAP = MediumMap(nil=None, external=None)


@dataclass(frozen=True, slots=True)
class TranslateOptions:
    worker_id: str
    worker_address: str = ""
    hash_mode: HashMode = HashMode.ENGINE
    media: MediumMap = MediumMap()
    # Tiers an AllBlocksCleared without a medium clears.
    clear_tiers: tuple[Tier, ...] = ALL_TIERS
    # Used when an event carries tokens but no block_size (canonical mode).
    default_block_size: int | None = None
    # A fixed spec for every batch; a hybrid stream's own spec (learned from its KV cache
    # groups) replaces it.
    cache_spec: CacheSpec | None = None
    # The engine's KV cache groups by group_idx, when known before its events name them.
    kv_cache_groups: tuple[CacheGroup, ...] = ()


@dataclass(slots=True)
class TranslateCounters:
    num_skipped_medium: int = 0  # medium mapped to no tier
    # canonical mode: no tokens, unknown parent or unknown hash, a LoRA's block without its name
    num_unresolved: int = 0


# What each `TranslateCounters` field counts, as the HELP of the indexer's counter of it.
TRANSLATE_COUNTER_HELP = {
    "num_skipped_medium": "KV events not indexed: their storage medium maps to no tier",
    "num_unresolved": "KV events not indexed (canonical hashing): no tokens, an unknown "
    "parent or hash, or a LoRA adapter's block without its name",
}


@dataclass(slots=True)
class _Live:
    """One engine hash live on this worker: copies per (tier, KV cache group), its key and
    parent in the index, and (hybrid streams) the component mask reported per tier."""

    key: BlockKey
    parent: BlockKey | None = None
    copies: dict[tuple[Tier, int], int] = field(default_factory=dict)
    masks: dict[Tier, int] = field(default_factory=dict)

    def at_tier(self, tier: Tier) -> int:
        """Copies at `tier`, over every group."""
        return sum(n for (t, _group), n in self.copies.items() if t == tier)

    def groups_at(self, tier: Tier) -> set[int]:
        """The KV cache groups holding the block at `tier`."""
        return {group for (t, group) in self.copies if t == tier}


@dataclass(frozen=True, slots=True)
class KeyedBlock:
    """One block's tokens and the key it is indexed under."""

    token_ids: tuple[int, ...]
    key: BlockKey


@dataclass(slots=True)
class RootBlockSeen:
    """The latest block an engine stored at the start of a prompt with no LoRA adapter, cache
    salt or multimodal item in it, as indexed (None: none since the last reset): hashing its tokens
    as a prompt gives its key in the worker's key space only (GetIndexStats `keyings`,
    `root_block`). Shared, like the counters, by the translators of one source (its ranks, a
    take-over's)."""

    block: KeyedBlock | None = None


class WorkerTranslator:
    def __init__(self, options: TranslateOptions) -> None:
        self.options = options
        self.counters = TranslateCounters()
        self.root_block = RootBlockSeen()
        self._live: dict[BlockKey, _Live] = {}  # by sfixed64 engine hash
        self._groups = CacheGroups(dict(enumerate(options.kv_cache_groups)))

    @property
    def cache_spec(self) -> CacheSpec | None:
        """The spec every batch carries: the hybrid stream's own, else the configured one."""
        return self._groups.spec() or self.options.cache_spec

    @property
    def num_live_blocks(self) -> int:
        return len(self._live)

    def live_keys(self, tier: Tier | None = None) -> dict[BlockKey, int]:
        """Index key -> copies (at `tier`, or summed over tiers) of every live block."""
        out: dict[BlockKey, int] = {}
        for live in self._live.values():
            copies = sum(live.copies.values()) if tier is None else live.at_tier(tier)
            if copies:
                out[live.key] = copies
        return out

    def translate(self, events: Iterable[EngineEvent], *, seq: int = 0) -> list[Batch]:
        """The batches (possibly none) that apply `events` to the index, in order."""
        actions: list[_Run] = []
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, actions)
            elif isinstance(event, BlockRemoved):
                self._removed(event, actions)
            elif isinstance(event, AllBlocksCleared):
                self._cleared(event, actions)
        return self._batches(actions, seq)

    def reset(self, *, seq: int = 0) -> Batch:
        """Forget everything (the root block seen too: a new engine process may hash with
        another seed) and return the batch that clears this worker at every tier."""
        self._live.clear()
        self.root_block.block = None
        self._groups.reset()
        actions = tuple(Action(ActionType.CLEAR_ALL_AT_TIER, t) for t in ALL_TIERS)
        return self._batch(actions, seq)

    # -- events ------------------------------------------------------------------------------

    def _tier(self, medium: str | None) -> Tier | None:
        tier = self.options.media.tier(medium)
        if tier is None:
            self.counters.num_skipped_medium += 1
        return tier

    def _stored(self, event: BlockStored, out: list[_Run]) -> None:
        tier = self._tier(event.medium)
        if tier is None or not event.block_hashes:
            return
        engine_keys = [to_sfixed64(h) for h in event.block_hashes]
        index_keys = self._index_keys(event, engine_keys)
        if index_keys is None:
            self.counters.num_unresolved += 1
            return
        block_size = event.block_size or self.options.default_block_size or 0
        if _starts_a_plain_prompt(event, block_size):
            self.root_block.block = KeyedBlock(event.token_ids[:block_size], index_keys[0])
        reannounce = event.parent_block_hash is None
        parent = self._parent_key(event.parent_block_hash)
        slot = (tier, event.group_idx)
        groups = self._groups
        if groups.observe(
            event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window
        ):
            self._restate_masks(out)
        for engine_key, key in zip(engine_keys, index_keys, strict=True):
            live = self._live.get(engine_key)
            if live is None:
                live = self._live[engine_key] = _Live(key, parent)
                held = 0  # new to this worker: no copies anywhere yet
            else:
                if parent is not None:
                    live.parent = parent
                held = live.at_tier(tier)
            copies = live.copies.get(slot, 0)
            if copies and reannounce:
                pass  # full-mode re-announcement: not a new copy
            else:
                live.copies[slot] = copies + 1
            if groups.hybrid:
                mask = groups.mask(live.groups_at(tier))
                if live.masks.get(tier) != mask:
                    live.masks[tier] = mask
                    _append_report(out, tier, key, live.parent, block_size, mask=mask)
            elif not held:
                # (The parent it has: a live block's, where the event's parent is not live,
                # is the one stated before, not "a root".)
                _append_report(out, tier, key, live.parent, block_size)
            parent = key

    def _restate_masks(self, out: list[_Run]) -> None:
        """Re-report every live placement whose mask the groups now read differently (the
        stream just turned hybrid, or a group changed kind)."""
        groups = self._groups
        if not groups.hybrid:
            return
        for live in self._live.values():
            for tier in sorted({t for t, _group in live.copies}):
                mask = groups.mask(live.groups_at(tier))
                if live.masks.get(tier) != mask:
                    live.masks[tier] = mask
                    _append_report(out, tier, live.key, live.parent, 0, mask=mask)

    def _index_keys(
        self, event: BlockStored, engine_keys: Sequence[BlockKey]
    ) -> list[BlockKey] | None:
        if self.options.hash_mode is HashMode.ENGINE:
            return list(engine_keys)
        # Canonical: reuse the keys of blocks already live (re-announcements, copies), hash
        # the others from their tokens, chaining from the parent's canonical key.
        block_size = event.block_size or self.options.default_block_size
        known = [self._live.get(k) for k in engine_keys]
        if all(live is not None for live in known):
            return [live.key for live in known if live is not None]
        if not block_size or len(event.token_ids) != block_size * len(engine_keys):
            return None
        if event.lora_id is not None and not event.lora_name:
            # A LoRA's block named by id only (vLLM before lora_name): its key must carry the
            # adapter's name, and keyed from its tokens alone it would pass for the base
            # model's block.
            return None
        parent: BlockKey | None = None
        # The parent keys the first block only: a live first block has its key already.
        if known[0] is None and event.parent_block_hash is not None:
            parent_live = self._live.get(to_sfixed64(event.parent_block_hash))
            if parent_live is None:
                return None
            parent = parent_live.key
        lora_name = event.lora_name or None
        salt, mm_ids = read_extra_keys(event)
        out: list[BlockKey] = []
        i = 0
        while i < len(known):
            live = known[i]
            if live is not None:
                out.append(live.key)
                parent = live.key
                i += 1
                continue
            # A run of blocks not live yet is hashed in one call, the chain continuing from
            # block to block as it would one block at a time (one call a block cost more than
            # the hashing itself: a request's new blocks come as one such run).
            end = i + 1
            while end < len(known) and known[end] is None:
                end += 1
            run_mm = [mm_ids[b] if b < len(mm_ids) else None for b in range(i, end)]
            out.extend(
                keys.block_keys(
                    event.token_ids[i * block_size : end * block_size],
                    block_size,
                    lora_name=lora_name,
                    cache_salt=salt if parent is None else None,
                    mm_hashes=run_mm if any(run_mm) else None,
                    parent=parent,
                )
            )
            parent = out[-1]
            i = end
        return out

    def _parent_key(self, parent_hash: EngineHash | None) -> BlockKey | None:
        if parent_hash is None:
            return None
        engine_key = to_sfixed64(parent_hash)
        if self.options.hash_mode is HashMode.ENGINE:
            return engine_key
        live = self._live.get(engine_key)
        return None if live is None else live.key

    def _removed(self, event: BlockRemoved, out: list[_Run]) -> None:
        tier = self._tier(event.medium)
        if tier is None:
            return
        for engine_hash in event.block_hashes:
            engine_key = to_sfixed64(engine_hash)
            live = self._live.get(engine_key)
            if live is None:
                if self.options.hash_mode is HashMode.ENGINE:
                    _append_revoke(out, tier, engine_key)
                else:
                    self.counters.num_unresolved += 1
                continue
            slot = (tier, event.group_idx)
            copies = live.copies.get(slot, 0) - 1
            if copies > 0:
                live.copies[slot] = copies
                continue
            live.copies.pop(slot, None)
            if live.at_tier(tier):  # another KV cache group still holds it
                if self._groups.hybrid:
                    mask = self._groups.mask(live.groups_at(tier))
                    if live.masks.get(tier) != mask:
                        live.masks[tier] = mask
                        _append_report(out, tier, live.key, live.parent, 0, mask=mask)
                continue
            live.masks.pop(tier, None)
            if not live.copies:
                del self._live[engine_key]
            _append_revoke(out, tier, live.key)

    def _cleared(self, event: AllBlocksCleared, out: list[_Run]) -> None:
        if event.medium is None:
            tiers: tuple[Tier, ...] = self.options.clear_tiers
        else:
            tier = self._tier(event.medium)
            if tier is None:
                return
            tiers = (tier,)
        for tier in tiers:
            out.append(_Run(ActionType.CLEAR_ALL_AT_TIER, tier))
        for engine_key in list(self._live):
            live = self._live[engine_key]
            for slot in [slot for slot in live.copies if slot[0] in tiers]:
                del live.copies[slot]
            for tier in tiers:
                live.masks.pop(tier, None)
            if not live.copies:
                del self._live[engine_key]

    # -- batches ---------------------------------------------------------------------------

    def _batch(self, actions: tuple[Action, ...], seq: int) -> Batch:
        return Batch(
            worker_id=self.options.worker_id,
            actions=actions,
            worker_address=self.options.worker_address,
            seq=seq,
            cache_spec=self.cache_spec,
        )

    def _batches(self, runs: list[_Run], seq: int) -> list[Batch]:
        actions = [run.action() for run in runs]
        return [self._batch(chunk, seq) for chunk in split_actions(actions)]


def _starts_a_plain_prompt(event: BlockStored, block_size: int) -> bool:
    """Whether the event's first block starts a prompt (a nil parent: in the real vLLM
    capture, every such block, re-announcements included, is its request's first) of the
    first KV cache group, with its tokens, no LoRA adapter, and extra keys sent for each
    block, the first one's empty (no salt, no multimodal item in it: an event without them
    cannot tell). Only the first block's own extra keys enter its key (vLLM's and kvplane's
    alike), so an item in a later block does not matter. O(1): every BlockStored asks."""
    return (
        event.parent_block_hash is None
        and event.group_idx == 0
        and block_size > 0
        and len(event.token_ids) == block_size * len(event.block_hashes)
        and len(event.extra_keys) == len(event.block_hashes)
        and not event.extra_keys[0]
        and not event.lora_name
        and event.lora_id is None
        and not event.cache_salt
    )


def read_extra_keys(event: BlockStored) -> tuple[str | None, list[list[str] | None]]:
    """The cache salt and, per block, the multimodal item ids in a BlockStored's extra keys.

    vLLM publishes each block's extra keys in the order it hashes them: the LoRA name, one
    entry per multimodal item overlapping the block, the cache salt (first block only), then
    prompt-embedding digests. The shapes tell them apart:
    - typed keys (vLLM's tagged schema, decoded as a map with a "type"): `cache_salt`, `lora`,
      `mm` (its `hash` is the item id); anything else is kept as an opaque id;
    - `("cache_salt", salt)` / `("lora", name)`: tagged pairs;
    - `(item id, offset in block)`: a multimodal item (the offset is dropped: the tokens
      already fix where an item starts);
    - a bare string equal to the event's `lora_name`: the LoRA name (not a key of its own);
    - other bare strings: on the first block of an event without a parent, the last one is
      vLLM 0.32's bare salt (the real capture's `["tenant-A"]`) unless the salt came
      explicitly or the string recurs on the second block, which a salt never does (older
      vLLM published multimodal ids bare, and an item that starts in the first block
      continues into the next); the rest are multimodal ids;
    - anything else (prompt-embedding bytes, unknown shapes): an opaque id, so the block
      keeps a key of its own that a token-only query cannot produce.
    A salt sent as a field (SGLang's `cache_salt`) wins. "" is no salt.
    """
    if not any(event.extra_keys):  # no block has any (most events): nothing to tell apart
        return event.cache_salt or None, [None] * len(event.extra_keys)
    lora_name = event.lora_name or None
    blocks = [[_extra_key(item) for item in block or ()] for block in event.extra_keys]
    first = blocks[0] if blocks else []
    salt = event.cache_salt or next((v for kind, v in first if kind == "salt"), None) or None
    # vLLM 0.32's bare salt: the last bare string of block 0 not on block 1, and only when
    # block 0 starts the request (no parent): the salt is hashed into a request's first block.
    if salt is None and event.parent_block_hash is None:
        recurring = {v for kind, v in blocks[1] if kind == "bare"} if len(blocks) > 1 else set()
        bare = [v for kind, v in first if kind == "bare" and v != lora_name and v not in recurring]
        salt = bare[-1] if bare else None
    per_block: list[list[str] | None] = []
    for i, block in enumerate(blocks):
        ids = [
            value
            for kind, value in block
            if kind not in ("salt", "lora")
            and not (kind == "bare" and (value == lora_name or (i == 0 and value == salt)))
        ]
        per_block.append(ids or None)
    return salt or None, per_block


def _extra_key(item: object) -> tuple[str, str]:
    """(kind, value) of one extra key: kind is "salt", "lora", "mm" (value: the item id),
    "bare" (a plain string, read by position) or "opaque" (value: its repr)."""
    if isinstance(item, str):
        return "bare", item
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        tag, value = item
        if tag == "cache_salt" and isinstance(value, str):
            return "salt", value
        if tag == "lora" and isinstance(value, str):
            return "lora", value
        if isinstance(value, int) and not isinstance(value, bool):
            return "mm", tag  # (item id, offset in block)
    typed = _typed_key(item)
    if typed is not None:
        tag, fields = typed
        if tag == "cache_salt" and isinstance(fields.get("salt"), str):
            return "salt", str(fields["salt"])
        if tag == "lora":
            return "lora", str(fields.get("name"))
        if tag == "mm" and isinstance(fields.get("hash"), str):
            return "mm", str(fields["hash"])
    return "opaque", repr(item)


def _typed_key(item: object) -> tuple[str, dict[object, object]] | None:
    """A typed extra key (a msgpack map with a "type" tag, decoded as sorted (name, value)
    pairs by `indexer.zmq_decode`) as (tag, fields); None for any other shape."""
    if not isinstance(item, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in item
    ):
        return None
    fields: dict[object, object] = dict(item)
    tag = fields.get("type")
    return (tag, fields) if isinstance(tag, str) else None


@dataclass(slots=True)
class _Run:
    """An action being built: adjacent events to one tier extend it in place (appending to
    lists, so a long run costs linear time)."""

    type: ActionType
    tier: Tier
    hashes: list[BlockKey] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    parent: BlockKey | None = None
    component_masks: list[int] = field(default_factory=list)
    # A REPORT's parent and hashes: a block among them appended again would close a loop.
    chain: set[BlockKey] = field(default_factory=set)

    def action(self) -> Action:
        return Action(
            self.type,
            self.tier,
            tuple(self.hashes),
            tuple(self.component_masks),
            tuple(self.block_sizes),
            self.parent,
        )


def _append_report(
    out: list[_Run],
    tier: Tier,
    key: BlockKey,
    parent: BlockKey | None,
    block_size: int,
    *,
    mask: int | None = None,
) -> None:
    """Append a REPORT of `key`; `mask` None = a legacy whole block (no masks on the wire).
    A merge never closes a parent cycle (SGLang's indexer refuses one REPORT that does): a
    store of a block already in the run, or of its parent, starts a REPORT of its
    own (a block stated as the child of its descendant, then re-reported: a hybrid model's
    masks restated)."""
    last = out[-1] if out else None
    if (
        last is not None
        and last.type is ActionType.REPORT
        and last.tier is tier
        and last.hashes[-1] == parent
        and bool(last.block_sizes) == (block_size > 0)
        and bool(last.component_masks) == (mask is not None)
        and key not in last.chain
    ):
        last.hashes.append(key)
    else:
        last = _Run(ActionType.REPORT, tier, [key], [], parent)
        if parent is not None:
            last.chain.add(parent)
        out.append(last)
    last.chain.add(key)
    if block_size > 0:
        last.block_sizes.append(block_size)
    if mask is not None:
        last.component_masks.append(mask)


def _append_revoke(out: list[_Run], tier: Tier, key: BlockKey) -> None:
    last = out[-1] if out else None
    if last is not None and last.type is ActionType.REVOKE and last.tier is tier:
        last.hashes.append(key)
    else:
        out.append(_Run(ActionType.REVOKE, tier, [key]))


def _split_action(action: Action, max_hashes: int) -> list[Action]:
    if len(action.hashes) <= max_hashes:
        return [action]
    parts = []
    for start in range(0, len(action.hashes), max_hashes):
        end = start + max_hashes
        parent = action.parent if start == 0 else action.hashes[start - 1]
        parts.append(
            action._replace(
                hashes=action.hashes[start:end],
                component_masks=action.component_masks[start:end],
                block_sizes=action.block_sizes[start:end],
                parent=parent if action.type is ActionType.REPORT else None,
            )
        )
    return parts


def split_actions(
    actions: Sequence[Action],
    *,
    max_actions: int = MAX_ACTIONS_PER_BATCH,
    max_hashes: int = MAX_HASHES_PER_BATCH,
) -> list[tuple[Action, ...]]:
    """Cut an ordered action list into chunks within the seed's per-batch limits, keeping
    order (an oversized REPORT/REVOKE becomes several actions; a REPORT part's parent is the
    last hash of the part before)."""
    chunks: list[tuple[Action, ...]] = []
    current: list[Action] = []
    num_hashes = 0
    for whole in actions:
        for action in _split_action(whole, max_hashes):
            n = len(action.hashes)
            if current and (len(current) >= max_actions or num_hashes + n > max_hashes):
                chunks.append(tuple(current))
                current, num_hashes = [], 0
            current.append(action)
            num_hashes += n
    if current:
        chunks.append(tuple(current))
    return chunks
