"""A model's generation_config.json as the engine's sampling defaults (`generation_config`),
through real OpenEngine and vllm.Generate stubs against torch engines serving a copy of the
tiny Llama whose generation_config.json the test writes: options a request leaves unset
follow the file, explicit ones win, `generation_config: none` restores the fixed defaults,
and a bad file stops the engine at start with one line naming it."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.config import EngineConfig, GenerationConfigSource
from engine.core.api import SamplingDefaults, SamplingParams
from engine.server.service import start_engine
from engine.torch_runner.errors import CheckpointError
from engine.torch_runner.generation_config import sampling_defaults
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import Engine, collect, running_engine
from tests.engine.torch_reference import TEST_DEVICE, TINY_LLAMA
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vllm
from vllm_grpc import vllm_grpc_pb2_grpc as vllm_grpc

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 306, 465, 278, 659]
MAX_MODEL_LEN = 128
SEED = 7
VOCAB_SIZE = 1024  # tiny-llama's: top_k of the whole vocabulary is no top-k


def _checkpoint(directory: Path, **sampling: Any) -> Path:
    """A copy of tiny-llama whose generation_config.json also sets `sampling`."""
    model_dir = directory / "tiny-llama"
    shutil.copytree(TINY_LLAMA, model_dir)
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **sampling}))
    return model_dir


def _config(
    model_dir: Path, source: GenerationConfigSource = GenerationConfigSource.auto
) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        listen="127.0.0.1:0",
        block_size=16,
        num_kv_blocks=64,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_threads=1,
        shutdown_grace_s=1.0,
        device=TEST_DEVICE,
        generation_config=source,
    )


async def _openengine(
    engine: Engine, max_tokens: int | None = None, /, **sampling: Any
) -> list[int]:
    """OpenEngine Generate's tokens; what is not given stays absent (EOS ignored, so the
    length is the max_tokens in force)."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(**sampling),
        stopping=pb.StoppingOptions(ignore_eos=True),
    )
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    return await _openengine_tokens(engine, request)


async def _openengine_tokens(engine: Engine, request: pb.GenerateRequest) -> list[int]:
    responses = await collect(engine.stub, request)
    assert responses[-1].WhichOneof("event") == "finished", responses[-1]
    return [t.token_id for r in responses if r.HasField("token") for t in r.token.tokens]


async def _vllm(
    engine: Engine, max_new_tokens: int = 0, /, *, temperature: float | None = None, **sampling: Any
) -> list[int]:
    """vllm.Generate's tokens; 0 and an absent temperature are this proto's "default"."""
    request = vllm.GenerateRequest(
        token_ids=vllm.TokenIds(ids=PROMPT),
        sampling=vllm.RandomSampling(**sampling),
        stopping=vllm.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        response=vllm.ResponseOptions(output_token_ids=True),
    )
    if temperature is not None:
        request.temperature = temperature
    return list((await engine.vllm.Generate(request)).outputs.token_ids)


# Each file value makes a temperature of 1.5 greedy, so a request that leaves it unset gets
# the greedy tokens; then the value each front end can send to turn it off explicitly.
GREEDY_MAKERS = [
    pytest.param("top_k", 1, {"top_k": 0}, {"top_k": VOCAB_SIZE}, id="top_k"),
    pytest.param("top_p", 1e-9, {"top_p": 1.0}, {"top_p": 1.0}, id="top_p"),
    # vLLM's min_p 0 means "default": the smallest positive value is as good as none.
    pytest.param("min_p", 1.0, {"min_p": 0.0}, {"min_p": 1e-30}, id="min_p"),
]


