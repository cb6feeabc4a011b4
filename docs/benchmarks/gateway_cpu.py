"""The controller's CPU a gateway Generate request, beside a bare relay's, for one or more
source trees side by side (before and after a change).

    python docs/benchmarks/gateway_cpu.py [--engines 8] [--requests 500] [--rounds 6]
        [--idle-s 5] [--tree NAME=PATH ...] [--no-relay]

One process serves the sim engines (`fleet_scale.py`'s engine host: `time_scale: 0`, one
grpc.aio server each); each tree (default: this checkout) runs one `kvplane controller serve`
(its code from PATH, PYTHONPATH=PATH:PATH/proto) in front of `--engines` engines of its own,
with the default settings (embedded index, KV events over SubscribeKvEvents, the default
polls); the bare relay (`controller.relay_floor`, this checkout's) stands in front of one
more engine. After a warm-up, each process's idle CPU rate is read over `--idle-s`; then each
round sends `--requests` Generate calls (fleet_scale's prompts: 512 tokens, 384 of them one of
16 prefixes, `max_tokens` 4) to every target in turn, first one at a time, then 8 at a time,
the order of the targets reversed every other round. Printed: each target's CPU a request
(user + system from /proc, above its idle rate) and its main thread's (the event loop's;
the rest is grpc's poller and event-engine threads), per round, then the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleet_scale import (
    CLOCK_TICKS,
    _all_routable,
    _cpu_seconds,
    _latencies,
    _prompts,
    _wait_file,
)

CHECKOUT = Path(__file__).resolve().parents[2]
CONCURRENCY = (1, 8)


def _thread_cpu_seconds(pid: int) -> float:
    """CPU of the process's main thread (the event loop's)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def measure(args: argparse.Namespace, workdir: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str], tree: Path = CHECKOUT) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'proto'}"}
        with (workdir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        return proc

    try:
        trees: list[tuple[str, Path]] = args.tree
        port_file = workdir / "engines.ports"
        count = args.engines * len(trees) + 1
        host = start(
            "engines",
            [
                sys.executable,
                str(Path(__file__).with_name("fleet_scale.py")),
                "--serve-engines",
                str(count),
                "--port-file",
                str(port_file),
            ],
        )
        ports = _wait_file(port_file, host).split()
        targets: list[tuple[str, str, int]] = []  # name, address, pid
        for i, (name, tree) in enumerate(trees):
            config = workdir / f"{name}.yaml"
            mine = ports[i * args.engines : (i + 1) * args.engines]
            config.write_text(
                "listen: 127.0.0.1:0\nrouter: {seed: 0}\nengines:\n"
                + "".join(f"  - {{address: 127.0.0.1:{p}}}\n" for p in mine)
            )
            own_port = workdir / f"{name}.port"
            proc = start(
                name,
                [
                    sys.executable,
                    "-m",
                    "kvplane",
                    "controller",
                    "serve",
                    "--config",
                    str(config),
                    "--port-file",
                    str(own_port),
                ],
                tree,
            )
            targets.append((name, f"127.0.0.1:{_wait_file(own_port, proc).strip()}", proc.pid))
        for _, address, _ in targets:
            await _all_routable(address, args.engines)
        if not args.no_relay:
            relay_port = workdir / "relay.port"
            proc = start(
                "relay",
                [
                    sys.executable,
                    "-m",
                    "controller.relay_floor",
                    "--target",
                    f"127.0.0.1:{ports[-1]}",
                    "--port-file",
                    str(relay_port),
                ],
            )
            targets.append(("relay", f"127.0.0.1:{_wait_file(relay_port, proc).strip()}", proc.pid))
        for name, address, _ in targets:  # warm-up: channels, caches, the index
            await _latencies([address], _prompts(50, 99), f"warm-{name}", 8)
        await asyncio.sleep(3)
        before = {name: _cpu_seconds(pid) for name, _, pid in targets}
        started = time.monotonic()
        await asyncio.sleep(args.idle_s)
        elapsed = time.monotonic() - started
        idle = {name: (_cpu_seconds(pid) - before[name]) / elapsed for name, _, pid in targets}
        print(
            "idle CPU: "
            + ", ".join(f"{n} {r * 100:.1f}%" for n, r in idle.items())
            + f" of a core (load average {os.getloadavg()[0]:.2f})",
            flush=True,
        )
        results: dict[tuple[int, str], list[tuple[float, float]]] = {}
        seed = 0
        for round_ in range(args.rounds):
            for concurrency in CONCURRENCY:
                for name, address, pid in targets if round_ % 2 == 0 else targets[::-1]:
                    seed += 1
                    prompts = _prompts(args.requests, seed)
                    cpu, main = _cpu_seconds(pid), _thread_cpu_seconds(pid)
                    started = time.monotonic()
                    await _latencies([address], prompts, f"{name}-{seed}", concurrency)
                    elapsed = time.monotonic() - started
                    per = (_cpu_seconds(pid) - cpu - idle[name] * elapsed) / len(prompts) * 1e3
                    main_per = (_thread_cpu_seconds(pid) - main) / len(prompts) * 1e3
                    results.setdefault((concurrency, name), []).append((per, main_per))
                    print(
                        f"round {round_} x{concurrency} {name:>8}: {per:.2f} ms CPU a "
                        f"request above idle (main thread {main_per:.2f} ms) (load average "
                        f"{os.getloadavg()[0]:.2f})",
                        flush=True,
                    )
        for (concurrency, name), values in sorted(results.items()):
            print(
                f"x{concurrency} {name:>8}: median {statistics.median(v for v, _ in values):.2f} "
                f"ms (main thread {statistics.median(m for _, m in values):.2f}); runs "
                + ", ".join(f"{v:.2f}" for v, _ in values)
            )
    finally:
        for proc in reversed(procs):  # the controllers and the relay before the engines
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _tree(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not Path(path, "kvplane").is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH of a kvplane tree: {value!r}")
    return name, Path(path).resolve()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--tree", type=_tree, nargs="+", default=[("this", CHECKOUT)])
    parser.add_argument("--no-relay", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gateway-cpu-") as scratch:
        asyncio.run(measure(args, Path(scratch)))
