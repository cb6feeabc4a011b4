"""The gateway's per-engine outcomes stay within what gRPC clients accept as metadata."""

from __future__ import annotations

import json

from controller.outcomes import (
    MAX_OUTCOME_BYTES,
    OUTCOME_METADATA_KEY,
    outcome_metadata,
    read_outcomes,
)


def _entry(i: int, outcome: str = "ok") -> dict[str, object]:
    return {
        "engine": f"10.0.{i // 256}.{i % 256}:9000",
        "instance_id": f"engine-{i:04d}",
        "outcome": outcome,
        "adapters": [f"adapter-{j}" for j in range(3)],
    }


def test_a_small_fleet_gets_every_entry_in_order() -> None:
    entries = [_entry(0), _entry(1, "UNAVAILABLE"), _entry(2)]
    metadata = outcome_metadata(entries)
    # Failures first, then the rest in fleet order.
    assert read_outcomes(metadata) == [entries[1], entries[0], entries[2]]


def test_a_large_fleet_is_capped_failures_first_with_a_count_of_the_rest() -> None:
    entries = [_entry(i, "NOT_FOUND" if i == 150 else "ok") for i in range(200)]
    metadata = outcome_metadata(entries)
    assert sum(len(k) + len(v) for k, v in metadata) <= MAX_OUTCOME_BYTES + 100
    read = read_outcomes(metadata)
    assert read[0]["instance_id"] == "engine-0150"  # the failure is never the one dropped
    shown = [e for e in read if "truncated" not in e]
    assert read[-1] == {"truncated": 200 - len(shown)}
    assert all(k == OUTCOME_METADATA_KEY for k, _ in metadata)
    assert json.loads(metadata[-1][1])["truncated"] > 0
