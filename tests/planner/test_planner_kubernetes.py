"""The Kubernetes actuator against a fake API server (tests/planner/fake_kube.py: the real
paths and JSON, a ReplicaSet-like controller, pods as real `kvplane engine serve --model sim`
processes on their own loopback IPs) and a real in-process controller: a start scales up and
registers the Ready pod; a removal deletes the drained pod, not a serving one (and is retried
when the API refuses it); a restarted planner adopts the pods instead of doubling them; pods
that vanish or crash are reported and leave the controller, draining ones (drained by the
planner or by hand) with their replicas, one whose drain by hand was not taken serves again
(keeping its replica), and the pod made for the replica of a draining pod deleted or evicted
is the one deleted; a hung pod is scaled away and replaced by one start;
API errors are one line; end to end, load scales the pool up and its end scales it down again,
deleting the drained pod."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import itertools
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from kvplane.cli import app as kvplane_app
from kvplane.config import load_config
from kvplane.errors import ConfigError, KvplaneError
from kvplane.request_decoding import TolerantRegistration
from kvplane.token_file import TokenFile
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.config import CapacityConfig, PlannerConfig, PoolConfig, ScalingConfig
from planner.controller_admin import ControllerAdmin
from planner.core.decisions import Decision, DrainEngine, Reason, RemoveEngine, ScalePool
from planner.core.observations import EngineState
from planner.core.planner import Planner
from planner.kube_api import (
    DELETION_COST,
    SERVICE_ACCOUNT_DIR,
    KubeApi,
    KubeApiError,
    KubeConnection,
    Pod,
    Scale,
    in_cluster,
)
from planner.kubernetes import DRAINED_DELETION_COST, KubernetesDeployments
from planner.live import LivePlanner
from planner.metrics import PlannerMetrics
from tests.controller.conftest import generate_request
from tests.planner.fake_kube import FakeKube, Fault
from tests.planner.fake_kube import Pod as FakePod
from tests.polling import eventually
from tests.tcp_forwarder import TcpForwarder

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEPLOYMENT = "kvplane-engine"
LABELS = {"app": "kvplane-engine", "pool": "default"}


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: the fake serves HTTPS, as an API server does,
    and the actuator verifies it against it as its CA file."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "ca.crt", folder / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


@dataclass
class Cluster:
    kube: FakeKube
    app: ControllerApp
    ca_file: Path | None  # None: the fake serves plain HTTP
    token_file: Path

    def api(self, token_file: Path | None = None) -> KubeApi:
        token = followed(token_file or self.token_file)
        return KubeApi(KubeConnection(self.kube.url, self.kube.namespace, token, self.ca_file))

    def actuator(
        self,
        api: KubeApi | None = None,
        *,
        controller: str | None = None,
        start_timeout_s: float = 60,
    ) -> KubernetesDeployments:
        """The actuator of the Deployment, dialling the controller at `controller` (a
        forwarder to it, say), by default the controller itself."""
        return KubernetesDeployments(
            controller=controller or f"127.0.0.1:{self.app.port}",
            api=api or self.api(),
            deployments={"default": DEPLOYMENT},
            engine_port=self.kube.engine_port,
            start_timeout_s=start_timeout_s,
            poll_s=0.05,
        )

    def routable(self) -> list[str]:
        return sorted(r.address for r in self.app.controller.fleet.registry.routable())

    def registered(self) -> list[str]:
        return sorted(r.address for r in self.app.controller.fleet.registry.records())

    async def wait(self, predicate: Callable[[], bool]) -> None:
        await asyncio.to_thread(self.kube.wait_for, predicate)

    async def wait_routable(self, count: int) -> None:
        fleet = self.app.controller.fleet
        await fleet.wait_for(lambda: len(self.routable()) == count, 60)


def followed(token_file: Path) -> TokenFile:
    """`token_file` as `in_cluster` follows it."""
    return TokenFile(token_file, "live.kubernetes.token_file")


@contextlib.contextmanager
def fake_kube(
    tmp_path: Path,
    tls_files: tuple[Path, Path] | None,
    *,
    restart_delay_s: float = 1.0,
    ipv6: bool = False,
) -> Iterator[FakeKube]:
    kube = FakeKube(
        tmp_path, engine_port=free_port(), tls=tls_files, restart_delay_s=restart_delay_s, ipv6=ipv6
    )
    try:
        yield kube
    finally:
        kube.close()


async def cluster_with(
    tmp_path: Path,
    tls_files: tuple[Path, Path] | None,
    replicas: int,
    *,
    restart_delay_s: float = 1.0,
    ipv6: bool = False,
    engines: Sequence[str] = (),
) -> AsyncIterator[Cluster]:
    """The fake cluster, its Deployment at `replicas`, and a controller whose config lists
    `engines` (addresses)."""
    health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1}
    config = {
        "listen": "127.0.0.1:0",
        "health": health,
        "shutdown_grace_s": 0.5,
        "engines": [{"address": address} for address in engines],
    }
    app = await start_controller(ControllerConfig.model_validate(config))
    try:
        with fake_kube(tmp_path, tls_files, restart_delay_s=restart_delay_s, ipv6=ipv6) as kube:
            kube.add_deployment(DEPLOYMENT, replicas, LABELS)
            token_file = tmp_path / "token"
            token_file.write_text(kube.token + "\n")
            cluster = Cluster(kube, app, tls_files[0] if tls_files else None, token_file)
            await cluster.wait(lambda: len(kube.ready_pods(DEPLOYMENT)) == replicas)
            yield cluster
    finally:
        await app.close(0.2)


@pytest.fixture
async def empty(tmp_path: Path, tls_files: tuple[Path, Path]) -> AsyncIterator[Cluster]:
    async for cluster in cluster_with(tmp_path, tls_files, 0):
        yield cluster


@pytest.fixture
async def two_pods(tmp_path: Path, tls_files: tuple[Path, Path]) -> AsyncIterator[Cluster]:
    # Containers that crash stay down: the test sees the pod not Ready.
    async for cluster in cluster_with(tmp_path, tls_files, 2, restart_delay_s=3600):
        yield cluster


@pytest.fixture
async def three_pods(tmp_path: Path, tls_files: tuple[Path, Path]) -> AsyncIterator[Cluster]:
    # Containers that crash stay down (crash-looping: not Ready).
    async for cluster in cluster_with(tmp_path, tls_files, 3, restart_delay_s=3600):
        yield cluster


def planner(min_engines: int, max_engines: int, **capacity: float) -> Planner:
    pool = PoolConfig(min_engines=min_engines, max_engines=max_engines)
    scaling = ScalingConfig(
        tick_s=0.2,
        scale_up_cooldown_s=0,
        scale_down_cooldown_s=0,
        scale_down_stabilisation_s=0,
        scale_down_headroom=0,
    )
    return Planner(
        PlannerConfig(pools=(pool,), scaling=scaling, capacity=CapacityConfig(**capacity))
    )


@pytest.mark.timeout(120)
async def test_a_start_scales_up_and_registers_the_ready_pod(empty: Cluster) -> None:
    actuator = empty.actuator()
    try:
        address = await actuator.start("default")
    finally:
        await actuator.close()
    assert empty.kube.deployments[DEPLOYMENT].replicas == 1
    (pod,) = empty.kube.ready_pods(DEPLOYMENT)
    assert address == empty.kube.address(pod)
    assert empty.routable() == [address]  # routed to when the start returns


@pytest.mark.timeout(60)
async def test_a_pod_of_an_ipv6_cluster_is_an_engine_at_its_bracketed_address(
    tmp_path: Path, tls_files: tuple[Path, Path]
) -> None:
    async for cluster in cluster_with(tmp_path, tls_files, 1, ipv6=True):
        actuator = cluster.actuator()
        try:
            address = f"[::1]:{cluster.kube.engine_port}"  # HOST:PORT as the controller reads it
            assert await actuator.adopt() == [(address, "default")]
            await cluster.wait_routable(1)
            assert cluster.routable() == [address]
        finally:
            await actuator.close()


@pytest.mark.timeout(60)
async def test_a_pod_stuck_pending_is_waited_for_not_asked_for_again(empty: Cluster) -> None:
    """No node has room for the new pod (Pending, unschedulable): the start gives up after
    start_timeout_s and leaves its replica, and the next start waits for that pod instead of
    asking for one more (no replica a tick while the cluster is full); once it is scheduled,
    that start takes it. Each start that gives up names the pod and the scheduler's reason."""
    kube = empty.kube
    kube.unschedulable = True
    actuator = empty.actuator(start_timeout_s=1)
    try:
        for _ in range(2):
            with pytest.raises(KvplaneError, match="no Ready pod after start_timeout_s") as failed:
                await actuator.start("default")
            assert kube.deployments[DEPLOYMENT].replicas == 1
        (pending,) = kube.pods.values()
        assert str(failed.value) == (  # the second start: the pod was there all along
            "no engine of default started: no Ready pod after start_timeout_s (1 s): "
            f"pod {pending.name} Pending, Unschedulable: 0/1 nodes are available: "
            "1 Insufficient nvidia.com/gpu."
        )
        kube.unschedulable = False
        await empty.wait(lambda: pending.ready)
        started = await actuator.start("default")
    finally:
        await actuator.close()
    assert started == kube.address(pending)
    assert kube.deployments[DEPLOYMENT].replicas == 1


@pytest.mark.timeout(120)
async def test_a_start_waits_for_a_crash_looping_pod_and_names_it_when_it_gives_up(
    two_pods: Cluster,
) -> None:
    """An engine's container crashes and Kubernetes backs off restarting it: the engine
    exits and leaves the controller, its replica stays, and the core's replacement waits for
    that pod rather than asking for another; a start that gives up says which pod it waited
    for and why (CrashLoopBackOff), and once the container runs again a start takes it."""
    kube = two_pods.kube
    actuator = two_pods.actuator(start_timeout_s=1)
    try:
        assert len(await actuator.adopt()) == 2
        crashed, serving = kube.ready_pods(DEPLOYMENT)
        kube.kill_container(crashed.name)
        await two_pods.wait(lambda: crashed.restart_at is not None)
        assert await actuator.adopt() == []
        assert actuator.exited() == [kube.address(crashed)]
        await actuator.stop(kube.address(crashed))
        with pytest.raises(KvplaneError) as timed_out:
            await actuator.start("default")
        assert kube.deployments[DEPLOYMENT].replicas == 2  # no replica asked for
        assert str(timed_out.value) == (
            "no engine of default started: no Ready pod after start_timeout_s (1 s): "
            f"pod {crashed.name} CrashLoopBackOff: back-off 3600s restarting failed "
            f"container=engine pod={crashed.name}_{kube.namespace}({crashed.uid})"
        )
        kube.restart_container(crashed.name)
        await two_pods.wait(lambda: crashed.ready)
        started = await actuator.start("default")
    finally:
        await actuator.close()
    assert started == kube.address(crashed) and crashed.restarts == 1
    assert kube.deployments[DEPLOYMENT].replicas == 2
    assert two_pods.registered() == sorted([kube.address(serving), started])


@pytest.mark.timeout(120)
async def test_a_start_does_not_overwrite_a_scale_changed_meanwhile(empty: Cluster) -> None:
    class OperatorScalesMeanwhile(KubeApi):
        """`kubectl scale --replicas=2` between the actuator's read of the scale and its
        PATCH: the PATCH, conditional on the version read, is refused (409 Conflict)."""

        scaled = False

        def get_scale(self, deployment: str) -> Scale:
            scale = super().get_scale(deployment)
            if not self.scaled:
                self.scaled = True
                super().patch_scale(deployment, 2, scale.resource_version)
            return scale

    actuator = empty.actuator(OperatorScalesMeanwhile(empty.api().connection))
    try:
        address = await actuator.start("default")
    finally:
        await actuator.close()
    # Read again, the Deployment has replicas no engine is: the start takes one of them.
    assert empty.kube.deployments[DEPLOYMENT].replicas == 2
    await empty.wait(lambda: len(empty.kube.ready_pods(DEPLOYMENT)) == 2)
    assert address in {empty.kube.address(p) for p in empty.kube.ready_pods(DEPLOYMENT)}


