"""`kvplane up`: a whole local fleet as child processes, from YAML or embedded defaults.

Each member is one `kvplane <group> serve` process with its own config (written to a private
temporary folder) listening on a port it picks; a member's config may name another member's
address as `${name}`, filled in once that member is listening. A member starts as soon as the
members it names are healthy (the engines all at once, then the controller) and is waited for
until its health service answers SERVING. Every channel up opens to a member (readiness, the
live status, the drain, the check) is insecure, or TLS per the fleet's `client_tls`. A
controller's `tokenizer: builtin` names the builtin model's tokenizer, and a controller
without `metrics_listen` gets one on a free port (the live status reads its routing counters
there). Then every address is printed and a live
status (engines' health, load, KV usage, cached and indexed blocks; the index size; the
routing hit ratio and decisions) is refreshed every second until Ctrl-C (or SIGTERM), which
drains the engines (a short deadline, then what is left is aborted), stops every member in
reverse order with SIGTERM, and kills what is still running (with its process group) after a
grace period. A member that exits on its own is reported (its log's last lines) and the rest
are stopped the same way: up then exits 1. On Linux the members get SIGTERM when up dies, even
by SIGKILL; the folder such a run leaves behind is removed by the next `kvplane up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import Field, field_validator, model_validator

from kvplane.channels import ClientChannels
from kvplane.config import ClientTlsConfig, StrictModel, load_config
from kvplane.errors import KvplaneError
from kvplane.fleet_member import member_environment
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The planner is not a member kind yet: `kvplane planner run` is not implemented.
MemberKind = Literal["engine", "indexer", "controller"]
# A member's name is a file name in the fleet's folder and is referred to as ${name}.
_NAME = r"[A-Za-z0-9_.-]+"
_PLACEHOLDER = re.compile(rf"\$\{{({_NAME})\}}")
_METRICS_LINE = re.compile(r"metrics on http://(\S+)/metrics")
BUILTIN = "builtin"
STATUS_INTERVAL_S = 1.0
STATUS_RPC_TIMEOUT_S = 1.0
# Each run's private folder is named after its pid, so a later run can tell a dead run's.
WORKDIR_PREFIX = "kvplane-up-"


class MemberConfig(StrictModel):
    name: str  # letters, digits, '_', '.', '-' (not '.' or '..')
    kind: MemberKind
    # The member's own config file content (its server's YAML schema); `listen` defaults to
    # 127.0.0.1:0. Strings may refer to earlier members' addresses as ${name}.
    config: dict[str, Any] = Field(default_factory=dict)
    # The CPUs the member's process may run on (Linux CPU affinity), e.g. one core per
    # engine; unset: every CPU this process may use.
    cpus: list[int] | None = Field(default=None, min_length=1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not re.fullmatch(_NAME, value) or value in (".", ".."):
            raise ValueError(
                f"{value!r} is not a member name: use letters, digits, '_', '.' and '-'"
            )
        return value

    def refers_to(self) -> set[str]:
        return set(_PLACEHOLDER.findall(yaml.safe_dump(self.config)))


class FleetConfig(StrictModel):
    members: list[MemberConfig] = Field(min_length=1)
    # Seconds each member gets to become healthy, and to stop after SIGTERM.
    start_timeout_s: float = Field(default=120.0, gt=0)
    stop_timeout_s: float = Field(default=15.0, gt=0)
    # On Ctrl-C engines finish what they run for this long; what is left is then aborted.
    drain_deadline_s: float = Field(default=3.0, ge=0)
    # How up dials its members (readiness, status, drain, --check): members serving `tls:`
    # need it; unset: insecure.
    client_tls: ClientTlsConfig | None = None

    @model_validator(mode="after")
    def _check_names(self) -> FleetConfig:
        seen: set[str] = set()
        for member in self.members:
            if member.name in seen:
                raise ValueError(f"duplicate member name {member.name!r}")
            for ref in sorted(member.refers_to()):
                if ref not in seen:
                    raise ValueError(
                        f"member {member.name!r} refers to ${{{ref}}} before it is defined"
                    )
            seen.add(member.name)
        return self


# The embedded defaults (configs/local.yaml spells out the same fleet): three engines serving
# the builtin model (a tiny random Llama built on first use, see
# engine.torch_runner.builtin_model) behind a controller with the embedded in-memory index.
NUM_DEFAULT_ENGINES = 3
DEFAULT_FLEET: dict[str, Any] = {
    "members": [
        *(
            {
                "name": f"engine-{i}",
                "kind": "engine",
                "config": {"model": BUILTIN, "num_threads": 1},
            }
            for i in range(NUM_DEFAULT_ENGINES)
        ),
        {
            "name": "controller",
            "kind": "controller",
            "config": {
                "listen": "127.0.0.1:8100",
                "index": {"backend": "memory"},
                "router": {"policy": "kvplane"},
                "tokenizer": BUILTIN,
                "engines": [{"address": f"${{engine-{i}}}"} for i in range(NUM_DEFAULT_ENGINES)],
            },
        },
    ]
}


def _member_environment(name: str, cpus: list[int] | None) -> dict[str, str]:
    """The member's environment: ours, and that it dies with us and keeps to `cpus` (if
    given), which it applies itself (`kvplane.fleet_member`)."""
    if cpus is not None:
        available = os.sched_getaffinity(0)
        missing = sorted(set(cpus) - available)
        if missing:
            raise KvplaneError(
                f"{name}: cpus {missing} are not among this process's CPUs {sorted(available)}"
            )
    return {**os.environ, **member_environment(cpus)}


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the member and whatever it started (it leads its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a member's log, on one line."""
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


