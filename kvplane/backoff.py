"""The wait before a loop tries again what failed (the indexer's sources and bridge, its Redis
recovery, the controller's replica sync): doubling from `initial_s` up to `max_s` with each
failure in a row, and back to `initial_s` once an attempt succeeds (`reset`), so one episode of
failures does not lengthen the first wait of the next."""

from __future__ import annotations


class Backoff:
    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        # The wait the next failure takes (`take`).
        self.next_s = initial_s

    def take(self) -> float:
        """The wait after a failure; the next failure in a row waits twice as long."""
        delay = self.next_s
        self.next_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits `initial_s` again."""
        self.next_s = self.initial_s
