"""Connecting to Redis or Redis Cluster for the shared index: the backend's options (the
`redis:` config block), the client for a backend URL, and the errors the backend raises.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from indexer.backends import check_redis_options, shown_url
from kvplane.config import read_secret_file
from kvplane.errors import ConfigError, KvplaneError
from kvplane.tls_files import (
    CERTIFICATE,
    PRIVATE_KEY,
    PemFileError,
    check_key_pair,
    read_ca,
    read_pem,
)


class IndexUnavailableError(KvplaneError):
    """The shared index cannot answer now (Redis down, loading, out of memory, failing
    over); retry later. Applies that meet it are buffered."""


class RedisMisconfiguredError(IndexUnavailableError):
    """The backend URL names something no retry makes usable while the configuration stays
    as it is: a server that is not Redis, a DB the server does not have, a redis+cluster://
    URL on a Redis without cluster mode, credentials it refuses. At start-up the indexer
    stops with it (a configuration error); once the backend has run, it is an outage like any
    other (the server was changed under it, and may be changed back)."""


class IndexBackendError(KvplaneError):
    """Redis refused a call for a reason that retrying does not cure (e.g. a new worker while
    65,535 are registered in one partition); the batch is not buffered."""


class LeaseLostError(IndexBackendError):
    """A fenced write (a controller replica following an engine) was refused: this process
    does not hold the engine's writer lease (any more). Nothing of it was written; the
    replica holding the lease writes that engine's workers."""


