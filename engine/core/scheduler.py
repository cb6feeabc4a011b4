"""Continuous batching with chunked prefill, priorities and preemption by recompute.

Each step (`schedule`) spends a token budget (`max_num_batched_tokens`):
1. Running sequences first, highest (effective) priority first, FCFS within a level: each gets
   all its uncomputed tokens (one for a decode, the rest of its prompt for a prefill) capped by
   what is left of the budget. When the pool cannot hold them, the lowest-priority,
   latest-arrived running sequence is preempted (blocks freed, `num_computed_tokens` reset; it
   goes back to the front of its level's queue) until it fits; a sequence whose next chunk
   needs more blocks than the whole pool is finished as out of capacity, one short only of
   blocks that KV sessions hold is preempted too (it waits for their release).
2. Then waiting sequences, while seats (`max_num_seqs`) and budget remain and nothing was
   preempted this step: the waiting queue's best head (below) takes its prefix hits and slots
   for its first chunk. If the pool cannot hold that chunk, admission stops (head-of-line: a
   big prompt is not overtaken forever by small ones); with nothing running, the head waits
   for KV sessions to release their blocks, or is out of capacity if the chunk is larger than
   the pool. With nothing running, a head whose chunk fits but whose context so far does not
   (its prefix not cached: `bypass_prefix_cache`, caching off) waits likewise, rather than be
   admitted, preempted at the chunk that reaches the sessions' blocks, and recomputed again.
   A head whose request holds pulled KV not yet imported (`HeldKv`: a DECODE engine's, pulled
   while the pool was full) is admitted once the pool holds those blocks and its first chunk
   after them; they are imported then, and count as its prefix hits.

A scheduled chunk's full blocks enter the prefix cache at once (`BlockManager.cache_blocks`,
Scheduled blocks), as in vLLM v1: a sequence admitted later in the same step finds them as
prefix hits, and the forward pass computes them for both. If that pass fails, `discard_step`
takes them back out.

Waiting order: larger priority first, FCFS within a priority (one FIFO per level, so picking
is O(number of levels)). No starvation: with `aging_s` set, a sequence's effective priority
grows by one level per `aging_s` seconds since its arrival, so any sequence eventually outranks
newer high-priority arrivals, both for admission and when choosing whom to preempt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from engine.core.api import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence, SequenceStatus


class ScheduledWork(NamedTuple):
    """One sequence's share of a step (a named tuple: built for every sequence of every step;
    see `engine.core.api`)."""

    sequence: Sequence
    num_new_tokens: int


class HeldKv(Protocol):
    """Pulled KV held for waiting requests, imported as they are admitted (`EngineCore`)."""

    def held_kv_tokens(self, seq: Sequence) -> int:
        """The prompt tokens whose KV is held for `seq`'s request (0: none)."""
        ...

    def import_held_kv(self, seq: Sequence) -> None:
        """Import it into the prefix cache: the pool has room for it now."""
        ...


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_capacity: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix hits of the sequences admitted this step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(w.num_new_tokens for w in self.scheduled)


