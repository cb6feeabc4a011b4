"""The engine servers' domain errors and the one table that says how each is reported.

Before acceptance an error is a non-OK status (`grpc_status_for`); after acceptance a
Generate or subscription stream ends with one terminal `EngineError` (`engine_error_for`)
and then OK, as the OpenEngine seed requires. The status is its error code's status form
(kvplane/error_codes.py, which the gateway judges engines' in-band errors by) unless the
table names another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import grpc

from engine.core.api import ErrorKind
from engine.core.errors import (
    AbortFailedError,
    DuplicateRequestError,
    EngineStoppedError,
    InvalidRequestError,
    LoraCapacityError,
    LoraConflictError,
    LoraMismatchError,
    LoraNotFoundError,
)
from engine.server.kv_event_log import ReplayNotCoveredError, SubscriberOverrunError
from kvplane.error_codes import status_form
from kvplane.errors import KvplaneError
from openengine.v1 import openengine_pb2 as pb


class EngineServerError(KvplaneError):
    """Root of the servers' own errors."""


class ModelNotFoundError(EngineServerError):
    """The request names a model this engine does not serve (NOT_FOUND)."""


class UnsupportedOptionError(InvalidRequestError):
    """An explicit request option this engine does not implement, e.g. guided decoding or
    media (INVALID_ARGUMENT: 'malformed or unsupported explicit option')."""


class FeatureDisabledError(EngineServerError):
    """A whole feature is off here: LoRA, embed/classify/score tasks (FAILED_PRECONDITION)."""


class RoleMismatchError(EngineServerError):
    """The request does not fit this engine's role, e.g. a KV session on an aggregated engine
    (FAILED_PRECONDITION, before acceptance)."""


class DrainingError(EngineServerError):
    """The engine is draining and accepts no new requests (UNAVAILABLE)."""


class RequestAbortedError(EngineServerError):
    """An accepted unary task (Embed, Classify, Score) stopped by Abort or a drain (CANCELLED:
    a unary RPC reports it as its status)."""


class RequestNotFoundError(EngineServerError):
    """Abort of a request id never seen (NOT_FOUND)."""


class KvSessionNotFoundError(EngineServerError):
    """A KV session the engine asked does not hold: Abort or a pull of an unknown, expired,
    released or already pulled session; a decode engine passes on its prefill engine's
    answer (NOT_FOUND)."""


class KvSessionRefusedError(EngineServerError):
    """A DECODE engine cannot use this KV session: another transfer backend, no endpoint it
    can pull from, another KV layout or block size, tokens that are not a prefix of the
    prompt, or a prefill engine refusing its credentials (FAILED_PRECONDITION)."""


class KvTransferError(EngineServerError):
    """Pulling a KV session failed on the way: the prefill engine unreachable, too slow, or
    the stream malformed (UNAVAILABLE, retryable)."""


class NonFiniteOutputError(EngineServerError):
    """The model produced NaN or an infinity for a pooling task: the seed's tensors are
    finite, so the request fails rather than carry them (INTERNAL: the engine's fault)."""


class OverloadedError(EngineServerError):
    """Admission refused: too many requests queued (RESOURCE_EXHAUSTED)."""


class _Reported(NamedTuple):
    """How the servers report an error: after acceptance its in-band `code` and whether a retry
    may succeed; before, the code's status form (kvplane/error_codes.py) unless `status` says
    more than the code can."""

    error: type[Exception]
    code: pb.ErrorCode.ValueType
    retryable: bool = False
    status: grpc.StatusCode | None = None

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return self.status or status_form(self.code, self.retryable)


