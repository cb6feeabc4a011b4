"""A failing pool's starts back off as Kubernetes' CrashLoopBackOff does: the first failure
retried at once, then waits doubling from `first_s` up to `max_s`, over once an engine of the
pool started after the last failure has served `crash_within_s`. An engine lost is a failure
only if it served less than `crash_within_s`."""

from __future__ import annotations

from planner.start_backoff import StartBackoff


def test_waits_double_up_to_the_maximum() -> None:
    backoff = StartBackoff(10.0, 60.0, 10.0)
    assert backoff.wait_s("p", 0.0) == 0.0
    assert [backoff.failed("p", float(t)) for t in range(6)] == [0, 10, 20, 40, 60, 60]
    assert backoff.wait_s("p", 5.0) == 60.0  # from the last failure
    assert backoff.wait_s("p", 30.0) == 35.0
    assert backoff.wait_s("p", 65.0) == 0.0
    assert backoff.wait_s("other", 5.0) == 0.0  # each pool its own


def test_an_engine_started_after_the_failures_that_served_ends_them() -> None:
    backoff = StartBackoff(10.0, 60.0, 10.0)
    backoff.failed("p", 100.0)
    backoff.failed("p", 101.0)
    backoff.serving("p", since_s=110.0, served_s=9.0)  # not long enough yet
    assert backoff.wait_s("p", 105.0) == 6.0
    backoff.serving("p", since_s=110.0, served_s=10.0)
    assert backoff.wait_s("p", 105.0) == 0.0
    assert backoff.failed("p", 200.0) == 0.0  # retried at once again


def test_an_engine_that_served_all_along_does_not_end_them() -> None:
    """A pool of healthy engines whose new ones cannot start (a full GPU): still backed off."""
    backoff = StartBackoff(10.0, 60.0, 10.0)
    backoff.failed("p", 1000.0)
    backoff.failed("p", 1001.0)
    backoff.serving("p", since_s=0.0, served_s=1002.0)
    assert backoff.wait_s("p", 1002.0) == 9.0
    assert backoff.failed("p", 1011.0) == 20.0


def test_a_pool_failing_for_days_waits_the_maximum() -> None:
    """Thousands of failures in a row (an engine that cannot start, retried every `max_s` for
    days): each waits `max_s` (the doubling overflowed a float past 1024 of them)."""
    backoff = StartBackoff(10.0, 300.0, 10.0)
    waits = [backoff.failed("p", 300.0 * n) for n in range(2000)]
    assert waits[-1] == 300.0
    assert backoff.wait_s("p", 300.0 * 1999) == 300.0


def test_only_an_engine_lost_before_it_served_crash_within_s_is_a_crash() -> None:
    """Lost sooner, a crash loop; later (killed, its node lost), replaced at once."""
    backoff = StartBackoff(10.0, 60.0, 10.0)
    assert backoff.crash(0.0) and backoff.crash(9.9)
    assert not backoff.crash(10.0) and not backoff.crash(3600.0)
