"""Stopping: stop strings across token boundaries (with holdback), include_stop_in_output,
stop token ids, EOS and ignore_eos, min_tokens, max_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.core.api import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
    StopKind,
    StopMatch,
)
from engine.core.engine_core import EngineCore
from engine.core.errors import InvalidRequestError
from engine.core.sim_runner import SimRunner
from engine.core.stopping import StopChecker, StopDecision
from tests.engine.detok_reference import finished_text

TOKENIZER = Path(__file__).resolve().parents[2].parent / "shared/models/tiny-llama/tokenizer.json"
EOS = 2


def feed(
    checker: StopChecker, pieces: list[tuple[int, str]]
) -> tuple[str, list[str], StopDecision]:
    emitted: list[str] = []
    for token_id, text in pieces:
        decision = checker.on_token(token_id, text)
        emitted.append(decision.text_delta)
        if decision.finish_reason is not None:
            break
    return "".join(emitted), emitted, decision


def test_stop_string_split_across_three_tokens_is_found_and_held_back() -> None:
    checker = StopChecker(SamplingParams(stop=("STOP!",)), {EOS}, 100)
    text, deltas, decision = feed(
        checker, [(10, "hello S"), (11, "TO"), (12, "P! and more"), (13, "never")]
    )
    assert text == "hello "
    # Nothing of the stop string leaked before the match was confirmed.
    assert all("S" not in d for d in deltas)
    assert decision.finish_reason is FinishReason.STOP
    assert decision.stop_match == StopMatch(StopKind.STOP_TEXT, text="STOP!")


def test_include_stop_in_output_keeps_the_stop_string() -> None:
    checker = StopChecker(
        SamplingParams(stop=("xyz", "b c"), include_stop_in_output=True), {EOS}, 100
    )
    text, deltas, decision = feed(checker, [(5, "a b"), (6, " c d"), (7, "e")])
    assert text == "a b c"
    # A match keeps the stop string, so no text is held back (vLLM streams it at once).
    assert deltas == ["a b", " c"]
    assert decision.stop_match is not None and decision.stop_match.text == "b c"


def test_earliest_stop_string_wins() -> None:
    checker = StopChecker(SamplingParams(stop=("later", "ear")), {EOS}, 100)
    text, _, _ = feed(checker, [(5, "an earlier later")])
    assert text == "an "


def test_held_back_text_is_flushed_when_the_length_runs_out() -> None:
    checker = StopChecker(SamplingParams(stop=("zzzz",), max_tokens=2), {EOS}, 2)
    text, deltas, decision = feed(checker, [(5, "abc"), (6, "defz")])
    assert deltas[0] == ""  # "abc" held back: it could start a 4-char stop string
    assert text == "abcdefz"
    assert decision.finish_reason is FinishReason.LENGTH


def test_an_eos_listed_as_a_stop_id_matches_as_the_eos_unless_ignored() -> None:
    """vLLM's order (its `check_stop`): the EOS before the caller's stop ids."""
    listed = SamplingParams(stop_token_ids=(EOS,))
    assert StopChecker(listed, {EOS}, 9).on_token(EOS, "").stop_match == StopMatch(
        StopKind.EOS, token_id=EOS
    )
    ignored = SamplingParams(stop_token_ids=(EOS,), ignore_eos=True)
    assert StopChecker(ignored, {EOS}, 9).on_token(EOS, "").stop_match == StopMatch(
        StopKind.STOP_TOKEN, token_id=EOS
    )


def test_stop_token_and_eos_respect_min_tokens_and_ignore_eos() -> None:
    sampling = SamplingParams(stop_token_ids=(7,), min_tokens=2)
    checker = StopChecker(sampling, {EOS}, 100)
    assert checker.on_token(7, "x").finish_reason is None  # before min_tokens: just a token
    assert checker.on_token(EOS, "").finish_reason is None
    decision = checker.on_token(7, "y")
    assert decision.finish_reason is FinishReason.STOP
    assert decision.stop_match == StopMatch(StopKind.STOP_TOKEN, token_id=7)
    assert not decision.emit_token

    eos = StopChecker(SamplingParams(), {EOS}, 100).on_token(EOS, "")
    assert eos.stop_match == StopMatch(StopKind.EOS, token_id=EOS)
    assert (
        StopChecker(SamplingParams(ignore_eos=True), {EOS}, 100).on_token(EOS, "").finish_reason
        is None
    )
    included = StopChecker(SamplingParams(stop_token_ids=(7,), include_stop_in_output=True), {}, 9)
    assert included.on_token(7, "q").emit_token
    # vLLM's output: the stop token's id is emitted, its text only with include_stop_in_output.
    emitted = StopChecker(SamplingParams(stop_token_ids=(7,), emit_stop_token=True), {}, 9)
    assert emitted.on_token(3, "ab").text_delta == "ab"
    decision = emitted.on_token(7, "q")
    assert decision.emit_token and decision.text_delta == "" and emitted.text == "ab"


# ------------------------------------------------------------------ through the engine


def engine(eos_after: int | None = None) -> EngineCore:
    runner = SimRunner(
        block_size=4, num_blocks=128, vocab_size=1024, time_scale=0, eos_after=eos_after
    )
    return EngineCore(
        runner,
        SchedulerConfig(max_num_batched_tokens=64),
        tokenizer=Tokenizer.from_file(str(TOKENIZER)),
    )


def generate(core: EngineCore, sampling: SamplingParams) -> list[RequestOutput]:
    core.add_request(EngineRequest("r", (1, 450, 300, 600, 71), sampling))
    outputs: list[RequestOutput] = []
    while core.has_work():
        outputs.extend(core.step().outputs)
    return outputs


@pytest.mark.parametrize("include", [False, True])
def test_engine_stops_on_a_string_spanning_a_token_boundary(include: bool) -> None:
    full = generate(engine(), SamplingParams(max_tokens=12, ignore_eos=True))
    pieces = [o.new_text for o in full]
    text = "".join(pieces)
    # A stop string made of the end of token 3's text and the start of token 4's.
    boundary = len("".join(pieces[:3]))
    assert pieces[2] and pieces[3]
    stop = text[boundary - 1 : boundary + 1]
    index = text.find(stop)
    outputs = generate(
        engine(), SamplingParams(max_tokens=12, stop=(stop,), include_stop_in_output=include)
    )
    got = "".join(o.new_text for o in outputs)
    assert got == (text[: index + len(stop)] if include else text[:index])
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].stop_match == StopMatch(StopKind.STOP_TEXT, text=stop)
    assert outputs[-1].usage is not None


def test_engine_eos_ends_the_output_unless_ignored() -> None:
    outputs = generate(engine(eos_after=3), SamplingParams(max_tokens=10))
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 0]  # EOS itself not emitted
    assert outputs[-1].stop_match == StopMatch(StopKind.EOS, token_id=EOS)
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 3
    ignored = generate(engine(eos_after=3), SamplingParams(max_tokens=10, ignore_eos=True))
    assert sum(len(o.new_token_ids) for o in ignored) == 10
    assert ignored[-1].finish_reason is FinishReason.LENGTH
    late = generate(engine(eos_after=3), SamplingParams(max_tokens=10, min_tokens=5))
    assert late[-1].finish_reason is FinishReason.LENGTH


def test_stop_strings_without_a_tokenizer_are_rejected() -> None:
    core = EngineCore(SimRunner(time_scale=0))
    with pytest.raises(InvalidRequestError):
        core.add_request(EngineRequest("r", (1, 2, 3), SamplingParams(stop=("x",))))


# ------------------------------------------------------------------ a finished output's text


class ScriptedRunner(SimRunner):
    """A sim runner whose outputs are `script`, token by token."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(block_size=4, num_blocks=128, vocab_size=1024, time_scale=0)
        self.script = script

    @property
    def may_emit_eos(self) -> bool:
        return True

    def next_token(self, last_token_id: int, num_output: int, output_index: int) -> int:
        return self.script[num_output]

    def next_tokens(
        self, last_token_id: int, num_output: int, output_index: int, count: int
    ) -> list[int]:
        return self.script[num_output : num_output + count]


