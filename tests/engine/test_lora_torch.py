"""LoRA on the torch runner, with small random PEFT adapters written for the builtin tiny
Llama: greedy output with an adapter equals the output of the model with the adapter merged
into its weights (and differs from the base model's); a mixed batch gives every request the
tokens it gets alone; prefix hits never cross adapters; adapters that do not fit the model are
refused naming the problem; an adapter unloaded in use keeps serving its running request."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, LoraConfig
from engine.core.api import EngineRequest, SamplingParams, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.lora import LoraAdapter
from engine.torch_runner.builtin_model import ensure_builtin_model
from engine.torch_runner.runner import TorchModelRunner
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import Engine, collect, rpc_error, running_engine
from tests.engine.lora_adapters import (
    merged_model,
    module_shapes,
    write_adapter,
    write_adapter_config,
)
from tests.engine.torch_reference import TEST_DEVICE

pytestmark = pytest.mark.timeout(180)

PROMPT = list(range(20, 60))  # 40 tokens: two full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("models"))


def torch_config(model_dir: Path, *, lora: bool = True, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "model": str(model_dir),
        "listen": "127.0.0.1:0",
        "served_model_name": "m",
        "block_size": 16,
        "num_kv_blocks": 128,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "num_threads": 1,
        "shutdown_grace_s": 1.0,
        "device": TEST_DEVICE,
        "lora": LoraConfig(enabled=lora),
    }
    values.update(overrides)
    return EngineConfig(**values)


def greedy(prompt: list[int], *, lora: str = "", max_tokens: int = 24) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model="m",
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        response=pb.ResponseOptions(return_output_logprobs=True),
        lora_name=lora,
    )


def tokens_and_logprobs(responses: list[pb.GenerateResponse]) -> tuple[list[int], list[float]]:
    infos = [t for r in responses if r.HasField("token") for t in r.token.tokens]
    return [t.token_id for t in infos], [t.logprob for t in infos]


def cached(responses: list[pb.GenerateResponse]) -> int:
    return next(r.usage for r in responses if r.HasField("usage")).cached_prompt_tokens


async def load(engine: Engine, name: str, path: Path, lora_id: int) -> pb.LoadLoraResponse:
    adapter = pb.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=str(path))
    return await engine.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))


async def refused(engine: Engine, cases: list[tuple[Path, grpc.StatusCode, str]]) -> None:
    """Each adapter directory's LoadLora fails with its status, the details holding its text."""
    for lora_id, (path, status, detail) in enumerate(cases, start=1):
        err = await rpc_error(load(engine, path.name, path, lora_id))
        assert (err.code(), path.name) == (status, path.name), err.details()
        assert detail in (err.details() or ""), err.details()


@pytest.mark.parametrize(
    "adapter",
    [
        {"rank": 8, "alpha": 16},
        {"rank": 4, "alpha": 8, "modules": ("q_proj", "v_proj", "down_proj"), "use_rslora": True},
    ],
    ids=["every-module", "some-modules-rslora"],
)
async def test_adapter_output_equals_the_merged_model_and_differs_from_the_base(
    base_model: Path, tmp_path: Path, adapter: dict[str, Any]
) -> None:
    x = write_adapter(tmp_path / "x", base_model, b_scale=0.2, **adapter)
    merged = merged_model(base_model, x, tmp_path / "merged")
    async with running_engine(torch_config(base_model)) as engine:
        await load(engine, "x", x, 1)
        with_lora = tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT, lora="x")))
        base = tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT)))
    async with running_engine(torch_config(merged, lora=False)) as engine:
        reference = tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT)))
    assert with_lora[0] == reference[0]
    assert with_lora[1] == pytest.approx(reference[1], abs=1e-4)
    assert with_lora[0] != base[0]


def _run(core: EngineCore, requests: list[EngineRequest]) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens, and the size of the first step's batch."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first_batch = None
    while core.has_work():
        result = core.step()
        if first_batch is None and result.stats is not None:
            first_batch = result.stats.batch_size
        for output in result.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert first_batch is not None
    return tokens, first_batch


