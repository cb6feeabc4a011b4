"""Embed, Classify and Score on torch engines over gRPC: the values equal an independent
float64 forward (`torch_reference.dense_hidden`), batches equal one-by-one, generation running
meanwhile is unchanged, and every refusal has the seed's status."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import urllib.request
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.torch_runner.config import ModelConfig
from engine.torch_runner.errors import CheckpointError
from engine.torch_runner.loader import load_model
from engine.torch_runner.pooling import TorchPooler
from engine.torch_runner.runner import TorchModelRunner
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    collect,
    engine_thread_held,
    generate_request,
    metrics_text,
    rpc_error,
    running_engine,
)
from tests.engine.test_text_prompt_off_loop import (
    HUGE_PROMPT,
    OUT_OF_VOCABULARY,
    PROMPT_IDS,
    BlockingTokenizer,
)
from tests.engine.torch_reference import TEST_DEVICE, dense_hidden
from tests.polling import eventually

pytestmark = pytest.mark.timeout(180)

MODEL = "builtin"
LABELS = ["negative", "neutral", "positive"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def classifier_dir(builtin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builtin decoder as a LlamaForSequenceClassification with a random 3-label head."""
    directory = tmp_path_factory.mktemp("classifier")
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(builtin_dir / name, directory / name)
    state = load_file(str(builtin_dir / "model.safetensors"))
    hidden = state["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(7)
    state["score.weight"] = torch.randn(len(LABELS), hidden, generator=generator)
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((builtin_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    config["id2label"] = {str(i): label for i, label in enumerate(LABELS)}
    config["label2id"] = {label: i for i, label in enumerate(LABELS)}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": MODEL,
        "listen": "127.0.0.1:0",
        "block_size": 16,
        "num_kv_blocks": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 512,
        "num_threads": 1,
        "shutdown_grace_s": 1.0,
        "device": TEST_DEVICE,
    }
    values.update(overrides)
    return EngineConfig(**values)


def context(request_id: str = "t", **fields: Any) -> pb.TaskRequestContext:
    return pb.TaskRequestContext(request_id=request_id, model=MODEL, **fields)


def ids_input(item_id: str, ids: list[int]) -> pb.TaskInput:
    return pb.TaskInput(item_id=item_id, token_ids=pb.TokenIds(ids=ids))


def overloaded_metric(task: str) -> str:
    """The exposition sample counting `task`'s refusals at the bound, less its value."""
    return f'kvplane_engine_overloaded_requests_total{{model="{MODEL}",task="{task}"}}'


def forward_tokens_metric(task: str) -> str:
    """The exposition sample counting the input tokens `task`'s forwards ran, less its value."""
    return f'kvplane_engine_pooling_forward_tokens_total{{model="{MODEL}",task="{task}"}}'


def prompts() -> list[list[int]]:
    """Token ids of several lengths (one past a 16-token block, one long)."""
    return [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((1, 9, 17, 40, 130))]


def values(tensor: pb.DenseFloatTensor) -> torch.Tensor:
    return torch.tensor(list(tensor.values), dtype=torch.float64).reshape(*tensor.shape)


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float = TOLERANCE) -> bool:
    return got.shape == want.shape and float((got - want).abs().max()) <= tolerance


def normalized(x: torch.Tensor) -> torch.Tensor:
    return x.div(x.norm(dim=-1, keepdim=True))


# ------------------------------------------------------------------------------------------
# Embed
# ------------------------------------------------------------------------------------------


async def test_embed_is_the_normalized_last_hidden_state_of_the_reference(
    builtin_dir: Path,
) -> None:
    inputs = prompts()
    async with running_engine(engine_config(builtin_dir)) as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
        response = await engine.stub.Embed(
            pb.EmbedRequest(
                context=context(),
                inputs=[ids_input(f"i{n}", ids) for n, ids in enumerate(inputs)],
            )
        )
    caps = info.tasks.embed
    assert caps.supported and caps.dimension == 256 and caps.supports_dimension_override
    assert list(caps.input_types) == [pb.TASK_INPUT_TYPE_TEXT, pb.TASK_INPUT_TYPE_TOKEN_IDS]
    assert info.tasks.score.supported and info.tasks.score.higher_is_better
    assert info.tasks.classify.HasField("supported") and not info.tasks.classify.supported
    assert response.request_id == "t"
    assert response.usage.input_tokens == sum(map(len, inputs))
    assert response.usage.HasField("cached_input_tokens")
    assert response.usage.cached_input_tokens == 0
    for index, (ids, output) in enumerate(zip(inputs, response.outputs, strict=True)):
        assert (output.item_id, output.input_index) == (f"i{index}", index)
        assert output.HasField("input_index")
        assert output.granularity == pb.TASK_OUTPUT_GRANULARITY_SEQUENCE
        assert list(output.dense.shape) == [256] and not output.token_ids
        want = normalized(dense_hidden(builtin_dir, ids)[-1])
        assert close(values(output.dense), want), index


async def test_embed_options_normalize_dimensions_tokens_and_text(builtin_dir: Path) -> None:
    ids = prompts()[3]
    text = "You are a helpful assistant."
    tokenizer = Tokenizer.from_file(str(builtin_dir / "tokenizer.json"))
    hidden = dense_hidden(builtin_dir, ids)
    async with running_engine(engine_config(builtin_dir)) as engine:

        async def embed(options: pb.EmbedOptions, item: pb.TaskInput) -> pb.EmbeddingOutput:
            request = pb.EmbedRequest(context=context(), inputs=[item], options=options)
            return (await engine.stub.Embed(request)).outputs[0]

        raw = await embed(pb.EmbedOptions(normalize=False), ids_input("a", ids))
        short = await embed(pb.EmbedOptions(dimensions=32), ids_input("a", ids))
        short_raw = await embed(
            pb.EmbedOptions(dimensions=32, normalize=False), ids_input("a", ids)
        )
        tokens = await embed(
            pb.EmbedOptions(granularity=pb.TASK_OUTPUT_GRANULARITY_TOKEN), ids_input("a", ids)
        )
        by_text = await embed(pb.EmbedOptions(), pb.TaskInput(item_id="a", text=text))
        by_ids = await embed(pb.EmbedOptions(), ids_input("a", tokenizer.encode(text).ids))
    assert close(values(raw.dense), hidden[-1])
    assert float(values(raw.dense).norm()) > 2.0  # really not normalized
    assert close(values(short.dense), normalized(hidden[-1][:32]))
    assert close(values(short_raw.dense), hidden[-1][:32])
    assert tokens.granularity == pb.TASK_OUTPUT_GRANULARITY_TOKEN
    assert list(tokens.token_ids) == ids
    assert close(values(tokens.dense), normalized(hidden))
    assert list(by_text.dense.values) == list(by_ids.dense.values)


async def test_mean_pooling_from_a_sentence_transformers_config(
    builtin_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "mean"
    shutil.copytree(builtin_dir, model_dir)
    modules = [
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 256, "pooling_mode_mean_tokens": True})
    )
    inputs = prompts()[1:4]
    async with running_engine(engine_config(model_dir)) as engine:
        response = await engine.stub.Embed(
            pb.EmbedRequest(
                context=context(), inputs=[ids_input(f"i{n}", ids) for n, ids in enumerate(inputs)]
            )
        )
    for ids, output in zip(inputs, response.outputs, strict=True):
        want = normalized(dense_hidden(model_dir, ids).mean(dim=0))
        assert close(values(output.dense), want)
        assert not close(values(output.dense), normalized(dense_hidden(model_dir, ids)[-1]))


