"""Prometheus /metrics on a side port, shared by every server."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from kvplane.config import parse_host_port
from kvplane.errors import ConfigError

log = logging.getLogger(__name__)


def start_metrics_server(listen: str, registry: CollectorRegistry) -> tuple[Any, int]:
    """Serve `registry` at http://listen/metrics; returns (server, bound port). An address
    that cannot be bound (in use, not this host's) is a ConfigError. The standard `process_*`
    metrics are served beside the registry's (`process_start_time_seconds` says when every
    counter started), without the `_created` series prometheus_client adds to each counter
    and histogram (in the text format a gauge each, documented nowhere, doubling the series)."""
    # Read at each scrape, by every registry of this process (untyped in prometheus_client).
    disable_created_metrics()  # type: ignore[no-untyped-call]
    host, port = parse_host_port(listen)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from exc
    ProcessCollector(registry=registry)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
