"""The regex syntax guided decoding compiles to an automaton: a parser from a pattern to a small
syntax tree (`Node`), refusing what a finite automaton cannot express.

The pattern must first compile with the `regex` module (the caller checks: its error messages
are the user's). The language is then that of `regex.fullmatch` with default flags (version 0,
Unicode), for the subset:

- literals, `.` (not `\\n`), character classes `[...]` (ranges, negation, POSIX `[:name:]`,
  escapes), and the escapes `\\d \\D \\w \\W \\s \\S`, `\\p{..} \\P{..}`, `\\N{..}`, `\\xhh`,
  `\\uhhhh`, `\\Uhhhhhhhh`, octal, `\\a \\f \\n \\r \\t \\v`, and any escaped punctuation;
- concatenation, `|`, groups `(...)`, `(?:...)`, `(?P<name>...)`, `(?<name>...)`, comments
  `(?#...)`;
- quantifiers `* + ? {m} {m,} {,n} {m,n}`, greedy or lazy (`*?`: the same language);
- the anchors `^`, `\\A` (the start), `$` (the end, or before a final newline) and `\\Z`, `\\z`
  (the end).

Refused (InvalidRequestError naming the construct): backreferences, lookarounds, word
boundaries and other assertions, atomic groups and possessive quantifiers (they change the
language in ways an automaton does not track), conditionals, inline flags, fuzzy matching,
`\\X`, `\\G`, `\\K`, and a `{` that the `regex` module might read as a count or a fuzzy
constraint.

Character sets are whatever the `regex` module says they are: a class or escape's members are
found once by running it over every code point (`char_set`), so `\\w`, `\\d` and `\\p{..}` are
exactly the `regex` module's. That scan takes milliseconds, so a pattern may name at most
`MAX_CHAR_SETS` distinct ones (beyond: InvalidRequestError); an escape of one character
(`\\xhh`, `\\uhhhh`, octal, `\\n`, `\\.`) is its code point, not scanned, nor counted. A set is a
tuple of half-open code point intervals.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from engine.core.errors import InvalidRequestError

CharSet = tuple[tuple[int, int], ...]  # sorted, disjoint, half-open [start, stop) intervals

_MAX_CODE_POINT = 0x110000
# Distinct classes, `.` and class escapes one pattern may name: each costs a scan of every code
# point the first time (about 8 ms), so that a long pattern of distinct classes cannot hold the
# guide compiler for seconds.
MAX_CHAR_SETS = 100
_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")
# Escapes of one character set: the letter, and how much text follows it.
_CLASS_ESCAPES = frozenset("dDwWsSafnrtv")
_CONTROL_ESCAPES = {"a": 0x07, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}  # `regex` checked that the digits are there
_BRACED_ESCAPES = frozenset("NpP")
_REFUSED_ESCAPES = {
    "b": "a word boundary \\b",
    "B": "a word boundary \\B",
    "G": "\\G",
    "K": "\\K",
    "X": "a grapheme \\X",
    "m": "a word boundary \\m",
    "M": "a word boundary \\M",
    "g": "a backreference \\g",
    "L": "a named list \\L",
}
_REFUSED_GROUPS = (
    ("(?=", "a lookahead (?=...)"),
    ("(?!", "a lookahead (?!...)"),
    ("(?<=", "a lookbehind (?<=...)"),
    ("(?<!", "a lookbehind (?<!...)"),
    ("(?>", "an atomic group (?>...)"),
    ("(?(", "a conditional (?(...)...)"),
    ("(?|", "a branch reset (?|...)"),
    ("(?P=", "a backreference (?P=...)"),
    ("(?P>", "a subroutine call (?P>...)"),
    ("(?&", "a subroutine call (?&...)"),
)


class Anchor(enum.Enum):
    START = "^"  # ^ and \A: only at the start of the text
    END = "\\Z"  # \Z and \z: only at the end
    DOLLAR = "$"  # at the end, or before a newline that ends the text


@dataclass(frozen=True, slots=True)
class Chars:
    chars: CharSet


@dataclass(frozen=True, slots=True)
class Concat:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alternation:
    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    item: Node
    low: int
    high: int | None  # None: unbounded


@dataclass(frozen=True, slots=True)
class Assertion:
    anchor: Anchor


Node = Chars | Concat | Alternation | Repeat | Assertion


def parse(pattern: str) -> Node:
    """The syntax tree of `pattern` (which the `regex` module compiles); InvalidRequestError
    for a construct outside the subset."""
    parser = _Parser(pattern)
    node = parser.alternation()
    if parser.pos != len(pattern):  # an unbalanced ")" (which `regex` would have refused)
        raise _refuse("an unbalanced ')'", parser.pos)
    return node


def _refuse(what: str, pos: int) -> InvalidRequestError:
    return InvalidRequestError(f"{what} at position {pos} is not supported")


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0
        self._scanned: set[str] = set()  # the distinct texts given to `char_set`

    def _chars(self, text: str) -> Chars:
        """The set of the class, `.` or escape `text` (InvalidRequestError past MAX_CHAR_SETS)."""
        point = _literal_escape(text)
        if point is not None:
            return Chars(((point, point + 1),))
        self._scanned.add(text)
        if len(self._scanned) > MAX_CHAR_SETS:
            raise _refuse(
                f"a character class beyond the {MAX_CHAR_SETS} distinct ones a pattern may use",
                self.pos - len(text),
            )
        return Chars(char_set(text))

    def _peek(self, text: str) -> bool:
        return self.pattern.startswith(text, self.pos)

    def alternation(self) -> Node:
        options = [self._concat()]
        while self._peek("|"):
            self.pos += 1
            options.append(self._concat())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def _concat(self) -> Node:
        items: list[Node] = []
        while self.pos < len(self.pattern) and self.pattern[self.pos] not in "|)":
            item = self._atom()
            if item is not None:
                items.append(self._quantified(item))
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def _quantified(self, item: Node) -> Node:
        """`item` under the quantifier that follows it, if any (`regex` refuses a second)."""
        start = self.pos
        char = self.pattern[start : start + 1]
        if char and char in "*+?":
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            self.pos += 1
        elif char == "{" and (count := _COUNT.match(self.pattern, start)) is not None:
            low_text, comma, high_text = count.groups()
            if not (low_text or comma or high_text):
                return item  # "{}" is two literal characters
            low = int(low_text or 0)
            high = low if not comma else int(high_text) if high_text else None
            self.pos = count.end()
        else:
            return item
        if self._peek("+"):
            raise _refuse("a possessive quantifier", start)
        if self._peek("?"):
            self.pos += 1  # lazy: the same language under a full match
        return Repeat(item, low, high)

    def _atom(self) -> Node | None:
        pattern, start = self.pattern, self.pos
        char = pattern[start]
        if char == "(":
            return self._group()
        if char == "[":
            end = _class_end(pattern, start)
            self.pos = end
            return self._chars(pattern[start:end])
        if char == "\\":
            return self._escape()
        self.pos += 1
        if char == ".":
            return self._chars(".")
        if char == "^":
            return Assertion(Anchor.START)
        if char == "$":
            return Assertion(Anchor.DOLLAR)
        if (
            char == "{"
            and start + 1 < len(pattern)
            and pattern[start + 1] in "0123456789,eidsEIDS "
        ):
            raise _refuse("a '{' that is neither a count nor a literal", start)
        return Chars(((ord(char), ord(char) + 1),))

    def _group(self) -> Node | None:
        start = self.pos
        for prefix, what in _REFUSED_GROUPS:
            if self._peek(prefix):
                raise _refuse(what, start)
        if self._peek("(?#"):
            self.pos = self.pattern.index(")", start) + 1
            return None
        if self._peek("(?:"):
            self.pos += 3
        elif self._peek("(?P<") or self._peek("(?<"):
            self.pos = self.pattern.index(">", start) + 1
        elif self._peek("(?"):
            raise _refuse("an inline flag or extension (?...)", start)
        else:
            self.pos += 1
        node = self.alternation()
        self.pos += 1  # the ")" (the pattern compiled, so the group is closed)
        return node

    def _escape(self) -> Node:
        pattern, start = self.pattern, self.pos
        letter = pattern[start + 1]
        end = start + 2
        if letter == "A":
            self.pos = end
            return Assertion(Anchor.START)
        if letter in ("Z", "z"):
            self.pos = end
            return Assertion(Anchor.END)
        if letter in _REFUSED_ESCAPES:
            raise _refuse(_REFUSED_ESCAPES[letter], start)
        if letter in _HEX_DIGITS:
            end += _HEX_DIGITS[letter]
        elif letter in _BRACED_ESCAPES:
            end = pattern.index("}", end) + 1 if pattern.startswith("{", end) else end + 1
        elif letter == "0" or _is_octal(pattern, start + 1):  # up to three octal digits
            end = start + 1
            while end < min(start + 4, len(pattern)) and pattern[end] in "01234567":
                end += 1
        elif letter.isdigit():
            raise _refuse("a backreference", start)
        elif letter.isalnum() and letter not in _CLASS_ESCAPES:
            raise _refuse(f"the escape \\{letter}", start)
        self.pos = end
        return self._chars(pattern[start:end])


def _literal_escape(text: str) -> int | None:
    """The code point of an escape of one character (`text` as `_escape` delimits it), or None
    (a class escape, `\\N{..}`, or not an escape)."""
    if not text.startswith("\\"):
        return None
    letter = text[1]
    if letter in _HEX_DIGITS:
        return int(text[2:], 16)
    if letter in "01234567":  # `_escape` took only octal digits
        return int(text[1:], 8)
    if letter in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[letter]
    return None if letter.isalnum() else ord(letter)


def _is_octal(pattern: str, pos: int) -> bool:
    """A three-digit octal escape (`\\101`); one or two digits are a group reference."""
    digits = pattern[pos : pos + 3]
    return len(digits) == 3 and all(d in "01234567" for d in digits)


def _class_end(pattern: str, start: int) -> int:
    """The index just after the `]` that closes the class opening at `start` (version 0
    syntax: a `]` first is a member, `[` is a member unless it opens `[:name:]`)."""
    pos = start + 1
    if pattern.startswith("^", pos):
        pos += 1
    if pattern.startswith("]", pos):
        pos += 1
    while pattern[pos] != "]":
        if pattern[pos] == "\\":
            pos += 2
        elif pattern.startswith("[:", pos) and (close := pattern.find(":]", pos + 2)) != -1:
            pos = close + 2
        else:
            pos += 1
    return pos + 1


@cache
def _every_code_point() -> str:
    return "".join(map(chr, range(_MAX_CODE_POINT)))


@lru_cache(maxsize=1024)
def char_set(text: str) -> CharSet:
    """The code points the one-character pattern `text` (a class, an escape, `.`) matches,
    as the `regex` module decides: one scan of every code point per distinct text."""
    import regex  # the engine extra's dependency; only guided requests need it

    try:
        runs: Any = regex.compile(f"(?:{text})+").finditer(_every_code_point())
    except regex.error as exc:
        raise InvalidRequestError(f"the character set {text!r}: {exc}") from None
    return tuple((m.start(), m.end()) for m in runs)
