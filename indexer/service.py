"""Runs the indexer process: opens the backend, starts every configured event source as an
owned task, serves `kv_indexer.v1.KVIndexer` and `kvplane.v1.KvIndex` (plus health and
reflection) until SIGTERM/SIGINT, and exports Prometheus metrics on `metrics_listen`.

Sources run in one `asyncio.TaskGroup`: a source never ends on its own (it retries with
backoff), and all of them are cancelled when the server stops. When the backend asks for a
worker's resync (the Redis backend after a buffer overflow or a Redis that lost its data), the
source feeding that worker clears and rebuilds it (`indexer.sources.resync`).

On a Redis backend, several indexers may follow the same engines into one partition (replicas
for high availability): each engine's sources run only in the replica holding its writer
lease (`indexer.sources.leased`, `writer_lease_s`, `replica_name`), and their writes are
fenced by it; ApplyExternalKvBatch's writes to other workers stay unconditional.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from indexer.backend import IndexBackend, index_answers
from indexer.backends import open_backend
from indexer.config import IndexerConfig, OpenEngineSourceConfig, ZmqSourceConfig
from indexer.servicer import (
    IngestCounters,
    KvIndexerServicer,
    PrefixQueryLimiter,
    index_services,
    source_keying,
)
from indexer.size_gauges import IndexSizeGauges, refresh_index_size
from indexer.sources.leased import LeasedEngineSources, LeasedSource, Source, lease_name
from indexer.sources.openengine import OpenEngineSource, OpenEngineSourceSettings
from indexer.sources.resync import Resyncable, connect_resync, resync_engine
from indexer.sources.zmq import (
    SOURCE_COUNTER_HELP,
    BatchSink,
    SourceCounters,
    ZmqSource,
    ZmqSourceSettings,
)
from indexer.translate import TRANSLATE_COUNTER_HELP, TranslateOptions, WorkerTranslator
from indexer.writer_lease import LeasingIndex, lease_holder
from kvplane.channels import ClientSettings
from kvplane.errors import KvplaneError
from kvplane.metrics import start_metrics_server
from kvplane.server import create_server, publish_port, serve_until_signal

log = logging.getLogger(__name__)

# A configured source as the service sees it: run as it is, or under a writer lease.
ServedSource = Source | LeasedSource

# How an openengine source's warnings name the settings a failed subscription most likely
# lacks (its engine's TLS, client certificate or token).
OPENENGINE_SOURCE_SETTINGS = ClientSettings(
    tls="the source's tls",
    client_certificate="the source's tls.cert_file and key_file",
    token="the source's token_file",
    server_name="the source's tls.server_name",
)


def build_source(
    config: ZmqSourceConfig | OpenEngineSourceConfig, backend: BatchSink, block_size: int
) -> Source:
    """One configured source, feeding `backend`."""
    worker_id, address = config.worker()
    translator = WorkerTranslator(
        TranslateOptions(
            worker_id=worker_id,
            worker_address=address,
            hash_mode=config.hash,
            media=config.medium_map(),
            clear_tiers=config.clear_tier_values(),
            default_block_size=config.block_size or block_size,
            kv_cache_groups=config.cache_group_values(),
        )
    )
    if isinstance(config, ZmqSourceConfig):
        settings = ZmqSourceSettings(
            endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint,
            topic=config.topic,
            bind=config.bind,
            array_tail=config.array_tail,
            replay_timeout_s=config.replay_timeout_s,
            heartbeat=config.heartbeat(),
            receive_queue_bytes=config.receive_queue_bytes,
            replay_bytes=config.replay_bytes,
        )
        return ZmqSource(settings, translator, backend)
    return OpenEngineSource(
        OpenEngineSourceSettings(
            target=config.target,
            data_parallel_ranks=tuple(config.data_parallel_ranks),
            discover_zmq=config.discover_zmq,
            array_tail=config.array_tail,
            heartbeat=config.heartbeat(),
            client_settings=OPENENGINE_SOURCE_SETTINGS,
        ),
        translator,
        backend,
        channels=config.channels(),
    )


def _dropped(counters: SourceCounters) -> int:
    return counters.num_bad_messages + counters.num_bad_events + counters.num_unknown_events


class IndexerCollector:
    """Prometheus view of the sources' and the servicers' counters (read at scrape time)."""

    def __init__(
        self,
        sources: Sequence[ServedSource],
        servicer: KvIndexerServicer,
        limiter: PrefixQueryLimiter,
        backend: IndexBackend,
    ) -> None:
        self._sources = sources
        self._servicer = servicer
        self._limiter = limiter
        self._backend = backend

    def collect(self) -> Iterator[Any]:
        for name, help_text in SOURCE_COUNTER_HELP.items():
            metric = CounterMetricFamily(
                f"kvplane_indexer_source_{name.removeprefix('num_')}",
                help_text,
                labels=["worker_id"],
            )
            for source in self._sources:
                metric.add_metric([source.worker_id], getattr(source.counters, name))
            yield metric
        for name, help_text in TRANSLATE_COUNTER_HELP.items():
            metric = CounterMetricFamily(
                f"kvplane_indexer_events_{name.removeprefix('num_')}",
                help_text,
                labels=["worker_id"],
            )
            for source in self._sources:
                metric.add_metric([source.worker_id], getattr(source.translator.counters, name))
            yield metric
        followed = GaugeMetricFamily(
            "kvplane_indexer_source_followed",
            "1 while this indexer follows the source (0: another replica on the shared index "
            "holds its engine's writer lease)",
            labels=["worker_id"],
        )
        for source in self._sources:
            followed_now = source.followed if isinstance(source, LeasedSource) else True
            followed.add_metric([source.worker_id], int(followed_now))
        yield followed
        up = GaugeMetricFamily(
            "kvplane_indexer_source_up",
            "1 while the source's stream from its engine is up (a ZMQ SUB connected to its "
            "publisher, a SubscribeKvEvents call reaching the engine); 0 while it is not (the "
            "publisher unreachable or not up yet, gone, refusing): the worker's entries are "
            "then missing or frozen. No series while another replica follows it",
            labels=["worker_id"],
        )
        for source in self._sources:
            if not isinstance(source, LeasedSource) or source.followed:
                up.add_metric([source.worker_id], int(source.link.up))
        yield up
        yield CounterMetricFamily(
            "kvplane_indexer_external_batches_applied",
            "ApplyExternalKvBatch calls applied",
            value=self._servicer.num_batches_applied,
        )
        yield CounterMetricFamily(
            "kvplane_indexer_prefix_queries_shed",
            "Prefix queries shed with RESOURCE_EXHAUSTED",
            value=self._limiter.num_shed,
        )
        yield GaugeMetricFamily(
            "kvplane_indexer_prefix_queries_in_flight",
            "Prefix queries being answered",
            value=self._limiter.in_flight,
        )
        yield GaugeMetricFamily(
            "kvplane_indexer_index_reachable",
            "1 when the index answers queries; 0 while a shared Redis does not (down, out of "
            "memory, or replaying the batches buffered meanwhile)",
            value=int(index_answers(self._backend)),
        )


async def run_indexer(config: IndexerConfig, *, port_file: Path | None = None) -> None:
    backend = await open_backend(config.backend, **config.backend_options())
    try:
        sources, leased = _served_sources(config, backend)
        # A backend that dropped or lost a worker's entries asks its source to rebuild them.
        by_worker = {s.worker_id: s for s in sources}
        # The latest root block each source's engine stored (GetIndexStats `keyings`), one
        # source per configured one.
        root_blocks = {s.worker_id: s.translator.root_block for s in sources}
        connect_resync(backend, by_worker.get)
        servicer_box: list[KvIndexerServicer] = []

        def ingest_counters() -> IngestCounters:
            applied = sum(s.counters.num_batches_applied for s in sources)
            applied += sum(s.num_batches_applied for s in servicer_box)
            dropped = sum(_dropped(s.counters) for s in sources)
            return IngestCounters(num_batches_applied=applied, num_events_dropped=dropped)

        services, kv_indexer, _ = index_services(
            backend,
            default_block_size=config.block_size,
            max_concurrent_prefix_queries=config.max_concurrent_prefix_queries,
            ingest_counters=ingest_counters,
            source_of=by_worker.get,
            keyings=lambda: [
                source_keying(c, root_blocks[c.worker()[0]].block) for c in config.sources
            ],
        )
        servicer_box.append(kv_indexer)
        server, port = await create_server(
            config,
            services,
            options=[("grpc.max_receive_message_length", config.max_request_bytes)],
        )
        metrics_server = None
        index_size = IndexSizeGauges("indexer", functools.partial(index_answers, backend))
        if config.metrics_listen is not None:
            registry = CollectorRegistry()
            registry.register(IndexerCollector(sources, kv_indexer, kv_indexer.limiter, backend))
            registry.register(index_size)
            try:
                metrics_server, _ = start_metrics_server(config.metrics_listen, registry)
            except KvplaneError:
                await server.stop(None)
                raise
        await publish_port(server, port_file, port)
        log.info("indexer on port %d: backend %s, %d sources", port, backend.name, len(sources))
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(s.run(), name=f"source:{s.worker_id}")
                    for s in sources
                    if not isinstance(s, LeasedSource)
                ]
                tasks += [
                    group.create_task(e.run(), name=f"lease:{e.lease.engine}") for e in leased
                ]
                if config.metrics_listen is not None:
                    tasks.append(
                        group.create_task(
                            refresh_index_size(backend, index_size), name="index size"
                        )
                    )
                await serve_until_signal(server, config.shutdown_grace_s)
                for task in tasks:
                    task.cancel()
        except* KvplaneError as failed:
            # A source that cannot run at all (an endpoint ZMQ cannot connect to): the process
            # stops with its one-line error, as for any bad config.
            await server.stop(None)
            raise failed.exceptions[0] from None
        finally:
            if metrics_server is not None:
                metrics_server.shutdown()
    finally:
        await backend.close()


def _served_sources(
    config: IndexerConfig, backend: IndexBackend
) -> tuple[list[ServedSource], list[LeasedEngineSources]]:
    """The configured sources, and on a shared index with writer leases (Redis) the engines'
    groups of them that run under their leases (`indexer.sources.leased`); every write of
    their sources is then fenced by the lease (`fence_writes`: their batches, and removals of
    their workers), and only those."""
    if not isinstance(backend, LeasingIndex) or not config.sources:
        return [build_source(s, backend, config.block_size) for s in config.sources], []
    holder = lease_holder(config.replica_name, config.listen, f"indexer-{uuid.uuid4().hex[:8]}")
    by_engine: dict[str, list[LeasedSource]] = {}
    for source_config in config.sources:
        build = functools.partial(build_source, source_config, block_size=config.block_size)
        source = LeasedSource(build, backend)
        by_engine.setdefault(lease_name(source.worker_id), []).append(source)
    backend.fence_writes(holder, lambda worker_id: _leased_name(worker_id, by_engine))
    log.info("writer leases held as %s (writer_lease_s %.1f)", holder, config.writer_lease_s)
    engines = [
        LeasedEngineSources(
            backend,
            name,
            holder,
            config.writer_lease_s,
            group,
            on_resync=functools.partial(
                _resync_handed_over, backend, name, {s.worker_id: s for s in group}.get
            ),
        )
        for name, group in by_engine.items()
    ]
    return [s for group in by_engine.values() for s in group], engines


async def _resync_handed_over(
    backend: IndexBackend,
    engine: str,
    source_of: Callable[[str], Resyncable | None],
    only_if_stream_lost: bool,
) -> None:
    """A resync of `engine` that another replica was asked (ResyncEngine) and handed to this
    one, the holder of its writer lease: done here as if asked here."""
    done = await resync_engine(backend, engine, source_of, only_if_stream_lost=only_if_stream_lost)
    log.info(
        "engine %s: resync handed over by another replica; dropped workers %s, %d source(s) "
        "resubscribing",
        engine,
        done.dropped,
        done.resubscribed,
    )


def _leased_name(worker_id: str, leased: dict[str, list[LeasedSource]]) -> str | None:
    """The lease a worker is written under, None for one no source of this process feeds
    (fed through ApplyExternalKvBatch: unconditional)."""
    name = lease_name(worker_id)
    return name if name in leased else None
