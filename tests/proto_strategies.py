"""Hypothesis strategies that build any protobuf message from its descriptor, with the values a
careless or hostile client sends: integer extremes of each wire type (0, -1, the signed and
unsigned limits), NaN and infinities, empty / long / unicode / NUL strings, empty and long
repeated fields, maps, oneofs and optional fields left unset or set, nested messages absent or
present, and enum numbers the schema does not name. Every message it builds encodes; the
point is input a server must refuse cleanly, not bytes that fail to parse. Not a test module
itself."""

from __future__ import annotations

from typing import Any, Literal, cast

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

# Nested messages deeper than this are left unset (Struct/Value recurse without end).
MAX_DEPTH = 4
# A "long" repeated field: long enough to cross any sane per-request limit, short enough that
# one example still takes milliseconds.
LONG_REPEATED = 20_000
LONG_STRING = 70_000

_INT32 = (0, 1, -1, 2**31 - 1, -(2**31))
_INT64 = (0, 1, -1, 2**63 - 1, -(2**63), 2**31, 2**53 + 1)
_UINT32 = (0, 1, 2**32 - 1, 2**31)
_UINT64 = (0, 1, 2**64 - 1, 2**63, 2**32)

_T = FieldDescriptor
_INTEGER_RANGES: dict[int, tuple[tuple[int, ...], int, int]] = {
    **{t: (_INT32, -(2**31), 2**31 - 1) for t in (_T.TYPE_INT32, _T.TYPE_SINT32, _T.TYPE_SFIXED32)},
    **{t: (_INT64, -(2**63), 2**63 - 1) for t in (_T.TYPE_INT64, _T.TYPE_SINT64, _T.TYPE_SFIXED64)},
    **{t: (_UINT32, 0, 2**32 - 1) for t in (_T.TYPE_UINT32, _T.TYPE_FIXED32)},
    **{t: (_UINT64, 0, 2**64 - 1) for t in (_T.TYPE_UINT64, _T.TYPE_FIXED64)},
}


def _integers(field_type: int) -> st.SearchStrategy[int]:
    extremes, low, high = _INTEGER_RANGES[field_type]
    return st.one_of(st.sampled_from(extremes), st.integers(0, 64), st.integers(low, high))


def _strings() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(
            ["", "\x00", "a\x00b", "a\nb", " ", "sim", "..", "/", "é☃𝄞", "x" * LONG_STRING]
        ),
        st.text(max_size=12),
    )


def _floats(width: Literal[32, 64]) -> st.SearchStrategy[float]:
    specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), -1.0, 1e300]
    return st.one_of(st.sampled_from(specials), st.floats(width=width))


def scalar_values(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """One value of a non-message field."""
    t = field.type
    if t in _INTEGER_RANGES:
        return _integers(t)
    if t == _T.TYPE_BOOL:
        return st.booleans()
    if t == _T.TYPE_STRING:
        return _strings()
    if t == _T.TYPE_BYTES:
        return st.one_of(st.sampled_from([b"", b"\x00" * 64]), st.binary(max_size=16))
    if t == _T.TYPE_DOUBLE:
        return _floats(64)
    if t == _T.TYPE_FLOAT:
        return _floats(32)
    if t == _T.TYPE_ENUM:
        assert field.enum_type is not None  # an enum field names its enum
        named = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(named), st.sampled_from([-1, 99, 2**31 - 1]))
    raise AssertionError(f"unhandled field type {t} of {field.full_name}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


@st.composite
def _set_field(draw: st.DrawFn, message: Message, field: FieldDescriptor, depth: int) -> None:
    name = field.name
    if _is_map(field):
        assert field.message_type is not None  # a map's entries are messages
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        target = getattr(message, name)
        for _ in range(draw(st.integers(0, 3))):
            key = draw(scalar_values(key_field))
            if value_field.message_type is not None:
                target[key].CopyFrom(draw(messages(value_field.message_type, depth + 1)))
            else:
                target[key] = draw(scalar_values(value_field))
        return
    if field.is_repeated:
        target = getattr(message, name)
        if field.message_type is not None:
            for _ in range(draw(st.integers(0, 3))):
                target.add().CopyFrom(draw(messages(field.message_type, depth + 1)))
        elif draw(st.integers(0, 9)) == 0 and field.type != _T.TYPE_STRING:
            # One value repeated very often: a prompt, a hash list or an id list past limits
            # (not strings: a long list of long strings passes gRPC's message size limit).
            target.extend([draw(scalar_values(field))] * LONG_REPEATED)
        else:
            target.extend(draw(st.lists(scalar_values(field), max_size=6)))
        return
    if field.message_type is not None:
        getattr(message, name).CopyFrom(draw(messages(field.message_type, depth + 1)))
    else:
        setattr(message, name, draw(scalar_values(field)))


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int) -> Message:
    message = message_factory.GetMessageClass(descriptor)()
    if depth > MAX_DEPTH:
        return message
    # A oneof gets at most one member set (setting a second would clear the first anyway).
    chosen: dict[str, FieldDescriptor | None] = {}
    for group in descriptor.oneofs:
        chosen[group.name] = draw(st.one_of(st.none(), st.sampled_from(list(group.fields))))
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None:
            if chosen[oneof.name] is not field:
                continue
        elif not draw(st.booleans()):
            continue  # left unset: the zero value, or absent where presence is tracked
        draw(_set_field(message, field, depth))
    return message


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type with random, often extreme, field values."""
    return _message(descriptor, depth)


@st.composite
def _mutate(draw: st.DrawFn, message: Message, depth: int) -> None:
    """Overwrite one field somewhere in `message` (descending into nested messages, set or
    not) with a drawn value."""
    # The C (upb) descriptor, which the stubs type apart, implements the same Descriptor API.
    descriptor = cast(Descriptor, message.DESCRIPTOR)
    fields = list(descriptor.fields)
    if not fields:
        return
    field = draw(st.sampled_from(fields))
    # Mostly into a nested message, so that one change leaves the rest of it well formed.
    nested = (
        field.message_type is not None
        and not field.is_repeated
        and depth < MAX_DEPTH
        and draw(st.integers(0, 3)) > 0
    )
    if nested:
        draw(_mutate(getattr(message, field.name), depth + 1))
        return
    message.ClearField(field.name)
    draw(_set_field(message, field, depth))


@st.composite
def mutations(draw: st.DrawFn, base: Message, max_changes: int = 3) -> Message:
    """`base`, a well-formed request, with one to `max_changes` fields overwritten by extreme
    values: unlike `messages`, most of these get past a server's first checks and reach the
    code behind them."""
    message = type(base)()
    message.CopyFrom(base)
    for _ in range(draw(st.integers(1, max_changes))):
        draw(_mutate(message, 0))
    return message
