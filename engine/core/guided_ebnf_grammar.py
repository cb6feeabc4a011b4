"""GBNF grammar text -> plain BNF, for the EBNF guide (`engine.core.guided_ebnf`).

The dialect (docs/engine.md lists it with the statuses):

    root   ::= "(" expr ")" | item*      # rules: name ::= alternatives; `root` starts
    expr   ::= [0-9]+ ("+" [0-9]+)?      # literals "..", classes [a-z] [^"\\], ( ) | * + ?
    item   ::= .{2,3} "\\n"              # `.` any character, counts {m} {m,} {m,n}

Names are `[A-Za-z0-9_-]+`; a rule runs until the next `name ::=` (newlines are plain space,
and space may come before a quantifier); `#` comments to the end of the line. Escapes in
literals and classes: `\\n \\r \\t \\\\ \\" \\[ \\] \\- \\^ \\xHH \\uHHHH \\UHHHHHHHH`. In a class
`a-z` is a range, a `-` first or last is itself, `^` first negates. Rules may be recursive,
left recursion included.

Compilation: every group, repetition and literal becomes plain BNF (`x*` is `N ::= | N x`, left
recursive, so a long run keeps one Earley item; `x{m,n}` is m copies of x then n - m optional
ones). Rules that derive no text are dropped with their alternatives, so that every production
the recognizer sees can complete.

Bounds: a grammar over `MAX_GRAMMAR_CHARS` characters or `MAX_SYMBOLS` BNF symbols after
expansion, with groups nested deeper than `MAX_GROUP_NESTING` or a count above `MAX_COUNT` is
refused (InvalidRequestError, naming the line and column).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from engine.core.errors import InvalidRequestError

MAX_GRAMMAR_CHARS = 100_000
MAX_SYMBOLS = 50_000
MAX_GROUP_NESTING = 64
MAX_COUNT = 1000

_MAX_CODE_POINT = 0x10FFFF
_NAME = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START = re.compile(r"[A-Za-z0-9_-]+[ \t\r\n]*::=")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_SIMPLE_ESCAPES |= {"-": "-", "^": "^"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}

Ranges = tuple[tuple[int, int], ...]


class Grammar(NamedTuple):
    """Productions `lhs[p] ::= rhs[p]`: a nonterminal is an int >= 0, a terminal is class id c
    written -(c + 1), production 0 is `S' ::= root` (nonterminal 0). `classes` are the
    terminals' code-point ranges (sorted, disjoint); `nullable` the nonterminals that derive
    the empty text."""

    lhs: list[int]
    rhs: list[tuple[int, ...]]
    classes: list[Ranges]
    nullable: frozenset[int]


def parse_grammar(text: str) -> Grammar:
    """The grammar of GBNF `text`, without its productions that derive no text; raises
    InvalidRequestError for a malformed grammar, one beyond the bounds, or one whose `root`
    matches no text."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(
            f"guided ebnf_grammar: the grammar is over {MAX_GRAMMAR_CHARS} characters"
        )
    parser = _Parser(text)
    parser.grammar()
    nullable, productive = _nullable_and_productive(parser)
    if 0 not in productive:
        raise InvalidRequestError("guided ebnf_grammar: 'root' matches no text")
    empty = {-(c + 1) for c, ranges in enumerate(parser.classes) if not ranges}
    keep = [
        p
        for p, rhs in enumerate(parser.rhs)
        if all(s in productive if s >= 0 else s not in empty for s in rhs)
    ]
    # Production 0 (S' ::= root) is kept, root being productive, and stays first.
    return Grammar(
        lhs=[parser.lhs[p] for p in keep],
        rhs=[parser.rhs[p] for p in keep],
        classes=parser.classes,
        nullable=frozenset(nullable),
    )


