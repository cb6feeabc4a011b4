"""`kvplane complete`: send a prompt to a controller (or a single engine) and print what it
generates, as vLLM's `vllm complete` does for its server: a newcomer with a fleet up tries it
without writing a gRPC client.

One OpenEngine Generate per prompt (`--prompt`, `--tokens-file` for the token ids of one, else
each line of stdin in turn). Text output streams the generated text to stdout as it arrives
(a model the target has no tokenizer for, as its GetModelInfo says, such as a sim engine's,
has no text: then the token ids; a text prompt for it is refused before it is sent; a
target without GetModelInfo says nothing: its text, else its token ids once it ends), then
one summary line on stderr: the engine that served it (a controller's `kvplane-route`
trailing metadata, controller/route_report.py; a single engine sends none), the prompt
tokens, those served from cache against the router's prediction, the time to the first
token, the tokens and time in all, and why it finished. `--output json`: one JSON object per
prompt, a line each. An unreachable target, a refused call or an in-band EngineError is one
line and exit 1 (kvplane/cli.py)."""

from __future__ import annotations

import enum
import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import grpc
import typer

from controller.admin_cli import DEFAULT_TARGET, TARGET_KIND, TokensFileOpt
from controller.model_info import generates, reported
from controller.route_report import read_route
from indexer.admin_cli import read_token_ids
from indexer.validation import MAX_UINT32
from kvplane.cli_common import (
    RPC_TIMEOUT_S,
    ClientTarget,
    GroupTokenFileOption,
    RpcCallError,
    TlsCaOption,
    TlsCertOption,
    TlsKeyOption,
    TlsServerNameOption,
    client_channels,
    finite_number,
    not_blank,
    target_option,
)
from kvplane.enum_names import enum_name
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

# The metadata key configs/controller.yaml gives `router.session_metadata_key`.
DEFAULT_SESSION_METADATA_KEY = "session_id"


class CompletionOutput(enum.StrEnum):
    text = "text"
    json = "json"


class _Echo(enum.Enum):
    """What a run writes to stdout as a Generate streams."""

    NOTHING = "nothing"  # --output json: one object once it ends
    TEXT = "text"  # the text as it comes: a token whose text is held back (part of a
    # character, what may begin a stop string) writes nothing until the text comes
    IDS = "ids"  # the token ids, space-separated: the target has no text for the model
    # TEXT, and the token ids once it ends where no text came: the target does not say
    # whether it has text for the model (no GetModelInfo)
    TEXT_OR_IDS = "text or ids"