# Checked in order: the first matching class wins (subclasses before their bases). `status`
# only where a status says more than any code: the seed's unsupported task and LoRA-disabled
# engine are FAILED_PRECONDITION (UNSUPPORTED_FEATURE's form is an unsupported explicit
# option's INVALID_ARGUMENT), its conflicting LoRA adapter ALREADY_EXISTS; a replay from a
# sequence number the log no longer covers is OUT_OF_RANGE.
_TABLE: tuple[_Reported, ...] = (
    _Reported(ModelNotFoundError, pb.ERROR_CODE_MODEL_NOT_FOUND),
    _Reported(UnsupportedOptionError, pb.ERROR_CODE_UNSUPPORTED_FEATURE),
    _Reported(InvalidRequestError, pb.ERROR_CODE_INVALID_ARGUMENT),
    _Reported(
        FeatureDisabledError,
        pb.ERROR_CODE_UNSUPPORTED_FEATURE,
        status=grpc.StatusCode.FAILED_PRECONDITION,
    ),
    _Reported(RoleMismatchError, pb.ERROR_CODE_ROLE_MISMATCH),
    _Reported(DrainingError, pb.ERROR_CODE_DRAINING, retryable=True),
    _Reported(RequestAbortedError, pb.ERROR_CODE_CANCELLED),
    _Reported(RequestNotFoundError, pb.ERROR_CODE_REQUEST_NOT_FOUND),
    _Reported(KvSessionNotFoundError, pb.ERROR_CODE_KV_SESSION_NOT_FOUND),
    _Reported(KvSessionRefusedError, pb.ERROR_CODE_KV_TRANSFER_FAILED),
    _Reported(KvTransferError, pb.ERROR_CODE_KV_TRANSFER_FAILED, retryable=True),
    _Reported(DuplicateRequestError, pb.ERROR_CODE_DUPLICATE_REQUEST),
    _Reported(NonFiniteOutputError, pb.ERROR_CODE_INTERNAL),
    _Reported(AbortFailedError, pb.ERROR_CODE_INTERNAL),
    _Reported(OverloadedError, pb.ERROR_CODE_OVERLOADED, retryable=True),
    _Reported(
        ReplayNotCoveredError, pb.ERROR_CODE_INVALID_ARGUMENT, status=grpc.StatusCode.OUT_OF_RANGE
    ),
    _Reported(SubscriberOverrunError, pb.ERROR_CODE_OVERLOADED, retryable=True),
    _Reported(EngineStoppedError, pb.ERROR_CODE_INTERNAL, retryable=True),
    # LoRA (the seed's lifecycle rules; InvalidLoraError is an InvalidRequestError above).
    _Reported(LoraNotFoundError, pb.ERROR_CODE_MODEL_NOT_FOUND),
    _Reported(
        LoraConflictError, pb.ERROR_CODE_INVALID_ARGUMENT, status=grpc.StatusCode.ALREADY_EXISTS
    ),
    _Reported(LoraCapacityError, pb.ERROR_CODE_OVERLOADED),
    _Reported(
        LoraMismatchError,
        pb.ERROR_CODE_UNSUPPORTED_FEATURE,
        status=grpc.StatusCode.FAILED_PRECONDITION,
    ),
)


def _reported(exc: Exception) -> _Reported | None:
    return next((row for row in _TABLE if isinstance(exc, row.error)), None)


def grpc_status_for(exc: Exception) -> grpc.StatusCode:
    """The status of a refusal before acceptance; unknown errors are INTERNAL."""
    row = _reported(exc)
    return grpc.StatusCode.INTERNAL if row is None else row.grpc_status


def engine_error_for(exc: Exception) -> pb.EngineError:
    """The terminal EngineError of a failure after acceptance."""
    row = _reported(exc)
    if row is None:
        return pb.EngineError(code=pb.ERROR_CODE_INTERNAL, message="internal engine error")
    return pb.EngineError(code=row.code, message=str(exc), retryable=row.retryable)


# A generation the engine ended with FinishReason.ERROR, by whose failure it is: OpenEngine's
# terminal EngineError of this code, vLLM's front end (no in-band errors) the code's status.
ERROR_KIND_CODES: Mapping[ErrorKind, pb.ErrorCode.ValueType] = {
    ErrorKind.ENGINE: pb.ERROR_CODE_INTERNAL,
    ErrorKind.REQUEST: pb.ERROR_CODE_INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: pb.ERROR_CODE_MODEL_NOT_FOUND,  # as an unloaded adapter is refused
}


def grpc_status_for_kind(kind: ErrorKind) -> grpc.StatusCode:
    """The status of a generation ended by `kind`'s failure, for a front end without in-band
    errors."""
    return status_form(ERROR_KIND_CODES[kind], retryable=False)


def public_message(exc: Exception) -> str:
    """One line for the client: a known error's own message, never a traceback."""
    if isinstance(exc, KvplaneError):
        return str(exc) or type(exc).__name__
    return "internal engine error"
