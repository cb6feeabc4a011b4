"""The router's own in-flight accounting, updated the instant it routes.

Routers that only learn load from a periodic poll send a whole burst to the engine that looked
idle at the last poll. Here `begin` charges the engine at once with the request and its
uncached prefill work (and notes the cached rest of its prompt, which the engine's polled queue
still counts: `Candidate.pending_prefill_tokens`); `first_token` releases the prefill work (the
engine reported its first token, so the prompt is computed); `finish` releases the request.
Every call is idempotent per request id, so a retried or duplicated notification never drives a
counter negative.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.router.model import InFlight

# An engine with nothing in flight (InFlight is immutable, so one instance serves them all).
_IDLE = InFlight()


@dataclass(slots=True)
class _Entry:
    engine_id: str
    prefill_tokens: int
    cached_tokens: int
    context_blocks: int
    prefilling: bool = True


class InFlightTracker:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_engine: dict[str, InFlight] = {}

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

    def of(self, engine_id: str) -> InFlight:
        return self._by_engine.get(engine_id, _IDLE)

    def begin(
        self,
        request_id: str,
        engine_id: str,
        prefill_tokens: int,
        context_blocks: int,
        cached_tokens: int = 0,
    ) -> None:
        """Charge `engine_id` with a request (`prefill_tokens` to compute, `cached_tokens` of
        its prompt expected from the engine's cache); a request id already in flight is
        moved."""
        if request_id in self._entries:
            self.finish(request_id)
        self._entries[request_id] = _Entry(engine_id, prefill_tokens, cached_tokens, context_blocks)
        self._add(
            engine_id,
            requests=1,
            prefilling=1,
            prefill_tokens=prefill_tokens,
            prefill_cached_tokens=cached_tokens,
            context_blocks=context_blocks,
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
        self._add(entry.engine_id, requests=-1, context_blocks=-entry.context_blocks)

    def drop_engine(self, engine_id: str) -> list[str]:
        """Forget every request on `engine_id` (it died or was removed); returns their ids."""
        dropped = self.request_ids(engine_id)
        for rid in dropped:
            del self._entries[rid]
        self._by_engine.pop(engine_id, None)
        return dropped

    def _add(
        self,
        engine_id: str,
        *,
        requests: int = 0,
        prefilling: int = 0,
        prefill_tokens: int = 0,
        prefill_cached_tokens: int = 0,
        context_blocks: int = 0,
    ) -> None:
        """Apply a change to the engine's totals (a new snapshot: candidates already built keep
        the one they were given)."""
        old = self._by_engine.get(engine_id, _IDLE)
        new = InFlight(
            requests=old.requests + requests,
            prefilling=old.prefilling + prefilling,
            prefill_tokens=old.prefill_tokens + prefill_tokens,
            prefill_cached_tokens=old.prefill_cached_tokens + prefill_cached_tokens,
            context_blocks=old.context_blocks + context_blocks,
        )
        if new.requests == 0:
            self._by_engine.pop(engine_id, None)
        else:
            self._by_engine[engine_id] = new