@dataclass(slots=True)
class Completion:
    """What one Generate answered, as the command reports it."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = None  # None: the engine did not say
    finish_reason: str = ""
    first_token_ms: float | None = None
    total_ms: float = 0.0
    route: dict[str, Any] | None = None  # a controller's `kvplane-route`; None from an engine

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "finish_reason": self.finish_reason,
            "first_token_ms": _rounded(self.first_token_ms),
            "total_ms": _rounded(self.total_ms),
            "route": self.route,
        }

    def summary(self) -> str:
        """One line: `e1 (127.0.0.1:9002): 1,040 prompt tokens, 1,024 cached (predicted
        1,024) · first token 12.3 ms · 32 tokens in 85 ms · finished: length`."""
        prompt = f"{self.prompt_tokens:,} prompt tokens" if self.prompt_tokens is not None else ""
        prefill = (self.route or {}).get("prefill")
        if prefill is not None:
            # Handed over: the serving engine counts the KV it pulled as cached, and what the
            # prompt found cached is the prefill engine's, which reports no usage to the client.
            if self.cached_prompt_tokens is not None:
                prompt += f", {self.cached_prompt_tokens:,} handed over"
            if "predicted_cached_tokens" in prefill:
                prompt += f" (predicted cached {prefill['predicted_cached_tokens']:,})"
        elif self.cached_prompt_tokens is not None:
            prompt += f", {self.cached_prompt_tokens:,} cached"
            if self.route is not None and "predicted_cached_tokens" in self.route:
                prompt += f" (predicted {self.route['predicted_cached_tokens']:,})"
        parts = [
            prompt,
            "no token"
            if self.first_token_ms is None
            else f"first token {self.first_token_ms:.1f} ms",
            f"{self.completion_tokens:,} tokens in {self.total_ms:.0f} ms",
            f"finished: {self.finish_reason or 'no reason given'}",
        ]
        line = " · ".join(p for p in parts if p)
        engine = _route_text(self.route) if self.route is not None else ""
        return f"{engine}: {line}" if engine else line


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def _engine_text(hop: dict[str, Any]) -> str:
    return f"{hop.get('instance_id', '?')} ({hop.get('engine', '?')})"


def _route_text(route: dict[str, Any]) -> str:
    """Which engines ran the request, as the summary line names them."""
    words = [_engine_text(route)] if "engine" in route else []
    if "prefill" in route:
        words.append(f"prefilled on {_engine_text(route['prefill'])}")
    if route.get("retried"):  # each failed it, or refused what it cannot serve
        words.append(f"after {', '.join(route.get('retried_from', []))} failed or refused it")
    return ", ".join(words)


@dataclass(frozen=True, slots=True)
class _AskedModel:
    """The model a run asks for, and whether the target has text for it: False where its
    GetModelInfo says it takes no text (`supports_text_input` false: no engine serving it
    has a tokenizer, such as a sim engine), which then sends token ids only; None where it
    does not say (a target without GetModelInfo)."""

    name: str
    has_text: bool | None  # None: the target does not say


def _asked_model(stub: pb_grpc.OpenEngineStub, model: str | None) -> _AskedModel:
    """`--model`, else the first model the target serves that generates, as its
    GetEngineInfo and GetModelInfo say (a controller fronting pooling-only engines beside
    generating ones lists both; a target without GetModelInfo, the first it serves). None
    listed (a controller before its engines answer): "", the default model, which the
    target then accepts or refuses itself."""
    if model is not None:
        info: pb.ModelInfo | None = _model_info(stub, model)
    else:
        models = stub.GetEngineInfo(
            pb.GetEngineInfoRequest(), timeout=RPC_TIMEOUT_S
        ).supported_models
        infos = ((name, _model_info(stub, name)) for name in models)
        first = (models[0], None) if models else ("", None)
        model, info = next(((name, i) for name, i in infos if i is None or generates(i)), first)
    if info is None:
        return _AskedModel(model, None)
    return _AskedModel(model, reported(info, "supports_text_input") is not False)


def _model_text(model: str) -> str:
    return f"model {model!r}" if model else "the default model"


def _model_info(stub: pb_grpc.OpenEngineStub, model: str) -> pb.ModelInfo | None:
    """The target's GetModelInfo of `model`; None where it does not implement it (an engine
    the controller serves without it, `controller.fleet`: it tells nothing of the model)."""
    try:
        info: pb.ModelInfo = stub.GetModelInfo(
            pb.GetModelInfoRequest(model=model), timeout=RPC_TIMEOUT_S
        )
    except grpc.RpcError as failed:
        if failed.code() is grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise
    return info


def _complete(stub: pb_grpc.OpenEngineStub, request: pb.GenerateRequest, echo: _Echo) -> Completion:
    """Run one Generate, writing its text or token ids to stdout as they arrive (`echo`). An
    in-band EngineError raises RpcCallError (the stream's output so far is written)."""
    done = Completion(request.request_id)
    started = time.perf_counter()
    call = stub.Generate(request)
    for response in call:
        event = response.WhichOneof("event")
        if event == "token":
            if done.first_token_ms is None:
                done.first_token_ms = (time.perf_counter() - started) * 1000
            token = response.token
            ids = [t.token_id for t in token.tokens]
            if echo in (_Echo.TEXT, _Echo.TEXT_OR_IDS) and token.text:
                sys.stdout.write(token.text)
                sys.stdout.flush()
            elif echo is _Echo.IDS and ids:
                sys.stdout.write((" " if done.token_ids else "") + " ".join(map(str, ids)))
                sys.stdout.flush()
            done.text += token.text
            done.token_ids.extend(ids)
        elif event == "finished":
            reason = enum_name(pb.FinishReason.DESCRIPTOR, response.finished.reason)
            done.finish_reason = reason.removeprefix("FINISH_REASON_").lower()
        elif event == "error":
            error = response.error
            code = enum_name(pb.ErrorCode.DESCRIPTOR, error.code).removeprefix("ERROR_CODE_")
            raise RpcCallError(f"the engine failed the request: {code}: {error.message}")
        if response.HasField("usage"):
            usage = response.usage
            done.prompt_tokens = usage.prompt_tokens
            done.completion_tokens = usage.completion_tokens
            if usage.HasField("cached_prompt_tokens"):
                done.cached_prompt_tokens = usage.cached_prompt_tokens
    if echo is _Echo.TEXT_OR_IDS and not done.text and done.token_ids:
        sys.stdout.write(" ".join(map(str, done.token_ids)))
    done.total_ms = (time.perf_counter() - started) * 1000
    done.route = read_route(call.trailing_metadata())
    return done


def _prompts(prompt: str | list[int] | None) -> Iterator[str | list[int]]:
    """--prompt (or --tokens-file's token ids), else each non-blank line of stdin as it comes
    (a `> ` on a terminal)."""
    if prompt is not None:
        yield prompt
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def complete(
    *,
    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            "-p",
            callback=not_blank("the prompt's text, or leave it out to read stdin"),
            help="Prompt text; without it, each line of stdin is a prompt, sent in turn.",
        ),
    ] = None,
    tokens_file: TokensFileOpt = None,
    max_tokens: Annotated[
        int,
        typer.Option(  # StoppingOptions.max_tokens is a uint32
            "--max-tokens", min=1, max=MAX_UINT32, help="Tokens to generate at most."
        ),
    ] = 32,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature", min=0, callback=finite_number, help="Sampling temperature (0: greedy)."
        ),
    ] = 0.0,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Model to ask for (default: the first the target generates with).",
            callback=not_blank("a model name, or leave it out for the first the target generates"),
        ),
    ] = None,
    session_key: Annotated[
        str | None,
        typer.Option(
            "--session-key",
            help="Session of the request: a controller with router.session_metadata_key sends "
            "a session's requests to the engine that served it.",
            callback=not_blank("a session key, or leave it out for a request of no session"),
        ),
    ] = None,
    session_metadata_key: Annotated[
        str,
        typer.Option(
            "--session-metadata-key",
            help="The controller's router.session_metadata_key, which carries --session-key.",
        ),
    ] = DEFAULT_SESSION_METADATA_KEY,
    output: Annotated[
        CompletionOutput,
        typer.Option(
            "--output",
            "-o",
            help="text: the generated text on stdout, a summary on stderr; json: one object "
            "per prompt.",
        ),
    ] = CompletionOutput.text,
    target: Annotated[
        str | None, target_option("HOST:PORT of the controller or engine.", DEFAULT_TARGET)
    ] = None,
    tls_ca: TlsCaOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_server_name: TlsServerNameOption = None,
    token_file: GroupTokenFileOption = None,
) -> None:
    """Send a prompt to a controller (or an engine) and print what it generates."""
    if session_key is not None and not session_metadata_key:
        raise typer.BadParameter("is empty", param_hint="--session-metadata-key")
    if prompt is not None and tokens_file is not None:
        raise typer.BadParameter("give at most one of --prompt and --tokens-file")
    # Read before any call: a bad file is a usage error whether or not the target answers.
    given: str | list[int] | None = read_token_ids(tokens_file) if tokens_file else prompt
    channels = client_channels(tls_ca, tls_cert, tls_key, tls_server_name)
    server = ClientTarget.given(target or DEFAULT_TARGET, channels, token_file)
    with server.channel(TARGET_KIND) as channel:
        stub = pb_grpc.OpenEngineStub(channel)
        asked = _asked_model(stub, model)
        if output is CompletionOutput.json:
            echo = _Echo.NOTHING
        else:
            echo = {True: _Echo.TEXT, False: _Echo.IDS, None: _Echo.TEXT_OR_IDS}[asked.has_text]
        for each in _prompts(given):
            if isinstance(each, str) and asked.has_text is False:
                raise RpcCallError(
                    f"{server.address}: {_model_text(asked.name)} takes no text prompt (it has "
                    "no tokenizer): give the prompt's token ids, --tokens-file F"
                )
            request = pb.GenerateRequest(
                request_id=f"complete-{uuid.uuid4().hex}",
                model=asked.name,
                sampling=pb.SamplingParams(temperature=temperature),
                stopping=pb.StoppingOptions(max_tokens=max_tokens),
            )
            if isinstance(each, str):
                request.prompt = each
            else:
                request.token_ids.ids.extend(each)
            if session_key is not None:
                request.metadata[session_metadata_key] = session_key
            done = _complete(stub, request, echo)
            if output is CompletionOutput.json:
                typer.echo(json.dumps(done.as_json(), sort_keys=True))
            else:
                typer.echo()  # the text ends its line
                typer.echo(done.summary(), err=True)
