"""The Kubernetes actuator: one Deployment per pool, scaled through its scale subresource.

- **Start**: once the pool's pods scaled away are terminating (a scale-up sooner could be
  seen together with the scale-down by Kubernetes' controllers, which would then delete
  none), unless the Deployment already has a replica no engine was handed out for (a pod
  still starting, one a crash is restarting, one an earlier start gave up on), its
  spec.replicas goes up by one (a PATCH conditional on the scale's resourceVersion: a 409
  Conflict is read again and retried). Then the first Ready pod (status.conditions Ready ==
  "True", not terminating) of the Deployment's selector that no engine is yet is taken:
  its address is podIP:`engine_port`, it is registered with the controller, and the start
  returns once the controller routes to it. Pod IPs are recycled: a pod at the address of an
  engine the actuator has (its pod gone before a look noted it) waits until a look has
  reported that engine and the planner stopped it (`_free`: one address, one engine). A
  start that times out leaves the replica asked for: the next start waits for that pod rather
  than asking for one more (no runaway scale-up while an image does not pull); its error
  names the pods it waited for and why each is not Ready (`_not_ready`: Unschedulable,
  CrashLoopBackOff, ImagePullBackOff...).
- **Removal** (of an engine the planner drained through the controller): it leaves the
  controller, then the pod gets `controller.kubernetes.io/pod-deletion-cost` set to the
  lowest value, then spec.replicas goes down by one, so the ReplicaSet deletes that pod and
  not a serving one (it deletes not-Ready pods first, then the lowest cost). While another pod
  of the Deployment is not Ready (a crash-looping container's, one still starting), which the
  ReplicaSet would delete first, the drained pod is deleted first (`_spared`; optional: a
  Role without `delete` on pods, a warning once, and the scale-down alone). A removal the API
  refuses is retried at every later `adopt` (each tick) until it is done, and so is one the
  ReplicaSet did not honour (its cache lagged the annotation and it deleted another pod; an
  operator scaled back up before it acted, and it deleted none). A
  drained pod already gone, terminating or ended (Failed: evicted) hands the cost to the pod
  the ReplicaSet made for its replica (`_stand_in`); none made, and none to be (an operator
  scaled the Deployment down, deleting it with its replica), nothing is scaled away.
- **Adoption**: every `adopt` (each tick) lists each Deployment's pods; Ready pods no engine is
  yet are registered with the controller (one it already lists is fine) and reported, unless a
  start of that pool is waiting for a pod, or a removal of that pool is due whose pod is gone
  (the pod made for its replica is to be scaled away instead). So a restarted planner takes
  over the fleet as it finds it instead of doubling it, and a pod the ReplicaSet recreated
  serves again. Engines stopped whose RemoveEngine failed (the controller did not answer) are
  taken out of the controller there too, until it no longer lists them (else it would list
  each, its pod gone, unreachable for good); a pod given the IP of one meanwhile waits. So are
  those an earlier planner left so (stopped, or no longer leading, before it took them out):
  each registration says the pool's Deployment (RegisterEngine `owner`), and the pool's
  engines the controller lists that no pod of it is at are found by the pool's first look
  the controller answers, and every LEFT_REGISTERED_LOOK_S after (`_find_left_registered`);
  one the controller routes to still is taken out by the first look after it no longer
  does (each look checks, for LEFT_REGISTERED_LOOK_S).
  A pod taken as an engine (adopted, or by a start) first has the drained
  deletion cost cleared, if a removal that did not finish left it; one a scale-down the
  ReplicaSet has yet to act on is to delete is left to go (`_cleared`).
- **Exits**: an engine whose pod vanished, is terminating or is no longer Ready is reported by
  `exited` (from the last `adopt`'s listing); its removal only takes it out of the controller:
  the replica stays, Kubernetes restarts or replaces the pod. Unless it was draining, by the
  planner's drain or an operator's (`sync` reports those): it was on its way out and the core
  has replaced it, so its replica goes too (as a drained pod's), else the restarted or
  replacement pod would be adopted and grow the pool back.
- **Close** leaves the pods running and registered: the Deployment outlives the planner.
- **A standby's look** (`serving`, a planner that does not lead): each Deployment's Ready pods,
  by reads alone; none is registered or taken as an engine.

API errors at `check` (a verb the token's RBAC does not allow, asked of the API server by a
SelfSubjectAccessReview per call before any is made; a missing Deployment, a server that cannot
be reached) are a one-line ConfigError; later they are one warning line and the tick goes on (a
start fails and the core asks again; an adoption or a removal is tried again next tick). Each
call ends within `live.kubernetes.api_timeout_s` (`KubeApi`, which also waits out a
Retry-After). The pools are looked at and scaled concurrently, at most MAX_CALLS_IN_FLIGHT calls at
once; one pool's look (`adopt`) and removals take turns under its lock, in the order asked (the
live planner runs them beside its ticks, so none holds up the engines' observation). A scale
PATCH that failed yet may have been made (a 5xx, an answer lost) is not made twice: a start's
count of free replicas sees the replica it made, and a removal tried again first reads whether
the scale is at what it asked (`_scale_away`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import grpc

from kvplane.channels import INSECURE, ClientChannels
from kvplane.config import join_host_port
from kvplane.errors import ConfigError, KvplaneError
from kvplane_api.v1 import admin_pb2 as apb
from planner.config import KubernetesConfig, LiveConfig
from planner.controller_admin import ControllerAdmin, Reconciliation
from planner.kube_api import (
    DELETION_COST,
    ROLE_HINT,
    Access,
    KubeApi,
    KubeApiError,
    Pod,
    Scale,
    in_cluster,
)

log = logging.getLogger(__name__)

# The lowest cost the API accepts (an int32): a drained pod goes before any other Ready one.
DRAINED_DELETION_COST = str(-(2**31))
# A scale PATCH is conditional on the resourceVersion read just before, which any write of the
# Deployment changes: an operator's `kubectl scale` (rare), or the Deployment controller's
# status write after a scale or a pod's change of readiness (a few in the 100 ms after each
# scale). The window between the read and the PATCH is short: a few re-reads, 10, 20, 30 and
# 40 ms apart, so that the status writes of the 100 ms after a scale (the pool's previous
# start) cannot use them all up (client-go's `retry.RetryOnConflict`: 5 tries, 10 ms apart).
_SCALE_ATTEMPTS = 5
_CONFLICT_BACKOFF_S = 0.01
# API calls under way at once, all pools together (each in a thread of its own): pools are
# looked at and scaled concurrently, within what a loaded API server should be asked.
MAX_CALLS_IN_FLIGHT = 8
# How often a pool's look asks the controller for the engines an earlier planner left
# registered (`_find_left_registered`), after the first look that could: a ListWorkers, which
# on a Redis index reads the whole index for its block counts, and such engines come from a
# planner before this actuator (a restart, an earlier leader), so mostly at its first look.
LEFT_REGISTERED_LOOK_S = 60.0
# A start that times out names the pods it waited for (`_not_ready`): this many at most.
_PODS_NAMED = 3
P = ParamSpec("P")
T = TypeVar("T")


@dataclass(slots=True)
class _Engine:
    """A pod handed to the planner as an engine."""

    pool: str
    pod: str  # its name
    uid: str
    address: str

    def replica(self) -> _Replica:
        return _Replica(self.pool, self.pod, self.uid)


class _ScaleOutcomeUnknown(KubeApiError):
    """A scale PATCH that failed in a way that may have made it (`unknown_outcome`: a 5xx, an
    answer lost): conditional on resourceVersion `version`, it set spec.replicas to
    `replicas`."""

    def __init__(self, error: KubeApiError, version: str, replicas: int) -> None:
        super().__init__(str(error), error.status)
        self.version, self.replicas = version, replicas


@dataclass(frozen=True, slots=True)
class _UnknownScaleDown:
    """A removal's scale-down whose outcome is unknown, and the pod it was to delete."""

    replica: _Replica
    version: str
    replicas: int


