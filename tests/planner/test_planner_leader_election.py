"""Leader election of planners that share Deployments (planner/leader_election.py) against the
fake API server's Leases (tests/planner/fake_kube.py): one candidate leads, another takes over
only once the lease expired as it saw it, a leader that cannot renew stops acting before
then, a takeover that races a renewal loses on the 409 (a create that races another on
the 409 AlreadyExists), each candidate counts the takeovers it sees; end to end, of two
`kvplane planner run` only the leader acts (and its /metrics says it leads), the other takes
over when the leader is killed, and a leader whose renewals fail stops acting until it holds
the lease again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any, Never

import grpc
import pytest

from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.config import (
    LeaderElectionConfig,
    PlannerConfig,
    PoolConfig,
    ScalingConfig,
    SlaTargets,
)
from planner.controller_admin import NOT_RECONCILED
from planner.core.decisions import Decision, Reason, ScalePool
from planner.core.observations import EngineState, Observations
from planner.core.planner import Planner
from planner.kube_api import KubeApi, KubeApiError, KubeConnection, Scale
from planner.kubernetes import in_daemon_thread
from planner.leader_election import LeaderElector
from planner.live import LivePlanner
from planner.metrics import PlannerMetrics
from tests.controller.conftest import generate_request
from tests.partial_servicers import PartialAdmin
from tests.planner.fake_kube import FakeKube, Fault
from tests.planner.test_planner_kubernetes import DEPLOYMENT, Cluster, cluster_with
from tests.planner.test_planner_live import scrape, serving_admin, value
from tests.polling import eventually

LEASE = "kvplane-planner"


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async for cluster in cluster_with(tmp_path, None, 0):
        yield cluster


class Transitions:
    """What a candidate reports by `on_transitions`, summed."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, count: int) -> None:
        self.count += count


def candidate(
    cluster: Cluster,
    identity: str,
    clock: Clock,
    api: KubeApi | None = None,
    transitions: Transitions | None = None,
) -> LeaderElector:
    """A candidate with client-go's timing (15 s, 10 s, 2 s) on `clock`."""
    return LeaderElector(
        api or cluster.api(),
        LeaderElectionConfig(),
        identity,
        clock=clock,
        on_transitions=transitions or Transitions(),
    )


def lease_spec(kube: FakeKube) -> dict[str, Any]:
    return dict(kube.leases[LEASE]["spec"])


@pytest.mark.timeout(60)
async def test_a_standby_takes_over_only_once_the_lease_expired_and_the_leader_stopped_before(
    cluster: Cluster,
) -> None:
    clock = Clock()
    a, b = candidate(cluster, "a", clock), candidate(cluster, "b", clock)
    assert await a.try_acquire_or_renew() and a.leading  # the Lease is made, held by a
    first = lease_spec(cluster.kube)
    assert first["holderIdentity"] == "a" and first["leaseDurationSeconds"] == 15
    assert first["leaseTransitions"] == 0 and first["acquireTime"] == first["renewTime"]
    assert not await b.try_acquire_or_renew() and not b.leading  # held: b stands by
    clock.now = 5.0
    assert await a.try_acquire_or_renew()  # a renewal: the term goes on
    renewed = lease_spec(cluster.kube)
    assert renewed["acquireTime"] == first["acquireTime"] and renewed["leaseTransitions"] == 0
    assert renewed["renewTime"] >= first["renewTime"]
    clock.now = 14.0
    # b sees the renewal now (its own clock: the holder's may be skewed): valid until 29 s.
    assert not await b.try_acquire_or_renew()
    # a stops renewing (killed, or cut off from the API server): past its renew deadline (10 s
    # from its last renewal) it no longer leads, before b may take over.
    clock.now = 15.5
    assert not a.leading
    assert not await b.try_acquire_or_renew()
    clock.now = 28.5
    assert not await b.try_acquire_or_renew()
    clock.now = 29.5
    assert await b.try_acquire_or_renew() and b.leading
    taken = lease_spec(cluster.kube)
    assert taken["holderIdentity"] == "b" and taken["leaseTransitions"] == 1
    assert taken["acquireTime"] == taken["renewTime"] > renewed["renewTime"]
    # a, back, finds the lease taken: it stands by until b's expires.
    assert not await a.try_acquire_or_renew() and not a.leading


