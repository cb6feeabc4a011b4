"""The engine core's public types: requests in, outputs and KV events out, and the runner contract.

Everything here is immutable: a frozen, slotted dataclass, a named tuple, an Enum or a Protocol;
proto types stop at the servers (`engine/server/`), torch stays in the runners. The flow of one
step:

    EngineCore.step()
      scheduler picks a ScheduledBatch  ->  ModelRunner.execute(batch) -> list[SequenceResult]
      stop checks + detokenisation      ->  list[RequestOutput] (per-step deltas)
      block manager records KV events   ->  EngineCore.take_kv_events() -> list[KvEvent]

Conventions: token ids are ints; positions are 0-based; `None` means "not set / unknown", never
`-1`; block keys are kvplane's canonical chained keys (`indexer.keys.block_keys`).

What every step builds once per scheduled sequence (`ScheduledSequence`, `SequenceResult`,
`RequestOutput`) are named tuples rather than frozen dataclasses: a frozen dataclass sets each
field through `object.__setattr__`, and building these three took about a tenth of a saturated
simulated replay (docs/benchmarks/routing.md); a named tuple is built two to three times
faster. Read them by field name only (their tuple behaviour, such as unpacking or comparing
with a plain tuple, is not part of the API); use `value._replace(...)` for an altered copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Literal, NamedTuple, Protocol, TypeVar

from engine.core.errors import InvalidRequestError

_T = TypeVar("_T")

BlockKey = int
"""kvplane's canonical chained key of one full block, signed 64-bit (`indexer.keys.block_keys`)."""

