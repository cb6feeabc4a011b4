"""The controller's configuration (`kvplane controller serve --config FILE`).

```yaml
listen: 127.0.0.1:8100
index: {backend: memory}           # or redis://..., or {remote: 127.0.0.1:50051}
router: {policy: kvplane}
engines:
  - {address: 127.0.0.1:9001}
  - {address: 127.0.0.1:9002, kv_events: zmq, array_tail: vllm}
engine_tls: {ca_file: ca.pem}      # optional: engines serve TLS (add cert_file/key_file for mTLS)
```
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from controller.router import APPROXIMATE_TTL_S, POLICY_NAMES, BusyThresholds, KvplaneWeights
from indexer.backends import REDIS_SCHEMES, check_backend_url, check_redis_options, shown_url
from indexer.config import (
    DEFAULT_WRITER_LEASE_S,
    LEASE_KEYS,
    RedisBackendConfig,
    ReplicaName,
    WriterLeaseSeconds,
)
from indexer.vllm_hash import VllmHashAlgo, unseeded_problem
from indexer.zmq_decode import ArrayTail
from kvplane.channels import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S
from kvplane.config import (
    ClientTlsConfig,
    ServerConfig,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictModel,
    check_ceilings,
    check_needs,
    parse_dial_target,
)
from kvplane.server import MIN_PING_INTERVAL_S

_DEFAULT_WEIGHTS = KvplaneWeights()
_DEFAULT_BUSY = BusyThresholds()


class KvEventsMode(enum.StrEnum):
    grpc = "grpc"  # SubscribeKvEvents (falls back to an advertised ZMQ source)
    zmq = "zmq"  # the ZMQ source GetKvEventSources advertises
    none = "none"  # no events: the router is cache-blind for this engine
    # No events: the router predicts the engine's cache from the prompts it routed there
    # (`router.approximate_ttl_s`, bounded by the engine's KV capacity).
    approximate = "approximate"

    @property
    def followed(self) -> bool:
        """Whether the controller follows the engine's KV events (none and approximate
        engines publish none it reads)."""
        return self in (KvEventsMode.grpc, KvEventsMode.zmq)


class EngineEntry(StrictModel):
    address: str
    kv_events: KvEventsMode = KvEventsMode.grpc
    # How the positional events of the engine's ZMQ source (`kv_events: zmq`, or grpc's
    # fallback) are read from index 7 on (`indexer.zmq_decode`); None: as the engine's
    # GetEngineInfo name says (`engine_array_tail`: "vllm" for vLLM, else "ignore").
    array_tail: ArrayTail | None = None

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_dial_target(value)
        return value

    @model_validator(mode="after")
    def _check_array_tail(self) -> EngineEntry:
        check_needs(self, ("array_tail",), "kv_events zmq or grpc", met=self.kv_events.followed)
        return self


# The settings of a remote indexer, read only with `remote`.
_REMOTE_KEYS = ("remote_key_space", "remote_hash_seed", "remote_tls", "remote_token_file")


class IndexConfig(StrictModel):
    # `memory` (embedded), `redis://HOST:PORT[/DB]` or `redis+cluster://HOST:PORT`.
    backend: str = "memory"
    # A remote `kvplane indexer` (HOST:PORT): the controller asks it (MatchTokens) instead of
    # keeping an index, and does not subscribe to KV events itself.
    remote: str | None = None
    # The key space the remote indexer's workers are in (its sources' `hash:`): `canonical`
    # (kvplane engines, `hash: canonical` sources), or vLLM's own block hashes for `hash:
    # engine` sources fed by vLLM: `sha256` (vLLM's default) or `sha256_cbor`, with
    # `remote_hash_seed` the engines' PYTHONHASHSEED (unset: vLLM's default seed; refused
    # with `canonical`, which has no seed). These and `remote_tls` / `remote_token_file` are
    # refused without `remote` (`_REMOTE_KEYS`): nothing else reads them.
    remote_key_space: Literal["canonical", "sha256", "sha256_cbor"] = "canonical"
    remote_hash_seed: str | None = None
    # Dial the remote indexer with TLS ({ca_file, cert_file, key_file, server_name}; see
    # kvplane.config.ClientTlsConfig); None: insecure.
    remote_tls: ClientTlsConfig | None = None
    # A file holding the bearer token of a remote indexer run with `auth` (sent on every call:
    # it needs it for ResyncEngine, and for MatchTokens too with `protect_reads`).
    remote_token_file: Path | None = None
    # Options of a Redis backend, the indexer's `redis:` block (docs/redis.md).
    redis: RedisBackendConfig = Field(default_factory=RedisBackendConfig)
    # Several controller replicas on one Redis index: an engine's KV events are written by
    # the one replica holding its writer lease, which expires this long after its last
    # renewal (renewed every third of it); another replica takes over within about this long
    # after the holder stops (indexer.writer_lease, docs/controller.md).
    writer_lease_s: WriterLeaseSeconds = DEFAULT_WRITER_LEASE_S
    # This replica's name in the writer leases: a new process under the same name (the
    # replica restarted: kill -9, a crash, a container restart) takes its leases back at once
    # rather than after writer_lease_s, and its previous process's late writes are refused.
    # None: the host name and `listen` (with a port: `listen` on port 0 names no replica, and
    # a restarted process waits for the expiry). Replicas must not share a name.
    replica_name: ReplicaName | None = None

    @field_validator("remote")
    @classmethod
    def _check_remote(cls, value: str | None) -> str | None:
        if value is not None:
            parse_dial_target(value)
        return value

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        check_backend_url(value)
        return value

    @model_validator(mode="after")
    def _one_index(self) -> IndexConfig:
        if self.remote is not None and "backend" in self.model_fields_set:
            raise ValueError(
                "set either remote (a kvplane indexer) or backend "
                f"{shown_url(self.backend)!r}, not both"
            )
        check_redis_options(
            self.backend, "redis" in self.model_fields_set, tls=self.redis.tls is not None
        )
        redis = self.backend.startswith(REDIS_SCHEMES)
        check_needs(self, LEASE_KEYS, f"a Redis backend (backend is {self.backend})", met=redis)
        check_needs(self, _REMOTE_KEYS, "remote (a kvplane indexer)", met=self.remote is not None)
        algo = None if self.remote_key_space == "canonical" else VllmHashAlgo(self.remote_key_space)
        problem = unseeded_problem(
            self.remote_hash_seed, algo, "remote_hash_seed", "remote_key_space"
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    def backend_options(self) -> dict[str, Any]:
        """Keyword options for `indexer.backends.open_backend(self.backend, ...)`."""
        return {} if self.backend == "memory" else self.redis.backend_options()


class RouterConfig(StrictModel):
    policy: str = "kvplane"
    # The `kvplane` cost (controller.router.policies.KvplaneWeights).
    overlap_weight: StrictFloat = Field(default=_DEFAULT_WEIGHTS.overlap_weight, ge=0)
    idle_overlap_weight: StrictFloat = Field(default=_DEFAULT_WEIGHTS.idle_overlap_weight, ge=0)
    # 0 disables the knee (the queue costs its length).
    queue_knee: StrictFloat = Field(default=_DEFAULT_WEIGHTS.queue_knee, ge=0)
    # 0 = a flat decode_weight per active request.
    pass_tokens: StrictFloat = Field(default=_DEFAULT_WEIGHTS.pass_tokens, ge=0)
    pass_decodes: StrictInt = Field(default=_DEFAULT_WEIGHTS.pass_decodes, ge=0)
    host_weight: StrictFloat = Field(default=_DEFAULT_WEIGHTS.host_weight, ge=0)
    disk_weight: StrictFloat = Field(default=_DEFAULT_WEIGHTS.disk_weight, ge=0)
    decode_weight: StrictFloat = Field(default=_DEFAULT_WEIGHTS.decode_weight, ge=0)
    tie_tokens: StrictFloat = Field(default=_DEFAULT_WEIGHTS.tie_tokens, ge=0)
    tie_ratio: StrictFloat = Field(default=_DEFAULT_WEIGHTS.tie_ratio, ge=0)
    temperature: StrictFloat = Field(default=_DEFAULT_WEIGHTS.temperature, ge=0)
    # A backlogged fleet (every queue at least backlog_tokens prefill tokens) keeps prefixes
    # at backlog_overlap_weight; 0 turns it off.
    backlog_tokens: StrictFloat = Field(default=_DEFAULT_WEIGHTS.backlog_tokens, ge=0)
    backlog_overlap_weight: StrictFloat = Field(
        default=_DEFAULT_WEIGHTS.backlog_overlap_weight, ge=0
    )
    # An engine whose prefill wait is more than this many tokens longer than the quickest
    # engine's is not chosen, whatever it holds; 0 turns it off.
    patience_tokens: StrictFloat = Field(default=_DEFAULT_WEIGHTS.patience_tokens, ge=0)
    # What each token of KV an engine cannot hold for the request costs; 0 turns it off.
    memory_weight: StrictFloat = Field(default=_DEFAULT_WEIGHTS.memory_weight, ge=0)
    # A prefix that this many requests in flight share is hot: recomputing it on another
    # engine costs the overlap weight divided by their number; 0 turns it off (1 is refused:
    # dividing by one changes nothing).
    hot_prefix_requests: StrictInt = Field(default=_DEFAULT_WEIGHTS.hot_prefix_requests, ge=0)
    # `kvplane` skips busy engines (controller.router.router.BusyThresholds): KV usage or
    # queued requests at these thresholds, while at most busy_max_fraction of them are busy.
    busy_kv_usage: StrictFloat | None = Field(default=_DEFAULT_BUSY.kv_usage, gt=0, le=1)
    busy_queued_requests: StrictInt | None = Field(default=_DEFAULT_BUSY.queued_requests, gt=0)
    busy_max_fraction: StrictFloat = Field(default=_DEFAULT_BUSY.max_busy_fraction, ge=0, le=1)
    # Load shedding, for every policy: a new request whose every candidate engine is busy by
    # the thresholds above (busy_max_fraction aside) is refused with RESOURCE_EXHAUSTED, for
    # the client to retry later, rather than queued on the least loaded of them. Off: queued.
    reject_when_all_busy: StrictBool = False
    # Requests whose metadata has this key stick to the engine that served the same value.
    session_metadata_key: str | None = Field(default=None, min_length=1)
    # How long blocks just routed count as held before the engine's events arrive (and in any
    # case until the request's first token).
    pending_ttl_s: StrictFloat = Field(default=10.0, ge=0)
    # Engines with `kv_events: approximate` (no KV events): each prompt routed to one counts
    # as cached there this long after the last request routed through its blocks, its least
    # recently routed blocks dropped first past the engine's KV capacity
    # (controller.router.router.PendingPrefixes, APPROXIMATE_TTL_S).
    approximate_ttl_s: StrictFloat = Field(default=APPROXIMATE_TTL_S, gt=0)
    # Disaggregated fleets: a decode engine that already holds this fraction of a prompt
    # prefills it itself, skipping the prefill hop. None (default): always hop, since the
    # seed's DECODE engines take requests that carry a KV session; set it (e.g. 0.9) for decode
    # engines that also prefill locally.
    skip_prefill_ratio: StrictFloat | None = Field(default=None, gt=0, le=1)
    # Disaggregated fleets whose decode engines do not prefill: a request that finds no
    # prefill engine taking traffic while one is in the fleet out of routing for a moment
    # (restarting, not READY again yet; not one unreachable for longer than
    # health.abandon_streams_after_s) waits this long at most for one to take traffic
    # again (a new request, and one run again after its KV session was lost), before it
    # fails as it would at once; its deadline passing ends it as any call. None: twice
    # health.poll_interval_s (what an engine's health takes to be read again); 0: no wait.
    prefill_wait_s: StrictFloat | None = Field(default=None, ge=0)
    # Seed of the router's randomness (ties, power of two); None = from the OS.
    seed: StrictInt | None = None
    # Controller replicas behind one load balancer, sharing an index on Redis: each tells the
    # others what it routes (on a pub/sub channel of that Redis), so each routes knowing the
    # whole fleet's requests in flight and sticks a session to one engine through any of them
    # (controller.replica_sync). Needs index.backend redis.
    replica_sync: StrictBool = False
    # A replica publishes at least this often (a beat when it routes nothing); one not heard
    # from for replica_timeout_s has its requests released.
    replica_heartbeat_s: StrictFloat = Field(default=1.0, gt=0)
    replica_timeout_s: StrictFloat = Field(default=5.0, gt=0)

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; choose from {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("hot_prefix_requests")
    @classmethod
    def _check_hot_prefix_requests(cls, value: int) -> int:
        if value == 1:
            # Dividing by one sharer changes nothing: 1 would read as "any prefix in flight
            # is hot" and act as 2.
            raise ValueError(
                "hot_prefix_requests 1 divides the overlap weight by 1, which changes nothing: "
                "use 2 or more, or 0 to turn the rule off"
            )
        return value

    @model_validator(mode="after")
    def _check_shedding(self) -> RouterConfig:
        if (
            self.reject_when_all_busy
            and self.busy_kv_usage is None
            and self.busy_queued_requests is None
        ):
            raise ValueError(
                "reject_when_all_busy needs busy_kv_usage or busy_queued_requests: "
                "without either no engine is ever busy"
            )
        return self

    def weights(self) -> KvplaneWeights:
        return KvplaneWeights(
            overlap_weight=self.overlap_weight,
            idle_overlap_weight=self.idle_overlap_weight,
            queue_knee=self.queue_knee,
            pass_tokens=self.pass_tokens,
            pass_decodes=self.pass_decodes,
            host_weight=self.host_weight,
            disk_weight=self.disk_weight,
            decode_weight=self.decode_weight,
            tie_tokens=self.tie_tokens,
            tie_ratio=self.tie_ratio,
            temperature=self.temperature,
            backlog_tokens=self.backlog_tokens,
            backlog_overlap_weight=self.backlog_overlap_weight,
            patience_tokens=self.patience_tokens,
            memory_weight=self.memory_weight,
            hot_prefix_requests=self.hot_prefix_requests,
        )

    def busy(self) -> BusyThresholds:
        return BusyThresholds(self.busy_kv_usage, self.busy_queued_requests, self.busy_max_fraction)


class HealthConfig(StrictModel):
    poll_interval_s: StrictFloat = Field(default=1.0, gt=0)
    load_poll_interval_s: StrictFloat = Field(default=0.5, gt=0)
    rpc_timeout_s: StrictFloat = Field(default=2.0, gt=0)
    # Unreachable engines are retried after backoff_initial_s, doubling up to backoff_max_s;
    # one that nothing listened for is polled at once when its channel connects again.
    backoff_initial_s: StrictFloat = Field(default=0.5, gt=0)
    backoff_max_s: StrictFloat = Field(default=30.0, gt=0)
    # An engine unreachable this long (its polls unanswered: a stopped or wedged process, a
    # host gone without a TCP reset; a poll it answers, with an error even, restarts the
    # count) has the gateway's calls to it ended, as if it had left
    # the fleet: streams without output are retried elsewhere, the others end with the
    # gateway's error for a lost engine. Long enough to ride out a blip (a GC pause, a
    # congested link); well below clients' deadlines, which would otherwise be what ends
    # them. 0 or null: never (streams wait for the engine or the client's deadline).
    abandon_streams_after_s: StrictFloat | None = Field(default=30.0, ge=0)
    # Keepalive pings on an engine's connections while calls are under way (its KV-event
    # subscription, relayed streams): one without an answer within keepalive_timeout_s ends
    # them (a subscription is made again), so a connection gone silent without a reset is
    # noticed within keepalive_s + keepalive_timeout_s. Not below 300 unless every engine
    # takes pings that often (kvplane's own take one a second): a server with gRPC's
    # defaults (vLLM's) answers them with GOAWAY `too_many_pings`, ending its calls.
    keepalive_s: StrictFloat = Field(default=KEEPALIVE_TIME_S, ge=MIN_PING_INTERVAL_S)
    keepalive_timeout_s: StrictFloat = Field(default=KEEPALIVE_TIMEOUT_S, gt=0)
    # Outlier ejection (controller/registry.py): an engine whose requests fail this many times
    # in a row (INTERNAL, UNKNOWN, DATA_LOSS) while its health says ready leaves
    # routing for eject_for_s, doubling with each ejection in a row up to eject_max_s; at
    # most half of the fleet at once. 0: never.
    eject_after_failures: StrictInt = Field(default=5, ge=0)
    eject_for_s: StrictFloat = Field(default=10.0, gt=0)
    eject_max_s: StrictFloat = Field(default=120.0, gt=0)
    # Hold-down (controller/registry.py): an engine whose health leaves ready (NOT_READY,
    # STARTING, a failed poll) this many times within flap_window_s is held out of routing
    # once it says READY again, until it has said so for hold_down_s (doubling with each
    # hold-down in a row up to hold_down_max_s) and then for hold_down_ready_polls polls.
    # One leave (a restart) comes back at its first READY, as ever. 0: never held down;
    # 1 is refused (every restart would be held down). Never more than half of the fleet
    # is held out (held down or ejected) at once: the rest is routed all the same.
    hold_down_after_flaps: StrictInt = Field(default=3, ge=0)
    flap_window_s: StrictFloat = Field(default=60.0, gt=0)
    hold_down_s: StrictFloat = Field(default=10.0, gt=0)
    hold_down_max_s: StrictFloat = Field(default=300.0, gt=0)
    hold_down_ready_polls: StrictInt = Field(default=3, ge=1)

    @model_validator(mode="after")
    def _check_waits_and_hold_down(self) -> HealthConfig:
        check_ceilings(
            self,
            ("backoff_initial_s", "backoff_max_s"),
            ("eject_for_s", "eject_max_s"),
            ("hold_down_s", "hold_down_max_s"),
        )
        if self.hold_down_after_flaps == 1:
            # One leave of ready (a restart) comes back at its first READY: held down at
            # its first flap, every restart would be.
            raise ValueError(
                "health.hold_down_after_flaps must be 0 (never) or at least 2: at 1 every "
                "engine restart would be held down"
            )
        return self


class ControllerConfig(ServerConfig):
    listen: str = "127.0.0.1:8100"
    index: IndexConfig = Field(default_factory=IndexConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    engines: list[EngineEntry] = Field(default_factory=list)
    # Dial every engine (the configured ones and those added through the admin API) with TLS:
    # {ca_file, cert_file, key_file, server_name} (kvplane.config.ClientTlsConfig); None:
    # insecure.
    engine_tls: ClientTlsConfig | None = None
    # A file holding the bearer token of engines run with `auth`, sent on every call to an
    # engine (its polls, KV-event subscription and the gateway's calls): engines need it for
    # Drain, Abort and LoRA calls, and for every call with `protect_reads`. None: no token.
    engine_token_file: Path | None = None
    health: HealthConfig = Field(default_factory=HealthConfig)
    # The longest an engine may take to load or unload a LoRA adapter (the gateway's
    # LoadLora/UnloadLora, a restore on an engine that joins): an engine reads the adapter's
    # weights from disk, where health.rpc_timeout_s is for calls that read nothing. The
    # gateway's LoRA calls run one at a time, so a wedged engine holds the others up this
    # long at most (the wait for its LoRA change in progress included: the wait and the
    # call share it); a restore, off the engine's polls, holds up only the changes to it.
    lora_timeout_s: StrictFloat = Field(default=30.0, gt=0)
    # tokenizer.json of each model (by the model name requests carry), used to tokenise its
    # text prompts for routing (controller/tokenizers.py).
    tokenizers: dict[str, Path] = Field(default_factory=dict)
    # The tokenizer.json for text prompts of every model not in `tokenizers`; None: those are
    # routed by load only (token-id prompts always use the cache).
    tokenizer: Path | None = None
    # Text prompts longer than this many characters are routed by load without tokenising
    # them (the engine still gets the whole prompt): tokenising megabytes takes seconds of
    # CPU, and a prefix that long is rarely what decides where a request is cached.
    tokenize_max_chars: StrictInt = Field(default=1 << 20, ge=0)
    # Tokens per block when engines do not report it (GetModelInfo.kv_block_size).
    default_block_size: StrictInt = Field(default=16, gt=0)

    @field_validator("index", mode="before")
    @classmethod
    def _index_shorthand(cls, value: Any) -> Any:
        return {"backend": value} if isinstance(value, str) else value

    @field_validator("tokenizers")
    @classmethod
    def _check_tokenizer_models(cls, value: dict[str, Path]) -> dict[str, Path]:
        if "" in value:
            raise ValueError("tokenizers: name a model (the default tokenizer is `tokenizer`)")
        return value

    @model_validator(mode="after")
    def _check_replica_sync(self) -> ControllerConfig:
        if self.router.replica_sync and not self.index.backend.startswith("redis"):
            raise ValueError(
                "router.replica_sync needs the replicas' shared index on Redis "
                "(index.backend redis://... or redis+cluster://...): its pub/sub carries the sync"
            )
        if self.router.replica_timeout_s <= self.router.replica_heartbeat_s:
            raise ValueError("router.replica_timeout_s must be longer than replica_heartbeat_s")
        return self

    @model_validator(mode="after")
    def _check_engines(self) -> ControllerConfig:
        addresses = [e.address for e in self.engines]
        duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
        if duplicates:
            raise ValueError(f"engines listed twice: {', '.join(duplicates)}")
        return self
