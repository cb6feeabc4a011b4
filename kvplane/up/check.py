"""`kvplane up --check`: a smoke test of a running fleet through its controller.

Sends greedy requests that share prefixes through the controller's OpenEngine gateway and
checks each answer: a complete stream (the tokens asked for, exactly one GenerationFinished),
and the same tokens when the same prompt comes again (then served from the prefix cache: an
answer from cached KV must be the answer computed from scratch). It also checks that every
repeated prefix was routed to the engine holding it: the engine that served the repeat reports
the whole prefix as cached (`Usage.cached_prompt_tokens`). A failed RPC (no engine to route
to, an engine dying, the controller gone) is a problem of the check, like a wrong answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from controller.model_info import generates
from kvplane.channels import INSECURE, ClientChannels
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

NUM_PREFIXES = 3
PREFIX_TOKENS = 256  # a multiple of every block size the bundled engine defaults to
# Prompt ids are drawn from [FIRST_ID, FIRST_ID + ID_RANGE): inside every bundled model's
# vocabulary (the builtin model's byte tokens; the sim runner's dummy vocabulary) and clear
# of the builtin model's special tokens (0-2).
FIRST_ID = 3
ID_RANGE = 256
MAX_TOKENS = 4
TIMEOUT_S = 60.0


def _prefix(index: int, length: int = PREFIX_TOKENS) -> list[int]:
    return [FIRST_ID + (index * 7919 + position * 31) % ID_RANGE for position in range(length)]


async def _model_info(stub: pb_grpc.OpenEngineAsyncStub, model: str) -> pb.ModelInfo | None:
    try:
        info: pb.ModelInfo = await stub.GetModelInfo(
            pb.GetModelInfoRequest(model=model), timeout=TIMEOUT_S
        )
    except grpc.aio.AioRpcError:
        return None  # the check's own requests will say what is wrong
    return info


async def _model_to_check(
    stub: pb_grpc.OpenEngineAsyncStub, models: list[str]
) -> tuple[str, int] | str:
    """The first of the fleet's models that generates and its KV block size (1 unknown), or
    the problem when every model is served for pooling only. The controller answers a
    model's ModelInfo from a generating engine when one serves it, so a model whose answer
    does not generate is served by pooling-only engines alone: Generate would be refused."""
    if not models:
        return "", 1  # the requests will say why (no engine answered yet)
    for model in models:
        info = await _model_info(stub, model)
        if info is None:
            return model, 1
        if generates(info):
            block = info.kv_block_size if info.HasField("kv_block_size") else 0
            return model, block or 1
    return (
        f"no model generates: {', '.join(models)} served by pooling-only engines"
        " (runner: pooling) alone, and the check sends Generate requests"
    )


def _rpc_problem(what: str, exc: grpc.aio.AioRpcError) -> str:
    return f"{what}: {exc.code().name} {exc.details()}"


@dataclass(frozen=True, slots=True)
class _Answer:
    tokens: list[int]
    cached: int | None  # the prompt tokens the serving engine had cached
    problems: list[str]
    completed: bool  # the stream ended without an RPC error


async def _generate(
    stub: pb_grpc.OpenEngineAsyncStub, model: str, request_id: str, tokens: list[int]
) -> _Answer:
    """One greedy request; an RPC error (no engine to route to, an engine dying) is a
    problem like any other."""
    request = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=pb.TokenIds(ids=tokens),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    output: list[int] = []
    num_finished, cached, problems = 0, None, []
    try:
        async for response in stub.Generate(request, timeout=TIMEOUT_S):
            kind = response.WhichOneof("event")
            if kind == "token":
                output += [token.token_id for token in response.token.tokens]
            elif kind == "finished":
                num_finished += 1
            elif kind == "error":
                problems.append(f"{request_id}: engine error {response.error.message}")
            if response.HasField("usage") and response.usage.HasField("cached_prompt_tokens"):
                cached = response.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        return _Answer(output, cached, [*problems, _rpc_problem(request_id, exc)], False)
    if len(output) != MAX_TOKENS:
        problems.append(f"{request_id}: {len(output)} tokens, expected {MAX_TOKENS}")
    if num_finished != 1:
        problems.append(f"{request_id}: {num_finished} GenerationFinished events, expected 1")
    return _Answer(output, cached, problems, True)


async def check_fleet(controller: str, channels: ClientChannels = INSECURE) -> list[str]:
    """Run the smoke test against the controller at `controller` (dialled per `channels`);
    returns the problems."""
    problems: list[str] = []
    async with channels.aio_channel(controller) as channel:
        stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
        try:
            info = await stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return [_rpc_problem("GetEngineInfo", exc)]
        # A pooling-only engine's model (a classifier beside generating engines) is not
        # one to send Generate to: the first model that generates is checked.
        chosen = await _model_to_check(stub, list(info.supported_models))
        if isinstance(chosen, str):
            return [chosen]
        model, block = chosen
        # The prefix is whole blocks: only full blocks are cached.
        length = -(-PREFIX_TOKENS // block) * block
        for index in range(NUM_PREFIXES):
            prefix = _prefix(index, length)
            prompt = [*prefix, FIRST_ID, FIRST_ID + 1, FIRST_ID + 2]
            first = await _generate(stub, model, f"check-{index}-a", prompt)
            extended = await _generate(
                stub, model, f"check-{index}-b", [*prefix, FIRST_ID + 3, FIRST_ID + 4]
            )
            again = await _generate(stub, model, f"check-{index}-c", prompt)
            problems += first.problems + extended.problems + again.problems
            if not (first.completed and extended.completed and again.completed):
                continue  # nothing to compare
            if first.tokens != again.tokens:
                problems.append(
                    f"check-{index}-c: the same greedy prompt answered {again.tokens},"
                    f" first {first.tokens}"
                )
            for request_id, hit in (("b", extended.cached), ("c", again.cached)):
                if hit is None or hit < length:
                    problems.append(
                        f"check-{index}-{request_id}: {hit} of its {length} prefix tokens were"
                        " cached where it was served: the repeated prefix was not routed to"
                        " its holder"
                    )
            log.info(
                "prefix %d: repeats served with %s and %s cached tokens, same answer: %s",
                index, extended.cached, again.cached, first.tokens == again.tokens,
            )  # fmt: skip
    return problems
