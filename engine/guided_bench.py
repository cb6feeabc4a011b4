"""`kvplane bench guided`: what a guided decoding step costs.

The trie walk (`TokenMasker.allowed`) per state, the first time ("walk") and again (the
per-state memo), on the builtin tokenizer, tiny-llama's (when ../shared is there) and a
32000-token byte-level BPE trained here on the Python standard library's sources (no download;
`--quick` leaves it out); compiling the regex and schema guides to their DFAs and the EBNF
guide (llama.cpp's JSON grammar); and the sampler's mask on a 32000-wide row. Best of several
runs each. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from engine.core.api import GuidedDecoding, GuideKind
from engine.core.guided import RegexGuide, compile_guide
from engine.core.guided_ebnf import EbnfGuide
from engine.core.guided_json import schema_to_regex
from engine.core.guided_vocab import GuidedState, TokenMasker, VocabTrie, token_bytes
from kvplane.cli_common import OutputFormat, OutputOption, emit

TINY_LLAMA = Path(__file__).resolve().parents[2] / "shared/models/tiny-llama/tokenizer.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age"],
}


def _stdlib_text() -> Iterator[str]:
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        yield path.read_text(errors="replace")


def _bpe_32k() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_stdlib_text(), trainer)
    return tokenizer


def _ms(fn: Callable[[], object], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _state(masker: TokenMasker, text: str) -> GuidedState:
    state = masker.start()
    guide_state = state.guide_state
    for char in text:
        advanced = masker.guide.advance(guide_state, char)
        assert advanced is not None, text
        guide_state = advanced
    return GuidedState(guide_state)


def _case(masker: TokenMasker, text: str) -> dict[str, Any]:
    state = _state(masker, text)
    fresh = TokenMasker(masker.guide, masker.trie, masker.vocabulary)
    walk = _ms(lambda: TokenMasker(masker.guide, masker.trie, masker.vocabulary).allowed(state))
    allowed, _ = fresh.allowed(state)
    again = _ms(lambda: fresh.allowed(state), repeat=50)
    result = {"allowed": len(allowed), "first_visit_ms": walk, "repeat_visit_ms": again}
    if isinstance(masker.guide, EbnfGuide):
        result["first_visit_cold_ms"] = _ebnf_cold_ms(masker, text)
    return result


def _ebnf_cold_ms(masker: TokenMasker, text: str) -> float:
    """The first visit with a new guide: its cache of Earley steps empty (the first visit
    above reuses the guide, so it measures the walk over cached steps)."""
    best = float("inf")
    for _ in range(5):
        cold = TokenMasker(EbnfGuide(EBNF_JSON), masker.trie, masker.vocabulary)
        state = _state(cold, text)
        start = time.perf_counter()
        cold.allowed(state)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


SCHEMA_TEXT = json.dumps(SCHEMA)
MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30)}}
CHOICES = ("yes", "no", "maybe", "never")
# llama.cpp's json.gbnf, its whitespace cut to at most one space (as the JSON guides).
EBNF_JSON = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [0-9]{0,15})? ws
ws ::= " "?
"""
CASES = [
    ("regex after '123-ab'", GuidedDecoding(GuideKind.REGEX, r"[0-9]{3}-[a-z]+"), "123-ab"),
    ("choice of 4 at the start", GuidedDecoding(GuideKind.CHOICE, choices=CHOICES), ""),
    ("json_object in a string", GuidedDecoding(GuideKind.JSON_OBJECT), '{"key": "val'),
    ("json_object after a comma", GuidedDecoding(GuideKind.JSON_OBJECT), '{"a": 1,'),
    ("json_schema in a string", GuidedDecoding(GuideKind.JSON_SCHEMA, SCHEMA_TEXT), '{"name": "Jo'),
    ("ebnf json in a string", GuidedDecoding(GuideKind.EBNF_GRAMMAR, EBNF_JSON), '{"key": ["val'),
]  # fmt: skip


