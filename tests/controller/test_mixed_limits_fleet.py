"""A fleet whose engines of one model differ in their limits (a short-context sim engine
beside a long-context one) behind the controller, through real servers: a prompt only the
long-context engine takes goes there and succeeds, one past every engine's context is
refused by the gateway naming the limit and the largest the fleet has, and GetModelInfo
advertises the largest context (routing honours each engine's)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest

from controller.eligibility import ROUTED_LIMITS, ROUTED_OPTIONS
from controller.model_info import CAPABILITY_FLAGS, REQUEST_LIMITS
from controller.registry import Role
from controller.route_report import ROUTE_METADATA_KEY, read_route
from engine.config import LoraConfig
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    Fleet,
    ServedEngine,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.controller.test_admin_cli import cli, cli_json
from tests.controller.test_fleet_health import SaysHealth
from tests.controller.test_gateway import engine_answer_or_raise, generate_routed
from tests.controller.test_lora_fleet_intent import adapter, on
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(60)

SHORT, LONG = 128, 1024  # each engine's max_model_len (its KV cache holds more)


@pytest.fixture
async def mixed() -> AsyncIterator[Fleet]:
    engines = [
        await start_sim_engine("short0", max_model_len=SHORT),
        await start_sim_engine("short1", max_model_len=SHORT),
        await start_sim_engine("long", max_model_len=LONG),
    ]
    fleet = await make_fleet(engines=engines, router={"policy": "round_robin"})
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def test_a_long_prompt_goes_to_the_engine_that_takes_it(mixed: Fleet) -> None:
    """Round robin would send two of every three requests to a short engine, which refuses
    a 300-token prompt: each goes to the long engine and succeeds; a short prompt still goes
    anywhere."""
    long_engine = f"127.0.0.1:{mixed.engines[2].port}"
    for i in range(4):
        reply, route = await generate_routed(
            mixed, generate_request(f"long{i}", [i + 1] * 300, max_tokens=4)
        )
        assert reply[-1].WhichOneof("event") == "finished"
        assert route is not None and route["engine"] == long_engine
    served = set()
    for i in range(3):
        _, route = await generate_routed(mixed, generate_request(f"short{i}", [i + 7] * 40))
        assert route is not None
        served.add(route["engine"])
    assert len(served) == 3


async def test_a_prompt_past_every_engines_context_is_refused_naming_the_largest(
    mixed: Fleet,
) -> None:
    call = mixed.gateway.Generate(generate_request("huge", [5] * LONG, max_tokens=4))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert "max_context_length" in details and str(LONG) in details, details
    # Refused before any engine was asked: no route told.
    trailing = await call.trailing_metadata() or ()
    assert ROUTE_METADATA_KEY not in [k for k, _ in trailing]


async def test_match_lists_the_engines_that_do_not_take_the_prompt_and_why(
    mixed: Fleet, tmp_path: Path
) -> None:
    """`kvplane admin match` of a prompt only the long engine takes lists the short engines
    too, each naming the limit it lacks, as an engine out of routing names its state (they
    were left out, while a draining short engine was listed); `route` (what the router sees)
    still weighs the long engine alone, and a short prompt marks no engine."""
    t = ["--target", mixed.target]
    prompt = list(range(1000, 1300))
    _, route = await generate_routed(mixed, generate_request("long", prompt, max_tokens=4))
    long_engine = f"127.0.0.1:{mixed.engines[2].port}"
    assert route is not None and route["engine"] == long_engine
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(map(str, prompt)))

    async def matched() -> dict[str, Any]:
        reply = await cli_json("match", "--tokens-file", str(tokens), *t)
        return {m["instance_id"]: m for m in reply["matches"]}

    async def long_holds_it() -> bool:
        blocks: int = (await matched()).get("long", {}).get("device_blocks", 0)
        return blocks >= len(prompt) // 16

    await eventually(long_holds_it)
    rows = await matched()
    assert sorted(rows) == ["long", "short0", "short1"]
    assert rows["long"]["out_of_routing"] == ""
    lacks = f"max_context_length {SHORT} < {len(prompt) + 1}"  # the prompt and one output token
    assert rows["short0"]["out_of_routing"] == rows["short1"]["out_of_routing"] == lacks
    table = await cli("match", "--tokens-file", str(tokens), *t)
    assert table.exit_code == 0, table.output
    header, *lines = table.stdout.splitlines()[1:]
    assert header.endswith("OUT OF ROUTING"), header
    marks = {line.split()[0]: line.split(maxsplit=6)[-1] for line in lines}
    assert marks == {"long": "-", "short0": lacks, "short1": lacks}, table.stdout
    # What the router sees is unchanged.
    routed = await cli_json("route", "--tokens-file", str(tokens), *t)
    assert [c["instance_id"] for c in routed["costs"]] == ["long"]

    tokens.write_text(" ".join(map(str, prompt[:40])))
    rows = await matched()
    assert {i: m["out_of_routing"] for i, m in rows.items()} == dict.fromkeys(rows, "")
    assert sorted(rows) == ["long", "short0", "short1"]


async def test_match_of_a_prompt_no_engine_takes_lists_each_with_the_limit_it_lacks(
    mixed: Fleet, tmp_path: Path
) -> None:
    """A prompt past every engine's context: `route` (what the router does) refuses it,
    naming the largest, while `match` still lists every engine taking traffic, each with the
    limit it lacks (it failed with route's refusal, listing none, while a prompt one engine
    takes lists the others with theirs)."""
    t = ["--target", mixed.target]
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(map(str, range(1000, 1000 + LONG))))
    routed = await cli("route", "--tokens-file", str(tokens), *t)
    refusal = str(routed.exception)
    assert routed.exit_code == 1 and "INVALID_ARGUMENT" in refusal, refusal
    assert f"the largest any engine serving the default model takes is {LONG}" in refusal
    reply = await cli_json("match", "--tokens-file", str(tokens), *t)
    assert reply["num_prompt_tokens"] == LONG
    rows = {m["instance_id"]: m["out_of_routing"] for m in reply["matches"]}
    assert rows == {
        "short0": f"max_context_length {SHORT} < {LONG + 1}",
        "short1": f"max_context_length {SHORT} < {LONG + 1}",
        "long": f"max_context_length {LONG} < {LONG + 1}",
    }


async def test_model_info_advertises_the_largest_context_and_the_fleets_names(
    mixed: Fleet,
) -> None:
    """The largest context (routing honours each engine's), the output limit still the
    smallest (an engine caps its output at its context); the block size and the model's name
    the engines share, whichever engine answers."""
    for _ in range(3):
        info = await mixed.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        assert info.max_context_length == LONG
        assert info.max_output_tokens == SHORT - 1
        assert info.kv_block_size == 16
        assert info.served_model_name == "sim"


async def test_health_is_starting_while_the_only_engine_starts() -> None:
    """An engine that says STARTING takes no traffic: the fleet of it alone is STARTING (it
    will serve), not NOT_READY."""
    scripted = await start_fronted_engine("s0", SaysHealth)
    fleet = await make_fleet(engines=[scripted])
    try:
        scripted.servicer.state = pb.HEALTH_STATE_STARTING
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(lambda: not registry.routable(), 30.0)
        health = await fleet.gateway.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_STARTING
    finally:
        await close_fleet(fleet)


def test_what_routing_honours_is_of_what_model_info_tells() -> None:
    """Routing's limits and options are drawn from GetModelInfo's lists, and every limit and
    option a request may need (`needs_of`, asking everything) is one of them: a need of a
    name no engine reports would pass every engine unread."""
    from controller.eligibility import KV_CACHE_LIMIT, needs_of
    from controller.model_info import SELECTION_OPTIONS

    assert set(ROUTED_LIMITS) <= set(REQUEST_LIMITS)
    assert set(ROUTED_OPTIONS) <= {*CAPABILITY_FLAGS, *SELECTION_OPTIONS}
    everything = pb.GenerateRequest(
        sampling=pb.SamplingParams(num_sequences=4),
        stopping=pb.StoppingOptions(min_tokens=3, include_stop_in_output=True),
        response=pb.ResponseOptions(
            return_prompt_logprobs=True,
            prompt_candidates=pb.CandidateTokenSelection(top_n=2),
            return_output_logprobs=True,
            output_candidates=pb.CandidateTokenSelection(top_n=5),
        ),
        kv=pb.KvOptions(bypass_prefix_cache=True, cache_salt="s"),
        guided=pb.GuidedDecoding(regex="a+"),
        priority=2,
    )
    needs = [
        needs_of(pb.GenerateRequest(prompt="hi")),
        needs_of(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))),
    ]
    needs.append(needs_of(everything).with_prompt(10))
    for selection in (
        pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[1])),
        pb.CandidateTokenSelection(all=pb.AllCandidates()),
    ):
        response = pb.ResponseOptions(prompt_candidates=selection, output_candidates=selection)
        needs.append(needs_of(pb.GenerateRequest(prompt="hi", response=response)))
    assert {path for n in needs for path, _ in n.limits} == {*ROUTED_LIMITS, KV_CACHE_LIMIT}
    assert {o for n in needs for o in n.options} == set(ROUTED_OPTIONS)


@pytest.mark.parametrize(
    "module", ["controller.eligibility", "controller.fleet_view", "controller.fleet"]
)
def test_the_modules_routing_reads_model_info_through_import_first(module: str) -> None:
    """Routing's limits and options are drawn from the lists GetModelInfo is read by
    (controller.model_info), which once lived in controller.fleet: eligibility could not
    import them (fleet imports fleet_view, which imports eligibility) and kept copies. Each
    module imports first in a fresh process: no cycle among them."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)


async def test_model_info_tells_the_fleets_block_size_and_name_whichever_engine_answers() -> None:
    """Engines serving `x` with different block sizes, one as its name, one as an alias of
    `m`: GetModelInfo leaves `kv_block_size` out (no one size: as GetLoad's lists them) and
    names the model `x` (the name every one of them serves), whichever engine answers. It
    used to be the answering engine's: 16 or 32, `m` or `x`, by which was routable."""
    aliased = await start_sim_engine("aliased", served_model_name="m", served_model_aliases=["x"])
    named = await start_sim_engine("named", served_model_name="x", block_size=32)
    fleet = await make_fleet(engines=[aliased, named])
    try:
        for cordoned in ("aliased", "named"):
            await fleet.admin.Cordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(1)
            info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="x"))
            assert not info.HasField("kv_block_size")
            assert info.served_model_name == "x"
            await fleet.admin.Uncordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(2)
    finally:
        await close_fleet(fleet)


