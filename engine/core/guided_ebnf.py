"""EBNF grammars (the GBNF dialect of llama.cpp, vLLM and xgrammar) as a guide: an Earley
recognizer over characters whose state is one Earley column.

The dialect (docs/engine.md lists it with the statuses):

    root   ::= "(" expr ")" | item*      # rules: name ::= alternatives; `root` starts
    expr   ::= [0-9]+ ("+" [0-9]+)?      # literals "..", classes [a-z] [^"\\], ( ) | * + ?
    item   ::= .{2,3} "\\n"              # `.` any character, counts {m} {m,} {m,n}

Names are `[A-Za-z0-9_-]+`; a rule runs until the next `name ::=` (newlines are plain space,
and space may come before a quantifier);
`#` comments to the end of the line. Escapes in literals and classes: `\\n \\r \\t \\\\ \\"
\\[ \\] \\- \\^ \\xHH \\uHHHH \\UHHHHHHHH`. In a class `a-z` is a range, a `-` first or last is
itself, `^` first negates. Rules may be recursive, left recursion included.

Compilation: every group, repetition and literal becomes plain BNF (`x*` is `N ::= | N x`, left
recursive, so a long run keeps one item; `x{m,n}` is m copies of x then n - m optional ones).
Rules that derive no text are dropped with their alternatives, so every Earley item can still
complete: a column with an item is a viable prefix (and the guide never offers a dead end but
at the bounds below).

The state, a `_Column`: the Earley items of the text so far that can still scan a character,
the column's `_Origin` (its items waiting on a nonterminal: the parents a later completion
returns to), and whether `root` is complete. An item is (production, dot, origin), the origin
being the `_Origin` of the column where the production started, cut to the items that item can
return to (`_trim`; None: this column). Columns and origins are interned per guide (weak
tables: equal ones are one object), so a state hashes and compares by identity and a column
that recurs (a repetition, a string's inside, from the second element on) is the same state,
which is what `TokenMasker`'s memo needs. The origins' chain is the text's nesting:
parentheses, or each element of a right-recursive rule (prefer `*` or left recursion, which
keep it flat). Steps are cached per (column, character), up to `MAX_CACHED_TRANSITIONS`.

Bounds, so that no request can hang the engine: the grammar (`MAX_GRAMMAR_CHARS`,
`MAX_SYMBOLS` BNF symbols after expansion, `MAX_GROUP_NESTING`, counts up to `MAX_COUNT`) is
refused beyond them (InvalidRequestError, naming the place); at run time a character whose
column would hold more than `MAX_ITEMS` items, need more than `MAX_STEP_WORK` Earley steps or
nest deeper than `MAX_DEPTH` origins is refused (the language is cut there: a text may then
reach a point where no token is allowed, which ends the request with the guided-decoding error).
"""

from __future__ import annotations

import itertools
import re
import threading
import weakref
from bisect import bisect_right
from collections.abc import Iterable
from typing import cast

from engine.core.errors import InvalidRequestError
from engine.core.guided import GuideState

MAX_GRAMMAR_CHARS = 100_000
MAX_SYMBOLS = 50_000
MAX_GROUP_NESTING = 64
MAX_COUNT = 1000
MAX_ITEMS = 1000
MAX_STEP_WORK = 10_000
MAX_DEPTH = 128
MAX_CACHED_TRANSITIONS = 65536

