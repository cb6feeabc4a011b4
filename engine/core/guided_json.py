"""JSON guides: any JSON object (a pushdown parser over characters) and a JSON-Schema subset
(compiled to a regex, as outlines does).

Whitespace policy (both): at most one space (U+0020) between JSON tokens, no newline or tab,
nothing before the first `{` (or value) and nothing after the last `}`. JSON allows any run of
whitespace there; a model left free to add it can pad forever, so outlines and xgrammar bound it
too (outlines: `[ ]?`, the same as here). Every output is still plain JSON for any parser.

JsonObjectGuide: a state is `(stack, mode, arg, space)`: the open containers (`"o"`/`"a"`
per level, innermost last), what the parser expects next, a mode's argument (the rest of a
literal, the kind of string, the hex digits left of a `\\u` escape) and whether the last
character was a policy space. Strings: any character from U+0020 up but `"` and `\\`, escapes
`\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX`; numbers as RFC 8259 (no leading zero, no `+`, no
NaN/Infinity). Duplicate keys are allowed (as `json.loads`). A string is accepted exactly
when some continuation parses as a JSON object under the whitespace policy, and complete
exactly when it is one.

schema_to_regex, the subset (anything else is refused naming the keyword):
`type` string/integer/number/boolean/null/object/array (or a list of these simple types);
`enum`, `const` (with `type`, or both, only the values every keyword allows); strings with
`minLength`/`maxLength`; arrays with `items`, `minItems`, `maxItems`; objects with
`properties` (emitted in schema order; those in `required` always present, the others
optional) and `additionalProperties: false` (the only behaviour: no property outside
`properties`); annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`,
`$comment`) are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any, cast

from engine.core.errors import InvalidRequestError
from engine.core.guided import GuideState

# --------------------------------------------------------------------------------------------
# JSON object guide
# --------------------------------------------------------------------------------------------

_JsonState = tuple[str, str, str, bool]

_START: _JsonState = ("", "start", "", False)
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# Modes where one policy space may come before the next token.
_SPACED = frozenset(("obj_first", "obj_key", "colon", "value", "arr_first", "after"))
# Number modes that already hold a whole number: another character may end it.
_NUMBER_ENDS = frozenset(("num_zero", "num_int", "num_frac", "num_exp"))


class JsonObjectGuide:
    """Any JSON object under the whitespace policy (see the module docstring)."""

    def start(self) -> GuideState:
        return _START

    def is_complete(self, state: GuideState) -> bool:
        return cast(_JsonState, state)[1] == "done"

    def accepts_any(self, state: GuideState, first: int, last: int) -> bool:
        # Beyond ASCII (first >= 0x80) only a string's inside accepts characters, all alike.
        return self.advance(state, chr(first)) is not None

    def advance(self, state: GuideState, char: str) -> GuideState | None:
        stack, mode, arg, space = cast(_JsonState, state)
        if char == " " and mode in _SPACED:
            return None if space else (stack, mode, arg, True)
        if mode == "str":
            if char == '"':
                return (stack, "colon" if arg == "k" else "after", "", False)
            if char == "\\":
                return (stack, "esc", arg, False)
            return state if char >= " " else None
        if mode == "esc":
            if char == "u":
                return (stack, "hex", arg + "4", False)
            return (stack, "str", arg, False) if char in _ESCAPES else None
        if mode == "hex":
            if char not in _HEX:
                return None
            left = int(arg[1]) - 1
            if left == 0:
                return (stack, "str", arg[0], False)
            return (stack, "hex", f"{arg[0]}{left}", False)
        if mode.startswith("num"):
            return _number(stack, mode, char)
        if mode == "lit":
            if char != arg[0]:
                return None
            return (stack, "lit", arg[1:], False) if len(arg) > 1 else (stack, "after", "", False)
        return _structural(stack, mode, char)


def _number(stack: str, mode: str, char: str) -> _JsonState | None:
    digit = char in _DIGITS
    if mode == "num_minus":
        if not digit:
            return None
        return (stack, "num_zero" if char == "0" else "num_int", "", False)
    if mode in ("num_int", "num_frac", "num_exp") and digit:
        return (stack, mode, "", False)
    if mode in ("num_zero", "num_int") and char == ".":
        return (stack, "num_dot", "", False)
    if mode in ("num_zero", "num_int", "num_frac") and char in "eE":
        return (stack, "num_e", "", False)
    if mode == "num_dot":
        return (stack, "num_frac", "", False) if digit else None
    if mode == "num_e" and char in "+-":
        return (stack, "num_esign", "", False)
    if mode in ("num_e", "num_esign"):
        return (stack, "num_exp", "", False) if digit else None
    if mode in _NUMBER_ENDS:  # the number is over: the character belongs to what follows
        if char == " ":
            return (stack, "after", "", True)
        return _structural(stack, "after", char)
    return None


def _structural(stack: str, mode: str, char: str) -> _JsonState | None:
    if mode == "start":
        return ("o", "obj_first", "", False) if char == "{" else None
    if mode in ("obj_first", "obj_key"):
        if char == '"':
            return (stack, "str", "k", False)
        return _close(stack, char) if mode == "obj_first" and char == "}" else None
    if mode == "colon":
        return (stack, "value", "", False) if char == ":" else None
    if mode == "after":
        if char == ",":
            return (stack, "obj_key" if stack[-1] == "o" else "value", "", False)
        return _close(stack, char)
    if mode == "arr_first" and char == "]":
        return _close(stack, char)
    if mode not in ("value", "arr_first"):
        return None  # "done": nothing may follow the object
    if char == "{":
        return (stack + "o", "obj_first", "", False)
    if char == "[":
        return (stack + "a", "arr_first", "", False)
    if char == '"':
        return (stack, "str", "v", False)
    if char == "-":
        return (stack, "num_minus", "", False)
    if char in _DIGITS:
        return (stack, "num_zero" if char == "0" else "num_int", "", False)
    rest = _LITERALS.get(char)
    return None if rest is None else (stack, "lit", rest, False)


def _close(stack: str, char: str) -> _JsonState | None:
    if not stack or char != ("}" if stack[-1] == "o" else "]"):
        return None
    rest = stack[:-1]
    return (rest, "after" if rest else "done", "", False)


# --------------------------------------------------------------------------------------------
# JSON Schema subset -> regex
# --------------------------------------------------------------------------------------------

_WS = "[ ]?"
_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SIMPLE = {
    "integer": _INTEGER,
    "number": _NUMBER,
    "boolean": "(?:true|false)",
    "null": "null",
}
_ANNOTATIONS = frozenset(
    ("title", "description", "default", "examples", "$schema", "$id", "$comment")
)
_KEYWORDS = {
    "string": frozenset(("type", "minLength", "maxLength")),
    "integer": frozenset(("type",)),
    "number": frozenset(("type",)),
    "boolean": frozenset(("type",)),
    "null": frozenset(("type",)),
    "object": frozenset(("type", "properties", "required", "additionalProperties")),
    "array": frozenset(("type", "items", "minItems", "maxItems")),
}
_ALL_KEYWORDS = frozenset().union(*_KEYWORDS.values())
# The pattern's size is bounded as it is built, at every node of the schema: an array writes
# its item's pattern twice (so nested arrays double it at each level) and an object's pattern
# grows as the square of its properties before the first required one (a branch per possible
# first member). The DFA's state bound usually binds first.
_MAX_PATTERN_CHARS = 200_000


def schema_to_regex(schema_json: str) -> str:
    """The regex of the JSON texts `schema_json` accepts (InvalidRequestError outside the
    subset: the message names the keyword)."""
    try:
        schema = json.loads(schema_json)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"guided json_schema: not valid JSON: {exc}") from None
    try:
        return _value(schema, "#")
    except RecursionError:
        raise InvalidRequestError("guided json_schema: the schema nests too deeply") from None


def _refuse(where: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"guided json_schema: {what} at {where} is not supported")


def _value(schema: Any, where: str) -> str:
    pattern = _unbounded_value(schema, where)
    _check_size(len(pattern), where)
    return pattern


def _check_size(num_chars: int, where: str) -> None:
    if num_chars > _MAX_PATTERN_CHARS:
        raise InvalidRequestError(
            f"guided json_schema: the schema at {where} is too large (its pattern would exceed "
            f"{_MAX_PATTERN_CHARS} characters)"
        )


def _unbounded_value(schema: Any, where: str) -> str:
    """`schema`'s pattern, its parts bounded (`_value` bounds the whole)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"guided json_schema: the schema at {where} is not an object")
    if "enum" in schema or "const" in schema:
        _only(schema, where, frozenset(("enum", "const", "type")))
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise InvalidRequestError(f"guided json_schema: empty or malformed enum at {where}")
        values = _enum_values(schema, values, where)
        try:  # NaN and Infinity (which `json.loads` reads) are not JSON: refused
            literals = [
                json.dumps(v, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)
                for v in values
            ]
        except ValueError:
            raise InvalidRequestError(
                f"guided json_schema: NaN or Infinity in the enum at {where} is not JSON"
            ) from None
        return "(?:" + "|".join(re.escape(v) for v in literals) + ")"
    if "type" not in schema:  # name what the schema uses instead (anyOf, $ref, ...)
        unknown = next(
            (k for k in schema if k not in _ANNOTATIONS and k not in _ALL_KEYWORDS), None
        )
        raise _refuse(where, "a schema without type" if unknown is None else f"keyword {unknown!r}")
    kind = schema.get("type")
    if isinstance(kind, list) and kind and all(k in _SIMPLE or k == "string" for k in kind):
        _only(schema, where, _KEYWORDS["string"])
        return "(?:" + "|".join(_value({**schema, "type": k}, where) for k in kind) + ")"
    if not isinstance(kind, str) or kind not in _KEYWORDS:
        raise _refuse(where, f"type {kind!r}")
    _only(schema, where, _KEYWORDS[kind])
    if kind == "string":
        low, high = _bounds(schema, where, "minLength", "maxLength")
        return f'"{_STRING_CHAR}{{{low},{high}}}"'
    if kind == "array":
        return _array(schema, where)
    if kind == "object":
        return _object(schema, where)
    return _SIMPLE[kind]


