"""Token masks for guided decoding: which token ids keep the output inside a guide's language.

Bytes, not strings: a byte-level BPE token can end in the middle of a UTF-8 character (and
decoding a token alone loses what its neighbours give it), so the vocabulary is taken as the
bytes each token adds to the output (`token_bytes`), and a guided output's state is its guide
state plus the bytes of a character not finished yet (`GuidedState.pending`).

Once per tokenizer, a byte trie of the vocabulary (`VocabTrie`). At each step the trie is walked
from the output's state: an edge appends one byte; when the bytes so far end a character, the
guide advances by it and the subtree is pruned when it refuses; while they are an unfinished
character the walk goes on without asking the guide. A token ending on an unfinished character
is allowed exactly when some character it can start is accepted by the guide: the characters
whose UTF-8 encoding starts with given bytes are one code point interval, and the guide says
whether it accepts any of them (`Guide.accepts_any`); continuation bytes are tokens of every
byte-level vocabulary, so such a character can be finished. EOS is allowed exactly when the
text is complete.

Cost: one guide step per trie node visited (nodes under a refused prefix are never visited), so
a guide that allows most of the vocabulary (inside a JSON string) visits most of the trie, the
first time. Every guide's states recur across steps (a regex or schema guide's state is a DFA
state, a choice's is a prefix of a choice, a JSON object's inner state repeats along a string),
so the allowed ids are memoised per state: a step in a state already seen costs a dict lookup.
docs/engine.md has the measured costs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.api import GuidedDecoding
from engine.core.guided import Guide, GuideState, compile_guide

# The code points of a UTF-8 character of each length (surrogates apart: never characters).
_UTF8_FIRST = {2: 0x80, 3: 0x800, 4: 0x10000}
_UTF8_LAST = {2: 0x7FF, 3: 0xFFFF, 4: 0x10FFFF}
_SURROGATES_FIRST = 0xD800
_MEMO_MAX_STATES = 4096
# A guide whose steps cost more than a table lookup (an EBNF guide: Earley columns) counts
# them in `work`. One vocabulary walk may do at most this much of it (about 25-150 ms here),
# so that a grammar whose states never recur cannot hold the engine thread for seconds on one
# token: the request fails instead (GuideTooCostlyError). A JSON string takes about 2,000.
MAX_WALK_WORK = 100_000


class GuideTooCostlyError(Exception):
    """A vocabulary walk needed more than MAX_WALK_WORK of its guide's work."""


