"""Prometheus /metrics on a side port, shared by every server."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from kvplane.config import parse_host_port

log = logging.getLogger(__name__)


def start_metrics_server(listen: str, registry: CollectorRegistry) -> tuple[Any, int]:
    """Serve `registry` at http://listen/metrics; returns (server, bound port)."""
    host, port = parse_host_port(listen)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
