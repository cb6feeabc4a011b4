"""The gateway in front of a disaggregated fleet (prefill and decode engines, no aggregated
one): each request is prefilled on a prefill engine chosen by overlap and load, handed to a
decode engine chosen by load through the KV session the prefill engine returned, and the
client sees one ordinary stream. See tests/controller/disagg_engines.py for the engines."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner, Result

from controller.outcomes import read_outcomes
from controller.route_report import read_route
from kvplane.cli import app
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    close_fleet,
    ended_while_queued,
    generate_request,
    make_fleet,
)
from tests.controller.disagg_engines import (
    RoleEngine,
    Sessions,
    restart_role_engine,
    start_role_engine,
)
from tests.controller.test_fleet_events import scrape
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

PREFIX = list(range(300, 364))  # 4 blocks of 16


async def _fleet(
    num_prefill: int, num_decode: int, accept_local_prefill: bool = False, **controller: Any
) -> tuple[EngineFleet[RoleEngine], list[RoleEngine], list[RoleEngine], Sessions]:
    sessions = Sessions()
    prefill = [
        await start_role_engine(f"p{i}", pb.ENGINE_ROLE_PREFILL, sessions)
        for i in range(num_prefill)
    ]
    decode = [
        await start_role_engine(f"d{i}", pb.ENGINE_ROLE_DECODE, sessions, accept_local_prefill)
        for i in range(num_decode)
    ]
    fleet = await make_fleet(engines=[*prefill, *decode], **controller)
    return fleet, prefill, decode, sessions


async def _generate(
    fleet: EngineFleet[Any], request: pb.GenerateRequest
) -> list[pb.GenerateResponse]:
    return [r async for r in fleet.gateway.Generate(request)]


async def _cli(*args: str) -> Result:
    """`kvplane admin ARGS`, as an operator types it."""
    return await asyncio.to_thread(CliRunner().invoke, app, ["admin", *args])


async def _prefix_indexed(fleet: EngineFleet[Any]) -> None:
    """Until the index places PREFIX's 4 blocks on some engine."""

    async def indexed() -> bool:
        reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX)))
        return any(m.device_blocks >= 4 for m in reply.matches)

    await eventually(indexed)


async def _decode_engine_holding_a_prompt(fleet: EngineFleet[Any], decode: RoleEngine) -> list[int]:
    """A prompt of 8 full blocks, sent once (so the decode engine computed it): returned
    when the index shows the decode engine holding all of it."""
    prompt = [*PREFIX, *range(900, 964)]
    await _generate(fleet, generate_request("a", [*prompt, 1]))
    await _held(fleet, decode, prompt)
    return prompt


async def _held(fleet: EngineFleet[Any], engine: RoleEngine, prompt: list[int]) -> None:
    """Until the index shows `engine` holding all of `prompt`'s full blocks."""

    async def held() -> bool:
        reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=prompt)))
        return any(
            m.engine == fleet.address(engine) and m.device_blocks >= len(prompt) // 16
            for m in reply.matches
        )

    await eventually(held)


def _calls(engines: list[RoleEngine], request_id: str) -> list[tuple[str, bool]]:
    """(engine, carried a KV session) for every Generate `request_id` reached."""
    return [
        (e.servicer.name, with_session)
        for e in engines
        for rid, with_session in e.servicer.generated
        if rid == request_id
    ]


async def test_prefill_then_decode_through_the_session() -> None:
    fleet, prefill, decode, sessions = await _fleet(2, 2)
    try:
        reply = await _generate(fleet, generate_request("r1", [*PREFIX, 1, 2], max_tokens=5))
        kinds = [r.WhichOneof("event") for r in reply]
        assert "prefill_ready" not in kinds  # the handoff stays between gateway and engines
        assert kinds[-1] == "finished"
        assert sum(len(r.token.tokens) for r in reply if r.HasField("token")) == 5
        assert reply[-1].usage.completion_tokens == 5
        calls = _calls(prefill + decode, "r1")
        assert len(calls) == 2
        (first, first_session), (second, second_session) = calls
        assert first.startswith("p") and not first_session
        assert second.startswith("d") and second_session
        assert sessions.open == {}  # the decode engine attached the session
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


async def test_the_route_names_the_prefill_and_the_decode_engine() -> None:
    """`kvplane-route` of a request handed over: the decode engine that served it, and the
    prefill engine, each with the router's decision."""
    fleet, prefill, decode, _ = await _fleet(2, 2)
    try:
        call = fleet.gateway.Generate(generate_request("r1", [*PREFIX, 1, 2], max_tokens=3))
        reply = [r async for r in call]
        assert reply[-1].WhichOneof("event") == "finished"
        route = read_route(await call.trailing_metadata())
        assert route is not None
        (first, _), (second, _) = _calls(prefill + decode, "r1")
        engines = {e.servicer.name: f"127.0.0.1:{e.port}" for e in prefill + decode}
        # (Each test engine fronts a sim engine, whose instance id it answers.)
        assert (route["instance_id"], route["engine"]) == (f"{second}-inner", engines[second])
        assert (route["prefill"]["instance_id"], route["prefill"]["engine"]) == (
            f"{first}-inner",
            engines[first],
        )
        assert route["retried"] is False
        assert route["prefill"]["reason"] in ("tie", "load", "cache")
    finally:
        await close_fleet(fleet)


