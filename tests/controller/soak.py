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
that the soak started is left. `run_soak` returns a `SoakReport`; `docs/benchmarks/soak.py`
runs it from the command line, tests/controller/test_soak.py as a short CI test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from indexer.backends import open_backend
from indexer.batch import ActionType, to_sfixed64
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.redis_servers import RedisServer, restartable_port

KVPLANE = [sys.executable, "-m", "kvplane"]
LEASE_S = 1.5
REQUEST_DEADLINE_S = 20.0
SETTLE_TIMEOUT_S = 60.0
PREFIXES = 6  # prompts share one of these 3-block prefixes
BLOCK = 16
# A request failing with one of these during a fault is what a client retries.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}


class SoakFailure(AssertionError):
    """An invariant the fleet did not reach (within its bounded wait) or broke."""


@dataclass
class Process:
    """One child process and how to start it again (same ports, same config)."""

    name: str
    args: list[str]
    workdir: Path
    port_file: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False

    def start(self) -> None:
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)
        log = (self.workdir / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

    async def started(self, timeout_s: float = 60.0) -> None:
        """Until the process wrote its port file (it serves)."""
        assert self.port_file is not None and self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise SoakFailure(f"{self.name} exited with {self.proc.returncode}: see its log")
            if time.monotonic() > deadline:
                raise SoakFailure(f"{self.name} did not serve within {timeout_s:g} s")
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                self.proc.send_signal(signal.SIGCONT)
                self.paused = False
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.proc.send_signal(signal.SIGCONT)
            self.paused = False
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


@dataclass
class Engine:
    process: Process
    port: int
    zmq: bool
    in_fleet: bool = True  # registered with the controllers (not removed)
    cordoned: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class SoakReport:
    seed: int
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    # The errors allowed in fault windows, by the fault and the error's message (addresses
    # and numbers left out): what the clients of a fault saw.
    window_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    convergence_s: list[tuple[str, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"seed {self.seed}: {sum(self.faults.values())} faults"]
        lines += [f"  fault {kind}: {count}" for kind, count in sorted(self.faults.items())]
        lines += [f"  requests {kind}: {n}" for kind, n in sorted(self.requests.items())]
        for kind in sorted(self.faults):
            times = [t for k, t in self.convergence_s if k == kind]
            if not times:  # it failed to converge
                continue
            lines.append(
                f"  converged after {kind}: max {max(times):.1f} s, "
                f"mean {sum(times) / len(times):.1f} s"
            )
        lines += [f"  in a fault window, {n}: {why}" for why, n in self.window_errors.most_common()]
        lines += [f"  FAILURE: {failure}" for failure in self.failures]
        return "\n".join(lines)


def _engine_config(name: str, port: int, zmq_ports: tuple[int, int] | None) -> str:
    config = (
        f"listen: 127.0.0.1:{port}\ninstance_id: {name}\nmodel: sim\nnum_kv_blocks: 64\n"
        "sim: {time_scale: 0.2}\n"
    )
    if zmq_ports is not None:
        config += (
            f"kv_events: {{zmq_enabled: true, endpoint: 'tcp://127.0.0.1:{zmq_ports[0]}', "
            f"replay_endpoint: 'tcp://127.0.0.1:{zmq_ports[1]}'}}\n"
        )
    return config


class SeededSoak:
    """What every soak's run shares: the seeded generators, the reference engine, the client
    and its checks, the cycle of traffic, fault and convergence, the search for processes
    left behind. A fleet's soak (`Soak`, `planner_soak.PlannerSoak`) says how its processes
    start and stop (`start`, `stop`), where requests go (`gateways`), its faults (`FAULTS`,
    each a `fault_KIND` method) and what differs from its converged state (`_disagreements`)."""

    FAULTS: tuple[str, ...] = ()

    def __init__(self, workdir: Path, seed: int) -> None:
        self.workdir = workdir
        # Faults from a generator of their own: the same seed draws the same faults, whatever
        # the traffic (whose timing varies from run to run) drew meanwhile.
        self.rng = random.Random(seed)
        self.traffic_rng = random.Random(seed + 1_000_003)
        self.report = SoakReport(seed)
        self.reference = self._engine("reference", None)
        self.expected: dict[tuple[int, ...], list[int]] = {}
        self.completed: list[tuple[tuple[int, ...], list[int]]] = []
        self.in_fault = False
        self.fault = ""  # the kind of the last fault (its window's errors are counted by it)
        self.request_number = 0

    async def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def gateways(self) -> list[str]:
        """Where the client sends requests (in turn)."""
        raise NotImplementedError

    async def _disagreements(self) -> list[str]:
        """What still differs from the converged fleet (empty once converged)."""
        raise NotImplementedError

    def traffic_rate(self, rate_per_s: float) -> float:
        """The request rate of the next cycle (a fleet's soak may vary it)."""
        return rate_per_s

    def _serve(self, name: str, kind: str, config: str) -> Process:
        path = self.workdir / f"{name}.yaml"
        path.write_text(config)
        port_file = self.workdir / f"{name}.port"
        args = [*KVPLANE, kind, "serve", "--config", str(path), "--port-file", str(port_file)]
        return Process(name, args, self.workdir, port_file)

    def _engine(self, name: str, zmq_ports: tuple[int, int] | None) -> Engine:
        port = restartable_port()
        process = self._serve(name, "engine", _engine_config(name, port, zmq_ports))
        return Engine(process, port, zmq_ports is not None)

    # -- processes ---------------------------------------------------------------------------

    def leftovers(self) -> list[str]:
        """Processes still running whose command line names this soak's directory (but for
        this process and those that started it: the soak's own command line may name it)."""
        ours = _ancestors()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(self.workdir) in cmdline:
                found.append(f"{entry.name}: {cmdline.strip()}")
        return found

    # -- the client --------------------------------------------------------------------------

    def _prompt(self) -> tuple[int, ...]:
        prefix = self.traffic_rng.randrange(PREFIXES)
        head = range(1000 * (prefix + 1), 1000 * (prefix + 1) + 3 * BLOCK)
        rng = self.traffic_rng
        tail = [rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 2 * BLOCK))]
        return (*head, *tail)

    async def _generate(self, target: str, prompt: tuple[int, ...], request_id: str) -> list[int]:
        async with grpc.aio.insecure_channel(target) as channel:
            request = pb.GenerateRequest(
                request_id=request_id,
                model="sim",
                token_ids=pb.TokenIds(ids=prompt),
                stopping=pb.StoppingOptions(max_tokens=6, ignore_eos=True),
            )
            tokens: list[int] = []
            stream = pb_grpc.OpenEngineStub(channel).Generate(request, timeout=REQUEST_DEADLINE_S)
            async for response in stream:
                event = response.WhichOneof("event")
                if event == "token":
                    tokens += [t.token_id for t in response.token.tokens]
                elif event == "error":
                    raise _InStreamError(response.error)
                elif event == "finished":
                    return tokens
            raise _InStreamError(pb.EngineError(message="the stream ended without finished"))

    async def _one_request(self, target: str) -> None:
        self.request_number += 1
        prompt = self._prompt()
        started_in_fault = self.in_fault
        try:
            tokens = await self._generate(target, prompt, f"soak-{self.request_number}")
        except grpc.aio.AioRpcError as exc:
            during_fault = started_in_fault or self.in_fault  # sent or failed in the window
            code = exc.code()
            kind = f"error {code.name}"
            if code in RETRYABLE and during_fault:
                self.report.requests[f"{kind} (fault window)"] += 1
                self.report.window_errors[f"{self.fault}: {kind} {_cause(exc.details())}"] += 1
                return
            self.report.requests[kind] += 1
            self.report.failures.append(
                f"request {self.request_number} via {target} "
                f"{'during' if during_fault else 'outside'} a fault: {code.name} {exc.details()}"
            )
            return
        except _InStreamError as exc:
            if exc.error.retryable and (started_in_fault or self.in_fault):
                self.report.requests["in-stream retryable error (fault window)"] += 1
                self.report.window_errors[
                    f"{self.fault}: in-stream {_cause(exc.error.message)}"
                ] += 1
                return
            self.report.requests["in-stream error"] += 1
            self.report.failures.append(
                f"request {self.request_number} via {target}: in-stream error {exc.error}"
            )
            return
        self.report.requests["ok"] += 1
        self.completed.append((prompt, tokens))

    async def client(self, rate_per_s: float) -> None:
        """Requests through the gateways in turn until cancelled; then waits for those sent."""
        sent: set[asyncio.Task[None]] = set()
        try:
            while True:
                gateways = self.gateways()
                target = gateways[self.request_number % len(gateways)]
                task = asyncio.create_task(self._one_request(target))
                sent.add(task)
                task.add_done_callback(sent.discard)
                await asyncio.sleep(self.traffic_rng.expovariate(rate_per_s))
        except asyncio.CancelledError:
            if sent:
                await asyncio.gather(*sent)  # each ends by its deadline
            raise

    async def check_tokens(self) -> None:
        """Every completed request's tokens equal the reference engine's for its prompt."""
        for prompt, tokens in self.completed:
            if prompt not in self.expected:
                self.expected[prompt] = await self._generate(
                    self.reference.address, prompt, f"reference-{len(self.expected)}"
                )
            if tokens != self.expected[prompt]:
                self.report.failures.append(
                    f"prompt {prompt[:4]}... got {tokens}, the engine gives {self.expected[prompt]}"
                )
        self.completed.clear()

    # -- looking at the fleet ---------------------------------------------------------------

    async def _engine_keys(self, address: str) -> set[int]:
        """The blocks the engine at `address` holds: the snapshot its KV event stream starts
        with."""
        async with grpc.aio.insecure_channel(address) as channel:
            stream = pb_grpc.OpenEngineStub(channel).SubscribeKvEvents(
                pb.SubscribeKvEventsRequest(include_snapshot=True), timeout=10
            )
            async for response in stream:
                stream.cancel()
                return {
                    to_sfixed64(block_hash.value)
                    for event in response.batch.events
                    if event.WhichOneof("event") == "block_stored"
                    for block_hash in event.block_stored.block_hashes
                }
        raise SoakFailure(f"{address} sent no snapshot")

    async def _workers(self, target: str) -> list[apb.WorkerInfo]:
        """The engines the controller at `target` lists (its admin API's ListWorkers)."""
        async with grpc.aio.insecure_channel(target) as channel:
            reply = await apb_grpc.AdminStub(channel).ListWorkers(
                apb.ListWorkersRequest(), timeout=5
            )
            return list(reply.workers)

    # -- a cycle ----------------------------------------------------------------------------

    async def settle(self, kind: str, what: str) -> None:
        """Wait (bounded) for the fleet to converge after `what` (a fault of `kind`); record
        the time or the failure."""
        started = time.monotonic()
        deadline = started + SETTLE_TIMEOUT_S
        while found := await self._disagreements():
            if time.monotonic() > deadline:
                self.report.failures.append(
                    f"not converged {SETTLE_TIMEOUT_S:g} s after {what}: {'; '.join(found)}"
                )
                return
            await asyncio.sleep(0.25)
        converged_s = time.monotonic() - started
        self.report.convergence_s.append((kind, converged_s))
        print(f"  {what}: converged in {converged_s:.1f} s", flush=True)
        self.in_fault = False  # converged: from here on an error is a failure
        for target in self.gateways():  # every gateway routes
            await self._one_request(target)

    async def cycle(self, rate_per_s: float) -> None:
        client = asyncio.create_task(self.client(self.traffic_rate(rate_per_s)))
        try:
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))  # steady: errors are failures
            kind = self.rng.choice(self.FAULTS)
            self.in_fault = True
            self.fault = kind
            self.report.faults[kind] += 1
            try:
                what = await getattr(self, f"fault_{kind}")()
            except (grpc.aio.AioRpcError, SoakFailure) as exc:  # an admin call refused, ...
                self.report.failures.append(f"fault {kind} failed: {exc}")
                return
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))  # traffic meets the aftermath
        finally:
            client.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await client
        await self.settle(kind, what)
        await self.check_tokens()