@pytest.mark.parametrize("native_kernels", [False, None], ids=["torch-ops", "native-if-built"])
def test_a_mixed_batch_gives_each_request_its_tokens_alone(
    base_model: Path, tmp_path: Path, native_kernels: bool | None
) -> None:
    x = write_adapter(tmp_path / "x", base_model, b_scale=0.2, seed=1)
    y = write_adapter(tmp_path / "y", base_model, b_scale=0.2, seed=2, rank=4, modules=("o_proj",))
    runner = TorchModelRunner.from_pretrained(
        base_model, block_size=16, num_blocks=128, num_threads=1, native_kernels=native_kernels
    )
    weights = {name: runner.read_lora(path, max_rank=16) for name, path in (("x", x), ("y", y))}

    def core() -> EngineCore:
        engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=1024), max_loras=4)
        for lora_id, name in enumerate(("x", "y"), start=1):
            path = str(x if name == "x" else y)
            engine.load_lora(LoraAdapter(lora_id, name, path), weights[name])
        return engine

    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT, PROMPT[5:], list(range(100, 130)), PROMPT[3:]]
    # x's rows are not contiguous (requests 0 and 3), y's and the base's are.
    requests = [
        EngineRequest(f"r{i}", tuple(prompt), sampling, lora_name=lora)
        for i, (prompt, lora) in enumerate(zip(prompts, ("x", "y", None, "x"), strict=True))
    ]
    together, batch_size = _run(core(), requests)
    assert batch_size == 4
    for request in requests:
        alone, _ = _run(core(), [request])
        assert together[request.request_id] == alone[request.request_id], request.request_id
    # The adapters do change what is generated.
    assert together["r0"] != _run(core(), [EngineRequest("b", tuple(PROMPT), sampling)])[0]["b"]
    assert together["r1"] != _run(core(), [EngineRequest("b", tuple(PROMPT[5:]), sampling)])[0]["b"]


async def test_prefix_hits_never_cross_adapters(base_model: Path, tmp_path: Path) -> None:
    x = write_adapter(tmp_path / "x", base_model, b_scale=0.2, seed=1)
    y = write_adapter(tmp_path / "y", base_model, b_scale=0.2, seed=2)
    async with running_engine(torch_config(base_model)) as engine:
        await load(engine, "x", x, 1)
        await load(engine, "y", y, 2)
        first = await collect(engine.stub, greedy(PROMPT, lora="x"))
        others = [await collect(engine.stub, greedy(PROMPT, lora=name)) for name in ("y", "")]
        again = await collect(engine.stub, greedy(PROMPT, lora="x"))
    assert [cached(r) for r in (first, *others, again)] == [0, 0, 0, 32]
    # The hit served x's KV: the same tokens as computed from scratch.
    assert tokens_and_logprobs(again)[0] == tokens_and_logprobs(first)[0]
    assert tokens_and_logprobs(others[0])[0] != tokens_and_logprobs(first)[0]


async def test_adapters_that_do_not_fit_the_model_are_refused(
    base_model: Path, tmp_path: Path
) -> None:
    shapes = module_shapes(base_model)
    wrong = {**shapes, "k_proj": (shapes["k_proj"][0], shapes["k_proj"][1] * 2)}
    mismatched = write_adapter(tmp_path / "mismatched", base_model, shapes=wrong)
    no_weights = write_adapter(tmp_path / "no-weights", base_model)
    (no_weights / "adapter_model.safetensors").unlink()
    # Weights for a module the config does not target.
    untargeted = write_adapter(tmp_path / "untargeted", base_model, modules=("q_proj", "k_proj"))
    (untargeted / "adapter_config.json").write_text(
        (untargeted / "adapter_config.json").read_text().replace('"k_proj"', '"v_proj"')
    )
    # The tensors' rank (8) is not the config's (4).
    wrong_rank = write_adapter(tmp_path / "wrong-rank", base_model)
    (wrong_rank / "adapter_config.json").write_text(
        (wrong_rank / "adapter_config.json").read_text().replace('"r": 8', '"r": 4')
    )
    big = write_adapter(tmp_path / "big", base_model, rank=32)
    cases = [
        (mismatched, grpc.StatusCode.FAILED_PRECONDITION, "k_proj: shape mismatch"),
        (no_weights, grpc.StatusCode.INVALID_ARGUMENT, "adapter_model.safetensors does not"),
        (untargeted, grpc.StatusCode.INVALID_ARGUMENT, "which target_modules does not list"),
        (wrong_rank, grpc.StatusCode.INVALID_ARGUMENT, "do not have the config's rank r=4"),
        (big, grpc.StatusCode.FAILED_PRECONDITION, "rank 32 is above"),
    ]
    async with running_engine(torch_config(base_model)) as engine:
        await refused(engine, cases)
        listed = await engine.stub.ListLoras(pb.ListLorasRequest())
        assert list(listed.adapters) == []