@pytest.mark.parametrize(("key", "value", "openengine_off", "vllm_off"), GREEDY_MAKERS)
async def test_unset_options_follow_the_file_and_explicit_ones_win(
    tmp_path: Path,
    key: str,
    value: float,
    openengine_off: dict[str, float],
    vllm_off: dict[str, float],
) -> None:
    model_dir = _checkpoint(tmp_path, temperature=1.5, max_new_tokens=6, **{key: value})
    async with running_engine(_config(model_dir)) as engine:
        greedy = await _openengine(engine, 6, temperature=0.0)
        # The file's temperature with the key turned off, every option explicit.
        hot = await _openengine(engine, 6, temperature=1.5, seed=SEED, **openengine_off)
        assert len(greedy) == 6 and hot != greedy

        # OpenEngine: absent fields take the file's values (max_new_tokens included).
        assert await _openengine(engine, seed=SEED) == greedy
        assert await _openengine(engine, seed=SEED, **openengine_off) == hot
        # Explicit values win over the file's.
        assert await _openengine(engine, 3, seed=SEED) == greedy[:3]
        assert await _openengine(engine, 6, seed=SEED, temperature=1.5, **openengine_off) == hot

        # vllm.Generate: an absent temperature and the "0 means default" fields too.
        assert await _vllm(engine, seed=SEED) == greedy
        assert await _vllm(engine, seed=SEED, **vllm_off) == hot
        assert await _vllm(engine, 3, seed=SEED) == greedy[:3]
        assert await _vllm(engine, 6, temperature=0.0, seed=SEED, **vllm_off) == greedy


async def test_a_file_temperature_of_zero_makes_unset_requests_greedy(tmp_path: Path) -> None:
    model_dir = _checkpoint(tmp_path, temperature=0.0)
    async with running_engine(_config(model_dir)) as engine:
        greedy = await _openengine(engine, 8, temperature=0.0)
        assert await _openengine(engine, 8, seed=SEED) == greedy
        sampled = await _openengine(engine, 8, seed=SEED, temperature=1.0)
        assert sampled != greedy
        assert await _vllm(engine, 8, temperature=1.0, seed=SEED) == sampled
    async with running_engine(_config(model_dir, GenerationConfigSource.none)) as engine:
        # OpenEngine's own default temperature is 1.0.
        assert await _openengine(engine, 8, seed=SEED) == sampled


async def test_generation_config_none_restores_the_fixed_defaults(tmp_path: Path) -> None:
    model_dir = _checkpoint(tmp_path, temperature=1.5, top_k=1, max_new_tokens=6)
    async with running_engine(_config(model_dir, GenerationConfigSource.none)) as engine:
        greedy = await _openengine(engine, 20, temperature=0.0)
        fixed = await _openengine(engine, 8, temperature=1.0, top_k=0, seed=SEED)
        assert fixed != greedy[:8]
        assert await _openengine(engine, 8, seed=SEED) == fixed
        # No max_tokens: until the context is full.
        assert len(await _openengine(engine, temperature=0.0)) == MAX_MODEL_LEN - len(PROMPT)
        # vllm.Generate's own: greedy, 20 tokens.
        assert await _vllm(engine, seed=SEED) == greedy


async def test_min_tokens_above_the_files_max_new_tokens_is_refused_saying_so(
    tmp_path: Path,
) -> None:
    model_dir = _checkpoint(tmp_path, max_new_tokens=6)
    async with running_engine(_config(model_dir)) as engine:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), stopping=pb.StoppingOptions(min_tokens=10)
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(engine.stub, request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "min_tokens 10 exceeds the model's default max_tokens 6 (max_new_tokens in its "
            "generation_config.json): set max_tokens"
        )
        vllm_request = vllm.GenerateRequest(
            token_ids=vllm.TokenIds(ids=PROMPT),
            stopping=vllm.StoppingCriteria(min_new_tokens=10),
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await engine.vllm.Generate(vllm_request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "min_new_tokens 10 exceeds max_new_tokens 0 (0 means 6: the model's "
            "max_new_tokens, in its generation_config.json)"
        )
        # With a maximum of its own, the same minimum is fine.
        request.stopping.max_tokens = 10
        assert len(await _openengine_tokens(engine, request)) == 10


def _write_generation_config(directory: Path, content: str) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(content)
    return directory


def test_the_sampling_values_of_the_file_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    values = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1,  # an integer is a number
        "max_new_tokens": 256,
        "do_sample": False,  # not read (nor by vLLM)
        "max_length": 4,  # not read (nor by vLLM)
        "eos_token_id": [2, 7],
    }
    defaults = sampling_defaults(_write_generation_config(tmp_path, json.dumps(values)))
    assert defaults == SamplingDefaults(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.0, max_tokens=256
    )
    assert defaults.over(SamplingParams(temperature=0.0, max_tokens=20, seed=3)) == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, max_tokens=256, seed=3
    )
    # null is unset; top_k 0 and -1 are "no top-k"; no file or no keys: nothing.
    for top_k in (0, -1):
        unset = json.dumps({"temperature": None, "top_k": top_k, "bos_token_id": 1})
        assert sampling_defaults(_write_generation_config(tmp_path, unset)) == SamplingDefaults()
    assert sampling_defaults(tmp_path / "missing") == SamplingDefaults()


