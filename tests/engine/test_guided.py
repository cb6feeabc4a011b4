"""Guides and token masks against naive models (no torch): the JSON prefix parser against
"some completion parses", the schema subset's regex, and the trie walk against every token
tried one at a time."""

from __future__ import annotations

import itertools
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.core.api import GuidedDecoding, GuideKind
from engine.core.errors import InvalidRequestError
from engine.core.guided import ChoiceGuide, Guide, GuideState, RegexGuide, compile_guide
from engine.core.guided_dfa import MAX_DFA_STATES
from engine.core.guided_ebnf import EbnfGuide
from engine.core.guided_json import JsonObjectGuide, schema_to_regex
from engine.core.guided_regex import MAX_CHAR_SETS
from engine.core.guided_vocab import GuidedState, TokenMasker, VocabTrie, token_bytes
from engine.torch_runner.builtin_model import build_tokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
BOUNDED = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(guide: Guide, text: str) -> GuideState | None:
    state: GuideState | None = guide.start()
    for char in text:
        if state is None:
            return None
        state = guide.advance(state, char)
    return state


# ---------------------------------------------------------------- JSON object: naive model

# Short strings over a small alphabet, and every completion of up to five characters that a
# prefix of at most five of them can need (close a string, a value, a container).
_ALPHABET = '{}[]":,01-.e'
_COMPLETIONS = ["".join(c) for n in range(6) for c in itertools.product('"0:}]', repeat=n)]


@cache
def _step(masker: TokenMasker, state: GuidedState, token: int) -> GuidedState:
    """The state after `token`, which the test knows the guide allows there."""
    after = masker.advance(state, token)
    assert after is not None, f"token {token} refused after {state}"
    return after


def _some_completion_is_an_object(prefix: str) -> bool:
    for rest in _COMPLETIONS:
        try:
            if isinstance(json.loads(prefix + rest), dict):
                return True
        except json.JSONDecodeError:
            continue
    return False


@BOUNDED
@given(st.text(alphabet=_ALPHABET, max_size=5))
def test_json_prefix_parser_agrees_with_some_completion_parses(text: str) -> None:
    if not text or text[0] != "{":  # mostly objects (the completions never open one)
        text = "{" + text[1:]
    guide = JsonObjectGuide()
    state = _run(guide, text)
    assert (state is not None) == _some_completion_is_an_object(text), text
    if state is not None:
        try:
            complete = isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            complete = False
        assert guide.is_complete(state) == complete, text


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@BOUNDED
@given(st.dictionaries(st.text(max_size=3), _JSON, max_size=4), st.booleans(), st.booleans())
def test_every_prefix_of_an_object_is_accepted(
    value: dict[str, Any], spaced: bool, ascii_only: bool
) -> None:
    separators = (", ", ": ") if spaced else (",", ":")
    text = json.dumps(value, separators=separators, ensure_ascii=ascii_only)
    guide = JsonObjectGuide()
    state = guide.start()
    for i, char in enumerate(text):
        assert not guide.is_complete(state)
        state = guide.advance(state, char)
        assert state is not None, (text, i)
    assert guide.is_complete(state)
    assert guide.advance(state, " ") is None and guide.advance(state, "{") is None


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"a": true, "b": [null, false]}', True),
        ('{"a":  1}', False),  # two spaces: the whitespace policy
        ('{\n"a": 1}', False),
        (' {"a": 1}', False),
        ('{"a": tru', True),
        ('{"a": trux', False),
        ('{"a": "\\u00e9\\n"}', True),
        ('{"a": "\\x"}', False),
        ('{"a": "\x01"}', False),
        ('{"a": 01}', False),
        ('{"a": -0.5e+3}', True),
        ("[1]", False),
    ],
)
def test_json_object_examples(text: str, ok: bool) -> None:
    assert (_run(JsonObjectGuide(), text) is not None) == ok


# ---------------------------------------------------------------- regex, choice, schema


