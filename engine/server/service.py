"""Assemble and run one engine process: runner, core, engine thread, servers, publishers.

`start_engine(config)` builds everything in the running event loop and returns an
`EngineApp` whose gRPC server is bound and serving (port 0 picks a free port: tests and
`kvplane up` read `app.port`); `kvplane.v1.KvTransfer` (KV sessions of PREFILL engines) is
served on the same port. The engine thread starts last, after every publisher is
attached, so no KV event batch is ever missing from the ZMQ stream. `run_engine` serves until
SIGTERM/SIGINT, then drains: no new requests, in-flight ones get `shutdown_grace_s`, the rest
are cancelled, subscriptions end, the thread stops.

torch is imported only when `config.model` is a model directory or `builtin` (never for
`sim`).

`runner` is resolved here, against the checkpoint (`_generates`): a pooling-only engine loads
no LM head and sizes its KV cache at one block (the block manager needs a pool; pooling
forwards run on the pooler's own scratch cache and nothing else ever runs), whatever
`num_kv_blocks`/`kv_cache_bytes` say.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from engine.config import (
    EngineConfig,
    EngineRoleName,
    GenerationConfigSource,
    RunnerName,
    check_model_source,
)
from engine.core.api import ModelRunner, SamplingDefaults, SchedulerConfig, StepReport
from engine.core.engine_core import EngineCore, EngineLoop
from engine.core.pooling import Pooler
from engine.server.engine_service import EngineService
from engine.server.info import ServedModel, kv_connector_info
from engine.server.kv_event_log import KvEventLog
from engine.server.kv_pull import KvSessionPuller
from engine.server.kv_transfer import PROTOCOL, KvTransferServicer
from engine.server.lora_service import LoraService
from engine.server.metrics import EngineMetrics
from engine.server.openengine_convert import EngineContext
from engine.server.openengine_servicer import OpenEngineServicer
from engine.server.pooling_tasks import PoolingTasks
from engine.server.runtime_events import RuntimeEventHub
from engine.server.vllm_servicer import VllmGenerateServicer
from engine.server.zmq_publisher import ZmqKvPublisher, routable_host_port
from kvplane.config import BIND_WILDCARD_HOSTS, join_host_port, parse_host_port
from kvplane.metrics import start_metrics_server
from kvplane.server import create_server, publish_port, serve_until_signal
from kvplane.zmq_ip import is_ipv4_wildcard
from openengine.v1 import openengine_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_NUM_KV_BLOCKS = 1024
# A pooling-only engine's KV cache: the least the block manager accepts, never written.
POOLING_NUM_KV_BLOCKS = 1
DEFAULT_SIM_MAX_MODEL_LEN = 4096

_ROLE = {
    EngineRoleName.aggregated: pb.ENGINE_ROLE_AGGREGATED,
    EngineRoleName.prefill: pb.ENGINE_ROLE_PREFILL,
    EngineRoleName.decode: pb.ENGINE_ROLE_DECODE,
}


@dataclass(frozen=True, slots=True)
class _Model:
    runner: ModelRunner
    tokenizer: Any | None  # tokenizers.Tokenizer
    vocab_size: int
    pooler: Pooler | None = None  # Embed/Classify/Score (a torch model's)
    generates: bool = True  # False: runner pooling (then `pooler` is set)
    # What a request's unset sampling options take (the checkpoint's generation_config.json).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


def _build_sim(config: EngineConfig) -> _Model:
    from engine.core.sim_runner import SimRunner, TimingModel

    sim = config.sim
    defaults = TimingModel()
    timing = TimingModel(
        prefill_ms_coeffs=sim.prefill_ms_coeffs or defaults.prefill_ms_coeffs,
        decode_ms_coeffs=sim.decode_ms_coeffs or defaults.decode_ms_coeffs,
        min_decode_ms=defaults.min_decode_ms if sim.min_decode_ms is None else sim.min_decode_ms,
    )
    runner = SimRunner(
        block_size=config.block_size,
        num_blocks=config.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS,
        max_model_len=config.max_model_len or DEFAULT_SIM_MAX_MODEL_LEN,
        vocab_size=sim.vocab_size,
        eos_after=sim.eos_after,
        timing=timing,
        time_scale=sim.time_scale,
    )
    return _Model(runner, None, sim.vocab_size)


def _build_torch(config: EngineConfig) -> _Model:
    check_model_source(config.model)
    model_dir = Path(config.model)
    if config.is_builtin:
        from engine.torch_runner.builtin_model import ensure_builtin_model

        model_dir = ensure_builtin_model()
    from tokenizers import Tokenizer as HfTokenizer

    from engine.torch_runner.pooling import TorchPooler  # imports torch
    from engine.torch_runner.runner import TorchModelRunner

    generates = _generates(config, model_dir)
    # Read before the weights: a bad file is refused at once, never per request.
    defaults = _sampling_defaults(config, model_dir) if generates else SamplingDefaults()
    num_blocks: int | None = POOLING_NUM_KV_BLOCKS
    kv_cache_bytes = None
    if generates:
        kv_cache_bytes = config.kv_cache_bytes
        num_blocks = config.num_kv_blocks
        if num_blocks is None and kv_cache_bytes is None:
            num_blocks = DEFAULT_NUM_KV_BLOCKS
    elif config.num_kv_blocks is not None or config.kv_cache_bytes is not None:
        log.warning(
            "runner pooling keeps no KV cache: num_kv_blocks and kv_cache_bytes are ignored"
        )
    runner = TorchModelRunner.from_pretrained(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        block_size=config.block_size,
        num_blocks=num_blocks,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=config.max_model_len,
        seed=config.seed,
        num_threads=config.num_threads,
        with_lm_head=generates,
    )
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer = HfTokenizer.from_file(str(tokenizer_file)) if tokenizer_file.is_file() else None
    pooler = TorchPooler.for_model_dir(runner, model_dir)
    return _Model(runner, tokenizer, runner.model.config.vocab_size, pooler, generates, defaults)


def _sampling_defaults(config: EngineConfig, model_dir: Path) -> SamplingDefaults:
    """The checkpoint's sampling defaults under `generation_config: auto` (CheckpointError
    for a bad file), none under `none`."""
    if config.generation_config is GenerationConfigSource.none:
        return SamplingDefaults()
    from engine.torch_runner.generation_config import GENERATION_CONFIG_FILE, sampling_defaults

    defaults = sampling_defaults(model_dir)
    if defaults != SamplingDefaults():
        # As vLLM warns: a deployment expecting the engine's own defaults learns why not.
        log.warning(
            "requests that leave them unset sample with %s's defaults: %s (set "
            "generation_config: none for the engine's own)",
            model_dir / GENERATION_CONFIG_FILE,
            defaults.describe(),
        )
    return defaults


def _generates(config: EngineConfig, model_dir: Path) -> bool:
    """`runner` resolved for this checkpoint (`EngineConfig.pools_only`)."""
    if not config.pools_only(model_dir):
        return True
    if config.runner is RunnerName.auto:
        log.info("runner auto: %s has no LM head, serving Embed/Classify/Score only", model_dir)
    return False


def advertised_host(config: EngineConfig) -> str:
    """A host others can dial: configured, else the listen host, else this machine's address
    (`own_address`) in the IP version the listen wildcard names."""
    if config.kv_events.advertised_host:
        return config.kv_events.advertised_host
    host, _ = parse_host_port(config.listen)
    if host not in BIND_WILDCARD_HOSTS:
        return host
    return own_address(host)


def own_address(
    wildcard: str,
    route_address: Callable[[socket.AddressFamily], str | None] | None = None,
    host_name_addresses: Callable[[], list[tuple[socket.AddressFamily, str]]] | None = None,
    *,
    dual_stack: bool = True,
) -> str:
    """This machine's address for a server bound to `wildcard`: `::` prefers IPv6, `*` and
    0.0.0.0 IPv4, then, for a `dual_stack` server (gRPC binds either wildcard dual-stack), the
    other version, dialable too (e.g. on an IPv6-only host). In that order of versions: the
    address of the interface with a route out, else one the host name resolves to, else
    loopback. A loopback result (no route, and a hosts file mapping the name to 127.0.x.x, as
    Debian's does) reaches this machine only: a warning says to set the host. The lookups are
    parameters so that a test can give any host's view of its addresses."""
    route_address = route_address or _route_address
    host_name_addresses = host_name_addresses or _host_name_addresses
    ipv6_first = wildcard in ("::", "[::]")
    families: tuple[socket.AddressFamily, ...] = (
        (socket.AF_INET6, socket.AF_INET) if ipv6_first else (socket.AF_INET, socket.AF_INET6)
    )
    if not dual_stack:
        families = families[:1]
    found = next((a for f in families if (a := route_address(f))), None)
    if found is None:
        named = host_name_addresses()
        found = next((a for f in families for family, a in named if family == f), None)
    if found is None:
        found = "::1" if ipv6_first else "127.0.0.1"
    if ipaddress.ip_address(found).is_loopback:
        log.warning(
            "KV events are advertised at %s, which only this machine can reach: set "
            "kv_events.advertised_host to an address other machines can dial",
            found,
        )
    return found


def zmq_advertised_host(
    bound_endpoint: str,
    host: str,
    route_address: Callable[[socket.AddressFamily], str | None] | None = None,
    host_name_addresses: Callable[[], list[tuple[socket.AddressFamily, str]]] | None = None,
) -> str:
    """The host to advertise for a ZMQ TCP endpoint bound at `bound_endpoint` (libzmq's last
    endpoint) where the engine's other endpoints are advertised at `host` (`advertised_host`).
    That host is chosen for gRPC, which listens on both IP versions; a ZMQ socket on 0.0.0.0
    listens on IPv4 only (`kvplane.zmq_ip`: `*` binds `[::]`, dual stack, and binds 0.0.0.0
    only where the kernel has no IPv6), so an IPv6 address there names a socket nothing can
    reach: this machine's IPv4 address instead. A host name is kept (a ZMQ client resolves a
    name to IPv4 only), as is any host of a dual-stack or a specific endpoint."""
    if not is_ipv4_wildcard(bound_endpoint) or ":" not in host:  # (IPv6 addresses have colons)
        return host
    return own_address("0.0.0.0", route_address, host_name_addresses, dual_stack=False)


# Documentation addresses (RFC 5737, RFC 3849): connecting a UDP socket to one only picks the
# route, and nothing is ever sent there.
_ROUTE_PROBES = {socket.AF_INET: "192.0.2.1", socket.AF_INET6: "2001:db8::1"}


def _route_address(family: socket.AddressFamily) -> str | None:
    """The local address of `family` a UDP socket would send from to a public address; None
    without a route (or without that IP version)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((_ROUTE_PROBES[family], 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _host_name_addresses() -> list[tuple[socket.AddressFamily, str]]:
    """The addresses the host name resolves to (hosts file or DNS), either IP version."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    # A link-local address (fe80::, 169.254/16) is dialable only on its own link, and an IPv6
    # one only with its zone.
    return [
        (family, str(sockaddr[0]))
        for family, _, _, _, sockaddr in infos
        if family in _ROUTE_PROBES
        and not ipaddress.ip_address(str(sockaddr[0]).partition("%")[0]).is_link_local
    ]


@dataclass
class EngineApp:
    """A running engine: its servers, service and publishers."""

    config: EngineConfig
    instance_id: str
    server: grpc.aio.Server
    port: int
    service: EngineService
    openengine: OpenEngineServicer
    vllm: VllmGenerateServicer
    publisher: ZmqKvPublisher | None
    metrics_server: Any | None
    metrics_port: int | None
    kv_puller: KvSessionPuller | None = None

    async def close_engine(self) -> None:
        """Drain and stop everything but the gRPC server (serve_until_signal stops that)."""
        await self.service.close(self.config.shutdown_grace_s)
        if self.kv_puller is not None:
            await self.kv_puller.close()
        if self.publisher is not None:
            await self.publisher.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()

    async def close(self) -> None:
        await self.close_engine()
        await self.server.stop(self.config.shutdown_grace_s)


def _token_text(tokenizer: Any | None) -> Callable[[int], str]:
    if tokenizer is None:
        return lambda _token_id: ""

    @functools.lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))

    return text