def load_fleet(path: Path | None) -> FleetConfig:
    if path is None:
        return FleetConfig.model_validate(DEFAULT_FLEET)
    return load_config(FleetConfig, path)


@dataclass
class Member:
    config: MemberConfig
    process: asyncio.subprocess.Process | None = None
    address: str | None = None
    metrics_address: str | None = None
    log_path: Path | None = None
    state: str = "pending"
    started_at: float = field(default_factory=time.monotonic)
    up: asyncio.Event = field(default_factory=asyncio.Event)

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


def _substitute(value: Any, addresses: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: addresses[m.group(1)], value)
    if isinstance(value, list):
        return [_substitute(v, addresses) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, addresses) for k, v in value.items()}
    return value


async def _healthy(channels: ClientChannels, address: str) -> bool:
    try:
        async with channels.aio_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def _builtin_tokenizer() -> str:
    from engine.torch_runner.builtin_model import ensure_builtin_model  # torch-free

    model_dir = await asyncio.to_thread(ensure_builtin_model)
    return str(model_dir / "tokenizer.json")


class Fleet:
    def __init__(self, config: FleetConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.members = [Member(m) for m in config.members]
        # Loaded (its files read and checked) before any member starts.
        self.channels = ClientChannels.load(config.client_tls, "client_tls")

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    async def start(self) -> None:
        """Start every member as soon as the members it names are up; raise if one fails."""
        tasks = [asyncio.ensure_future(self._start_when_ready(member)) for member in self.members]
        try:
            for task in asyncio.as_completed(tasks):
                await task
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _start_when_ready(self, member: Member) -> None:
        refs = member.config.refers_to()
        for ref in sorted(refs):
            await self.member(ref).up.wait()
        addresses = {ref: self.member(ref).address or "" for ref in refs}
        await self._start_member(member, addresses)
        member.up.set()

    async def _start_member(self, member: Member, addresses: dict[str, str]) -> None:
        name = member.name
        config = {"listen": "127.0.0.1:0", **_substitute(member.config.config, addresses)}
        if member.kind == "controller":
            config.setdefault("metrics_listen", "127.0.0.1:0")
            if config.get("tokenizer") == BUILTIN:
                config["tokenizer"] = await _builtin_tokenizer()
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port_file = self.workdir / f"{name}.port"
        log_path = member.log_path = self.workdir / f"{name}.log"
        command = [
            sys.executable, "-m", "kvplane", member.kind, "serve",
            "--config", str(config_path), "--port-file", str(port_file),
        ]  # fmt: skip
        env = _member_environment(name, member.config.cpus)
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
            if member.process.returncode is not None:
                member.state = f"exited {member.process.returncode}"
                how = _exit_how(member.process.returncode)
                tail = _log_tail(log_path)
                raise KvplaneError(f"{name} exited during start-up with {how}: {tail}")
            if member.address is None and port_file.exists() and port_file.read_text().strip():
                host = str(config["listen"]).rpartition(":")[0] or "127.0.0.1"
                member.address = f"{host}:{port_file.read_text().strip()}"
            if member.address is not None and await _healthy(self.channels, member.address):
                member.state = "serving"
                member.find_metrics_address()
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
                healthy = await _healthy(self.channels, member.address)
                member.state = "serving" if healthy else "unhealthy"

    def kill_all(self) -> None:
        """SIGKILL every running member (a second Ctrl-C); `stop` then reaps them."""
        for member in self.members:
            if member.process is not None and member.process.returncode is None:
                _kill_group(member.process)

    async def first_exit(self) -> Member:
        """The first started member whose process ends."""
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

    async def drain_engines(self) -> None:
        """Drain every running engine at once: in-flight requests get the drain deadline,
        then the rest are aborted. Errors are logged, never raised (stopping goes on)."""
        engines = [
            m
            for m in self.members
            if m.kind == "engine"
            and m.address is not None
            and m.process is not None
            and m.process.returncode is None
        ]
        if engines:
            await asyncio.gather(*(self._drain(m) for m in engines))

    async def _drain(self, member: Member) -> None:
        assert member.address is not None
        deadline_s = self.config.drain_deadline_s
        request = pb.DrainRequest(
            stop_accepting_new_requests=True,
            deadline_ms=int(deadline_s * 1000),
            abort_after_deadline=True,
        )
        try:
            async with self.channels.aio_channel(member.address) as channel:
                stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
                async for reply in stub.Drain(request, timeout=deadline_s + 5.0):
                    if reply.state == pb.DRAIN_STATE_COMPLETE:
                        member.state = "drained"
                        log.debug("%s drained", member.name)
                        return
        except grpc.aio.AioRpcError as exc:
            log.warning("%s: drain failed (%s); stopping it anyway", member.name, exc.code().name)

    def _depths(self) -> dict[str, int]:
        """How far each member is from the members that name no one (0): the start order."""
        depths: dict[str, int] = {}
        for member in self.members:  # a member names only earlier members
            refs = member.config.refers_to()
            depths[member.name] = 1 + max((depths[r] for r in refs), default=-1)
        return depths

    async def stop(self) -> None:
        """SIGTERM members in reverse start order (those that name others first), each
        level at once; kill what is still running after `stop_timeout_s`."""
        depths = self._depths()
        for depth in sorted(set(depths.values()), reverse=True):
            level = [m for m in self.members if depths[m.name] == depth]
            await asyncio.gather(*(self._stop_member(m) for m in level))

    async def _stop_member(self, member: Member) -> None:
        process = member.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.config.stop_timeout_s)
        except TimeoutError:
            log.warning("%s did not stop in time; killing it", member.name)
            _kill_group(process)
            await process.wait()
        member.state = f"stopped ({process.returncode})"
        log.debug("%s stopped (%s)", member.name, process.returncode)


