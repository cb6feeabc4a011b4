"""kvplane.backoff: the doubling retry wait every retrying loop of the indexer and the
controller takes."""

from __future__ import annotations

from kvplane.backoff import Backoff


def test_waits_double_up_to_the_ceiling() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.take() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_a_success_starts_the_next_failures_from_the_first_wait() -> None:
    backoff = Backoff(0.1, 5.0)
    backoff.take()
    backoff.take()
    assert backoff.next_s == 0.4
    backoff.reset()
    assert backoff.next_s == 0.1
    assert [backoff.take() for _ in range(2)] == [0.1, 0.2]
