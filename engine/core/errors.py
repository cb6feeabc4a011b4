"""Domain errors of the engine core. Servicers map each to one gRPC status (one table)."""

from __future__ import annotations

from kvplane.errors import KvplaneError


class EngineCoreError(KvplaneError):
    """Root of the engine core's errors."""


class InvalidRequestError(EngineCoreError):
    """A request's parameters are malformed or unsupported (INVALID_ARGUMENT)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one output token) does not fit the context or the KV cache."""


class DuplicateRequestError(EngineCoreError):
    """A request with this id is already running (ALREADY_EXISTS)."""


class EngineStoppedError(EngineCoreError):
    """The engine loop has stopped (or failed) and accepts no more work (UNAVAILABLE)."""


class AbortFailedError(EngineCoreError):
    """The core failed to abort every request at once (Abort of all requests): each was then
    aborted on its own, one whose abort failed too ending ERROR (INTERNAL)."""


class InvalidLoraError(InvalidRequestError):
    """A LoadLora request or the adapter it names is malformed: a non-positive id, an empty
    name (UnloadLora's too), a relative or missing directory, an unreadable or incomplete
    adapter_config.json or safetensors file, or a PEFT option this engine does not implement
    (INVALID_ARGUMENT)."""


class LoraMismatchError(EngineCoreError):
    """A well-formed adapter this engine cannot serve: its modules, layers or shapes do not fit
    the base model, its rank is above `max_lora_rank`, or requests of an earlier adapter of the
    same name still run (FAILED_PRECONDITION)."""


class LoraNotFoundError(EngineCoreError):
    """No adapter of that name is loaded: UnloadLora, or a request naming it (NOT_FOUND)."""


class LoraConflictError(EngineCoreError):
    """Another loaded adapter has this name, id or path (ALREADY_EXISTS)."""


class LoraCapacityError(EngineCoreError):
    """`max_loras` adapters are loaded already (RESOURCE_EXHAUSTED)."""
