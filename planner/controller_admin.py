"""The planner's side of the controller's admin API, shared by every actuator.

Engines enter routing by `register` (RegisterEngine), leave it by `drain` (DrainEngine: the
controller stops routing at once and relays the engine's Drain, followed in a background task
whose events are logged) and `remove` (RemoveEngine). `sync` is the per-tick reconciliation:
serving engines the controller does not list (it restarted, or someone removed them by hand)
are registered again, those it lists as draining are returned with the blocks its index
places on each engine (the one listing, ListWorkers), and those the planner drained that it
routes to again (the drain was not taken) are drained again. Every call is bounded by
`ADMIN_TIMEOUT_S` except the drain stream, which lasts as long as the drain (at the
planner's close, `drain_all`: until `DRAIN_ANSWER_S` past the drain's deadline). A leader's
(`left_s`) end by its renew deadline too, as its Kubernetes API calls do (planner.term_bound),
the drain's first answer included: a hung controller holds none past its term. `restarted`'s
wait on the controller's identity, which changes nothing, is left to the term's end to cancel.
`restarted` returns when the controller is a new process (its instance id changed): the planner then
registers its engines again at once, not at its next tick. Every registration carries the
`owner` that `owner_of` gives its address (none when ""), so that the actuator finds its
engines among the controller's (`registered_by`) after a restart of its own; a controller
older than the field refuses it, and is asked again without it. `describe` gives a
failed call in one line, with the setting it most likely lacks: `live.controller_tls` when a
TLS controller hung up on the connection, `live.controller_token_file` when the controller
refused the call's token (or its lack of one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

import grpc

from kvplane.channels import (
    INSECURE,
    METHOD_NOT_FOUND,
    ClientChannels,
    ClientSettings,
    Redialling,
    setting_hint,
)
from kvplane.errors import KvplaneError
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.term_bound import TimeLeft, bounded_s

log = logging.getLogger(__name__)

# The longest an admin call may take (the tick waits for the reconciliation's).
ADMIN_TIMEOUT_S = 5.0
# How long past its deadline a drain's end is waited for (`drain_all`): the engine aborts
# what is left at the deadline and says so at once.
DRAIN_ANSWER_S = 1.0
# A controller that does not answer (restarting, or a network hiccup): waited for.
_CONTROLLER_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# How often `wait_routed` lists the controller's engines.
_ROUTED_POLL_S = 0.2
# The admin channel dials a controller that went away again after 0.1 s, then less and less
# often, at least once a second: a restarted controller listens again within a second or two,
# and gRPC's own backoff (from 1 s, x1.6) left it without the planner's engines for up to
# 1.6 s more. A controller that stays down gets one connection attempt a second.
_RECONNECT_S = (0.1, 1.0)
# How often `restarted` asks the controller's instance id while its connection stays up: a
# controller that restarts drops it (and is asked at once), one behind a proxy may not.
_IDENTITY_POLL_S = 5.0
# The settings `describe` names when the controller's TLS or token and the planner's do not
# match.
CONTROLLER_SETTINGS = ClientSettings(
    "live.controller_tls",
    "live.controller_tls.cert_file and key_file",
    "live.controller_token_file",
    "live.controller_tls.server_name",
)


class Reconciliation(NamedTuple):
    """What a reconciliation (`sync`) found: drains not the planner's (`kvplane admin drain`,
    or those of the planner before this one) and the engines' cached prefixes."""

    begun: list[str]  # engines it was told serve that the controller lists as draining
    # Engines it was told were drained by hand that the controller routes to again: the drain
    # was not taken (the engine did not answer it in time; the operator was told so).
    withdrawn: list[str]
    # Blocks the controller's index places on each engine it lists (ListWorkers'
    # indexed_blocks): the cached prefixes the fleet would lose with it.
    indexed_blocks: dict[str, int]


NOT_RECONCILED = Reconciliation([], [], {})


class Removals(NamedTuple):
    """What `remove_listed` did with the engines the controller listed."""

    removed: list[str]
    # The controller lists them still: their RemoveEngine failed, or they were spared as
    # routed to.
    kept: list[str]


def _drain_request(address: str, within_s: float) -> apb.DrainEngineRequest:
    """DrainEngine of `address`, what it still runs after `within_s` aborted."""
    return apb.DrainEngineRequest(
        engine=address, deadline_ms=max(0, int(within_s * 1000)), abort_after_deadline=True
    )


def _admin_and_gateway(
    channel: grpc.aio.Channel,
) -> tuple[apb_grpc.AdminAsyncStub, pb_grpc.OpenEngineAsyncStub]:
    return apb_grpc.AdminStub(channel), pb_grpc.OpenEngineStub(channel)


