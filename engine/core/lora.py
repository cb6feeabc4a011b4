"""LoRA adapters as the engine core sees them: what is loaded, under which name, id and path,
and which names running requests use. No tensors: a runner that serves LoRA (`LoraRunner`)
reads and applies the weights; the sim runner only checks the adapter's config.

Contract (the OpenEngine seed, "LoRA lifecycle"): an adapter is (positive `lora_id`, non-empty
`name`, absolute directory `path`); loading the same triple again is idempotent; another
loaded adapter with the same name, id or path is a conflict (ALREADY_EXISTS); an unknown name
is NOT_FOUND. Paths are compared as directories: `/a/x/` and `/a/./x` are `/a/x` (a client's
spelling must neither load one adapter twice under two names nor fail a repeated load). At
most `max_loras` adapters are loaded at once (RESOURCE_EXHAUSTED beyond).

A request holds its adapter from its acceptance to its end (`LoraSlot`: one load of an
adapter, its weights in the runner under the slot's key): a request accepted is served with
the adapter it was accepted with, whatever unloads or loads follow (vLLM's behaviour: its
request carries the adapter). Unloading forgets the name at once for new requests; the slot,
and its place among `max_loras`, lives until the last request holding it ends. Until then the
same triple may be loaded again (`LoraLoad.RESUMED`: the same slot, served again as it is, its
weights, cached blocks and KV sessions kept, and its requests go on); another adapter under
that name takes a new slot (and a place of its own): new requests get the new weights, the old
slot's requests keep the old ones, and, the prefix cache's namespace being the name, they no
longer use the cache (`LoraSlot.superseded`), whose blocks of the name
`EngineCore.load_lora` drops: a prefix hit never mixes the two adapters' KV.

Threads: the engine thread loads, unloads and releases; servers acquire a request's slot as
they accept it; a lock orders them. `adapters` is an immutable snapshot, replaced on every
change, that any thread may read (servers check a request's adapter before acceptance).

`read_adapter_config` parses a PEFT `adapter_config.json` (stdlib only).
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import threading
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
    """A `ModelRunner` that serves LoRA adapters. It holds each load of an adapter under the
    key of its slot (`LoraSlot.key`); scheduled sequences name theirs in
    `ScheduledSequence.lora_key`."""

    def read_lora(self, path: Path, *, max_rank: int) -> object:
        """Read and check an adapter against the base model (any thread: file I/O). Raises
        InvalidLoraError or LoraMismatchError; returns what `add_lora` takes."""
        ...

    def add_lora(self, key: str, weights: object) -> None:
        """Serve `weights` (from `read_lora`) under `key` (engine thread, between steps)."""
        ...

    def remove_lora(self, key: str) -> None:
        """Forget the adapter (engine thread; no running sequence uses it any more)."""
        ...


@dataclass(eq=False, slots=True)
class LoraSlot:
    """One load of an adapter: the weights the runner holds under `key` (unique per load, so
    a name loaded again with other weights never mixes with this one) and the requests that
    hold them. A request holds its slot from its acceptance to its end (`LoraRegistry.acquire`,
    `release`): an unload, or another adapter loaded under the name, never takes the weights
    from a request already accepted. `superseded`: another load of the name serves new
    requests now; this slot's requests run on with these weights, out of the prefix cache (the
    cache's namespace is the name, now the new weights')."""

    adapter: LoraAdapter
    key: str
    num_requests: int = 0
    superseded: bool = False


class LoraRegistry:
    """The loaded adapters by name, and the slots requests hold (`LoraSlot`).

    A slot lives while its adapter is loaded or a request holds it, and counts against
    `max_loras` while it lives: an adapter unloaded (or replaced under its name) while requests
    use it still takes a place until they end. Thread-safe (one lock): servers acquire a slot
    as they accept a request, the engine thread loads, unloads and releases."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self._lock = threading.Lock()
        self._adapters: Mapping[str, LoraAdapter] = MappingProxyType({})
        self._loaded: dict[str, LoraSlot] = {}  # by name: what new requests get
        self._latest: dict[str, LoraSlot] = {}  # by name: its last load, while the slot lives
        self._unloaded_in_use: dict[str, LoraSlot] = {}  # by key: unloaded, still held
        self._num_loads = 0

    @property
    def adapters(self) -> Mapping[str, LoraAdapter]:
        """An immutable snapshot, safe to read from any thread."""
        return self._adapters

    def check_load(self, adapter: LoraAdapter) -> LoraLoad:
        """What loading `adapter` would do (`LoraLoad`); raises on a conflict or when full."""
        adapter.validate()
        with self._lock:
            return self._check_load(adapter)

    def _check_load(self, adapter: LoraAdapter) -> LoraLoad:
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
        latest = self._latest.get(adapter.name)
        if latest is not None and latest.adapter.same_as(adapter):
            return LoraLoad.RESUMED  # takes no new slot
        num_slots = len(self._loaded) + len(self._unloaded_in_use)
        if num_slots >= self.max_loras:
            raise LoraCapacityError(
                f"{len(self._loaded)} LoRA adapters are loaded and {len(self._unloaded_in_use)} "
                f"unloaded ones still serve requests, this engine's max_loras: unload one "
                "first (an unloaded adapter's place is free once its requests end)"
            )
        return LoraLoad.LOADED

    def load(self, adapter: LoraAdapter) -> tuple[LoraLoad, LoraSlot]:
        """Serve `adapter` under its name: a fresh slot (LOADED: the name's previous slot, if
        requests still hold it, is superseded), the name's last slot again (RESUMED), or the
        slot already loaded (ALREADY_LOADED). Raises as `check_load`."""
        adapter.validate()
        with self._lock:
            outcome = self._check_load(adapter)
            if outcome is LoraLoad.ALREADY_LOADED:
                return outcome, self._loaded[adapter.name]
            if outcome is LoraLoad.RESUMED:
                slot = self._latest[adapter.name]
                del self._unloaded_in_use[slot.key]
            else:
                previous = self._latest.get(adapter.name)
                if previous is not None:
                    previous.superseded = True
                self._num_loads += 1
                slot = LoraSlot(adapter, f"{adapter.name}#{self._num_loads}")
                self._latest[adapter.name] = slot
            self._loaded[adapter.name] = slot
            self._adapters = MappingProxyType({**self._adapters, adapter.name: adapter})
            return outcome, slot

    def remove(self, name: str) -> tuple[LoraAdapter, LoraSlot | None]:
        """Unload `name` for new requests; the slot too when no request holds it (returned:
        its weights can go), else it lives on until its last request ends."""
        with self._lock:
            slot = self._loaded.pop(name, None)
            if slot is None:
                raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
            self._adapters = MappingProxyType(
                {k: v for k, v in self._adapters.items() if k != name}
            )
            if slot.num_requests:
                self._unloaded_in_use[slot.key] = slot
                return slot.adapter, None
            self._forget(slot)
            return slot.adapter, slot

    def check_request(self, name: str) -> None:
        if name not in self._adapters:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")

    def acquire(self, name: str) -> LoraSlot:
        """A request using `name` is accepted: it holds the name's slot until `release`
        (any thread). Raises LoraNotFoundError when the name is not loaded."""
        with self._lock:
            slot = self._loaded.get(name)
            if slot is None:
                raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
            slot.num_requests += 1
            return slot

    def release(self, slot: LoraSlot) -> bool:
        """A request holding `slot` ended; True when the slot is unloaded and now unheld (its
        weights can go)."""
        with self._lock:
            slot.num_requests -= 1
            if slot.num_requests or self._loaded.get(slot.adapter.name) is slot:
                return False
            del self._unloaded_in_use[slot.key]
            self._forget(slot)
            return True

    def _forget(self, slot: LoraSlot) -> None:
        if self._latest.get(slot.adapter.name) is slot:
            del self._latest[slot.adapter.name]
