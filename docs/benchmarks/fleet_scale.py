"""One controller in front of a large fleet of sim engines (8 to 256): what the controller
costs as the fleet grows.

    python docs/benchmarks/fleet_scale.py [--engines 8 64 256] [--idle-s 30] [--requests 400]
        [--load-poll-s 0.5] [--profile DIR] [--no-load] [--decisions [--no-model]]
        [--health-rounds ROUNDS]

For each fleet size N: one process serves N sim engines (`--model sim`, `time_scale: 0`), each
its own grpc.aio server on its own loopback port, built by `engine.server.service.start_engine`
as `kvplane engine serve --model sim` builds one (N engine processes would not fit a small
machine); one `kvplane controller serve` process lists them (embedded memory index, the default
health intervals: Health every 1 s, GetLoad every 0.5 s or `--load-poll-s`; one KV-event
stream per engine). Measured, from outside the controller:

* until routable: from the controller's start until ListWorkers reports all N routable;
* idle: the controller's CPU (user + system, /proc/PID/stat) per second over `--idle-s` with
  nothing to route, after 5 s to settle, and its RSS then;
* under load: `--requests` Generate calls (8 at a time; prompts of 512 tokens, 384 of them one
  of 16 shared prefixes; max_tokens 4) through the gateway, then as many like them straight to
  the engines, in turn: the client's p50/p99 latency each way (the difference is what the
  gateway adds; see the caveat in fleet_scale.md), the controller's CPU per request above its
  idle rate, and `kvplane_controller_route_seconds` (from the request's arrival until its
  engine is chosen: wall time, so a busy event loop counts);
* the CPU (of the event loop's thread) that each Controller.plan (the prompt's keys, index
  match, candidates) and Controller.route (the router's decision) call took, from wrappers
  around those two methods in the controller process.

`--decisions` measures instead, in this process and without gRPC, the CPU of what the gateway
does for each Generate before it calls an engine (`Controller.disaggregated`, `plan` and
`route`, then the request finished) over N engines registered as ready, at 8, 64 and 256:
the routing path's own cost per engine, free of the polls and of a shared machine's noise.
With `--no-model` its requests name no model, each with a session key of its own, and are
checked first as the gateway checks them (`Controller.check_model`): the fleet's default
model is looked up twice a request (`Registry.default_model`), for the check and for the
session key.

`--health-rounds ROUNDS` measures instead, in this process, the CPU of one round of health
answers (one `Registry.on_health` per engine, every engine READY, the time one second on at
each round) over N engines of which a quarter are ejected and a quarter held down (after a
flap) while saying READY: what the fleet's poll loop spends in the registry while engines are
held out, `ROUNDS` rounds.

`--profile DIR` also runs the controller under cProfile and writes DIR/controller-N.prof when it
stops (cProfile's per-call cost inflates code that makes many small calls: compare profiles with
each other, not with the figures above); `--no-load` stops the controller after the idle window,
so that profile is of idleness alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
from replica_sync_live import Processes, _free_port  # this folder's live harness (sys.path[0])

from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

CONCURRENCY = 8
PREFIXES = 16
PREFIX_TOKENS = 384
PROMPT_TOKENS = 512
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# `python -m kvplane ARGS`, run as `python -c CONTROLLER TIMES_FILE PROFILE_FILE ARGS`: the CPU
# time (of the event loop's thread: other threads' work does not count, nor time preempted)
# of each Controller.plan and Controller.route call is summed into TIMES_FILE at exit, and
# with a PROFILE_FILE other than "-" the process runs under cProfile, written there at exit.
CONTROLLER = """
import cProfile, functools, sys, time
from controller.service import Controller
from kvplane.cli import main

times_file, profile_file = sys.argv.pop(1), sys.argv.pop(1)
spent = {"plan": [0.0, 0], "route": [0.0, 0]}

def timed(name, call):
    async def timed_async(*args, **kwargs):
        started = time.thread_time()
        try:
            return await call(*args, **kwargs)
        finally:
            spent[name][0] += time.thread_time() - started
            spent[name][1] += 1
    def timed_sync(*args, **kwargs):
        started = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            spent[name][0] += time.thread_time() - started
            spent[name][1] += 1
    import inspect
    return functools.wraps(call)(timed_async if inspect.iscoroutinefunction(call) else timed_sync)

