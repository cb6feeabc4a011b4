"""`kvplane indexer ...` commands: `serve` (the indexer service) and `bridge` (a ZMQ KV-event
stream -> ApplyExternalKvBatch against any KVIndexer)."""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from indexer.config import IndexerConfig
from indexer.zmq_decode import ArrayTail
from kvplane.cli_common import (
    ConfigOption,
    ListenOption,
    PortFileOption,
    TlsCaOption,
    TlsCertOption,
    TlsKeyOption,
    TlsServerNameOption,
    client_channels,
    load_command_config,
    target_option,
    usage_error_for,
)
from kvplane.config import check_zmq_endpoint
from kvplane.zmq_heartbeat import DEFAULT_HEARTBEAT, Heartbeat
from kvplane.zmq_heartbeat import seconds_problem as heartbeat_seconds_problem

indexer_app = typer.Typer(no_args_is_help=True)


@indexer_app.command()
def serve(
    config: ConfigOption = None, listen: ListenOption = None, port_file: PortFileOption = None
) -> None:
    """Serve kv_indexer.v1.KVIndexer and kvplane's token-level match API."""
    import uvloop

    from indexer.service import run_indexer

    cfg = load_command_config(IndexerConfig, config, {"listen": listen})
    # On uvloop, like the controller: grpc.aio wakes the loop for every completed operation,
    # and a match costs the server about a tenth less CPU (docs/benchmarks/index.md).
    uvloop.run(run_indexer(cfg, port_file=port_file))


def _medium(option: str, value: str, *, skip: bool = True) -> Any:
    """The tier an option names (None for "skip", where the option takes it)."""
    from indexer.batch import Tier

    upper = value.upper()
    if skip and upper == "SKIP":
        return None
    if upper not in ("HBM", "DRAM", "SSD"):
        choices = "HBM, DRAM, SSD or skip" if skip else "HBM, DRAM or SSD"
        raise typer.BadParameter(f"expected {choices}, got {value!r}", param_hint=option)
    return Tier[upper]


def _check_endpoint(option: str, endpoint: str, *, bind: bool = False) -> None:
    """The rules `indexer serve` applies to a source's endpoints (`check_zmq_endpoint`), as a
    usage error naming the option."""
    with usage_error_for(option):
        check_zmq_endpoint(endpoint, bind=bind)