def test_regex_and_choice_guides() -> None:
    guide = RegexGuide("[0-9]{3}-[a-z]+")
    assert _run(guide, "12") is not None and _run(guide, "12a") is None
    assert not guide.is_complete(_run(guide, "123-"))
    assert guide.is_complete(_run(guide, "123-ab"))
    choice = ChoiceGuide(("apple", "apricot", "b"))
    assert _run(choice, "ap") is not None and _run(choice, "apx") is None
    assert choice.is_complete(_run(choice, "b")) and not choice.is_complete(_run(choice, "ap"))
    with pytest.raises(InvalidRequestError, match="invalid pattern"):
        RegexGuide("(")
    with pytest.raises(InvalidRequestError, match="empty"):
        ChoiceGuide(())


SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": "array", "items": {"enum": ["x", 1, None]}, "minItems": 1, "maxItems": 2},
        "c": {"type": "object", "properties": {"d": {"type": ["string", "null"]}}},
        "e": {"const": "k"},
    },
    "required": ["a", "e"],
}


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ({"a": 1, "e": "k"}, True),
        ({"a": -12, "b": ["x", None], "c": {"d": "é"}, "e": "k"}, True),
        ({"a": 1, "c": {}, "e": "k"}, True),
        ({"e": "k", "a": 1}, False),  # schema order
        ({"a": 1}, False),  # e is required
        ({"a": 1.5, "e": "k"}, False),
        ({"a": 1, "b": [], "e": "k"}, False),  # minItems
        ({"a": 1, "b": ["x", 1, 1], "e": "k"}, False),  # maxItems
        ({"a": 1, "e": "k", "z": 1}, False),  # no additional properties
    ],
)
def test_schema_regex_accepts_exactly_the_schema(value: dict[str, Any], ok: bool) -> None:
    pattern = schema_to_regex(json.dumps(SCHEMA))
    for separators in ((",", ":"), (", ", ": ")):
        text = json.dumps(value, separators=separators, ensure_ascii=False)
        assert (re.fullmatch(pattern, text) is not None) == ok, text


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "string", "format": "date"}, "'format'"),
        ({"type": "object", "additionalProperties": True}, "additionalProperties"),
        ({"$ref": "#/x"}, "'$ref'"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "'anyOf'"),
        ({"type": "object", "properties": {"a": {}}, "required": [["a"]]}, "malformed"),
        ({"enum": ["a", float("nan")]}, "NaN or Infinity"),  # json.dumps writes NaN
        ({"const": float("inf")}, "NaN or Infinity"),
        ({"type": "integer", "enum": ["a", "b"]}, "no value of the enum"),
        ({"type": "integer", "minimum": 0}, "'minimum'"),
        ({"type": "array"}, "without items"),
        ({"enum": []}, "empty"),
        ({"type": "object", "properties": {}, "required": ["q"]}, "not in properties"),
        ({"enum": [[1], {"a": 0}], "const": [True]}, "no value of the enum"),
        (  # the pattern grows as n^2: 30 optional properties fit the state bound, 60 do not
            {"type": "object", "properties": {str(i): {"type": "null"} for i in range(60)}},
            "too many",
        ),
    ],
)
def test_schema_refusals_name_the_keyword(schema: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        compile_guide(GuidedDecoding(GuideKind.JSON_SCHEMA, json.dumps(schema)))


@pytest.mark.parametrize(
    ("schema", "texts"),
    [  # every keyword of a schema holds at once: an enum's values outside its type are not
        ({"type": "string", "enum": ["a", 1, None]}, ['"a"']),
        ({"type": ["integer", "null"], "enum": ["a", 1, 2.5, None, True]}, ["1", "null"]),
        ({"enum": [1, 2, 3], "const": 2}, ["2"]),
        ({"enum": [2.0, True], "const": 2}, ["2.0"]),
        # A boolean is no number inside an array or object either: [true] is not [1].
        ({"enum": [[1], [True]], "const": [True]}, ["[true]"]),
        ({"enum": [{"a": 1}, {"a": True}], "const": {"a": 1}}, ['{"a": 1}']),
    ],
)
def test_an_enum_keeps_only_the_values_its_type_and_const_allow(
    schema: dict[str, Any], texts: list[str]
) -> None:
    pattern = schema_to_regex(json.dumps(schema))
    candidates = ['"a"', "1", "2", "2.0", "3", "2.5", "null", "true"]
    candidates += ["[1]", "[true]", '{"a": 1}', '{"a": true}']
    assert [t for t in candidates if re.fullmatch(pattern, t)] == texts


def _nested(outer: str, inner: str, depth: int) -> str:
    """`outer` (with one `{}` where the next level goes) `depth` times around `inner`."""
    before, after = outer.split("{}")
    return before * depth + inner + after * depth


@pytest.mark.parametrize(
    ("schema_json", "needle"),
    [
        # Each array level writes its item twice: the pattern doubles per level, so it is
        # bounded as it is built (40 levels would be 2^40 times the item).
        (_nested('{"type": "array", "items": {}}', '{"type": "null"}', 40), "is too large"),
        (_nested('{"type": "array", "items": {}}', '{"type": "null"}', 19), "is too large"),
        (
            _nested('{"type": "object", "properties": {"a": {}}, "required": ["a"]}', "{}", 350),
            "nests too deeply",
        ),
    ],
)
@pytest.mark.timeout(30)  # a bound on a blow-up (2^40 items), not a timing check
def test_large_and_deep_schemas_are_refused_quickly(schema_json: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        schema_to_regex(schema_json)


@pytest.mark.parametrize(
    ("schema", "empty"),
    [
        ({"type": "object"}, "{}"),
        ({"type": "object", "properties": {"a": {"type": "null"}}}, "{}"),
        ({"type": "array", "items": {"type": "null"}}, "[]"),
    ],
)
def test_an_empty_container_holds_at_most_one_space(schema: dict[str, Any], empty: str) -> None:
    pattern = schema_to_regex(json.dumps(schema))
    assert re.fullmatch(pattern, empty) and re.fullmatch(pattern, f"{empty[0]} {empty[1]}")
    assert not re.fullmatch(pattern, f"{empty[0]}  {empty[1]}")


# ---------------------------------------------------------------- regex -> DFA

# Patterns over the alphabet below, covering each construct the DFA compiles.
DFA_PATTERNS = [
    r"[0-9]{3}-[a-z]+",
    r"a|b*c",
    r"(ab|a)*b?",
    r"(?:x|y){2,4}z?",
    r"a{,3}b{2,}",
    r"(a|)*c",
    r"(?P<word>\w+)\s(?<n>\d{1,2})",
    r"[^\"\\]*x",
    r"[]a-c]+|[^]\n]",
    r"\d+\.\w*",
    r"é+|[à-ÿ]{2}",
    r"\x41\u00e9\101\0?\.",
    r".*a.{2}",
    r"[[:alpha:]][[:digit:]]*",
    r"\p{L}\S\P{Nd}",
    r"a{}b",
    r"(?#comment)ab",
    r"^a$|\Ab\Z|c\z",
    r"a$\n?",
    r"^$\n",
    r"(?:a|b$)+\n",
    r"\{\"a\": [0-9]+\}",
]
_DFA_ALPHABET = 'abcxyz019-. \n"\\\\AéàÿZ{}]'


@pytest.mark.parametrize("pattern", DFA_PATTERNS)
def test_dfa_agrees_with_regex_partial_and_full_matches(pattern: str) -> None:
    import regex

    guide = RegexGuide(pattern)

    @settings(max_examples=150, deadline=None)
    @given(st.text(alphabet=_DFA_ALPHABET, max_size=7))
    def check(text: str) -> None:
        state = _run(guide, text)
        partial = regex.fullmatch(pattern, text, partial=True) is not None
        assert (state is not None) == partial, text
        if state is not None:
            assert guide.is_complete(state) == (regex.fullmatch(pattern, text) is not None), text

    check()


def test_lazy_quantifiers_have_the_greedy_language() -> None:
    """Under a full match laziness does not change the language. (`regex`'s partial matching
    gets lazy quantifiers wrong: it says "a0" can still match `a*?b`.)"""
    import regex

    lazy, greedy = RegexGuide(r"a*?b+?c??"), regex.compile(r"a*b+c?")
    assert _run(lazy, "a0") is None

    @settings(max_examples=200, deadline=None)
    @given(st.text(alphabet="abc0", max_size=7))
    def check(text: str) -> None:
        state = _run(lazy, text)
        full = greedy.fullmatch(text) is not None
        assert (state is not None and lazy.is_complete(state)) == full, text
        assert (state is not None) == (greedy.fullmatch(text, partial=True) is not None), text

    check()


@BOUNDED
@given(
    st.dictionaries(st.sampled_from("abcez"), _JSON, max_size=5),
    st.booleans(),
    st.integers(min_value=0, max_value=40),
)
def test_schema_regex_through_the_dfa_agrees_with_regex(
    value: dict[str, Any], spaced: bool, cut: int
) -> None:
    """Schema-shaped texts, whole and cut: the DFA against `regex` (full and partial)."""
    import regex

    pattern = schema_to_regex(json.dumps(SCHEMA))
    guide = compile_guide(GuidedDecoding(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    separators = (", ", ": ") if spaced else (",", ":")
    text = json.dumps(value, separators=separators, ensure_ascii=False)
    for candidate in (text, text[: len(text) - cut]):
        state = _run(guide, candidate)
        partial = regex.fullmatch(pattern, candidate, partial=True) is not None
        assert (state is not None) == partial, candidate
        if state is not None:
            full = regex.fullmatch(pattern, candidate) is not None
            assert guide.is_complete(state) == full, candidate


def test_optional_properties_are_each_written_or_skipped_in_order() -> None:
    props = {name: {"type": "integer"} for name in "abcd"}
    subsets = [c for r in range(5) for c in itertools.combinations("abcd", r)]
    for required in subsets:
        schema = {"type": "object", "properties": props, "required": list(required)}
        guide = compile_guide(GuidedDecoding(GuideKind.JSON_SCHEMA, json.dumps(schema)))
        for keys in subsets:
            state = _run(guide, json.dumps(dict.fromkeys(keys, 1)))
            ok = set(required) <= set(keys)
            assert (state is not None and guide.is_complete(state)) == ok, (required, keys)


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        (r"(a)\1", "backreference"),
        (r"(?P<x>a)(?P=x)", "backreference"),
        ("a(?=b)", "lookahead"),
        ("a(?!b)", "lookahead"),
        ("(?<=a)b", "lookbehind"),
        ("(?<!a)b", "lookbehind"),
        (r"\bword\b", "word boundary"),
        ("(?>a*)a", "atomic group"),
        ("a*+a", "possessive"),
        ("(?i)abc", "inline flag"),
        ("(a)?(?(1)b|c)", "conditional"),
        ("x{e<=1}", "'{'"),
        (r"\X", "grapheme"),
    ],
)
def test_syntax_outside_the_dfa_subset_is_refused(pattern: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        compile_guide(GuidedDecoding(GuideKind.REGEX, pattern))


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        ("[ab]{20000}", f"more than {MAX_DFA_STATES}"),
        ("(a|b)*a(a|b){14}", f"more than {MAX_DFA_STATES}"),  # 2^15 subsets
        ("(?:a?){3000}a{3000}", "too complex"),
        ("(?:x{1000}){1000}", "too large"),
        ("[a-c](?!)", "lookahead"),
        (r"a\Zb", "matches no string"),
    ],
)
def test_pathological_patterns_are_refused_before_acceptance(pattern: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        RegexGuide(pattern)


@pytest.mark.parametrize(
    "escape",
    [
        r"\x41",
        r"\xe9",
        r"\u65e5",
        r"\U0001F600",
        r"\0",
        r"\101",
        r"\400",
        r"\n",
        r"\v",
        r"\.",
        r"\-",
        r"\ ",
    ],
)
def test_an_escaped_character_matches_what_regex_says(escape: str) -> None:
    point = next(p for p in range(0x20000) if regex.fullmatch(escape, chr(p)))
    guide = RegexGuide(f"{escape}+")
    assert guide.is_complete(_run(guide, chr(point) * 2))
    assert all(_run(guide, chr(other)) is None for other in (point - 1, point + 1) if other >= 0)


def test_distinct_character_classes_are_bounded_but_escaped_characters_are_free() -> None:
    # Each distinct class costs a scan of every code point; escapes of one character do not.
    escapes = "".join(f"\\u{0x4E00 + i:04x}" for i in range(2 * MAX_CHAR_SETS))
    guide = RegexGuide(escapes)
    text = "".join(chr(0x4E00 + i) for i in range(2 * MAX_CHAR_SETS))
    assert guide.is_complete(_run(guide, text))
    classes = "".join(f"[{chr(0x100 + i)}x]" for i in range(MAX_CHAR_SETS + 1))
    with pytest.raises(InvalidRequestError, match=f"the {MAX_CHAR_SETS} distinct ones"):
        RegexGuide(classes)


def test_dfa_state_count_is_bounded() -> None:
    guide = RegexGuide("(a|b)*a(a|b){12}")  # the last 13 characters: 2^13 states, in bounds
    assert guide.num_states <= MAX_DFA_STATES
    assert guide.is_complete(_run(guide, "ba" + "b" * 12))
    assert not guide.is_complete(_run(guide, "ab" + "b" * 12))


# ---------------------------------------------------------------- token masks


def test_unfinished_utf8_fragments_are_allowed_only_when_a_completion_fits() -> None:
    # "é" is C3 A9, "ĩ" is C4 A9: a lone C3 may start "é", a lone C4 cannot.
    vocabulary = [b"\xc3", b"\xa9", b"\xc3\xa9", b"e", b"\xc4", None]
    masker = TokenMasker(RegexGuide("é+"), VocabTrie(vocabulary), vocabulary)
    start = masker.start()
    assert masker.allowed(start) == ((0, 2), False)
    half = _step(masker, start, 0)
    assert half == GuidedState(start.guide_state, b"\xc3")
    assert masker.allowed(half) == ((1,), False)
    assert masker.allowed(_step(masker, half, 1)) == ((0, 2), True)


@pytest.mark.parametrize(
    "guide",
    [
        RegexGuide("[à-ÿ]日本?|ü|\U0001f600x|[\ud000-\ud7ff]|\\w+"),
        ChoiceGuide(("ü", "日本", "\U0001f600", "\uffff")),
        JsonObjectGuide(),
        EbnfGuide(
            'root ::= ([à-ÿ] "日" "本"? | "ü" | "\U0001f600x" | [\ud000-\ud7ff] | [^\x00-\x7f]+)'
        ),
    ],
    ids=["regex", "choice", "json_object", "ebnf_grammar"],
)
def test_a_fragment_is_allowed_exactly_when_some_character_it_starts_is(guide: Guide) -> None:
    """Every prefix of the characters below (and their neighbours): a token of that prefix is
    allowed exactly when one of its completions (all of them tried) is accepted."""
    states = [guide.start()]
    if isinstance(guide, JsonObjectGuide):
        states = [_run(guide, '{"'), _run(guide, '{"a":1')]
    chars = "üà日本\U0001f600\uffff\ud7ff\ue000\u0080\u07ff\u0800\U0010ffff"
    points = {p + d for p in map(ord, chars) for d in (-1, 0, 1) if 0x80 <= p + d < 0x110000}
    prefixes = {
        char.encode()[:n]
        for char in map(chr, points)
        if not 0xD800 <= ord(char) < 0xE000
        for n in range(1, len(char.encode()))
    }
    for state in states:
        for prefix in prefixes:
            size = 2 if prefix[0] < 0xE0 else 3 if prefix[0] < 0xF0 else 4
            if size - len(prefix) > 2:
                continue  # 262144 completions: too many to try here
            completions = itertools.product(range(0x80, 0xC0), repeat=size - len(prefix))
            expected = False
            for rest in completions:
                try:
                    char = (prefix + bytes(rest)).decode()
                except UnicodeDecodeError:
                    continue
                if guide.advance(state, char) is not None:
                    expected = True
                    break
            vocabulary = [prefix]
            masker = TokenMasker(guide, VocabTrie(vocabulary), vocabulary)
            allowed = masker.allowed(GuidedState(state))[0] == (0,)
            assert allowed == expected, (state, prefix)


def test_regex_masks_are_memoised_per_dfa_state() -> None:
    vocabulary = [b"1", b"12", b"-", b"-a", b"ab", b"x", None]
    masker = TokenMasker(RegexGuide("[0-9]{3}-[a-z]+"), VocabTrie(vocabulary), vocabulary)
    state = _step(masker, _step(masker, masker.start(), 1), 0)  # "121"
    assert masker.allowed(state) == ((2, 3), False)
    assert masker.allowed(state) is masker.allowed(state)  # the memo's entry
    after = _step(masker, _step(masker, state, 3), 4)  # "121-aab": the DFA state of "121-a"
    assert after == masker.advance(state, 3)
    assert masker.allowed(after) == ((4, 5), True)


def _sentencepiece_tokenizer() -> Any:
    """Llama 2's style: "▁" for a space, byte fallback, a decoder that strips one leading space."""
    from tokenizers import decoders, models, pre_tokenizers

    pieces = ["<unk>", "<0xC3>", "<0xA9>", "▁the", "▁", "a", "b", "▁é", "é"]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<s>"])
    return tokenizer


def _tokenizers() -> list[Any]:
    tokenizers = [build_tokenizer(), _sentencepiece_tokenizer()]
    path = SHARED / "models/tiny-llama/tokenizer.json"
    if path.is_file():
        tokenizers.append(Tokenizer.from_file(str(path)))
    return tokenizers


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=lambda t: str(t.get_vocab_size()))
def test_token_bytes_concatenate_to_the_decoded_text(tokenizer: Any) -> None:
    table = token_bytes(tokenizer)
    ids = [t for t, data in enumerate(table) if data]
    first = tokenizer.token_to_id("a")  # as after a prompt: a decoder may strip a first space

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.sampled_from(ids), max_size=12))
    def check(sequence: list[int]) -> None:
        data = b"".join(table[t] or b"" for t in [first, *sequence])
        try:
            text = data.decode()
        except UnicodeDecodeError:  # never a guided text (byte fallback replaces such runs
            return  # its own way)
        assert text == tokenizer.decode([first, *sequence])

    check()


