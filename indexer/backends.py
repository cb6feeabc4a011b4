"""Opens an index backend from its URL: `memory`, `redis://...` or `redis+cluster://...`;
`check_backend_url` is the URL's shape alone, for config models to check before anything
opens."""

from __future__ import annotations

import importlib
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

from indexer.backend import IndexBackend
from indexer.memory_backend import MemoryBackend
from kvplane.errors import ConfigError

REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "unix://")


def shown_url(url: str) -> str:
    """`url` as an error or a log line shows it: the password a Redis URL may carry
    (`redis://user:PASSWORD@host`, `unix:///path?password=PASSWORD`) replaced by `***`, as
    redis.password_file's is never shown (docs/redis.md)."""
    url = _URL_PASSWORD.sub(r"\1:***@", url)
    return _QUERY_PASSWORD.sub(r"\1***", url)


# The password of a URL's user information, and of its query.
_URL_PASSWORD = re.compile(r"^([^:/?#]+://[^/?#@:]*):[^/?#]*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")


def check_backend_url(url: str) -> None:
    """Raises ValueError for a URL that names no backend: an unknown scheme, or a DB that is
    not a number (redis-py would silently use DB 0 for `redis://h:p/abc`) or, on a cluster,
    not 0 (a cluster has DB 0 only). Whether the server has that DB, it tells at start-up."""
    if url == "memory":
        return
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(
            f"unknown index backend {shown_url(url)!r}: use 'memory', 'redis://HOST:PORT[/DB]' or "
            "'redis+cluster://HOST:PORT'"
        )
    parts = urlsplit(url)
    # A unix:// path is the socket's: its DB can only come as ?db=N.
    dbs = parse_qs(parts.query).get("db", [])
    if parts.scheme != "unix" and parts.path.strip("/"):
        dbs.append(parts.path.strip("/"))
    for db in dbs:
        if not (db.isascii() and db.isdigit()):
            raise ValueError(f"backend {shown_url(url)!r}: the DB must be a number, got {db!r}")
        if parts.scheme == "redis+cluster" and int(db) != 0:
            raise ValueError(f"backend {shown_url(url)!r}: a Redis Cluster has DB 0 only")


def check_redis_options(backend: str, given: bool, tls: bool = False) -> None:
    """A `redis:` options block only goes with a Redis backend (it would be ignored), and
    TLS (`tls`: `redis.tls` given) only with a Redis reached over TCP: Redis serves TLS on its
    tls-port, never on a unix socket."""
    if given and not backend.startswith(REDIS_SCHEMES):
        raise ValueError(
            f"redis: options are for a Redis backend, but backend is {shown_url(backend)}: "
            "remove the redis: block or set backend to redis://HOST:PORT/DB"
        )
    if tls and backend.startswith("unix://"):
        raise ValueError(
            f"redis.tls: a unix:// socket carries no TLS (Redis serves TLS on a TCP port), "
            f"but backend is {shown_url(backend)}: remove redis.tls or set backend to "
            "rediss://HOST:PORT/DB"
        )


async def open_backend(url: str, **options: Any) -> IndexBackend:
    """The backend named by `url`; options go to the Redis backend (memory takes none).

    Raises ConfigError for a URL `check_backend_url` refuses, for options the memory backend
    cannot take, and when the Redis backend is not available in this build.
    """
    try:
        check_backend_url(url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if url == "memory":
        if options:
            raise ConfigError(f"the memory backend takes no options, got {sorted(options)}")
        return MemoryBackend()
    try:
        module = importlib.import_module("indexer.redis_backend")
    except ModuleNotFoundError as exc:
        if exc.name != "indexer.redis_backend":
            raise
        raise ConfigError(
            f"backend {shown_url(url)!r}: the Redis backend is not available"
        ) from None
    backend: IndexBackend = await module.open_redis_backend(url, **options)
    return backend
