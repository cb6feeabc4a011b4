"""Prometheus /metrics on a side port, shared by every server."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from kvplane.config import parse_host_port
from kvplane.errors import ConfigError

log = logging.getLogger(__name__)


def start_metrics_server(listen: str, registry: CollectorRegistry) -> tuple[Any, int]:
    """Serve `registry` at http://listen/metrics; returns (server, bound port). An address
    that cannot be bound (in use, not this host's) is a ConfigError."""
    host, port = parse_host_port(listen)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from exc
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
