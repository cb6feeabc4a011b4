"""The simulated runner: the real block manager and scheduler, a timing model instead of torch.

Timing model (default: Dynamo's mocker, so results compare with its simulator; BENCHMARKS.md
section 2). One forward pass takes

    P(x) = 4.209989e-7 x^2 + 0.01518344 x + 16.50142 ms      x = prompt tokens computed this pass
    D(u) = max(1, -25.74 u^2 + 54.01 u + 5.74) ms           only when some sequence decodes
    u    = decoding context tokens / (num_blocks * block_size), capped at 1

and the pass costs P(x) + D(u) when it has prefill and decode work, P(x) alone for pure prefill
and D(u) alone for pure decode (Dynamo's mocker charges no prefill constant to a step that
computes no prompt token). All coefficients are configurable (`TimingModel`).

Time. `time_scale` multiplies the modelled duration: 1.0 sleeps in real time, 0 never sleeps
(fast tests). With a `VirtualClock` the runner never sleeps and advances that clock instead;
give the same clock to `EngineCore(clock=...)` and hundreds of engines replay a trace offline
in one process, each at its own virtual time.

KV transfer. No KV data: a block is zero bytes (`kv_layout` `sim:B<block_size>`).

Tokens. Deterministic dummy tokens: a mix of the sequence's last token, position and output
index, mapped into `[token_id_floor, vocab_size)` and never an EOS id, so equal prompts give
equal outputs (like greedy). `eos_after` makes output token number `eos_after` (1-based) the
EOS, for tests of EOS handling. Stop token ids, max/min tokens and stop strings apply as usual
(the core owns them).

LoRA. Bookkeeping only (`LoraRunner`): an adapter's directory must hold a valid PEFT
`adapter_config.json` (rank within `max_lora_rank`, supported target modules); no weights are
read and tokens do not depend on the adapter. Sim engines thus serve the LoRA lifecycle,
routing and prefix-cache namespaces in tests and benchmarks.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.core.api import (
    Candidate,
    KvBlockBytes,
    LogprobRequest,
    ScheduledBatch,
    SequenceResult,
    TokenLogprob,
)
from engine.core.lora import AdapterConfig, read_adapter_config

# The logprob of the token at each position (sampled or the prompt's): the sim has no model,
# so a fixed, plausible figure; the rest of the vocabulary shares the remaining mass.
CHOSEN_LOGPROB = -1.0


@dataclass(frozen=True, slots=True)
class TimingModel:
    prefill_ms_coeffs: tuple[float, float, float] = (4.209989e-7, 0.01518344, 16.50142)
    decode_ms_coeffs: tuple[float, float, float] = (-25.74, 54.01, 5.74)
    min_decode_ms: float = 1.0

    def prefill_ms(self, num_prefill_tokens: int) -> float:
        a2, a1, a0 = self.prefill_ms_coeffs
        x = float(num_prefill_tokens)
        return a2 * x * x + a1 * x + a0

    def decode_ms(self, utilisation: float) -> float:
        a2, a1, a0 = self.decode_ms_coeffs
        u = min(1.0, max(0.0, utilisation))
        return max(self.min_decode_ms, a2 * u * u + a1 * u + a0)

    def decode_run(
        self,
        *,
        start_s: float,
        until_s: float,
        max_steps: int,
        num_sequences: int,
        context_tokens: int,
        capacity_tokens: int,
    ) -> tuple[int, float]:
        """Consecutive pure-decode passes of `num_sequences` sequences (each adds one token of
        context), started while the clock is before `until_s`: (passes, end time). The clock
        arithmetic is the same as that many single passes, so replays agree to the bit."""
        # `decode_ms` inlined (this loop is the replay's hot path); the same arithmetic.
        a2, a1, a0 = self.decode_ms_coeffs
        floor_ms = self.min_decode_ms
        now_s = start_s
        num_steps = 0
        while num_steps < max_steps and now_s < until_s:
            u = context_tokens / capacity_tokens
            if u > 1.0:
                u = 1.0
            elif u < 0.0:
                u = 0.0
            duration_ms = a2 * u * u + a1 * u + a0
            if duration_ms < floor_ms:  # noqa: PLR1730 (hot loop: cheaper than max())
                duration_ms = floor_ms
            now_s += duration_ms / 1000.0
            context_tokens += num_sequences
            num_steps += 1
        return num_steps, now_s

    def forward_ms(
        self, num_prefill_tokens: int, num_decode_sequences: int, decode_utilisation: float
    ) -> float:
        """Duration of one forward pass (0 for an empty one)."""
        total = 0.0
        if num_prefill_tokens > 0:
            total += self.prefill_ms(num_prefill_tokens)
        if num_decode_sequences > 0:
            total += self.decode_ms(decode_utilisation)
        return total


class VirtualClock:
    """A clock that only moves when told to (offline replay)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def __call__(self) -> float:
        return self._now_s

    def now(self) -> float:
        return self._now_s

    def advance(self, duration_s: float) -> None:
        if duration_s < 0:
            raise ValueError("a clock never goes back")
        self._now_s += duration_s

    def advance_to(self, time_s: float) -> None:
        """Move to `time_s` if it is later (an idle engine waiting for the next arrival)."""
        self._now_s = max(self._now_s, time_s)