class Soak(SeededSoak):
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
            self.engines.append(self._engine(f"e{i}", zmq_ports))
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
            "backoff_max_s: 1.0}\n"
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

    async def _admin(self, call: Callable[[apb_grpc.AdminStub], Any]) -> None:
        """`call` on the admin API of a replica drawn at random (as behind a balancer)."""
        async with grpc.aio.insecure_channel(self._admin_target()) as channel:
            await call(apb_grpc.AdminStub(channel))

    async def fault_engine_restart(self) -> str:
        engine = self.rng.choice(self.engines)
        engine.process.kill()
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        engine.process.start()
        await engine.process.started()
        return f"kill -9 and restart {engine.process.name}"

    async def fault_controller_restart(self) -> str:
        process, _ = self.rng.choice(self.controllers)
        process.kill()
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        process.start()
        await process.started()
        return f"kill -9 and restart {process.name}"

    async def fault_controller_pause(self) -> str:
        process, _ = self.rng.choice(self.controllers)
        assert process.proc is not None
        pause_s = self.rng.uniform(LEASE_S, 3 * LEASE_S)
        process.proc.send_signal(signal.SIGSTOP)
        process.paused = True
        await asyncio.sleep(pause_s)
        process.proc.send_signal(signal.SIGCONT)
        process.paused = False
        return f"SIGSTOP {process.name} for {pause_s:.1f} s"

    async def fault_redis_restart(self) -> str:
        self.redis.kill()
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        await asyncio.to_thread(self.redis.start)
        return "kill -9 and restart redis-server (empty)"

    async def fault_drain_and_restart(self) -> str:
        """A rolling restart: drain through a replica, then the engine process restarts."""
        engine = self.rng.choice([e for e in self.engines if e.in_fleet])

        async def drain(admin: apb_grpc.AdminStub) -> None:
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
        at most is out of the fleet, so that two stay routable)."""
        removed = [e for e in self.engines if not e.in_fleet]
        engine = removed[0] if removed else self.rng.choice(self.engines)
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

    async def _index_keys(self) -> dict[str, set[int]]:
        backend = await open_backend(self.redis.url)
        try:
            placed: dict[str, set[int]] = {}
            for engine in self.engines:
                keys: set[int] = set()
                async for batch in backend.snapshot(engine.address):
                    for action in batch.actions:
                        if action.type is ActionType.REPORT:
                            keys.update(action.hashes)
                placed[engine.address] = keys
            return placed
        finally:
            await backend.close()

    async def _disagreements(self) -> list[str]:
        """What still differs from the converged fleet (empty once converged)."""
        found = []
        try:
            placed = await self._index_keys()
            for engine in self.engines:
                held = await self._engine_keys(engine.address) if engine.in_fleet else set()
                index = placed[engine.address]
                if index != held:
                    found.append(
                        f"index places {len(index)} blocks on {engine.process.name}, "
                        f"it holds {len(held)} ({len(index - held)} stale, "
                        f"{len(held - index)} missing)"
                    )
            expected = {e.address: e.cordoned for e in self.engines if e.in_fleet}
            for process, port in self.controllers:
                workers = await self._workers(f"127.0.0.1:{port}")
                listed = {w.address: w.cordoned for w in workers}
                if listed != expected:
                    found.append(f"{process.name} lists {listed}, the fleet is {expected}")
                for worker in workers:
                    if not worker.cordoned and not worker.routable:
                        found.append(f"{process.name}: {worker.address} not routable")
        except (grpc.aio.AioRpcError, OSError, ConnectionError) as exc:
            found.append(f"not answering: {exc}")
        except Exception as exc:  # the index backend's errors while redis starts again
            found.append(f"index not readable: {type(exc).__name__}: {exc}")
        return found


def _cause(message: str | None) -> str:
    """An error's message without its addresses and numbers (errors of one cause alike)."""
    return re.sub(r"[0-9.:]+[0-9]", "N", message or "")[:120]