async def _until_signal(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` until it ends or SIGTERM/SIGINT arrives (then cancel it)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@indexer_app.command()
def bridge(
    *,
    endpoint: Annotated[
        str, typer.Option(help="ZMQ PUB endpoint, e.g. tcp://HOST:5557 or tcp://[IPV6]:5557.")
    ],
    target: Annotated[str, target_option("KVIndexer HOST:PORT.")],
    worker_id: Annotated[str, typer.Option(help="worker_id sent with every batch.")],
    worker_address: Annotated[
        str, typer.Option(help="Router-facing address reported in prefix matches.")
    ] = "",
    replay_endpoint: Annotated[
        str | None, typer.Option(help="The publisher's replay ROUTER endpoint.")
    ] = None,
    topic: Annotated[
        str, typer.Option(help="Topic prefix (messages without a topic frame pass too).")
    ] = "",
    bind: Annotated[bool, typer.Option(help="Bind the SUB (publisher connects).")] = False,
    array_tail: Annotated[
        ArrayTail,
        typer.Option(
            help="Array-form events' fields at index >= 7: vllm (vLLM's: LoRA name, extra "
            "keys, a hybrid model's KV cache group) or ignore (engine-specific there)."
        ),
    ] = "ignore",
    hash_mode: Annotated[
        str, typer.Option("--hash", help="engine (engine hashes) or canonical (kvplane keys).")
    ] = "engine",
    block_size: Annotated[
        int | None, typer.Option(help="Block size for events without one (canonical).")
    ] = None,
    nil_medium: Annotated[
        str, typer.Option(help="Tier for events with a nil medium: HBM, DRAM, SSD or skip.")
    ] = "skip",
    external_medium: Annotated[
        str, typer.Option(help="Tier for medium EXTERNAL: HBM, DRAM, SSD or skip.")
    ] = "skip",
    clear_tier: Annotated[
        list[str] | None,
        typer.Option(help="Tier AllBlocksCleared clears (repeat; default all three)."),
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="File with the bearer token for ApplyExternalKvBatch.")
    ] = None,
    tls_ca: TlsCaOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_server_name: TlsServerNameOption = None,
    probe_interval_s: Annotated[
        float,
        typer.Option(
            help="Seconds between probes that the target still holds the worker (0: off)."
        ),
    ] = 2.0,
    heartbeat_interval_s: Annotated[
        float, typer.Option(help="Seconds between ZMTP pings to the publisher.")
    ] = DEFAULT_HEARTBEAT.interval_s,
    heartbeat_timeout_s: Annotated[
        float,
        typer.Option(
            help="Seconds without an answer to a ping before the publisher counts as gone "
            "(its worker is cleared until it is back)."
        ),
    ] = DEFAULT_HEARTBEAT.timeout_s,
) -> None:
    """Bridge a vLLM/SGLang ZMQ KV-event stream into ApplyExternalKvBatch calls."""
    from indexer.batch import Tier
    from indexer.bridge import BridgeSettings, run_bridge
    from indexer.translate import ALL_TIERS, HashMode, MediumMap
    from indexer.validation import MAX_UINT32, worker_name_problem
    from kvplane.channels import INSECURE

    if hash_mode not in {m.value for m in HashMode}:
        raise typer.BadParameter(
            f"must be engine or canonical, got {hash_mode!r}", param_hint="--hash"
        )
    mode = HashMode(hash_mode)
    _check_endpoint("--endpoint", endpoint, bind=bind)
    if replay_endpoint is not None:
        _check_endpoint("--replay-endpoint", replay_endpoint)
    if not worker_id:
        raise typer.BadParameter("must not be empty", param_hint="--worker-id")
    # The names every batch carries: one the target refuses would fail every apply.
    for option, field, name in (
        ("--worker-id", "worker_id", worker_id),
        ("--worker-address", "worker_address", worker_address),
    ):
        problem = worker_name_problem(field, name)
        if problem is not None:
            raise typer.BadParameter(problem, param_hint=option)
    if block_size is not None and not 0 < block_size <= MAX_UINT32:
        raise typer.BadParameter(
            f"must be between 1 and {MAX_UINT32}, got {block_size}", param_hint="--block-size"
        )
    if not 0 <= probe_interval_s < math.inf:
        raise typer.BadParameter(
            f"must be 0 (off) or a positive, finite number of seconds, got {probe_interval_s}",
            param_hint="--probe-interval-s",
        )
    heartbeat = Heartbeat(heartbeat_interval_s, heartbeat_timeout_s)
    for option, value in (
        ("--heartbeat-interval-s", heartbeat_interval_s),
        ("--heartbeat-timeout-s", heartbeat_timeout_s),
    ):
        problem = heartbeat_seconds_problem(value)
        if problem is not None:
            raise typer.BadParameter(problem, param_hint=option)
    clear_tiers: tuple[Tier, ...] = ALL_TIERS
    if clear_tier:
        clear_tiers = tuple(_medium("--clear-tier", t, skip=False) for t in clear_tier)
    channels = client_channels(tls_ca, tls_cert, tls_key, tls_server_name) or INSECURE
    with usage_error_for("--token-file"):  # followed as it changes, as every token file
        channels = channels.with_token_file(token_file, "token file")
    settings = BridgeSettings(
        endpoint=endpoint,
        target=target,
        worker_id=worker_id,
        worker_address=worker_address,
        replay_endpoint=replay_endpoint,
        topic=topic,
        bind=bind,
        array_tail=array_tail,
        hash_mode=mode,
        media=MediumMap(
            nil=_medium("--nil-medium", nil_medium),
            external=_medium("--external-medium", external_medium),
        ),
        clear_tiers=clear_tiers,
        block_size=block_size,
        channels=channels,
        probe_interval_s=probe_interval_s,
        heartbeat=heartbeat,
    )
    asyncio.run(_until_signal(run_bridge(settings)))