async def test_a_disaggregated_fleet_takes_the_context_its_decode_engines_take() -> None:
    """A long-context prefill engine beside a short-context decode engine: prefill engines
    alone serve no Generate, so a prompt past the decode engine's context is refused naming
    it as the largest the fleet takes, before any engine is asked, and GetModelInfo
    advertises it; a prompt within it is served. Before, the prefill engine's context was
    advertised, and such a prompt failed UNAVAILABLE ("no decode engine available"), worth
    retrying by its status, which it never was."""
    prefill = await start_sim_engine("p0", role="prefill", max_model_len=LONG)
    decode = await start_sim_engine("d0", role="decode", max_model_len=SHORT)
    fleet = await make_fleet(engines=[prefill, decode])
    try:
        info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        call = fleet.gateway.Generate(generate_request("past", [5] * 300, max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        details = caught.value.details() or ""
        assert "max_context_length 301; the largest" in details and str(SHORT) in details
        assert info.max_context_length == SHORT
        within = [r async for r in fleet.gateway.Generate(generate_request("in", [5] * 40))]
        assert within[-1].WhichOneof("event") == "finished", within[-1]
    finally:
        await close_fleet(fleet)


async def refused_invalid(call: Any) -> str:
    """The details of the INVALID_ARGUMENT refusal the Generate `call` ends with."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    return caught.value.details() or ""


async def test_a_prompt_past_every_prefill_engine_is_prefilled_by_a_decode_engine_or_refused() -> (
    None
):
    """A short-context prefill engine beside a long-context decode engine. Where decode
    engines may prefill (`skip_prefill_ratio`), a prompt past the prefill engine's context
    is prefilled by the decode engine itself, as when no prefill engine is up, and
    GetModelInfo advertises the decode engine's context; where they never do, no engine of
    its path takes it: refused INVALID_ARGUMENT naming the prefill engine's context, the
    largest that would serve it, which GetModelInfo advertises. It advertised the decode
    engine's context either way, and such a prompt failed UNAVAILABLE ("no prefill engine
    available") where decode engines never prefill: worth retrying by its status, which it
    never was. A prompt within both is served either way."""
    for router, prefills in (({}, False), ({"skip_prefill_ratio": 0.9}, True)):
        prefill = await start_sim_engine("p0", role="prefill", max_model_len=SHORT)
        decode = await start_sim_engine("d0", role="decode", max_model_len=LONG)
        fleet = await make_fleet(engines=[prefill, decode], router=router)
        try:
            long_prompt = generate_request("past", [5] * 300, max_tokens=4)
            if prefills:
                reply, route = await generate_routed(fleet, long_prompt)
                assert reply[-1].WhichOneof("event") == "finished", reply[-1]
                assert route is not None and "prefill" not in route, route
                assert route["engine"] == f"127.0.0.1:{decode.port}", route
            else:
                details = await refused_invalid(fleet.gateway.Generate(long_prompt))
                assert "max_context_length 301" in details, details
                assert f"takes is {SHORT}" in details, details
            within = [r async for r in fleet.gateway.Generate(generate_request("in", [5] * 40))]
            assert within[-1].WhichOneof("event") == "finished", (router, within[-1])
            info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
            assert info.max_context_length == (LONG if prefills else SHORT), (router, info)
        finally:
            await close_fleet(fleet)


async def test_a_lora_request_no_engine_holding_its_adapter_takes_names_the_adapter(
    tmp_path: Path,
) -> None:
    """Adapter x is on the short engine alone; a prompt past its context, which the long
    engine would take, is refused naming x, what narrowed the candidates: the short engine's
    context and the long engine without x. It used to name the short engine's context alone,
    as if no engine took such a prompt."""
    engines = [
        await start_sim_engine(name, max_model_len=length, lora=LoraConfig(enabled=True))
        for name, length in (("short", SHORT), ("long", LONG))
    ]
    fleet = await make_fleet(engines=engines)
    try:
        x = adapter(tmp_path, "x", 1)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x), metadata=on("short"))
        request = generate_request("past-x", [3] * 300, max_tokens=4)
        request.lora_name = "x"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in fleet.gateway.Generate(request)]
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = caught.value.details() or ""
        assert "with LoRA adapter 'x' do not take the request: short max_context_length" in (
            details
        ), details
        assert "it would go to long, which do not hold 'x'" in details, details
    finally:
        await close_fleet(fleet)


def test_a_pooling_inputs_limit_is_the_context_unless_the_kv_cache_bounds_it() -> None:
    """An engine checks a pooling input against its model's length, which its context is,
    unless a generating engine's KV cache bounds the context (its cache's tokens plus one):
    that says nothing of the model's length, so such an engine may take any input."""
    from controller.eligibility import CONTEXT_LIMIT, input_context, takes_input
    from controller.registry import ModelFacts

    kv_bound = ModelFacts(block_size=16, total_kv_blocks=4, limits=((CONTEXT_LIMIT, 65),))
    assert input_context(kv_bound) is None and takes_input(kv_bound, 4096)
    model_bound = ModelFacts(block_size=16, total_kv_blocks=4, limits=((CONTEXT_LIMIT, 64),))
    assert input_context(model_bound) == 64
    assert takes_input(model_bound, 64) and not takes_input(model_bound, 65)
    pooling = ModelFacts(generates=False, tasks=frozenset({"embed"}), limits=((CONTEXT_LIMIT, 65),))
    assert input_context(pooling) == 65 and takes_input(pooling, None)


async def test_a_vllm_generate_goes_only_to_an_engine_that_takes_what_it_asks() -> None:
    """Round robin between an engine of 2 sequences and a short context and one of 8 and a
    long context: a vllm.Generate of 4 sequences, or of a minimum output past the short
    context, goes to the second and is served; one of 16 sequences is refused before any
    engine is asked, naming the largest. vllm.Generate was routed by its context alone:
    every other one was refused by the first engine ("num_sequences 4 is more than this
    engine's max_num_seqs 2", "a minimum of 100 new tokens does not fit")."""
    few = await start_sim_engine("few", max_num_seqs=2, max_model_len=SHORT)
    many = await start_sim_engine("many", max_num_seqs=8, max_model_len=LONG)
    fleet = await make_fleet(engines=[few, many], router={"policy": "round_robin"})
    stub = vpb_grpc.GenerateStub(fleet.channel)

    def request(request_id: str, sequences: int, min_tokens: int) -> vpb.GenerateRequest:
        return vpb.GenerateRequest(
            request_id=request_id,
            model="sim",
            token_ids=vpb.TokenIds(ids=[7] * 50),
            sampling=vpb.RandomSampling(num_sequences=sequences),
            stopping=vpb.StoppingCriteria(max_new_tokens=100, min_new_tokens=min_tokens),
        )

    try:
        for i, (sequences, min_tokens) in enumerate([(4, 0), (4, 0), (1, 100), (1, 100)]):
            call = stub.GenerateStream(request(f"v{i}", sequences, min_tokens))
            chunks = [r async for r in call]
            ended = [c.outputs.index for c in chunks if c.outputs.HasField("finish_info")]
            assert sorted(ended) == list(range(sequences)), chunks[-1]
            route = read_route(await call.trailing_metadata())
            assert route is not None and route["engine"] == fleet.address(many), route
            assert route["retried"] is False, route
        call = stub.GenerateStream(request("past", 16, 0))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        details = caught.value.details() or ""
        assert "generation.max_num_sequences 16; the largest" in details and "is 8" in details
        trailing = await call.trailing_metadata() or ()
        assert ROUTE_METADATA_KEY not in [k for k, _ in trailing]
    finally:
        await close_fleet(fleet)


async def test_candidates_asked_without_their_flag_go_only_to_an_engine_taking_them() -> None:
    """Round robin between engines of a 64-token and a 1000-token vocabulary (each takes as
    many logprob candidates, its `max_top_n`): a Generate selecting 100 prompt or output
    candidates and leaving `return_*_logprobs` absent asks for those logprobs, as an engine
    reads it, so it goes to the second and is served; 2000 is refused before any engine is
    asked, naming the largest; candidates beside an explicit false flag are the engine's
    refusal, relayed as it is. The controller counted logprobs asked by the flag alone:
    every other such request went to the small engine, which refused it ("top_n 100 is more
    than max_top_n 64")."""
    small = await start_sim_engine("small", sim={"vocab_size": 64})
    large = await start_sim_engine("large", sim={"vocab_size": 1000})
    fleet = await make_fleet(engines=[small, large], router={"policy": "round_robin"})

    def request(request_id: str, **response: Any) -> pb.GenerateRequest:
        generate = generate_request(request_id, [5, 6, 7, 8], max_tokens=2)
        generate.response.CopyFrom(pb.ResponseOptions(**response))
        return generate

    hundred = pb.CandidateTokenSelection(top_n=100)
    try:
        for i in range(4):
            asked = {"output_candidates": hundred} if i % 2 else {"prompt_candidates": hundred}
            reply, route = await generate_routed(fleet, request(f"c{i}", **asked))
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            tokens = [t for r in reply for t in (*r.prompt.tokens, *r.token.tokens)]
            assert max(len(t.candidates) for t in tokens) == 100
            assert route is not None and route["engine"] == fleet.address(large), route
        call = fleet.gateway.Generate(
            request("past", output_candidates=pb.CandidateTokenSelection(top_n=2000))
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        details = caught.value.details() or ""
        assert "generation.output_logprobs.max_top_n 2000; the largest" in details, details
        assert "is 1000" in details, details
        contradicting = request("no", return_prompt_logprobs=False, prompt_candidates=hundred)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await engine_answer_or_raise(fleet.address(large), contradicting)
        with pytest.raises(grpc.aio.AioRpcError) as relayed:
            [r async for r in fleet.gateway.Generate(contradicting)]
        assert relayed.value.code() == refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert relayed.value.details() == refused.value.details(), relayed.value
        assert "return_prompt_logprobs is false" in (relayed.value.details() or "")
    finally:
        await close_fleet(fleet)


class PriorityNotTold(Forwarding):
    """GetModelInfo leaves `generation.supports_priority` out (an engine that does not tell
    it: it may take a priority, or not, and says so only by its answer)."""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await self.inner.GetModelInfo(request)
        info.generation.ClearField("supports_priority")
        return info


async def test_an_option_an_engine_does_not_tell_is_taken_as_supported() -> None:
    """Round robin between an engine telling `supports_priority: true` and one that does not
    tell it: requests with a priority go to both, served (an engine that does not report an
    option may take any). Taken as unsupported, every one went to the first."""
    untold = await start_fronted_engine("untold", PriorityNotTold)
    told = await start_sim_engine("told")
    engines: list[Any] = [untold, told]
    fleet = await make_fleet(engines=engines, router={"policy": "round_robin"})
    try:
        chosen = set()
        for i in range(4):
            request = generate_request(f"p{i}", [5, 6, 7, 8], max_tokens=2)
            request.priority = 1
            reply, route = await generate_routed(fleet, request)
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            assert route is not None and route["retried"] is False, route
            chosen.add(route["engine"])
        assert chosen == {fleet.address(untold), fleet.address(told)}, chosen
    finally:
        await close_fleet(fleet)


class PromptLogprobsOf(Forwarding):
    """A decode engine whose GetModelInfo tells other prompt logprobs than the sim engine
    behind it (`limits`: the `prompt_logprobs` capabilities' fields it replaces)."""

    limits: ClassVar[dict[str, Any]] = {}

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await self.inner.GetModelInfo(request)
        for field, value in self.limits.items():
            setattr(info.generation.prompt_logprobs, field, value)
        return info


class NoPromptLogprobs(PromptLogprobsOf):
    limits: ClassVar[dict[str, Any]] = {"supported": False, "max_top_n": 2}


class FewPromptCandidates(PromptLogprobsOf):
    limits: ClassVar[dict[str, Any]] = {"max_top_n": 2}


async def test_prompt_logprobs_are_asked_of_the_prefill_engine_not_the_decode_engine() -> None:
    """A prefill engine taking prompt logprobs of 8 candidates beside decode engines that
    do not (one says unsupported, both 2 candidates at most): decode engines never prefill
    a prompt here (no `router.skip_prefill_ratio`), and the decode hop is handed the
    prompt's KV without asking its logprobs (the prefill hop sends them), so such a request
    is served, its prompt logprobs with 8 candidates. The fleet's largest was the decode
    engines' (refused INVALID_ARGUMENT, "the largest ... is 2"), and every hop was checked
    for the prompt logprobs (no decode engine took it: UNAVAILABLE)."""
    engines: list[ServedEngine] = [
        await start_sim_engine("p0", role="prefill"),
        await start_fronted_engine("d0", NoPromptLogprobs, role="decode"),
        await start_fronted_engine("d1", FewPromptCandidates, role="decode"),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        for i in range(4):
            request = generate_request(f"p{i}", [5, 6, 7, 8] * 8, max_tokens=2)
            request.response.prompt_candidates.top_n = 8
            reply = [r async for r in fleet.gateway.Generate(request)]
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            prompt = [t for r in reply for t in r.prompt.tokens]
            assert prompt and max(len(t.candidates) for t in prompt) == 8, reply
    finally:
        await close_fleet(fleet)


async def test_model_info_tells_the_prompt_logprobs_of_the_engines_computing_a_prompt() -> None:
    """A prefill engine of a 64-token vocabulary (64 prompt candidates) beside decode
    engines saying prompt logprobs unsupported, of 2 candidates at most: routing asks prompt
    logprobs of the prefill engine alone where decode engines never prefill, so the
    gateway's GetModelInfo advertises them supported with 64 candidates, and a request
    asking those is served. It advertised the decode engines' (unsupported, 2 candidates),
    which routing never asks. Where decode engines may prefill (`skip_prefill_ratio`),
    routing asks them too: then theirs, and a request past them is refused naming 2."""
    for router, served in (({}, True), ({"skip_prefill_ratio": 0.9}, False)):
        engines: list[ServedEngine] = [
            await start_sim_engine("p0", role="prefill", sim={"vocab_size": 64}),
            await start_fronted_engine("d0", NoPromptLogprobs, role="decode"),
            await start_fronted_engine("d1", NoPromptLogprobs, role="decode"),
        ]
        fleet = await make_fleet(engines=engines, router=router)
        try:
            info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
            prompt_logprobs = info.generation.prompt_logprobs
            assert prompt_logprobs.supported is served, (router, info)
            assert prompt_logprobs.max_top_n == (64 if served else 2), (router, info)
            request = generate_request("all", [5, 6, 7, 8] * 8, max_tokens=2)
            request.response.prompt_candidates.top_n = 64
            call = fleet.gateway.Generate(request)
            if served:
                reply = [r async for r in call]
                prompt = [t for r in reply for t in r.prompt.tokens]
                assert prompt and max(len(t.candidates) for t in prompt) == 64, reply[-1]
                continue
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [r async for r in call]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert "prompt_logprobs.max_top_n 64; the largest" in (caught.value.details() or "")
            assert "is 2" in (caught.value.details() or ""), caught.value
        finally:
            await close_fleet(fleet)


def mode(selection: str) -> pb.CandidateTokenSelectionMode.ValueType:
    """The candidate selection mode a GetModelInfo lists of a CandidateTokenSelection's
    `selection` ("top_n", "token_ids", "all")."""
    return pb.CandidateTokenSelectionMode.Value(
        f"CANDIDATE_TOKEN_SELECTION_MODE_{selection.upper()}"
    )


class CandidateModes(Forwarding):
    """An engine selecting its logprobs' candidates by `modes` alone (per kind: "prompt",
    "output"): its GetModelInfo lists them, and it refuses a Generate
    selecting by another, INVALID_ARGUMENT, as an engine without the mode does."""

    modes: ClassVar[dict[str, tuple[str, ...]]] = {}

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await self.inner.GetModelInfo(request)
        for kind, selections in self.modes.items():
            listed = [mode(s) for s in selections]
            getattr(info.generation, f"{kind}_logprobs").candidate_selection_modes[:] = listed
        return info

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        for kind, selections in self.modes.items():
            which = getattr(request.response, f"{kind}_candidates").WhichOneof("selection")
            if which is not None and which not in selections:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{kind} candidates by {which}: unsupported"
                )
        async for response in self.inner.Generate(request):
            yield response


class NoWholeVocabulary(CandidateModes):
    modes: ClassVar[dict[str, tuple[str, ...]]] = {
        "prompt": ("top_n",),
        "output": ("top_n", "token_ids"),
    }


class NoTokenIds(CandidateModes):
    modes: ClassVar[dict[str, tuple[str, ...]]] = {
        "prompt": ("top_n",),
        "output": ("top_n", "all"),
    }


async def test_candidates_go_only_to_an_engine_selecting_them_as_asked() -> None:
    """Round robin between an engine selecting output candidates by top-N or token ids and
    one by top-N or the whole vocabulary: output candidates by token ids (twice in a row:
    round robin would send one to each) go to the first, the whole vocabulary to the second,
    each served; GetModelInfo lists every mode one of
    them takes for the output (routing honours each engine's), whichever answers, and
    top-N alone for the prompt, which both take alone; prompt candidates by token ids are
    the engine's own refusal, relayed as it is. An engine's modes were never read: every
    other such request went to an engine refusing it, and GetModelInfo listed the
    answering engine's own."""
    engines: list[ServedEngine] = [
        await start_fronted_engine("ids", NoWholeVocabulary, sim={"vocab_size": 64}),
        await start_fronted_engine("vocab", NoTokenIds, sim={"vocab_size": 64}),
    ]
    fleet = await make_fleet(engines=engines, router={"policy": "round_robin"})

    def request(request_id: str, **response: Any) -> pb.GenerateRequest:
        generate = generate_request(request_id, [5, 6, 7, 8], max_tokens=2)
        generate.response.CopyFrom(pb.ResponseOptions(**response))
        return generate

    ids = pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[1, 2, 3]))
    whole = pb.CandidateTokenSelection(all=pb.AllCandidates())
    try:
        for i in range(4):
            selection, engine, count = (ids, engines[0], 3) if i < 2 else (whole, engines[1], 64)
            reply, route = await generate_routed(
                fleet, request(f"c{i}", output_candidates=selection)
            )
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            assert max(len(t.candidates) for r in reply for t in r.token.tokens) == count
            assert route is not None and route["engine"] == fleet.address(engine), route
        for cordoned in ("ids", "vocab"):
            await fleet.admin.Cordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(1)
            info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
            generation = info.generation
            output = generation.output_logprobs.candidate_selection_modes
            assert list(output) == [mode("top_n"), mode("token_ids"), mode("all")], info
            prompt = generation.prompt_logprobs.candidate_selection_modes
            assert list(prompt) == [mode("top_n")], info
            await fleet.admin.Uncordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(2)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in fleet.gateway.Generate(request("p", prompt_candidates=ids))]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert refused.value.details() == "prompt candidates by token_ids: unsupported"
    finally:
        await close_fleet(fleet)


