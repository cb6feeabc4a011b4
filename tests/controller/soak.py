"""A seeded fault soak of a real fleet: one redis-server, two `kvplane controller serve`
replicas on it (short writer lease, `router.replica_sync`), sim engines as
`kvplane engine serve` processes (some followed over ZMQ), a client sending prefix-sharing
Generate requests through both replicas, and faults drawn at random from the seed.

Each cycle: traffic with no fault (any error then is a failure), then one fault with the
traffic going on (a retryable error then is allowed), then the traffic stops and the fleet
must converge within a bounded wait:

- the shared index places on each engine of the fleet exactly the blocks the engine holds (its
  `SubscribeKvEvents` snapshot), and nothing on an engine removed from the fleet;
- both replicas list the same engines, cordoned as the soak left them, every uncordoned one
  routable, and a request through each replica completes;

every completed request carried the tokens a reference sim engine (outside the fleet) gives for
its prompt, and no request outlived its deadline. At the end every process is stopped and none
that the soak started is left. The cycle, processes, client and report are tests/soak_fleet.py's
(`GatewaySoak`); `drive(Soak(workdir, seed), seconds=...)` runs it and returns a `SoakReport`;
`docs/benchmarks/soak.py` runs it from the command line, tests/controller/test_soak.py as a
short CI test.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from tests.redis_servers import RedisServer, restartable_port
from tests.soak_fleet import (
    GatewaySoak,
    Process,
    SoakEngine,
    controller_workers,
    engine_keys,
    index_mismatch,
    indexed_keys,
)

LEASE_S = 1.5
# The longest flap hold-down (`health.hold_down_max_s`; shipped 300 s): the soak restarts an
# engine every few seconds, so one of three is often held down (10 s, then 20 s: the hold-down
# is exercised), but a third in a row (40 s, then 80 s) would outlast the 60 s convergence bound.
HOLD_DOWN_MAX_S = 20.0


@dataclass
class Engine(SoakEngine):
    zmq: bool
    in_fleet: bool = True  # registered with the controllers (not removed)
    cordoned: bool = False


class Soak(GatewaySoak):
    """A replicated fleet: redis-server, two controller replicas, sim engines."""

    FAULTS = (
        "engine_restart",
        "controller_restart",
        "controller_pause",
        "redis_restart",
        "drain_and_restart",
        "cordon",
        "membership",
    )

    def __init__(self, workdir: Path, seed: int, engines: int = 3) -> None:
        super().__init__(workdir, seed)
        # Ports below the ephemeral range: a process killed and started again finds its own
        # free (redis-server, engines and controllers restart on the ports they had).
        self.redis = RedisServer(workdir / "redis", port=restartable_port())
        self.engines: list[Engine] = []
        for i in range(engines):
            zmq_ports = (restartable_port(), restartable_port()) if i % 2 == 1 else None
            self.engines.append(Engine(*self._sim_engine(f"e{i}", zmq_ports), zmq=bool(zmq_ports)))
        self.controllers = [self._controller(f"c{n}") for n in range(2)]

    def gateways(self) -> list[str]:
        return [f"127.0.0.1:{port}" for _, port in self.controllers]

    def _controller(self, name: str) -> tuple[Process, int]:
        port = restartable_port()
        engines = "".join(
            f"  - {{address: {e.address}, kv_events: {'zmq' if e.zmq else 'grpc'}}}\n"
            for e in self.engines
        )
        config = (
            f"listen: 127.0.0.1:{port}\n"
            f"index: {{backend: '{self.redis.url}', writer_lease_s: {LEASE_S}}}\n"
            "router: {replica_sync: true}\n"
            "health: {poll_interval_s: 0.3, load_poll_interval_s: 0.3, backoff_initial_s: 0.1, "
            f"backoff_max_s: 1.0, hold_down_max_s: {HOLD_DOWN_MAX_S}}}\n"
            f"engines:\n{engines}"
        )
        return self._serve(name, "controller", config), port

    # -- processes ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.redis.start()
        for engine in [*self.engines, self.reference]:
            engine.process.start()
        for engine in [*self.engines, self.reference]:
            await engine.process.started()
        for process, _ in self.controllers:
            process.start()
        for process, _ in self.controllers:
            await process.started()

    def stop(self) -> None:
        for process, _ in self.controllers:
            process.stop()
        for engine in [*self.engines, self.reference]:
            engine.process.stop()
        self.redis.stop()

    # -- faults ------------------------------------------------------------------------------

    def _admin_target(self) -> str:
        _, port = self.rng.choice(self.controllers)
        return f"127.0.0.1:{port}"

    async def _admin(self, call: Callable[[apb_grpc.AdminAsyncStub], Awaitable[object]]) -> None:
        """`call` on the admin API of a replica drawn at random (as behind a balancer)."""
        async with grpc.aio.insecure_channel(self._admin_target()) as channel:
            await call(apb_grpc.AdminStub(channel))

    async def fault_controller_restart(self) -> str:
        return await self.restart(self.rng.choice(self.controllers)[0])

    async def fault_controller_pause(self) -> str:
        return await self.pause(self.rng.choice(self.controllers)[0], LEASE_S)

    async def fault_drain_and_restart(self) -> str:
        """A rolling restart: drain through a replica, then the engine process restarts."""
        engine = self.rng.choice([e for e in self.engines if e.in_fleet])

        async def drain(admin: apb_grpc.AdminAsyncStub) -> None:
            request = apb.DrainEngineRequest(engine=engine.address, deadline_ms=5000)
            async for _ in admin.DrainEngine(request, timeout=30):
                pass

        await self._admin(drain)
        engine.process.kill()
        engine.process.start()
        await engine.process.started()
        return f"drain and restart {engine.process.name}"

    async def fault_cordon(self) -> str:
        """Cordon an engine through one replica, or uncordon a cordoned one (one engine at
        least stays routable: a fleet with none refuses every request, faults or not)."""
        routable = [e for e in self.engines if e.in_fleet and not e.cordoned]
        cordoned = [e for e in self.engines if e.in_fleet and e.cordoned]
        engine = self.rng.choice(cordoned + routable if len(routable) > 1 else cordoned)
        ref = apb.EngineRef(engine=engine.address)
        if engine.cordoned:
            await self._admin(lambda admin: admin.Uncordon(ref, timeout=10))
        else:
            await self._admin(lambda admin: admin.Cordon(ref, timeout=10))
        engine.cordoned = not engine.cordoned
        return f"{'cordon' if engine.cordoned else 'uncordon'} {engine.process.name}"

    async def fault_membership(self) -> str:
        """Remove an engine through one replica, or register a removed one again (one engine
        at most is out of the fleet, and one uncordoned engine at least stays in it: a fleet
        with none refuses every request, faults or not; seed 19 removed the last one)."""
        removed = [e for e in self.engines if not e.in_fleet]
        engine = removed[0] if removed else self.rng.choice(self.engines)
        routable = [e for e in self.engines if e.in_fleet and not e.cordoned]
        if engine.in_fleet and routable == [engine]:
            # Another engine instead, with no second draw: every other seed's faults stay
            # the same.
            engine = next(e for e in self.engines if e.in_fleet and e is not engine)
        if engine.in_fleet:
            ref = apb.EngineRef(engine=engine.address)
            await self._admin(lambda admin: admin.RemoveEngine(ref, timeout=10))
            engine.in_fleet = False
            engine.cordoned = False
            return f"remove {engine.process.name}"
        request = apb.RegisterEngineRequest(
            address=engine.address, kv_events="zmq" if engine.zmq else "grpc"
        )
        await self._admin(lambda admin: admin.RegisterEngine(request, timeout=10))
        engine.in_fleet = True
        return f"register {engine.process.name}"

    # -- invariants --------------------------------------------------------------------------

    async def disagreements(self) -> list[str]:
        """What still differs from the converged fleet (empty once converged)."""
        found = []
        placed = await indexed_keys(self.redis.url, [e.address for e in self.engines])
        for engine in self.engines:
            held = await engine_keys(engine.address) if engine.in_fleet else set()
            found += index_mismatch(engine.process.name, placed[engine.address], held)
        expected = {e.address: e.cordoned for e in self.engines if e.in_fleet}
        for process, port in self.controllers:
            workers = await controller_workers(f"127.0.0.1:{port}")
            listed = {w.address: w.cordoned for w in workers}
            if listed != expected:
                found.append(f"{process.name} lists {listed}, the fleet is {expected}")
            for worker in workers:
                if not worker.cordoned and not worker.routable:
                    found.append(f"{process.name}: {worker.address} not routable")
        return found
