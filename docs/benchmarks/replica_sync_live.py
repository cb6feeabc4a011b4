"""Two controller replicas in front of four sim engines, live, with and without
`router.replica_sync`: the TTFT of bursts sent to the two replicas in turn.

    python docs/benchmarks/replica_sync_live.py [--rounds 2] [--bursts 16]

Starts a private redis-server (the replicas' shared index; `scripts/ensure_redis.sh` installs
one), four `kvplane engine serve --model sim` processes in real time (`time_scale: 1`, the
trace replay's timing model), and for each mode two `kvplane controller serve` processes on
that Redis. Each burst is eight prompts of distinct tokens (no prefix shared, so only load
decides), one every 5 ms, given to the replicas in turn: first a long one (16,384 tokens: 400 ms
of prefill alone, in passes of 2,048 tokens), then seven of 512; a burst every second; every
run its own tokens, so nothing is cached from an earlier one. A replica that does not know of
the long prompt its peer just sent sees its engine idle until the next load poll. Each
round runs both modes, the first of them taking turns, so both see the machine alike. Prints
TTFT mean / p50 / p99 per mode and round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

KVPLANE = [sys.executable, "-m", "kvplane"]
ENGINES = 4
BURST = 8
SPACING_S = 0.005
LONG_PROMPT_TOKENS = 16_384  # the first of each burst: 8 passes of 2,048 tokens
SHORT_PROMPT_TOKENS = 512


def _wait_port(path: Path, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}")
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise SystemExit(f"no port in {path}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(proc)
        return proc

    def serve(self, name: str, kind: str, config: str) -> str:
        path = self.workdir / f"{name}.yaml"
        path.write_text(config)
        port_file = self.workdir / f"{name}.port"
        proc = self.start(
            name, [*KVPLANE, kind, "serve", "--config", str(path), "--port-file", str(port_file)]
        )
        return f"127.0.0.1:{_wait_port(port_file, proc)}"

    def stop(self, procs: list[subprocess.Popen[bytes]] | None = None) -> None:
        targets = self.procs if procs is None else procs
        for proc in targets:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in targets:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = [p for p in self.procs if p not in targets]


async def _routable(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        admin = apb_grpc.AdminStub(channel)
        while True:
            workers = (await admin.ListWorkers(apb.ListWorkersRequest())).workers
            if len(workers) == ENGINES and all(w.routable for w in workers):
                return
            await asyncio.sleep(0.1)


async def _ttft(
    stub: pb_grpc.OpenEngineAsyncStub, request_id: str, length: int, rng: random.Random
) -> float:
    tokens = [rng.randrange(1, 30_000) for _ in range(length)]
    request = pb.GenerateRequest(
        request_id=request_id,
        model="sim",
        token_ids=pb.TokenIds(ids=tokens),
        stopping=pb.StoppingOptions(max_tokens=16, ignore_eos=True),
    )
    started = time.perf_counter()
    first = None
    async for response in stub.Generate(request):
        if first is None and response.WhichOneof("event") in ("token", "finished"):
            first = time.perf_counter() - started
    return (first or 0.0) * 1000.0


async def _drive(targets: list[str], bursts: int, tag: str) -> list[float]:
    rng = random.Random(tag)  # prompts of their own: nothing cached by an earlier run
    channels = [grpc.aio.insecure_channel(t) for t in targets]
    stubs: list[pb_grpc.OpenEngineAsyncStub] = [pb_grpc.OpenEngineStub(c) for c in channels]
    tasks: list[asyncio.Task[float]] = []
    try:
        for burst in range(bursts):
            for i in range(BURST):
                stub = stubs[(burst * BURST + i) % len(stubs)]
                length = LONG_PROMPT_TOKENS if i == 0 else SHORT_PROMPT_TOKENS
                request_id = f"{tag}-{burst}-{i}"
                tasks.append(asyncio.create_task(_ttft(stub, request_id, length, rng)))
                await asyncio.sleep(SPACING_S)
            await asyncio.sleep(1.0 - BURST * SPACING_S)
        return list(await asyncio.gather(*tasks))
    finally:
        for channel in channels:
            await channel.close()


def _summary(ttfts: list[float]) -> str:
    ordered = sorted(ttfts)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"TTFT mean {statistics.fmean(ttfts):7.1f} ms, p50 {statistics.median(ttfts):7.1f}, "
        f"p99 {p99:7.1f} ({len(ttfts)} requests)"
    )


async def main(rounds: int, bursts: int) -> None:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("needs redis-server (bash scripts/ensure_redis.sh)")
    with tempfile.TemporaryDirectory(prefix="replica-sync-") as scratch:
        workdir = Path(scratch)
        procs = Processes(workdir)
        try:
            port = _free_port()
            procs.start(
                "redis",
                [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(workdir)],
            )  # fmt: skip
            await asyncio.sleep(0.5)
            engines = [
                procs.serve(
                    f"e{i}",
                    "engine",
                    f"listen: 127.0.0.1:0\ninstance_id: e{i}\nmodel: sim\nnum_kv_blocks: 8192\n"
                    "max_model_len: 32768\n"
                    "sim: {time_scale: 1}\n",
                )
                for i in range(ENGINES)
            ]
            listed = "".join(f"  - {{address: {a}}}\n" for a in engines)
            for round_number in range(rounds):
                # Each round starts with the other mode: neither always meets a fresh fleet.
                for sync in (False, True) if round_number % 2 == 0 else (True, False):
                    config = (
                        "listen: 127.0.0.1:0\n"
                        f"index: {{backend: 'redis://127.0.0.1:{port}/0', "
                        f"redis: {{key_prefix: r{round_number}{int(sync)}}}}}\n"
                        f"router: {{replica_sync: {str(sync).lower()}}}\nengines:\n{listed}"
                    )
                    before = len(procs.procs)
                    targets = [
                        procs.serve(f"c{n}-{round_number}-{int(sync)}", "controller", config)
                        for n in range(2)
                    ]
                    controllers = procs.procs[before:]
                    for target in targets:
                        await _routable(target)
                    await asyncio.sleep(1.5)  # the replicas have heard of each other
                    ttfts = await _drive(targets, bursts, f"{round_number}{int(sync)}")
                    mode = "in sync" if sync else "apart  "
                    print(f"round {round_number} {mode}: {_summary(ttfts)}", flush=True)
                    procs.stop(controllers)
        finally:
            procs.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.bursts))
