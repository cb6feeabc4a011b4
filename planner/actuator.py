"""Actuators: how the live planner's decisions reach the fleet.

`Actuator` is the seam (a Protocol, like Dynamo's planner connectors): start one engine of a
pool and return its address once the controller routes to it; report engines that serve
without the planner having started them (adopted); say when the controller restarted (its
engines are then registered again at once); drain one through the controller (which
stops routing to it at once and relays the engine's Drain); stop a drained one, or kill one
that stopped answering. Both actuators speak to the controller through
`planner.controller_admin.ControllerAdmin`.
`LocalProcesses` runs `kvplane engine serve` children on this machine (they end with the
planner, so it adopts nothing); `planner.kubernetes.KubernetesDeployments` scales one
Deployment per pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import grpc

from kvplane.channels import INSECURE, ClientChannels
from kvplane.child_signals import signal_child
from kvplane.errors import KvplaneError
from kvplane.process_exit import exit_how, log_tail
from kvplane.up.member import STOP_TIMEOUT_S, member_environment
from planner.controller_admin import (
    ADMIN_TIMEOUT_S,
    DRAIN_ANSWER_S,
    ControllerAdmin,
    Reconciliation,
)
from planner.engine_args import serve_args

log = logging.getLogger(__name__)

# How often a starting engine's port file is looked at (the wait itself is bounded).
_PORT_POLL_S = 0.05
# How long a stopped engine (scaled down, or a failed start's) has to exit after its SIGTERM,
# then it is killed (a hung one, SIGSTOPped, holds SIGTERM pending).
_STOP_GRACE_S = 20.0
# How long the engines' requests may run on when the planner closes (Ctrl-C), before they are
# aborted: the engine's own `shutdown_grace_s` (less, when the planner has less time to stop).
_CLOSE_DRAIN_S = 5.0
# At the close, how long each engine's RemoveEngine is waited for (a hung controller): it is
# stopped all the same, its port file kept for the next planner on the workdir to remove it.
_CLOSE_REMOVE_S = 2.0
# What an engine gets at least, between its SIGTERM and the close's end, to exit.
_CLOSE_EXIT_S = 2.0
# The planner's close ends this long before the time it has to stop (`kvplane up`'s
# `stop_timeout_s`, which `up` tells it; then up kills the planner, and the engines, which
# lead sessions of their own, get only their parent-death SIGTERM: a hung one never handles
# it): the planner's own exit after the close, on a loaded machine. Every engine still
# running at the close's end is killed. Until then the engines are drained together (at
# most `_CLOSE_DRAIN_S`, less when the time is short, then `DRAIN_ANSWER_S` for their
# answers), each taken out of the controller (at most `_CLOSE_REMOVE_S`) and sent SIGTERM,
# and `_CLOSE_EXIT_S` at least is left for them to exit (a test checks that the default
# time fits it all).
_EXIT_MARGIN_S = 5.0
_AFTER_DRAIN_S = DRAIN_ANSWER_S + _CLOSE_REMOVE_S + _CLOSE_EXIT_S


class Actuator(Protocol):
    async def adopt(self, *, wait: bool = True) -> list[tuple[str, str]]:
        """Look at the fleet (once a tick, before `exited`); return the engines (address,
        pool) found serving that no `start` returned and no earlier `adopt` reported: those a
        previous planner left running. They are then the planner's like engines it started.
        Without `wait`, a look that may wait on a remote system (the Kubernetes API) goes on
        beside the ticks: the call returns what the looks that ended found and starts the
        next ones."""
        ...

    async def start(self, pool: str) -> str:
        """Start one engine of `pool`; its address once the controller routes to it. An
        engine the planner has at that address (exited, its address reused before `exited`
        reported it) is gone: the start settled it, and `exited` reports it no more once the
        start returned (a start that fails leaves it to be reported); a stop or kill of it
        asked for before the planner learnt the new engine's address is not to be made (it
        would take the new engine out). (The Kubernetes actuator settles none: a pod at such
        an address is not taken until `exited` has reported that engine and it was stopped,
        so no start returns it.)"""
        ...

    async def sync(
        self, serving: Sequence[str], draining: Mapping[str, float | None]
    ) -> Reconciliation:
        """Register again those of `serving` the controller does not list (it restarted); return
        those it lists as draining (drained by hand or by the planner before this one, not by
        this one), those of `draining` drained by hand (None: found so by an earlier `sync`)
        that it routes to again (the drain was not taken: they serve again), and the blocks
        its index places on each engine. Drain again those of `draining` drained by the
        planner (address -> seconds left to the deadline) that the controller routes to
        again."""
        ...

    async def controller_restarted(self) -> None:
        """Return once the controller is a new process (restarted since the last return, or
        since the first call): it lists none of the engines registered at run time."""
        ...

    def exited(self) -> list[str]:
        """Addresses of started or adopted engines that are gone on their own (crashed,
        killed, their pod deleted): not stopped through `stop`, nor settled by a `start`
        that got their address and returned it."""
        ...

    async def drain(self, address: str, within_s: float) -> None:
        """Ask for a drain; requests still running after `within_s` are aborted."""
        ...

    async def stop(self, address: str) -> None:
        """Take a drained engine out of the controller and stop it."""
        ...

    async def kill(self, address: str) -> None:
        """Take an engine that stopped answering out of the controller and stop it at once
        (it cannot finish anything; a graceful stop would wait for nothing)."""
        ...

    async def close(self) -> None:
        """Release what the actuator holds; engines that end with the planner are stopped."""
        ...


class LocalProcesses:
    """`kvplane engine serve ENGINE_ARGS POOL_ARGS --listen 127.0.0.1:0` children (POOL_ARGS:
    `pool_args` of their pool, e.g. its role), registered with the controller at `controller`
    (its admin API); their port files and logs go to `workdir`."""

    def __init__(
        self,
        *,
        controller: str,
        engine_args: Sequence[str],
        workdir: Path,
        start_timeout_s: float,
        channels: ClientChannels = INSECURE,
        pool_args: Mapping[str, Sequence[str]] | None = None,
        stop_within_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self._engine_args = tuple(engine_args)
        self._pool_args = {pool: tuple(args) for pool, args in (pool_args or {}).items()}
        self._workdir = workdir
        self._start_timeout_s = start_timeout_s
        self._admin = ControllerAdmin(controller, channels)
        # Engines stopped that the controller may list still, with their port files: a
        # reused workdir's (a planner restarted after SIGKILL: its engines' port files say
        # which it left registered; its logs, which numbers not to write over), and this
        # run's whose RemoveEngine failed. Each look (`adopt`) takes them out.
        self._left_registered, first_number = _previous_run(workdir)
        # Held by `adopt` while it takes those out of the controller, and by a start while it
        # registers its engine: ports are reused, and an engine of this run may have one.
        self._registering = asyncio.Lock()
        self._numbers = itertools.count(first_number)
        self._processes: dict[str, asyncio.subprocess.Process] = {}  # by address, serving
        self._port_files: dict[str, Path] = {}  # by address, serving
        self._logs: dict[str, Path] = {}  # by address, serving
        # Engines `exited` said why they exited (once each, though reported until stopped).
        self._exits_said: set[str] = set()
        # Engines a start settled as it got their port (`_take_over_port`), until it serves:
        # `exited` reports them meanwhile, so that one whose start fails is the planner's to
        # lose and stop (a stop then does nothing: the start took it out).
        self._settled: set[str] = set()
        # Children not reaped yet as of the last start, for `num_alive` and `kill_all`: each
        # start drops those reaped since, so engines crash-looping for days do not grow it.
        self._spawned: list[asyncio.subprocess.Process] = []
        # Stops under way, with their processes: each waits for its engine to exit (killed
        # after `_STOP_GRACE_S`) beside the ticks, so a drained engine that hangs as it stops
        # holds up no decision.
        self._stopping: dict[asyncio.Task[bool], asyncio.subprocess.Process] = {}
        # The close's drain while under way (`kill_all` cuts it); whether `kill_all` was called.
        self._close_drain: asyncio.Future[None] | None = None
        self._killed = False
        # How long the planner has to stop (`_EXIT_MARGIN_S`), and when its close must end
        # (the event loop's clock), from its first signal (`closing`) or the close's start.
        self._stop_within_s = stop_within_s
        self._close_by: float | None = None
        # RemoveEngines under way (`_remove`), which the close's time cuts (`_remove_by`).
        self._removing: set[asyncio.Timeout] = set()

    def running(self) -> list[str]:
        """Addresses of the engines started and not stopped yet."""
        return sorted(self._processes)

    async def adopt(self, *, wait: bool = True) -> list[tuple[str, str]]:
        """Nothing: a previous planner's children died with it. Engines left registered are
        taken out of the controller, which would otherwise list them, unreachable, for good:
        a previous planner's (it was killed: SIGKILL, a crash), and this run's whose
        RemoveEngine failed as they stopped (the controller did not answer). A port file is
        dropped once its engine is out of the controller (removed, or not listed); one whose
        RemoveEngine failed again is kept, for the next look to take it out."""
        if not self._left_registered:
            return []
        # Not while a start registers its engine: one that got a dead engine's port takes it
        # out of `_left_registered` first, and must not be removed as that engine.
        async with self._registering:
            tried = sorted(self._left_registered)  # a stop may add one meanwhile: next look's
            removals = await self._admin.remove_listed(tried)
            if removals is None:  # the controller did not answer: the next tick's look
                return []
            for address in removals.removed:
                log.warning(
                    "engine %s left registered (its port file %s): taken out of the controller",
                    address,
                    self._left_registered[address],
                )
            for address in set(tried) - set(removals.kept):
                self._left_registered.pop(address).unlink(missing_ok=True)
        return []

    async def sync(
        self, serving: Sequence[str], draining: Mapping[str, float | None]
    ) -> Reconciliation:
        return await self._admin.sync(serving, draining)

    async def controller_restarted(self) -> None:
        await self._admin.restarted()

    def exited(self) -> list[str]:
        codes = {a: p.returncode for a, p in self._processes.items() if p.returncode is not None}
        for address, code in codes.items():
            if address not in self._exits_said:
                self._say_exit(address, code)
        return sorted({*codes, *self._settled})

    def _say_exit(self, address: str, code: int) -> None:
        """How an engine that exited on its own ended and its log's last lines (a traceback,
        an out-of-memory), as a failed start says them: the operator's first question."""
        self._exits_said.add(address)
        log_path = self._logs[address]
        tail = log_tail(log_path)
        ends = f" ends: {tail}" if tail else ""
        log.warning(
            "engine %s (%s) exited with %s; its log %s%s",
            log_path.stem, address, exit_how(code), log_path, ends,
        )  # fmt: skip

    def num_alive(self) -> int:
        """Child processes not reaped yet, registered or not."""
        return sum(1 for process in self._spawned if process.returncode is None)

    async def start(self, pool: str) -> str:
        await self._admin.check_reachable(pool)
        number = next(self._numbers)
        port_file = self._workdir / f"{pool}-{number}.port"
        port_file.unlink(missing_ok=True)  # a previous run's, in a reused workdir: a stale port
        log_path = self._workdir / f"{pool}-{number}.log"
        with log_path.open("wb") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvplane", "engine", "serve",
                *serve_args(self._engine_args, self._pool_args.get(pool, ()), port_file),
                stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
                env={**os.environ, **member_environment(None)},  # it dies with the planner
                start_new_session=True,  # Ctrl-C reaches the planner only; it stops them in order
            )  # fmt: skip
        self._spawned = [child for child in self._spawned if child.returncode is None]
        self._spawned.append(process)
        address: str | None = None
        registered = False
        try:
            address = f"127.0.0.1:{await self._port(port_file, process)}"
            async with self._registering:
                await self._take_over_port(address)
                await self._admin.register(address)
            registered = True
            await self._routed(address)
        except (KvplaneError, grpc.aio.AioRpcError, TimeoutError) as exc:
            await self._remove(address, port_file)
            self._terminate(process)
            if isinstance(exc, grpc.aio.AioRpcError):
                why = self._admin.describe(exc)
            elif isinstance(exc, TimeoutError):  # its str is empty
                why = f"no port after start_timeout_s ({self._start_timeout_s:g} s)"
            else:
                why = str(exc)
            # Why it failed is in its log (a bad model path, a config error): said here, so
            # one line tells the operator what to fix, and where to read more.
            tail = log_tail(log_path)
            ends = f"; its log {log_path} ends: {tail}" if tail else ""
            raise KvplaneError(f"engine {pool}-{number} did not start: {why}{ends}") from exc
        except asyncio.CancelledError:  # the planner is closing: leave no child behind
            if registered:  # the controller may route to it already: drained as the others
                assert address is not None
                self._serving(address, process, port_file, log_path)
            else:  # the controller may have taken it before the answer came
                try:
                    await self._remove(address, port_file)
                finally:  # cancelled again meanwhile: stopped all the same
                    self._terminate(process)
            raise
        self._serving(address, process, port_file, log_path)
        return address

    def _serving(
        self, address: str, process: asyncio.subprocess.Process, port_file: Path, log_path: Path
    ) -> None:
        """`process` serves at `address`, one of the engines started (`close` stops it)."""
        self._settled.discard(address)
        self._processes[address] = process
        self._port_files[address] = port_file
        self._logs[address] = log_path

    async def _take_over_port(self, address: str) -> None:
        """`address`, a new engine's, is no longer that of a dead engine that holds it still:
        one left registered (a previous planner's, or one stopped), or one of this run that
        exited and that no stop took out yet (the port is reused: that engine is dead). The
        dead one is settled as an exited one is stopped: its exit said (it is forgotten: a
        stop of it does nothing, and `exited` reports it until the new engine serves, so that
        a failed start leaves it to the planner) and taken out of the controller, which would
        refuse the new engine's registration while it lists the dead one. Its port file is
        dropped, whatever the removal did, so that `adopt` does not remove the new engine in
        its place: from now on the new engine's port file names the address (a failed start
        keeps that one while the controller may list it)."""
        if (process := self._processes.get(address)) is not None:
            signal_child(process, signal.SIGKILL)  # its port is another's: it serves no more
            code = await process.wait()  # (exited: its exit may not be collected yet)
            if address not in self._exits_said:
                self._say_exit(address, code)
            self._forget(address)
            self._settled.add(address)
            port_file = self._port_files.pop(address, None)
        elif (port_file := self._left_registered.pop(address, None)) is None:
            return
        log.info("port %s of a dead engine (its port file %s) is reused", address, port_file)
        await self._admin.remove(address)
        if port_file is not None:
            port_file.unlink(missing_ok=True)

    async def _routed(self, address: str) -> None:
        """Until the controller routes to `address`: an engine it cannot reach (its TLS or
        token settings for engines do not match the engine's) is no capacity, and the core
        must not count it as serving."""
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await self._admin.wait_routed(address)
        except TimeoutError:
            state = await self._admin.worker_state(address)
            raise KvplaneError(
                f"the controller did not route to it within start_timeout_s "
                f"({self._start_timeout_s:g} s)" + (f": {state}" if state else "")
            ) from None

    async def _port(self, port_file: Path, process: asyncio.subprocess.Process) -> int:
        async with asyncio.timeout(self._start_timeout_s):
            while True:
                if process.returncode is not None:
                    raise KvplaneError(f"exited with {exit_how(process.returncode)}")
                port = _read_port(port_file)
                if port is not None:
                    return port
                await asyncio.sleep(_PORT_POLL_S)

    async def drain(self, address: str, within_s: float) -> None:
        await self._admin.drain(address, within_s)

    async def stop(self, address: str, remove_within_s: float = ADMIN_TIMEOUT_S) -> None:
        """Out of the controller (its RemoveEngine waited for `remove_within_s`, less once
        the planner closes: `_remove`), then `_terminate`d: also when the removal raised
        (the error is the caller's to say), which must leave no engine running."""
        await self._take_out(address, remove_within_s, self._terminate)

    def _terminate(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM sent; its exit is waited for in the background (`close` waits for every
        stop under way)."""
        signal_child(process, signal.SIGTERM)
        task = asyncio.create_task(_exited(process))
        self._stopping[task] = process
        task.add_done_callback(self._stopping.pop)

    async def kill(self, address: str) -> None:
        # SIGKILL: a hung process may never handle SIGTERM (a SIGSTOPped one holds it pending).
        # Killed also when the removal raised, as `stop` terminates it.
        end = functools.partial(signal_child, sig=signal.SIGKILL)
        if (process := await self._take_out(address, ADMIN_TIMEOUT_S, end)) is not None:
            await process.wait()

    async def _take_out(
        self,
        address: str,
        remove_within_s: float,
        end: Callable[[asyncio.subprocess.Process], None],
    ) -> asyncio.subprocess.Process | None:
        """Out of the controller (`_remove`) and forgotten, then `end`ed (also when the
        removal raised): the engine started at `address`; its process, or None where a start
        that got its port settled it (`_take_over_port`): it was taken out then. One that
        exited is taken out under `_registering`, as a start takes over the port it left
        free: a new engine's registration must not come between its RemoveEngine (which would
        take the new engine out) and its `_forget` (which would forget the new engine's
        process). A running one holds its port: none can take it over."""
        if (process := self._processes.get(address)) is None:
            self._settled.discard(address)
            return None
        exited = process.returncode is not None
        async with self._registering if exited else contextlib.nullcontext():
            if self._processes.get(address) is not process:
                return None  # settled while it waited
            try:
                await self._remove(address, self._port_files.pop(address, None), remove_within_s)
            finally:
                if self._processes.get(address) is process:  # (it may exit meanwhile)
                    self._forget(address)
                end(process)
        return process

    def _forget(self, address: str) -> None:
        """Take `address` out of the engines started (`_remove` took it out of the
        controller)."""
        self._logs.pop(address, None)
        self._exits_said.discard(address)
        self._processes.pop(address, None)

    async def _remove(
        self, address: str | None, port_file: Path | None, within_s: float = ADMIN_TIMEOUT_S
    ) -> None:
        """RemoveEngine of `address`, an engine of this run that stops (None: a start that
        read no port registered nothing), waited for `within_s`. Once the planner closes, for
        `_CLOSE_REMOVE_S` at most, and not past `_CLOSE_EXIT_S` before the close's end (a
        hung controller), one sent before the planner's first signal included (`closing`):
        the engine, sent SIGTERM after it, has that time left to exit. Its port file goes once
        the controller no longer lists it; else (its RemoveEngine failed: the controller did
        not answer, or the call raised; or the removal raised or was cancelled, whatever it
        was) it is kept, in the workdir and for the next look (`adopt`) to take it out: a
        port file left in the workdir names an engine left registered."""
        removed = address is None
        try:
            if address is not None:
                removed = await self._remove_within(address, within_s)
        finally:
            if port_file is not None:
                self._keep_port_file(port_file, None if removed else address)

    async def _remove_within(self, address: str, within_s: float) -> bool:
        """`_remove`'s RemoveEngine: whether the controller no longer lists `address`."""
        if self._close_by is not None:
            within_s = min(within_s, _CLOSE_REMOVE_S)
        try:
            async with asyncio.timeout_at(self._remove_by()) as cut:
                self._removing.add(cut)
                try:
                    return await self._admin.remove(address, within_s)
                finally:
                    self._removing.discard(cut)
        except TimeoutError:
            log.warning(
                "controller: RemoveEngine of %s: not answered %g s before the close's end "
                "(the engine's time to exit): given up", address, _CLOSE_EXIT_S,
            )  # fmt: skip
            return False

    def _keep_port_file(self, port_file: Path, registered: str | None) -> None:
        """Keep `port_file` with the address the controller may list still, or drop it
        (`registered` None)."""
        if registered is None:
            port_file.unlink(missing_ok=True)
        else:
            self._left_registered[registered] = port_file

    def closing(self) -> None:
        """The planner begins to stop (its first SIGTERM/SIGINT): the close's time counts
        from now, the removals it waits for first included (their RemoveEngines under way
        cut by its end, `_remove`)."""
        if self._close_by is None:
            close_within_s = max(0.0, self._stop_within_s - _EXIT_MARGIN_S)
            self._close_by = asyncio.get_running_loop().time() + close_within_s
            for cut in self._removing:
                cut.reschedule(self._remove_by())

    def _remove_by(self) -> float | None:
        """When a RemoveEngine is given up (the event loop's clock): `_CLOSE_EXIT_S` before
        the close's end, the engine's time to exit; None before the planner closes."""
        return None if self._close_by is None else self._close_by - _CLOSE_EXIT_S

    async def close(self) -> None:
        """Stop every engine started (the fleet ends with the planner), all at once: one at a
        time, a slow or hung engine would hold up the others' stop. Each is drained first
        (all together, `ControllerAdmin.drain_all`), for `_CLOSE_DRAIN_S` or what the close's
        time leaves: RemoveEngine ends the streams the controller relays from it, and its
        clients would lose the requests it runs; then stopped. Every engine still running
        at the close's end, `_EXIT_MARGIN_S` before the planner's time to stop is up (hung:
        SIGSTOPped, its SIGTERM pending), stops under way before it included, is killed:
        the close fits the time `kvplane up` gives the planner."""
        self.closing()
        assert self._close_by is not None
        close_by = self._close_by
        loop = asyncio.get_running_loop()
        addresses = list(self._processes)
        drain_s = min(_CLOSE_DRAIN_S, close_by - loop.time() - _AFTER_DRAIN_S)
        if addresses and not self._killed and drain_s > 0:
            log.info(
                "draining %d engine(s) for up to %.3g s, then stopping them (interrupt again "
                "to stop them at once)", len(addresses), drain_s,
            )  # fmt: skip
            self._close_drain = asyncio.ensure_future(self._admin.drain_all(addresses, drain_s))
            try:  # waited, not awaited: `kill_all` cancels it, the close goes on
                await asyncio.wait([self._close_drain])
            finally:
                self._close_drain.cancel()
                self._close_drain = None
        stops = [self.stop(address, _CLOSE_REMOVE_S) for address in addresses]
        for address, failed in zip(
            addresses, await asyncio.gather(*stops, return_exceptions=True), strict=True
        ):
            if isinstance(failed, Exception):  # stopped all the same (`stop`), as the others
                log.error("stopping engine %s at close failed", address, exc_info=failed)
        stopping = list(self._stopping.values())
        killed = await asyncio.gather(*(_exited(process, close_by) for process in stopping))
        if late := [process.pid for process, k in zip(stopping, killed, strict=True) if k]:
            log.warning(
                "engine process(es) %s still running at the close's end (%g s before the "
                "planner's %g s to stop are up): killed",
                ", ".join(map(str, late)), _EXIT_MARGIN_S, self._stop_within_s,
            )  # fmt: skip
        await asyncio.gather(*self._stopping)
        await self._admin.close()

    def kill_all(self) -> None:
        """SIGKILL every engine, started, starting or stopping (a second Ctrl-C while the
        planner closes): the close's drain, under way or not begun, is cut; the close then
        takes them out of the controller."""
        self._killed = True
        for process in self._spawned:
            signal_child(process, signal.SIGKILL)
        if self._close_drain is not None:
            self._close_drain.cancel()