_MAX_CODE_POINT = 0x10FFFF
_NAME = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START = re.compile(r"[A-Za-z0-9_-]+[ \t\r\n]*::=")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_SIMPLE_ESCAPES |= {"-": "-", "^": "^"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_START_PRODUCTION = 0  # S' ::= root; nonterminal 0

# A terminal is a class id c, written -(c + 1) in a production; a nonterminal is an int >= 0.
_Ranges = tuple[tuple[int, int], ...]
_Item = tuple[int, int, "_Origin | None"]


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
        self.classes: list[_Ranges] = []
        self._class_ids: dict[_Ranges, int] = {}
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

    def terminal(self, ranges: _Ranges) -> int:
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

    def char_class(self) -> _Ranges:
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


def _merge(ranges: list[tuple[int, int]]) -> _Ranges:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def _complement(ranges: _Ranges) -> _Ranges:
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


class _Origin:
    """The items of one column that wait on a nonterminal: what a later completion of a
    rule started there returns to (interned: compared by identity)."""

    __slots__ = ("__weakref__", "depth", "waiting")

    def __init__(self, items: frozenset[_Item], rhs: list[tuple[int, ...]]) -> None:
        self.depth: int = max((o.depth + 1 for _, _, o in items if o is not None), default=0)
        waiting: dict[int, list[_Item]] = {}
        for p, d, o in items:
            waiting.setdefault(rhs[p][d], []).append((p, d, o))
        self.waiting = {symbol: tuple(found) for symbol, found in waiting.items()}


class _Column:
    """A guide state: the items before a terminal grouped by class, the column's `_Origin`
    (for its items of origin None) and whether `root` is complete. Interned."""

    __slots__ = ("__weakref__", "complete", "origin", "scans")

    def __init__(
        self, items: frozenset[_Item], origin: _Origin, complete: bool, rhs: list[tuple[int, ...]]
    ) -> None:
        self.complete = complete
        self.origin = origin
        by_class: dict[int, list[_Item]] = {}
        for p, d, o in items:
            by_class.setdefault(-rhs[p][d] - 1, []).append((p, d, o))
        self.scans = tuple((c, tuple(found)) for c, found in sorted(by_class.items()))


class EbnfGuide:
    """A GBNF grammar's language, from `root` (see the module docstring)."""

    def __init__(self, text: str) -> None:
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
        self.lhs = [parser.lhs[p] for p in keep]
        self.rhs = [parser.rhs[p] for p in keep]
        self.num_productions = len(keep)
        self._nullable = frozenset(nullable)
        self._productions_of: dict[int, list[int]] = {}
        for p, lhs in enumerate(self.lhs):
            self._productions_of.setdefault(lhs, []).append(p)
        self._starts = [tuple(r[0] for r in ranges) for ranges in parser.classes]
        self._lasts = [tuple(r[1] for r in ranges) for ranges in parser.classes]
        self._lock = threading.Lock()  # the intern table (compiled in a worker thread)
        self._columns: weakref.WeakValueDictionary[
            tuple[frozenset[_Item], _Origin, bool], _Column
        ] = weakref.WeakValueDictionary()
        self._origins: weakref.WeakValueDictionary[frozenset[_Item], _Origin]
        self._origins = weakref.WeakValueDictionary()
        # A vocabulary walk steps from a few recurring columns by the same characters again
        # and again (inside a string): the steps are cached, up to MAX_CACHED_TRANSITIONS
        # (then dropped: the cache keeps its columns alive).
        self._transitions: dict[tuple[_Column, str], _Column | None] = {}
        # Earley steps done so far: a vocabulary walk bounds its own share
        # (guided_vocab.MAX_WALK_WORK), since one walk may step thousands of columns.
        self.work = 0
        start = self._close(None, [(_START_PRODUCTION, 0, None)])
        if start is None:
            raise InvalidRequestError(
                f"guided ebnf_grammar: the start state exceeds {MAX_ITEMS} items "
                f"or {MAX_STEP_WORK} steps"
            )
        self._start = start

    def start(self) -> GuideState:
        return self._start

    def is_complete(self, state: GuideState) -> bool:
        return cast(_Column, state).complete

    def advance(self, state: GuideState, char: str) -> GuideState | None:
        column = cast(_Column, state)
        key = (column, char)
        transitions = self._transitions
        if key in transitions:
            return transitions[key]
        code = ord(char)
        scanned: list[_Item] = []
        for class_id, items in column.scans:
            if self._contains(class_id, code):
                scanned.extend((p, d + 1, column.origin if o is None else o) for p, d, o in items)
        after = self._close(column.origin, scanned) if scanned else None
        if len(transitions) >= MAX_CACHED_TRANSITIONS:
            transitions.clear()
        transitions[key] = after
        return after

    def accepts_any(self, state: GuideState, first: int, last: int) -> bool:
        # The classes' boundaries cut [first, last] into pieces whose characters all scan the
        # same items: one character of each piece stands for it.
        column = cast(_Column, state)
        points = set()
        for class_id, _ in column.scans:
            for lo, hi in zip(self._starts[class_id], self._lasts[class_id], strict=True):
                if lo <= last and hi >= first:
                    points.add(max(lo, first))
                    if hi < last:
                        points.add(hi + 1)
        tried: set[tuple[int, ...]] = set()  # pieces in the same classes step alike: once
        for point in sorted(points):
            if 0xD800 <= point <= 0xDFFF:
                continue
            classes = tuple(c for c, _ in column.scans if self._contains(c, point))
            if classes and classes not in tried:
                tried.add(classes)
                if self.advance(state, chr(point)) is not None:
                    return True
        return False

    def _contains(self, class_id: int, code: int) -> bool:
        i = bisect_right(self._starts[class_id], code) - 1
        return i >= 0 and code <= self._lasts[class_id][i]

    def _close(self, previous: _Origin | None, seeds: list[_Item]) -> _Column | None:
        """The column whose scanned items are `seeds` (scanned from a column whose origin is
        `previous`): predictions and completions (Aycock and Horspool's nullable rule:
        predicting a nullable nonterminal also steps over it). None beyond the bounds."""
        rhs_of, lhs_of, nullable = self.rhs, self.lhs, self._nullable
        seen: set[_Item] = set()
        scans: list[_Item] = []
        waiting: list[_Item] = []
        predicted: set[int] = set()
        completed: set[tuple[int, _Origin]] = set()
        complete = False
        work = seeds
        num_steps = 0
        while work:
            item = work.pop()
            num_steps += 1
            if num_steps > MAX_STEP_WORK:
                self.work += num_steps
                return None
            if item in seen:
                continue
            seen.add(item)
            p, d, origin = item
            rhs = rhs_of[p]
            if d == len(rhs):
                if p == _START_PRODUCTION:
                    complete = True
                elif origin is not None and (lhs_of[p], origin) not in completed:
                    completed.add((lhs_of[p], origin))
                    for q, e, o in origin.waiting.get(lhs_of[p], ()):
                        work.append((q, e + 1, origin if o is None else o))
                continue  # an origin of None completes a nullable one: stepped over already
            symbol = rhs[d]
            if symbol < 0:
                scans.append(item)
                continue
            waiting.append(item)
            if symbol in nullable:
                work.append((p, d + 1, origin))
            if symbol not in predicted:
                predicted.add(symbol)
                work.extend((r, 0, None) for r in self._productions_of.get(symbol, ()))
        # Each step, and each item the new column holds (trimmed and interned below).
        self.work += num_steps + len(scans) + len(waiting)
        if len(scans) + len(waiting) > MAX_ITEMS:
            return None
        if any(
            o is not None and o.depth >= MAX_DEPTH for _, _, o in itertools.chain(scans, waiting)
        ):
            return None  # the new column would be MAX_DEPTH + 1 deep
        with self._lock:
            if previous is not None:
                scans, waiting = self._trim(previous, scans, waiting)
            scan_items, waiting_items = frozenset(scans), frozenset(waiting)
            origin_of_column = self._origins.get(waiting_items)
            if origin_of_column is None:
                origin_of_column = _Origin(waiting_items, rhs_of)
                self._origins[waiting_items] = origin_of_column
            key = (scan_items, origin_of_column, complete)
            column = self._columns.get(key)
            if column is None:
                column = self._columns[key] = _Column(
                    scan_items, origin_of_column, complete, rhs_of
                )
        return column

    def _trim(
        self, previous: _Origin, scans: list[_Item], waiting: list[_Item]
    ) -> tuple[list[_Item], list[_Item]]:
        """The items with `previous` as their origin replaced by the part of it they can
        return to: the items waiting on their rules (and on the rules of those items that
        started there too). Without it the state would remember every waiting item of every
        column behind it (the inside of a finished list element, say) and never recur."""
        lhs_of = self.lhs
        needed = {lhs_of[p] for p, _, o in itertools.chain(scans, waiting) if o is previous}
        stack = list(needed)
        while stack:
            for q, _, o in previous.waiting.get(stack.pop(), ()):
                if o is None and lhs_of[q] not in needed:
                    needed.add(lhs_of[q])
                    stack.append(lhs_of[q])
        kept = frozenset(item for symbol in needed for item in previous.waiting.get(symbol, ()))
        trimmed = self._origins.get(kept)
        if trimmed is None:
            trimmed = self._origins[kept] = _Origin(kept, self.rhs)
        if trimmed is previous:
            return scans, waiting
        return (
            [(p, d, trimmed if o is previous else o) for p, d, o in scans],
            [(p, d, trimmed if o is previous else o) for p, d, o in waiting],
        )
