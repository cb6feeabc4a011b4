"""The Kubernetes actuator (`planner.kubernetes.KubernetesDeployments`) against a naive model of
the rules docs/planner.md ("The Kubernetes actuator") and the module's docstring give, driven
by a hypothesis state machine the way `planner.live.LivePlanner` drives it, over the fake API
server (tests/planner/fake_kube.py: a ReplicaSet-like part, pods as real `kvplane engine serve
--model sim` processes) and a real in-process controller.

Rules: a start (its scale PATCH answered 500, or 504 though made, now and then); a drain of a
serving engine; a removal (`stop`) of a draining one, or of one drained just now (its scale-
down refused by RBAC, answered 500, or 504 though made, now and then); a tick's look (`adopt`,
`exited`, the exited engines stopped as the live planner does, `sync`); an engine's container
crashed (restarted only when the test says: CrashLoopBackOff meanwhile), and a crashed pod that
is no engine restarted; an engine's pod deleted by an operator; the Deployment scaled up by an
operator; the planner restarted (a new actuator, its first look waited for). A rule drawn where
it does not apply does nothing, so what is drawn does not depend on the cluster (pod names,
timings).

The model: the planner's engines (address -> pod, serving or draining, crashed), the
Deployment's spec.replicas, and the removals not done yet (refused, or whose outcome was not
known). After each rule, once the cluster has settled (as many active pods as replicas, each
Ready or crash-looping), the invariants: spec.replicas is the model's; the controller lists
exactly the planner's engines and routes to none but serving ones; each engine is its own
Ready pod; no pod the ReplicaSet deleted to scale down was a serving engine's; and after a
look, every active pod is an engine's, crash-looping, or a removal's not done yet (the pool
ends at its target, no pod left serving nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import urllib.request
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from kvplane.errors import KvplaneError
from kvplane.token_file import TokenFile
from planner.kube_api import KubeApi, KubeConnection
from planner.kubernetes import KubernetesDeployments
from tests.planner.fake_kube import FakeKube, Fault

pytestmark = pytest.mark.timeout(300)

POOL = "default"
DEPLOYMENT = "kvplane-engine"
LABELS = {"app": "kvplane-engine", "pool": POOL}
SETTLE_S = 60.0
T = TypeVar("T")
M = TypeVar("M", bound=RuleBasedStateMachine)
# Which of the candidates a rule takes (modulo their number). A rule drawn where it does not
# apply does nothing: the draws do not depend on what the cluster did (pod names, timings),
# which hypothesis would report as flaky data generation.
picks = st.integers(0, 7)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


@dataclass
class Engine:
    """One engine of the planner as the documented rules have it."""

    pod: str
    draining: bool = False
    crashed: bool = False  # its container killed, or its pod deleted: the next look says so


@dataclass(frozen=True)
class PodView:
    """A pod of the Deployment as the cluster has it now."""

    name: str
    address: str
    ready: bool
    active: bool  # neither terminating nor failed
    crash_looping: bool  # its container exited, its restart waiting


class KubernetesActuatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.workdir = Path(tempfile.mkdtemp(prefix="kube-actuator-model-"))
        health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1}
        config = {"listen": "127.0.0.1:0", "health": health, "shutdown_grace_s": 0.5}
        self.app: ControllerApp = self.run(
            start_controller(ControllerConfig.model_validate(config))
        )
        # Crashed containers stay down until `restart_crashed_pod`: the looks see them.
        self.kube = FakeKube(self.workdir, engine_port=free_port(), restart_delay_s=3600)
        token_file = self.workdir / "token"
        token_file.write_text(self.kube.token)
        self.connection = KubeConnection(
            self.kube.url, self.kube.namespace, TokenFile(token_file, "token"), None
        )
        self.actuator: KubernetesDeployments | None = None
        # The model.
        self.engines: dict[str, Engine] = {}  # by address
        self.replicas = 0
        # Removals whose scale-down is not made yet, or not known to be: pod -> whether it was
        # made (a 504 that went through), None when refused before it was sent (RBAC).
        self.unscaled: dict[str, bool | None] = {}

    # ---- plumbing -------------------------------------------------------------------------

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def new_actuator(self) -> KubernetesDeployments:
        return self.run(self._new_actuator())

    async def _new_actuator(self) -> KubernetesDeployments:
        """Made on the machine's loop: its gRPC channels belong to the loop they are made on."""
        return KubernetesDeployments(
            controller=f"127.0.0.1:{self.app.port}",
            api=KubeApi(self.connection),
            deployments={POOL: DEPLOYMENT},
            engine_port=self.kube.engine_port,
            start_timeout_s=SETTLE_S,
            poll_s=0.05,
        )

    def pods(self) -> list[PodView]:
        def read() -> list[PodView]:
            return [
                PodView(
                    pod.name,
                    self.kube.address(pod),
                    pod.ready,
                    pod.active,
                    pod.active and pod.restart_at is not None,
                )
                for pod in self.kube.pods.values()
                if pod.deployment == DEPLOYMENT
            ]

        return self.kube.view(read)

    def pod(self, name: str) -> PodView | None:
        return next((p for p in self.pods() if p.name == name), None)

    def settle(self) -> None:
        """Until the cluster is at rest: as many active pods as spec.replicas, each Ready or
        crash-looping (what a look finds is then what the model says)."""

        def settled() -> bool:
            active = [p for p in self.kube.pods.values() if p.active]
            return len(active) == self.kube.deployments[DEPLOYMENT].replicas and all(
                p.ready or p.restart_at is not None for p in active
            )

        self.run(asyncio.to_thread(self.kube.wait_for, settled, SETTLE_S))

    def registered(self) -> dict[str, bool]:
        """The controller's engines: address -> whether it routes to it."""
        records = self.app.controller.fleet.registry.records()
        return {r.address: r.routable for r in records}

    def controller_state(self, address: str) -> str | None:
        record = next(
            (r for r in self.app.controller.fleet.registry.records() if r.address == address), None
        )
        return None if record is None else record.state.value

    def actor(self) -> KubernetesDeployments:
        assert self.actuator is not None
        return self.actuator

    def free_replicas(self) -> int:
        """Replicas no engine and no removal holds: what a start takes before scaling up."""
        return self.replicas - len(self.engines) - len(self.unscaled)

    def free_pods(self) -> dict[str, str]:
        """Ready pods no engine is and no removal is for (address -> name)."""
        engine_pods = {e.pod for e in self.engines.values()}
        return {
            p.address: p.name
            for p in self.pods()
            if p.ready and p.active and p.name not in engine_pods and p.name not in self.unscaled
        }

    def stand_ins(self) -> int:
        """Removals not made yet whose pod is gone: the ReplicaSet made a pod for each
        replica, and that pod (or another no engine is) goes in its place."""
        active = {p.name for p in self.pods() if p.active}
        return sum(1 for pod, made in self.unscaled.items() if not made and pod not in active)

    def serving(self) -> list[str]:
        return sorted(a for a, e in self.engines.items() if not e.draining and not e.crashed)

    def draining(self) -> list[str]:
        return sorted(a for a, e in self.engines.items() if e.draining)

    def operator(self, method: str, path: str, body: bytes | None = None) -> None:
        request = urllib.request.Request(
            f"{self.kube.url}/{path}",
            data=body,
            method=method,
            headers={
                "Authorization": f"Bearer {self.kube.token}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200

    # ---- the planner's tick ---------------------------------------------------------------

    def look(self) -> None:
        """A tick's look as `LivePlanner` makes it: the pods adopted, the exited engines
        stopped, the fleet reconciled with the controller."""
        actuator = self.actor()
        pods = {p.name: p for p in self.pods()}
        exited = sorted(a for a, e in self.engines.items() if e.crashed)
        # A draining engine whose pod is gone: the pod made for its replica goes instead, so
        # no pod is adopted by this look.
        stand_in_due = any(
            e.crashed and e.draining and not (e.pod in pods and pods[e.pod].active)
            for e in self.engines.values()
        )
        free = self.free_pods()
        # A pod given the IP of an engine whose pod was deleted (pod IPs are recycled) waits
        # until that engine, reported exited now, is stopped: the next look adopts it.
        held = {address for address in free if address in self.engines}
        # The removals not done yet are done now, before the adoptions (one whose pod is gone
        # takes a free pod with it); one that was made is not made again.
        # A stand-in is a pod no engine is, not Ready first: a crash-looping one (its engine
        # exited, its replica stays) before a free one.
        kept = {e.pod for e in self.engines.values() if not e.crashed or e.draining}
        idle_crash_looping = sum(
            1
            for p in self.pods()
            if p.active and p.crash_looping and p.name not in kept and p.name not in self.unscaled
        )
        stand_ins = max(0, self.stand_ins() - idle_crash_looping)
        self.replicas -= sum(1 for made in self.unscaled.values() if not made)
        self.unscaled.clear()
        found = self.run(actuator.adopt())
        assert all(pool == POOL for _, pool in found)
        adopted = sorted(address for address, _ in found)
        assert set(adopted) <= set(free), (adopted, free)
        assert not set(adopted) & held, (adopted, held)
        expected = max(0, len(free) - len(held) - stand_ins)
        assert len(adopted) == (0 if stand_in_due else expected)
        assert actuator.exited() == exited
        for address in adopted:
            self.engines[address] = Engine(free[address])
        for address in exited:
            engine = self.engines.pop(address)
            self.run(actuator.stop(address))
            if engine.draining:  # on its way out: its replica goes with it
                self.replicas -= 1
        self.reconcile([])
        self.settle()
        if stand_in_due or held:  # the pods this look did not adopt are the next one's
            return
        # The pool is at its target: no active pod serves nothing, but a crash-looping one
        # (its replica stays, Kubernetes restarts it) and one a removal has yet to scale away.
        engine_pods = {e.pod for e in self.engines.values()}
        for pod in self.pods():
            if pod.active and not pod.crash_looping:
                assert pod.name in engine_pods, f"pod {pod.name} is no engine after a look"

    def reconcile(self, begun: list[str]) -> None:
        """The live planner's `sync`: its serving and draining engines; `begun` those the
        controller is expected to list as draining that the planner counts as serving."""
        serving = sorted(set(self.serving()) | set(begun))
        draining: dict[str, float | None] = {a: 30.0 for a in self.draining() if a not in begun}
        reconciled = self.run(self.actor().sync(serving, draining))
        if serving or draining:
            assert sorted(reconciled.begun) == sorted(begun)
            assert list(reconciled.withdrawn) == []

    # ---- rules ----------------------------------------------------------------------------

    @initialize(replicas=st.integers(0, 2))
    def a_fleet_left_running(self, replicas: int) -> None:
        """Pods a previous planner left (not registered): the first look adopts them."""
        self.kube.add_deployment(DEPLOYMENT, replicas, LABELS)
        self.replicas = replicas
        self.settle()
        self.actuator = self.new_actuator()
        self.look()

    def may_start(self) -> bool:
        """A start waits for a free replica's pod (one crash-looping: its back-off, an hour
        here) and for a scale-down whose outcome is unknown to be found made (the next look):
        not drawn then."""
        engine_pods = {e.pod for e in self.engines.values()}
        crash_looping = any(
            p.crash_looping and p.name not in engine_pods and p.name not in self.unscaled
            for p in self.pods()
        )
        unknown = any(made is not None for made in self.unscaled.values())
        return not crash_looping and not unknown

    @rule(fault=st.sampled_from([None, None, None, 500, 504]))
    def start(self, fault: int | None) -> None:
        if not self.may_start():
            return
        free = self.free_replicas()
        free_pods = self.free_pods()
        # Free replicas are Ready pods (else no start is drawn), and so are the pods made in
        # place of those gone: a removal's (a stand-in) and an engine's not looked at yet.
        active = {p.name for p in self.pods() if p.active}
        replaced = sum(1 for e in self.engines.values() if e.pod not in active)
        assert len(free_pods) == free + self.stand_ins() + replaced
        if fault is not None:
            self.kube.faults.append(
                Fault("PATCH", "deployments/scale", fault, applied=fault == 504)
            )
        try:
            address = self.run(self.actor().start(POOL))
        except KvplaneError as exc:
            # Only a scale-up meets the fault; one that may have been made is not retried.
            assert free == 0 and fault is not None, exc
            self.replicas += fault == 504
            self.kube.faults.clear()
            self.settle()
            return
        self.kube.faults.clear()
        if free:
            assert address in free_pods  # no scale-up: the free replica's pod is taken
        else:  # a scale-up; the pod taken may be a stand-in's, the new pod then goes instead
            self.replicas += 1
            assert address not in self.engines
            if not self.stand_ins() + replaced:
                assert address not in free_pods  # the new pod
        self.settle()
        pod = next(p for p in self.pods() if p.address == address and p.active)
        # Never a pod a removal is still to scale away (a drained engine's).
        assert pod.name not in self.unscaled, pod
        self.engines[address] = Engine(pod.name)
        assert self.registered().get(address) is True  # routed to once the start returns

    @rule(pick=picks)
    def drain(self, pick: int) -> None:
        if not (serving := self.serving()):
            return
        address = serving[pick % len(serving)]
        self.run(self.actor().drain(address, 30.0))
        self.engines[address].draining = True
        # Out of routing at once; listed as draining once its health says so (what a new
        # planner's `sync` goes by).
        fleet = self.app.controller.fleet
        self.run(fleet.wait_for(lambda: self.controller_state(address) == "draining", SETTLE_S))
        assert not self.registered()[address]

    @rule(pick=picks, fault=st.sampled_from([None, None, None, 403, 500, 504]))
    def stop(self, pick: int, fault: int | None) -> None:
        """The removal of a drained engine: out of the controller, then the removals not done
        yet scaled away in order, its own last; the first that fails stops the others (they
        wait for it), and the error names it. None draining, one drained just now (the core
        drains an engine, then removes it once empty). With a pod crash-looping too (the
        ReplicaSet deletes a not-Ready pod before any Ready one, whatever its deletion cost),
        the drained pod is deleted first: the crash-looping one stays."""
        if not (draining := self.draining()):
            self.drain(pick)
            if not (draining := self.draining()):
                return
        address = draining[pick % len(draining)]
        engine = self.engines.pop(address)
        if fault == 403:
            self.kube.forbidden.add(("patch", "deployments/scale"))
        elif fault is not None:
            self.kube.faults.append(
                Fault("PATCH", "deployments/scale", fault, applied=fault == 504)
            )
        try:
            self.run(self.actor().stop(address))
        except KvplaneError as exc:
            raised: KvplaneError | None = exc
        else:
            raised = None
        finally:
            self.kube.forbidden.clear()
            self.kube.faults.clear()
        self.unscaled[engine.pod] = False
        failed = None
        for name, made in list(self.unscaled.items()):
            if made:  # found made: not sent again
                del self.unscaled[name]
            elif fault is None:
                self.replicas -= 1
                del self.unscaled[name]
            else:  # the first PATCH meets the fault; the later removals wait
                failed = name
                self.unscaled[name] = None if fault == 403 else fault == 504
                self.replicas -= fault == 504
                break
        if failed is None:
            assert raised is None, raised
        else:
            assert raised is not None and f"pod {failed} not scaled away yet" in str(raised)
        self.settle()
        pod = self.pod(engine.pod)
        if self.unscaled.get(engine.pod, True):  # scaled away: the drained pod is the one gone
            assert pod is None or not pod.active, f"drained pod {engine.pod} stays"

    @rule()
    def tick(self) -> None:
        self.look()

    @rule(pick=picks, how=st.sampled_from(["crash", "crash", "delete", "delete, IP reused"]))
    def engine_lost(self, pick: int, how: str) -> None:
        """An engine's container crashes (its pod stays, not Ready, CrashLoopBackOff), or an
        operator deletes its pod (the ReplicaSet makes another, which may be given the
        deleted pod's IP: pod IPs are recycled)."""
        if not (alive := sorted(a for a, e in self.engines.items() if not e.crashed)):
            return
        engine = self.engines[alive[pick % len(alive)]]
        fake = self.kube.view(lambda: self.kube.pods[engine.pod])
        if how == "crash":
            self.kube.kill_container(engine.pod)
            self.run(asyncio.to_thread(self.kube.wait_for, lambda: fake.restart_at is not None))
        else:
            reused = how == "delete, IP reused"
            self.kube.unschedulable = reused  # its replacement waits, Pending, for the IP
            self.operator("DELETE", f"api/v1/namespaces/{self.kube.namespace}/pods/{engine.pod}")
            if reused:
                gone = lambda: engine.pod not in self.kube.pods  # noqa: E731
                self.run(asyncio.to_thread(self.kube.wait_for, gone, SETTLE_S))
                self.kube.reuse_ip(fake.ip)
                self.kube.unschedulable = False
        engine.crashed = True
        self.settle()

    @rule(pick=picks)
    def restart_crashed_pod(self, pick: int) -> None:
        """A crashed pod no engine is (its engine stopped) runs again: the next look adopts it,
        or a start takes it."""
        engine_pods = {e.pod for e in self.engines.values()}
        names = sorted(p.name for p in self.pods() if p.crash_looping and p.name not in engine_pods)
        if not names:
            return
        name = names[pick % len(names)]
        self.kube.restart_container(name)
        self.settle()

    # Not while a scale-down's outcome is unknown: the operator's count would hide whether it
    # was made, and the removal tried again would scale down once more (documented).
    @rule()
    def operator_scales_up(self) -> None:
        """`kubectl scale` one replica up: a pod no engine is, which the next look adopts."""
        if self.replicas >= 4 or True in self.unscaled.values():
            return
        self.replicas += 1
        body = b'{"spec": {"replicas": %d}}' % self.replicas
        path = f"apis/apps/v1/namespaces/{self.kube.namespace}/deployments/{DEPLOYMENT}/scale"
        self.operator("PATCH", path, body)
        self.settle()

    @rule()
    def planner_restarts(self) -> None:
        """A new planner (a restart, the next leader) takes the fleet over as it finds it: its
        first look adopts every Ready pod, the draining ones included (its `sync` finds them
        draining at the controller), and a removal that did not scale its pod away yet is
        cut short: that pod, its deletion cost cleared, is an engine again, registered again,
        and found draining too (its engine drains still). (Not with an engine crashed and not
        looked at: its pod not Ready, the new planner does not know it, and the controller
        lists it until the pod runs again.)"""
        if any(e.crashed for e in self.engines.values()):
            return
        self.run(self.actor().close())
        draining = self.draining()
        cut_short = set(self.unscaled)
        self.engines = {}
        # Made, its pod went; not made, the pod stays for the new planner to adopt.
        self.unscaled.clear()
        self.actuator = self.new_actuator()
        pods = {p.address: p for p in self.pods() if p.ready and p.active}
        adopted = self.run(self.actor().adopt())
        assert sorted(a for a, _ in adopted) == sorted(pods)
        for address, pod in pods.items():
            self.engines[address] = Engine(pod.name)
            if pod.name in cut_short:  # registered again: draining once its health is read
                draining.append(address)
        fleet = self.app.controller.fleet
        again = [a for a in draining if self.engines[a].pod in cut_short]
        self.run(
            fleet.wait_for(lambda: all(self.controller_state(a) == "draining" for a in again), 30)
        )
        self.reconcile(draining)  # found draining: the new planner counts them as leaving
        for address in draining:
            self.engines[address].draining = True
        self.settle()

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def the_deployment_has_the_models_replicas(self) -> None:
        if self.actuator is not None:
            assert self.kube.deployments[DEPLOYMENT].replicas == self.replicas

    @invariant()
    def the_controller_lists_the_planners_engines_and_routes_to_serving_ones(self) -> None:
        registered = self.registered()
        assert sorted(registered) == sorted(self.engines)
        routed = {a for a, routable in registered.items() if routable}
        assert routed <= set(self.serving()) | {a for a, e in self.engines.items() if e.crashed}

    @invariant()
    def each_engine_is_its_own_pod(self) -> None:
        pods = {p.name: p for p in self.pods()}
        assert len({e.pod for e in self.engines.values()}) == len(self.engines)
        for address, engine in self.engines.items():
            if engine.crashed:
                continue
            pod = pods[engine.pod]
            assert pod.address == address and pod.ready and pod.active

    @invariant()
    def no_serving_engines_pod_was_scaled_away(self) -> None:
        serving_pods = {self.engines[a].pod for a in self.serving()}
        deleted = self.kube.view(lambda: list(self.kube.deleted))
        assert not serving_pods & set(deleted), (serving_pods, deleted)

    def teardown(self) -> None:
        try:
            if self.actuator is not None:
                self.run(self.actuator.close())
            self.run(self.app.close(0.2))
        finally:
            self.kube.close()
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            shutil.rmtree(self.workdir, ignore_errors=True)


KubernetesActuatorMachine.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKubernetesActuatorModel = KubernetesActuatorMachine.TestCase


# Sequences the machine draws only now and then, replayed every run: each checks a rule whose
# breakage the random runs find only sometimes.


def replay_on(
    machine: M, steps: Iterable[Callable[[M], object]], invariants: Iterable[Callable[[], None]]
) -> None:
    """Run `steps` on `machine`, each of its `invariants` checked after each; then torn down."""
    try:
        for step in steps:
            step(machine)
            for invariant_holds in invariants:
                invariant_holds()
    finally:
        machine.teardown()


def replay(*steps: Callable[[KubernetesActuatorMachine], object]) -> None:
    """Run `steps` on a fresh machine, its invariants checked after each, then a look."""
    machine = KubernetesActuatorMachine()
    invariants = (
        machine.the_deployment_has_the_models_replicas,
        machine.the_controller_lists_the_planners_engines_and_routes_to_serving_ones,
        machine.each_engine_is_its_own_pod,
        machine.no_serving_engines_pod_was_scaled_away,
    )
    replay_on(machine, (*steps, KubernetesActuatorMachine.tick), invariants)


def test_a_start_takes_a_free_replica_without_scaling_up() -> None:
    """An operator's replica not adopted yet is the start's: no replica more."""
    replay(
        lambda m: m.a_fleet_left_running(1),
        KubernetesActuatorMachine.operator_scales_up,
        lambda m: m.start(None),
    )


def ready_first(machine: KubernetesActuatorMachine) -> int:
    """The pick of the serving engine whose pod was Ready first."""
    kube, serving = machine.kube, machine.serving()
    since = kube.view(lambda: {kube.address(p): p.ready_since or 0.0 for p in kube.pods.values()})
    return serving.index(min(serving, key=since.__getitem__))


def test_a_removal_scales_away_the_drained_pod_not_a_newer_one() -> None:
    """Of two pods, the one Ready first drained and removed: without the deletion cost, the
    ReplicaSet would delete the other, Ready more recently."""
    replay(lambda m: m.a_fleet_left_running(2), lambda m: m.stop(ready_first(m), None))


def test_a_start_does_not_take_the_pod_of_a_removal_refused() -> None:
    """A removal's scale-down refused (RBAC) leaves the drained pod Ready: a start scales up
    and takes the new pod, not that one (its engine drains: never routed to)."""
    replay(lambda m: m.a_fleet_left_running(2), lambda m: m.stop(0, 403), lambda m: m.start(None))


def test_a_removal_beside_a_crash_looping_pod_deletes_the_drained_pod() -> None:
    """The ReplicaSet deletes a not-Ready pod before any Ready one, whatever its deletion
    cost: one replica fewer alone would take the crash-looping pod and spare the drained one,
    which the next look would scale away again, the Deployment one replica short."""
    replay(
        lambda m: m.a_fleet_left_running(2),
        lambda m: m.engine_lost(0, "crash"),
        KubernetesActuatorMachine.tick,  # its engine stopped: the replica stays
        lambda m: m.stop(0, None),
    )


def test_a_refused_removal_beside_a_crash_looping_pod_is_done_at_the_next_look() -> None:
    """The drained pod deleted, the scale-down refused (RBAC): the next look scales one
    replica away, a pod no engine is (the crash-looping one, not Ready, as the ReplicaSet
    would choose), and adopts the pod the ReplicaSet made for the drained pod's replica."""
    replay(
        lambda m: m.a_fleet_left_running(2),
        lambda m: m.engine_lost(0, "crash"),
        KubernetesActuatorMachine.tick,
        lambda m: m.stop(0, 403),
        KubernetesActuatorMachine.tick,
    )


def test_a_start_does_not_take_the_pod_given_the_ip_of_an_engine_not_looked_at() -> None:
    """An engine's pod deleted and its IP given to the pod made in its place, before a look:
    a start scales up and takes the new pod, not that one (one address, one engine); the
    look reports the old engine exited and stops it, and the next adopts that pod."""
    replay(
        lambda m: m.a_fleet_left_running(1),
        lambda m: m.engine_lost(0, "delete, IP reused"),
        lambda m: m.start(None),
        KubernetesActuatorMachine.tick,
    )
