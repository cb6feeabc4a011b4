"""Block manager: paired verbs, prefix caching, LRU eviction, KV events, and a state machine
against a naive model (a fake KV store that records which tokens each physical slot holds)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from engine.core import block_manager
from engine.core.api import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium
from engine.core.block_manager import BlockManager
from indexer.keys import block_keys


def assert_keys_chain_from_the_parent(event: BlockStored) -> None:
    """What an index that hashes request tokens relies on: a BlockStored's keys are the
    canonical chain of its tokens from its parent key (from the namespace's root when it has
    none; the salt, as vLLM sends it, in the extra keys of a request's first block only)."""
    salt = None
    if event.extra_keys and event.extra_keys[0] is not None:
        assert event.parent_key is None, "a salt sent with a block that has a parent"
        (_, salt) = event.extra_keys[0]
    assert not any(event.extra_keys[1:])
    chain = block_keys(
        event.token_ids,
        event.block_size,
        lora_name=event.lora_name,
        cache_salt=salt,
        parent=event.parent_key,
    )
    assert event.block_keys == tuple(chain)


def replay(events: list[KvEvent], cached: set[int] | None = None) -> set[int]:
    cached = set() if cached is None else cached
    for event in events:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_keys) * event.block_size
            assert_keys_chain_from_the_parent(event)
            cached.update(event.block_keys)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_keys) <= cached, "removed a key that was never stored"
            cached.difference_update(event.block_keys)
        else:
            cached.clear()
    return cached


def test_allocate_append_free_counts_blocks() -> None:
    bm = BlockManager(8, 4)
    assert bm.can_allocate(list(range(10)), 10)
    assert bm.allocate(1, list(range(10)), 10) == 0
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.can_append(1, 12) and not bm.can_append(1, 33)
    bm.append(1, 13)
    assert len(bm.block_table(1)) == 4
    with pytest.raises(MemoryError):
        bm.append(1, 33)
    bm.free(1)
    bm.free(1)  # freeing twice is harmless
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_hit_reuses_blocks_and_never_covers_the_last_token() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(100, 112))  # 3 full blocks
    bm.allocate(1, prompt, 12)
    bm.cache_blocks(1, prompt, 12)
    events = bm.take_events()
    assert events == [
        BlockStored(
            block_keys=tuple(block_keys(prompt, 4)),
            parent_key=None,
            token_ids=tuple(prompt),
            block_size=4,
            medium=Medium.GPU,
            lora_name=None,
            extra_keys=(None, None, None),
        )
    ]
    # Same 12-token prompt: the last block is recomputed (its last token needs logits).
    assert bm.count_hit_tokens(prompt) == 8
    assert bm.allocate(2, prompt, 12) == 8
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(2)[2] != bm.block_table(1)[2]
    # A longer prompt sharing the prefix gets all three blocks.
    longer = [*prompt, 7, 8]
    assert bm.allocate(3, longer, 14) == 12
    bm.check_invariants()


def test_namespaces_and_bypass_do_not_share_blocks() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(9))
    bm.allocate(1, prompt, 9, cache_salt="a")
    bm.cache_blocks(1, prompt, 9)
    (stored,) = bm.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == (("cache_salt", "a"), None)
    assert stored.block_keys == tuple(block_keys(prompt, 4, cache_salt="a"))
    assert bm.count_hit_tokens(prompt, cache_salt="a") == 8
    assert bm.count_hit_tokens(prompt, cache_salt="b") == 0
    assert bm.count_hit_tokens(prompt) == 0
    assert bm.count_hit_tokens(prompt, lora_name="x", cache_salt="a") == 0
    assert bm.allocate(2, prompt, 9, cache_salt="a", use_cache=False) == 0
    bm.cache_blocks(2, prompt, 9)
    assert bm.take_events() == []  # bypass still caches, but the keys were already cached


