"""`kvplane up --check`: a smoke test of a running fleet through its controller.

Sends requests that share prefixes through the controller's OpenEngine gateway, checks each
answer (a complete stream: tokens, exactly one GenerationFinished, final Usage), and checks
that a repeated prefix was routed to the engine holding it: the engine that served the repeat
reports the whole prefix as cached (`Usage.cached_prompt_tokens`).
"""

from __future__ import annotations

import logging

import grpc

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


async def _block_size(stub: pb_grpc.OpenEngineAsyncStub, model: str) -> int:
    try:
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return 1
    return info.kv_block_size if info.HasField("kv_block_size") and info.kv_block_size else 1


async def _generate(
    stub: pb_grpc.OpenEngineAsyncStub, model: str, request_id: str, tokens: list[int]
) -> tuple[int, int | None, list[str]]:
    """(output tokens, cached prompt tokens, problems) of one request."""
    request = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=pb.TokenIds(ids=tokens),
        stopping=pb.StoppingOptions(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    num_tokens, num_finished, cached, problems = 0, 0, None, []
    async for response in stub.Generate(request, timeout=TIMEOUT_S):
        kind = response.WhichOneof("event")
        if kind == "token":
            num_tokens += len(response.token.tokens)
        elif kind == "finished":
            num_finished += 1
        elif kind == "error":
            problems.append(f"{request_id}: engine error {response.error.message}")
        if response.HasField("usage") and response.usage.HasField("cached_prompt_tokens"):
            cached = response.usage.cached_prompt_tokens
    if num_tokens != MAX_TOKENS:
        problems.append(f"{request_id}: {num_tokens} tokens, expected {MAX_TOKENS}")
    if num_finished != 1:
        problems.append(f"{request_id}: {num_finished} GenerationFinished events, expected 1")
    return num_tokens, cached, problems


async def check_fleet(controller: str) -> list[str]:
    """Run the smoke test against the controller at `controller`; returns the problems."""
    problems: list[str] = []
    async with grpc.aio.insecure_channel(controller) as channel:
        stub: pb_grpc.OpenEngineAsyncStub = pb_grpc.OpenEngineStub(channel)
        info = await stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=TIMEOUT_S)
        model = info.supported_models[0] if info.supported_models else ""
        # The prefix is whole blocks: only full blocks are cached.
        block = await _block_size(stub, model)
        length = -(-PREFIX_TOKENS // block) * block
        for index in range(NUM_PREFIXES):
            prefix = _prefix(index, length)
            _, _, first = await _generate(
                stub, model, f"check-{index}-a", [*prefix, FIRST_ID, FIRST_ID + 1, FIRST_ID + 2]
            )
            _, cached, repeat = await _generate(
                stub, model, f"check-{index}-b", [*prefix, FIRST_ID + 3, FIRST_ID + 4]
            )
            problems += first + repeat
            if cached is None or cached < length:
                problems.append(
                    f"check-{index}-b: {cached} of its {length} prefix tokens were cached"
                    " where it was served: the repeated prefix was not routed to its holder"
                )
            else:
                log.info("prefix %d: repeat served with %d cached tokens", index, cached)
    return problems