BlockId = int
# One block's KV as the runner's `write_kv_blocks` takes it: its own bytes, or a zero-copy view
# into a larger message holding a run of blocks (KV transfer).
KvBlockBytes = bytes | memoryview
"""Index of a physical KV block in the runner's cache, 0 <= id < num_blocks."""
# What a DECODE engine did with a pulled session's blocks (`EngineCore.import_or_hold_kv_blocks`):
# imported at once, held until its request is admitted (no room then), dropped (no room, and
# the bound on held bytes reached: the request computes its prompt), unused (nothing to import).
KvImportOutcome = Literal["imported", "held", "dropped", "unused"]


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogprobRequest:
    """Return the logprob and rank of each token, plus candidates at each position.

    At most one candidate selection: `top_n` most likely tokens, explicit `token_ids`, or
    `all_candidates` (the whole vocabulary). With none of them, only the token's own logprob.
    """

    top_n: int = 0
    token_ids: tuple[int, ...] = ()
    all_candidates: bool = False

    def validate(self, what: str) -> None:
        chosen = sum((self.top_n > 0, bool(self.token_ids), self.all_candidates))
        if chosen > 1:
            raise InvalidRequestError(f"{what}: choose one of top_n, token_ids or all")
        if self.top_n < 0 or any(t < 0 for t in self.token_ids):
            raise InvalidRequestError(f"{what}: negative top_n or token id")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling, stopping and returned-data options of one request.

    Defaults are OpenEngine's fixed defaults; the front ends put a model's own
    (`SamplingDefaults`) in place of them for the options a request leaves unset.
    `temperature == 0` means greedy; a positive one under 0.01 samples at 0.01 (as vLLM raises
    it: dividing by a tinier one overflows the logits). `max_tokens=None` means "until the
    context is full".
    `num_sequences` (n) independent outputs share the prompt; output i samples with seed
    `seed + i` when a seed is given.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    num_sequences: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_in_output: bool = False
    # vLLM's output: a matched stop token (a stop id or EOS) is emitted (its id and logprob)
    # even without `include_stop_in_output`, which then still keeps its text out.
    emit_stop_token: bool = False
    logprobs: LogprobRequest | None = None
    prompt_logprobs: LogprobRequest | None = None
    prompt_logprob_start: int = 0
    # vLLM's: (token id, value added to its logit before the penalties), and the only ids the
    # output may take (None: any). `vllm.Generate` sets them; OpenEngine has neither.
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError on a malformed combination (checked before acceptance)."""
        # NaN passes every comparison below as false (NaN <= 0 is false): refuse it, and the
        # infinities, first.
        for name, value in (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
            ("repetition_penalty", self.repetition_penalty),
        ):
            if not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, not {value}")
        # Each out-of-range value is named with what was sent, in the fields' own names
        # (OpenEngine's and vllm.Generate's alike).
        for name, value, within, allowed in (
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", self.min_p, 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            (
                "frequency_penalty",
                self.frequency_penalty,
                abs(self.frequency_penalty) <= 2.0,
                "in [-2, 2]",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                abs(self.presence_penalty) <= 2.0,
                "in [-2, 2]",
            ),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0"),
        ):
            if not within:
                raise InvalidRequestError(f"{name} must be {allowed}, got {value:g}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1 when set, got {self.top_k}")
        if self.num_sequences < 1:
            raise InvalidRequestError("num_sequences must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop token ids must be >= 0")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not math.isfinite(bias):
                raise InvalidRequestError(
                    f"logit_bias: token id {token_id} >= 0 with a finite bias, got {bias}"
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise InvalidRequestError("allowed_token_ids must be non-empty ids >= 0")
        if self.prompt_logprob_start < 0:
            raise InvalidRequestError("prompt_logprob_start must be >= 0")
        if self.logprobs is not None:
            self.logprobs.validate("output candidates")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.validate("prompt candidates")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A model's own defaults for the sampling options a request leaves unset (its
    `generation_config.json`, `engine.torch_runner.generation_config`). None: the model sets
    none, and the front end's fixed default applies. `top_k` None also stands for the model's
    "no top-k" (HF's 0): the same as every front end's fixed default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def over(self, fixed: SamplingParams) -> SamplingParams:
        """`fixed` (a front end's own defaults) with the values this model sets in their place:
        what each unset field of a request takes."""
        return replace(
            fixed,
            temperature=_first_set(self.temperature, fixed.temperature),
            top_p=_first_set(self.top_p, fixed.top_p),
            top_k=_first_set(self.top_k, fixed.top_k),
            min_p=_first_set(self.min_p, fixed.min_p),
            repetition_penalty=_first_set(self.repetition_penalty, fixed.repetition_penalty),
            max_tokens=_first_set(self.max_tokens, fixed.max_tokens),
        )

    def describe(self) -> str:
        """`temperature=0.6, top_p=0.9`: the values set, for logs and messages ("" for none)."""
        return ", ".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) is not None
        )


def _first_set(preferred: _T | None, fallback: _T) -> _T:
    return fallback if preferred is None else preferred


class GuideKind(Enum):
    """Guided decoding modes this engine implements (`engine.core.guided`)."""

    REGEX = "regex"
    CHOICE = "choice"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    EBNF_GRAMMAR = "ebnf_grammar"


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """A constraint on the output text: `value` is the pattern (REGEX), the schema's JSON
    text (JSON_SCHEMA) or the grammar (EBNF_GRAMMAR); `choices` the strings of CHOICE;
    JSON_OBJECT takes neither."""

    kind: GuideKind
    value: str = ""
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request, already tokenised.

    `priority`: larger is scheduled first; FCFS within a priority. `cache_salt` and `lora_name`
    namespace prefix-cache keys. `bypass_prefix_cache` skips reuse of cached blocks but still
    caches the blocks it computes. Prompt logprobs imply no reuse for that request (every
    position must be computed). `kv_session_id` (a PREFILL engine's request): once the prompt
    is computed, the blocks a decode engine can reuse stay held under this id after the request
    ends (`EngineCore.release_kv_session`); the last output then says `held_kv_session`.
    `guided`: every output's text is constrained (`engine.core.guided`; needs a tokenizer).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    bypass_prefix_cache: bool = False
    kv_session_id: str | None = None
    guided: GuidedDecoding | None = None


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One candidate token at a position. `rank` is 1-based in the full distribution."""

    token_id: int
    logprob: float
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob and 1-based rank of the chosen (or prompt) token, plus requested candidates."""

    token_id: int
    logprob: float
    rank: int
    candidates: tuple[Candidate, ...] = ()


class FinishReason(Enum):
    STOP = "stop"  # stop token, stop string or EOS: see StopMatch
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"  # aborted
    ERROR = "error"  # the request failed; `RequestOutput.message` and `.error` say why


class ErrorKind(Enum):
    """Whose failure a FinishReason.ERROR is."""

    ENGINE = "engine"  # the runner or the engine failed
    REQUEST = "request"  # the request cannot go on as asked (its guide allows no token)
    # What the request names left after it was accepted, before it could start (its LoRA
    # adapter unloaded between the request's check and the engine thread adding it).
    NOT_FOUND = "not_found"


class StopKind(Enum):
    STOP_TOKEN = "stop_token"
    STOP_TEXT = "stop_text"
    EOS = "eos"


@dataclass(frozen=True, slots=True)
class StopMatch:
    kind: StopKind
    token_id: int | None = None  # STOP_TOKEN and EOS
    text: str | None = None  # STOP_TEXT


@dataclass(frozen=True, slots=True)
class Usage:
    """Cumulative over every output of the request. cached <= prompt."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RequestOutput(NamedTuple):
    """What one step produced for one output (`output_index`) of a request: deltas only.

    `new_token_ids` are the tokens emitted this step; `new_text` is the text delta (text may lag
    tokens: stop-string holdback and incomplete UTF-8 are held back). `logprobs`, when requested,
    align with `new_token_ids`. `prompt_logprobs` is set at most once per request, on the first
    output that carries it: one entry per prompt position from `prompt_logprob_start`, `None` for
    position 0 (no conditional probability). `finish_reason` is set on the last output of this
    index; `usage` only on the request's very last output (the last index to finish).
    A matched stop token (caller stop id or EOS) is not in `new_token_ids` unless
    `include_stop_in_output` or `emit_stop_token`; it is still counted in `completion_tokens`.
    `held_kv_session`: on the last output of a request with `kv_session_id`, whether its
    prompt's KV is now held under that id (not when it was cancelled, failed or never computed
    its whole prompt, nor when its adapter's name serves other weights by its end: `message`
    then says so).
    """

    request_id: str
    output_index: int
    new_token_ids: tuple[int, ...] = ()
    new_text: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_match: StopMatch | None = None
    message: str = ""
    error: ErrorKind = ErrorKind.ENGINE  # with FinishReason.ERROR only
    usage: Usage | None = None
    held_kv_session: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# --------------------------------------------------------------------------------------------
# KV events (recorded by the block manager, drained by EngineCore.take_kv_events)
# --------------------------------------------------------------------------------------------


class Medium(Enum):
    GPU = "GPU"  # the runner's KV cache, wherever it lives (a CPU engine reports GPU, as vLLM)
    CPU = "CPU"
    DISK = "DISK"
    EXTERNAL = "EXTERNAL"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence became cached.

    `parent_key` is the key of the block before the first listed one (None for a prefix start);
    each later block's parent is the one before it. `token_ids` has exactly
    `len(block_keys) * block_size` tokens. `extra_keys` has one entry per block: the cache salt
    as `("cache_salt", salt)` on a sequence's first block, else None.
    """

    block_keys: tuple[BlockKey, ...]
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium = Medium.GPU
    lora_name: str | None = None
    extra_keys: tuple[tuple[str, ...] | None, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_keys: tuple[BlockKey, ...]
    medium: Medium = Medium.GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: Medium = Medium.GPU


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


# --------------------------------------------------------------------------------------------
# Runner contract
# --------------------------------------------------------------------------------------------


class ScheduledSequence(NamedTuple):
    """One sequence's work in a step.

    Compute `token_ids` at positions `start_position ..`; their KV goes into the slots
    `block_table[p // block_size]`, offset `p % block_size`; attention covers positions
    `0 .. start_position + len(token_ids) - 1` through `block_table`. When `sample` is set,
    sample one token from the logits of the last position with `sampling` (penalties read
    `prompt_token_ids` and `output_token_ids`; `seed` is already per output). When
    `prompt_logprobs` is set, return the logprob of each prompt token at positions
    `start_position + 1 .. min(start_position + len(token_ids), len(prompt_token_ids) - 1)`.
    `allowed_token_ids` (guided decoding, sampling sequences only): sample among these ids
    alone (never empty; already within the request's own `sampling.allowed_token_ids`); None:
    the request's, else the whole vocabulary. `lora_key`: the LoRA weights to apply,
    as the runner holds them (`LoraRunner.add_lora`; one per load of an adapter, not its
    name); None: the base model. The sequences passed here are views valid during the call
    only: do not keep them.
    """

    seq_id: int
    request_id: str
    output_index: int
    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[BlockId]
    sample: bool
    sampling: SamplingParams
    seed: int | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    prompt_logprobs: LogprobRequest | None = None
    lora_key: str | None = None
    allowed_token_ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    sequences: tuple[ScheduledSequence, ...]
    num_scheduled_tokens: int
    num_prefill_tokens: int  # prompt tokens computed this step (uncached prefill work)
    num_decode_sequences: int  # sequences past their prompt, computing one token
    num_decode_context_tokens: int  # context length summed over the decoding sequences


class SequenceResult(NamedTuple):
    """A runner's answer for one scheduled sequence.

    `token_id` (and `logprob` when `sampling.logprobs`) only when the sequence sampled.
    `prompt_logprobs` as described in ScheduledSequence.
    """

    seq_id: int
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class ModelRunner(Protocol):
    """Runs forward passes over a paged KV cache of `num_blocks` blocks of `block_size` tokens."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model supports."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def execute(self, batch: ScheduledBatch) -> list[SequenceResult]:
        """Run one forward pass; return one result per scheduled sequence, in any order."""
        ...

    # KV transfer between engines: whole blocks as bytes. Two engines exchange blocks only
    # when their `kv_layout`s are equal (same engine kind, dtype and geometry).

    @property
    def kv_layout(self) -> str:
        """What the bytes of a block mean, e.g. the torch runner's dtype and shape."""
        ...

    @property
    def kv_block_bytes(self) -> int:
        """The size of one block's bytes (every layer's K and V)."""
        ...

    def read_kv_blocks(self, block_ids: Sequence[BlockId]) -> bytes:
        """A copy of these blocks' KV as one string: each block's `kv_block_bytes` in turn,
        in order (one string, not one per block: the transfer sends runs of blocks as one
        message, and a copy per block cost as much as the stream)."""
        ...

    def write_kv_blocks(self, block_ids: Sequence[BlockId], blocks: Sequence[KvBlockBytes]) -> None:
        """Overwrite these blocks' KV with `blocks`, one `kv_block_bytes` buffer per block (a
        slice of what `read_kv_blocks` returns); raises ValueError on a count or size mismatch
        before writing anything."""
        ...


# --------------------------------------------------------------------------------------------
# Engine-level observations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ForwardPassStats:
    """One step, for FORWARD_PASS / BATCH runtime events and metrics."""

    duration_s: float
    batch_size: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_sequences: int
    num_cached_tokens: int  # prefix-cache hits of the sequences admitted this step
    num_preempted: int


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The engine's load for GetLoad, measured at one instant on the engine thread: at the
    start of a pass (once scheduled) and at its end, or after a command.

    Every sequence is in exactly one of running (admitted by the scheduler: computing its
    prompt, chunk by chunk, or decoding) and waiting (not admitted yet, or preempted), with its
    context tokens in the matching token count; a PREFILL engine's finished prompt whose KV the
    core holds for a decode engine is in neither, but one of `num_kv_sessions`."""

    num_running: int
    num_waiting: int
    num_used_blocks: int  # referenced by a running sequence or a held KV session
    num_cached_blocks: int  # holding a prefix-cache key (referenced or evictable)
    num_total_blocks: int
    running_tokens: int  # context tokens of running sequences (computed or not)
    waiting_tokens: int  # tokens still to compute for waiting sequences
    prefill_batch_size: int  # of the pass in progress, else of the last one
    decode_batch_size: int  # of the pass in progress, else of the last one
    num_kv_sessions: int  # KV sessions whose blocks the core holds (a PREFILL engine's)

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: list[RequestOutput]
    stats: ForwardPassStats | None  # None when nothing ran
    # Sequences preempted this step, with or without a pass (one preempted to wait for blocks
    # that KV sessions hold is preempted in a step that runs none: `stats` cannot say it).
    num_preempted: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # token budget per step (chunked prefill)
    enable_prefix_caching: bool = True
    medium: Medium = Medium.GPU
    # A waiting sequence gains one priority level per `aging_s` seconds waited, so low priority
    # work is never starved (None disables aging: strict priority, FCFS within a level).
    aging_s: float | None = 30.0


@dataclass(frozen=True, slots=True)
class StepReport:
    """What the engine thread hands to `EngineLoop(on_step=...)` after each step or command."""

    result: StepResult
    kv_events: list[KvEvent]
    load: LoadSnapshot