def _json_types(value: Any) -> set[str]:
    """The JSON Schema types `value` (from `json.loads`) is an instance of."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {
        "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"
    }


def _same_json(a: Any, b: Any) -> bool:
    """JSON Schema's equality of two values (from `json.loads`): Python's `==`, except that a
    boolean never equals a number, at any depth (`[true]` is not `[1]`)."""
    if _json_types(a) != _json_types(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    return bool(a == b)


def _enum_values(schema: dict[str, Any], values: list[Any], where: str) -> list[Any]:
    """The values of `enum` that also satisfy the schema's `const` and `type`, if given (all
    of a schema's keywords hold at once)."""
    kept = values
    if "enum" in schema and "const" in schema:
        const = schema["const"]
        kept = [v for v in kept if _same_json(v, const)]
    if "type" in schema:
        kind = schema["type"]
        kinds = {k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)}
        kept = [v for v in kept if _json_types(v) & kinds]
    if not kept:
        raise InvalidRequestError(
            f"guided json_schema: no value of the enum at {where} satisfies its type or const"
        )
    return kept


def _only(schema: dict[str, Any], where: str, allowed: frozenset[str]) -> None:
    for key in schema:
        if key not in allowed and key not in _ANNOTATIONS:
            raise _refuse(where, f"keyword {key!r}")


