"""The version of the fleet view a controller's gateway serves: what its GetEngineInfo and
GetModelInfo tell a controller fronting it as an engine (the models the fleet serves, each
one's facts as its engines report them: block size, pooling tasks, generation, LoRA support,
request limits and options; the controllers it fronts), as a short digest sent in GetLoad's
`attributes` and in GetEngineInfo's trailing metadata under `FLEET_VIEW_KEY`. It moves only
when that view does, not with load or health: an upper controller reads the identity again
when it moves (`Fleet._poll`), so an engine of a new model joining the lower fleet, or the
last engine of a model leaving it, reaches the upper's routing at its next GetLoad poll."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from controller.registry import EngineIdentity, EngineRecord, EngineState

FLEET_VIEW_KEY = "kvplane-fleet-view"


def fleet_view(records: Iterable[EngineRecord]) -> str:
    """The digest of what the fleet's engines (those read and not incompatible, as
    GetEngineInfo lists them) tell of themselves."""
    described = sorted(
        {
            _described(r.identity)
            for r in records
            if r.identity is not None and r.state is not EngineState.INCOMPATIBLE
        }
    )
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]


def _described(identity: EngineIdentity) -> str:
    """One engine's part of the view, in a canonical text (no set order in it)."""
    parts = []
    for model in identity.models:
        facts = identity.facts_of(model)
        tasks = ",".join(sorted(facts.tasks))
        limits = ",".join(f"{path}={value}" for path, value in facts.limits)
        unsupported = ",".join(sorted(facts.unsupported))
        parts.append(
            f"{model}:{facts.block_size}:{facts.supports_lora}:{facts.generates}:{tasks}:{limits}"
            f":{unsupported}"
        )
    if identity.is_controller:
        fronted = sorted(identity.fronted_controller_ids | {identity.instance_id})
        parts.append("fronts:" + ",".join(fronted))
    return " ".join(parts)
