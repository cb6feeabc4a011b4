"""Admission control (`max_queued_requests`) over gRPC, sim runner: at the bound a new request
of either front end is refused before acceptance (RESOURCE_EXHAUSTED, nothing queued, counted
in the metrics), the requests already queued run as before, and once the queue drains new
requests are admitted again. The bound's default (none) queues without limit. A DECODE engine
refuses a request with a KV session before pulling it (the session stays for another decode
engine), and counts the requests it is pulling for as queued. Pooling tasks:
test_server_pooling.py."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from engine.config import SimTimingConfig
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    generate_request,
    metrics_text,
    rpc_error,
    running_engine,
    sim_config,
    stream_error,
)
from tests.engine.test_server_kv_transfer import (
    engines,
    held_prefill_engine,
    prefill,
    with_session,
)
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(10, 22))
BOUND = 2


def one_seat_config(**overrides: Any) -> Any:
    """One seat and steps of 20 ms or more: a long request holds the seat while the rest wait
    (aborted when the test has seen what it needs)."""
    values: dict[str, Any] = {
        "max_num_seqs": 1,
        "max_model_len": 4096,
        "num_kv_blocks": 2048,
        "sim": SimTimingConfig(time_scale=1.0, min_decode_ms=20.0, vocab_size=1000),
        "metrics_listen": "127.0.0.1:0",
    }
    values.update(overrides)
    return sim_config(**values)


async def load(engine: Engine) -> pb.LoadInfo:
    return await engine.stub.GetLoad(pb.GetLoadRequest())


async def hold_seat(engine: Engine) -> asyncio.Task[list[Any]]:
    """Start a request that runs until aborted (id `long`), once it holds the one seat."""
    long = asyncio.create_task(
        collect(engine.stub, generate_request(PROMPT, max_tokens=4000, request_id="long"))
    )

    async def running() -> bool:
        return (await load(engine)).running_requests == 1

    await eventually(running, what="the long request running")
    return long


async def queue(engine: Engine, count: int) -> list[asyncio.Task[list[Any]]]:
    """`count` short requests (ids q0, q1, ...) queued behind the seat holder."""
    before = (await load(engine)).queued_requests
    queued = [
        asyncio.create_task(
            collect(engine.stub, generate_request(PROMPT, max_tokens=2, request_id=f"q{i}"))
        )
        for i in range(count)
    ]

    async def all_queued() -> bool:
        return (await load(engine)).queued_requests == before + count

    await eventually(all_queued, what=f"{count} requests queued")
    return queued


def finished(responses: list[pb.GenerateResponse]) -> bool:
    """The stream ended with GenerationFinished (LENGTH) and usage: the request ran."""
    last = responses[-1]
    return (
        last.WhichOneof("event") == "finished"
        and last.finished.reason == pb.FINISH_REASON_LENGTH
        and last.HasField("usage")
    )


def vllm_request(request_id: str) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id,
        token_ids=vpb.TokenIds(ids=PROMPT),
        stopping=vpb.StoppingCriteria(max_new_tokens=2),
    )


def assert_overloaded(error: grpc.aio.AioRpcError) -> None:
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    details = error.details() or ""
    assert f"overloaded: {BOUND} queued, max_queued_requests is {BOUND};" in details, details


async def test_both_front_ends_are_refused_at_the_bound_and_admitted_once_it_drains() -> None:
    async with running_engine(one_seat_config(max_queued_requests=BOUND)) as engine:
        long = await hold_seat(engine)
        queued = await queue(engine, BOUND)

        refused = await rpc_error(
            lambda: collect(engine.stub, generate_request(PROMPT, request_id="refused"))
        )
        assert_overloaded(refused)
        responses, streamed = await stream_error(engine.vllm.GenerateStream(vllm_request("v1")))
        assert responses == []
        assert_overloaded(streamed)
        assert_overloaded(await rpc_error(engine.vllm.Generate(vllm_request("v2"))))
        # Nothing of them was queued: the engine never saw the id, the queue is as it was.
        unknown = await rpc_error(engine.stub.Abort(pb.AbortRequest(request_id="refused")))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND
        assert (await load(engine)).queued_requests == BOUND
        assert engine.app.service.num_in_flight == 1 + BOUND
        # The health probe is the engine's own work: queued past the bound, it runs in turn.
        probe = asyncio.ensure_future(
            engine.stub.Health(pb.HealthRequest(include_inference_probe=True))
        )

        aborted = await engine.stub.Abort(pb.AbortRequest(request_id="long"))
        assert aborted.status == pb.ABORT_STATUS_ABORTED
        await long
        # The requests queued before the bound was reached ran as any other.
        assert all(finished(r) for r in await asyncio.gather(*queued))
        assert (await probe).state == pb.HEALTH_STATE_READY

        async def drained() -> bool:
            return (await load(engine)).queued_requests == 0

        await eventually(drained, what="the queue drained")
        again = await collect(engine.stub, generate_request(PROMPT, max_tokens=2))
        assert finished(again)
        unary = await engine.vllm.Generate(vllm_request("v3"))
        assert unary.outputs.finish_info.finish_reason == vpb.FinishInfo.LENGTH
        text = await metrics_text(engine)
    assert 'kvplane_engine_overloaded_requests_total{model="sim",task="generate"} 3.0' in text
    # Accepted requests only: long, the queued ones and the two admitted after.
    assert f'kvplane_engine_requests_total{{model="sim"}} {1 + BOUND + 2}.0' in text


async def test_a_request_at_the_bound_that_is_wrong_itself_is_refused_for_that() -> None:
    # Every check of the request comes before admission: INVALID_ARGUMENT or ALREADY_EXISTS
    # (no engine would take it as it is), never an overload a router would retry elsewhere.
    async with running_engine(one_seat_config(max_queued_requests=1)) as engine:
        long = await hold_seat(engine)
        queued = await queue(engine, 1)
        too_many = generate_request(PROMPT, n=2)  # more sequences than max_num_seqs (1)
        invalid = await rpc_error(lambda: collect(engine.stub, too_many))
        assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT, invalid
        again = generate_request(PROMPT, request_id="q0")  # the queued one's id
        duplicate = await rpc_error(lambda: collect(engine.stub, again))
        assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS, duplicate
        await engine.stub.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        await long
        await asyncio.gather(*queued)


async def test_without_a_bound_requests_queue_without_limit() -> None:
    async with running_engine(one_seat_config()) as engine:
        long = await hold_seat(engine)
        queued = await queue(engine, 5)
        assert engine.app.service.num_in_flight == 6
        await engine.stub.Abort(pb.AbortRequest(request_id="long"))
        await long
        assert all(finished(r) for r in await asyncio.gather(*queued))


async def test_a_decode_engine_at_its_bound_refuses_a_session_before_pulling_it() -> None:
    """The refusal comes before the pull: no transfer is wasted, and the prefill engine's
    session stays for another decode engine (the gateway's retry elsewhere)."""
    bounded = one_seat_config(role="decode", max_queued_requests=1)
    async with engines(sim_config(role="prefill"), bounded, sim_config(role="decode")) as (
        prefiller,
        decoder,
        other_decoder,
    ):
        long = await hold_seat(decoder)
        queued = await queue(decoder, 1)
        session = await prefill(prefiller)
        refused = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "max_queued_requests is 1" in (refused.details() or "")
        assert (await load(prefiller)).active_kv_sessions == 1
        decoded = await collect(other_decoder.stub, with_session(session))
        assert decoded[-1].WhichOneof("event") == "finished", decoded[-1]
        assert decoded[-1].usage.cached_prompt_tokens == 8  # the session's two blocks
        await decoder.stub.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        await long
        await asyncio.gather(*queued)
        text = await metrics_text(decoder)
    assert "kvplane_engine_kv_pulls_total{" not in text  # no pull was started
    assert 'kvplane_engine_overloaded_requests_total{model="sim",task="generate"} 1.0' in text


async def test_a_request_pulling_its_session_counts_as_queued() -> None:
    """It joins the queue once pulled: with a bound of 1, one pull in progress fills it."""
    async with (
        held_prefill_engine() as (held, session),
        engines(sim_config(role="decode", max_queued_requests=1)) as (decoder,),
    ):
        pulling = asyncio.create_task(collect(decoder.stub, with_session(session)))
        await asyncio.wait_for(held.pulling.wait(), 10)
        plain = generate_request(PROMPT, max_tokens=2)
        refused = await rpc_error(lambda: collect(decoder.stub, plain))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        held.release.set()
        # Admitted before the pull, it is not refused after it.
        decoded = await pulling
        assert decoded[-1].WhichOneof("event") == "finished", decoded[-1]

        async def drained() -> bool:
            return decoder.app.service.num_queued == 0

        await eventually(drained, what="the pulled request out of the queue")
        assert finished(await collect(decoder.stub, plain))
