"""An engine serving two models behind the controller, through real servers: each model is
routed as its own GetModelInfo says (the controller asked the first model's only, and took
its tasks, generation and block size for every model's), and an engine whose models disagree
on the KV block size is rejected, in one line, rather than indexed in the wrong size."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import EngineFleet, Fleet, close_fleet, generate_request, make_fleet
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine
from tests.controller.test_fleet_events import WAIT_S
from tests.controller.test_gateway import status_of
from tests.controller.test_gateway_scripted import cli

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]

GENERATOR = "sim"  # the sim engine's own model
EMBEDDER = "embedder"  # the second model, played by the front server: Embed only
EMBED_DIMENSION = 3


class TwoModels(Forwarding):
    """A sim engine that also serves `EMBEDDER`, as the seed has an engine describe each of
    its models: GetEngineInfo lists both (in `order`), GetModelInfo answers per model (the
    embedder: Embed only, no `generation`, blocks of `embedder_block_size`; an unknown model
    NOT_FOUND, from the sim engine), and the sim model says it takes LoRA adapters, the
    embedder that it does not. Embed is answered for the embedder only; the sim model's
    requests are the sim engine's."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.order = (GENERATOR, EMBEDDER)
        self.embedder_block_size = 16
        self.embedded: list[str] = []  # request ids of the Embed calls answered

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        info = await self.inner.GetEngineInfo(request)
        del info.supported_models[:]
        info.supported_models.extend(self.order)
        return info

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        if request.model != EMBEDDER:
            info = await self.inner.GetModelInfo(request)
            info.supports_lora = True
            return info
        embed = pb.EmbedCapabilities(supported=True, dimension=EMBED_DIMENSION)
        return pb.ModelInfo(
            model_id=EMBEDDER,
            served_model_name=EMBEDDER,
            kv_block_size=self.embedder_block_size,
            total_kv_blocks=256,
            supports_token_ids_input=True,
            supports_lora=False,
            tasks=pb.TaskCapabilities(
                embed=embed,
                classify=pb.ClassifyCapabilities(supported=False),
                score=pb.ScoreCapabilities(supported=False),
            ),
        )

    async def ListLoras(self, request: pb.ListLorasRequest, context: Context) -> Any:
        return pb.ListLorasResponse()

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> Any:
        if request.context.model != EMBEDDER:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "embed is unsupported")
        self.embedded.append(request.context.request_id)
        outputs = [
            pb.EmbeddingOutput(
                item_id=item.item_id,
                input_index=index,
                granularity=pb.TASK_OUTPUT_GRANULARITY_SEQUENCE,
                dense=pb.DenseFloatTensor(
                    shape=[EMBED_DIMENSION], values=[float(len(item.token_ids.ids))] * 3
                ),
            )
            for index, item in enumerate(request.inputs)
        ]
        return pb.EmbedResponse(request_id=request.context.request_id, outputs=outputs)


def generate_for(model: str, request_id: str) -> pb.GenerateRequest:
    request = generate_request(request_id, [5, 6, 7])
    request.model = model
    return request


async def two_model_fleet(
    order: tuple[str, str] = (GENERATOR, EMBEDDER), embedder_block_size: int = 16
) -> tuple[EngineFleet[FrontedEngine[TwoModels]], FrontedEngine[TwoModels]]:
    engine = await start_fronted_engine("two", TwoModels, block_size=16)
    engine.servicer.order = order
    engine.servicer.embedder_block_size = embedder_block_size
    fleet = await make_fleet(engines=[engine])
    return fleet, engine


