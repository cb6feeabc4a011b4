"""A seeded fault soak of a planner-run, disaggregated fleet: one `kvplane controller serve`
(memory index, `skip_prefill_ratio`), and a `kvplane planner run` (local process actuator)
keeping two pools of sim engines, prefill and decode (`pools[].engine_args: [--role, ...]`),
within small bounds on a short tick; a client whose rate changes from cycle to cycle (bursts,
quiet spells), so the planner scales up and down; faults drawn from the seed.

The faults: `kill -9` an engine the planner started (it must replace it), `kill -9` the
controller and start it again (the planner registers its engines again), `SIGSTOP` an engine
for a few seconds (hung: the planner loses it after `lost_after_failed_polls`), `kill -9` a
prefill engine while it holds requests (at the handoff), `DrainEngine` one by hand through the
admin API (the planner replaces it and removes it once drained).

After each fault the fleet must converge (tests/soak_fleet.py, `SeededSoak.settle`):

- the controller's engines are exactly the planner's engines running: every child process of
  the planner alive serves and is listed, none listed that is not a live child;
- each pool holds between its min and max engines, all of its role, every one routable;
- the controller's index places on each engine as many blocks as it holds;

and throughout, every completed request carried the reference engine's tokens, a request
failed only in a fault window and then retryably; at the end (the planner stopped with
SIGTERM: it drains and stops its children) no process is left. `drive(PlannerSoak(workdir,
seed), seconds=...)` returns a `SoakReport`; `docs/benchmarks/soak.py --fleet planner` runs it
from the command line, tests/controller/test_soak.py a short one in CI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.start_backoff import CRASH_WITHIN_S
from tests.redis_servers import restartable_port
from tests.soak_fleet import (
    KVPLANE,
    SETTLE_TIMEOUT_S,
    GatewaySoak,
    Process,
    SoakFailure,
    controller_workers,
    engine_keys,
)

TICK_S = 0.5
LOST_AFTER_FAILED_POLLS = 3
# pool -> (role, min engines, max engines)
POOLS = {"prefill": ("prefill", 1, 2), "decode": ("decode", 2, 3)}
ENGINE_CONFIG = "model: sim\nnum_kv_blocks: 64\n"
# How long an engine is routed to before a fault may take it: the soak's faults are an outside
# kill, a hang, a drain of an engine that served; an engine lost within the planner's
# `live.start_backoff_crash_s` of serving is a crash loop to it (planner/start_backoff.py), and
# a few in a row back its pool's starts off for 10, 20, 40 s, past what a fault's convergence
# bound and a short CI soak allow (the back-off has tests of its own).
SERVED_BEFORE_A_FAULT_S = CRASH_WITHIN_S + 1.0
# The prefill engines' `kv_transfer.session_ttl_s` (see `_planner_config`).
SESSION_TTL_S = 20
# The client's rate, times the run's --rate, drawn for each cycle.
RATES = {"quiet": 0.25, "steady": 1.0, "burst": 4.0}


@dataclass(frozen=True)
class Child:
    """An engine process the planner started."""

    pid: int
    pool: str
    address: str | None  # None until it wrote its port file


class PlannerSoak(GatewaySoak):
    """A controller and a planner running prefill and decode pools of local sim engines."""

    FAULTS = (
        "engine_kill",
        "controller_restart",
        "engine_pause",
        "prefill_kill_at_handoff",
        "drain_by_hand",
    )

    def __init__(self, workdir: Path, seed: int) -> None:
        super().__init__(workdir, seed)
        self.controller_port = restartable_port()
        self.controller = self._serve("controller", "controller", self._controller_config())
        self.engines_dir = workdir / "planner-engines"
        self.engines_dir.mkdir(exist_ok=True)
        config = workdir / "planner.yaml"
        config.write_text(self._planner_config())
        self.planner = Process(
            "planner", [*KVPLANE, "planner", "run", "--config", str(config)], workdir
        )
        # When this soak first saw each child routable (its pid: `_serving_child`).
        self._routable_since: dict[int, float] = {}

    def _controller_config(self) -> str:
        return (
            f"listen: 127.0.0.1:{self.controller_port}\n"
            "index: {backend: memory}\n"
            "router: {policy: kvplane, skip_prefill_ratio: 0.9}\n"
            "health: {poll_interval_s: 0.3, load_poll_interval_s: 0.3, backoff_initial_s: 0.1, "
            "backoff_max_s: 1.0}\n"
        )

    def _planner_config(self) -> str:
        engine = self.workdir / "planner-engine.yaml"
        engine.write_text(f"{ENGINE_CONFIG}sim: {{time_scale: 0.2}}\n")
        # Prefills of about 80 ms (the sim's default is 3 ms at this time scale): long enough
        # for a kill to land while the engine holds requests. Sessions prefilled for a gateway
        # killed before their decode half pulled them are held to their TTL, and a drain waits
        # for them (docs/soak.md): 20 s, not the default 60 s, keeps such a drain inside a
        # fault's convergence bound.
        slow = self.workdir / "planner-prefill-engine.yaml"
        slow.write_text(
            f"{ENGINE_CONFIG}sim: {{time_scale: 0.2, prefill_ms_coeffs: [0, 2, 300]}}\n"
            f"kv_transfer: {{session_ttl_s: {SESSION_TTL_S}}}\n"
        )
        pool_args = {"prefill": f"--config, '{slow}', "}
        pools = "".join(
            f"  - {{name: {name}, min_engines: {low}, max_engines: {high}, "
            f"engine_args: [{pool_args.get(name, '')}--role, {role}]}}\n"
            for name, (role, low, high) in POOLS.items()
        )
        return (
            "sla: {ttft_ms: 200, itl_ms: 10}\n"
            f"pools:\n{pools}"
            f"scaling: {{tick_s: {TICK_S}, scale_up_cooldown_s: 1, scale_down_cooldown_s: 3, "
            "scale_down_stabilisation_s: 6, drain_deadline_s: 5}\n"
            "capacity: {forecast_horizon_s: 2, half_life_s: 20}\n"
            "live:\n"
            f"  controller: 127.0.0.1:{self.controller_port}\n"
            f"  engine_args: [--config, '{engine}']\n"
            f"  workdir: '{self.engines_dir}'\n"
            "  start_timeout_s: 60\n"
            "  load_timeout_s: 0.5\n"
            f"  lost_after_failed_polls: {LOST_AFTER_FAILED_POLLS}\n"
        )

    @property
    def controller_target(self) -> str:
        return f"127.0.0.1:{self.controller_port}"

    def gateways(self) -> list[str]:
        return [self.controller_target]

    def traffic_rate(self, rate_per_s: float) -> float:
        phase = self.rng.choice(sorted(RATES))
        print(f"  traffic {phase}", flush=True)
        return rate_per_s * RATES[phase]

    # -- processes ---------------------------------------------------------------------------

    async def start(self) -> None:
        for process in (self.reference.process, self.controller):
            process.start()
        for process in (self.reference.process, self.controller):
            await process.started()
        self.planner.start()

    def stop(self) -> None:
        self.planner.stop()  # SIGTERM: it drains and stops its engines
        self.controller.stop()
        self.reference.process.stop()

    def children(self) -> list[Child]:
        """The planner's engine processes alive (not exited, not a zombie)."""
        proc = self.planner.proc
        if proc is None:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[1]) != proc.pid or stat[0] in "ZX":
                continue
            args = [a.decode() for a in cmdline]
            if "--port-file" not in args:
                continue
            port_file = Path(args[args.index("--port-file") + 1])
            pool = port_file.name.rsplit("-", 1)[0]
            try:
                address: str | None = f"127.0.0.1:{int(port_file.read_text())}"
            except (OSError, ValueError):
                address = None
            found.append(Child(int(entry.name), pool, address))
        return found

    async def _serving_child(self, pool: str | None = None) -> Child:
        """A child of `pool` (None: any) drawn at random among those the controller has routed
        to for SERVED_BEFORE_A_FAULT_S as seen here (not one the planner is starting, draining
        or stopping); waits for one (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT_S
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                routable = {
                    w.address
                    for w in await controller_workers(self.controller_target)
                    if w.routable
                }
                now = loop.time()
                children = [c for c in self.children() if c.address in routable]
                since = {c.pid: self._routable_since.get(c.pid, now) for c in children}
                self._routable_since = since
                serving = [
                    c
                    for c in children
                    if now - since[c.pid] >= SERVED_BEFORE_A_FAULT_S and pool in (None, c.pool)
                ]
                if serving:
                    return self.rng.choice(sorted(serving, key=lambda c: c.pid))
            if loop.time() > deadline:
                raise SoakFailure(f"no engine of {pool or 'any pool'} routable")
            await asyncio.sleep(0.1)

    # -- faults ------------------------------------------------------------------------------

    async def fault_engine_kill(self) -> str:
        child = await self._serving_child()
        os.kill(child.pid, signal.SIGKILL)
        return f"kill -9 {child.pool} engine {child.address}"

    async def fault_controller_restart(self) -> str:
        return await self.restart(self.controller)

    async def fault_engine_pause(self) -> str:
        """SIGSTOP an engine past the planner's patience (it kills it), or shorter."""
        child = await self._serving_child()
        pause_s = self.rng.uniform(1.0, 2 * LOST_AFTER_FAILED_POLLS * TICK_S + 2.0)
        os.kill(child.pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s)
        if any(c.pid == child.pid for c in self.children()):  # the planner did not kill it
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGCONT)
        return f"SIGSTOP {child.pool} engine {child.address} for {pause_s:.1f} s"

    async def fault_prefill_kill_at_handoff(self) -> str:
        """A burst of requests, and a prefill engine holding some of them killed."""
        burst = [asyncio.create_task(self._one_request(self.controller_target)) for _ in range(6)]
        for _ in range(5):  # an engine the planner stops meanwhile (scaling down): another
            child = await self._serving_child("prefill")
            holding = await self._holding(child)
            if holding is not None:
                break
        with contextlib.suppress(ProcessLookupError):  # stopped and reaped meanwhile
            os.kill(child.pid, signal.SIGKILL)
        await asyncio.gather(*burst)
        return f"kill -9 prefill engine {child.address} holding {holding} requests or sessions"

    async def _holding(self, child: Child) -> int | None:
        """Requests `child` holds, once it holds some (bounded wait: maybe 0); None when it
        stopped answering (the planner stopped it)."""
        assert child.address is not None
        holding = 0
        async with grpc.aio.insecure_channel(child.address) as channel:
            for _ in range(200):
                try:
                    load = await pb_grpc.OpenEngineStub(channel).GetLoad(
                        pb.GetLoadRequest(), timeout=2
                    )
                except grpc.aio.AioRpcError:
                    return None
                # (A prefill engine's requests end at the handoff; their sessions stay open
                # until a decode engine pulls them.)
                holding = load.running_requests + load.queued_requests + load.active_kv_sessions
                if holding:
                    break
        return holding

    async def fault_drain_by_hand(self) -> str:
        """DrainEngine through the admin API. The planner replaces the engine and removes it
        once empty, often before its drain completes: the drain then ends as the controller
        ends the calls of an engine that left (UNAVAILABLE, "engine ADDRESS left",
        docs/controller.md)."""
        child = await self._serving_child()
        assert child.address is not None  # routed to: it wrote its port file
        outcome = "completed"
        async with grpc.aio.insecure_channel(self.controller_target) as channel:
            request = apb.DrainEngineRequest(engine=child.address, deadline_ms=3000)
            try:
                async for _ in apb_grpc.AdminStub(channel).DrainEngine(request, timeout=30):
                    pass
            except grpc.aio.AioRpcError as exc:
                if exc.details() != f"engine {child.address} left":
                    raise
                outcome = "removed by the planner first"
        return f"drain {child.pool} engine {child.address} through the admin API ({outcome})"

    # -- invariants --------------------------------------------------------------------------

    async def disagreements(self) -> list[str]:
        found = []
        try:
            children = self.children()
            workers = {w.address: w for w in await controller_workers(self.controller_target)}
        except (grpc.aio.AioRpcError, OSError) as exc:
            return [f"not answering: {exc}"]
        starting = [c for c in children if c.address is None]
        if starting:
            found.append(f"{len(starting)} engines starting")
        running = {c.address: c for c in children if c.address is not None}
        if set(running) != set(workers):
            found.append(
                f"the controller lists {sorted(workers)}, the planner runs {sorted(running)}"
            )
        for name, (_, low, high) in POOLS.items():
            count = sum(1 for c in children if c.pool == name)
            if not low <= count <= high:
                found.append(f"pool {name} has {count} engines, not {low}-{high}")
        for address, worker in workers.items():
            child = running.get(address)
            if child is not None and worker.role != POOLS[child.pool][0]:
                found.append(f"{address} of pool {child.pool} is {worker.role}")
            if not worker.routable or worker.cordoned:
                found.append(f"{address} not routable ({worker.state})")
                continue
            try:
                held = await engine_keys(address)
            except grpc.aio.AioRpcError as exc:
                found.append(f"{address} not answering: {exc.code().name}")
                continue
            if worker.indexed_blocks != len(held):
                found.append(
                    f"the index places {worker.indexed_blocks} blocks on {address}, "
                    f"it holds {len(held)}"
                )
        return found

    def leftovers(self) -> list[str]:
        found = super().leftovers()
        if self.planner.proc is not None:  # it should have been stopped: its children too
            found.append(f"the planner {self.planner.proc.pid}")
        return found
