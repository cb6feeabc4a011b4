"""Sampling and logprobs on a batch of float32 logits.

Pipeline per row, in this order (the order vLLM and the OpenAI API define):

0. `logit_bias` added to the raw logits (vLLM applies it before the penalties);
1. penalties: repetition (prompt and output tokens; divide a positive logit, multiply a
   negative one), then frequency (minus `f * count` over output tokens) and presence (minus
   `p` for each token present in the output);
2. masks: while fewer than `min_tokens` outputs exist, stop token ids and EOS (EOS even with
   `ignore_eos`, as vLLM: its min-tokens processor masks every stop id it knows); every token
   outside the request's `allowed_token_ids` or, guided decoding, the row's (the core limits
   those to the request's); all before temperature, min-p, top-k and top-p, so those act on
   the constrained distribution and greedy is the argmax of the allowed tokens;
3. greedy rows (temperature 0) take the argmax here (lowest id on an exact tie);
4. the rest divide by the temperature (at least 0.01, as vLLM raises it: a tinier one
   overflows the logits to inf and the probabilities to NaN), drop tokens under
   `min_p * max_prob`, keep the `top_k` most likely (and every token tied with the k-th, as
   vLLM), keep the smallest most-likely set reaching mass `top_p` (renormalised after top-k),
   and draw by the exponential race `argmax(p / E)`, `E ~ Exp(1)`.

Randomness: a row with a seed draws from a generator seeded by (seed, number of tokens already
output), so a seeded output is the same whatever else is in the batch and after a preemption
that recomputes it; rows without a seed draw from the sampler's own generator.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before
penalties and temperature), like vLLM's default `raw_logprobs`. Ranks are 1-based: one plus the
number of tokens strictly more likely. Candidates come most likely first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.api import Candidate, LogprobRequest, SamplingParams, TokenLogprob

# vLLM's `_MAX_TEMP`: a positive temperature under it samples at it (dividing by a tinier one
# overflows the logits to inf and the probabilities to NaN).
MIN_SAMPLING_TEMPERATURE = 1e-2
_MASK_64 = (1 << 64) - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of logits to sample from and what the pipeline needs to know about it."""

    params: SamplingParams
    seed: int | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    allowed_token_ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


def step_seed(seed: int, num_output_tokens: int) -> int:
    """A per-step seed from the request seed (splitmix64 finaliser; fits a torch seed)."""
    z = (seed + (num_output_tokens + 1) * _GOLDEN_64) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], seed: int | None = None) -> None:
        self._eos_token_ids = eos_token_ids
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """logits [N, V] float32 (one row per entry of `rows`) -> one token per row."""
        if all(
            plain_greedy(row.params, len(row.output_token_ids)) and row.allowed_token_ids is None
            for row in rows
        ):
            # Nothing to adjust or report: the argmax of the raw logits, as below.
            return [SampledToken(t, None) for t in logits.argmax(dim=-1).tolist()]
        raw = logits.float()
        processed = apply_penalties(apply_logit_bias(raw, rows), rows)
        processed = self._mask_min_tokens(processed, rows)
        processed = mask_disallowed(processed, rows)
        token_ids = processed.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=raw.device)
            probs = filtered_probs(processed.index_select(0, index), [rows[i] for i in random_rows])
            draws = self._exponentials(probs, [rows[i] for i in random_rows])
            token_ids.index_copy_(0, index, (probs / draws).argmax(dim=-1))
        chosen = token_ids.tolist()
        wants_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprobs: dict[int, TokenLogprob] = {}
        if wants_logprobs:
            index = torch.tensor(wants_logprobs, device=raw.device)
            log_probs = torch.log_softmax(raw.index_select(0, index), dim=-1)
            for j, i in enumerate(wants_logprobs):
                request = rows[i].params.logprobs
                assert request is not None  # selected above
                logprobs[i] = token_logprob(log_probs[j], chosen[i], request)
        return [SampledToken(chosen[i], logprobs.get(i)) for i in range(len(rows))]

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        masked: torch.Tensor | None = None
        for i, row in enumerate(rows):
            params = row.params
            if len(row.output_token_ids) >= params.min_tokens:
                continue
            stop_ids = {
                t for t in (*params.stop_token_ids, *self._eos_token_ids) if t < logits.shape[1]
            }
            if not stop_ids:
                continue
            if masked is None:
                masked = logits.clone()
            masked[i, sorted(stop_ids)] = float("-inf")
        return logits if masked is None else masked

    def _exponentials(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        draws = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.seed is None]
        if unseeded:
            shared = torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype)
            shared.exponential_(generator=self._generator)
            draws[unseeded] = shared.to(probs.device)
        for i, row in enumerate(rows):
            if row.seed is None:
                continue
            generator = torch.Generator().manual_seed(
                step_seed(row.seed, len(row.output_token_ids))
            )
            own = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=generator)
            draws[i] = own.to(probs.device)
        return draws


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each row's `logit_bias` added; returns `logits` itself if no row has one."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return logits
    out = logits.clone()
    vocab = logits.shape[1]
    for i in biased:
        for token_id, bias in rows[i].params.logit_bias:
            if token_id < vocab:
                out[i, token_id] += bias
    return out


