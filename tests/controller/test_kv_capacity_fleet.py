"""A disaggregated fleet whose decode engines differ in their KV cache (engine config
`num_kv_blocks`), real torch engines on the builtin model behind a controller with no
tokenizer (or a prompt past `tokenize_max_chars`), so the gateway does not know a text
prompt's size before its prefill: a prompt only the larger decode engine's cache holds is
decoded there, chosen by the prompt's tokens the prefill engine told at its handoff. It was
handed to whichever decode engine the load chose, and a smaller one refused it after its
prefill, INVALID_ARGUMENT "does not fit the KV cache", never tried on the larger one. A
prompt no decode engine's cache holds is refused at the handoff, INVALID_ARGUMENT, naming
the largest context a decode engine takes, its KV session released on the prefill engine. And an
engine that reports a context past what its KV cache holds (not a kvplane engine, which
reports no more than its cache holds) is not sent a prompt its cache cannot hold."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.config import EngineConfig, EngineRoleName
from engine.server.service import EngineApp, start_engine
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.controller.test_gateway import generate_routed
from tests.controller.test_two_model_fleet import front
from tests.polling import eventually

pytestmark = pytest.mark.timeout(120)

# Each engine's cache, in blocks of 16 tokens: the small decode engine's holds 128 tokens,
# the large one's 1024, the prefill engine's 2048.
SMALL, LARGE, PREFILL = 8, 64, 128
# 480 tokens in the builtin model's tokenizer: past the small engine's cache, within the
# large one's.
LONG_TEXT = "hello world " * 60


async def builtin_engine(name: str, role: EngineRoleName, num_kv_blocks: int) -> EngineApp:
    """A torch engine on the builtin model of `role`, its cache `num_kv_blocks` blocks."""
    return await start_engine(
        EngineConfig(
            model="builtin",
            listen="127.0.0.1:0",
            instance_id=name,
            role=role,
            num_kv_blocks=num_kv_blocks,
            num_threads=1,
            shutdown_grace_s=0.5,
        )
    )


@pytest.fixture
async def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    engines = [
        await builtin_engine("p0", EngineRoleName.prefill, PREFILL),
        await builtin_engine("small", EngineRoleName.decode, SMALL),
        await builtin_engine("large", EngineRoleName.decode, LARGE),
    ]
    # Past 100 characters a text prompt is not tokenised here: its size is first known at the
    # prefill engine's handoff.
    fleet = await make_fleet(engines=engines, tokenize_max_chars=100)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


def text_request(request_id: str, text: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, model="builtin", prompt=text)
    request.stopping.max_tokens = 4
    return request


async def test_a_prompt_only_the_larger_decode_engine_holds_is_decoded_there(
    fleet: Fleet,
) -> None:
    """Each request finishes, decoded on the large engine; a short prompt still goes to the
    small one (the large one cordoned: the small one takes it, eligible)."""
    large = fleet.address(fleet.engines[2])
    for i in range(4):
        reply, route = await generate_routed(fleet, text_request(f"long{i}", f"{i} {LONG_TEXT}"))
        assert reply[-1].WhichOneof("event") == "finished", reply[-1]
        assert reply[-1].usage.prompt_tokens > SMALL * 16
        assert route is not None and route["engine"] == large, route
    fleet.app.controller.fleet.registry.set_cordoned(large, True)
    small = fleet.address(fleet.engines[1])
    for i in range(2):
        reply, route = await generate_routed(fleet, text_request(f"short{i}", f"hi {i}"))
        assert reply[-1].WhichOneof("event") == "finished"
        assert route is not None and route["engine"] == small, route


async def test_a_prompt_no_decode_engine_holds_is_refused_at_the_handoff(fleet: Fleet) -> None:
    """1440 tokens: within the prefill engine's cache, past both decode engines'."""
    call = fleet.gateway.Generate(text_request("huge", LONG_TEXT * 3))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert "the request needs max_context_length 1441" in details, details
    assert str(LARGE * 16 + 1) in details, details  # the large engine's context
    async with grpc.aio.insecure_channel(fleet.address(fleet.engines[0])) as channel:
        prefill = pb_grpc.OpenEngineStub(channel)

        async def released() -> bool:
            load = await prefill.GetLoad(pb.GetLoadRequest())
            return load.active_kv_sessions == 0

        await eventually(released)


async def test_a_prompt_only_a_cordoned_decode_engine_holds_is_refused_naming_each_lack(
    fleet: Fleet,
) -> None:
    """The large decode engine cordoned: a prompt only its cache holds is refused at the
    handoff, INVALID_ARGUMENT naming what the small one lacks, its KV session released on
    the prefill engine; not UNAVAILABLE, "no engine", as if the fleet were down."""
    fleet.app.controller.fleet.registry.set_cordoned(fleet.address(fleet.engines[2]), True)
    call = fleet.gateway.Generate(text_request("long-cordoned", LONG_TEXT))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    details = caught.value.details() or ""
    assert "no decode engine takes the prompt of" in details, details
    assert f"small max_context_length {SMALL * 16 + 1} <" in details, details
    async with grpc.aio.insecure_channel(fleet.address(fleet.engines[0])) as channel:
        prefill = pb_grpc.OpenEngineStub(channel)

        async def released() -> bool:
            load = await prefill.GetLoad(pb.GetLoadRequest())
            return load.active_kv_sessions == 0

        await eventually(released)


class ContextPastItsCache(Forwarding):
    """GetModelInfo says the model's context, 4096, whatever its KV cache holds (as an engine
    may that does not bound its context by its cache)."""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await self.inner.GetModelInfo(request)
        info.max_context_length = 4096
        return info


async def test_an_engine_whose_cache_cannot_hold_the_prompt_is_not_sent_it() -> None:
    """Round robin between an engine whose cache holds 128 tokens (its context said 4096) and
    one whose cache holds 4096: every prompt of 300 tokens goes to the second at once (the
    first was sent every other one, and refused it, "does not fit the KV cache", to be sent
    it again)."""
    small = await start_fronted_engine("small", ContextPastItsCache, num_kv_blocks=SMALL)
    large = await start_sim_engine("large", num_kv_blocks=256)
    engines: list[Any] = [small, large]
    fleet = await make_fleet(engines=engines, router={"policy": "round_robin"})
    try:
        for i in range(4):
            reply, route = await generate_routed(
                fleet, generate_request(f"r{i}", [i + 1] * 300, max_tokens=4)
            )
            assert reply[-1].WhichOneof("event") == "finished"
            assert route is not None and route["engine"] == fleet.address(large), route
            assert route["retried"] is False, route
    finally:
        await close_fleet(fleet)


async def test_a_prompt_that_just_fits_an_engines_cache_is_still_sent_it() -> None:
    """Round robin between an engine whose cache holds 128 tokens (its context said 4096) and
    a larger one: a prompt of 128 tokens and one output token goes to both, served at once
    (its KV is the prompt's: the output's one token computes none, as the engine checks
    it), and one of 129 to the larger alone. A need counting the last token's KV too sent
    every prompt that just fits the small engine to the larger one."""
    small = await start_fronted_engine("small", ContextPastItsCache, num_kv_blocks=SMALL)
    large = await start_sim_engine("large", num_kv_blocks=256)
    engines: list[Any] = [small, large]
    fleet = await make_fleet(engines=engines, router={"policy": "round_robin"})
    try:
        for tokens, served_by in (
            (SMALL * 16, {fleet.address(small), fleet.address(large)}),
            (SMALL * 16 + 1, {fleet.address(large)}),
        ):
            chosen = set()
            for i in range(4):
                reply, route = await generate_routed(
                    fleet, generate_request(f"r{tokens}-{i}", [i + 1] * tokens, max_tokens=1)
                )
                assert reply[-1].WhichOneof("event") == "finished", reply[-1]
                assert route is not None and route["retried"] is False, route
                chosen.add(route["engine"])
            assert chosen == served_by, (tokens, chosen)
    finally:
        await close_fleet(fleet)


async def test_a_fronted_fleet_is_not_sent_a_prompt_no_engine_of_it_holds() -> None:
    """An upper controller fronting two lower ones, round robin: one of two engines whose
    caches hold 128 tokens each (their context said 4096), one of an engine whose cache holds
    1024. The first advertises the context its engines serve (129: their cache's, a token
    more), not 4096, and every prompt of 200 tokens goes to the second at once. (The first
    advertised 4096 and 256 tokens of cache, its engines' summed: the upper sent it every
    other prompt, which it refused, no engine of it holding one, to be sent it again.)"""
    small: list[Any] = [
        await start_fronted_engine(f"small{i}", ContextPastItsCache, num_kv_blocks=SMALL)
        for i in range(2)
    ]
    small_fleet = await make_fleet(engines=small)
    large_fleet = await make_fleet(engines=[await start_sim_engine("large", num_kv_blocks=64)])
    upper: Fleet = await make_fleet(engines=[], router={"policy": "round_robin"})
    try:
        info = await small_fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        assert info.max_context_length == SMALL * 16 + 1, info
        assert info.total_kv_blocks == 2 * SMALL, info  # the capacity stays the fleet's
        for lower, routable in ((small_fleet, 1), (large_fleet, 2)):
            await front(upper, lower, routable)
        for i in range(4):
            reply, route = await generate_routed(
                upper, generate_request(f"r{i}", [i + 1] * 200, max_tokens=4)
            )
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            assert route is not None and route["engine"] == large_fleet.target, route
            assert route["retried"] is False, route
    finally:
        for fleet in (upper, small_fleet, large_fleet):
            await close_fleet(fleet)


async def test_a_minimum_output_past_the_prefill_engines_context_is_still_prefilled_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill engine whose cache holds 128 tokens beside a decode engine whose cache holds
    1024: a request asking at least 200 new tokens (`min_tokens`) is prefilled on the first,
    which computes the prompt and one token alone (`prefill_request`), and decoded on the
    second, whether its prompt's tokens are known here (token ids) or not (a text prompt past
    `tokenize_max_chars`). Its minimum was judged against the prefill engine's context too,
    as if it produced the output: with a text prompt, UNAVAILABLE "no prefill engine
    available", and with token ids alike. A minimum past the decode engine's is still refused
    before any engine is asked, naming the decode engine's context."""
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    engines = [
        await builtin_engine("p0", EngineRoleName.prefill, SMALL),
        await builtin_engine("d0", EngineRoleName.decode, LARGE),
    ]
    fleet = await make_fleet(engines=engines, tokenize_max_chars=100)
    try:
        prefill, decode = (fleet.address(e) for e in fleet.engines)
        text = text_request("min-text", "hello world " * 10)  # not tokenised here
        tokens = generate_request("min-tokens", list(range(1, 31)))
        tokens.model = "builtin"
        for request in (text, tokens):
            request.stopping.min_tokens = request.stopping.max_tokens = 200
            reply, route = await generate_routed(fleet, request)
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            assert reply[-1].usage.completion_tokens == 200, reply[-1]
            assert route is not None and route["engine"] == decode, route
            assert route["prefill"]["engine"] == prefill, route
        huge = text_request("min-huge", "hello world " * 10)
        huge.stopping.min_tokens = huge.stopping.max_tokens = 2000
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate_routed(fleet, huge)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert f"the largest any engine serving model 'builtin' takes is {LARGE * 16 + 1}" in (
            caught.value.details() or ""
        ), caught.value.details()
    finally:
        await close_fleet(fleet)