class Scheduler:
    """Owns the waiting queues and the running set; not thread-safe."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, held_kv: HeldKv | None = None
    ) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.config = config
        self.block_manager = block_manager
        self._held_kv = held_kv
        self._waiting: dict[int, deque[Sequence]] = {}  # priority level -> FIFO
        self._num_waiting = 0
        self.running: list[Sequence] = []
        # The sequences whose prefix hits the last `schedule` recorded (first admissions).
        self._first_admitted: list[Sequence] = []

    # ---------------------------------------------------------------- queue

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def waiting(self) -> list[Sequence]:
        return [s for level in self._waiting.values() for s in level]

    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, sequence: Sequence) -> None:
        sequence.status = SequenceStatus.WAITING
        self._waiting.setdefault(sequence.priority, deque()).append(sequence)
        self._num_waiting += 1

    def _effective_priority(self, sequence: Sequence, now_s: float) -> float:
        if self.config.aging_s is None:
            return sequence.priority
        waited_s = max(0.0, now_s - sequence.arrival_s)
        return sequence.priority + waited_s // self.config.aging_s

    def _peek_best(self, now_s: float) -> Sequence | None:
        best: Sequence | None = None
        best_rank: tuple[float, int] | None = None
        for level in self._waiting.values():
            if not level:
                continue
            head = level[0]
            rank = (-self._effective_priority(head, now_s), head.arrival_order)
            if best_rank is None or rank < best_rank:
                best, best_rank = head, rank
        return best

    def _pop(self, sequence: Sequence) -> None:
        level = self._waiting[sequence.priority]
        if level and level[0] is sequence:
            level.popleft()
        else:
            level.remove(sequence)
        if not level:
            del self._waiting[sequence.priority]
        self._num_waiting -= 1

    def remove(self, sequence: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if sequence.status is SequenceStatus.WAITING:
            self._pop(sequence)
        elif sequence.status is SequenceStatus.RUNNING:
            self.running.remove(sequence)
        sequence.status = SequenceStatus.FINISHED
        self.block_manager.free(sequence.seq_id)

    def forget(self, sequence: Sequence) -> None:
        """Take a sequence out wherever it is, whatever its status says (its request's end
        raised partway, see `EngineCore.abort`), and free its blocks."""
        if sequence in self.running:
            self.running.remove(sequence)
        for priority, level in list(self._waiting.items()):
            if sequence in level:
                level.remove(sequence)
                self._num_waiting -= 1
                if not level:
                    del self._waiting[priority]
        sequence.status = SequenceStatus.FINISHED
        self.block_manager.free(sequence.seq_id)

    # ---------------------------------------------------------------- one step

    def schedule(self, now_s: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        self._first_admitted.clear()
        self.running.sort(key=lambda s: (-self._effective_priority(s, now_s), s.arrival_order))
        kept: list[Sequence] = []
        pending = deque(self.running)  # not yet given work this step, best first
        while pending and budget > 0:
            seq = pending.popleft()
            num_new = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + num_new
            while not bm.can_append(seq.seq_id, target):
                if pending:
                    self._preempt(pending.pop(), out)
                    continue
                if kept or not self._beyond_pool(target):
                    # The blocks it lacks are held by sequences already scheduled, or by KV
                    # sessions: yield this one until they are free.
                    self._preempt(seq, out)
                else:  # alone and still too big for the whole pool
                    out.out_of_capacity.append(seq)
                break
            else:
                bm.append(seq.seq_id, target)
                self._cache_scheduled(seq, target)
                out.scheduled.append(ScheduledWork(seq, num_new))
                kept.append(seq)
                budget -= num_new
        # Sequences left in `pending` ran out of budget; they stay running, unscheduled.
        # Out-of-capacity sequences stay listed until the core finishes them (`remove`).
        self.running = [*kept, *pending, *out.out_of_capacity]
        if not out.preempted:
            budget = self._admit(now_s, budget, out)
        return out

    def _admit(self, now_s: float, budget: int, out: SchedulerOutput) -> int:
        bm = self.block_manager
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_best(now_s)
            if seq is None:
                break
            request = seq.request
            use_cache = seq.use_prefix_cache
            num_hit = bm.count_hit_tokens(
                seq.token_ids, lora_name=request.lora_name, cache_salt=request.cache_salt
            )
            num_hit = num_hit if use_cache else 0
            num_held = self._held_kv.held_kv_tokens(seq) if self._held_kv is not None else 0
            # Its hits once its held KV is imported: it waits until they and its chunk fit.
            num_new = min(seq.num_tokens - max(num_hit, num_held), budget)
            ok = self._can_allocate(seq, max(num_hit, num_held) + num_new)
            if ok and num_held:  # imported (what is not cached yet), and no longer held
                assert self._held_kv is not None
                self._held_kv.import_held_kv(seq)
                num_hit = bm.count_hit_tokens(
                    seq.token_ids, lora_name=request.lora_name, cache_salt=request.cache_salt
                )
                num_new = min(seq.num_tokens - num_hit, budget)
                ok = self._can_allocate(seq, num_hit + num_new)  # short only if the import failed
            if not ok:
                if not self.running and self._beyond_pool(num_hit + num_new):
                    out.out_of_capacity.append(seq)
                # Else it waits: for running sequences to end, or KV sessions to be released.
                break
            if not self.running and not self._fits_alone(seq):
                # Its chunk fits, its context does not: alone, it would be preempted at the
                # chunk that reaches the blocks KV sessions hold, admitted again, and so on,
                # recomputing it pass after pass. It waits for their release instead.
                break
            num_cached = bm.allocate(
                seq.seq_id,
                seq.token_ids,
                num_hit + num_new,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt,
                use_cache=use_cache,
            )
            self._pop(seq)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            self._cache_scheduled(seq, num_cached + num_new)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                self._first_admitted.append(seq)
            out.num_cached_tokens += num_cached
            self.running.append(seq)
            out.scheduled.append(ScheduledWork(seq, num_new))
            budget -= num_new
        return budget

    def _cache_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """Its chunk is scheduled: the full blocks of its first `num_tokens` tokens are
        prefix hits from now on, for the sequences admitted after it in this very step too."""
        if seq.caches_blocks:
            self.block_manager.cache_blocks(seq.seq_id, seq.token_ids, num_tokens, scheduled=True)

    def discard_step(self) -> list[Sequence]:
        """The forward pass of the last `schedule` did not run (it raised): the blocks its
        chunks were to fill leave the prefix cache, and the sequences that took some of them as
        prefix hits are preempted (returned), to compute them when admitted again (their hits
        never served, a first admission's are not reported). The others compute the chunk
        again at the next step, the block it was to fill too (their own: it holds their
        tokens computed before it)."""
        kept = self.block_manager.discard_scheduled()
        size = self.block_manager.block_size
        out = SchedulerOutput()
        for seq in self.running[::-1]:  # each goes to its queue's front: keep their order
            # A hit on an unwritten block: a whole one among the tokens it counts computed.
            if kept.get(seq.seq_id, seq.num_computed_tokens) + size <= seq.num_computed_tokens:
                self.running.remove(seq)
                self._preempt(seq, out)
        for seq in self._first_admitted:
            if seq in out.preempted:
                seq.num_cached_tokens = None
        self._first_admitted.clear()
        return out.preempted

    def _can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        request = seq.request
        return self.block_manager.can_allocate(
            seq.token_ids,
            num_tokens,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            use_cache=seq.use_prefix_cache,
        )

    def _beyond_pool(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens need more blocks than the whole pool has: the only
        reason to finish a sequence as out of capacity. Blocks it lacks with nothing else
        running are held by KV sessions, which are released in time."""
        return self.block_manager.blocks_for(num_tokens) > self.block_manager.num_blocks

    def _fits_alone(self, seq: Sequence) -> bool:
        """Whether the free blocks (and its prefix hits) hold all of `seq`'s tokens so far, or
        nothing would: a context larger than the whole pool runs until it is out of capacity."""
        return self._beyond_pool(seq.num_tokens) or self._can_allocate(seq, seq.num_tokens)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.setdefault(seq.priority, deque()).appendleft(seq)
        self._num_waiting += 1
        out.preempted.append(seq)
