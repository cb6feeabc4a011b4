"""Two pooling engines of one model behind the controller, one without a tokenizer
(GetModelInfo `supports_text_input` false): a pooling task with a text input goes to the one
that takes text (it went to the least loaded, which refused it: "this engine has no
tokenizer"); token ids go to either; with no engine taking text, the engine's own refusal."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controller.registry import ModelFacts
from engine.server.service import start_engine
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import Fleet, close_fleet, make_fleet
from tests.controller.test_pooling_fleet import MODEL, engine_config
from tests.engine.test_server_pooling import LABELS
from tests.engine.test_server_pooling_runner import write_headless_classifier
from tests.redis_servers import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    headless = write_headless_classifier(tmp_path)
    untokenized = tmp_path / "untokenized"
    shutil.copytree(headless, untokenized)
    (untokenized / "tokenizer.json").unlink()
    # The one without a tokenizer at the first address: of engines alike in load, the
    # registry's first (by address) is chosen.
    ports = {free_port()}
    while len(ports) < 2:
        ports.add(free_port())
    first, second = sorted(f"127.0.0.1:{port}" for port in ports)
    engines = []
    for model, instance_id, listen in (
        (untokenized, "ids-only", first),
        (headless, "text", second),
    ):
        config = engine_config(model, instance_id).model_copy(update={"listen": listen})
        engines.append(await start_engine(config))
    fleet = await make_fleet(engines=engines)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


def _facts(fleet: Fleet, engine_id: str) -> ModelFacts:
    record = fleet.app.controller.fleet.registry.by_engine_id(engine_id)
    assert record is not None and record.identity is not None
    return record.identity.facts_of(MODEL)


async def _classify(fleet: Fleet, request_id: str, item: pb.TaskInput) -> pb.ClassifyResponse:
    return await fleet.gateway.Classify(
        pb.ClassifyRequest(
            context=pb.TaskRequestContext(request_id=request_id, model=MODEL), inputs=[item]
        )
    )


async def test_a_text_input_goes_to_an_engine_that_takes_text(fleet: Fleet) -> None:
    assert "supports_text_input" in _facts(fleet, "ids-only").unsupported
    assert "supports_text_input" not in _facts(fleet, "text").unsupported
    for n in range(3):
        ids = pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))
        mixed = [pb.TaskInput(item_id="t", text="hello world"), ids]
        classified = await _classify(fleet, f"c{n}", pb.TaskInput(item_id="t", text="hello"))
        assert list(classified.outputs[0].labels) == LABELS
        embedded = await fleet.gateway.Embed(
            pb.EmbedRequest(
                context=pb.TaskRequestContext(request_id=f"e{n}", model=MODEL), inputs=mixed
            )
        )
        assert len(embedded.outputs) == 2
        scored = await fleet.gateway.Score(
            pb.ScoreRequest(
                context=pb.TaskRequestContext(request_id=f"s{n}", model=MODEL),
                groups=[pb.ScoreGroup(group_id="g", query=ids, candidates=[mixed[0]])],
            )
        )
        assert len(scored.groups) == 1


async def test_with_no_engine_taking_text_the_engine_refuses_it(fleet: Fleet) -> None:
    await fleet.admin.RemoveEngine(apb.EngineRef(engine="text"))
    ids = pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))
    assert list((await _classify(fleet, "ids", ids)).outputs[0].labels) == LABELS
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _classify(fleet, "text", pb.TaskInput(item_id="t", text="hello"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no tokenizer" in (err.value.details() or "")