MIDDLE = 2 * SHORT


@pytest.fixture
async def aggregated_beside_decode() -> AsyncIterator[Fleet]:
    """Aggregated engines of a short and a middle context beside a long-context decode
    engine."""
    engines = [
        await start_sim_engine("a0", max_model_len=SHORT),
        await start_sim_engine("a1", max_model_len=MIDDLE),
        await start_sim_engine("d0", role="decode", max_model_len=LONG),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def test_the_aggregated_path_refuses_past_its_own_engines_limits(
    aggregated_beside_decode: Fleet,
) -> None:
    """Aggregated engines of a short and a middle context beside a long-context decode
    engine: requests take the aggregated path while an aggregated engine is routable, so a
    prompt past the middle context is refused before any engine is asked, INVALID_ARGUMENT
    naming it as the largest; one within it is served there. The decode engine's context
    counted toward the refusal: the prompt failed UNAVAILABLE ("those taking traffic do not
    take the request"), worth retrying by its status, which it never was while an
    aggregated engine was up."""
    fleet, engines = aggregated_beside_decode, aggregated_beside_decode.engines
    call = fleet.gateway.Generate(generate_request("past", [5] * 300, max_tokens=4))
    details = await refused_invalid(call)
    assert "max_context_length 301; the largest" in details, details
    assert f"takes is {MIDDLE}" in details, details
    trailing = await call.trailing_metadata() or ()
    assert ROUTE_METADATA_KEY not in [k for k, _ in trailing]
    reply, route = await generate_routed(fleet, generate_request("in", [5] * 200))
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    assert route is not None and route["engine"] == fleet.address(engines[1]), route


async def test_model_info_promises_the_context_of_the_path_requests_take(
    aggregated_beside_decode: Fleet,
) -> None:
    """Aggregated engines beside a longer-context decode engine: requests take the
    aggregated path while an aggregated engine is up, so GetModelInfo advertises the largest
    context of the aggregated engines, which routing takes, and a prompt within it is
    served. It advertised the decode engine's, which routing refused (INVALID_ARGUMENT,
    above): a client or a controller fronting this one trusting it was refused."""
    fleet, engines = aggregated_beside_decode, aggregated_beside_decode.engines
    info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
    assert info.max_context_length == MIDDLE, info
    prompt = [5] * (info.max_context_length - 4)
    reply, route = await generate_routed(fleet, generate_request("in", prompt, max_tokens=4))
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    assert route is not None and route["engine"] == fleet.address(engines[1]), route


def test_a_vllm_generate_needs_what_the_same_openengine_generate_needs() -> None:
    """Both APIs are read by one set of rules: a vllm.Generate asking what an OpenEngine
    Generate asks (in its own fields) needs the same of an engine; its defaults (0 sequences,
    priority 0, no salt, `json_object` false) ask nothing."""
    from controller.eligibility import needs_of

    openengine = pb.GenerateRequest(
        prompt="hi",
        sampling=pb.SamplingParams(num_sequences=4),
        stopping=pb.StoppingOptions(min_tokens=3, include_stop_in_output=True),
        response=pb.ResponseOptions(
            return_prompt_logprobs=True,
            return_output_logprobs=True,
            output_candidates=pb.CandidateTokenSelection(top_n=5),
        ),
        kv=pb.KvOptions(bypass_prefix_cache=True, cache_salt="s"),
        guided=pb.GuidedDecoding(regex="a+"),
        priority=2,
    )
    vllm = vpb.GenerateRequest(
        text="hi",
        sampling=vpb.RandomSampling(num_sequences=4),
        stopping=vpb.StoppingCriteria(min_new_tokens=3, include_stop_strings=True),
        response=vpb.ResponseOptions(
            prompt_logprobs=True,
            output_logprobs=True,
            output_candidates=vpb.CandidateTokens(top_n=5),
        ),
        kv=vpb.KVCacheParameters(bypass_prefix_cache=True, cache_salt="s"),
        decoding=vpb.DecodingParameters(regex="a+"),
        priority=-2,
    )
    assert needs_of(vllm) == needs_of(openengine)
    plain = vpb.GenerateRequest(
        token_ids=vpb.TokenIds(ids=[1]), decoding=vpb.DecodingParameters(json_object=False)
    )
    assert needs_of(plain) == needs_of(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])))
    # Each candidate selection mode alike; vLLM's that select none (an empty `token_ids`,
    # `all` false) ask the logprobs alone, as its engine reads them.
    for vllm_select, openengine_select in (
        (vpb.CandidateTokens(token_ids=vpb.TokenIds(ids=[3])), {"token_ids": pb.TokenIds(ids=[3])}),
        (vpb.CandidateTokens(all=True), {"all": pb.AllCandidates()}),
        (vpb.CandidateTokens(all=False), {}),
    ):
        selected = vpb.GenerateRequest(
            text="hi",
            response=vpb.ResponseOptions(output_logprobs=True, output_candidates=vllm_select),
        )
        response = pb.ResponseOptions(
            return_output_logprobs=True,
            output_candidates=pb.CandidateTokenSelection(**openengine_select),
        )
        if not openengine_select:
            response.ClearField("output_candidates")
        assert needs_of(selected) == needs_of(pb.GenerateRequest(prompt="hi", response=response))