async def test_a_start_outlasts_the_status_writes_that_follow_a_scale(empty: Cluster) -> None:
    kube = empty.kube

    class StatusWrittenMeanwhile(KubeApi):
        """The Deployment controller writes the status four times between the actuator's
        reads of the scale and its PATCHes (as after the pool's previous scale): each PATCH,
        conditional on the version read, is refused (409 Conflict) until the writes stop."""

        writes_left = 4

        def get_scale(self, deployment: str) -> Scale:
            scale = super().get_scale(deployment)
            if self.writes_left:
                self.writes_left -= 1
                kube.status_written(deployment)
            return scale

    actuator = empty.actuator(StatusWrittenMeanwhile(empty.api().connection))
    try:
        address = await actuator.start("default")
    finally:
        await actuator.close()
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert [address] == [kube.address(p) for p in kube.ready_pods(DEPLOYMENT)]


@pytest.mark.timeout(120)
async def test_a_removal_deletes_the_drained_pod_not_another(two_pods: Cluster) -> None:
    kube = two_pods.kube
    # Draining the pod Ready first: one replica fewer alone would delete the other one
    # (Kubernetes deletes the more recently Ready first).
    old, new = sorted(kube.ready_pods(DEPLOYMENT), key=lambda pod: pod.ready_since or 0)
    actuator = two_pods.actuator()
    try:
        assert sorted(await actuator.adopt()) == sorted(
            (kube.address(pod), "default") for pod in (old, new)
        )
        await actuator.drain(kube.address(old), 5)
        fleet = two_pods.app.controller.fleet
        await fleet.wait_for(lambda: two_pods.routable() == [kube.address(new)], 30)
        # The API refuses the scale-down for now (RBAC): the removal waits, nothing deleted.
        kube.forbidden.add(("patch", "deployments/scale"))
        with pytest.raises(KvplaneError, match=f"pod {old.name} not scaled away yet"):
            await actuator.stop(kube.address(old))  # the planner counts a failed stop
        assert kube.deployments[DEPLOYMENT].replicas == 2 and not kube.deleted
        kube.forbidden.clear()
        assert await actuator.adopt() == []  # the next tick retries it (and adopts nothing)
        await two_pods.wait(lambda: old.name not in kube.pods)
    finally:
        await actuator.close()
    assert kube.deleted == [old.name]
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert old.process is not None and old.process.returncode == 0  # SIGTERM, graceful
    assert two_pods.registered() == [kube.address(new)]


async def adopt_and_drain_the_first_ready(
    cluster: Cluster, actuator: KubernetesDeployments
) -> tuple[FakePod, FakePod]:
    """Adopt the Deployment's two pods and drain the one Ready first (one replica fewer alone
    would delete the other, Ready more recently): (drained, the other)."""
    kube = cluster.kube
    drained, other = sorted(kube.ready_pods(DEPLOYMENT), key=lambda pod: pod.ready_since or 0)
    await actuator.adopt()
    await actuator.drain(kube.address(drained), 5)
    return drained, other


@pytest.mark.timeout(120)
async def test_a_drained_pod_the_scale_down_spared_is_removed_again(two_pods: Cluster) -> None:
    """The ReplicaSet controller ranks pods from a cache that may not hold the deletion cost
    yet: it deletes the other pod. That one is reported as exited, and the drained pod is
    scaled away again, rather than left serving nothing and counting as a replica."""
    kube = two_pods.kube
    actuator = two_pods.actuator()
    try:
        drained, other = await adopt_and_drain_the_first_ready(two_pods, actuator)
        kube.stale_deletion_cost = True
        await actuator.stop(kube.address(drained))
        await two_pods.wait(lambda: other.deletion_timestamp is not None)
        assert await actuator.adopt() == []
        assert actuator.exited() == [kube.address(other)]
        await two_pods.wait(lambda: drained.name not in kube.pods)
    finally:
        await actuator.close()
    assert kube.deleted == [other.name, drained.name]
    assert kube.deployments[DEPLOYMENT].replicas == 0  # the core starts the one it needs


async def until_not_serving(address: str, service: str) -> None:
    """Until the engine at `address` reports `service` NOT_SERVING (grpc.health.v1 Watch)."""
    async with grpc.aio.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service)
        )
        async for answer in watch:
            if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                watch.cancel()
                return


async def crash_one_and_drain_one(
    cluster: Cluster, actuator: KubernetesDeployments
) -> tuple[FakePod, FakePod, FakePod]:
    """Of three pods adopted, one's container crashed (its engine stopped, its replica kept)
    and one's engine drained, the third serving: (drained, serving, crashed)."""
    kube = cluster.kube
    await actuator.adopt()
    await cluster.wait_routable(3)
    drained, serving, crashed = kube.ready_pods(DEPLOYMENT)
    kube.kill_container(crashed.name)
    await cluster.wait(lambda: not kube.pods[crashed.name].ready)
    assert await actuator.adopt() == []
    assert actuator.exited() == [kube.address(crashed)]
    await actuator.stop(kube.address(crashed))  # its replica stays, to come back
    await actuator.drain(kube.address(drained), 5)
    fleet = cluster.app.controller.fleet
    await fleet.wait_for(lambda: cluster.routable() == [kube.address(serving)], 30)
    return drained, serving, crashed


@pytest.mark.timeout(60)
async def test_a_pod_is_deleted_only_if_it_is_still_the_drained_one(two_pods: Cluster) -> None:
    """The DELETE names the drained pod's uid (a precondition): another pod under its name
    since is 409 Conflict and left alone, which the removal takes as the drained pod gone."""
    kube = two_pods.kube
    api = two_pods.api()
    pod = kube.ready_pods(DEPLOYMENT)[0]
    with pytest.raises(KubeApiError) as refused:
        api.delete_pod(pod.name, "an-earlier-pod-s-uid")
    assert refused.value.status == 409 and "Precondition failed" in str(refused.value)
    assert pod.deletion_timestamp is None
    api.delete_pod(pod.name, pod.uid)
    assert pod.deletion_timestamp is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", [500, 504])
async def test_a_failed_delete_of_the_drained_pod_is_done_at_the_next_tick(
    three_pods: Cluster, code: int
) -> None:
    """The DELETE of a drained pod the ReplicaSet would spare fails (500: not made; 504: made
    all the same): no scale-down yet, the removal tried again at the next tick, which deletes
    the drained pod (or finds it terminating) and not the crash-looping one."""
    cluster = three_pods
    kube = cluster.kube
    actuator = cluster.actuator()
    try:
        drained, serving, crashed = await crash_one_and_drain_one(cluster, actuator)
        kube.faults.append(Fault("DELETE", "pods", code, applied=code == 504))
        with pytest.raises(KvplaneError, match=f"pod {drained.name} not scaled away yet"):
            await actuator.stop(kube.address(drained))
        assert kube.deployments[DEPLOYMENT].replicas == 3
        assert (drained.deletion_timestamp is not None) == (code == 504)
        assert await actuator.adopt() == []  # the next tick: the removal done
        await cluster.wait(lambda: drained.name not in kube.pods)
        assert await actuator.adopt() == []
    finally:
        await actuator.close()
    assert kube.deployments[DEPLOYMENT].replicas == 2
    assert crashed.deletion_timestamp is None and serving.deletion_timestamp is None
    active = kube.view(lambda: sorted(p.name for p in kube.pods.values() if p.active))
    assert active == sorted([serving.name, crashed.name])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("refused", ["at start", "at the delete"])