async def test_a_request_carrying_a_kv_session_is_refused_as_a_role_mismatch() -> None:
    """The gateway is AGGREGATED (GetEngineInfo) and makes the handoff itself: a client's
    `kv.session` is a decode request, refused before acceptance (seed: role mismatch, a
    non-OK status) and sent to no engine, not to a prefill or decode engine of the fleet."""
    fleet, prefill, decode, _ = await _fleet(1, 1, accept_local_prefill=True)
    try:
        info = await fleet.gateway.GetEngineInfo(pb.GetEngineInfoRequest())
        assert info.role == pb.ENGINE_ROLE_AGGREGATED
        request = generate_request("own", [*PREFIX, 1])
        request.kv.session.CopyFrom(pb.KvSessionRef(session_id="s0", transfer_backend="grpc"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(fleet, request)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _calls(prefill + decode, "own") == []  # was sent to the prefill engine
        assert "kv.session is for a DECODE engine" in (err.value.details() or "")
    finally:
        await close_fleet(fleet)


async def test_prompt_logprobs_come_once_from_the_prefill_hop() -> None:
    """The prefill engine computed the prompt and its logprobs were relayed: the decode hop
    does not ask for them again (a decode engine would recompute the prompt for them, and the
    client would get them twice)."""
    fleet, _, _, _ = await _fleet(1, 1)
    try:
        request = generate_request("r1", [*PREFIX, 1, 2], max_tokens=3)
        request.response.return_prompt_logprobs = True
        reply = await _generate(fleet, request)
        kinds = [r.WhichOneof("event") for r in reply]
        assert kinds.count("prompt") == 1 and kinds[0] == "prompt"
        assert kinds[-1] == "finished"
    finally:
        await close_fleet(fleet)


async def test_prefill_goes_where_the_prefix_lives() -> None:
    fleet, prefill, decode, _ = await _fleet(3, 1)
    try:
        await _generate(fleet, generate_request("a", [*PREFIX, 1]))
        (holder, _), _ = _calls(prefill + decode, "a")
        await _prefix_indexed(fleet)
        for i in range(4):
            await _generate(fleet, generate_request(f"b{i}", [*PREFIX, 50 + i]))
            (engine, _), _ = _calls(prefill + decode, f"b{i}")
            assert engine == holder
    finally:
        await close_fleet(fleet)


async def test_decode_engine_holding_the_prompt_prefills_it_itself() -> None:
    fleet, prefill, decode, _ = await _fleet(
        1, 1, accept_local_prefill=True, router={"skip_prefill_ratio": 0.9}
    )
    try:
        prompt = await _decode_engine_holding_a_prompt(fleet, decode[0])
        # Admin `route` explains that first hop, not the prefill engine's it would not take.
        explained = await fleet.admin.Route(
            apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prompt, 2]))
        )
        assert explained.engine == f"127.0.0.1:{decode[0].port}"
        assert explained.predicted_cached_tokens == len(prompt)
        reply = await _generate(fleet, generate_request("b", [*prompt, 2]))
        assert reply[-1].WhichOneof("event") == "finished"
        assert _calls(prefill + decode, "b") == [("d0", False)]  # no prefill hop
    finally:
        await close_fleet(fleet)


async def test_admin_route_match_and_load_tell_each_engines_hop_and_role(tmp_path: Path) -> None:
    """An operator reads which hop admin `route`'s engine is (a prefill engine, its decode
    engine chosen by load at the handoff; or a decode engine prefilling the prompt itself),
    and each engine's role in `match` and `load`: they named engines only, and a decode
    engine prefilling a prompt read as any decision by load (only `workers` told roles)."""
    fleet, prefill, decode, _ = await _fleet(
        1, 1, accept_local_prefill=True, router={"skip_prefill_ratio": 0.9}
    )
    p0, d0 = (f"127.0.0.1:{e.port}" for e in (prefill[0], decode[0]))
    try:
        target = ["--target", fleet.target]
        fresh = tmp_path / "fresh.txt"
        fresh.write_text(" ".join(str(t) for t in range(2000, 2040)))
        routed = await _cli("route", "--tokens-file", str(fresh), *target)
        assert routed.exit_code == 0, routed.output
        assert p0 in routed.stdout.splitlines()[0]
        assert (
            "prefill hop: this prefill engine computes the prompt's KV; a decode engine is "
            "chosen by load when it hands the KV session over"
        ) in " ".join(routed.stdout.split())
        held = tmp_path / "held.txt"
        prompt = await _decode_engine_holding_a_prompt(fleet, decode[0])
        held.write_text(" ".join(str(t) for t in [*prompt, 2]))
        routed = await _cli("route", "--tokens-file", str(held), *target)
        assert d0 in routed.stdout.splitlines()[0]
        assert (
            "no prefill hop: this decode engine prefills the prompt itself (it holds "
            "router.skip_prefill_ratio of it"
        ) in " ".join(routed.stdout.split())
        matched = await _cli("match", "--tokens-file", str(held), *target)
        assert matched.exit_code == 0, matched.output
        header, *rows = matched.stdout.splitlines()[1:]
        assert header.split()[:3] == ["ENGINE", "ADDRESS", "ROLE"]
        assert {row.split()[1]: row.split()[2] for row in rows} == {p0: "prefill", d0: "decode"}
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert " role=prefill " in load.attributes[f"engine.{p0}"]
        assert " role=decode " in load.attributes[f"engine.{d0}"]
    finally:
        await close_fleet(fleet)


