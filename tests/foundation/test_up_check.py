"""`kvplane up --check`'s smoke test (kvplane/up/check.py) fails on engines that answer
wrongly: a real controller in this process over a sim engine fronted by a server that
corrupts its answers the way a broken engine would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvplane.up.check import NUM_PREFIXES, check_fleet
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import close_fleet, engines_of_kinds, make_fleet
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine

pytestmark = pytest.mark.timeout(60)


class _CacheChangesAnswers(Forwarding):
    """An engine whose answer to a prompt it has seen (its prefix then cached) is not the
    answer it computed the first time: each token one more."""

    seen: set[tuple[int, ...]]

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = tuple(request.token_ids.ids)
        again = prompt in self.seen
        self.seen.add(prompt)
        async for response in self.inner.Generate(request):
            if again and response.HasField("token"):
                for token in response.token.tokens:
                    token.token_id += 1
            yield response


class _NeverFinishes(Forwarding):
    """An engine whose streams end without their GenerationFinished."""

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.inner.Generate(request):
            if response.HasField("finished"):
                response.ClearField("finished")
            yield response


async def _problems(servicer_for: Any) -> list[str]:
    engine = await start_fronted_engine("e0", servicer_for)
    fleet = await make_fleet(engines=engines_of_kinds(engine))
    try:
        return await check_fleet(fleet.target)
    finally:
        await close_fleet(fleet)


async def test_check_fails_when_a_cached_prefix_changes_the_answer() -> None:
    """A greedy prompt sent again is answered from the engine's prefix cache: an answer
    other than the first is a problem of each prefix (cached KV computed wrongly)."""

    def servicer_for(inner: Any) -> _CacheChangesAnswers:
        servicer = _CacheChangesAnswers(inner)
        servicer.seen = set()
        return servicer

    problems = await _problems(servicer_for)
    changed = [p for p in problems if "the same greedy prompt answered" in p]
    assert [p.split(":")[0] for p in changed] == [f"check-{i}-c" for i in range(NUM_PREFIXES)]


async def test_check_fails_when_a_stream_ends_without_its_generation_finished() -> None:
    """A stream that ends without saying how (GenerationFinished) is incomplete, whatever
    tokens it brought."""
    problems = await _problems(_NeverFinishes)
    assert "check-0-a: 0 GenerationFinished events, expected 1" in problems, problems