async def test_a_role_without_pod_deletes_warns_once_and_scales_down_alone(
    three_pods: Cluster, caplog: pytest.LogCaptureFixture, refused: str
) -> None:
    """`delete` on pods is optional (a Role applied before it was added): the start goes on,
    with one warning naming it and what it costs, and a removal beside a not-Ready pod is the
    scale-down alone, as before: the ReplicaSet deletes the crash-looping pod and spares the
    drained one (scaled away at the next look), the replica refilled by the next start."""
    cluster = three_pods
    kube = cluster.kube
    caplog.set_level(logging.WARNING, "planner.kubernetes")
    if refused == "at start":
        kube.forbidden.add(("delete", "pods"))
    actuator = cluster.actuator()
    try:
        await actuator.check()  # no ConfigError
        kube.forbidden.add(("delete", "pods"))  # a Role changed since: the DELETE gets 403
        drained, serving, crashed = await crash_one_and_drain_one(cluster, actuator)
        await actuator.stop(kube.address(drained))
        await cluster.wait(lambda: crashed.deletion_timestamp is not None)
        assert kube.deployments[DEPLOYMENT].replicas == 2
        assert drained.deletion_timestamp is None  # spared, as Kubernetes ranks them
        await actuator.adopt()
        await cluster.wait(lambda: drained.deletion_timestamp is not None)
    finally:
        await actuator.close()
    assert serving.deletion_timestamp is None
    assert kube.deployments[DEPLOYMENT].replicas == 1  # the core starts the one it needs
    warnings = [r.getMessage() for r in caplog.records if "not the drained one" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "may delete that pod and not the drained one" in warnings[0]
    assert "configs/k8s/planner-rbac.yaml" in warnings[0]


@pytest.mark.timeout(120)
async def test_a_removal_beside_a_crash_looping_pod_deletes_the_drained_one(
    three_pods: Cluster,
) -> None:
    """Kubernetes deletes a not-Ready pod before a Ready one, whatever its deletion cost, and a
    drained engine's pod stays Ready (its readiness probe asks for the empty service name):
    one replica fewer alone would delete the crash-looping pod and spare the drained one,
    scaled away again at the next look, the Deployment one replica short."""
    cluster = three_pods
    kube = cluster.kube
    actuator = cluster.actuator()
    try:
        drained, serving, crashed = await crash_one_and_drain_one(cluster, actuator)
        # Drained, the engine takes no Generate; its probe, the empty name's, still passes.
        await until_not_serving(kube.address(drained), "vllm.Generate")
        probed = kube.view(lambda: drained.probes)
        await cluster.wait(lambda: drained.probes >= probed + 2)  # one made since
        assert kube.view(lambda: drained.ready)
        await actuator.stop(kube.address(drained))
        await cluster.wait(lambda: drained.name not in kube.pods or bool(kube.deleted))
        assert drained.deletion_timestamp is not None  # not spared
        await cluster.wait(lambda: drained.name not in kube.pods)
        # Nothing was spared: the next look scales nothing away again.
        assert await actuator.adopt() == []
        assert actuator.exited() == []
    finally:
        await actuator.close()
    assert kube.deployments[DEPLOYMENT].replicas == 2
    # The crash-looping pod is kept, for its engine to come back in; a pod the ReplicaSet
    # made for the drained pod's replica meanwhile may have gone in its place.
    assert crashed.deletion_timestamp is None and crashed.name not in kube.deleted
    assert serving.deletion_timestamp is None and serving.name not in kube.deleted
    active = kube.view(lambda: sorted(p.name for p in kube.pods.values() if p.active))
    assert active == sorted([serving.name, crashed.name])
    assert cluster.registered() == [kube.address(serving)]


@pytest.mark.timeout(120)
async def test_a_scale_down_an_operator_undid_before_the_replicaset_acted_holds_up_no_start(
    two_pods: Cluster,
) -> None:
    """`kubectl scale` back up (an operator, a GitOps sync) lands before the ReplicaSet acted
    on a removal's scale-down: the ReplicaSet sees the count unchanged and deletes no pod, so
    the drained pod stays, serving nothing. It is scaled away again (one replica fewer than
    the operator's count, the drained pod going), rather than waited for by every start of
    the pool, each of which would time out."""
    kube = two_pods.kube
    actuator = two_pods.actuator(start_timeout_s=20)
    try:
        drained, serving = await adopt_and_drain_the_first_ready(two_pods, actuator)
        kube.hold_replicasets = True
        await actuator.stop(kube.address(drained))
        assert kube.deployments[DEPLOYMENT].replicas == 1
        two_pods.api().patch_scale(DEPLOYMENT, 2, "")  # unconditional, as `kubectl scale`
        kube.hold_replicasets = False
        await two_pods.wait(lambda: kube.deployments[DEPLOYMENT].status[0] == 2)
        assert not kube.deleted  # the ReplicaSet saw 2 replicas all along
        assert await actuator.adopt() == []  # the drained pod is not adopted: removed again
        await two_pods.wait(lambda: drained.name not in kube.pods)
        started = await actuator.start("default")
    finally:
        await actuator.close()
    assert kube.deleted == [drained.name]
    assert kube.deployments[DEPLOYMENT].replicas == 2
    assert two_pods.registered() == sorted([kube.address(serving), started])


@pytest.mark.timeout(120)
async def test_a_start_that_follows_a_scale_down_is_not_undone_by_a_look_listed_before_it(
    two_pods: Cluster,
) -> None:
    """A look lists the pods while the drained pod is still there (the ReplicaSet has not
    acted on the scale-down yet); before its answer is in, the ReplicaSet deletes that pod
    and a start, which waited for it to go, scales up. The look does not take the start's
    replica for an operator's scale-up that spared the drained pod: it scales nothing away,
    and the start gets its engine."""
    kube = two_pods.kube
    loop = asyncio.get_running_loop()
    starting: list[concurrent.futures.Future[str]] = []

    class ListingAnsweredLate(KubeApi):
        """Its next listing after `armed` is answered once the start it begins has scaled
        up, the ReplicaSet let act meanwhile."""

        armed = False

        def list_pods(self, selector: str) -> list[Pod]:
            pods = super().list_pods(selector)
            if self.armed:
                self.armed = False
                starting.append(asyncio.run_coroutine_threadsafe(actuator.start("default"), loop))
                kube.hold_replicasets = False
                kube.wait_for(lambda: kube.deployments[DEPLOYMENT].replicas == 2)
            return pods

    api = ListingAnsweredLate(two_pods.api().connection)
    actuator = two_pods.actuator(api, start_timeout_s=20)
    try:
        drained, serving = await adopt_and_drain_the_first_ready(two_pods, actuator)
        kube.hold_replicasets = True
        await actuator.stop(kube.address(drained))
        assert kube.deployments[DEPLOYMENT].replicas == 1 and drained.active
        api.armed = True
        assert await actuator.adopt() == []
        started = await asyncio.wrap_future(starting[0])
    finally:
        await actuator.close()
    assert kube.deleted == [drained.name]
    assert kube.deployments[DEPLOYMENT].replicas == 2
    assert two_pods.registered() == sorted([kube.address(serving), started])


@pytest.mark.timeout(120)
async def test_a_draining_pod_an_operator_scaled_away_takes_no_other_pod_with_it(
    two_pods: Cluster,
) -> None:
    """`kubectl scale --replicas=1` while an engine drains: the ReplicaSet deletes the
    draining pod (Ready more recently), its replica gone with it. Its exit while draining
    scales away nothing more: no pod was made for that replica, and one replica fewer would
    delete the last serving engine."""
    kube = two_pods.kube
    serving, draining = sorted(kube.ready_pods(DEPLOYMENT), key=lambda pod: pod.ready_since or 0)
    actuator = two_pods.actuator()
    try:
        assert len(await actuator.adopt()) == 2
        await actuator.drain(kube.address(draining), 60)
        two_pods.api().patch_scale(DEPLOYMENT, 1, "")  # unconditional, as `kubectl scale`
        await two_pods.wait(lambda: draining.deletion_timestamp is not None)
        assert await actuator.adopt() == []
        assert actuator.exited() == [kube.address(draining)]
        await actuator.stop(kube.address(draining))  # the core's removal of the exit
        await two_pods.wait(lambda: draining.name not in kube.pods)
        assert await actuator.adopt() == []
    finally:
        await actuator.close()
    assert kube.deleted == [draining.name]
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert serving.deletion_timestamp is None
    assert two_pods.registered() == [kube.address(serving)]


@pytest.mark.timeout(120)
async def test_an_engine_scaled_away_while_the_controller_is_unreachable_is_taken_out_later(
    two_pods: Cluster,
) -> None:
    """A drained engine removed while the controller does not answer (a partition between
    the planner and it): its RemoveEngine fails, its pod is scaled away all the same, and a
    later look (each tick's `adopt`) takes the engine out of the controller once it answers,
    even while the API server is down. Else the controller would list it, its pod gone,
    unreachable for good."""
    kube, fleet = two_pods.kube, two_pods.app.controller.fleet
    partition = await TcpForwarder.start(f"127.0.0.1:{two_pods.app.port}")
    actuator = two_pods.actuator(controller=partition.address)
    try:
        drained, serving = await adopt_and_drain_the_first_ready(two_pods, actuator)
        await fleet.wait_for(lambda: two_pods.routable() == [kube.address(serving)], 30)
        await partition.cut()
        await actuator.stop(kube.address(drained))  # its RemoveEngine fails, said in a line
        await two_pods.wait(lambda: drained.name not in kube.pods)
        assert kube.deleted == [drained.name]
        assert await actuator.adopt() == []  # unreachable still: tried again at the next
        both = sorted(kube.address(pod) for pod in (drained, serving))
        assert two_pods.registered() == both
        kube.go_down()
        await partition.mend()

        async def taken_out() -> bool:
            await actuator.adopt()
            return two_pods.registered() == [kube.address(serving)]

        await eventually(taken_out, 60, "a look to take the scaled-away engine out")
        kube.come_back()
        assert await actuator.adopt() == [] and actuator.exited() == []
    finally:
        await actuator.close()
        await partition.cut()
    assert two_pods.registered() == [kube.address(serving)]


@pytest.mark.timeout(120)
async def test_a_pod_at_the_address_of_an_engine_left_registered_waits_until_it_is_out(
    two_pods: Cluster,
) -> None:
    """A crashed engine whose RemoveEngine failed as it stopped (its request lost on the way:
    the controller lists it still) and whose container then restarts, in the same pod at the
    same IP: the pod is not taken as an engine while a look has yet to take the old one out
    (one address, one engine: taken, the new engine would be the one taken out), then it
    is, and stays registered."""
    kube = two_pods.kube
    crashed, serving = kube.ready_pods(DEPLOYMENT)
    address = kube.address(crashed)
    partition = await TcpForwarder.start(f"127.0.0.1:{two_pods.app.port}")
    actuator = two_pods.actuator(controller=partition.address)
    try:
        assert len(await actuator.adopt()) == 2
        await two_pods.wait_routable(2)
        kube.kill_container(crashed.name)
        await two_pods.wait(lambda: not crashed.ready)
        assert await actuator.adopt() == [] and actuator.exited() == [address]
        lost = partition.lose_next_request(address.encode())  # its RemoveEngine
        await actuator.stop(address)  # only out of the controller: its replica stays
        assert lost.is_set() and address in two_pods.registered()
        kube.restart_container(crashed.name)
        await two_pods.wait(lambda: crashed.ready)
        lost = partition.lose_next_request(address.encode())  # the look's RemoveEngine
        assert await actuator.adopt() == []
        assert lost.is_set() and address in two_pods.registered()
        assert await actuator.adopt() == [(address, "default")]  # out, then registered anew
        assert await actuator.adopt() == [] and actuator.exited() == []
        await two_pods.wait_routable(2)
    finally:
        await actuator.close()
        await partition.cut()
    assert kube.deployments[DEPLOYMENT].replicas == 2 and not kube.deleted
    assert two_pods.registered() == sorted(kube.address(pod) for pod in (crashed, serving))


async def scale_away_unreachable(
    cluster: Cluster, drained: FakePod, *, also_exited: FakePod | None = None
) -> None:
    """A planner adopts the Deployment's pods, drains `drained` and removes it while the
    controller does not answer (a partition): its RemoveEngine fails, its pod is scaled away
    all the same. Then, with `also_exited`, that engine's container crashes (its pod stays,
    not Ready, its replica too) and its RemoveEngine fails as well. Then the planner stops:
    what it knew of them goes with it."""
    kube = cluster.kube
    partition = await TcpForwarder.start(f"127.0.0.1:{cluster.app.port}")
    actuator = cluster.actuator(controller=partition.address)
    try:
        assert len(await actuator.adopt()) == 2
        await cluster.wait_routable(2)
        await actuator.drain(kube.address(drained), 5)
        await cluster.app.controller.fleet.wait_for(
            lambda: kube.address(drained) not in cluster.routable(), 30
        )
        await partition.cut()
        await actuator.stop(kube.address(drained))
        await cluster.wait(lambda: drained.name not in kube.pods)
        if also_exited is not None:
            kube.kill_container(also_exited.name)
            await cluster.wait(lambda: not also_exited.ready)
            assert await actuator.adopt() == []
            assert actuator.exited() == [kube.address(also_exited)]
            await actuator.stop(kube.address(also_exited))  # its replica stays
    finally:
        await actuator.close()
        await partition.cut()
    assert kube.deleted == [drained.name]
    assert kube.address(drained) in cluster.registered()


@pytest.fixture
def config_engine() -> str:
    """The address of an engine of the controller's config, at which nothing listens."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
async def two_pods_and_a_config_engine(
    tmp_path: Path, tls_files: tuple[Path, Path], config_engine: str
) -> AsyncIterator[Cluster]:
    async for cluster in cluster_with(
        tmp_path, tls_files, 2, restart_delay_s=3600, engines=[config_engine]
    ):
        yield cluster


async def another_deployments_engine(cluster: Cluster) -> str:
    """The address of an engine of another Deployment, adopted by its planner, then that
    Deployment deleted (its pod with it): the controller lists the engine, no pod is at it."""
    kube = cluster.kube
    kube.add_deployment("another-engine", 1, {"app": "another-engine"})
    await cluster.wait(lambda: len(kube.ready_pods("another-engine")) == 1)
    (pod,) = kube.ready_pods("another-engine")
    others = KubernetesDeployments(
        controller=f"127.0.0.1:{cluster.app.port}",
        api=cluster.api(),
        deployments={"other": "another-engine"},
        engine_port=kube.engine_port,
        start_timeout_s=60,
    )
    try:
        assert await others.adopt() == [(kube.address(pod), "other")]
    finally:
        await others.close()
    kube.delete_deployment("another-engine")
    await cluster.wait(lambda: pod.name not in kube.pods)
    return kube.address(pod)


@pytest.mark.timeout(120)
async def test_a_new_planner_takes_out_the_engines_its_predecessor_left_registered(
    two_pods_and_a_config_engine: Cluster, config_engine: str
) -> None:
    """A planner scales a pool down while the controller is unreachable, then stops (Ctrl-C,
    a crash, a lost Lease): the controller lists the engine, its pod gone. The next planner
    finds it among the engines the controller lists as registered for the pool's Deployment
    that no pod is, and takes it out. Engines that are not the pool's stay, though no pod is
    at their address either: the controller's config engine, one registered by hand
    (`kvplane admin register`, as an older planner registered its engines), another
    Deployment's."""
    cluster = two_pods_and_a_config_engine
    kube = cluster.kube
    by_hand = f"127.0.0.1:{free_port()}"
    admin = ControllerAdmin(f"127.0.0.1:{cluster.app.port}")
    try:
        await admin.register(by_hand)
    finally:
        await admin.close()
    others = await another_deployments_engine(cluster)
    drained, serving = sorted(kube.ready_pods(DEPLOYMENT), key=lambda pod: pod.ready_since or 0)
    await scale_away_unreachable(cluster, drained)
    kept = sorted([config_engine, by_hand, others, kube.address(serving)])
    actuator = cluster.actuator()  # the next planner
    try:

        async def taken_out() -> bool:
            await actuator.adopt()
            return cluster.registered() == kept

        await eventually(taken_out, 30, "the new planner to take the engine out")
        assert await actuator.adopt() == [] and actuator.exited() == []
    finally:
        await actuator.close()
    assert cluster.registered() == kept
    assert cluster.routable() == [kube.address(serving)]
    assert kube.deployments[DEPLOYMENT].replicas == 1


@pytest.mark.timeout(120)
async def test_an_engine_left_registered_and_routed_to_is_taken_out_once_it_is_not(
    two_pods: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine the controller lists under the pool's owner, at an address no pod of the
    Deployment is at, still routed to when the next planner first looks (a predecessor's,
    its pod gone or terminating before the controller's health poll saw the engine go; here
    another Deployment's pod): left alone while routed to, then taken out by the first look
    after the controller stops routing to it, not by the next listing of the pool's engines
    (LEFT_REGISTERED_LOOK_S later); its RemoveEngine lost on the way, by the look after."""
    monkeypatch.setattr("planner.kubernetes.LEFT_REGISTERED_LOOK_S", 3600.0)
    kube, fleet = two_pods.kube, two_pods.app.controller.fleet
    kube.add_deployment("another-engine", 1, {"app": "another-engine"})
    await two_pods.wait(lambda: len(kube.ready_pods("another-engine")) == 1)
    (pod,) = kube.ready_pods("another-engine")
    address = kube.address(pod)
    owner = f"kubernetes:{kube.namespace}/{DEPLOYMENT}"
    admin = ControllerAdmin(f"127.0.0.1:{two_pods.app.port}", owner_of=lambda _: owner)
    try:
        await admin.register(address)
    finally:
        await admin.close()
    await fleet.wait_for(lambda: address in two_pods.routable(), 30)
    partition = await TcpForwarder.start(f"127.0.0.1:{two_pods.app.port}")
    actuator = two_pods.actuator(controller=partition.address)
    try:
        assert len(await actuator.adopt()) == 2  # the pool's pods; the engine routed to stays
        await two_pods.wait_routable(3)
        kube.kill_container(pod.name)
        await fleet.wait_for(lambda: address not in two_pods.routable(), 30)
        lost = partition.lose_next_request(address.encode())  # the look's RemoveEngine
        assert await actuator.adopt() == []
        assert lost.is_set() and address in two_pods.registered()
        assert await actuator.adopt() == [] and actuator.exited() == []
        assert address not in two_pods.registered()
    finally:
        await actuator.close()
        await partition.cut()
    assert two_pods.registered() == sorted(map(kube.address, kube.ready_pods(DEPLOYMENT)))


def request_without_owner() -> type[Message]:
    """RegisterEngineRequest as a controller older than its `owner` has it."""
    older = descriptor_pb2.FileDescriptorProto(
        name="older_admin.proto", package="kvplane.v1", syntax="proto3"
    )
    message = older.message_type.add()
    apb.RegisterEngineRequest.DESCRIPTOR.CopyToProto(message)
    fields = [f for f in message.field if f.name != "owner"]
    del message.field[:]
    message.field.extend(fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(older)
    return GetMessageClass(pool.FindMessageTypeByName("kvplane.v1.RegisterEngineRequest"))


@pytest.mark.timeout(30)
async def test_a_controller_older_than_owner_gets_the_registration_without_it() -> None:
    """Such a controller refuses a field it does not have (INVALID_ARGUMENT, as every
    controller's admin API does: `kvplane.request_decoding`): the actuator registers the
    engine without its owner rather than not at all."""
    registered: list[str] = []

    async def register(request: Any, context: object) -> apb.WorkerInfo:
        registered.append(request.address)
        return apb.WorkerInfo(address=request.address)

    method = grpc.unary_unary_rpc_method_handler(
        register,
        request_deserializer=request_without_owner().FromString,
        response_serializer=apb.WorkerInfo.SerializeToString,
    )
    server = grpc.aio.server()
    TolerantRegistration(
        server, strict={"/kvplane.v1.Admin/RegisterEngine"}
    ).add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("kvplane.v1.Admin", {"RegisterEngine": method})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    admin = ControllerAdmin(f"127.0.0.1:{port}", owner_of=lambda address: "kubernetes:ns/d")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            refused = apb.RegisterEngineRequest(address="127.0.0.1:8", owner="kubernetes:ns/d")
            with pytest.raises(grpc.aio.AioRpcError, match="RegisterEngineRequest field 3"):
                await apb_grpc.AdminStub(channel).RegisterEngine(refused)
        await admin.register("127.0.0.1:9")
    finally:
        await admin.close()
        await server.stop(None)
    assert registered == ["127.0.0.1:9"]


@pytest.mark.timeout(120)
async def test_a_new_planner_leaves_an_engine_whose_pod_is_not_ready_yet(
    two_pods: Cluster,
) -> None:
    """The engine of a pod not Ready (its container crashed: restarted in the same pod, at
    the same IP) is no engine left behind: the next planner, taking out the one scaled away,
    leaves it in the controller, and takes the pod as an engine once it is Ready."""
    kube = two_pods.kube
    drained, crashed = sorted(kube.ready_pods(DEPLOYMENT), key=lambda pod: pod.ready_since or 0)
    await scale_away_unreachable(two_pods, drained, also_exited=crashed)
    address = kube.address(crashed)
    actuator = two_pods.actuator()  # the next planner
    try:

        async def taken_out() -> bool:
            assert await actuator.adopt() == []  # not Ready: not taken
            assert address in two_pods.registered()
            return two_pods.registered() == [address]

        await eventually(taken_out, 30, "the new planner to take the scaled-away engine out")
        kube.restart_container(crashed.name)
        await two_pods.wait(lambda: crashed.ready)
        assert await actuator.adopt() == [(address, "default")]
        await two_pods.wait_routable(1)
    finally:
        await actuator.close()
    assert two_pods.registered() == two_pods.routable() == [address]
    assert kube.deployments[DEPLOYMENT].replicas == 1


@pytest.mark.timeout(120)
async def test_a_restarted_planner_adopts_the_pods_instead_of_doubling_them(
    two_pods: Cluster,
) -> None:
    addresses = sorted(two_pods.kube.address(p) for p in two_pods.kube.ready_pods(DEPLOYMENT))
    first = LivePlanner(planner(2, 2), two_pods.actuator())
    try:
        assert await first.tick() == []  # the Deployment's two pods are the pool's two
    finally:
        await first.close()  # a planner that stops leaves the pods serving
    await two_pods.wait_routable(2)
    again = LivePlanner(planner(2, 2), two_pods.actuator())
    try:
        assert await again.tick() == []
        assert sorted(again.engines) == addresses
    finally:
        await again.close()
    assert two_pods.kube.deployments[DEPLOYMENT].replicas == 2
    assert two_pods.registered() == addresses


@pytest.mark.timeout(120)
async def test_a_pod_a_removal_left_with_the_drained_deletion_cost_is_cleared_when_adopted(
    two_pods: Cluster,
) -> None:
    """A planner that stopped between a removal's annotation and its scale-down left the pod
    with the lowest deletion cost (or a removal chose it to go in place of a pod gone, then
    failed): adopted as an engine, the pod has the cost cleared first, so a later removal
    deletes its own drained pod and not this serving one (both at the lowest cost, Kubernetes
    would delete the more recently Ready)."""
    kube = two_pods.kube
    drained, marked = sorted(kube.ready_pods(DEPLOYMENT), key=lambda pod: pod.ready_since or 0)
    cost = {DELETION_COST: DRAINED_DELETION_COST}
    await asyncio.to_thread(two_pods.api().annotate_pod, marked.name, cost)
    actuator = two_pods.actuator()
    try:
        assert len(await actuator.adopt()) == 2
        assert DELETION_COST not in marked.annotations
        await actuator.drain(kube.address(drained), 5)
        fleet = two_pods.app.controller.fleet
        await fleet.wait_for(lambda: two_pods.routable() == [kube.address(marked)], 30)
        await actuator.stop(kube.address(drained))
        await two_pods.wait(lambda: bool(kube.deleted))  # the ReplicaSet scaled down
    finally:
        await actuator.close()
    assert kube.deleted == [drained.name]
    assert two_pods.registered() == [kube.address(marked)]


@pytest.mark.timeout(120)
async def test_a_planner_restarted_before_the_replicaset_acted_leaves_the_drained_pod_to_go(
    two_pods: Cluster,
) -> None:
    """The planner scaled a drained pod away and stopped before the ReplicaSet acted on the
    scale-down (its controller lagging): the planner started again neither adopts that pod
    nor clears its deletion cost, so the ReplicaSet, once it acts, deletes it and not the
    serving pod."""
    kube = two_pods.kube
    first = two_pods.actuator()
    try:
        drained, serving = await adopt_and_drain_the_first_ready(two_pods, first)
        fleet = two_pods.app.controller.fleet
        await fleet.wait_for(lambda: two_pods.routable() == [kube.address(serving)], 30)
        kube.hold_replicasets = True
        await first.stop(kube.address(drained))
    finally:
        await first.close()
    again = two_pods.actuator()
    try:
        assert await again.adopt() == [(kube.address(serving), "default")]
        assert drained.annotations[DELETION_COST] == DRAINED_DELETION_COST
        kube.hold_replicasets = False
        await two_pods.wait(lambda: bool(kube.deleted))
    finally:
        await again.close()
    assert kube.deleted == [drained.name]
    assert two_pods.registered() == [kube.address(serving)]


@pytest.mark.timeout(120)
async def test_pods_that_vanish_or_crash_are_reported_and_leave_the_controller(
    two_pods: Cluster,
) -> None:
    kube = two_pods.kube
    deleted, crashed = kube.ready_pods(DEPLOYMENT)
    actuator = two_pods.actuator()
    try:
        await actuator.adopt()
        await two_pods.wait_routable(2)
        delete_pod(two_pods, deleted.name)  # `kubectl delete pod`: the ReplicaSet replaces it
        kube.kill_container(crashed.name)
        await two_pods.wait(lambda: not kube.pods[crashed.name].ready)
        adopted = await actuator.adopt()  # the replacement, if it is Ready already
        gone = sorted(kube.address(pod) for pod in (deleted, crashed))
        assert actuator.exited() == gone
        for address in gone:
            await actuator.stop(address)
        assert kube.deployments[DEPLOYMENT].replicas == 2  # refilled by Kubernetes, not by us
        assert not set(gone) & set(two_pods.registered())
        # The ReplicaSet's replacement serves: adopted.
        await two_pods.wait(lambda: len(kube.ready_pods(DEPLOYMENT)) == 1)
        (replacement,) = kube.ready_pods(DEPLOYMENT)
        adopted += await actuator.adopt()
        assert adopted == [(kube.address(replacement), "default")]
        assert actuator.exited() == []
        assert two_pods.registered() == [kube.address(replacement)]
    finally:
        await actuator.close()


@pytest.fixture
async def one_pod(tmp_path: Path, tls_files: tuple[Path, Path]) -> AsyncIterator[Cluster]:
    async for cluster in cluster_with(tmp_path, tls_files, 1, restart_delay_s=3600):
        yield cluster


@pytest.mark.timeout(120)
async def test_a_start_waits_for_the_engine_whose_ip_its_pod_was_given_to_be_reported_and_out(
    one_pod: Cluster,
) -> None:
    """An engine's pod deleted (`kubectl delete pod`), and its IP given to the pod the
    ReplicaSet made in its place (pod IPs are recycled) before a look noted it gone: a start
    does not take that pod while the old engine is the planner's (one address, one engine:
    taken, the old one would never be reported exited). The ticks' looks report the old one
    exited, once; once it is stopped (out of the controller), the start takes the pod at its
    address, registered anew."""
    kube = one_pod.kube
    (old,) = kube.ready_pods(DEPLOYMENT)
    address = kube.address(old)
    actuator = one_pod.actuator()
    try:
        assert await actuator.adopt() == [(address, "default")]
        await one_pod.wait_routable(1)
        kube.unschedulable = True  # its replacement waits, Pending, for the IP to be free
        delete_pod(one_pod, old.name)
        await one_pod.wait(lambda: old.name not in kube.pods)
        kube.reuse_ip(old.ip)
        kube.unschedulable = False
        await one_pod.wait(
            lambda: [kube.address(pod) for pod in kube.ready_pods(DEPLOYMENT)] == [address]
        )
        kube.hold_replicasets = True  # the start's new replica makes no pod: this one or none
        listed = kube.pod_listings
        start = asyncio.create_task(actuator.start("default"))
        # Until the start has taken the pod, or listed the pods again after passing it over.
        await one_pod.wait(lambda: start.done() or kube.pod_listings >= listed + 2)
        assert not start.done()
        exits: list[str] = []
        while not start.done():  # the ticks beside the start, as the live planner's
            await actuator.adopt()
            exits += actuator.exited()
            for gone in actuator.exited():
                await actuator.stop(gone)  # out of the controller; its replica stays
            await asyncio.sleep(0.05)
        assert await start == address
        assert exits == [address]
        assert await actuator.adopt() == [] and actuator.exited() == []
        assert one_pod.registered() == [address]
        await one_pod.wait_routable(1)
    finally:
        kube.hold_replicasets = False
        await actuator.close()


@pytest.mark.timeout(120)
async def test_pods_that_crash_or_vanish_while_draining_take_their_replica_with_them(
    two_pods: Cluster,
) -> None:
    """The planner was scaling them away: Kubernetes must not refill their replicas, or the
    restarted and replacement pods would be adopted and grow the pool back."""
    kube = two_pods.kube
    crashed, deleted = kube.ready_pods(DEPLOYMENT)
    actuator = two_pods.actuator()
    try:
        await actuator.adopt()
        for pod in (crashed, deleted):
            await actuator.drain(kube.address(pod), 300)
        await two_pods.wait_routable(0)
        # The ReplicaSet waits (its work queue has not synced), so that no replacement of the
        # deleted pod is Ready, and adopted, before the planner's next tick.
        kube.hold_replicasets = True
        kube.kill_container(crashed.name)
        delete_pod(two_pods, deleted.name)
        await two_pods.wait(
            lambda: not kube.pods[crashed.name].ready and deleted.name not in kube.pods
        )
        await actuator.adopt()
        gone = sorted(kube.address(pod) for pod in (crashed, deleted))
        assert actuator.exited() == gone
        for address in gone:  # the deleted pod: no deletion cost to set (404)
            await actuator.stop(address)
        assert kube.deployments[DEPLOYMENT].replicas == 0
        kube.hold_replicasets = False
        await two_pods.wait(lambda: not kube.pods)  # the crashed pod deleted, none created
        assert await actuator.adopt() == [] and actuator.exited() == []
    finally:
        await actuator.close()
    assert two_pods.registered() == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("exit", ["crashes", "is deleted"])
async def test_a_pod_drained_by_hand_that_exits_takes_its_replica_with_it(
    two_pods: Cluster, exit: str
) -> None:
    """An operator's drain (`kvplane admin drain`) sends the engine on its way out, and the
    planner starts its replacement at once. When its pod then crashes or is deleted before it
    is empty, its replica goes too: refilled by Kubernetes, it would be adopted and the pool
    would run one engine more than the planner wants."""
    kube, fleet = two_pods.kube, two_pods.app.controller.fleet
    actuator = two_pods.actuator()
    live = LivePlanner(planner(2, 2), actuator)
    operator = ControllerAdmin(f"127.0.0.1:{two_pods.app.port}")
    drained, _ = kube.ready_pods(DEPLOYMENT)
    address = kube.address(drained)
    generation: asyncio.Task[None] | None = None
    try:
        assert await live.tick() == []  # the Deployment's two pods adopted
        await two_pods.wait_routable(2)
        # A long request keeps the engine from being empty, so it is not removed at once.
        generation = asyncio.create_task(generate_on(address))
        await fleet.wait_for(
            lambda: (fleet.registry.get(address).load.running_requests or 0) > 0, 60
        )
        await operator.drain(address, 300)
        await fleet.wait_for(lambda: address not in two_pods.routable(), 30)
        await live.tick()  # seen draining: replaced
        assert live.engines[address].state is EngineState.DRAINING
        await fleet.wait_for(lambda: not live._starts and len(two_pods.routable()) == 2, 60)
        assert kube.deployments[DEPLOYMENT].replicas == 3
        if exit == "crashes":
            kube.kill_container(drained.name)
            await two_pods.wait(lambda: not drained.ready)
        else:
            delete_pod(two_pods, drained.name)  # the ReplicaSet makes a pod for its replica
        async with asyncio.timeout(30):  # until a look at the fleet has seen it go
            while address in live.engines:
                await live.tick()
                await asyncio.sleep(0.1)
        await asyncio.gather(*live._removals)  # its removal runs beside the ticks
        assert kube.deployments[DEPLOYMENT].replicas == 2  # its replica went with it
        # Its address is no longer taken for a draining one: a pod given its IP later is not.
        assert address not in actuator._draining
        await two_pods.wait(lambda: drained.name not in kube.pods and len(kube.pods) == 2)
        serving = sorted(kube.address(pod) for pod in kube.ready_pods(DEPLOYMENT))
        assert await live.tick() == []
        assert sorted(live.engines) == serving == two_pods.registered()
    finally:
        if generation is not None:
            generation.cancel()
            await asyncio.gather(generation, return_exceptions=True)
        await operator.close()
        await live.close()


@pytest.mark.timeout(180)
async def test_an_engine_drained_by_hand_that_empties_is_removed_and_forgotten(
    two_pods: Cluster,
) -> None:
    """An operator's drain of an engine that holds no request: the planner replaces it and
    removes it, deleting its pod, and keeps its address as draining no longer (a pod given
    that IP later would otherwise take its replica with it when it exits)."""
    kube = two_pods.kube
    actuator = two_pods.actuator()
    live = LivePlanner(planner(2, 2), actuator)
    operator = ControllerAdmin(f"127.0.0.1:{two_pods.app.port}")
    drained, _ = kube.ready_pods(DEPLOYMENT)
    address = kube.address(drained)
    try:
        assert await live.tick() == []  # the Deployment's two pods adopted
        await two_pods.wait_routable(2)
        await operator.drain(address, 300)
        async with asyncio.timeout(60):
            while address in live.engines or len(two_pods.routable()) != 2:
                await live.tick()
                await asyncio.sleep(0.1)
            await asyncio.gather(*live._removals, *live._starts)
        assert address not in actuator._draining
        assert kube.deleted == [drained.name] and kube.deployments[DEPLOYMENT].replicas == 2
        assert sorted(live.engines) == two_pods.routable() == two_pods.registered()
    finally:
        await operator.close()
        await live.close()


@pytest.mark.timeout(180)
async def test_an_engine_whose_drain_by_hand_was_not_taken_serves_again(
    two_pods: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's drain the engine does not take: it did not answer the Drain in time, so
    the controller withdraws the drain (here as its DrainEngine does then) and routes to the
    engine again once it answers its health. The planner, which counted it as leaving and
    started its replacement, counts it as serving again: its pod exiting later is a serving
    engine's crash, whose replica stays for Kubernetes to refill."""
    caplog.set_level(logging.WARNING, "planner.live")
    kube, fleet = two_pods.kube, two_pods.app.controller.fleet
    actuator = two_pods.actuator()
    pool = PoolConfig(min_engines=2, max_engines=3)  # no scale-down for 300 s (the default)
    scaling = ScalingConfig(tick_s=0.2, scale_up_cooldown_s=0)
    live = LivePlanner(Planner(PlannerConfig(pools=(pool,), scaling=scaling)), actuator)
    drained, _ = kube.ready_pods(DEPLOYMENT)
    address = kube.address(drained)
    # A long request keeps the engine from being empty, so it is not removed at once.
    generation = asyncio.create_task(generate_on(address))
    try:
        assert await live.tick() == []  # the Deployment's two pods adopted
        await two_pods.wait_routable(2)
        await fleet.wait_for(
            lambda: (fleet.registry.get(address).load.running_requests or 0) > 0, 60
        )
        await fleet.request_drain(address)  # what DrainEngine does first
        assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
        assert live.engines[address].state is EngineState.DRAINING
        await fleet.wait_for(lambda: not live._starts and len(two_pods.routable()) == 2, 60)
        fleet.registry.withdraw_drain(address)  # the engine did not answer the Drain in time
        await two_pods.wait_routable(3)
        assert await live.tick() == []
        assert live.engines[address].state is EngineState.SERVING
        assert f"engine {address} is routed to again" in caplog.text
        kube.kill_container(drained.name)
        await two_pods.wait(lambda: not drained.ready)
        async with asyncio.timeout(30):  # until a look at the fleet has seen it go
            while address in live.engines:
                await live.tick()
                await asyncio.sleep(0.1)
        await asyncio.gather(*live._removals)
        assert kube.deployments[DEPLOYMENT].replicas == 3  # its replica stays
        assert address not in actuator._draining
    finally:
        generation.cancel()
        await asyncio.gather(generation, return_exceptions=True)
        await live.close()


async def generate_on(address: str) -> None:
    """One generation that lasts until cancelled (or its engine goes), sent to the engine."""
    async with grpc.aio.insecure_channel(address) as channel:
        request = generate_request("long", [1, 2, 3], max_tokens=1_000_000)
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in pb_grpc.OpenEngineStub(channel).Generate(request):
                pass


@pytest.fixture
async def two_pods_restarting(
    tmp_path: Path, tls_files: tuple[Path, Path]
) -> AsyncIterator[Cluster]:
    # Containers that crash are restarted at once: the pod is Ready again.
    async for cluster in cluster_with(tmp_path, tls_files, 2, restart_delay_s=0.2):
        yield cluster


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["deleted", "evicted"])
async def test_the_pod_a_deleted_or_evicted_draining_pod_leaves_is_the_one_scaled_away(
    two_pods_restarting: Cluster, way: str
) -> None:
    """A draining pod deleted by hand, or evicted by the kubelet (node pressure; a GPU pod
    rejected at admission ends so too: it fails and stays listed, without a
    deletionTimestamp, for good): the ReplicaSet makes a pod for its replica, and the planner
    scales that replica away. The new pod, Ready by then, is not adopted (the scale-down is to
    delete it) and gets the lowest deletion cost, so the ReplicaSet deletes it and not a
    serving pod, even one Ready more recently (its container restarted), which Kubernetes
    would delete first. An evicted pod, which stays, holds up no later start of the pool."""
    cluster, kube = two_pods_restarting, two_pods_restarting.kube
    left, serving = kube.ready_pods(DEPLOYMENT)
    actuator = cluster.actuator()
    try:
        await actuator.adopt()
        await actuator.drain(kube.address(left), 300)
        await cluster.wait_routable(1)
        if way == "deleted":
            delete_pod(cluster, left.name)
        else:
            kube.evict(left.name)
        await cluster.wait(lambda: len(kube.ready_pods(DEPLOYMENT)) == 2)
        (new,) = (pod for pod in kube.ready_pods(DEPLOYMENT) if pod is not serving)
        kube.kill_container(serving.name)
        await cluster.wait(lambda: (serving.ready_since or 0) > (new.ready_since or 0))
        assert await actuator.adopt() == []  # the tick the pod is seen gone, or failed
        assert actuator.exited() == [kube.address(left)]
        await actuator.stop(kube.address(left))
        assert kube.deployments[DEPLOYMENT].replicas == 1
        await cluster.wait(lambda: bool(kube.deleted))  # the ReplicaSet scaled down
        assert kube.deleted == [new.name]
        await cluster.wait(lambda: new.name not in kube.pods)
        assert await actuator.adopt() == [] and actuator.exited() == []
        assert kube.ready_pods(DEPLOYMENT) == [serving]
        assert cluster.registered() == [kube.address(serving)]
        started = await actuator.start("default")
    finally:
        await actuator.close()
    assert (left.name in kube.pods) == (way == "evicted")  # an evicted pod stays listed
    assert kube.deployments[DEPLOYMENT].replicas == 2
    assert cluster.registered() == sorted([kube.address(serving), started])


@pytest.mark.timeout(120)
async def test_a_deployment_deleted_by_hand_ends_its_engines_and_fails_starts_in_one_line(
    two_pods: Cluster,
) -> None:
    """`kubectl delete deployment`: its pods, terminating, are reported as exited; a start
    fails with the API's 404 in one line (the core asks again each tick) rather than stopping
    the planner; once the Deployment is applied again, a start scales it up."""
    kube = two_pods.kube
    pods = kube.ready_pods(DEPLOYMENT)
    actuator = two_pods.actuator()
    try:
        assert len(await actuator.adopt()) == 2
        kube.delete_deployment(DEPLOYMENT)
        assert await actuator.adopt() == []
        assert actuator.exited() == sorted(kube.address(pod) for pod in pods)
        for address in actuator.exited():
            await actuator.stop(address)
        with pytest.raises(KvplaneError) as refused:
            await actuator.start("default")
        message = str(refused.value)
        assert f'404 NotFound: deployments.apps "{DEPLOYMENT}" not found' in message
        assert message.startswith("no engine of default started: ") and "\n" not in message
        kube.add_deployment(DEPLOYMENT, 0, LABELS)  # applied again
        started = await actuator.start("default")
    finally:
        await actuator.close()
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert two_pods.registered() == [started]


def delete_pod(cluster: Cluster, name: str) -> None:
    assert cluster.ca_file is not None
    context = ssl.create_default_context(cafile=str(cluster.ca_file))
    connection = http.client.HTTPSConnection(cluster.kube.url.split("//")[1], context=context)
    path = f"/api/v1/namespaces/{cluster.kube.namespace}/pods/{name}"
    connection.request("DELETE", path, headers={"Authorization": f"Bearer {cluster.kube.token}"})
    assert connection.getresponse().status == 200
    connection.close()


@pytest.mark.timeout(60)
async def test_api_errors_at_start_are_one_line(empty: Cluster, tmp_path: Path) -> None:
    wrong_token = tmp_path / "wrong-token"
    wrong_token.write_text("not-the-token")
    with socket.socket() as unused:  # bound, not listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        unreachable = KubeApi(
            KubeConnection(f"https://127.0.0.1:{unused.getsockname()[1]}", "serving", None, None)
        )
        untrusted = KubeApi(  # the system's roots do not hold the fake's certificate
            KubeConnection(empty.kube.url, "serving", followed(empty.token_file), None)
        )
        cases: list[tuple[KubeApi, str]] = [
            (empty.api(wrong_token), "401 Unauthorized: Unauthorized"),
            (unreachable, "Connection refused"),
            (untrusted, "TLS: self-signed certificate"),
        ]
        messages = [await check(empty, api) for api, _ in cases]
    empty.kube.forbidden.add(("list", "pods"))
    messages.append(await check(empty, empty.api()))
    cases.append((empty.api(), "the planner may not list pods in namespace serving"))
    empty.kube.forbidden.clear()
    del empty.kube.deployments[DEPLOYMENT]
    messages.append(await check(empty, empty.api()))
    cases.append(
        (empty.api(), f"pool default: GET {empty.kube.url}/apis/apps/v1/namespaces/serving/")
    )
    for message, (_, expected) in zip(messages, cases, strict=True):
        assert expected in message and "\n" not in message
    assert messages[-1].endswith(f'404 NotFound: deployments.apps "{DEPLOYMENT}" not found (is '
                                 f"Deployment {DEPLOYMENT} in namespace serving?)")  # fmt: skip


@pytest.mark.timeout(60)
def test_a_token_file_caught_mid_rotation_keeps_the_token_read_before(
    empty: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A token file rewritten in place (not the kubelet's atomic swap: a hand-made Secret, an
    operator's edit) is seen empty halfway, or holding what no token carries: the calls go
    on with the token read before (one warning each), instead of sending `Bearer ` (401) or
    failing in http.client on a line break; the next whole token is used from the next call."""
    api = empty.api()
    assert api.get_scale(DEPLOYMENT).replicas == 0
    setting = f"live.kubernetes.token_file {empty.token_file}"
    with caplog.at_level(logging.WARNING, logger="kvplane.token_file"):
        empty.token_file.write_text("")
        assert api.get_scale(DEPLOYMENT).replicas == 0
        empty.token_file.write_text("half\nwritten")
        assert api.get_scale(DEPLOYMENT).replicas == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"{setting} is empty; keeping the token read before",
        f"{setting} holds a character a bearer token cannot carry (character 5: a line break, "
        "a control or a non-ASCII character; a token is printable ASCII); keeping the token "
        "read before",
    ]
    empty.kube.token = "rotated-token"  # the old one is refused from now on
    empty.token_file.write_text("rotated-token\n")  # hand-made: a trailing line break
    assert api.get_scale(DEPLOYMENT).replicas == 0


# The Role of configs/k8s/planner-rbac.yaml without its writes: what a read-only Role grants.
READ_ONLY_ROLE = {
    ("apps", "deployments/scale", "get"),
    ("", "pods", "list"),
    ("coordination.k8s.io", "leases", "get"),
}


@pytest.mark.timeout(60)
async def test_a_role_lacking_a_verb_fails_the_start_naming_every_verb_it_lacks(
    empty: Cluster,
) -> None:
    """Before the first scale: reads alone would pass the start-up check, and the missing
    writes show only when the planner first scales (a warning every tick)."""
    empty.kube.allowed = READ_ONLY_ROLE
    message = await check(empty, empty.api())
    assert message == (
        f"the planner may not patch deployments.apps/scale {DEPLOYMENT}, patch pods in "
        "namespace serving (the planner's RBAC Role: configs/k8s/planner-rbac.yaml)"
    )  # not `delete` on pods: optional (a warning)
    # The review says what the calls would meet: the API server refuses them alike.
    with pytest.raises(KubeApiError) as refused:
        empty.api().patch_scale(DEPLOYMENT, 1, "")
    assert refused.value.status == 403
    assert 'cannot patch resource "deployments/scale" in API group "apps"' in str(refused.value)
    assert empty.kube.deployments[DEPLOYMENT].replicas == 0
    # The shipped Role grants all the actuator asks to be reviewed.
    empty.kube.allowed = shipped_role()
    await empty.actuator().check()
    subresource = {a.get("subresource", "") for a in empty.kube.reviews}
    assert subresource == {"scale", ""}
    asked = {
        (a["group"], a["resource"] + (f"/{a['subresource']}" if a.get("subresource") else ""),
         a["verb"])
        for a in empty.kube.reviews
    }  # fmt: skip
    assert asked == {
        ("apps", "deployments/scale", "get"),
        ("apps", "deployments/scale", "patch"),
        ("", "pods", "list"),
        ("", "pods", "patch"),
        ("", "pods", "delete"),
    }


def test_planner_run_names_the_verbs_its_role_lacks_in_one_line(tmp_path: Path) -> None:
    with fake_kube(tmp_path, None) as kube:
        kube.add_deployment(DEPLOYMENT, 0, LABELS)
        kube.allowed = READ_ONLY_ROLE
        config = config_file(tmp_path, kube)
        result = CliRunner().invoke(kvplane_app, ["planner", "run", "--config", str(config)])
    assert result.exit_code == 1 and isinstance(result.exception, ConfigError)  # main: one line
    # The leader election's Lease too (live.kubernetes.leader_election, on by default).
    assert str(result.exception) == (
        f"the planner may not patch deployments.apps/scale {DEPLOYMENT}, patch pods, create "
        "leases.coordination.k8s.io, update leases.coordination.k8s.io kvplane-planner in "
        "namespace serving (the planner's RBAC Role: configs/k8s/planner-rbac.yaml)"
    )


async def check(cluster: Cluster, api: KubeApi) -> str:
    actuator = cluster.actuator(api)
    try:
        with pytest.raises(ConfigError) as refused:
            await actuator.check()
    finally:
        await actuator.close()
    return str(refused.value)


def test_in_cluster_defaults_come_from_the_pod_or_are_asked_for_in_one_line(
    tmp_path: Path,
) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")  # a hand-made file's trailing line break is not the token's
    split_token = tmp_path / "split-token"
    split_token.write_text("to\nken\n")
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "6443"}

    def connect(
        env: dict[str, str], namespace: str | None = "serving", token_file: Path = token
    ) -> KubeConnection:
        return in_cluster(
            env, server=None, namespace=namespace, token_file=token_file, ca_file=None
        )

    connection = connect(environ)
    assert connection.server == "https://10.96.0.1:6443"
    assert connection.token_file is not None and connection.token_file.current() == "t"
    assert connect({"KUBERNETES_SERVICE_HOST": "fd00::1"}).server == "https://[fd00::1]:443"
    # `kubectl proxy`: plain HTTP, no token; the default CA file (absent here) is not needed.
    proxy = in_cluster(
        {},
        server="http://127.0.0.1:8001",
        namespace="serving",
        token_file=None,
        ca_file=SERVICE_ACCOUNT_DIR / "ca.crt",
    )
    assert proxy == KubeConnection("http://127.0.0.1:8001", "serving", None, None)
    refusals: dict[str, Callable[[], KubeConnection]] = {
        "KUBERNETES_SERVICE_HOST is not in the environment": lambda: connect({}),
        "cannot read live.kubernetes.token_file /nonexistent": lambda: connect(
            environ, token_file=Path("/nonexistent")
        ),
        "live.kubernetes.token_file .*/split-token holds a character a bearer token cannot "
        "carry": lambda: connect(environ, token_file=split_token),
    }
    if not SERVICE_ACCOUNT_DIR.exists():  # outside a pod: no namespace file to default to
        refusals["namespace is not set"] = lambda: connect(environ, namespace=None)
    for expected, call in refusals.items():
        with pytest.raises(ConfigError, match=expected) as refused:
            call()
        assert "\n" not in str(refused.value)


def test_planner_run_names_a_missing_deployment_in_one_line(tmp_path: Path) -> None:
    with fake_kube(tmp_path, None) as kube:
        config = config_file(tmp_path, kube, deployments={"default": "missing"})
        result = CliRunner().invoke(kvplane_app, ["planner", "run", "--config", str(config)])
    assert result.exit_code == 1 and isinstance(result.exception, ConfigError)  # main: one line
    line = str(result.exception)
    assert '404 NotFound: deployments.apps "missing" not found' in line and "\n" not in line
    assert "is Deployment missing in namespace serving?" in line


def config_file(tmp_path: Path, kube: FakeKube, **kubernetes: object) -> Path:
    """A live planner's config file for pool default against `kube` over plain HTTP (as
    through a `kubectl proxy`), the controller unreachable; `kubernetes` adds to (or replaces
    in) its `live.kubernetes`."""
    token_file = tmp_path / "token"
    token_file.write_text(kube.token)
    settings = {
        "api_server": kube.url,
        "namespace": kube.namespace,
        "token_file": str(token_file),  # the default ca_file (absent here) is not needed
        "deployments": {"default": DEPLOYMENT},
        **kubernetes,
    }
    config = tmp_path / "planner.yaml"
    config.write_text(json.dumps({"live": {"controller": "127.0.0.1:1", "kubernetes": settings}}))
    return config


def test_planner_run_ends_each_api_call_within_live_kubernetes_api_timeout_s(
    tmp_path: Path,
) -> None:
    """An API server that trickles its answers: the start-up check's call gives up at the
    limit the configuration sets, and says which."""
    with fake_kube(tmp_path, None) as kube:
        kube.add_deployment(DEPLOYMENT, 0, LABELS)
        kube.hang_requests = True
        config = config_file(tmp_path, kube, api_timeout_s=2)
        result = CliRunner().invoke(kvplane_app, ["planner", "run", "--config", str(config)])
        kube.hang_requests = False
    assert result.exit_code == 1 and isinstance(result.exception, ConfigError), result.output
    line = str(result.exception)
    # The first call: the review of the planner's access.
    assert line.startswith("reviewing the planner's access: POST ") and "\n" not in line
    # Given up at 2 s: mid-answer, or (a loaded machine) before its headers came.
    assert line.endswith(("no whole answer within 2 s", "timed out")), line


@pytest.mark.timeout(60)
async def test_ctrl_c_during_the_start_up_check_does_not_wait_for_a_hung_api(
    tmp_path: Path,
) -> None:
    """The API server takes the planner's first call and never finishes answering it: Ctrl-C
    ends the planner while that call is still pending (its connection dropped mid-answer),
    rather than after it (which, the answer trickling in, would be never)."""
    with fake_kube(tmp_path, None) as kube:
        kube.add_deployment(DEPLOYMENT, 0, LABELS)
        kube.hang_requests = True
        # The call's own limit far beyond the test's bound, so that it cannot end the call
        # first on a loaded machine (it did once at the default 10 s: exit 1, "timed out").
        config = config_file(tmp_path, kube, api_timeout_s=600)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvplane", "planner", "run", "--config", str(config),
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            await asyncio.to_thread(kube.wait_for, lambda: kube.hung_requests == 1)
            process.send_signal(signal.SIGINT)
            async with asyncio.timeout(30):  # a bound for the old behaviour: waiting forever
                _, stderr = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 130, stderr.decode()  # kvplane's exit for Ctrl-C
        assert b"Traceback" not in stderr, stderr.decode()
        # The call was abandoned mid-answer: the planner hung up on it, having asked nothing
        # more.
        await asyncio.to_thread(kube.wait_for, lambda: kube.dropped_requests == 1)
        assert kube.hung_requests == 1


@pytest.mark.timeout(120)
async def test_planner_run_scales_the_deployment_and_leaves_its_pods_when_stopped(
    empty: Cluster, tmp_path: Path
) -> None:
    kubernetes = {
        "api_server": empty.kube.url,
        "namespace": empty.kube.namespace,
        "token_file": str(empty.token_file),
        "ca_file": str(empty.ca_file),
        "engine_port": empty.kube.engine_port,
        "deployments": {"default": DEPLOYMENT},
        "poll_s": 0.1,
    }
    live = {"controller": f"127.0.0.1:{empty.app.port}", "kubernetes": kubernetes}
    config = tmp_path / "planner.yaml"
    config.write_text(json.dumps({"pools": [{"min_engines": 2, "max_engines": 2}], "live": live}))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvplane", "planner", "run", "--config", str(config),
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await empty.wait_routable(2)
    finally:
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    # The Deployment outlives the planner: its pods serve on, registered, for the next one.
    assert empty.kube.deployments[DEPLOYMENT].replicas == 2
    addresses = sorted(empty.kube.address(p) for p in empty.kube.ready_pods(DEPLOYMENT))
    assert len(addresses) == 2 and empty.registered() == addresses
    # It led (its Lease) and, stopped, released the Lease: a standby takes over at once.
    lease = empty.kube.leases["kvplane-planner"]["spec"]
    assert lease["holderIdentity"] == "" and lease["leaseDurationSeconds"] == 1
    assert empty.kube.requests <= shipped_role()  # the shipped RBAC Role allows all it asked


@pytest.mark.timeout(60)
async def test_api_errors_mid_run_do_not_stop_the_planner(empty: Cluster) -> None:
    live = LivePlanner(planner(1, 1), empty.actuator())
    empty.kube.forbidden.update({("list", "pods"), ("patch", "deployments/scale")})
    try:
        assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
        await asyncio.gather(*live._starts)  # the start failed (logged)
        assert not live.engines
        empty.kube.forbidden.clear()
        assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]  # asked again
        await empty.wait_routable(1)
    finally:
        await live.close()


@pytest.mark.timeout(60)
async def test_an_overloaded_api_server_is_asked_again_after_its_retry_after(
    empty: Cluster,
) -> None:
    """429 (API Priority and Fairness) on the scale PATCH, 503 on the pod listing, each with
    Retry-After: the start waits as told and goes on, rather than failing and starting over
    at the next tick."""
    kube = empty.kube
    kube.faults += [
        Fault("PATCH", "deployments/scale", 429, retry_after_s=1),
        Fault("GET", "pods", 503, retry_after_s=1),
    ]
    actuator = empty.actuator()
    try:
        address = await actuator.start("default")
    finally:
        await actuator.close()
    assert kube.faulted == 2 and not kube.faults  # both were answered, and asked again
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert empty.routable() == [address]


@pytest.mark.timeout(120)
async def test_a_scale_down_whose_answer_was_lost_is_not_made_twice(two_pods: Cluster) -> None:
    """The scale PATCH of a removal answered 504 Timeout, though the API server made it: the
    drained pod is deleted, and the removal tried again at the next tick sees the scale
    changed to what it asked, rather than scaling down once more (a serving pod)."""
    kube = two_pods.kube
    drained, serving = kube.ready_pods(DEPLOYMENT)
    actuator = two_pods.actuator()
    try:
        await actuator.adopt()
        await actuator.drain(kube.address(drained), 5)
        kube.faults.append(Fault("PATCH", "deployments/scale", 504, applied=True))
        with pytest.raises(KvplaneError, match=f"pod {drained.name} not scaled away yet"):
            await actuator.stop(kube.address(drained))
        await two_pods.wait(lambda: drained.name not in kube.pods)
        assert await actuator.adopt() == []  # the removal tried again
        assert await actuator.adopt() == []
    finally:
        await actuator.close()
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert kube.deleted == [drained.name]
    assert kube.ready_pods(DEPLOYMENT) == [serving]
    assert two_pods.registered() == [kube.address(serving)]


@pytest.mark.timeout(120)
async def test_a_scale_up_whose_answer_was_lost_is_not_made_twice(empty: Cluster) -> None:
    """The start's scale PATCH answered 504 though made: the start fails (the core asks
    again), and the next start takes the replica it made rather than asking for another."""
    kube = empty.kube
    kube.faults.append(Fault("PATCH", "deployments/scale", 504, applied=True))
    actuator = empty.actuator()
    try:
        with pytest.raises(KvplaneError, match="504 Timeout"):
            await actuator.start("default")
        address = await actuator.start("default")
    finally:
        await actuator.close()
    assert kube.deployments[DEPLOYMENT].replicas == 1
    assert empty.routable() == [address]


@pytest.mark.timeout(60)
async def test_a_rotated_token_is_named_and_the_next_one_read(
    two_pods: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet rotates the service account's token in its file: while the file holds one
    the API server refuses, each tick says which file, in one line; the next token written
    there is used at the next call."""
    kube, token_file = two_pods.kube, two_pods.token_file
    pods = kube.ready_pods(DEPLOYMENT)
    actuator = two_pods.actuator()
    try:
        token_file.write_text("an-expired-token\n")
        with caplog.at_level(logging.WARNING, logger="planner.kubernetes"):
            assert await actuator.adopt() == []
        (line,) = (r.getMessage() for r in caplog.records if "401" in r.getMessage())
        assert f"the token in {token_file} was refused" in line and "\n" not in line
        token_file.write_text(kube.token)
        adopted = await actuator.adopt()
    finally:
        await actuator.close()
    assert sorted(adopted) == sorted((kube.address(pod), "default") for pod in pods)
    assert kube.ready_pods(DEPLOYMENT) == pods and not kube.deleted


@pytest.mark.timeout(60)
async def test_an_api_server_that_trickles_its_answers_does_not_hold_up_the_tick(
    two_pods: Cluster,
) -> None:
    """The API server takes each call and answers a byte at a time: every read of the
    socket gets a byte before its timeout, yet each call ends at the API timeout, and the
    ticks go on meanwhile, their engines polled."""
    kube = two_pods.kube
    api = KubeApi(two_pods.api().connection, timeout_s=1)
    live = LivePlanner(planner(2, 2), two_pods.actuator(api))
    try:
        assert await live.tick() == []  # the pods adopted
        kube.hang_requests = True
        async with asyncio.timeout(30):  # a bound for the old behaviour: never
            while kube.dropped_requests == 0:  # until the planner hangs up on a call
                assert await live.tick() == []
                await asyncio.sleep(0.1)
        assert sorted(live.engines) == two_pods.registered()
        for engine in live.engines.values():  # polled, and answered
            assert engine.state is EngineState.SERVING and engine.failed_polls == 0
    finally:
        kube.hang_requests = False
        await live.close()


@pytest.mark.timeout(120)
async def test_a_hung_api_server_holds_up_neither_the_engines_load_nor_the_ticks(
    two_pods: Cluster,
) -> None:
    """The API server takes the planner's listing of the pods and never finishes answering
    (each call's limit is an hour here): the ticks go on all the same, the engines' load
    observed at each (a request that starts meanwhile is seen), and the listing under way is
    not asked again while it hangs."""
    kube = two_pods.kube
    api = KubeApi(two_pods.api().connection, timeout_s=3600)
    metrics = PlannerMetrics()
    live = LivePlanner(planner(2, 2), two_pods.actuator(api), metrics=metrics)
    busy = kube.address(kube.ready_pods(DEPLOYMENT)[0])
    generation: asyncio.Task[None] | None = None
    try:
        assert await live.tick() == []  # the pods adopted: the first look is waited for
        await two_pods.wait_routable(2)
        kube.hang_requests = True
        generation = asyncio.create_task(generate_on(busy))
        async with asyncio.timeout(60):  # a bound for the old behaviour: an hour
            while kube.hung_requests == 0 or live.engines[busy].load.running_requests == 0:
                assert await live.tick() == []
                await asyncio.sleep(0.1)
            ticks = ticks_done(metrics)
            for _ in range(3):
                assert await live.tick() == []
        assert ticks_done(metrics) == ticks + 3
        assert kube.hung_requests == 1 and kube.dropped_requests == 0  # still under way
        assert sorted(live.engines) == two_pods.registered()
        assert all(e.state is EngineState.SERVING for e in live.engines.values())
    finally:
        kube.hang_requests = False
        if generation is not None:
            generation.cancel()
            await asyncio.gather(generation, return_exceptions=True)
        await live.close()


def ticks_done(metrics: PlannerMetrics) -> float:
    return metrics.registry.get_sample_value("kvplane_planner_tick_seconds_count") or 0.0


DEPLOYMENT_B = "kvplane-engine-b"


@pytest.fixture
async def two_pools(tmp_path: Path, tls_files: tuple[Path, Path]) -> AsyncIterator[Cluster]:
    """One pod in each of two pools: `default` (DEPLOYMENT) and `b` (DEPLOYMENT_B)."""
    async for cluster in cluster_with(tmp_path, tls_files, 1):
        cluster.kube.add_deployment(DEPLOYMENT_B, 1, {**LABELS, "pool": "b"})

        def b_ready(kube: FakeKube = cluster.kube) -> bool:
            return len(kube.ready_pods(DEPLOYMENT_B)) == 1

        await cluster.wait(b_ready)
        yield cluster


def two_pool_actuator(cluster: Cluster) -> KubernetesDeployments:
    """The actuator of pools `default` and `b`, each API call bounded by an hour only."""
    return KubernetesDeployments(
        controller=f"127.0.0.1:{cluster.app.port}",
        api=KubeApi(cluster.api().connection, timeout_s=3600),
        deployments={"default": DEPLOYMENT, "b": DEPLOYMENT_B},
        engine_port=cluster.kube.engine_port,
        start_timeout_s=60,
        poll_s=0.05,
    )


async def hang_pool_default(cluster: Cluster, live: LivePlanner) -> None:
    """Both pools' pods adopted, then every call about pool default's Deployment hangs: ticks
    until a look lists its pods (and hangs)."""
    assert await live.tick() == []  # both pods adopted
    await cluster.wait_routable(2)
    cluster.kube.hang_deployments = {DEPLOYMENT}
    async with asyncio.timeout(60):
        while cluster.kube.hung_requests == 0:
            await live.tick()
            await asyncio.sleep(0.1)


@pytest.mark.timeout(180)
async def test_a_pool_whose_api_calls_hang_does_not_stop_another_from_being_scaled(
    two_pools: Cluster,
) -> None:
    """Every call about pool default's Deployment hangs (an hour each, here). Pool b's engine
    is drained by hand meanwhile: the planner removes it, deleting its pod, and starts its
    replacement, in that order, while the call about pool default is still under way."""
    kube, fleet = two_pools.kube, two_pools.app.controller.fleet
    actuator = two_pool_actuator(two_pools)
    pools = tuple(PoolConfig(name=name, min_engines=1, max_engines=1) for name in ("default", "b"))
    live = LivePlanner(
        Planner(PlannerConfig(pools=pools, scaling=ScalingConfig(tick_s=0.2))), actuator
    )
    operator = ControllerAdmin(f"127.0.0.1:{two_pools.app.port}")
    (stuck,), (drained,) = kube.ready_pods(DEPLOYMENT), kube.ready_pods(DEPLOYMENT_B)
    try:
        await hang_pool_default(two_pools, live)
        async with asyncio.timeout(90):  # a bound for the old behaviour: an hour
            await operator.drain(kube.address(drained), 300)
            while drained.name in kube.pods or len(two_pools.routable()) != 2:
                await live.tick()
                await asyncio.sleep(0.1)
            await fleet.wait_for(lambda: not live._starts and not live._removals, 60)
        assert kube.hung_requests == 1 and kube.dropped_requests == 0  # still under way
        (replacement,) = kube.ready_pods(DEPLOYMENT_B)
    finally:
        kube.hang_deployments = set()
        await operator.close()
        await live.close()
    assert kube.deleted == [drained.name]  # scaled away first, then one pod made
    assert kube.deployments[DEPLOYMENT_B].replicas == 1
    assert replacement.name != drained.name
    assert kube.deployments[DEPLOYMENT].replicas == 1 and kube.ready_pods(DEPLOYMENT) == [stuck]
    assert two_pools.registered() == sorted(kube.address(p) for p in (stuck, replacement))


@pytest.mark.timeout(180)
async def test_a_pool_whose_listing_hangs_does_not_stop_another_pools_pods_being_adopted(
    two_pools: Cluster,
) -> None:
    """Every call about pool default's Deployment hangs (an hour each, here). An operator
    scales pool b's Deployment up by hand meanwhile: its new pod is adopted (registered and
    observed) while the listing of pool default's pods is still under way."""
    kube = two_pools.kube
    actuator = two_pool_actuator(two_pools)
    pools = (
        PoolConfig(name="default", min_engines=1, max_engines=1),
        PoolConfig(name="b", min_engines=1, max_engines=2),
    )
    live = LivePlanner(
        Planner(PlannerConfig(pools=pools, scaling=ScalingConfig(tick_s=0.2))), actuator
    )
    try:
        await hang_pool_default(two_pools, live)
        async with asyncio.timeout(90):  # a bound for the old behaviour: an hour
            operator = two_pools.api()  # kubectl scale --replicas=2
            version = (await asyncio.to_thread(operator.get_scale, DEPLOYMENT_B)).resource_version
            await asyncio.to_thread(operator.patch_scale, DEPLOYMENT_B, 2, version)
            await two_pools.wait(lambda: len(kube.ready_pods(DEPLOYMENT_B)) == 2)
            (added,) = [
                kube.address(p)
                for p in kube.ready_pods(DEPLOYMENT_B)
                if kube.address(p) not in live.engines
            ]
            while added not in live.engines:
                await live.tick()
                await asyncio.sleep(0.1)
        assert kube.hung_requests == 1 and kube.dropped_requests == 0  # still under way
        await two_pools.wait_routable(3)
    finally:
        kube.hang_deployments = set()
        await live.close()
    assert added in two_pools.registered()


@pytest.mark.timeout(120)
async def test_an_api_server_down_for_a_while_is_caught_up_with_once_back(
    two_pods: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The API server refuses connections for a while: the ticks go on, the engines polled;
    one whose container crashed meanwhile is lost, and its removal and its replacement's
    start fail in one line each, tick after tick, changing nothing. Once the API server
    answers, the planner catches up: the crashed pod scaled away, one pod started, neither
    twice."""
    kube = two_pods.kube
    crashed, serving = kube.ready_pods(DEPLOYMENT)
    live = LivePlanner(
        planner(2, 2), two_pods.actuator(), load_timeout_s=1, lost_after_failed_polls=2
    )
    try:
        assert await live.tick() == []  # both pods adopted
        await two_pods.wait_routable(2)
        kube.go_down()
        kube.kill_container(crashed.name)
        with caplog.at_level(logging.WARNING):
            await ticks_until(live, lambda d: isinstance(d, ScalePool))  # lost, replaced
            await asyncio.gather(*live._starts)
            assert list(live.engines) == [kube.address(serving)]  # polled all along
            assert live.engines[kube.address(serving)].failed_polls == 0
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("planner.")]
        assert all("\n" not in line for line in lines)
        # The failed removal (the planner's own line, counted) and start each say why.
        for failure in ("stopping", "starting an engine"):
            (line, *_) = (line for line in lines if line.startswith(failure))
            assert "Connection refused" in line, line
        assert kube.deployments[DEPLOYMENT].replicas == 2 and not kube.deleted
        kube.come_back()
        async with asyncio.timeout(60):  # ticks until the pool serves two engines again
            while len(two_pods.routable()) < 2 or live._starts:
                await live.tick()
                await asyncio.sleep(0.1)
        assert await live.tick() == []
        engines = sorted(live.engines)
    finally:
        await live.close()
    assert kube.deleted == [crashed.name]
    assert kube.deployments[DEPLOYMENT].replicas == 2
    ready = sorted(kube.address(pod) for pod in kube.ready_pods(DEPLOYMENT))
    assert engines == ready == two_pods.registered()
    assert kube.address(serving) in ready


class ListingSpy(KubeApi):
    """A KubeApi that tells the test each time it lists pods."""

    def __init__(self, connection: KubeConnection) -> None:
        super().__init__(connection)
        self.listed = threading.Event()

    def list_pods(self, selector: str) -> list[Pod]:
        pods = super().list_pods(selector)
        self.listed.set()
        return pods


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scale_down_answer", ["200", "lost"])
async def test_a_hung_pod_is_scaled_away_and_replaced_by_one_start(
    empty: Cluster, scale_down_answer: str
) -> None:
    """A pod Ready to Kubernetes whose engine answers nothing (SIGSTOPped) is lost after
    `lost_after_failed_polls` ticks and scaled away (`kill`), and the core's replacement,
    asked in the same tick, scales up only once the ReplicaSet has deleted that pod: a
    Deployment controller that saw both changes at once (1 -> 0 -> 1) would delete nothing,
    and the start would wait for a pod that never comes. So too when the scale-down was
    answered 504 though made: the start waits until the next tick has found it made."""
    kube, metrics = empty.kube, PlannerMetrics()
    spy = ListingSpy(empty.api().connection)
    actuator = KubernetesDeployments(
        controller=f"127.0.0.1:{empty.app.port}",
        api=spy,
        deployments={"default": DEPLOYMENT},
        engine_port=kube.engine_port,
        start_timeout_s=20,
        poll_s=0.05,
    )
    live = LivePlanner(
        planner(1, 1), actuator, load_timeout_s=1, lost_after_failed_polls=2, metrics=metrics
    )
    hung = None
    try:
        await live.tick()
        await empty.wait_routable(1)
        await empty.app.controller.fleet.wait_for(lambda: not live._starts, 30)
        (hung,) = kube.ready_pods(DEPLOYMENT)
        assert hung.process is not None
        os.kill(hung.process.pid, signal.SIGSTOP)
        kube.hold_replicasets = True
        if scale_down_answer == "lost":
            kube.faults.append(Fault("PATCH", "deployments/scale", 504, applied=True))
        await ticks_until(live, lambda d: isinstance(d, ScalePool))  # lost, and replaced
        await asyncio.gather(*live._removals)  # the kill runs beside the ticks
        assert kube.deployments[DEPLOYMENT].replicas == 0  # scaled away
        spy.listed.clear()
        await asyncio.to_thread(spy.listed.wait, 30)  # the replacement's start is under way
        kube.hold_replicasets = False
        async with asyncio.timeout(60):  # ticks until another pod serves
            while empty.routable() in ([], [kube.address(hung)]):
                await live.tick()
                await asyncio.sleep(0.1)
    finally:
        if hung is not None and hung.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung.process.pid, signal.SIGCONT)
        await live.close()
    lost = {"pool": "default", "cause": "unresponsive"}
    assert metrics.registry.get_sample_value("kvplane_planner_engines_lost_total", lost) == 1
    failed = {"operation": "start"}
    assert not metrics.registry.get_sample_value("kvplane_planner_actuator_failures_total", failed)
    assert kube.deleted == [hung.name] and kube.deployments[DEPLOYMENT].replicas == 1
    (replacement,) = kube.ready_pods(DEPLOYMENT)
    assert empty.registered() == [kube.address(replacement)] != [kube.address(hung)]


@pytest.mark.timeout(120)
async def test_load_scales_the_deployment_up_and_its_end_down_deleting_the_drained_pod(
    empty: Cluster,
) -> None:
    """`LivePlanner` over the actuator: sized on KV use (a tiny `max_kv_usage`), long requests
    through the controller need a second engine; once they end, one is drained and removed,
    and the pod the ReplicaSet deletes is the drained one."""
    kube = empty.kube
    live = LivePlanner(planner(1, 2, max_kv_usage=0.01, level_alpha=1, trend_beta=0,
                               forecast_horizon_s=0), empty.actuator())  # fmt: skip
    stop_load = asyncio.Event()
    load: asyncio.Task[None] | None = None
    try:
        decisions = await ticks_until(live, lambda d: isinstance(d, ScalePool))
        assert decisions[-1] == ScalePool("default", 1, Reason.BELOW_MIN)
        await empty.wait_routable(1)
        load = asyncio.create_task(send_load(empty.app.port, stop_load))
        decisions = await ticks_until(live, lambda d: isinstance(d, ScalePool))
        scaled = decisions[-1]
        assert isinstance(scaled, ScalePool) and scaled.num_engines == 2
        await empty.wait_routable(2)
        assert kube.deployments[DEPLOYMENT].replicas == 2
        stop_load.set()
        await load
        decisions = await ticks_until(live, lambda d: isinstance(d, DrainEngine))
        drain = decisions[-1]
        assert isinstance(drain, DrainEngine)
        drained = drain.engine_id
        pods = {kube.address(p): p.name for p in kube.ready_pods(DEPLOYMENT)}
        decisions = await ticks_until(live, lambda d: isinstance(d, RemoveEngine))
        assert decisions[-1] == RemoveEngine(drained, "default", Reason.DRAINED)
        await empty.wait(lambda: len(kube.pods) == 1)
    finally:
        stop_load.set()
        if load is not None:
            await asyncio.gather(load, return_exceptions=True)
        await live.close()
    assert kube.deleted == [pods[drained]]
    assert kube.deployments[DEPLOYMENT].replicas == 1
    (serving,) = (kube.address(p) for p in kube.ready_pods(DEPLOYMENT))
    assert serving != drained and empty.registered() == [serving]
    assert kube.requests <= shipped_role()  # the shipped RBAC Role allows all it asked


def shipped_role() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) the Role of configs/k8s/planner-rbac.yaml grants."""
    documents = yaml.safe_load_all((CONFIGS / "k8s" / "planner-rbac.yaml").read_text())
    (role,) = (d for d in documents if d["kind"] == "Role")
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_shipped_manifest_fits_the_shipped_config() -> None:
    config = load_config(PlannerConfig, CONFIGS / "planner-k8s.yaml")
    assert config.live is not None and config.live.kubernetes is not None
    (deployment,) = yaml.safe_load_all((CONFIGS / "k8s" / "engine-deployment.yaml").read_text())
    assert config.live.kubernetes.deployments == {"default": deployment["metadata"]["name"]}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [config.live.kubernetes.engine_port]
    assert container["readinessProbe"]["grpc"]["port"] == config.live.kubernetes.engine_port
    assert f"0.0.0.0:{config.live.kubernetes.engine_port}" in container["command"]
    # The planner owns the count: a manifest's `replicas` would reset it at every apply.
    assert "replicas" not in deployment["spec"]


async def ticks_until(live: LivePlanner, wanted: Callable[[Decision], bool]) -> list[Decision]:
    """Tick (every 0.1 s, bounded) until a decision is `wanted`; the decisions of that tick."""
    async with asyncio.timeout(60):
        while True:
            decisions = list(await live.tick())
            if any(wanted(d) for d in decisions):
                return [d for d in decisions if wanted(d)]
            await asyncio.sleep(0.1)


async def send_load(controller_port: int, stop: asyncio.Event) -> None:
    """Long requests through the controller, four at a time, until `stop`."""
    numbers = itertools.count()

    async def one(stub: pb_grpc.OpenEngineAsyncStub) -> None:
        while not stop.is_set():
            n = next(numbers)
            request = pb.GenerateRequest(
                request_id=f"load-{n}",
                model="sim",
                token_ids=pb.TokenIds(ids=[(n * 7 + i) % 30000 for i in range(512)]),
                stopping=pb.StoppingOptions(max_tokens=64, ignore_eos=True),
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in stub.Generate(request):
                    pass

    async with grpc.aio.insecure_channel(f"127.0.0.1:{controller_port}") as channel:
        stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
        await asyncio.gather(*(one(stub) for _ in range(4)))
