"""The LoRA lifecycle over gRPC on sim engines (bookkeeping only: the adapter's config is
checked, no weights are read): LoadLora/UnloadLora/ListLoras statuses as the seed says, a
Generate naming an adapter, prefix-cache namespaces, and unloading an adapter in use."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.config import LoraConfig, SimTimingConfig
from engine.core.engine_core import EngineCore
from engine.core.sim_runner import SimRunner
from indexer.keys import block_keys
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    generate_request,
    rpc_error,
    running_engine,
    sim_config,
    stream_error,
)
from tests.engine.lora_adapters import write_adapter_config

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(10, 19))  # two full blocks of 4, and one token


def lora_config(**lora: int) -> LoraConfig:
    return LoraConfig(enabled=True, **lora)


def load(
    engine: Engine, name: str, path: Path | str, lora_id: int
) -> grpc.aio.UnaryUnaryCall[pb.LoadLoraRequest, pb.LoadLoraResponse]:
    adapter = pb.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=str(path))
    return engine.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))


async def names(engine: Engine) -> list[str]:
    reply = await engine.stub.ListLoras(pb.ListLorasRequest())
    return [a.lora_name for a in reply.adapters]


def usage(responses: list[pb.GenerateResponse]) -> pb.Usage:
    return next(r.usage for r in responses if r.HasField("usage"))


async def test_load_list_unload_follow_the_seed(tmp_path: Path) -> None:
    x = write_adapter_config(tmp_path / "x")
    y = write_adapter_config(tmp_path / "y", r=4, use_rslora=True)
    async with running_engine(sim_config(lora=lora_config(max_loras=2))) as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        assert info.HasField("supports_lora") and info.supports_lora
        loaded = await load(engine, "x", x, 7)
        assert not loaded.already_loaded
        assert (loaded.adapter.lora_id, loaded.adapter.lora_name) == (7, "x")
        assert loaded.adapter.source_path == str(x)
        again = await load(engine, "x", x, 7)  # the same triple: idempotent
        assert again.already_loaded and again.adapter == loaded.adapter
        for name, path, lora_id in (("x", y, 7), ("x", x, 8), ("z", x, 9), ("z", y, 7)):
            err = await rpc_error(load(engine, name, path, lora_id))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS, (name, path, lora_id)
            assert "conflicts with loaded adapter 'x'" in (err.details() or "")
        await load(engine, "y", y, 3)
        assert await names(engine) == ["y", "x"]  # by id
        full = await rpc_error(load(engine, "z", write_adapter_config(tmp_path / "z"), 9))
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_loras" in (full.details() or "")

        gone = await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert gone.adapter == loaded.adapter
        assert await names(engine) == ["y"]
        unknown = await rpc_error(engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x")))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND
        # A malformed request, as LoadLora's empty name (and vLLM's 400), not an unknown one.
        nameless = await rpc_error(engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="")))
        assert nameless.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert nameless.details() == "lora_name must be non-empty"
        _, refused = await stream_error(
            engine.stub.Generate(generate_request(PROMPT, lora_name="x"))
        )
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        assert refused.details() == "LoRA adapter 'x' is not loaded"
        # Loaded again under a new id once unloaded.
        assert not (await load(engine, "x", x, 8)).already_loaded


@pytest.mark.parametrize(
    ("fault", "status", "detail"),
    [
        ("id", grpc.StatusCode.INVALID_ARGUMENT, "lora_id must be positive"),
        ("name", grpc.StatusCode.INVALID_ARGUMENT, "lora_name must be non-empty"),
        ("relative", grpc.StatusCode.INVALID_ARGUMENT, "absolute directory"),
        ("missing dir", grpc.StatusCode.INVALID_ARGUMENT, "does not exist or is not a directory"),
        ("no config", grpc.StatusCode.INVALID_ARGUMENT, "not a PEFT adapter directory"),
        ("bad json", grpc.StatusCode.INVALID_ARGUMENT, "cannot read"),
        # A config that is no regular file once blocked every LoRA call (a FIFO) or read until
        # memory ran out (/dev/zero); one far larger than any PEFT writes is refused unread.
        ("fifo", grpc.StatusCode.INVALID_ARGUMENT, "adapter_config.json is not a regular file"),
        ("device", grpc.StatusCode.INVALID_ARGUMENT, "adapter_config.json is not a regular file"),
        ("huge", grpc.StatusCode.INVALID_ARGUMENT, "is larger than 1048576 bytes"),
        ("no rank", grpc.StatusCode.INVALID_ARGUMENT, "r must be a positive integer"),
        ("dora", grpc.StatusCode.INVALID_ARGUMENT, "DoRA"),
        ("rank", grpc.StatusCode.FAILED_PRECONDITION, "rank 32 is above"),
        ("module", grpc.StatusCode.FAILED_PRECONDITION, "embed_tokens, lm_head not supported"),
        # Expressions Python's `re` refuses with another error than re.error: they were INTERNAL.
        ("repeat", grpc.StatusCode.INVALID_ARGUMENT, "is not a regular expression: the rep"),
        ("nesting", grpc.StatusCode.INVALID_ARGUMENT, "is not a regular expression: maximum"),
        ("lora bias", grpc.StatusCode.INVALID_ARGUMENT, "lora_bias is not supported"),
    ],
)
async def test_bad_adapters_are_refused_naming_the_problem(
    tmp_path: Path, fault: str, status: grpc.StatusCode, detail: str
) -> None:
    path, lora_id, name = tmp_path / "a", 1, "a"
    write_adapter_config(path)
    if fault == "id":
        lora_id = 0
    elif fault == "name":
        name = ""
    elif fault == "relative":
        path = Path("a")
    elif fault == "missing dir":
        path = tmp_path / "nowhere"
    elif fault == "no config":
        (path / "adapter_config.json").unlink()
    elif fault == "bad json":
        (path / "adapter_config.json").write_text("{")
    elif fault in ("fifo", "device"):
        (path / "adapter_config.json").unlink()
        if fault == "fifo":
            os.mkfifo(path / "adapter_config.json")
        else:
            (path / "adapter_config.json").symlink_to("/dev/zero")
    elif fault == "huge":
        write_adapter_config(path, padding="x" * (1 << 21))  # valid JSON, 2 MiB
    elif fault == "no rank":
        write_adapter_config(path, r=None)
    elif fault == "dora":
        write_adapter_config(path, use_dora=True)
    elif fault == "rank":
        write_adapter_config(path, r=32)
    elif fault == "module":
        write_adapter_config(path, target_modules=["lm_head", "embed_tokens"])
    elif fault == "repeat":
        write_adapter_config(path, target_modules=r".*\.q_proj{99999999999}")
    elif fault == "nesting":
        write_adapter_config(path, target_modules="(" * 5000 + "q_proj" + ")" * 5000)
    elif fault == "lora bias":
        write_adapter_config(path, lora_bias=True)
    async with running_engine(sim_config(lora=lora_config())) as engine:
        err = await rpc_error(load(engine, name, path, lora_id))
        assert err.code() == status
        assert detail in (err.details() or "")
        assert await names(engine) == []


async def test_a_path_is_one_directory_however_it_is_spelled(tmp_path: Path) -> None:
    """`x/`, `./x` and `x` are one directory: the same triple spelled so is idempotent, and
    another name over it conflicts (the seed: a conflicting path is ALREADY_EXISTS), rather
    than loading one adapter twice under two names."""
    x = write_adapter_config(tmp_path / "x")
    async with running_engine(sim_config(lora=lora_config(max_loras=3))) as engine:
        await load(engine, "x", x, 7)
        assert (await load(engine, "x", f"{x}/", 7)).already_loaded
        for name, path, lora_id in (("y", f"{x}/", 8), ("z", f"{tmp_path}/./x", 9)):
            err = await rpc_error(load(engine, name, path, lora_id))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS, (name, path, err.details())
            assert "conflicts with loaded adapter 'x'" in (err.details() or "")
        assert await names(engine) == ["x"]


async def test_lora_disabled_by_default_refuses_every_lora_call(tmp_path: Path) -> None:
    """Each refusal says how to have LoRA (`kvplane admin lora list` against a default
    engine said only that it is not enabled)."""
    how = "LoRA is not enabled on this engine (start it with lora.enabled: true)"
    async with running_engine() as engine:
        err = await rpc_error(load(engine, "x", write_adapter_config(tmp_path / "x"), 1))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details() == how
        list_err = await rpc_error(engine.stub.ListLoras(pb.ListLorasRequest()))
        assert list_err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert list_err.details() == how
        request = generate_request(PROMPT, lora_name="x")
        _, generate_err = await stream_error(engine.stub.Generate(request))
        assert generate_err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert generate_err.details() == how


async def test_adapters_namespace_the_prefix_cache_and_kv_events(tmp_path: Path) -> None:
    async with running_engine(sim_config(lora=lora_config())) as engine:
        await load(engine, "x", write_adapter_config(tmp_path / "x"), 1)
        await load(engine, "y", write_adapter_config(tmp_path / "y"), 2)
        cached = {}
        for label, lora in (("x", "x"), ("y", "y"), ("base", ""), ("x again", "x")):
            responses = await collect(engine.stub, generate_request(PROMPT, lora_name=lora))
            cached[label] = usage(responses).cached_prompt_tokens
        assert cached == {"x": 0, "y": 0, "base": 0, "x again": 8}
        snapshot = engine.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(include_snapshot=True))
        first = await anext(aiter(snapshot))
        snapshot.cancel()
        stored = [e.block_stored for e in first.batch.events if e.HasField("block_stored")]
        by_name: dict[str, set[int]] = {}
        for event in stored:
            keys = {int.from_bytes(h.value, "big", signed=True) for h in event.block_hashes}
            by_name.setdefault(event.lora_name, set()).update(keys)
        # Each namespace's blocks carry its name and the index's keys for that name (the
        # prompt's two blocks, then blocks of generated tokens); no block is shared.
        assert set(by_name) == {"x", "y", ""}
        for name, keys in by_name.items():
            assert set(block_keys(PROMPT[:8], 4, lora_name=name or None)) <= keys
        assert not (by_name["x"] & by_name["y"] or by_name["x"] & by_name[""])


async def _start_long_request(engine: Engine) -> tuple[Any, list[pb.GenerateResponse]]:
    """Cache the prompt's 2 blocks under "x", then start a 150-token request with "x": its
    stream and its first response."""
    await collect(engine.stub, generate_request(PROMPT, lora_name="x"))
    long = generate_request(PROMPT, max_tokens=150, lora_name="x", request_id="long")
    long.stopping.ignore_eos = True
    stream = engine.stub.Generate(long)
    return stream, [await anext(aiter(stream))]


async def _finish_long_request(stream: Any, responses: list[pb.GenerateResponse]) -> None:
    responses += [r async for r in stream]
    finished = [r.finished for r in responses if r.HasField("finished")]
    assert [f.reason for f in finished] == [pb.FINISH_REASON_LENGTH]
    assert usage(responses).completion_tokens == 150


SLOW_SIM = sim_config(lora=lora_config(), sim=SimTimingConfig(time_scale=1.0, vocab_size=1000))


async def test_unloading_an_adapter_in_use_lets_its_requests_finish(tmp_path: Path) -> None:
    """As vLLM: the name goes at once, the running request keeps its adapter to the end;
    another adapter loaded under the name meanwhile serves the new requests, and nothing
    cached under the old one is hit (the old request caches nothing more either)."""
    x = write_adapter_config(tmp_path / "x")
    other = write_adapter_config(tmp_path / "other")
    async with running_engine(SLOW_SIM) as engine:
        await load(engine, "x", x, 1)
        stream, responses = await _start_long_request(engine)
        await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert await names(engine) == []
        _, refused = await stream_error(
            engine.stub.Generate(generate_request(PROMPT, lora_name="x"))
        )
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        assert not (await asyncio.wait_for(load(engine, "x", other, 1), 10)).already_loaded
        again = await collect(engine.stub, generate_request(PROMPT, lora_name="x"))
        assert usage(again).cached_prompt_tokens == 0
        await _finish_long_request(stream, responses)
        runner = engine.app.service.engine_loop.core.runner
        assert isinstance(runner, SimRunner)
        assert len(runner.loras) == 1  # the old request ended: its weights went with it
        after = await collect(engine.stub, generate_request(PROMPT, lora_name="x"))
        assert usage(after).cached_prompt_tokens == 8  # the new adapter's own blocks


async def test_an_adapter_unloaded_in_use_keeps_its_place_until_its_requests_end(
    tmp_path: Path,
) -> None:
    """Its requests still hold its weights: it counts against max_loras until they end."""
    x = write_adapter_config(tmp_path / "x")
    y = write_adapter_config(tmp_path / "y")
    config = sim_config(
        lora=lora_config(max_loras=1), sim=SimTimingConfig(time_scale=1.0, vocab_size=1000)
    )
    async with running_engine(config) as engine:
        await load(engine, "x", x, 1)
        stream, responses = await _start_long_request(engine)
        await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        full = await rpc_error(load(engine, "y", y, 2))
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 unloaded ones still serve requests" in (full.details() or "")
        await _finish_long_request(stream, responses)
        assert not (await asyncio.wait_for(load(engine, "y", y, 2), 10)).already_loaded


async def test_the_same_adapter_loaded_back_while_its_requests_run_is_served_again(
    tmp_path: Path,
) -> None:
    """Unloaded while a request uses it, then loaded back as the same triple: accepted (it
    is the same adapter), the request runs on, new requests use it (its cached blocks still
    hit), and its weights stay once the old request ends."""
    x = write_adapter_config(tmp_path / "x")
    async with running_engine(SLOW_SIM) as engine:
        await load(engine, "x", x, 1)
        stream, responses = await _start_long_request(engine)
        await engine.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        reloaded = await load(engine, "x", f"{x}/", 1)  # another spelling of the directory
        assert not reloaded.already_loaded
        assert await names(engine) == ["x"]
        again = await collect(engine.stub, generate_request(PROMPT, lora_name="x"))
        assert usage(again).cached_prompt_tokens == 8
        await _finish_long_request(stream, responses)
        runner = engine.app.service.engine_loop.core.runner
        assert isinstance(runner, SimRunner)
        assert len(runner.loras) == 1  # the last old request took no weights away
        after = await collect(engine.stub, generate_request(PROMPT, lora_name="x"))
        assert usage(after).cached_prompt_tokens == 8
        assert (await load(engine, "x", x, 1)).already_loaded


async def test_a_request_whose_adapter_is_unloaded_as_it_is_added_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of one call: the request was accepted, then its adapter was unloaded before
    the engine thread added it (pinned here by unloading in the engine thread just before the
    add). As vLLM, whose request carries its adapter, it is served to its end with the adapter
    it was accepted with, whose weights go once it ends."""
    x = write_adapter_config(tmp_path / "x")
    async with running_engine(sim_config(lora=lora_config())) as engine:
        await load(engine, "x", x, 1)
        loop = engine.app.service.engine_loop
        submit = loop.submit

        def unloaded_as_added(
            request: Any, sink: Any, *, before: Any = None, **options: Any
        ) -> None:
            def unload_first(core: EngineCore) -> None:
                core.unload_lora("x")
                if before is not None:
                    before(core)

            submit(request, sink, before=unload_first, **options)

        monkeypatch.setattr(loop, "submit", unloaded_as_added)
        responses = await collect(engine.stub, generate_request(PROMPT, lora_name="x"))
        assert [r for r in responses if r.HasField("error")] == []
        finished = [r.finished for r in responses if r.HasField("finished")]
        assert [f.reason for f in finished] == [pb.FINISH_REASON_LENGTH]
        assert await names(engine) == []
        runner = loop.core.runner
        assert isinstance(runner, SimRunner)
        assert runner.loras == {}