async def start_engine(config: EngineConfig) -> EngineApp:
    model = _build_sim(config) if config.is_sim else _build_torch(config)
    runner, tokenizer = model.runner, model.tokenizer
    instance_id = config.instance_id
    if instance_id is None:
        instance_id = f"engine-{uuid.uuid4().hex[:12]}"
    core = EngineCore(
        runner,
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        ),
        tokenizer=tokenizer if tokenizer is not None else None,
        max_loras=config.lora.max_loras if config.lora.enabled else None,
    )
    served = ServedModel(
        model_id=config.model,
        name=config.model_name(),
        aliases=tuple(config.served_model_aliases),
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        num_blocks=runner.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_batched_tokens=config.max_num_batched_tokens,
        vocab_size=model.vocab_size,
        has_tokenizer=tokenizer is not None,
        embedding_dimension=model.pooler.hidden_size if model.pooler is not None else None,
        classifier_labels=model.pooler.labels if model.pooler is not None else None,
        supports_lora=config.lora.enabled,
        generates=model.generates,
    )
    kv_config = config.kv_events
    kv_log = KvEventLog(kv_config.buffer_steps)
    runtime = RuntimeEventHub(instance_id)
    metrics_registry = CollectorRegistry() if config.metrics_listen else None
    metrics = EngineMetrics(metrics_registry, served.name) if metrics_registry else None
    services: list[EngineService] = []

    def on_step(report: StepReport) -> None:  # engine thread; the service exists by then
        services[0].on_step_threadsafe(report)

    def on_exit() -> None:  # engine thread
        services[0].on_exit_threadsafe()

    engine_loop = EngineLoop(core, on_step=on_step, on_exit=on_exit)
    role = _ROLE[config.role]
    service = EngineService(
        engine_loop,
        served,
        kv_log,
        runtime,
        metrics,
        kv_session_ttl_s=config.kv_transfer.session_ttl_s
        if role == pb.ENGINE_ROLE_PREFILL
        else None,
        pooler=model.pooler,
        max_queued_requests=config.max_queued_requests,
    )
    services.append(service)
    kv_puller = None
    if role == pb.ENGINE_ROLE_DECODE:
        kv_puller = KvSessionPuller.from_config(
            config.kv_transfer,
            block_size=runner.block_size,
            kv_layout=runner.kv_layout,
            kv_block_bytes=runner.kv_block_bytes,
        )
        if metrics is not None:
            metrics.watch_held_kv_bytes(lambda: core.held_import_bytes)

    encode: Callable[[str], list[int]] | None = None
    if tokenizer is not None:
        hf = tokenizer

        def encode(text: str) -> list[int]:
            return list(hf.encode(text).ids)

    ctx = EngineContext(
        model=served,
        role=role,
        data_parallel_rank=kv_config.data_parallel_rank,
        encode=encode,
        sampling_defaults=model.sampling_defaults,
    )
    openengine = OpenEngineServicer(
        service,
        ctx,
        instance_id=instance_id,
        token_text=_token_text(tokenizer),
        kv_puller=kv_puller,
        tasks=None
        if model.pooler is None
        else PoolingTasks(service, ctx, model.pooler, config.max_num_batched_tokens),
        lora=LoraService(
            engine_loop, max_lora_rank=config.lora.max_lora_rank, kv_sessions=service.kv_sessions
        )
        if config.lora.enabled
        else None,
    )
    vllm = VllmGenerateServicer(service, ctx)
    kv_transfer = KvTransferServicer(
        service.kv_sessions,
        engine_loop,
        block_size=runner.block_size,
        kv_layout=runner.kv_layout,
        kv_block_bytes=runner.kv_block_bytes,
    )
    services_to_serve = [openengine.service(), vllm.service(), kv_transfer.service()]
    health_servicer = health.aio.HealthServicer()
    await vllm.report_health(health_servicer)  # NOT_SERVING until the engine thread runs
    server, port = await create_server(config, services_to_serve, health_servicer=health_servicer)
    publisher: ZmqKvPublisher | None = None
    metrics_server: Any | None = None
    metrics_port: int | None = None
    try:
        host = advertised_host(config)
        sources = [
            pb.KvEventSource(
                transport="grpc",
                endpoint_addr=pb.KvEndpoint(host=host, port=port, protocol="grpc"),
                data_parallel_rank=kv_config.data_parallel_rank,
                encoding="protobuf",
                schema_version=1,
                buffer_steps=kv_config.buffer_steps,
            )
        ]
        if kv_config.zmq_enabled:
            topic = kv_config.topic or f"kv@{join_host_port(host, port)}@{served.name}"
            publisher = ZmqKvPublisher(
                endpoint=kv_config.endpoint,
                replay_endpoint=kv_config.replay_endpoint,
                topic=topic,
                hwm=kv_config.hwm,
                buffer_steps=kv_config.buffer_steps,
                first_sequence_number=kv_log.first_sequence_number,
                data_parallel_rank=kv_config.data_parallel_rank,
                snapshot=kv_log.snapshot,
            )
            await publisher.start()
            kv_log.add_listener(publisher.publish_batch)
            sources.append(_zmq_source(publisher, host, kv_config.buffer_steps, kv_config.hwm))
            sources[-1].data_parallel_rank = kv_config.data_parallel_rank
        openengine.kv_event_sources = sources
        kv_endpoints = [pb.KvEndpoint(host=host, port=port, protocol=PROTOCOL)]
        openengine.kv_connector = kv_connector_info(role, kv_endpoints)
        if service.kv_sessions is not None:
            service.kv_sessions.endpoints = kv_endpoints
            service.kv_sessions.data_parallel_rank = kv_config.data_parallel_rank
        if metrics_registry is not None and config.metrics_listen:
            metrics_server, metrics_port = start_metrics_server(
                config.metrics_listen, metrics_registry
            )
    except BaseException:
        if publisher is not None:
            await publisher.close()
        if kv_puller is not None:
            await kv_puller.close()
        await server.stop(0)
        raise
    engine_loop.start()
    await vllm.update_health()
    log.info(
        "engine %s serving %s (%s, role %s, runner %s) on port %d",
        instance_id,
        served.name,
        "sim" if config.is_sim else config.model,
        config.role.value,
        "generate" if model.generates else "pooling",
        port,
    )
    return EngineApp(
        config=config,
        instance_id=instance_id,
        server=server,
        port=port,
        service=service,
        openengine=openengine,
        vllm=vllm,
        publisher=publisher,
        metrics_server=metrics_server,
        metrics_port=metrics_port,
        kv_puller=kv_puller,
    )