async def test_a_batch_split_over_forwards_equals_one_by_one(builtin_dir: Path) -> None:
    # A 64-token budget: the 130-token input runs alone, the others in several forwards.
    inputs = prompts() * 2
    async with running_engine(engine_config(builtin_dir, max_num_batched_tokens=64)) as engine:
        batch = await engine.stub.Embed(
            pb.EmbedRequest(
                context=context(), inputs=[ids_input(f"i{n}", ids) for n, ids in enumerate(inputs)]
            )
        )
        alone = [
            (
                await engine.stub.Embed(
                    pb.EmbedRequest(context=context(f"r{n}"), inputs=[ids_input("x", ids)])
                )
            ).outputs[0]
            for n, ids in enumerate(inputs)
        ]
    assert len(batch.outputs) == len(inputs)
    for one, together in zip(alone, batch.outputs, strict=True):
        assert close(values(one.dense), values(together.dense), 1e-5)


# ------------------------------------------------------------------------------------------
# Score
# ------------------------------------------------------------------------------------------


async def test_score_is_the_cosine_of_the_embeddings(builtin_dir: Path) -> None:
    query, *candidates = prompts()
    config = engine_config(builtin_dir, metrics_listen="127.0.0.1:0")
    async with running_engine(config) as engine:
        embeddings = await engine.stub.Embed(
            pb.EmbedRequest(
                context=context("e"),
                inputs=[ids_input(f"i{n}", ids) for n, ids in enumerate([query, *candidates])],
            )
        )
        response = await engine.stub.Score(
            pb.ScoreRequest(
                context=context("s"),
                groups=[
                    pb.ScoreGroup(
                        group_id="g0",
                        query=ids_input("q", query),
                        candidates=[ids_input(f"c{n}", ids) for n, ids in enumerate(candidates)],
                    ),
                    pb.ScoreGroup(
                        group_id="g1", query=ids_input("q", candidates[0]),
                        candidates=[ids_input("c", query)],
                    ),
                ],
            )
        )  # fmt: skip
        url = f"http://127.0.0.1:{engine.app.metrics_port}/metrics"
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    text = metrics.decode()
    assert 'kvplane_engine_pooling_requests_total{model="builtin",task="embed"} 1.0' in text
    assert 'kvplane_engine_pooling_requests_total{model="builtin",task="score"} 1.0' in text
    tokens = sum(map(len, prompts()))  # the score's distinct inputs: the same five
    assert (
        f'kvplane_engine_pooling_input_tokens_total{{model="builtin",task="score"}} {tokens}.0'
        in text
    )
    vectors = [values(output.dense) for output in embeddings.outputs]
    assert response.semantics == pb.TASK_VALUE_SEMANTICS_SIMILARITY
    assert response.granularity == pb.TASK_OUTPUT_GRANULARITY_SEQUENCE
    assert response.HasField("higher_is_better") and response.higher_is_better
    assert response.normalization == pb.SCORE_NORMALIZATION_NONE
    first, second = response.groups
    assert (first.group_id, first.group_index, second.group_index) == ("g0", 0, 1)
    assert first.HasField("group_index")
    got = [float(c.scores.values[0]) for c in first.candidates]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(g, 3) for g in got)) == len(got)  # different inputs, different scores
    assert [c.candidate_id for c in first.candidates] == [f"c{n}" for n in range(4)]
    assert [c.candidate_index for c in first.candidates] == list(range(4))
    assert list(first.candidates[0].scores.shape) == [1]
    assert float(second.candidates[0].scores.values[0]) == pytest.approx(got[0], abs=1e-5)
    assert response.usage.input_tokens == sum(map(len, prompts())) + len(query) + len(candidates[0])


