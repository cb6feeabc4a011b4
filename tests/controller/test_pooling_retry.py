"""Embed, Classify and Score through the gateway when the engine it picks fails: two torch
pooling engines (a classifier without an LM head: all three tasks) behind a controller whose
polls are slow, so a stopped engine still looks routable. A task failing with a retryable
status (here UNAVAILABLE: the engine cannot be reached) is retried once on the other engine,
as a Generate failing before its first response is, and counted as a retry; with no engine
left to try, the client gets the engine's own status, naming the engine as a Generate's
failure does. A request the engine refuses for itself (INVALID_ARGUMENT) is not retried, and
its refusal passes as the engine gave it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.server.service import start_engine
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import Fleet, close_fleet, make_fleet
from tests.controller.test_gateway import engine_answer
from tests.engine.test_server_pooling import LABELS
from tests.engine.test_server_pooling_runner import write_headless_classifier

pytestmark = pytest.mark.timeout(120)

MODEL = "pooler"
ITEM = pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))


@pytest.fixture
async def pooling_fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    headless = str(write_headless_classifier(tmp_path))
    engines = [
        await start_engine(
            EngineConfig(
                model=headless,
                served_model_name=MODEL,
                listen="127.0.0.1:0",
                instance_id=name,
                num_threads=1,
                shutdown_grace_s=0.5,
            )
        )
        for name in ("p0", "p1")
    ]
    # Slow polls: the controller still believes a stopped engine is ready.
    fleet = await make_fleet(
        engines=engines, health={"poll_interval_s": 60, "load_poll_interval_s": 60}
    )
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


def retries(fleet: Fleet) -> float:
    return float(fleet.app.controller.metrics.retries._value.get())


async def run_task(fleet: Fleet, task: str, request_id: str) -> object:
    task_context = pb.TaskRequestContext(request_id=request_id, model=MODEL)
    gateway = fleet.gateway
    if task == "embed":
        reply = await gateway.Embed(pb.EmbedRequest(context=task_context, inputs=[ITEM]))
        return [o.item_id for o in reply.outputs]
    if task == "classify":
        classified = await gateway.Classify(pb.ClassifyRequest(context=task_context, inputs=[ITEM]))
        return list(classified.outputs[0].labels)
    query = pb.TaskInput(item_id="q", token_ids=pb.TokenIds(ids=[5, 6]))
    group = pb.ScoreGroup(group_id="g", query=query, candidates=[ITEM])
    scored = await gateway.Score(pb.ScoreRequest(context=task_context, groups=[group]))
    return [g.group_id for g in scored.groups]


async def ran(address: str, request_id: str) -> bool:
    """Whether the engine at `address` itself ran the request: its Abort of the id says it
    ended, rather than NOT_FOUND."""
    answer = await engine_answer(address, "Abort", pb.AbortRequest(request_id=request_id))
    if isinstance(answer, pb.AbortResponse):
        return answer.status == pb.ABORT_STATUS_ALREADY_FINISHED
    assert answer == grpc.StatusCode.NOT_FOUND
    return False


async def test_a_task_the_picked_engine_fails_is_retried_on_the_other(
    pooling_fleet: Fleet,
) -> None:
    fleet = pooling_fleet
    # A request refused for itself is the client's answer at once: no retry.
    bad = pb.EmbedRequest(
        context=pb.TaskRequestContext(request_id="bad", model=MODEL),
        inputs=[pb.TaskInput(item_id="a")],
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fleet.gateway.Embed(bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with grpc.aio.insecure_channel(fleet.address(fleet.engines[0])) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as direct:
            await pb_grpc.OpenEngineStub(channel).Embed(bad)
    assert refused.value.details() == direct.value.details()
    assert retries(fleet) == 0
    # Both idle, the gateway picks the same engine each time: the one that ran "first"
    # (it alone knows the id). Stopped, it fails every task sent to it (UNAVAILABLE).
    assert await run_task(fleet, "embed", "first") == ["a"]
    (picked,) = [e for e in fleet.engines if await ran(fleet.address(e), "first")]
    await picked.server.stop(None)
    assert fleet.app.controller.fleet.registry.get(fleet.address(picked)).routable
    assert await run_task(fleet, "embed", "e") == ["a"]
    assert await run_task(fleet, "classify", "c") == LABELS
    assert await run_task(fleet, "score", "s") == ["g"]
    assert retries(fleet) == 3
    # Abort of a retried task's id: it ended (on the engine that served it).
    reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="e"))
    assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
    (other,) = [e for e in fleet.engines if e is not picked]
    assert await ran(fleet.address(other), "e")


async def test_with_no_engine_left_to_try_the_client_gets_the_engines_status(
    pooling_fleet: Fleet,
) -> None:
    """Retried once, not once per engine: the second engine's failure is the answer, naming
    it (the engine's bare words, "failed to connect", would read as the controller's)."""
    fleet = pooling_fleet
    for engine in fleet.engines:
        await engine.server.stop(None)
    for n, task in enumerate(("embed", "classify", "score")):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await run_task(fleet, task, f"t{n}")
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, task
        details = failed.value.details() or ""
        named = details.removeprefix("engine ").split(" ", 1)[0]
        assert named in {fleet.address(e) for e in fleet.engines}, details
        assert details.startswith(f"engine {named} failed the request: UNAVAILABLE: "), details
        assert retries(fleet) == n + 1
