"""The indexer server's configuration (`kvplane indexer serve --config FILE`).

```yaml
listen: 127.0.0.1:50051
backend: memory                    # or redis://HOST:PORT/DB, redis+cluster://H:P,H:P (see `redis:`)
block_size: 16                     # default for MatchTokens and canonical-mode sources
sources:
  - kind: zmq                      # a vLLM or SGLang publisher
    worker_id: w0
    worker_address: 10.0.0.1:8000  # router-facing address reported in prefix matches
    endpoint: tcp://127.0.0.1:5557
    replay_endpoint: tcp://127.0.0.1:5558   # optional
    topic: ""                      # optional topic prefix (2-frame messages pass too)
    hash: engine                   # engine | canonical
  - kind: openengine               # SubscribeKvEvents on an OpenEngine engine
    target: 127.0.0.1:9000
```

Booleans and numbers are strict, as in every kvplane config (`kvplane.config.StrictBool`...).
Numbers that reach C (gRPC's channel arguments, uint32 wire fields) are bounded here, so that a
config that loads also runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from indexer.backends import REDIS_SCHEMES, check_backend_url, check_redis_options
from indexer.batch import Component, Tier
from indexer.cache_groups import CacheGroup, component_of_kind
from indexer.sources.held_replies import DEFAULT_REPLAY_BYTES
from indexer.sources.receive_queue import DEFAULT_RECEIVE_QUEUE_BYTES
from indexer.translate import HashMode, MediumMap
from indexer.validation import MAX_UINT32, worker_name_problem
from indexer.vllm_hash import VllmHashAlgo, unseeded_problem
from indexer.zmq_decode import ArrayTail
from kvplane.channels import ClientChannels
from kvplane.config import (
    ClientTlsConfig,
    ClientTlsFilesConfig,
    ServerConfig,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictModel,
    check_needs,
    check_zmq_endpoint,
    parse_host_port,
)
from kvplane.zmq_heartbeat import DEFAULT_HEARTBEAT, Heartbeat

TierName = Literal["HBM", "DRAM", "SSD"]
MediumTarget = Literal["HBM", "DRAM", "SSD", "skip"]
# gRPC channel arguments are C ints.
MAX_C_INT = (1 << 31) - 1
BlockSize = Annotated[StrictInt, Field(gt=0, le=MAX_UINT32)]
# The term of a writer lease (`indexer.writer_lease`), the controller's `index.writer_lease_s`
# and the indexer's `writer_lease_s`.
DEFAULT_WRITER_LEASE_S = 10.0
WriterLeaseSeconds = Annotated[StrictFloat, Field(gt=0)]
# The writer lease's settings (the indexer's and the controller's `index:`), read only with a
# Redis backend: replicas share the index there.
LEASE_KEYS = ("writer_lease_s", "replica_name")


def _check_replica_name(value: str) -> str:
    """A replica's name is the part of a writer lease holder's id before its '/'."""
    if not value or any(c.isspace() or c == "/" for c in value):
        raise ValueError(f"must be a non-empty name without spaces or '/', got {value!r}")
    return value


# The controller's `index.replica_name` and the indexer's `replica_name` (`lease_holder`).
ReplicaName = Annotated[str, AfterValidator(_check_replica_name)]


def _tier(name: MediumTarget) -> Tier | None:
    return None if name == "skip" else Tier[name]


def _all_tier_names() -> list[TierName]:
    return ["HBM", "DRAM", "SSD"]


class KvCacheGroupConfig(StrictModel):
    """One KV cache group of a hybrid model, as vLLM names it (`kv_cache_spec_kind`)."""

    kind: str = Field(min_length=1)
    # Tokens in the window (vLLM's `sliding_window`); sliding-window kinds only.
    sliding_window: Annotated[StrictInt, Field(ge=1, le=MAX_UINT32)] | None = None

    @model_validator(mode="after")
    def _check_window(self) -> KvCacheGroupConfig:
        if self.sliding_window is not None and component_of_kind(self.kind) is not Component.SWA:
            raise ValueError(f"sliding_window is for sliding-window kinds, not {self.kind!r}")
        return self


class _SourceCommon(StrictModel):
    # Which key space this worker is indexed in; MatchTokens finds it with the matching
    # `key_space` (engine, from vLLM: KEY_SPACE_VLLM_SHA256[_CBOR]; canonical: the default).
    hash: HashMode = HashMode.ENGINE
    # `hash: engine` from vLLM: its prefix_caching_hash_algo and PYTHONHASHSEED value (None:
    # vLLM's default seed), as declared here. Not used to key anything: GetIndexStats reports
    # them (`keyings`), so that a controller asking in another key space can tell.
    vllm_hash: VllmHashAlgo | None = None
    hash_seed: str | None = None
    # Block size for events that carry tokens but no block_size; default: the top-level one.
    block_size: BlockSize | None = None
    # Where events with a nil medium, and with medium EXTERNAL, go ("skip" drops them).
    nil_medium: MediumTarget = "HBM"
    external_medium: MediumTarget = "skip"
    # Tiers an AllBlocksCleared (without a medium) clears.
    clear_tiers: list[TierName] = Field(default_factory=_all_tier_names)
    # A hybrid model's KV cache groups in group_idx order, known before (or without) the
    # events naming them; events that name a group's kind override it (docs/indexer.md).
    kv_cache_groups: list[KvCacheGroupConfig] = Field(default_factory=list)
    # ZMTP heartbeats to a ZMQ publisher (a zmq source's, or those an openengine source
    # follows with discover_zmq): how one that falls silent without closing its connection
    # is found (`kvplane.zmq_heartbeat`).
    heartbeat_interval_s: StrictFloat = DEFAULT_HEARTBEAT.interval_s
    heartbeat_timeout_s: StrictFloat = DEFAULT_HEARTBEAT.timeout_s

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(self.heartbeat_interval_s, self.heartbeat_timeout_s)

    @model_validator(mode="after")
    def _check_vllm_hash(self) -> Self:
        if self.vllm_hash is not None and self.hash is not HashMode.ENGINE:
            raise ValueError(
                "vllm_hash is for hash: engine (a canonical source is keyed by kvplane)"
            )
        problem = unseeded_problem(self.hash_seed, self.vllm_hash, "hash_seed", "vllm_hash")
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_heartbeat(self) -> Self:
        problem = self.heartbeat().problem()
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("worker_id", "worker_address", check_fields=False)
    @classmethod
    def _check_worker_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Names the index takes (None: OpenEngine's default, the target)."""
        if value is None:
            return None
        field = str(info.field_name)
        problem = worker_name_problem(field, value)
        if not value and field == "worker_id":
            problem = "worker_id must not be empty"
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("clear_tiers")
    @classmethod
    def _check_clear_tiers(cls, value: list[TierName]) -> list[TierName]:
        if not value:
            # An AllBlocksCleared that clears nothing keeps every block the engine dropped.
            raise ValueError(
                "must name at least one tier: with none, AllBlocksCleared clears nothing and "
                "every block the engine dropped stays indexed"
            )
        return value

    def medium_map(self) -> MediumMap:
        return MediumMap(nil=_tier(self.nil_medium), external=_tier(self.external_medium))

    def clear_tier_values(self) -> tuple[Tier, ...]:
        return tuple(Tier[name] for name in self.clear_tiers)

    def cache_group_values(self) -> tuple[CacheGroup, ...]:
        return tuple(CacheGroup(g.kind, g.sliding_window) for g in self.kv_cache_groups)


