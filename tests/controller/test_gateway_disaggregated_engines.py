"""The gateway in front of the bundled engine playing PREFILL and DECODE (sim runner, real KV
sessions pulled over gRPC), where test_gateway_disaggregated.py runs the same flows on fakes:
the client's stream is that of an aggregated engine, the decode engine reports the pulled
prefix as cached, and no session stays open on the prefill engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller import gateway
from controller.registry import EngineIdentity
from engine.config import KvTransferConfig, LoraConfig
from engine.server.service import EngineApp
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_gateway_scripted import cli
from tests.engine.engine_server_harness import engine_thread_held
from tests.engine.lora_adapters import write_adapter_config
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(60)

PROMPT = [*range(300, 364), 1]  # 4 blocks of 16 and one token


def _tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t.token_id for r in responses if r.HasField("token") for t in r.token.tokens]


async def test_prefill_and_decode_engines_behind_the_gateway() -> None:
    prefill = await start_sim_engine("p0", role="prefill")
    decode = await start_sim_engine("d0", role="decode")
    aggregated = await start_sim_engine("a0")
    fleet = await make_fleet(engines=[prefill, decode])
    try:
        request = generate_request("r", PROMPT, max_tokens=6)
        request.response.return_prompt_logprobs = True
        reply = [r async for r in fleet.gateway.Generate(request)]
        events = [r.WhichOneof("event") for r in reply]
        assert events[0] == "prompt" and events.count("prompt") == 1
        assert "prefill_ready" not in events and events[-1] == "finished"
        assert reply[-1].usage.cached_prompt_tokens == 64  # the pulled blocks

        async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregated.port}") as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            alone = [r async for r in stub.Generate(generate_request("a", PROMPT, 6))]
        assert _tokens(reply) == _tokens(alone)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill.port}") as channel:
            stub = pb_grpc.OpenEngineStub(channel)

            async def released() -> bool:
                load = await stub.GetLoad(pb.GetLoadRequest())
                return load.active_kv_sessions == 0 and load.used_kv_blocks == 0

            await eventually(released)
    finally:
        await close_fleet(fleet)
        await aggregated.close()


async def test_a_decode_engine_holding_the_prompt_prefills_it_itself() -> None:
    prefill = await start_sim_engine("p0", role="prefill")
    decode = await start_sim_engine("d0", role="decode")
    fleet = await make_fleet(engines=[prefill, decode], router={"skip_prefill_ratio": 0.5})
    try:
        first = [r async for r in fleet.gateway.Generate(generate_request("r1", PROMPT))]
        assert first[-1].WhichOneof("event") == "finished"

        async def decode_holds_it() -> bool:
            return any(e.device_blocks >= 4 for e in await _matches(fleet, decode.port))

        await eventually(decode_holds_it)
        second = [r async for r in fleet.gateway.Generate(generate_request("r2", PROMPT))]
        assert second[-1].usage.cached_prompt_tokens == 64
        assert "r2" in decode.service._finished and "r2" not in prefill.service._finished

    finally:
        await close_fleet(fleet)


async def _matches(fleet: Fleet, port: int) -> list[apb.EngineMatch]:
    reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT)))
    return [m for m in reply.matches if m.engine == f"127.0.0.1:{port}"]


async def test_a_lora_adapter_no_decode_engine_holds_is_refused_before_the_prefill(
    tmp_path: Path,
) -> None:
    """The adapter loaded on the prefill engine only: Generate and admin `route` naming it
    are NOT_FOUND, saying no decode engine has it, and no prefill runs (it was UNAVAILABLE,
    "no decode engine available", with an idle decode engine there). Once the decode engine
    loads it the request runs."""
    lora = LoraConfig(enabled=True)
    prefill = await start_sim_engine("p0", role="prefill", lora=lora)
    decode = await start_sim_engine("d0", role="decode", lora=lora)
    fleet = await make_fleet(engines=[prefill, decode])
    try:
        adapter = str(write_adapter_config(tmp_path / "x"))
        target = ["--target", fleet.target]
        loaded = await cli("lora", "load", "x", adapter, "--id", "1", "--engine", "p0", *target)
        assert loaded.exit_code == 0, loaded.output
        request = generate_request("r1", PROMPT)
        request.lora_name = "x"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in fleet.gateway.Generate(request)]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "no decode engine has LoRA adapter 'x' loaded"
        assert "r1" not in prefill.service._finished
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), lora_name="x")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.admin.Route(query)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no decode engine has LoRA adapter 'x'" in (err.value.details() or "")

        loaded = await cli("lora", "load", "x", adapter, "--id", "1", "--engine", "d0", *target)
        assert loaded.exit_code == 0, loaded.output
        request.request_id = "r2"
        reply = [r async for r in fleet.gateway.Generate(request)]
        assert reply[-1].WhichOneof("event") == "finished"
        assert "r2" in prefill.service._finished and "r2" in decode.service._finished
    finally:
        await close_fleet(fleet)


class StalledAtTheHandoff(NamedTuple):
    """A disaggregated request whose client stopped reading before the gateway read its
    prefill engine's handoff: a real controller, a real prefill and decode engine (sim)."""

    fleet: Fleet
    prefill: EngineApp
    decode: EngineApp
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]

    async def open_sessions(self) -> int:
        """The KV sessions the prefill engine holds (GetLoad)."""
        async with grpc.aio.insecure_channel(self.fleet.address(self.prefill)) as direct:
            load = await pb_grpc.OpenEngineStub(direct).GetLoad(pb.GetLoadRequest())
        return load.active_kv_sessions

    async def assert_nothing_left(self) -> None:
        """No KV session, no request on either engine, nothing in the gateway's accounts."""

        async def released() -> bool:
            return await self.open_sessions() == 0

        await eventually(released)
        for engine in (self.prefill, self.decode):
            async with grpc.aio.insecure_channel(self.fleet.address(engine)) as direct:
                load = await pb_grpc.OpenEngineStub(direct).GetLoad(pb.GetLoadRequest())
            assert (load.running_requests, load.used_kv_blocks) == (0, 0)
        relay = self.fleet.app.gateway.relay
        assert (relay.running, relay.holding, relay.handed_over) == (set(), {}, {})
        assert (relay.prefilling, relay.aborted_unrouted) == (set(), set())
        assert len(self.fleet.app.controller.router.inflight) == 0


