"""Pooling-only engines (`runner: pooling`, or `auto` on a classifier without an LM head) over
gRPC: Classify equals HF transformers, Embed and Score the float64 reference, Generate is
FAILED_PRECONDITION on both front ends and changes nothing, Health probes with a pooling
forward, ModelInfo advertises no generation, `max_queued_requests` bounds the tasks waiting for
the engine thread; and every config a pooling engine cannot honour is refused at load."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import shutil
import threading
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, EngineRoleName, LoraConfig, RunnerName
from engine.server.service import start_engine
from engine.torch_runner.builtin_model import write_builtin_model
from engine.torch_runner.errors import CheckpointError
from engine.torch_runner.loader import ships_lm_head
from engine.torch_runner.runner import TorchModelRunner
from kvplane.config import validate_config
from kvplane.errors import ConfigError
from kvplane.tokenize import INLINE_TOKENIZE_MAX_CHARS
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    collect,
    engine_thread_held,
    generate_request,
    rpc_error,
    running_engine,
    stream_error,
)
from tests.engine.test_server_pooling import (
    LABELS,
    MODEL,
    close,
    context,
    engine_config,
    ids_input,
    normalized,
    overloaded_metric,
    prompts,
    values,
)
from tests.engine.torch_reference import dense_hidden
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb

pytestmark = pytest.mark.timeout(180)


def write_headless_classifier(directory: Path) -> Path:
    """The builtin decoder as a LlamaForSequenceClassification with a random 3-label head,
    untied and without `lm_head.weight` (what HF saves for a classifier), in `directory`."""
    builtin = write_builtin_model(directory / "builtin")
    headless = directory / "headless"
    headless.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(builtin / name, headless / name)
    state = load_file(str(builtin / "model.safetensors"))
    del state["lm_head.weight"]
    hidden = state["model.norm.weight"].shape[0]
    state["score.weight"] = torch.randn(
        len(LABELS), hidden, generator=torch.Generator().manual_seed(11)
    )
    save_file(state, str(headless / "model.safetensors"))
    config = json.loads((builtin / "config.json").read_text())
    assert not config.get("tie_word_embeddings")
    config["architectures"] = ["LlamaForSequenceClassification"]
    config["id2label"] = {str(i): label for i, label in enumerate(LABELS)}
    config["label2id"] = {label: i for i, label in enumerate(LABELS)}
    (headless / "config.json").write_text(json.dumps(config))
    return headless


@pytest.fixture(scope="module")
def headless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_headless_classifier(tmp_path_factory.mktemp("models"))


async def test_auto_serves_a_headless_classifier_for_pooling_only(headless_dir: Path) -> None:
    assert not ships_lm_head(headless_dir)
    transformers: Any = importlib.import_module("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(headless_dir), local_files_only=True, dtype=torch.float32
    ).eval()
    inputs = prompts()[1:4]
    with torch.inference_mode():
        want = [hf(input_ids=torch.tensor([ids])).logits[0].softmax(-1) for ids in inputs]
    items = [ids_input(f"i{n}", ids) for n, ids in enumerate(inputs)]
    async with running_engine(engine_config(headless_dir)) as engine:
        stub = engine.stub
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
        load = await stub.GetLoad(pb.GetLoadRequest())
        health = await stub.Health(pb.HealthRequest(include_inference_probe=True))
        serving = await health_pb2_grpc.HealthStub(engine.channel).Check(
            health_pb2.HealthCheckRequest()
        )
        classified = await stub.Classify(pb.ClassifyRequest(context=context("c"), inputs=items))
        embedded = await stub.Embed(pb.EmbedRequest(context=context("e"), inputs=items))
        scored = await stub.Score(
            pb.ScoreRequest(
                context=context("s"),
                groups=[pb.ScoreGroup(group_id="g", query=items[0], candidates=items[1:])],
            )
        )
    # ModelInfo: the tasks, no generation, no KV geometry; the context is the model's.
    assert info.tasks.classify.supported and info.tasks.embed.supported
    assert info.tasks.score.supported
    assert not info.HasField("generation") and not info.HasField("max_output_tokens")
    assert not info.HasField("kv_block_size") and not info.HasField("total_kv_blocks")
    assert info.max_context_length == 512 and info.supports_lora is False
    assert load.total_kv_blocks == 1  # the one block the block manager needs, never used
    assert health.state == pb.HEALTH_STATE_READY
    probe = next(c for c in health.checks if c.name == "inference_probe")
    assert (probe.state, probe.message) == (pb.HEALTH_STATE_READY, "pooled 1 token")
    assert serving.status == health_pb2.HealthCheckResponse.SERVING
    for output, expected in zip(classified.outputs, want, strict=True):
        assert list(output.labels) == LABELS
        assert close(values(output.scores), expected.double())
    hidden = [normalized(dense_hidden(headless_dir, ids)[-1]) for ids in inputs]
    for embedding, expected in zip(embedded.outputs, hidden, strict=True):
        assert close(values(embedding.dense), expected)
    cosines = [float(hidden[0] @ h) for h in hidden[1:]]
    got = [c.scores.values[0] for c in scored.groups[0].candidates]
    assert got == pytest.approx(cosines, abs=1e-4)


async def test_generate_is_failed_precondition_and_changes_nothing(headless_dir: Path) -> None:
    items = [ids_input("a", [5, 6, 7])]
    async with running_engine(engine_config(headless_dir)) as engine:
        stub = engine.stub
        before = await stub.Classify(pb.ClassifyRequest(context=context("c1"), inputs=items))
        refused = [
            await rpc_error(
                collect(stub, generate_request([5, 6, 7], request_id="g", model=MODEL))
            ),
            # First, before any other check: an empty prompt is still this, not INVALID_ARGUMENT.
            await rpc_error(collect(stub, generate_request([], model=MODEL))),
            await rpc_error(
                engine.vllm.Generate(
                    vpb.GenerateRequest(
                        request_id="v", token_ids=vpb.TokenIds(ids=[5, 6]), model=MODEL
                    )
                )
            ),
            (
                await stream_error(
                    engine.vllm.GenerateStream(
                        vpb.GenerateRequest(request_id="w", token_ids=vpb.TokenIds(ids=[5]))
                    )
                )
            )[1],
        ]
        load = await stub.GetLoad(pb.GetLoadRequest())
        vllm_health = await health_pb2_grpc.HealthStub(engine.channel).Check(
            health_pb2.HealthCheckRequest(service="vllm.Generate")
        )
        # The refused id was never taken: a task may use it.
        after = await stub.Classify(pb.ClassifyRequest(context=context("g"), inputs=items))
    for error in refused:
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Embed, Classify and Score only" in (error.details() or "")
    assert (load.running_requests, load.queued_requests, load.used_kv_blocks) == (0, 0, 0)
    assert list(after.outputs[0].scores.values) == list(before.outputs[0].scores.values)
    # vllm.Generate refuses every request here: a probe must not send it any.
    assert vllm_health.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_runner_pooling_on_a_causal_lm_embeds_and_never_generates(tmp_path: Path) -> None:
    builtin = write_builtin_model(tmp_path)
    config = engine_config(builtin, runner="pooling", num_kv_blocks=None)
    async with running_engine(config) as engine:
        embedded = await engine.stub.Embed(
            pb.EmbedRequest(context=context(), inputs=[ids_input("a", [5, 6, 7])])
        )
        error = await rpc_error(collect(engine.stub, generate_request([5, 6], model=MODEL)))
        runner = engine.app.service.engine_loop.core.runner
        assert isinstance(runner, TorchModelRunner)  # a builtin model: the torch runner
        assert runner.model.weights.lm_head is None
    assert close(
        values(embedded.outputs[0].dense), normalized(dense_hidden(builtin, [5, 6, 7])[-1])
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_max_queued_requests_bounds_the_tasks_waiting_for_the_engine_thread(
    headless_dir: Path,
) -> None:
    """A pooling-only engine takes `max_queued_requests` (2): with its engine thread busy, two
    tasks wait and the third is refused (RESOURCE_EXHAUSTED naming the bound, counted by
    task); once the thread is free both complete and new tasks are admitted."""
    config = engine_config(
        headless_dir, runner="pooling", max_queued_requests=2, metrics_listen="127.0.0.1:0"
    )
    good = [ids_input("a", [5, 6, 7])]
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            waiting = [
                asyncio.ensure_future(
                    stub.Embed(pb.EmbedRequest(context=context(f"w{i}"), inputs=good))
                )
                for i in range(2)
            ]

            async def accepted() -> bool:
                return service.num_running_tasks == 2

            await eventually(accepted, what="two embeds accepted")
            refused = await rpc_error(
                stub.Embed(pb.EmbedRequest(context=context("e"), inputs=good))
            )
            load = await stub.GetLoad(pb.GetLoadRequest())
        waited = await asyncio.gather(*waiting)
        embedded, classified = await asyncio.gather(
            stub.Embed(pb.EmbedRequest(context=context("e"), inputs=good)),
            stub.Classify(pb.ClassifyRequest(context=context("c"), inputs=good)),
        )
        url = f"http://127.0.0.1:{engine.app.metrics_port}/metrics"
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "2 queued, max_queued_requests is 2" in (refused.details() or "")
    # GetLoad counts them as the bound does: queued, not running.
    assert (load.queued_requests, load.running_requests) == (2, 0)
    outputs = [len(r.outputs) for r in waited] + [len(embedded.outputs), len(classified.outputs)]
    assert outputs == [1, 1, 1, 1]
    assert f"{overloaded_metric('embed')} 1.0" in metrics.decode()


async def test_runner_generate_refuses_a_headless_classifier(headless_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="runner: pooling"):
        await start_engine(engine_config(headless_dir, runner="generate"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"role": "prefill"}, "role prefill is for engines that generate"),
        ({"role": "decode"}, "role decode is for engines that generate"),
        ({"lora": {"enabled": True}}, "unset lora.enabled"),
        ({"kv_events": {"zmq_enabled": True}}, "unset kv_events.zmq_enabled"),
        ({"model": "sim", "num_kv_blocks": 8}, "the sim runner has no hidden states"),
    ],
)
def test_runner_pooling_refuses_what_it_cannot_honour(
    overrides: dict[str, Any], message: str
) -> None:
    data = {"model": "/models/x", "runner": "pooling", **overrides}
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(EngineConfig, data, "engine.yaml")
    assert "\n" not in str(err.value)
    assert "runner: pooling" in str(err.value)


async def test_auto_refuses_a_headless_classifier_with_pooling_conflicts(
    headless_dir: Path,
) -> None:
    config = engine_config(headless_dir, lora={"enabled": True})
    assert config.runner is RunnerName.auto
    with pytest.raises(ConfigError, match=r"without an LM head.*unset lora\.enabled"):
        await start_engine(config)


def test_runner_defaults_to_auto_and_generate_allows_everything() -> None:
    assert EngineConfig().runner is RunnerName.auto
    EngineConfig(
        runner=RunnerName.generate, role=EngineRoleName.prefill, lora=LoraConfig(enabled=True)
    )


async def test_a_batch_of_short_texts_is_tokenised_off_the_event_loop(
    headless_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many text inputs, each within the inline limit but long together, are tokenised in one
    call in a worker thread, as one long text is (they were tokenised one by one on the event
    loop, stalling every stream and Health meanwhile); Embed and Score, whose groups' texts go
    in the same call, answer as for the same inputs as token ids."""
    async with running_engine(engine_config(headless_dir)) as engine:
        tasks = engine.app.openengine._tasks
        assert tasks is not None
        encode = tasks._ctx.encode
        assert encode is not None
        threads: set[threading.Thread] = set()

        def recording(text: str) -> list[int]:
            threads.add(threading.current_thread())
            return encode(text)

        # Which thread tokenises: instrumentation only.
        monkeypatch.setattr(tasks, "_ctx", dataclasses.replace(tasks._ctx, encode=recording))
        texts = [f"hello world {n}" for n in range(INLINE_TOKENIZE_MAX_CHARS // 10)]
        assert all(len(text) <= INLINE_TOKENIZE_MAX_CHARS for text in texts)
        assert sum(map(len, texts)) > INLINE_TOKENIZE_MAX_CHARS
        as_text = [pb.TaskInput(item_id=f"t{n}", text=t) for n, t in enumerate(texts)]
        as_ids = [ids_input(f"t{n}", encode(t)) for n, t in enumerate(texts)]
        embedded, by_ids = [
            await engine.stub.Embed(pb.EmbedRequest(context=context(f"e{n}"), inputs=inputs))
            for n, inputs in enumerate((as_text, as_ids))
        ]
        assert len(embedded.outputs) == len(texts)
        assert embedded.outputs == by_ids.outputs
        scored, scored_by_ids = [
            await engine.stub.Score(
                pb.ScoreRequest(
                    context=context(f"s{n}"),
                    groups=[
                        pb.ScoreGroup(group_id=f"g{g}", query=inputs[g], candidates=inputs[g + 1 :])
                        for g in range(3)
                    ],
                )
            )
            for n, inputs in enumerate((as_text, as_ids))
        ]
        assert [len(g.candidates) for g in scored.groups] == [len(texts) - g - 1 for g in range(3)]
        assert scored.groups == scored_by_ids.groups
    assert threads and threading.current_thread() not in threads, threads
