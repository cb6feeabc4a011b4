"""What a guided decoding step costs: the trie walk (`TokenMasker.allowed`) per state, the first
time ("walk") and again (the per-state memo), on the builtin tokenizer, tiny-llama's and a
32000-token byte-level BPE trained here on the Python standard library's sources (no download);
compiling the regex and schema guides to their DFAs; and the sampler's mask on a 32000-wide row.

    python scripts/guided_mask_cost.py        # prints one line per case (docs/engine.md)
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.core.api import GuidedDecoding, GuideKind
from engine.core.guided import RegexGuide, compile_guide
from engine.core.guided_json import schema_to_regex
from engine.core.guided_vocab import GuidedState, TokenMasker, VocabTrie, token_bytes

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


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")


def _case(label: str, masker: TokenMasker, text: str) -> None:
    state = _state(masker, text)
    fresh = TokenMasker(masker.guide, masker.trie, masker.vocabulary)
    walk = _ms(lambda: TokenMasker(masker.guide, masker.trie, masker.vocabulary).allowed(state))
    allowed, _ = fresh.allowed(state)
    again = _ms(lambda: fresh.allowed(state), repeat=50)
    _say(f"  {label}: {len(allowed)} allowed, walk {walk:.2f} ms, same state {again:.3f} ms")


SCHEMA_TEXT = json.dumps(SCHEMA)
MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30)}}
CHOICES = ("yes", "no", "maybe", "never")
CASES = [
    ("regex after '123-ab'", GuidedDecoding(GuideKind.REGEX, r"[0-9]{3}-[a-z]+"), "123-ab"),
    ("choice of 4 at the start", GuidedDecoding(GuideKind.CHOICE, choices=CHOICES), ""),
    ("json_object in a string", GuidedDecoding(GuideKind.JSON_OBJECT), '{"key": "val'),
    ("json_object after a comma", GuidedDecoding(GuideKind.JSON_OBJECT), '{"a": 1,'),
    ("json_schema in a string", GuidedDecoding(GuideKind.JSON_SCHEMA, SCHEMA_TEXT), '{"name": "Jo'),
]  # fmt: skip


def _compile_cost() -> None:
    RegexGuide("a")  # the one-off table of every code point the character sets are cut from
    patterns = {
        "regex [0-9]{3}-[a-z]+": r"[0-9]{3}-[a-z]+",
        "json_schema (3 properties)": schema_to_regex(SCHEMA_TEXT),
        "json_schema (30 optional strings)": schema_to_regex(json.dumps(MANY_OPTIONAL)),
    }
    for label, pattern in patterns.items():
        cost = _ms(lambda pattern=pattern: RegexGuide(pattern), repeat=3)  # type: ignore[misc]
        states = RegexGuide(pattern).num_states
        _say(f"compile {label}: {states} DFA states, {cost:.1f} ms")


def main() -> None:
    from tokenizers import Tokenizer

    from engine.torch_runner.builtin_model import build_tokenizer

    tokenizers = {"builtin": build_tokenizer()}
    tiny = Path(__file__).resolve().parents[2] / "shared/models/tiny-llama/tokenizer.json"
    if tiny.is_file():
        tokenizers["tiny-llama"] = Tokenizer.from_file(str(tiny))
    tokenizers["bpe-32k"] = _bpe_32k()
    for name, tokenizer in tokenizers.items():
        start = time.perf_counter()
        vocabulary = token_bytes(tokenizer)
        trie = VocabTrie(vocabulary)
        build_ms = (time.perf_counter() - start) * 1e3
        _say(
            f"{name}: {len(vocabulary)} tokens, {trie.num_nodes} nodes, built in {build_ms:.0f} ms"
        )
        for label, spec, text in CASES:
            _case(label, TokenMasker(compile_guide(spec), trie, vocabulary), text)
    _compile_cost()
    _sampler_cost()


def _sampler_cost() -> None:
    import torch

    from engine.core.api import SamplingParams
    from engine.torch_runner.sampler import Sampler, SamplingRow

    vocab = 32000
    logits = torch.randn(8, vocab)
    sampler = Sampler(frozenset({2}), seed=0)
    params = SamplingParams(temperature=1.0)
    for allowed_count in (None, 10, 16000):
        allowed = None if allowed_count is None else tuple(range(allowed_count))
        rows = [SamplingRow(params, 1, (), (), allowed) for _ in range(8)]
        cost = _ms(lambda rows=rows: sampler.sample(logits, rows), repeat=20)  # type: ignore[misc]
        what = "unguided" if allowed_count is None else f"{allowed_count} allowed"
        _say(f"sampler, 8 rows x {vocab}, {what}: {cost:.2f} ms")


if __name__ == "__main__":
    main()