class ZmqSourceConfig(_SourceCommon):
    kind: Literal["zmq"]
    worker_id: str
    worker_address: str = ""
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    # Bind the SUB socket instead of connecting (for publishers that connect).
    bind: StrictBool = False
    # Positional (array) events: read fields at index >= 7 as vLLM's ("vllm") or ignore them.
    array_tail: ArrayTail = "ignore"
    replay_timeout_s: StrictFloat = Field(default=5.0, gt=0)
    # Received messages waiting for the index, at most (their bytes; the oldest are dropped
    # past it, healed from the replay as gaps).
    receive_queue_bytes: StrictInt = Field(default=DEFAULT_RECEIVE_QUEUE_BYTES, gt=0)
    # A replay's replies held until applied, at most (their bytes; the oldest are dropped past
    # it: the worker is rebuilt from the newest).
    replay_bytes: StrictInt = Field(default=DEFAULT_REPLAY_BYTES, gt=0)

    def worker(self) -> tuple[str, str]:
        """The worker it feeds: its id and router-facing address."""
        return self.worker_id, self.worker_address

    @model_validator(mode="after")
    def _check_replay_settings(self) -> ZmqSourceConfig:
        replay = self.replay_endpoint is not None
        check_needs(self, ("replay_timeout_s", "replay_bytes"), "replay_endpoint", met=replay)
        return self

    @model_validator(mode="after")
    def _check_endpoints(self) -> ZmqSourceConfig:
        # (The replay endpoint is always connected to: the source's DEALER.)
        for field, endpoint, bind in (
            ("endpoint", self.endpoint, self.bind),
            ("replay_endpoint", self.replay_endpoint, False),
        ):
            try:
                if endpoint is not None:
                    check_zmq_endpoint(endpoint, bind=bind)
            except ValueError as exc:
                raise ValueError(f"{field}: {exc}") from None
        return self