def _zmq_source(
    publisher: ZmqKvPublisher, host: str, buffer_steps: int, hwm: int
) -> pb.KvEventSource:
    source = pb.KvEventSource(
        transport="zmq",
        topic=publisher.topic.decode(),
        encoding="msgpack",
        buffer_steps=buffer_steps,
        hwm=hwm,
    )
    if publisher.bound_endpoint.startswith("tcp://"):
        pub_host, pub_port = routable_host_port(
            publisher.bound_endpoint, zmq_advertised_host(publisher.bound_endpoint, host)
        )
        source.endpoint_addr.CopyFrom(pb.KvEndpoint(host=pub_host, port=pub_port, protocol="tcp"))
    replay = publisher.bound_replay_endpoint
    if replay is not None and replay.startswith("tcp://"):
        replay_host, replay_port = routable_host_port(replay, zmq_advertised_host(replay, host))
        source.replay_endpoint = "tcp://" + join_host_port(replay_host, replay_port)
    return source


async def run_engine(config: EngineConfig, *, port_file: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop cleanly."""
    app = await start_engine(config)
    try:
        await publish_port(app.server, port_file, app.port)
        await serve_until_signal(app.server, config.shutdown_grace_s, on_stop=app.close_engine)
    finally:
        with contextlib.suppress(Exception):
            if app.service.engine_running:
                await app.close_engine()
    log.info("engine %s stopped", app.instance_id)
