"""In-flight accounting against a naive model, under any order of route / first token /
finish / engine removal (including duplicates and unknown ids); with the policies whose router
refcounts active blocks, the distinct active blocks too, and how many requests share a prefix."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.router import Candidate, InFlight, PrefixHit, Router, RouteRequest, make_policy

ENGINES = ("a", "b", "c")
BS = 16

ops = st.lists(
    st.tuples(
        st.sampled_from(["route", "first", "finish", "drop"]),
        st.integers(0, 7),  # request number
        st.integers(1, 200),  # prompt tokens
        st.sampled_from(ENGINES),
    ),
    max_size=60,
)


@pytest.mark.parametrize("policy", ["kvplane", "dynamo_cost"])
@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_inflight_matches_a_naive_model(
    policy: str, steps: list[tuple[str, int, int, str]]
) -> None:
    router = Router(make_policy(policy), pending_ttl_s=0)
    counts_blocks = router.policy.counts_active_blocks
    rng = random.Random(0)
    # rid -> engine, prefill, cached, block keys, prefilling (prompts share leading keys)
    model: dict[str, tuple[str, int, int, tuple[int, ...], bool]] = {}
    for op, n, tokens, engine in steps:
        rid = f"r{n}"
        if op == "route":
            req = RouteRequest(rid, tokens, BS, tuple(range(tokens // BS)))
            cands = [Candidate(e, hit=PrefixHit(1 if e == engine else 0)) for e in ENGINES]
            d = router.route(req, cands, rng, 0.0)
            model[rid] = (
                d.engine_id,
                tokens - d.predicted_cached_tokens,
                d.predicted_cached_tokens,
                req.block_keys,
                True,
            )
        elif op == "first":
            router.first_token(rid)
            if rid in model:
                e, p, c, b, _ = model[rid]
                model[rid] = (e, p, c, b, False)
        elif op == "finish":
            router.finish(rid)
            model.pop(rid, None)
        else:
            router.forget_engine(engine)
            model = {k: v for k, v in model.items() if v[0] != engine}
        for e in ENGINES:
            mine = [v for v in model.values() if v[0] == e]
            expected = InFlight(
                requests=len(mine),
                prefilling=sum(v[4] for v in mine),
                prefill_tokens=sum(v[1] for v in mine if v[4]),
                prefill_cached_tokens=sum(v[2] for v in mine if v[4]),
                active_blocks=len({k for v in mine for k in v[3]}) if counts_blocks else 0,
            )
            assert router.inflight.of(e) == expected
            probe = tuple(range(8))
            active = {k for v in mine for k in v[3]} if counts_blocks else set()
            overlap = len(active & set(probe))
            # ... and the requests that hold all of that prefix.
            holding = [v for v in mine if overlap and set(probe[:overlap]) <= set(v[3])]
            sharers = len(holding) if counts_blocks else 0
            assert router.inflight.active_prefix(e, probe) == (overlap, sharers)
    assert len(router.inflight) == len(model)