class IndexFullError(IndexBackendError):
    """The partition cannot take the batch's new worker: 65,535 workers are registered in it,
    the most its records can address (removing one frees its id). Nothing of the batch was
    written; the client must not retry it as it is (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """Options of `open_redis_backend` (the `redis:` block of the indexer config)."""

    key_prefix: str = "kvplane"
    # The partition: indexes of different models never share keys.
    model: str = "default"
    # Hashes per partition that hold the block records (fixed once a partition holds data).
    buckets: int = 65536
    password: str | None = None
    password_file: Path | None = None
    username: str | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    timeout_s: float = 2.0
    connect_timeout_s: float = 0.5
    max_buffered_batches: int = 10_000
    # Background upkeep: boot-token check and sweeping of dead placements.
    maintenance_interval_s: float = 1.0
    sweep_chunk_buckets: int = 256
    dump_chunk_buckets: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.buckets <= 1 << 24:
            raise ConfigError(f"redis buckets must be in 1..{1 << 24}, got {self.buckets}")
        if not self.key_prefix or any(c in self.key_prefix + self.model for c in "{}"):
            raise ConfigError("redis key_prefix must be non-empty; key_prefix and model no braces")
        if self.max_buffered_batches < 0:
            raise ConfigError("redis max_buffered_batches must be >= 0")

    def partition_key(self, name: str) -> str:
        """The key `name` of this partition (`<key_prefix>:{<model>:0}:<name>`): the hash tag
        keeps every key of a partition in one cluster slot (docs/redis.md)."""
        return f"{self.key_prefix}:{{{self.model}:0}}:{name}"

    def read_password(self) -> str | None:
        if self.password_file is None:
            return self.password
        return read_secret_file(self.password_file, "redis.password_file")

    def tls_files(self) -> dict[str, str | None]:
        """redis-py's options of the TLS files (none: no `redis.tls` files), each file read and
        checked first (kvplane.tls_files): one that is missing or unusable is a PemFileError
        naming its setting as the index opens (and in `kvplane up`'s preflight), where
        redis-py would fail each connection, the first as late as the first command."""
        ca, cert, key = self.tls_ca_file, self.tls_cert_file, self.tls_key_file
        if ca is None and cert is None:
            return {}
        try:
            if ca is not None:
                read_ca(ca, "ca_file")
            if cert is not None:
                read_pem(cert, CERTIFICATE, "cert_file")
                # Without key_file, OpenSSL looks for the key in cert_file.
                read_pem(key or cert, PRIVATE_KEY, "key_file" if key else "cert_file")
                check_key_pair(cert, key or cert, _pair_problem(cert, key))
        except PemFileError as exc:
            raise PemFileError(f"redis.tls: {exc}") from exc
        return {
            "ssl_ca_certs": str(ca) if ca else None,
            "ssl_certfile": str(cert) if cert else None,
            "ssl_keyfile": str(key) if key else None,
        }


def _pair_problem(cert: Path, key: Path | None) -> str:
    if key is None:
        return f"cert_file {cert} holds no key of its certificate (give key_file)"
    return f"key_file {key} and cert_file {cert} do not make a pair"


class _FcallCluster(RedisCluster):
    """RedisCluster that routes FCALL/FCALL_RO by their first key without asking the server
    (redis-py otherwise sends COMMAND GETKEYS, a second round trip, before every call), and
    that sends a call a node let time out once, as `connect` has a single Redis's client do:
    redis-py's cluster client sends it again after reading the slot table anew, not by
    `retry`'s errors (a second `timeout_s`, and a write run twice on another pooled
    connection once the node answers)."""

    # (redis-py types it as its own four errors, exactly.)
    ERRORS_ALLOW_RETRY = tuple(  # type: ignore[assignment]
        error for error in RedisCluster.ERRORS_ALLOW_RETRY if error is not RedisTimeoutError
    )

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() in ("FCALL", "FCALL_RO") and len(args) >= 3 and int(args[1]) > 0:
            slot: int = self.keyslot(args[2])
            return slot
        slot = await super()._determine_slot(command, *args)
        return slot


Client = aioredis.Redis | RedisCluster


def connect(url: str, options: RedisOptions) -> tuple[Client, str]:
    """A client for `redis://`, `rediss://`, `unix://` or `redis+cluster://h:p[,h:p...]`,
    and the address to name in errors."""
    common: dict[str, Any] = {
        "password": options.read_password(),
        "username": options.username,
        "socket_timeout": options.timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
        # One quick retry heals a pooled connection that a Redis restart broke; not a call
        # Redis let time out (redis-py retries those too by default): sent again, it would
        # wait a second `timeout_s`, and a write would reach Redis twice.
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }
    tls: dict[str, Any] = options.tls_files()
    if url.startswith("redis+cluster://"):
        # Its credentials, as redis-py takes a redis:// URL's (they win over the options):
        # not part of the first node's host (never sent, and named in every connection error).
        netloc = url.removeprefix("redis+cluster://").split("/", 1)[0]
        credentials, _, rest = netloc.rpartition("@")
        username, _, password = credentials.partition(":")
        if username:
            common["username"] = unquote(username)
        if password:
            common["password"] = unquote(password)
        nodes = []
        for part in rest.split(","):
            host, _, port = part.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(
                    f"backend {shown_url(url)!r}: expected redis+cluster://HOST:PORT[,...]"
                )
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        cluster = _FcallCluster(startup_nodes=nodes, **common, **tls, ssl=bool(tls))
        return cluster, _address(url)
    try:
        check_redis_options(url, True, tls=bool(tls))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if tls:  # TLS with redis:// too; a pool's connections take no `ssl` option
        tls["connection_class"] = SSLConnection
    try:
        client = aioredis.Redis.from_url(url, **common, **tls)
    except ValueError as exc:
        raise ConfigError(f"backend {shown_url(url)!r}: {exc}") from exc
    return client, _address(url)


def _address(url: str) -> str:
    """What errors name of the Redis at `url`: its HOST:PORT (a cluster's, each node's), or
    the URL, never a password in it."""
    return urlsplit(url).netloc.rpartition("@")[2] or shown_url(url)


def stop_if_cancelled() -> None:
    """Raise CancelledError if this task was cancelled. redis-py can turn a cancellation that
    lands inside a command into a connection error, which a background loop catches and
    retries: without this check at the top of each turn such a loop outlives its
    cancellation, and whoever awaits it (a `close()`) waits forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
