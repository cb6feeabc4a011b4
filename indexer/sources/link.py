"""Whether a KV-event source's stream from its engine is up: what an operator asks when the
index may be stale for one engine only (`kvplane admin workers`, the controller's
`kvplane_controller_engine_kv_events_up`).

A source may be running while it reaches nothing (a ZMQ publisher nothing listens for, a
SubscribeKvEvents call failing and retried): its counters and `stream_lost` do not say so.
Each source keeps a `Link` instead, moved by what it sees itself: a ZMQ SUB's monitor (the
publisher's ZMTP handshake, its disconnection), a SubscribeKvEvents call reaching the engine
and its end."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Link:
    """The stream's state: `up` since `since_unix_s`, or down since then for `reason`;
    `ever_up`: it was up once (down after that, not still connecting). Wall-clock time: an
    operator reads it as a time of day, and it stays the same from one look to the next."""

    reason: str = "connecting"
    up: bool = False
    ever_up: bool = False
    clock: Callable[[], float] = time.time
    since_unix_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.since_unix_s = self.clock()

    def went_up(self) -> None:
        if not self.up:
            self.up = self.ever_up = True
            self.since_unix_s = self.clock()
            self.reason = ""

    def went_down(self, reason: str) -> None:
        """Down for `reason` (since now if it was up; a later reason replaces an earlier)."""
        if self.up:
            self.up = False
            self.since_unix_s = self.clock()
        self.reason = reason


def weakest(links: Iterable[tuple[str, Link]]) -> Link:
    """One link for several (an engine's data-parallel ranks, each named): up while all are
    (since the last came up), else the first one down, its reason naming its rank."""
    named = list(links)
    down = [(name, link) for name, link in named if not link.up]
    if not down:
        return max((link for _, link in named), key=lambda link: link.since_unix_s)
    name, link = down[0]
    prefix = f"{name}: " if len(named) > 1 else ""
    named_link = Link(f"{prefix}{link.reason}", False, link.ever_up, link.clock)
    named_link.since_unix_s = link.since_unix_s
    return named_link
