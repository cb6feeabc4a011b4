"""vLLM's `truncate_prompt_tokens` (`vllm.Generate`): a prompt keeps its last N tokens, 0 keeps
them all. One rule for the engine, which runs the prompt so kept (and counts it in
`prompt_info`, even for a request aborted before it was converted), and the controller, which
routes by those tokens and counts them for a request aborted before any engine took it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def kept_prompt(tokens: Sequence[T], truncate_prompt_tokens: int) -> Sequence[T]:
    """The tokens of `tokens` that `truncate_prompt_tokens` keeps."""
    return tokens[-truncate_prompt_tokens:] if truncate_prompt_tokens else tokens