def _previous_run(workdir: Path) -> tuple[dict[str, Path], int]:
    """What an earlier planner left in `workdir`: its engines' addresses with their port
    files (each removed when its engine is, so those left are of a planner that was killed,
    or whose RemoveEngine failed),
    and the first engine number none of its files has."""
    left_over: dict[str, Path] = {}
    numbers = [-1]
    for path in workdir.glob("*-*.*"):
        name, _, number = path.stem.rpartition("-")
        if not (name and number.isdigit() and path.suffix in (".port", ".log")):
            continue
        numbers.append(int(number))
        if path.suffix == ".port":
            with contextlib.suppress(ValueError):  # not a port: not an engine's
                if (port := _read_port(path)) is not None:
                    left_over[f"127.0.0.1:{port}"] = path
    return left_over, max(numbers) + 1


def _read_port(path: Path) -> int | None:
    """The port an engine wrote (atomically: a file is there whole or not at all)."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return None


async def _exited(process: asyncio.subprocess.Process, kill_at: float | None = None) -> bool:
    """Until `process` exits after its SIGTERM; killed if it has not within `_STOP_GRACE_S`,
    or by `kill_at` (the event loop's clock) if that comes first. Whether it was killed."""
    deadline = asyncio.get_running_loop().time() + _STOP_GRACE_S
    try:
        async with asyncio.timeout_at(deadline if kill_at is None else min(deadline, kill_at)):
            await process.wait()
    except TimeoutError:
        signal_child(process, signal.SIGKILL)
        await process.wait()
        return True
    return False