# Nested parentheses (not regular) and non-ASCII digits-to-be, over a left-recursive rule.
EBNF_ARITHMETIC = r"""root ::= expr
expr ::= expr [-+] term | term
term ::= factor ("*" factor)*
factor ::= [0-9é]+ | "(" " "? expr " "? ")"
"""

GUIDES = [
    GuidedDecoding(GuideKind.REGEX, r"[0-9]{2}(-[a-zé]+)?"),
    GuidedDecoding(GuideKind.CHOICE, choices=("yes", "no", "ñandú", "yesterday")),
    GuidedDecoding(GuideKind.JSON_OBJECT),
    GuidedDecoding(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    GuidedDecoding(GuideKind.EBNF_GRAMMAR, EBNF_ARITHMETIC),
]


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=lambda t: str(t.get_vocab_size()))
@pytest.mark.parametrize("spec", GUIDES, ids=lambda g: g.kind.value)
def test_trie_walk_equals_every_token_tried_alone(tokenizer: Any, spec: GuidedDecoding) -> None:
    vocabulary = token_bytes(tokenizer)
    masker = TokenMasker(compile_guide(spec), VocabTrie(vocabulary), vocabulary)

    @settings(max_examples=8, deadline=None)
    @given(st.randoms(use_true_random=False))
    def check(rng: Any) -> None:
        state = masker.start()
        for _ in range(6):  # a random walk through allowed tokens, checking every state
            allowed, _complete = masker.allowed(state)
            brute = [t for t in range(len(vocabulary)) if masker.advance(state, t) is not None]
            assert list(allowed) == brute
            if not allowed:
                break
            state = _step(masker, state, rng.choice(allowed))

    check()
