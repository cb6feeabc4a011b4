"""The one table between OpenEngine's error codes and gRPC statuses (kvplane/error_codes.py)."""

from __future__ import annotations

import grpc
import pytest

from kvplane.error_codes import RETRYABLE_STATUS_FORMS, STATUS_FORMS, status_form
from openengine.v1 import openengine_pb2 as pb

# The checked-in proto is the seed's text (tests/foundation/test_protos.py).
SEED_CODES = pb.ErrorCode.values()


def test_every_error_code_of_the_seed_has_a_status_form() -> None:
    # A code the seed grows fails here until someone decides its status.
    unmapped = [pb.ErrorCode.Name(code) for code in SEED_CODES if code not in STATUS_FORMS]
    assert unmapped == []
    assert set(RETRYABLE_STATUS_FORMS) <= set(STATUS_FORMS)


@pytest.mark.parametrize(
    ("code", "retryable", "status"),
    [
        (pb.ERROR_CODE_KV_TRANSFER_FAILED, False, grpc.StatusCode.FAILED_PRECONDITION),
        (pb.ERROR_CODE_KV_TRANSFER_FAILED, True, grpc.StatusCode.UNAVAILABLE),
        (pb.ERROR_CODE_INTERNAL, False, grpc.StatusCode.INTERNAL),
        (pb.ERROR_CODE_INTERNAL, True, grpc.StatusCode.UNAVAILABLE),
        (pb.ERROR_CODE_DRAINING, True, grpc.StatusCode.UNAVAILABLE),
        (pb.ERROR_CODE_OVERLOADED, False, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (pb.ERROR_CODE_UNSPECIFIED, False, grpc.StatusCode.INTERNAL),
        (max(SEED_CODES) + 1, True, grpc.StatusCode.INTERNAL),  # newer than this build
    ],
)
def test_status_form(code: int, retryable: bool, status: grpc.StatusCode) -> None:
    assert status_form(pb.ErrorCode.ValueType(code), retryable) == status
