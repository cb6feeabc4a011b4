"""Each sampling parameter does what the API says, on real torch logits."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.api import LogprobRequest, SamplingParams
from engine.torch_runner.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    filtered_probs,
    prompt_logprobs,
    token_logprob,
)

VOCAB = 50


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(
    params: SamplingParams,
    seed: int | None = None,
    prompt: tuple[int, ...] = (),
    outputs: tuple[int, ...] = (),
) -> SamplingRow:
    return SamplingRow(params=params, seed=seed, prompt_token_ids=prompt, output_token_ids=outputs)


def sample_ids(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [s.token_id for s in sampler.sample(logits, rows)]


def test_greedy_and_top_k_1_take_the_argmax() -> None:
    logits = random_logits(16)
    sampler = Sampler(frozenset({2}), seed=0)
    argmax = logits.argmax(-1).tolist()
    assert sample_ids(sampler, logits, [row(SamplingParams(temperature=0.0))] * 16) == argmax
    top1 = [row(SamplingParams(temperature=1.5, top_k=1))] * 16
    assert sample_ids(sampler, logits, top1) == argmax


def test_a_tiny_temperature_samples_at_vllms_minimum() -> None:
    # vLLM raises a positive temperature under 0.01 to 0.01. Dividing by 1e-40 overflowed every
    # logit to inf, the probabilities to NaN, and the draw took token 0.
    logits = torch.tensor([[1.0, 9.0, -5.0, 10.0] + [0.0] * (VOCAB - 4)])
    sampler = Sampler(frozenset(), seed=0)
    for temperature in (1e-40, 1e-6):
        params = SamplingParams(temperature=temperature)
        assert sample_ids(sampler, logits, [row(params, seed=7)]) == [3]
        raised = filtered_probs(logits, [row(params)])
        assert torch.equal(raised, filtered_probs(logits, [row(SamplingParams(temperature=0.01))]))


def test_temperature_sampling_follows_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    draws = 8000
    sampler = Sampler(frozenset(), seed=123)
    for temperature in (0.5, 1.0, 2.0):
        params = SamplingParams(temperature=temperature)
        ids = sample_ids(sampler, logits.expand(draws, VOCAB), [row(params)] * draws)
        counts = torch.bincount(torch.tensor(ids), minlength=VOCAB)[:4].double() / draws
        expected = torch.softmax(logits[0, :4].double() / temperature, -1)
        # Binomial standard error is at most 0.0056 here; 4 sigma.
        assert torch.allclose(counts, expected, atol=0.023), (temperature, counts, expected)


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log().unsqueeze(0)
    kept = filtered_probs(logits, [row(SamplingParams(top_p=0.7))])[0]
    # 0.5 < 0.7, 0.5 + 0.25 >= 0.7: exactly the two most likely tokens, renormalised.
    assert kept[:4].tolist() == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])
    kept = filtered_probs(logits, [row(SamplingParams(top_p=0.76))])[0]
    assert (kept > 0).nonzero().squeeze(1).tolist() == [0, 1, 2]
    sampler = Sampler(frozenset(), seed=5)
    ids = sample_ids(sampler, logits.expand(500, VOCAB), [row(SamplingParams(top_p=0.7))] * 500)
    assert set(ids) == {0, 1}


def test_top_k_then_top_p_renormalises_after_top_k() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log().unsqueeze(0)
    # After top-k=2 the distribution is (4/7, 3/7); top_p=0.5 then keeps only the first.
    kept = filtered_probs(logits, [row(SamplingParams(top_k=2, top_p=0.5))])[0]
    assert kept[:3].tolist() == pytest.approx([1.0, 0.0, 0.0])
    kept = filtered_probs(logits, [row(SamplingParams(top_k=3))])[0]
    assert kept[:4].tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0])


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    # vLLM keeps each token whose logit is at least the k-th largest: a tie at the boundary
    # is kept whole (bf16 logits tie often), not cut at an order the sort happened to give.
    logits = torch.tensor([[-1.0, 0.5, -1.0, 0.5, 0.5, -3.0] + [-9.0] * (VOCAB - 6)])
    kept = filtered_probs(logits, [row(SamplingParams(top_k=2))])[0]
    assert (kept > 0).nonzero().squeeze(1).tolist() == [1, 3, 4]
    assert kept[[1, 3, 4]].tolist() == pytest.approx([1 / 3] * 3)
    kept = filtered_probs(logits, [row(SamplingParams(top_k=4))])[0]
    assert (kept > 0).nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log().unsqueeze(0)
    kept = filtered_probs(logits, [row(SamplingParams(min_p=0.2))])[0]
    # Threshold 0.2 * 0.5 = 0.1: 0.08 goes, 0.12 stays.
    assert kept[:4].tolist() == pytest.approx([0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0.0])


def test_penalties_change_logits_as_defined() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5] + [0.0] * (VOCAB - 5)])
    prompt, outputs = (0, 1), (2, 2, 3)
    rep = apply_penalties(
        logits, [row(SamplingParams(repetition_penalty=2.0), None, prompt, outputs)]
    )
    # Seen in prompt or output: positive logits halve, negative ones double; 4 is untouched.
    assert rep[0, :5].tolist() == [1.0, -4.0, 0.5, -2.0, 0.5]
    freq = apply_penalties(
        logits, [row(SamplingParams(frequency_penalty=0.5), None, prompt, outputs)]
    )
    # Output counts only (2 twice, 3 once); prompt tokens are not penalised.
    assert freq[0, :5].tolist() == [2.0, -2.0, 0.0, -1.5, 0.5]
    presence = apply_penalties(
        logits, [row(SamplingParams(presence_penalty=0.25), None, prompt, outputs)]
    )
    assert presence[0, :5].tolist() == [2.0, -2.0, 0.75, -1.25, 0.5]
    untouched = apply_penalties(logits, [row(SamplingParams(), None, prompt, outputs)])
    assert untouched is logits


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9] + [0.0] * (VOCAB - 2)])
    sampler = Sampler(frozenset(), seed=0)
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample_ids(sampler, logits, [row(plain, outputs=(0,))]) == [0]
    assert sample_ids(sampler, logits, [row(penalised, outputs=(0,))]) == [1]


def test_logit_bias_is_added_before_the_penalties() -> None:
    # vLLM's order: token 1 biased to 4.0, then halved by the repetition penalty to 2.0, loses
    # to token 0's 2.5 (penalty first would give 0.5 + 3.0 = 3.5, and win).
    logits = torch.tensor([[2.5, 1.0] + [0.0] * (VOCAB - 2)])
    sampler = Sampler(frozenset(), seed=0)
    biased = SamplingParams(temperature=0.0, logit_bias=((1, 3.0),))
    assert sample_ids(sampler, logits, [row(biased)]) == [1]
    penalised = SamplingParams(temperature=0.0, logit_bias=((1, 3.0),), repetition_penalty=2.0)
    assert sample_ids(sampler, logits, [row(penalised, prompt=(1,))]) == [0]
    # Logprobs stay the model's: the bias does not change them.
    logprobs = SamplingParams(temperature=0.0, logit_bias=((1, 3.0),), logprobs=LogprobRequest())
    (token,) = sampler.sample(logits, [row(logprobs)])
    assert token.token_id == 1 and token.logprob is not None
    assert token.logprob.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


def test_allowed_token_ids_limit_every_draw() -> None:
    logits = random_logits(1, seed=4)
    allowed = (3, 17, 40)
    sampler = Sampler(frozenset(), seed=0)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert sample_ids(sampler, logits, [row(greedy)]) == [best]
    sampled = SamplingParams(temperature=2.0, allowed_token_ids=allowed)
    ids = sample_ids(sampler, logits.expand(300, VOCAB), [row(sampled)] * 300)
    assert set(ids) == set(allowed)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # EOS
    logits[0, 7] = 9.0  # a caller stop id
    logits[0, 9] = 8.0
    sampler = Sampler(frozenset({2}), seed=0)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sample_ids(sampler, logits, [row(params, outputs=(5,))]) == [9]
    assert sample_ids(sampler, logits, [row(params, outputs=(5, 5))]) == [2]
    # EOS is masked with ignore_eos too (as vLLM), then may be sampled like any token.
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample_ids(sampler, logits, [row(ignore, outputs=())]) == [7]
    assert sample_ids(sampler, logits, [row(ignore, outputs=(5, 5))]) == [2]


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    logits = random_logits(1, seed=3) / 3  # flat enough to make draws vary
    params = SamplingParams(temperature=1.0)

    def run(seed: int, companions: int, sampler_seed: int) -> list[int]:
        sampler = Sampler(frozenset(), seed=sampler_seed)
        tokens: list[int] = []
        for _ in range(20):
            rows = [row(params)] * companions + [row(params, seed=seed, outputs=tuple(tokens))]
            batch = torch.cat([random_logits(companions, seed=9), logits]) if companions else logits
            tokens.append(sample_ids(sampler, batch, rows)[-1])
        return tokens

    alone = run(seed=42, companions=0, sampler_seed=1)
    assert run(seed=42, companions=5, sampler_seed=2) == alone
    assert run(seed=43, companions=0, sampler_seed=1) != alone
    assert len(set(alone)) > 3


def test_logprob_candidates_are_sorted_ranked_and_normalised() -> None:
    log_probs = torch.log_softmax(random_logits(1, seed=11)[0], -1)
    chosen = int(log_probs.argsort(descending=True)[4])
    top = token_logprob(log_probs, chosen, LogprobRequest(top_n=5))
    assert top.token_id == chosen
    assert top.rank == 5
    assert top.logprob == pytest.approx(float(log_probs[chosen]))
    values = [c.logprob for c in top.candidates]
    assert values == sorted(values, reverse=True)
    assert [c.rank for c in top.candidates] == [1, 2, 3, 4, 5]
    assert top.candidates[4].token_id == chosen
    everything = token_logprob(log_probs, chosen, LogprobRequest(all_candidates=True))
    assert len(everything.candidates) == VOCAB
    assert math.fsum(math.exp(c.logprob) for c in everything.candidates) == pytest.approx(1.0)
    assert token_logprob(log_probs, chosen, LogprobRequest()).candidates == ()


def test_logprobs_for_explicit_token_ids() -> None:
    log_probs = torch.log_softmax(random_logits(1, seed=12)[0], -1)
    order = log_probs.argsort(descending=True).tolist()
    wanted = (order[10], order[0], 10_000)  # an id outside the vocabulary is not reported
    result = token_logprob(log_probs, order[3], LogprobRequest(token_ids=wanted))
    assert [(c.token_id, c.rank) for c in result.candidates] == [(order[10], 11), (order[0], 1)]
    assert result.candidates[0].logprob == pytest.approx(float(log_probs[order[10]]))


def test_sampled_token_logprob_is_of_the_raw_distribution() -> None:
    logits = random_logits(2, seed=13)
    sampler = Sampler(frozenset(), seed=0)
    params = SamplingParams(temperature=0.7, top_k=3, logprobs=LogprobRequest(top_n=2))
    result = sampler.sample(logits, [row(params, seed=1), row(params, seed=2)])
    raw = torch.log_softmax(logits, -1)
    for i, sampled in enumerate(result):
        assert sampled.logprob is not None
        assert sampled.logprob.token_id == sampled.token_id
        assert sampled.logprob.logprob == pytest.approx(float(raw[i, sampled.token_id]))
        assert sampled.logprob.rank <= 3  # top_k=3 only ever picks among the three best
        assert [c.token_id for c in sampled.logprob.candidates] == raw[i].topk(2).indices.tolist()
    no_logprobs = sampler.sample(logits[:1], [row(SamplingParams())])
    assert no_logprobs[0].logprob is None


def test_prompt_logprobs_score_each_next_prompt_token() -> None:
    logits = random_logits(4, seed=14)
    targets = [5, 6, 7, 8]
    result = prompt_logprobs(logits, targets, LogprobRequest(top_n=1))
    raw = torch.log_softmax(logits, -1)
    assert [r.token_id for r in result] == targets
    assert [r.logprob for r in result] == pytest.approx(
        [float(raw[i, t]) for i, t in enumerate(targets)]
    )
    assert [r.candidates[0].token_id for r in result] == raw.argmax(-1).tolist()


def test_top_p_stops_at_a_token_whose_mass_reaches_it_exactly() -> None:
    # Powers of two sum exactly: 0.5 + 0.25 reaches top_p=0.75, so the third token (whose mass
    # before it is exactly 0.75) is not needed, as in vLLM (which drops tail mass <= 1 - top_p).
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125] + [0.0] * (VOCAB - 4))
    logits = probs.log().unsqueeze(0)
    for top_p, kept in ((0.5, [0]), (0.75, [0, 1]), (0.875, [0, 1, 2])):
        result = filtered_probs(logits, [row(SamplingParams(top_p=top_p))])[0]
        assert (result > 0).nonzero().squeeze(1).tolist() == kept, top_p


def test_min_p_1_keeps_the_most_likely_tokens() -> None:
    # The threshold is the top probability itself: the tokens at it stay (vLLM drops only those
    # strictly under it), so the draw never meets an all-masked row.
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0] + [-1.0] * (VOCAB - 4)])
    params = SamplingParams(min_p=1.0)
    kept = filtered_probs(logits, [row(params)])[0]
    assert kept[:4].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.5])
    assert float(kept.sum()) == pytest.approx(1.0)
    sampler = Sampler(frozenset(), seed=0)
    assert set(sample_ids(sampler, logits.expand(200, VOCAB), [row(params)] * 200)) == {1, 3}


def test_greedy_takes_the_lowest_id_on_an_exact_tie() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 3.0, 3.0] + [0.0] * (VOCAB - 6)])
    sampler = Sampler(frozenset(), seed=0)
    plain = SamplingParams(temperature=0.0)
    # Both the plain-argmax shortcut and the full pipeline (logprobs asked for) pick token 2.
    assert sample_ids(sampler, logits, [row(plain)]) == [2]
    with_logprobs = SamplingParams(temperature=0.0, logprobs=LogprobRequest())
    assert sample_ids(sampler, logits, [row(with_logprobs)]) == [2]
    biased = SamplingParams(temperature=0.0, logit_bias=((0, 3.0),))
    assert sample_ids(sampler, logits, [row(biased)]) == [0]
