"""Names of protobuf enum values that a peer sent.

proto3 enums are open: a value this build's schema does not define (a newer peer's, or
nonsense) arrives as a bare number, and the enum's `Name` raises ValueError on it. Code
that names a value a peer chose (an engine's health state, error code, role) names it here,
so that an unknown value is reported as such instead of failing the call that met it.
"""

from __future__ import annotations

from google.protobuf.descriptor import EnumDescriptor


def enum_name(enum: EnumDescriptor, value: int) -> str:
    """`value`'s name in the enum `enum` describes ("HEALTH_STATE_READY" in
    `pb.HealthState.DESCRIPTOR`), or "HealthState 77" for a value the schema does not
    define."""
    known = enum.values_by_number.get(value)
    return known.name if known is not None else f"{enum.name} {value}"