class OpenEngineSourceConfig(_SourceCommon):
    kind: Literal["openengine"]
    target: str
    # Defaults: the target (the address routers dial is the engine's OpenEngine address).
    worker_id: str | None = None
    worker_address: str | None = None
    # The wire's uint32.
    data_parallel_ranks: list[Annotated[StrictInt, Field(ge=0, le=MAX_UINT32)]] = Field(
        default_factory=list
    )
    # When SubscribeKvEvents is unimplemented, follow a ZMQ source from GetKvEventSources.
    discover_zmq: StrictBool = True
    # The array tail of those ZMQ sources' positional events (as a zmq source's).
    array_tail: ArrayTail = "ignore"
    # Dial the engine with TLS ({ca_file, cert_file, key_file, server_name}); None: insecure.
    tls: ClientTlsConfig | None = None
    # A file holding the bearer token of an engine run with `auth` and `protect_reads`, sent
    # on every call (followed as it changes); None: no token.
    token_file: Path | None = None

    def channels(self) -> ClientChannels:
        """How the engine is dialled: `tls`, every call carrying `token_file`'s token. A file
        that cannot be used now is a ConfigError naming the source and the setting."""
        where = f"source {self.target}"
        return ClientChannels.load(self.tls, f"{where}: tls").with_token_file(
            self.token_file, f"{where}: token_file"
        )

    def worker(self) -> tuple[str, str]:
        """The worker it feeds: its id and router-facing address (both default to the
        target)."""
        address = self.target if self.worker_address is None else self.worker_address
        return self.worker_id or self.target, address

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @model_validator(mode="after")
    def _check_array_tail(self) -> OpenEngineSourceConfig:
        check_needs(self, ("array_tail",), "discover_zmq: true", met=self.discover_zmq)
        return self


SourceConfig = Annotated[ZmqSourceConfig | OpenEngineSourceConfig, Field(discriminator="kind")]


class RedisTlsConfig(ClientTlsFilesConfig):
    """TLS to Redis (also implied by a rediss:// URL)."""


