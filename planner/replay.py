"""Offline replay of a planner policy: trace arrivals through simulated engines, in virtual
time, with engines started and drained as the policy decides.

The engines are the engine's own `SimFleet` (`engine/core/sim_fleet.py`: the real EngineCore,
block manager and scheduler over the sim runner, whose timing model is Dynamo's mocker's: a pass
takes P(prompt tokens computed) + D(decode KV usage)). A row's prompt is `prompt_tokens` copies
of a token of its own (no two requests share a prefix: the Azure traces have no prefix data),
its output exactly `output_tokens` tokens.

The actuator (`_Actuator`, the fleet's `Timer`) is what a live actuator and observer would be:
- every `tick_s` it builds `Observations` (each engine's `EngineLoad` as GetLoad gives it, its
  cached blocks as the controller's index would place them on it, and the passes each ran
  since the last tick, as FORWARD_PASS events would report them, summed)
  and applies the policy's decisions: ScalePool starts engines, which serve `startup_s` later;
  DrainEngine stops routing to one; RemoveEngine stops one (only a drained one: anything else
  is a policy bug and raises). A draining engine still running requests at its deadline has
  them aborted (counted as failed).
- requests go to the serving engine with the fewest requests in flight (the planner, not the
  routing, is measured); the router never sends to a starting or draining engine.

Cost: engine-seconds, each engine from the moment it was asked for (start-up counts) to its
removal or the end of the replay (the last request's end), draining included.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.api import EngineRequest, SamplingParams, ScheduledBatch, SchedulerConfig
from engine.core.mooncake_trace import FILLER_TOKEN_BASE
from engine.core.sim_fleet import Progress, RequestRecord, SimEngine, SimFleet, TimedRequest
from engine.core.sim_runner import SimRunner
from planner.azure_trace import TraceRow
from planner.config import SlaTargets
from planner.core.decisions import Decision, DrainEngine, Policy, RemoveEngine, ScalePool
from planner.core.observations import (
    EngineLoad,
    EngineObservation,
    EngineState,
    ForwardPasses,
    Observations,
)

POOL = "default"


class NoScaling:
    """Static provisioning: never decides anything."""

    def decide(self, observations: Observations, now_s: float) -> list[Decision]:
        return []


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """The simulated engine and the replay's timing."""

    block_size: int = 16  # tokens per KV block
    blocks_per_engine: int = 1024  # one engine's KV cache: 16,384 tokens
    max_num_seqs: int = 256  # the scheduler's batch limits (vLLM's defaults for seqs)
    max_num_batched_tokens: int = 2048
    startup_s: float = 30.0  # from ScalePool to serving
    speedup: float = 1.0  # trace time runs this much faster

    @property
    def kv_tokens(self) -> int:
        return self.block_size * self.blocks_per_engine


