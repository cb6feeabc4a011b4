"""Draining the controller itself (the gateway's Drain, `kvplane admin drain --self`): a real
controller in front of real sim engines (time_scale 1, so that a 2,000-token request is still
running when the drain's deadline passes), real gRPC clients, the admin CLI through CliRunner.
The controller drains as an engine does: a deadline that passes with requests in flight ends
the drain with one terminal DRAINING error; `abort_after_deadline` aborts only the requests
the controller relays, and COMPLETE comes once they have ended."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller import gateway
from kvplane.cli_common import RpcCallError
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import Fleet, close_fleet, generate_request, make_fleet
from tests.controller.test_admin_cli import admin_process, cli
from tests.controller.test_gateway import hold_planning
from tests.interrupted import interrupted
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

PREFIX = list(range(500, 564))
KVPLANE = (sys.executable, "-m", "kvplane")
LONG = 2000  # tokens: about 12 s of sim decoding, far longer than any drain here


@pytest.fixture
async def slow_fleet() -> AsyncIterator[Fleet]:
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def start_long(
    stub: pb_grpc.OpenEngineAsyncStub, request_id: str
) -> grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
    """A long request, once its first token came back (it is running)."""
    call = stub.Generate(generate_request(request_id, [*PREFIX, 1], max_tokens=LONG))
    first = await call.read()
    assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
    return call


async def health(fleet: Fleet) -> pb.HealthState.ValueType:
    return (await fleet.gateway.Health(pb.HealthRequest())).state


async def test_a_deadline_passing_with_a_request_in_flight_ends_with_a_draining_error(
    slow_fleet: Fleet,
) -> None:
    fleet = slow_fleet
    assert await health(fleet) == pb.HEALTH_STATE_READY
    long = await start_long(fleet.gateway, "long")

    request = pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=200)
    events = [e async for e in fleet.gateway.Drain(request)]

    assert events[0].state == pb.DRAIN_STATE_STARTED
    assert pb.DRAIN_STATE_COMPLETE not in [e.state for e in events]
    last = events[-1]
    assert last.WhichOneof("event") == "error"
    assert last.error.code == pb.ERROR_CODE_DRAINING
    assert last.in_flight_requests == 1
    assert "deadline passed, requests in flight: 1" in last.error.message
    # The request was left running, as an engine leaves it.
    more = await long.read()
    assert isinstance(more, pb.GenerateResponse) and more.WhichOneof("event") == "token"
    # Draining: Health says so, and new requests are refused.
    assert await health(fleet) == pb.HEALTH_STATE_DRAINING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        _ = [r async for r in fleet.gateway.Generate(generate_request("new", [1, 2, 3]))]
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in (refused.value.details() or "")
    # Admin Route still explains (it sends nothing; was refused "the controller is
    # draining"), and nothing is placed: the one refusal counted is Generate's.
    explained = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[1, 2, 3])))
    assert explained.engine in {e.address for e in fleet.app.controller.fleet.registry.records()}
    assert fleet.app.controller.metrics.requests.labels("no_engine")._value.get() == 1
    long.cancel()


async def follow(
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
    events: list[str],
) -> None:
    """Record each event's kind until the stream ends (read(): the first was read so)."""
    while isinstance(response := await call.read(), pb.GenerateResponse):
        events.append(str(response.WhichOneof("event")))


