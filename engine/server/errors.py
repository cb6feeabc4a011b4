"""The engine servers' domain errors and the one table that maps every error to a gRPC status.

Before acceptance an error is a non-OK status (`grpc_status_for`); after acceptance a
Generate or subscription stream ends with one terminal `EngineError` (`engine_error_for`)
and then OK, as the OpenEngine seed requires.
"""

from __future__ import annotations

import grpc

from engine.core.errors import (
    DuplicateRequestError,
    EngineStoppedError,
    InvalidRequestError,
    LoraCapacityError,
    LoraConflictError,
    LoraMismatchError,
    LoraNotFoundError,
)
from engine.server.kv_event_log import ReplayNotCoveredError, SubscriberOverrunError
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


# Checked in order: the first matching class wins (subclasses before their bases).
_TABLE: tuple[tuple[type[Exception], grpc.StatusCode, pb.ErrorCode.ValueType, bool], ...] = (
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND, pb.ERROR_CODE_MODEL_NOT_FOUND, False),
    (
        UnsupportedOptionError,
        grpc.StatusCode.INVALID_ARGUMENT,
        pb.ERROR_CODE_UNSUPPORTED_FEATURE,
        False,
    ),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, pb.ERROR_CODE_INVALID_ARGUMENT, False),
    (
        FeatureDisabledError,
        grpc.StatusCode.FAILED_PRECONDITION,
        pb.ERROR_CODE_UNSUPPORTED_FEATURE,
        False,
    ),
    (RoleMismatchError, grpc.StatusCode.FAILED_PRECONDITION, pb.ERROR_CODE_ROLE_MISMATCH, False),
    (DrainingError, grpc.StatusCode.UNAVAILABLE, pb.ERROR_CODE_DRAINING, True),
    (RequestAbortedError, grpc.StatusCode.CANCELLED, pb.ERROR_CODE_CANCELLED, False),
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND, pb.ERROR_CODE_REQUEST_NOT_FOUND, False),
    (KvSessionNotFoundError, grpc.StatusCode.NOT_FOUND, pb.ERROR_CODE_KV_SESSION_NOT_FOUND, False),
    (
        KvSessionRefusedError,
        grpc.StatusCode.FAILED_PRECONDITION,
        pb.ERROR_CODE_KV_TRANSFER_FAILED,
        False,
    ),
    (KvTransferError, grpc.StatusCode.UNAVAILABLE, pb.ERROR_CODE_KV_TRANSFER_FAILED, True),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS, pb.ERROR_CODE_DUPLICATE_REQUEST, False),
    (NonFiniteOutputError, grpc.StatusCode.INTERNAL, pb.ERROR_CODE_INTERNAL, False),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, pb.ERROR_CODE_OVERLOADED, True),
    (ReplayNotCoveredError, grpc.StatusCode.OUT_OF_RANGE, pb.ERROR_CODE_INVALID_ARGUMENT, False),
    (SubscriberOverrunError, grpc.StatusCode.RESOURCE_EXHAUSTED, pb.ERROR_CODE_OVERLOADED, True),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE, pb.ERROR_CODE_INTERNAL, True),
    # LoRA (the seed's lifecycle rules; InvalidLoraError is an InvalidRequestError above).
    (LoraNotFoundError, grpc.StatusCode.NOT_FOUND, pb.ERROR_CODE_MODEL_NOT_FOUND, False),
    (LoraConflictError, grpc.StatusCode.ALREADY_EXISTS, pb.ERROR_CODE_INVALID_ARGUMENT, False),
    (LoraCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED, pb.ERROR_CODE_OVERLOADED, False),
    (
        LoraMismatchError,
        grpc.StatusCode.FAILED_PRECONDITION,
        pb.ERROR_CODE_UNSUPPORTED_FEATURE,
        False,
    ),
)


def grpc_status_for(exc: Exception) -> grpc.StatusCode:
    """The status of a refusal before acceptance; unknown errors are INTERNAL."""
    for cls, status, _code, _retryable in _TABLE:
        if isinstance(exc, cls):
            return status
    return grpc.StatusCode.INTERNAL


def engine_error_for(exc: Exception) -> pb.EngineError:
    """The terminal EngineError of a failure after acceptance."""
    for cls, _status, code, retryable in _TABLE:
        if isinstance(exc, cls):
            return pb.EngineError(code=code, message=str(exc), retryable=retryable)
    return pb.EngineError(code=pb.ERROR_CODE_INTERNAL, message="internal engine error")


def public_message(exc: Exception) -> str:
    """One line for the client: a known error's own message, never a traceback."""
    if isinstance(exc, KvplaneError):
        return str(exc) or type(exc).__name__
    return "internal engine error"
