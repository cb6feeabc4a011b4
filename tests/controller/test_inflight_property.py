"""In-flight accounting against a naive model, under any order of route / first token /
finish / engine removal (including duplicates and unknown ids)."""

from __future__ import annotations

import math
import random

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


@settings(max_examples=150, deadline=None)
@given(ops)
def test_inflight_matches_a_naive_model(steps: list[tuple[str, int, int, str]]) -> None:
    router = Router(make_policy("kvplane"), pending_ttl_s=0)
    rng = random.Random(0)
    # rid -> engine, prefill, cached, blocks, prefilling
    model: dict[str, tuple[str, int, int, int, bool]] = {}
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
                math.ceil(tokens / BS),
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
                context_blocks=sum(v[3] for v in mine),
            )
            assert router.inflight.of(e) == expected
    assert len(router.inflight) == len(model)