class RedisBackendConfig(StrictModel):
    """The `redis:` block, read when `backend` is redis://, rediss:// or redis+cluster://
    (docs/redis.md)."""

    # Every key starts with it; one partition (one cluster slot) per `model`.
    key_prefix: str = Field(default="kvplane", min_length=1)
    model: str = Field(default="default", min_length=1)
    # Hashes holding a partition's block records; fixed once the partition holds data.
    buckets: StrictInt = Field(default=65536, ge=1, le=1 << 24)
    username: str | None = None
    # A file holding the password (surrounding whitespace ignored).
    password_file: Path | None = None
    tls: RedisTlsConfig | None = None
    timeout_s: StrictFloat = Field(default=2.0, gt=0)
    connect_timeout_s: StrictFloat = Field(default=0.5, gt=0)
    # Batches kept in order while Redis is down; past that, overflowing workers are resynced.
    max_buffered_batches: StrictInt = Field(default=10_000, ge=0)

    def backend_options(self) -> dict[str, Any]:
        tls = self.tls or RedisTlsConfig()
        return {
            "key_prefix": self.key_prefix,
            "model": self.model,
            "buckets": self.buckets,
            "username": self.username,
            "password_file": self.password_file,
            "tls_ca_file": tls.ca_file,
            "tls_cert_file": tls.cert_file,
            "tls_key_file": tls.key_file,
            "timeout_s": self.timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "max_buffered_batches": self.max_buffered_batches,
        }


class IndexerConfig(ServerConfig):
    listen: str = "127.0.0.1:50051"
    backend: str = "memory"
    sources: list[SourceConfig] = Field(default_factory=list)
    # Default tokens per block: MatchTokens with block_size 0, canonical-mode sources.
    block_size: BlockSize = 16
    # Prefix queries (MatchExternalKvPrefix, MatchTokens) in flight beyond this are shed with
    # RESOURCE_EXHAUSTED.
    max_concurrent_prefix_queries: StrictInt = Field(default=64, gt=0)
    # Largest request the server accepts (gRPC's default is 4 MiB). MatchExternalKvPrefix has
    # no length cap in the seed; this one (about 8 bytes a hash) is the effective one.
    max_request_bytes: StrictInt = Field(default=64 << 20, gt=0)
    # Options of a Redis backend; an error with `memory`, which has none.
    redis: RedisBackendConfig = Field(default_factory=RedisBackendConfig)
    # Several indexers on one Redis index with the same `sources:`: each engine's sources
    # are followed by the one replica holding its writer lease, which expires this long after
    # its last renewal (renewed every third of it); another replica takes over within about
    # this long after the holder stops, from a fresh replay or snapshot (indexer.writer_lease,
    # docs/indexer.md "Several indexer replicas"). Refused with `memory` (LEASE_KEYS).
    writer_lease_s: WriterLeaseSeconds = DEFAULT_WRITER_LEASE_S
    # This replica's name in the writer leases: a new process under the same name (the
    # replica restarted) takes its leases back at once rather than after writer_lease_s, and
    # its previous process's late writes are refused. None: the host name and `listen` (with
    # a port: `listen` on port 0 names no replica, and a restarted process waits for the
    # expiry). Replicas must not share a name.
    replica_name: ReplicaName | None = None

    def backend_options(self) -> dict[str, Any]:
        """Keyword options for `indexer.backends.open_backend(self.backend, ...)`."""
        return {} if self.backend == "memory" else self.redis.backend_options()

    @field_validator("max_request_bytes")
    @classmethod
    def _check_max_request_bytes(cls, value: int) -> int:
        if value > MAX_C_INT:  # gRPC's channel arguments are C ints
            raise ValueError(f"must be at most {MAX_C_INT} (2 GiB - 1, gRPC's limit), got {value}")
        return value

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        check_backend_url(value)
        return value

    @model_validator(mode="after")
    def _redis_needs_a_redis_backend(self) -> IndexerConfig:
        check_redis_options(
            self.backend, "redis" in self.model_fields_set, tls=self.redis.tls is not None
        )
        redis = self.backend.startswith(REDIS_SCHEMES)
        check_needs(self, LEASE_KEYS, f"a Redis backend (backend is {self.backend})", met=redis)
        return self

    @model_validator(mode="after")
    def _unique_workers(self) -> IndexerConfig:
        seen: set[str] = set()
        for source in self.sources:
            worker_id = source.worker_id or (
                source.target if isinstance(source, OpenEngineSourceConfig) else ""
            )
            if worker_id in seen:
                raise ValueError(f"two sources feed worker_id {worker_id!r}")
            seen.add(worker_id)
        return self