@pytest.mark.timeout(60)
async def test_each_candidate_counts_the_takeovers_it_sees_its_own_included(
    cluster: Cluster,
) -> None:
    """From the first Lease it reads (its baseline: a made Lease counts none), a candidate
    counts each new holder it sees, by the Lease's leaseTransitions: a release is none, the
    takeover of a released Lease one."""
    clock = Clock()
    seen_by = {name: Transitions() for name in "abc"}
    a, b, c = (candidate(cluster, n, clock, transitions=seen_by[n]) for n in "abc")
    assert await a.try_acquire_or_renew()  # made: no takeover
    assert not await b.try_acquire_or_renew()
    clock.now = 16.0  # a renewed nothing: expired as b saw it
    assert await b.try_acquire_or_renew()  # b takes over
    assert not await a.try_acquire_or_renew()  # a sees it
    assert not await c.try_acquire_or_renew()  # c's first read (a candidate started late)
    assert [seen_by[n].count for n in "abc"] == [1, 1, 0]
    await b.release()  # no new holder yet
    assert await a.try_acquire_or_renew()  # the released Lease taken: one more
    assert not await b.try_acquire_or_renew()
    assert not await c.try_acquire_or_renew()
    assert lease_spec(cluster.kube)["leaseTransitions"] == 2
    assert [seen_by[n].count for n in "abc"] == [2, 2, 1]


class ReadsThen(KubeApi):
    """An API client that runs `then` after each Lease it reads (before its caller writes)."""

    def __init__(self, connection: KubeConnection, then: Any) -> None:
        super().__init__(connection)
        self._then = then

    def get_lease(self, name: str) -> dict[str, Any]:
        try:
            return super().get_lease(name)
        finally:
            self._then()


@pytest.mark.timeout(60)
async def test_a_takeover_that_races_the_leaders_renewal_loses_on_the_conflict(
    cluster: Cluster,
) -> None:
    """The update is conditional on the resourceVersion read: a candidate that read an
    expired lease, which its holder renewed before the candidate's write, gets a 409 and
    stands by; the lease stays the holder's."""
    clock = Clock()
    a = candidate(cluster, "a", clock)
    assert await a.try_acquire_or_renew()
    raw = cluster.api()

    def renewal_by_a() -> None:
        lease = raw.get_lease(LEASE)
        raw.update_lease(lease, {**lease["spec"], "renewTime": "2099-01-01T00:00:00.000000Z"})

    renewals_first = ReadsThen(cluster.api().connection, lambda: None)
    b = candidate(cluster, "b", clock, renewals_first)
    assert not await b.try_acquire_or_renew()  # seen at 0 s, held by a
    clock.now = 16.0  # expired as b saw it
    renewals_first._then = renewal_by_a
    assert not await b.try_acquire_or_renew() and not b.leading
    spec = lease_spec(cluster.kube)
    assert spec["holderIdentity"] == "a" and spec["renewTime"].startswith("2099")


@pytest.mark.timeout(60)
async def test_of_two_candidates_that_found_no_lease_the_second_to_create_it_stands_by(
    cluster: Cluster,
) -> None:
    raw = cluster.api()

    def creation_by_a() -> None:  # between b's read (404) and its create
        if LEASE not in cluster.kube.leases:
            raw.create_lease(LEASE, {"holderIdentity": "a", "leaseDurationSeconds": 15})

    b = candidate(cluster, "b", Clock(), ReadsThen(raw.connection, creation_by_a))
    assert not await b.try_acquire_or_renew() and not b.leading  # 409 AlreadyExists
    assert lease_spec(cluster.kube)["holderIdentity"] == "a"


