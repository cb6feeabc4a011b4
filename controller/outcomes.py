"""Per-engine outcomes of the gateway's fanned-out calls (Abort, LoadLora, UnloadLora,
ListLoras). The seed's replies have no per-engine field, so the gateway sends them in the
call's trailing metadata, success or failure: one `kvplane-engine-outcome` entry per engine,
a JSON object `{"engine": ADDRESS, "instance_id": ID, "outcome": "ok" | "skipped" |
"not_loaded" | STATUS, "detail": TEXT, "adapters": [NAMES]}` ("detail" and "adapters" only
when there is something to say). gRPC clients refuse trailing metadata beyond 8-16 KB, so a
large fleet's entries are capped (`outcome_metadata`): failures first, and a last entry
`{"truncated": N}` counting the engines left out.

The other way round, a LoRA call (LoadLora, UnloadLora, ListLoras) may name the one engine
it is for in its request metadata: `kvplane-engine: ENGINE` (an instance id or an address of
the fleet); the gateway then asks that engine only and reports its outcome alone. A LoadLora
may name the base model the adapter is for: `kvplane-model: MODEL`; the gateway then asks the
engines serving that model only, or, with `kvplane-engine`, that engine, which must serve it
(and passes the metadata on, for a controller fronted as an engine), and the fleet's LoRA
intent remembers the model (controller.lora_intent)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

OUTCOME_METADATA_KEY = "kvplane-engine-outcome"
ENGINE_METADATA_KEY = "kvplane-engine"
MODEL_METADATA_KEY = "kvplane-model"
# Bytes of outcome entries one call carries (gRPC's default client limit is 8 KiB soft, 16 KiB
# hard, for all the metadata together).
MAX_OUTCOME_BYTES = 6_000


def outcome_metadata(entries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The trailing metadata for `entries` (one per engine, in fleet order), within
    MAX_OUTCOME_BYTES: entries whose outcome is not "ok" go first, then the rest in order,
    as long as they fit; the count of those left out ends the list."""
    ordered = [e for e in entries if e.get("outcome") != "ok"]
    ordered += [e for e in entries if e.get("outcome") == "ok"]
    out: list[tuple[str, str]] = []
    size = 0
    for i, entry in enumerate(ordered):
        value = json.dumps(entry, sort_keys=True)
        size += len(OUTCOME_METADATA_KEY) + len(value)
        if size > MAX_OUTCOME_BYTES:
            out.append((OUTCOME_METADATA_KEY, json.dumps({"truncated": len(ordered) - i})))
            break
        out.append((OUTCOME_METADATA_KEY, value))
    return out


def lora_model_metadata(model: str | None) -> tuple[tuple[str, str], ...]:
    """The request metadata of a LoadLora for the engines serving `model` (none: None)."""
    return ((MODEL_METADATA_KEY, model),) if model else ()


def read_outcomes(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[dict[str, Any]]:
    """The entries in a call's trailing metadata, in the order the gateway sent them."""
    entries = []
    for key, value in metadata or ():
        if key == OUTCOME_METADATA_KEY:
            entries.append(json.loads(value))
    return entries
