"""A KV-event batch's event lag: the controller's wall clock when the batch is in the index
minus the engine's timestamp on it (engine and controller clocks must agree, NTP).

Some stamps cannot be when the batch was produced: 0 or another time decades back (an engine
that stamps nothing where the format has no "unset", an engine whose clock was never set), or
a time well ahead of the controller's (a clock set wrong). Taken as lag they read as ~1.8e9 s,
or as no lag at all, and a single one spoils the lag histogram's sum for good. Such a stamp is
not taken as lag: the fleet counts it and warns once per source (`Fleet._event_applied`)."""

from __future__ import annotations

# Lag past this is taken for a clock off, not a backlog: a source replays at most what its
# engine's replay buffer holds (vLLM's: its last 10,000 steps, minutes of work), so real lag
# stays in seconds to minutes (the lag histogram's top bucket is 60 s).
MAX_PLAUSIBLE_LAG_S = 3600.0
# Two NTP-synced clocks agree within milliseconds: a stamp up to this far in the controller's
# future is skew and reads as no lag; further ahead, the engine's clock is wrong.
MAX_CLOCK_LEAD_S = 1.0


def event_lag_s(stamped_unix_s: float, now_unix_s: float) -> float | None:
    """The lag of a batch stamped at `stamped_unix_s` and in the index at `now_unix_s` (unix
    seconds); None when the stamp is implausible (see the module's docstring)."""
    lag_s = now_unix_s - stamped_unix_s
    if lag_s > MAX_PLAUSIBLE_LAG_S or lag_s < -MAX_CLOCK_LEAD_S:
        return None
    return max(0.0, lag_s)
