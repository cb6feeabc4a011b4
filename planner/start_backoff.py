"""How long a pool's next engine start waits after its engines failed: Kubernetes'
CrashLoopBackOff rule. An engine that cannot start (a bad model path, an engine argument it
refuses) or that crashes soon after it serves would otherwise be started again at every tick,
for good: a process spawned, a log file written and, with a real model, minutes of GPU time
loading it, each `tick_s`. A failure is a start that fails, or the loss of an engine that had
served less than `crash_within_s` (`crash`): a crash loop. An engine lost after serving longer
(killed, its node lost, OOM-killed after a while) proves the pool's engines can start and serve,
and is replaced at once, as a ReplicaSet replaces a lost pod (the kubelet backs off restarting a
container that keeps crashing, not the ReplicaSet its lost pods): it is no failure, and counted
as one, a pool whose engines are killed now and then waited longer at each, and one below its
minimum stayed empty for minutes. The engines of a pool lost in one look at the fleet are one
failure (`LivePlanner` reports each pool once per tick): several killed at once by a node
failure are not a crash loop. So are the starts of a pool one decision began that fail
(`LivePlanner` reports the first): several failing for one cause (a bad model path) are one
attempt. The first failure is retried at once (one engine crashing is replaced at the next
tick); each failure in a row after it waits twice as long, from `first_s` up to `max_s`. The
count starts over once an engine of the pool started after the last failure has served
`crash_within_s`: past the window in which its loss would be a crash, it shows the pool's new
engines start and serve again (the kubelet, with nothing but a container running to go by, waits
ten minutes). Not for the engines that served all along, or a pool of healthy engines whose new
ones cannot start (a full GPU) would be started again at every tick; and counted over the
kubelet's ten minutes, a pool whose engines are often replaced (a soak, a spot fleet) added a
rare early loss to the last for good, and its waits grew."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The defaults (`live.start_backoff_s`, `start_backoff_max_s`, `start_backoff_crash_s`).
FIRST_S = 10.0
MAX_S = 300.0
CRASH_WITHIN_S = 2.0


@dataclass(slots=True)
class _Failures:
    in_a_row: int
    last_s: float


class StartBackoff:
    def __init__(
        self,
        first_s: float = FIRST_S,
        max_s: float = MAX_S,
        crash_within_s: float = CRASH_WITHIN_S,
    ) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.crash_within_s = crash_within_s
        self._pools: dict[str, _Failures] = {}

    def crash(self, served_s: float) -> bool:
        """Whether losing an engine that served `served_s` (since it was started or adopted,
        up to its last answer) is a failure of its pool: it served less than `crash_within_s`."""
        return served_s < self.crash_within_s

    def failed(self, pool: str, now_s: float) -> float:
        """Starts of `pool` failed (any number, begun by one decision), or engines of it
        crashed (any number, in one look at the fleet: see `crash`), at `now_s`: the seconds
        its next start waits."""
        failures = self._pools.get(pool)
        if failures is None:
            failures = self._pools[pool] = _Failures(0, now_s)
        failures.in_a_row += 1
        failures.last_s = now_s
        return self._wait_s(failures)

    def serving(self, pool: str, since_s: float, served_s: float) -> None:
        """An engine of `pool` serves, since `since_s`, for `served_s` so far: its pool's
        failures are over if it began after the last and is past `crash`'s window."""
        failures = self._pools.get(pool)
        if failures is not None and since_s >= failures.last_s and not self.crash(served_s):
            del self._pools[pool]

    def wait_s(self, pool: str, now_s: float) -> float:
        """Seconds from `now_s` until a start of `pool` may begin (0: now)."""
        failures = self._pools.get(pool)
        if failures is None:
            return 0.0
        return max(0.0, failures.last_s + self._wait_s(failures) - now_s)

    def _wait_s(self, failures: _Failures) -> float:
        if failures.in_a_row <= 1:
            return 0.0
        # Doubled no further than to reach `max_s`: a pool failing for days counts thousands
        # of failures in a row, and 2.0 ** n overflows a float past n = 1023.
        most = max(0, math.ceil(math.log2(self.max_s / self.first_s)))
        return min(self.max_s, self.first_s * 2.0 ** min(failures.in_a_row - 2, most))
