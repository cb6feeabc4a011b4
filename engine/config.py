"""The engine server's configuration (`kvplane engine serve --config FILE`).

One pydantic model for the whole process. `model` is `sim` (the timing-model runner, no torch),
`builtin` (the torch runner on a tiny deterministic random Llama that kvplane builds on first
use under ~/.cache/kvplane/models, or $KVPLANE_CACHE_DIR/models: see
engine.torch_runner.builtin_model) or the path of an HF model directory (the torch runner).
KV capacity is given either as a number of blocks or as a byte budget (the torch runner turns
bytes into blocks from the model's shape; the sim runner needs blocks). KV events always go to
`SubscribeKvEvents`; the vLLM-compatible ZMQ publisher is optional. `kv_transfer` sets the
KV sessions of PREFILL and DECODE engines (on an AGGREGATED engine it is refused, never
ignored). `lora` serves PEFT LoRA adapters (off by default, as vLLM's `--enable-lora`).
`generation_config` (vLLM's `--generation-config`): whether a model directory's
generation_config.json gives the defaults of the sampling options requests leave unset.

`runner` (vLLM's `--runner`): `generate` serves Generate and the pooling tasks, `pooling` only
Embed/Classify/Score (no LM head needed, a one-block KV cache, the health probe pools instead
of generating), `auto` picks pooling for a `*ForSequenceClassification` checkpoint without an
LM head and generate otherwise (it needs the checkpoint, so the service resolves it at load).
`pooling_conflicts` names what a pooling engine cannot have: checked here for an explicit
`runner: pooling`, for `auto` by `pools_only` on the checkpoint (by the service at load, and
by `kvplane up` before any member starts).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kvplane.config import (
    BIND_WILDCARD_HOSTS,
    ClientTlsConfig,
    ServerConfig,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictModel,
    check_needs,
    check_zmq_endpoint,
    settings_given,
)
from kvplane.errors import ConfigError
from kvplane.zmq_ip import is_ipv4_wildcard

SIM_MODEL = "sim"
BUILTIN_MODEL = "builtin"


class EngineRoleName(enum.StrEnum):
    aggregated = "aggregated"
    prefill = "prefill"
    decode = "decode"


class RunnerName(enum.StrEnum):
    """What the engine serves: vLLM's `--runner` (`generate`, `pooling`, `auto`)."""

    generate = "generate"  # Generate (and the pooling tasks the model supports)
    pooling = "pooling"  # Embed, Classify, Score only
    auto = "auto"  # pooling for a classifier without an LM head, else generate


class GenerationConfigSource(enum.StrEnum):
    """Where the defaults of the sampling options a request leaves unset come from: vLLM's
    `--generation-config` (`auto`; its `vllm` is `none` here)."""

    auto = "auto"  # the model directory's generation_config.json, where it sets them
    none = "none"  # the engine's fixed defaults only


class SimTimingConfig(StrictModel):
    """The sim runner (`engine.core.sim_runner`): its timing model and dummy vocabulary.

    `time_scale` multiplies the modelled step time: 1 sleeps in real time, 0 never sleeps.
    The coefficients default to the sim runner's own (Dynamo's mocker, in ms).
    """

    time_scale: StrictFloat = Field(default=1.0, ge=0.0)
    prefill_ms_coeffs: tuple[StrictFloat, StrictFloat, StrictFloat] | None = None
    decode_ms_coeffs: tuple[StrictFloat, StrictFloat, StrictFloat] | None = None
    min_decode_ms: StrictFloat | None = Field(default=None, ge=0.0)
    vocab_size: StrictInt = Field(default=32000, gt=8)
    # Output token number N (1-based) is the EOS; None: never (dummy tokens avoid EOS).
    eos_after: StrictInt | None = Field(default=None, gt=0)


# The settings of the vLLM-compatible ZMQ publisher, read only with `zmq_enabled: true`.
_ZMQ_KEYS = ("endpoint", "replay_endpoint", "topic", "hwm")
# The transports the vLLM-compatible publisher binds (a data-parallel rank's own endpoint is
# derived from each: engine.server.zmq_publisher.rank_endpoint).
_PUBLISHER_TRANSPORTS = frozenset({"tcp", "ipc", "inproc"})