@pytest.fixture(
    params=[(GENERATOR, EMBEDDER), (EMBEDDER, GENERATOR)], ids=["gen-first", "embed-first"]
)
async def two_models(
    request: pytest.FixtureRequest,
) -> AsyncIterator[EngineFleet[FrontedEngine[TwoModels]]]:
    """The engine listing its two models in either order: neither is taken for the other."""
    fleet, _ = await two_model_fleet(request.param)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def test_a_generate_for_either_model_goes_where_that_model_generates(
    two_models: Fleet,
) -> None:
    """A Generate for the generating model reaches the engine (listed second, it was refused
    as pooling-only); one for the embedder is refused by the controller, saying why (listed
    second, it reached the engine, which knows no such generating model)."""
    responses = [r async for r in two_models.gateway.Generate(generate_for(GENERATOR, "g"))]
    assert responses[-1].WhichOneof("event") == "finished", responses[-1]
    refused = two_models.gateway.Generate(generate_for(EMBEDDER, "e"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [r async for r in refused]
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Embed, Classify and Score only" in (caught.value.details() or "")


async def test_an_embed_for_the_embedder_reaches_the_engine(two_models: Fleet) -> None:
    """The embedder's Embed is routed to the engine (listed second, it was refused: "no
    engine serving embedder supports embed"); the generating model's is refused as no
    engine's GetModelInfo for it has the task."""
    inputs = [pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[1, 2]))]
    embedded = await two_models.gateway.Embed(
        pb.EmbedRequest(
            context=pb.TaskRequestContext(request_id="x", model=EMBEDDER), inputs=inputs
        )
    )
    assert list(embedded.outputs[0].dense.values) == [2.0, 2.0, 2.0]
    other = two_models.gateway.Embed(
        pb.EmbedRequest(
            context=pb.TaskRequestContext(request_id="y", model=GENERATOR), inputs=inputs
        )
    )
    assert await status_of(other) == grpc.StatusCode.FAILED_PRECONDITION


async def test_admin_workers_and_info_describe_each_model_as_it_is(two_models: Fleet) -> None:
    """`kvplane admin workers` shows the engine as generating (it was "pooling only" with the
    embedder listed first), and `kvplane admin info` through the controller gives each
    model its own ModelInfo: the embedder takes no LoRA adapter (the generating model's
    `supports_lora` was put on it) and embeds."""
    workers = await cli("workers", "--target", two_models.target, "--output", "json")
    assert workers.exit_code == 0, workers.output
    (worker,) = json.loads(workers.output)["workers"]
    assert (worker.get("pooling_only", False), sorted(worker["models"])) == (
        False,
        sorted([GENERATOR, EMBEDDER]),
    )
    info = await cli("info", "--target", two_models.target, "--output", "json")
    assert info.exit_code == 0, info.output
    models = {m["served_model_name"]: m for m in json.loads(info.output)["models"]}
    assert models[EMBEDDER]["supports_lora"] is False
    assert models[EMBEDDER]["tasks"]["embed"]["supported"] is True
    assert models[GENERATOR]["supports_lora"] is True


async def test_an_engine_whose_models_disagree_on_the_block_size_is_rejected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its KV events name no model: its blocks cannot be told apart, and one model's prompts
    would be matched in the other's block size. It is out of routing (admin `workers`
    says why) and the log says so in one line naming both sizes; it was routed in the first
    model's size."""
    caplog.set_level(logging.ERROR, logger="controller.fleet")
    engine = await start_fronted_engine("two", TwoModels, block_size=16)
    engine.servicer.embedder_block_size = 32
    other = await start_fronted_engine("other", Forwarding)
    fleet = await make_fleet(engines=[other])
    try:
        address = f"127.0.0.1:{engine.port}"
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.INCOMPATIBLE, WAIT_S
        )
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        (worker,) = [w for w in workers.workers if w.address == address]
        assert (worker.state, worker.routable) == ("incompatible", False)
        assert "KV block sizes differ (sim 16, embedder 32)" in worker.last_error
        # One line per attempt (retried every backoff_max_s), each naming both sizes.
        rejected = [r.getMessage() for r in caplog.records if address in r.getMessage()]
        assert rejected, caplog.text
        assert all("block sizes differ (sim 16, embedder 32)" in m for m in rejected), rejected
        embed = fleet.gateway.Embed(
            pb.EmbedRequest(
                context=pb.TaskRequestContext(request_id="x", model=EMBEDDER),
                inputs=[pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[1]))],
            )
        )
        assert await status_of(embed) == grpc.StatusCode.NOT_FOUND
        assert engine.servicer.embedded == []
    finally:
        await close_fleet(fleet)
        await engine.close()
