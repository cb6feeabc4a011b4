"""Which engine stamps on KV-event batches are taken as event lag (`controller.event_lag`)."""

from __future__ import annotations

from controller.event_lag import MAX_CLOCK_LEAD_S, MAX_PLAUSIBLE_LAG_S, event_lag_s

NOW = 1_800_000_000.0


def test_a_backlog_is_lag_and_a_small_skew_ahead_is_none() -> None:
    assert event_lag_s(NOW - 0.25, NOW) == 0.25
    assert event_lag_s(NOW - MAX_PLAUSIBLE_LAG_S, NOW) == MAX_PLAUSIBLE_LAG_S  # an old replay
    assert event_lag_s(NOW + MAX_CLOCK_LEAD_S, NOW) == 0.0  # clocks a little apart


def test_stamps_no_clock_could_have_given_are_not_lag() -> None:
    assert event_lag_s(0.0, NOW) is None  # unstamped, or a clock never set
    assert event_lag_s(NOW - MAX_PLAUSIBLE_LAG_S - 1, NOW) is None
    assert event_lag_s(NOW + MAX_CLOCK_LEAD_S + 1, NOW) is None  # a clock set ahead
