"""ZMTP heartbeats: how a ZMQ peer that falls silent without closing its connection is found.

A SUB never sends on its own, so when a publisher's host freezes, its network is cut or its
process is stopped, TCP sees nothing and the connection looks alive for good. With
heartbeats libzmq pings the peer and closes a connection that brings nothing back in time;
the socket monitor then reports the disconnect as if the peer had closed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

# libzmq's bounds: the TTL travels in deciseconds in 16 bits (6553.5 s at most), and one below
# a decisecond would be sent as 0, i.e. no TTL.
HEARTBEAT_MIN_S = 0.1
HEARTBEAT_MAX_S = 6553.5


def seconds_problem(value: float) -> str | None:
    """Why `value` cannot be a heartbeat interval or timeout, or None."""
    if HEARTBEAT_MIN_S <= value <= HEARTBEAT_MAX_S:
        return None
    return f"must be between {HEARTBEAT_MIN_S} and {HEARTBEAT_MAX_S} seconds, got {value}"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """ZMTP heartbeats on a SUB: a PING every `interval_s`; a connection that brings nothing
    back (no PONG, no message) within `timeout_s` of a PING is closed. The publisher also drops
    the SUB after `timeout_s` without a PING from it (ZMTP's TTL), so a stopped indexer frees
    the publisher's queue for it. A new connection whose ZMTP handshake brings nothing back
    within `timeout_s` is closed too (libzmq's handshake interval, 30 s unless set): the
    kernel of a stopped process still accepts TCP connections, which then carry nothing;
    libzmq dials again after it.

    PINGs are answered by the publisher's libzmq I/O thread, not its Python code: a busy engine
    or a GC pause (on either side) still answers; only a stopped process, a frozen host or a
    cut network does not. The defaults clear a silent publisher's worker 20 to 25 s after it
    went quiet and ride out a network stall shorter than 20 s (TCP retransmits within that);
    a clear that was not needed costs one replay at the reconnection (docs/indexer.md)."""

    interval_s: float = 5.0
    timeout_s: float = 20.0

    def problem(self) -> str | None:
        """Why libzmq cannot take these values, or None."""
        for name, value in (("interval_s", self.interval_s), ("timeout_s", self.timeout_s)):
            problem = seconds_problem(value)
            if problem is not None:
                return f"heartbeat_{name} {problem}"
        return None

    def apply_to(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.HEARTBEAT_IVL, round(self.interval_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(self.timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, round(self.timeout_s * 1000))
        sock.setsockopt(zmq.HANDSHAKE_IVL, round(self.timeout_s * 1000))


DEFAULT_HEARTBEAT = Heartbeat()
