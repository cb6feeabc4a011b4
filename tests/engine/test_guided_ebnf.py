"""The EBNF guide (`engine.core.guided_ebnf`, no torch): acceptance and prefix acceptance
against oracles (the `regex` module's partial matching for generated regular grammars, a
brute-force recursive matcher for non-regular ones), refusals, bounds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.api import GuidedDecoding, GuideKind
from engine.core.errors import InvalidRequestError
from engine.core.guided import GuideState, compile_guide
from engine.core.guided_ebnf import MAX_DEPTH, MAX_ITEMS, EbnfGuide
from engine.core.guided_vocab import (
    MAX_WALK_WORK,
    GuidedState,
    GuideTooCostlyError,
    TokenMasker,
    VocabTrie,
)


def _run(guide: EbnfGuide, text: str) -> GuideState | None:
    state: GuideState | None = guide.start()
    for char in text:
        assert state is not None
        state = guide.advance(state, char)
        if state is None:
            return None
    return state


# ---- regular grammars, generated, against `regex` ---------------------------------------------

_ATOMS = [('"a"', "a"), ('"ab"', "(?:ab)"), ("[bc]", "[bc]"), ("[^a]", "[^a]"), ('""', "(?:)")]
_ATOMS += [('"\\x63"', "c"), (".", "(?s:.)")]


@st.composite
def _regular(draw: st.DrawFn, depth: int = 0) -> tuple[str, str]:
    """(GBNF expression, the same language as a regex) over the alphabet 'abcd'."""
    kind = draw(st.sampled_from(["atom", "atom", "seq", "alt", "rep"] if depth < 3 else ["atom"]))
    if kind == "atom":
        return draw(st.sampled_from(_ATOMS))
    if kind == "rep":
        gbnf, pattern = draw(_regular(depth + 1))
        op = draw(st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,}", "{2,}"]))
        return f"({gbnf}){op}", f"(?:{pattern}){op}"
    parts = draw(st.lists(_regular(depth + 1), min_size=2, max_size=3))
    joiner = " " if kind == "seq" else " | "
    return (
        "(" + joiner.join(g for g, _ in parts) + ")",
        "(?:" + ("" if kind == "seq" else "|").join(p for _, p in parts) + ")",
    )


@settings(max_examples=60, deadline=None)
@given(_regular(), _regular(), st.lists(st.text(alphabet="abcd", max_size=6), max_size=25))
def test_regular_grammars_agree_with_regex_partial_and_full_matches(
    first: tuple[str, str], second: tuple[str, str], texts: list[str]
) -> None:
    import regex

    # Two rules, one referring to the other, with a comment and a multi-line layout.
    grammar = f"root ::= {first[0]} other  # the start\n  | {first[0]}\nother ::= {second[0]}\n"
    pattern = f"(?:{first[1]})(?:{second[1]})|(?:{first[1]})"
    guide = EbnfGuide(grammar)
    for text in [*texts, "", "a", "ab", "abab", "cc", "d"]:
        state = _run(guide, text)
        partial = regex.fullmatch(pattern, text, partial=True) is not None
        assert (state is not None) == partial, (grammar, text)
        if state is not None:
            full = regex.fullmatch(pattern, text) is not None
            assert guide.is_complete(state) == full, (grammar, text)


# ---- non-regular grammars, against a brute-force matcher --------------------------------------

# Each grammar as GBNF and as plain BNF for the oracle (alternatives of symbols; a symbol
# that is a key is a rule, anything else a literal character). No left recursion or nullable
# cycles in the BNF (the oracle is naive recursion); the GBNF may have them.
_Bnf = dict[str, list[list[str]]]
_NON_REGULAR: list[tuple[str, str, _Bnf]] = [
    (
        "arithmetic",
        """root ::= expr
        expr ::= term (("+" | "-") term)*
        term ::= factor ("*" factor)*
        factor ::= [0-9]+ | "(" expr ")" """,
        {
            "E": [["T", "+", "E"], ["T", "-", "E"], ["T"]],
            "T": [["F", "*", "T"], ["F"]],
            "F": [["N"], ["(", "E", ")"]],
            "N": [["1", "N"], ["2", "N"], ["1"], ["2"]],
        },
    ),
    (
        "arithmetic, left recursive",
        """root ::= expr
        expr ::= expr "+" term | expr "-" term | term
        term ::= term "*" factor | factor
        factor ::= num | "(" expr ")"
        num ::= num [0-9] | [0-9]""",
        {
            "E": [["T", "+", "E"], ["T", "-", "E"], ["T"]],
            "T": [["F", "*", "T"], ["F"]],
            "F": [["N"], ["(", "E", ")"]],
            "N": [["1", "N"], ["2", "N"], ["1"], ["2"]],
        },
    ),
    (
        "balanced",
        'root ::= ( "(" root ")" | "[" root "]" )*',
        {"E": [["(", "E", ")", "E"], ["[", "E", "]", "E"], []]},
    ),
    (
        "palindromes",
        'root ::= "a" root "a" | "b" root "b" | "a" | "b" | ""',
        {"E": [["a", "E", "a"], ["b", "E", "b"], ["a"], ["b"], []]},
    ),
    (
        "a^n b^n c*, nullable rules",
        'root ::= ab c\nab ::= "a" ab "b" | empty\nempty ::= ""\nc ::= c "c" | ',
        {"E": [["A", "C"]], "A": [["a", "A", "b"], []], "C": [["c", "C"], []]},
    ),
]


def _oracle(bnf: _Bnf, text: str) -> tuple[bool, bool]:
    """(text is a prefix of the language, text is in it): every way of matching from the start
    symbol; reaching a literal at the end of the text means the text is a prefix."""
    start = next(iter(bnf))
    prefix = False

    def ends(symbols: tuple[str, ...], pos: int) -> Iterator[int]:
        nonlocal prefix
        if not symbols:
            yield pos
            return
        head, rest = symbols[0], symbols[1:]
        if head in bnf:
            for alternative in bnf[head]:
                for mid in set(ends(tuple(alternative), pos)):
                    yield from ends(rest, mid)
        elif pos == len(text):
            prefix = True
        elif text[pos] == head:
            yield from ends(rest, pos + 1)

    full = len(text) in set(ends((start,), 0))
    return prefix or full, full


def _alphabet(bnf: _Bnf) -> str:
    return "".join(sorted({s for alts in bnf.values() for a in alts for s in a if s not in bnf}))


@pytest.mark.parametrize(
    ("grammar", "bnf"), [g[1:] for g in _NON_REGULAR], ids=[g[0] for g in _NON_REGULAR]
)
def test_non_regular_grammars_agree_with_a_brute_force_matcher(grammar: str, bnf: _Bnf) -> None:
    """Every text up to 7 characters (5 over larger alphabets) whose prefixes the oracle
    accepts, and every one-character extension of each (the refused ones included)."""
    guide = EbnfGuide(grammar)
    alphabet = _alphabet(bnf) + "x"
    frontier = [("", guide.start())]
    num_checked = 0
    for _ in range(7 if len(alphabet) <= 5 else 5):
        extended = []
        for text, state in frontier:
            for char in alphabet:
                after = guide.advance(state, char)
                prefix, full = _oracle(bnf, text + char)
                assert (after is not None) == prefix, text + char
                num_checked += 1
                if after is not None:
                    assert guide.is_complete(after) == full, text + char
                    extended.append((text + char, after))
        frontier = extended
    assert num_checked > 100


def test_states_recur_so_masks_are_memoised() -> None:
    guide = EbnfGuide('root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+ | "(" item ")"')
    # From the second element of a repetition on, the columns recur.
    assert _run(guide, "[ab,cd") is _run(guide, "[xyz,qr")
    assert _run(guide, "[ab,cd,ef") is _run(guide, "[ab,cd,ef,gh,ij") is _run(guide, "[a,bc,de")
    assert _run(guide, "[ab,(cd") is _run(guide, "[xyz,(qr")
    assert _run(guide, "[ab,((cd") is not _run(guide, "[ab,(cd")  # the nesting is the state


def test_accepts_any_agrees_with_advance() -> None:
    guide = EbnfGuide('root ::= ([à-ÿ] | "日本" | [^\\x00-\\U0001F5FF] "x" | "é")+')
    for text in ["", "à", "日", "\U0001f600"]:
        state = _run(guide, text)
        assert state is not None
        for first, last in [(0x80, 0xBF), (0xE0, 0xFF), (0x65E5, 0x65E5), (0x65E6, 0xFFFF),
                            (0x10000, 0x10FFFF), (0x100, 0x65E4)]:  # fmt: skip
            expected = any(
                guide.advance(state, chr(c)) is not None
                for c in range(first, min(last, first + 70000) + 1)
                if not 0xD800 <= c <= 0xDFFF
            )
            assert guide.accepts_any(state, first, last) == expected, (text, first, last)


def test_the_dialect() -> None:
    grammar = r"""
    # a comment line
    root   ::= greeting ws list? "\n"   # a trailing comment
    greeting ::= "h\x69" | "\u00e9t\U0001F600" | [\[\]\-^]{2} | "\"\\\t"
    list ::= "[" [a-c-]{1,2} ("," [^\x00-\x2f\]]{2,})* "]"
    ws ::= [ \t]*
    """
    guide = EbnfGuide(grammar)
    for text, full in [
        ("hi\n", True),
        ("ét\U0001f600 \t[a-,zz,ééé]\n", True),
        ("[]\n", True),
        ("^-\n", True),
        ('"\\\t\n', True),
        ("hi [a]", False),
        ("hi[ab,z]\n", None),
        ("hi [abc]", None),
        ("hi [a,]", None),
    ]:
        state = _run(guide, text)
        if full is None:
            assert state is None, text
        else:
            assert state is not None and guide.is_complete(state) == full, text


def test_space_may_come_between_a_term_and_its_quantifier() -> None:
    # llama.cpp's parser skips space after every term, so grammars written for it do this.
    guide = EbnfGuide('root ::= "a" *  ("b" | "c") +\n  [0-9] {2}  # two digits\n')
    for text, full in [("bc12", True), ("aab12", True), ("ab1", False), ("a1", None)]:
        state = _run(guide, text)
        if full is None:
            assert state is None, text
        else:
            assert state is not None and guide.is_complete(state) == full, text


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        ("", "no rule named 'root'"),
        ('item ::= "a"', "no rule named 'root'"),
        ('root ::= item\nitem ::= "a" other', "undefined rule 'other' at line 2, column 14"),
        ('root ::= "a"\nroot ::= "b"', "defined twice at line 2, column 1"),
        ('root ::= "a', "unterminated string at line 1, column 10"),
        ("root ::= [a-", "unterminated class"),
        ("root ::= []", "empty class"),
        ("root ::= [z-a]", "out of order"),
        ('root ::= "\\q"', "unknown escape \\q"),
        ('root ::= "\\x4"', "\\x needs 2 hex digits"),
        ('root ::= "\\U00110000"', "above U+10FFFF"),
        ('root ::= ("a"', "expected ')'"),
        ('root ::= "a" )', "expected a rule name"),
        ("root = 'a'", "expected '::='"),
        ("root ::= 'a'", 'unexpected "\'"'),
        ('root ::= "a"{2,1}', "n < m"),
        ('root ::= "a"{x}', "malformed count"),
        ('root ::= "a"{1001}', "a count above 1000"),
        ('root ::= "a" root', "'root' matches no text"),
        ("root ::= [^\\x00-\\U0010FFFF]", "'root' matches no text"),
        ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "groups nest deeper than 64"),
        ('root ::= "a"{1000} "b"{1000}' + ' "c"{1000}' * 60, "too large"),
        ("root ::= " + '"a" ' * 100_000, "over 100000 characters"),
    ],
)
@pytest.mark.timeout(30)  # a bound on a blow-up (60,000 repeats), not a timing check
def test_refusals_name_the_problem_and_its_place(grammar: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match="guided ebnf_grammar") as info:
        compile_guide(GuidedDecoding(GuideKind.EBNF_GRAMMAR, grammar))
    assert needle in str(info.value), str(info.value)


def test_unproductive_alternatives_are_dropped_not_refused() -> None:
    # `loop` derives no text: root's first alternative can never finish, so "l" is refused.
    guide = EbnfGuide('root ::= "l" loop | "ok"\nloop ::= "x" loop')
    assert _run(guide, "l") is None
    ok = _run(guide, "ok")
    assert ok is not None and guide.is_complete(ok)


def test_nesting_beyond_the_depth_bound_is_refused() -> None:
    guide = EbnfGuide('root ::= "(" root ")" | "x"')
    deep = _run(guide, "(" * MAX_DEPTH)
    assert deep is not None
    assert guide.advance(deep, "(") is None
    text = "(" * MAX_DEPTH + "x" + ")" * MAX_DEPTH
    state = _run(guide, text)
    assert state is not None and guide.is_complete(state)


def test_a_state_beyond_the_item_bound_is_refused_and_each_step_is_bounded() -> None:
    def wide(num_rules: int) -> EbnfGuide:
        # After "a" each of the rules is predicted: 2 * num_rules + 1 items.
        text = 'root ::= "a" any\nany ::= ' + " | ".join(f"r{i}" for i in range(num_rules))
        text += "".join(f'\nr{i} ::= "{chr(0x100 + i)}"' for i in range(num_rules))
        return EbnfGuide(text)

    guide = wide(MAX_ITEMS // 2 + 100)
    assert guide.advance(guide.start(), "a") is None  # refused at the bound, not built whole
    narrow = wide(MAX_ITEMS // 2 - 100)
    assert narrow.advance(narrow.start(), "a") is not None
    with pytest.raises(InvalidRequestError, match="the start state exceeds"):
        EbnfGuide(
            "root ::= any\nany ::= " + " | ".join(f'"{chr(0x100 + i)}"' for i in range(MAX_ITEMS))
        )


def test_a_vocabulary_walk_is_bounded_in_work_not_only_each_step() -> None:
    """Each character's step is bounded, but a mask steps once per trie node: a grammar whose
    states never recur (nested palindromes of 60 letters) would make one token's mask take
    seconds on a large vocabulary. The walk stops at MAX_WALK_WORK and says why; a JSON
    string's mask on the same vocabulary stays far below it."""
    printable = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\[]']
    vocabulary: list[bytes | None] = [
        (a + b).encode() for a in printable for b in printable
    ]  # 8,100 two-character tokens
    trie = VocabTrie(vocabulary)
    alternatives = " | ".join(f'"{c}" root "{c}"' for c in printable[:60])
    costly = EbnfGuide(f'root ::= {alternatives} | ""')
    state = costly.start()
    for char in printable[:2]:
        state = costly.advance(state, char)
    with pytest.raises(GuideTooCostlyError, match="more than 100000 steps"):
        TokenMasker(costly, trie, vocabulary).allowed(GuidedState(state))

    json_string = EbnfGuide('root ::= "\\"" [^"\\\\]* "\\""')
    state = json_string.advance(json_string.start(), '"')
    before = json_string.work
    allowed, complete = TokenMasker(json_string, trie, vocabulary).allowed(GuidedState(state))
    assert len(allowed) > 7000 and not complete
    assert json_string.work - before < MAX_WALK_WORK // 10
