"""Incremental detokenisation that streams correct text deltas.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and decoding a token alone can
lose the space or merge that its left context gives it. So each step decodes a small window:
`prefix` = tokens already turned into text (kept only as left context), `read` = tokens not yet
emitted. The delta is `decode(prefix + read)` minus `decode(prefix)`, emitted only when it does
not end in U+FFFD (an incomplete character); then the window slides forward. The window starts
on the last few prompt tokens so that the first output token gets its left context too.
Nothing is flushed at the end: the bytes of a character the output never finishes are not
emitted (as vLLM's detokenizer), so an output's text ends on its last whole character. Invalid
bytes followed by more text are emitted, as U+FFFD, with that text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    """The part of `tokenizers.Tokenizer` the core needs."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one output's token ids into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Do not start the window inside a character: drop context that decodes to U+FFFD.
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop(0)
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the decoded window short: drop ids before the prefix.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta
