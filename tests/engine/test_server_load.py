"""GetLoad over gRPC while a prompt is prefilled, on PREFILL and AGGREGATED engines (sim and
torch runners): a request counts from its acceptance, exactly once at every answer, queued
until the pass that admits it starts, running from then (its prompt computing, chunk after
chunk, then decoding), and on a PREFILL engine one of `active_kv_sessions` from the instant
its prefill ends until the decode engine's pull lets go of it (docs/engine.md, GetLoad)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from engine.config import SimTimingConfig
from kvplane_api.v1 import kv_transfer_pb2 as kt
from kvplane_api.v1 import kv_transfer_pb2_grpc as kt_grpc
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    engine_thread_held,
    generate_request,
    running_engine,
    sim_config,
    torch_config,
)
from tests.polling import eventually

pytestmark = pytest.mark.timeout(120)

PROMPT = [10 + i % 300 for i in range(64)]


def slow_sim(role: str, *, chunk: int) -> Any:
    """A sim engine whose every pass lasts about half a second (the sim's timing model, 30x), with
    `chunk` prompt tokens a pass at most."""
    return sim_config(
        role=role,
        max_num_batched_tokens=chunk,
        sim=SimTimingConfig(time_scale=30.0, vocab_size=1000),
    )


async def load(engine: Engine) -> pb.LoadInfo:
    return await engine.stub.GetLoad(pb.GetLoadRequest(include_per_rank=True))


def where(info: pb.LoadInfo) -> tuple[int, int, int]:
    """(running, queued, held KV sessions): where GetLoad counts the one request."""
    return info.running_requests, info.queued_requests, info.active_kv_sessions


async def accepted(engine: Engine, request: pb.GenerateRequest) -> asyncio.Task[list[Any]]:
    """Send `request`; return its stream's task once the engine has accepted it."""
    generation = asyncio.create_task(collect(engine.stub, request))

    def in_flight() -> bool:
        return engine.app.service.num_in_flight == 1

    await eventually(in_flight, what="the request accepted")
    return generation


async def loads_until(done: Awaitable[list[Any]], engine: Engine) -> list[pb.LoadInfo]:
    """Every GetLoad answer, one call after another, until `done` has completed."""
    task = asyncio.ensure_future(done)
    seen: list[pb.LoadInfo] = []
    while not task.done():
        seen.append(await load(engine))
    await task
    return seen


QUEUED, RUNNING, HELD, GONE = (0, 1, 0), (1, 0, 0), (0, 0, 1), (0, 0, 0)


def assert_counted_in_order(
    seen: list[pb.LoadInfo], lifecycle: list[tuple[int, int, int]], *, seen_running: bool = True
) -> None:
    """Every answer counts the request in one place of `lifecycle`, never going back; with
    `seen_running`, some answer came while it ran (the sim's passes last long enough)."""
    places = [where(info) for info in seen]
    assert all(place in lifecycle for place in places), places
    steps = [lifecycle.index(place) for place in places]
    assert steps == sorted(steps), places
    assert RUNNING in places or not seen_running, places


@pytest.mark.parametrize("role", ["prefill", "aggregated"])
async def test_a_request_accepted_while_the_engine_is_busy_counts_queued(role: str) -> None:
    """Accepted while the engine thread is in the middle of something long (a pass), the
    request is queued, its whole prompt in `waiting_tokens`, before the engine takes it in."""
    async with running_engine(sim_config(role=role)) as engine:
        async with engine_thread_held(engine.app.service):
            generation = await accepted(engine, generate_request(PROMPT, max_tokens=1))
            info = await load(engine)
            assert where(info) == QUEUED
            assert (info.waiting_tokens, info.running_tokens) == (len(PROMPT), 0)
            assert (info.ranks[0].running_requests, info.ranks[0].queued_requests) == (0, 1)
        responses = await generation
        assert responses[-1].HasField("usage")


async def test_a_prefill_counts_running_in_its_one_pass_then_as_a_held_session() -> None:
    """One pass computes the whole prompt: the request is running during it (the pass that
    admits it), and the instant it ends a held KV session (never neither, never both)."""
    async with running_engine(slow_sim("prefill", chunk=256)) as engine:
        generation = await accepted(engine, generate_request(PROMPT))
        seen = await loads_until(generation, engine)
        responses = generation.result()
        assert responses[-1].WhichOneof("event") == "prefill_ready"
        assert_counted_in_order(seen, [QUEUED, RUNNING, HELD])
        running = [info for info in seen if info.running_requests == 1]
        assert {(i.running_tokens, i.waiting_tokens, i.prefill_batch_size) for i in running} == {
            (len(PROMPT), 0, 1)
        }
        assert where(await load(engine)) == HELD


async def test_a_chunked_prefill_counts_running_from_its_first_chunk() -> None:
    """Four passes of 16 prompt tokens: running throughout, its KV blocks growing a chunk a
    pass, and a held session once done; the pull's release ends that."""
    async with running_engine(slow_sim("prefill", chunk=16)) as engine:
        generation = await accepted(engine, generate_request(PROMPT))
        seen = await loads_until(generation, engine)
        session = generation.result()[-1].prefill_ready.kv_session
        assert_counted_in_order(seen, [QUEUED, RUNNING, HELD])
        used = [info.used_kv_blocks for info in seen if info.running_requests == 1]
        assert used[0] == 16 // 4 and used == sorted(used)  # block size 4: one chunk's blocks
        held = await load(engine)
        assert where(held) == HELD and held.used_kv_blocks == (len(PROMPT) - 1) // 4

        transfer = kt_grpc.KvTransferStub(engine.channel)
        await transfer.ReleaseKvSession(kt.ReleaseKvSessionRequest(session_id=session.session_id))

        async def released() -> bool:
            info = await load(engine)
            return where(info) == GONE and info.used_kv_blocks == 0

        await eventually(released, what="the session released")


async def test_an_aggregated_request_counts_running_from_its_prefill_to_its_last_token() -> None:
    async with running_engine(slow_sim("aggregated", chunk=256)) as engine:
        generation = await accepted(engine, generate_request(PROMPT, max_tokens=2))
        seen = await loads_until(generation, engine)
        assert generation.result()[-1].WhichOneof("event") == "finished"
        assert_counted_in_order(seen, [QUEUED, RUNNING, GONE])
        batches = [
            (info.prefill_batch_size, info.decode_batch_size)
            for info in seen
            if info.running_requests == 1
        ]
        assert batches[0] == (1, 0) and batches[-1] == (0, 1)  # its prefill, then its decode


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("role", ["prefill", "aggregated"])
async def test_torch_engines_count_a_request_from_its_acceptance(
    builtin_dir: Path, role: str
) -> None:
    """The same accounting on the torch runner: queued while the engine is busy, then counted
    exactly once at every answer until it ends (or is handed over as a session)."""
    prompt = [5 + i % 400 for i in range(300)]
    async with running_engine(torch_config(str(builtin_dir), role=role)) as engine:
        async with engine_thread_held(engine.app.service):
            generation = await accepted(engine, generate_request(prompt, max_tokens=2))
            info = await load(engine)
            assert where(info) == QUEUED and info.waiting_tokens == len(prompt)
        seen = await loads_until(generation, engine)
        end = HELD if role == "prefill" else GONE
        assert_counted_in_order(seen, [QUEUED, RUNNING, end], seen_running=False)
        assert where(await load(engine)) == end
