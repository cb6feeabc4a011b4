"""`kvplane bench route`: routing quality on a Mooncake-format trace, every policy side by
side over the same simulated fleet (controller.replay), optionally with Dynamo's own mocker
replay as peer rows (`--peer dynamo`, needs `pip install ai-dynamo-runtime==1.6.1`)."""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from controller.gateway_timing import time_gateway_pairs, wait_routable
from controller.replay import ReplaySettings, load_trace, oracle_hit_ratio, replay
from controller.router import POLICY_NAMES
from kvplane.cli_common import OutputFormat, OutputOption, emit
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

DYNAMO_RUNS = 3  # its kv_router breaks ties at random: average three runs


def run_route_bench(
    trace_path: Path,
    settings: ReplaySettings,
    policies: list[str],
    peer: str | None = None,
) -> dict[str, Any]:
    """The benchmark's JSON document (see the issue for its shape)."""
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise KvplaneError(f"unknown policies: {', '.join(unknown)}")
    trace = load_trace(trace_path)
    result: dict[str, Any] = {
        "trace": trace_path.name,
        "workers": settings.workers,
        "blocks_per_worker": settings.blocks_per_worker,
        "block_size": settings.block_size,
        "speedup": settings.speedup,
        "num_requests": len(trace),
        "oracle_hit_ratio": round(oracle_hit_ratio(trace, settings.block_size), 4),
        "policies": {},
    }
    for name in policies:
        started = time.monotonic()
        outcome = replay(trace, name, settings)
        log.debug("%s replayed in %.1fs", name, time.monotonic() - started)
        result["policies"][name] = outcome.to_json()
    if peer == "dynamo":
        result["policies"].update(_dynamo_rows(trace_path, settings))
    elif peer is not None:
        raise KvplaneError(f"unknown peer {peer!r} (supported: dynamo)")
    return result


def _dynamo_rows(trace_path: Path, settings: ReplaySettings) -> dict[str, Any]:
    # Dynamo logs every routing decision at INFO unless told otherwise.
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo import _core
    except ImportError as exc:
        raise KvplaneError(
            "--peer dynamo needs Dynamo's mocker: pip install ai-dynamo-runtime==1.6.1"
        ) from exc
    rows: dict[str, Any] = {}
    for mode in ("kv_router", "round_robin"):
        runs = []
        for _ in range(DYNAMO_RUNS if mode == "kv_router" else 1):
            report = _core.run_mocker_trace_replay(
                [str(trace_path)],
                extra_engine_args={
                    "engine": {
                        "block_size": settings.block_size,
                        "num_gpu_blocks": settings.blocks_per_worker,
                    }
                },
                num_workers=settings.workers,
                router_mode=mode,
                trace_block_size=settings.block_size,
                trace_format="mooncake",
                replay_mode="offline",
                arrival_speedup_ratio=settings.speedup,
            )
            runs.append(dict(report.summary))
        # Like for like: our reuse counts each request's cache hits at its first admission.
        # Dynamo's `prefix_cache_reused_ratio` also counts the hits of every re-admission
        # after a preemption, so it exceeds ours wherever requests are preempted.
        rows[f"dynamo_{mode}"] = {
            "hit_ratio": _mean_of(runs, "first_admission_prefix_cache_reused_ratio"),
            "prefix_cache_reused_ratio": _mean_of(runs, "prefix_cache_reused_ratio"),
            "ttft_ms": {
                "mean": _mean_of(runs, "mean_ttft_ms", 1),
                "p99": _mean_of(runs, "p99_ttft_ms", 1),
            },
            "runs": len(runs),
        }
    return rows


def _mean_of(runs: list[dict[str, float]], field: str, digits: int = 4) -> float:
    return round(statistics.fmean(run[field] for run in runs), digits)


