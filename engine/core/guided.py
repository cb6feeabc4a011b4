"""Guided (structured) decoding: the constraints, as guides over the text generated so far.

A `Guide` is a small automaton over characters: `start()` gives the state before any output,
`advance(state, char)` the state after one more character (None when no string of the language
starts with the text so far plus that character: the character is refused), and
`is_complete(state)` whether the text so far is a whole string of the language;
`accepts_any(state, first, last)` whether some character with a code point in [first, last]
would be accepted (the vocabulary walk asks it for a token that ends inside a UTF-8 character:
the characters such a fragment can start are one code point interval). States are
immutable and hashable, so a caller can branch from one state many times (the vocabulary walk
in `engine.core.guided_vocab` does, once per trie edge) and memoise per state.

The modes (`GuideKind`):

- REGEX: the text must match the pattern in full (`regex.fullmatch`), for the subset of the
  `regex` module's syntax a finite automaton expresses (`engine.core.guided_regex` lists it and
  refuses the rest). The pattern is compiled to a DFA over characters
  (`engine.core.guided_dfa`), bounded in size; the state is the DFA's, a step one lookup.
- CHOICE: the text must be one of the choices exactly (a sorted list and a binary search for
  "some choice starts with the text").
- JSON_OBJECT: any JSON object (`engine.core.guided_json.JsonObjectGuide`, a pushdown parser).
- JSON_SCHEMA: a subset of JSON Schema compiled to a regex, as outlines does
  (`engine.core.guided_json.schema_to_regex`), then to a DFA as REGEX.
- EBNF_GRAMMAR: a GBNF grammar from `root` (`engine.core.guided_ebnf.EbnfGuide`, an Earley
  recognizer whose state is one interned column).

`compile_guide(spec)` validates and builds a guide, raising InvalidRequestError on a bad
pattern, schema, grammar or choice list; it is memoised, so validating a request before
acceptance and building its outputs' guides after costs one compilation.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable
from functools import lru_cache
from typing import Protocol, cast

from engine.core.api import GuidedDecoding, GuideKind
from engine.core.errors import InvalidRequestError

GuideState = Hashable


class Guide(Protocol):
    def start(self) -> GuideState: ...

    def advance(self, state: GuideState, char: str) -> GuideState | None:
        """The state after `char`, or None when no string of the language continues so."""
        ...

    def is_complete(self, state: GuideState) -> bool: ...

    def accepts_any(self, state: GuideState, first: int, last: int) -> bool:
        """Whether `advance` accepts some character with a code point in [first, last]
        (0x80 <= first: the vocabulary walk asks only about multi-byte characters)."""
        ...


class RegexGuide:
    """A full match of a pattern, as a DFA over characters; the state is the DFA's (an int)."""

    def __init__(self, pattern: str, what: str = "guided regex") -> None:
        import regex  # the engine extra's dependency; only guided requests need it

        from engine.core.guided_dfa import compile_dfa
        from engine.core.guided_regex import parse

        try:
            regex.compile(pattern)  # the syntax check, with `regex`'s messages
        except (regex.error, ValueError, OverflowError, RecursionError) as exc:
            raise InvalidRequestError(f"{what}: invalid pattern: {exc}") from None
        try:
            self._dfa = compile_dfa(parse(pattern))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{what}: {exc}") from None
        except RecursionError:
            raise InvalidRequestError(f"{what}: the pattern nests too deeply") from None

    @property
    def num_states(self) -> int:
        return self._dfa.num_states

    def start(self) -> GuideState:
        return 0

    def advance(self, state: GuideState, char: str) -> GuideState | None:
        return self._dfa.step(cast(int, state), char)

    def is_complete(self, state: GuideState) -> bool:
        return self._dfa.accepting[cast(int, state)]

    def accepts_any(self, state: GuideState, first: int, last: int) -> bool:
        return self._dfa.accepts_any(cast(int, state), first, last)


class ChoiceGuide:
    """Exactly one of the choices; the state is the text so far."""

    def __init__(self, choices: tuple[str, ...]) -> None:
        if not choices:
            raise InvalidRequestError("guided choice: the list of choices is empty")
        if any(not c for c in choices):
            raise InvalidRequestError("guided choice: a choice is the empty string")
        self._choices = sorted(set(choices))
        self._set = frozenset(choices)

    def start(self) -> GuideState:
        return ""

    def advance(self, state: GuideState, char: str) -> GuideState | None:
        text = f"{state}{char}"
        # The first choice not below `text` is the only candidate that can start with it.
        i = bisect_left(self._choices, text)
        return text if i < len(self._choices) and self._choices[i].startswith(text) else None

    def is_complete(self, state: GuideState) -> bool:
        return state in self._set

    def accepts_any(self, state: GuideState, first: int, last: int) -> bool:
        # The first choice not below text + chr(first): if any choice continues the text with
        # a character in [first, last], this one does (it sorts between the two).
        text = cast(str, state)
        i = bisect_left(self._choices, text + chr(first))
        if i == len(self._choices) or not self._choices[i].startswith(text):
            return False
        return ord(self._choices[i][len(text)]) <= last


@lru_cache(maxsize=64)
def compile_guide(spec: GuidedDecoding) -> Guide:
    """Validate `spec` and build its guide (InvalidRequestError when it is malformed)."""
    from engine.core.guided_json import JsonObjectGuide, schema_to_regex

    if spec.kind is GuideKind.REGEX:
        return RegexGuide(spec.value)
    if spec.kind is GuideKind.CHOICE:
        return ChoiceGuide(spec.choices)
    if spec.kind is GuideKind.JSON_OBJECT:
        return JsonObjectGuide()
    if spec.kind is GuideKind.EBNF_GRAMMAR:
        from engine.core.guided_ebnf import EbnfGuide

        return EbnfGuide(spec.value)
    return RegexGuide(schema_to_regex(spec.value), "guided json_schema")
