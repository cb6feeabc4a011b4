"""`kvplane complete` through CliRunner against a real controller in front of real torch
engines on the builtin model (a text prompt needs a tokenizer: the engines' own, and the
controller's `tokenizer: builtin` to route it by its cached prefix), and as a process for
what `kvplane` prints on an error. The synchronous CLI runs in a worker thread so that the
servers keep serving."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner, Result

from controller.complete_cli import Completion
from kvplane.cli import app
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import Fleet, close_fleet, make_fleet, start_builtin_engines
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.polling import eventually

pytestmark = pytest.mark.timeout(180)

MODEL = "builtin"
# About 100 tokens of the builtin model's tokenizer: several full KV blocks.
PROMPT = "The quick brown fox jumps over the lazy dog, then runs back over the hill again."
SUMMARY = re.compile(
    r"^(?P<instance>\S+) \((?P<address>[\d.:]+)\): (?P<prompt>[\d,]+) prompt tokens, "
    r"(?P<cached>[\d,]+) cached \(predicted (?P<predicted>[\d,]+)\) · first token [\d.]+ ms · "
    r"(?P<tokens>\d+) tokens in \d+ ms · finished: (?P<reason>\w+)$"
)


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One builtin model for the module's fleets (built on first use)."""
    return tmp_path_factory.mktemp("kvplane-cache")


@pytest.fixture
async def fleet(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(model_cache))
    fleet = await make_fleet(engines=await start_builtin_engines(2), tokenizer="builtin")
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def complete(*args: str, stdin: str | None = None) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, app, ["complete", *args], input=stdin)


async def prompt_held(fleet: Fleet, prompt: str) -> None:
    """Until the controller's index shows an engine holding the prompt's full blocks."""

    async def held() -> bool:
        reply = await fleet.admin.Match(apb.PromptQuery(prompt=prompt, model=MODEL))
        return reply.num_blocks > 0 and any(
            m.device_blocks == reply.num_blocks for m in reply.matches
        )

    await eventually(held)


def number(text: str) -> int:
    return int(text.replace(",", ""))


async def test_complete_streams_the_text_and_names_the_engine_with_its_cached_tokens(
    fleet: Fleet,
) -> None:
    """The text on stdout, a summary on stderr naming the engine that served it; the same
    prompt again lands on that engine and its summary shows the prompt served from cache,
    as the router predicted."""
    first = await complete("--target", fleet.target, "--prompt", PROMPT, "--max-tokens", "8")
    assert first.exit_code == 0, first.output
    summary = SUMMARY.match(first.stderr.strip())
    assert summary is not None, first.stderr
    assert first.stdout.endswith("\n") and first.stdout.strip()
    engine = fleet.engine_at(summary["address"])
    assert summary["instance"] == engine.instance_id
    assert (number(summary["cached"]), number(summary["predicted"])) == (0, 0)
    assert summary["reason"] in ("length", "stop")
    await prompt_held(fleet, PROMPT)

    again = await complete("-t", fleet.target, "-p", PROMPT, "--max-tokens", "8")
    assert again.exit_code == 0, again.output
    second = SUMMARY.match(again.stderr.strip())
    assert second is not None, again.stderr
    assert (second["instance"], second["address"]) == (summary["instance"], summary["address"])
    cached = number(second["cached"])
    assert cached > 0 and cached == number(second["predicted"])
    assert second["prompt"] == summary["prompt"]
    assert again.stdout == first.stdout  # greedy: the same text, from cached KV


