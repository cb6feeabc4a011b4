"""EBNF grammars (the GBNF dialect of llama.cpp, vLLM and xgrammar) as a guide: an Earley
recognizer over characters whose state is one Earley column.

The grammar's dialect and its compilation to plain BNF are `engine.core.guided_ebnf_grammar`'s.
Its rules that derive no text are dropped there, so every Earley item can still complete: a
column with an item is a viable prefix (and the guide never offers a dead end but at the bounds
below).

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

Bounds, so that no request can hang the engine: the grammar's own (`guided_ebnf_grammar`), and
at run time a character whose column would hold more than `MAX_ITEMS` items, need more than
`MAX_STEP_WORK` Earley steps or nest deeper than `MAX_DEPTH` origins is refused (the language
is cut there: a text may then reach a point where no token is allowed, which ends the request
with the guided-decoding error).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from bisect import bisect_right
from typing import cast

from engine.core.errors import InvalidRequestError
from engine.core.guided import GuideState
from engine.core.guided_ebnf_grammar import parse_grammar

MAX_ITEMS = 1000
MAX_STEP_WORK = 10_000
MAX_DEPTH = 128
MAX_CACHED_TRANSITIONS = 65536

_START_PRODUCTION = 0  # S' ::= root; nonterminal 0

# An item: (production, dot, origin). Symbols as in `Grammar`.
_Item = tuple[int, int, "_Origin | None"]


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
        grammar = parse_grammar(text)
        self.lhs = grammar.lhs
        self.rhs = grammar.rhs
        self.num_productions = len(grammar.lhs)
        self._nullable = grammar.nullable
        self._productions_of: dict[int, list[int]] = {}
        for p, lhs in enumerate(self.lhs):
            self._productions_of.setdefault(lhs, []).append(p)
        self._starts = [tuple(r[0] for r in ranges) for ranges in grammar.classes]
        self._lasts = [tuple(r[1] for r in ranges) for ranges in grammar.classes]
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
