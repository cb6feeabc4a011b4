"""Engines that answer nonsense, through real servers: a scripted OpenEngine server in front
of a sim engine, next to plain sim engines, behind a real controller. What an engine says
must never break what the controller answers of the whole fleet, nor keep an engine in
routing that did not say it is ready in words this controller reads, nor stop following its
KV events for good.

- GetLoad figures at the top of their wire type (2^32 - 1 requests, 2^64 - 1 blocks), used
  blocks past the total: the engine is listed as it says, never chosen over sane engines, and
  the gateway's own GetLoad (a parent controller polls it) still answers, its sums capped at
  what the wire holds (it failed with UNKNOWN: "Value out of range").
- A Health state this build does not know: NOT_READY with "unknown health state N" (it was
  FAILING with "poll failed: N" and a traceback at every poll); an inference probe answered
  so, or a Generate error with an unknown code, are reported with the number (both failed
  the gateway's call with ValueError).
- A KV-event batch numbered 2^64 - 1 and a broken stream: the source starts over from a
  snapshot (it could not build the resubscription, start 2^64, and retried that forever).
"""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine
from tests.controller.test_admin_cli_membership import cli_json
from tests.controller.test_complete_cli import complete
from tests.controller.test_failing_engines import wait_state, worker
from tests.controller.test_fleet_health import routed
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
WAIT_S = 15.0
MAX_UINT32 = (1 << 32) - 1
MAX_UINT64 = (1 << 64) - 1
UNKNOWN_STATE = 77
UNKNOWN_CODE = 99


