"""Fields a request carries that this server's schema does not have.

protobuf keeps a field it does not know as bytes and the servicer never sees it, so an option
from a newer revision of a proto (today's vLLM adds `lora_name`, `session_id`,
`skip_special_tokens`, `ec_transfer_params`, ... to the `vllm.Generate` seed's messages; a
later OpenEngine revision may add options to `openengine.v1`) would be served as if it had not
been sent: a LoRA request answered by the base model. A server that refuses unsupported
explicit options (INVALID_ARGUMENT) names these instead: `kvplane.request_decoding` does so
for the methods a `kvplane.server.Service` declares strict. A proto3 client sends a field
only when it is set, so a request that uses none of them passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Where `message` (and every message set inside it) holds fields outside its schema:
    `"GenerateRequest field 15"`, `"GenerateRequest.response field 8"`, in field order."""
    here = path or message.DESCRIPTOR.name
    unknown = UnknownFieldSet(message)
    numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
    found = [f"{here} field {number}" for number in numbers]
    for descriptor, value in message.ListFields():
        for name, nested in _messages_in(descriptor, value, f"{here}.{descriptor.name}"):
            found += unknown_fields(nested, name)
    return found


def _messages_in(descriptor: FieldDescriptor, value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """The messages a set field holds, with their paths: itself, each repeated item, each
    map value (a map of scalars holds none)."""
    entry = descriptor.message_type
    if entry is None:
        return
    if entry.GetOptions().map_entry:
        if entry.fields_by_name["value"].message_type is not None:
            yield from ((f"{name}[{key!r}]", item) for key, item in value.items())
    elif descriptor.is_repeated:
        yield from ((f"{name}[{index}]", item) for index, item in enumerate(value))
    else:
        yield name, value
