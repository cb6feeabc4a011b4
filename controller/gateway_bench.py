"""`kvplane bench gateway`: what the controller adds to one request.

Sim engines (no compute time) and the controller run as their own processes, started by the
same launcher as `kvplane up` (`kvplane.up.fleet.Fleet`); requests go one at a time, directly to an
engine and through the gateway, in rotating order (controller.gateway_timing), so the
difference is the gateway's hop. With the relay floor on, a bare relay
(controller.relay_floor, its own process, in front of one more engine outside the
controller's fleet) is timed in the same rounds: the floor of any Python gRPC hop here."""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.gateway_timing import time_gateway_pairs, wait_routable
from kvplane.child_signals import signal_child
from kvplane.cli_common import OutputFormat, OutputOption, emit
from kvplane.errors import KvplaneError

RELAY_START_TIMEOUT_S = 60.0


def _fleet(num_engines: int, relay_floor: bool) -> Any:
    """Sim engines e0..e{n-1} behind a controller; with the relay floor, e{n} too: the bare
    relay's engine (the controller sees none of the relay's traffic, nor its KV events)."""
    from kvplane.up.config import FleetConfig

    engines = [
        {
            "name": f"e{i}",
            "kind": "engine",
            "config": {
                "instance_id": f"e{i}",
                "model": "sim",
                "num_kv_blocks": 4096,
                "sim": {"time_scale": 0},
            },
        }
        for i in range(num_engines + relay_floor)
    ]
    controller = {
        "name": "controller",
        "kind": "controller",
        "config": {"engines": [{"address": f"${{e{i}}}"} for i in range(num_engines)]},
    }
    return FleetConfig.model_validate({"members": [*engines, controller]})


async def _start_relay(target: str, workdir: Path) -> tuple[asyncio.subprocess.Process, str]:
    """The bare relay in its own process (it serves only Generate, so it is no fleet member:
    it has no config and no Health to wait on); its address once it listens."""
    port_file = workdir / "relay.port"
    log_path = workdir / "relay.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "controller.relay_floor",
            "--target", target, "--port-file", str(port_file),
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + RELAY_START_TIMEOUT_S
    while not (port_file.exists() and (port := port_file.read_text().strip())):
        if proc.returncode is not None or time.monotonic() > deadline:
            signal_child(proc, signal.SIGKILL)
            raise KvplaneError(f"the bare relay did not start (see {log_path})")
        await asyncio.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


async def _gateway_overhead(
    num_engines: int, num_requests: int, prompt_tokens: int, relay_floor: bool
) -> dict[str, Any]:
    from kvplane.up.fleet import Fleet

    with tempfile.TemporaryDirectory(prefix="kvplane-gateway-") as tmp:
        fleet = Fleet(_fleet(num_engines, relay_floor), Path(tmp))
        relay_proc = None
        try:
            await fleet.start()
            controller = fleet.member("controller")
            engines = [m.address for m in fleet.members if m.kind == "engine"]
            assert controller.address is not None and controller.pid is not None
            assert all(engines)  # start() waited for every member
            relay = relay_pid = None
            if relay_floor:
                relay_proc, relay = await _start_relay(str(engines[-1]), Path(tmp))
                relay_pid = relay_proc.pid
            await wait_routable(controller.address, num_engines)
            results = await time_gateway_pairs(
                controller.address,
                [str(engines[0])],
                model="sim",
                prompt=lambda i: [(i * 7 + j) % 30000 for j in range(prompt_tokens)],
                num_pairs=num_requests,
                max_tokens=4,
                controller_pid=controller.pid,
                relay=relay,
                relay_pid=relay_pid,
            )
        finally:
            if relay_proc is not None and relay_proc.returncode is None:
                signal_child(relay_proc, signal.SIGTERM)
                async with asyncio.timeout(30):
                    await relay_proc.wait()
            await fleet.stop()
    return {
        "engines": num_engines,
        "requests": num_requests,
        "prompt_tokens": prompt_tokens,
        **results,
    }


def bench_gateway(
    *,
    engines: Annotated[int, typer.Option(min=1, help="Sim engines behind the gateway.")] = 3,
    requests: Annotated[
        int, typer.Option(min=10, help="Request pairs: each sent direct and through the gateway.")
    ] = 300,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Tokens of each prompt.")] = 256,
    relay_floor: Annotated[
        bool, typer.Option(help="Also time a bare gRPC relay: the floor of any Python hop.")
    ] = True,
    output: OutputOption = OutputFormat.table,
) -> None:
    """What the controller adds to a request's latency.

    Sim engines (no compute time), sequential requests, direct and through the gateway (and a
    bare relay) in rotating order."""
    doc = asyncio.run(_gateway_overhead(engines, requests, prompt_tokens, relay_floor))
    emit(doc, output, render_table)


def render_table(doc: dict[str, Any]) -> str:
    lines = [
        f"{doc['requests']} sequential request pairs, {doc['prompt_tokens']} prompt tokens, "
        f"{doc['engines']} sim engines"
    ]
    for name in ("direct", "gateway", "relay"):
        if name not in doc:
            continue
        first, whole = doc[name]["first_response_ms"], doc[name]["request_ms"]
        lines.append(
            f"{name:<8} first response p50 {first['p50']:.2f} ms p99 {first['p99']:.2f} ms; "
            f"request p50 {whole['p50']:.2f} ms p99 {whole['p99']:.2f} ms"
        )
    for label, key in (("added", "added_ms"), ("relay added", "relay_added_ms")):
        if key in doc:
            added = doc[key]
            lines.append(
                f"{label:<8} p50 {added['p50']:.2f} ms p99 {added['p99']:.2f} ms; "
                f"paired median {added['paired_median']:.2f} ms"
            )
    cpu = f"controller CPU {doc['controller_cpu_ms_per_request']:.3f} ms a request"
    if "relay_cpu_ms_per_request" in doc:
        cpu += f"; bare relay {doc['relay_cpu_ms_per_request']:.3f} ms"
    lines.append(cpu)
    return "\n".join(lines)