async def test_complete_json_and_prompts_from_stdin(fleet: Fleet) -> None:
    """`--output json`: one object per prompt, a line each; without --prompt each line of
    stdin is a prompt, sent in turn (blank lines skipped)."""
    result = await complete(
        "--target", fleet.target, "--output", "json", "--max-tokens", "4",
        stdin=f"{PROMPT}\n\nHello there\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    answers = [json.loads(line) for line in lines]
    for answer in answers:
        assert answer["completion_tokens"] <= 4 and answer["text"]
        assert answer["finish_reason"] in ("length", "stop")
        assert answer["prompt_tokens"] > 0 and answer["cached_prompt_tokens"] == 0
        assert answer["total_ms"] >= answer["first_token_ms"] > 0
        route = answer["route"]
        assert fleet.engine_at(route["engine"]).instance_id == route["instance_id"]
        assert route["predicted_cached_tokens"] == 0 and route["retried"] is False
    assert answers[0]["prompt_tokens"] > answers[1]["prompt_tokens"]
    assert len({a["request_id"] for a in answers}) == 2
    assert result.stderr == ""


async def test_the_text_streamed_is_the_text_generated(fleet: Fleet) -> None:
    """Text output writes what the engine generates and nothing else: a token whose text the
    engine holds back (a byte of a character not complete yet, as the builtin model's answer
    to this prompt begins with; with a real model, an emoji or a CJK character split over
    tokens) writes nothing until its text comes. It used to write the token's id there, as
    for an engine without a tokenizer, so the stream differed from `--output json`'s text."""
    args = ["--target", fleet.target, "--prompt", "hello there", "--max-tokens", "16"]
    as_json = await complete(*args, "--output", "json")
    assert as_json.exit_code == 0, as_json.output
    answer = json.loads(as_json.stdout)
    assert answer["text"] and len(answer["token_ids"]) == 16
    as_text = await complete(*args)
    assert as_text.exit_code == 0, as_text.output
    assert as_text.stdout == answer["text"] + "\n"


async def test_complete_against_a_single_engine(fleet: Fleet) -> None:
    """An engine sends no route: the summary has no engine part, the JSON a null route."""
    engine = fleet.address(fleet.engines[0])
    result = await complete("--target", engine, "--prompt", PROMPT, "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    assert re.match(r"^[\d,]+ prompt tokens, 0 cached · first token ", result.stderr), result.stderr
    as_json = await complete("-t", engine, "-p", PROMPT, "--max-tokens", "4", "-o", "json")
    assert as_json.exit_code == 0, as_json.output
    answer = json.loads(as_json.stdout)
    assert answer["route"] is None and answer["cached_prompt_tokens"] > 0


async def test_complete_sends_token_ids_to_engines_without_a_tokenizer(tmp_path: Path) -> None:
    """Sim engines have no tokenizer (`kvplane up configs/local-planner.yaml`'s): a text prompt
    is refused before it is sent, with the option to use instead (the gateway's own refusal
    said "send token_ids", which names no option of the CLI); `--tokens-file` sends token
    ids, and the output, which has no text, is shown as the generated token ids; a repeat is
    served from the cache, as predicted."""
    fleet = await make_fleet(num_engines=2)
    try:
        ids = list(range(1, 41))  # two full blocks of 16, and a partial one
        tokens = tmp_path / "prompt.json"
        tokens.write_text(json.dumps(ids))
        refused = await complete("--target", fleet.target, "--prompt", "hi", "--max-tokens", "4")
        assert refused.exit_code == 1  # (kvplane's main prints it: one line, exit 1)
        assert str(refused.exception) == (
            f"{fleet.target}: model 'sim' takes no text prompt (it has no tokenizer): give the "
            "prompt's token ids, --tokens-file F"
        )
        first = await complete(
            "-t", fleet.target, "--tokens-file", str(tokens), "--max-tokens", "4"
        )
        assert first.exit_code == 0, first.output
        generated = first.stdout.split()
        assert len(generated) == 4 and all(t.isdigit() for t in generated)
        summary = SUMMARY.match(first.stderr.strip())
        assert summary is not None, first.stderr
        assert (number(summary["prompt"]), number(summary["cached"])) == (len(ids), 0)

        async def held() -> bool:
            query = apb.PromptQuery(token_ids=pb.TokenIds(ids=ids), model="sim")
            return any(m.device_blocks == 2 for m in (await fleet.admin.Match(query)).matches)

        await eventually(held)
        again = await complete(
            "-t", fleet.target, "--tokens-file", str(tokens), "--max-tokens", "4", "-o", "json"
        )
        answer = json.loads(again.stdout)
        assert answer["text"] == "" and len(answer["token_ids"]) == 4
        assert answer["cached_prompt_tokens"] == answer["route"]["predicted_cached_tokens"] == 32
        assert answer["route"]["engine"] == summary["address"]
    finally:
        await close_fleet(fleet)


class NoModelInfo(Forwarding):
    """A sim engine without GetModelInfo (UNIMPLEMENTED), which the controller serves all
    the same (its facts unknown)."""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no GetModelInfo here")


async def test_complete_against_a_target_without_model_info(tmp_path: Path) -> None:
    """A target that does not implement GetModelInfo, an engine alone or a controller in
    front of it, is asked all the same, `--model` given or not: it tells nothing of the
    model's text, so its text streams as it comes and, where none came (a sim engine has no
    tokenizer), its token ids are written once the output ends. GetModelInfo's UNIMPLEMENTED
    used to end the run: with `--model` too once the model's text was asked for."""
    engine = await start_fronted_engine("e0", NoModelInfo)
    fleet = await make_fleet(engines=[engine])
    try:
        tokens = tmp_path / "prompt.json"
        tokens.write_text(json.dumps(list(range(1, 41))))
        for target in (f"127.0.0.1:{engine.port}", fleet.target):
            for model in ([], ["--model", "sim"]):
                args = ["-t", target, "--tokens-file", str(tokens), "--max-tokens", "4", *model]
                done = await complete(*args)
                assert done.exit_code == 0, (target, model, done.output)
                generated = done.stdout.split()
                assert len(generated) == 4 and all(t.isdigit() for t in generated), done.stdout
                as_json = json.loads((await complete(*args, "-o", "json")).stdout)
                assert as_json["text"] == "" and len(as_json["token_ids"]) == 4
    finally:
        await close_fleet(fleet)


def kvplane(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvplane", *args], capture_output=True, text=True, timeout=60
    )


def test_an_unreachable_target_is_one_line_and_exit_1() -> None:
    """A port nothing listens on (no fleet up yet, a wrong --target): the line says what to
    do, not only gRPC's "Connection refused"; so does `admin`'s, which shares the client."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    for command in (["complete", "--prompt", "hi"], ["admin", "workers"]):
        result = kvplane(*command, "--target", target)
        assert result.returncode == 1, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvplane: error: {target}: UNAVAILABLE")
        assert lines[0].endswith(
            "Connection refused (nothing listens there: start the server, or give --target "
            "HOST:PORT)"
        ), command
        assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--max-tokens", "0"], "--max-tokens"),
        (["--max-tokens", str(2**32)], "--max-tokens"),  # a uint32: protobuf's ValueError
        (["--temperature", "-1"], "--temperature"),
        (["--prompt", ""], "--prompt"),
        (["--output", "table"], "--output"),
        (["--target", ""], "--target"),
        (["--tokens-file", "/nonexistent/ids.json"], "--tokens-file"),
        (["--prompt", "hi", "--tokens-file", "/dev/null"], "--tokens-file"),
        # Empty is not "the default" (leaving it out is): nothing is dialled (port 1).
        (["-p", "hi", "-t", "127.0.0.1:1", "--model", ""], "--model: is empty: give a model"),
        (["-p", "hi", "-t", "127.0.0.1:1", "--session-key", " "], "--session-key: is empty"),
    ],
)
def test_a_bad_option_exits_2(args: list[str], problem: str) -> None:
    result = kvplane("complete", *args)
    assert result.returncode == 2, result.stderr
    assert problem in result.stderr


def test_the_summary_of_a_handed_over_request_names_both_engines_and_the_prefill_prediction() -> (
    None
):
    """Behind a disaggregated gateway the serving (decode) engine counts the KV it pulled as
    cached: the line says "handed over" and shows the prefill engine's prediction, not the
    decode hop's (the whole prompt), which read as a miss."""
    hop = {"engine": "127.0.0.1:9001", "instance_id": "p1", "predicted_cached_tokens": 32}
    route = {
        "engine": "127.0.0.1:9002",
        "instance_id": "d1",
        "predicted_cached_tokens": 77,
        "prefill": hop,
        "retried": False,
    }
    done = Completion(
        request_id="r",
        prompt_tokens=77,
        completion_tokens=4,
        cached_prompt_tokens=64,
        finish_reason="length",
        first_token_ms=5.0,
        total_ms=9.0,
        route=route,
    )
    assert done.summary() == (
        "d1 (127.0.0.1:9002), prefilled on p1 (127.0.0.1:9001): 77 prompt tokens, 64 handed "
        "over (predicted cached 32) · first token 5.0 ms · 4 tokens in 9 ms · finished: length"
    )


def test_the_summary_of_a_request_sent_on_names_the_engines_that_failed_or_refused_it() -> None:
    """`retried_from` names the engines that failed the request and those that refused what
    they cannot serve (a LoRA adapter gone, a prompt past their context), which did not fail:
    the line says so, not "failed" alone (it was "retried after ... failed")."""
    route = {
        "engine": "127.0.0.1:9003",
        "instance_id": "long",
        "predicted_cached_tokens": 0,
        "retried": True,
        "retried_from": ["127.0.0.1:9001", "127.0.0.1:9002"],
    }
    done = Completion(
        request_id="r",
        prompt_tokens=240,
        completion_tokens=4,
        cached_prompt_tokens=0,
        finish_reason="length",
        first_token_ms=5.0,
        total_ms=9.0,
        route=route,
    )
    assert done.summary().startswith(
        "long (127.0.0.1:9003), after 127.0.0.1:9001, 127.0.0.1:9002 failed or refused it: "
    ), done.summary()