async def test_target_modules_are_read_as_peft_reads_them(base_model: Path, tmp_path: Path) -> None:
    """PEFT (and vLLM, which takes the weights' names as the truth) ignores a listed module the
    model lacks and reads a string as a regular expression over the modules' full names: such
    adapters load and serve what the plain list serves. Weights of a module the engine does
    not adapt (the LM head) do not fit the engine; a regex that leaves a tensor's module out
    is a malformed adapter."""
    listed = write_adapter(tmp_path / "listed", base_model, modules=("q_proj", "v_proj"), seed=3)

    def variant(name: str, target_modules: Any) -> Path:
        directory = shutil.copytree(listed, tmp_path / name)
        return write_adapter_config(directory, target_modules=target_modules)

    lacking = variant("lacking", ["q_proj", "v_proj", "query_key_value"])
    regex = variant("regex", r".*\.(q_proj|v_proj)")
    named = write_adapter(tmp_path / "named", base_model, modules=("q_proj",), seed=3)
    write_adapter_config(named, target_modules="q_proj")  # a name as a string: as before
    narrow = variant("narrow", r"model\.layers\.0\.self_attn\.q_proj")
    head = variant("head", ["q_proj", "v_proj", "lm_head"])
    tensors = load_file(str(head / "adapter_model.safetensors"))
    hidden = module_shapes(base_model)["q_proj"][0]
    vocab = json.loads((base_model / "config.json").read_text())["vocab_size"]
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, hidden)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(vocab, 8)
    save_file(tensors, str(head / "adapter_model.safetensors"))
    async with running_engine(torch_config(base_model)) as engine:
        outputs = {}
        await load(engine, "named", named, 6)
        for lora_id, path in enumerate((listed, lacking, regex), start=1):
            await load(engine, path.name, path, lora_id)
            responses = await collect(engine.stub, greedy(PROMPT, lora=path.name))
            outputs[path.name] = tokens_and_logprobs(responses)[0]
        base = tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT)))[0]
        err = await rpc_error(load(engine, "head", head, 4))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "adapts lm_head, which this engine does not adapt" in (err.details() or "")
        err = await rpc_error(load(engine, "narrow", narrow, 5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layers.0.self_attn.v_proj.lora_A.weight' adapts v_proj" in (err.details() or "")
    assert outputs["lacking"] == outputs["listed"] == outputs["regex"] != base


async def test_adapters_the_engine_cannot_serve_as_written_are_refused_safely(
    base_model: Path, tmp_path: Path
) -> None:
    """A `target_modules` regular expression comes with the adapter: one that backtracks
    catastrophically on a module's name (hours with Python's `re`, which holds the process
    meanwhile) is refused at once, and the engine serves on. PEFT's `lora_bias` (a `lora_B.bias`
    per module) is an unsupported option, not a module the engine does not adapt."""
    plain = write_adapter(tmp_path / "plain", base_model, modules=("q_proj",), seed=5)
    costly = shutil.copytree(plain, tmp_path / "costly")
    write_adapter_config(costly, target_modules="(.*?)" * 12 + r"\d\1")
    biased = shutil.copytree(plain, tmp_path / "biased")
    write_adapter_config(biased, target_modules=["q_proj"], lora_bias=True)
    tensors = load_file(str(plain / "adapter_model.safetensors"))
    out_features = module_shapes(base_model)["q_proj"][1]
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.zeros(
        out_features
    )
    save_file(tensors, str(biased / "adapter_model.safetensors"))
    bias_unstated = shutil.copytree(biased, tmp_path / "bias-unstated")
    write_adapter_config(bias_unstated, target_modules=["q_proj"])
    cases = [
        (costly, grpc.StatusCode.INVALID_ARGUMENT, "backtracks catastrophically"),
        (biased, grpc.StatusCode.INVALID_ARGUMENT, "lora_bias is not supported"),
        (bias_unstated, grpc.StatusCode.INVALID_ARGUMENT, "q_proj.lora_B.bias' in the adapter"),
    ]
    async with running_engine(torch_config(base_model)) as engine:
        await refused(engine, cases)
        await load(engine, "plain", plain, 9)
        assert tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT, lora="plain")))[0]


