"""A short seeded soak of the indexer fleet (tests/indexer/soak.py, docs/soak.md) in CI: real
processes (redis, two `kvplane indexer serve` replicas with the same ZMQ and OpenEngine
sources, a `kvplane indexer bridge` into one of them, four sim engines), a few random faults,
and after each the shared index exactly the engines' blocks, both replicas answering every
prefix query alike, no query failed outside a fault window, no process left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.indexer.soak import IndexerSoak
from tests.soak_fleet import CI_AFTERMATH_S, CI_STEADY_S, drive

# Draws each kind of fault once: the bridged engine restarted, a resync asked of a replica
# while the other (holding the lease or not) is stopped, a resync of the OpenEngine-fed engine
# through the non-holder, redis-server restarted empty, ...
SEED = 1358
FAULTS = 7


@pytest.mark.timeout(240)
async def test_a_short_seeded_indexer_soak_converges_after_every_fault(tmp_path: Path) -> None:
    soak = IndexerSoak(tmp_path, SEED)
    report = await drive(
        soak, seconds=60, max_faults=FAULTS, steady_s=CI_STEADY_S, aftermath_s=CI_AFTERMATH_S
    )
    assert not report.failures, report.summary()
    assert sum(report.faults.values()) == FAULTS, report.summary()
    assert report.requests["MatchTokens ok"] > 0, report.summary()
    assert report.requests["MatchExternalKvPrefix ok"] > 0, report.summary()