_METASPACE = "\u2581"  # SentencePiece's stand-in for a space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, inverted (what ByteLevel vocabularies spell)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """The bytes each token id adds to decoded text (None for special tokens, never allowed by
    a guide). ByteLevel BPE (GPT-2, Llama 3, Qwen2, the builtin model): the vocabulary's
    stand-in characters mapped back to bytes. SentencePiece style (Llama 2, Mistral: a
    Metaspace or "▁" -> " " decoder, byte fallback): "▁" is a space and `<0xHH>` the byte HH
    (decoding such a token alone would drop its leading space, or give U+FFFD). Otherwise each
    token decoded alone, encoded as UTF-8 (a tokenizer whose decoding depends on neighbours is
    then approximated)."""
    spec = json.loads(tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    steps = [decoder, *(decoder.get("decoders") or ())]
    kinds = {d.get("type") for d in steps}
    metaspace = "Metaspace" in kinds or any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == _METASPACE
        for d in steps
    )
    byte_fallback = "ByteFallback" in kinds
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    special = {t["content"] for t in spec.get("added_tokens", ()) if t.get("special")}
    byte_of = _gpt2_byte_decoder() if "ByteLevel" in kinds else None
    for text, token_id in vocab.items():
        if text in special:
            continue
        if byte_of is not None and all(c in byte_of for c in text):
            table[token_id] = bytes(byte_of[c] for c in text)
        elif byte_fallback and (byte := _BYTE_TOKEN.fullmatch(text)) is not None:
            table[token_id] = bytes((int(byte[1], 16),))
        elif metaspace:
            table[token_id] = text.replace(_METASPACE, " ").encode()
        else:
            table[token_id] = tokenizer.decode([token_id], skip_special_tokens=True).encode()
    return table


class _Node:
    __slots__ = ("children", "edges", "token_ids")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.edges: tuple[tuple[int, _Node], ...] = ()
        self.token_ids: list[int] = []


class VocabTrie:
    """A byte trie of the vocabulary: the path to a node spells the bytes of its tokens."""

    def __init__(self, vocabulary: Sequence[bytes | None]) -> None:
        self.root = _Node()
        self.num_nodes = 1
        for token_id, data in enumerate(vocabulary):
            if not data:
                continue  # special or empty: a guide never allows it
            node = self.root
            for byte in data:
                child = node.children.get(byte)
                if child is None:
                    child = node.children[byte] = _Node()
                    self.num_nodes += 1
                node = child
            node.token_ids.append(token_id)
        stack = [self.root]
        while stack:  # frozen edge tuples: iterating them is faster than dict items
            node = stack.pop()
            node.edges = tuple(sorted(node.children.items()))
            stack.extend(node.children.values())


def _next_char(guide: Guide, state: GuideState, pending: bytes) -> tuple[GuideState, bytes] | None:
    """The guide after `pending` (one byte more than before): a finished character advances
    it; an unfinished one waits; invalid UTF-8 is refused."""
    if len(pending) == 1 and pending[0] < 0x80:
        new = guide.advance(state, chr(pending[0]))
        return None if new is None else (new, b"")
    try:
        char = pending.decode()
    except UnicodeDecodeError as exc:
        return (state, pending) if exc.reason == "unexpected end of data" else None
    new = guide.advance(state, char)
    return None if new is None else (new, b"")


def _fragment_fits(guide: Guide, state: GuideState, pending: bytes) -> bool:
    """Whether the guide accepts some character whose UTF-8 encoding starts with `pending`
    (an unfinished character that `_next_char` let through: a valid prefix)."""
    size = 2 if pending[0] < 0xE0 else 3 if pending[0] < 0xF0 else 4
    value = pending[0] & (0x7F >> size)
    for byte in pending[1:]:
        value = value << 6 | byte & 0x3F
    num_missing_bits = 6 * (size - len(pending))
    first = max(value << num_missing_bits, _UTF8_FIRST[size])
    last = min(((value + 1) << num_missing_bits) - 1, _UTF8_LAST[size])
    if first < _SURROGATES_FIRST <= last:  # a lone ED: U+D000..U+D7FF, then surrogates
        last = _SURROGATES_FIRST - 1
    return guide.accepts_any(state, first, last)


@dataclass(frozen=True, slots=True)
class GuidedState:
    """One output's place in its guide: the guide's state and an unfinished character's
    bytes (b"" between characters)."""

    guide_state: GuideState
    pending: bytes = b""


class TokenMasker:
    """The allowed tokens of one guide (shared by every output that uses it)."""

    def __init__(self, guide: Guide, trie: VocabTrie, vocabulary: Sequence[bytes | None]) -> None:
        self.guide = guide
        self.trie = trie
        self.vocabulary = vocabulary
        # Every guide's states recur (a DFA state, a choice's prefix, a JSON string's inner
        # state), so the allowed ids are kept per state, up to _MEMO_MAX_STATES.
        self._memo: dict[GuidedState, tuple[tuple[int, ...], bool]] = {}

    def start(self) -> GuidedState:
        return GuidedState(self.guide.start())

    def is_complete(self, state: GuidedState) -> bool:
        return not state.pending and self.guide.is_complete(state.guide_state)

    def advance(self, state: GuidedState, token_id: int) -> GuidedState | None:
        """The state after a sampled token; None when the guide refuses it."""
        data = self.vocabulary[token_id] if token_id < len(self.vocabulary) else None
        if not data:
            return None
        guide_state, pending = state.guide_state, state.pending
        for byte in data:
            step = _next_char(self.guide, guide_state, pending + bytes((byte,)))
            if step is None:
                return None
            guide_state, pending = step
        if pending and not _fragment_fits(self.guide, guide_state, pending):
            return None
        return GuidedState(guide_state, pending)

    def allowed(self, state: GuidedState) -> tuple[tuple[int, ...], bool]:
        """(the token ids that keep the text a valid prefix, sorted; whether it is complete)."""
        memo = self._memo
        hit = memo.get(state)
        if hit is not None:
            return hit
        result = (tuple(sorted(self._walk(state))), self.is_complete(state))
        if len(memo) >= _MEMO_MAX_STATES:
            memo.clear()
        memo[state] = result
        return result

    def _walk(self, state: GuidedState) -> Iterable[int]:
        guide = self.guide
        work: int | None = getattr(guide, "work", None)
        limit = None if work is None else work + MAX_WALK_WORK
        allowed: list[int] = []
        stack = [(self.trie.root, state.guide_state, state.pending)]
        while stack:
            if limit is not None and getattr(guide, "work", 0) > limit:
                raise GuideTooCostlyError(
                    f"guided decoding: the grammar needs more than {MAX_WALK_WORK} steps of "
                    "work to find the tokens that may come next (its states do not recur; "
                    "bound repetitions or nesting)"
                )
            node, guide_state, pending = stack.pop()
            for byte, child in node.edges:
                if not pending and byte < 0x80:  # the common case, inline
                    new = guide.advance(guide_state, chr(byte))
                    if new is None:
                        continue
                    step: tuple[GuideState, bytes] = (new, b"")
                else:
                    found = _next_char(guide, guide_state, pending + bytes((byte,)))
                    if found is None:
                        continue
                    step = found
                if child.token_ids and (not step[1] or _fragment_fits(guide, step[0], step[1])):
                    allowed.extend(child.token_ids)
                if child.edges:
                    stack.append((child, step[0], step[1]))
        return allowed


class GuideRegistry:
    """One engine's guided decoding: the tokenizer's vocabulary and trie, built on the first
    guided request (not at startup: most engines never see one), and a masker per distinct
    constraint (the last `max_maskers`, so a recurring schema keeps its memo). The EOS ids
    are never text, even where the tokenizer does not mark them special (a model may end on
    an ordinary token): the core allows them only where the text is complete."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], max_maskers: int = 64) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = tuple(eos_token_ids)
        self._vocabulary: list[bytes | None] | None = None
        self._trie: VocabTrie | None = None
        self._maskers: dict[GuidedDecoding, TokenMasker] = {}
        self._max_maskers = max_maskers

    def masker(self, spec: GuidedDecoding) -> TokenMasker:
        masker = self._maskers.pop(spec, None)
        if masker is None:
            if self._vocabulary is None or self._trie is None:
                self._vocabulary = token_bytes(self._tokenizer)
                for token_id in self._eos_token_ids:
                    if token_id < len(self._vocabulary):
                        self._vocabulary[token_id] = None
                self._trie = VocabTrie(self._vocabulary)
            masker = TokenMasker(compile_guide(spec), self._trie, self._vocabulary)
            if len(self._maskers) >= self._max_maskers:
                del self._maskers[next(iter(self._maskers))]  # the least recently used
        self._maskers[spec] = masker
        return masker