def test_dropping_a_lora_namespace_forgets_its_blocks_only() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(9))
    for seq_id, lora_name in ((1, "x"), (2, "y"), (3, None)):
        bm.allocate(seq_id, prompt, 9, lora_name=lora_name)
        bm.cache_blocks(seq_id, prompt, 9)
        bm.free(seq_id)
    x_keys = tuple(block_keys(prompt, 4, lora_name="x"))
    bm.take_events()
    assert bm.drop_lora_blocks("x") == 2
    assert bm.take_events() == [BlockRemoved(x_keys, Medium.GPU)]
    assert bm.count_hit_tokens(prompt, lora_name="x") == 0
    assert bm.count_hit_tokens(prompt, lora_name="y") == 8
    assert bm.count_hit_tokens(prompt) == 8
    assert bm.drop_lora_blocks("x") == 0
    assert bm.take_events() == []
    bm.check_invariants()


def test_blocks_of_a_dropped_lora_still_held_stay_with_their_holder_uncached() -> None:
    # A KV session's scratch table holds a LoRA's prompt blocks (hits only) when the name is
    # dropped: the keys go (BlockRemoved), the blocks stay with the table, which no longer
    # counts them cached; freed, they are reused first and nothing more is recorded.
    bm = BlockManager(8, 4)
    prompt = list(range(9))
    bm.allocate(1, prompt, 9, lora_name="x")
    bm.cache_blocks(1, prompt, 9)
    bm.free(1)
    assert bm.allocate(2, prompt, 8, lora_name="x") == 8  # the scratch table: hits only
    held = list(bm.block_table(2))
    bm.take_events()
    assert bm.drop_lora_blocks("x") == 2
    bm.check_invariants()
    assert bm.block_table(2) == held
    assert bm.num_cached_blocks == 0
    bm.free(2)
    bm.check_invariants()
    assert bm.take_events() == [BlockRemoved(tuple(block_keys(prompt, 4, lora_name="x")))]
    assert bm.num_free_blocks == 8