async def test_a_prompt_a_short_prefill_engine_refuses_skips_the_other_short_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prefill engines whose caches hold 128 tokens beside one whose cache holds 1024,
    round robin, a text prompt of 480 tokens not tokenised here asking at least 100 new
    tokens: a short prefill engine's refusal says the prompt is 128 tokens at least (its hop
    is the prompt and one token, whatever `min_tokens`), so it goes to the long prefill
    engine at once, never to the other short one."""
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    engines = [
        await builtin_engine("p-short0", EngineRoleName.prefill, SMALL),
        await builtin_engine("p-short1", EngineRoleName.prefill, SMALL),
        await builtin_engine("p-long", EngineRoleName.prefill, LARGE),
        await builtin_engine("d0", EngineRoleName.decode, LARGE),
    ]
    fleet = await make_fleet(
        engines=engines, tokenize_max_chars=100, router={"policy": "round_robin"}
    )
    try:
        long_prefill = fleet.address(engines[2])
        refused_by = []
        for i in range(6):
            request = text_request(f"long{i}", f"{i} {LONG_TEXT}")
            request.stopping.min_tokens = request.stopping.max_tokens = 100
            reply, route = await generate_routed(fleet, request)
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            assert route is not None and route["prefill"]["engine"] == long_prefill, route
            refused_by.append(route.get("retried_from", []))
        assert all(len(refusals) <= 1 for refusals in refused_by), refused_by
        assert any(refused_by), refused_by
    finally:
        await close_fleet(fleet)
