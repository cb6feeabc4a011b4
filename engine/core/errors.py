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