class _Parser:
    """GBNF text -> BNF productions (recursive descent; positions for the error messages)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.names: dict[str, int] = {"": 0}  # "" is S'
        self.defined: set[str] = set()
        self.first_reference: dict[str, int] = {}
        self.lhs: list[int] = []
        self.rhs: list[tuple[int, ...]] = []
        self.classes: list[Ranges] = []
        self._class_ids: dict[Ranges, int] = {}
        self.num_nonterminals = 1
        self.num_symbols = 0

    # ---- errors and lexing ------------------------------------------------------------------

    def error(self, what: str, pos: int | None = None) -> InvalidRequestError:
        at = self.pos if pos is None else pos
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return InvalidRequestError(f"guided ebnf_grammar: {what} at line {line}, column {column}")

    def skip(self) -> None:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char in " \t\r\n":
                self.pos += 1
            else:
                return

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def char(self, opened: int) -> int:
        """One character of the literal or class opened at `opened` (escapes decoded), as a
        code point."""
        start = self.pos
        char = self.peek()
        if not char or char == "\n":
            what = "string" if self.text[opened] == '"' else "class"
            raise self.error(f"an unterminated {what}", opened)
        self.pos += 1
        if char != "\\":
            return ord(char)
        escape = self.peek()
        self.pos += 1
        if escape in _SIMPLE_ESCAPES:
            return ord(_SIMPLE_ESCAPES[escape])
        if escape in _HEX_ESCAPES:
            digits = self.text[self.pos : self.pos + _HEX_ESCAPES[escape]]
            if len(digits) != _HEX_ESCAPES[escape] or not all(
                d in "0123456789abcdefABCDEF" for d in digits
            ):
                raise self.error(f"\\{escape} needs {_HEX_ESCAPES[escape]} hex digits", start)
            self.pos += len(digits)
            value = int(digits, 16)
            if value > _MAX_CODE_POINT:
                raise self.error("a code point above U+10FFFF", start)
            return value
        raise self.error(f"unknown escape \\{escape}", start)

    # ---- building -----------------------------------------------------------------------------

    def terminal(self, ranges: Ranges) -> int:
        class_id = self._class_ids.get(ranges)
        if class_id is None:
            class_id = self._class_ids[ranges] = len(self.classes)
            self.classes.append(ranges)
        return -(class_id + 1)

    def new_nonterminal(self) -> int:
        self.num_nonterminals += 1
        return self.num_nonterminals - 1

    def nonterminal(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = self.new_nonterminal()
        return self.names[name]

    def production(self, lhs: int, rhs: Iterable[int]) -> None:
        symbols = tuple(rhs)
        self.num_symbols += len(symbols) + 1
        if self.num_symbols > MAX_SYMBOLS:
            raise self.error(f"the grammar is too large (over {MAX_SYMBOLS} symbols expanded)")
        self.lhs.append(lhs)
        self.rhs.append(symbols)

    def one_symbol(self, symbols: list[int]) -> int:
        if len(symbols) == 1:
            return symbols[0]
        group = self.new_nonterminal()
        self.production(group, symbols)
        return group

    # ---- the grammar ----------------------------------------------------------------------------

    def grammar(self) -> None:
        self.production(0, (self.nonterminal("root"),))
        self.skip()
        while self.pos < len(self.text):
            start = self.pos
            match = _NAME.match(self.text, self.pos)
            if match is None:
                raise self.error("expected a rule name")
            name = match.group()
            self.pos = match.end()
            self.skip()
            if not self.text.startswith("::=", self.pos):
                raise self.error("expected '::='")
            self.pos += 3
            if name in self.defined:
                raise self.error(f"rule {name!r} is defined twice", start)
            self.defined.add(name)
            lhs = self.nonterminal(name)
            for sequence in self.alternatives(0):
                self.production(lhs, sequence)
            self.skip()
        if "root" not in self.defined:
            raise InvalidRequestError("guided ebnf_grammar: no rule named 'root'")
        for name, pos in self.first_reference.items():
            if name not in self.defined:
                raise self.error(f"undefined rule {name!r}", pos)

    def alternatives(self, nesting: int) -> list[list[int]]:
        sequences = [self.sequence(nesting)]
        while self.peek() == "|":
            self.pos += 1
            sequences.append(self.sequence(nesting))
        return sequences

    def sequence(self, nesting: int) -> list[int]:
        symbols: list[int] = []
        while True:
            self.skip()
            char = self.peek()
            if not char or char in "|)" or _RULE_START.match(self.text, self.pos):
                return symbols
            term = self.term(nesting)
            self.skip()  # `"a" *`: llama.cpp allows space between a term and its quantifier
            symbols.extend(self.quantified(term))

    def term(self, nesting: int) -> list[int]:
        start, char = self.pos, self.peek()
        if char == '"':
            self.pos += 1
            codes = []
            while self.peek() != '"':
                codes.append(self.char(start))
            self.pos += 1
            return [self.terminal(((code, code),)) for code in codes]
        if char == "[":
            return [self.terminal(self.char_class())]
        if char == ".":
            self.pos += 1
            return [self.terminal(((0, _MAX_CODE_POINT),))]
        if char == "(":
            if nesting >= MAX_GROUP_NESTING:
                raise self.error(f"groups nest deeper than {MAX_GROUP_NESTING}")
            self.pos += 1
            sequences = self.alternatives(nesting + 1)
            self.skip()
            if self.peek() != ")":
                raise self.error("expected ')'")
            self.pos += 1
            if len(sequences) == 1:
                return sequences[0]
            group = self.new_nonterminal()
            for sequence in sequences:
                self.production(group, sequence)
            return [group]
        match = _NAME.match(self.text, self.pos)
        if match is None:
            raise self.error(f"unexpected {char!r}")
        self.pos = match.end()
        self.first_reference.setdefault(match.group(), start)
        return [self.nonterminal(match.group())]

    def char_class(self) -> Ranges:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            first = self.char(start)
            last = first
            if self.peek() == "-" and self.text[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.pos += 1
                last = self.char(start)
                if last < first:
                    raise self.error("a class range out of order", start)
            ranges.append((first, last))
        self.pos += 1
        if not ranges:
            raise self.error("an empty class", start)
        merged = _merge(ranges)
        return _complement(merged) if negated else merged

    def quantified(self, term: list[int]) -> list[int]:
        char = self.peek()
        if char not in ("*", "+", "?", "{"):
            return term
        start = self.pos
        self.pos += 1
        if char == "{":
            low, high = self.count(start)
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        symbol = self.one_symbol(term)
        result = [symbol] * low
        self.num_symbols += low
        if high is None:
            many = self.new_nonterminal()  # many ::= | many symbol  (left recursive)
            self.production(many, ())
            self.production(many, (many, symbol))
            result.append(many)
        elif high > low:
            optional = self.new_nonterminal()
            self.production(optional, ())
            self.production(optional, (symbol,))
            result.extend([optional] * (high - low))
            self.num_symbols += high - low
        if self.num_symbols > MAX_SYMBOLS:
            raise self.error(f"the grammar is too large (over {MAX_SYMBOLS} symbols expanded)")
        return result

    def count(self, start: int) -> tuple[int, int | None]:
        end = self.text.find("}", self.pos)
        body = self.text[self.pos : end] if end >= 0 else ""
        match = re.fullmatch(r"\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?", body)
        if end < 0 or match is None:
            raise self.error("a malformed count {m}, {m,} or {m,n}", start)
        self.pos = end + 1
        low = int(match.group(1))
        high = None if match.group(2) and not match.group(3) else int(match.group(3) or low)
        if max(low, high or 0) > MAX_COUNT:
            raise self.error(f"a count above {MAX_COUNT}", start)
        if high is not None and high < low:
            raise self.error("a count {m,n} with n < m", start)
        return low, high


def _merge(ranges: list[tuple[int, int]]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def _complement(ranges: Ranges) -> Ranges:
    result, next_first = [], 0
    for first, last in ranges:
        if first > next_first:
            result.append((next_first, first - 1))
        next_first = last + 1
    if next_first <= _MAX_CODE_POINT:
        result.append((next_first, _MAX_CODE_POINT))
    return tuple(result)


def _nullable_and_productive(parser: _Parser) -> tuple[set[int], set[int]]:
    """The nonterminals that derive the empty text, and those that derive some text (linear
    worklists: each production waits on a count of symbols not yet known to qualify)."""
    uses: dict[int, list[int]] = {}
    for p, rhs in enumerate(parser.rhs):
        for symbol in set(rhs):  # once per production: the count below takes every occurrence
            if symbol >= 0:
                uses.setdefault(symbol, []).append(p)

    def fixpoint(counts: list[int]) -> set[int]:
        found: set[int] = set()
        ready = [parser.lhs[p] for p, n in enumerate(counts) if n == 0]
        while ready:
            symbol = ready.pop()
            if symbol in found:
                continue
            found.add(symbol)
            for p in uses.get(symbol, ()):
                for s in parser.rhs[p]:
                    if s == symbol:
                        counts[p] -= 1
                if counts[p] == 0:
                    ready.append(parser.lhs[p])
        return found

    nullable = fixpoint([len(rhs) for rhs in parser.rhs])
    empty_class = {-(c + 1) for c, ranges in enumerate(parser.classes) if not ranges}
    productive = fixpoint([sum(1 for s in rhs if s >= 0 or s in empty_class) for rhs in parser.rhs])
    # An empty class never counts down, so its productions never qualify: that is intended.
    return nullable, productive
