"""`kvplane up`: a whole local fleet as child processes, from YAML or embedded defaults.

Each member is one `kvplane <group> serve` process with its own config (written to a private
temporary folder) listening on a port it picks; a member's config may name another member's
address as `${name}` (e.g. the controller's engine list), filled in once that member is
listening. Members start in file order, each waited for until its health service answers
SERVING; then a live table shows them until Ctrl-C (or SIGTERM), which stops them in reverse
order with SIGTERM, and kills what is still running after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import Field, model_validator

from kvplane.config import StrictModel, load_config
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

MemberKind = Literal["engine", "indexer", "controller", "planner"]
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_.-]+)\}")


class MemberConfig(StrictModel):
    name: str
    kind: MemberKind
    # The member's own config file content (its server's YAML schema); `listen` defaults to
    # 127.0.0.1:0. Strings may refer to earlier members' addresses as ${name}.
    config: dict[str, Any] = Field(default_factory=dict)


class FleetConfig(StrictModel):
    members: list[MemberConfig]
    # Seconds each member gets to become healthy, and to stop after SIGTERM.
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 15.0

    @model_validator(mode="after")
    def _check_names(self) -> FleetConfig:
        seen: set[str] = set()
        for member in self.members:
            if member.name in seen:
                raise ValueError(f"duplicate member name {member.name!r}")
            for ref in _PLACEHOLDER.findall(yaml.safe_dump(member.config)):
                if ref not in seen:
                    raise ValueError(
                        f"member {member.name!r} refers to ${{{ref}}} before it is defined"
                    )
            seen.add(member.name)
        return self


# The embedded defaults (configs/local.yaml spells out the same fleet): three simulated
# engines behind a controller with the embedded in-memory index.
NUM_DEFAULT_ENGINES = 3
DEFAULT_FLEET: dict[str, Any] = {
    "members": [
        *(
            {"name": f"engine-{i}", "kind": "engine", "config": {"model": "sim"}}
            for i in range(NUM_DEFAULT_ENGINES)
        ),
        {
            "name": "controller",
            "kind": "controller",
            "config": {
                "listen": "127.0.0.1:8100",
                "index": {"backend": "memory"},
                "router": {"policy": "kvplane"},
                "engines": [{"address": f"${{engine-{i}}}"} for i in range(NUM_DEFAULT_ENGINES)],
            },
        },
    ]
}


def load_fleet(path: Path | None) -> FleetConfig:
    if path is None:
        return FleetConfig.model_validate(DEFAULT_FLEET)
    return load_config(FleetConfig, path)


@dataclass
class Member:
    config: MemberConfig
    process: asyncio.subprocess.Process | None = None
    address: str | None = None
    state: str = "pending"
    started_at: float = field(default_factory=time.monotonic)


def _substitute(value: Any, addresses: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: addresses[m.group(1)], value)
    if isinstance(value, list):
        return [_substitute(v, addresses) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, addresses) for k, v in value.items()}
    return value


async def _healthy(address: str) -> bool:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class Fleet:
    def __init__(self, config: FleetConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.members = [Member(m) for m in config.members]

    async def start(self) -> None:
        addresses: dict[str, str] = {}
        for member in self.members:
            await self._start_member(member, addresses)
            assert member.address is not None
            addresses[member.config.name] = member.address

    async def _start_member(self, member: Member, addresses: dict[str, str]) -> None:
        name = member.config.name
        config = {"listen": "127.0.0.1:0", **_substitute(member.config.config, addresses)}
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port_file = self.workdir / f"{name}.port"
        verb = "run" if member.config.kind == "planner" else "serve"
        log_path = self.workdir / f"{name}.log"
        command = [
            sys.executable, "-m", "kvplane", member.config.kind, verb,
            "--config", str(config_path), "--port-file", str(port_file),
        ]  # fmt: skip
        member.process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_path.open("wb"),
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us only; we stop children in order.
        )
        member.state = "starting"
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if member.process.returncode is not None:
                member.state = f"exited {member.process.returncode}"
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise KvplaneError(f"{name} exited during start-up: {' | '.join(tail)}")
            if member.address is None and port_file.exists() and port_file.read_text().strip():
                host = str(config["listen"]).rpartition(":")[0] or "127.0.0.1"
                member.address = f"{host}:{port_file.read_text().strip()}"
            if member.address is not None and await _healthy(member.address):
                member.state = "serving"
                log.info("%s serving on %s (log %s)", name, member.address, log_path)
                return
            await asyncio.sleep(0.1)
        raise KvplaneError(f"{name} did not become healthy in {self.config.start_timeout_s}s")

    async def refresh(self) -> None:
        for member in self.members:
            if member.process is None:
                continue
            if member.process.returncode is not None:
                member.state = f"exited {member.process.returncode}"
            elif member.address is not None:
                member.state = "serving" if await _healthy(member.address) else "unhealthy"

    async def stop(self) -> None:
        for member in reversed(self.members):
            process = member.process
            if process is None or process.returncode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.config.stop_timeout_s)
            except TimeoutError:
                log.warning("%s did not stop in time; killing it", member.config.name)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            member.state = f"stopped ({process.returncode})"


def _status_table(fleet: Fleet) -> Any:
    from rich.table import Table

    table = Table(title="kvplane fleet (Ctrl-C stops it)")
    for column in ("member", "kind", "address", "pid", "state"):
        table.add_column(column)
    for m in fleet.members:
        pid = str(m.process.pid) if m.process else "-"
        table.add_row(m.config.name, m.config.kind, m.address or "-", pid, m.state)
    return table


async def run_fleet(config: FleetConfig, live: bool, check: bool = False) -> bool:
    """Run the fleet until Ctrl-C (or, with `check`, through the smoke test); returns whether
    the check passed (always True without one)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with tempfile.TemporaryDirectory(prefix="kvplane-up-") as tmp:
        fleet = Fleet(config, Path(tmp))
        passed = True
        try:
            starting = asyncio.ensure_future(fleet.start())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # raise start-up errors
                if check:
                    passed = await _check(fleet)
                else:
                    await _show_until(fleet, stop, live)
            else:
                starting.cancel()
            stopper.cancel()
        finally:
            await fleet.stop()
            log.info("fleet stopped")
        return passed


async def _check(fleet: Fleet) -> bool:
    from kvplane.up_check import check_fleet

    controllers = [m for m in fleet.members if m.config.kind == "controller"]
    if not controllers or controllers[0].address is None:
        raise KvplaneError("--check needs a controller in the fleet")
    problems = await check_fleet(controllers[0].address)
    for problem in problems:
        log.error("check failed: %s", problem)
    if not problems:
        log.info("check passed: answers complete, repeated prefixes routed to their holders")
    return not problems


async def _show_until(fleet: Fleet, stop: asyncio.Event, live: bool) -> None:
    if not live or not os.isatty(sys.stdout.fileno()):
        for m in fleet.members:
            log.info("fleet member %s (%s) on %s", m.config.name, m.config.kind, m.address)
        await stop.wait()
        return
    from rich.live import Live

    with Live(_status_table(fleet), refresh_per_second=2) as view:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            await fleet.refresh()
            view.update(_status_table(fleet))
