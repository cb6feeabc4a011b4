"""LoRA adapters as the engine core sees them: what is loaded, under which name, id and path,
and which names running requests use. No tensors: a runner that serves LoRA (`LoraRunner`)
reads and applies the weights; the sim runner only checks the adapter's config.

Contract (the OpenEngine seed, "LoRA lifecycle"): an adapter is (positive `lora_id`, non-empty
`name`, absolute directory `path`); loading the same triple again is idempotent; another
loaded adapter with the same name, id or path is a conflict (ALREADY_EXISTS); an unknown name
is NOT_FOUND. Paths are compared as directories: `/a/x/` and `/a/./x` are `/a/x` (a client's
spelling must neither load one adapter twice under two names nor fail a repeated load). At
most `max_loras` adapters are loaded at once (RESOURCE_EXHAUSTED beyond).

Unloading while requests use the adapter (vLLM's behaviour: its unload only forgets the name,
requests already admitted keep their adapter): the name is gone at once for new requests, and
the runner drops the weights when the last request using them ends. Until then the same triple
may be loaded again (`LoraLoad.RESUMED`: the adapter is served again as it is, its weights,
cached blocks and KV sessions kept, and its running requests go on), but no other adapter under
that name (LoraMismatchError, FAILED_PRECONDITION): its running requests and the prefix cache
must never mix the old adapter's KV with the new one's (`EngineCore.load_lora` drops the name's
cached blocks when it loads another).

Threads: the engine thread mutates the registry; `adapters` is an immutable snapshot, replaced
on every change, that any thread may read (servers check a request's adapter before
acceptance, and again in the engine thread).

`read_adapter_config` parses a PEFT `adapter_config.json` (stdlib only).
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from engine.core.errors import (
    InvalidLoraError,
    LoraCapacityError,
    LoraConflictError,
    LoraMismatchError,
    LoraNotFoundError,
)

ADAPTER_CONFIG = "adapter_config.json"
# PEFT writes a few hundred bytes; anything near this is not an adapter config.
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The linear layers of a Llama/Qwen2 decoder layer that an adapter may target (PEFT's names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One loaded adapter, as LoadLora names it and ListLoras reports it."""

    lora_id: int
    name: str
    path: str

    def validate(self) -> None:
        if self.lora_id <= 0:
            raise InvalidLoraError(f"lora_id must be positive, got {self.lora_id}")
        if not self.name:
            raise InvalidLoraError("lora_name must be non-empty")
        if not Path(self.path).is_absolute():
            raise InvalidLoraError(f"source_path must be an absolute directory, got {self.path!r}")

    @property
    def directory(self) -> str:
        """`path` without a trailing slash, `.` or `..` components or doubled slashes: the
        directory, however the client spelled it (lexically: symlinks are not followed)."""
        return os.path.normpath(self.path)

    def same_as(self, other: LoraAdapter) -> bool:
        """The same triple (a repeated load, idempotent)."""
        return (self.lora_id, self.name, self.directory) == (
            other.lora_id,
            other.name,
            other.directory,
        )


