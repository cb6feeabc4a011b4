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
    topic: ""                      # optional subscription prefix
    hash: engine                   # engine | canonical
  - kind: openengine               # SubscribeKvEvents on an OpenEngine engine
    target: 127.0.0.1:9000
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from indexer.batch import Tier
from indexer.translate import HashMode, MediumMap
from kvplane.config import ClientTlsConfig, ServerConfig, StrictModel, parse_host_port

TierName = Literal["HBM", "DRAM", "SSD"]
MediumTarget = Literal["HBM", "DRAM", "SSD", "skip"]


def _tier(name: MediumTarget) -> Tier | None:
    return None if name == "skip" else Tier[name]


def _all_tier_names() -> list[TierName]:
    return ["HBM", "DRAM", "SSD"]


class _SourceCommon(StrictModel):
    # Which key space this worker is indexed in; MatchTokens finds it with the matching
    # `key_space` (engine, from vLLM: KEY_SPACE_VLLM_SHA256[_CBOR]; canonical: the default).
    hash: HashMode = HashMode.ENGINE
    # Block size for events that carry tokens but no block_size; default: the top-level one.
    block_size: int | None = Field(default=None, gt=0)
    # Where events with a nil medium, and with medium EXTERNAL, go ("skip" drops them).
    nil_medium: MediumTarget = "HBM"
    external_medium: MediumTarget = "skip"
    # Tiers an AllBlocksCleared (without a medium) clears.
    clear_tiers: list[TierName] = Field(default_factory=_all_tier_names)

    def medium_map(self) -> MediumMap:
        return MediumMap(nil=_tier(self.nil_medium), external=_tier(self.external_medium))

    def clear_tier_values(self) -> tuple[Tier, ...]:
        return tuple(Tier[name] for name in self.clear_tiers)


class ZmqSourceConfig(_SourceCommon):
    kind: Literal["zmq"]
    worker_id: str = Field(min_length=1)
    worker_address: str = ""
    endpoint: str = Field(min_length=1)
    replay_endpoint: str | None = None
    topic: str = ""
    # Bind the SUB socket instead of connecting (for publishers that connect).
    bind: bool = False
    # Positional (array) events: read fields at index >= 7 as vLLM's ("vllm") or ignore them.
    array_tail: Literal["ignore", "vllm"] = "ignore"
    replay_timeout_s: float = Field(default=5.0, gt=0)


class OpenEngineSourceConfig(_SourceCommon):
    kind: Literal["openengine"]
    target: str
    # Defaults: the target (the address routers dial is the engine's OpenEngine address).
    worker_id: str | None = None
    worker_address: str | None = None
    data_parallel_ranks: list[int] = Field(default_factory=list)
    # When SubscribeKvEvents is unimplemented, follow a ZMQ source from GetKvEventSources.
    discover_zmq: bool = True
    # Dial the engine with TLS ({ca_file, cert_file, key_file, server_name}); None: insecure.
    tls: ClientTlsConfig | None = None

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        parse_host_port(value)
        return value


SourceConfig = Annotated[ZmqSourceConfig | OpenEngineSourceConfig, Field(discriminator="kind")]


class RedisTlsConfig(StrictModel):
    """TLS to Redis (also implied by a rediss:// URL). Files are PEM."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


class RedisBackendConfig(StrictModel):
    """The `redis:` block, read when `backend` is redis://, rediss:// or redis+cluster://
    (docs/redis.md)."""

    # Every key starts with it; one partition (one cluster slot) per `model`.
    key_prefix: str = Field(default="kvplane", min_length=1)
    model: str = Field(default="default", min_length=1)
    # Hashes holding a partition's block records; fixed once the partition holds data.
    buckets: int = Field(default=65536, ge=1, le=1 << 24)
    username: str | None = None
    # A file holding the password (surrounding whitespace ignored).
    password_file: Path | None = None
    tls: RedisTlsConfig | None = None
    timeout_s: float = Field(default=2.0, gt=0)
    connect_timeout_s: float = Field(default=0.5, gt=0)
    # Batches kept in order while Redis is down; past that, overflowing workers are resynced.
    max_buffered_batches: int = Field(default=10_000, ge=0)

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
    block_size: int = Field(default=16, gt=0)
    # Prefix queries (MatchExternalKvPrefix, MatchTokens) in flight beyond this are shed with
    # RESOURCE_EXHAUSTED.
    max_concurrent_prefix_queries: int = Field(default=64, gt=0)
    # Largest request the server accepts (gRPC's default is 4 MiB). MatchExternalKvPrefix has
    # no length cap in the seed; this one (about 8 bytes a hash) is the effective one.
    max_request_bytes: int = Field(default=64 << 20, gt=0)
    # Options of a Redis backend (ignored by `memory`).
    redis: RedisBackendConfig = Field(default_factory=RedisBackendConfig)

    def backend_options(self) -> dict[str, Any]:
        """Keyword options for `indexer.backends.open_backend(self.backend, ...)`."""
        return {} if self.backend == "memory" else self.redis.backend_options()

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