def render_table(doc: dict[str, Any]) -> str:
    lines = [
        f"trace {doc['trace']}: {doc['workers']} workers x {doc['blocks_per_worker']} blocks "
        f"of {doc['block_size']} tokens, speedup {doc['speedup']}, "
        f"oracle reuse {doc['oracle_hit_ratio']:.3f}",
        f"{'policy':<22}{'reuse':>8}{'ttft mean':>11}{'p50':>8}{'p99':>9}"
        f"{'itl mean':>10}{'imbal.':>8}{'req/s':>8}",
    ]
    for name, row in doc["policies"].items():
        ttft = row.get("ttft_ms", {})
        itl = row.get("itl_ms", {}).get("mean")
        imbalance = row.get("imbalance")
        rps = row.get("throughput_rps")
        lines.append(
            f"{name:<22}{row['hit_ratio']:>8.3f}{ttft.get('mean', 0):>11.1f}"
            f"{_cell(ttft.get('p50'), 8, 1)}{_cell(ttft.get('p99'), 9, 1)}"
            f"{_cell(itl, 10, 2)}{_cell(imbalance, 8, 3)}{_cell(rps, 8, 2)}"
        )
    return "\n".join(lines)


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def bench_route(
    *,
    trace: Annotated[Path, typer.Option("--trace", help="Mooncake-format JSONL trace.")],
    workers: Annotated[int, typer.Option(min=1)] = 8,
    blocks_per_worker: Annotated[int, typer.Option(min=1)] = 2048,
    block_size: Annotated[int, typer.Option(min=1)] = 512,
    speedup: Annotated[float, typer.Option(min=0.001)] = 1.0,
    policies: Annotated[
        str, typer.Option(help="Comma-separated policies (default: all).")
    ] = ",".join(POLICY_NAMES),
    peer: Annotated[str | None, typer.Option(help="Also run a peer's own replay: dynamo.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the router's randomness.")] = 0,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Routing quality on a real trace: reuse, TTFT, ITL, imbalance per policy."""
    settings = ReplaySettings(
        workers=workers,
        blocks_per_worker=blocks_per_worker,
        block_size=block_size,
        speedup=speedup,
        seed=seed,
    )
    names = [p.strip() for p in policies.split(",") if p.strip()]
    doc = run_route_bench(trace, settings, names, peer)
    emit(doc, output, render_table)


async def _spawn(
    args: list[str], port_file: Path, log_path: Path, module: str = "kvplane"
) -> tuple[Any, int]:
    import asyncio
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        "--port-file",
        str(port_file),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log_path.open("wb"),
    )
    deadline = time.monotonic() + 60
    while not (text := await asyncio.to_thread(_read_port, port_file)):
        if proc.returncode is not None or time.monotonic() > deadline:
            raise KvplaneError(f"{module} {args[0]} did not start (see {log_path})")
        await asyncio.sleep(0.05)
    return proc, int(text)


def _read_port(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


async def _gateway_overhead(
    num_engines: int, num_requests: int, prompt_tokens: int, relay_floor: bool
) -> dict[str, Any]:
    """Time to first response and to the end of the stream, calling a sim engine directly and
    through the controller, one request at a time (the difference is what the gateway adds). Engines
    and controller run as their own processes, as deployed. With `relay_floor`, a bare relay
    (controller.relay_floor, its own process too) to an engine of its own is timed in the
    same rounds: the floor of a Python gRPC hop on this machine."""
    import asyncio
    import tempfile

    procs: list[Any] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            ports = []
            # The bare relay's engine is one more like the others, outside the controller's
            # fleet: the controller sees none of the relay's traffic (nor its KV events).
            for i in range(num_engines + (1 if relay_floor else 0)):
                cfg = work / f"e{i}.yaml"
                cfg.write_text(
                    f"listen: 127.0.0.1:0\ninstance_id: e{i}\nmodel: sim\n"
                    "num_kv_blocks: 4096\nsim: {time_scale: 0}\n"
                )
                proc, port = await _spawn(
                    ["engine", "serve", "--config", str(cfg)],
                    work / f"e{i}.port",
                    work / f"e{i}.log",
                )
                procs.append(proc)
                ports.append(port)
            cfg = work / "controller.yaml"
            cfg.write_text(
                "listen: 127.0.0.1:0\nengines:\n"
                + "".join(f"  - {{address: 127.0.0.1:{p}}}\n" for p in ports[:num_engines])
            )
            proc, controller_port = await _spawn(
                ["controller", "serve", "--config", str(cfg)], work / "c.port", work / "c.log"
            )
            procs.append(proc)
            controller_pid = proc.pid
            relay = relay_pid = None
            if relay_floor:
                proc, relay_port = await _spawn(
                    ["--target", f"127.0.0.1:{ports[num_engines]}"],
                    work / "relay.port",
                    work / "relay.log",
                    module="controller.relay_floor",
                )
                procs.append(proc)
                relay, relay_pid = f"127.0.0.1:{relay_port}", proc.pid
            gateway = f"127.0.0.1:{controller_port}"
            await wait_routable(gateway, num_engines)
            results = await time_gateway_pairs(
                gateway,
                [f"127.0.0.1:{ports[0]}"],
                model="sim",
                prompt=lambda i: [(i * 7 + j) % 30000 for j in range(prompt_tokens)],
                num_pairs=num_requests,
                max_tokens=4,
                controller_pid=controller_pid,
                relay=relay,
                relay_pid=relay_pid,
            )
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
            for proc in procs:
                await asyncio.wait_for(proc.wait(), 30)
    return {
        "engines": num_engines,
        "requests": num_requests,
        "prompt_tokens": prompt_tokens,
        **results,
    }


def bench_gateway(
    *,
    engines: Annotated[int, typer.Option(min=1)] = 3,
    requests: Annotated[int, typer.Option(min=10)] = 300,
    prompt_tokens: Annotated[int, typer.Option(min=1)] = 256,
    relay_floor: Annotated[
        bool, typer.Option(help="Also time a bare gRPC relay: the floor of any Python hop.")
    ] = True,
    output: OutputOption = OutputFormat.table,
) -> None:
    """What the controller adds to a request: sim engines (no compute time), sequential
    requests, direct and through the gateway (and a bare relay) in rotating order."""
    import asyncio

    doc = asyncio.run(_gateway_overhead(engines, requests, prompt_tokens, relay_floor))

    def render(d: dict[str, Any]) -> str:
        lines = [
            f"{d['requests']} sequential request pairs, {d['prompt_tokens']} prompt tokens, "
            f"{d['engines']} sim engines"
        ]
        for name in ("direct", "gateway", "relay"):
            if name not in d:
                continue
            f, t = d[name]["first_response_ms"], d[name]["request_ms"]
            lines.append(
                f"{name:<8} first response p50 {f['p50']:.2f} ms p99 {f['p99']:.2f} ms; "
                f"request p50 {t['p50']:.2f} ms p99 {t['p99']:.2f} ms"
            )
        for label, key in (("added", "added_ms"), ("relay added", "relay_added_ms")):
            if key in d:
                added = d[key]
                lines.append(
                    f"{label:<8} p50 {added['p50']:.2f} ms p99 {added['p99']:.2f} ms; "
                    f"paired median {added['paired_median']:.2f} ms"
                )
        cpu = f"controller CPU {d['controller_cpu_ms_per_request']:.3f} ms a request"
        if "relay_cpu_ms_per_request" in d:
            cpu += f"; bare relay {d['relay_cpu_ms_per_request']:.3f} ms"
        lines.append(cpu)
        return "\n".join(lines)

    emit(doc, output, render)
