"""Incremental detokenisation with the tiny-llama byte-level BPE tokenizer: deltas concatenate to
the full decode (up to the last whole character), and no delta ever carries a partial UTF-8
character."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.core.detokenizer import IncrementalDetokenizer

TOKENIZER = Path(__file__).resolve().parents[2].parent / "shared/models/tiny-llama/tokenizer.json"


@functools.cache
def load_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return [detok.add(t) for t in output]


TEXTS = [
    "héllo wörld, naïve café",
    "日本語のテキスト and 中文",
    "emoji 🎉🚀 and 👩‍👩‍👧 families",
    "Ελληνικά, русский, עברית",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    # Byte-level BPE really splits these characters across tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas = stream(tokenizer, [], ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_output_after_a_prompt_keeps_its_leading_space(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say it:", add_special_tokens=False).ids
    output = tokenizer.encode(" " + text, add_special_tokens=False).ids
    full = tokenizer.decode(prompt + output)
    expected = full[len(tokenizer.decode(prompt)) :]
    deltas = stream(tokenizer, prompt, output)
    assert "".join(deltas) == expected
    assert expected.startswith(" ")


def test_the_bytes_of_an_unfinished_character_are_never_emitted(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    partial = ids[:-1]  # the emoji's bytes never complete
    assert tokenizer.decode(partial) == "\ufffd"
    assert stream(tokenizer, [], partial) == [""] * len(partial)


def test_invalid_bytes_followed_by_text_are_emitted_with_it(tokenizer: Tokenizer) -> None:
    partial = tokenizer.encode("🎉", add_special_tokens=False).ids[:-1]
    ids = partial + tokenizer.encode(" ok", add_special_tokens=False).ids
    assert "".join(stream(tokenizer, [], ids)) == tokenizer.decode(ids) == "\ufffd ok"


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_any_text_streams_back_exactly(text: str) -> None:
    tokenizer = load_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    deltas = stream(tokenizer, [], ids)
    full, streamed = tokenizer.decode(ids), "".join(deltas)
    # A text ending in U+FFFD itself reads as an unfinished character: held, as in vLLM.
    assert streamed == full or (full.endswith("\ufffd") and full.startswith(streamed))
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full


def test_special_tokens_are_kept_when_asked(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hi there", add_special_tokens=False).ids
    eos = tokenizer.token_to_id("</s>")
    assert eos is not None
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(kept.add(t) for t in [*ids, eos]) == "hi there</s>"
    skipped = IncrementalDetokenizer(tokenizer)
    assert "".join(skipped.add(t) for t in [*ids, eos]) == "hi there"


def test_a_prompt_ending_inside_a_character_does_not_swallow_the_output(
    tokenizer: Tokenizer,
) -> None:
    # The prompt's last tokens are the first bytes of an emoji that the output's first token
    # completes: the window starts after them, so the output's text is what its own tokens
    # decode to (the lone byte as U+FFFD, then the rest), not the rest alone.
    emoji = tokenizer.encode("🎉", add_special_tokens=False).ids
    prompt = tokenizer.encode("Say", add_special_tokens=False).ids + emoji[:-1]
    output = [emoji[-1], *tokenizer.encode(" ok", add_special_tokens=False).ids]
    assert "".join(stream(tokenizer, prompt, output)) == tokenizer.decode(output) == "\ufffd ok"


def test_the_first_output_token_keeps_the_space_its_prompt_gives_it() -> None:
    # A SentencePiece-style (Metaspace) decoder strips the leading space of the first token it
    # decodes: only the prompt's tokens as left context keep the output's first space.
    metaspace = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "[UNK]": 2}, "[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert metaspace.decode([1]) == "world"
    assert stream(metaspace, [0], [1, 1]) == [" world", " world"]