class KvEventsConfig(StrictModel):
    """Where KV events go besides `SubscribeKvEvents` (always on)."""

    # Batches kept for replay (gRPC `start_sequence_number` and the ZMQ replay socket).
    buffer_steps: StrictInt = Field(default=10_000, gt=0)
    # The vLLM-compatible ZMQ PUB (+ replay ROUTER). Off by default.
    zmq_enabled: StrictBool = False
    # Bind addresses; port `*` picks a free port (the bound one is advertised). Data-parallel
    # rank r binds port + r (an ipc/inproc name + `_dp<r>`), as vLLM does.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5558"
    # None -> `kv@<advertised host:port>@<served model name>`, vLLM fleets' convention.
    topic: str | None = None
    hwm: StrictInt = Field(default=100_000, gt=0)
    # Host put in GetKvEventSources (and in the KV session endpoints of PREFILL/DECODE engines)
    # when the bind host is a wildcard (`*`, 0.0.0.0, ::). None -> the gRPC listen host if it is
    # specific, else this machine's address.
    advertised_host: str | None = None
    data_parallel_rank: StrictInt = Field(default=0, ge=0)

    @field_validator("advertised_host")
    @classmethod
    def _unbracket(cls, value: str | None) -> str | None:
        """`[fd00::1]` is the host fd00::1: the brackets belong to HOST:PORT, which adds them."""
        if value and value.startswith("[") and value.endswith("]"):
            return value[1:-1]
        return value

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        """A bind address (`*` allowed) the publisher's sockets take: refused here, before
        the engine serves, rather than when they bind."""
        if value is not None:
            check_zmq_endpoint(value, bind=True, transports=_PUBLISHER_TRANSPORTS)
        return value

    @model_validator(mode="after")
    def _check_endpoints(self) -> KvEventsConfig:
        check_needs(self, _ZMQ_KEYS, "zmq_enabled: true", met=self.zmq_enabled)
        if self.advertised_host and self.advertised_host in BIND_WILDCARD_HOSTS:
            raise ValueError(
                f"kv_events.advertised_host {self.advertised_host!r} is a bind wildcard: set "
                "an address other machines can dial (or leave it out)"
            )
        if self.zmq_enabled and self.advertised_host and ":" in self.advertised_host:
            for name, value in (
                ("endpoint", self.endpoint),
                ("replay_endpoint", self.replay_endpoint),
            ):
                if value is not None and is_ipv4_wildcard(value):
                    raise ValueError(
                        f"kv_events.{name} {value} listens on IPv4 only, so it cannot be "
                        f"reached at the IPv6 kv_events.advertised_host {self.advertised_host}: "
                        "bind tcp://*:PORT (both IP versions) or [::]"
                    )
        return self


class KvTransferConfig(StrictModel):
    """KV transfer between a PREFILL and a DECODE engine (`engine.server.kv_transfer`)."""

    # A PREFILL engine releases a session that no decode engine released (nor Abort) this long
    # after its PrefillReady at the latest (10 s after a pull that sent every block).
    session_ttl_s: StrictFloat = Field(default=60.0, gt=0.0)
    # A DECODE engine gives up a pull after this long (UNAVAILABLE).
    pull_timeout_s: StrictFloat = Field(default=30.0, gt=0.0)
    # A DECODE engine whose KV pool has no room for a pulled session's blocks when they arrive
    # holds their bytes in host memory, and imports them when the scheduler admits the request
    # (in its FCFS turn, as running sequences end), up to this many bytes for all its waiting
    # requests; beyond, the blocks are dropped and the request computes its prompt (counted in
    # kvplane_engine_kv_imports{outcome="dropped"}). A sim engine's blocks have no bytes.
    max_held_kv_bytes: StrictInt = Field(default=1 << 30, ge=0)
    # The bearer token a DECODE engine presents to prefill engines that have `auth:` (their
    # token); None: none.
    peer_token_file: Path | None = None
    # TLS for a DECODE engine's connections to prefill engines that serve TLS; None: insecure.
    peer_tls: ClientTlsConfig | None = None

    # The role whose engines read each key (`EngineConfig` refuses it on any other).
    ROLE_OF_KEY: ClassVar[dict[str, EngineRoleName]] = {
        "session_ttl_s": EngineRoleName.prefill,
        "pull_timeout_s": EngineRoleName.decode,
        "max_held_kv_bytes": EngineRoleName.decode,
        "peer_token_file": EngineRoleName.decode,
        "peer_tls": EngineRoleName.decode,
    }


