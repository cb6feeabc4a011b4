"""How many engines a load needs at the SLA: a cost model learned from forward passes.

The cost model. One forward pass of an aggregated engine (prefill chunks and decode steps in
one batch, as vLLM and kvplane's engine schedule) takes about

    pass_ms = fixed_ms + prefill_ms_per_token * prefill tokens + kv_ms * kv usage

(kv usage = the engine's used KV blocks / its total, 0..1: decode cost grows with the context
read). It is fitted online by weighted least squares over `ForwardPasses` (each paired with the
engine's KV usage at the tick), with exponential forgetting, and starts from priors worth a few
passes (a ridge towards them), so a cold planner is sane and a warm one measures its fleet.
Because the model is linear, a sum of passes is as good a sample as one pass.

Sizing (why these equations: docs/planner.md). With forecast prompt tokens per second L,
fleet KV usage K (the sum over engines, in engines' worth of cache) and N engines sharing the
load evenly, a pass on one engine takes

    T(N) = fixed_ms + kv_ms * K / N + prefill_ms_per_token * (L / N) * T / 1000

since each pass absorbs the prompt tokens that arrived during it. Every decoding request gets
one token per pass, so ITL = T; asking T <= itl_margin * ITL target gives N_itl. Prefill takes a
share rho = prefill_ms_per_token * L / (1000 N) of each engine's time; a prompt's prefill
(service time S) waits behind others' as in a processor-sharing queue, S / (1 - rho), and asking
that to be <= ttft_margin * TTFT target gives N_ttft. KV caches are kept below max_kv_usage:
N_kv = K / max_kv_usage. The need is the largest of the three.

N_itl has a second bound: short outputs next to prefill chunks. T is a mean; a request that
decodes only a few tokens sees the few passes of its engine meanwhile, and when the engine
computes a prompt then, those passes carry a prefill chunk (a full 2,048-token chunk alone
outlasts a 40 ms ITL target). The chance of that is about the engine's prefill share rho, so
N_itl also asks rho <= max_prefill_share for requests that decode for k <= short_output_passes
passes. A longer decode averages its ITL over more passes, and the prompts its engine computes
meanwhile vary less against their mean (a count's spread grows as the square root of its
mean), so the share allowed grows as sqrt(k / short_output_passes): for long outputs (k in the
hundreds) the mean-pass bound is the tighter one again.

Roles (planner.core.roles: what the pool's engines report, else its configured `role`). The
equations above are those of aggregated engines; a disaggregated fleet's pools keep them (one
cost model per pool, fitted on that pool's own passes; L, K and the mean prompt measured on its
own engines) and differ in which bounds apply:
- prefill: N_ttft and N_kv only. A prefill engine never decodes (each prompt's KV goes to a
  decode engine, which streams the tokens), so no request's ITL depends on its passes, and the
  ITL bounds applied to them ask for far too many engines: a prefill-only pass is a full chunk
  (a 2,048-token one alone outlasts a 40 ms ITL target) and its prefill share is near the
  whole engine by design. Its KV is the prompts computing and those held in open KV sessions
  until a decode engine pulls them: small, unless the decode pool falls behind.
- decode: all three, over what its own engines compute. Its passes are decode steps plus the
  little prompt work a decode engine does (the tokens the KV it pulled lacks: the last partial
  block, or a whole prompt when the controller skips the prefill hop because almost all of it
  is cached), so L is small, N_itl and N_kv bind, and N_ttft is sized only for the prompt
  tokens these engines compute (the prefill pool's share of TTFT is the prefill pool's).
- aggregated: all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.config import CapacityConfig, SlaTargets
from planner.core.observations import EngineRole

# The smallest prefill share a tight TTFT target is sized for (below it the need explodes).
_MIN_PREFILL_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class PassCost:
    fixed_ms: float
    prefill_ms_per_token: float
    kv_ms: float  # at a full KV cache

    def pass_ms(self, num_prefill_tokens: float, kv_usage: float) -> float:
        return (
            self.fixed_ms + self.prefill_ms_per_token * num_prefill_tokens + self.kv_ms * kv_usage
        )


class CostModel:
    """Weighted least squares of pass time on (passes, prefill tokens, passes x KV usage), with
    a ridge towards the priors and a half-life on old samples."""

    def __init__(self, config: CapacityConfig) -> None:
        self._half_life_s = config.half_life_s
        self._prior = PassCost(
            config.prior_pass_ms, config.prior_prefill_ms_per_token, config.prior_kv_ms
        )
        # The prior as pseudo-passes at three reference points (an empty pass, a full prefill
        # chunk, a full cache), so its pull is in the units the data has.
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._last_s: float | None = None
        weight = config.prior_weight
        for row in ((1.0, 0.0, 0.0), (1.0, 2048.0, 0.0), (1.0, 0.0, 1.0)):
            prefill = row[1]
            self._add(row, self._prior.pass_ms(prefill, row[2]), weight)
        self._prior_rows = [r[:] for r in self._xtx], self._xty[:]
        self.num_passes = 0

    def observe(
        self,
        now_s: float,
        num_passes: int,
        duration_ms: float,
        prefill_tokens: int,
        kv_usage: float,
    ) -> None:
        if num_passes <= 0:
            return
        self._forget(now_s)
        self._add(
            (float(num_passes), float(prefill_tokens), num_passes * kv_usage), duration_ms, 1.0
        )
        self.num_passes += num_passes

    def cost(self) -> PassCost:
        """The current fit, each coefficient at least 0 (a pass never gets faster with load)."""
        solved = _solve3(self._xtx, self._xty)
        if solved is None:
            return self._prior
        fixed, per_token, kv = (max(0.0, c) for c in solved)
        return PassCost(fixed, per_token, kv)

    def _forget(self, now_s: float) -> None:
        if self._last_s is not None and now_s > self._last_s:
            keep = 0.5 ** ((now_s - self._last_s) / self._half_life_s)
            prior_xtx, prior_xty = self._prior_rows
            # Data decays; the prior does not (it stays worth `prior_weight` passes).
            for i in range(3):
                for j in range(3):
                    data = self._xtx[i][j] - prior_xtx[i][j]
                    self._xtx[i][j] = prior_xtx[i][j] + keep * data
                self._xty[i] = prior_xty[i] + keep * (self._xty[i] - prior_xty[i])
        self._last_s = now_s if self._last_s is None else max(self._last_s, now_s)

    def _add(self, row: tuple[float, float, float], y: float, weight: float) -> None:
        # A summed sample: rows scale with the number of passes; weight each pass equally by
        # dividing by the pass count (row[0]).
        scale = weight / row[0]
        for i in range(3):
            self._xty[i] += scale * row[i] * y
            for j in range(3):
                self._xtx[i][j] += scale * row[i] * row[j]


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    m = [[*a[i], b[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]


@dataclass(frozen=True, slots=True)
class Need:
    """Engines (fractional) each SLA constraint asks for, and the largest. A bound that does
    not apply to the pool's role (ITL for a prefill pool) asks for 0."""

    itl: float
    ttft: float
    kv: float

    @property
    def engines(self) -> float:
        return max(self.itl, self.ttft, self.kv)