# ------------------------------------------------------------------------------------------
# Classify
# ------------------------------------------------------------------------------------------


async def test_classify_is_the_softmax_of_the_head_on_the_last_hidden_state(
    classifier_dir: Path,
) -> None:
    inputs = prompts()
    head = load_file(str(classifier_dir / "model.safetensors"))["score.weight"].double()
    async with running_engine(engine_config(classifier_dir)) as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
        items = [ids_input(f"i{n}", ids) for n, ids in enumerate(inputs)]
        probabilities = await engine.stub.Classify(
            pb.ClassifyRequest(context=context("p"), inputs=items)
        )
        logits = await engine.stub.Classify(
            pb.ClassifyRequest(
                context=context("l"),
                inputs=items[:2],
                options=pb.ClassifyOptions(output_semantics=pb.TASK_VALUE_SEMANTICS_LOGITS),
            )
        )
        per_token = await engine.stub.Classify(
            pb.ClassifyRequest(
                context=context("k"),
                inputs=items[2:3],
                options=pb.ClassifyOptions(granularity=pb.TASK_OUTPUT_GRANULARITY_TOKEN),
            )
        )
        # A classifier still generates (its LM head is there).
        generated = await collect(engine.stub, generate_request([5, 6, 7], model=MODEL))
    assert info.tasks.classify.supported
    assert pb.TASK_VALUE_SEMANTICS_PROBABILITIES in info.tasks.classify.semantics
    for ids, output in zip(inputs, probabilities.outputs, strict=True):
        assert list(output.labels) == LABELS
        assert output.semantics == pb.TASK_VALUE_SEMANTICS_PROBABILITIES
        assert list(output.scores.shape) == [3]
        want = (dense_hidden(classifier_dir, ids)[-1] @ head.T).softmax(-1)
        assert close(values(output.scores), want)
    for ids, output in zip(inputs[:2], logits.outputs, strict=True):
        assert output.semantics == pb.TASK_VALUE_SEMANTICS_LOGITS
        assert close(values(output.scores), dense_hidden(classifier_dir, ids)[-1] @ head.T)
    token_output = per_token.outputs[0]
    assert list(token_output.scores.shape) == [len(inputs[2]), 3]
    assert list(token_output.token_ids) == inputs[2]
    want_rows = (dense_hidden(classifier_dir, inputs[2]) @ head.T).softmax(-1)
    assert close(values(token_output.scores), want_rows)
    assert generated[-1].finished.reason == pb.FINISH_REASON_LENGTH