class LoraConfig(StrictModel):
    """LoRA adapters (LoadLora/UnloadLora/ListLoras, `GenerateRequest.lora_name`)."""

    # Off: every LoRA call and a Generate naming an adapter is FAILED_PRECONDITION and
    # ModelInfo says supports_lora false (vLLM serves LoRA only with --enable-lora too).
    enabled: StrictBool = False
    # Adapters loaded at once (LoadLora beyond: RESOURCE_EXHAUSTED); one unloaded while
    # requests use it counts until they end (they hold its weights). Unlike vLLM's max_loras
    # (adapters per batch, default 1, the rest cached on the CPU), every loaded adapter is
    # resident and any mix of them runs in one step.
    max_loras: StrictInt = Field(default=8, gt=0)
    # Highest adapter rank accepted (vLLM's default, 16); above: FAILED_PRECONDITION.
    max_lora_rank: StrictInt = Field(default=16, gt=0)

    @model_validator(mode="after")
    def _check_enabled(self) -> LoraConfig:
        check_needs(self, ("max_loras", "max_lora_rank"), "enabled: true", met=self.enabled)
        return self


class EngineConfig(ServerConfig):
    listen: str = "127.0.0.1:50061"
    # `sim`, `builtin` or the path of an HF model directory (config.json, safetensors,
    # tokenizer.json).
    model: str = SIM_MODEL
    # The name clients put in `GenerateRequest.model`; None -> `sim` or the directory's name.
    served_model_name: str | None = Field(default=None, min_length=1)
    served_model_aliases: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    role: EngineRoleName = EngineRoleName.aggregated
    runner: RunnerName = RunnerName.auto
    # `auto`: the sampling values of the model's generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty, max_new_tokens) are the defaults of the options a
    # request leaves unset, as vLLM's default `--generation-config auto`; `none`: the
    # engine's fixed defaults. The sim and builtin models have none either way.
    generation_config: GenerationConfigSource = GenerationConfigSource.auto
    # None -> a fresh id per process (`engine-<hex>`).
    instance_id: str | None = None

    block_size: StrictInt = Field(default=16, gt=0)
    # Exactly one of these may be set; neither -> 1024 blocks.
    num_kv_blocks: StrictInt | None = Field(default=None, gt=0)
    kv_cache_bytes: StrictInt | None = Field(default=None, gt=0)
    max_num_seqs: StrictInt = Field(default=64, gt=0)
    max_num_batched_tokens: StrictInt = Field(default=2048, gt=0)
    # Admission control: a Generate, Embed, Classify or Score arriving while this many
    # requests are queued (GetLoad's queued_requests: accepted, not yet running; and pooling
    # tasks accepted whose first batch has not begun on the engine thread) is refused at once
    # with RESOURCE_EXHAUSTED, so that a client or router goes elsewhere instead of waiting.
    # None: unbounded, as vLLM (a lone engine's clients would rather wait than fail).
    max_queued_requests: StrictInt | None = Field(default=None, gt=0)
    # None -> the model's own limit (config.json) or 4096 for sim.
    max_model_len: StrictInt | None = Field(default=None, gt=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = Field(default="cpu", min_length=1)
    # torch intra-op threads for the torch runner; None keeps torch's default. On small
    # machines shared with other processes, 1 is often several times faster for small steps.
    num_threads: StrictInt | None = Field(default=None, ge=1)
    seed: StrictInt = 0

    sim: SimTimingConfig = Field(default_factory=SimTimingConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    kv_transfer: KvTransferConfig = Field(default_factory=KvTransferConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("instance_id")
    @classmethod
    def _check_instance_id(cls, value: str | None) -> str | None:
        # Left out, each process gets a fresh id; an empty one given is a mistake (an unset
        # shell variable), not a request for one, and a blank id names no engine to a reader.
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out for a fresh id per process)")
        return value

    @model_validator(mode="after")
    def _check_capacity(self) -> EngineConfig:
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("set num_kv_blocks or kv_cache_bytes, not both")
        if self.model == SIM_MODEL and self.kv_cache_bytes is not None:
            raise ValueError("the sim runner needs num_kv_blocks, not kv_cache_bytes")
        return self

    @model_validator(mode="after")
    def _check_sim(self) -> EngineConfig:
        # `sim` configures the sim runner alone: a torch model (builtin, a checkpoint) has
        # its own vocabulary and takes the time its passes take, so it would do nothing, and
        # whoever set it expects it to (a sim config pointed at a real model).
        given = settings_given(self.sim, tuple(SimTimingConfig.model_fields))
        if given and not self.is_sim:
            keys = ", ".join(f"sim.{key}" for key in given)
            raise ValueError(
                f"sim applies only to model: sim (the sim runner), not to the torch model "
                f"{self.model!r} ({keys} given): remove sim, or set model: sim"
            )
        return self

    @model_validator(mode="after")
    def _check_kv_transfer(self) -> EngineConfig:
        # Each key is read by one role only (a PREFILL engine holds sessions, a DECODE engine
        # pulls them): elsewhere it would do nothing, and a user who set it expects it to (a
        # fleet config meant for another engine, a mistyped role).
        for key in sorted(self.kv_transfer.model_fields_set):
            role = KvTransferConfig.ROLE_OF_KEY[key]
            if self.role is not role:
                raise ValueError(
                    f"kv_transfer.{key} applies to {role.value.upper()} engines only: set "
                    f"role: {role.value}, or remove kv_transfer.{key}"
                )
        return self

    @model_validator(mode="after")
    def _check_runner(self) -> EngineConfig:
        if self.runner is RunnerName.pooling:
            conflict = self.pooling_conflicts()
            if conflict is not None:
                raise ValueError(f"runner: pooling {conflict}")
        return self

    def pooling_conflicts(self) -> str | None:
        """What in this config a pooling-only engine cannot honour (the rest of the sentence
        after "runner: pooling"), or None."""
        if self.is_sim:
            return "needs a torch model: the sim runner has no hidden states to pool"
        if self.role is not EngineRoleName.aggregated:
            return (
                f"serves Embed/Classify/Score only: role {self.role.value} is for engines "
                "that generate (use role: aggregated)"
            )
        if self.lora.enabled:
            return "takes no LoRA adapter (pooling tasks refuse lora_name): unset lora.enabled"
        if self.kv_events.zmq_enabled:
            return "has no KV cache and publishes no KV events: unset kv_events.zmq_enabled"
        return None

    @property
    def is_sim(self) -> bool:
        return self.model == SIM_MODEL

    @property
    def is_builtin(self) -> bool:
        return self.model == BUILTIN_MODEL

    def pools_only(self, model_dir: Path) -> bool:
        """`runner` resolved for the checkpoint in `model_dir`: whether the engine serves
        Embed/Classify/Score only. `auto` does so for a sequence classifier without an LM head
        (untied, no `lm_head.weight`; it reads config.json and the safetensors headers, no
        tensor) and then refuses what `pooling_conflicts` names, as `runner: pooling` is
        refused at load (ConfigError). (vLLM's `auto` pools every classifier; here one with a
        head keeps generating: `runner: pooling` gives vLLM's behaviour.) Raises
        CheckpointError for a checkpoint it cannot read."""
        if self.runner is not RunnerName.auto:
            return self.runner is RunnerName.pooling
        from engine.torch_runner.config import ModelConfig
        from engine.torch_runner.loader import ships_lm_head  # imports torch

        if ModelConfig.from_dir(model_dir).classifier_labels is None or ships_lm_head(model_dir):
            return False
        conflict = self.pooling_conflicts()
        if conflict is not None:
            raise ConfigError(
                f"{model_dir} is a sequence classifier without an LM head, so runner auto "
                f"serves it for pooling only, and runner: pooling {conflict}"
            )
        return True

    def model_name(self) -> str:
        """The served model name: explicit, else `sim`, else the model directory's name."""
        if self.served_model_name:
            return self.served_model_name
        if self.is_sim:
            return SIM_MODEL
        return self.model.rstrip("/").rsplit("/", 1)[-1] or self.model


def check_model_source(model: str) -> None:
    """`model` names what an engine can serve: `sim`, `builtin`, or a directory holding
    config.json (its weights and tokenizer are read when the engine starts); ConfigError
    otherwise. Not one of EngineConfig's checks: the directory is looked for on the machine
    that runs the engine, by `kvplane engine serve` before anything loads (its --model as a
    usage error, its file's `model` as a config error naming the file; `kvplane up` when it
    loads the fleet file, naming the member) and by the engine when it starts."""
    if model in (SIM_MODEL, BUILTIN_MODEL) or (Path(model) / "config.json").is_file():
        return
    raise ConfigError(
        f"model {model!r} is not {SIM_MODEL!r}, {BUILTIN_MODEL!r} or an HF model directory"
        " (one holding config.json)"
    )
