"""The live view of a running fleet: members, engines (health, load, KV usage, cached and
indexed blocks, in flight) and routing (policy, index size, hit ratio, decisions)."""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from controller.registry import poll_failure
from kvplane.channels import ClientChannels
from kvplane.up.fleet import Fleet
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATUS_RPC_TIMEOUT_S = 1.0

_T = TypeVar("_T")


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
    models: tuple[str, ...] = ()  # what it serves, as the controller read it (none without)

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


async def _ask(
    channels: ClientChannels, address: str, call: Callable[[grpc.aio.Channel], Awaitable[_T]]
) -> _T | grpc.aio.AioRpcError:
    """One RPC to `address` with the status deadline: its reply, or how it failed."""
    try:
        async with channels.aio_channel(address) as channel:
            return await call(channel)
    except grpc.aio.AioRpcError as exc:
        return exc


def _answered(reply: _T | grpc.aio.AioRpcError) -> _T | None:
    return None if isinstance(reply, grpc.aio.AioRpcError) else reply


async def collect_status(fleet: Fleet) -> FleetStatus:
    """One status snapshot: the controller's admin view (ListWorkers), each engine's own
    GetLoad (its prefix cache), and the controller's routing counters (Prometheus)."""
    names = {m.address: m.name for m in fleet.members if m.address is not None}
    members = [(m.name, m.kind, m.address or "-", m.pid, m.state) for m in fleet.members]
    controller = next(
        (m for m in fleet.members if m.kind == "controller" and m.address is not None), None
    )
    workers = _answered(
        await _ask(
            fleet.channels,
            controller.address,
            lambda channel: apb_grpc.AdminStub(channel).ListWorkers(
                apb.ListWorkersRequest(), timeout=STATUS_RPC_TIMEOUT_S
            ),
        )
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
    loads = await asyncio.gather(
        *(
            _ask(
                fleet.channels,
                address,
                lambda channel: pb_grpc.OpenEngineStub(channel).GetLoad(
                    pb.GetLoadRequest(), timeout=STATUS_RPC_TIMEOUT_S
                ),
            )
            for address, *_ in rows
        )
    )
    engines = []
    for (address, engine_id, listed_state, worker), answer in zip(rows, loads, strict=True):
        load = _answered(answer)
        state = listed_state
        if worker is None and isinstance(answer, grpc.aio.AioRpcError):
            # No controller to say: the engine's own answer tells a dead engine (unreachable)
            # from one answering with errors (failing), as the controller tells them apart.
            state = poll_failure(answer.code().name).state.value
        source: Any = worker if worker is not None else load
        cached = load.attributes.get("cached_kv_blocks") if load is not None else None
        engines.append(
            EngineStatus(
                name=names.get(address, engine_id),
                address=address,
                state=state,
                running=_opt(source, "running_requests") if source is not None else None,
                queued=_opt(source, "queued_requests") if source is not None else None,
                used_kv_blocks=_opt(source, "used_kv_blocks") if source is not None else None,
                total_kv_blocks=_opt(source, "total_kv_blocks") if source is not None else None,
                cached_blocks=int(cached) if cached else None,
                indexed_blocks=worker.indexed_blocks if worker is not None else None,
                inflight=worker.inflight_requests if worker is not None else None,
                models=tuple(worker.models) if worker is not None else (),
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


def engines_by_model(engines: list[EngineStatus]) -> str:
    """Each model (an engine's default first, as it lists them) with the engines serving it:
    `a: a0, a1; b: b0` (an engine whose models are not known is left out)."""
    serving: dict[str, list[str]] = {}
    for e in engines:
        for model in e.models:
            serving.setdefault(model, []).append(e.name)
    return "; ".join(f"{model}: {', '.join(names)}" for model, names in serving.items())


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def render_status(status: FleetStatus) -> Any:
    """The live view: members, engines, routing (a rich renderable; a fleet without a
    controller has no routing to show)."""
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

    if not any(kind == "controller" for _, kind, *_ in status.members):
        # Nothing routes: no policy, index, hit ratio or decisions to show ("decisions none
        # yet" promised some).
        return Group(
            members,
            engines,
            "routing: none, the fleet has no controller (send requests to an engine's own address)",
        )
    ratio = status.hit_ratio
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(status.decisions.items())) or "none yet"
    routing = Table.grid(padding=(0, 2))
    routing.add_row("policy", status.policy or "-")
    # A fleet of several models: which engines serve which (a models column would not fit
    # the engines table in 80 columns, model names being long).
    if len({e.models for e in status.engines}) > 1:
        routing.add_row("models", engines_by_model(status.engines))
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