def _bounds(schema: dict[str, Any], where: str, low_key: str, high_key: str) -> tuple[int, str]:
    low = schema.get(low_key, 0)
    high = schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (type(value) is not int or value < 0):
            raise InvalidRequestError(f"guided json_schema: {key} at {where} must be an int >= 0")
    if high is not None and high < low:
        raise InvalidRequestError(f"guided json_schema: {high_key} < {low_key} at {where}")
    return low, "" if high is None else str(high)


def _array(schema: dict[str, Any], where: str) -> str:
    if "items" not in schema:
        raise _refuse(where, "an array without items")
    item = _value(schema["items"], f"{where}/items")
    low, high = _bounds(schema, where, "minItems", "maxItems")
    if high == "0":
        return rf"\[{_WS}\]"
    more_high = "" if not high else str(int(high) - 1)
    items = f"{item}(?:{_WS},{_WS}{item}){{{max(low - 1, 0)},{more_high}}}"
    if low == 0:  # may be empty: one policy space at most, "[ ]"
        return rf"\[{_WS}(?:{items}{_WS})?\]"
    return rf"\[{_WS}{items}{_WS}\]"


def _object(schema: dict[str, Any], where: str) -> str:
    if schema.get("additionalProperties", False) is not False:
        raise _refuse(where, "additionalProperties other than false")
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if (
        not isinstance(properties, dict)
        or not isinstance(required, list)
        or not all(isinstance(name, str) for name in required)
    ):
        raise InvalidRequestError(f"guided json_schema: malformed properties at {where}")
    if unknown := [r for r in required if r not in properties]:
        raise InvalidRequestError(f"guided json_schema: required {unknown} not in properties")
    members: list[tuple[str, bool]] = []
    num_chars = 0
    for name, sub in properties.items():
        key = re.escape(json.dumps(name, ensure_ascii=False))
        text = f"{key}{_WS}:{_WS}{_value(sub, f'{where}/properties/{name}')}"
        num_chars += len(text)
        _check_size(num_chars, where)  # many large members: stop before joining them
        members.append((text, name in required))
    # The first member written is any one up to the first required; after it, each later
    # member follows its comma, required or optional. One branch per possible first member:
    # O(n^2) pattern, O(n^2) automaton states (a nested "written or skipped" pattern per
    # member would be O(2^n)).
    first_required = next((i for i, (_, is_required) in enumerate(members) if is_required), None)
    last_first = len(members) - 1 if first_required is None else first_required
    branches = []
    for first in range(last_first + 1):
        rest = (
            f"{_WS},{_WS}{text}" if is_required else f"(?:{_WS},{_WS}{text})?"
            for text, is_required in members[first + 1 :]
        )
        branches.append(members[first][0] + "".join(rest))
        if sum(map(len, branches)) > _MAX_PATTERN_CHARS:
            raise InvalidRequestError(
                f"guided json_schema: too many optional properties at {where}; make some "
                "of them required"
            )
    if not branches:
        return rf"\{{{_WS}\}}"
    body = "(?:" + "|".join(branches) + ")"
    if first_required is None:  # may be empty: one policy space at most, "{ }"
        return rf"\{{{_WS}(?:{body}{_WS})?\}}"
    return rf"\{{{_WS}{body}{_WS}\}}"