def test_candidates_ask_for_their_logprobs_unless_the_flag_says_false() -> None:
    """As an engine reads a Generate (`kvplane.logprobs_asked`): candidates with the flag
    absent ask what candidates with it true do, an empty selection the logprobs alone; with
    it false nothing is asked of the engine routed to, which refuses the contradiction."""
    from controller.eligibility import needs_of

    def needs(**response: Any) -> Any:
        return needs_of(pb.GenerateRequest(prompt="hi", response=pb.ResponseOptions(**response)))

    five = pb.CandidateTokenSelection(top_n=5)
    assert needs(output_candidates=five) == needs(
        return_output_logprobs=True, output_candidates=five
    )
    assert needs(prompt_candidates=pb.CandidateTokenSelection()) == needs(
        return_prompt_logprobs=True
    )
    assert needs(return_output_logprobs=False, output_candidates=five) == needs()


class TellsNoRole(Forwarding):
    """The sim engine behind, but its GetEngineInfo leaves the role unspecified (an engine
    that does not tell one: routing takes it for any role)."""

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Any) -> Any:
        info = await self.inner.GetEngineInfo(request)
        info.ClearField("role")
        return info


async def test_an_engine_telling_no_role_counts_on_the_aggregated_path() -> None:
    """Aggregated engines of a short and a middle context beside a long-context engine that
    tells no role, which routing takes for an aggregated one: a prompt past the middle
    context goes to it and is served, and GetModelInfo's largest context is its. The
    aggregated path's limits counted only the engines that said AGGREGATED: the prompt was
    refused before any engine was asked, naming the middle context as the largest."""
    middle = 2 * SHORT
    unsaid = await start_fronted_engine("unsaid", TellsNoRole, max_model_len=LONG)
    engines: list[ServedEngine] = [
        await start_sim_engine("a0", max_model_len=SHORT),
        await start_sim_engine("a1", max_model_len=middle),
        unsaid,
    ]
    fleet = await make_fleet(engines=engines)
    try:
        registry = fleet.app.controller.fleet.registry
        record = registry.by_engine_id(fleet.address(unsaid))
        assert record is not None and record.identity is not None
        assert record.identity.role is Role.UNKNOWN
        for i in range(3):
            call = fleet.gateway.Generate(generate_request(f"long{i}", [i + 5] * 300, max_tokens=4))
            reply = [r async for r in call]
            assert reply[-1].WhichOneof("event") == "finished", reply[-1]
            route = read_route(await call.trailing_metadata())
            assert route is not None and route["engine"] == fleet.address(unsaid), route
        info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        assert info.max_context_length == LONG
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize(
    "vllm, openengine",
    [
        (
            {"sampling": vpb.RandomSampling(num_sequences=3)},
            {"sampling": pb.SamplingParams(num_sequences=3)},
        ),
        (
            {"stopping": vpb.StoppingCriteria(min_new_tokens=9)},
            {"stopping": pb.StoppingOptions(min_tokens=9)},
        ),
        (
            {"stopping": vpb.StoppingCriteria(include_stop_strings=True)},
            {"stopping": pb.StoppingOptions(include_stop_in_output=True)},
        ),
        (
            {"response": vpb.ResponseOptions(output_logprobs=True)},
            {"response": pb.ResponseOptions(return_output_logprobs=True)},
        ),
        (
            {"decoding": vpb.DecodingParameters(json_object=True)},
            {"guided": pb.GuidedDecoding(json_object=pb.JsonObjectConstraint())},
        ),
        ({"priority": 1}, {"priority": -1}),
        ({"kv": vpb.KVCacheParameters(cache_salt="s")}, {"kv": pb.KvOptions(cache_salt="s")}),
        (
            {"kv": vpb.KVCacheParameters(bypass_prefix_cache=True)},
            {"kv": pb.KvOptions(bypass_prefix_cache=True)},
        ),
    ],
)
def test_each_option_of_a_vllm_generate_is_read_alone(
    vllm: dict[str, Any], openengine: dict[str, Any]
) -> None:
    """A vllm.Generate asking one thing besides its input needs what the OpenEngine Generate
    asking it needs: none is missed by the glance that tells a request asking nothing."""
    from controller.eligibility import needs_of

    asked = needs_of(vpb.GenerateRequest(text="hi", **vllm))
    assert asked == needs_of(pb.GenerateRequest(prompt="hi", **openengine))
    assert asked != needs_of(vpb.GenerateRequest(text="hi"))
