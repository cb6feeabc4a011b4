"""A disaggregated fleet (prefill and decode engines) meeting the faults of real engine
processes (`kvplane engine serve`, sim runner, real KV sessions pulled over gRPC): a prefill
engine killed under its requests, a decode engine stopped at the handoff. The health polls
are set far apart, so that routing goes on taking the faulty engine for the live one it was
(as in the moments before a poll notices), which is the window these faults hit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.route_report import read_route
from engine.server.service import EngineApp
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    ServedEngine,
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_gateway import PREFIX
from tests.controller.test_stalled_engines import EngineProcess
from tests.grpc_streams import remaining_replies
from tests.polling import eventually

pytestmark = pytest.mark.timeout(120)

# Polls far apart; streams wait for a stopped engine rather than being abandoned.
UNPOLLED = {"poll_interval_s": 600, "load_poll_interval_s": 600, "abandon_streams_after_s": 0}


async def _at(fleet: EngineFleet[Any], request_id: str, engine: EngineProcess) -> None:
    """Until the gateway's call for `request_id` is with `engine`."""
    relay = fleet.app.gateway.relay

    async def there() -> bool:
        return relay.holding.get(request_id) == f"127.0.0.1:{engine.port}"

    await eventually(there)


async def _served_in_full(
    stream: grpc.aio.UnaryStreamCall[Any, pb.GenerateResponse], decode_port: int
) -> list[pb.GenerateResponse]:
    """The stream's events, once it ended finished with its 5 tokens, each once; the decode
    engine that served it holds nothing afterwards."""
    async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
        events = await remaining_replies(stream)
    assert events[-1].WhichOneof("event") == "finished", events[-1]
    assert events[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.token.tokens) for r in events if r.HasField("token")) == 5
    load = await _load(decode_port)
    assert load.running_requests == 0 and load.queued_requests == 0
    return events


async def _at_the_handoff_to_a_stopped_decode_engine(
    tmp_path: Path,
) -> tuple[
    EngineFleet[ServedEngine],
    EngineApp,
    EngineProcess,
    grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
]:
    """A prefill engine and a decode engine process behind the gateway, and a request "r"
    handed over to the decode engine, which was stopped before it could answer."""
    decode = await EngineProcess.start(tmp_path, "decode", role="decode")
    prefill = await start_sim_engine("prefill", role="prefill")
    fleet = await make_fleet(engines=engines_of_kinds(prefill, decode), health=UNPOLLED)
    try:
        decode.stop()
        stream = fleet.gateway.Generate(generate_request("r", [*PREFIX, 1], max_tokens=5))
        await _at(fleet, "r", decode)
    except BaseException:
        await close_fleet(fleet)
        raise
    return fleet, prefill, decode, stream


async def _load(port: int) -> pb.LoadInfo:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await pb_grpc.OpenEngineStub(channel).GetLoad(pb.GetLoadRequest())


async def test_a_prefill_killed_under_its_request_is_prefilled_by_a_decode_engine(
    tmp_path: Path,
) -> None:
    """The only prefill engine is killed (SIGKILL) while it holds a request: the retry that
    follows a failure before any output goes to a decode engine, which prefills the prompt
    itself (`skip_prefill_ratio` lets decode engines prefill, as the first hop does when no
    prefill engine is up), and the client gets every token instead of the dead engine's
    bare 'Stream removed' UNAVAILABLE."""
    prefill = await EngineProcess.start(tmp_path, "prefill", role="prefill")
    decode = await start_sim_engine("decode", role="decode")
    fleet = await make_fleet(
        engines=engines_of_kinds(prefill, decode),
        health=UNPOLLED,
        router={"skip_prefill_ratio": 0.9},
    )
    try:
        prefill.stop()  # holds the request mid-prefill, for the kill to land there
        stream = fleet.gateway.Generate(generate_request("r", [*PREFIX, 1], max_tokens=5))
        await _at(fleet, "r", prefill)
        prefill.proc.kill()
        await _served_in_full(stream, decode.port)
        # Its route: the decode engine served it whole, after the prefill engine failed it.
        route = read_route(await stream.trailing_metadata())
        assert route is not None and "prefill" not in route
        assert (route["engine"], route["instance_id"]) == (f"127.0.0.1:{decode.port}", "decode")
        assert (route["retried"], route["retried_from"]) == (True, [f"127.0.0.1:{prefill.port}"])
    finally:
        await close_fleet(fleet)