def _compile_cost() -> list[dict[str, Any]]:
    RegexGuide("a")  # the one-off table of every code point the character sets are cut from
    patterns = {
        "regex [0-9]{3}-[a-z]+": r"[0-9]{3}-[a-z]+",
        "json_schema (3 properties)": schema_to_regex(SCHEMA_TEXT),
        "json_schema (30 optional strings)": schema_to_regex(json.dumps(MANY_OPTIONAL)),
    }
    rows: list[dict[str, Any]] = []
    for label, pattern in patterns.items():
        cost = _ms(lambda pattern=pattern: RegexGuide(pattern), repeat=3)  # type: ignore[misc]
        rows.append({"guide": label, "dfa_states": RegexGuide(pattern).num_states, "ms": cost})
    cost = _ms(lambda: EbnfGuide(EBNF_JSON), repeat=3)
    productions = EbnfGuide(EBNF_JSON).num_productions
    rows.append({"guide": "ebnf_grammar (json)", "bnf_productions": productions, "ms": cost})
    return rows


def run_guided_bench(*, quick: bool = False) -> dict[str, Any]:
    """The benchmark's JSON document."""
    from tokenizers import Tokenizer

    from engine.torch_runner.builtin_model import build_tokenizer

    tokenizers = {"builtin": build_tokenizer()}
    if TINY_LLAMA.is_file():
        tokenizers["tiny-llama"] = Tokenizer.from_file(str(TINY_LLAMA))
    if not quick:
        tokenizers["bpe-32k"] = _bpe_32k()
    vocabularies = []
    for name, tokenizer in tokenizers.items():
        start = time.perf_counter()
        vocabulary = token_bytes(tokenizer)
        trie = VocabTrie(vocabulary)
        build_ms = (time.perf_counter() - start) * 1e3
        cases = [
            {"case": label, **_case(TokenMasker(compile_guide(spec), trie, vocabulary), text)}
            for label, spec, text in CASES
        ]
        vocabularies.append(
            {
                "name": name,
                "tokens": len(vocabulary),
                "trie_nodes": trie.num_nodes,
                "build_ms": build_ms,
                "cases": cases,
            }
        )
    return {"vocabularies": vocabularies, "compile": _compile_cost(), "sampler": _sampler_cost()}


def _sampler_cost() -> list[dict[str, Any]]:
    import torch

    from engine.core.api import SamplingParams
    from engine.torch_runner.sampler import Sampler, SamplingRow

    vocab = 32000
    logits = torch.randn(8, vocab)
    sampler = Sampler(frozenset({2}), seed=0)
    params = SamplingParams(temperature=1.0)
    rows_out = []
    # One torch thread, as the engine configs run (`num_threads: 1`): torch's own pool, beside
    # the tokenizer's worker threads the vocabularies above started, measures contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for allowed_count in (None, 10, 16000):
            allowed = None if allowed_count is None else tuple(range(allowed_count))
            rows = [SamplingRow(params, 1, (), (), allowed) for _ in range(8)]
            cost = _ms(lambda rows=rows: sampler.sample(logits, rows), repeat=20)  # type: ignore[misc]
            rows_out.append({"rows": 8, "vocab": vocab, "allowed": allowed_count, "ms": cost})
    finally:
        torch.set_num_threads(threads)
    return rows_out


def render_table(result: dict[str, Any]) -> str:
    lines = []
    for v in result["vocabularies"]:
        lines.append(
            f"{v['name']}: {v['tokens']} tokens, {v['trie_nodes']} trie nodes, "
            f"built in {v['build_ms']:.0f} ms"
        )
        for c in v["cases"]:
            cold = c.get("first_visit_cold_ms")
            lines.append(
                f"  {c['case']}: {c['allowed']} allowed, first visit {c['first_visit_ms']:.2f} "
                f"ms{'' if cold is None else f' (new guide {cold:.2f} ms)'}, "
                f"repeat visit {c['repeat_visit_ms']:.3f} ms"
            )
    for c in result["compile"]:
        size = (
            f"{c['dfa_states']} DFA states"
            if "dfa_states" in c
            else f"{c['bnf_productions']} BNF productions"
        )
        lines.append(f"compile {c['guide']}: {size}, {c['ms']:.1f} ms")
    for r in result["sampler"]:
        what = "unguided" if r["allowed"] is None else f"{r['allowed']} allowed"
        lines.append(f"sampler, {r['rows']} rows x {r['vocab']}, {what}: {r['ms']:.2f} ms")
    return "\n".join(lines)


def bench_guided(
    *,
    quick: Annotated[
        bool, typer.Option("--quick", help="Leave out the 32k BPE (trained here, ~a minute).")
    ] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Guided decoding: the token mask's cost per step, the guides' compilation, the sampler."""
    emit(run_guided_bench(quick=quick), output, render_table)
