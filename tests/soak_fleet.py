"""What the seeded fault soaks share (docs/soak.md): restartable child processes, the report,
the engines' truth, the client's accounting, and the cycle of traffic, one fault drawn from the
seed and a bounded wait for the fleet to converge (`drive`). `tests/controller/soak.py` soaks
controller replicas, `tests/controller/planner_soak.py` a planner-run disaggregated fleet (both
`GatewaySoak`s: Generate requests through controllers, checked against a reference engine),
`tests/indexer/soak.py` indexer replicas and a bridge; each says what its fleet is, how its
client sends traffic, which faults it draws and what "converged" means."""

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
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from indexer.backends import open_backend
from indexer.batch import to_sfixed64
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.indexer.backend_views import worker_keys
from tests.redis_servers import RedisServer, restartable_port

KVPLANE = [sys.executable, "-m", "kvplane"]
SETTLE_TIMEOUT_S = 60.0
# A cycle's spells of traffic, each drawn uniformly from its bounds (seconds): with no fault
# before it (an error then is a failure), and meeting the fault's aftermath. A CI run passes
# shorter ones to `drive`: each is one draw from the seed whatever its bounds, so a seed
# injects the same faults in the same order.
STEADY_S = (1.0, 3.0)
AFTERMATH_S = (0.5, 2.0)
CI_STEADY_S = (0.5, 1.5)  # the short CI soaks': a few requests still in each spell
CI_AFTERMATH_S = (0.25, 1.0)
REQUEST_DEADLINE_S = 20.0
PREFIXES = 6  # prompts share one of these 3-block prefixes
BLOCK = 16
# In the environment of every process a soak starts (and so of their children): how `leftovers`
# finds those whose command line does not name the soak's directory (a bridge's).
SOAK_MARK = "KVPLANE_SOAK_DIR"
# A call failing with one of these during a fault is what a client retries.
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
    """One child process and how to start it again (same ports, same config). With a
    `port_file` it serves once it wrote it; without one (a bridge), once it runs."""

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
            env={**os.environ, "PYTHONUNBUFFERED": "1", SOAK_MARK: str(self.workdir)},
        )
        log.close()

    async def started(self, timeout_s: float = 60.0) -> None:
        """Until the process wrote its port file (it serves)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while self.port_file is not None and not (
            self.port_file.exists() and self.port_file.read_text().strip()
        ):
            if self.proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                raise SoakFailure(f"{self.name} did not serve within {timeout_s:g} s")
            await asyncio.sleep(0.05)
        if self.proc.poll() is not None:
            raise SoakFailure(f"{self.name} exited with {self.proc.returncode}: see its log")

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                self.resume()
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


@dataclass
class SoakEngine:
    """A sim engine of the fleet (`engine_config`), restartable on its port."""

    process: Process
    port: int

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


def prefix_head(prefix: int) -> tuple[int, ...]:
    """The 3 blocks of tokens that the prompts of shared prefix number `prefix` start with."""
    return tuple(range(1000 * (prefix + 1), 1000 * (prefix + 1) + 3 * BLOCK))


def engine_config(name: str, port: int, zmq_ports: tuple[int, int] | None) -> str:
    """A sim engine with 64 KV blocks of 16 tokens (prompts evict each other), optionally
    publishing its KV events over ZMQ with a replay endpoint."""
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


async def engine_keys(address: str) -> set[int]:
    """The blocks an engine holds: the snapshot its KV event stream starts with."""
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


async def indexed_keys(backend_url: str, workers: Iterable[str]) -> dict[str, set[int]]:
    """The blocks the shared index at `backend_url` places on each of `workers`."""
    backend = await open_backend(backend_url)
    try:
        return {worker: await worker_keys(backend, worker) for worker in workers}
    finally:
        await backend.close()


def index_mismatch(name: str, index: set[int], held: set[int]) -> list[str]:
    """How the blocks the index places on engine `name` differ from those it holds (none
    when equal)."""
    if index == held:
        return []
    return [
        f"index places {len(index)} blocks on {name}, it holds {len(held)} "
        f"({len(index - held)} stale, {len(held - index)} missing)"
    ]


async def controller_workers(target: str) -> list[apb.WorkerInfo]:
    """The engines the controller at `target` lists (its admin API's ListWorkers)."""
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await apb_grpc.AdminStub(channel).ListWorkers(apb.ListWorkersRequest(), timeout=5)
        return list(reply.workers)


class InStreamError(Exception):
    """A Generate stream that ended with an `EngineError` (or without `finished`)."""

    def __init__(self, error: pb.EngineError) -> None:
        super().__init__(error.message)
        self.error = error


async def generate(
    target: str, prompt: tuple[int, ...], request_id: str, deadline_s: float
) -> list[int]:
    """One Generate of 6 tokens (ignoring EOS): the tokens, or `InStreamError`."""
    async with grpc.aio.insecure_channel(target) as channel:
        request = pb.GenerateRequest(
            request_id=request_id,
            model="sim",
            token_ids=pb.TokenIds(ids=prompt),
            stopping=pb.StoppingOptions(max_tokens=6, ignore_eos=True),
        )
        tokens: list[int] = []
        stream = pb_grpc.OpenEngineStub(channel).Generate(request, timeout=deadline_s)
        async for response in stream:
            event = response.WhichOneof("event")
            if event == "token":
                tokens += [t.token_id for t in response.token.tokens]
            elif event == "error":
                raise InStreamError(response.error)
            elif event == "finished":
                return tokens
        raise InStreamError(pb.EngineError(message="the stream ended without finished"))


def _cause(message: str | None) -> str:
    """An error's message without its addresses and numbers (errors of one cause alike)."""
    return re.sub(r"[0-9]([0-9.:]*[0-9])?", "N", message or "")[:120]


def _ancestors() -> set[int]:
    """This process and its parents, up to init."""
    found = set()
    pid = os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def leftovers(workdir: Path) -> list[str]:
    """Processes still running whose command line names `workdir` or whose environment
    carries `SOAK_MARK` for it (but for this process and those that started it: the soak's
    own command line may name it)."""
    ours = _ancestors()
    mark = f"{SOAK_MARK}={workdir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(workdir) in cmdline or mark in environ:
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


class SeededSoak:
    """A fleet under seeded faults. Subclasses name their `FAULTS` (a `fault_<kind>` method
    each, returning what it did; `engine_restart` and `redis_restart` are here, for fleets
    with `engines` and a `redis`), start and stop the fleet, run the `client` traffic
    (`traffic`, at `traffic_rate`), list what still keeps the fleet from having converged
    (`disagreements`), and check what they need once it has (`converged`)."""

    FAULTS: tuple[str, ...] = ()
    engines: Sequence[SoakEngine]
    redis: RedisServer

    def __init__(self, workdir: Path, seed: int) -> None:
        self.workdir = workdir
        # Faults from a generator of their own: the same seed draws the same faults, whatever
        # the traffic (whose timing varies from run to run) drew meanwhile.
        self.rng = random.Random(seed)
        self.traffic_rng = random.Random(seed + 1_000_003)
        self.report = SoakReport(seed)
        self.in_fault = False
        self.fault = ""  # the kind of the last fault (its window's errors are counted by it)
        self.request_number = 0

    async def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def traffic(self) -> list[Coroutine[Any, Any, None]]:
        """The calls of one tick of the client's Poisson stream."""
        raise NotImplementedError

    def traffic_rate(self, rate_per_s: float) -> float:
        """The client's rate in the next cycle (a fleet's soak may vary it)."""
        return rate_per_s

    async def disagreements(self) -> list[str]:
        """What still differs from the converged fleet (empty once converged)."""
        raise NotImplementedError

    async def converged(self) -> None:
        """Checks once the fleet converged (no fault window any more)."""

    def leftovers(self) -> list[str]:
        """What of the soak still runs once it stopped (none, or a failure)."""
        return leftovers(self.workdir)

    # -- the fleet ---------------------------------------------------------------------------

    def _serve(self, name: str, kind: str, config: str) -> Process:
        """A `kvplane <kind> serve` process with `config`, its log and port file here."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(config)
        port_file = self.workdir / f"{name}.port"
        args = [*KVPLANE, kind, "serve", "--config", str(path), "--port-file", str(port_file)]
        return Process(name, args, self.workdir, port_file)

    def _sim_engine(
        self, name: str, zmq_ports: tuple[int, int] | None = None
    ) -> tuple[Process, int]:
        """A sim engine's process (`engine_config`) and its port (one of its own)."""
        port = restartable_port()
        return self._serve(name, "engine", engine_config(name, port, zmq_ports)), port

    # -- the client --------------------------------------------------------------------------

    def prompt(self) -> tuple[int, ...]:
        """One of the shared prefixes and a random tail."""
        rng = self.traffic_rng
        head = prefix_head(rng.randrange(PREFIXES))
        tail = [rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 2 * BLOCK))]
        return (*head, *tail)

    def failed(self, kind: str, exc: grpc.aio.AioRpcError, what: str, in_window: bool) -> None:
        """A call (counted as `kind`) failed: allowed in a fault window with a retryable
        status (counted by the fault and the cause), else a failure of the soak (`what` says
        which call)."""
        code = exc.code()
        if code in RETRYABLE and in_window:
            self.report.requests[f"{kind} error {code.name} (fault window)"] += 1
            cause = _cause(exc.details())
            self.report.window_errors[f"{self.fault}: {kind} error {code.name} {cause}"] += 1
            return
        self.report.requests[f"{kind} error {code.name}"] += 1
        where = "during" if in_window else "outside"
        self.report.failures.append(f"{what} {where} a fault: {code.name} {exc.details()}")

    async def request(self, target: str, prompt: tuple[int, ...], kind: str) -> list[int] | None:
        """One Generate of `prompt` to `target`, counted as `kind`: its tokens, or None when
        it failed (a failure of the soak unless allowed, `failed`)."""
        self.request_number += 1
        started_in_fault = self.in_fault
        what = f"request {self.request_number} via {target}"
        try:
            return await generate(target, prompt, f"soak-{self.request_number}", REQUEST_DEADLINE_S)
        except grpc.aio.AioRpcError as exc:
            in_window = started_in_fault or self.in_fault  # sent or failed in the window
            self.failed(kind, exc, what, in_window)
        except InStreamError as exc:
            if exc.error.retryable and (started_in_fault or self.in_fault):
                self.report.requests[f"{kind} in-stream retryable error (fault window)"] += 1
                cause = _cause(exc.error.message)
                self.report.window_errors[f"{self.fault}: {kind} in-stream {cause}"] += 1
                return None
            self.report.requests[f"{kind} in-stream error"] += 1
            self.report.failures.append(f"{what}: in-stream error {exc.error}")
        return None

    async def client(self, rate_per_s: float) -> None:
        """The `traffic` of a tick after another (a Poisson stream) until cancelled; then
        waits for the calls sent."""
        sent: set[asyncio.Task[None]] = set()
        try:
            while True:
                for call in self.traffic():
                    task = asyncio.create_task(call)
                    sent.add(task)
                    task.add_done_callback(sent.discard)
                await asyncio.sleep(self.traffic_rng.expovariate(rate_per_s))
        except asyncio.CancelledError:
            if sent:
                await asyncio.gather(*sent)  # each ends by its deadline
            raise

    # -- faults ------------------------------------------------------------------------------

    async def restart(self, process: Process) -> str:
        """`kill -9` the process, start it again (same ports, same config)."""
        process.kill()
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        process.start()
        await process.started()
        return f"kill -9 and restart {process.name}"

    async def pause(self, process: Process, lease_s: float) -> str:
        """`SIGSTOP` the process for 1-3 writer leases, then `SIGCONT`."""
        pause_s = self.rng.uniform(lease_s, 3 * lease_s)
        process.pause()
        await asyncio.sleep(pause_s)
        process.resume()
        return f"SIGSTOP {process.name} for {pause_s:.1f} s"

    async def fault_engine_restart(self) -> str:
        """An engine killed and started again (cold cache)."""
        return await self.restart(self.rng.choice(self.engines).process)

    async def fault_redis_restart(self) -> str:
        self.redis.kill()
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        await asyncio.to_thread(self.redis.start)
        return "kill -9 and restart redis-server (empty)"

    # -- a cycle -----------------------------------------------------------------------------

    async def _disagreements_or_errors(self) -> list[str]:
        """`disagreements`, or why the fleet could not be looked at (a process not answering
        yet, the index backend failing while redis-server starts again)."""
        try:
            return await self.disagreements()
        except (grpc.aio.AioRpcError, OSError, ConnectionError) as exc:
            return [f"not answering: {exc}"]
        except Exception as exc:  # the index backend's errors while redis starts again
            return [f"index not readable: {type(exc).__name__}: {exc}"]

    async def settle(self, kind: str, what: str) -> None:
        """Wait (bounded) for the fleet to converge after `what` (a fault of `kind`); record
        the time or the failure."""
        started = time.monotonic()
        deadline = started + SETTLE_TIMEOUT_S
        while found := await self._disagreements_or_errors():
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
        await self.converged()

    async def cycle(
        self,
        rate_per_s: float,
        steady_s: tuple[float, float] = STEADY_S,
        aftermath_s: tuple[float, float] = AFTERMATH_S,
    ) -> None:
        """Traffic with no fault, then one fault drawn from the seed with the traffic going
        on, then the traffic stops and the fleet must converge."""
        client = asyncio.create_task(self.client(self.traffic_rate(rate_per_s)))
        try:
            await asyncio.sleep(self.rng.uniform(*steady_s))  # steady: errors are failures
            kind = self.rng.choice(self.FAULTS)
            self.in_fault = True
            self.fault = kind
            self.report.faults[kind] += 1
            try:
                what = await getattr(self, f"fault_{kind}")()
            except (grpc.aio.AioRpcError, SoakFailure) as exc:  # an admin call refused, ...
                self.report.failures.append(f"fault {kind} failed: {exc}")
                return
            await asyncio.sleep(self.rng.uniform(*aftermath_s))  # traffic meets the aftermath
        finally:
            client.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await client
        await self.settle(kind, what)


