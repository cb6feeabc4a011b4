"""Pooling tasks (embed, classify) as the engine thread runs them: torch-free types and the
batch plan.

A pooling request is one forward pass per batch of inputs over the model's final hidden
states, with no KV cache: nothing is scheduled, no block is allocated, nothing is cached (as
vLLM runs pooling models by default, without prefix caching). A `Pooler` (the torch runner's
`engine.torch_runner.pooling.TorchPooler`) computes one batch; the server runs each batch as an
`EngineLoop.call` command between generation steps, so a running generation only waits for
one batch, never for a whole request. `plan_batches` keeps each batch within the scheduler's
token budget (`max_num_batched_tokens`); an input longer than the budget runs alone, since a
forward without a KV cache cannot be chunked.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class PoolingType(enum.Enum):
    """Which hidden states make a sequence's vector: vLLM's names for a causal LM."""

    LAST = "last"  # the last token's (vLLM's default for causal LMs: it has seen everything)
    MEAN = "mean"  # the mean over every token
    CLS = "cls"  # the first token's


class PoolingTask(enum.Enum):
    EMBED = "embed"
    CLASSIFY = "classify"


class Activation(enum.Enum):
    """What a classification head's logits become."""

    NONE = "none"  # the logits
    PROBABILITIES = "probabilities"  # softmax, or sigmoid for a one-label head (vLLM's)
    LOG_PROBABILITIES = "log_probabilities"  # their log


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What to compute for every input of a batch.

    `per_token`: one row per token instead of one pooled vector. EMBED: `dimensions` keeps the
    first d values (Matryoshka truncation), then `normalize` scales each row to unit L2 norm
    (vLLM's order). CLASSIFY: the head on the pooled state (or on every token), then
    `activation`.
    """

    task: PoolingTask
    per_token: bool = False
    normalize: bool = True
    dimensions: int | None = None
    activation: Activation = Activation.PROBABILITIES


@dataclass(frozen=True, slots=True)
class PooledOutput:
    """One input's result: a row-major float32 tensor (`[d]`, or `[tokens, d]` per token)."""

    shape: tuple[int, ...]
    values: list[float]


class Pooler(Protocol):
    """Runs pooling batches; called on the engine thread only (it shares the model)."""

    @property
    def hidden_size(self) -> int:
        """The native embedding dimension."""
        ...

    @property
    def labels(self) -> tuple[str, ...] | None:
        """The classification head's labels in output order; None without a head."""
        ...

    @property
    def pooling_type(self) -> PoolingType: ...

    def pool(self, inputs: Sequence[Sequence[int]], params: PoolingParams) -> list[PooledOutput]:
        """One forward over `inputs` (token ids, checked by the caller), one output each."""
        ...


def plan_batches(lengths: Sequence[int], max_batched_tokens: int) -> list[range]:
    """Consecutive index ranges of `lengths` whose token sums stay within the budget; an
    input above the budget alone makes a batch. Order is kept (outputs follow inputs)."""
    batches: list[range] = []
    start, tokens = 0, 0
    for index, length in enumerate(lengths):
        if index > start and tokens + length > max_batched_tokens:
            batches.append(range(start, index))
            start, tokens = index, 0
        tokens += length
    if start < len(lengths):
        batches.append(range(start, len(lengths)))
    return batches