@contextlib.asynccontextmanager
async def stalled_at_the_handoff(
    *,
    router: dict[str, Any] | None = None,
    health: dict[str, Any] | None = None,
    **prefill_config: Any,
) -> AsyncIterator[StalledAtTheHandoff]:
    """A client that stops reading (its flow-control window full, never cancelling) holds
    the gateway before its prompt output (prompt logprobs, more than its window) is through,
    and so before the gateway reads the prefill engine's PrefillReady: the prefill engine's
    part is over, its KV session open. `router`, `health`: more of the controller's
    RouterConfig, HealthConfig; `prefill_config`: more of the prefill engine's EngineConfig."""
    prefill = await start_sim_engine(
        "p0", role="prefill", num_kv_blocks=1100, max_model_len=4096, **prefill_config
    )
    decode = await start_sim_engine("d0", role="decode", num_kv_blocks=1100, max_model_len=4096)
    fleet = await make_fleet(engines=[prefill, decode], router=router or {}, health=health or {})
    try:
        async with stalled_on(fleet, prefill, decode) as stalled:
            yield stalled
    finally:
        await close_fleet(fleet)


@contextlib.asynccontextmanager
async def stalled_on(
    fleet: Fleet, prefill: EngineApp, decode: EngineApp
) -> AsyncIterator[StalledAtTheHandoff]:
    """`stalled_at_the_handoff` in `fleet`, the request prefilled on `prefill` (the only
    prefill engine routable)."""
    async with grpc.aio.insecure_channel(
        fleet.target,
        options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
    ) as slow_reader:
        request = generate_request("r", list(range(1000, 3000)), max_tokens=50)
        request.response.return_prompt_logprobs = True  # more than the client's window
        call = pb_grpc.OpenEngineStub(slow_reader).Generate(request)
        stalled = StalledAtTheHandoff(fleet, prefill, decode, call)

        async def handed_over() -> bool:
            return await stalled.open_sessions() == 1

        await eventually(handed_over)
        assert "r" not in fleet.app.gateway.relay.handed_over  # not read by the gateway
        yield stalled