def allowed_ids(row: SamplingRow) -> Sequence[int] | None:
    """The ids a row may sample: its guide's (which the core already limited to the request's
    `allowed_token_ids`), else the request's; None: any."""
    return row.allowed_token_ids or row.params.allowed_token_ids


def mask_disallowed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf outside each row's `allowed_ids`; returns `logits` itself if no row has them."""
    limited = [i for i, row in enumerate(rows) if allowed_ids(row)]
    if not limited:
        return logits
    vocab = logits.shape[1]
    keep = torch.zeros((len(limited), vocab), dtype=torch.bool)
    for j, i in enumerate(limited):
        ids = torch.tensor(allowed_ids(rows[i]), dtype=torch.int64)
        keep[j, ids[ids < vocab]] = True
    index = torch.tensor(limited, device=logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~keep.to(logits.device), float("-inf"))
    return masked


def plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the pipeline reduces to the argmax of the raw logits for this row: greedy, no
    bias, penalty, allow-list or min-tokens mask left, no logprobs to report."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.allowed_token_ids is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and num_output_tokens >= params.min_tokens
    )


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns `logits` itself if none."""
    penalised = [
        i
        for i, row in enumerate(rows)
        if row.params.repetition_penalty != 1.0
        or row.params.frequency_penalty != 0.0
        or row.params.presence_penalty != 0.0
    ]
    if not penalised:
        return logits
    out = logits.clone()
    vocab = logits.shape[1]
    for i in penalised:
        params = rows[i].params
        output_ids = torch.tensor(
            [t for t in rows[i].output_token_ids if t < vocab], dtype=torch.int64
        ).to(logits.device)
        row = out[i]
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            prompt_ids = torch.tensor(
                [t for t in rows[i].prompt_token_ids if t < vocab], dtype=torch.int64
            ).to(logits.device)
            seen[prompt_ids] = True
            seen[output_ids] = True
            penalty = params.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row))
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.index_add_(0, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
            row -= params.frequency_penalty * counts
            row -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return out


def filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p -> probabilities (masked tokens exactly 0)."""
    device = logits.device
    temperature = torch.tensor(
        [max(r.params.temperature, MIN_SAMPLING_TEMPERATURE) for r in rows], device=device
    )
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    top_k = [min(r.params.top_k or vocab, vocab) for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    # Keep every token at least as likely as the k-th (vLLM's rule): a tie at the boundary
    # keeps all the tied tokens, whatever order the sort left them in.
    kth_logit = sorted_logits.gather(1, k - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, float("-inf"))
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep a token while the mass strictly before it is under top_p: the most likely token is
    # always kept, and the kept set is the smallest one whose mass reaches top_p.
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def token_logprob(log_probs: torch.Tensor, token_id: int, request: LogprobRequest) -> TokenLogprob:
    """The logprob and rank of `token_id` in one row of log-probabilities, with candidates."""
    value = log_probs[token_id]
    rank = int((log_probs > value).sum()) + 1
    return TokenLogprob(
        token_id=token_id,
        logprob=float(value),
        rank=rank,
        candidates=candidates(log_probs, request),
    )


def candidates(log_probs: torch.Tensor, request: LogprobRequest) -> tuple[Candidate, ...]:
    if request.top_n > 0 or request.all_candidates:
        count = (
            log_probs.shape[0] if request.all_candidates else min(request.top_n, log_probs.shape[0])
        )
        values, ids = log_probs.topk(count, sorted=True)
        return tuple(
            Candidate(token_id=t, logprob=v, rank=r + 1)
            for r, (t, v) in enumerate(zip(ids.tolist(), values.tolist(), strict=True))
        )
    if request.token_ids:
        vocab = log_probs.shape[0]
        result = []
        for token_id in request.token_ids:
            if token_id >= vocab:
                continue  # not a token of this model: nothing to report
            value = log_probs[token_id]
            result.append(
                Candidate(
                    token_id=token_id,
                    logprob=float(value),
                    rank=int((log_probs > value).sum()) + 1,
                )
            )
        return tuple(result)
    return ()


def prompt_logprobs(
    logits: torch.Tensor, target_ids: Sequence[int], request: LogprobRequest
) -> tuple[TokenLogprob, ...]:
    """logits [M, V] at positions p .. p+M-1 and the prompt tokens at p+1 .. p+M."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return tuple(
        token_logprob(log_probs[i], token_id, request) for i, token_id in enumerate(target_ids)
    )
