"""Tokenising a text prompt without stalling the event loop. A fast tokenizer takes about 40 us
for 100 characters and 350 us for 1,000, and a prompt of several MB a second or more: on the
event loop that would stall every other request's stream, poll, Abort and health check. So a
long prompt is tokenised in a worker thread (the tokenizer releases the GIL); a short one in
place, where the thread hop (about 180 us here) would cost more than the work. Used by the
controller (routing) and the engine (text prompts)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

# Prompts up to this many characters (together, for a batch) are tokenised on the event loop.
INLINE_TOKENIZE_MAX_CHARS = 512

T = TypeVar("T")


async def tokenize_off_loop(encode: Callable[[str], T], text: str) -> T:
    """`encode(text)`, in a worker thread when `text` is long."""
    return (await tokenize_all_off_loop(encode, (text,)))[0]


async def tokenize_all_off_loop(encode: Callable[[str], T], texts: Sequence[str]) -> list[T]:
    """`encode` of each of `texts` (a pooling task's inputs), in one worker thread when they
    are long together: many short texts stall the event loop as one long one does."""

    def encode_all() -> list[T]:
        return [encode(text) for text in texts]

    if sum(map(len, texts)) <= INLINE_TOKENIZE_MAX_CHARS:
        return encode_all()
    return await asyncio.to_thread(encode_all)
