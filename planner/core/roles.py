"""A pool's role: what its engines compute, so which SLA bounds size it (planner.core.capacity).

What the engines say wins (GetEngineInfo's role, carried by each observation): they know what
they were started as, while a pool's configured `role` is only what the operator wrote. The
configured role stands until an engine reports one (before any engine serves, and for engines
that report none). A pool whose engines report different roles is not a prefill nor a decode
pool: it is sized as aggregated engines, the sizing that holds every bound, and said.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.core.observations import EngineObservation, EngineRole


@dataclass(frozen=True, slots=True)
class PoolRole:
    role: EngineRole
    # Why the role sized for is not simply what every engine and the configuration agree on
    # (a line for the planner's log); None when nothing is amiss.
    warning: str | None = None


def pool_role(
    pool: str, configured: EngineRole | None, engines: Iterable[EngineObservation]
) -> PoolRole:
    """The role `pool` is sized as (the module docstring's rules)."""
    reported = sorted({e.role for e in engines if e.role is not None}, key=lambda r: r.value)
    if len(reported) > 1:
        names = ", ".join(r.value for r in reported)
        return PoolRole(
            EngineRole.AGGREGATED,
            f"pool {pool}: its engines report different roles ({names}): sized as aggregated",
        )
    if reported:
        (role,) = reported
        if configured is not None and configured is not role:
            return PoolRole(
                role,
                f"pool {pool}: configured as {configured.value} but its engines report "
                f"{role.value}: sized as {role.value}",
            )
        return PoolRole(role)
    return PoolRole(configured or EngineRole.AGGREGATED)