BAD_VALUES = [
    ('{"temperature": -0.5}', "temperature must be >= 0"),
    ('{"temperature": NaN}', "temperature must be a finite number"),
    ('{"temperature": "0.7"}', "temperature must be a number, got '0.7'"),
    ('{"top_p": 0}', "top_p must be in (0, 1]"),
    ('{"top_p": 1.5}', "top_p must be in (0, 1]"),
    ('{"top_k": -3}', "top_k must be >= 1 when set"),
    ('{"top_k": 2.5}', "top_k must be an integer, got 2.5"),
    ('{"top_k": true}', "top_k must be an integer, got True"),
    ('{"min_p": 2}', "min_p must be in [0, 1]"),
    ('{"repetition_penalty": 0}', "repetition_penalty must be > 0"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be >= 1, got 0"),
    ("[1, 2]", "does not hold a JSON object"),
    ('{"temperature": 0.7,', "is not valid JSON"),
]


@pytest.mark.parametrize(("content", "message"), BAD_VALUES)
def test_a_bad_value_is_one_error_naming_the_file(
    tmp_path: Path, content: str, message: str
) -> None:
    directory = _write_generation_config(tmp_path, content)
    with pytest.raises(CheckpointError) as raised:
        sampling_defaults(directory)
    assert str(raised.value).startswith(f"{directory / 'generation_config.json'}")
    assert message in str(raised.value)


async def test_an_engine_with_a_bad_file_does_not_start_unless_told_to_ignore_it(
    tmp_path: Path,
) -> None:
    model_dir = _checkpoint(tmp_path, top_p=1.5)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: top_p must be in"):
        await start_engine(_config(model_dir))
    # `none` does not read the sampling values: the engine serves with its fixed defaults.
    async with running_engine(_config(model_dir, GenerationConfigSource.none)) as engine:
        assert len(await _vllm(engine, seed=SEED)) == 20


def _serve(model_dir: Path, *flags: str) -> list[str]:
    serve = ["engine", "serve", "--model", str(model_dir), "--listen", "127.0.0.1:0", *flags]
    return [sys.executable, "-m", "kvplane", *serve]


@pytest.mark.timeout(180)
def test_kvplane_engine_serve_says_what_is_wrong_with_the_file(tmp_path: Path) -> None:
    model_dir = _checkpoint(tmp_path, temperature=math.inf)
    result = subprocess.run(
        _serve(model_dir), cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvplane: error:")]
    assert errors == [
        f"kvplane: error: {model_dir / 'generation_config.json'}: temperature must be a finite "
        "number, not inf (its sampling values are this engine's defaults: fix the file, or set "
        "generation_config: none to ignore them)"
    ]
    assert "Traceback" not in result.stderr
    # A --generation-config it does not know is a usage error.
    bogus = subprocess.run(
        _serve(model_dir, "--generation-config", "vllm"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert bogus.returncode == 2, bogus.stderr
    assert "Invalid value for --generation-config: Input should be 'auto' or 'none'" in (
        bogus.stderr
    )


@pytest.mark.timeout(180)
async def test_kvplane_engine_serve_generation_config_none_serves_the_model(
    tmp_path: Path,
) -> None:
    model_dir = _checkpoint(tmp_path, temperature=math.inf)
    port_file = tmp_path / "port"
    proc = await asyncio.create_subprocess_exec(
        *_serve(model_dir, "--generation-config", "none", "--port-file", str(port_file)),
        cwd=REPO,
    )
    try:
        await eventually(
            lambda: port_file.exists() or proc.returncode is not None, 100, "the engine to serve"
        )
        assert proc.returncode is None, "the engine exited"
        port = int(port_file.read_text())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await vllm_grpc.GenerateStub(channel).Generate(
                vllm.GenerateRequest(
                    token_ids=vllm.TokenIds(ids=PROMPT),
                    stopping=vllm.StoppingCriteria(ignore_eos=True),
                )
            )
        assert reply.outputs.num_tokens == 20  # the proto's own default, not the file's
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