class MeteredSimRunner(SimRunner):
    """The sim runner, counting what FORWARD_PASS events would report: prompt tokens and
    prefill sequences of each pass (passes and their time it counts already; the prefix-cache
    hits of each pass the engine counts: `SimEngine.num_cached_tokens`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_prefill_tokens = 0
        self.num_prefill_sequences = 0

    def execute(self, batch: ScheduledBatch) -> list[Any]:
        self.num_prefill_tokens += batch.num_prefill_tokens
        self.num_prefill_sequences += len(batch.sequences) - batch.num_decode_sequences
        return super().execute(batch)

    def totals(self, engine_id: str, num_cached_tokens: int) -> ForwardPasses:
        """Every pass so far, as one `ForwardPasses` (with the engine's count of hits)."""
        return ForwardPasses(
            engine_id,
            self.num_forward_passes,
            self.total_forward_ms / 1000.0,
            self.num_prefill_tokens,
            self.num_prefill_sequences,
            num_cached_tokens,
        )


@dataclass(slots=True, eq=False)
class _Member:
    engine: SimEngine
    state: EngineState
    asked_s: float  # cost counts from here: start-up is paid for
    ready_s: float  # serving from here
    stopped_s: float | None = None  # None: still running (cost counts to the replay's end)
    deadline_s: float | None = None  # of its drain: what is left then is aborted
    in_flight: int = 0  # the router's count of requests sent and not finished
    seen: ForwardPasses | None = None  # the runner's totals at the last tick

    @property
    def is_stopped(self) -> bool:
        return self.stopped_s is not None

    @property
    def engine_id(self) -> str:
        return f"e{self.engine.index}"

    @property
    def runner(self) -> MeteredSimRunner:
        assert isinstance(self.engine.runner, MeteredSimRunner)
        return self.engine.runner


@dataclass(slots=True)
class _Counters:
    num_scale_ups: int = 0
    num_drains: int = 0
    max_engines: int = 0
    aborted: set[str] = field(default_factory=set)


class _Actuator:
    """The fleet's Timer: engines' start-up, drain deadlines and the policy's ticks."""

    def __init__(
        self, fleet: SimFleet, policy: Policy, settings: FleetSettings, tick_s: float, engines: int
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.settings = settings
        self.tick_s = tick_s
        self.members: list[_Member] = []
        self.counters = _Counters()
        self._next_tick_s = 0.0
        for _ in range(engines):
            self._start(0.0, ready_s=0.0)

    # ---------------------------------------------------------------- Timer

    def next_s(self) -> float | None:
        due = [self._next_tick_s]
        for m in self.members:
            if m.state is EngineState.STARTING:
                due.append(m.ready_s)
            elif m.state is EngineState.DRAINING and m.deadline_s is not None:
                due.append(m.deadline_s)
        return min(due)

    def fire(self, now_s: float) -> None:
        for m in self.members:
            if m.state is EngineState.STARTING and m.ready_s <= now_s:
                m.state = EngineState.SERVING
            elif (
                m.state is EngineState.DRAINING
                and m.deadline_s is not None
                and m.deadline_s <= now_s
            ):
                self._abort(m)
        if self._next_tick_s <= now_s:
            self._next_tick_s = now_s + self.tick_s
            self._apply(self.policy.decide(self._observe(now_s), now_s), now_s)

    # ---------------------------------------------------------------- routing

    def route(self, request: EngineRequest, engines: Sequence[SimEngine]) -> int:
        serving = [m for m in self.members if m.state is EngineState.SERVING]
        if not serving:  # the policies keep one engine serving; a bug otherwise
            raise RuntimeError("no serving engine to route to")
        chosen = min(serving, key=lambda m: (m.in_flight, m.engine.index))
        chosen.in_flight += 1
        return chosen.engine.index

    def on_progress(self, index: int, request_id: str, what: Progress, now_s: float) -> None:
        if what is Progress.FINISHED:
            self.members[index].in_flight -= 1

    # ---------------------------------------------------------------- actions

    def _start(self, now_s: float, ready_s: float) -> None:
        engine = self.fleet.add_engine(MeteredSimRunner)
        state = EngineState.SERVING if ready_s <= now_s else EngineState.STARTING
        self.members.append(_Member(engine, state, now_s, ready_s))
        alive = sum(1 for m in self.members if not m.is_stopped)
        self.counters.max_engines = max(self.counters.max_engines, alive)

    def _abort(self, member: _Member) -> None:
        outputs = member.engine.core.abort_all()
        self.counters.aborted.update(o.request_id for o in outputs)
        member.in_flight = 0
        member.deadline_s = None

    def _apply(self, decisions: list[Decision], now_s: float) -> None:
        by_id = {m.engine_id: m for m in self.members}
        for decision in decisions:
            if isinstance(decision, ScalePool):
                current = sum(1 for m in self.members if m.state is not EngineState.DRAINING)
                missing = decision.num_engines - current
                for _ in range(missing):
                    self._start(now_s, now_s + self.settings.startup_s)
                self.counters.num_scale_ups += 1 if missing > 0 else 0
            elif isinstance(decision, DrainEngine):
                member = by_id[decision.engine_id]
                if member.state is EngineState.SERVING:
                    member.state = EngineState.DRAINING
                    member.deadline_s = decision.deadline_s
                    self.counters.num_drains += 1
            elif isinstance(decision, RemoveEngine):
                member = by_id[decision.engine_id]
                if member.state is not EngineState.DRAINING or member.engine.core.has_work():
                    raise RuntimeError(f"policy removed {member.engine_id}, not drained")
                member.stopped_s = now_s
                member.deadline_s = None

    # ---------------------------------------------------------------- observing

    def _observe(self, now_s: float) -> Observations:
        alive = [m for m in self.members if not m.is_stopped]
        passes = []
        for m in alive:
            totals = m.runner.totals(m.engine_id, m.engine.num_cached_tokens)
            if m.seen is None or totals.num_passes > m.seen.num_passes:
                passes.append(_since(totals, m.seen))
            m.seen = totals
        return Observations(self._observe_members(alive), tuple(passes))

    def _observe_members(self, members: list[_Member]) -> tuple[EngineObservation, ...]:
        observed = []
        for m in members:
            load = m.engine.core.load()
            observed.append(
                EngineObservation(
                    m.engine_id,
                    POOL,
                    m.state,
                    EngineLoad(
                        load.num_running,
                        load.num_waiting,
                        load.waiting_tokens,
                        load.num_used_blocks,
                        load.num_total_blocks,
                        self.settings.block_size,
                    ),
                    # The controller's index holds exactly the keys the engine's KV events
                    # stored and did not remove: its prefix cache's.
                    indexed_blocks=load.num_cached_blocks,
                )
            )
        return tuple(observed)


def _since(totals: ForwardPasses, seen: ForwardPasses | None) -> ForwardPasses:
    if seen is None:
        return totals
    return ForwardPasses(
        totals.engine_id,
        totals.num_passes - seen.num_passes,
        totals.duration_s - seen.duration_s,
        totals.num_prefill_tokens - seen.num_prefill_tokens,
        totals.num_prefill_sequences - seen.num_prefill_sequences,
        totals.num_cached_tokens - seen.num_cached_tokens,
    )


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    num_requests: int
    # Shares of all requests (a failed one misses both targets).
    ttft_attainment: float
    itl_attainment: float  # its mean ITL within the target
    sla_attainment: float  # both targets met
    ttft_ms: dict[str, float]  # p50, p99 over requests that got a first token
    itl_ms: dict[str, float]  # mean, p99 of requests' mean ITL
    # Cost: every engine from its start request to its removal (or the end).
    engine_seconds: float
    max_engines: int
    num_scale_ups: int
    num_drains: int
    num_failed: int
    initial_engines: int

    def to_json(self) -> dict[str, Any]:
        return {
            "sla_attainment": round(self.sla_attainment, 4),
            "ttft_attainment": round(self.ttft_attainment, 4),
            "itl_attainment": round(self.itl_attainment, 4),
            "ttft_ms": {k: round(v, 1) for k, v in self.ttft_ms.items()},
            "itl_ms": {k: round(v, 2) for k, v in self.itl_ms.items()},
            "engine_seconds": round(self.engine_seconds, 1),
            "max_engines": self.max_engines,
            "initial_engines": self.initial_engines,
            "num_scale_events": self.num_scale_ups + self.num_drains,
            "num_scale_ups": self.num_scale_ups,
            "num_drains": self.num_drains,
            "num_failed": self.num_failed,
            "num_requests": self.num_requests,
        }


def fits(row: TraceRow, settings: FleetSettings) -> bool:
    """Whether one engine's KV cache holds the row's prompt and a first output token; no
    engine could admit one that does not, so the replay leaves it out (and says so)."""
    return row.prompt_tokens + 1 <= settings.kv_tokens


def replay(
    rows: Sequence[TraceRow],
    policy_name: str,
    policy: Policy,
    *,
    engines: int,
    tick_s: float,
    settings: FleetSettings,
    sla: SlaTargets,
) -> PolicyResult:
    """Replay `rows` (sorted by arrival; rows that do not fit are skipped) with `engines`
    serving at time 0 and `policy` deciding every `tick_s`."""
    scheduler = SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens)
    block_size, num_blocks = settings.block_size, settings.blocks_per_engine
    fleet = SimFleet(
        0, block_size=block_size, num_blocks=num_blocks, max_model_len=1 << 30, config=scheduler
    )
    actuator = _Actuator(fleet, policy, settings, tick_s, engines)

    def requests() -> Iterator[TimedRequest]:
        for number, row in enumerate(rows):
            if not fits(row, settings):
                continue
            tokens = (FILLER_TOKEN_BASE + number,) * row.prompt_tokens
            sampling = SamplingParams(max_tokens=row.output_tokens, ignore_eos=True)
            request = EngineRequest(f"r{number}", tokens, sampling)
            yield TimedRequest(row.arrival_s / settings.speedup, request)

    records = fleet.replay(
        requests(), actuator.route, on_progress=actuator.on_progress, timer=actuator
    )
    return _summarise(policy_name, records, actuator, sla, engines)


def _summarise(
    policy: str, records: list[RequestRecord], actuator: _Actuator, sla: SlaTargets, engines: int
) -> PolicyResult:
    aborted = actuator.counters.aborted
    end_s = max((r.finish_s or r.arrival_s for r in records), default=0.0)
    ttfts: list[float] = []
    itls: list[float] = []
    ttft_ok = itl_ok = both_ok = failed = 0
    for r in records:
        if r.request_id in aborted or r.first_token_s is None or r.finish_s is None:
            failed += 1
            continue
        ttft_ms = (r.first_token_s - r.arrival_s) * 1000.0
        ttfts.append(ttft_ms)
        itl_ms = 0.0
        if r.num_output_tokens > 1:
            itl_ms = (r.finish_s - r.first_token_s) * 1000.0 / (r.num_output_tokens - 1)
            itls.append(itl_ms)
        t_ok, i_ok = ttft_ms <= sla.ttft_ms, itl_ms <= sla.itl_ms
        ttft_ok += t_ok
        itl_ok += i_ok
        both_ok += t_ok and i_ok
    total = len(records) or 1
    members = actuator.members
    engine_s = sum((m.stopped_s if m.stopped_s is not None else end_s) - m.asked_s for m in members)
    counters = actuator.counters
    return PolicyResult(
        policy=policy,
        num_requests=len(records),
        ttft_attainment=ttft_ok / total,
        itl_attainment=itl_ok / total,
        sla_attainment=both_ok / total,
        ttft_ms={"p50": _percentile(ttfts, 0.5), "p99": _percentile(ttfts, 0.99)},
        itl_ms={
            "mean": statistics.fmean(itls) if itls else 0.0,
            "p99": _percentile(itls, 0.99),
        },
        engine_seconds=engine_s,
        max_engines=counters.max_engines,
        num_scale_ups=counters.num_scale_ups,
        num_drains=counters.num_drains,
        num_failed=failed,
        initial_engines=engines,
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
