"""The handoff with real KV: a PREFILL and a DECODE torch engine (tiny Llama, same weights)
generate exactly what one AGGREGATED engine does, the decode computing only the prompt's last
partial block on top of the blocks it pulled."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

import grpc
import pytest

from engine.config import EngineConfig, EngineRoleName
from engine.server import kv_pull
from kvplane_api.v1 import kv_transfer_pb2 as kt
from kvplane_api.v1 import kv_transfer_pb2_grpc as kt_grpc
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    engine_thread_held,
    metrics_text,
    running_engine,
)
from tests.engine.torch_reference import TEST_DEVICE, TINY_LLAMA
from tests.polling import eventually

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
PROMPT = [(i * 37 + 11) % 900 + 5 for i in range(3 * BLOCK + 7)]  # 3 full blocks + 7 tokens
# 48 full blocks: more KV than a pull's tiny flow-control window lets through.
LONG_PROMPT = [(i * 37 + 11) % 900 + 5 for i in range(48 * BLOCK + 3)]


# The weights' dtypes the torch runner takes (EngineConfig.dtype).
DType = Literal["float32", "bfloat16"]


def _config(role: EngineRoleName, dtype: DType) -> EngineConfig:
    return EngineConfig(
        model=str(TINY_LLAMA),
        listen="127.0.0.1:0",
        served_model_name="tiny-llama",
        role=role,
        block_size=BLOCK,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        shutdown_grace_s=1.0,
        dtype=dtype,
        device=TEST_DEVICE,
        num_threads=1,
    )


@asynccontextmanager
async def role_engines(dtype: DType) -> AsyncIterator[list[Engine]]:
    """A PREFILL, a DECODE and an AGGREGATED engine on the same weights."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(running_engine(_config(role, dtype)))
            for role in (EngineRoleName.prefill, EngineRoleName.decode, EngineRoleName.aggregated)
        ]


def _greedy(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model="tiny-llama",
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=12, ignore_eos=True),
        **fields,
    )


def _tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t.token_id for r in responses if r.HasField("token") for t in r.token.tokens]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_decode_with_a_pulled_session_generates_what_an_aggregated_engine_does(
    dtype: DType,
) -> None:
    async with role_engines(dtype) as (prefiller, decoder, aggregated):
        handoff = await collect(prefiller.stub, _greedy())
        assert [r.WhichOneof("event") for r in handoff] == ["prefill_ready"]
        session = handoff[-1].prefill_ready.kv_session
        layout = session.attributes_struct["kv_layout"]
        assert isinstance(layout, str)
        assert f"kvplane-torch-v1:{dtype}:layers=2:block={BLOCK}" in layout

        decode = _greedy()
        decode.kv.session.CopyFrom(session)
        decoded = await collect(decoder.stub, decode)
        alone = await collect(aggregated.stub, _greedy())

        assert _tokens(decoded) == _tokens(alone) and len(_tokens(alone)) == 12
        # The three full blocks came over the wire; the last 7 tokens were computed here.
        assert decoded[-1].usage.cached_prompt_tokens == 3 * BLOCK
        assert alone[-1].usage.cached_prompt_tokens == 0
        # The imported blocks are the decode engine's own cached prefix now.
        again = await collect(decoder.stub, _greedy())
        assert _tokens(again) == _tokens(alone)
        assert again[-1].usage.cached_prompt_tokens == 3 * BLOCK


async def test_a_session_of_other_bytes_gives_other_tokens() -> None:
    """The decode engine really computes on the pulled KV (the test above cannot pass by
    recomputing): the same session's blocks, zeroed on the prefill engine before the pull,
    change what the decode engine generates."""
    async with role_engines("float32") as (prefiller, decoder, aggregated):
        handoff = await collect(prefiller.stub, _greedy())
        session = handoff[-1].prefill_ready.kv_session

        def zero_session_blocks(core: Any) -> None:
            held = core._kv_sessions[session.session_id]
            table = core.block_manager.block_table(held.seq_id)
            empty = bytes(core.runner.kv_block_bytes)
            core.runner.write_kv_blocks(table, [empty] * len(table))

        await asyncio.wrap_future(prefiller.app.service.engine_loop.call(zero_session_blocks))
        decode = _greedy()
        decode.kv.session.CopyFrom(session)
        decoded = await collect(decoder.stub, decode)
        alone = await collect(aggregated.stub, _greedy())
        assert decoded[-1].usage.cached_prompt_tokens == 3 * BLOCK
        assert _tokens(decoded) != _tokens(alone)


