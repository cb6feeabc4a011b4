"""OpenEngine's error codes and the gRPC statuses that report the same failures.

The seed reports one failure in one of two forms, by its phase ("Standard errors"): a non-OK
gRPC status before the request is accepted, one terminal `EngineError` (an `ErrorCode` and
whether a retry may succeed) after it. This is the one table between the two: the status
form of each code, the status an engine answers for the same failure before acceptance. The
bundled engine builds its errors' statuses on it (engine/server/errors.py), the gateway
judges an engine's in-band errors by it (controller/gateway.py).

The seed's prose fixes most rows: malformed input or an unsupported explicit option is
INVALID_ARGUMENT, an unknown model NOT_FOUND, admission or capacity exhaustion
RESOURCE_EXHAUSTED, a role mismatch a non-OK status before acceptance (FAILED_PRECONDITION).
Two codes have a second form when the failure is retryable: a KV transfer failing on the way
(UNAVAILABLE), not a session the decode engine cannot use (FAILED_PRECONDITION); an engine
stopping (UNAVAILABLE), not its own fault (INTERNAL).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from openengine.v1 import openengine_pb2 as pb

# Every code of the seed's ErrorCode (tests/foundation/test_error_codes.py keeps it so).
STATUS_FORMS: Mapping[pb.ErrorCode.ValueType, grpc.StatusCode] = {
    pb.ERROR_CODE_UNSPECIFIED: grpc.StatusCode.INTERNAL,  # an engine that said nothing useful
    pb.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ERROR_CODE_UNSUPPORTED_FEATURE: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ERROR_CODE_ROLE_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    pb.ERROR_CODE_MODEL_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    pb.ERROR_CODE_OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.ERROR_CODE_REQUEST_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    pb.ERROR_CODE_DUPLICATE_REQUEST: grpc.StatusCode.ALREADY_EXISTS,
    pb.ERROR_CODE_KV_SESSION_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    pb.ERROR_CODE_KV_TRANSFER_FAILED: grpc.StatusCode.FAILED_PRECONDITION,
    pb.ERROR_CODE_CANCELLED: grpc.StatusCode.CANCELLED,
    pb.ERROR_CODE_DRAINING: grpc.StatusCode.UNAVAILABLE,
    pb.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
}
# The codes whose retryable failures have a form of their own.
RETRYABLE_STATUS_FORMS: Mapping[pb.ErrorCode.ValueType, grpc.StatusCode] = {
    pb.ERROR_CODE_KV_TRANSFER_FAILED: grpc.StatusCode.UNAVAILABLE,
    pb.ERROR_CODE_INTERNAL: grpc.StatusCode.UNAVAILABLE,
}


def status_form(code: pb.ErrorCode.ValueType, retryable: bool) -> grpc.StatusCode:
    """The status that reports before acceptance the failure `code` and `retryable` report
    after it; INTERNAL for a code newer than this build."""
    if retryable and code in RETRYABLE_STATUS_FORMS:
        return RETRYABLE_STATUS_FORMS[code]
    return STATUS_FORMS.get(code, grpc.StatusCode.INTERNAL)