def engines_needed(
    cost: PassCost,
    *,
    prompt_tokens_per_s: float,
    kv_usage_sum: float,
    mean_prompt_tokens: float,
    sla: SlaTargets,
    config: CapacityConfig,
    decode_passes: float = 0.0,
    role: EngineRole = EngineRole.AGGREGATED,
) -> Need:
    """The module docstring's equations, the bounds `role` applies; `math.inf` when no count
    can meet a target (a target below the fixed cost of one pass). `decode_passes`: the mean
    number of passes a request decodes for (0 when not known: sized as short outputs)."""
    prefill_ms = cost.prefill_ms_per_token * prompt_tokens_per_s  # per second of load
    itl = (
        0.0  # no request decodes on a prefill engine
        if role is EngineRole.PREFILL
        else _itl_need(
            cost,
            prefill_ms=prefill_ms,
            kv_usage_sum=kv_usage_sum,
            sla=sla,
            config=config,
            decode_passes=decode_passes,
        )
    )
    service_ms = cost.fixed_ms + cost.prefill_ms_per_token * mean_prompt_tokens
    share = max(_MIN_PREFILL_SHARE, 1.0 - service_ms / (config.ttft_margin * sla.ttft_ms))
    ttft = prefill_ms / 1000.0 / share
    kv = kv_usage_sum / config.max_kv_usage
    return Need(itl=itl, ttft=ttft, kv=kv)


def _itl_need(
    cost: PassCost,
    *,
    prefill_ms: float,
    kv_usage_sum: float,
    sla: SlaTargets,
    config: CapacityConfig,
    decode_passes: float,
) -> float:
    """N_itl: the larger of the mean-pass bound and the short-output prefill-share bound."""
    target_ms = config.itl_margin * sla.itl_ms
    room_ms = target_ms - cost.fixed_ms
    mean_pass_itl = (
        (cost.kv_ms * kv_usage_sum + prefill_ms * target_ms / 1000.0) / room_ms
        if room_ms > 0
        else math.inf
    )
    longer = max(1.0, decode_passes / config.short_output_passes)
    prefill_share = min(1.0, config.max_prefill_share * math.sqrt(longer))
    short_output_itl = prefill_ms / 1000.0 / prefill_share
    return max(mean_pass_itl, short_output_itl)
