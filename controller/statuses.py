"""The one table from the controller's domain errors to gRPC status codes, for every adapter
that serves them (the admin API, the gateway's routing)."""

from __future__ import annotations

import grpc

from controller.eligibility import BeyondFleetError
from controller.membership import MembershipUnavailableError
from controller.registry import (
    DuplicateEngineError,
    EmptyEngineRefError,
    LoraNotLoadedError,
    LoraUnavailableError,
    ModelRequiredError,
    NoEngineRegisteredError,
    UnknownEngineError,
    UnknownModelError,
)
from controller.router import AllEnginesBusyError, NoEngineAvailableError
from kvplane.errors import KvplaneError

# First match wins: subclasses before their bases. A KvplaneError not named otherwise is a
# precondition the caller can fix (LoraUnsupportedError among them: the seed's "LoRA
# disabled").
_STATUS: tuple[tuple[type[KvplaneError], grpc.StatusCode], ...] = (
    (UnknownEngineError, grpc.StatusCode.NOT_FOUND),
    (EmptyEngineRefError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownModelError, grpc.StatusCode.NOT_FOUND),
    (ModelRequiredError, grpc.StatusCode.INVALID_ARGUMENT),
    (BeyondFleetError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoEngineRegisteredError, grpc.StatusCode.UNAVAILABLE),
    (DuplicateEngineError, grpc.StatusCode.ALREADY_EXISTS),
    (NoEngineAvailableError, grpc.StatusCode.UNAVAILABLE),
    # Load shed: the engines are up but full. Retry later, as an engine's own overload.
    (AllEnginesBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LoraNotLoadedError, grpc.StatusCode.NOT_FOUND),
    (LoraUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (MembershipUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (KvplaneError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_of(exc: KvplaneError) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL  # pragma: no cover - KvplaneError is in the table