@pytest.mark.parametrize("target", ["request_id", "all_requests"])
async def test_an_abort_after_an_unread_handoff_ends_the_request_without_a_decode(
    target: str,
) -> None:
    """The prefill engine's part is over (an Abort of the request there is
    ALREADY_FINISHED), the gateway's is not. An Abort through the gateway ends the request
    there, as at any handoff: the client then gets its output finished CANCELLED, no decode
    engine is called, and the prefill engine's KV session is released. It used to answer
    ALREADY_FINISHED and let the decode hop generate everything once the client read on."""
    async with stalled_at_the_handoff() as stalled:
        if target == "request_id":
            reply = await stalled.fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
            assert (reply.status, reply.message) == (
                pb.ABORT_STATUS_ABORTED,
                "aborted at the handoff to a decode engine",
            )
        else:
            everything = pb.AbortRequest(all_requests=pb.AllRequests())
            reply = await stalled.fleet.gateway.Abort(everything)
            assert reply.status == pb.ABORT_STATUS_ABORTED
        responses = [r async for r in stalled.call]
        assert [r.WhichOneof("event") for r in responses] == ["prompt", "finished"]
        assert responses[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        await stalled.assert_nothing_left()
        assert "r" not in stalled.decode.service._finished  # no decode engine was called


async def test_an_abort_while_the_decode_engine_pulls_ends_the_request_as_on_an_engine() -> None:
    """The decode engine pulls the KV session (the prefill engine's engine thread held: the
    pull waits for it) when an Abort through the gateway reaches it: it ends the request
    as one aborted before its prefill, its output finished CANCELLED with the Usage of the
    prompt, status OK, relayed as it came, and tells the prefill engine to release the
    session. The client used to get an in-band EngineError ("engine ... failed mid-stream:
    CANCELLED: ..."), the decode engine having ended the call with the status CANCELLED."""
    async with stalled_at_the_handoff() as stalled:
        async with grpc.aio.insecure_channel(stalled.fleet.address(stalled.decode)) as direct:
            decoder = pb_grpc.OpenEngineStub(direct)
            async with engine_thread_held(stalled.prefill.service):
                reading = asyncio.ensure_future(_read_all(stalled.call))

                async def pulling() -> bool:
                    load = await decoder.GetLoad(pb.GetLoadRequest())
                    return load.running_requests == 1

                await eventually(pulling)
                reply = await stalled.fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
                assert reply.status == pb.ABORT_STATUS_ABORTED
                responses = await reading  # at once: the pull is cancelled
        assert {r.WhichOneof("event") for r in responses[:-1]} == {"prompt"}
        num_prompt_tokens = 2000
        assert responses[-1] == pb.GenerateResponse(
            request_id="r",
            finished=pb.GenerationFinished(
                output_index=0, reason=pb.FINISH_REASON_CANCELLED, message="aborted"
            ),
            usage=pb.Usage(
                prompt_tokens=num_prompt_tokens,
                total_tokens=num_prompt_tokens,
                cached_prompt_tokens=0,
            ),
        )
        await stalled.assert_nothing_left()


async def _read_all(
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
) -> list[pb.GenerateResponse]:
    return [r async for r in call]


async def test_a_session_drained_before_an_unread_handoff_ends_the_request() -> None:
    """The prefill engine ends the KV session while the gateway has not read the handoff:
    `admin drain` of that engine aborting past its deadline. Once the client reads on, the
    decode engine refuses the session (NOT_FOUND), the prefill engine, asked to release it,
    says it ended it already (ALREADY_FINISHED), and it drains: the request ended there, and
    the client gets its outputs finished CANCELLED with the prefill's usage, as from an
    engine whose drain aborted the request. It used to get a retryable INTERNAL error
    ("refused the KV session: NOT_FOUND") for a request no engine would run."""
    async with stalled_at_the_handoff() as stalled:
        fleet = stalled.fleet
        drain = apb.DrainEngineRequest(engine="p0", deadline_ms=0, abort_after_deadline=True)
        events = [e async for e in fleet.admin.DrainEngine(drain)]
        assert events[-1].state == pb.DRAIN_STATE_COMPLETE

        async def session_ended() -> bool:
            return await stalled.open_sessions() == 0

        await eventually(session_ended)
        responses = [r async for r in stalled.call]
        assert [r.WhichOneof("event") for r in responses] == ["prompt", "finished"]
        assert responses[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        assert responses[-1].usage.prompt_tokens == 2000
        await stalled.assert_nothing_left()
        requests = fleet.app.controller.metrics.requests
        assert requests.labels("aborted")._value.get() == 1
        assert requests.labels("engine_error")._value.get() == 0


async def test_a_session_that_expired_before_an_unread_handoff_runs_the_request_again() -> None:
    """The client read the prefill's output so slowly that the prefill engine's KV session
    passed its TTL (`kv_transfer.session_ttl_s`) before the gateway read the handoff. The
    decode engine refuses the session (NOT_FOUND); the prefill engine says it ended it
    (ALREADY_FINISHED) and does not drain: the client did nothing wrong, so the request runs
    again as a whole, once (here on the same prefill engine, the only one), and the client,
    reading on, gets all its tokens, its prompt output once. It used to end finished
    CANCELLED, as a drain's end."""
    async with stalled_at_the_handoff(kv_transfer=KvTransferConfig(session_ttl_s=2.0)) as stalled:
        fleet = stalled.fleet

        async def session_ended() -> bool:
            return await stalled.open_sessions() == 0

        await eventually(session_ended)
        responses = [r async for r in stalled.call]
        events = [r.WhichOneof("event") for r in responses]
        assert events == ["prompt", *["token"] * 50, "finished"]
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 50
        await stalled.assert_nothing_left()
        assert "r" in stalled.decode.service._finished  # decoded, with the second session
        metrics = fleet.app.controller.metrics
        assert metrics.requests.labels("ok")._value.get() == 1
        assert metrics.requests.labels("aborted")._value.get() == 0
        assert metrics.retries._value.get() == 1


async def test_an_aborting_gateway_drain_completes_past_an_unread_handoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway's own Drain (deadline 0, aborting) asks the prefill engine to abort the
    request, which answers ALREADY_FINISHED (its part is over): the gateway ends the request
    at the handoff, and the drain completes at once, its engines idle, without waiting out
    its grace for the client (here far longer than the test's bound: it used to wait all of
    it). The client gets its output finished CANCELLED once it reads on."""
    monkeypatch.setattr(gateway, "DRAIN_ABORT_GRACE_S", 3600.0)
    async with stalled_at_the_handoff() as stalled:
        drain = pb.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
        )
        async with asyncio.timeout(30):  # a bound, not a measurement
            events = [e async for e in stalled.fleet.gateway.Drain(drain)]
        assert [e.WhichOneof("event") for e in events].count("error") == 0
        assert (events[-1].state, events[-1].in_flight_requests) == (pb.DRAIN_STATE_COMPLETE, 0)
        assert "r" in stalled.fleet.app.gateway.relay.running  # its client still holds it
        responses = [r async for r in stalled.call]
        assert [r.WhichOneof("event") for r in responses] == ["prompt", "finished"]
        assert responses[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        await stalled.assert_nothing_left()


async def test_a_session_lost_with_its_prefill_engine_restarted_under_its_instance_id() -> None:
    """The prefill engine restarts at its address, under the `instance_id` of its config,
    before the gateway read its handoff: the new process answers GetEngineInfo as the old one
    did (the seed's answers carry no start time or incarnation), but knows nothing of the KV
    session. The decode engine's pull finds none (NOT_FOUND), the new process answers the
    session's release NOT_FOUND: the session is lost, so the request runs again as a whole,
    once, on the new process, and the client, reading on, gets all its tokens. It used to
    get a retryable error ("refused the KV session"), the session taken for one still there."""
    async with stalled_at_the_handoff() as stalled:
        fleet = stalled.fleet
        address = fleet.address(stalled.prefill)
        restarted = await fleet.restart_engine(
            address, "p0", role="prefill", num_kv_blocks=1100, max_model_len=4096
        )
        await eventually(lambda: fleet.answers_as(address, "p0"))
        responses = [r async for r in stalled.call]
        events = [r.WhichOneof("event") for r in responses]
        assert events == ["prompt", *["token"] * 50, "finished"]
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert "r" in restarted.service._finished  # the run again's prefill
        assert "r" in stalled.decode.service._finished  # decoded, with the second session
        metrics = fleet.app.controller.metrics
        assert metrics.requests.labels("ok")._value.get() == 1
        assert metrics.retries._value.get() == 1


class HeldConfigChange(NamedTuple):
    """A request stalled at the handoff whose prefill engine restarted with another config,
    the controller held before it takes the new process in (`held_config_change`)."""

    stalled: StalledAtTheHandoff
    restarted: EngineApp
    resume: asyncio.Event  # set: the controller takes the new process in, READY at once


@contextlib.asynccontextmanager
async def held_config_change(
    monkeypatch: pytest.MonkeyPatch, router: dict[str, Any]
) -> AsyncIterator[HeldConfigChange]:
    """The prefill engine of a request stalled at the handoff comes back with another config
    (256 KV blocks, not 1100: a rolling config change under the `instance_id` of its
    config). The controller, once it meets the new process (its KV events break sequence),
    reads its changed identity and takes it for a new process: out of routing until
    `resume` lets it follow the new process's KV events, READY then. Set on exit."""
    # Polled hourly: only its KV events tell the controller of the new process. A poll
    # meeting the old one's shutdown (CANCELLED) had the identity read again before the
    # events broke sequence: the changed identity was taken for the same process's, and
    # the restart passed unseen (the controller's race, not this test's subject).
    hourly = {"poll_interval_s": 3600.0, "load_poll_interval_s": 3600.0}
    async with stalled_at_the_handoff(router=router, health=hourly) as stalled:
        fleet = stalled.fleet
        address = fleet.address(stalled.prefill)
        controller_fleet = fleet.app.controller.fleet
        registry = controller_fleet.registry
        follow = controller_fleet._follow_events
        taking_in, resume = asyncio.Event(), asyncio.Event()

        def new_config(identity: EngineIdentity | None) -> bool:
            return identity is not None and identity.model_facts[0].total_kv_blocks == 256

        async def held(engine: Any, identity: EngineIdentity) -> None:
            if engine.address == address and new_config(identity):
                taking_in.set()
                await resume.wait()
            await follow(engine, identity)

        monkeypatch.setattr(controller_fleet, "_follow_events", held)
        try:
            restarted = await fleet.restart_engine(
                address, "p0", role="prefill", num_kv_blocks=256, max_model_len=4096, routed=False
            )
            await asyncio.wait_for(taking_in.wait(), 20)  # a bound, not a measurement
            record = registry.get(address)
            assert new_config(record.identity) and not record.routable
            yield HeldConfigChange(stalled, restarted, resume)
        finally:
            resume.set()


async def _waiting_for_a_prefill_engine(
    fleet: Fleet, reading: asyncio.Future[Any], waits: int = 1
) -> None:
    """Until `waits` requests waited for a prefill engine (`kvplane_controller_prefill_waits`),
    or the client's `reading` of one ends (it did not wait)."""
    counted = fleet.app.controller.metrics.prefill_waits

    def waiting() -> bool:
        return reading.done() or counted._value.get() >= waits

    await eventually(waiting)


@pytest.mark.parametrize("decode_engines_prefill", [False, True])
async def test_a_session_lost_to_a_config_change_runs_again_where_a_new_request_goes_then(
    monkeypatch: pytest.MonkeyPatch, decode_engines_prefill: bool
) -> None:
    """The prefill engine comes back with another config, out of routing until its next
    health answer (`held_config_change`); the controller held there, the client reads on:
    the session is lost, and the request runs again where a new request goes at that
    moment, no prefill engine routable: with decode engines that prefill
    (`skip_prefill_ratio`), to the decode engine prefilling the prompt itself, the client
    getting all its tokens; without, it waits `router.prefill_wait_s` for a prefill engine
    (here 0.5 s, the engine held out longer), then goes nowhere, as a new request is
    refused UNAVAILABLE "no prefill engine available" after its own wait: the client,
    having its prompt output, gets one retryable EngineError naming the lost session (the
    first run's failure), counted engine_error, and sent again once the engine is back in
    routing, the request succeeds. (What a loaded CI met once in the test above when it
    restarted the engine with 256 blocks, the client getting that error.)"""
    router: dict[str, Any] = {"prefill_wait_s": 0.5}
    if decode_engines_prefill:
        router["skip_prefill_ratio"] = 0.5
    async with held_config_change(monkeypatch, router) as held:
        stalled, restarted = held.stalled, held.restarted
        fleet = stalled.fleet
        address = fleet.address(stalled.prefill)
        new_request = generate_request("r2", PROMPT, max_tokens=2)
        if decode_engines_prefill:
            reply = [r async for r in fleet.gateway.Generate(new_request)]
            assert reply[-1].WhichOneof("event") == "finished"
        else:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in fleet.gateway.Generate(new_request)]
            assert (refused.value.code(), refused.value.details()) == (
                grpc.StatusCode.UNAVAILABLE,
                "no prefill engine available",
            )
        responses = [r async for r in stalled.call]
        held.resume.set()
        events = [r.WhichOneof("event") for r in responses]
        metrics = fleet.app.controller.metrics
        if decode_engines_prefill:
            assert events == ["prompt", *["token"] * 50, "finished"]
            assert "r" in stalled.decode.service._finished
            assert "r" not in restarted.service._finished
            ok, retries = metrics.requests.labels("ok")._value.get(), metrics.retries._value.get()
            assert (ok, retries) == (2, 1)  # the new request and this one; its run again
        else:
            assert events == ["prompt", "error"]
            error = responses[-1].error
            assert (error.code, error.retryable) == (pb.ERROR_CODE_INTERNAL, True)
            assert error.message.startswith(
                f"engine {fleet.address(stalled.decode)} refused the KV session (NOT_FOUND: "
            )
            assert error.message.endswith(
                f"): engine {address}, which held it, no longer holds it (a decode engine took "
                "it, or the engine restarted)"
            )
            assert metrics.requests.labels("engine_error")._value.get() == 1
            assert metrics.requests.labels("no_engine")._value.get() == 1  # the new request
            await eventually(lambda: fleet.answers_as(address, "p0"))
            again = generate_request("r", list(range(1000, 3000)), max_tokens=50)
            reply = [r async for r in fleet.gateway.Generate(again)]
            assert [r.WhichOneof("event") for r in reply] == ["token"] * 50 + ["finished"]
            assert "r" in restarted.service._finished
        await stalled.assert_nothing_left()


async def test_a_run_again_waits_for_its_prefill_engine_back_in_routing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, decode engines not prefilling, but the prefill engine is back in routing
    within `router.prefill_wait_s` (here far longer than the test's bound): the run again,
    finding no prefill engine routable, waits for one, woken as the engine is taken in, and
    runs there; the client, reading on, gets all its tokens. It used to get the first
    loss's retryable EngineError at once, the engine back a moment later."""
    async with held_config_change(monkeypatch, {"prefill_wait_s": 3600.0}) as held:
        stalled = held.stalled
        reading = asyncio.ensure_future(_read_all(stalled.call))
        await _waiting_for_a_prefill_engine(stalled.fleet, reading)
        held.resume.set()
        async with asyncio.timeout(30):  # a bound, not a measurement
            responses = await reading
        events = [r.WhichOneof("event") for r in responses]
        assert events == ["prompt", *["token"] * 50, "finished"]
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert "r" in held.restarted.service._finished  # the run again's prefill
        assert "r" in stalled.decode.service._finished
        metrics = stalled.fleet.app.controller.metrics
        assert metrics.requests.labels("ok")._value.get() == 1
        assert metrics.retries._value.get() == 1
        await stalled.assert_nothing_left()


async def test_a_new_request_waits_for_a_prefill_engine_back_in_routing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new request, no prefill engine routable (the only one held out of routing after a
    config change), decode engines not prefilling: it waits for a prefill engine, and runs
    once that one is back, where it was refused UNAVAILABLE "no prefill engine available"
    at once."""
    async with held_config_change(monkeypatch, {"prefill_wait_s": 3600.0}) as held:
        stalled = held.stalled
        new_request = generate_request("r2", PROMPT, max_tokens=2)
        reading = asyncio.ensure_future(_read_all(stalled.fleet.gateway.Generate(new_request)))
        await _waiting_for_a_prefill_engine(stalled.fleet, reading)
        held.resume.set()
        async with asyncio.timeout(30):  # a bound, not a measurement
            reply = await reading
        assert [r.WhichOneof("event") for r in reply] == ["token"] * 2 + ["finished"]
        assert "r2" in held.restarted.service._finished
        responses = [r async for r in stalled.call]  # its run again finds the engine back
        assert responses[-1].WhichOneof("event") == "finished"
        await stalled.assert_nothing_left()


async def test_a_run_again_does_not_wait_for_the_prefill_engine_that_did_not_answer() -> None:
    """The only prefill engine, holding the request's KV session, stops before the gateway
    read its handoff, and is out of routing (unreachable, not for long) when the client reads
    on: the decode engine's pull fails, the engine does not answer the session's release,
    so the request runs again without it. No other prefill engine may come back, so it does
    not wait `router.prefill_wait_s` (here far longer than the test's bound) for that one,
    which it would not go to: the client gets the failure at once, as before the wait
    existed. It used to wait for it, the engine's instance id taken for its address."""
    async with stalled_at_the_handoff(
        router={"prefill_wait_s": 3600.0}, health={"abandon_streams_after_s": 3600.0}
    ) as stalled:
        fleet = stalled.fleet
        registry = fleet.app.controller.fleet.registry
        address = fleet.address(stalled.prefill)
        await stalled.prefill.close()
        await eventually(lambda: registry.get(address).unreachable_since_s is not None)
        async with asyncio.timeout(30):  # a bound, not a measurement
            responses = [r async for r in stalled.call]
        assert [r.WhichOneof("event") for r in responses] == ["prompt", "error"]
        assert responses[-1].error.retryable
        assert f"engine {address}, which held the request's KV session, does not answer" in (
            responses[-1].error.message
        )
        assert fleet.app.controller.metrics.prefill_waits._value.get() == 0


async def test_a_run_again_goes_to_a_prefill_engine_back_since_the_request_was_planned() -> None:
    """Two prefill engines, one out of routing (cordoned here; restarting in a rolling
    restart) when a request is planned and prefilled on the other; that one then stops
    before the gateway read its handoff, the first is back in routing. The request runs
    again where a new request would go then, on the engine back, and the client, reading
    on, gets all its tokens. It used to fail ("does not answer"), run again among its first
    plan's candidates only, the engine back not among them."""
    engine_config: dict[str, Any] = {"num_kv_blocks": 1100, "max_model_len": 4096}
    p0 = await start_sim_engine("p0", role="prefill", **engine_config)
    p1 = await start_sim_engine("p1", role="prefill", **engine_config)
    d0 = await start_sim_engine("d0", role="decode", **engine_config)
    fleet = await make_fleet(engines=[p0, p1, d0])
    try:
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(p1)))
        async with stalled_on(fleet, p0, d0) as stalled:
            await fleet.admin.Uncordon(apb.EngineRef(engine=fleet.address(p1)))
            registry = fleet.app.controller.fleet.registry
            await p0.close()
            await eventually(lambda: not registry.get(fleet.address(p0)).routable)
            async with asyncio.timeout(30):  # a bound, not a measurement
                responses = [r async for r in stalled.call]
        events = [r.WhichOneof("event") for r in responses]
        assert events == ["prompt", *["token"] * 50, "finished"]
        assert "r" in p1.service._finished  # the run again's prefill
        assert "r" in d0.service._finished
        assert fleet.app.controller.metrics.requests.labels("ok")._value.get() == 1
        relay = fleet.app.gateway.relay
        await eventually(lambda: not relay.running)
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


@contextlib.asynccontextmanager
async def prefill_stopped(
    abandon_streams_after_s: float, prefill_wait_s: float = 3600.0
) -> AsyncIterator[Fleet]:
    """A controller in front of a prefill and a decode engine (sim), decode engines not
    prefilling, waiting `router.prefill_wait_s` (by default far longer than any test's
    bound); the prefill engine stopped, out of routing (unreachable), with
    `health.abandon_streams_after_s`."""
    prefill = await start_sim_engine("p0", role="prefill")
    decode = await start_sim_engine("d0", role="decode")
    fleet = await make_fleet(
        engines=[prefill, decode],
        router={"prefill_wait_s": prefill_wait_s},
        health={"abandon_streams_after_s": abandon_streams_after_s},
    )
    try:
        registry = fleet.app.controller.fleet.registry
        address = fleet.address(prefill)
        await prefill.close()
        await eventually(lambda: registry.get(address).unreachable_since_s is not None)
        yield fleet
    finally:
        await close_fleet(fleet)


async def _refused_no_prefill_engine(fleet: Fleet, request_id: str) -> None:
    """A new request is refused UNAVAILABLE "no prefill engine available" (within the
    test's bound)."""
    request = generate_request(request_id, PROMPT, max_tokens=2)
    await _refused(fleet, request, grpc.StatusCode.UNAVAILABLE, "no prefill engine available")


async def _refused(
    fleet: Fleet, request: pb.GenerateRequest, code: grpc.StatusCode, details: str
) -> None:
    """The request is refused `code` `details` (within the test's bound)."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with asyncio.timeout(30):  # a bound, not a measurement
            [r async for r in fleet.gateway.Generate(request)]
    assert (refused.value.code(), refused.value.details()) == (code, details)


async def test_a_new_request_does_not_wait_for_a_prefill_engine_dead_for_long() -> None:
    """The only prefill engine stopped, unreachable for longer than
    `health.abandon_streams_after_s` (here 1 s): a new request does not wait
    `router.prefill_wait_s` for it, dead as far as its calls are concerned, but is refused
    UNAVAILABLE "no prefill engine available" at once, as before the wait existed."""
    async with prefill_stopped(abandon_streams_after_s=1.0) as fleet:
        registry = fleet.app.controller.fleet.registry
        clock = fleet.app.controller.clock
        address = fleet.address(fleet.engines[0])

        def dead_for_long() -> bool:
            since_s = registry.get(address).unreachable_since_s
            return since_s is not None and clock() - since_s > 1.0

        await eventually(dead_for_long)
        await _refused_no_prefill_engine(fleet, "r")


async def test_no_wait_for_a_prefill_engine_where_the_wait_is_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`router.prefill_wait_s: 0`: a new request finding no prefill engine routable, the only
    one stopped but not for long, is refused at once, neither counted nor logged as waiting
    (it used to be both, "waiting up to 0.0 s")."""
    caplog.set_level(logging.INFO, logger="controller.relay")
    async with prefill_stopped(abandon_streams_after_s=3600.0, prefill_wait_s=0.0) as fleet:
        await _refused_no_prefill_engine(fleet, "r")
        assert fleet.app.controller.metrics.prefill_waits._value.get() == 0
        assert not any("waiting up to" in r.getMessage() for r in caplog.records)


async def test_a_wait_for_a_prefill_engine_ends_once_it_is_dead_for_long() -> None:
    """A new request waits for the only prefill engine, stopped, unreachable for less than
    `health.abandon_streams_after_s` (here 5 s) yet; once it is unreachable for longer,
    dead as far as its calls are concerned, the wait ends (no registry change tells it: the
    time does), and the request is refused UNAVAILABLE "no prefill engine available", as
    one arriving then is. It used to wait all of `router.prefill_wait_s` (here far longer
    than the test's bound)."""
    async with prefill_stopped(abandon_streams_after_s=5.0) as fleet:
        refused = asyncio.ensure_future(_refused_no_prefill_engine(fleet, "r"))
        await _waiting_for_a_prefill_engine(fleet, refused)
        assert not refused.done()  # it waits
        await refused


async def test_requests_waiting_for_a_prefill_engine_are_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Requests waiting for the only prefill engine (stopped, but not for long) are each
    counted (`kvplane_controller_prefill_waits_total`), and logged once at most every 10
    s, not a line each: every request meets the outage while it lasts. Their clients
    cancelling, nothing is left in flight."""
    caplog.set_level(logging.INFO, logger="controller.relay")
    async with prefill_stopped(abandon_streams_after_s=3600.0) as fleet:
        calls = [
            fleet.gateway.Generate(generate_request(f"r{i}", PROMPT, max_tokens=2))
            for i in range(3)
        ]
        readings = asyncio.gather(*(_read_all(call) for call in calls), return_exceptions=True)
        await _waiting_for_a_prefill_engine(fleet, readings, waits=3)
        said = "no prefill engine takes traffic; waiting"
        assert sum(said in r.getMessage() for r in caplog.records) == 1
        for call in calls:
            call.cancel()
        async with asyncio.timeout(30):  # a bound, not a measurement
            await readings
        relay = fleet.app.gateway.relay
        await eventually(lambda: not relay.running)
        assert fleet.app.controller.metrics.requests.labels("cancelled")._value.get() == 3


async def test_a_deadline_passing_while_a_request_waits_for_a_prefill_engine() -> None:
    """New requests whose deadline (here 1 s) is shorter than their wait for a prefill engine
    (the only one stopped, but not for long): each ends as any call whose deadline passes,
    its client getting DEADLINE_EXCEEDED, counted cancelled, nothing left in flight. The
    wait used to end at the deadline too, by a timer of its own racing gRPC's: a client got
    UNAVAILABLE "no prefill engine available" or DEADLINE_EXCEEDED, and a request was
    counted no_engine or cancelled, by chance."""
    async with prefill_stopped(abandon_streams_after_s=3600.0) as fleet:

        async def past_its_deadline(request_id: str) -> grpc.StatusCode:
            request = generate_request(request_id, PROMPT, max_tokens=2)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                [r async for r in fleet.gateway.Generate(request, timeout=1.0)]
            return ended.value.code()

        async with asyncio.timeout(30):  # a bound, not a measurement
            codes = await asyncio.gather(*(past_its_deadline(f"r{i}") for i in range(5)))
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 5
        relay = fleet.app.gateway.relay
        await eventually(lambda: not relay.running)
        requests = fleet.app.controller.metrics.requests
        assert requests.labels("cancelled")._value.get() == 5
        assert requests.labels("no_engine")._value.get() == 0
        assert len(fleet.app.controller.router.inflight) == 0


@pytest.mark.parametrize(
    "ended_by", ["client_cancel", "gateway_abort", "gateway_abort_all", "gateway_drain"]
)
async def test_a_run_again_waiting_for_a_prefill_engine_ends_when_it_is_cancelled(
    monkeypatch: pytest.MonkeyPatch, ended_by: str
) -> None:
    """The run again waits for the prefill engine (held out of routing, the wait far
    longer than the test's bound) when its client cancels, or an Abort through the gateway
    comes (of its id, `all_requests`, the gateway's own Drain aborting past its deadline):
    the request ends then, nothing left in flight on the gateway or either engine;
    cancelled, counted so; aborted, as one aborted between two engines, each output
    finished CANCELLED."""
    async with held_config_change(monkeypatch, {"prefill_wait_s": 3600.0}) as held:
        stalled = held.stalled
        reading = asyncio.ensure_future(_read_all(stalled.call))
        await _waiting_for_a_prefill_engine(stalled.fleet, reading)
        assert not reading.done()
        metrics = stalled.fleet.app.controller.metrics
        if ended_by == "client_cancel":
            stalled.call.cancel()
            async with asyncio.timeout(30):  # a bound, not a measurement
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await reading
            relay = stalled.fleet.app.gateway.relay
            await eventually(lambda: not relay.running)
            assert metrics.requests.labels("cancelled")._value.get() == 1
        else:
            gateway = stalled.fleet.gateway
            if ended_by == "gateway_drain":
                drain = pb.DrainRequest(deadline_ms=0, abort_after_deadline=True)
                async with asyncio.timeout(30):  # a bound, not a measurement
                    events = [e async for e in gateway.Drain(drain)]
                assert events[-1].state == pb.DRAIN_STATE_COMPLETE
            else:
                everything = pb.AbortRequest(all_requests=pb.AllRequests())
                one = pb.AbortRequest(request_id="r")
                reply = await gateway.Abort(everything if ended_by.endswith("all") else one)
                assert reply.status == pb.ABORT_STATUS_ABORTED
            async with asyncio.timeout(30):  # a bound, not a measurement
                responses = await reading
            assert [r.WhichOneof("event") for r in responses] == ["prompt", "finished"]
            assert responses[-1].finished.reason == pb.FINISH_REASON_CANCELLED
            assert metrics.requests.labels("aborted")._value.get() == 1
        await stalled.assert_nothing_left()


async def test_vllm_generate_is_not_serving_while_only_prefill_engines_are_routable() -> None:
    """A Generate goes to an aggregated engine or through a decode engine, never to prefill
    engines alone: with the decode engine cordoned, every vllm.Generate is refused
    (UNAVAILABLE), and `grpc.health.v1` for `vllm.Generate` (what a load balancer in front
    of the vLLM front end reads) says NOT_SERVING, SERVING again once it is uncordoned.
    Before, the routable prefill engine kept it SERVING: traffic was sent to a controller
    that refused all of it."""
    prefill = await start_sim_engine("p0", role="prefill")
    decode = await start_sim_engine("d0", role="decode")
    fleet = await make_fleet(engines=[prefill, decode])
    health = health_pb2_grpc.HealthStub(fleet.channel)

    async def vllm_status() -> int:
        reply = await health.Check(health_pb2.HealthCheckRequest(service="vllm.Generate"))
        return int(reply.status)

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    try:
        assert await vllm_status() == serving
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(decode)))
        request = vpb.GenerateRequest(
            request_id="v", model="sim", token_ids=vpb.TokenIds(ids=PROMPT),
            stopping=vpb.StoppingCriteria(max_new_tokens=2),
        )  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await vpb_grpc.GenerateStub(fleet.channel).Generate(request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value

        async def status_is(status: int) -> bool:
            return await vllm_status() == status

        await eventually(lambda: status_is(not_serving), what="vllm.Generate NOT_SERVING")
        await fleet.admin.Uncordon(apb.EngineRef(engine=fleet.address(decode)))
        await eventually(lambda: status_is(serving), what="vllm.Generate SERVING again")
    finally:
        await close_fleet(fleet)


@contextlib.asynccontextmanager
async def lora_fleet_prefill_stopped(
    tmp_path: Path, *loads: str, prefill_engines: int = 1
) -> AsyncIterator[Fleet]:
    """Prefill engines p0.. and a decode engine d0 (sim, LoRA), decode engines not
    prefilling, waiting `router.prefill_wait_s` far longer than any test's bound; adapter x
    loaded and unloaded by the `lora` commands `loads` (each its arguments after `lora`,
    `{x}` standing for the adapter's path, `{y}` for another's), then p0 stopped, out of
    routing (unreachable, not for long)."""
    lora = LoraConfig(enabled=True)
    engines = [
        *[
            await start_sim_engine(f"p{i}", role="prefill", lora=lora)
            for i in range(prefill_engines)
        ],
        await start_sim_engine("d0", role="decode", lora=lora),
    ]
    fleet = await make_fleet(
        engines=engines,
        router={"prefill_wait_s": 3600.0},
        health={"abandon_streams_after_s": 3600.0},
    )
    try:
        paths = {name: str(write_adapter_config(tmp_path / name)) for name in "xy"}
        for load in loads:
            done = await cli("lora", *load.format(**paths).split(), "--target", fleet.target)
            assert done.exit_code == 0, done.output
        registry = fleet.app.controller.fleet.registry
        address = fleet.address(engines[0])
        await engines[0].close()
        await eventually(lambda: registry.get(address).unreachable_since_s is not None)
        yield fleet
    finally:
        await close_fleet(fleet)


async def _refused_at_once_naming_x(fleet: Fleet) -> None:
    """A request naming adapter x is refused NOT_FOUND without waiting for a prefill engine
    (`router.prefill_wait_s` is far longer than the bound here)."""
    request = generate_request("r", PROMPT, max_tokens=2)
    request.lora_name = "x"
    details = "no prefill engine has LoRA adapter 'x' loaded"
    await _refused(fleet, request, grpc.StatusCode.NOT_FOUND, details)
    assert fleet.app.controller.metrics.prefill_waits._value.get() == 0


async def test_a_lora_request_does_not_wait_for_a_prefill_engine_that_will_not_hold_it(
    tmp_path: Path,
) -> None:
    """Adapter x loaded on the decode engine alone (`--engine d0`); the only prefill engine
    stopped, not for long. A new request naming x does not wait `router.prefill_wait_s`
    (far longer than the test's bound) for that engine: back, it would not hold x (the
    fleet restores x on d0 only), and the request would be refused all the same. It is
    refused at once, NOT_FOUND, as before the wait existed. It used to wait."""
    load = "load x {x} --id 1 --engine d0"
    async with lora_fleet_prefill_stopped(tmp_path, load) as fleet:
        await _refused_at_once_naming_x(fleet)


async def test_a_lora_request_waits_for_a_prefill_engine_back_with_its_adapter(
    tmp_path: Path,
) -> None:
    """Adapter x loaded on the fleet, then unloaded from prefill engine p1 alone (kept off
    it); p0, the other prefill engine, stopped, not for long. A new request naming x, the
    only routable prefill engine (p1) without it, waits for p0: back (a new process), the
    fleet loads x on it again, and the request runs there. It used to be refused at once
    (UNAVAILABLE: the prefill engines with x take no traffic now), a prefill engine taking
    traffic without x counted as one taking the request."""
    loads = ("load x {x} --id 1", "unload x --engine p1")
    async with lora_fleet_prefill_stopped(tmp_path, *loads, prefill_engines=2) as fleet:
        request = generate_request("r", PROMPT, max_tokens=2)
        request.lora_name = "x"
        reading = asyncio.ensure_future(_read_all(fleet.gateway.Generate(request)))
        await _waiting_for_a_prefill_engine(fleet, reading)
        assert not reading.done()  # it waits
        address = fleet.address(fleet.engines[0])
        restarted = await fleet.restart_engine(address, "p0-2", routed=False)
        async with asyncio.timeout(30):  # a bound, not a measurement
            reply = await reading
        assert [r.WhichOneof("event") for r in reply] == ["token"] * 2 + ["finished"]
        assert "r" in restarted.service._finished
        assert fleet.app.controller.fleet.registry.get(address).holds_lora("x")


async def test_a_lora_request_does_not_wait_for_a_prefill_engine_whose_restore_of_it_failed(
    tmp_path: Path,
) -> None:
    """Adapters y, then x loaded on the fleet; the only prefill engine p0 restarted with one
    LoRA slot: the fleet restores y there, and p0 refuses x. A request naming x is refused
    at once, NOT_FOUND, as before the wait existed: p0, taking traffic without x, will not
    get it (its adapters restored are all it gets until they are next read). It used to
    wait `router.prefill_wait_s` (far longer than the test's bound) for p0 to hold x."""
    loads = ("load y {y} --id 2", "load x {x} --id 1")
    async with lora_fleet_prefill_stopped(tmp_path, *loads) as fleet:
        address = fleet.address(fleet.engines[0])
        one_slot = LoraConfig(enabled=True, max_loras=1)
        await fleet.restart_engine(address, "p0-2", lora=one_slot)
        engine = fleet.app.controller.fleet._engines[address]
        record = fleet.app.controller.fleet.registry.get(address)

        def restore_done() -> bool:
            task = engine.lora_task
            return record.holds_lora("y") and task is not None and task.done()

        await eventually(restore_done, what="y restored on p0, x refused")
        assert not record.holds_lora("x")
        await _refused_at_once_naming_x(fleet)
