"""The builtin model (`model: builtin`): built on first use, the same bytes every time, and a
real checkpoint the engine serves, text prompts included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.torch_runner.builtin_model import (
    BUILTIN_MODEL_NAME,
    ensure_builtin_model,
    write_builtin_model,
)
from engine.torch_runner.config import ModelConfig
from engine.torch_runner.errors import CheckpointError
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import collect, running_engine

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def test_two_builds_write_the_same_bytes(tmp_path: Path) -> None:
    first = write_builtin_model(tmp_path / "a")
    second = write_builtin_model(tmp_path / "b")
    assert sorted(p.name for p in first.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_ensure_builds_once_under_the_cache_and_leaves_no_scratch(tmp_path: Path) -> None:
    model = ensure_builtin_model(tmp_path)
    assert model == tmp_path / BUILTIN_MODEL_NAME
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model(tmp_path) == model
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [BUILTIN_MODEL_NAME]


def test_concurrent_first_uses_all_get_the_complete_model(tmp_path: Path) -> None:
    # Three engines starting at once on a fresh machine race to build it.
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: ensure_builtin_model(tmp_path / "cache"), range(3)))
    assert len(set(paths)) == 1
    reference = write_builtin_model(tmp_path / "reference")
    for name in FILES:
        assert (paths[0] / name).read_bytes() == (reference / name).read_bytes(), name
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [BUILTIN_MODEL_NAME]


# A first build held open until it is stopped (the real one takes a fraction of a second).
_BUILD_UNTIL_STOPPED = """
import sys, time
from pathlib import Path
from engine.torch_runner import builtin_model

def held_open(directory):
    print("building", flush=True)
    time.sleep(600)

builtin_model.write_builtin_model = held_open
builtin_model.ensure_builtin_model(Path(sys.argv[1]))
"""


def test_a_build_stopped_by_sigterm_leaves_no_scratch_in_the_cache(tmp_path: Path) -> None:
    # `kvplane up` stops engines still starting with SIGTERM: Ctrl-C during a first start.
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", _BUILD_UNTIL_STOPPED, str(cache)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    ) as build:  # fmt: skip
        assert build.stdout is not None
        assert build.stdout.readline() == b"building\n"
        assert [p.name.startswith(".") for p in cache.iterdir()] == [True]  # its scratch
        build.send_signal(signal.SIGTERM)
        _, errors = build.communicate(timeout=60)
    assert build.returncode == -signal.SIGTERM, errors  # still reads as killed by SIGTERM
    assert list(cache.iterdir()) == []


def test_an_unwritable_cache_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="KVPLANE_CACHE_DIR"):
        ensure_builtin_model(blocker / "models")


def test_the_tokenizer_round_trips_any_text_within_the_model_vocab(tmp_path: Path) -> None:
    model = ensure_builtin_model(tmp_path)
    config = ModelConfig.from_dir(model)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "You are a helpful assistant.\n\tdéjà vu — 東京 🚀 def parse(self):"
    ids = tokenizer.encode(text).ids
    assert ids and max(ids) < config.vocab_size
    assert tokenizer.decode(ids) == text
    assert tokenizer.get_vocab_size() == config.vocab_size
    assert config.eos_token_ids == (tokenizer.token_to_id("</s>"),)


@pytest.mark.timeout(120)
async def test_an_engine_serves_the_builtin_model_with_text_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    config = EngineConfig(
        model="builtin",
        listen="127.0.0.1:0",
        num_kv_blocks=64,
        num_threads=1,
        shutdown_grace_s=1.0,
    )
    prompt = "You are a helpful assistant. Answer the question below in one short paragraph."
    async with running_engine(config) as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="builtin"))
        assert info.supports_text_input
        request = pb.GenerateRequest(
            model="builtin",
            prompt=prompt,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingOptions(max_tokens=8, ignore_eos=True),
        )
        first = await collect(engine.stub, request)
        again = await collect(engine.stub, request)
    tokenizer = Tokenizer.from_file(
        str(tmp_path / "models" / BUILTIN_MODEL_NAME / "tokenizer.json")
    )

    def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
        return [
            t.token_id
            for r in responses
            if r.WhichOneof("event") == "token"
            for t in r.token.tokens
        ]

    assert len(tokens(first)) == 8
    assert tokens(again) == tokens(first)  # greedy on fixed weights
    text = "".join(r.token.text for r in first if r.WhichOneof("event") == "token")
    assert text == tokenizer.decode(tokens(first))
    num_prompt = len(tokenizer.encode(prompt).ids)
    assert first[-1].usage.prompt_tokens == num_prompt
    # The repeat finds the prompt's full blocks in the prefix cache.
    assert again[-1].usage.cached_prompt_tokens == num_prompt // 16 * 16 > 0
