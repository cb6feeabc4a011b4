"""When an output stops, and which of its tokens and text are emitted.

Checked after each sampled token, in this order:
1. EOS (unless `ignore_eos`), then a caller stop token id (vLLM's order: the EOS listed as a
   stop id too is reported as the EOS): both only once `min_tokens` tokens were generated;
   the matched token is emitted only with `include_stop_in_output` (its text too) or
   `emit_stop_token` (its id alone, vLLM's output);
2. stop strings (after `min_tokens`), searched in the text across token boundaries: the output
   text is cut before the match (or after it, with `include_stop_in_output`);
3. `max_tokens` (or the context limit): LENGTH.

Text holdback. Until the output ends, the last `max(len(stop)) - 1` characters are held back,
since they may be the start of a stop string that the next token completes and that would cut
them out; a finished output flushes the rest. With `include_stop_in_output` a match keeps
them, so nothing is held back (as vLLM). Token ids are never held back (they stream as
generated); only text lags.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from engine.core.api import FinishReason, SamplingParams, StopKind, StopMatch


@dataclass(frozen=True, slots=True)
class StopDecision:
    emit_token: bool
    text_delta: str
    finish_reason: FinishReason | None = None
    stop_match: StopMatch | None = None


# The decision for most tokens without a tokenizer (the simulator's), made once: decisions are
# immutable values, and building a frozen dataclass per token is a visible cost in replays.
_EMIT_WITHOUT_TEXT = StopDecision(True, "")


class StopChecker:
    """Stop state of one output. `max_new_tokens` already includes the context limit."""

    def __init__(
        self, sampling: SamplingParams, eos_token_ids: Collection[int], max_new_tokens: int
    ) -> None:
        self._sampling = sampling
        self._eos_token_ids = frozenset(() if sampling.ignore_eos else eos_token_ids)
        self._stop_token_ids = frozenset(sampling.stop_token_ids)
        self._max_new_tokens = max_new_tokens
        # With the stop string kept, a match only cuts text after it, never text already
        # out: nothing needs holding back (vLLM's `output_text_buffer_length` is 0 too).
        self._holdback = (
            0
            if sampling.include_stop_in_output
            else max((len(s) for s in sampling.stop), default=1) - 1
        )
        self._text = ""  # output text so far (emitted + held back)
        self._num_emitted_chars = 0
        self._num_tokens = 0

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens left before LENGTH."""
        return self._max_new_tokens - self._num_tokens

    def skip_tokens(self, num_tokens: int) -> None:
        """Count tokens that cannot stop the output (the caller checked that no stop id, EOS or
        stop string can end it before LENGTH)."""
        if num_tokens >= self.num_remaining_tokens:
            raise ValueError("skipping would pass the length limit")
        self._num_tokens += num_tokens

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        return self._text[: self._num_emitted_chars]

    def on_token(self, token_id: int, text_delta: str) -> StopDecision:
        """Account for one sampled token whose detokenised text delta is `text_delta`."""
        self._num_tokens += 1
        sampling = self._sampling
        past_min = self._num_tokens > sampling.min_tokens
        if past_min and (token_id in self._stop_token_ids or token_id in self._eos_token_ids):
            kind = StopKind.EOS if token_id in self._eos_token_ids else StopKind.STOP_TOKEN
            if sampling.include_stop_in_output:
                self._text += text_delta
            return StopDecision(
                emit_token=sampling.include_stop_in_output or sampling.emit_stop_token,
                text_delta=self._flush(),
                finish_reason=FinishReason.STOP,
                stop_match=StopMatch(kind, token_id=token_id),
            )
        start = len(self._text)
        self._text += text_delta
        if past_min and sampling.stop:
            match = self._find_stop(start)
            if match is not None:
                index, stop = match
                end = index + len(stop) if sampling.include_stop_in_output else index
                self._text = self._text[:end]
                return StopDecision(
                    emit_token=True,
                    text_delta=self._flush(),
                    finish_reason=FinishReason.STOP,
                    stop_match=StopMatch(StopKind.STOP_TEXT, text=stop),
                )
        if self._num_tokens >= self._max_new_tokens:
            return StopDecision(True, self._flush(), FinishReason.LENGTH)
        safe_end = max(self._num_emitted_chars, len(self._text) - self._holdback)
        delta = self._text[self._num_emitted_chars : safe_end]
        self._num_emitted_chars = safe_end
        return StopDecision(True, delta) if delta else _EMIT_WITHOUT_TEXT

    def finish(self) -> str:
        """End the output early (abort, error, KV cache full): the rest of the held-back text."""
        return self._flush()

    def _flush(self) -> str:
        delta = self._text[self._num_emitted_chars :]
        self._num_emitted_chars = len(self._text)
        return delta

    def _find_stop(self, new_text_start: int) -> tuple[int, str] | None:
        """The earliest stop string overlapping the new text, as (index, stop)."""
        best: tuple[int, str] | None = None
        for stop in self._sampling.stop:
            # A match must end inside the new text; it may start in held-back text.
            index = self._text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best
