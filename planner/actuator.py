"""Actuators: how the live planner's decisions reach the fleet.

`Actuator` is the seam (a Protocol, like Dynamo's planner connectors): start one engine of a
pool and return its address once the controller routes to it; drain one through the
controller (which stops routing to it at once and relays the engine's Drain); stop a drained
one, or kill one that stopped answering. `LocalProcesses` runs `kvplane engine serve` children
on this machine and registers them with the controller's admin API; a Kubernetes actuator
(patching a scale) is not built yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import grpc

from kvplane.channels import INSECURE, ClientChannels
from kvplane.errors import KvplaneError
from kvplane.up.member import member_environment
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc

log = logging.getLogger(__name__)

# How often a starting engine's port file is looked at (the wait itself is bounded).
_PORT_POLL_S = 0.05
_STOP_GRACE_S = 20.0
# The longest an admin call of the reconciliation may take (the tick waits for it).
_ADMIN_TIMEOUT_S = 5.0


class Actuator(Protocol):
    async def start(self, pool: str) -> str:
        """Start one engine of `pool`; its address once the controller has it."""
        ...

    async def sync(self, serving: Sequence[str]) -> list[str]:
        """Register again those of `serving` the controller does not list (it restarted); return
        those it lists as draining (drained by hand, not by the planner)."""
        ...

    def exited(self) -> list[str]:
        """Addresses of started engines that are gone on their own (crashed, killed): not
        stopped through `stop`."""
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

    async def close(self) -> None: ...


class LocalProcesses:
    """`kvplane engine serve ENGINE_ARGS --listen 127.0.0.1:0` children, registered with the
    controller at `controller` (its admin API); their port files and logs go to `workdir`."""

    def __init__(
        self,
        *,
        controller: str,
        engine_args: Sequence[str],
        workdir: Path,
        start_timeout_s: float,
        channels: ClientChannels = INSECURE,
    ) -> None:
        self._engine_args = tuple(engine_args)
        self._workdir = workdir
        self._start_timeout_s = start_timeout_s
        self._channel = channels.aio_channel(controller)
        self._admin = apb_grpc.AdminStub(self._channel)
        self._numbers = itertools.count()
        self._processes: dict[str, asyncio.subprocess.Process] = {}  # by address, serving
        self._spawned: list[asyncio.subprocess.Process] = []  # every child, for `num_alive`
        self._drains: set[asyncio.Task[None]] = set()

    def running(self) -> list[str]:
        """Addresses of the engines started and not stopped yet."""
        return sorted(self._processes)

    async def sync(self, serving: Sequence[str]) -> list[str]:
        if not serving:
            return []
        try:
            listed = await self._admin.ListWorkers(
                apb.ListWorkersRequest(), timeout=_ADMIN_TIMEOUT_S
            )
            states = {worker.address: worker.state for worker in listed.workers}
            for address in serving:
                if address not in states:
                    log.warning(
                        "engine %s is not in the controller (restarted?): registered", address
                    )
                    request = apb.RegisterEngineRequest(address=address)
                    await self._admin.RegisterEngine(request, timeout=_ADMIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("controller: %s", _rpc_error(exc))
            return []
        return [address for address in serving if states.get(address) == "draining"]

    def exited(self) -> list[str]:
        return sorted(a for a, process in self._processes.items() if process.returncode is not None)

    def num_alive(self) -> int:
        """Child processes not reaped yet, registered or not."""
        return sum(1 for process in self._spawned if process.returncode is None)

    async def start(self, pool: str) -> str:
        try:  # no engine (with a real model, minutes of loading) for a controller that is down
            await self._admin.ListWorkers(apb.ListWorkersRequest(), timeout=_ADMIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise KvplaneError(
                f"no engine of {pool} started: controller {_rpc_error(exc)}"
            ) from exc
        number = next(self._numbers)
        port_file = self._workdir / f"{pool}-{number}.port"
        port_file.unlink(missing_ok=True)  # a previous run's, in a reused workdir: a stale port
        with (self._workdir / f"{pool}-{number}.log").open("wb") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvplane", "engine", "serve", *self._engine_args,
                "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                stdout=asyncio.subprocess.DEVNULL, stderr=log_file,
                env={**os.environ, **member_environment(None)},  # it dies with the planner
            )  # fmt: skip
        self._spawned.append(process)
        try:
            address = f"127.0.0.1:{await self._port(port_file, process)}"
            await self._admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        except (KvplaneError, grpc.aio.AioRpcError, TimeoutError) as exc:
            await _terminate(process)
            if isinstance(exc, grpc.aio.AioRpcError):
                why = _rpc_error(exc)
            elif isinstance(exc, TimeoutError):  # its str is empty
                why = f"no port after start_timeout_s ({self._start_timeout_s:g} s)"
            else:
                why = str(exc)
            raise KvplaneError(f"engine {pool}-{number} did not start: {why}") from exc
        except asyncio.CancelledError:  # the planner is closing: leave no child behind
            await _terminate(process)
            raise
        self._processes[address] = process
        return address

    async def _port(self, port_file: Path, process: asyncio.subprocess.Process) -> int:
        async with asyncio.timeout(self._start_timeout_s):
            while True:
                if process.returncode is not None:
                    raise KvplaneError(f"exited with {process.returncode}")
                port = _read_port(port_file)
                if port is not None:
                    return port
                await asyncio.sleep(_PORT_POLL_S)

    async def drain(self, address: str, within_s: float) -> None:
        request = apb.DrainEngineRequest(
            engine=address, deadline_ms=max(0, int(within_s * 1000)), abort_after_deadline=True
        )
        task = asyncio.create_task(self._follow_drain(request))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _follow_drain(self, request: apb.DrainEngineRequest) -> None:
        try:
            async for event in self._admin.DrainEngine(request):
                log.debug("drain %s: %s", request.engine, event.message or event.state)
        except grpc.aio.AioRpcError as exc:
            log.warning("drain of %s: %s", request.engine, exc.details() or exc.code().name)

    async def stop(self, address: str) -> None:
        process = await self._forget(address)
        if process is not None:
            await _terminate(process)

    async def kill(self, address: str) -> None:
        # SIGKILL: a hung process may never handle SIGTERM (a SIGSTOPped one holds it pending).
        process = await self._forget(address)
        if process is not None:
            if process.returncode is None:
                process.kill()
            await process.wait()

    async def _forget(self, address: str) -> asyncio.subprocess.Process | None:
        """Take `address` out of the controller and of the engines started; its process."""
        with contextlib.suppress(grpc.aio.AioRpcError):  # already gone from the controller
            await self._admin.RemoveEngine(apb.EngineRef(engine=address), timeout=_ADMIN_TIMEOUT_S)
        return self._processes.pop(address, None)

    async def close(self) -> None:
        for task in list(self._drains):
            task.cancel()
        for address in list(self._processes):
            await self.stop(address)
        await self._channel.close()


def _rpc_error(exc: grpc.aio.AioRpcError) -> str:
    """One line (an AioRpcError's str is several, with a debug string)."""
    return f"{exc.code().name}: {exc.details()}" if exc.details() else exc.code().name


def _read_port(path: Path) -> int | None:
    """The port an engine wrote (atomically: a file is there whole or not at all)."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return None


async def _terminate(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), _STOP_GRACE_S)
    except TimeoutError:
        process.kill()
        await process.wait()