async def test_an_abort_at_the_handoff_to_a_stopped_decode_engine_ends_the_request(
    tmp_path: Path,
) -> None:
    """A disaggregated request handed to a decode engine that stopped before answering it (a
    SIGSTOPped process, not yet seen by the health polls): its Abort, which that engine
    cannot answer, still ends it as one at the handoff (ABORTED; the stream ends CANCELLED
    with the prefill's Usage; the KV session released on the prefill engine) instead of
    failing UNAVAILABLE while the request waits for the engine or the client's deadline;
    the decode engine, back, drops the call it never answered."""
    fleet, prefill, decode, stream = await _at_the_handoff_to_a_stopped_decode_engine(tmp_path)
    try:
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"), timeout=30)
        assert reply.status == pb.ABORT_STATUS_ABORTED, reply
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            events = await remaining_replies(stream)
        assert [r.WhichOneof("event") for r in events] == ["finished"], events
        assert events[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        assert events[-1].usage.prompt_tokens == len(PREFIX) + 1

        async def session_released() -> bool:
            load = await _load(prefill.port)
            return load.active_kv_sessions == 0 and load.used_kv_blocks == 0

        await eventually(session_released)
        decode.resume()

        async def dropped() -> bool:
            load = await _load(decode.port)
            return load.running_requests == 0 and load.queued_requests == 0

        await eventually(dropped)
        relay = fleet.app.gateway.relay
        assert not relay.holding and not relay.running
    finally:
        await close_fleet(fleet)


async def test_an_abort_of_every_request_ends_those_at_the_handoff_to_a_stopped_decode_engine(
    tmp_path: Path,
) -> None:
    """Abort(all_requests) while a request waits at the handoff to a stopped decode engine
    (its call unanswered): that engine's silence fails the call (UNAVAILABLE: its own
    requests may run on) with every outcome reported, and the gateway ends the request
    itself (CANCELLED, its KV session released on the prefill engine), as an Abort of its id
    does, instead of leaving it to run once the engine is back."""
    fleet, prefill, decode, stream = await _at_the_handoff_to_a_stopped_decode_engine(tmp_path)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        message = err.value.details() or ""
        assert f"127.0.0.1:{decode.port}: DEADLINE_EXCEEDED" in message, message
        assert f"127.0.0.1:{prefill.port}: ok" in message, message
        assert "gateway: 1 aborted before their engine accepted them" in message
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            events = await remaining_replies(stream)
        assert [r.WhichOneof("event") for r in events] == ["finished"], events
        assert events[-1].finished.reason == pb.FINISH_REASON_CANCELLED

        async def session_released() -> bool:
            load = await _load(prefill.port)
            return load.active_kv_sessions == 0 and load.used_kv_blocks == 0

        await eventually(session_released)
    finally:
        await close_fleet(fleet)


async def _handed_over_then_prefill_killed(
    tmp_path: Path, **router: object
) -> tuple[
    EngineFleet[EngineProcess],
    EngineProcess,
    EngineProcess,
    grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
]:
    """A request whose prefill engine handed its KV session over to a decode engine, and was
    then killed (SIGKILL) before the decode engine pulled the session: the decode engine was
    stopped at the handoff, and is resumed once the prefill engine is dead."""
    prefill = await EngineProcess.start(tmp_path, "prefill", role="prefill")
    decode = await EngineProcess.start(tmp_path, "decode", role="decode")
    fleet = await make_fleet(
        engines=[prefill, decode],
        health=UNPOLLED,
        router=router,
    )
    decode.stop()
    stream = fleet.gateway.Generate(generate_request("r", [*PREFIX, 1], max_tokens=5))
    await _at(fleet, "r", decode)
    prefill.proc.kill()
    await asyncio.to_thread(prefill.proc.wait)
    decode.resume()
    return fleet, prefill, decode, stream


async def test_a_session_whose_prefill_engine_died_is_prefilled_again_by_a_decode_engine(
    tmp_path: Path,
) -> None:
    """The prefill engine dies after handing over the KV session, before the decode engine
    pulled it: the decode engine cannot pull (UNAVAILABLE), and retrying the decode with the
    dead engine's session could only fail again. The gateway runs the request once more as a
    whole, as a new request goes with no prefill engine up: on the decode engine prefilling
    the prompt itself (`skip_prefill_ratio`), and the client gets every token once."""
    fleet, _, decode, stream = await _handed_over_then_prefill_killed(
        tmp_path, skip_prefill_ratio=0.9
    )
    try:
        events = await _served_in_full(stream, decode.port)
        assert events[-1].usage.prompt_tokens == len(PREFIX) + 1
        route = read_route(await stream.trailing_metadata())
        assert route is not None and route["engine"] == f"127.0.0.1:{decode.port}"
        assert route["retried"] is True
    finally:
        await close_fleet(fleet)


async def test_a_session_whose_prefill_engine_died_fails_naming_it_when_none_can_prefill(
    tmp_path: Path,
) -> None:
    """As above, but decode engines never prefill (no `skip_prefill_ratio`) and no other
    prefill engine is up: nothing can take the request again, and the client's failure names
    the dead prefill engine that held the session, not only the decode engine that could not
    pull it."""
    fleet, prefill, _, stream = await _handed_over_then_prefill_killed(tmp_path)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
                await remaining_replies(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        details = str(err.value.details())
        held = f"engine 127.0.0.1:{prefill.port}, which held the request's KV session, does not"
        assert details.startswith(held), details
    finally:
        await close_fleet(fleet)