def _ancestors() -> set[int]:
    """This process and its parents, up to init."""
    found = set()
    pid = os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


class _InStreamError(Exception):
    def __init__(self, error: pb.EngineError) -> None:
        super().__init__(error.message)
        self.error = error


async def run_soak(
    workdir: Path,
    seed: int,
    *,
    seconds: float,
    engines: int = 3,
    rate_per_s: float = 4.0,
    max_faults: int | None = None,
) -> SoakReport:
    """Faults until `seconds` have passed (each cycle completes) or `max_faults` were
    injected, or an invariant failed; then stop everything."""
    return await drive(Soak(workdir, seed, engines), seconds, rate_per_s, max_faults)


async def drive(
    soak: SeededSoak, seconds: float, rate_per_s: float, max_faults: int | None
) -> SoakReport:
    """`soak`'s run: its fleet started and converged, then cycles until `seconds` have passed
    (each cycle completes) or `max_faults` were injected, or an invariant failed; then
    everything stopped, and no process left behind."""
    try:
        await soak.start()
        await soak.settle("start", "the fleet's start")
        started = time.monotonic()
        while (
            time.monotonic() - started < seconds
            and not soak.report.failures
            and (max_faults is None or sum(soak.report.faults.values()) < max_faults)
        ):
            await soak.cycle(rate_per_s)
    finally:
        soak.stop()
    left = soak.leftovers()
    if left:
        soak.report.failures.append(f"processes left behind: {left}")
    return soak.report