class Scripted(Forwarding):
    """The sim engine's answers, but for those a test scripts: `instance_id` (GetEngineInfo's),
    `block_size` (GetModelInfo's), `load` (GetLoad; `load_instances`: the instance id of
    each answer), `health` (Health), `generate_error`
    (Generate's only event), `last_batch` (SubscribeKvEvents: that one batch, then the
    stream ends; each subscription's start is kept in `subscriptions`)."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.instance_id: str | None = None
        self.block_size: int | None = None
        self.load: pb.LoadInfo | None = None
        self.load_instances: Iterator[str] | None = None
        self.health: pb.HealthResponse | None = None
        self.generate_error: pb.EngineError | None = None
        self.last_batch: pb.KvEventBatch | None = None
        self.subscriptions: list[int] = []

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        info = await self.inner.GetEngineInfo(request)
        if self.instance_id is not None:
            info.instance_id = self.instance_id
        return info

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await self.inner.GetModelInfo(request)
        if self.block_size is not None:
            info.kv_block_size = self.block_size
        return info

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        load = self.load or await self.inner.GetLoad(request)
        if self.load_instances is not None:
            load.instance_id = next(self.load_instances)
        return load

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        return self.health or await self.inner.Health(request)

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.generate_error is not None:
            yield pb.GenerateResponse(error=self.generate_error)
            return
        async for response in self.inner.Generate(request):
            yield response

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        self.subscriptions.append(request.start_sequence_number)
        if self.last_batch is None:
            async for reply in self.inner.SubscribeKvEvents(request):
                yield reply
            return
        yield pb.SubscribeKvEventsResponse(batch=self.last_batch)


def free_port_after(port: int) -> int:
    """A free port on 127.0.0.1 whose address sorts after `port`'s (as many digits, higher)."""
    for candidate in range(port + 1, 10 ** len(str(port))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        return candidate
    raise AssertionError(f"no free port after {port}")


async def scripted_fleet(num_scripted: int, num_sims: int) -> EngineFleet[Any]:
    scripted = [await start_fronted_engine(f"odd{i}", Scripted) for i in range(num_scripted)]
    sims = [await start_sim_engine(f"e{i}") for i in range(num_sims)]
    return await make_fleet(engines=engines_of_kinds(*scripted, *sims))


def scripted_of(fleet: EngineFleet[Any]) -> list[FrontedEngine[Scripted]]:
    return [e for e in fleet.engines if isinstance(e, FrontedEngine)]


async def test_absurd_load_figures_are_listed_never_win_requests_nor_break_the_fleets_load() -> (
    None
):
    fleet = await scripted_fleet(2, 2)
    try:
        odd = scripted_of(fleet)
        absurd = pb.LoadInfo(
            running_requests=MAX_UINT32,
            queued_requests=MAX_UINT32,
            used_kv_blocks=MAX_UINT64,
            total_kv_blocks=1,  # in use: far past the total
            waiting_tokens=MAX_UINT64,
        )
        for engine in odd:
            engine.servicer.load = absurd
        registry = fleet.app.controller.fleet.registry
        addresses = [fleet.address(e) for e in odd]
        await fleet.app.controller.fleet.wait_for(
            lambda: all(registry.get(a).load.used_kv_blocks == MAX_UINT64 for a in addresses),
            WAIT_S,
        )

        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert load.running_requests == MAX_UINT32
        assert load.queued_requests == MAX_UINT32
        assert load.used_kv_blocks == MAX_UINT64
        assert load.waiting_tokens == MAX_UINT64
        assert load.attributes["routable_engines"] == "4"

        row = await worker(fleet, addresses[0])
        assert (row["state"], row["running_requests"]) == ("ready", MAX_UINT32)
        assert row["used_kv_blocks"] == MAX_UINT64

        chosen = await routed(fleet, "absurd", 8)
        assert not set(chosen) & set(addresses), chosen
    finally:
        await close_fleet(fleet)


async def test_a_health_state_this_build_does_not_know_is_not_ready_and_says_so() -> None:
    fleet = await scripted_fleet(1, 1)
    try:
        [odd] = scripted_of(fleet)
        address = fleet.address(odd)
        odd.servicer.health = pb.HealthResponse(state=UNKNOWN_STATE)  # type: ignore[arg-type]
        await wait_state(fleet, address, EngineState.NOT_READY)
        row = await worker(fleet, address)
        assert row["routable"] is False
        assert row["last_error"] == f"unknown health state {UNKNOWN_STATE}"
        assert set(await routed(fleet, "unknown", 3)) == {fleet.address(fleet.engines[1])}
        # `kvplane admin workers` asking the engine itself names the number too.
        [itself] = (await cli_json("workers", "--target", address))["workers"]
        assert itself["state"] == f"healthstate {UNKNOWN_STATE}"

        odd.servicer.health = None  # the sim engine's own answer: ready again
        await wait_state(fleet, address, EngineState.READY)
    finally:
        await close_fleet(fleet)


async def test_enum_values_this_build_does_not_know_are_named_by_their_number(
    tmp_path: Path,
) -> None:
    """The gateway's inference probe names the state the engine sent; a Generate error without
    a message is relayed as the engine sent it, and `kvplane complete` names its code."""
    fleet = await scripted_fleet(1, 0)
    try:
        [odd] = scripted_of(fleet)
        address = fleet.address(odd)
        probe = pb.HealthCheck(name="inference_probe", state=UNKNOWN_STATE)  # type: ignore[arg-type]
        odd.servicer.health = pb.HealthResponse(state=pb.HEALTH_STATE_READY, checks=[probe])
        reply = await fleet.gateway.Health(pb.HealthRequest(include_inference_probe=True))
        checks = {c.name: c for c in reply.checks}
        assert checks["inference_probe"].state == pb.HEALTH_STATE_NOT_READY
        assert checks["inference_probe"].message == f"{address}: HealthState {UNKNOWN_STATE}"

        odd.servicer.generate_error = pb.EngineError(code=UNKNOWN_CODE)  # type: ignore[arg-type]
        request = generate_request("unknown-code", [1] * 40, max_tokens=2)
        replies = [r async for r in fleet.gateway.Generate(request)]
        assert replies[-1].WhichOneof("event") == "error"
        assert replies[-1].error.code == UNKNOWN_CODE  # relayed as the engine sent it
        tokens = tmp_path / "prompt.json"
        tokens.write_text(json.dumps([1] * 40))
        failed = await complete("-t", fleet.target, "--tokens-file", str(tokens))
        assert failed.exit_code == 1
        said = f"the engine failed the request: ErrorCode {UNKNOWN_CODE}: "
        assert str(failed.exception) == said
    finally:
        await close_fleet(fleet)


async def test_a_kv_event_batch_numbered_at_the_end_of_uint64_is_followed_by_a_fresh_snapshot() -> (
    None
):
    """No sequence number follows 2^64 - 1: once the stream ends, the source subscribes from
    0 (a snapshot) and its events are followed again."""
    odd = await start_fronted_engine("odd", Scripted)
    odd.servicer.last_batch = pb.KvEventBatch(sequence_number=MAX_UINT64)
    fleet = await make_fleet(engines=engines_of_kinds(odd))
    try:
        subscriptions = odd.servicer.subscriptions
        await eventually(lambda: len(subscriptions) >= 2, WAIT_S, "a second subscription")
        assert subscriptions[:2] == [0, 0]
        odd.servicer.last_batch = None  # the sim engine's own stream: followed for good

        async def following() -> bool:
            row = await worker(fleet, fleet.address(odd))
            return bool(row["kv_events_state"] == "following")

        await eventually(following, WAIT_S, "its KV events followed")
    finally:
        await close_fleet(fleet)


async def test_an_instance_id_too_long_for_the_route_metadata_is_rejected_not_routed_to() -> None:
    """The gateway names each request's engine in its trailing metadata: an engine whose
    instance id would not fit there is incompatible, saying why (every request it served
    failed at the client with RESOURCE_EXHAUSTED: "received metadata size exceeds hard
    limit")."""
    sim = await start_sim_engine("e0")
    fleet = await make_fleet(engines=engines_of_kinds(sim), health={"backoff_max_s": 0.2})
    odd = await start_fronted_engine("odd", Scripted)
    odd.servicer.instance_id = "x" * 20_000
    try:
        address = fleet.address(odd)
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await wait_state(fleet, address, EngineState.INCOMPATIBLE)
        row = await worker(fleet, address)
        assert row["last_error"].startswith("its instance_id is 20000 bytes long, more than 1024")
        assert row["instance_id"] == address  # not the 20 KB one
        assert set(await routed(fleet, "long", 3)) == {fleet.address(sim)}

        odd.servicer.instance_id = "odd-" + "x" * 1020  # 1024 bytes: taken
        await wait_state(fleet, address, EngineState.READY)
        request = generate_request("taken", [7] * 40, max_tokens=2)
        call = fleet.gateway.Generate(request)
        assert [r.WhichOneof("event") async for r in call][-1] == "finished"
    finally:
        await close_fleet(fleet)
        await odd.close()


async def test_a_block_size_one_engine_in_two_reports_leaves_the_configured_ones_cache_seen() -> (
    None
):
    """Engines that disagree on the KV block size: a prompt is matched in the size most of
    them report, and on a tie in the controller's `default_block_size` (16) when one of them
    reports it. Listed first, an engine claiming 1024-token blocks next to a sim engine of
    16 made every prompt match in 1024: no prompt has a full block, and the sim engine's
    cache was never seen."""
    odd = await start_fronted_engine("odd", Scripted)
    odd.servicer.block_size = 1024
    # The engines are listed by address: the odd one first, the sim engine's port after it.
    sim = await start_sim_engine("e0", port=free_port_after(odd.port))
    fleet = await make_fleet(engines=engines_of_kinds(odd, sim))
    try:
        ids = list(range(1, 41))  # two full blocks of 16
        async with grpc.aio.insecure_channel(fleet.address(sim)) as channel:
            request = generate_request("on-sim", ids, max_tokens=1)
            [_ async for _ in pb_grpc.OpenEngineStub(channel).Generate(request)]
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=ids), model="sim")

        async def seen_on_sim() -> bool:
            reply = await fleet.admin.Match(query)
            held = {m.engine: m.device_blocks for m in reply.matches}
            return reply.num_blocks == 2 and held.get(fleet.address(sim)) == 2

        await eventually(seen_on_sim, WAIT_S, "the sim engine's blocks matched")
    finally:
        await close_fleet(fleet)


async def test_instance_ids_that_alternate_at_one_address_are_rejected_not_restarts() -> None:
    """GetLoad naming A, B, A, ... (two engine processes behind one address, a Kubernetes
    Service say): a process does not come back from before its successor without an outage,
    so this is no restart but an address the controller cannot follow; incompatible, saying
    why. It read as a restart at every GetLoad: the engine's index entries dropped and its
    identity read again each time, and it stayed routable in between."""
    fleet = await scripted_fleet(1, 1)
    try:
        [odd] = scripted_of(fleet)
        address = fleet.address(odd)
        odd.servicer.load_instances = itertools.cycle(["pod-a", "pod-b"])
        await wait_state(fleet, address, EngineState.INCOMPATIBLE)
        row = await worker(fleet, address)
        assert row["last_error"].startswith("GetLoad named instance pod-")
        assert "several engine processes answer at this address" in row["last_error"]
        assert set(await routed(fleet, "alternating", 3)) == {fleet.address(fleet.engines[1])}

        odd.servicer.load_instances = itertools.repeat("pod-a")  # one process again
        await wait_state(fleet, address, EngineState.READY)
    finally:
        await close_fleet(fleet)