@pytest.mark.timeout(60)
async def test_a_leaders_api_calls_end_at_its_renew_deadline_none_sent_after(
    cluster: Cluster,
) -> None:
    """A leader's client (as `kvplane planner run` gives each term's actuator) ends each call
    by the renew deadline: a scale PATCH answered 429 with a Retry-After past it is not sent
    again (a client bound only by api_timeout_s, 10 s, sends it then: past the 5 s margin
    before a standby may take over, two leaders would write), and past the deadline none is
    sent at all."""
    clock = Clock()
    a = candidate(cluster, "a", clock)
    assert await a.try_acquire_or_renew()  # leading until 10 s on its clock
    leader_api = cluster.api().within(a.left_s)

    def scale_patches() -> int:
        return sum(1 for _, method, path in cluster.kube.writes if path.endswith("/scale"))

    async def throttled_scale_to(replicas: int, api: KubeApi) -> Scale:
        cluster.kube.faults.append(Fault("PATCH", "deployments/scale", 429, retry_after_s=3))
        return await in_daemon_thread(api.patch_scale, DEPLOYMENT, replicas, "")

    clock.now = 8.0  # 2 s left: the Retry-After would send it again past the deadline
    with pytest.raises(KubeApiError, match="429 TooManyRequests"):
        await throttled_scale_to(1, leader_api)
    assert scale_patches() == 1 and cluster.kube.deployments[DEPLOYMENT].replicas == 0
    await throttled_scale_to(1, cluster.api())  # unbound: sent again after 3 s, and made
    assert scale_patches() == 3 and cluster.kube.deployments[DEPLOYMENT].replicas == 1
    clock.now = 10.5  # not renewed: its term is over
    assert not a.leading
    with pytest.raises(KubeApiError, match="not sent: past its deadline"):
        await in_daemon_thread(leader_api.patch_scale, DEPLOYMENT, 0, "")
    assert scale_patches() == 3 and cluster.kube.deployments[DEPLOYMENT].replicas == 1