# ---- live status ----


@dataclass(frozen=True, slots=True)
class EngineStatus:
    name: str  # the fleet member's name, else the engine's instance id
    address: str
    state: str  # the controller's view (ready, draining, ...), else the engine's health
    running: int | None = None
    queued: int | None = None
    used_kv_blocks: int | None = None
    total_kv_blocks: int | None = None
    cached_blocks: int | None = None  # the engine's prefix cache (GetLoad)
    indexed_blocks: int | None = None  # what the controller's index places on it
    inflight: int | None = None  # the router's own count

    @property
    def kv_usage(self) -> float | None:
        if self.used_kv_blocks is None or not self.total_kv_blocks:
            return None
        return self.used_kv_blocks / self.total_kv_blocks


@dataclass(frozen=True, slots=True)
class FleetStatus:
    members: list[tuple[str, str, str, int | None, str]]  # name, kind, address, pid, state
    engines: list[EngineStatus]
    policy: str = ""
    index_blocks: int | None = None
    decisions: dict[str, int] = field(default_factory=dict)  # by reason
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0  # engine-reported, of routed requests
    predicted_cached_tokens: float = 0.0

    @property
    def hit_ratio(self) -> float | None:
        """Prompt tokens served from cache / all prompt tokens, over routed requests."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def _scrape(address: str) -> dict[str, Any]:
    """The controller's routing counters from its Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=STATUS_RPC_TIMEOUT_S) as reply:
        text = reply.read().decode()
    decisions: dict[str, int] = {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvplane_controller_route_decisions_total":
                reason = sample.labels.get("reason", "?")
                decisions[reason] = decisions.get(reason, 0) + int(sample.value)
            elif sample.name.endswith("_total"):
                totals[sample.name.removeprefix("kvplane_controller_")] = sample.value
    return {
        "decisions": decisions,
        "prompt_tokens": totals.get("prompt_tokens_total", 0.0),
        "cached_tokens": totals.get("actual_cached_tokens_total", 0.0),
        "predicted_cached_tokens": totals.get("predicted_cached_tokens_total", 0.0),
    }


def _opt(message: Any, name: str) -> int | None:
    return int(getattr(message, name)) if message.HasField(name) else None


async def _engine_load(channels: ClientChannels, address: str) -> pb.LoadInfo | None:
    try:
        async with channels.aio_channel(address) as channel:
            stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
            return await stub.GetLoad(pb.GetLoadRequest(), timeout=STATUS_RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None


async def _workers(channels: ClientChannels, address: str) -> apb.ListWorkersResponse | None:
    try:
        async with channels.aio_channel(address) as channel:
            stub: apb_grpc.AdminAsyncStub = apb_grpc.AdminStub(channel)
            return await stub.ListWorkers(apb.ListWorkersRequest(), timeout=STATUS_RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None


async def collect_status(fleet: Fleet) -> FleetStatus:
    """One status snapshot: the controller's admin view (ListWorkers), each engine's own
    GetLoad (its prefix cache), and the controller's routing counters (Prometheus)."""
    names = {m.address: m.name for m in fleet.members if m.address is not None}
    members = [(m.name, m.kind, m.address or "-", m.pid, m.state) for m in fleet.members]
    controller = next(
        (m for m in fleet.members if m.kind == "controller" and m.address is not None), None
    )
    workers = (
        await _workers(fleet.channels, controller.address)
        if controller and controller.address
        else None
    )
    rows: list[tuple[str, str, str, apb.WorkerInfo | None]]
    if workers is not None:
        rows = [
            (w.address, w.instance_id, w.state + (" cordoned" if w.cordoned else ""), w)
            for w in workers.workers
        ]
    else:  # no controller: the engine members themselves
        rows = [
            (m.address, m.name, m.state, None)
            for m in fleet.members
            if m.kind == "engine" and m.address is not None
        ]
    loads = await asyncio.gather(*(_engine_load(fleet.channels, address) for address, *_ in rows))
    engines = []
    for (address, engine_id, state, worker), load in zip(rows, loads, strict=True):
        source: Any = worker if worker is not None else load
        cached = load.attributes.get("cached_kv_blocks") if load is not None else None
        engines.append(
            EngineStatus(
                name=names.get(address, engine_id),
                address=address,
                state=state if load is not None or worker is not None else "unreachable",
                running=_opt(source, "running_requests") if source is not None else None,
                queued=_opt(source, "queued_requests") if source is not None else None,
                used_kv_blocks=_opt(source, "used_kv_blocks") if source is not None else None,
                total_kv_blocks=_opt(source, "total_kv_blocks") if source is not None else None,
                cached_blocks=int(cached) if cached else None,
                indexed_blocks=worker.indexed_blocks if worker is not None else None,
                inflight=worker.inflight_requests if worker is not None else None,
            )
        )
    order = {m.address: i for i, m in enumerate(fleet.members)}
    engines.sort(key=lambda e: (order.get(e.address, len(order)), e.name))
    routing: dict[str, Any] = {}
    metrics = controller.find_metrics_address() if controller is not None else None
    if controller is not None and metrics is not None:
        try:
            routing = await asyncio.to_thread(_scrape, metrics)
        except OSError as exc:
            log.debug("metrics of %s: %s", controller.name, exc)
    return FleetStatus(
        members=members,
        engines=engines,
        policy=workers.policy if workers is not None else "",
        index_blocks=workers.index_blocks if workers is not None else None,
        **routing,
    )


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def render_status(status: FleetStatus) -> Any:
    """The live view: members, engines, routing (a rich renderable)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    members = Table(title="kvplane fleet (Ctrl-C drains and stops it)", title_justify="left")
    for column in ("member", "kind", "address", "pid", "state"):
        members.add_column(column)
    for name, kind, address, pid, state in status.members:
        members.add_row(name, kind, address, _text(pid), state)

    # Fits an 80-column terminal: the addresses are in the members table above.
    engines = Table(
        title="engines", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False
    )
    engines.add_column("engine", no_wrap=True)
    engines.add_column("health", min_width=len("unreachable"))
    for column in ("run", "queue", "kv used", "cached", "indexed", "in flight"):
        engines.add_column(column, justify="right", no_wrap=True, min_width=len(column))
    for e in status.engines:
        usage = e.kv_usage
        kv = "-" if usage is None else f"{usage:.0%}"
        engines.add_row(
            e.name,
            e.state,
            _text(e.running),
            _text(e.queued),
            kv,
            _text(e.cached_blocks),
            _text(e.indexed_blocks),
            _text(e.inflight),
        )
    caption = "run/queue: its requests running and queued; kv used: of its KV blocks; cached: "
    engines.caption = caption + "blocks in its prefix cache; indexed: in the controller's index"
    engines.caption_justify = "left"

    ratio = status.hit_ratio
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(status.decisions.items())) or "none yet"
    routing = Table.grid(padding=(0, 2))
    routing.add_row("policy", status.policy or "-")
    routing.add_row("index", f"{_text(status.index_blocks)} blocks")
    routing.add_row(
        "hit ratio",
        "-"
        if ratio is None
        else f"{ratio:.1%} ({int(status.cached_tokens)} of {int(status.prompt_tokens)} "
        f"prompt tokens from cache; {int(status.predicted_cached_tokens)} predicted)",
    )
    routing.add_row("decisions", decisions)
    return Group(members, engines, routing)


# ---- the command ----


def remove_stale_workdirs(parent: Path) -> list[Path]:
    """Remove the folders (member configs and logs) of earlier `kvplane up` runs that were
    killed (SIGKILL) before they could clean up: those whose process is gone. Returns them."""
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


async def run_fleet(config: FleetConfig, live: bool, check: bool = False) -> bool:
    """Run the fleet until Ctrl-C (or, with `check`, through the smoke test); returns False
    when the check failed or a member exited on its own (the rest are then stopped: a local
    fleet missing a member is broken). A second Ctrl-C kills every member at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    remove_stale_workdirs(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as tmp:
        fleet = Fleet(config, Path(tmp))

        def on_signal() -> None:
            if stop.is_set():
                log.warning("interrupted again: killing every member now")
                fleet.kill_all()
            stop.set()

        # SIGHUP too: the members run in sessions of their own, so a closed terminal reaches
        # only us, and we must stop them.
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        for sig in signals:
            loop.add_signal_handler(sig, on_signal)
        main = asyncio.ensure_future(_main(fleet, stop, live, check))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([main, stopper], return_when=asyncio.FIRST_COMPLETED)
            if not main.done():  # interrupted during start-up or the check
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await main
                return not check
            return main.result()
        finally:
            stopper.cancel()
            log.info("stopping the fleet: draining engines, then stopping every member")
            await fleet.drain_engines()
            await fleet.stop()
            log.info("fleet stopped")
            for sig in signals:
                loop.remove_signal_handler(sig)


async def _main(fleet: Fleet, stop: asyncio.Event, live: bool, check: bool) -> bool:
    await fleet.start()
    _announce(fleet)
    serving = asyncio.ensure_future(_serve(fleet, stop, live, check))
    exited = asyncio.ensure_future(fleet.first_exit())
    try:
        await asyncio.wait([serving, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (serving, exited):
            task.cancel()
        await asyncio.gather(serving, exited, return_exceptions=True)
    if exited.done() and not exited.cancelled():
        _report_exit(exited.result())
        return False
    return serving.result()


async def _serve(fleet: Fleet, stop: asyncio.Event, live: bool, check: bool) -> bool:
    """Run the check (whether it passed), or show the fleet until stopped (True)."""
    if check:
        return await _check(fleet)
    await _show_until(fleet, stop, live)
    return True


def _exit_how(code: int) -> str:
    """A member's exit status in words: "code 1", "code -9 (SIGKILL)"."""
    how = f"code {code}"
    if code < 0:  # killed by a signal
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-code).name})"
    return how


def _report_exit(member: Member) -> None:
    process, log_path = member.process, member.log_path
    assert process is not None and process.returncode is not None and log_path is not None
    log.error(
        "%s exited unexpectedly with %s; its log %s ends: %s",
        member.name, _exit_how(process.returncode), log_path, _log_tail(log_path),
    )  # fmt: skip


def _announce(fleet: Fleet) -> None:
    for m in fleet.members:
        log.info("fleet member %s (%s) on %s pid %s", m.name, m.kind, m.address, m.pid)
        if m.metrics_address is not None:
            log.info("fleet member %s metrics on http://%s/metrics", m.name, m.metrics_address)


async def _check(fleet: Fleet) -> bool:
    from kvplane.up_check import check_fleet

    controllers = [m for m in fleet.members if m.kind == "controller"]
    if not controllers or controllers[0].address is None:
        raise KvplaneError("--check needs a controller in the fleet")
    problems = await check_fleet(controllers[0].address, fleet.channels)
    for problem in problems:
        log.error("check failed: %s", problem)
    if not problems:
        log.info(
            "check passed: answers complete and the same from cache, repeated prefixes routed"
            " to their holders"
        )
    return not problems


def admin_tls_flags(tls: ClientTlsConfig | None) -> str:
    """The `kvplane admin` options that dial the fleet as up does (" --tls-ca F ...")."""
    if tls is None:
        return ""
    flags = [
        ("--tls-ca", tls.ca_file),
        ("--tls-cert", tls.cert_file),
        ("--tls-key", tls.key_file),
        ("--tls-server-name", tls.server_name),
    ]
    return "".join(f" {flag} {value}" for flag, value in flags if value is not None)


async def _show_until(fleet: Fleet, stop: asyncio.Event, live: bool) -> None:
    if not live or not os.isatty(sys.stdout.fileno()):
        await stop.wait()
        return
    from rich.console import Console
    from rich.live import Live

    console = Console()
    for m in fleet.members:
        if m.kind == "controller":
            console.print(
                f"controller on {m.address}: send OpenEngine requests there; "
                f"`kvplane admin --target {m.address}{admin_tls_flags(fleet.config.client_tls)}"
                " workers` shows the fleet",
                highlight=False,
            )
    with Live(render_status(await collect_status(fleet)), console=console) as view:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STATUS_INTERVAL_S)
            await fleet.refresh()
            view.update(render_status(await collect_status(fleet)))
