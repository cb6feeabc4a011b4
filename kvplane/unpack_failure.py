"""What a failed msgpack unpack says, for a warning about the message it dropped."""

from __future__ import annotations


def unpack_failure(exc: Exception) -> str:
    """The exception that failed a message's unpacking, by name and message (msgpack's, or
    one from reading what it unpacked); msgpack's FormatError (a byte msgpack never uses, e.g.
    0xc1) and StackError (nesting too deep) carry no message, so their docstring's first
    line stands for it."""
    detail = str(exc) or (type(exc).__doc__ or "").strip().split("\n")[0]
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
