"""Leader election for planners that share a fleet of Deployments, the Kubernetes way (as
client-go's `leaderelection` package does, over a coordination.k8s.io/v1 Lease).

Two planners at once (a rolling update of the planner's own Deployment overlaps the old pod
and the new; replicas for availability) would each scale by their own decisions and fight
over the count. So each planner is a candidate for one Lease; the one whose identity it holds
acts, the others observe it and stand by:

- **Acquire or renew** (every `retry_period_s`, jittered as client-go's 1.2 factor): the Lease
  is read; none yet is created holding this candidate (a 409 AlreadyExists: another won).
  Whenever the Lease's spec changes, the candidate notes when it saw the change on its own
  monotonic clock (not the renewTime written there: the holders' clocks may be skewed); a
  Lease held by another is valid until `leaseDurationSeconds` after that. A candidate takes a
  Lease that is free (holderIdentity empty: released) or no longer valid, and the leader
  renews its own, by an update conditional on the resourceVersion read: of two candidates
  that try at once, one gets a 409 Conflict and stays a candidate. A new holder sets
  acquireTime and counts one more leaseTransitions; renewals keep them.
- **Leading** lasts `renew_deadline_s` from the start of the last renewal that succeeded: a
  leader that cannot renew by then (an API server down, refusing, hung) stops acting, before
  another candidate could take over (`lease_duration_s` after it last saw the Lease change,
  later than the renewal's start), the margin covering calls sent just before the deadline:
  the leader's calls end by it (`left_s`; `KubeApi.within`), none sent or retried later,
  where `api_timeout_s` (10 s) alone would let one sent then run on past the margin.
- **Release**: a leader that stops (SIGTERM) frees the Lease (holderIdentity empty,
  leaseDurationSeconds 1), as client-go's ReleaseOnCancel, so a standby takes over at its
  next try instead of after the lease expires. A leader killed, or partitioned, releases
  nothing: the Lease expires.

Each change of holder counts one more leaseTransitions in the Lease; the candidate reports the
increments it sees (`on_transitions`, the planner's `kvplane_planner_leader_transitions`), its
own takeovers included, from the first Lease it reads on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from planner.config import LeaderElectionConfig
from planner.kube_api import Access, KubeApi, KubeApiError
from planner.kubernetes import in_daemon_thread

log = logging.getLogger(__name__)

# client-go's wait.JitterUntil factor for the candidates' retries: each waits between
# retry_period_s and 2.2 times it, so that candidates do not try in lockstep.
_JITTER = 1.2
# A Lease a leader released: free, and expired a second after.
_RELEASED_DURATION_S = 1


def leader_elector(
    api: KubeApi,
    config: LeaderElectionConfig,
    *,
    on_transitions: Callable[[int], None] = lambda _: None,
) -> LeaderElector:
    """This planner's candidacy per `config` (`live.kubernetes.leader_election`), through
    `api`'s server, as an identity of its host (in a pod, the pod's name) and a random suffix,
    so that a restarted planner on the same host is a new candidate. Its calls end within
    renew_deadline_s: a renewal that takes longer is too late anyway."""
    connection = dataclasses.replace(
        api.connection, namespace=config.namespace or api.connection.namespace
    )
    lease_api = KubeApi(connection, min(api.timeout_s, config.renew_deadline_s))
    identity = f"{socket.gethostname()}_{uuid.uuid4()}"
    return LeaderElector(lease_api, config, identity, on_transitions=on_transitions)


@dataclasses.dataclass(frozen=True, slots=True)
class _Observed:
    """A Lease's spec as last read, and when (this process's monotonic clock) it was first
    seen so."""

    spec: dict[str, Any]
    since: float

    @property
    def holder(self) -> str:
        return str(self.spec.get("holderIdentity") or "")

    def valid(self, now: float) -> bool:
        """Whether the holder may still be acting: its lease has not expired as seen here."""
        duration_s = self.spec.get("leaseDurationSeconds") or 0
        return bool(self.holder) and now < self.since + float(duration_s)


class LeaderElector:
    """A candidate `identity` for the Lease `config.lease_name` of `api`'s namespace;
    `on_transitions(n)`: the Lease's leaseTransitions went up by `n` since this candidate last
    read or wrote it (n new holders: another's takeover, or this candidate's)."""

    def __init__(
        self,
        api: KubeApi,
        config: LeaderElectionConfig,
        identity: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_transitions: Callable[[int], None] = lambda _: None,
    ) -> None:
        self._api = api
        self._config = config
        self.identity = identity
        self._clock = clock
        self._on_transitions = on_transitions
        self._transitions: int | None = None  # leaseTransitions as last read or written
        self._observed: _Observed | None = None
        self._lease: dict[str, Any] | None = None  # as last read or written
        self._leading_until = float("-inf")  # on `clock`

    @property
    def lease(self) -> str:
        return f"{self._api.connection.namespace}/{self._config.lease_name}"

    def needs(self) -> list[Access]:
        """The calls the election makes (configs/k8s/planner-rbac.yaml grants them); a Role may
        name the Lease for get and update, not for create (the object does not exist yet)."""
        name = self._config.lease_name
        return [
            Access("get", "coordination.k8s.io", "leases", name=name),
            Access("create", "coordination.k8s.io", "leases"),
            Access("update", "coordination.k8s.io", "leases", name=name),
        ]

    @property
    def leading(self) -> bool:
        """Whether this planner may act: it renewed the Lease less than `renew_deadline_s` ago."""
        return self._clock() < self._leading_until

    async def acquire(self) -> None:
        """Until this candidate holds the Lease."""
        while not await self.try_acquire_or_renew():
            period_s = self._config.retry_period_s
            await asyncio.sleep(random.uniform(period_s, period_s * (1 + _JITTER)))
        log.warning(
            "leading: lease %s taken as %s (%s transitions)",
            self.lease,
            self.identity,
            self._spec_of_lease().get("leaseTransitions", 0),
        )

    async def hold(self) -> None:
        """Renew the Lease every `retry_period_s`; return once leading ended (not renewed
        within `renew_deadline_s`: `leading` is then False, and the caller must stop acting).
        A renewal that hangs is given up at the deadline."""
        while True:
            await asyncio.sleep(min(self._config.retry_period_s, self.left_s()))
            try:  # a failed try is tried again after retry_period_s, while time is left
                async with asyncio.timeout(self.left_s()):
                    await self.try_acquire_or_renew()
            except TimeoutError:
                pass
            if not self.leading:
                log.error(
                    "lease %s not renewed within renew_deadline_s (%g s): stopped acting",
                    self.lease,
                    self._config.renew_deadline_s,
                )
                return

    async def release(self) -> None:
        """Free the Lease if this planner holds it (a planner that stops): a standby takes
        over at its next try. A failure is logged: the Lease then expires."""
        if not self.leading or self._lease is None:
            return
        self._leading_until = float("-inf")
        spec = {
            **self._spec_of_lease(),
            "holderIdentity": "",
            "leaseDurationSeconds": _RELEASED_DURATION_S,
            "renewTime": _micro_time(),
        }
        try:
            await in_daemon_thread(self._api.update_lease, self._lease, spec)
        except KubeApiError as exc:
            log.warning("lease %s not released (it expires): %s", self.lease, exc)
            return
        log.info("lease %s released", self.lease)

    async def try_acquire_or_renew(self) -> bool:
        """One try (client-go's tryAcquireOrRenew): whether this candidate holds the Lease."""
        begun = self._clock()
        now = _micro_time()
        ours = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self._config.lease_duration_s,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": 0,
        }
        name = self._config.lease_name
        try:
            lease = await in_daemon_thread(self._api.get_lease, name)
        except KubeApiError as exc:
            if exc.status != 404:
                log.warning("lease %s not read: %s", self.lease, exc)
                return False
            try:
                created = await in_daemon_thread(self._api.create_lease, name, ours)
            except KubeApiError as create_error:
                if create_error.status != 409:  # 409: another candidate created it first
                    log.warning("lease %s not created: %s", self.lease, create_error)
                return False
            self._won(created, begun)
            return True
        spec = dict(lease.get("spec") or {})
        self._count_transitions(spec)
        if self._observed is None or self._observed.spec != spec:
            self._observed = _Observed(spec, self._clock())
            if self._observed.holder and self._observed.holder != self.identity:
                log.info("lease %s is held by %s: standing by", self.lease, self._observed.holder)
        held_by_us = self._observed.holder == self.identity
        if not held_by_us and self._observed.valid(self._clock()):
            return False
        if held_by_us:  # a renewal: the term goes on
            ours["acquireTime"] = spec.get("acquireTime") or now
            ours["leaseTransitions"] = spec.get("leaseTransitions") or 0
        else:
            ours["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        try:
            updated = await in_daemon_thread(self._api.update_lease, lease, ours)
        except KubeApiError as exc:
            if exc.status != 409:  # 409: another candidate (or a renewal) wrote it first
                log.warning(
                    "lease %s not %s: %s", self.lease, "renewed" if held_by_us else "taken", exc
                )
            return False
        self._won(updated, begun)
        return True

    def _won(self, lease: dict[str, Any], begun: float) -> None:
        """This candidate wrote `lease` holding it, in a call begun at `begun`."""
        self._lease = lease
        self._observed = _Observed(dict(lease.get("spec") or {}), self._clock())
        self._count_transitions(self._observed.spec)
        self._leading_until = begun + self._config.renew_deadline_s

    def _count_transitions(self, spec: dict[str, Any]) -> None:
        """Report the holders that took the Lease since it was last seen (the first Lease seen
        is the baseline; one made again, its count restarted, is a new baseline)."""
        transitions = int(spec.get("leaseTransitions") or 0)
        if self._transitions is not None and transitions > self._transitions:
            self._on_transitions(transitions - self._transitions)
        self._transitions = transitions

    def _spec_of_lease(self) -> dict[str, Any]:
        return dict((self._lease or {}).get("spec") or {})

    def left_s(self) -> float:
        """The time left to act (0: not leading): until the renew deadline. The leader's API
        calls end by then (`KubeApi.within`), so none outlives its term by more than the
        margin before a standby may take over."""
        return max(0.0, self._leading_until - self._clock())


def _micro_time() -> str:
    """Now as a Lease's acquireTime and renewTime (metav1.MicroTime: RFC 3339, microseconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def lead(
    elector: LeaderElector,
    stop: asyncio.Event,
    term: Callable[[], Coroutine[Any, Any, None]],
    stand_by: Callable[[], Coroutine[Any, Any, None]],
) -> None:
    """Until `stop` is set: become leader, then run `term()` (which acts, until `stop`) while
    leading. A term whose leading ended is cancelled at once (it must stop acting; it then
    stands by as a candidate again); one that ended after `stop` releases the Lease. While
    not leading, `stand_by()` runs (it observes, acting on nothing, until cancelled: this
    candidate leads, or stops)."""
    while not stop.is_set():
        acquiring = asyncio.create_task(elector.acquire(), name="acquire the lease")
        stopping = asyncio.create_task(stop.wait())
        standing_by = asyncio.create_task(stand_by(), name="stand by")
        await asyncio.wait({acquiring, stopping, standing_by}, return_when=asyncio.FIRST_COMPLETED)
        standing_by.cancel()
        await asyncio.gather(standing_by, return_exceptions=True)
        if not standing_by.cancelled() and standing_by.exception() is not None:
            acquiring.cancel()
            stopping.cancel()
            await asyncio.gather(acquiring, stopping, return_exceptions=True)
            standing_by.result()  # its error: the planner fails, as with a term's
        if not acquiring.done():
            acquiring.cancel()
            await asyncio.gather(acquiring, return_exceptions=True)
            return
        stopping.cancel()
        acquiring.result()  # its error, if it failed: then this planner does not lead
        running = asyncio.create_task(term(), name="lead")
        holding = asyncio.create_task(elector.hold(), name="renew the lease")
        await asyncio.wait({running, holding}, return_when=asyncio.FIRST_COMPLETED)
        if not running.done():  # leading ended: stop acting now
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            continue
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        running.result()  # its error, if it failed
        await elector.release()