class GatewaySoak(SeededSoak):
    """A fleet whose client sends Generate requests through controllers (`gateways`, in
    turn); every completed request must carry the tokens that a reference sim engine outside
    the fleet gives for its prompt. The subclass starts and stops `reference` with its
    fleet."""

    def __init__(self, workdir: Path, seed: int) -> None:
        super().__init__(workdir, seed)
        self.reference = SoakEngine(*self._sim_engine("reference"))
        self.expected: dict[tuple[int, ...], list[int]] = {}
        self.completed: list[tuple[tuple[int, ...], list[int]]] = []

    def gateways(self) -> list[str]:
        """Where the client sends requests (in turn)."""
        raise NotImplementedError

    async def _one_request(self, target: str) -> None:
        prompt = self.prompt()
        tokens = await self.request(target, prompt, "request")
        if tokens is not None:
            self.report.requests["request ok"] += 1
            self.completed.append((prompt, tokens))

    def traffic(self) -> list[Coroutine[Any, Any, None]]:
        """A request through the next gateway."""
        gateways = self.gateways()
        return [self._one_request(gateways[self.request_number % len(gateways)])]

    async def check_tokens(self) -> None:
        """Every completed request's tokens equal the reference engine's for its prompt."""
        for prompt, tokens in self.completed:
            if prompt not in self.expected:
                self.expected[prompt] = await generate(
                    self.reference.address,
                    prompt,
                    f"reference-{len(self.expected)}",
                    REQUEST_DEADLINE_S,
                )
            if tokens != self.expected[prompt]:
                self.report.failures.append(
                    f"prompt {prompt[:4]}... got {tokens}, the engine gives {self.expected[prompt]}"
                )
        self.completed.clear()

    async def converged(self) -> None:
        """Every gateway routes, and every request so far got the reference's tokens."""
        for target in self.gateways():
            await self._one_request(target)
        await self.check_tokens()


async def drive(
    soak: SeededSoak,
    *,
    seconds: float,
    rate_per_s: float = 4.0,
    max_faults: int | None = None,
    steady_s: tuple[float, float] = STEADY_S,
    aftermath_s: tuple[float, float] = AFTERMATH_S,
) -> SoakReport:
    """`soak`'s run: its fleet started and converged, then cycles (with spells of traffic
    `steady_s` and `aftermath_s`) until `seconds` have passed (each cycle completes) or
    `max_faults` were injected, or an invariant failed; then everything stopped, and no
    process left behind."""
    try:
        await soak.start()
        await soak.settle("start", "the fleet's start")
        started = time.monotonic()
        while (
            time.monotonic() - started < seconds
            and not soak.report.failures
            and (max_faults is None or sum(soak.report.faults.values()) < max_faults)
        ):
            await soak.cycle(rate_per_s, steady_s, aftermath_s)
    finally:
        soak.stop()
    left = soak.leftovers()
    if left:
        soak.report.failures.append(f"processes left behind: {left}")
    return soak.report
