"""What the planner core sees: the fleet's engines and the work they did since the last tick.

Frozen, slotted dataclasses, free of protobuf: the adapters fill them from `GetLoad`
(`EngineLoad`) and `SubscribeRuntimeEvents` (`ForwardPasses` from FORWARD_PASS events), the
offline replay from the simulated engines.
Times are seconds on the caller's clock (wall or virtual): the core never reads one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineRole(enum.Enum):
    """What an engine computes (GetEngineInfo's role): which SLA bounds its pool is sized by
    (planner.core.capacity)."""

    AGGREGATED = "aggregated"  # prompts and decode steps in one batch
    PREFILL = "prefill"  # prompts only: hands each prompt's KV to a decode engine
    DECODE = "decode"  # decodes; pulls the prompt's KV, computes only what it lacks


class EngineState(enum.Enum):
    STARTING = "starting"  # asked for, not serving yet: capacity still pending
    SERVING = "serving"
    DRAINING = "draining"  # takes no new requests; removed once it holds none


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's GetLoad."""

    running_requests: int
    queued_requests: int
    # Prompt tokens of queued requests not computed yet: GetLoad's waiting_tokens, each queued
    # prompt whole (its cached prefix is found only when the engine admits it).
    waiting_prefill_tokens: int
    used_kv_blocks: int
    total_kv_blocks: int
    kv_block_size: int = 16  # tokens per block (GetModelInfo's kv_block_size)
    # False when the engine does not report its running or queued requests (GetLoad's counts
    # are optional): the counts above are then the last reported, or 0, and say nothing of
    # whether it holds a request.
    requests_known: bool = True
    # KV sessions a prefill engine opened that no decode engine has pulled yet (GetLoad's
    # active_kv_sessions): a drain completes only once these are gone too (the seed's
    # DrainResponse: "no requests or KV sessions remain"); stopping the engine earlier loses
    # the prompts' KV under the decode engines about to pull it.
    active_kv_sessions: int = 0

    @property
    def num_requests(self) -> int:
        return self.running_requests + self.queued_requests

    @property
    def kv_usage(self) -> float:
        return self.used_kv_blocks / self.total_kv_blocks if self.total_kv_blocks else 0.0

    def kv_demand(self, queued_new_share: float) -> float:
        """KV in use plus what the queued prompts will take into use, in this engine's caches
        (can exceed 1: a saturated engine's usage stops at 1, its demand does not), of which
        `queued_new_share` of the waiting tokens take blocks not in use now (the rest: prefix
        hits on blocks running requests hold, counted in `used_kv_blocks` already)."""
        if not self.total_kv_blocks:
            return 0.0
        capacity_tokens = self.total_kv_blocks * self.kv_block_size
        queued_tokens = self.waiting_prefill_tokens * queued_new_share
        return (self.used_kv_blocks * self.kv_block_size + queued_tokens) / capacity_tokens


IDLE = EngineLoad(0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class EngineObservation:
    engine_id: str
    pool: str
    state: EngineState
    load: EngineLoad = IDLE  # IDLE while starting (nothing to poll yet)
    # What the engine says it is (GetEngineInfo's role); None while starting or when it does
    # not say (ENGINE_ROLE_UNSPECIFIED, no GetEngineInfo).
    role: EngineRole | None = None
    # Blocks the controller's index places on the engine (ListWorkers' indexed_blocks): the
    # cached prefixes the fleet loses with it. 0 when not known.
    indexed_blocks: int = 0

    @property
    def is_drained(self) -> bool:
        """Draining and known to hold no request and no open KV session: an engine whose
        counts are unknown is never taken for empty."""
        return (
            self.state is EngineState.DRAINING
            and self.load.requests_known
            and self.load.num_requests == 0
            and self.load.active_kv_sessions == 0
        )


@dataclass(frozen=True, slots=True)
class ForwardPasses:
    """Forward passes of one engine: one FORWARD_PASS event (num_passes=1), or the sum of
    several (a cost model that is linear in its inputs fits sums as well as single passes)."""

    engine_id: str
    num_passes: int
    duration_s: float
    num_prefill_tokens: int
    # Sequences that computed prompt tokens, summed over the passes (batch_size minus
    # num_decode_sequences of each event): a prompt split into chunks counts once per chunk.
    num_prefill_sequences: int = 0
    # Prompt tokens the prefix cache already held for the sequences admitted in these passes
    # (the event's num_cached_tokens): not computed. 0 when the engine does not say.
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Observations:
    """One tick's input: every engine the actuator knows (its pool and state), and the passes
    they reported since the previous tick."""

    engines: tuple[EngineObservation, ...]
    passes: tuple[ForwardPasses, ...] = ()

    def in_pool(self, pool: str) -> list[EngineObservation]:
        return [e for e in self.engines if e.pool == pool]