async def test_route_decisions_name_the_hop_each_placed() -> None:
    """`route_decisions_total` counts each hop by its `hop` label: the prefill engine's and
    the decode engine's taking its session, and a decode engine prefilling a prompt itself
    (no prefill hop). Only policy and reason told them apart, which read alike for a decode
    engine with or without a session (`least_loaded`, `load`)."""
    from prometheus_client.parser import text_string_to_metric_families

    fleet, _, decode, _ = await _fleet(
        1,
        1,
        accept_local_prefill=True,
        router={"skip_prefill_ratio": 0.9},
        metrics_listen="127.0.0.1:0",
    )
    try:
        prompt = await _decode_engine_holding_a_prompt(fleet, decode[0])  # prefill, decode
        reply = await _generate(fleet, generate_request("b", [*prompt, 2]))  # decode alone
        assert reply[-1].WhichOneof("event") == "finished"
        decisions = {
            (s.labels["hop"], s.labels["policy"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(await scrape(fleet))
            for s in family.samples
            if s.name == "kvplane_controller_route_decisions_total"
        }
        assert decisions == {
            ("prefill", "kvplane", "only"): 1,
            ("decode", "least_loaded", "load"): 1,
            ("decode_prefill", "least_loaded", "load"): 1,
        }
    finally:
        await close_fleet(fleet)


async def test_a_dead_decode_engine_prefilling_the_prompt_itself_is_retried_on_another() -> None:
    """The decode engine holding the prompt would prefill it itself, but is gone: the request
    is retried on the other decode engine, which prefills it itself too (no prefill hop), and
    both decisions count as `decode_prefill`."""
    fleet, prefill, decode, _ = await _fleet(
        1,
        2,
        accept_local_prefill=True,
        router={"skip_prefill_ratio": 0.9},
        health={"poll_interval_s": 60, "load_poll_interval_s": 60},
    )
    try:
        prompt = [*PREFIX, *range(900, 964)]
        await _generate(fleet, generate_request("a", [*prompt, 1]))
        _, (holder, _) = _calls(prefill + decode, "a")
        dead = next(e for e in decode if e.servicer.name == holder)
        await _held(fleet, dead, prompt)
        await dead.server.stop(None)  # the controller still believes it is ready
        reply = await _generate(fleet, generate_request("b", [*prompt, 2]))
        assert reply[-1].WhichOneof("event") == "finished"
        assert _calls(prefill + decode, "b") == [
            (next(e.servicer.name for e in decode if e is not dead), False)
        ]
        # "a"'s two hops; "b"'s decode engine and its retry.
        assert _hops(fleet) == {"prefill": 1, "decode": 1, "decode_prefill": 2}
    finally:
        await close_fleet(fleet)


async def test_by_default_decode_engines_always_get_a_session() -> None:
    """The seed's DECODE engines take requests that carry a KV session: unless
    `router.skip_prefill_ratio` says they also prefill, every request takes the hop, even
    when the decode engine holds the whole prompt."""
    fleet, prefill, decode, _ = await _fleet(1, 1)
    try:
        prompt = await _decode_engine_holding_a_prompt(fleet, decode[0])
        reply = await _generate(fleet, generate_request("b", [*prompt, 2]))
        assert reply[-1].WhichOneof("event") == "finished"
        assert _calls(prefill + decode, "b") == [("p0", False), ("d0", True)]
    finally:
        await close_fleet(fleet)


async def test_no_decode_engine_is_unavailable() -> None:
    fleet, _, _, _ = await _fleet(2, 0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("a", [*PREFIX, 1]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await close_fleet(fleet)


async def test_a_dead_prefill_engine_is_retried_on_another() -> None:
    fleet, prefill, decode, sessions = await _fleet(
        2, 1, health={"poll_interval_s": 60, "load_poll_interval_s": 60}
    )
    try:
        await _generate(fleet, generate_request("a", [*PREFIX, 1]))
        (holder, _), _ = _calls(prefill + decode, "a")
        await _prefix_indexed(fleet)
        dead = next(e for e in prefill if e.servicer.name == holder)
        await dead.server.stop(None)  # the controller still believes it is ready
        reply = await _generate(fleet, generate_request("b", [*PREFIX, 2]))
        assert reply[-1].WhichOneof("event") == "finished"
        calls = _calls(prefill + decode, "b")
        assert [name for name, _ in calls] == [
            next(e.servicer.name for e in prefill if e is not dead),
            "d0",
        ]
        assert fleet.app.controller.metrics.retries._value.get() == 1
        # "a"'s two hops; "b"'s prefill, its retry on the other prefill engine, its decode.
        assert _hops(fleet) == {"prefill": 3, "decode": 2}
        assert sessions.open == {}
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


async def test_vllm_generate_cannot_hand_over_and_says_so() -> None:
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    fleet, _, _, _ = await _fleet(1, 1)
    try:
        stub = vpb_grpc.GenerateStub(fleet.channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(
                vpb.GenerateRequest(
                    request_id="v",
                    model="sim",
                    token_ids=vpb.TokenIds(ids=PREFIX),
                    stopping=vpb.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
                )
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "prefill and decode engines" in (info.value.details() or "")
    finally:
        await close_fleet(fleet)


# How a decode engine refuses a KV session it cannot find: the status NOT_FOUND before
# acceptance, or in-band (accepted, then one EngineError(KV_SESSION_NOT_FOUND)).
REFUSAL_FORMS = ["status", "in_band"]


def _refuse(sessions: Sessions, form: str) -> None:
    """Decode engines refuse an unknown session in `form`: a REFUSAL_FORMS name;
    "in_band_transfer" (in-band KV_TRANSFER_FAILED, not retryable: the status form
    FAILED_PRECONDITION of a session a decode engine cannot use); or a failed pull another
    engine may not fail, in either form: "in_band_transfer_retryable" (in-band
    KV_TRANSFER_FAILED, retryable) or "unavailable" (its status form, UNAVAILABLE)."""
    sessions.in_band_refusal = {
        "status": None,
        "in_band": pb.ERROR_CODE_KV_SESSION_NOT_FOUND,
        "in_band_transfer": pb.ERROR_CODE_KV_TRANSFER_FAILED,
        "in_band_transfer_retryable": pb.ERROR_CODE_KV_TRANSFER_FAILED,
        "unavailable": None,
    }[form]
    sessions.retryable_refusal = form == "in_band_transfer_retryable"
    if form == "unavailable":
        sessions.refusal_status = grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("form", REFUSAL_FORMS)
async def test_a_decode_failure_after_prompt_output_is_one_terminal_engine_error(form: str) -> None:
    """The client has the prefill's prompt logprobs: the decode engine refusing the session
    ends the stream with one EngineError, not a status (WIRE.md section 3): the gateway's,
    retryable (the session failed, not the request), whichever form the refusal took. An
    in-band refusal used to reach the client as it was, KV_SESSION_NOT_FOUND for a session
    the client never named."""
    fleet, _, _, sessions = await _fleet(1, 1)
    try:
        sessions.lost = True
        _refuse(sessions, form)
        request = generate_request("r", [*PREFIX, 1])
        request.response.return_prompt_logprobs = True
        reply = await _generate(fleet, request)
        assert [r.WhichOneof("event") for r in reply] == ["prompt", "error"]
        error = reply[-1].error
        assert (error.code, error.retryable) == (pb.ERROR_CODE_INTERNAL, True)
        assert "refused the KV session" in error.message
        assert "no KV session" in error.message
        assert not fleet.app.gateway.relay.holding
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


async def test_a_decode_engine_cordoned_during_the_prefill_gets_no_decode() -> None:
    fleet, prefill, decode, sessions = await _fleet(1, 2)
    try:
        registry = fleet.app.controller.fleet.registry
        # The least loaded decode engine at the handoff would be either; cordon d0 then.
        sessions.on_open = lambda: registry.set_cordoned(fleet.address(decode[0]), True)
        reply = await _generate(fleet, generate_request("r", [*PREFIX, 1]))
        assert reply[-1].WhichOneof("event") == "finished"
        assert [name for name, _ in _calls(prefill + decode, "r")] == ["p0", "d1"]
    finally:
        await close_fleet(fleet)


async def test_no_prefill_engine_up_is_unavailable_by_default() -> None:
    """Decode engines that only take a KV session are never sent a request without one."""
    fleet, prefill, decode, _ = await _fleet(1, 1)
    try:
        fleet.app.controller.fleet.registry.set_cordoned(fleet.address(prefill[0]), True)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("r", [*PREFIX, 1]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no prefill engine" in (info.value.details() or "")
        assert _calls(prefill + decode, "r") == []
    finally:
        await close_fleet(fleet)


def _outcomes(fleet: EngineFleet[Any]) -> dict[str, float]:
    requests = fleet.app.controller.metrics.requests
    outcomes = ("ok", "no_engine", "engine_error", "invalid")
    counts = {o: requests.labels(o)._value.get() for o in outcomes}
    return {o: n for o, n in counts.items() if n}


def _hops(fleet: EngineFleet[Any]) -> dict[str, float]:
    """`route_decisions_total` summed by its `hop` label (retries and runs again included)."""
    counts: dict[str, float] = {}
    for family in fleet.app.controller.metrics.decisions.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                hop = sample.labels["hop"]
                counts[hop] = counts.get(hop, 0) + sample.value
    return counts


async def test_an_abort_during_the_prefill_ends_the_request_once() -> None:
    """The aborted prefill engine ends the request with finished(CANCELLED): the client gets
    that one terminal event, no decode engine is called, and it counts as any aborted
    request does."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        prefill[0].servicer.prefill_gate = asyncio.Event()  # never set: the prefill waits
        running = asyncio.ensure_future(_generate(fleet, generate_request("r", [*PREFIX, 1])))

        async def prefilling() -> bool:
            return bool(prefill[0].servicer.prefilling)

        await eventually(prefilling)
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        events = await running
        assert [r.WhichOneof("event") for r in events] == ["finished"]
        assert events[0].finished.reason == pb.FINISH_REASON_CANCELLED
        assert _calls(prefill + decode, "r") == [("p0", False)]
        assert _outcomes(fleet) == {"ok": 1}
        assert sessions.open == {}
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("target", ["request_id", "all_requests"])
async def test_an_abort_at_the_handoff_ends_the_request_without_a_decode(target: str) -> None:
    """Aborted once the prefill engine handed the request over (its PrefillReady came, its
    stream still open): that engine finished its part and would answer ALREADY_FINISHED, so
    the gateway ends the request itself. The Abort says ABORTED, no decode engine is called,
    the client gets each output finished CANCELLED (the last with the prefill's Usage), as
    an engine ends an aborted request, and the session is released."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        gate = prefill[0].servicer.handover_gate = asyncio.Event()
        request = generate_request("r", [*PREFIX, 1])
        request.sampling.num_sequences = 2
        running = asyncio.ensure_future(_generate(fleet, request))
        inflight = fleet.app.controller.router.inflight

        def handed_over() -> bool:  # the gateway read its PrefillReady: the prefill is over
            load = inflight.of(fleet.address(prefill[0]))
            return load.requests == 1 and load.prefilling == 0

        await eventually(handed_over)
        # What the prefill engine itself answers now.
        async with grpc.aio.insecure_channel(fleet.address(prefill[0])) as channel:
            direct = pb_grpc.OpenEngineStub(channel)
            itself = await direct.Abort(pb.AbortRequest(request_id="r"))
        assert itself.status == pb.ABORT_STATUS_ALREADY_FINISHED
        abort = (
            pb.AbortRequest(request_id="r")
            if target == "request_id"
            else pb.AbortRequest(all_requests=pb.AllRequests())
        )
        reply = await fleet.gateway.Abort(abort)
        assert reply.status == pb.ABORT_STATUS_ABORTED
        gate.set()
        events = await running
        assert [r.WhichOneof("event") for r in events] == ["finished", "finished"]
        assert [r.finished.output_index for r in events] == [0, 1]
        assert {r.finished.reason for r in events} == {pb.FINISH_REASON_CANCELLED}
        assert not events[0].HasField("usage")
        assert events[1].usage.prompt_tokens == len(PREFIX) + 1
        assert events[1].usage.completion_tokens == 0
        assert _calls(prefill + decode, "r") == [("p0", False)]
        assert fleet.app.controller.metrics.requests.labels("aborted")._value.get() == 1

        async def released() -> bool:
            return sessions.open == {}

        await eventually(released)
        again = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
        assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


async def test_an_abort_before_the_decode_engine_accepted_ends_the_request_in_band() -> None:
    """The decode engine has the call but has not accepted it (its Abort: NOT_FOUND), and the
    client already has the prefill's prompt logprobs: the gateway cancels the call and ends
    the stream as an engine ends an aborted request (a status would follow output, and the
    Abort said NOT_FOUND), and releases the session."""
    fleet, _, decode, sessions = await _fleet(1, 1)
    try:
        decode[0].servicer.decode_gate = asyncio.Event()  # never set: not accepted
        request = generate_request("r", [*PREFIX, 1])
        request.response.return_prompt_logprobs = True
        running = asyncio.ensure_future(_generate(fleet, request))

        def at_the_decode_engine() -> bool:
            return ("r", True) in decode[0].servicer.generated

        await eventually(at_the_decode_engine)
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        events = await running
        assert [r.WhichOneof("event") for r in events] == ["prompt", "finished"]
        assert events[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        assert events[-1].usage.prompt_tokens == len(PREFIX) + 1
        assert fleet.app.controller.metrics.requests.labels("aborted")._value.get() == 1

        async def released() -> bool:
            return sessions.open == {}

        await eventually(released)
    finally:
        await close_fleet(fleet)


async def test_with_rejection_a_request_is_refused_while_every_prefill_engine_is_busy() -> None:
    """`router.reject_when_all_busy`: the only prefill engine holds a prefill the router sent
    (one queued request: busy here), so the next request is refused before either hop,
    RESOURCE_EXHAUSTED naming the prefill engines, and leaves nothing behind; once the
    prefill is through, it is served. (All decode engines busy: tests/controller/
    test_router.py, the same rule.)"""
    router = {"reject_when_all_busy": True, "busy_queued_requests": 1}
    fleet, prefill, decode, _ = await _fleet(1, 1, router=router)
    try:
        prefill[0].servicer.prefill_gate = gate = asyncio.Event()
        running = asyncio.ensure_future(_generate(fleet, generate_request("a", [*PREFIX, 1])))

        async def prefilling() -> bool:
            return bool(prefill[0].servicer.prefilling)

        await eventually(prefilling)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("b", [*PREFIX, 2]))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == (
            "every prefill engine is busy (KV usage >= 97% or queued requests >= 1): retry later"
        )
        assert _calls(prefill + decode, "b") == []
        controller = fleet.app.controller
        assert controller.metrics.requests.labels("overloaded")._value.get() == 1
        assert _hops(fleet) == {"prefill": 1, "none": 1}  # "a"'s prefill, "b" refused
        assert controller.router.inflight.engine_of("b") is None
        gate.set()
        assert (await running)[-1].WhichOneof("event") == "finished"
        reply = await _generate(fleet, generate_request("b", [*PREFIX, 2]))
        assert reply[-1].WhichOneof("event") == "finished"
        assert [c for c, _ in _calls(prefill + decode, "b")] == ["p0", "d0"]
        assert len(controller.router.inflight) == 0 and not fleet.app.gateway.relay.running
    finally:
        await close_fleet(fleet)


async def test_abort_of_a_kv_session_fans_out_to_the_engine_holding_it() -> None:
    """Abort(kv_session) through the gateway: the engine holding the session frees it
    (ABORTED, its outcome "ok"; the others' NOT_FOUND in the trailing outcomes), and once no
    engine has it, NOT_FOUND, as an engine answers an unknown session."""
    fleet, prefill, _, sessions = await _fleet(1, 1)
    try:
        # A session a client opened on the prefill engine itself, which no decode took.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill[0].port}") as direct:
            stub = pb_grpc.OpenEngineStub(direct)
            reply = [r async for r in stub.Generate(generate_request("own", [*PREFIX, 1]))]
        session = reply[-1].prefill_ready.kv_session
        assert sessions.open == {session.session_id: "p0"}
        abort = pb.AbortRequest(kv_session=session)
        call = fleet.gateway.Abort(abort)
        assert (await call).status == pb.ABORT_STATUS_ABORTED
        reported = {
            e["instance_id"]: e["outcome"] for e in read_outcomes(await call.trailing_metadata())
        }
        assert reported == {"p0-inner": "ok", "d0-inner": "NOT_FOUND"}
        assert sessions.open == {}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(abort)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await close_fleet(fleet)


async def test_a_session_no_decode_engine_took_is_released_on_the_prefill_engine() -> None:
    """The only decode engine is cordoned once the prefill engine opened the session: the
    client gets UNAVAILABLE, and the gateway frees the session (Abort(kv_session))."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        registry = fleet.app.controller.fleet.registry

        def cordon_the_decode_engine() -> None:
            registry.set_cordoned(f"127.0.0.1:{decode[0].port}", True)

        sessions.on_open = cordon_the_decode_engine
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("r", [*PREFIX, 1]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _calls(prefill + decode, "r") == [("p0", False)]

        async def released() -> bool:
            return sessions.open == {}

        await eventually(released)
    finally:
        await close_fleet(fleet)


async def test_a_decode_engine_refusing_the_session_is_an_engine_failure() -> None:
    """Not the client's NOT_FOUND for a session it never named: a session a decode engine
    cannot use (in-band KV_TRANSFER_FAILED, not retryable: FAILED_PRECONDITION) is not asked
    about on the prefill engine, another decode engine is tried with it, then the request is
    UNAVAILABLE, counted as an engine error. (It used to end the request at the first decode
    engine, its in-band error passed to the client.)"""
    fleet, prefill, decode, sessions = await _fleet(1, 2)
    try:
        sessions.lost = True
        _refuse(sessions, "in_band_transfer")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("r", [*PREFIX, 1]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "refused the KV session" in (info.value.details() or "")
        assert _calls(prefill, "r") == [("p0", False)]
        assert sorted(_calls(decode, "r")) == [("d0", True), ("d1", True)]
        assert _outcomes(fleet) == {"engine_error": 1}
        assert fleet.app.controller.metrics.retries._value.get() == 1
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", ["unavailable", "in_band_transfer_retryable"])
async def test_a_failed_pull_on_every_decode_engine_is_unavailable_in_either_form(
    form: str,
) -> None:
    """Both decode engines fail to pull the session, a failure another engine may not have:
    the status UNAVAILABLE before acceptance, or its in-band form, KV_TRANSFER_FAILED
    retryable. Retried once on the other decode engine, the request then ends alike: the
    client gets UNAVAILABLE naming the last decode engine, as for any spent retry of a
    status. In-band, the client used to get the engine's KV_TRANSFER_FAILED, for a session
    it never named (other in-band refusals, of its own request, still pass as they came)."""
    fleet, _, decode, sessions = await _fleet(1, 2)
    try:
        sessions.lost = True
        _refuse(sessions, form)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("r", [*PREFIX, 1]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        last = re.fullmatch(
            r"engine (\S+) failed the request: UNAVAILABLE: no KV session 'p0-0'",
            info.value.details() or "",
        )
        assert last is not None, info.value.details()
        assert last[1] in {fleet.address(d) for d in decode}
        assert sorted(_calls(decode, "r")) == [("d0", True), ("d1", True)]
        assert _outcomes(fleet) == {"engine_error": 1}
        assert fleet.app.controller.metrics.retries._value.get() == 1
        assert _hops(fleet) == {"prefill": 1, "decode": 2}  # the decode hop and its retry
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
@pytest.mark.parametrize("name", ["p0r", "p0"])
async def test_a_session_lost_with_its_restarted_prefill_engine_runs_the_request_again(
    form: str, name: str
) -> None:
    """The prefill engine restarts at its address after handing the session over, and the
    decode engine finds no session (status or in-band): the new process answers, but the
    session went with the old one, so the request runs again as a whole, once, as for a dead
    prefill engine, here on the new process (it is up), and the client gets its tokens.
    Under a new instance id (`name` p0r) GetEngineInfo tells the new process; under the old
    one (p0, as one with `instance_id` in its config restarts) nothing the seed's engines
    answer does (no start time or incarnation), and its answer NOT_FOUND to the session's
    release tells it. Either used to try the other decode engine with the dead session,
    then fail UNAVAILABLE."""
    fleet, prefill, decode, sessions = await _fleet(1, 2)
    try:
        _refuse(sessions, form)
        gate = asyncio.Event()
        for engine in decode:
            engine.servicer.decode_gate = gate
        running = asyncio.ensure_future(_generate(fleet, generate_request("r", [*PREFIX, 1])))

        async def at_a_decode_engine() -> bool:
            return bool(_calls(decode, "r"))

        await eventually(at_a_decode_engine)
        address = fleet.address(prefill[0])
        fleet.engines[0] = restarted = await restart_role_engine(prefill[0], name)
        await eventually(lambda: fleet.answers_as(address, f"{name}-inner"))
        gate.set()
        reply = await running
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert prefill[0].servicer.generated == [("r", False)]
        assert restarted.servicer.generated == [("r", False)]  # the run again's prefill
        assert [session for _, session in _calls(decode, "r")] == [True, True]
        assert _outcomes(fleet) == {"ok": 1}
        assert fleet.app.controller.metrics.retries._value.get() == 1
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
async def test_a_session_lost_with_its_prefill_engine_runs_the_request_again(form: str) -> None:
    """The prefill engine stops after handing the session over, and the decode engine finds
    no session (status or in-band): the prefill engine does not answer, so the request runs
    again as a whole, once, without it (here on the decode engine prefilling the prompt
    itself), and the client gets its tokens. In-band, it used to get the decode engine's
    KV_SESSION_NOT_FOUND."""
    fleet, prefill, decode, sessions = await _fleet(
        1, 1, accept_local_prefill=True, router={"skip_prefill_ratio": 0.9}
    )
    try:
        sessions.lost = True
        _refuse(sessions, form)
        gate = decode[0].servicer.decode_gate = asyncio.Event()
        running = asyncio.ensure_future(_generate(fleet, generate_request("r", [*PREFIX, 1])))

        async def at_the_decode_engine() -> bool:
            return ("r", True) in decode[0].servicer.generated

        await eventually(at_the_decode_engine)
        await prefill[0].server.stop(None)
        gate.set()
        reply = await running
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert _calls(prefill + decode, "r") == [("p0", False), ("d0", True), ("d0", False)]
        assert _outcomes(fleet) == {"ok": 1}
        # The run again's first hop: the decode engine prefilling the prompt itself.
        assert _hops(fleet) == {"prefill": 1, "decode": 1, "decode_prefill": 1}
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
async def test_a_session_its_prefill_engine_ended_runs_the_request_again(form: str) -> None:
    """The prefill engine ended the session before the decode engine came (its TTL): the
    decode engine finds none (status or in-band), and the prefill engine, asked to release
    it, says it ended it already (ALREADY_FINISHED) and does not drain. The request runs
    again as a whole, once, on that prefill engine too, and the client gets its tokens. It
    used to end finished CANCELLED (status), or with KV_SESSION_NOT_FOUND (in-band)."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        _refuse(sessions, form)
        sessions.ended_at_once = True  # the first session only:
        sessions.on_open = lambda: setattr(sessions, "ended_at_once", False)
        reply = await _generate(fleet, generate_request("r", [*PREFIX, 1], max_tokens=5))
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token.tokens) for r in reply if r.HasField("token")) == 5
        # Each engine's calls in order: twice the prefill, twice the decode with a session.
        expected = [("p0", False), ("p0", False), ("d0", True), ("d0", True)]
        assert _calls(prefill + decode, "r") == expected
        assert _outcomes(fleet) == {"ok": 1}
        assert sessions.open == {}
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
async def test_a_session_its_prefill_engine_ended_again_fails_the_request_unavailable(
    form: str,
) -> None:
    """As above, but the prefill engine ends the session of the run again too (its TTL, not
    a drain): the run again was the one allowed, so the client gets UNAVAILABLE naming the
    lost KV session (sent again, the request may succeed), counted as an engine's failure,
    not as aborted. It used to end at that handoff, each output finished CANCELLED (the
    word for a drain or a client's abort)."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        _refuse(sessions, form)
        sessions.ended_at_once = True  # every session
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("r", [*PREFIX, 1], max_tokens=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details() or ""
        assert "had ended it before a decode engine took it" in details
        assert "KV session was lost twice" in details
        expected = [("p0", False), ("p0", False), ("d0", True), ("d0", True)]
        assert _calls(prefill + decode, "r") == expected
        assert _outcomes(fleet) == {"engine_error": 1}
        assert fleet.app.controller.metrics.requests.labels("aborted")._value.get() == 0
    finally:
        await close_fleet(fleet)


async def test_a_session_ended_again_after_prompt_output_is_one_retryable_error() -> None:
    """As above, the client having the prompt's logprobs from the prefill hop: the stream
    ends with one retryable EngineError naming the lost KV session, not finished
    CANCELLED."""
    fleet, _, _, sessions = await _fleet(1, 1)
    try:
        _refuse(sessions, "status")
        sessions.ended_at_once = True
        request = generate_request("r", [*PREFIX, 1])
        request.response.return_prompt_logprobs = True
        reply = await _generate(fleet, request)
        assert [r.WhichOneof("event") for r in reply] == ["prompt", "error"]
        error = reply[-1].error
        assert error.retryable
        assert "KV session was lost twice" in error.message
        assert _outcomes(fleet) == {"engine_error": 1}
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
async def test_an_abort_while_a_lost_session_is_looked_into_ends_the_request(form: str) -> None:
    """As above (its TTL ended the session), but the client aborts the request while the
    gateway asks the prefill engine about the session: the Abort is ABORTED and the request
    ends as an engine ends one aborted before its prefill (status OK, its output finished
    CANCELLED with the prompt's usage), run again nowhere, counted once, "aborted". In-band,
    the decode engine had ended the request with its refusal yet still held it for the
    gateway: the Abort went there, which knew nothing of it (NOT_FOUND; an engine that
    remembers it: ALREADY_FINISHED), and the request ran again, to its last token."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        _refuse(sessions, form)
        sessions.ended_at_once = True
        gate = sessions.release_gate = asyncio.Event()
        request = generate_request("r", [*PREFIX, 1])
        running = asyncio.ensure_future(_generate(fleet, request))
        await eventually(lambda: bool(sessions.releases))
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        gate.set()
        assert await running == await ended_while_queued(request)
        assert _calls(prefill + decode, "r") == [("p0", False), ("d0", True)]
        assert fleet.app.controller.metrics.requests.labels("aborted")._value.get() == 1
        assert _outcomes(fleet) == {}  # not "ok" as well
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
async def test_a_session_its_draining_prefill_engine_ended_ends_the_request(form: str) -> None:
    """As above, but the prefill engine drains (its drain's deadline ended the session): the
    request ends at the handoff, finished CANCELLED, as one its engine's drain aborted; no
    run again. In-band, it used to end with KV_SESSION_NOT_FOUND."""
    fleet, prefill, decode, sessions = await _fleet(1, 1)
    try:
        _refuse(sessions, form)
        sessions.ended_at_once = True
        gate = decode[0].servicer.decode_gate = asyncio.Event()
        running = asyncio.ensure_future(_generate(fleet, generate_request("r", [*PREFIX, 1])))

        async def at_the_decode_engine() -> bool:
            return ("r", True) in decode[0].servicer.generated

        await eventually(at_the_decode_engine)
        drain = pb.DrainRequest(stop_accepting_new_requests=True)
        [_ async for _ in prefill[0].servicer.inner.Drain(drain)]
        gate.set()
        reply = await running
        assert [r.WhichOneof("event") for r in reply] == ["finished"]
        assert reply[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        assert _calls(prefill + decode, "r") == [("p0", False), ("d0", True)]
        assert fleet.app.controller.metrics.requests.labels("aborted")._value.get() == 1
    finally:
        await close_fleet(fleet)


# What the decode engine that refuses a session NOT_FOUND did with it (`Sessions`): left it
# open on its prefill engine, which a release frees (ABORTED), or took it, after which its
# prefill engine knows it no more (its release: NOT_FOUND).
REFUSED_SESSIONS = ["open", "taken"]


@pytest.mark.parametrize("form", REFUSAL_FORMS)
@pytest.mark.parametrize("held", REFUSED_SESSIONS)
async def test_a_session_gone_when_asked_about_runs_the_request_again(form: str, held: str) -> None:
    """The first decode engine refuses the session NOT_FOUND (status or in-band), whether it
    left it open on its prefill engine (a NOT_FOUND about something else: a model that
    engine no longer serves), which frees it when asked whether it had ended (ABORTED), or
    took it before failing, its prefill engine answering NOT_FOUND. Either way no decode
    engine can take it: the request runs again as a whole, once, and the client gets its
    tokens. The gateway used to hand the dead session to the other decode engine, which
    found none: the client got UNAVAILABLE."""
    fleet, prefill, decode, sessions = await _fleet(1, 2)
    try:
        _refuse(sessions, form)
        setattr(sessions, f"refuse_{held}", 1)
        reply = await _generate(fleet, generate_request("r", [*PREFIX, 1], max_tokens=5))
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token.tokens) for r in reply if r.HasField("token")) == 5
        assert _calls(prefill, "r") == [("p0", False), ("p0", False)]
        assert [session for _, session in _calls(decode, "r")] == [True, True]
        assert sessions.releases == ["p0-0"]  # the first session, asked about once
        assert sessions.open == {}
        assert _outcomes(fleet) == {"ok": 1}
        assert fleet.app.controller.metrics.retries._value.get() == 1
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("form", REFUSAL_FORMS)
@pytest.mark.parametrize("held", REFUSED_SESSIONS)
async def test_a_session_gone_when_asked_about_in_the_run_again_fails_the_request(
    form: str, held: str
) -> None:
    """As above, but a decode engine refuses the run again's session so too: gone when
    asked about, it goes to no other decode engine; the client gets the gateway's
    UNAVAILABLE naming the refusing engine and the lost KV session (sent again, the request
    may succeed), counted as an engine error. The run again used to hand the freed session
    to the other decode engine."""
    fleet, prefill, decode, sessions = await _fleet(1, 2)
    try:
        _refuse(sessions, form)
        setattr(sessions, f"refuse_{held}", 2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(fleet, generate_request("r", [*PREFIX, 1]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details() or ""
        assert "refused the KV session" in details
        assert "KV session was lost twice" in details
        assert _calls(prefill, "r") == [("p0", False), ("p0", False)]
        assert [session for _, session in _calls(decode, "r")] == [True, True]
        assert sessions.releases == ["p0-0", "p0-1"]
        assert sessions.open == {}
        assert _outcomes(fleet) == {"engine_error": 1}
    finally:
        await close_fleet(fleet)


async def test_a_session_whose_release_failed_runs_the_request_again_elsewhere() -> None:
    """As above (the first decode engine refuses an open session NOT_FOUND), but the prefill
    engine's answer to the session's release is lost (UNAVAILABLE, the session freed): the
    gateway cannot tell whether the session is still there, so it goes to no other decode
    engine; the request runs again as a whole, once, without that prefill engine (it did
    not answer), and the client gets its tokens. The gateway used to hand the session to
    the other decode engine, which found none: the client got UNAVAILABLE."""
    fleet, prefill, decode, sessions = await _fleet(2, 2)
    try:
        sessions.refuse_open = 1
        sessions.release_answer_lost = True
        reply = await _generate(fleet, generate_request("r", [*PREFIX, 1], max_tokens=5))
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason == pb.FINISH_REASON_LENGTH
        prefills = [engine for engine, _ in _calls(prefill, "r")]
        assert len(prefills) == 2 and prefills[0] != prefills[1]
        assert [session for _, session in _calls(decode, "r")] == [True, True]
        assert sessions.open == {}
        assert _outcomes(fleet) == {"ok": 1}
    finally:
        await close_fleet(fleet)


async def test_a_session_whose_release_hangs_runs_the_request_again_elsewhere() -> None:
    """As above, but the prefill engine never answers the session's release: the gateway
    gives up on it after `health.rpc_timeout_s` (as for its other calls that read nothing)
    and runs the request again elsewhere. The release used to have no deadline: the request
    waited as long as the engine did."""
    fleet, prefill, _, sessions = await _fleet(2, 2, health={"rpc_timeout_s": 0.5})
    sessions.release_gate = asyncio.Event()  # never set before the request ends
    try:
        sessions.refuse_open = 1
        async with asyncio.timeout(20):
            reply = await _generate(fleet, generate_request("r", [*PREFIX, 1], max_tokens=5))
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason == pb.FINISH_REASON_LENGTH
        prefills = [engine for engine, _ in _calls(prefill, "r")]
        assert len(prefills) == 2 and prefills[0] != prefills[1]
        assert _outcomes(fleet) == {"ok": 1}
    finally:
        sessions.release_gate.set()
        await close_fleet(fleet)


async def test_a_prefill_engine_that_never_hands_over_is_ejected() -> None:
    """Its streams end without error, and without the KV session: a fault of its own, which
    counts toward its outlier ejection like a failed call (its health says ready)."""
    fleet, prefill, _, _ = await _fleet(2, 1, health={"eject_after_failures": 2})
    prefill[0].servicer.hands_nothing_over = True
    broken = f"127.0.0.1:{prefill[0].port}"
    try:
        for n in range(200):
            if len(prefill[0].servicer.generated) >= 2:
                break
            try:
                await _generate(fleet, generate_request(f"r{n}", [n + 1000, 5, 5]))
            except grpc.aio.AioRpcError as exc:  # its prefills fail the request
                assert exc.code() == grpc.StatusCode.INTERNAL
                assert exc.details() == (
                    "the prefill engine ended without handing over a KV session"
                )
        record = fleet.app.controller.fleet.registry.get(broken)
        assert record.state.value == "ejected"
        shown = fleet.app.controller.fleet.error_of(record)
        assert "ended without handing over a KV session" in shown
    finally:
        await close_fleet(fleet)