async def test_a_session_in_runs_over_several_messages_decodes_as_aggregated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode engine asks for runs of 2 blocks: the 3 blocks come as a run of 2 and a run
    of 1, and it still generates what the aggregated engine does. A puller from before runs
    (`max_blocks_per_chunk` unset) gets the same bytes one block a message."""
    monkeypatch.setattr(kv_pull, "blocks_per_chunk", lambda kv_block_bytes: 2)
    async with role_engines("float32") as (prefiller, decoder, aggregated):
        handoff = await collect(prefiller.stub, _greedy())
        session = handoff[-1].prefill_ready.kv_session
        stub = kt_grpc.KvTransferStub(prefiller.channel)

        async def wire(max_blocks_per_chunk: int) -> list[tuple[int, int, bytes]]:
            request = kt.PullKvSessionRequest(
                session_id=session.session_id, max_blocks_per_chunk=max_blocks_per_chunk
            )
            chunks = [c async for c in stub.PullKvSession(request)]
            assert chunks[0].WhichOneof("chunk") == "header"
            return [(c.block.index, c.block.num_blocks, c.block.data) for c in chunks[1:]]

        runs = await wire(2)
        assert [(index, count) for index, count, _ in runs] == [(0, 2), (2, 1)]
        one_a_message = await wire(0)
        assert [(index, count) for index, count, _ in one_a_message] == [(0, 1), (1, 1), (2, 1)]
        assert b"".join(d for *_, d in runs) == b"".join(d for *_, d in one_a_message)

        decode = _greedy()
        decode.kv.session.CopyFrom(session)
        decoded = await collect(decoder.stub, decode)
        alone = await collect(aggregated.stub, _greedy())
        assert decoded[-1].usage.cached_prompt_tokens == 3 * BLOCK
        assert _tokens(decoded) == _tokens(alone) and len(_tokens(alone)) == 12


def _stalled_pull(channel: grpc.aio.Channel, session: pb.KvSessionRef) -> Any:
    """A pull whose client stops reading (without cancelling) on a channel whose flow-control
    window is tiny and never grows: the prefill engine's stream stalls in the middle of the
    session's blocks."""
    return kt_grpc.KvTransferStub(channel).PullKvSession(
        kt.PullKvSessionRequest(session_id=session.session_id)
    )


async def _held(engine: Engine) -> tuple[int, int]:
    """The KV sessions and the KV blocks the engine holds."""
    load = await engine.stub.GetLoad(pb.GetLoadRequest())
    return load.active_kv_sessions, load.used_kv_blocks


async def test_a_puller_that_stops_reading_holds_no_blocks_past_an_abort_or_a_drain() -> None:
    """Abort(kv_session) and a drain's deadline with abort_after_deadline release a session at
    once even while a pull of it is stalled (a client that stopped reading, never
    cancelling): its blocks are free again and the drain completes, rather than waiting for
    that client for as long as it likes."""
    config = _config(EngineRoleName.prefill, "float32").model_copy(
        update={"num_kv_blocks": 128, "max_model_len": 1024}
    )
    request = _greedy()
    request.token_ids.ids[:] = LONG_PROMPT
    num_blocks = len(LONG_PROMPT) // BLOCK
    async with (
        running_engine(config) as prefiller,
        grpc.aio.insecure_channel(
            f"127.0.0.1:{prefiller.app.port}",
            options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
        ) as slow_reader,
    ):
        aborted = (await collect(prefiller.stub, request))[-1].prefill_ready.kv_session
        stalled = _stalled_pull(slow_reader, aborted)
        assert (await stalled.read()).header.num_blocks == num_blocks
        assert await _held(prefiller) == (1, num_blocks)
        reply = await prefiller.stub.Abort(pb.AbortRequest(kv_session=aborted))
        assert reply.status == pb.ABORT_STATUS_ABORTED

        async def freed() -> bool:
            return await _held(prefiller) == (0, 0)

        await eventually(freed, what="the aborted session's blocks released")
        stalled.cancel()

        drained = (await collect(prefiller.stub, request))[-1].prefill_ready.kv_session
        stalled = _stalled_pull(slow_reader, drained)
        assert (await stalled.read()).header.num_blocks == num_blocks
        drain = pb.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
        )
        states = [response.state async for response in prefiller.stub.Drain(drain)]
        assert states[-1] == pb.DRAIN_STATE_COMPLETE
        await eventually(freed, what="the drained session's blocks released")
        stalled.cancel()