Controller.plan = timed("plan", Controller.plan)
Controller.route = timed("route", Controller.route)
profile = cProfile.Profile() if profile_file != "-" else None
try:
    if profile is None:
        main()
    else:
        profile.runcall(main)
except SystemExit:
    pass
finally:
    if profile is not None:
        profile.dump_stats(profile_file)
    with open(times_file, "w") as out:
        for name, (seconds, calls) in spent.items():
            out.write(f"{name} {seconds} {calls}\\n")
"""


# ---- the engine host: `fleet_scale.py --serve-engines N --port-file F` ----


async def serve_engines(count: int, port_file: Path) -> None:
    """Serve `count` sim engines in this process until SIGTERM; their ports, one a line, go
    to `port_file` once all listen."""
    from engine.config import EngineConfig, SimTimingConfig
    from engine.server.service import start_engine

    apps = [
        await start_engine(
            EngineConfig(
                model="sim",
                listen="127.0.0.1:0",
                instance_id=f"e{i}",
                num_kv_blocks=4096,
                sim=SimTimingConfig(time_scale=0.0),
                shutdown_grace_s=0.2,
            )
        )
        for i in range(count)
    ]
    partial = port_file.with_suffix(".partial")
    partial.write_text("".join(f"{app.port}\n" for app in apps))
    partial.rename(port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.gather(*(app.close() for app in apps), return_exceptions=True)


# ---- the driver ----


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}")
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.05)
    raise SystemExit(f"nothing in {path} after {timeout_s} s")


async def _all_routable(target: str, count: int) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        admin = apb_grpc.AdminStub(channel)
        while True:
            workers: Sequence[apb.WorkerInfo]
            try:
                workers = (await admin.ListWorkers(apb.ListWorkersRequest())).workers
            except grpc.aio.AioRpcError:
                workers = []
            if len(workers) == count and all(w.routable for w in workers):
                return
            await asyncio.sleep(0.1)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    tail = PROMPT_TOKENS - PREFIX_TOKENS
    return [
        rng.choice(prefixes) + [rng.randrange(1, 30_000) for _ in range(tail)] for _ in range(count)
    ]


async def _latencies(
    targets: list[str], prompts: list[list[int]], tag: str, concurrency: int = CONCURRENCY
) -> list[float]:
    """Client latency (ms) of each prompt's Generate, `concurrency` at a time, the prompts
    sent to `targets` in turn."""
    queue = list(enumerate(prompts))
    out: list[float] = []
    channels = [grpc.aio.insecure_channel(target) for target in targets]
    stubs = [pb_grpc.OpenEngineStub(channel) for channel in channels]

    async def worker() -> None:
        while queue:
            i, tokens = queue.pop()
            request = pb.GenerateRequest(
                request_id=f"{tag}-{i}",
                model="sim",
                token_ids=pb.TokenIds(ids=tokens),
                stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True),
            )
            started = time.perf_counter()
            async for _ in stubs[i % len(stubs)].Generate(request):
                pass
            out.append((time.perf_counter() - started) * 1000.0)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def measure(count: int, args: argparse.Namespace, workdir: Path) -> None:
    procs = Processes(workdir)
    times_file = workdir / f"controller-{count}.times"
    try:
        port_file = workdir / f"engines-{count}.ports"
        engines = procs.start(
            f"engines-{count}",
            [
                sys.executable,
                __file__,
                "--serve-engines",
                str(count),
                "--port-file",
                str(port_file),
            ],
        )
        ports = _wait_file(port_file, engines).split()
        metrics_port = _free_port()
        config = workdir / f"controller-{count}.yaml"
        config.write_text(
            f"listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
            f"router: {{seed: 0}}\nhealth: {{load_poll_interval_s: {args.load_poll_s}}}\n"
            "engines:\n" + "".join(f"  - {{address: 127.0.0.1:{p}}}\n" for p in ports)
        )
        controller_port = workdir / f"controller-{count}.port"
        profile = "-" if args.profile is None else str(args.profile / f"controller-{count}.prof")
        started = time.monotonic()
        controller = procs.start(
            f"controller-{count}",
            [sys.executable, "-c", CONTROLLER, str(times_file), profile, "controller", "serve",
             "--config", str(config), "--port-file", str(controller_port)],
        )  # fmt: skip
        target = f"127.0.0.1:{_wait_file(controller_port, controller).strip()}"
        await _all_routable(target, count)
        routable_s = time.monotonic() - started
        await asyncio.sleep(5)  # the KV-event streams and first polls settle
        cpu0, t0 = _cpu_seconds(controller.pid), time.monotonic()
        await asyncio.sleep(args.idle_s)
        idle_cpu = (_cpu_seconds(controller.pid) - cpu0) / (time.monotonic() - t0)
        rss = _rss_mib(controller.pid)
        print(
            f"N={count:4d}: routable after {routable_s:5.1f} s; idle CPU {idle_cpu * 100:5.1f}% "
            f"of a core; RSS {rss:6.1f} MiB (load average {os.getloadavg()[0]:.2f})",
            flush=True,
        )
        if args.no_load:
            return
        prompts = _prompts(args.requests, seed=count)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        route_s0 = _metric(metrics_url, "kvplane_controller_route_seconds_sum")
        routed0 = _metric(metrics_url, "kvplane_controller_route_seconds_count")
        cpu0, t0 = _cpu_seconds(controller.pid), time.monotonic()
        via = await _latencies([target], prompts, "gw")
        elapsed = time.monotonic() - t0
        # Above idle: the polls go on meanwhile, and at hundreds of engines they are not small.
        busy_cpu = _cpu_seconds(controller.pid) - cpu0 - idle_cpu * elapsed
        route_s = _metric(metrics_url, "kvplane_controller_route_seconds_sum") - route_s0
        routed = _metric(metrics_url, "kvplane_controller_route_seconds_count") - routed0
        # Spread over the engines as the gateway spreads them: one process serves them all, and
        # its own contention grows with N (the GIL, a thread per engine).
        direct = await _latencies(
            [f"127.0.0.1:{port}" for port in ports], _prompts(args.requests, 1), "direct"
        )
        print(
            f"      {len(prompts)} requests in {elapsed:.1f} s: via the gateway p50 "
            f"{statistics.median(via):.2f} ms, p99 {_percentile(via, 0.99):.2f}; straight to "
            f"the engines p50 {statistics.median(direct):.2f}, p99 "
            f"{_percentile(direct, 0.99):.2f}; controller CPU above idle "
            f"{busy_cpu / len(prompts) * 1e3:.2f} ms a request; route_seconds mean "
            f"{route_s / max(routed, 1) * 1e3:.3f} ms (load average {os.getloadavg()[0]:.2f})",
            flush=True,
        )
    finally:
        procs.stop(procs.procs[1:])  # the controller first: its streams end before the engines
        procs.stop()
    if times_file.exists() and not args.no_load:
        spent = {
            name: (float(seconds), int(calls))
            for name, seconds, calls in (
                line.split() for line in times_file.read_text().splitlines()
            )
        }
        print(
            "      CPU a call: "
            + "; ".join(
                f"Controller.{name} {seconds / max(calls, 1) * 1e3:.3f} ms"
                for name, (seconds, calls) in spent.items()
            ),
            flush=True,
        )


async def decisions(count: int, requests: int, *, no_model: bool = False) -> None:
    """CPU a request of the gateway's routing path over `count` ready engines (no gRPC);
    with `no_model`, of requests naming no model, checked first and each in a session."""
    from controller.config import ControllerConfig, RouterConfig
    from controller.registry import EngineIdentity, EngineState, ModelFacts, Role
    from controller.router import LoadSnapshot
    from controller.service import Controller, PromptInput
    from indexer.memory_backend import MemoryBackend

    controller = Controller(ControllerConfig(router=RouterConfig(seed=0)), MemoryBackend())
    registry = controller.fleet.registry
    facts = ModelFacts(block_size=16, total_kv_blocks=4096)
    rng = random.Random(0)
    for i in range(count):
        address = f"127.0.0.1:{20_000 + i}"
        registry.add(address)
        identity = EngineIdentity(
            f"e{i}", "sim", "0", Role.AGGREGATED, ("sim",), 16, 1, 1, "v1.0.0", (facts,)
        )
        registry.on_identity(address, identity)
        registry.on_health(address, EngineState.READY, 0.0)
        load = LoadSnapshot(rng.randrange(4), 0, rng.randrange(2048), 4096, rng.randrange(2048))
        registry.on_load(address, load)
    prompts = _prompts(requests, seed=count)
    started = time.thread_time()
    for i, tokens in enumerate(prompts):
        if no_model:
            query = PromptInput(f"r{i}", token_ids=tuple(tokens), session_key=f"s{i}")
            controller.check_model(query.model, generating=True)
        else:
            query = PromptInput(f"r{i}", token_ids=tuple(tokens), model="sim")
        disaggregated = controller.disaggregated(query.model)
        plan = await controller.plan(query, role=None if disaggregated else Role.AGGREGATED)
        controller.route(plan)
        controller.router.finish(query.request_id)
    spent = (time.thread_time() - started) / requests
    print(
        f"N={count:4d}: {spent * 1e6:7.0f} us CPU a request ({spent / count * 1e9:5.0f} ns an "
        f"engine) to {'check, ' if no_model else ''}plan and route"
        f"{' requests naming no model' if no_model else ''}, in process (load average "
        f"{os.getloadavg()[0]:.2f})",
        flush=True,
    )


def health_rounds(count: int, rounds: int) -> None:
    """CPU of a round of health answers over `count` engines, a quarter of them ejected and a
    quarter held down, all of them saying READY."""
    from controller.registry import (
        EjectionPolicy,
        EngineIdentity,
        EngineState,
        HoldDownPolicy,
        Registry,
        Role,
    )

    logging.getLogger("controller.registry").setLevel(logging.ERROR)  # a warning a hold-down
    # An ejection at the first failed request, a hold-down at the first flap, both outlasting
    # the run.
    long_s = 1e9
    registry = Registry(
        ejection=EjectionPolicy(after_failures=1, initial_s=long_s, max_s=long_s),
        hold_down=HoldDownPolicy(after_flaps=1, window_s=long_s, initial_s=long_s, max_s=long_s),
    )
    addresses = [f"127.0.0.1:{20_000 + i}" for i in range(count)]
    now_s = 0.0
    for i, address in enumerate(addresses):
        registry.add(address)
        identity = EngineIdentity(
            f"e{i}", "sim", "0", Role.AGGREGATED, ("sim",), 16, 1, 1, "v1.0.0"
        )
        registry.on_identity(address, identity)
        registry.on_health(address, EngineState.READY, now_s)
    for address in addresses[: count // 4]:
        registry.on_request_failed(address, now_s, "INTERNAL: device error")
    for address in addresses[count // 4 : count // 2]:
        registry.on_health(address, EngineState.NOT_READY, now_s)
        registry.on_health(address, EngineState.READY, now_s)
    states = collections.Counter(r.state.value for r in registry.records())
    started = time.thread_time()
    for _ in range(rounds):
        now_s += 1.0
        for address in addresses:
            registry.on_health(address, EngineState.READY, now_s)
    spent = (time.thread_time() - started) / rounds
    print(
        f"N={count:5d} ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))}): "
        f"{spent * 1e3:8.2f} ms CPU a round of health answers ({spent / count * 1e6:6.1f} us an "
        f"answer), in process (load average {os.getloadavg()[0]:.2f})",
        flush=True,
    )


async def main(args: argparse.Namespace) -> None:
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as scratch:
        for count in args.engines:
            if args.health_rounds is not None:
                health_rounds(count, args.health_rounds)
            elif args.decisions:
                await decisions(count, args.requests, no_model=args.no_model)
            else:
                await measure(count, args, Path(scratch))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--load-poll-s", type=float, default=0.5, help="health.load_poll_interval_s"
    )
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--decisions", action="store_true")
    parser.add_argument("--no-model", action="store_true", help="with --decisions")
    parser.add_argument("--health-rounds", type=int, default=None)
    parser.add_argument("--serve-engines", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engines is not None:
        asyncio.run(serve_engines(args.serve_engines, args.port_file))
    else:
        asyncio.run(main(args))
