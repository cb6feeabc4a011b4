"""Per-engine outcomes of the gateway's fanned-out calls (Abort, LoadLora, UnloadLora,
ListLoras). The seed's replies have no per-engine field, so the gateway sends them in the
call's trailing metadata, success or failure: one `kvplane-engine-outcome` entry per engine,
a JSON object `{"engine": ADDRESS, "instance_id": ID, "outcome": "ok" | "skipped" |
"not_loaded" | STATUS, "detail": TEXT, "adapters": [NAMES]}` ("detail" and "adapters" only
when there is something to say)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

OUTCOME_METADATA_KEY = "kvplane-engine-outcome"


def read_outcomes(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[dict[str, Any]]:
    """The entries in a call's trailing metadata, in the order the gateway sent them."""
    entries = []
    for key, value in metadata or ():
        if key == OUTCOME_METADATA_KEY:
            entries.append(json.loads(value))
    return entries
