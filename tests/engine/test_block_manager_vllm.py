"""The block manager against vLLM's prefix-cache rules (`vllm_prefix_cache.py`): the same
hypothesis-generated schedules (steps of admissions with prefix hits, the blocks scheduled
earlier in the same step included, chunked prefill, two sequences computing the same prefix at
once, decodes filling blocks, finishes, aborts and preemptions, resets) drive both, and their KV
events (taken after each step's forward pass) and prefix hits must agree.

- Under eviction pressure against the model with kvplane's two intended departures from vLLM
  (uncached blocks freed to the front, one cached copy per key with standby copies): the
  event streams, block by block, and every admission's cached tokens are equal.
- With a pool that never evicts, against vLLM's own rules: both copies of a duplicate are
  cached there, so its stream is compared without the stores of second copies; the rest must
  be equal.
- In both, a BlockStored's parent is cached when the block is stored (an index that follows
  the chain from the root can reach it).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from engine.core.block_manager import BlockManager
from tests.engine.vllm_prefix_cache import FlatEvent, VllmPrefixCache, flatten

BLOCK_SIZE = 2
PREFIXES: tuple[list[int], ...] = ([], [1, 1, 2, 2], [1, 1, 2, 3], [3, 3, 3, 3, 3, 3])


def first_copies(events: list[FlatEvent], live: set[object]) -> list[FlatEvent]:
    """vLLM's per-copy stream (of a pool that never evicts) as a per-key one: the first store
    of a key, not its later copies."""
    out: list[FlatEvent] = []
    for event in events:
        if event[0] == "stored":
            if event[1] in live:
                continue
            live.add(event[1])
        else:
            assert event[0] == "cleared", "the pool must never evict here"
            live.clear()
        out.append(event)
    return out


class _Differential(RuleBasedStateMachine):
    NUM_BLOCKS = 10
    KVPLANE_DEPARTURES = True

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BLOCK_SIZE)
        departures = self.KVPLANE_DEPARTURES
        self.vllm = VllmPrefixCache(
            self.NUM_BLOCKS,
            BLOCK_SIZE,
            uncached_to_front=departures,
            one_copy_per_key=departures,
        )
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}  # tokens the sequence has blocks for
        self.computed: dict[int, int] = {}
        self.in_step: set[int] = set()  # the sequences scheduled in the step not yet run
        self.live: set[object] = set()  # keys the events so far leave cached (ours)
        self.vllm_keys: set[object] = set()  # keys vLLM's events so far stored

    @rule(
        target=seqs,
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        salt=st.sampled_from([None, None, "s"]),
        use_cache=st.booleans(),
        chunk=st.integers(1, 8),
    )
    def admit(
        self, *, prefix: list[int], suffix: list[int], salt: str | None, use_cache: bool, chunk: int
    ) -> int | None:
        tokens = prefix + suffix
        hit = self.bm.count_hit_tokens(tokens, cache_salt=salt)
        assert hit == len(self.vllm.hit_blocks(tokens, salt)) * BLOCK_SIZE
        num = min(len(tokens), (hit if use_cache else 0) + chunk)
        fits = self.bm.can_allocate(tokens, num, cache_salt=salt, use_cache=use_cache)
        assert fits == self.vllm.can_allocate(tokens, num, salt, use_cache)
        if not fits:
            return None
        seq_id = self.next_id
        self.next_id += 1
        cached = self.bm.allocate(seq_id, tokens, num, cache_salt=salt, use_cache=use_cache)
        self.bm.cache_blocks(seq_id, tokens, num, scheduled=True)  # as the scheduler does
        assert cached == self.vllm.allocate(seq_id, tokens, num, salt, use_cache)
        self.tokens[seq_id], self.slots[seq_id], self.computed[seq_id] = tokens, num, cached
        self.in_step.add(seq_id)
        return seq_id

    @rule()
    def run_step(self) -> None:
        """The step's forward pass runs: the KV of every scheduled chunk is written."""
        for seq in self.in_step:
            self.computed[seq] = self.slots[seq]
        self.in_step.clear()
        self.bm.commit_scheduled()

    @rule(seq=seqs, more=st.integers(1, 5), sampled=st.integers(0, 3))
    def schedule_next(self, seq: int | None, more: int, sampled: int) -> None:
        """The next chunk of a prefill, or a decode of the token just sampled."""
        if seq not in self.tokens or seq in self.in_step:
            return
        tokens = self.tokens[seq]
        if self.computed[seq] == len(tokens):
            tokens.append(sampled)
        target = min(len(tokens), self.computed[seq] + more)
        fits = self.bm.can_append(seq, target)
        assert fits == self.vllm.can_grow(seq, target)
        if fits:
            self.bm.append(seq, target)
            self.bm.cache_blocks(seq, tokens, target, scheduled=True)
            self.vllm.schedule(seq, target)
            self.slots[seq] = target
            self.in_step.add(seq)

    @rule(seq=consumes(seqs))
    def free(self, seq: int | None) -> None:
        """Finished, aborted (maybe mid-prefill) or preempted: the same at the block level.
        Between steps, or while scheduling one a sequence not scheduled in it (the
        scheduler preempts only those)."""
        if seq not in self.tokens or seq in self.in_step:
            return
        self.bm.free(seq)
        self.vllm.free(seq)
        del self.tokens[seq], self.slots[seq], self.computed[seq]

    @rule()
    def reset(self) -> None:
        assert self.bm.reset_prefix_cache() == self.vllm.reset()

    @invariant()
    def same_events_and_cache(self) -> None:
        self.bm.check_invariants()
        assert self.bm.cached_keys() == self.vllm.cached_keys()
        if self.in_step:
            return  # the events of the step's blocks are taken after its forward pass
        ours = flatten(self.bm.take_events())
        theirs, self.vllm.events = self.vllm.events, []
        if not self.KVPLANE_DEPARTURES:
            theirs = first_copies(theirs, self.vllm_keys)
        assert ours == theirs
        for event in ours:
            if event[0] == "stored":
                assert event[2] is None or event[2] in self.live, "stored under a parent not cached"
                self.live.add(event[1])
            elif event[0] == "removed":
                self.live.discard(event[1])
            else:
                self.live.clear()
        assert self.live == self.bm.cached_keys() == self.vllm.cached_keys()


class KvplaneRulesUnderPressure(_Differential):
    NUM_BLOCKS = 10
    KVPLANE_DEPARTURES = True


class VllmRulesWithoutEviction(_Differential):
    NUM_BLOCKS = 2000
    KVPLANE_DEPARTURES = False


TestKvplaneRulesUnderPressure = KvplaneRulesUnderPressure.TestCase
TestKvplaneRulesUnderPressure.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
TestVllmRulesWithoutEviction = VllmRulesWithoutEviction.TestCase
TestVllmRulesWithoutEviction.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None
)