async def test_a_session_pulled_while_the_decode_pool_is_full_is_imported_once_admitted() -> None:
    """A DECODE engine whose blocks a running request holds when the pulled KV arrives keeps
    that KV (host memory) and imports it when the request is admitted, once the running one
    ends: the request reports the pulled blocks cached, computes only its last partial block,
    and generates what an aggregated engine does. (It used to drop them and compute its whole
    prompt again.)"""
    decode_config = _config(EngineRoleName.decode, "float32").model_copy(
        update={"num_kv_blocks": 24, "max_model_len": 1024, "metrics_listen": "127.0.0.1:0"}
    )
    handed = _greedy()
    handed.token_ids.ids[:] = LONG_PROMPT[: 10 * BLOCK + 7]  # 10 full blocks to pull
    # 15 of the 24 blocks from its admission, more as it decodes: the 10 pulled never fit
    # while it runs, until it ends out of capacity ("KV cache full") with the pool full.
    filler = _greedy()
    filler.token_ids.ids[:] = [(i * 53 + 7) % 900 + 5 for i in range(15 * BLOCK)]
    filler.stopping.max_tokens = 1000
    async with AsyncExitStack() as stack:
        prefiller, aggregated = [
            await stack.enter_async_context(running_engine(_config(role, "float32")))
            for role in (EngineRoleName.prefill, EngineRoleName.aggregated)
        ]
        decoder = await stack.enter_async_context(running_engine(decode_config))
        session = (await collect(prefiller.stub, handed))[-1].prefill_ready.kv_session

        running = decoder.stub.Generate(filler)
        first = await running.read()
        assert isinstance(first, pb.GenerateResponse) and first.HasField("token")
        service = decoder.app.service
        async with engine_thread_held(service):
            load = await decoder.stub.GetLoad(pb.GetLoadRequest())
            assert load.running_requests == 1 and load.used_kv_blocks > 24 - 10
            decode = pb.GenerateRequest()
            decode.CopyFrom(handed)
            decode.kv.session.CopyFrom(session)
            decoding = asyncio.ensure_future(collect(decoder.stub, decode))
            # Pulled and submitted: added (its KV meeting the full pool) once the thread is free.
            await eventually(lambda: service.engine_loop.num_queued() == 1, what="submitted")
            # Behind its addition (which holds the pulled KV), the thread is held again.
            holding, go_on = threading.Event(), threading.Event()

            def hold(_core: object) -> None:
                holding.set()
                go_on.wait(30)

            again = service.engine_loop.call(hold)
        await eventually(holding.is_set, what="the KV held")
        held_bytes = 10 * decoder.app.service.engine_loop.core.runner.kv_block_bytes
        text = await metrics_text(decoder)
        assert f'kvplane_engine_held_kv_bytes{{model="tiny-llama"}} {held_bytes:.1f}' in text
        go_on.set()
        await asyncio.wrap_future(again)
        while (response := await running.read()) is not grpc.aio.EOF:
            assert isinstance(response, pb.GenerateResponse)
            last = response
        assert last.finished.reason == pb.FINISH_REASON_LENGTH  # "KV cache full"
        decoded = await decoding
        alone = await collect(aggregated.stub, handed)

        assert decoded[-1].usage.cached_prompt_tokens == 10 * BLOCK
        assert _tokens(decoded) == _tokens(alone) and len(_tokens(alone)) == 12
        text = await metrics_text(decoder)
        assert 'kvplane_engine_kv_imports_total{model="tiny-llama",outcome="held"} 1.0' in text
        assert service.engine_loop.core.held_import_bytes == 0
        assert 'kvplane_engine_held_kv_bytes{model="tiny-llama"} 0.0' in text
