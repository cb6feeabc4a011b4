"""What the gateway counts and answers of the requests it relays, where the engines' answers
differ from the router's view: the cached-token prediction scored against the engine's own
count (and not where the engine gives none, as `vllm.Generate` does), an Abort of every
request that one engine did not carry out, and GetLoad's count of the requests each engine
runs for the gateway. Real sim engines behind a real controller, real gRPC clients."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.controller.test_gateway import PREFIX, generate, holder_of
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(60)


async def test_the_prediction_is_scored_against_the_cached_tokens_the_engine_reports() -> None:
    """An engine whose KV events the controller does not read (`kv_events: none`) is routed
    cache-blind (and, with no `router.pending_ttl_s`, claims no prefix for the prompts it
    routed): the router predicts no cached token, while the engine serves a repeated prompt
    from its cache. The metrics keep each figure on its side: predicted 0, actual the
    engine's count, the whole of it an error."""
    fleet = await make_fleet(1, kv_events="none", router={"pending_ttl_s": 0.0})
    try:
        await generate(fleet, generate_request("first", [*PREFIX, 1]))
        again = await generate(fleet, generate_request("again", [*PREFIX, 2]))
        cached = again[-1].usage.cached_prompt_tokens
        assert cached == len(PREFIX)
        metrics = fleet.app.controller.metrics
        assert metrics.predicted_cached_tokens._value.get() == 0
        assert metrics.actual_cached_tokens._value.get() == cached
        assert metrics.cached_tokens_abs_error._value.get() == cached
        assert metrics._cached_tokens_accuracy() == 0.0
    finally:
        await close_fleet(fleet)


async def test_a_vllm_request_counts_its_prompt_but_scores_no_prediction() -> None:
    """`vllm.Generate`'s responses carry no cached-token count: such a request adds its
    prompt's tokens, and nothing to the prediction's score (no invented zero), though the
    router predicted its prefix cached."""
    fleet = await make_fleet(1)
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        await holder_of(fleet, PREFIX, 4)
        metrics = fleet.app.controller.metrics
        predicted, actual = (
            metrics.predicted_cached_tokens._value.get(),
            metrics.actual_cached_tokens._value.get(),
        )
        prompt_tokens = metrics.prompt_tokens._value.get()
        request = vpb.GenerateRequest(
            request_id="v",
            model="sim",
            token_ids=vpb.TokenIds(ids=[*PREFIX, 2]),
            stopping=vpb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
        )
        reply = await vpb_grpc.GenerateStub(fleet.channel).Generate(request)
        assert reply.outputs.finish_info.finish_reason == vpb.FinishInfo.LENGTH
        assert metrics.prompt_tokens._value.get() == prompt_tokens + len(PREFIX) + 1
        assert metrics.predicted_cached_tokens._value.get() == predicted
        assert metrics.actual_cached_tokens._value.get() == actual
        assert metrics.cached_tokens_abs_error._value.get() == 0
    finally:
        await close_fleet(fleet)


async def test_an_abort_of_everything_one_engine_refused_fails_naming_it(tmp_path: Path) -> None:
    """One engine aborts its requests, the other refuses the controller's Abort (it asks for
    a token the controller lacks): not every request was aborted, so the gateway's
    Abort(all_requests) fails with that engine's status, naming it, rather than answering
    as if the fleet had ended them all."""
    token = tmp_path / "token"
    token.write_text("engine-only")
    plain = await start_sim_engine("plain")
    guarded = await start_sim_engine("guarded", auth={"token_file": token})
    fleet = await make_fleet(engines=[plain, guarded])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        details = err.value.details() or ""
        assert f"{fleet.address(guarded)} did not abort" in details
        assert f"{fleet.address(plain)}: ok" in details
    finally:
        await close_fleet(fleet)


async def test_the_fleets_load_details_the_requests_each_engine_runs_for_it() -> None:
    """GetLoad's line for each engine counts the requests the gateway relays to it now
    (`inflight`): the engine streaming one says 1, the other 0."""
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        call = fleet.gateway.Generate(generate_request("long", [*PREFIX, 1], max_tokens=2000))
        await call.read()
        holder = fleet.app.gateway.relay.holding["long"]
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        for engine in fleet.engines:
            at = fleet.address(engine)
            line = load.attributes[f"engine.{at}"]
            assert line.endswith(" inflight=1" if at == holder else " inflight=0")
        call.cancel()
    finally:
        await close_fleet(fleet)