class ControllerHung(PartialAdmin):
    """A controller that accepts the connection and answers nothing: each call it gets is
    counted, then held."""

    def __init__(self) -> None:
        self.calls = 0

    async def _hang(self) -> Never:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    async def ListWorkers(
        self, request: apb.ListWorkersRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.ListWorkersResponse:
        await self._hang()

    async def RemoveEngine(
        self, request: apb.EngineRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.WorkerInfo:
        await self._hang()


@pytest.mark.timeout(60)
async def test_a_leaders_controller_calls_end_at_its_renew_deadline_none_sent_after(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader's actuator (its client `within` the term, as `kvplane planner run` gives
    each term's) bounds its calls to the controller as its API calls: a controller that
    accepts the connection and never answers holds none past the renew deadline (here the
    admin calls' own bound is an hour), and past the deadline none is sent at all. Before,
    only the API calls were bounded so: the reconciliation waited on the hung controller
    for the admin calls' bound (5 s by default), past the margin before a standby may take
    over."""
    from planner import controller_admin as controller_admin_module

    monkeypatch.setattr(controller_admin_module, "ADMIN_TIMEOUT_S", 3600.0)
    caplog.set_level(logging.WARNING, logger="planner.controller_admin")
    clock = Clock()
    a = candidate(cluster, "a", clock)
    assert await a.try_acquire_or_renew()  # leading until 10 s on its clock
    controller = ControllerHung()
    async with serving_admin(controller) as port:
        actuator = cluster.actuator(cluster.api().within(a.left_s), controller=f"127.0.0.1:{port}")
        try:
            clock.now = 9.0  # 1 s left
            engine = "127.0.0.1:1"
            assert await actuator.sync([engine], {}) == NOT_RECONCILED
            assert controller.calls == 1
            (said,) = [r.getMessage() for r in caplog.records]
            assert said.startswith("controller: DEADLINE_EXCEEDED")
            clock.now = 10.5  # not renewed: its term is over
            assert not a.leading
            assert await actuator.sync([engine], {}) == NOT_RECONCILED
            await actuator.stop(engine)  # its RemoveEngine fails at once too
            assert controller.calls == 1  # none sent
        finally:
            await actuator.close()


@pytest.mark.timeout(60)
async def test_a_removal_that_gets_its_pools_turn_after_the_term_ended_is_skipped(
    one_pod: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """At a leader's end (`end_term`, while it leads), the removals queued in a pool all go,
    each taking its turn under the pool's lock; one whose turn comes once the term is over
    (the Lease lost meanwhile) does nothing, as one the term's end cut short: no "stopping
    ... failed" error nor stop failure for it, the engine registered and its pod serving,
    for the next leader to take over."""
    cluster = one_pod
    caplog.set_level(logging.WARNING)
    clock, metrics = Clock(), PlannerMetrics()
    a = candidate(cluster, "a", clock)
    assert await a.try_acquire_or_renew()  # leading until 10 s on its clock
    actuator = cluster.actuator(cluster.api().within(a.left_s))
    core = Planner(PlannerConfig(pools=(PoolConfig(min_engines=1, max_engines=1),)))
    live = LivePlanner(core, actuator, clock=clock, metrics=metrics, may_act=lambda: a.leading)
    try:
        await live.tick()  # adopts the Deployment's pod
        (engine,) = live.engines.values()
        await eventually(lambda: cluster.registered() == [engine.engine_id])
        async with actuator._pool_locks[engine.pool]:  # an earlier removal, under way
            await live._remove(engine)
            ending = asyncio.create_task(live.end_term())
            await asyncio.sleep(0.1)  # the removal waits for the lock
            assert not ending.done()
            clock.now = 10.5  # not renewed: its term is over
        await ending
        assert cluster.registered() == [engine.engine_id]
        assert cluster.kube.deployments[DEPLOYMENT].replicas == 1
        failures = metrics.registry.get_sample_value(
            "kvplane_planner_actuator_failures_total", {"operation": "stop"}
        )
        assert not failures
        assert not [r for r in caplog.records if r.name.startswith("planner.")]
    finally:
        await live.close()


# ------------------------------------------------------------------ a warm standby


@pytest.fixture
async def one_pod(tmp_path: Path) -> AsyncIterator[Cluster]:
    async for cluster in cluster_with(tmp_path, None, 1):
        yield cluster


class RecordedPlanner(Planner):
    """The kvplane core, keeping what each `decide` returned."""

    def __init__(self, config: PlannerConfig) -> None:
        super().__init__(config)
        self.decisions: list[list[Decision]] = []
        self.decided = asyncio.Event()

    def decide(self, observations: Observations, now_s: float) -> list[Decision]:
        decisions = super().decide(observations, now_s)
        self.decisions.append(decisions)
        self.decided.set()
        return decisions


@pytest.mark.timeout(120)
async def test_a_standby_learns_from_the_fleet_writing_nothing_and_decides_at_once_as_leader(
    one_pod: Cluster, tmp_path: Path
) -> None:
    """Standing by (`LivePlanner.watch`, on an injected clock), the planner observes the
    Deployment's pod as a leader does (its load, the forward passes of a generation it runs)
    and its core learns from them (the pool sized), while the API server gets no write from
    it (its own token), the controller no registration, and its metrics no gauge of the
    fleet (only the leader's report it). Taking over, its first tick sizes the pool from that
    history (an ITL target below any pass's time: the pool's maximum), where a planner that
    observed nothing only measures at its first; its term exports the fleet, until it ends."""
    cluster = one_pod
    cluster.kube.other_tokens.add("standby-token")
    token_file = tmp_path / "standby-token"
    token_file.write_text("standby-token\n")
    scaling = ScalingConfig(tick_s=0.2, scale_up_cooldown_s=0)
    pool = PoolConfig(min_engines=1, max_engines=2)
    core = RecordedPlanner(PlannerConfig(sla=SlaTargets(itl_ms=1), pools=(pool,), scaling=scaling))
    clock, metrics = Clock(), PlannerMetrics()
    fleet = cluster.actuator(cluster.api(token_file))
    live = LivePlanner(core, fleet, clock=clock, metrics=metrics)

    def passes_seen() -> float:
        passes = metrics.registry.get_sample_value(
            "kvplane_planner_forward_passes_total", {"pool": "default"}
        )
        return passes or 0.0

    try:
        async with generating(cluster):
            while not passes_seen() or core.estimate("default") is None:
                clock.now += 1.0
                await live.watch(fleet.serving)
                await asyncio.sleep(0.05)  # passes to come (the loop waits for them)
            assert [e.state for e in live.engines.values()] == [EngineState.SERVING]
            assert fleet_gauges(exported(metrics)) == set()
            assert not [w for w in cluster.kube.writes if w[0] == "standby-token"]
            assert cluster.registered() == [] and core.decisions == []
            assert cluster.kube.deployments[DEPLOYMENT].replicas == 1
            stop = asyncio.Event()
            clock.now += 1.0
            term = asyncio.create_task(live.lead(cluster.actuator(), stop, scaling.tick_s))
            await core.decided.wait()
            await eventually(lambda: fleet_gauges(exported(metrics)) == FLEET_GAUGES)
            stop.set()
            await term
            assert fleet_gauges(exported(metrics)) == set()  # standing by again
    finally:
        await live.close()
    assert core.decisions[0] == [ScalePool("default", 2, Reason.FORECAST_NEEDS_MORE)]


@contextlib.asynccontextmanager
async def generating(cluster: Cluster) -> AsyncIterator[None]:
    """While a long generation runs on the Deployment's one pod: its forward passes go on."""
    (pod,) = cluster.kube.ready_pods(DEPLOYMENT)
    async with grpc.aio.insecure_channel(cluster.kube.address(pod)) as channel:
        request = generate_request("long", [1, 2, 3], max_tokens=1_000_000)
        generation = pb_grpc.OpenEngineStub(channel).Generate(request)
        try:
            await generation.initial_metadata()
            yield
        finally:
            generation.cancel()


# The gauges of the fleet: every gauge of the planner's but whether it leads.
FLEET_GAUGES = {
    family.name for family in PlannerMetrics().registry.collect() if family.type == "gauge"
} - {"kvplane_planner_leader"}


def fleet_gauges(names: Iterable[str]) -> set[str]:
    """The gauges of the fleet among the names of samples `names`."""
    return set(names) & FLEET_GAUGES


def exported(metrics: PlannerMetrics) -> Iterator[str]:
    """The names of the samples `metrics` has."""
    return (sample.name for family in metrics.registry.collect() for sample in family.samples)


# ------------------------------------------------------------------ `kvplane planner run`


def planner_config(
    cluster: Cluster, path: Path, min_engines: int, token_file: Path | None = None
) -> Path:
    """A planner of pool default (at least `min_engines`) over the cluster's Deployment, with
    short leases (2 s, renewed every 0.2 s: a takeover within seconds), calling the API
    server with `token_file` (the cluster's if None)."""
    kubernetes = {
        "api_server": cluster.kube.url,
        "namespace": cluster.kube.namespace,
        "token_file": str(token_file or cluster.token_file),
        "engine_port": cluster.kube.engine_port,
        "deployments": {"default": DEPLOYMENT},
        "poll_s": 0.1,
        "leader_election": {"lease_duration_s": 2, "renew_deadline_s": 1, "retry_period_s": 0.2},
    }
    scaling = {"tick_s": 0.2, "scale_up_cooldown_s": 0, "scale_down_cooldown_s": 0}
    config = {
        "pools": [{"min_engines": min_engines, "max_engines": 2}],
        "scaling": scaling,
        "live": {
            "controller": f"127.0.0.1:{cluster.app.port}",
            "kubernetes": kubernetes,
            "metrics_listen": "127.0.0.1:0",
        },
    }
    path.write_text(json.dumps(config))
    return path


async def start_planner(config: Path, log: Path) -> asyncio.subprocess.Process:
    with log.open("wb") as stderr:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvplane", "planner", "run", "--config", str(config),
            stderr=stderr,
        )  # fmt: skip


async def logged(log: Path, text: str, after: str | None = None) -> list[str]:
    """Until the planner's `log` has a line holding `text` (after the line holding `after`,
    if given); its lines."""
    async with asyncio.timeout(90):
        while True:
            lines = (await asyncio.to_thread(log.read_text)).splitlines()
            start = next((i for i, line in enumerate(lines) if after and after in line), -1)
            if after is not None and start < 0:
                await asyncio.sleep(0.05)
                continue
            if any(text in line for line in lines[start + 1 :]):
                return lines
            await asyncio.sleep(0.05)


async def metrics_port(log: Path) -> int:
    """The planner's /metrics port (`metrics_listen: 127.0.0.1:0`), from its log."""
    lines = await logged(log, "metrics on http://")
    match = next(m for line in lines if (m := re.search(r"metrics on http://.*:(\d+)/", line)))
    return int(match[1])


async def leader_metrics(log: Path) -> tuple[float | None, float | None]:
    """The planner's `kvplane_planner_leader` and `..._leader_transitions_total`."""
    samples = await scrape(await metrics_port(log))
    leader = value(samples, "kvplane_planner_leader")
    return leader, value(samples, "kvplane_planner_leader_transitions_total")


def between(lines: list[str], first: str, last: str) -> list[str]:
    """The lines after the first holding `first`, up to the next holding `last`."""
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i, line in enumerate(lines) if i > start and last in line)
    return lines[start + 1 : end]


async def stop(process: asyncio.subprocess.Process, signum: int = signal.SIGTERM) -> None:
    if process.returncode is None:
        process.send_signal(signum)
        await process.wait()


@pytest.mark.timeout(180)
async def test_of_two_planners_only_the_leader_acts_and_the_other_takes_over_when_it_dies(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Planner a (at least one engine) leads; planner b (at least two: a difference the test
    can see) stands by and decides nothing until a is killed (SIGKILL: no release), then
    takes over once the lease expired and scales the pool to its own minimum. Each one's
    /metrics says whether it leads, and b counts the one takeover it saw (its own). Standing
    by, b observes a's engine (its /metrics count the forward passes of a generation there)
    and the API server gets no write from it (b has a token of its own); only the leader's
    /metrics show the fleet (the engines, the sizing): b's from its takeover on."""
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = await start_planner(planner_config(cluster, tmp_path / "a.yaml", 1), a_log)
    b = None
    cluster.kube.other_tokens.add("planner-b")
    b_token = tmp_path / "b-token"
    b_token.write_text("planner-b\n")
    try:
        await logged(a_log, "leading: lease serving/kvplane-planner taken")
        await cluster.wait_routable(1)
        b_config = planner_config(cluster, tmp_path / "b.yaml", 2, b_token)
        b = await start_planner(b_config, b_log)
        await logged(b_log, "standing by")
        assert lease_spec(cluster.kube)["holderIdentity"] in a_log.read_text()
        assert await leader_metrics(a_log) == (1, 0)  # a made the Lease: no takeover
        assert await leader_metrics(b_log) == (0, 0)
        a_port, b_port = await metrics_port(a_log), await metrics_port(b_log)

        async def b_observes_the_engine() -> bool:
            samples = await scrape(b_port)
            passes = value(samples, "kvplane_planner_forward_passes_total", pool="default")
            return passes is not None and passes >= 1

        async with generating(cluster):
            await eventually(b_observes_the_engine, 60)
        assert fleet_gauges(name for name, _ in await scrape(b_port)) == set()
        a_samples = await scrape(a_port)
        assert value(a_samples, "kvplane_planner_engines", pool="default", state="serving") == 1
        assert not [w for w in cluster.kube.writes if w[0] == "planner-b"]
        a.send_signal(signal.SIGKILL)
        await a.wait()
        lines = await logged(b_log, "decision: scale pool default to 2", after="leading: lease")
        await cluster.wait_routable(2)
        assert await leader_metrics(b_log) == (1, 1)

        async def b_shows_the_fleet() -> bool:
            samples = await scrape(b_port)
            return value(samples, "kvplane_planner_engines", pool="default", state="serving") == 2

        await eventually(b_shows_the_fleet, 60)
    finally:
        await stop(a, signal.SIGKILL)
        if b is not None:
            await stop(b)
    # b decided nothing while it stood by; it took the lease over from a (one transition).
    assert not any("decision:" in line for line in between(lines, "standing by", "leading:"))
    assert b.returncode == 0
    assert cluster.kube.deployments[DEPLOYMENT].replicas == 2
    spec = lease_spec(cluster.kube)
    assert spec["leaseTransitions"] == 1 and spec["holderIdentity"] == ""  # b released it


@pytest.mark.timeout(180)
async def test_a_leader_whose_renewals_fail_stops_acting_until_it_leads_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The API server refuses the renewals (500): past renew_deadline_s the planner stops
    acting (the Deployment scaled to 0 by hand meanwhile is left so), and once it holds the
    lease again it scales the pool back to its minimum."""
    log = tmp_path / "planner.log"
    planner = await start_planner(planner_config(cluster, tmp_path / "p.yaml", 1), log)
    try:
        await cluster.wait_routable(1)
        cluster.kube.faults.append(Fault("PUT", "leases", 500, times=10**6))
        await logged(log, "not renewed within renew_deadline_s (1 s): stopped acting")
        cluster.api().patch_scale(DEPLOYMENT, 0, "")  # an operator's scale to 0
        await cluster.wait(lambda: not cluster.kube.pods)
        cluster.kube.faults.clear()
        lines = await logged(log, "decision: scale pool default to 1", after="stopped acting")
        await cluster.wait_routable(1)
    finally:
        await stop(planner)
    assert not any("decision:" in line for line in between(lines, "stopped acting", "leading:"))
    assert planner.returncode == 0
