"""The index-size gauges, `kvplane_<component>_index_{blocks,placements,workers}`, of the
controller and of `kvplane indexer serve`: the figures of the index's last `stats()`.

A backend is async and /metrics is served from a thread, so the owner reads `stats()` on its
event loop (`refresh_index_size` or its own periodic task) and records the figures here; the
collector exports the last ones. No series before the first read succeeds, after a read that
failed, nor while the index does not answer (its `index_reachable` 0): a size frozen at the
last value read would tell a dashboard the index still holds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily

from indexer.backend import IndexBackend, IndexStats

log = logging.getLogger(__name__)

# The shortest wait between two reads of the indexer's own index (the controller's period).
MIN_REFRESH_S = 5.0
# A read of a shared Redis index walks all of it (`kvp_dump`, bucket range by bucket range,
# decoded here: about 5 s for 1M blocks), so the wait after a read is this many times as long
# as the read took: the refresh costs at most a tenth of the event loop on any index size.
REFRESH_COST_FACTOR = 10.0


def refresh_wait_s(read_s: float, minimum_s: float = MIN_REFRESH_S) -> float:
    """How long to wait before the next read of the index's size, after one that took
    `read_s`: `minimum_s`, or REFRESH_COST_FACTOR times as long as the read when longer."""
    return max(minimum_s, REFRESH_COST_FACTOR * read_s)


class IndexSizeGauges:
    """Prometheus collector of the last index size recorded, exported while `answers()`."""

    def __init__(self, component: str, answers: Callable[[], bool]) -> None:
        self._prefix = f"kvplane_{component}_index"
        self._answers = answers
        self._last: IndexStats | None = None

    def record(self, stats: IndexStats | None) -> None:
        """The figures of a read of the index's `stats()`; None: the read failed."""
        self._last = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._last
        families = (
            (GaugeMetricFamily(f"{self._prefix}_blocks", "Blocks in the index"), "num_blocks"),
            (
                GaugeMetricFamily(f"{self._prefix}_placements", "Placements in the index"),
                "num_placements",
            ),
            (GaugeMetricFamily(f"{self._prefix}_workers", "Workers in the index"), None),
        )
        shown = stats is not None and self._answers()
        for family, field in families:
            if shown:
                assert stats is not None
                value = len(stats.workers) if field is None else getattr(stats, field)
                family.add_metric([], value)
            yield family


async def refresh_index_size(backend: IndexBackend, gauges: IndexSizeGauges) -> None:
    """Forever: read `backend.stats()` into `gauges`, then wait (`refresh_wait_s`). A failed
    read (a shared index down) is logged when the failures start and when they end."""
    failing = False
    while True:
        started = time.monotonic()
        try:
            stats: IndexStats | None = await backend.stats()
        except Exception as exc:
            stats = None
            if not failing:
                log.warning("index size not read (asked again later): %s", exc)
            failing = True
        else:
            if failing:
                log.info("index size read again")
            failing = False
        gauges.record(stats)
        await asyncio.sleep(refresh_wait_s(time.monotonic() - started))
