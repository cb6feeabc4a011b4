"""vLLM v1's prefix-cache rules as a small, slow model: an oracle for the block manager's events
and prefix hits (`test_block_manager_vllm.py`).

Written from the behaviour of vLLM's `BlockPool` / `KVCacheManager` (v1, 0.32), not from its
code; block keys are kvplane's canonical keys (the hash function is not what is compared):

- the pool is a queue of free blocks in eviction order, block 0 first; allocation takes blocks
  from the front, and a taken block that still holds a key is evicted: `BlockRemoved` of that
  key, once per evicted block;
- a request's prefix hits are its leading full blocks whose keys are cached (the first copy of
  each), never the block holding its last token (its logits are needed), stopping at the first
  miss; a hit block on the free queue leaves it, and its reference count grows;
- when a chunk is scheduled (`allocate_slots`: a new request's hits and first chunk, or a
  running one's next chunk), each newly full block it covers gets its key and is cached at once,
  before the forward pass writes its KV, so a request admitted later in the same step hits it:
  one `BlockStored` per call for the run of new blocks, even for a key already cached in another
  block (vLLM does not de-duplicate: both copies are cached, and each gets its `BlockRemoved`);
  the events are published after the step's forward pass (`update_from_output`);
- freeing a request (finished, aborted, preempted) drops one reference from each of its blocks,
  last block first; blocks left unreferenced go to the back of the queue, cached or not, and
  cached ones stay cached (evictable), so the least recently freed is evicted first and a chain's
  tail before its head;
- `reset_prefix_cache` is refused while any block is referenced; otherwise every key is
  forgotten with one `AllBlocksCleared`.

kvplane departs from two rules on purpose (docs/engine.md, Block manager), each an option here:
`uncached_to_front` (a freed block with no key goes to the FRONT of the queue: reused first,
it holds nothing worth keeping) and `one_copy_per_key` (a second copy of a cached key stays
uncached, no event, but stands by: when the cached copy is evicted while the second is still
held, the oldest standby copy takes the key over and nothing is removed).

Events are compared flattened: `("stored", key, parent, tokens)` per block, `("removed", key)`
per key, `("cleared",)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.api import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from indexer.keys import block_keys

FlatEvent = tuple[object, ...]


def flatten(events: Sequence[KvEvent]) -> list[FlatEvent]:
    """The block manager's events one block at a time."""
    flat: list[FlatEvent] = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_key
            size = event.block_size
            for i, key in enumerate(event.block_keys):
                flat.append(
                    ("stored", key, parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                )
                parent = key
        elif isinstance(event, BlockRemoved):
            flat.extend(("removed", key) for key in event.block_keys)
        elif isinstance(event, AllBlocksCleared):
            flat.append(("cleared",))
    return flat


@dataclass
class _Request:
    tokens: Sequence[int]
    salt: str | None
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0


class VllmPrefixCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        uncached_to_front: bool = False,
        one_copy_per_key: bool = False,
    ) -> None:
        self.block_size = block_size
        self.uncached_to_front = uncached_to_front
        self.one_copy_per_key = one_copy_per_key
        self.queue: list[int] = list(range(num_blocks))  # front = next taken
        self.refs = [0] * num_blocks
        self.key_of: dict[int, int] = {}
        self.copies: dict[int, list[int]] = {}  # key -> cached blocks, first = the one hit
        self.standby: dict[int, list[int]] = {}  # key -> uncached held copies, oldest first
        self.requests: dict[int, _Request] = {}
        self.events: list[FlatEvent] = []

    def _keys(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        return block_keys(tokens, self.block_size, cache_salt=salt) if tokens else []

    def cached_keys(self) -> set[int]:
        return set(self.copies)

    def hit_blocks(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        hits: list[int] = []
        for key in self._keys(tokens[:usable], salt):
            if key not in self.copies:
                break
            hits.append(self.copies[key][0])
        return hits

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(
        self, tokens: Sequence[int], num_tokens: int, salt: str | None, use_cache: bool
    ) -> bool:
        hits = self.hit_blocks(tokens, salt) if use_cache else []
        num_new = max(0, self._blocks_for(num_tokens) - len(hits))
        return num_new + sum(1 for b in hits if self.refs[b] == 0) <= len(self.queue)

    def allocate(
        self, rid: int, tokens: Sequence[int], num_tokens: int, salt: str | None, use_cache: bool
    ) -> int:
        """Hits, then `schedule` of its first chunk; returns the number of cached tokens."""
        hits = self.hit_blocks(tokens, salt) if use_cache else []
        request = self.requests[rid] = _Request(tokens, salt)
        for block in hits:
            if self.refs[block] == 0:
                self.queue.remove(block)
            self.refs[block] += 1
            request.blocks.append(block)
        request.num_cached = len(hits)
        self.schedule(rid, max(num_tokens, len(hits) * self.block_size))
        return len(hits) * self.block_size

    def schedule(self, rid: int, num_tokens: int) -> None:
        """`allocate_slots`: slots for the request's tokens up to `num_tokens`, whose full
        blocks are cached now (the forward pass that writes them comes later in the step)."""
        self.grow(rid, num_tokens)
        self._cache(rid, num_tokens)

    def can_grow(self, rid: int, num_tokens: int) -> bool:
        return self._blocks_for(num_tokens) - len(self.requests[rid].blocks) <= len(self.queue)

    def grow(self, rid: int, num_tokens: int) -> None:
        request = self.requests[rid]
        while len(request.blocks) < self._blocks_for(num_tokens):
            block = self.queue.pop(0)
            if block in self.key_of:
                self._evict(block)
            self.refs[block] = 1
            request.blocks.append(block)

    def _evict(self, block: int) -> None:
        key = self.key_of.pop(block)
        self.copies[key].remove(block)
        standby = self.standby.get(key)
        if self.one_copy_per_key and standby:
            heir = standby.pop(0)
            self.key_of[heir] = key
            self.copies[key].append(heir)
            return
        if not self.copies[key]:
            del self.copies[key]
        self.events.append(("removed", key))

    def _cache(self, rid: int, num_tokens: int) -> None:
        request = self.requests[rid]
        size = self.block_size
        num_full = min(num_tokens // size, len(request.blocks))
        keys = self._keys(request.tokens[: num_full * size], request.salt)
        for i in range(request.num_cached, num_full):
            block, key = request.blocks[i], keys[i]
            if self.one_copy_per_key and key in self.copies:
                self.standby.setdefault(key, []).append(block)
                continue
            self.key_of[block] = key
            self.copies.setdefault(key, []).append(block)
            parent = keys[i - 1] if i else None
            self.events.append(
                ("stored", key, parent, tuple(request.tokens[i * size : (i + 1) * size]))
            )
        request.num_cached = max(request.num_cached, num_full)

    def free(self, rid: int) -> None:
        request = self.requests.pop(rid)
        for block in reversed(request.blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            for standby in self.standby.values():
                if block in standby:
                    standby.remove(block)
            if self.uncached_to_front and block not in self.key_of:
                self.queue.insert(0, block)
            else:
                self.queue.append(block)

    def reset(self) -> bool:
        if any(self.refs):
            return False
        self.key_of.clear()
        self.copies.clear()
        self.events.append(("cleared",))
        return True