async def test_abort_after_deadline_aborts_only_the_controllers_requests_then_completes(
    slow_fleet: Fleet,
) -> None:
    fleet = slow_fleet
    relay = fleet.app.gateway.relay
    mine = await start_long(fleet.gateway, "mine")
    # Another client's request, sent straight to the engine serving the controller's.
    engine = relay.holding["mine"]
    async with grpc.aio.insecure_channel(engine) as direct:
        theirs = await start_long(pb_grpc.OpenEngineStub(direct), "theirs")
        mine_events: list[str] = []
        theirs_events: list[str] = []
        following = [
            asyncio.create_task(follow(mine, mine_events)),
            asyncio.create_task(follow(theirs, theirs_events)),
        ]

        request = pb.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=100, abort_after_deadline=True
        )
        events: list[pb.DrainResponse] = []
        in_flight_at_complete: int | None = None
        async for event in fleet.gateway.Drain(request):
            events.append(event)
            if event.state == pb.DRAIN_STATE_COMPLETE:
                in_flight_at_complete = len(relay.holding)

        # COMPLETE, once the controller's request was gone (not right after the abort).
        assert [e.WhichOneof("event") for e in events].count("error") == 0
        assert events[-1].state == pb.DRAIN_STATE_COMPLETE
        assert events[-1].in_flight_requests == 0 and in_flight_at_complete == 0
        async with asyncio.timeout(30):  # a bound, not a measurement
            await following[0]
        assert mine_events[-1] in ("finished", "error") and len(mine_events) < LONG
        # The other client's request on the same engine keeps running: more tokens come.
        seen = len(theirs_events)

        async def theirs_went_on() -> bool:
            return len(theirs_events) > seen

        await eventually(theirs_went_on)
        assert not following[1].done()
        assert set(theirs_events) == {"token"}
        reply = await pb_grpc.OpenEngineStub(direct).Abort(pb.AbortRequest(request_id="theirs"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        async with asyncio.timeout(30):
            await following[1]


async def test_admin_drain_needs_engine_or_self_and_reports_a_passed_deadline(
    slow_fleet: Fleet,
) -> None:
    fleet = slow_fleet
    t = ["--target", fleet.target]

    for args in ([], ["e0", "--self"]):
        refused = await cli("drain", *args, *t)
        assert refused.exit_code == 2  # a usage error (README: exit codes)
        assert "give the ENGINE to drain" in refused.output
    assert await health(fleet) == pb.HEALTH_STATE_READY  # nothing was drained

    long = await start_long(fleet.gateway, "long")
    late = await cli("drain", "--self", "--deadline-ms", "0", *t)
    assert late.exit_code == 1
    assert late.stdout.strip().splitlines()[-1] == (
        "error ERROR_CODE_DRAINING: deadline passed, requests in flight: 1"
    )
    assert isinstance(late.exception, RpcCallError)
    assert str(late.exception) == "drain failed: deadline passed, requests in flight: 1"
    assert await health(fleet) == pb.HEALTH_STATE_DRAINING

    await fleet.gateway.Abort(pb.AbortRequest(request_id="long"))
    long.cancel()
    drained = await cli("drain", "--self", *t)
    assert drained.exit_code == 0, drained.output
    assert drained.stdout.strip().splitlines()[-1].startswith("COMPLETE")


async def test_ctrl_c_stops_following_a_drain_and_says_the_drain_goes_on(
    slow_fleet: Fleet,
) -> None:
    """`kvplane admin drain` interrupted (Ctrl-C) while a request holds the drain: exit 130,
    one line saying the drain goes on, which it does (it exited 130 saying nothing, and the
    operator could take the target for back in service)."""
    fleet = slow_fleet
    long = await start_long(fleet.gateway, "long")

    async def following(process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        started = await process.stdout.readline()
        assert started.decode().startswith("STARTED"), started

    result = await interrupted(["admin", "-t", fleet.target, "drain", "--self"], following)
    assert result.returncode == 130
    assert result.stderr == (
        f"kvplane: interrupted: the drain of {fleet.target} goes on (leaving it does not undo it)\n"
    )
    assert await health(fleet) == pb.HEALTH_STATE_DRAINING
    long.cancel()


async def test_drain_output_json_streams_each_event_as_it_comes(slow_fleet: Fleet) -> None:
    """`drain --output json` is JSON Lines, one object per event as the target sends it: a
    script follows the drain, and keeps what came before a Ctrl-C or a broken stream. It
    printed every event in one array once the drain had ended."""
    fleet = slow_fleet
    long = await start_long(fleet.gateway, "long")
    process = await asyncio.create_subprocess_exec(
        *KVPLANE,
        *["admin", "-t", fleet.target, "drain", "--self", "--output", "json"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        first = await process.stdout.readline()
        started = json.loads(first)
        assert (started["state"], started["in_flight_requests"]) == ("DRAIN_STATE_STARTED", 1)
        # Printed while the drain waits on the request, which still runs.
        more = await long.read()
        assert isinstance(more, pb.GenerateResponse) and more.WhichOneof("event") == "token"

        await fleet.gateway.Abort(pb.AbortRequest(request_id="long"))
        rest, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err
    events = [started, *(json.loads(line) for line in rest.decode().splitlines())]
    assert all(e.keys() >= {"state", "in_flight_requests"} for e in events), events
    assert (events[-1]["state"], events[-1]["in_flight_requests"]) == ("DRAIN_STATE_COMPLETE", 0)
    long.cancel()


async def test_drain_output_json_ends_a_passed_deadline_with_the_events_own_error(
    slow_fleet: Fleet,
) -> None:
    """What a script reads of a passed deadline, an engine's drain (relayed by DrainEngine)
    and the controller's own alike: the last line is the terminal DrainResponse as protobuf
    JSON, parsed back into one, its `error.code` the EngineError's ErrorCode name; exit 1.
    Not a gRPC status name, as a failed fan-out's (`abort`, `lora`) `error.code` is: the
    stream did not fail, it ended with an in-band error, and the status form of its code
    (UNAVAILABLE, kvplane/error_codes.py) is a retryable INTERNAL failure's too."""
    fleet = slow_fleet
    long = await start_long(fleet.gateway, "long")
    inflight = fleet.app.controller.router.inflight
    busy = next(a for a in map(fleet.address, fleet.engines) if inflight.of(a).requests)
    for drained in (busy, "--self"):
        code, out, err = await admin_process(
            *["-t", fleet.target, "drain", drained, "--deadline-ms", "0", "--output", "json"]
        )
        assert code == 1, err
        *_, last = out.splitlines()
        event = json.loads(last)
        assert event["error"]["code"] == "ERROR_CODE_DRAINING", last
        assert event["in_flight_requests"] == 1
        parsed = json_format.Parse(last, pb.DrainResponse())
        assert parsed.error.code == pb.ERROR_CODE_DRAINING
        assert "drain failed: deadline passed, requests in flight: 1" in err
    long.cancel()


async def test_admin_drain_self_drains_the_controller(fleet: Fleet) -> None:
    drained = await cli("drain", "--self", "--target", fleet.target)
    assert drained.exit_code == 0, drained.output
    assert drained.stdout.strip().splitlines()[-1] == "COMPLETE  in flight 0"
    assert await health(fleet) == pb.HEALTH_STATE_DRAINING


async def test_a_request_being_routed_when_the_drain_starts_is_in_flight_until_it_ends(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the controller admitted and is still planning (no engine holds it yet) is
    in flight: the drain counts it from STARTED on and is COMPLETE once it has ended, not
    while it is about to reach an engine."""
    relay = fleet.app.gateway.relay
    planning, go_on = hold_planning(fleet, monkeypatch)
    request = generate_request("early", [*PREFIX, 1])
    generating = asyncio.ensure_future(collect(fleet.gateway.Generate(request)))
    await asyncio.wait_for(planning.wait(), 30)
    drain = fleet.gateway.Drain(pb.DrainRequest(stop_accepting_new_requests=True))
    started = await drain.read()
    assert isinstance(started, pb.DrainResponse)
    assert (started.state, started.in_flight_requests) == (pb.DRAIN_STATE_STARTED, 1)
    go_on.set()
    last = started
    while isinstance(event := await drain.read(), pb.DrainResponse):
        last = event
        if event.state == pb.DRAIN_STATE_COMPLETE:
            assert relay.running == set()
    assert (last.state, last.in_flight_requests) == (pb.DRAIN_STATE_COMPLETE, 0)
    responses = await generating
    assert responses[-1].WhichOneof("event") == "finished"  # it ran, admitted before the drain


async def test_a_drain_aborting_at_its_deadline_ends_a_request_still_being_routed(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `abort_after_deadline`, the drain aborts the requests still being planned too
    (no engine holds them, so no engine's Abort reaches them): it is COMPLETE while such a
    request is still being routed, and the request then ends before any engine, each output
    finished CANCELLED, rather than holding the drain until it gives up."""
    planning, go_on = hold_planning(fleet, monkeypatch)
    request = generate_request("early", [*PREFIX, 1])
    generating = asyncio.ensure_future(collect(fleet.gateway.Generate(request)))
    await asyncio.wait_for(planning.wait(), 30)
    drain = fleet.gateway.Drain(
        pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True)
    )
    events = [event async for event in drain]
    assert (events[-1].state, events[-1].in_flight_requests) == (pb.DRAIN_STATE_COMPLETE, 0)
    go_on.set()
    responses = await generating
    assert [r.finished.reason for r in responses] == [pb.FINISH_REASON_CANCELLED]


async def collect(
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
) -> list[pb.GenerateResponse]:
    return [r async for r in call]


async def test_vllm_generate_counts_in_the_drain_and_is_refused_after_it(
    slow_fleet: Fleet,
) -> None:
    """The drain covers the gateway's vllm.Generate front end too: a running GenerateStream
    is in flight (the deadline passes with it: one DRAINING error, in flight 1), and once
    draining, a vllm.Generate is refused UNAVAILABLE as an OpenEngine Generate is."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    fleet = slow_fleet
    stub = vpb_grpc.GenerateStub(fleet.channel)

    def request(max_new_tokens: int) -> vpb.GenerateRequest:
        return vpb.GenerateRequest(
            request_id="v", model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 1]),
            stopping=vpb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        )  # fmt: skip

    stream = stub.GenerateStream(request(LONG))
    assert isinstance(await stream.read(), vpb.GenerateResponse)  # it runs
    drain = pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=100)
    events = [e async for e in fleet.gateway.Drain(drain)]
    assert (events[0].state, events[0].in_flight_requests) == (pb.DRAIN_STATE_STARTED, 1)
    assert events[-1].WhichOneof("event") == "error" and events[-1].in_flight_requests == 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(request(2))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == "the controller is draining"
    stream.cancel()


async def grpc_health(fleet: Fleet, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(fleet.channel).Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return int(reply.status)


async def test_grpc_health_of_vllm_generate_turns_not_serving_once_the_gateway_drains(
    fleet: Fleet,
) -> None:
    """As an engine's: `vllm.Generate` has no health call of its own, so a vLLM client (or
    its load balancer) reads `grpc.health.v1` for it, and a drained gateway refuses every
    new vllm.Generate. A drain that keeps accepting changes nothing; the empty name (the
    process is up) and OpenEngine (whose clients read its Health) stay SERVING."""
    serving: int = health_pb2.HealthCheckResponse.SERVING
    assert await grpc_health(fleet, "vllm.Generate") == serving
    [_ async for _ in fleet.gateway.Drain(pb.DrainRequest())]
    assert await grpc_health(fleet, "vllm.Generate") == serving
    drain = pb.DrainRequest(stop_accepting_new_requests=True)
    assert [e.state async for e in fleet.gateway.Drain(drain)][-1] == pb.DRAIN_STATE_COMPLETE

    async def not_serving() -> bool:
        wanted: int = health_pb2.HealthCheckResponse.NOT_SERVING
        return await grpc_health(fleet, "vllm.Generate") == wanted

    await eventually(not_serving, what="vllm.Generate NOT_SERVING")
    for service in ("", "openengine.v1.OpenEngine"):
        assert await grpc_health(fleet, service) == serving, service


async def test_a_drain_that_keeps_accepting_refuses_nothing(fleet: Fleet) -> None:
    """`stop_accepting_new_requests` false, as on an engine: the drain reports the requests
    in flight to COMPLETE, and the controller goes on taking requests and saying READY."""
    events = [e async for e in fleet.gateway.Drain(pb.DrainRequest())]
    assert [e.state for e in events] == [pb.DRAIN_STATE_STARTED, pb.DRAIN_STATE_COMPLETE]
    assert await health(fleet) == pb.HEALTH_STATE_READY
    reply = [r async for r in fleet.gateway.Generate(generate_request("after", [*PREFIX, 1]))]
    assert reply[-1].WhichOneof("event") == "finished"


async def test_an_aborting_drain_completes_past_clients_that_stop_reading(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stops reading its stream (its flow-control window full, never
    cancelling) keeps the gateway's relay of it open as long as it likes, although its
    engine ended the request when the drain aborted it: past its aborting deadline the drain
    completes once the engines said so, as an engine's does, instead of failing with
    "requests still in flight" (OpenEngine Generate and vllm.Generate alike), or waiting out
    its grace for requests that could end (here far longer than the test's bound: it used
    to wait all of it). The engines are idle then; the gateway's accounting of those
    requests ends when their clients leave."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    monkeypatch.setattr(gateway, "DRAIN_ABORT_GRACE_S", 3600.0)

    # Engines that never sleep: both requests are computed at once, and their clients stop
    # the gateway's relay of them with their windows full.
    controller = fleet.app.controller
    async with grpc.aio.insecure_channel(
        fleet.target,
        options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
    ) as slow_reader:
        openengine = pb_grpc.OpenEngineStub(slow_reader).Generate(
            generate_request("openengine", [*PREFIX, 1], max_tokens=LONG)
        )
        vllm = vpb_grpc.GenerateStub(slow_reader).GenerateStream(
            vpb.GenerateRequest(
                request_id="vllm",
                model="sim",
                token_ids=vpb.TokenIds(ids=[*PREFIX, 2]),
                stopping=vpb.StoppingCriteria(max_new_tokens=LONG, ignore_eos=True),
            )
        )
        for call in (openengine, vllm):
            await call.read()  # then never again
        drain = pb.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
        )
        # A bound, not a measurement: such a drain used to fail after its 5 s of grace, then
        # to wait all of it.
        async with asyncio.timeout(30):
            events = [e async for e in fleet.gateway.Drain(drain)]
        assert [e.WhichOneof("event") for e in events].count("error") == 0
        assert (events[-1].state, events[-1].in_flight_requests) == (pb.DRAIN_STATE_COMPLETE, 0)
        for engine in fleet.engines:
            async with grpc.aio.insecure_channel(fleet.address(engine)) as direct:
                load = await pb_grpc.OpenEngineStub(direct).GetLoad(pb.GetLoadRequest())
            assert (load.running_requests, load.used_kv_blocks) == (0, 0)
        openengine.cancel()
        vllm.cancel()

        async def released() -> bool:
            return not fleet.app.gateway.relay.running and len(controller.router.inflight) == 0

        await eventually(released)