def test_a_classifier_without_an_lm_head_is_refused_at_load(
    classifier_dir: Path, tmp_path: Path
) -> None:
    state = load_file(str(classifier_dir / "model.safetensors"))
    del state["lm_head.weight"]
    shutil.copy(classifier_dir / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    assert ModelConfig.from_dir(tmp_path).classifier_labels == tuple(LABELS)
    with pytest.raises(CheckpointError, match="lm_head"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------------------
# Running next to generation; refusals
# ------------------------------------------------------------------------------------------


async def test_generation_is_unchanged_by_embeds_running_meanwhile(builtin_dir: Path) -> None:
    request = generate_request(
        prompts()[3], max_tokens=48, model=MODEL, sampling=pb.SamplingParams(temperature=0.0)
    )
    request.stopping.ignore_eos = True

    def tokens(responses: list[Any]) -> list[int]:
        return [t.token_id for r in responses if r.HasField("token") for t in r.token.tokens]

    embed = pb.EmbedRequest(
        context=context("e"), inputs=[ids_input(f"i{n}", ids) for n, ids in enumerate(prompts())]
    )
    async with running_engine(engine_config(builtin_dir, max_num_batched_tokens=64)) as engine:
        alone = tokens(await collect(engine.stub, request))
        expected = await engine.stub.Embed(embed)
        generation = asyncio.ensure_future(collect(engine.stub, request))
        during: list[pb.EmbedResponse] = []
        while not generation.done():
            embed.context.request_id = f"e{len(during)}"
            during.append(await engine.stub.Embed(embed))
        together = tokens(await generation)
    assert len(alone) == 48 and together == alone
    assert len(during) >= 2  # the embeds really ran while it generated
    for response in during:
        assert [list(o.dense.values) for o in response.outputs] == [
            list(o.dense.values) for o in expected.outputs
        ]


async def test_refusals_have_the_seeds_statuses(builtin_dir: Path, classifier_dir: Path) -> None:
    invalid, failed = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    good = [ids_input("a", [5, 6, 7])]
    async with running_engine(engine_config(builtin_dir)) as engine:
        stub = engine.stub

        async def embed_status(
            inputs: list[pb.TaskInput] = good,
            ctx: pb.TaskRequestContext | None = None,
            **options: Any,
        ) -> grpc.StatusCode:
            request = pb.EmbedRequest(
                context=ctx or context(), inputs=inputs, options=pb.EmbedOptions(**options)
            )
            return (await rpc_error(stub.Embed(request))).code()

        async def score_status(
            groups: list[pb.ScoreGroup] | None = None, **options: Any
        ) -> grpc.StatusCode:
            group = pb.ScoreGroup(group_id="g", query=good[0], candidates=[ids_input("b", [8])])
            request = pb.ScoreRequest(
                context=context(), groups=groups if groups is not None else [group],
                options=pb.ScoreOptions(**options),
            )  # fmt: skip
            return (await rpc_error(stub.Score(request))).code()

        assert await embed_status([]) == invalid
        assert await embed_status([ids_input("a", [])]) == invalid
        assert await embed_status([ids_input("", [5])]) == invalid
        assert await embed_status([ids_input("a", [5]), ids_input("a", [6])]) == invalid
        assert await embed_status([pb.TaskInput(item_id="a")]) == invalid
        assert await embed_status([ids_input("a", [5] * 513)]) == invalid  # > max_model_len
        assert await embed_status([ids_input("a", [100_000])]) == invalid
        multimodal = pb.TaskInput(item_id="a", multimodal=pb.MultimodalTaskInput(text="x"))
        assert await embed_status([multimodal]) == invalid
        assert await embed_status(dimensions=0) == invalid
        assert await embed_status(dimensions=257) == invalid
        assert await embed_status(encoding=pb.EMBEDDING_ENCODING_SPARSE) == invalid
        unknown = pb.TaskRequestContext(request_id="t", model="other")
        assert await embed_status(ctx=unknown) == grpc.StatusCode.NOT_FOUND
        assert await embed_status(ctx=context(lora_name="x")) == failed
        assert await embed_status(ctx=context(priority=1)) == invalid
        assert await score_status([]) == invalid
        assert await score_status([pb.ScoreGroup(group_id="g", query=good[0])]) == invalid
        assert await score_status(normalization=pb.SCORE_NORMALIZATION_SOFTMAX) == invalid
        assert await score_status(label_token_ids=[5]) == invalid
        assert await score_status(instruction="rank these") == invalid
        assert await score_status(output_semantics=pb.TASK_VALUE_SEMANTICS_LOGITS) == invalid
        classify = stub.Classify(pb.ClassifyRequest(context=context(), inputs=good))
        assert (await rpc_error(classify)).code() == failed  # the builtin model has no head
        # A request id already running (a generation): ALREADY_EXISTS.
        running = stub.Generate(
            generate_request([5, 6], max_tokens=10_000, request_id="busy", model=MODEL)
        )
        await running.read()
        assert await embed_status(ctx=context("busy")) == grpc.StatusCode.ALREADY_EXISTS
        running.cancel()
        # Draining: UNAVAILABLE; the engine still works for what it had.
        async for _ in stub.Drain(pb.DrainRequest(stop_accepting_new_requests=True)):
            pass
        assert await embed_status() == grpc.StatusCode.UNAVAILABLE
        assert await score_status() == grpc.StatusCode.UNAVAILABLE
    async with running_engine(engine_config(classifier_dir)) as engine:
        request = pb.ClassifyRequest(
            context=context(),
            inputs=good,
            options=pb.ClassifyOptions(output_semantics=pb.TASK_VALUE_SEMANTICS_SIMILARITY),
        )
        assert (await rpc_error(engine.stub.Classify(request))).code() == invalid


async def test_tasks_are_refused_while_the_queue_is_at_its_bound(classifier_dir: Path) -> None:
    """`max_queued_requests`: a task takes no place in the generation queue, but arriving
    while it is full it is refused at once (RESOURCE_EXHAUSTED, counted by task) and runs
    again once the queue has room."""
    config = engine_config(classifier_dir, max_queued_requests=1, metrics_listen="127.0.0.1:0")
    good = [ids_input("a", [5, 6, 7])]
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            queued = asyncio.create_task(
                collect(stub, generate_request([5, 6, 7], max_tokens=2, model=MODEL))
            )

            async def full() -> bool:
                return service.num_queued == 1

            await eventually(full, what="one request queued")
            group = pb.ScoreGroup(group_id="g", query=good[0], candidates=[ids_input("b", [8])])
            refusals = [
                await rpc_error(stub.Embed(pb.EmbedRequest(context=context("e"), inputs=good))),
                await rpc_error(
                    stub.Classify(pb.ClassifyRequest(context=context("c"), inputs=good))
                ),
                await rpc_error(stub.Score(pb.ScoreRequest(context=context("s"), groups=[group]))),
            ]
        assert (await queued)[-1].finished.reason == pb.FINISH_REASON_LENGTH

        async def drained() -> bool:
            return service.num_queued == 0

        await eventually(drained, what="the queue drained")
        after = await stub.Embed(pb.EmbedRequest(context=context("e"), inputs=good))
        url = f"http://127.0.0.1:{engine.app.metrics_port}/metrics"
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    for refused in refusals:
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "max_queued_requests is 1" in (refused.details() or "")
    assert len(after.outputs) == 1
    text = metrics.decode()
    for task in ("embed", "classify", "score"):
        assert f"{overloaded_metric(task)} 1.0" in text
    # Refused before acceptance: not counted as accepted (the embed after it is).
    assert f'kvplane_engine_pooling_requests_total{{model="{MODEL}",task="embed"}} 1.0' in text
    assert f'kvplane_engine_pooling_requests_total{{model="{MODEL}",task="score"}}' not in text
    # What ran through the model: the embed's 3 tokens, nothing of the refused tasks.
    assert f"{forward_tokens_metric('embed')} 3.0" in text
    assert forward_tokens_metric("score") not in text


async def test_tasks_waiting_for_the_engine_thread_count_toward_the_bound(
    classifier_dir: Path,
) -> None:
    """A task accepted while the engine thread is busy waits for it, and so counts as queued:
    at `max_queued_requests` (1) a Generate and another task are refused; once the thread is
    free the waiting task completes and both are admitted again."""
    config = engine_config(classifier_dir, max_queued_requests=1)
    good = [ids_input("a", [5, 6, 7])]
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            waiting = asyncio.ensure_future(
                stub.Embed(pb.EmbedRequest(context=context("w"), inputs=good))
            )

            async def accepted() -> bool:
                return service.num_running_tasks == 1

            await eventually(accepted, what="the embed accepted")
            generate_refused = await rpc_error(
                collect(stub, generate_request([5, 6, 7], max_tokens=2, model=MODEL))
            )
            classify_refused = await rpc_error(
                stub.Classify(pb.ClassifyRequest(context=context("c"), inputs=good))
            )
        waited = await waiting
        generated = await collect(stub, generate_request([5, 6, 7], max_tokens=2, model=MODEL))
        classified = await stub.Classify(pb.ClassifyRequest(context=context("c"), inputs=good))
    for refused in (generate_refused, classify_refused):
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "1 queued, max_queued_requests is 1" in (refused.details() or "")
    assert len(waited.outputs) == 1
    assert generated[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert len(classified.outputs) == 1


async def test_text_without_a_tokenizer_is_invalid(builtin_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "no-tokenizer"
    shutil.copytree(builtin_dir, model_dir)
    (model_dir / "tokenizer.json").unlink()
    async with running_engine(engine_config(model_dir)) as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
        request = pb.EmbedRequest(context=context(), inputs=[pb.TaskInput(item_id="a", text="x")])
        error = await rpc_error(engine.stub.Embed(request))
    assert list(info.tasks.embed.input_types) == [pb.TASK_INPUT_TYPE_TOKEN_IDS]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_abort_stops_a_running_embed_between_batches(builtin_dir: Path) -> None:
    # 300 forwards of one 60-token input each (a 64-token budget): long enough to abort.
    inputs = [ids_input(f"i{n}", [5 + n % 50] * 60) for n in range(300)]
    async with running_engine(engine_config(builtin_dir, max_num_batched_tokens=64)) as engine:
        call = engine.stub.Embed(pb.EmbedRequest(context=context("long"), inputs=inputs))
        service = engine.app.service

        async def running() -> bool:
            # Accepted and its first batch begun on the engine thread (until then it counts
            # as queued: a race on a loaded machine).
            return service.num_running_tasks == 1 and service.num_waiting_tasks == 0

        await eventually(running, what="the embed to start")
        load = await engine.stub.GetLoad(pb.GetLoadRequest(include_per_rank=True))
        assert load.running_requests == 1 and service.num_in_flight == 1
        assert load.ranks[0].running_requests == 1  # the one rank's figure is the engine's
        aborted = await engine.stub.Abort(pb.AbortRequest(request_id="long"))
        error = await rpc_error(call)
        again = await engine.stub.Abort(pb.AbortRequest(request_id="long"))
        # The engine is fine afterwards.
        after = await engine.stub.Embed(pb.EmbedRequest(context=context(), inputs=inputs[:2]))
    assert aborted.status == pb.ABORT_STATUS_ABORTED
    assert error.code() == grpc.StatusCode.CANCELLED
    assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
    assert len(after.outputs) == 2


async def test_a_client_that_cancels_an_embed_stops_its_forwards(
    builtin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed: client cancellation stops queued or running task work. The forwards left
    are never run (a spy counts the pooler's forwards; the engine is not faked)."""
    forwards = 0
    pool = TorchPooler.pool

    def counting_pool(self: TorchPooler, *args: Any, **kwargs: Any) -> Any:
        nonlocal forwards
        forwards += 1
        return pool(self, *args, **kwargs)

    monkeypatch.setattr(TorchPooler, "pool", counting_pool)
    # 300 forwards of one 60-token input each (a 64-token budget).
    inputs = [ids_input(f"i{n}", [5 + n % 50] * 60) for n in range(300)]
    async with running_engine(engine_config(builtin_dir, max_num_batched_tokens=64)) as engine:
        call = engine.stub.Embed(pb.EmbedRequest(context=context("gone"), inputs=inputs))
        service = engine.app.service

        async def started() -> bool:
            return forwards > 0

        await eventually(started, what="the embed's first forward")
        call.cancel()

        async def ended() -> bool:
            return service.num_running_tasks == 0

        await eventually(ended, what="the cancelled embed to end")
        # Commands run in order on the engine thread: this one's forwards come after any the
        # cancelled embed still had queued.
        after = await engine.stub.Embed(pb.EmbedRequest(context=context(), inputs=inputs[:2]))
        aborted = await engine.stub.Abort(pb.AbortRequest(request_id="gone"))
    assert len(after.outputs) == 2
    assert forwards < 300  # the embed did not run to its end (300 forwards, then 2 more)
    assert aborted.status == pb.ABORT_STATUS_ALREADY_FINISHED


# ------------------------------------------------------------------------------------------
# A task stopped while it waits for the engine thread (queued behind the held thread)
# ------------------------------------------------------------------------------------------


def forward_tokens(metrics: str, task: str) -> float:
    """The input tokens `task`'s forwards ran through the model (0 before the first)."""
    pattern = rf"^{re.escape(forward_tokens_metric(task))} (\S+)$"
    found = re.search(pattern, metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def load_counts(stub: Any) -> tuple[int, int]:
    """GetLoad's (running_requests, queued_requests)."""
    load = await stub.GetLoad(pb.GetLoadRequest())
    return load.running_requests, load.queued_requests


async def waiting_for_the_engine_thread(stub: Any, num_tasks: int) -> None:
    async def queued() -> bool:
        return await load_counts(stub) == (0, num_tasks)

    await eventually(queued, what=f"{num_tasks} tasks waiting for the engine thread")


# Forty tokens each: what a stopped task's forward would add to the forward-tokens metric.
WAITING_INPUT = [ids_input("a", [5 + n for n in range(40)])]
AFTER_INPUT = [ids_input("b", [6, 7, 8])]


async def test_an_embed_aborted_while_it_waits_for_the_engine_thread_never_runs(
    builtin_dir: Path,
) -> None:
    """Abort(request_id) of an Embed queued behind the engine thread: ABORTED, and by the
    answer it is out of GetLoad's counts; its call ends CANCELLED, a second Abort is
    ALREADY_FINISHED, and its forward never runs (only the later embed's 3 tokens are
    computed: engine-thread commands run in order, so it would have run before that one)."""
    config = engine_config(builtin_dir, metrics_listen="127.0.0.1:0")
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            call = stub.Embed(pb.EmbedRequest(context=context("w"), inputs=WAITING_INPUT))
            await waiting_for_the_engine_thread(stub, 1)
            aborted = await stub.Abort(pb.AbortRequest(request_id="w"))
            counts = await load_counts(stub)
            error = await rpc_error(call)
            again = await stub.Abort(pb.AbortRequest(request_id="w"))
        after = await stub.Embed(pb.EmbedRequest(context=context("after"), inputs=AFTER_INPUT))
        metrics = await metrics_text(engine)
    assert aborted.status == pb.ABORT_STATUS_ABORTED
    assert counts == (0, 0)
    assert error.code() == grpc.StatusCode.CANCELLED
    assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
    assert len(after.outputs) == 1
    assert forward_tokens(metrics, "embed") == 3


@pytest.mark.parametrize("ids", [PROMPT_IDS, OUT_OF_VOCABULARY], ids=["taken", "refused"])
async def test_an_embed_aborted_while_its_text_is_tokenised_never_runs(
    builtin_dir: Path, ids: list[int]
) -> None:
    """Abort(request_id) of an Embed whose text input is still being tokenised (before
    acceptance): ABORTED; once tokenised the call ends CANCELLED, even when the input is
    refused then (a token id outside the vocabulary: the abort wins over INVALID_ARGUMENT), a
    second Abort is ALREADY_FINISHED, and its forward never runs."""
    tokenizer = BlockingTokenizer(ids)
    request = pb.EmbedRequest(
        context=context("t"), inputs=[pb.TaskInput(item_id="a", text=HUGE_PROMPT)]
    )
    config = engine_config(builtin_dir, metrics_listen="127.0.0.1:0")
    async with running_engine(config) as engine:
        tasks = engine.app.openengine._tasks
        assert tasks is not None
        tasks._ctx = dataclasses.replace(tasks._ctx, encode=tokenizer.encode)
        call = engine.stub.Embed(request)
        await asyncio.to_thread(tokenizer.entered.wait)
        aborted = await engine.stub.Abort(pb.AbortRequest(request_id="t"))
        tokenizer.release.set()
        error = await rpc_error(call)
        again = await engine.stub.Abort(pb.AbortRequest(request_id="t"))
        metrics = await metrics_text(engine)
    assert aborted.status == pb.ABORT_STATUS_ABORTED
    assert error.code() == grpc.StatusCode.CANCELLED
    assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
    assert forward_tokens(metrics, "embed") == 0


async def test_abort_all_requests_drops_every_waiting_task(classifier_dir: Path) -> None:
    """Abort(all_requests) with an Embed, a Classify and a Score waiting for the engine
    thread: each call ends CANCELLED, GetLoad counts none of them, none of their forwards
    runs."""
    config = engine_config(classifier_dir, metrics_listen="127.0.0.1:0")
    group = pb.ScoreGroup(group_id="g", query=WAITING_INPUT[0], candidates=AFTER_INPUT)
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            calls: list[Awaitable[object]] = [
                stub.Embed(pb.EmbedRequest(context=context("e"), inputs=WAITING_INPUT)),
                stub.Classify(pb.ClassifyRequest(context=context("c"), inputs=WAITING_INPUT)),
                stub.Score(pb.ScoreRequest(context=context("s"), groups=[group])),
            ]
            await waiting_for_the_engine_thread(stub, 3)
            aborted = stub.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
            # abort_all also stops generation requests: an engine-thread command, answered
            # once the thread is free; the tasks are stopped before it.
            errors = [await rpc_error(call) for call in calls]
            counts = await load_counts(stub)
        answer = await aborted
        after = await stub.Embed(pb.EmbedRequest(context=context("after"), inputs=AFTER_INPUT))
        metrics = await metrics_text(engine)
    assert answer.status == pb.ABORT_STATUS_ABORTED
    assert answer.message == "aborted 3 requests"
    assert [error.code() for error in errors] == [grpc.StatusCode.CANCELLED] * 3
    assert counts == (0, 0)
    assert len(after.outputs) == 1
    assert forward_tokens(metrics, "embed") == 3
    assert forward_tokens(metrics, "classify") == forward_tokens(metrics, "score") == 0


@pytest.mark.parametrize("leaves", ["cancel", "deadline"])
async def test_an_embed_whose_client_leaves_while_it_waits_never_runs(
    builtin_dir: Path, leaves: str
) -> None:
    """The seed: client cancellation or deadline expiration stops queued task work. An Embed
    waiting for the engine thread whose client cancels (or whose deadline passes) leaves
    GetLoad's counts, Abort then finds it ALREADY_FINISHED, and its forward never runs."""
    config = engine_config(builtin_dir, metrics_listen="127.0.0.1:0")
    request = pb.EmbedRequest(context=context("gone"), inputs=WAITING_INPUT)
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            # The thread stays held past the deadline: the call cannot end before it.
            call = stub.Embed(request, timeout=None if leaves == "cancel" else 3.0)
            await waiting_for_the_engine_thread(stub, 1)
            if leaves == "cancel":
                call.cancel()
                code = await call.code()
            else:
                code = (await rpc_error(call)).code()

            async def left() -> bool:
                return await load_counts(stub) == (0, 0)

            await eventually(left, what="the embed out of GetLoad's counts")
            aborted = await stub.Abort(pb.AbortRequest(request_id="gone"))
        after = await stub.Embed(pb.EmbedRequest(context=context("after"), inputs=AFTER_INPUT))
        metrics = await metrics_text(engine)
    assert code == (
        grpc.StatusCode.CANCELLED if leaves == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED
    )
    assert aborted.status == pb.ABORT_STATUS_ALREADY_FINISHED
    assert len(after.outputs) == 1
    assert forward_tokens(metrics, "embed") == 3


async def test_a_drain_aborting_at_its_deadline_drops_a_waiting_embed(builtin_dir: Path) -> None:
    """Drain(deadline 0, abort_after_deadline) with an Embed waiting for the engine thread:
    the call ends CANCELLED and leaves GetLoad's counts while the thread is still held, the
    drain completes, and the embed's forward never runs (the drain's own abort is an
    engine-thread command queued after it, so the drain completes only after it would have
    run)."""
    config = engine_config(builtin_dir, metrics_listen="127.0.0.1:0")
    drain_request = pb.DrainRequest(
        stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
    )
    async with running_engine(config) as engine:
        service, stub = engine.app.service, engine.stub
        async with engine_thread_held(service):
            call = stub.Embed(pb.EmbedRequest(context=context("w"), inputs=WAITING_INPUT))
            await waiting_for_the_engine_thread(stub, 1)
            drain = asyncio.ensure_future(collect_drain(stub, drain_request))
            error = await rpc_error(call)
            counts = await load_counts(stub)
        states = await drain
        metrics = await metrics_text(engine)
    assert error.code() == grpc.StatusCode.CANCELLED
    assert counts == (0, 0)
    assert states[0] == pb.DRAIN_STATE_STARTED and states[-1] == pb.DRAIN_STATE_COMPLETE
    assert forward_tokens(metrics, "embed") == 0


async def collect_drain(stub: Any, request: pb.DrainRequest) -> list[Any]:
    return [response.state async for response in stub.Drain(request)]


async def test_a_model_producing_nan_fails_the_task_instead_of_sending_it(
    builtin_dir: Path,
) -> None:
    """The seed's tensors are finite: a model whose output turned NaN (its final norm's
    weights corrupted here, in the running engine) fails Embed and Score with INTERNAL, a
    one-line message, rather than sending NaN."""
    async with running_engine(engine_config(builtin_dir)) as engine:
        runner = engine.app.service.engine_loop.core.runner
        assert isinstance(runner, TorchModelRunner)  # a builtin model: the torch runner
        weights = runner.model.weights
        with torch.inference_mode():
            weights.final_norm.fill_(float("nan"))
        inputs = [ids_input("a", [5, 6, 7]), ids_input("b", [8, 9])]
        embed = await rpc_error(
            engine.stub.Embed(pb.EmbedRequest(context=context("e"), inputs=inputs))
        )
        group = pb.ScoreGroup(group_id="g", query=inputs[0], candidates=inputs[1:])
        score = await rpc_error(
            engine.stub.Score(pb.ScoreRequest(context=context("s"), groups=[group]))
        )
        assert engine.app.service.num_running_tasks == 0
    for error in (embed, score):
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "non-finite" in (error.details() or "")
        assert "Traceback" not in (error.details() or "")


async def test_classify_equals_hf_transformers_sequence_classification(
    classifier_dir: Path,
) -> None:
    """HF's LlamaForSequenceClassification on the same checkpoint (its `score` head on the
    last token) gives the probabilities the engine returns."""
    import importlib

    transformers: Any = importlib.import_module("transformers")
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(classifier_dir), local_files_only=True, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"]  # the head was loaded, not made up (lm_head is extra)
    model.eval()
    inputs = prompts()[1:4]
    with torch.inference_mode():
        want = [model(input_ids=torch.tensor([ids])).logits[0].softmax(-1) for ids in inputs]
    async with running_engine(engine_config(classifier_dir)) as engine:
        response = await engine.stub.Classify(
            pb.ClassifyRequest(
                context=context(), inputs=[ids_input(f"i{n}", ids) for n, ids in enumerate(inputs)]
            )
        )
    assert [model.config.id2label[i] for i in range(3)] == LABELS
    for output, expected in zip(response.outputs, want, strict=True):
        assert close(values(output.scores), expected.double())
