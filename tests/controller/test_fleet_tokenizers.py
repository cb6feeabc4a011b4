"""Text prompts are tokenised with their model's tokenizer (`tokenizers:`), else the default
(`tokenizer:`), else not at all: then they are routed without prefix knowledge, and the admin
explanation says so. Real engines and controller; tokenizers built here (no model files)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from kvplane.cli import app
from kvplane.tokenize import INLINE_TOKENIZE_MAX_CHARS
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

WORDS = [f"w{i}" for i in range(64)]  # 64 tokens for the word tokenizer: 4 blocks of 16
TEXT = " ".join([*WORDS, "w99"])


def word_tokenizer(path: Path) -> Path:
    """One token per word `wN` (id N)."""
    vocab = {f"w{i}": i for i in range(100)} | {"[UNK]": 100}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def char_tokenizer(path: Path) -> Path:
    """One token per character: the same text, other tokens."""
    vocab = {c: 200 + i for i, c in enumerate("w0123456789")} | {"[UNK]": 199}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(path))
    return path


async def test_each_model_uses_its_own_tokenizer(tmp_path: Path) -> None:
    fleet = await make_fleet(
        2,
        tokenizers={"sim": str(word_tokenizer(tmp_path / "sim.json"))},
        tokenizer=str(char_tokenizer(tmp_path / "default.json")),
    )
    try:
        word_ids = list(range(64))
        [r async for r in fleet.gateway.Generate(generate_request("a", [*word_ids, 1]))]

        async def match(model: str) -> apb.MatchResponse:
            return await fleet.admin.Match(apb.PromptQuery(prompt=TEXT, model=model))

        async with asyncio.timeout(30):
            for _ in itertools.count():  # until the KV events reach the index
                sim = await match("sim")
                if any(m.device_blocks == 4 for m in sim.matches):
                    break
                await asyncio.sleep(0.02)
        assert sim.tokenized and sim.num_prompt_tokens == 65 and sim.num_blocks == 4

        # No model named: the fleet's default model's tokenizer (sim's, that of the engine
        # serving it), not the controller-wide one (one token per character, which would
        # match nothing the engines hold); the router sees the cache.
        default = await match("")
        assert default.tokenized and default.num_prompt_tokens == 65
        assert any(m.device_blocks == 4 for m in default.matches)
        route = await fleet.admin.Route(apb.PromptQuery(prompt=TEXT))
        assert route.tokenized and route.predicted_cached_tokens == 64

        # A prompt over the inline limit is tokenised in a worker thread, with the same result.
        long_text = " ".join([TEXT] * 10)
        assert len(long_text) > INLINE_TOKENIZE_MAX_CHARS
        long = await fleet.admin.Match(apb.PromptQuery(prompt=long_text, model="sim"))
        assert long.tokenized and long.num_prompt_tokens == 650
        assert any(m.device_blocks == 4 for m in long.matches)
    finally:
        await close_fleet(fleet)


async def test_an_alias_is_tokenised_as_the_model_it_names(tmp_path: Path) -> None:
    """A request naming an alias of a model (`served_model_aliases`) is split by that model's
    tokenizer, as the engines serving it split it, not by the controller-wide one: the router
    sees what they hold."""
    engines = [await start_sim_engine(f"e{i}", served_model_aliases=["sim-v1"]) for i in (0, 1)]
    fleet = await make_fleet(
        engines=engines,
        tokenizers={"sim": str(word_tokenizer(tmp_path / "sim.json"))},
        tokenizer=str(char_tokenizer(tmp_path / "default.json")),
    )
    try:
        [r async for r in fleet.gateway.Generate(generate_request("a", [*range(64), 1]))]

        async def held() -> bool:
            reply = await fleet.admin.Match(apb.PromptQuery(prompt=TEXT, model="sim"))
            return any(m.device_blocks == 4 for m in reply.matches)

        await eventually(held)
        alias = await fleet.admin.Match(apb.PromptQuery(prompt=TEXT, model="sim-v1"))
        assert alias.tokenized and alias.num_prompt_tokens == 65
        assert any(m.device_blocks == 4 for m in alias.matches)
        route = await fleet.admin.Route(apb.PromptQuery(prompt=TEXT, model="sim-v1"))
        assert route.predicted_cached_tokens == 64
    finally:
        await close_fleet(fleet)


async def test_tokenizer_builtin_is_the_builtin_models_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokenizer: builtin` in a controller's own config (not only through `kvplane up`)."""
    from engine.torch_runner.builtin_model import ensure_builtin_model

    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    fleet = await make_fleet(1, tokenizer="builtin")
    try:
        reply = await fleet.admin.Match(apb.PromptQuery(prompt=TEXT, model="sim"))
    finally:
        await close_fleet(fleet)
    builtin = Tokenizer.from_file(str(ensure_builtin_model(tmp_path) / "tokenizer.json"))
    assert reply.tokenized
    assert reply.num_prompt_tokens == len(builtin.encode(TEXT).ids)


async def test_without_a_tokenizer_text_is_routed_blind_and_route_says_so(fleet: Fleet) -> None:
    reply = await fleet.admin.Route(apb.PromptQuery(prompt=TEXT, model="sim"))
    assert not reply.tokenized and reply.predicted_cached_tokens == 0
    result = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["admin", "route", "--prompt", TEXT, "--model", "sim", "--target", fleet.target],
    )
    assert result.exit_code == 0, result.output
    assert "not tokenized: no tokenizer configured for model 'sim'" in result.output
    assert "routed without prefix knowledge" in result.output


def _text_request(request_id: str, text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        model="sim",
        prompt=text,
        stopping=pb.StoppingOptions(max_tokens=2, ignore_eos=True),
    )


async def test_a_huge_text_prompt_is_routed_without_stalling_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over `tokenize_max_chars` (1 MiB by default) a text prompt is routed by load without
    tokenising it (seconds of work that would stall the event loop: other requests, polls,
    Aborts); the engine still gets the whole prompt and answers (the sim engine has no
    tokenizer: it refuses the text). What the tokenizer is given is recorded, not how long the
    loop stalled: a wall-clock bound fails on a loaded machine."""
    fleet = await make_fleet(
        1,
        tokenizers={"sim": str(char_tokenizer(tmp_path / "sim.json"))},
    )
    tokenizers = fleet.app.controller._tokenizers
    encode = tokenizers.encode
    encoded_lengths: list[int] = []

    def recording_encode(prompt: str, model: str) -> list[int] | None:
        encoded_lengths.append(len(prompt))
        return encode(prompt, model)

    monkeypatch.setattr(tokenizers, "encode", recording_encode)
    try:
        text = "w1" * 750_000  # 1.5 M characters, one token each
        route = await fleet.admin.Route(apb.PromptQuery(prompt=text, model="sim"))
        assert not route.tokenized
        assert route.engine  # routed all the same

        async def generate() -> str:
            try:
                [r async for r in fleet.gateway.Generate(_text_request("big", text))]
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            return "answered"

        answer = await generate()
        assert answer == "INVALID_ARGUMENT: this engine has no tokenizer: send token_ids"
        # The same prompt under the limit is tokenised: the recording sees what it should.
        short = await fleet.admin.Route(apb.PromptQuery(prompt=TEXT, model="sim"))
        assert short.tokenized
        assert encoded_lengths == [len(TEXT)]
    finally:
        await close_fleet(fleet)