class ControllerAdmin:
    """The admin API of the controller at `controller` (HOST:PORT); `owner_of(address)` is
    the `owner` a registration of `address` says (RegisterEngine)."""

    def __init__(
        self,
        controller: str,
        channels: ClientChannels = INSECURE,
        owner_of: Callable[[str], str] = lambda address: "",
        left_s: TimeLeft | None = None,
    ) -> None:
        self._controller = controller
        # A leader's term (its calls end by its renew deadline, `bounded_s`), or None.
        self._left_s = left_s
        self._channels = channels
        self._owner_of = owner_of
        # The admin API and, on the same server, the gateway: GetEngineInfo names the
        # controller's process.
        self._dialled = Redialling(
            channels.reconnecting(*_RECONNECT_S),
            controller,
            _admin_and_gateway,
        )
        self._instance_id: str | None = None  # the last one `restarted` saw
        self._drains: set[asyncio.Task[None]] = set()

    async def restarted(self) -> None:
        """Return once the controller is another process than the one this last saw: its
        instance id (GetEngineInfo) changed, so it lost every engine registered at run time.
        Waits on the connection rather than asking all the time: a controller that dies drops
        it, and the next GetEngineInfo (wait_for_ready) is answered as soon as a process
        listens on the address again; one whose connection stays up is asked every
        `_IDENTITY_POLL_S`. A controller that does not answer is asked again (never raises)."""
        while True:
            try:
                info = await self._gateway.GetEngineInfo(
                    pb.GetEngineInfoRequest(), timeout=ADMIN_TIMEOUT_S, wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                await self._dialled.after_failure()
                self._dial_afresh_after(exc)
                # Down for longer than the call waited: asked again at once. Refused (its
                # token, an older controller): asked again later; the ticks' ListWorkers
                # reconciles meanwhile.
                if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                    await asyncio.sleep(_IDENTITY_POLL_S)
                continue
            seen, self._instance_id = self._instance_id, info.instance_id
            if seen is not None and info.instance_id != seen:
                return
            await self._connection_lost()

    async def _connection_lost(self) -> None:
        """Until the channel leaves the state it is in (a connection up: until it drops), or
        `_IDENTITY_POLL_S` passes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_IDENTITY_POLL_S):
                channel = self._dialled.channel
                await channel.wait_for_state_change(channel.get_state())

    async def check_reachable(self, pool: str) -> None:
        """Raise, in one line, unless the controller answers and would register an engine:
        no engine is started (with a real model, minutes of loading) for a controller that is
        down, or that asks for a token (`auth`) the planner does not have."""
        try:
            await self._list()
            await self._check_may_register()
        except grpc.aio.AioRpcError as exc:
            await self._dialled.after_failure()
            raise KvplaneError(
                f"no engine of {pool} started: controller {self.describe(exc)}"
            ) from exc

    async def _check_may_register(self) -> None:
        """CheckAccess: a controller answers it to a caller whose token lets it register
        engines and refuses it (UNAUTHENTICATED) to others, changing nothing either way.
        ListWorkers alone does not tell: a controller without `protect_reads` answers it to
        anyone. A controller older than CheckAccess (UNIMPLEMENTED) is not refused here:
        its RegisterEngine will say whether the token is right."""
        try:
            await self._stub.CheckAccess(
                apb.CheckAccessRequest(), timeout=self._timeout_s(ADMIN_TIMEOUT_S)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise

    async def register(self, address: str, *, existing_ok: bool = False) -> None:
        """RegisterEngine; with `existing_ok`, an engine the controller already lists (one a
        previous planner registered) is not an error. The engine's owner (`owner_of`) goes
        with it, unless the controller is older than RegisterEngine's `owner` (it refuses
        fields it does not have): the engine is registered without."""
        request = apb.RegisterEngineRequest(address=address, owner=self._owner_of(address))
        try:
            try:
                await self._stub.RegisterEngine(request, timeout=self._timeout_s(ADMIN_TIMEOUT_S))
            except grpc.aio.AioRpcError as exc:
                if not (request.owner and _refused_owner(exc)):
                    raise
                log.debug("controller %s has no RegisterEngine owner", self._controller)
                request.ClearField("owner")
                await self._stub.RegisterEngine(request, timeout=self._timeout_s(ADMIN_TIMEOUT_S))
        except grpc.aio.AioRpcError as exc:
            if not (existing_ok and exc.code() is grpc.StatusCode.ALREADY_EXISTS):
                raise

    async def wait_routed(self, address: str) -> None:
        """Until the controller lists `address` as routable (its first health poll answered);
        the caller bounds the wait. A controller that restarts meanwhile is waited for (it
        does not answer) and given the engine again (it answers without listing it): the
        engine is serving, and stopping it for the controller's restart would only lose the
        start."""
        while True:
            try:
                listed = await self._list()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _CONTROLLER_AWAY:
                    raise
            else:
                worker = next((w for w in listed.workers if w.address == address), None)
                if worker is None:
                    await self.register(address, existing_ok=True)
                elif worker.routable:
                    return
            await asyncio.sleep(_ROUTED_POLL_S)

    async def worker_state(self, address: str) -> str:
        """What the controller says of `address` (its state and last error), in one line; ""
        when it does not list it or does not answer."""
        try:
            listed = await self._list()
        except grpc.aio.AioRpcError:
            return ""
        for worker in listed.workers:
            if worker.address == address:
                return f"{worker.state}: {worker.last_error}" if worker.last_error else worker.state
        return ""

    async def sync(
        self, serving: Sequence[str], draining: Mapping[str, float | None]
    ) -> Reconciliation:
        """Register again those of `serving` the controller does not list; return those it
        lists as draining, those of `draining` drained by hand (None) that it routes to
        again, and the blocks its index places on each engine it lists. Drain again each of
        `draining` drained by the planner (address: seconds left to its deadline) that the
        controller routes to: its drain was not taken (the engine did not answer the Drain in
        time, and the controller routes to it again once it answers its health), and it would
        serve on while counted as leaving. A controller that does not answer: one warning,
        nothing returned."""
        if not serving and not draining:
            return NOT_RECONCILED
        withdrawn: list[str] = []
        try:
            listed = await self._list()
            states = {worker.address: worker.state for worker in listed.workers}
            routed = {worker.address for worker in listed.workers if worker.routable}
            for address, within_s in draining.items():
                if address not in routed or states[address] == "draining":
                    continue
                if within_s is None:  # an operator's: theirs to ask again
                    withdrawn.append(address)
                else:
                    log.warning("engine %s is routed to again (its drain was not taken)", address)
                    await self.drain(address, within_s)
            for address in serving:
                if address not in states:
                    log.warning(
                        "engine %s is not in the controller (it restarted, or the engine was "
                        "removed by hand): registered again",
                        address,
                    )
                    await self.register(address)
        except grpc.aio.AioRpcError as exc:
            log.warning("controller: %s", self.describe(exc))
            return NOT_RECONCILED
        return Reconciliation(
            [address for address in serving if states.get(address) == "draining"],
            withdrawn,
            {worker.address: worker.indexed_blocks for worker in listed.workers},
        )

    async def drain(self, address: str, within_s: float) -> None:
        """Ask the controller to drain `address`; requests still running after `within_s` are
        aborted. Returns at once: the drain's stream is followed in the background."""
        task = asyncio.create_task(self._follow_drain(_drain_request(address, within_s)))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def drain_all(self, addresses: Collection[str], within_s: float) -> None:
        """As `drain`, for each of `addresses` at once, returning once every drain has ended
        (its engine's requests done, or aborted after `within_s`) or failed (a warning each),
        and `DRAIN_ANSWER_S` past `within_s` at the latest, whatever the controller does
        meanwhile (hung before its first answer, or after it): one warning then names the
        drains not ended. A drain the controller does not answer at all is given up after
        `ADMIN_TIMEOUT_S` (it answers at once, as the engine takes the drain). Cancelled,
        the drains are."""
        drains = {
            asyncio.ensure_future(
                self._follow_drain(_drain_request(address, within_s), ADMIN_TIMEOUT_S)
            ): address
            for address in addresses
        }
        if not drains:
            return
        try:
            _, late = await asyncio.wait(drains, timeout=within_s + DRAIN_ANSWER_S)
        finally:
            for drain in drains:
                drain.cancel()
            await asyncio.gather(*drains, return_exceptions=True)
        if late:
            log.warning(
                "drain of %s: not ended %g s past its deadline",
                ", ".join(sorted(drains[drain] for drain in late)), DRAIN_ANSWER_S,
            )  # fmt: skip

    async def _follow_drain(
        self, request: apb.DrainEngineRequest, answer_within_s: float | None = None
    ) -> None:
        """Log the drain's events; given up (a warning) if the controller has not answered
        within `answer_within_s` (None: waited for), nor past a leader's term."""
        try:
            answer_within_s = self._timeout_s(answer_within_s)
            async with asyncio.timeout(answer_within_s) as answer_by:
                async for event in self._stub.DrainEngine(request):
                    answer_by.reschedule(None)
                    log.debug("drain %s: %s", request.engine, event.message or event.state)
        except grpc.aio.AioRpcError as exc:
            log.warning("drain of %s: %s", request.engine, self.describe(exc))
        except TimeoutError:  # `answer_by`'s: an outer timeout's is a cancellation here
            log.warning(
                "drain of %s: the controller did not answer in %g s",
                request.engine, answer_within_s,
            )  # fmt: skip

    async def remove(self, address: str, within_s: float = ADMIN_TIMEOUT_S) -> bool:
        """RemoveEngine, waited for `within_s`; whether the controller no longer lists
        `address` (one it no longer listed is not an error). Any other failure is logged and
        False: the engine is stopped all the same (the controller then lists it, unreachable,
        until it is removed by hand), and a caller that can retry keeps what names it. So is
        an exception that is no gRPC status (a bug, a channel closed under the call: logged
        once, with its traceback): the controller may list the engine still."""
        try:
            await self._stub.RemoveEngine(
                apb.EngineRef(engine=address), timeout=self._timeout_s(within_s)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                log.warning("controller: RemoveEngine of %s: %s", address, self.describe(exc))
                return False
        except Exception:
            log.exception("controller: RemoveEngine of %s failed", address)
            return False
        return True

    async def remove_listed(
        self, addresses: Sequence[str], unless_routed: Collection[str] = ()
    ) -> Removals | None:
        """RemoveEngine of each of `addresses` the controller lists, except those of
        `unless_routed` it routes to: those it removed and those it still lists (spared, or
        their RemoveEngine failed, said in a warning each), or None (said in one warning)
        when it did not answer."""
        try:
            listed = {worker.address: worker for worker in (await self._list()).workers}
        except grpc.aio.AioRpcError as exc:
            log.warning("controller: %s", self.describe(exc))
            return None
        removals = Removals([], [])
        for address in addresses:
            if address not in listed:
                continue
            if address in unless_routed and listed[address].routable:
                removals.kept.append(address)
                continue
            (removals.removed if await self.remove(address) else removals.kept).append(address)
        return removals

    async def registered_by(self, owner: str) -> list[apb.WorkerInfo] | None:
        """The engines the controller lists whose registration said `owner`, or None when it
        does not answer (the tick's `sync` says why). A controller older than the field lists
        none."""
        try:
            listed = await self._list()
        except grpc.aio.AioRpcError as exc:
            log.debug("controller: %s", self.describe(exc))
            return None
        return [worker for worker in listed.workers if worker.owner == owner]

    async def close(self) -> None:
        for task in list(self._drains):
            task.cancel()
        await self._dialled.close()

    @property
    def _stub(self) -> apb_grpc.AdminAsyncStub:
        return self._dialled.stub[0]

    @property
    def _gateway(self) -> pb_grpc.OpenEngineAsyncStub:
        return self._dialled.stub[1]

    def _timeout_s(self, timeout_s: float | None) -> float | None:
        """A call's `timeout_s` (None: unbounded), no longer than what is left of a leader's
        term; past the term, the call is not to be sent: DEADLINE_EXCEEDED, as one that ran
        out of time (gRPC sends a call whatever its timeout)."""
        within_s = bounded_s(timeout_s, self._left_s)
        if within_s is not None and within_s <= 0 and self._left_s is not None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "not sent: past the leader's renew deadline",
            )
        return within_s

    def describe(self, exc: grpc.aio.AioRpcError) -> str:
        """A failed admin call in one line, with the setting (TLS, token) it most likely
        lacks; a server without the admin API is said to be another kind of server (not
        gRPC's bare "UNIMPLEMENTED: Method not found!", every tick)."""
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED and exc.details() == METHOD_NOT_FOUND:
            return (
                f"{self._controller} is not a kvplane controller: it does not serve the admin "
                "API (does live.controller give another server's address?)"
            )
        hint = setting_hint(self._channels, exc.code(), exc.details() or "", CONTROLLER_SETTINGS)
        return rpc_error(exc) + hint

    async def _list(self) -> apb.ListWorkersResponse:
        """ListWorkers, every tick's call: one the controller lets time out has the calls
        after it made on a new connection (`_dial_afresh_after`)."""
        # Past a leader's term: not sent, and no new connection.
        timeout_s = self._timeout_s(ADMIN_TIMEOUT_S)
        try:
            return await self._stub.ListWorkers(apb.ListWorkersRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._dial_afresh_after(exc)
            raise

    def _dial_afresh_after(self, exc: grpc.aio.AioRpcError) -> None:
        """After a call the controller let time out: its connection may be dead without a
        reset (the controller's host gone, a blackholed path), and every call on it would
        time out until the kernel gave up on it (some 15 minutes); the next goes on a new
        one, which reaches the controller at once if it answers."""
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            self._dialled.dial_afresh()


def _refused_owner(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a RegisterEngine was refused for its `owner`, a field the controller does not
    have (`kvplane.request_decoding`: an older controller)."""
    owner = apb.RegisterEngineRequest.OWNER_FIELD_NUMBER
    return exc.code() is grpc.StatusCode.INVALID_ARGUMENT and (
        f"RegisterEngineRequest field {owner}" in (exc.details() or "")
    )


def rpc_error(exc: grpc.aio.AioRpcError) -> str:
    """One line (an AioRpcError's str is several, with a debug string)."""
    return f"{exc.code().name}: {exc.details()}" if exc.details() else exc.code().name
