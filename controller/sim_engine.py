"""A small discrete-event model of one vLLM-style engine in virtual time, for trace replay.

The contract (the same defaults as Dynamo's mocker, so results compare, BENCHMARKS.md sec. 2):
- Scheduling per forward pass: running requests first (decodes take one token, prefills a
  chunk), then waiting requests in arrival order, within 256 sequences and 8,192 tokens per
  pass (chunked prefill). A request added mid-pass starts at the next pass boundary.
- KV cache of `num_blocks` blocks: prefix caching of full blocks (a block becomes a cache hit
  once computed), LRU eviction of unreferenced blocks (a finished request's blocks are freed
  tail first, so its prefix outlives its tail), preemption by recompute of the newest running
  request when a block cannot be allocated.
- A pass lasts P(new prompt tokens in it) + D, P only when it prefills, D only when some
  request decodes; P(x) = 4.209989e-7 x^2 + 0.01518344 x + 16.50142 ms,
  D = max(1, -25.74 u^2 + 54.01 u + 5.74) ms, u = decoding context tokens / capacity, <= 1.
- Cached tokens: full blocks only, at least one prompt token always computed.

Prompt blocks are identified by the trace's chained hash ids; the partial last prompt block
and generated blocks get fresh negative ids (they occupy the cache but never hit).

This is a stand-in for the engine's own sim runner in virtual time; it is pure Python with no
I/O, and notifies first tokens and finishes through a list the caller drains.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

# The one timing model of the field (Dynamo's mocker), shared with the engine's sim runner.
from engine.core.sim_runner import TimingModel


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    num_blocks: int = 2048
    block_size: int = 512
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    timing: TimingModel = field(default_factory=TimingModel)


class Note(enum.Enum):
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"


@dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival_ms: float
    num_prompt_tokens: int
    num_output_tokens: int
    # Chained ids of the prompt's full blocks.
    block_keys: tuple[int, ...]
    # Filled in by the engine.
    cached_tokens: int | None = None
    first_token_ms: float | None = None
    finish_ms: float | None = None
    num_generated: int = 0
    num_computed: int = 0
    num_preemptions: int = 0
    blocks: list[int] = field(default_factory=list)
    # Leading blocks already announced as computed (so each pass marks only new ones).
    num_marked: int = 0

    @property
    def num_target_tokens(self) -> int:
        """Tokens to compute before the next token can be sampled (recompute includes the
        tokens generated before a preemption)."""
        return self.num_prompt_tokens + max(self.num_generated - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_target_tokens


class SimEngine:
    def __init__(self, engine_id: str, config: SimEngineConfig) -> None:
        self.engine_id = engine_id
        self.config = config
        self.clock_ms = 0.0
        self.busy_ms = 0.0
        self.num_passes = 0
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.notes: list[tuple[Note, str, float]] = []
        # Every block holding data -> reference count; `ready` blocks are computed (cache
        # hits); `evictable` are ready blocks nobody references, oldest first.
        self._refs: dict[int, int] = {}
        self._ready: set[int] = set()
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._next_unique = -1

    # ---- views (what KV events and GetLoad would tell a router) ----

    def prefix_blocks(self, block_keys: tuple[int, ...]) -> int:
        n = 0
        for key in block_keys:
            if key not in self._ready:
                break
            n += 1
        return n

    @property
    def used_blocks(self) -> int:
        return len(self._refs) - len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._ready)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def waiting_tokens(self) -> int:
        return sum(r.num_target_tokens - r.num_computed for r in self.waiting) + sum(
            r.num_target_tokens - r.num_computed for r in self.running if r.prefilling
        )

    # ---- driving ----

    def add(self, request: SimRequest, now_ms: float) -> None:
        if self.idle:
            self.clock_ms = max(self.clock_ms, now_ms)
        self.waiting.append(request)

    def advance_until(self, t_ms: float) -> None:
        """Run every pass that starts before `t_ms`."""
        while not self.idle and self.clock_ms < t_ms:
            self._step()
        if self.idle:
            self.clock_ms = max(self.clock_ms, t_ms)

    def run_to_completion(self) -> None:
        while not self.idle:
            self._step()

    # ---- blocks ----

    def _alloc_one(self) -> bool:
        if len(self._refs) < self.config.num_blocks:
            return True
        if not self._evictable:
            return False
        key, _ = self._evictable.popitem(last=False)
        del self._refs[key]
        self._ready.discard(key)
        return True

    def _grow(self, req: SimRequest, num_tokens: int) -> bool:
        """Give `req` blocks for its first `num_tokens` tokens."""
        need = math.ceil(num_tokens / self.config.block_size)
        num_full_keys = len(req.block_keys)
        while len(req.blocks) < need:
            index = len(req.blocks)
            key = req.block_keys[index] if index < num_full_keys else None
            if key is not None and key in self._refs:
                self._ref(key)
            else:
                if not self._alloc_one():
                    return False
                if key is None:
                    key = self._next_unique
                    self._next_unique -= 1
                self._refs[key] = 1
            req.blocks.append(key)
        return True

    def _ref(self, key: int) -> None:
        count = self._refs[key]
        if count == 0:
            del self._evictable[key]
        self._refs[key] = count + 1

    def _release(self, req: SimRequest) -> None:
        # Tail first into the LRU, so a prefix outlives its tail.
        for key in reversed(req.blocks):
            count = self._refs[key] - 1
            if count > 0:
                self._refs[key] = count
            elif key in self._ready:
                self._refs[key] = 0
                self._evictable[key] = None
            else:
                del self._refs[key]
        req.blocks.clear()
        req.num_marked = 0

    def _mark_ready(self, req: SimRequest) -> None:
        full = min(req.num_computed // self.config.block_size, len(req.blocks))
        if full > req.num_marked:
            self._ready.update(req.blocks[req.num_marked : full])
            req.num_marked = full

    # ---- one forward pass ----

    def _admit(self, req: SimRequest) -> int:
        """Reference the request's cached prefix; returns the cached tokens."""
        limit = min(len(req.block_keys), (req.num_prompt_tokens - 1) // self.config.block_size)
        hit = min(self.prefix_blocks(req.block_keys), max(limit, 0))
        for key in req.block_keys[:hit]:
            self._ref(key)
            req.blocks.append(key)
        req.num_computed = hit * self.config.block_size
        return req.num_computed

    def _preempt_newest(self, scheduled: dict[int, tuple[int, bool]]) -> SimRequest:
        victim = self.running.pop()
        scheduled.pop(id(victim), None)
        self._release(victim)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _step(self) -> None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # id(request) -> (tokens this pass, whether they are prompt tokens)
        scheduled: dict[int, tuple[int, bool]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_target_tokens - req.num_computed
            n = min(remaining, budget) if remaining > 0 else 1
            while not self._grow(req, req.num_computed + n):
                if self._preempt_newest(scheduled) is req:
                    break
            else:
                scheduled[id(req)] = (n, remaining > 0)
                budget -= n
                i += 1
                continue
            break
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            cached = self._admit(req)
            n = min(req.num_target_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                self._release(req)
                break
            if req.cached_tokens is None:
                req.cached_tokens = cached
            self.waiting.popleft()
            self.running.append(req)
            scheduled[id(req)] = (n, True)
            budget -= n
        if not scheduled:
            # Nothing fits even in an empty cache: drop the head request rather than spin.
            req = self.waiting.popleft()
            req.finish_ms = self.clock_ms
            self.notes.append((Note.FINISHED, req.request_id, self.clock_ms))
            return
        prefill_tokens = 0
        decode_context = 0
        for req in self.running:
            entry = scheduled.get(id(req))
            if entry is None:
                continue
            if entry[1]:
                prefill_tokens += entry[0]
            else:
                decode_context += req.num_computed + 1
        duration = 0.0
        if prefill_tokens:
            duration += cfg.timing.prefill_ms(prefill_tokens)
        if decode_context:
            capacity = cfg.num_blocks * cfg.block_size
            duration += cfg.timing.decode_ms(decode_context / capacity)
        end = self.clock_ms + duration
        self.clock_ms = end
        self.busy_ms += duration
        self.num_passes += 1
        still_running = []
        for req in self.running:
            entry = scheduled.get(id(req))
            if entry is not None:
                req.num_computed += entry[0]
                self._mark_ready(req)
                if req.num_computed >= req.num_target_tokens:
                    req.num_generated += 1
                    if req.first_token_ms is None:
                        req.first_token_ms = end
                        self.notes.append((Note.FIRST_TOKEN, req.request_id, end))
                    if req.num_generated >= req.num_output_tokens:
                        req.finish_ms = end
                        self._release(req)
                        self.notes.append((Note.FINISHED, req.request_id, end))
                        continue
            still_running.append(req)
        self.running = still_running