class LoraLoad(enum.Enum):
    """What a load did."""

    ALREADY_LOADED = "already_loaded"  # exactly this adapter was loaded: nothing changed
    LOADED = "loaded"  # served afresh: what the name's earlier adapter left is dropped
    RESUMED = "resumed"  # unloaded while its requests still run: served again as it is


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What kvplane uses of a PEFT LoRA config."""

    rank: int
    alpha: float
    target_modules: TargetModules
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True, slots=True)
class TargetModules:
    """PEFT's `target_modules`: module names (a module is targeted when its full name, e.g.
    `model.layers.0.self_attn.q_proj`, is one of them or ends with `.` and one) or one regular
    expression its full name matches (`re.fullmatch`, PEFT's rule for a string, also taken as
    a name); `all-linear` names every module this engine adapts. As in PEFT (and vLLM, which
    takes the weights' names as the truth), a name this model lacks targets nothing: the
    weights decide."""

    names: frozenset[str] = frozenset()
    pattern: str | None = None

    def targets(self, module_path: str) -> bool:
        """Whether the module is targeted. The pattern comes with the adapter, so its match is
        bounded (`MAX_TARGET_MATCH_S`, matched by `regex`, which lets other threads run): one
        that backtracks catastrophically (`(.*?)(.*?)...(.*?)\\d\\1`) would otherwise hold the
        engine's process for hours. Past the bound: InvalidLoraError."""
        if self.pattern is not None and _full_match(self.pattern, module_path):
            return True
        return any(module_path == n or module_path.endswith(f".{n}") for n in self.names)


# A pattern that takes longer than this on one module name (microseconds for any sensible one)
# is refused.
MAX_TARGET_MATCH_S = 0.5


def _full_match(pattern: str, module_path: str) -> bool:
    import regex  # the engine extra's dependency; only the torch runner matches modules

    try:
        return (
            regex.fullmatch(pattern, module_path, timeout=MAX_TARGET_MATCH_S, concurrent=True)
            is not None
        )
    except TimeoutError:
        raise InvalidLoraError(
            f"{ADAPTER_CONFIG}: target_modules {pattern!r} took over {MAX_TARGET_MATCH_S:g} s "
            f"to match {module_path} (a regular expression that backtracks catastrophically)"
        ) from None
    except (regex.error, OverflowError, RecursionError) as exc:
        raise InvalidLoraError(
            f"{ADAPTER_CONFIG}: target_modules {pattern!r} is not a regular expression: {exc}"
        ) from None


def _target_modules(value: Any) -> TargetModules:
    if value == "all-linear":
        return TargetModules(names=frozenset(SUPPORTED_MODULES))
    if isinstance(value, str) and value:
        try:
            re.compile(value)
        except (re.error, OverflowError, RecursionError) as exc:  # a{99999999999}, ((((...))))
            raise InvalidLoraError(
                f"{ADAPTER_CONFIG}: target_modules {value!r} is not a regular expression: {exc}"
            ) from exc
        # Also a name, as a list of one (a hand-written config's "q_proj"; PEFT would not match).
        return TargetModules(names=frozenset({value}), pattern=value)
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise InvalidLoraError(f"{ADAPTER_CONFIG}: target_modules must be a list of module names")
    names = frozenset(value)
    # PEFT allows suffixes such as "self_attn.q_proj": the last name is the module.
    if not {m.rsplit(".", 1)[-1] for m in names} & set(SUPPORTED_MODULES):
        raise LoraMismatchError(
            f"{ADAPTER_CONFIG}: target module(s) {', '.join(sorted(names))} not supported: this "
            f"engine applies LoRA to {', '.join(SUPPORTED_MODULES)}"
        )
    return TargetModules(names=names)


def read_adapter_config(directory: Path, *, max_rank: int) -> AdapterConfig:
    """Parse and check `directory/adapter_config.json`. Malformed or an unimplemented PEFT
    option: InvalidLoraError; a rank above `max_rank` or target modules none of which this
    engine adapts: LoraMismatchError."""
    if not directory.is_dir():
        raise InvalidLoraError(f"LoRA directory {directory} does not exist or is not a directory")
    file = directory / ADAPTER_CONFIG
    if not file.exists():
        raise InvalidLoraError(f"{file} does not exist (not a PEFT adapter directory)")
    # Only a regular file, and a bounded read: a FIFO would block the load (and every LoRA
    # change queued behind it) for ever, /dev/zero would read until memory ran out.
    if not file.is_file():
        raise InvalidLoraError(f"{file} is not a regular file")
    try:
        with file.open("rb") as f:
            text = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InvalidLoraError(f"cannot read {file}: {exc}") from exc
    if len(text) > MAX_ADAPTER_CONFIG_BYTES:
        raise InvalidLoraError(f"{file} is larger than {MAX_ADAPTER_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise InvalidLoraError(f"cannot read {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidLoraError(f"{file}: not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise InvalidLoraError(f"{file}: peft_type {raw['peft_type']!r} is not LORA")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise InvalidLoraError(f"{file}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise InvalidLoraError(f"{file}: lora_alpha must be a positive number, got {alpha!r}")
    # Options that change the arithmetic, which this engine does not implement: refused, never
    # silently ignored.
    if raw.get("use_dora"):
        raise InvalidLoraError(f"{file}: DoRA (use_dora) is not supported")
    if raw.get("bias", "none") != "none":
        raise InvalidLoraError(f"{file}: LoRA biases (bias {raw['bias']!r}) are not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "lora_bias"):
        if raw.get(key):
            raise InvalidLoraError(f"{file}: {key} is not supported")
    if raw.get("fan_in_fan_out"):
        raise InvalidLoraError(f"{file}: fan_in_fan_out is not supported (Llama/Qwen2 are not)")
    if rank > max_rank:
        raise LoraMismatchError(
            f"{file}: LoRA rank {rank} is above this engine's max_lora_rank {max_rank}"
        )
    return AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        target_modules=_target_modules(raw.get("target_modules")),
        use_rslora=bool(raw.get("use_rslora", False)),
    )


@runtime_checkable
class LoraRunner(Protocol):
    """A `ModelRunner` that serves LoRA adapters. Scheduled sequences name theirs in
    `ScheduledSequence.lora_name`."""

    def read_lora(self, path: Path, *, max_rank: int) -> object:
        """Read and check an adapter against the base model (any thread: file I/O). Raises
        InvalidLoraError or LoraMismatchError; returns what `add_lora` takes."""
        ...

    def add_lora(self, name: str, weights: object) -> None:
        """Serve `weights` (from `read_lora`) under `name` (engine thread, between steps)."""
        ...

    def remove_lora(self, name: str) -> None:
        """Forget the adapter (engine thread; no running sequence uses it any more)."""
        ...


class LoraRegistry:
    """The loaded adapters and the number of live requests per adapter name."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self._adapters: Mapping[str, LoraAdapter] = MappingProxyType({})
        # Live requests per name, unloaded names included (their weights stay until 0).
        self._num_requests: dict[str, int] = {}
        # The adapters unloaded while requests still use them, by name (engine thread only).
        self._unloaded_in_use: dict[str, LoraAdapter] = {}

    @property
    def adapters(self) -> Mapping[str, LoraAdapter]:
        """An immutable snapshot, safe to read from any thread."""
        return self._adapters

    def num_requests(self, name: str) -> int:
        return self._num_requests.get(name, 0)

    def check_load(self, adapter: LoraAdapter) -> LoraLoad:
        """What loading `adapter` would do (`LoraLoad`); raises on a conflict, when full, or
        while requests of another adapter unloaded under that name still run."""
        adapter.validate()
        loaded = self._adapters.get(adapter.name)
        if loaded is not None and loaded.same_as(adapter):
            return LoraLoad.ALREADY_LOADED
        for other in self._adapters.values():
            if (
                adapter.name == other.name
                or adapter.lora_id == other.lora_id
                or adapter.directory == other.directory
            ):
                raise LoraConflictError(
                    f"LoRA adapter {adapter.name!r} (id {adapter.lora_id}, {adapter.path}) "
                    f"conflicts with loaded adapter {other.name!r} (id {other.lora_id}, "
                    f"{other.path})"
                )
        if len(self._adapters) >= self.max_loras:
            raise LoraCapacityError(
                f"{len(self._adapters)} LoRA adapters are loaded, this engine's max_loras: "
                "unload one first"
            )
        unloaded = self._unloaded_in_use.get(adapter.name)
        if unloaded is not None:
            if unloaded.same_as(adapter):
                return LoraLoad.RESUMED
            raise LoraMismatchError(
                f"{self.num_requests(adapter.name)} requests of the unloaded LoRA adapter "
                f"{adapter.name!r} (id {unloaded.lora_id}, {unloaded.path}) still run: load "
                "another adapter under that name once they finish"
            )
        return LoraLoad.LOADED

    def add(self, adapter: LoraAdapter) -> None:
        self._unloaded_in_use.pop(adapter.name, None)
        self._adapters = MappingProxyType({**self._adapters, adapter.name: adapter})

    def remove(self, name: str) -> LoraAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
        self._adapters = MappingProxyType({k: v for k, v in self._adapters.items() if k != name})
        if self.num_requests(name):
            self._unloaded_in_use[name] = adapter
        return adapter

    def check_request(self, name: str) -> None:
        if name not in self._adapters:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")

    def acquire(self, name: str) -> None:
        """A request using `name` starts (the adapter must be loaded)."""
        self.check_request(name)
        self._num_requests[name] = self.num_requests(name) + 1

    def release(self, name: str) -> bool:
        """A request using `name` ended; True when the adapter is unloaded and now unused (its
        weights can go)."""
        left = self._num_requests[name] - 1
        if left:
            self._num_requests[name] = left
            return False
        del self._num_requests[name]
        self._unloaded_in_use.pop(name, None)
        return name not in self._adapters
