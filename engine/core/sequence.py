"""One sequence: an output (`output_index`) of a request, scheduled on its own.

A request with `num_sequences = n` becomes n sequences that share the prompt (and, through the
prefix cache, its blocks once one of them has computed them). `num_computed_tokens` counts the
tokens whose KV is in the cache; the scheduler computes `num_tokens - num_computed_tokens` more,
in chunks. Preemption by recompute resets `num_computed_tokens` to 0 and frees the blocks; the
tokens already generated stay and are recomputed as part of the "prompt" on resumption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.core.api import EngineRequest
from engine.core.lora import LoraSlot


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: EngineRequest
    output_index: int
    arrival_order: int  # FCFS tie-break: smaller first
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix hits at the first admission
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    lora: LoraSlot | None = None  # the request's adapter, held since its acceptance

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def use_prefix_cache(self) -> bool:
        sampling = self.request.sampling
        # Prompt logprobs need every prompt position computed.
        return (
            not self.request.bypass_prefix_cache
            and self.caches_blocks
            and (sampling.prompt_logprobs is None or self.output_index != 0)
        )

    @property
    def caches_blocks(self) -> bool:
        """Whether its computed blocks enter the prefix cache: not when its adapter's name
        serves other weights now (`LoraSlot.superseded`), since the cache's namespace is the
        name; such a sequence takes no prefix hits either."""
        return self.lora is None or not self.lora.superseded

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
