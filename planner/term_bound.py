"""How long a planner's call to another system (the Kubernetes API, the controller's admin API)
may run: its own bound, and for a leader's no longer than what is left of its term (`left_s`:
the time to its renew deadline, `LeaderElector.left_s`), read as the call begins. So none a
leader makes outlives its term by more than the margin before a standby may take over,
whatever the other side does (hung: it accepts the connection and never answers), and none
is sent once the term may have ended (0 left: it fails at once)."""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

# Seconds left of a leader's term (`LeaderElector.left_s`).
TimeLeft = Callable[[], float]


@overload
def bounded_s(timeout_s: float, left_s: TimeLeft | None) -> float: ...
@overload
def bounded_s(timeout_s: None, left_s: TimeLeft | None) -> float | None: ...
def bounded_s(timeout_s: float | None, left_s: TimeLeft | None) -> float | None:
    """The time a call bounded by `timeout_s` (None: unbounded) may run within `left_s`
    (None: not a leader's call)."""
    if left_s is None:
        return timeout_s
    left = max(0.0, left_s())
    return left if timeout_s is None else min(timeout_s, left)
