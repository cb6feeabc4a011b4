"""Offline replay of timed requests through a fleet of simulated engines in one process.

Discrete-event, in virtual time. Each engine is an `EngineCore` over a `SimRunner` sharing that
engine's own `VirtualClock`; an engine's clock is the time its current step ends. The driver
repeatedly takes the earliest of (next arrival, earliest busy engine's clock):
- an arrival is routed (`route(request, engines) -> engine index`) and queued there; an idle
  engine's clock first jumps forward to the arrival time;
- an engine step runs at its clock time and advances the clock by the modelled duration; its
  outputs are stamped with the step's end time (first token -> TTFT, last -> end-to-end).
A request that arrives while its engine is mid-step joins the next step, as in a live engine.
Arrivals at the same instant as a step end are handled first.

Observers. `route` may read `fleet.now_s` (the arrival's time) and each engine's state (its
`core.load()`, `runner.total_forward_ms`); `on_kv_events` gets each engine's KV events after
the step that made them, `on_progress` each request's first token and finish, stamped with the
step's end time. Both are called before any later arrival is routed, so a router callback sees
what a live router would have seen by then (a step's effects become visible when it is
scheduled, i.e. up to one pass early, the same for every router).

Speed. Long stretches of pure decode (nothing waiting, no block filling, nobody finishing) are
run by `EngineCore.fast_forward_decode` in one call up to the next arrival: same tokens, same
timing, same block state, far fewer Python calls (`fast_forward=False` disables it).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.core.api import EngineRequest, KvEvent, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.sim_runner import SimRunner, TimingModel, VirtualClock


@dataclass(frozen=True, slots=True)
class TimedRequest:
    arrival_s: float
    request: EngineRequest


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    engine_index: int
    arrival_s: float
    num_prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(slots=True, eq=False)
class SimEngine:
    index: int
    core: EngineCore
    clock: VirtualClock
    runner: SimRunner
    num_preemptions: int = 0
    # Prefix-cache hits of the sequences admitted, summed over its passes (what FORWARD_PASS
    # events report as num_cached_tokens).
    num_cached_tokens: int = 0

    @property
    def busy_s(self) -> float:
        """Virtual time spent in forward passes so far."""
        return self.runner.total_forward_ms / 1000.0


class Progress(enum.Enum):
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"


Router = Callable[[EngineRequest, Sequence[SimEngine]], int]
KvEventSink = Callable[[int, float, list[KvEvent]], None]
ProgressSink = Callable[[int, str, Progress, float], None]
""" `on_progress(engine index, request id, what, virtual time)`."""


class Timer(Protocol):
    """Events at times of its own (a planner's ticks, engines becoming ready): `next_s` is the
    next one (None: none), `fire(now_s)` handles it and must move `next_s` past `now_s`. It
    may add engines (`SimFleet.add_engine`) and abort requests (`engine.core.abort`)."""

    def next_s(self) -> float | None: ...

    def fire(self, now_s: float) -> None: ...


def round_robin() -> Router:
    counter = iter(range(1 << 62))

    def route(request: EngineRequest, engines: Sequence[SimEngine]) -> int:
        return next(counter) % len(engines)

    return route


class SimFleet:
    """N simulated engines with identical configuration."""

    def __init__(
        self,
        num_engines: int,
        *,
        block_size: int = 16,
        num_blocks: int = 2048,
        max_model_len: int = 131072,
        config: SchedulerConfig | None = None,
        timing: TimingModel | None = None,
        fast_forward: bool = True,
    ) -> None:
        self.fast_forward = fast_forward
        self.now_s = 0.0  # virtual time of the event being handled (arrival, step or timer)
        self.engines: list[SimEngine] = []
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._max_model_len = max_model_len
        self._config = config
        self._timing = timing
        for _ in range(num_engines):
            self.add_engine()

    def add_engine(self, runner_type: type[SimRunner] = SimRunner) -> SimEngine:
        """One more engine like the others (index = its position), idle; it gets work when
        `route` picks it. A `Timer` may call this mid-replay (a planner's scale-up)."""
        clock = VirtualClock()
        runner = runner_type(
            block_size=self._block_size,
            num_blocks=self._num_blocks,
            max_model_len=self._max_model_len,
            timing=self._timing,
            clock=clock,
        )
        core = EngineCore(runner, self._config, clock=clock)
        engine = SimEngine(len(self.engines), core, clock, runner)
        self.engines.append(engine)
        return engine

    def replay(
        self,
        requests: Iterable[TimedRequest],
        route: Router,
        *,
        on_kv_events: KvEventSink | None = None,
        on_progress: ProgressSink | None = None,
        timer: Timer | None = None,
    ) -> list[RequestRecord]:
        """Run every request to completion; records are in arrival order.

        `requests` must come in arrival order; it is consumed lazily (a trace of long prompts
        need not be in memory at once). `timer` fires at its times while work remains, before
        an arrival or a step at the same instant (see `Timer`)."""
        pending = iter(requests)
        timed: TimedRequest | None = next(pending, None)
        records: dict[str, RequestRecord] = {}
        busy: list[tuple[float, int]] = []  # (step start time, engine index), engines with work
        last_arrival_s = float("-inf")
        while timed is not None or busy:
            if timer is not None and self._fire_timer(timer, timed, busy):
                continue
            if timed is not None and (not busy or timed.arrival_s <= busy[0][0]):
                if timed.arrival_s < last_arrival_s:
                    raise ValueError("requests must be sorted by arrival time")
                last_arrival_s = timed.arrival_s
                self.now_s = timed.arrival_s
                engine = self.engines[route(timed.request, self.engines)]
                idle = not engine.core.has_work()
                if idle:
                    engine.clock.advance_to(timed.arrival_s)
                engine.core.add_request(timed.request)
                records[timed.request.request_id] = RequestRecord(
                    timed.request.request_id,
                    engine.index,
                    timed.arrival_s,
                    len(timed.request.prompt_token_ids),
                )
                if idle:
                    heapq.heappush(busy, (engine.clock.now(), engine.index))
                timed = next(pending, None)
                continue
            _, index = heapq.heappop(busy)
            engine = self.engines[index]
            if not engine.core.has_work():
                continue  # a timer aborted its requests
            until_s = float("inf") if timed is None else timed.arrival_s
            due_s = None if timer is None else timer.next_s()
            if due_s is not None:
                until_s = min(until_s, due_s)  # a timer sees passes up to its time, not later
            self.now_s = engine.clock.now()
            self._step(engine, records, on_kv_events, on_progress, until_s)
            if engine.core.has_work():
                heapq.heappush(busy, (engine.clock.now(), index))
        return list(records.values())

    def _fire_timer(
        self, timer: Timer, timed: TimedRequest | None, busy: list[tuple[float, int]]
    ) -> bool:
        due_s = timer.next_s()
        if due_s is None:
            return False
        if timed is not None and timed.arrival_s < due_s:
            return False
        if busy and busy[0][0] < due_s:
            return False
        self.now_s = due_s
        timer.fire(due_s)
        return True

    def _step(
        self,
        engine: SimEngine,
        records: dict[str, RequestRecord],
        on_kv_events: KvEventSink | None,
        on_progress: ProgressSink | None,
        until_s: float,
    ) -> None:
        if self.fast_forward:
            skipped = engine.core.fast_forward_decode(until_s)
            for output in skipped:
                records[output.request_id].num_output_tokens += len(output.new_token_ids)
            if skipped:
                return
        result = engine.core.step()
        if result.stats is None and not result.outputs:
            raise RuntimeError(f"sim engine {engine.index} has work but scheduled nothing")
        engine.num_preemptions += result.num_preempted
        if result.stats is not None:
            engine.num_cached_tokens += result.stats.num_cached_tokens
        now_s = engine.clock.now()
        for output in result.outputs:
            record = records[output.request_id]
            if record.first_token_s is None and (output.new_token_ids or output.finished):
                record.first_token_s = now_s
                if on_progress is not None:
                    on_progress(engine.index, output.request_id, Progress.FIRST_TOKEN, now_s)
            record.num_output_tokens += len(output.new_token_ids)
            if output.usage is not None:
                record.finish_s = now_s
                record.num_cached_tokens = output.usage.cached_prompt_tokens
                if on_progress is not None:
                    on_progress(engine.index, output.request_id, Progress.FINISHED, now_s)
        if on_kv_events is not None:
            events = engine.core.take_kv_events()
            if events:
                on_kv_events(engine.index, now_s, events)
        else:
            engine.core.block_manager.take_events()  # nobody listens: do not accumulate


def trace_prompt_tokens(
    hash_ids: Sequence[int], input_length: int, block_size: int, filler: int
) -> tuple[int, ...]:
    """Token ids for a Mooncake-format trace row (its hash ids are chained block ids): hash id
    h becomes a block of `block_size` tokens all equal to h, the last block cut to
    `input_length`, so equal hash-id prefixes get equal canonical block keys and the prefix
    cache hits exactly where the trace shares blocks. Prompt tokens past the row's hash ids
    (a malformed row) are `filler` (give each request its own, above any hash id)."""
    tokens: list[int] = []
    for h in hash_ids:
        if len(tokens) >= input_length:
            break
        tokens.extend((h,) * block_size)
    if len(tokens) < input_length:
        tokens.extend((filler,) * (input_length - len(tokens)))
    return tuple(tokens[:input_length])