async def test_an_adapter_unloaded_in_use_serves_its_request_to_the_end(
    base_model: Path, tmp_path: Path
) -> None:
    """The same adapter loaded back meanwhile is served again, the request running on with
    the same weights."""
    x = write_adapter(tmp_path / "x", base_model, b_scale=0.2, seed=3)
    request = greedy(PROMPT, lora="x", max_tokens=400)
    async with running_engine(torch_config(base_model, max_model_len=1024)) as engine:
        await load(engine, "x", x, 1)
        stream = engine.stub.Generate(request)
        responses = [await anext(aiter(stream))]
        await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert not (await asyncio.wait_for(load(engine, "x", x, 1), 10)).already_loaded
        responses += [r async for r in stream]
        fresh = await collect(engine.stub, request)
    assert tokens_and_logprobs(responses)[0] == tokens_and_logprobs(fresh)[0]
    assert len(tokens_and_logprobs(fresh)[0]) == 400


async def test_a_name_loaded_with_other_weights_serves_new_requests_with_them_alone(
    base_model: Path, tmp_path: Path
) -> None:
    """Unloaded while a request uses it, then loaded from another path: new requests get the
    new weights, the running request keeps the old ones to its end (and no prefix hit mixes
    the two)."""
    x = write_adapter(tmp_path / "x", base_model, b_scale=0.2, seed=3)
    other = write_adapter(tmp_path / "other", base_model, b_scale=0.2, seed=4)
    request = greedy(PROMPT, lora="x", max_tokens=400)
    short = greedy(PROMPT, lora="x")
    async with running_engine(torch_config(base_model, max_model_len=1024)) as engine:
        await load(engine, "other", other, 2)
        with_other = tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT, lora="other")))
        await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="other"))
        await load(engine, "x", x, 1)
        alone = await collect(engine.stub, request)
        stream = engine.stub.Generate(request)
        responses = [await anext(aiter(stream))]
        await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert not (await asyncio.wait_for(load(engine, "x", other, 1), 10)).already_loaded
        renamed = await collect(engine.stub, short)
        responses += [r async for r in stream]
        again = await collect(engine.stub, short)
    assert tokens_and_logprobs(responses)[0] == tokens_and_logprobs(alone)[0]
    assert tokens_and_logprobs(renamed)[0] == with_other[0] == tokens_and_logprobs(again)[0]
    assert with_other[0] != tokens_and_logprobs(alone)[0][:24]
    assert cached(renamed) == 0  # the old adapter's blocks are never hit under the new one


async def test_a_request_accepted_before_its_adapter_is_unloaded_is_served_with_it(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepted, then its adapter unloaded (and another loaded under its name) before the
    engine thread adds it (pinned by doing so on the engine thread just before the add): it
    is served with the adapter it was accepted with, to its end."""
    x = write_adapter(tmp_path / "x", base_model, b_scale=0.2, seed=3)
    other = write_adapter(tmp_path / "other", base_model, b_scale=0.2, seed=4)
    other_weights = TorchModelRunner.read_lora  # read on the engine thread below
    request = greedy(PROMPT, lora="x")
    async with running_engine(torch_config(base_model)) as engine:
        await load(engine, "x", x, 1)
        alone = tokens_and_logprobs(await collect(engine.stub, request))
        base = tokens_and_logprobs(await collect(engine.stub, greedy(PROMPT)))
        loop = engine.app.service.engine_loop
        submit = loop.submit

        def replaced_as_added(
            request: Any, sink: Any, *, before: Any = None, **options: Any
        ) -> None:
            def replace_first(core: EngineCore) -> None:
                core.unload_lora("x")
                runner = core.runner
                assert isinstance(runner, TorchModelRunner)
                weights = other_weights(runner, other, max_rank=16)
                core.load_lora(LoraAdapter(1, "x", str(other)), weights)
                if before is not None:
                    before(core)

            submit(request, sink, before=replace_first, **options)

        monkeypatch.setattr(loop, "submit", replaced_as_added)
        responses = await collect(engine.stub, request)
    assert [r for r in responses if r.HasField("error")] == []
    assert tokens_and_logprobs(responses)[0] == alone[0] != base[0]
