"""The indexer server's configuration (`kvplane indexer serve --config FILE`).

```yaml
listen: 127.0.0.1:50051
backend: memory                    # or redis://HOST:PORT/DB
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

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from indexer.batch import Tier
from indexer.translate import HashMode, MediumMap
from kvplane.config import ServerConfig, StrictModel, parse_host_port

TierName = Literal["HBM", "DRAM", "SSD"]
MediumTarget = Literal["HBM", "DRAM", "SSD", "skip"]


def _tier(name: MediumTarget) -> Tier | None:
    return None if name == "skip" else Tier[name]


def _all_tier_names() -> list[TierName]:
    return ["HBM", "DRAM", "SSD"]


class _SourceCommon(StrictModel):
    # Which key space this worker is indexed in.
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

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        parse_host_port(value)
        return value


SourceConfig = Annotated[ZmqSourceConfig | OpenEngineSourceConfig, Field(discriminator="kind")]


class IndexerConfig(ServerConfig):
    listen: str = "127.0.0.1:50051"
    backend: str = "memory"
    sources: list[SourceConfig] = Field(default_factory=list)
    # Default tokens per block: MatchTokens with block_size 0, canonical-mode sources.
    block_size: int = Field(default=16, gt=0)
    # Concurrent MatchExternalKvPrefix calls beyond this are shed with RESOURCE_EXHAUSTED.
    max_concurrent_prefix_queries: int = Field(default=64, gt=0)

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
