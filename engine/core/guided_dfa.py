"""A regex compiled to a deterministic finite automaton over characters (`compile_dfa`).

The syntax tree (`engine.core.guided_regex`) becomes a Thompson NFA, then a DFA by subset
construction, built whole before the request is accepted. Its language is the pattern's full
matches: a DFA state is live when some accepting state is reachable from it, moves into dead
states are dropped, so a move exists exactly when the text so far plus that character can still
be extended to a full match (what `regex.fullmatch(..., partial=True)` says), and a state is
accepting exactly when the text is a full match.

The alphabet is cut into atoms: code points that belong to exactly the same character sets of
the pattern (so every set is a union of atoms, and two characters of one atom move alike; `\\w`
is one atom, not its 800 intervals). A move is one table lookup (ASCII) or one bisection over
the sets' interval boundaries (the rest) to find the atom, then a dict lookup.

Anchors, kept exact: an NFA item is a state and a condition on the rest of the text: FREE, AT_END
(nothing may follow: after `\\Z`, or `$` at the end) or NEWLINE_END (exactly one `\\n` follows:
`$` before a final newline). `^` and `\\A` hold only in the start state's closure.

Bounds, so that a request can never hang the engine: at most `MAX_DFA_STATES` DFA states,
`MAX_NFA_STATES` NFA states, and `MAX_BUILD_STEPS` steps of the construction (an NFA item
reached in a closure or moved on an atom); beyond
any of them the pattern is refused (InvalidRequestError) before anything runs. Within them a
compilation takes well under a second on one core (docs/engine.md has the figures).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.errors import InvalidRequestError
from engine.core.guided_regex import (
    Alternation,
    Anchor,
    Assertion,
    Chars,
    CharSet,
    Concat,
    Node,
    Repeat,
)

MAX_DFA_STATES = 10_000
MAX_NFA_STATES = 200_000
MAX_BUILD_STEPS = 1_000_000

# An NFA item is `state << 2 | condition`.
_FREE, _AT_END, _NEWLINE_END = 0, 1, 2
_NEWLINE = ord("\n")
_END_OF_CODE_POINTS = 0x110000


@dataclass(frozen=True, slots=True)
class Dfa:
    """States are ints from 0 (the start); `moves[state]` maps an atom to the next live state."""

    moves: tuple[dict[int, int], ...]
    accepting: tuple[bool, ...]
    interval_starts: tuple[int, ...]  # the alphabet cut where any character set starts or stops
    interval_atoms: tuple[int, ...]  # the atom of each interval
    ascii_atoms: tuple[int, ...]  # the atom of each ASCII code point

    @property
    def num_states(self) -> int:
        return len(self.moves)

    def step(self, state: int, char: str) -> int | None:
        """The state after `char`, or None when no full match starts with the text so far."""
        point = ord(char)
        if point < 128:
            atom = self.ascii_atoms[point]
        else:
            atom = self.interval_atoms[bisect_right(self.interval_starts, point) - 1]
        return self.moves[state].get(atom)

    def accepts_any(self, state: int, first: int, last: int) -> bool:
        """Whether some code point in [first, last] has a move from `state`."""
        starts, moves = self.interval_starts, self.moves[state]
        low = bisect_right(starts, first) - 1
        high = bisect_right(starts, last)
        return any(atom in moves for atom in self.interval_atoms[low:high])


def compile_dfa(node: Node) -> Dfa:
    """The DFA of `node`'s full matches (InvalidRequestError past a bound, or when it matches
    no string)."""
    nfa = _Nfa()
    start, nfa.final = nfa.emit(node)
    atoms = _Atoms(nfa.sets)
    return _Subsets(nfa, atoms).build(start)


class _Nfa:
    """Thompson's construction: each state has one character move or epsilon moves (some
    guarded by an anchor); one final state."""

    def __init__(self) -> None:
        self.moves: list[tuple[int, int] | None] = []  # (character set id, next state)
        self.epsilons: list[list[tuple[Anchor | None, int]]] = []
        self.sets: list[CharSet] = []
        self._set_ids: dict[CharSet, int] = {}
        self.final = 0

    def _state(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise InvalidRequestError(
                f"the pattern is too large (its NFA would exceed {MAX_NFA_STATES} states)"
            )
        self.moves.append(None)
        self.epsilons.append([])
        return len(self.moves) - 1

    def _link(self, source: int, target: int, anchor: Anchor | None = None) -> None:
        self.epsilons[source].append((anchor, target))

    def emit(self, node: Node) -> tuple[int, int]:
        """(entry, exit) of a fresh fragment for `node`."""
        if isinstance(node, Chars):
            entry, exit_ = self._state(), self._state()
            set_id = self._set_ids.setdefault(node.chars, len(self.sets))
            if set_id == len(self.sets):
                self.sets.append(node.chars)
            self.moves[entry] = (set_id, exit_)
            return entry, exit_
        if isinstance(node, Assertion):
            entry, exit_ = self._state(), self._state()
            self._link(entry, exit_, node.anchor)
            return entry, exit_
        if isinstance(node, Alternation):
            entry, exit_ = self._state(), self._state()
            for option in node.options:
                first, last = self.emit(option)
                self._link(entry, first)
                self._link(last, exit_)
            return entry, exit_
        entry = exit_ = self._state()
        if isinstance(node, Concat):
            for item in node.items:
                first, last = self.emit(item)
                self._link(exit_, first)
                exit_ = last
            return entry, exit_
        return entry, self._repeat(node, exit_)

    def _repeat(self, node: Repeat, exit_: int) -> int:
        for _ in range(node.low):
            first, last = self.emit(node.item)
            self._link(exit_, first)
            exit_ = last
        done = self._state()
        if node.high is None:  # exit_ -> loop; loop -> item -> loop; loop -> done
            first, last = self.emit(node.item)
            self._link(exit_, first)
            self._link(last, exit_)
        else:  # each optional copy may be skipped to `done`
            for _ in range(node.high - node.low):
                self._link(exit_, done)
                first, last = self.emit(node.item)
                self._link(exit_, first)
                exit_ = last
        self._link(exit_, done)
        return done


class _Atoms:
    """The alphabet cut into atoms: code points in exactly the same character sets of the
    pattern share an atom (so `\\w`'s 800 intervals are one atom). `\\n` is always an atom
    of its own (`$` treats it apart)."""

    def __init__(self, sets: list[CharSet]) -> None:
        bounds = {0, _NEWLINE, _NEWLINE + 1}
        for chars in sets:
            for start, stop in chars:
                bounds.update((start, stop))
        bounds.discard(_END_OF_CODE_POINTS)
        self.starts = tuple(sorted(bounds))  # the elementary intervals
        index = {start: i for i, start in enumerate(self.starts)}
        index[_END_OF_CODE_POINTS] = len(self.starts)
        members: list[list[int]] = [[] for _ in self.starts]  # the sets of each interval
        for set_id, chars in enumerate(sets):
            for start, stop in chars:
                for interval in range(index[start], index[stop]):
                    members[interval].append(set_id)
        # An atom per distinct membership; the flag keeps "\n" apart.
        atom_of: dict[tuple[bool, tuple[int, ...]], int] = {}
        self.of_interval = tuple(
            atom_of.setdefault((i == index[_NEWLINE], tuple(m)), len(atom_of))
            for i, m in enumerate(members)
        )
        self.of_set = [
            tuple(
                sorted({self.of_interval[i] for a, b in chars for i in range(index[a], index[b])})
            )
            for chars in sets
        ]
        self.newline = self.of_interval[index[_NEWLINE]]
        self.has_newline = [self.newline in atoms for atoms in self.of_set]
        self.ascii = tuple(self.of_interval[bisect_right(self.starts, p) - 1] for p in range(128))


class _Subsets:
    """Subset construction. A DFA state is the frozen set of NFA items that can still move
    (FREE or NEWLINE_END items of states with a character move) and whether it accepts."""

    def __init__(self, nfa: _Nfa, atoms: _Atoms) -> None:
        self.nfa = nfa
        self.atoms = atoms
        self.num_steps = 0

    def build(self, start: int) -> Dfa:
        ids: dict[tuple[frozenset[int], bool], int] = {}
        kernels: list[frozenset[int]] = []
        accepting: list[bool] = []
        moves: list[dict[int, int]] = []

        def state_of(key: tuple[frozenset[int], bool]) -> int:
            found = ids.get(key)
            if found is None:
                if len(kernels) >= MAX_DFA_STATES:
                    raise InvalidRequestError(
                        f"the pattern's automaton has too many states (more than {MAX_DFA_STATES})"
                    )
                found = ids[key] = len(kernels)
                kernels.append(key[0])
                accepting.append(key[1])
            return found

        state_of(self._closure([start << 2 | _FREE], at_start=True))
        by_target: dict[frozenset[int], int] = {}  # the state each set of moved items closes to
        while len(moves) < len(kernels):
            targets = self._targets(kernels[len(moves)])
            moves.append({})
            for atom, items in targets.items():
                key = frozenset(items)
                following = by_target.get(key)
                if following is None:
                    following = by_target[key] = state_of(self._closure(key, at_start=False))
                moves[-1][atom] = following
        return _prune(moves, accepting, self.atoms)

    def _count(self, num_steps: int) -> None:
        self.num_steps += num_steps
        if self.num_steps > MAX_BUILD_STEPS:
            raise InvalidRequestError(
                f"the pattern is too complex (building its automaton takes more than "
                f"{MAX_BUILD_STEPS} steps)"
            )

    def _targets(self, kernel: frozenset[int]) -> dict[int, set[int]]:
        """For each atom, the NFA items after it from `kernel`."""
        atoms, nfa_moves = self.atoms, self.nfa.moves
        targets: dict[int, set[int]] = {}
        for item in kernel:
            move = nfa_moves[item >> 2]
            assert move is not None  # a kernel holds only items with a move
            set_id, following = move
            if item & 3 == _FREE:
                self._count(len(atoms.of_set[set_id]))
                for atom in atoms.of_set[set_id]:
                    targets.setdefault(atom, set()).add(following << 2 | _FREE)
            elif atoms.has_newline[set_id]:  # NEWLINE_END: only "\n", then the end
                targets.setdefault(atoms.newline, set()).add(following << 2 | _AT_END)
        return targets

    def _closure(self, seeds: Iterable[int], at_start: bool) -> tuple[frozenset[int], bool]:
        epsilons = self.nfa.epsilons
        seen = set(seeds)
        stack = list(seen)
        while stack:
            item = stack.pop()
            condition = item & 3
            for anchor, target in epsilons[item >> 2]:
                for after in _after_anchor(anchor, condition, at_start):
                    following = target << 2 | after
                    if following not in seen:
                        seen.add(following)
                        stack.append(following)
        self._count(len(seen))
        nfa_moves, final = self.nfa.moves, self.nfa.final
        kernel = frozenset(i for i in seen if nfa_moves[i >> 2] is not None and i & 3 != _AT_END)
        return kernel, (final << 2 | _FREE) in seen or (final << 2 | _AT_END) in seen


def _after_anchor(anchor: Anchor | None, condition: int, at_start: bool) -> tuple[int, ...]:
    """The conditions an epsilon move guarded by `anchor` leads to from `condition`."""
    if anchor is None:
        return (condition,)
    if anchor is Anchor.START:
        return (condition,) if at_start else ()
    if anchor is Anchor.END:
        return () if condition == _NEWLINE_END else (_AT_END,)
    # `$`: at the end, or before a final newline
    return (_AT_END, _NEWLINE_END) if condition == _FREE else (condition,)


def _prune(moves: list[dict[int, int]], accepting: list[bool], atoms: _Atoms) -> Dfa:
    """Drop moves into states from which no accepting state is reachable."""
    sources: list[list[int]] = [[] for _ in moves]
    for state, table in enumerate(moves):
        for following in table.values():
            sources[following].append(state)
    live = {state for state, accepts in enumerate(accepting) if accepts}
    stack = list(live)
    while stack:
        for source in sources[stack.pop()]:
            if source not in live:
                live.add(source)
                stack.append(source)
    if 0 not in live:
        raise InvalidRequestError("the pattern matches no string")
    pruned = tuple({a: s for a, s in table.items() if s in live} for table in moves)
    return Dfa(pruned, tuple(accepting), atoms.starts, atoms.of_interval, atoms.ascii)