def test_lru_evicts_least_recently_freed_and_records_removal() -> None:
    bm = BlockManager(4, 2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for seq_id, tokens in ((1, a), (2, b)):
        bm.allocate(seq_id, tokens, 4)
        bm.cache_blocks(seq_id, tokens, 4)
    bm.free(1)
    bm.free(2)
    keys_a, keys_b = block_keys(a, 2), block_keys(b, 2)
    bm.take_events()
    # Touch `a` again (hit, then free): `b` is now least recently used.
    bm.allocate(3, [*a, 9], 5)
    bm.free(3)
    bm.allocate(4, [10, 11, 12, 13], 4)
    events = bm.take_events()
    removed = [k for e in events if isinstance(e, BlockRemoved) for k in e.block_keys]
    # The tail of b goes first (blocks are freed last-first), then its head.
    assert removed == [keys_b[1], keys_b[0]]
    assert bm.cached_keys() >= set(keys_a)
    bm.check_invariants()


def test_a_preempted_sequence_readmitted_hits_the_blocks_its_outputs_filled() -> None:
    # Its token list (the same object) grew while it ran; asked about again with no other
    # list in between, its hits cover the blocks its outputs filled, not only its prompt's.
    bm = BlockManager(8, 2)
    tokens = [1, 1, 2, 2, 9]
    assert bm.count_hit_tokens(tokens) == 0
    bm.allocate(1, tokens, 5)
    bm.cache_blocks(1, tokens, 5)
    tokens += [5, 6]  # two outputs: the block [9, 5] is full
    bm.append(1, 7)
    bm.cache_blocks(1, tokens, 7)
    bm.free(1)  # preempted
    assert bm.count_hit_tokens(tokens) == 6
    assert bm.can_allocate(tokens, 7)
    assert bm.allocate(1, tokens, 7) == 6
    bm.check_invariants()


def test_a_block_that_loses_its_key_is_reused_before_any_cached_block_is_evicted() -> None:
    # Once a free block holds nothing worth keeping (its LoRA's blocks dropped, or the failed
    # step that was to write it), it goes to the head of the free list, as a freed block
    # without a key does: the next allocation takes it, not a cached block's.
    def drop_lora(bm: BlockManager) -> None:
        assert bm.drop_lora_blocks("old") == 1

    def fail_step(bm: BlockManager) -> None:
        bm.discard_scheduled()

    for lose_key, lora in ((drop_lora, "old"), (fail_step, None)):
        bm = BlockManager(3, 2)
        bm.allocate(1, [1, 1, 9], 3)
        bm.cache_blocks(1, [1, 1, 9], 3)
        bm.free(1)
        bm.allocate(2, [5, 5, 9], 3, lora_name=lora)
        bm.cache_blocks(2, [5, 5, 9], 3, scheduled=lora is None)
        bm.free(2)  # aborted while its step runs, for the failed one
        lose_key(bm)
        cached = bm.cached_keys()
        assert cached == set(block_keys([1, 1], 2))
        bm.allocate(3, [7, 7, 7], 3)  # two blocks: both free blocks that hold no key
        assert bm.cached_keys() == cached, lose_key.__name__
        bm.check_invariants()


def test_a_lookup_remembered_across_evictions_serves_only_what_is_cached_now() -> None:
    # The scheduler asks about a waiting head's token list at every step until it fits; what
    # the block manager remembers of that list must follow the evictions and stores made in
    # between by running sequences (growing, computing), which ask about no other list.
    bm = BlockManager(6, 2)
    bm.allocate(2, [7] * 8, 2)  # runs; grows later
    computing = [1, 2, 3, 4, 6]
    bm.allocate(4, computing, 4)  # runs; computes the shared prefix later
    bm.allocate(1, [1, 2, 3, 4, 5], 5)
    bm.cache_blocks(1, [1, 2, 3, 4, 5], 5)
    bm.free(1)  # its two full blocks stay cached, evictable
    waiting = [1, 2, 3, 4, 9]  # one list object throughout, as a waiting sequence's
    assert bm.count_hit_tokens(waiting) == 4
    bm.append(2, 8)  # takes every free block: both cached ones are evicted
    assert bm.count_hit_tokens(waiting) == 0
    assert not bm.can_allocate(waiting, 5)
    bm.cache_blocks(4, computing, 4)  # the same prefix stored again, in other blocks
    assert bm.count_hit_tokens(waiting) == 4
    stored = list(bm.block_table(4))
    bm.free(4)
    bm.free(2)
    assert bm.allocate(5, waiting, 5) == 4
    assert bm.block_table(5)[:2] == stored
    bm.check_invariants()


def test_a_key_collision_never_serves_another_prompts_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Keys made to collide: every prompt's block i gets the same key.
    def colliding_keys(tokens: Sequence[int], size: int, **_: object) -> list[int]:
        return list(range(1, len(tokens) // size + 1))

    monkeypatch.setattr(block_manager, "block_keys", colliding_keys)
    bm = BlockManager(8, 2)
    bm.allocate(1, [1, 2, 3, 4, 5], 5)
    bm.cache_blocks(1, [1, 2, 3, 4, 5], 5)
    bm.free(1)
    other = [1, 2, 6, 6, 5]  # block 0 really matches, block 1 only by its colliding key
    assert bm.count_hit_tokens(other) == 2
    assert bm.count_hit_tokens([1, 2, 3, 4, 5], cache_salt="s") == 0  # namespace differs
    assert bm.allocate(2, other, 5) == 2
    bm.check_invariants()


def test_a_duplicate_still_held_keeps_the_key_cached_when_the_first_copy_is_evicted() -> None:
    # Two sequences compute the same prompt at once; the first caches it, the second's copy
    # is private. The first ends and its copy is evicted while the second still runs: vLLM
    # keeps the hash (it caches both copies); the second copy must take the key over, or the
    # prefix is lost and the second sequence's next block is stored under a parent that no
    # longer exists.
    bm = BlockManager(6, 2)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate(1, prompt, 5)
    running = list(prompt)
    bm.allocate(2, running, 5)
    bm.cache_blocks(1, prompt, 5)
    bm.cache_blocks(2, running, 5)
    cached = replay(bm.take_events())
    assert cached == set(block_keys(prompt, 2))
    bm.free(1)
    bm.allocate(3, [9] * 6, 6)  # takes the three free blocks: evicts the first copy
    assert not any(isinstance(e, BlockRemoved) for e in bm.take_events())
    assert bm.cached_keys() == cached
    assert bm.count_hit_tokens(prompt) == 4
    running.append(6)  # the second sequence decodes into its third block
    bm.cache_blocks(2, running, 6)
    (stored,) = bm.take_events()
    assert isinstance(stored, BlockStored) and stored.parent_key in cached
    bm.check_invariants()
    second_copy = bm.block_table(2)[:2]
    bm.free(2)
    assert bm.allocate(4, prompt, 5) == 4
    assert bm.block_table(4)[:2] == second_copy
    bm.check_invariants()


def scheduled_with_a_same_step_hit(prompt: list[int]) -> BlockManager:
    """Sequence 1 is scheduled to compute `prompt`; sequence 2, admitted after it in the same
    step, takes its full blocks (but the last token's) as hits."""
    bm = BlockManager(8, 2)
    bm.allocate(1, prompt, len(prompt))
    bm.cache_blocks(1, prompt, len(prompt), scheduled=True)
    hits = (len(prompt) - 1) // 2 * 2
    assert bm.count_hit_tokens(prompt) == hits
    assert bm.allocate(2, list(prompt), len(prompt)) == hits
    bm.cache_blocks(2, prompt, len(prompt), scheduled=True)  # nothing new: its hits are cached
    return bm


def test_a_scheduled_block_is_a_hit_at_once_and_announced_once_its_pass_has_run() -> None:
    # vLLM v1 caches a block when the chunk that fills it is scheduled: a sequence admitted
    # later in the same step hits it (the forward pass writes it before attention reads it).
    prompt = [1, 2, 3, 4, 5]
    bm = scheduled_with_a_same_step_hit(prompt)
    assert bm.take_events() == []  # held until the pass has run
    bm.commit_scheduled()
    (stored,) = bm.take_events()
    assert isinstance(stored, BlockStored) and stored.block_keys == tuple(block_keys(prompt, 2))
    bm.check_invariants()


def test_a_failed_step_takes_its_scheduled_blocks_back_out_unannounced() -> None:
    prompt = [1, 2, 3, 4, 5]
    bm = scheduled_with_a_same_step_hit(prompt)
    bm.allocate(3, [7, 7, 7], 3)  # an event recorded behind the held ones stays
    bm.cache_blocks(3, [7, 7, 7], 3)
    # The pass raised: no block of it holds KV. The sequence that hit them keeps none.
    assert bm.discard_scheduled() == {1: 0, 2: 0}
    assert bm.count_hit_tokens(prompt) == 0
    assert bm.cached_keys() == set(block_keys([7, 7], 2))
    assert replay(bm.take_events()) == bm.cached_keys()
    bm.check_invariants()
    bm.free(2)
    bm.free(1)
    bm.check_invariants()


def test_a_failed_step_removes_a_key_its_unwritten_standby_took_over() -> None:
    # A key cached (and announced) before the step; a sequence computes it again in the step
    # (its copy a standby), and the announced copy is evicted: the standby takes the key over.
    # If the pass fails, that copy holds no KV: the key is removed, and said so.
    bm = BlockManager(4, 2)
    prompt = [1, 2, 9]
    bm.allocate(1, prompt, 3)
    bm.cache_blocks(1, prompt, 3)
    (key,) = replay(bm.take_events())
    bm.allocate(2, prompt, 3, use_cache=False)
    bm.cache_blocks(2, prompt, 3, scheduled=True)  # its copy stands by
    bm.free(1)
    bm.allocate(3, [7, 7, 7], 3)  # evicts the announced copy: the standby takes over
    assert bm.cached_keys() == {key}
    assert bm.discard_scheduled() == {2: 0}
    assert bm.cached_keys() == set()
    assert bm.take_events() == [BlockRemoved((key,), Medium.GPU)]
    bm.check_invariants()


def test_reset_prefix_cache_refused_while_blocks_are_used() -> None:
    bm = BlockManager(4, 2)
    bm.allocate(1, [1, 2, 3], 3)
    bm.cache_blocks(1, [1, 2, 3], 3)
    assert not bm.reset_prefix_cache()
    bm.free(1)
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert isinstance(bm.take_events()[-1], AllBlocksCleared)


def test_snapshot_lists_parents_first_and_replays_to_the_cached_set() -> None:
    bm = BlockManager(32, 2)
    for seq_id, tokens in enumerate(([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9], [7, 7, 7])):
        bm.allocate(seq_id, tokens, len(tokens))
        bm.cache_blocks(seq_id, tokens, len(tokens))
    snapshot = bm.snapshot()
    seen: set[int] = set()
    for event in snapshot:
        assert event.parent_key is None or event.parent_key in seen
        seen.update(event.block_keys)
    assert replay(list(snapshot)) == bm.cached_keys() == replay(bm.take_events())


def test_a_prefix_recomputed_under_its_cached_descendants_is_announced_run_by_run() -> None:
    # A prefix's first block evicted while its next ones stay cached: they were computed by a
    # sequence that bypassed the cache (its first block a private copy), freed after the
    # first block's holder. A sequence that computes the prefix again stores its first block
    # and the block after the cached ones: two runs, each under its own parent, and a
    # snapshot lists the first block before the descendants that outlived it.
    bm = BlockManager(7, 2)
    prefix = [1, 1, 2, 2, 3, 3]
    k0, k1, k2, k3 = block_keys([*prefix, 4, 4], 2)
    bm.allocate(1, [1, 1, 9], 3)
    bm.cache_blocks(1, [1, 1, 9], 3)
    bm.free(1)
    bm.allocate(2, [*prefix, 9], 7, use_cache=False)
    bm.cache_blocks(2, [*prefix, 9], 7)
    bm.free(2)
    bm.allocate(3, [7] * 9, 9)  # evicts the first block only
    bm.free(3)
    assert bm.cached_keys() == {k1, k2}
    bm.take_events()
    tokens = [*prefix, 4, 4, 9]
    assert bm.allocate(4, tokens, 9) == 0
    bm.cache_blocks(4, tokens, 9)
    stored = bm.take_events()
    assert [(e.block_keys, e.parent_key) for e in stored if isinstance(e, BlockStored)] == [
        ((k0,), None),
        ((k3,), k2),
    ]
    replay(stored)
    seen: set[int] = set()
    for event in bm.snapshot():
        assert event.parent_key is None or event.parent_key in seen
        seen.update(event.block_keys)
    assert seen == {k0, k1, k2, k3}
    bm.check_invariants()


# ------------------------------------------------------------------------------ state machine

BLOCK_SIZE = 2
NUM_BLOCKS = 10
PREFIXES: tuple[list[int], ...] = ([], [1, 1, 2, 2], [1, 1, 2, 3], [3, 3, 3, 3, 3, 3])


class BlockManagerMachine(RuleBasedStateMachine):
    """Steps as the scheduler makes them: chunks are scheduled (their full blocks cached at
    once, hits for the sequences admitted after them in the same step), then the step's forward
    pass writes every chunk's tokens into the fake KV store before any hit is read, or fails
    and writes nothing. A hit must always read its own tokens."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # a sequence's full future token list
        self.namespace: dict[int, str | None] = {}
        self.computed: dict[int, int] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.replayed: set[int] = set()
        # The step being scheduled: each sequence's chunk [start, end).
        self.chunks: dict[int, tuple[int, int]] = {}
        # The last token list refused for lack of blocks: retried like a waiting head, with the
        # same list object, after the cache changed under it.
        self.refused: tuple[list[int], str | None] | None = None

    def _schedule(self, seq_id: int, start: int, end: int) -> None:
        self.chunks[seq_id] = (start, end)
        self.bm.cache_blocks(seq_id, self.tokens[seq_id], end, scheduled=True)

    @rule(
        target=seqs,
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=8),
        salt=st.sampled_from([None, None, "s"]),
        use_cache=st.booleans(),
        chunk=st.integers(1, 12),
        retry=st.booleans(),
    )
    def new_sequence(
        self,
        *,
        prefix: list[int],
        suffix: list[int],
        salt: str | None,
        use_cache: bool,
        chunk: int,
        retry: bool,
    ) -> int | None:
        tokens = prefix + suffix
        if retry and self.refused is not None:
            tokens, salt = self.refused
        seq_id = self.next_id
        self.next_id += 1
        # The naive model of a hit: leading full blocks whose keys are cached (never the one
        # holding the last token).
        cached_prefix = 0
        cached = self.bm.cached_keys()
        for key in block_keys(tokens, BLOCK_SIZE, cache_salt=salt)[
            : (len(tokens) - 1) // BLOCK_SIZE
        ]:
            if key not in cached:
                break
            cached_prefix += BLOCK_SIZE
        assert self.bm.count_hit_tokens(tokens, cache_salt=salt) == cached_prefix
        expected = cached_prefix if use_cache else 0
        num = min(len(tokens), expected + chunk)
        if not self.bm.can_allocate(tokens, num, cache_salt=salt, use_cache=use_cache):
            with pytest.raises(MemoryError):
                self.bm.allocate(seq_id, tokens, num, cache_salt=salt, use_cache=use_cache)
            self.refused = (tokens, salt)
            return None
        if self.refused is not None and self.refused[0] is tokens:
            self.refused = None
        hit = self.bm.allocate(seq_id, tokens, num, cache_salt=salt, use_cache=use_cache)
        assert hit == expected
        self.tokens[seq_id] = tokens
        self.namespace[seq_id] = salt
        self.computed[seq_id] = hit
        self._schedule(seq_id, hit, num)
        return seq_id

    @precondition(lambda self: bool(self.tokens))
    @rule(seq=seqs, more=st.integers(1, 5), generated=st.lists(st.integers(0, 3), max_size=3))
    def extend(self, seq: int | None, more: int, generated: list[int]) -> None:
        if seq not in self.tokens or seq in self.chunks:
            return
        self.tokens[seq].extend(generated)
        target = min(len(self.tokens[seq]), self.computed[seq] + more)
        if not self.bm.can_append(seq, target):
            with pytest.raises(MemoryError):
                self.bm.append(seq, target)
            return
        self.bm.append(seq, target)
        self._schedule(seq, self.computed[seq], target)

    @rule()
    def run_step(self) -> None:
        """The forward pass: every layer writes the step's tokens, then attention reads."""
        for seq_id, (start, end) in self.chunks.items():
            table = self.bm.block_table(seq_id)
            for pos in range(start, end):
                block = table[pos // BLOCK_SIZE]
                self.slots[(block, pos % BLOCK_SIZE)] = self.tokens[seq_id][pos]
        for seq_id, (start, _) in self.chunks.items():  # what attention reads: its own tokens
            table = self.bm.block_table(seq_id)
            for pos in range(start):
                slot = (table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                assert self.slots.get(slot) == self.tokens[seq_id][pos]
        for seq_id, (_, end) in self.chunks.items():
            self.computed[seq_id] = end
        self.chunks.clear()
        self.bm.commit_scheduled()

    @rule()
    def fail_step(self) -> None:
        """The forward pass raises: nothing is written. A sequence that hit blocks of the
        step is preempted (the scheduler's `discard_step`), the others stay as they were."""
        kept = self.bm.discard_scheduled()
        for seq_id, num_kept in kept.items():
            if num_kept < self.computed[seq_id]:
                self._forget(seq_id)
        self.chunks.clear()

    @rule(seq=consumes(seqs))
    def free(self, seq: int | None) -> None:
        """Finished, aborted or preempted: between steps, or while scheduling one a sequence
        not scheduled in it (the scheduler preempts only those)."""
        if seq in self.tokens and seq not in self.chunks:
            self._forget(seq)

    def _forget(self, seq: int) -> None:
        self.bm.free(seq)
        del self.tokens[seq], self.computed[seq], self.namespace[seq]

    @rule()
    def reset(self) -> None:
        assert self.bm.reset_prefix_cache() == (not self.tokens)

    @invariant()
    def structure_holds(self) -> None:
        self.bm.check_invariants()
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == NUM_BLOCKS
        used = {b for s in self.tokens for b in self.bm.block_table(s)}
        assert len(used) == self.bm.num_used_blocks

    @invariant()
    def events_replay_to_the_cached_set(self) -> None:
        """Between steps, the events announce exactly the cached keys (never a block whose
        KV a failed step did not write)."""
        if not self.chunks:
            replay(self.bm.take_events(), self.replayed)
            assert self.replayed == self.bm.cached_keys()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
