"""The live planner (`kvplane planner run`): observe the engines, run the core, act.

Every `tick_s`: the GetLoad of every serving or draining engine (its GetEngineInfo role and
KV block size read once before it; concurrently, each bounded by `load_timeout_s`; one that
does not answer keeps its last load, and one that has not answered
`lost_after_failed_polls` ticks in a row is lost: taken out of the controller and killed, so
the core replaces it), the FORWARD_PASS events each engine sent since the last tick (one
SubscribeRuntimeEvents stream per engine, summed into `ForwardPasses`), then
`decide(observations, now)` on the monotonic clock, then each decision in order through the
actuator, logged with its reason (the decision log). What may wait on a remote system (the
Kubernetes API) runs beside the ticks, as Kubernetes' controllers never block observation on
writes: the actuator's looks at the fleet (`adopt`: the first waited for, then each tick
takes what the looks that ended found, one look per pool), starts and removals (stop, kill),
so a slow API server holds up neither the engines' observation nor the decisions. One pool's
starts and removals go in order (a start after the removals under way; a removal after the
earlier ones), other pools' beside them. Engines the actuator is still starting are observed
as STARTING (under a placeholder id), so the core sees its pending capacity; an engine being
removed is no longer observed. An engine whose process exited on its own is removed (from the
controller too) before the tick observes, so the core does not count it; a serving engine the
controller does not list (it restarted) is registered again (at once when the controller
restarted: `run` watches its instance id, and reconciles as soon as a new process answers,
between ticks), one it lists as draining (drained by hand, or by the planner before this
one) is observed as DRAINING, its deadline `scaling.drain_deadline_s` from then: the core
replaces it and removes it once empty (or past its deadline, as its own drains); one the
planner drained that it routes to again (the drain was not taken) is drained again. Only
engines this planner started, or the actuator adopted (found serving: a Deployment's pods a
previous planner scaled), are managed. Each tick updates the metrics (`planner.metrics`),
served on `live.metrics_listen` when set. The controller is dialled per
`live.controller_tls` and the engines per `live.engine_tls` (insecure when unset), every call
carrying the bearer token of `live.controller_token_file` / `live.engine_token_file` when set;
their files are read and checked before anything starts.

With leader election (`planner.leader_election`), a planner that does not lead stands by warm
(`stand_by`): each tick it observes the engines of the Deployments' Ready pods as above
(GetLoad, runtime events) and its core learns from them (`Planner.observe`), by reads of the
API alone and with no call to the controller, exporting no gauge of the fleet (only the
leader reports the fleet it acts on); each term as leader (`lead`) acts through an actuator of
its own, with that core and those engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from kvplane.channels import (
    HUNG_UP,
    INSECURE,
    ClientChannels,
    ClientSettings,
    Redialling,
    setting_hint,
)
from kvplane.enum_names import enum_name
from kvplane.errors import ConfigError
from kvplane.metrics import start_metrics_server
from kvplane.redialled_stream import redialled_stream
from kvplane.up.member import stop_within_s
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.actuator import Actuator, LocalProcesses
from planner.config import DEFAULT_DRAIN_DEADLINE_S, LiveConfig, PlannerConfig
from planner.core.actions import provisioned
from planner.core.decisions import Decision, DrainEngine, Policy, RemoveEngine, ScalePool
from planner.core.observations import (
    IDLE,
    EngineLoad,
    EngineObservation,
    EngineRole,
    EngineState,
    ForwardPasses,
    Observations,
)
from planner.core.planner import Planner
from planner.kubernetes import (
    KubernetesDeployments,
    connect_deployments,
    deployments_actuator,
    kube_api,
)
from planner.leader_election import LeaderElector, lead, leader_elector
from planner.metrics import LossCause, Operation, PlannerMetrics
from planner.start_backoff import StartBackoff

log = logging.getLogger(__name__)

# A GetLoad answered with these refused the planner's `live.engine_token_file`: not a failed
# poll of the engine.
_REFUSED_CREDENTIALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

# GetEngineInfo's role as the core's (ENGINE_ROLE_UNSPECIFIED: not reported).
_ROLES = {
    pb.ENGINE_ROLE_AGGREGATED: EngineRole.AGGREGATED,
    pb.ENGINE_ROLE_PREFILL: EngineRole.PREFILL,
    pb.ENGINE_ROLE_DECODE: EngineRole.DECODE,
}

# How long after a runtime-event stream ends the planner subscribes again.
RESUBSCRIBE_S = 1.0
# An engine's load before it answered a GetLoad: nothing known, its requests included (so a
# first GetLoad that fails, a busy engine's that times out, does not make it look empty).
UNPOLLED = replace(IDLE, requests_known=False)
# How long past the deadline of the planner's drain an engine that still reports requests or
# KV sessions is kept: its Drain was to abort them at the deadline (abort_after_deadline), so
# one that did not (an engine without it, a wedged request) is removed then, or it would be
# kept draining, serving nothing and uncounted, for good.
DRAIN_OVERRUN_S = 60.0
# The settings a failed GetLoad names when an engine's TLS or token and the planner's do not
# match.
ENGINE_SETTINGS = ClientSettings(
    "live.engine_tls",
    "live.engine_tls.cert_file and key_file",
    "live.engine_token_file",
    "live.engine_tls.server_name",
)


@dataclass(slots=True, eq=False)
class _Engine:
    engine_id: str  # its address once started; a placeholder while starting
    pool: str
    state: EngineState
    load: EngineLoad = UNPOLLED
    # Its channel and stub (None: not started yet).
    dialled: Redialling[pb_grpc.OpenEngineAsyncStub] | None = None
    passes: list[ForwardPasses] = field(default_factory=list)  # since the last tick
    events: asyncio.Task[None] | None = None
    # GetLoads in a row that failed or timed out (not those that refused the planner's token).
    failed_polls: int = 0
    # Its drain's deadline: the planner's Drain's, or for a drain found at the controller
    # (`drain_found`: by hand, or by the planner before this one), `drain_deadline_s` counted
    # from when this planner first saw it. None: not draining.
    drain_deadline_s: float | None = None
    drain_found: bool = False
    # GetEngineInfo's role and GetModelInfo's kv_block_size taken (or not reported).
    info_read: bool = False
    role: EngineRole | None = None  # GetEngineInfo's (None: not reported)
    serving_since_s: float = 0.0  # when it was started or adopted (the planner's clock)
    answered_s: float | None = None  # when it last answered a GetLoad (None: never)
    # Blocks the controller's index places on it (ListWorkers, each reconciliation; the last
    # listed stands while the controller does not answer).
    indexed_blocks: int = 0

    def served_s(self) -> float:
        """How long it served: from its start (or adoption) to its last answer."""
        return 0.0 if self.answered_s is None else self.answered_s - self.serving_since_s

    def drain_over(self, now_s: float) -> bool:
        """Whether this engine's drain is over, whatever its counts say: `DRAIN_OVERRUN_S`
        past its deadline, or, drained by the planner, at the deadline when the engine does
        not report its request counts (its Drain aborts what is left then:
        abort_after_deadline; a drain found at the controller may not)."""
        if self.drain_deadline_s is None:
            return False
        past_s = now_s - self.drain_deadline_s
        aborted = past_s >= 0 and not self.drain_found and not self.load.requests_known
        return past_s >= DRAIN_OVERRUN_S or aborted

    def leave(self, deadline_s: float, *, found: bool = False) -> None:
        """Observe it DRAINING until `deadline_s`: the planner's drain, or one `found` at the
        controller."""
        self.state, self.drain_deadline_s, self.drain_found = (
            EngineState.DRAINING,
            deadline_s,
            found,
        )

    def serve_again(self) -> None:
        """Observe it SERVING: no drain (any is forgotten)."""
        self.state, self.drain_deadline_s, self.drain_found = EngineState.SERVING, None, False

    def observation(self, now_s: float | None = None) -> EngineObservation:
        """What the core sees at `now_s`: once the planner's drain is over (`drain_over`),
        an engine holding nothing."""
        load = self.load
        if now_s is not None and self.drain_over(now_s):
            load = replace(
                load,
                running_requests=0,
                queued_requests=0,
                requests_known=True,
                active_kv_sessions=0,  # the drain released them at its deadline
            )
        return EngineObservation(
            self.engine_id, self.pool, self.state, load, self.role, self.indexed_blocks
        )


@dataclass(slots=True, eq=False)
class _Starts:
    """The engine starts of a pool that one decision began. Those that fail are one failure
    of the pool for the start back-off, as the engines one look finds lost are: several
    failing for one cause (a model path that does not exist, a full node) are not a crash
    loop, and counted one by one, a pool scaled up by three would wait after its first
    attempt, not after its second."""

    # The wait the first of them to fail set, said with each failure (None: none failed).
    wait_s: float | None = None


class LivePlanner:
    def __init__(
        self,
        policy: Policy,
        actuator: Actuator,
        *,
        load_timeout_s: float = 2.0,
        lost_after_failed_polls: int = 3,
        channels: ClientChannels = INSECURE,
        clock: Callable[[], float] = time.monotonic,
        metrics: PlannerMetrics | None = None,
        may_act: Callable[[], bool] = lambda: True,
        start_backoff: StartBackoff | None = None,
        drain_deadline_s: float = DEFAULT_DRAIN_DEADLINE_S,
    ) -> None:
        self.policy = policy
        self.actuator = actuator
        self.engines: dict[str, _Engine] = {}
        self._load_timeout_s = load_timeout_s
        self._lost_after_failed_polls = lost_after_failed_polls
        self.metrics = metrics if metrics is not None else PlannerMetrics()
        self._channels = channels
        self._clock = clock
        # False once this planner must not act (a leader whose Lease ran out: it is cancelled
        # soon after; until then, nothing more is begun, not even in the same tick).
        self._may_act = may_act
        # The deadline a drain found at the controller gets, from when it is found (the
        # policy's `scaling.drain_deadline_s`).
        self._drain_deadline_s = drain_deadline_s
        self._placeholders = itertools.count()
        # Starts of a pool whose engines keep failing wait longer and longer.
        self._backoff = start_backoff if start_backoff is not None else StartBackoff()
        self._starts: set[asyncio.Task[None]] = set()
        # The actuator's work under way beside the ticks (with `_starts` and its own looks at
        # the fleet, `_adopted`): removals (their pool by task, in the order begun: a pool's
        # go one after another, `_removals_done`, until the planner stops acting: then those
        # it finishes go at once, `_finishing`).
        self._looked = False  # the first look at the fleet was waited for
        self._removals: dict[asyncio.Task[None], str] = {}
        self._finishing = asyncio.Event()
        # Held by a tick and by a reconciliation between ticks: one must not register an
        # engine again while the other takes it out of the controller.
        self._acting = asyncio.Lock()
        # The engines observed standing by (`watch`), from a term's start (`lead`) to its
        # first look at the fleet: those the actuator does not adopt then are forgotten.
        self._observed_standing_by: set[str] = set()

    async def run(self, stop: asyncio.Event, tick_s: float) -> None:
        """Tick until `stop` is set; meanwhile, a restarted controller gets the engines back
        as soon as it answers (`_reregister_on_restart`), not up to `tick_s` later."""
        watch = asyncio.create_task(self._reregister_on_restart(), name="controller restarts")
        try:
            await _every(tick_s, stop, self.tick)
        finally:
            watch.cancel()
            # Not `await watch`: awaiting the cancelled task raises CancelledError, and
            # swallowing that swallowed a cancellation of `run` itself as it ended.
            await asyncio.wait([watch])
            if not watch.cancelled():  # it ended on its own, by an error: raised here
                watch.result()

    async def lead(self, actuator: Actuator, stop: asyncio.Event, tick_s: float) -> None:
        """One term as leader (`planner.leader_election`): `run` through `actuator`, a fresh
        one (its first look adopts the fleet as the last leader left it), until `stop` or
        until cancelled (leading ended), then `end_term`. The engines observed standing by
        (`stand_by`) that its first look adopts are observed on, so their forward passes since
        the standby's last tick count at the first; the others are forgotten then (they are
        not this planner's). The actuator held before is held again after."""
        standing_by, self.actuator = self.actuator, actuator
        self._looked = False
        self._observed_standing_by = set(self.engines)
        try:
            await self.run(stop, tick_s)
        finally:
            try:
                await self.end_term(finish_removals=self._may_act())
            finally:
                self.actuator = standing_by

    async def stand_by(
        self,
        serving: Callable[[], Awaitable[Mapping[str, str]]],
        stop: asyncio.Event,
        tick_s: float,
    ) -> None:
        """Until `stop` is set (or until cancelled: this planner takes over), `watch` the
        engines `serving()` lists every `tick_s`."""
        await _every(tick_s, stop, lambda: self.watch(serving))

    async def watch(self, serving: Callable[[], Awaitable[Mapping[str, str]]]) -> None:
        """A standby's tick: observe the engines `serving()` lists (address -> pool: the
        leader's Deployments' Ready pods) as a leader's tick does, their load and their
        forward passes, and let the core learn from them (`Planner.observe`: its forecast and
        cost model go on), acting on nothing: neither the actuator nor the controller is
        called, nothing is decided, and no gauge of the fleet is exported (the leader's
        are: `PlannerMetrics.on_standing_by`). An engine no longer listed is forgotten; one
        that does not answer keeps its last load (losing it is the leader's). A listing that
        fails keeps the engines as they were (said in one line)."""
        now_s = self._clock()
        try:
            listed = await serving()
        except Exception as exc:  # the next tick lists again
            log.warning("standing by: the engines not listed: %s", exc)
        else:
            for engine in [e for e in self.engines.values() if e.engine_id not in listed]:
                await self._forget(engine)
            for address, pool in listed.items():
                if address not in self.engines:
                    self._serve(address, pool)
        engines = list(self.engines.values())
        await asyncio.gather(*(self._poll(e) for e in engines))
        observations = self._observations(engines, now_s)
        if isinstance(self.policy, Planner):  # the benchmark's peers learn nothing
            self.policy.observe(observations, now_s)

    async def _reregister_on_restart(self) -> None:
        """Each time the controller is a new process, reconcile with it at once (`_reconcile`:
        it registers the serving engines again): until then, every request the gateway gets
        for their model is refused."""
        while True:
            await self.actuator.controller_restarted()
            log.warning("the controller restarted: registering the engines again")
            async with self._acting:
                if self._may_act():
                    await self._reconcile(self._clock())

    async def tick(self) -> list[Decision]:
        async with self._acting:
            if not self._may_act():
                return []
            now_s = self._clock()
            observations = await self._observe(now_s)
            decisions = self.policy.decide(observations, now_s)
            for decision in decisions:
                if not self._may_act():
                    return []
                log.info("decision: %s", _describe(decision))
                self.metrics.on_decision(decision)
                await self._apply(decision, now_s)
            self._update_metrics()
            self.metrics.tick_seconds.observe(self._clock() - now_s)
            return decisions

    def _update_metrics(self) -> None:
        self.metrics.on_engines(e.observation() for e in self.engines.values())
        self.metrics.on_not_answering(e.pool for e in self.engines.values() if e.failed_polls)
        if isinstance(self.policy, Planner):  # the benchmark's peers have no estimates
            for pool in self.policy.config.pools:
                estimate = self.policy.estimate(pool.name)
                if estimate is not None:
                    self.metrics.on_estimate(pool.name, estimate)

    async def close(self, *, finish_removals: bool = True) -> None:
        """Stop observing, then close the actuator, which decides the engines' fate: local
        ones end with the planner, a Deployment's pods keep serving. Starts under way are
        cancelled (the looks at the fleet too, by the actuator's close); removals under way
        are finished (each call is bounded), else a drained engine would be left serving nothing;
        without `finish_removals` (a leader that lost its lease must stop acting at once) they
        are cancelled too, and the next leader takes them back (it adopts the drained pod,
        clearing the deletion cost a removal left, or sees it draining)."""
        await self._stop_acting(finish_removals=finish_removals)
        for engine in list(self.engines.values()):
            await self._forget(engine)
        await self.actuator.close()

    async def end_term(self, *, finish_removals: bool = True) -> None:
        """As `close`, but the engines are observed on, as a standby finds them (serving: it
        does not know which the controller drains), so that a leader that lost its Lease
        stands by without a gap in their forward passes; the engines still starting are
        forgotten. The fleet's gauges go with the term."""
        await self._stop_acting(finish_removals=finish_removals)
        self.metrics.on_standing_by()
        for engine in list(self.engines.values()):
            if engine.dialled is None:
                del self.engines[engine.engine_id]
            else:
                engine.serve_again()
        await self.actuator.close()

    async def _stop_acting(self, *, finish_removals: bool) -> None:
        """Starts under way cancelled; removals finished, or cancelled too. Those finished
        go at once, not one after another in each pool: at the close, local engines' removals
        (each RemoveEngine bounded) all share the planner's time to stop, which a hung
        controller would otherwise use up a removal at a time; a Deployment's still take
        turns under its pool's lock (`KubernetesDeployments`)."""
        for task in [*self._starts, *(self._removals if not finish_removals else ())]:
            task.cancel()
        self._finishing.set()
        try:
            await asyncio.gather(*self._starts, *self._removals, return_exceptions=True)
        finally:
            self._finishing.clear()

    # ---------------------------------------------------------------- observing

    async def _observe(self, now_s: float) -> Observations:
        adopted = await self._adopted()
        taken = {address for address, _ in adopted}
        for address in self._observed_standing_by - taken:  # not this planner's
            if (left := self.engines.get(address)) is not None:
                await self._forget(left)
        self._observed_standing_by = set()
        for address, pool in adopted:
            if address not in self.engines:
                self._serve(address, pool)
        # Pools whose serving engines this look lost soon after they began serving (`_lose`):
        # one failure each, however many it lost (a node failure killing three at once is one
        # failure, not three in a row).
        failing: set[str] = set()
        for address in self.actuator.exited():  # the core must not count a dead engine
            engine = self.engines.get(address)
            if engine is not None:
                log.warning("engine %s exited on its own: removed", address)
                failing |= await self._lose(engine, "exited")
        await self._reconcile(now_s)
        running = [e for e in self.engines.values() if e.dialled is not None]
        await asyncio.gather(*(self._poll(e) for e in running))
        # Alive to the OS but not answering (hung, SIGSTOPped): serving nothing, yet the core
        # would count it forever. One slow answer is not enough to lose it.
        lost = [e for e in running if e.failed_polls >= self._lost_after_failed_polls]
        for engine in lost:
            log.warning(
                "engine %s did not answer GetLoad %d ticks in a row: lost, killed",
                engine.engine_id,
                engine.failed_polls,
            )
            failing |= await self._lose(engine, "unresponsive")
        for pool in sorted(failing):
            self._pool_failed(pool)
        kept = [e for e in running if e not in lost]
        for engine in kept:
            if engine.state is EngineState.SERVING:
                self._backoff.serving(engine.pool, engine.serving_since_s, engine.served_s())
        return self._observations(kept, now_s)

    def _observations(self, running: list[_Engine], now_s: float) -> Observations:
        """The core's input at `now_s`: every engine, and the forward passes `running` ones
        reported since the last tick (counted, then taken)."""
        passes: list[ForwardPasses] = []
        for engine in running:
            held = engine.load.num_requests + engine.load.active_kv_sessions
            if engine.load.requests_known and held and engine.drain_over(now_s):
                log.warning(
                    "engine %s still reports requests (%d) or KV sessions (%d) %g s past "
                    "its drain's deadline (its Drain did not abort them): taken as drained",
                    engine.engine_id,
                    engine.load.num_requests,
                    engine.load.active_kv_sessions,
                    DRAIN_OVERRUN_S,
                )
            self.metrics.forward_passes.labels(engine.pool).inc(
                sum(p.num_passes for p in engine.passes)
            )
            passes.extend(engine.passes)
            engine.passes = []
        engines = tuple(e.observation(now_s) for e in self.engines.values())
        return Observations(engines, tuple(passes))

    async def _adopted(self) -> list[tuple[str, str]]:
        """What the actuator's looks at the fleet (`adopt`) found. They run beside the ticks,
        as an informer's list does beside its controller: a slow API server must not hold up
        the engines' observation and the decisions. The first look is waited for (the planner
        takes over the fleet as it is, as a controller waits for its informers' first sync);
        then each tick takes what the looks that ended found and the actuator starts their
        next, one look per pool, so a pool whose listing hangs delays no other's."""
        first, self._looked = not self._looked, True
        try:
            return await self.actuator.adopt(wait=first)
        except Exception as exc:  # the actuator logs its own failures; the next look retries
            log.error("looking at the fleet failed: %s", exc)
            return []

    async def _reconcile(self, now_s: float) -> None:
        """The actuator's `sync` with the engines running: serving ones the controller does
        not list are registered again, those it lists as draining (drained by hand, or by the
        planner before this one) are marked DRAINING, with `drain_deadline_s` from `now_s` as
        their deadline (this planner does not know theirs: one stuck draining is taken as
        drained `DRAIN_OVERRUN_S` past it, as its own drains are), and those drained by hand
        that it routes to again (the engine did not take the drain) SERVING again: else, kept
        busy, one would serve on for good counted as leaving, and its pod's exit would take
        its replica with it. Each engine's indexed blocks are taken from the same listing."""
        running = [e for e in self.engines.values() if e.dialled is not None]
        serving = [e.engine_id for e in running if e.state is EngineState.SERVING]
        # Seconds left to the planner's drains' deadlines; None: a drain found (by hand).
        draining = {
            e.engine_id: None
            if e.drain_found or e.drain_deadline_s is None
            else max(0.0, e.drain_deadline_s - now_s)
            for e in running
            if e.state is EngineState.DRAINING
        }
        try:
            synced = await self.actuator.sync(serving, draining)
        except Exception as exc:  # any failure: the next tick reconciles again
            self._failed("sync", "reconciling with the controller failed: %s", exc)
            return
        for address in synced.begun:
            log.warning("engine %s was drained through the controller: leaving", address)
            self.engines[address].leave(now_s + self._drain_deadline_s, found=True)
        for address in synced.withdrawn:
            log.warning(
                "engine %s is routed to again (its drain through the controller was not "
                "taken): serving",
                address,
            )
            self.engines[address].serve_again()
        for engine in running:
            engine.indexed_blocks = synced.indexed_blocks.get(
                engine.engine_id, engine.indexed_blocks
            )

    async def _poll(self, engine: _Engine) -> None:
        assert engine.dialled is not None
        if not engine.info_read:
            await self._read_engine_info(engine, engine.dialled)
        try:
            info = await engine.dialled.stub.GetLoad(
                pb.GetLoadRequest(), timeout=self._load_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            await engine.dialled.after_failure()
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                # Its connection may be dead without a reset (a blackholed path): polled on
                # it, a healthy engine would be lost, killed and replaced; the next GetLoad
                # goes on a new one.
                engine.dialled.dial_afresh()
            details = exc.details() or ""
            hint = setting_hint(self._channels, exc.code(), details, ENGINE_SETTINGS)
            log.warning("GetLoad %s: %s%s", engine.engine_id, details or exc.code().name, hint)
            # A refusal of the planner's own token is the planner's mistake, answered by an
            # engine alive and serving: losing it (killed, replaced by another that refuses
            # the same) would churn the whole pool. Its last load stays.
            if exc.code() not in _REFUSED_CREDENTIALS:
                engine.failed_polls += 1
            return
        engine.failed_polls = 0
        engine.answered_s = self._clock()
        engine.load = _load(info, engine.load)

    async def _read_engine_info(
        self, engine: _Engine, dialled: Redialling[pb_grpc.OpenEngineAsyncStub]
    ) -> None:
        """Once per engine: its role (GetEngineInfo's: which SLA bounds its pool is sized by)
        and its KV block size (GetModelInfo of the first model GetEngineInfo lists, its
        default: the seed requires a model), in which the KV demand of its queued prompt
        tokens is counted. Not reported (unspecified, absent, no model listed,
        UNIMPLEMENTED): no role (the pool's configured one stands) and the default block size;
        another failure: asked again at the next poll (its GetLoad says why). Each call is
        made on `dialled.stub` as it is then: a channel left for renewed TLS files is closed
        once its calls ended."""
        timeout = self._load_timeout_s
        try:
            engine_info = await dialled.stub.GetEngineInfo(
                pb.GetEngineInfoRequest(), timeout=timeout
            )
            engine.role = _ROLES.get(engine_info.role)
            info = None
            if engine_info.supported_models:
                request = pb.GetModelInfoRequest(model=engine_info.supported_models[0])
                info = await dialled.stub.GetModelInfo(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            engine.info_read = exc.code() is grpc.StatusCode.UNIMPLEMENTED
            return
        engine.info_read = True
        if info is not None and info.HasField("kv_block_size") and info.kv_block_size > 0:
            engine.load = replace(engine.load, kv_block_size=info.kv_block_size)

    async def _follow_passes(self, engine: _Engine) -> None:
        """Sum FORWARD_PASS events until the engine is removed (this task is cancelled then).
        A stream that ends is subscribed again after `RESUBSCRIBE_S` (or the engine's
        retry_after_ms, if longer): an engine ends it with an EngineError when the planner
        falls too far behind, and every pass missed after that would make the fleet look idler
        than it is. Renewed TLS files (`Redialling`) move the subscription to the new channel,
        no pass lost or counted twice (`kvplane.redialled_stream`). An engine without runtime
        events (UNIMPLEMENTED) is not asked again; an event whose attributes are not numbers
        is skipped (said once)."""
        dialled = engine.dialled
        assert dialled is not None
        request = pb.SubscribeRuntimeEventsRequest(types=[pb.RUNTIME_EVENT_TYPE_FORWARD_PASS])
        said_malformed = False
        while True:
            wait_s = RESUBSCRIBE_S
            why = "ended"
            events = redialled_stream(
                dialled, lambda stub: stub.SubscribeRuntimeEvents(request), _event_id
            )
            try:
                async for response in events:
                    if response.WhichOneof("event") == "error":  # terminal: nothing follows
                        error = response.error
                        code = enum_name(pb.ErrorCode.DESCRIPTOR, error.code)
                        why = f"ended by the engine ({code}"
                        why += f": {error.message})" if error.message else ")"
                        if error.HasField("retry_after_ms"):
                            wait_s = max(wait_s, error.retry_after_ms / 1000.0)
                        break
                    if response.WhichOneof("event") != "runtime_event":
                        continue
                    # Only FORWARD_PASS is asked for; an engine that sends its other kinds too
                    # (BATCH, QUEUE, TRANSFER: the filter is the server's to apply) must not
                    # have them read as passes, of no duration, that halve the cost model.
                    if response.runtime_event.type != pb.RUNTIME_EVENT_TYPE_FORWARD_PASS:
                        continue
                    try:
                        engine.passes.append(_forward_pass(engine.engine_id, response))
                    except ValueError as exc:
                        if not said_malformed:
                            log.warning("runtime events of %s: skipped: %s", engine.engine_id, exc)
                            said_malformed = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    log.warning(
                        "engine %s has no runtime events (UNIMPLEMENTED): its forward passes "
                        "are not observed",
                        engine.engine_id,
                    )
                    return
                details = exc.details() or ""
                # An engine that answered over this channel and hangs up is one whose process
                # ended (killed, crashed), not a TLS server refusing plaintext.
                hung_up = engine.info_read and HUNG_UP in details
                hint = (
                    ""
                    if hung_up
                    else setting_hint(self._channels, exc.code(), details, ENGINE_SETTINGS)
                )
                why = f"ended ({exc.code().name}){hint}"
            except asyncio.CancelledError:
                # The stream's channel was closed under it (dialled again after a call failed
                # for renewed TLS files, before the stream moved): subscribed again on the
                # new one. This task's own cancellation (the engine removed) goes on.
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise
                why = "ended (its channel was closed: the TLS files were renewed)"
            finally:
                await events.aclose()
            log.info("runtime events of %s %s; subscribing again", engine.engine_id, why)
            await asyncio.sleep(wait_s)

    # ---------------------------------------------------------------- acting

    async def _apply(self, decision: Decision, now_s: float) -> None:
        if isinstance(decision, ScalePool):
            pool = [e.observation() for e in self.engines.values() if e.pool == decision.pool]
            starts = _Starts()
            for _ in range(decision.num_engines - provisioned(pool)):
                placeholder = _Engine(
                    f"{decision.pool}-starting-{next(self._placeholders)}",
                    decision.pool,
                    EngineState.STARTING,
                )
                self.engines[placeholder.engine_id] = placeholder
                task = asyncio.create_task(self._start(placeholder, starts))
                self._starts.add(task)
                task.add_done_callback(self._starts.discard)
        elif isinstance(decision, DrainEngine):
            engine = self.engines[decision.engine_id]
            engine.leave(decision.deadline_s)
            try:
                await self.actuator.drain(engine.engine_id, decision.deadline_s - now_s)
            except Exception as exc:  # any failure: it stays draining, removed once empty
                self._failed("drain", "draining %s failed: %s", engine.engine_id, exc)
        elif isinstance(decision, RemoveEngine):
            await self._remove(self.engines[decision.engine_id])

    async def _start(self, placeholder: _Engine, starts: _Starts) -> None:
        """After the removals of its pool under way (a pool's actions go in order: a Deployment
        scaled down, then up), start an engine in place of `placeholder`, one of `starts`."""
        pool = placeholder.pool
        await self._removals_done(pool)
        # Its pool's engines failed: it waits as STARTING, so the core asks for no other.
        if (wait_s := self._backoff.wait_s(pool, self._clock())) > 0:
            await asyncio.sleep(wait_s)
        if not self._may_act():
            del self.engines[placeholder.engine_id]
            return
        try:
            address = await self.actuator.start(pool)
        except Exception as exc:  # any failure: the core will ask again, after the back-off
            if starts.wait_s is None:  # the first of them to fail: its pool's failure
                starts.wait_s = self._backoff.failed(pool, self._clock())
            self._failed(
                "start",
                "starting an engine of %s failed: %s%s",
                pool,
                exc,
                _next_start(starts.wait_s),
            )
            del self.engines[placeholder.engine_id]
            return
        del self.engines[placeholder.engine_id]
        if (gone := self.engines.get(address)) is not None:
            await self._settled(gone)
        self._serve(address, placeholder.pool)

    async def _settled(self, engine: _Engine) -> None:
        """`engine` exited and a start got its address (its port reused) before a look
        reported it: the start settled it (`Actuator.start`). Lost as an engine that exited
        is, its pool failing by it as by a crash that a look finds, but not stopped: the
        process at its address is the new engine."""
        log.warning(
            "engine %s exited on its own: removed (a new engine has its address)",
            engine.engine_id,
        )
        if self._lost(engine, "exited"):
            self._pool_failed(engine.pool)
        await self._forget(engine)

    def _serve(self, address: str, pool: str) -> None:
        """Observe a serving engine (started, or adopted by the actuator)."""
        engine = _Engine(address, pool, EngineState.SERVING, serving_since_s=self._clock())
        engine.dialled = Redialling(self._channels, address, pb_grpc.OpenEngineStub)
        engine.events = asyncio.create_task(self._follow_passes(engine))
        self.engines[address] = engine
        log.info("engine %s serves in pool %s", address, pool)

    async def _lose(self, engine: _Engine, cause: LossCause) -> set[str]:
        """Count and remove an engine lost; the pool failing by it (`_lost`)."""
        failing = {engine.pool} if self._lost(engine, cause) else set()
        await self._remove(engine, kill=cause == "unresponsive")
        return failing

    def _lost(self, engine: _Engine, cause: LossCause) -> bool:
        """Count an engine lost; whether its pool fails by it, for the start back-off: a
        serving engine's crash soon after it began serving (`StartBackoff.crash`). One that
        served longer is replaced at once, and a draining engine was leaving anyway: no."""
        self.metrics.on_lost(engine.pool, cause)
        return engine.state is EngineState.SERVING and self._backoff.crash(engine.served_s())

    def _pool_failed(self, pool: str) -> None:
        """Engines of `pool` failed: its next start waits (`StartBackoff.failed`)."""
        if (next_s := self._backoff.failed(pool, self._clock())) > 0:
            log.warning("engines of %s keep failing:%s", pool, _next_start(next_s))

    async def _remove(self, engine: _Engine, *, kill: bool = False) -> None:
        """Stop observing `engine` at once; the actuator stops (or kills) it beside the ticks,
        after the removals of its pool under way (`_removals_done`)."""
        await self._forget(engine)
        pool = engine.pool
        task = asyncio.create_task(self._actuate_removal(engine.engine_id, pool, kill=kill))
        self._removals[task] = pool
        task.add_done_callback(self._removals.pop)

    async def _actuate_removal(self, address: str, pool: str, *, kill: bool) -> None:
        await self._removals_done(pool, before=asyncio.current_task())
        if not self._may_act():
            return  # the next leader takes the engine over as it finds it
        if address in self.engines:  # a start got its address since (its port reused): it
            return  # settled the engine removed (`Actuator.start`); the new one serves there
        operation: Operation = "kill" if kill else "stop"
        try:
            await (self.actuator.kill if kill else self.actuator.stop)(address)
        except Exception as exc:  # forgotten all the same: its channel is closed
            self._failed(operation, "stopping %s failed: %s", address, exc)

    async def _removals_done(self, pool: str, before: asyncio.Task[None] | None = None) -> None:
        """Until the removals of `pool` under way (those begun before `before`, if given) are
        done: one Deployment's changes are made one after another, while other pools' go on;
        or, for a removal (`before`), until the planner stops acting (`_stop_acting`)."""
        earlier = []
        for task, of in self._removals.items():
            if task is before:
                break
            if of == pool:
                earlier.append(task)
        if not earlier:
            return
        # Not gather: a start cancelled (the planner closing) cancels no removal.
        waits: list[asyncio.Future[object]] = [asyncio.ensure_future(asyncio.wait(earlier))]
        if before is not None:
            waits.append(asyncio.ensure_future(self._finishing.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _forget(self, engine: _Engine) -> None:
        """Stop observing `engine` (the actuator still has it). Cancelled midway (a standby
        taking over), the engine is forgotten all the same, and the cancellation goes on."""
        self.engines.pop(engine.engine_id, None)
        try:
            if engine.events is not None:
                engine.events.cancel()
                await asyncio.wait([engine.events])  # unlike awaiting it, swallows no cancel
        finally:
            if engine.dialled is not None:
                await engine.dialled.close()

    def _failed(self, operation: Operation, message: str, *args: object) -> None:
        """One log line (`message % args`) and the failure counted."""
        log.error(message, *args)
        self.metrics.on_failure(operation)


async def _every(tick_s: float, stop: asyncio.Event, step: Callable[[], Awaitable[object]]) -> None:
    """`step()` every `tick_s` until `stop` is set."""
    while not stop.is_set():
        await step()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(tick_s):
                await stop.wait()


def _load(info: pb.LoadInfo, last: EngineLoad) -> EngineLoad:
    """A GetLoad answer as the core's input. Every scalar of it is optional: one absent is
    unavailable in this snapshot, not zero, so the last value reported stands (0 before any);
    without both request counts the engine's requests are unknown (`requests_known`)."""

    has = info.HasField
    return EngineLoad(
        info.running_requests if has("running_requests") else last.running_requests,
        info.queued_requests if has("queued_requests") else last.queued_requests,
        info.waiting_tokens if has("waiting_tokens") else last.waiting_prefill_tokens,
        info.used_kv_blocks if has("used_kv_blocks") else last.used_kv_blocks,
        info.total_kv_blocks if has("total_kv_blocks") else last.total_kv_blocks,
        last.kv_block_size,
        requests_known=has("running_requests") and has("queued_requests"),
        active_kv_sessions=(
            info.active_kv_sessions if has("active_kv_sessions") else last.active_kv_sessions
        ),
    )


def _event_id(response: pb.SubscribeRuntimeEventsResponse) -> str | None:
    """A runtime event's id (None: a terminal error)."""
    if response.WhichOneof("event") != "runtime_event":
        return None
    event_id: str = response.runtime_event.event_id
    return event_id


def _forward_pass(engine_id: str, response: pb.SubscribeRuntimeEventsResponse) -> ForwardPasses:
    """One FORWARD_PASS event as the core's input; ValueError when an attribute it reads is
    not a finite number >= 0 (a NaN would poison the cost model for good), or when it says
    more decoding sequences than the batch holds."""
    attributes = response.runtime_event.attributes

    def number(name: str, parse: Callable[[str], float]) -> float:
        text = attributes.get(name, "0")
        try:
            value = parse(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"FORWARD_PASS attribute {name}={text!r} is not a number >= 0")
        return value

    batch_size = int(number("batch_size", int))
    decode_sequences = int(number("num_decode_sequences", int))
    if decode_sequences > batch_size:  # a negative count of prompts would skew the means
        raise ValueError(
            f"FORWARD_PASS attribute num_decode_sequences={decode_sequences} is above "
            f"batch_size={batch_size}"
        )
    return ForwardPasses(
        engine_id,
        1,
        number("duration_ms", float) / 1000.0,
        int(number("num_prefill_tokens", int)),
        batch_size - decode_sequences,
        int(number("num_cached_tokens", int)),
    )


def _next_start(wait_s: float) -> str:
    """When a failing pool's next engine start begins, said after its failure."""
    return f" (the next start waits {wait_s:g} s)" if wait_s > 0 else ""


def _describe(decision: Decision) -> str:
    """One line of the decision log."""
    if isinstance(decision, ScalePool):
        what = f"scale pool {decision.pool} to {decision.num_engines}"
    elif isinstance(decision, DrainEngine):
        what = f"drain {decision.engine_id} of pool {decision.pool}"
    else:
        what = f"remove {decision.engine_id} of pool {decision.pool}"
    return f"{what} ({decision.reason.value})"


def _make_workdir(workdir: Path) -> None:
    """Make `live.workdir` (and its parents), or say in one line why it cannot be."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"live.workdir {workdir} is a file, not a folder") from None
    except OSError as exc:
        raise ConfigError(f"cannot make live.workdir {workdir}: {exc.strerror or exc}") from None


def live_channels(live: LiveConfig) -> tuple[ClientChannels, ClientChannels]:
    """How the planner dials its controller and its engines: `live`'s TLS files and token
    files read (followed from then on); a ConfigError naming the setting of one that is
    missing or cannot be used (`kvplane up` reads them so before any member starts)."""
    controller_channels = ClientChannels.load(
        live.controller_tls, "live.controller_tls"
    ).with_token_file(live.controller_token_file, "live.controller_token_file")
    engine_channels = ClientChannels.load(live.engine_tls, "live.engine_tls").with_token_file(
        live.engine_token_file, "live.engine_token_file"
    )
    return controller_channels, engine_channels


async def run_live(config: PlannerConfig, environ: Mapping[str, str]) -> None:
    """`kvplane planner run`: the core over the actuator `live:` chooses (local engine
    processes, or Deployments' pods) until SIGTERM/SIGINT. Local engines are drained, removed
    from the controller and stopped (SIGTERM) at the end, killed on a second signal; pods keep
    serving. `environ` gives a
    Kubernetes actuator its in-cluster defaults; with its `leader_election` (the default), the
    planner acts only while it leads (planner/leader_election.py), each term through an
    actuator of its own, as a restarted planner would, and stands by otherwise, observing the
    fleet (`LivePlanner.stand_by`) so that a term goes on from what it learnt."""
    live = config.live
    if live is None:
        raise ConfigError(
            "the live planner needs a `live:` section (the controller's address) in its "
            "--config file (example: configs/planner.yaml)"
        )
    # Before any engine starts: an unusable file stops the planner in one line.
    controller_channels, engine_channels = live_channels(live)
    with tempfile.TemporaryDirectory(prefix="kvplane-planner-") as scratch:
        metrics = PlannerMetrics()
        metrics_server = None
        if live.metrics_listen is not None:  # before any engine starts: a bad address stops it
            metrics_server, _ = start_metrics_server(live.metrics_listen, metrics.registry)
        actuator: Actuator
        elector: LeaderElector | None = None
        kubernetes = live.kubernetes
        if kubernetes is not None:
            api = kube_api(kubernetes, environ)
            if kubernetes.leader_election is not None:
                elector = leader_elector(
                    api,
                    kubernetes.leader_election,
                    on_transitions=metrics.on_leader_transitions,
                )
            actuator = await connect_deployments(
                live, kubernetes, api, controller_channels, elector.needs() if elector else ()
            )
        else:
            workdir = live.workdir or Path(scratch)
            _make_workdir(workdir)
            actuator = LocalProcesses(
                controller=live.controller,
                engine_args=live.engine_args,
                workdir=workdir,
                start_timeout_s=live.start_timeout_s,
                channels=controller_channels,
                pool_args={pool.name: pool.engine_args for pool in config.pools},
                stop_within_s=stop_within_s(environ),
            )

        def leading() -> bool:
            """Whether this planner may act: it leads, or there is no election."""
            return elector is None or elector.leading

        metrics.on_leading(leading)

        planner = LivePlanner(
            Planner(config),
            actuator,
            load_timeout_s=live.load_timeout_s,
            lost_after_failed_polls=live.lost_after_failed_polls,
            channels=engine_channels,
            start_backoff=StartBackoff(
                live.start_backoff_s, live.start_backoff_max_s, live.start_backoff_crash_s
            ),
            metrics=metrics,
            may_act=leading,
            drain_deadline_s=config.scaling.drain_deadline_s,
        )
        stop = asyncio.Event()

        def on_signal() -> None:
            """The first SIGTERM/SIGINT closes the planner; one while it closes stops its
            local engines at once (killed, their drain cut), as a second Ctrl-C to `kvplane
            up` kills its members. A Deployment's pods keep serving either way."""
            if isinstance(actuator, LocalProcesses):
                if stop.is_set():
                    log.warning("interrupted while closing: killing the engines now")
                    actuator.kill_all()
                actuator.closing()  # its time counts from the first signal
            stop.set()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal)
        tick_s = config.scaling.tick_s
        try:
            if elector is None:
                await planner.run(stop, tick_s)
            else:
                # Standing by, the planner observes the fleet through the actuator checked at
                # start, which only lists it (`serving`); each term as leader acts through an
                # actuator of its own, as a restarted planner would: it adopts the fleet as
                # the last leader left it, with what the standby learnt.
                assert kubernetes is not None and isinstance(actuator, KubernetesDeployments)
                # Its calls end by the renew deadline: none outlives the term past the margin
                # before a standby may take over.
                leader_api = api.within(elector.left_s)
                await lead(
                    elector,
                    stop,
                    lambda: planner.lead(
                        deployments_actuator(live, kubernetes, leader_api, controller_channels),
                        stop,
                        tick_s,
                    ),
                    functools.partial(planner.stand_by, actuator.serving, stop, tick_s),
                )
        finally:
            try:
                await planner.close(finish_removals=leading())
            finally:
                if metrics_server is not None:
                    metrics_server.shutdown()
