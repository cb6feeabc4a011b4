"""The member processes of a local fleet: each started once the members it names are up (its
config written to the fleet's folder, its port read back from a port file, its health
awaited), then watched, drained and stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.registry import EngineState
from kvplane.channels import ClientChannels
from kvplane.child_signals import signal_child
from kvplane.config import parse_host_port
from kvplane.errors import ConfigError, KvplaneError
from kvplane.process_exit import exit_how, log_tail
from kvplane.server import check_bindable
from kvplane.up.config import FleetConfig, MemberConfig
from kvplane.up.member import cpus_missing, member_environment
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.config import PlannerConfig

log = logging.getLogger(__name__)

_METRICS_LINE = re.compile(r"metrics on http://(\S+)/metrics")
# Each run's private folder is named after its pid, so a later run can tell a dead run's.
WORKDIR_PREFIX = "kvplane-up-"
# How long past the drain's deadline a member's answer is waited for (it aborts what is left,
# then says so); one that has not answered by then is stopped anyway.
DRAIN_REPLY_GRACE_S = 5.0
# The members drained before they stop (they serve requests); the others (an indexer) are
# what those use, stopped after them.
DRAINED_KINDS = ("engine", "controller")


def _member_environment(name: str, cpus: list[int] | None, stop_within_s: float) -> dict[str, str]:
    """The member's environment: ours, and that it dies with us, keeps to `cpus` (if given),
    which it applies itself, and has `stop_within_s` to stop (`kvplane.up.member`)."""
    if cpus is not None and (missing := cpus_missing(cpus)):
        raise KvplaneError(f"{name}: cpus {missing}")
    return {**os.environ, **member_environment(cpus, stop_within_s)}


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the member and whatever it started (it leads its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


@dataclass
class Member:
    config: MemberConfig
    process: asyncio.subprocess.Process | None = None
    address: str | None = None
    metrics_address: str | None = None
    log_path: Path | None = None
    state: str = "pending"
    up: asyncio.Event = field(default_factory=asyncio.Event)
    # Whether how its process ended has been said (an error, or "NAME stopped with ..."):
    # said once, whoever saw it end.
    end_said: bool = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def find_metrics_address(self) -> str | None:
        """Where the member serves /metrics, from its log's start-up line (the port may be
        picked at run time)."""
        if self.metrics_address is None and self.log_path is not None:
            with contextlib.suppress(OSError):
                found = _METRICS_LINE.search(self.log_path.read_text(errors="replace"))
                self.metrics_address = found.group(1) if found else None
        return self.metrics_address


async def _healthy(channels: ClientChannels, address: str) -> bool:
    try:
        async with channels.aio_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def _list_workers(channels: ClientChannels, address: str) -> apb.ListWorkersResponse:
    """The engines of the controller at `address` (its admin API's ListWorkers)."""
    async with channels.aio_channel(address) as channel:
        return await apb_grpc.AdminStub(channel).ListWorkers(apb.ListWorkersRequest(), timeout=1.0)


async def _engines_reached(channels: ClientChannels, address: str) -> bool:
    """Whether the controller at `address` has tried each of its engines once (none is still
    `unknown`). Its health service serves before its first polls end, and until then it has
    no engine to route to: a request sent at once (`--check`'s, an operator's) would fail.
    A controller that will not say (its `protect_reads` wants a token up lacks) is taken as
    it is."""
    try:
        reply = await _list_workers(channels, address)
    except grpc.aio.AioRpcError as exc:
        return exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return all(worker.state != EngineState.UNKNOWN for worker in reply.workers)


async def _registered_engines_routable(
    channels: ClientChannels, address: str, minimum: int
) -> bool:
    """Whether the controller at `address` routes to at least `minimum` engines registered
    through its admin API (`source: admin`, as a planner registers its engines)."""
    try:
        reply = await _list_workers(channels, address)
    except grpc.aio.AioRpcError:
        return False
    registered = [w for w in reply.workers if w.source == "admin" and w.routable]
    return len(registered) >= minimum


def _ready_what(member: Member) -> str:
    """What the member is once ready: "serving on ADDRESS"; one that has not said where it
    listens (its port file) is not "listening" yet."""
    if not member.config.serves:
        return "running with its pools' minimum of engines routed to"
    return "listening" if member.address is None else f"serving on {member.address}"


class Fleet:
    def __init__(self, config: FleetConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.members = [Member(m) for m in config.members]
        self.killed = False  # by `kill_all`: nothing is left to drain
        # Loaded (its files read and checked) before any member starts.
        self.channels = ClientChannels.load(config.client_tls, "client_tls").with_token_file(
            config.client_token_file, "client_token_file"
        )

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def any_started(self) -> bool:
        """Whether any member's process was started: a failed pre-flight (`check_ports`)
        starts none, so there is nothing to stop, nor to say is being stopped."""
        return any(m.process is not None for m in self.members)

    async def start(self) -> None:
        """Start every member as soon as the members it names are up; raise if one fails.
        The ports they are configured to listen on are checked first (`check_ports`)."""
        self.check_ports()
        tasks = [asyncio.ensure_future(self._start_when_ready(member)) for member in self.members]
        try:
            for task in asyncio.as_completed(tasks):
                await task
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def check_ports(self) -> None:
        """The pre-flight: bind and close at once each port a member is configured to listen
        on (not port 0, picked at run time), before any member starts, so that one another
        process holds (another fleet's controller on 127.0.0.1:8100) fails the start in a
        moment, not once the engines started before that member have loaded their models. It
        holds nothing: the member binds the port itself, and one taken in between still fails
        that member's start. An address two members are both given is refused too (each
        would pass alone)."""
        given: dict[tuple[str, int], str] = {}  # (host, port) -> "member (its setting)"
        for member in self.members:
            for setting, listen in member.config.fixed_listen_addresses():
                which = f"{member.name} (its {setting})"
                host, port = parse_host_port(listen)
                if (host, port) in given:
                    raise KvplaneError(
                        f"{given[host, port]} and {which} both listen on {listen}; no member "
                        "was started"
                    )
                given[host, port] = which
                try:
                    check_bindable(listen, host, port)
                except ConfigError as exc:
                    raise KvplaneError(
                        f"{which}: {exc}; no member was started (a kvplane up already "
                        f"running? stop it, or give {member.name} another {setting} in the "
                        "fleet file)"
                    ) from None

    async def _start_when_ready(self, member: Member) -> None:
        refs = member.config.refers_to()
        for ref in sorted(refs):
            await self.member(ref).up.wait()
        addresses = {ref: self.member(ref).address or "" for ref in refs}
        await self._start_member(member, addresses)
        member.up.set()

    async def _start_member(self, member: Member, addresses: dict[str, str]) -> None:
        name = member.name
        config = member.config.server_config(addresses, self.workdir)
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port_file = self.workdir / f"{name}.port"
        log_path = member.log_path = self.workdir / f"{name}.log"
        command = [sys.executable, "-m", "kvplane", *member.config.command(config_path, port_file)]
        ready = self._readiness(member, config)
        env = _member_environment(name, member.config.cpus, self.config.stop_timeout_s)
        with log_path.open("wb") as log_file:
            member.process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us only; we stop children in order.
                env=env,
            )
        member.state = "starting"
        log.info("%s started (pid %d)", name, member.process.pid)
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            self._raise_if_one_exited()
            if member.address is None and port_file.exists() and port_file.read_text().strip():
                host = str(config["listen"]).rpartition(":")[0] or "127.0.0.1"
                member.address = f"{host}:{port_file.read_text().strip()}"
            if await ready():
                member.state = "serving" if member.config.serves else "running"
                member.find_metrics_address()
                log.info("%s %s (log %s)", name, _ready_what(member), log_path)
                return
            await asyncio.sleep(0.1)
        tail = log_tail(log_path)
        log_says = f"its log ends: {tail}" if tail else "its log is empty"
        raise KvplaneError(
            f"{name} did not become ready in {self.config.start_timeout_s}s (not "
            f"{_ready_what(member)}); {log_says}"
        )

    def _raise_if_one_exited(self) -> None:
        """Fail the start if a member started has exited: the one starting, or one already
        up that a member still starting uses (a planner waiting for its controller to route
        to its engines would wait for it until `start_timeout_s`, then be blamed)."""
        for member in self.members:
            if member.process is None or (code := member.process.returncode) is None:
                continue
            member.state = f"exited {code}"
            member.end_said = True  # by the error raised
            assert member.log_path is not None  # set before its process starts
            raise KvplaneError(
                f"{member.name} exited during start-up with {exit_how(code)}: "
                f"{log_tail(member.log_path)}"
            )

    def _readiness(self, member: Member, config: dict[str, Any]) -> Callable[[], Awaitable[bool]]:
        """Whether the member is ready: a server serving (a controller, also past its first
        contact with each engine); a planner once the controller routes to its pools'
        minimum of engines (before that the fleet is smaller than configured, and a request
        sent at once, --check's, may find no engine)."""
        if not member.config.serves:
            planner = PlannerConfig.model_validate(config)  # load_fleet checked it
            assert planner.live is not None  # FleetConfig fills in live.controller
            controller = planner.live.controller
            minimum = sum(pool.min_engines for pool in planner.pools)
            return lambda: _registered_engines_routable(self.channels, controller, minimum)

        async def serving() -> bool:
            if member.address is None or not await _healthy(self.channels, member.address):
                return False
            return member.kind != "controller" or await _engines_reached(
                self.channels, member.address
            )

        return serving

    async def refresh(self) -> None:
        for member in self.members:
            if member.process is None:
                continue
            if member.process.returncode is not None:
                member.state = f"exited {member.process.returncode}"
            elif member.address is not None:
                healthy = await _healthy(self.channels, member.address)
                member.state = "serving" if healthy else "unhealthy"

    def kill_all(self) -> None:
        """SIGKILL every running member (a second Ctrl-C); `stop` then reaps them."""
        self.killed = True
        for member in self.members:
            if member.process is not None and member.process.returncode is None:
                _kill_group(member.process)

    async def first_exit(self) -> Member:
        """The first started member whose process ends. Its caller says how it ended, and
        sets its `end_said`: one cancelled before it could (a stop signal at that moment)
        leaves it to the stop."""
        waits = {
            asyncio.ensure_future(m.process.wait()): m
            for m in self.members
            if m.process is not None
        }
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return waits[done.pop()]

    async def stop(self) -> None:
        """Stop every member: the planners first, then the engines and controllers at once
        (`_drain_and_stop`), each killed if it still runs `stop_timeout_s` after its SIGTERM
        or at one deadline for all, `drain_deadline_s` + `stop_timeout_s` from the drain's
        start (nothing is drained after a second Ctrl-C's kill), whichever comes first; then
        what they use (an indexer), killed `stop_timeout_s` after its SIGTERM. Every engine
        and controller is signalled on its own schedule, so a hung one (answering neither its
        drain nor SIGTERM) holds up no other one's SIGTERM, and their stop lasts at most one
        member's worst case: the drain's deadline, then `stop_timeout_s`; not the wait for its
        drain's answer plus `stop_timeout_s`."""
        await self.stop_planners()
        loop = asyncio.get_running_loop()
        drain_s = 0.0 if self.killed else self.config.drain_deadline_s
        deadline = loop.time() + drain_s + self.config.stop_timeout_s
        drained = [m for m in self.members if m.kind in DRAINED_KINDS]
        await asyncio.gather(*(self._drain_and_stop(m, deadline) for m in drained))
        # Then what they use (an indexer): a controller draining still reads its index.
        used = [m for m in self.members if m.config.serves and m.kind not in DRAINED_KINDS]
        await asyncio.gather(*(self._stop_member(m) for m in used))

    async def stop_planners(self) -> None:
        """Stop the planners first, before the rest is drained: a planner still running would
        replace the engines it sees draining. Each takes its engines out of the controller
        and stops them as it exits (a planner that does not exit in time is killed with its
        process group, its engines too)."""
        planners = [m for m in self.members if not m.config.serves and m.process is not None]
        if planners:
            log.info(
                "stopping %s first (each stops its engines)", ", ".join(m.name for m in planners)
            )
        await asyncio.gather(*(self._stop_member(m) for m in planners))

    def _drainable(self, member: Member) -> bool:
        """An engine or controller serving and still running (killed members are not dialled:
        their processes may not be reaped yet, and each drain would fail)."""
        return (
            not self.killed
            and member.kind in DRAINED_KINDS
            and member.address is not None
            and member.process is not None
            and member.process.returncode is None
        )

    def _drain_wait_s(self) -> float:
        """How long a drain's answer is waited for: its deadline, and `DRAIN_REPLY_GRACE_S`
        for the member to abort what is left and say so."""
        return self.config.drain_deadline_s + DRAIN_REPLY_GRACE_S

    async def _drain_and_stop(self, member: Member, deadline: float) -> None:
        """Drain the member (an engine or controller), then SIGTERM it as soon as its own
        drain has ended (or has not answered by `_drain_wait_s`, or the stop's `deadline`)."""
        if self._drainable(member):
            now = asyncio.get_running_loop().time()
            await self._drain(member, min(deadline, now + self._drain_wait_s()))
        await self._stop_member(member, deadline)

    async def _drain(self, member: Member, answer_by: float) -> None:
        assert member.address is not None
        deadline_s = self.config.drain_deadline_s
        request = pb.DrainRequest(
            stop_accepting_new_requests=True,
            deadline_ms=int(deadline_s * 1000),
            abort_after_deadline=True,
        )
        timeout = max(0.0, answer_by - asyncio.get_running_loop().time())
        try:
            async with self.channels.aio_channel(member.address) as channel:
                stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
                async for reply in stub.Drain(request, timeout=timeout):
                    if reply.state == pb.DRAIN_STATE_COMPLETE:
                        member.state = "drained"
                        log.debug("%s drained", member.name)
                        return
        except grpc.aio.AioRpcError as exc:
            if self.killed:  # during the drain: its failure is the kill's, already announced
                return
            log.warning("%s: drain failed (%s); stopping it anyway", member.name, exc.code().name)

    async def _stop_member(self, member: Member, deadline: float = math.inf) -> None:
        """SIGTERM the member; kill it with its process group if it still runs
        `stop_timeout_s` later, or at the stop's `deadline` (the event loop's clock) if that
        comes first. Then say how it ended, unless that was said already; also when it ended
        before (killed by a second Ctrl-C, or crashed, while its drain was under way)."""
        process = member.process
        if process is None or member.end_said:
            return
        if process.returncode is None:
            signal_child(process, signal.SIGTERM)
            now = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout_at(min(deadline, now + self.config.stop_timeout_s)):
                    await process.wait()
            except TimeoutError:
                log.warning("%s did not stop in time; killing it", member.name)
                _kill_group(process)
        code = await process.wait()
        member.state = f"stopped ({code})"
        member.end_said = True
        log.info("%s stopped with %s", member.name, exit_how(code))


def remove_stale_workdirs(parent: Path) -> list[Path]:
    """Remove the folders (member configs and logs) of earlier `kvplane up` runs that were
    killed (SIGKILL) before they could clean up, or kept for the logs of a failure: those
    whose process is gone. Returns them."""
    removed = []
    for path in parent.glob(f"{WORKDIR_PREFIX}*-*"):
        pid = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except PermissionError:  # alive, someone else's
            pass
    return removed
