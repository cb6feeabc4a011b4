"""The KV-aware router: a pure core (no I/O; time and randomness passed in) used unchanged by
the gateway and by the trace replay. `make_policy(name)` builds a policy by its config name."""

from __future__ import annotations

from controller.router.model import (
    Candidate,
    Decision,
    EngineCost,
    Hop,
    InFlight,
    LoadSnapshot,
    PrefixHit,
    Reason,
    RouteRequest,
    cacheable_blocks,
)
from controller.router.peers import DynamoCost, LlmdLongestPrefix, SglangCacheAware
from controller.router.policies import (
    KvplanePolicy,
    KvplaneWeights,
    LeastLoaded,
    Policy,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
)
from controller.router.router import (
    APPROXIMATE_TTL_S,
    AllEnginesBusyError,
    BusyThresholds,
    DisaggDecision,
    NoEngineAvailableError,
    Router,
)

POLICY_NAMES: tuple[str, ...] = (
    "kvplane",
    "round_robin",
    "least_loaded",
    "power_of_two",
    "random",
    "sglang_cache_aware",
    "dynamo_cost",
    "llmd_longest_prefix",
)


def make_policy(name: str, kvplane_weights: KvplaneWeights | None = None) -> Policy:
    """A fresh policy by its config name; raises ValueError for an unknown name."""
    policies: dict[str, Policy] = {
        "kvplane": KvplanePolicy(kvplane_weights),
        "round_robin": RoundRobin(),
        "least_loaded": LeastLoaded(),
        "power_of_two": PowerOfTwo(),
        "random": RandomChoice(),
        "sglang_cache_aware": SglangCacheAware(),
        "dynamo_cost": DynamoCost(),
        "llmd_longest_prefix": LlmdLongestPrefix(),
    }
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return policies[name]


__all__ = [
    "APPROXIMATE_TTL_S",
    "POLICY_NAMES",
    "AllEnginesBusyError",
    "BusyThresholds",
    "Candidate",
    "Decision",
    "DisaggDecision",
    "EngineCost",
    "Hop",
    "InFlight",
    "KvplaneWeights",
    "LoadSnapshot",
    "NoEngineAvailableError",
    "Policy",
    "PrefixHit",
    "Reason",
    "RouteRequest",
    "Router",
    "cacheable_blocks",
    "make_policy",
]