def scripted_text(script: list[int], sampling: SamplingParams) -> tuple[str, RequestOutput]:
    core = EngineCore(
        ScriptedRunner(script),
        SchedulerConfig(max_num_batched_tokens=64),
        tokenizer=Tokenizer.from_file(str(TOKENIZER)),
    )
    outputs = generate(core, sampling)
    return "".join(o.new_text for o in outputs), outputs[-1]


@pytest.mark.parametrize("end", ["length", "eos", "stop_token"])
@pytest.mark.parametrize("text", ["ok 🎉", "café 日本"])
def test_a_finished_output_ends_on_its_last_whole_character_whatever_ends_it(
    end: str, text: str
) -> None:
    """Byte-level BPE splits these characters into several tokens; the output ends inside the
    last one. Its text is what HF's decode of the whole output gives, up to the last whole
    character (as vLLM's detokenizer: held bytes are not flushed as U+FFFD), whether the length
    ran out, the EOS came or a stop token: before, the length flushed "\ufffd" and the EOS did
    not."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    cut = ids[:-1]
    assert tokenizer.decode(cut).endswith("\ufffd")  # the last character is unfinished
    stop_id = 1000
    script = cut + [stop_id if end == "stop_token" else EOS] * 2
    sampling = SamplingParams(
        max_tokens=len(cut) if end == "length" else len(cut) + 5,
        stop_token_ids=(stop_id,) if end == "stop_token" else (),
    )
    got, last = scripted_text(script, sampling)
    assert got == finished_text(tokenizer, cut)
    assert "\ufffd" not in got
    assert last.finish_reason is (FinishReason.LENGTH if end == "length" else FinishReason.STOP)
    # Once the character completes, the whole decode is the text, whatever ends the output.
    whole, _ = scripted_text([*ids, EOS], SamplingParams(max_tokens=len(ids)))
    assert whole == tokenizer.decode(ids) == text
