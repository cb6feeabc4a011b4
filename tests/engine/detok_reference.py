"""What a finished output's text is, from HF's decode of its tokens (the reference the engine's
detokenisation is checked against)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def finished_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """HF's decode of `ids` up to their last whole character: as vLLM's detokenizer, the engine
    never emits the bytes of a character the output does not finish (a decode ending in U+FFFD),
    whatever ends the output."""
    ids = list(ids)
    while ids and tokenizer.decode(ids).endswith("\ufffd"):
        ids.pop()
    return str(tokenizer.decode(ids))