class SimRunner:
    """A `ModelRunner` that models time instead of computing (see the module docstring)."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 2048,
        max_model_len: int = 131072,
        vocab_size: int = 32000,
        token_id_floor: int = 3,
        eos_token_ids: frozenset[int] = frozenset({2}),
        eos_after: int | None = None,
        timing: TimingModel | None = None,
        time_scale: float = 1.0,
        clock: VirtualClock | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if vocab_size <= token_id_floor + len(eos_token_ids):
            raise ValueError("vocab_size leaves no room for dummy tokens")
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._max_model_len = max_model_len
        self._eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.token_id_floor = token_id_floor
        # What each other token's logprob is when the chosen one takes CHOSEN_LOGPROB.
        self._other_logprob = math.log(-math.expm1(CHOSEN_LOGPROB) / (vocab_size - 1))
        self.eos_after = eos_after
        self.timing = timing or TimingModel()
        self.time_scale = time_scale
        self.clock = clock
        self._sleep = sleep
        self.total_forward_ms = 0.0
        self.num_forward_passes = 0
        self.loras: dict[str, AdapterConfig] = {}

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    def forward_ms(self, batch: ScheduledBatch) -> float:
        capacity = self._num_blocks * self._block_size
        utilisation = batch.num_decode_context_tokens / capacity
        return self.timing.forward_ms(
            batch.num_prefill_tokens, batch.num_decode_sequences, utilisation
        )

    def pass_time(self, duration_ms: float) -> None:
        """Account for one forward pass: advance the virtual clock, or sleep (scaled)."""
        self.total_forward_ms += duration_ms
        self.num_forward_passes += 1
        if self.clock is not None:
            self.clock.advance(duration_ms / 1000.0)
        elif self.time_scale > 0 and duration_ms > 0:
            self._sleep(duration_ms / 1000.0 * self.time_scale)

    def pass_time_until(self, end_s: float, num_passes: int) -> None:
        """Account for `num_passes` passes ending at virtual time `end_s` (see decode_run)."""
        if self.clock is None:
            raise RuntimeError("only a virtual clock can jump")
        self.total_forward_ms += (end_s - self.clock.now()) * 1000.0
        self.num_forward_passes += num_passes
        self.clock.advance_to(end_s)

    def execute(self, batch: ScheduledBatch) -> list[SequenceResult]:
        self.pass_time(self.forward_ms(batch))
        results: list[SequenceResult] = []
        for seq in batch.sequences:
            prompt_logprobs: tuple[TokenLogprob, ...] = ()
            if seq.prompt_logprobs is not None:
                last = min(seq.start_position + len(seq.token_ids), len(seq.prompt_token_ids) - 1)
                prompt_logprobs = tuple(
                    self._logprob(seq.prompt_token_ids[p], seq.prompt_logprobs)
                    for p in range(seq.start_position + 1, last + 1)
                )
            if not seq.sample:
                results.append(SequenceResult(seq.seq_id, prompt_logprobs=prompt_logprobs))
                continue
            token_id = self.next_token(
                seq.token_ids[-1], len(seq.output_token_ids), seq.output_index
            )
            wanted = seq.sampling.logprobs
            logprob = None if wanted is None else self._logprob(token_id, wanted)
            results.append(SequenceResult(seq.seq_id, token_id, logprob, prompt_logprobs))
        return results

    # LoRA: bookkeeping only (see the module docstring).

    def read_lora(self, path: Path, *, max_rank: int) -> AdapterConfig:
        return read_adapter_config(path, max_rank=max_rank)

    def add_lora(self, key: str, weights: object) -> None:
        assert isinstance(weights, AdapterConfig)
        self.loras[key] = weights

    def remove_lora(self, key: str) -> None:
        self.loras.pop(key, None)

    # KV transfer: the simulator holds no KV data, so a block is zero bytes; the layout names
    # the block size, so sim engines exchange sessions like real ones (tests, benchmarks).

    @property
    def kv_layout(self) -> str:
        return f"sim:B{self._block_size}"

    @property
    def kv_block_bytes(self) -> int:
        return 0

    def read_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        return b""

    def write_kv_blocks(self, block_ids: Sequence[int], blocks: Sequence[KvBlockBytes]) -> None:
        if len(blocks) != len(block_ids) or any(blocks):
            raise ValueError("the sim runner's blocks are empty, one per block id")

    @property
    def may_emit_eos(self) -> bool:
        return self.eos_after is not None and bool(self._eos_token_ids)

    def next_token(self, last_token_id: int, num_output: int, output_index: int) -> int:
        """The dummy token after `last_token_id` when `num_output` tokens were generated."""
        if self.eos_after is not None and num_output + 1 == self.eos_after and self.eos_token_ids:
            return min(self.eos_token_ids)
        return self.next_tokens(last_token_id, num_output, output_index, 1)[0]

    def next_tokens(
        self, last_token_id: int, num_output: int, output_index: int, count: int
    ) -> list[int]:
        """`count` consecutive dummy tokens (EOS via `eos_after` is the caller's business)."""
        floor = self.token_id_floor
        span = self.vocab_size - floor
        eos = self._eos_token_ids
        tokens: list[int] = []
        last = last_token_id
        salt = output_index * 97
        for step in range(num_output, num_output + count):
            mixed = (last * 2654435761 + step * 40503 + salt) & 0xFFFFFFFF
            last = floor + mixed % span
            while last in eos:
                last = floor + (last + 1 - floor) % span
            tokens.append(last)
        return tokens

    def _logprob(self, token_id: int, wanted: LogprobRequest) -> TokenLogprob:
        """The sim's fixed distribution at every position: the token there (sampled, or the
        prompt's) at logprob -1.0, rank 1, the rest of the vocabulary sharing what is left
        (rank 2, a tie). The candidates are those `wanted` selects, as a model's are."""

        def candidate(candidate_id: int) -> Candidate:
            if candidate_id == token_id:
                return Candidate(token_id, CHOSEN_LOGPROB, 1)
            return Candidate(candidate_id, self._other_logprob, 2)

        if wanted.top_n > 0 or wanted.all_candidates:
            count = self.vocab_size if wanted.all_candidates else min(wanted.top_n, self.vocab_size)
            others = (t for t in range(self.vocab_size) if t != token_id)
            ids = [token_id, *itertools.islice(others, count - 1)]
        else:  # explicit ids (the front ends refused any outside the vocabulary), or none
            ids = [t for t in wanted.token_ids if t < self.vocab_size]
        return TokenLogprob(token_id, CHOSEN_LOGPROB, 1, tuple(candidate(t) for t in ids))
