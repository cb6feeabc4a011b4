"""The router's own in-flight accounting, updated the instant it routes.

Routers that only learn load from a periodic poll send a whole burst to the engine that looked
idle at the last poll. Here `begin` charges the engine at once with the request and its
uncached prefill work (and notes the cached rest of its prompt, which the engine's polled queue
still counts: `Candidate.pending_prefill_tokens`); `first_token` releases the prefill work (the
engine reported its first token, so the prompt is computed); `finish` releases the request.
Every call is idempotent per request id, so a retried or duplicated notification never drives a
counter negative.

A tracker built with `count_blocks` also refcounts each engine's active block keys, from
`begin` to `finish`: blocks that several active requests share (a common prefix) count once
(`InFlight.active_blocks`), and `active_prefix` says how many of a new prompt's blocks are
already active there, and how many active requests share all of them. Only policies that read
them pay for it (`Policy.counts_active_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controller.router.model import InFlight

# An engine with nothing in flight (InFlight is immutable, so one instance serves them all).
_IDLE = InFlight()


@dataclass(slots=True)
class _Entry:
    engine_id: str
    prefill_tokens: int
    cached_tokens: int
    block_keys: Sequence[int]
    prefilling: bool = True


class InFlightTracker:
    def __init__(self, count_blocks: bool = False) -> None:
        self.count_blocks = count_blocks
        self._entries: dict[str, _Entry] = {}
        self._by_engine: dict[str, InFlight] = {}
        # Per engine, how many active requests hold each block key (count_blocks only).
        self._block_refs: dict[str, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def engine_of(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return entry.engine_id if entry is not None else None

    def request_ids(self, engine_id: str | None = None) -> list[str]:
        return [
            rid
            for rid, entry in self._entries.items()
            if engine_id is None or entry.engine_id == engine_id
        ]

    def is_prefilling(self, request_id: str) -> bool:
        """Whether the request is in flight and has not had its first token."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.prefilling

    def of(self, engine_id: str) -> InFlight:
        return self._by_engine.get(engine_id, _IDLE)

    def active_prefix(self, engine_id: str, block_keys: Sequence[int]) -> tuple[int, int]:
        """How many of `block_keys`, from the first, the engine's active requests hold, and
        how many of those requests hold all of them (the last one's refcount: a request that
        holds a block holds the blocks before it). (0, 0) unless counting."""
        refs = self._block_refs.get(engine_id)
        if not refs:
            return 0, 0
        # Chained keys (each names its whole prefix): the active ones are the prompt's first
        # ones, so the walk stops at the first that is not active rather than looking up all
        # of them (a long prompt, at every engine with requests in flight: intersecting its
        # 416 keys took 60% of a decision at 256 engines).
        overlap = 0
        for key in block_keys:
            if key not in refs:
                break
            overlap += 1
        return overlap, refs[block_keys[overlap - 1]] if overlap else 0

    def begin(
        self,
        request_id: str,
        engine_id: str,
        prefill_tokens: int,
        cached_tokens: int = 0,
        block_keys: Sequence[int] = (),
    ) -> None:
        """Charge `engine_id` with a request (`prefill_tokens` to compute, `cached_tokens` of
        its prompt expected from the engine's cache, the prompt's `block_keys`); a request id
        already in flight is moved."""
        if request_id in self._entries:
            self.finish(request_id)
        keys = block_keys if self.count_blocks else ()
        self._entries[request_id] = _Entry(engine_id, prefill_tokens, cached_tokens, keys)
        self._add(
            engine_id,
            requests=1,
            prefilling=1,
            prefill_tokens=prefill_tokens,
            prefill_cached_tokens=cached_tokens,
            active_blocks=self._hold(engine_id, keys),
        )

    def first_token(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is None or not entry.prefilling:
            return
        entry.prefilling = False
        self._add(
            entry.engine_id,
            prefilling=-1,
            prefill_tokens=-entry.prefill_tokens,
            prefill_cached_tokens=-entry.cached_tokens,
        )

    def finish(self, request_id: str) -> None:
        self.first_token(request_id)  # ended before its first token: its prefill is off too
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        released = self._release(entry.engine_id, entry.block_keys)
        self._add(entry.engine_id, requests=-1, active_blocks=-released)

    def drop_engine(self, engine_id: str) -> list[str]:
        """Forget every request on `engine_id` (it died or was removed); returns their ids."""
        dropped = self.request_ids(engine_id)
        for rid in dropped:
            del self._entries[rid]
        self._by_engine.pop(engine_id, None)
        self._block_refs.pop(engine_id, None)
        return dropped

    def _hold(self, engine_id: str, block_keys: Sequence[int]) -> int:
        """Take a reference on each key; returns how many keys were not active before."""
        if not block_keys:
            return 0
        refs = self._block_refs.setdefault(engine_id, {})
        new = 0
        for key in block_keys:
            count = refs.get(key, 0)
            if count == 0:
                new += 1
            refs[key] = count + 1
        return new

    def _release(self, engine_id: str, block_keys: Sequence[int]) -> int:
        """Drop a reference on each key; returns how many keys are no longer active."""
        refs = self._block_refs.get(engine_id)
        if refs is None or not block_keys:
            return 0
        gone = 0
        for key in block_keys:
            count = refs.get(key, 0) - 1
            if count > 0:
                refs[key] = count
            elif key in refs:
                del refs[key]
                gone += 1
        if not refs:
            del self._block_refs[engine_id]
        return gone

    def _add(
        self,
        engine_id: str,
        *,
        requests: int = 0,
        prefilling: int = 0,
        prefill_tokens: int = 0,
        prefill_cached_tokens: int = 0,
        active_blocks: int = 0,
    ) -> None:
        """Apply a change to the engine's totals (a new snapshot: candidates already built keep
        the one they were given)."""
        old = self._by_engine.get(engine_id, _IDLE)
        new = InFlight(
            requests=old.requests + requests,
            prefilling=old.prefilling + prefilling,
            prefill_tokens=old.prefill_tokens + prefill_tokens,
            prefill_cached_tokens=old.prefill_cached_tokens + prefill_cached_tokens,
            active_blocks=old.active_blocks + active_blocks,
        )
        if new.requests == 0:
            self._by_engine.pop(engine_id, None)
        else:
            self._by_engine[engine_id] = new