@dataclass(frozen=True, slots=True)
class _Replica:
    """A pod to be scaled away with its replica: a drained engine's, or the one the
    ReplicaSet made for the replica of an engine whose own pod was deleted."""

    pool: str
    pod: str  # its name
    uid: str


class KubernetesDeployments:
    """Engines of pool P are the pods of Deployment `deployments[P]`, registered with the
    controller at `controller`; `engine_port` is the port their containers serve on."""

    def __init__(
        self,
        *,
        controller: str,
        api: KubeApi,
        deployments: Mapping[str, str],
        engine_port: int,
        start_timeout_s: float,
        poll_s: float = 1.0,
        channels: ClientChannels = INSECURE,
    ) -> None:
        self._api = api
        self._deployments = dict(deployments)
        self._engine_port = engine_port
        self._start_timeout_s = start_timeout_s
        self._poll_s = poll_s
        # A leader's calls to the controller end by its term's end as its API calls do.
        self._admin = ControllerAdmin(
            controller, channels, owner_of=self._owner_of, left_s=api.left_s
        )
        self._selectors: dict[str, str] = {}  # by pool, from its scale
        self._engines: dict[str, _Engine] = {}  # by address
        self._waiting = collections.Counter[str]()  # starts of a pool waiting for a pod
        self._exited: dict[str, _Engine] = {}  # by address, reported by `exited`
        self._draining: set[str] = set()  # addresses drained (by anyone), until stopped
        self._unscaled: dict[str, _Replica] = {}  # by uid: removals the API refused so far
        self._leaving: dict[str, _Replica] = {}  # by uid: pods scaled away, until gone
        # Engines stopped whose RemoveEngine failed (the controller did not answer), which it
        # may list still, and those an earlier planner left registered: their pool by
        # address, until a look takes them out (`_take_out`).
        self._left_registered: dict[str, str] = {}
        # Of those an earlier planner left, the ones the controller routed to when found
        # (`_find_left_registered`): their pool and when, by address. Taken out once it no
        # longer routes to them, watched at each look for LEFT_REGISTERED_LOOK_S.
        self._routed_left: dict[str, tuple[str, float]] = {}
        # By uid of `_unscaled`: scale-downs that may have been made (`_scale_away`).
        self._unknown_scale_downs: dict[str, _UnknownScaleDown] = {}
        self._listed: dict[str, list[Pod]] = {}  # by pool: its pods, as last listed
        self._scale_locks = {pool: asyncio.Lock() for pool in self._deployments}
        # One pool's look (`adopt`) and removals (`stop`) one at a time, in the order asked.
        self._pool_locks = {pool: asyncio.Lock() for pool in self._deployments}
        self._looks: dict[str, asyncio.Task[list[tuple[str, str]]]] = {}  # by pool: `adopt`
        self._calls = asyncio.Semaphore(MAX_CALLS_IN_FLIGHT)
        # By pool: when its look last found the engines left registered (`time.monotonic`).
        self._left_registered_looked: dict[str, float] = {}
        # Whether the drained pod the ReplicaSet would spare may be deleted (`_spared`): the
        # Role's optional `delete` on pods; False once the review or a DELETE says no.
        self._may_delete_pods = True

    def needs(self) -> list[Access]:
        """Every call the actuator cannot do without (configs/k8s/planner-rbac.yaml grants
        them): each Deployment's scale read and patched, pods listed and patched (deletion
        cost). `DELETE_PODS`, which the Role grants too, is optional."""
        scales = [
            Access(verb, "apps", "deployments", "scale", deployment)
            for deployment in self._deployments.values()
            for verb in ("get", "patch")
        ]
        return [*scales, Access("list", "", "pods"), Access("patch", "", "pods")]

    async def check(self, also: Sequence[Access] = ()) -> None:
        """Ask the API server whether the token may make every call the actuator makes
        (`needs`) and `also` (the leader election's), then read each Deployment's scale and
        pods: a ConfigError (one line) when a call is not allowed (naming each), when the API
        refuses (404: no such Deployment; 401: the token) or cannot be reached. Without the
        review, a Role that lacks a write would only show at the first scale, as a warning
        every tick. `DELETE_PODS` denied is a warning (`_no_pod_deletes`), not an error."""
        namespace = self._api.connection.namespace
        try:
            denied = [
                a for a in [*self.needs(), *also] if not await self._call(self._api.allows, a)
            ]
            may_delete = await self._call(self._api.allows, DELETE_PODS)
        except KubeApiError as exc:
            raise ConfigError(f"reviewing the planner's access: {exc}") from exc
        if not may_delete:
            self._no_pod_deletes(
                f"the planner may not {DELETE_PODS} in namespace {namespace} ({ROLE_HINT})"
            )
        if denied:
            calls = [
                f"{access} in namespace {access.namespace}"
                if access.namespace not in {"", namespace}
                else str(access)
                for access in denied
            ]
            raise ConfigError(
                f"the planner may not {', '.join(calls)} in namespace {namespace} ({ROLE_HINT})"
            )
        for pool, deployment in self._deployments.items():
            try:
                await self._selector(pool)
                await self._pods(pool)
            except KubeApiError as exc:
                hint = f" (is Deployment {deployment} in namespace {namespace}?)"
                hint = hint if exc.status == 404 else ""  # 401 and 403: KubeApi says what
                raise ConfigError(f"pool {pool}: {exc}{hint}") from exc

    # ---------------------------------------------------------------- observing

    async def adopt(self, *, wait: bool = True) -> list[tuple[str, str]]:
        """Each pool's look at its pods (`_adopt_pool`), the pools' at once and each on its
        own: what the looks that ended found, the next look of those pools started. With
        `wait` every pool's look is waited for; without, a look under way is left to end by
        itself, so a slow Deployment holds up no other pool's adoptions."""
        found = self._ended_looks()
        for pool in self._deployments:
            if pool not in self._looks:
                self._looks[pool] = asyncio.create_task(
                    self._adopt_pool(pool), name=f"adopt {pool}"
                )
        if wait:
            await asyncio.wait(self._looks.values())
            found += self._ended_looks()
        return found

    def _ended_looks(self) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        for pool, look in list(self._looks.items()):
            if not look.done():
                continue
            del self._looks[pool]
            if look.cancelled():
                continue
            if (exc := look.exception()) is not None:  # the next look tries again
                log.error("looking at pool %s failed: %s", pool, exc)
                continue
            found += look.result()
        return found

    async def _adopt_pool(self, pool: str) -> list[tuple[str, str]]:
        adopted: list[tuple[str, str]] = []
        async with self._pool_locks[pool]:
            await self._take_out(pool)  # the controller's: not held up by the API server
            registered = None
            looked = self._left_registered_looked.get(pool)
            if looked is None or time.monotonic() - looked >= LEFT_REGISTERED_LOOK_S:
                # Before the pods: an engine registered after this has its pod listed.
                registered = await self._admin.registered_by(self._owner(pool))
            replicas = await self._replicas_while_leaving(pool)
            try:
                pods = await self._pods(pool)
            except KubeApiError as exc:
                log.warning("pods of pool %s not listed: %s", pool, exc)
                return adopted
            self._note_exits(pool, pods, replicas)
            self._routed_left_now_pods(pool, pods)
            if registered is not None:
                self._left_registered_looked[pool] = time.monotonic()
                if self._find_left_registered(pool, registered, pods):
                    await self._take_out(pool)
            if (not_done := await self._retry_removals(pool)) is not None:
                log.warning("%s (tried again next tick)", not_done)
            if self._waiting[pool]:  # its starts take the Ready pods first
                return adopted
            if self._stand_in_due(pool, pods):
                return adopted  # adopted, the pod to be scaled away would be a serving engine
            for pod in self._free(pods):
                if not await self._cleared(pool, pod, pods):
                    continue
                if any(e.uid == pod.uid for e in self._engines.values()):
                    continue  # a start that began during a registration below took it
                engine = _Engine(pool, pod.name, pod.uid, self._address(pod))
                self._engines[engine.address] = engine  # taken before the wait: starts look
                try:
                    await self._admin.register(engine.address, existing_ok=True)
                except grpc.aio.AioRpcError as exc:
                    del self._engines[engine.address]
                    log.warning(
                        "pod %s not adopted yet: controller %s", pod.name, self._admin.describe(exc)
                    )
                    break
                adopted.append((engine.address, pool))
                log.info("pod %s of Deployment %s adopted", pod.name, self._deployments[pool])
        return adopted

    def _find_left_registered(
        self, pool: str, registered: Sequence[apb.WorkerInfo], pods: Sequence[Pod]
    ) -> bool:
        """Note as left registered (for `_take_out`) the pool's engines the controller lists
        (`registered`: its registrations say this pool's owner) that no pod of the pool is
        now, nor an engine of this planner: an earlier planner's, stopped (or no longer
        leading) after its RemoveEngine failed, whose memory of them went with it. A pod not
        Ready yet, or restarting its engine, is not one of those. One still routed to (its
        pod gone or terminating before the controller's health poll saw its engine go; or
        an address reused by another Deployment's pod, which another pool or planner
        adopted under the owner the controller kept) is taken out only once the controller
        no longer routes to it: `_take_out` looks at it each look for LEFT_REGISTERED_LOOK_S,
        then leaves it to these listings. Whether any was found."""
        present = self._addresses_of_active(pods)
        found = False
        routed: set[str] = set()
        for worker in registered:
            address = worker.address
            if address in present or address in self._engines or address in self._exited:
                continue
            if worker.routable:
                routed.add(address)
                if address in self._left_registered or address in self._routed_left:
                    continue  # watched, or watched for long enough
                self._routed_left[address] = (pool, time.monotonic())
            elif address in self._left_registered:
                continue
            log.warning(
                "engine %s of pool %s is in the controller (%s) but no pod of Deployment %s: "
                "left registered by an earlier planner, taken out%s",
                address,
                pool,
                worker.state,
                self._deployments[pool],
                " once it is no longer routed to" if worker.routable else "",
            )
            self._left_registered[address] = pool
            found = True
        for address, (of, _) in list(self._routed_left.items()):
            if of == pool and address not in routed:
                del self._routed_left[address]
        return found

    def _routed_left_now_pods(self, pool: str, pods: Sequence[Pod]) -> None:
        """Forget the pool's engines found left registered while routed to that an active pod
        of the pool is now at (its IP reused): the engine routed to there is that pod's, for
        a look to adopt, not to take out."""
        present = self._addresses_of_active(pods)
        for address, (of, _) in list(self._routed_left.items()):
            if of == pool and address in present:
                del self._routed_left[address]
                self._left_registered.pop(address, None)

    def _addresses_of_active(self, pods: Sequence[Pod]) -> set[str]:
        """Where the active pods of `pods` (Ready or not) serve."""
        return {self._address(pod) for pod in pods if pod.ip and pod.active}

    def _owner(self, pool: str) -> str:
        """What the pool's registrations say of whom they are (RegisterEngine `owner`): its
        Deployment, which a planner restarted, or the next leader, manages as this one did."""
        return f"kubernetes:{self._api.connection.namespace}/{self._deployments[pool]}"

    def _owner_of(self, address: str) -> str:
        engine = self._engines.get(address) or self._exited.get(address)
        return "" if engine is None else self._owner(engine.pool)

    async def serving(self) -> dict[str, str]:
        """The Ready pods of every Deployment (address -> pool), as a standby planner
        observes them (`LivePlanner.watch`): by reads alone (each scale for its selector, the
        pods listed), for a planner that must not act: nothing is registered, annotated or
        scaled, and the actuator takes none of them as its engines."""
        pools = list(self._deployments)
        listed = await asyncio.gather(*(self._pods(pool) for pool in pools))
        return {
            self._address(pod): pool
            for pool, pods in zip(pools, listed, strict=True)
            for pod in pods
            if pod.ready and pod.active and pod.ip
        }

    def _note_exits(self, pool: str, pods: Sequence[Pod], replicas: int | None) -> None:
        by_uid = {pod.uid: pod for pod in pods}
        self._check_leaving(pool, by_uid, replicas)
        for engine in [e for e in self._engines.values() if e.pool == pool]:
            pod = by_uid.get(engine.uid)
            if pod is None or pod.deleting:
                why = "is gone" if pod is None else "is terminating"
            elif not pod.active:
                why = f"has ended ({pod.phase})"
            elif not pod.ready:
                why = "is not Ready"
            else:
                continue
            log.warning("pod %s (engine %s) %s", engine.pod, engine.address, why)
            self._exited[engine.address] = self._engines.pop(engine.address)

    async def _replicas_while_leaving(self, pool: str) -> int | None:
        """The pool's spec.replicas (for `_check_leaving`) while a pod it scaled away may be
        there still, active (not listed terminating or ended yet): an operator's scale since
        (`kubectl scale`, a GitOps sync) may have undone the scale-down. Read before the pods
        are listed: read after, it could count a scale-up made once that pod had left the
        listing's state (this planner's start, which waits for it to go; an operator's), as
        if it had spared the pod, and undo it. None: no such pod, or the read failed (the
        next look reads again)."""
        gone = {pod.uid for pod in self._listed.get(pool, ()) if not pod.active}
        if not any(e.pool == pool and uid not in gone for uid, e in self._leaving.items()):
            return None
        try:
            return (await self._scale(pool)).replicas
        except KubeApiError as exc:
            log.warning("scale of pool %s not read: %s", pool, exc)
            return None

    def _check_leaving(self, pool: str, by_uid: Mapping[str, Pod], replicas: int | None) -> None:
        """Forget pods scaled away once they are gone (or ended: a Failed pod stays listed,
        but counts for the ReplicaSet no more than a gone one). One still there, active, while
        the Deployment has no more active pods than replicas was spared: the ReplicaSet
        deleted another (it reads the deletion cost from a cache that may lag the annotation;
        the other is then reported as exited), or an operator scaled back up before it acted
        (it saw the count unchanged and deleted none): `replicas`, read before the pods were
        listed (`_replicas_while_leaving`; None: not read, nothing is done again). Its
        removal is done again: else it would serve nothing, and every start of the pool would
        wait for it to go."""
        active = sum(1 for pod in by_uid.values() if pod.active)
        for uid, engine in list(self._leaving.items()):
            pod = by_uid.get(uid)
            if engine.pool != pool or (pod is not None and pod.deleting):
                continue  # another pool's, or terminating: gone soon
            if pod is None or not pod.active:
                del self._leaving[uid]
            elif replicas is not None and active <= replicas:
                log.warning("pod %s was spared by the scale-down: removing it again", pod.name)
                self._unscaled[uid] = self._leaving.pop(uid)

    def _stand_in_due(self, pool: str, pods: Sequence[Pod]) -> bool:
        """Whether a replica of the pool is to be scaled away (an engine that exited while
        draining, whose `stop` comes this tick, or a removal the API refused so far) whose own
        pod is gone, terminating or ended (`Pod.active`): the pod the scale-down is to delete
        is then one no engine is yet, the one the ReplicaSet made for that replica, so none is
        adopted until the removal has marked it (`_scale_away`)."""
        present = {pod.uid for pod in pods if pod.active}
        return any(r.pool == pool and r.uid not in present for r in self._removals_due())

    def _removals_due(self) -> list[_Replica]:
        """Replicas to be scaled away that are not yet: removals the API refused so far, and
        engines that exited while draining (their `stop` comes this tick)."""
        exited_draining = [e for a, e in self._exited.items() if a in self._draining]
        return [*self._unscaled.values(), *(e.replica() for e in exited_draining)]

    def exited(self) -> list[str]:
        return sorted(self._exited)

    async def sync(
        self, serving: Sequence[str], draining: Mapping[str, float | None]
    ) -> Reconciliation:
        hand = await self._admin.sync(serving, draining)
        # An operator's drain sends the engine on its way out as the planner's does (the core
        # starts its replacement at once): should its pod exit, its replica goes too. One not
        # taken (the engine serves again) is no longer on its way out: its replica stays.
        self._draining.update(hand.begun)
        self._draining.difference_update(hand.withdrawn)
        return hand

    async def controller_restarted(self) -> None:
        await self._admin.restarted()

    # ---------------------------------------------------------------- acting

    async def start(self, pool: str) -> str:
        await self._admin.check_reachable(pool)
        self._waiting[pool] += 1
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await self._until_scaled_away(pool)
                await self._claim_replica(pool)
                engine = await self._ready_pod(pool)
        except TimeoutError as exc:  # its str is empty
            why = f"no Ready pod after start_timeout_s ({self._start_timeout_s:g} s)"
            if starting := self._not_ready(pool):
                why += f": {starting}"
            raise KvplaneError(f"no engine of {pool} started: {why}") from exc
        except KubeApiError as exc:
            raise KvplaneError(f"no engine of {pool} started: {exc}") from exc
        finally:
            self._waiting[pool] -= 1
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await self._admin.register(engine.address, existing_ok=True)
                await self._admin.wait_routed(engine.address)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            # Free again (or exited meanwhile): the next `adopt` takes it if it is Ready.
            self._engines.pop(engine.address, None)
            self._exited.pop(engine.address, None)
            await self._remove(engine.address, pool)
            why = (
                self._admin.describe(exc)
                if isinstance(exc, grpc.aio.AioRpcError)
                else "never routed to"
            )
            raise KvplaneError(f"pod {engine.pod} of pool {pool}: controller {why}") from exc
        return engine.address

    async def _until_scaled_away(self, pool: str) -> None:
        """Until the pool's pods scaled away are terminating, ended or gone (the caller bounds
        the wait). A scale-up sooner could undo a scale-down: Kubernetes' Deployment and
        ReplicaSet controllers may see both changes at once (N -> N-1 -> N, one sync) and
        delete no pod, and a start would wait for a new pod that never comes (with
        `min_engines` 1, a hung engine killed and replaced in the same tick would leave the
        pool empty for `start_timeout_s`). A scale-down whose outcome is unknown is waited
        out too, until the next `adopt` has found it made (its pod then leaving) or sent it
        again: a scale-up meanwhile would move the scale off what the scale-down asked, so
        the removal tried again would not find it made and would scale down once more,
        taking this start's pod."""
        while True:
            leaving = {uid for uid, e in self._leaving.items() if e.pool == pool}
            unknown = any(u.replica.pool == pool for u in self._unknown_scale_downs.values())
            if not leaving and not unknown:
                return
            try:
                pods = await self._pods(pool)
            except KubeApiError as exc:
                log.warning("pods of pool %s not listed: %s", pool, exc)
            else:
                if not unknown and not any(p.uid in leaving and p.active for p in pods):
                    return
            await asyncio.sleep(self._poll_s)

    async def _claim_replica(self, pool: str) -> None:
        """One more replica for this start, unless the Deployment has one no engine and no
        other start has claimed (the starts of a pool take turns: the count is theirs)."""

        def replicas(scale: Scale) -> int | None:
            taken = sum(1 for e in self._engines.values() if e.pool == pool)
            unscaled = sum(1 for e in self._unscaled.values() if e.pool == pool)
            if scale.replicas >= taken + unscaled + self._waiting[pool]:
                return None
            return scale.replicas + 1

        await self._rescale(pool, replicas)

    async def _ready_pod(self, pool: str) -> _Engine:
        """The first Ready pod of the pool no engine is, taken (the caller bounds the wait)."""
        while True:
            try:
                pods = await self._pods(pool)
            except KubeApiError as exc:
                log.warning("pods of pool %s not listed: %s", pool, exc)
                pods = []
            for pod in self._free(pods):
                if not await self._cleared(pool, pod, pods) or pod.uid in self._taken():
                    continue  # not cleared yet, or taken meanwhile (an adoption)
                engine = _Engine(pool, pod.name, pod.uid, self._address(pod))
                self._engines[engine.address] = engine
                log.info("pod %s of pool %s is Ready at %s", pod.name, pool, engine.address)
                return engine
            await asyncio.sleep(self._poll_s)

    async def _cleared(self, pool: str, pod: Pod, pods: Sequence[Pod]) -> bool:
        """Whether `pod` (one of the pool's `pods`) may be taken as an engine: not while it
        carries the drained deletion cost, which a removal left that did not finish (a
        planner stopped between the annotation and the scale-down; a pod chosen to go in
        place of one gone whose scale-down failed, another chosen at the retry), until the
        cost is cleared. Serving with it, the pod would be the one the ReplicaSet deletes at
        the next scale-down (a tie with the drained pod, broken by the more recently Ready),
        requests and all. Not while the Deployment has more active pods than replicas either:
        a scale-down is under way that the ReplicaSet has not acted on yet (a planner
        restarted in between), and the pod is the one it is to delete. A clear the API
        refuses leaves the pod for a later look."""
        if pod.deletion_cost != DRAINED_DELETION_COST:
            return True
        try:
            if sum(1 for p in pods if p.active) > (await self._scale(pool)).replicas:
                return False  # to go: the ReplicaSet has yet to act on a scale-down
            await self._call(self._api.annotate_pod, pod.name, {DELETION_COST: None})
        except KubeApiError as exc:
            log.warning("pod %s not taken yet, its deletion cost not cleared: %s", pod.name, exc)
            return False
        log.info("pod %s: the deletion cost an unfinished removal left on it cleared", pod.name)
        return True

    def _taken(self) -> set[str]:
        """The uids of the pods that are engines or on their way out."""
        return {e.uid for e in self._engines.values()} | set(self._leaving) | set(self._unscaled)

    def _free(self, pods: Sequence[Pod]) -> list[Pod]:
        """Ready pods, oldest first, that are no engine and not on their way out. Pod IPs are
        reused: a pod at the address of an engine of another pod (gone, its IP given to this
        one before a look noted it: `_note_exits`) or of an exited one waits until the planner
        has reported that engine exited and removed it, and one at the address of an engine
        left registered until the controller no longer lists it. One address, one engine:
        taken sooner, the new engine would write over the old one's entry (never reported
        exited, its replica's fate lost), and the old one's removal, by address, would take
        the new one out."""
        taken = self._taken()
        held = self._engines.keys() | self._exited.keys() | self._left_registered.keys()
        return sorted(
            (
                pod
                for pod in pods
                if pod.ready
                and pod.active
                and pod.ip
                and pod.uid not in taken
                and self._address(pod) not in held
            ),
            key=lambda pod: (pod.created, pod.name),
        )

    def _address(self, pod: Pod) -> str:
        """The engine's address: podIP:engine_port (an IPv6 cluster's in brackets)."""
        assert pod.ip is not None  # only Ready pods, which have an IP, are engines
        return join_host_port(pod.ip, self._engine_port)

    async def drain(self, address: str, within_s: float) -> None:
        self._draining.add(address)
        await self._admin.drain(address, within_s)

    async def stop(self, address: str) -> None:
        """Take a drained engine out of the controller and scale its pod away; one that
        exited only leaves the controller (its replica stays for Kubernetes to refill), unless
        it exited while draining, by the planner's drain or an operator's (it was on its way
        out and the core has replaced it: its replica goes too). A scale-away the API refuses
        raises (the planner counts the failure), and is retried at every later `adopt`; so is
        a RemoveEngine that failed (`_remove`), which is only logged. Under
        its pool's lock, as `adopt`'s look at that pool: the two must not scale the same
        removal away twice. One that gets the lock once the leader's term is over does
        nothing (no call would be sent): the next leader takes the engine over as it finds
        it, as one whose removal was cut short."""
        known = self._exited.get(address) or self._engines.get(address)
        if known is None:
            self._draining.discard(address)
            await self._admin.remove(address)
            return
        async with self._pool_locks[known.pool]:
            if not self._term_over():
                await self._stop(address, known.pool)

    def _term_over(self) -> bool:
        """Whether the leader's term this actuator acts in is over (never, unbound)."""
        return self._api.left_s is not None and self._api.left_s() <= 0

    async def _stop(self, address: str, pool: str) -> None:
        await self._remove(address, pool)
        was_draining = address in self._draining
        self._draining.discard(address)
        engine = self._exited.pop(address, None)
        if engine is None:
            engine = self._engines.pop(address, None)
        elif not was_draining:
            return
        if engine is None:
            return
        self._unscaled[engine.uid] = engine.replica()
        not_done = await self._retry_removals(engine.pool)
        if engine.uid in self._unscaled:  # the planner logs why, in one line
            not_done = not_done or f"pod {engine.pod} not scaled away yet"
            raise KvplaneError(f"{not_done} (tried again every tick)")

    async def _remove(self, address: str, pool: str) -> None:
        """RemoveEngine of `address`, an engine of `pool` that stops. One that failed (the
        controller did not answer: restarting, a partition) is kept, for the pool's next look
        to take out (`_take_out`): else the controller would list the engine, its pod gone,
        unreachable for good."""
        if not await self._admin.remove(address):
            self._left_registered[address] = pool
            self._routed_left.pop(address, None)  # taken out routed to or not: it stopped

    async def _take_out(self, pool: str) -> None:
        """RemoveEngine of the pool's engines left registered (`_remove`; by an earlier
        planner: `_find_left_registered`) that the controller lists still, but those found
        routed to while it routes to them; each is forgotten once it no longer lists it. One
        whose RemoveEngine fails again, or all when the controller does not answer, wait for
        the next look (a warning says why); so does one routed to, for LEFT_REGISTERED_LOOK_S
        after it was found (then the pool's listings find it again once it is not)."""
        tried = sorted(a for a, of in self._left_registered.items() if of == pool)
        if not tried:
            return
        removals = await self._admin.remove_listed(tried, unless_routed=self._routed_left)
        if removals is None:
            return
        for address in removals.removed:
            log.warning(
                "engine %s left registered as it stopped: taken out of the controller", address
            )
        for address in set(tried) - set(removals.kept):
            self._left_registered.pop(address, None)
            self._routed_left.pop(address, None)
        now = time.monotonic()
        for address in removals.kept:
            _, found = self._routed_left.get(address, (pool, now))
            if now - found >= LEFT_REGISTERED_LOOK_S:  # routed to all along: not watched on
                self._left_registered.pop(address, None)

    async def kill(self, address: str) -> None:
        """An engine that stopped answering goes as a drained one does: its pod is scaled
        away, and Kubernetes kills the container after its termination grace period (SIGTERM
        first; a hung process gets SIGKILL), which the planner need not wait for."""
        await self.stop(address)

    async def _retry_removals(self, pool: str) -> str | None:
        """Scale away the pool's removals not done yet, in order: None once all are done,
        else why one is not (one line; the later ones wait for it)."""
        for replica in [r for r in self._unscaled.values() if r.pool == pool]:
            try:
                leaving = await self._scale_away(replica)
            except KubeApiError as exc:
                return f"pod {replica.pod} not scaled away yet: {exc}"
            del self._unscaled[replica.uid]
            self._unknown_scale_downs.pop(replica.uid, None)
            if leaving is not None:
                self._leaving[leaving.uid] = leaving
        return None

    async def _scale_away(self, replica: _Replica) -> _Replica | None:
        """The pod first to go (lowest deletion cost), then one replica fewer; the pod that
        goes (None: its replica went already). A pod already gone, terminating or ended
        (deleted or evicted while draining: `Pod.active`) no longer counts as a replica: the
        pod the ReplicaSet made for its replica goes instead (`_stand_in`), else the
        ReplicaSet would take the most recently Ready pod, which may serve.

        A scale-down tried before whose outcome is unknown (a 504 Timeout: the API server
        may commit the write after answering) is not sent again if the scale shows it made:
        changed since, to the replicas it set. (An operator's scale to that same count looks
        the same, and leaves the count this removal wanted.) Sent again, it would delete a
        serving pod."""
        gone_uid = replica.uid  # its key in `_unscaled`, whichever pod goes instead
        unknown = self._unknown_scale_downs.get(gone_uid)
        if unknown is not None:
            scale = await self._scale(replica.pool)
            if scale.resource_version != unknown.version and scale.replicas == unknown.replicas:
                log.info(
                    "Deployment %s is at %d replicas: the scale-down for pod %s was made",
                    self._deployments[replica.pool],
                    scale.replicas,
                    unknown.replica.pod,
                )
                return unknown.replica
        pods = await self._pods(replica.pool)
        spared_by = self._spared(replica, pods)
        if spared_by is not None:
            log.info(
                "pod %s is not Ready: a scale-down would delete it before drained pod %s, "
                "deleted instead",
                spared_by.name,
                replica.pod,
            )
            try:
                await self._call(self._api.delete_pod, replica.pod, replica.uid)
            except KubeApiError as exc:
                if exc.status == 403:  # the Role lacks it: the scale-down alone, as without
                    self._no_pod_deletes(str(exc))
                elif exc.status not in {404, 409}:  # 404, 409 (another pod of its name):
                    raise  # gone already; else tried again at the next tick
            else:  # on its way out, whichever pod the scale-down takes: never adopted again
                self._leaving[replica.uid] = replica
            pods = await self._pods(replica.pool)
        if not any(pod.uid == replica.uid and pod.active for pod in pods):
            stand_in = await self._stand_in(replica, pods)
            if stand_in is None:
                return None
            replica = stand_in
        try:
            await self._call(
                self._api.annotate_pod, replica.pod, {DELETION_COST: DRAINED_DELETION_COST}
            )
        except KubeApiError as exc:
            if exc.status != 404:  # gone: nothing to order
                raise
        try:
            await self._rescale(replica.pool, lambda scale: max(0, scale.replicas - 1))
        except _ScaleOutcomeUnknown as exc:
            self._unknown_scale_downs[gone_uid] = _UnknownScaleDown(
                replica, exc.version, exc.replicas
            )
            raise
        deployment = self._deployments[replica.pool]
        log.info("pod %s scaled away from Deployment %s", replica.pod, deployment)
        return replica

    def _no_pod_deletes(self, why: str) -> None:
        """No more deletes of a drained pod the ReplicaSet would spare (warned once): a
        scale-down beside a not-Ready pod then deletes that one, and the core's next start
        refills the replica."""
        if self._may_delete_pods:
            log.warning(
                "%s: a removal while another pod of the Deployment is not Ready may delete "
                "that pod and not the drained one, a replica the next start refills",
                why,
            )
        self._may_delete_pods = False

    def _spared(self, replica: _Replica, pods: Sequence[Pod]) -> Pod | None:
        """A pod the ReplicaSet would delete before `replica`'s, whatever their deletion
        costs, had the Deployment one replica fewer: one of its pods staying (active, neither
        scaled away nor to be) that Kubernetes ranks first (`ActivePodsWithRanks`: Pending
        before Running, not Ready before Ready), such as a crash-looping container's. None if
        there is none, or `replica`'s pod is not active. The drained pod would be spared, and
        scaled away again at the next look: the Deployment one replica short, a crash-looping
        engine's pod deleted. (A drained engine's pod stays Ready: its readiness probe checks
        the empty service name, SERVING while the process runs.) None too while pods may not
        be deleted (`_no_pod_deletes`)."""
        if not self._may_delete_pods:
            return None
        drained = next((pod for pod in pods if pod.uid == replica.uid and pod.active), None)
        if drained is None:
            return None
        going = set(self._leaving) | {r.uid for r in self._removals_due()}
        return next(
            (
                pod
                for pod in pods
                if pod.active
                and pod.uid not in going
                and pod.uid != replica.uid
                and _deletion_rank(pod) < _deletion_rank(drained)
            ),
            None,
        )

    async def _stand_in(self, gone: _Replica, pods: Sequence[Pod]) -> _Replica | None:
        """The pod to scale away in place of `gone`'s: one the ReplicaSet made for its
        replica, that is a pod no engine serves on (an exited engine's, whose replica stays,
        will do: the core replaces it, and a start takes any free pod) and not on its way out
        already; not Ready before Ready, then the newest, as the ReplicaSet would choose
        among them. While the Deployment has fewer pods staying (active, not scaled away)
        than replicas, none was made for it yet (or the one made is a start's): the
        scale-down then deletes no pod, and `gone` is returned (a pod gone, or going). With
        as many pods staying as replicas and none of them free, its replica went with its
        pod: the Deployment was scaled down meanwhile (`kubectl scale`), and one replica
        fewer would delete a serving engine: None."""
        active = [pod for pod in pods if pod.active]
        staying = [pod for pod in active if pod.uid not in self._leaving]
        replicas = (await self._scale(gone.pool)).replicas
        if len(staying) < replicas:
            return gone
        taken = {e.uid for e in self._engines.values()} | set(self._leaving)
        taken |= {r.uid for r in self._removals_due()}
        candidates = [pod for pod in active if pod.uid not in taken]
        newest_first = sorted(candidates, key=lambda pod: (pod.created, pod.name), reverse=True)
        stand_in = min(newest_first, key=lambda pod: pod.ready, default=None)
        if stand_in is None:
            log.info(
                "pod %s is gone, and so is its replica: Deployment %s has %d pods for its %d "
                "replicas, all serving or on their way out (scaled down meanwhile?): nothing "
                "scaled away for it",
                gone.pod,
                self._deployments[gone.pool],
                len(staying),
                replicas,
            )
            return None
        log.info("pod %s goes in place of pod %s, which is gone", stand_in.name, gone.pod)
        return _Replica(gone.pool, stand_in.name, stand_in.uid)

    async def close(self) -> None:
        """Leave the pods serving (the Deployment outlives the planner; the next adopts them).
        Looks under way are cancelled."""
        for look in self._looks.values():
            look.cancel()
        await asyncio.gather(*self._looks.values(), return_exceptions=True)
        await self._admin.close()

    # ---------------------------------------------------------------- the API

    async def _scale(self, pool: str) -> Scale:
        scale = await self._call(self._api.get_scale, self._deployments[pool])
        self._selectors[pool] = scale.selector
        return scale

    async def _rescale(self, pool: str, replicas: Callable[[Scale], int | None]) -> None:
        """Set the pool's scale to `replicas(scale)` (None: leave it), read under the pool's
        lock; the PATCH is conditional on the version read, and a conflict (someone else
        scaled meanwhile) is read again. A PATCH that may have been made all the same raises
        `_ScaleOutcomeUnknown`."""
        deployment = self._deployments[pool]
        async with self._scale_locks[pool]:
            for attempt in range(_SCALE_ATTEMPTS):
                scale = await self._scale(pool)
                wanted = replicas(scale)
                if wanted is None:
                    return
                try:
                    await self._call(
                        self._api.patch_scale, deployment, wanted, scale.resource_version
                    )
                except KubeApiError as exc:
                    if exc.unknown_outcome:
                        raise _ScaleOutcomeUnknown(exc, scale.resource_version, wanted) from exc
                    if exc.status != 409 or attempt == _SCALE_ATTEMPTS - 1:
                        raise
                    await asyncio.sleep(_CONFLICT_BACKOFF_S * (attempt + 1))
                    continue
                log.info("Deployment %s scaled from %d to %d", deployment, scale.replicas, wanted)
                return

    async def _selector(self, pool: str) -> str:
        if pool not in self._selectors:
            await self._scale(pool)
        selector = self._selectors[pool]
        if not selector:  # an empty selector would list every pod of the namespace
            raise KubeApiError(f"the scale of Deployment {self._deployments[pool]} has no selector")
        return selector

    async def _pods(self, pool: str) -> list[Pod]:
        pods = await self._call(self._api.list_pods, await self._selector(pool))
        self._listed[pool] = pods
        return pods

    def _not_ready(self, pool: str) -> str:
        """The pods a start of the pool waits for, as last listed, and why each is not Ready
        (one line: `pod NAME Pending, Unschedulable: 0/4 nodes are available: ...`): active,
        not Ready, and neither an engine nor on its way out. "" if none."""
        taken = self._taken()
        pods = [
            pod
            for pod in self._listed.get(pool, ())
            if pod.active and not pod.ready and pod.uid not in taken
        ]
        named = [f"pod {pod.name} {pod.why_not_ready}" for pod in pods[:_PODS_NAMED]]
        if len(pods) > _PODS_NAMED:
            named.append(f"{len(pods) - _PODS_NAMED} more not Ready")
        return "; ".join(named)

    async def _call(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """An API call, once fewer than MAX_CALLS_IN_FLIGHT are under way."""
        async with self._calls:
            return await in_daemon_thread(call, *args, **kwargs)


# Optional (`_spared`): without it a removal beside a not-Ready pod may take that pod instead.
DELETE_PODS = Access("delete", "", "pods")

# Pod phases in the order the ReplicaSet deletes them (`ActivePodsWithRanks`); any other, first.
_PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


def _deletion_rank(pod: Pod) -> tuple[int, bool]:
    """How the ReplicaSet ranks a pod to delete before the deletion cost: the lower first."""
    return _PHASE_RANK.get(pod.phase, -1), pod.ready


async def in_daemon_thread(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`call(*args, **kwargs)` (a blocking API call) in a daemon thread of its own.

    Not `asyncio.to_thread`: its pool's threads are joined by `asyncio.run` on the way out
    and again at interpreter exit, so a call still pending when the planner stops (a hung API
    server: up to the call's timeout, 10 s) would hold up the exit, Ctrl-C during the
    start-up check included. A blocking http.client call cannot be interrupted, so the
    prompt way out is to stop waiting for it:
    cancelling the await abandons the call, and the thread ends with it (or with the
    process, as a daemon)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before the thread ran
        try:
            future.set_result(call(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            future.set_exception(exc)

    threading.Thread(target=run, name="kubernetes-api", daemon=True).start()
    return await asyncio.wrap_future(future)


def kube_api(kubernetes: KubernetesConfig, environ: Mapping[str, str]) -> KubeApi:
    """The API client `live.kubernetes` describes (`environ` gives the in-cluster defaults);
    a ConfigError (one line) when it cannot be made."""
    connection = in_cluster(
        environ,
        server=kubernetes.api_server,
        namespace=kubernetes.namespace,
        token_file=kubernetes.token_file,
        ca_file=kubernetes.ca_file,
    )
    return KubeApi(connection, kubernetes.api_timeout_s)


def deployments_actuator(
    live: LiveConfig,
    kubernetes: KubernetesConfig,
    api: KubeApi,
    controller_channels: ClientChannels = INSECURE,
) -> KubernetesDeployments:
    """The actuator `live.kubernetes` describes over `api`, dialling the controller with
    `controller_channels` (`live.controller_tls`); not checked (`connect_deployments`)."""
    return KubernetesDeployments(
        controller=live.controller,
        api=api,
        deployments=kubernetes.deployments,
        engine_port=kubernetes.engine_port,
        start_timeout_s=live.start_timeout_s,
        poll_s=kubernetes.poll_s,
        channels=controller_channels,
    )


async def connect_deployments(
    live: LiveConfig,
    kubernetes: KubernetesConfig,
    api: KubeApi,
    controller_channels: ClientChannels = INSECURE,
    also: Sequence[Access] = (),
) -> KubernetesDeployments:
    """`deployments_actuator`, once the API has shown it may make every call the actuator
    makes and `also` (the leader election's) and that it serves each Deployment; else a
    ConfigError (one line)."""
    actuator = deployments_actuator(live, kubernetes, api, controller_channels)
    try:
        await actuator.check(also)
    except BaseException:  # a ConfigError, or Ctrl-C during the check: nobody else closes it
        await actuator.close()
        raise
    return actuator
