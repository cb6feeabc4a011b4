"""PREFILL and DECODE engines over gRPC (sim runner): PrefillReady, the `kvplane-pull` handoff,
session lifetime (pull, Abort, TTL, drain), the statuses of every refusal, auth, info and
health. The torch handoff (real KV bytes) is in test_server_kv_transfer_torch.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from engine.config import KvTransferConfig, LoraConfig
from engine.core.api import EngineRequest, SamplingParams
from engine.core.lora import LoraAdapter
from engine.core.sim_runner import SimRunner
from engine.server import kv_transfer
from engine.server.engine_service import AbortOutcome
from engine.server.errors import RequestAbortedError
from engine.server.kv_pull import MAX_IDLE_PEERS, PulledSession
from kvplane.channels import ClientChannels
from kvplane.config import AuthConfig, ClientTlsConfig, TlsConfig
from kvplane_api.v1 import kv_transfer_pb2 as kt
from kvplane_api.v1 import kv_transfer_pb2_grpc as kt_grpc
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    engine_thread_held,
    fake_prefill_engine,
    generate_request,
    metrics_text,
    rpc_error,
    running_engine,
    sim_config,
    stream_error,
)
from tests.engine.lora_adapters import write_adapter_config
from tests.engine.test_text_prompt_off_loop import (
    HUGE_PROMPT,
    OUT_OF_VOCABULARY,
    PROMPT_IDS,
    BlockingTokenizer,
    aborted_while_tokenised,
    text_engine,
)
from tests.grpc_streams import next_reply
from tests.partial_servicers import PartialKvTransfer
from tests.polling import eventually
from tests.redis_servers import free_port
from tests.rotation import replace_file
from vllm_grpc import vllm_grpc_pb2 as vpb

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(10, 20))  # block size 4: blocks 0 and 1 transferred, block 2 holds the last


@asynccontextmanager
async def engines(*configs: Any) -> AsyncIterator[list[Engine]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_engine(c)) for c in configs]


async def prefill(engine: Engine, prompt: list[int] = PROMPT, **fields: Any) -> pb.KvSessionRef:
    responses = await collect(engine.stub, generate_request(prompt, **fields))
    assert responses[-1].WhichOneof("event") == "prefill_ready", responses[-1]
    return responses[-1].prefill_ready.kv_session


def with_session(session: pb.KvSessionRef, prompt: list[int] = PROMPT) -> pb.GenerateRequest:
    request = generate_request(prompt, max_tokens=5)
    request.kv.session.CopyFrom(session)
    return request


def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t.token_id for r in responses if r.HasField("token") for t in r.token.tokens]


async def used_blocks(engine: Engine) -> int:
    return (await engine.stub.GetLoad(pb.GetLoadRequest())).used_kv_blocks


async def test_prefill_ready_then_decode_with_the_session() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode"), sim_config()) as (
        prefiller,
        decoder,
        aggregated,
    ):
        responses = await collect(prefiller.stub, generate_request(PROMPT, max_tokens=5))
        # No tokens: one terminal PrefillReady carrying Usage of the prompt only.
        assert [r.WhichOneof("event") for r in responses] == ["prefill_ready"]
        usage = responses[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 0, 10)
        assert usage.cached_prompt_tokens == 0
        session = responses[-1].prefill_ready.kv_session
        assert session.session_id and session.transfer_backend == "kvplane-pull"
        assert [(e.host, e.port, e.protocol) for e in session.endpoints] == [
            ("127.0.0.1", prefiller.app.port, "grpc")
        ]
        assert session.dp_rank == 0
        attributes = dict(session.attributes_struct.items())
        assert attributes == {"block_size": 4, "num_prompt_tokens": 10, "kv_layout": "sim:B4"}
        load = await prefiller.stub.GetLoad(pb.GetLoadRequest())
        assert (load.active_kv_sessions, load.used_kv_blocks) == (1, 2)  # held, not evictable

        decoded = await collect(decoder.stub, with_session(session))
        alone = await collect(aggregated.stub, generate_request(PROMPT, max_tokens=5))
        assert tokens(decoded) == tokens(alone) and len(tokens(decoded)) == 5
        assert decoded[-1].usage.cached_prompt_tokens == 8  # the two transferred blocks
        assert alone[-1].usage.cached_prompt_tokens == 0
        # A complete pull released the session: the blocks stay cached, no longer held.
        await eventually(lambda: _no_sessions(prefiller), timeout_s=30, what="the session released")
        again = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert again.code() == grpc.StatusCode.NOT_FOUND


async def _no_sessions(engine: Engine) -> bool:
    load = await engine.stub.GetLoad(pb.GetLoadRequest())
    return load.active_kv_sessions == 0 and load.used_kv_blocks == 0


async def test_a_pulled_session_stays_for_a_retry_until_it_is_released() -> None:
    """A pull does not consume the session: a decode engine that dies after pulling leaves it
    to the gateway's retry on another decode engine. ReleaseKvSession (a decode engine sends
    it once its request is accepted) ends it."""
    async with engines(sim_config(role="prefill")) as (prefiller,):
        session = await prefill(prefiller)
        stub = kt_grpc.KvTransferStub(prefiller.channel)
        pull = kt.PullKvSessionRequest(session_id=session.session_id)
        for _ in range(2):
            chunks = [c async for c in stub.PullKvSession(pull)]
            header = chunks[0].header
            assert header.num_blocks == 2 and list(header.token_ids) == PROMPT[:8]
            assert header.kv_layout == "sim:B4" and header.block_size == 4
            assert [c.block.index for c in chunks[1:]] == [0, 1]
        await stub.ReleaseKvSession(kt.ReleaseKvSessionRequest(session_id=session.session_id))
        await eventually(lambda: _no_sessions(prefiller), timeout_s=30, what="the session released")
        _, error = await stream_error(stub.PullKvSession(pull))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        # Releasing it again is idempotent; only a session never handed over is unknown.
        await stub.ReleaseKvSession(kt.ReleaseKvSessionRequest(session_id=session.session_id))
        again = await rpc_error(
            lambda: stub.ReleaseKvSession(kt.ReleaseKvSessionRequest(session_id="unknown"))
        )
        assert again.code() == grpc.StatusCode.NOT_FOUND


async def test_a_decode_engine_takes_a_session_another_puller_left_and_releases_it() -> None:
    """The retry after a decode engine that pulled everything and then failed: the session is
    still there for the next decode engine, which releases it once its request runs."""
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        stub = kt_grpc.KvTransferStub(prefiller.channel)
        pull = kt.PullKvSessionRequest(session_id=session.session_id)
        assert len([c async for c in stub.PullKvSession(pull)]) == 3  # a puller that left
        decoded = await collect(decoder.stub, with_session(session))
        assert decoded[-1].WhichOneof("event") == "finished"
        assert decoded[-1].usage.cached_prompt_tokens == 8
        await eventually(
            lambda: _no_sessions(prefiller), timeout_s=30, what="the decode engine's release"
        )


async def test_abort_of_a_session_releases_its_blocks() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        assert await used_blocks(prefiller) == 2
        reply = await prefiller.stub.Abort(pb.AbortRequest(kv_session=session))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        await eventually(lambda: _no_sessions(prefiller), what="the blocks released")
        gone = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert gone.code() == grpc.StatusCode.NOT_FOUND
        # Abort is idempotent (the seed): a session that ended is ALREADY_FINISHED, as is one
        # a decode engine took (and released); only a session never handed over is NOT_FOUND.
        again = await prefiller.stub.Abort(pb.AbortRequest(kv_session=session))
        assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
        taken = await prefill(prefiller, [*PROMPT, 1])
        assert (await collect(decoder.stub, with_session(taken, [*PROMPT, 1])))[-1].HasField(
            "finished"
        )
        await eventually(lambda: _no_sessions(prefiller), what="the decode engine's release")
        late = await prefiller.stub.Abort(pb.AbortRequest(kv_session=taken))
        assert late.status == pb.ABORT_STATUS_ALREADY_FINISHED
        unknown = pb.KvSessionRef(session_id="kvs-never-handed-over")
        never = await rpc_error(prefiller.stub.Abort(pb.AbortRequest(kv_session=unknown)))
        assert never.code() == grpc.StatusCode.NOT_FOUND
        # Only a PREFILL engine holds sessions.
        elsewhere = await rpc_error(decoder.stub.Abort(pb.AbortRequest(kv_session=session)))
        assert elsewhere.code() == grpc.StatusCode.NOT_FOUND


async def test_an_unpulled_session_expires_after_its_ttl() -> None:
    ttl = KvTransferConfig(session_ttl_s=0.3)
    async with engines(sim_config(role="prefill", kv_transfer=ttl), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        assert await used_blocks(prefiller) == 2
        await eventually(lambda: _no_sessions(prefiller), what="the session expired")
        gone = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert gone.code() == grpc.StatusCode.NOT_FOUND


async def test_a_prefill_short_of_the_blocks_sessions_hold_waits_for_their_release() -> None:
    """A prefill that fits the KV cache but not what the sessions waiting for their pulls
    leave free waits until one is released (a pull, Abort, the TTL); it used to fail at once
    (KV_TRANSFER_FAILED "KV cache full"), however briefly the blocks were held."""
    async with engines(sim_config(role="prefill", num_kv_blocks=8)) as (prefiller,):
        held, waiting = await _a_prefill_waiting_for_blocks(prefiller)
        await prefiller.stub.Abort(pb.AbortRequest(kv_session=held))
        responses = await waiting
        assert responses[-1].WhichOneof("event") == "prefill_ready", responses[-1]


async def _a_prefill_waiting_for_blocks(
    prefiller: Engine, request: pb.GenerateRequest | None = None
) -> tuple[pb.KvSessionRef, asyncio.Future[list[pb.GenerateResponse]]]:
    """On an engine of 8 blocks: a session holding 7, and a prefill of 3 blocks waiting for
    them (its responses to come; `request`, of 3 blocks, if given)."""
    held = await prefill(prefiller, list(range(100, 129)))  # 29 tokens: holds 7 blocks
    assert await used_blocks(prefiller) == 7
    request = request or generate_request(list(range(300, 312)))  # 3 blocks
    waiting = asyncio.ensure_future(collect(prefiller.stub, request))

    async def queued() -> bool:
        load = await prefiller.stub.GetLoad(pb.GetLoadRequest())
        return (load.running_requests, load.queued_requests) == (0, 1)

    await eventually(queued, what="the second prefill waiting for blocks")
    return held, waiting


async def test_a_health_probe_is_not_held_behind_a_prefill_waiting_for_blocks() -> None:
    """The probe goes ahead of the waiting prefill (the free block is enough for it): Health
    answers READY while the session is still held, the prefill still waiting."""
    async with engines(sim_config(role="prefill", num_kv_blocks=8)) as (prefiller,):
        held, waiting = await _a_prefill_waiting_for_blocks(prefiller)
        probed = await prefiller.stub.Health(pb.HealthRequest(include_inference_probe=True))
        assert probed.state == pb.HEALTH_STATE_READY, probed
        probe = next(c for c in probed.checks if c.name == "inference_probe")
        assert probe.message == "generated 1 token"
        assert not waiting.done() and await used_blocks(prefiller) == 7
        await prefiller.stub.Abort(pb.AbortRequest(kv_session=held))
        responses = await waiting
        assert responses[-1].WhichOneof("event") == "prefill_ready", responses[-1]


async def test_a_prefill_whose_adapter_is_loaded_again_meanwhile_says_so_and_is_retryable(
    tmp_path: Path,
) -> None:
    """Another adapter loaded under the prefill's adapter name while it ran (here: while it
    waited for blocks): its KV, computed with the earlier weights, is not held for a session.
    It ends with a retryable KV_TRANSFER_FAILED saying so (it used to say only "the prompt's
    KV could not be held", as if the KV cache were full); retried unchanged, it succeeds."""
    config = sim_config(role="prefill", num_kv_blocks=8, lora=LoraConfig(enabled=True))
    async with engines(config) as (prefiller,):
        old, new = (
            pb.LoraAdapter(
                lora_id=i, lora_name="a", source_path=str(write_adapter_config(tmp_path / d))
            )
            for i, d in ((1, "old"), (2, "new"))
        )
        await prefiller.stub.LoadLora(pb.LoadLoraRequest(adapter=old))
        request = generate_request(list(range(300, 312)), lora_name="a")
        held, waiting = await _a_prefill_waiting_for_blocks(prefiller, request)
        await prefiller.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="a"))
        await prefiller.stub.LoadLora(pb.LoadLoraRequest(adapter=new))
        await prefiller.stub.Abort(pb.AbortRequest(kv_session=held))
        responses = await waiting
        error = responses[-1].error
        assert (error.code, error.retryable) == (pb.ERROR_CODE_KV_TRANSFER_FAILED, True), error
        assert "LoRA adapter 'a' was loaded again, with other weights" in error.message
        assert "not held for a session" in error.message
        retried = await collect(prefiller.stub, request)
        assert retried[-1].WhichOneof("event") == "prefill_ready", retried[-1]


async def test_sessions_the_decode_engine_cannot_use_are_refused_before_acceptance() -> None:
    async with engines(
        sim_config(role="prefill"),
        sim_config(role="decode"),
        sim_config(role="decode", block_size=8),
    ) as (prefiller, decoder, other_blocks):
        session = await prefill(prefiller)
        cases: list[tuple[pb.KvSessionRef, list[int], str]] = []
        wrong_backend = pb.KvSessionRef()
        wrong_backend.CopyFrom(session)
        wrong_backend.transfer_backend = "nixl"
        cases.append((wrong_backend, PROMPT, "kvplane-pull"))
        no_grpc = pb.KvSessionRef()
        no_grpc.CopyFrom(session)
        no_grpc.endpoints[0].protocol = "tcp"
        cases.append((no_grpc, PROMPT, "'grpc' endpoint"))
        other_prompt = [*PROMPT[:3], 999, *PROMPT[4:]]
        cases.append((session, other_prompt, "not a prefix"))
        for ref, prompt, why in cases:
            error = await rpc_error(collect(decoder.stub, with_session(ref, prompt)))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, why
            assert why in (error.details() or ""), error.details()
        # Another block size: refused from the session's attributes, before any pull ...
        error = await rpc_error(lambda: collect(other_blocks.stub, with_session(session)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "blocks of 4 tokens" in (error.details() or "")
        # ... and from the pulled header when the attributes do not say (layouts differ too).
        bare = pb.KvSessionRef()
        bare.CopyFrom(session)
        bare.ClearField("attributes_struct")
        error = await rpc_error(lambda: collect(other_blocks.stub, with_session(bare)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        # None of that consumed the session (a pull cut short leaves it pullable).
        decoded = await collect(decoder.stub, with_session(session))
        assert decoded[-1].usage.cached_prompt_tokens == 8


async def test_a_session_serves_only_the_lora_adapter_and_cache_salt_it_was_computed_with(
    tmp_path: Path,
) -> None:
    lora = LoraConfig(enabled=True)
    async with engines(
        sim_config(role="prefill", lora=lora), sim_config(role="decode", lora=lora)
    ) as (
        prefiller,
        decoder,
    ):
        adapter = pb.LoraAdapter(
            lora_id=1, lora_name="a", source_path=str(write_adapter_config(tmp_path / "a"))
        )
        for engine in (prefiller, decoder):
            await engine.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))
        session = await prefill(prefiller, lora_name="a", kv=pb.KvOptions(cache_salt="s"))
        # KV computed with adapter "a" and salt "s", imported under another namespace, would
        # be served as that namespace's prefix: refused, nothing sent, the session kept.
        for lora_name, salt, why in (
            ("", "s", "LoRA adapter 'a' (the request's: None)"),
            ("a", "t", "another cache salt"),
            ("a", None, "another cache salt"),
        ):
            request = with_session(session)
            request.lora_name = lora_name
            if salt is not None:
                request.kv.cache_salt = salt
            error = await rpc_error(collect(decoder.stub, request))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, why
            assert why in (error.details() or ""), error.details()
        plain = await collect(decoder.stub, generate_request(PROMPT, max_tokens=1))
        assert plain[-1].usage.cached_prompt_tokens == 0
        request = with_session(session)
        request.lora_name = "a"
        request.kv.cache_salt = "s"
        decoded = await collect(decoder.stub, request)
        assert decoded[-1].usage.cached_prompt_tokens == 8
        assert await used_blocks(prefiller) == 0


async def load_cancelled_as_it_completes(engine: Engine, request: pb.LoadLoraRequest) -> None:
    """LoadLora whose client goes away (the call cancelled) just as the engine thread completes
    the load, before the call resumes."""
    engine_loop = engine.app.service.engine_loop
    registry = engine_loop.core.loras
    assert registry is not None
    in_step, step_over = threading.Event(), threading.Event()

    def long_step(_core: object) -> None:
        in_step.set()
        step_over.wait(30)

    held = asyncio.wrap_future(engine_loop.call(long_step))
    await eventually(in_step.is_set, what="the engine thread held")
    load = asyncio.ensure_future(engine.app.openengine.LoadLora(request, cast(Any, None)))
    await eventually(lambda: bool(engine_loop._commands), what="the load queued")
    step_over.set()
    # Blocking the event loop on purpose: the call must not resume before it is cancelled.
    while registry.adapters.get(request.adapter.lora_name) != LoraAdapter(
        request.adapter.lora_id, request.adapter.lora_name, request.adapter.source_path
    ):
        time.sleep(0.001)  # noqa: ASYNC251
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    await held
    await asyncio.wrap_future(engine_loop.call(lambda _: None))  # the load's answer is out


@pytest.mark.parametrize("client_leaves", [False, True], ids=["answered", "client-leaves"])
async def test_loading_an_adapter_again_ends_the_sessions_of_its_earlier_load(
    tmp_path: Path, client_leaves: bool
) -> None:
    """A fresh load of a name lets go of the KV sessions computed with its earlier load (KV of
    an old adapter is never handed over): they are gone for Drain too, which does not wait for
    them until their TTL, and for Abort, which answers that they ended. So too when the load's
    client leaves as the engine thread completes it (before, the sessions stayed)."""
    async with engines(sim_config(role="prefill", lora=LoraConfig(enabled=True))) as (prefiller,):
        adapter = pb.LoraAdapter(
            lora_id=1, lora_name="a", source_path=str(write_adapter_config(tmp_path / "a"))
        )
        await prefiller.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))
        session = await prefill(prefiller, lora_name="a")
        await prefiller.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="a"))
        adapter.lora_id = 2
        if client_leaves:
            await load_cancelled_as_it_completes(prefiller, pb.LoadLoraRequest(adapter=adapter))
        else:
            await prefiller.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))
            assert (await prefiller.stub.GetLoad(pb.GetLoadRequest())).active_kv_sessions == 0
        drain = pb.DrainRequest(stop_accepting_new_requests=True)
        first = await next_reply(prefiller.stub.Drain(drain))
        assert (first.state, first.open_kv_sessions) == (pb.DRAIN_STATE_STARTED, 0)
        ended = await prefiller.stub.Abort(pb.AbortRequest(kv_session=session))
        assert ended.status == pb.ABORT_STATUS_ALREADY_FINISHED


async def test_malformed_session_refs_are_refused_with_a_clear_status() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        cases: list[tuple[pb.KvSessionRef, grpc.StatusCode, str]] = []
        huge_id = pb.KvSessionRef()
        huge_id.CopyFrom(session)
        huge_id.session_id = "x" * 100_000
        cases.append((huge_id, grpc.StatusCode.INVALID_ARGUMENT, "100000 characters"))
        bad_port = pb.KvSessionRef()
        bad_port.CopyFrom(session)
        bad_port.endpoints[0].port = prefiller.app.port + 65536  # not that port modulo 2**16
        cases.append((bad_port, grpc.StatusCode.FAILED_PRECONDITION, "'grpc' endpoint"))
        # gRPC ends a target at a NUL: 127.0.0.1:443 would have been dialled.
        nul_host = pb.KvSessionRef()
        nul_host.CopyFrom(session)
        nul_host.endpoints[0].host += "\x00.example"
        cases.append((nul_host, grpc.StatusCode.FAILED_PRECONDITION, "'grpc' endpoint"))
        text_block_size = pb.KvSessionRef()
        text_block_size.CopyFrom(session)
        text_block_size.attributes_struct.update({"block_size": "4"})
        cases.append((text_block_size, grpc.StatusCode.INVALID_ARGUMENT, "must be a number"))
        number_layout = pb.KvSessionRef()
        number_layout.CopyFrom(session)
        number_layout.attributes_struct.update({"kv_layout": 4})
        cases.append((number_layout, grpc.StatusCode.INVALID_ARGUMENT, "must be a string"))
        for ref, code, why in cases:
            error = await rpc_error(collect(decoder.stub, with_session(ref)))
            assert error.code() == code, (why, error.details())
            assert why in (error.details() or ""), error.details()
        decoded = await collect(decoder.stub, with_session(session))
        assert decoded[-1].usage.cached_prompt_tokens == 8


async def test_an_unreachable_prefill_engine_is_unavailable() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        await prefiller.app.server.stop(0)
        error = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert session.session_id in (error.details() or "")


async def test_refs_to_ever_new_prefill_endpoints_keep_a_bounded_number_of_channels() -> None:
    """Prefill engines come and go on new ports (a planner scaling them), and a ref may name
    any endpoint: the decode engine keeps at most MAX_IDLE_PEERS channels to them unused,
    the least recently used closed (one per address was kept for its life), and still pulls
    from a prefill engine it had a channel to before."""
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        assert decoder.app.kv_puller is not None
        session = await prefill(prefiller)
        for _ in range(MAX_IDLE_PEERS + 8):
            gone = pb.KvSessionRef()
            gone.CopyFrom(session)
            gone.endpoints[0].port = free_port()  # nothing listens there
            error = await rpc_error(collect(decoder.stub, with_session(gone)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert decoder.app.kv_puller.num_peer_channels == MAX_IDLE_PEERS
        assert tokens(await collect(decoder.stub, with_session(session)))


async def test_roles_and_sessions_that_do_not_fit_are_failed_precondition() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode"), sim_config()) as (
        prefiller,
        decoder,
        aggregated,
    ):
        session = await prefill(prefiller)
        for engine in (prefiller, aggregated):
            error = await rpc_error(collect(engine.stub, with_session(session)))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "kv.session is for a DECODE engine" in (error.details() or "")
        # A DECODE engine prefills a request without a session itself.
        alone = await collect(decoder.stub, generate_request(PROMPT, max_tokens=3))
        assert len(tokens(alone)) == 3 and alone[-1].WhichOneof("event") == "finished"
        # vllm.Generate stays on AGGREGATED engines.
        for engine in (prefiller, decoder):
            vllm_request = vpb.GenerateRequest(request_id="v", token_ids=vpb.TokenIds(ids=PROMPT))
            refused = await rpc_error(engine.vllm.Generate(vllm_request))
            assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_prompt_logprobs_come_before_prefill_ready_and_not_again_from_decode() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        request = generate_request(PROMPT)
        request.response.return_prompt_logprobs = True
        responses = await collect(prefiller.stub, request)
        assert [r.WhichOneof("event") for r in responses] == ["prompt", "prefill_ready"]
        assert len(responses[0].prompt.tokens) == len(PROMPT)
        decode = with_session(responses[-1].prefill_ready.kv_session)
        decode.response.return_prompt_logprobs = True
        decoded = await collect(decoder.stub, decode)
        assert "prompt" not in [r.WhichOneof("event") for r in decoded]
        assert decoded[-1].usage.cached_prompt_tokens == 8


async def test_a_prefill_aborted_midway_ends_cancelled_without_a_session() -> None:
    slow = sim_config(
        role="prefill",
        max_num_batched_tokens=8,
        sim={"time_scale": 1.0, "vocab_size": 1000},
        max_model_len=512,
        num_kv_blocks=128,
    )
    async with engines(slow) as (prefiller,):
        stream = prefiller.stub.Generate(generate_request(list(range(300)), request_id="slow"))
        responses: asyncio.Task[list[Any]] = asyncio.create_task(_read(stream))

        async def running() -> bool:
            load = await prefiller.stub.GetLoad(pb.GetLoadRequest())
            return load.running_requests == 1

        await eventually(running, what="the prefill running")
        reply = await prefiller.stub.Abort(pb.AbortRequest(request_id="slow"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        events = await responses
        assert [r.WhichOneof("event") for r in events] == ["finished"]
        assert events[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        await eventually(lambda: _no_sessions(prefiller), what="nothing held")


async def _drain_reply(
    drain: grpc.aio.UnaryStreamCall[pb.DrainRequest, pb.DrainResponse],
) -> pb.DrainResponse:
    """The drain's next progress reply, which the test knows is coming."""
    reply = await drain.read()
    assert isinstance(reply, pb.DrainResponse), "the drain stream ended"
    return reply


async def _read(stream: Any) -> list[Any]:
    return [r async for r in stream]


async def test_drain_waits_for_open_sessions_and_releases_them_at_the_deadline() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode")) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        drain = prefiller.stub.Drain(pb.DrainRequest(stop_accepting_new_requests=True))
        first = await _drain_reply(drain)
        assert first.state == pb.DRAIN_STATE_STARTED
        assert (first.in_flight_requests, first.open_kv_sessions) == (0, 1)
        # Draining, it still serves the pull of a session it handed over.
        decoded = await collect(decoder.stub, with_session(session))
        assert decoded[-1].usage.cached_prompt_tokens == 8
        last = first
        while last.state != pb.DRAIN_STATE_COMPLETE:
            last = await _drain_reply(drain)
        assert last.open_kv_sessions == 0 and last.in_flight_requests == 0

    async with engines(sim_config(role="prefill")) as (prefiller,):
        await prefill(prefiller)
        at_once = pb.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
        )
        replies = [r async for r in prefiller.stub.Drain(at_once)]
        assert replies[-1].state == pb.DRAIN_STATE_COMPLETE
        await eventually(lambda: _no_sessions(prefiller), timeout_s=30, what="the session released")


class _HeldPrefillEngine(PartialKvTransfer):
    """A prefill engine's pull service that sends the header of PROMPT's session, then holds
    the blocks until `release` is set: a pull in progress for as long as a test needs. The
    sessions its pullers release are in `released` (`released_one` set at each)."""

    def __init__(self) -> None:
        self.pulling = asyncio.Event()
        self.release = asyncio.Event()
        self.released: list[str] = []
        self.released_one = asyncio.Event()

    async def ReleaseKvSession(
        self, request: kt.ReleaseKvSessionRequest, context: Any
    ) -> kt.ReleaseKvSessionResponse:
        self.released.append(request.session_id)
        self.released_one.set()
        return kt.ReleaseKvSessionResponse()

    async def PullKvSession(
        self, request: kt.PullKvSessionRequest, context: Any
    ) -> AsyncIterator[kt.KvSessionChunk]:
        header = kt.KvSessionHeader(
            token_ids=PROMPT[:8], block_size=4, kv_layout="sim:B4", num_blocks=2
        )
        yield kt.KvSessionChunk(header=header)
        self.pulling.set()
        await self.release.wait()
        for index in range(2):
            yield kt.KvSessionChunk(block=kt.KvBlockData(index=index))


@asynccontextmanager
async def held_prefill_engine() -> AsyncIterator[tuple[_HeldPrefillEngine, pb.KvSessionRef]]:
    servicer = _HeldPrefillEngine()
    async with fake_prefill_engine(servicer, "held") as session:
        yield servicer, session


async def test_a_drain_waits_for_a_pull_in_progress_and_admits_its_request() -> None:
    # The pull consumes the session: a request refused once it is pulled would be lost.
    async with (
        held_prefill_engine() as (held, session),
        engines(sim_config(role="decode")) as (decoder,),
    ):
        generation = asyncio.create_task(collect(decoder.stub, with_session(session)))
        await asyncio.wait_for(held.pulling.wait(), 10)
        load = await decoder.stub.GetLoad(pb.GetLoadRequest())
        assert load.running_requests == 1
        drain = decoder.stub.Drain(pb.DrainRequest(stop_accepting_new_requests=True))
        first = await _drain_reply(drain)
        assert first.state == pb.DRAIN_STATE_STARTED and first.in_flight_requests == 1
        held.release.set()
        decoded = await generation
        assert decoded[-1].WhichOneof("event") == "finished", decoded[-1]
        assert decoded[-1].usage.cached_prompt_tokens == 8
        last = first
        while last.state != pb.DRAIN_STATE_COMPLETE:
            last = await _drain_reply(drain)
        assert last.in_flight_requests == 0


async def unload_while_pulled(
    decoder: Engine,
    held: _HeldPrefillEngine,
    session: pb.KvSessionRef,
    adapter: pb.LoraAdapter,
) -> asyncio.Task[list[pb.GenerateResponse]]:
    """`adapter` loaded on `decoder`, a request naming it decoding `session` (held by the
    prefill engine, `held`), and the adapter unloaded while it is pulled: the request's
    generation, its pull still held."""
    await decoder.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))
    request = with_session(session)
    request.lora_name = adapter.lora_name
    generation = asyncio.create_task(collect(decoder.stub, request))
    await asyncio.wait_for(held.pulling.wait(), 10)
    await decoder.stub.UnloadLora(pb.UnloadLoraRequest(lora_name=adapter.lora_name))
    return generation


async def reload_while_pulled(
    decoder: Engine, held: _HeldPrefillEngine, session: pb.KvSessionRef, tmp_path: Path
) -> list[pb.GenerateResponse]:
    """A request naming adapter "a" decoding `session`, the adapter loaded again under its
    name (other weights) while the session is pulled: the request's generation."""
    old, new = (
        pb.LoraAdapter(
            lora_id=i, lora_name="a", source_path=str(write_adapter_config(tmp_path / d))
        )
        for i, d in ((1, "old"), (2, "new"))
    )
    generation = await unload_while_pulled(decoder, held, session, old)
    await decoder.stub.LoadLora(pb.LoadLoraRequest(adapter=new))
    held.release.set()
    return await generation


async def test_a_request_whose_adapter_is_unloaded_during_its_pull_is_served_with_it(
    tmp_path: Path,
) -> None:
    """Admitted, the request holds its adapter: an unload while its KV session is pulled
    does not take it away (it used to be refused NOT_FOUND after the pull, the session
    consumed); the adapter's weights go once it ends."""
    async with (
        held_prefill_engine() as (held, session),
        engines(sim_config(role="decode", lora=LoraConfig(enabled=True))) as (decoder,),
    ):
        adapter = pb.LoraAdapter(
            lora_id=1, lora_name="a", source_path=str(write_adapter_config(tmp_path / "a"))
        )
        generation = await unload_while_pulled(decoder, held, session, adapter)
        held.release.set()
        decoded = await generation
        assert decoded[-1].WhichOneof("event") == "finished", decoded[-1]
        assert decoded[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert decoded[-1].usage.cached_prompt_tokens == 8
        runner = decoder.app.service.engine_loop.core.runner
        assert isinstance(runner, SimRunner)
        assert runner.loras == {}


def import_outcomes(metrics: str) -> dict[str, float]:
    """`kvplane_engine_kv_imports_total` in a /metrics page, by outcome."""
    return {
        line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvplane_engine_kv_imports_total{")
    }


async def failed_after_its_submission(
    engine: Engine, request: pb.GenerateRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generate `request` on `engine`, accepting it failing after the engine thread took it
    (here: its metrics): the client is told INTERNAL. Returns once the request the engine
    thread took is over."""
    metrics = engine.app.service.metrics
    assert metrics is not None

    def metrics_down(request: object) -> None:
        raise RuntimeError("metrics down")

    monkeypatch.setattr(metrics, "on_accept", metrics_down)
    failed = await rpc_error(lambda: collect(engine.stub, request))
    assert failed.code() == grpc.StatusCode.INTERNAL
    monkeypatch.undo()

    async def ended() -> bool:
        load = await engine.stub.GetLoad(pb.GetLoadRequest())
        return load.running_requests == 0 and load.queued_requests == 0

    await eventually(ended, what="the request ended")


async def test_a_request_failing_after_its_submission_lets_go_of_its_adapter_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pull over, the request is submitted, and accepting it fails after the engine
    thread took it (here: its metrics): the request, aborted there, lets go of its adapter at
    its end, and only it. The adapter used to be released there too, twice in all: unloaded
    then, it stayed in the runner (and in its place among max_loras) for good."""
    config = sim_config(role="decode", lora=LoraConfig(enabled=True), metrics_listen="127.0.0.1:0")
    async with held_prefill_engine() as (held, session), engines(config) as (decoder,):
        adapter = pb.LoraAdapter(
            lora_id=1, lora_name="a", source_path=str(write_adapter_config(tmp_path / "a"))
        )
        await decoder.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))
        service = decoder.app.service
        request = with_session(session)
        request.lora_name = "a"
        held.release.set()
        await failed_after_its_submission(decoder, request, monkeypatch)
        await decoder.stub.UnloadLora(pb.UnloadLoraRequest(lora_name="a"))
        runner = service.engine_loop.core.runner
        assert isinstance(runner, SimRunner)
        assert runner.loras == {}
        await decoder.stub.LoadLora(pb.LoadLoraRequest(adapter=adapter))
        listed = await decoder.stub.ListLoras(pb.ListLorasRequest())
        assert [a.lora_name for a in listed.adapters] == ["a"]


async def test_a_decode_failing_after_its_submission_counts_one_import_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pull over, the request is submitted, and accepting it fails after the engine
    thread took it (here: its metrics): the client is told it failed, and the pull counts one
    import outcome, that of its blocks, which the engine thread imported as it took the
    request. It used to count "refused" too, as if never submitted: two for one pull."""
    config = sim_config(role="decode", metrics_listen="127.0.0.1:0")
    async with held_prefill_engine() as (held, session), engines(config) as (decoder,):
        held.release.set()
        await failed_after_its_submission(decoder, with_session(session), monkeypatch)
        text = await metrics_text(decoder)
        assert 'kvplane_engine_kv_pulls_total{model="sim",outcome="ok"} 1.0' in text
        assert import_outcomes(text) == {"imported": 1.0}


async def test_a_decode_failing_after_its_submission_releases_its_session_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pull over, the request is submitted, and accepting it fails after the engine
    thread took it (here: its metrics): the decode engine still tells the prefill engine to
    release the session (it needs it no longer), which lets go of it at once. The release used
    to be skipped, so the prefill engine held the session's blocks until `PULLED_GRACE_S` or
    its TTL passed (both made long here)."""
    prefill_config = sim_config(role="prefill", kv_transfer=KvTransferConfig(session_ttl_s=3600))
    decode_config = sim_config(role="decode", metrics_listen="127.0.0.1:0")
    with pytest.MonkeyPatch.context() as grace:  # (the helper undoes `monkeypatch`)
        grace.setattr(kv_transfer, "PULLED_GRACE_S", 3600.0)
        async with engines(prefill_config, decode_config) as (prefiller, decoder):
            session = await prefill(prefiller)
            await failed_after_its_submission(decoder, with_session(session), monkeypatch)
            await eventually(lambda: _no_sessions(prefiller), what="the session released")
            # The request was abandoned, not the engine: the next decode takes a session.
            decoded = await collect(decoder.stub, with_session(await prefill(prefiller)))
            assert len(tokens(decoded)) == 5


async def test_a_prefill_failing_after_its_submission_holds_no_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepting a prefill fails after the engine thread took it (here: its metrics): the
    client is told it failed, and the engine holds no session for it. The request used to run
    on: the session's release, sent as the failure was answered, reached the core before the
    prefill ended, so the core then held its blocks for good (no TTL: the session store had
    forgotten it), shown by GetLoad's active_kv_sessions and used_kv_blocks."""
    config = sim_config(role="prefill", metrics_listen="127.0.0.1:0")
    async with engines(config) as (prefiller,):
        await failed_after_its_submission(prefiller, generate_request(PROMPT), monkeypatch)
        # The engine serves on, and the next request's session is the only one it holds.
        await prefill(prefiller)
        load = await prefiller.stub.GetLoad(pb.GetLoadRequest())
        assert (load.active_kv_sessions, load.used_kv_blocks) == (1, 2)


async def test_a_pulled_session_never_enters_the_cache_under_an_adapter_reloaded_meanwhile(
    tmp_path: Path,
) -> None:
    """The request's adapter is loaded afresh under its name (other weights) while its KV
    session is pulled: the request runs with the weights it was accepted with, and the
    blocks it pulled, computed with those, are not cached under the name, which the new
    weights serve now: a later request naming it hits none of them."""
    async with (
        held_prefill_engine() as (held, session),
        engines(sim_config(role="decode", lora=LoraConfig(enabled=True))) as (decoder,),
    ):
        decoded = await reload_while_pulled(decoder, held, session, tmp_path)
        assert decoded[-1].finished.reason == pb.FINISH_REASON_LENGTH, decoded[-1]
        later = generate_request(PROMPT, max_tokens=1)
        later.lora_name = "a"
        responses = await collect(decoder.stub, later)
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH, responses[-1]
        assert responses[-1].usage.cached_prompt_tokens == 0


async def test_an_abort_during_the_pull_ends_the_request_as_one_aborted_before_its_prefill() -> (
    None
):
    """As an aggregated engine ends a request aborted while queued (and as this one ends it
    aborted later): each output finished CANCELLED, the last with the Usage of its prompt,
    status OK; the pull cancelled, the session released on the prefill engine, which the
    request needs no longer. It used to end with the status CANCELLED, the session kept."""
    async with (
        held_prefill_engine() as (held, session),
        engines(sim_config(role="decode", metrics_listen="127.0.0.1:0")) as (decoder,),
    ):
        request = with_session(session)
        request.request_id = "pulling"
        request.sampling.num_sequences = 2
        generation = asyncio.create_task(collect(decoder.stub, request))
        await asyncio.wait_for(held.pulling.wait(), 10)
        # Its id is taken while it pulls: a second request of that id would pull for nothing.
        duplicate = await rpc_error(lambda: collect(decoder.stub, request))
        assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS
        reply = await decoder.stub.Abort(pb.AbortRequest(request_id="pulling"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        # At once, not when the (held) pull ends: the transfer is cancelled.
        events = await asyncio.wait_for(generation, 5)
        assert events == _aborted_before_its_prefill("pulling", num_outputs=2)
        await asyncio.wait_for(held.released_one.wait(), 10)
        assert held.released == [session.session_id]
        held.release.set()
        load = await decoder.stub.GetLoad(pb.GetLoadRequest())
        assert load.running_requests == 0 and load.used_kv_blocks == 0
        again = await decoder.stub.Abort(pb.AbortRequest(request_id="pulling"))
        assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
        text = await metrics_text(decoder)
        assert 'kvplane_engine_kv_pulls_total{model="sim",outcome="cancelled"} 1.0' in text
        _assert_counted_as_aborted_before_its_prefill(text, num_outputs=2)


@pytest.mark.parametrize("ids", [PROMPT_IDS, OUT_OF_VOCABULARY], ids=["taken", "refused"])
async def test_an_abort_while_the_request_is_converted_releases_its_session(
    ids: list[int],
) -> None:
    """A DECODE engine's request aborted before its pull, while its text prompt is tokenised:
    it ends as one aborted before its prefill, and the prefill engine is told to release the
    session, which the request needs no longer, as when it is aborted during the pull (even
    when the conversion then refuses the prompt: the abort wins). The session used to stay
    held until its TTL."""
    tokenizer = BlockingTokenizer(ids)
    async with (
        engines(sim_config(role="prefill")) as (prefiller,),
        text_engine(tokenizer, role="decode") as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client,
    ):
        session = await prefill(prefiller, PROMPT_IDS)
        request = pb.GenerateRequest(
            request_id="converting", prompt=HUGE_PROMPT, stopping=pb.StoppingOptions(max_tokens=3)
        )
        request.kv.session.CopyFrom(session)
        reply, events = await aborted_while_tokenised(client, tokenizer, request)
        assert reply.status == pb.ABORT_STATUS_ABORTED
        assert [e.finished.reason for e in events] == [pb.FINISH_REASON_CANCELLED]
        await eventually(lambda: _no_sessions(prefiller), what="the session released")


def _assert_counted_as_aborted_before_its_prefill(metrics: str, num_outputs: int) -> None:
    """How an engine's metrics count one request of PROMPT aborted before its prefill: an
    accepted request, each output finished cancelled, the tokens of its prompt."""
    for line in (
        'kvplane_engine_requests_total{model="sim"} 1.0',
        f'kvplane_engine_finished_outputs_total{{model="sim",reason="cancelled"}} {num_outputs}.0',
        f'kvplane_engine_prompt_tokens_total{{model="sim"}} {len(PROMPT)}.0',
    ):
        assert line in metrics, line


def _aborted_before_its_prefill(request_id: str, num_outputs: int) -> list[pb.GenerateResponse]:
    """How an engine ends a request of PROMPT aborted before its prefill: each output
    finished CANCELLED ("aborted"), the last with the Usage of its prompt alone."""
    events = [
        pb.GenerateResponse(
            request_id=request_id,
            finished=pb.GenerationFinished(
                output_index=index, reason=pb.FINISH_REASON_CANCELLED, message="aborted"
            ),
        )
        for index in range(num_outputs)
    ]
    events[-1].usage.CopyFrom(
        pb.Usage(prompt_tokens=len(PROMPT), total_tokens=len(PROMPT), cached_prompt_tokens=0)
    )
    return events


async def test_an_aggregated_engine_ends_a_request_aborted_before_its_prefill_alike() -> None:
    """The end the test above expects is an aggregated engine's for the same request aborted
    while queued (its engine thread busy: the core has not begun it), and so are the metrics
    (a DECODE engine's used to count neither the request nor its outputs)."""
    async with engines(sim_config(metrics_listen="127.0.0.1:0")) as (engine,):
        request = generate_request(PROMPT, max_tokens=5)
        request.request_id = "queued"
        request.sampling.num_sequences = 2
        async with engine_thread_held(engine.app.service):
            generation = asyncio.create_task(collect(engine.stub, request))

            def in_flight() -> bool:
                return engine.app.service.num_in_flight == 1

            await eventually(in_flight, what="the request accepted")
            abort = asyncio.ensure_future(engine.stub.Abort(pb.AbortRequest(request_id="queued")))
            commands = engine.app.service.engine_loop._commands  # the thread's queue

            def abort_queued() -> bool:  # behind the request's admission: the core adds it
                return len(commands) == 2  # and aborts it before a step

            await eventually(abort_queued, what="the Abort queued")
        assert (await abort).status == pb.ABORT_STATUS_ABORTED
        assert await generation == _aborted_before_its_prefill("queued", num_outputs=2)
        _assert_counted_as_aborted_before_its_prefill(await metrics_text(engine), num_outputs=2)


async def test_metrics_count_pulls_by_outcome_and_open_sessions() -> None:
    metered = {"metrics_listen": "127.0.0.1:0"}
    async with engines(
        sim_config(role="prefill", **metered), sim_config(role="decode", **metered)
    ) as (
        prefiller,
        decoder,
    ):
        session = await prefill(prefiller)
        assert 'kvplane_engine_open_kv_sessions{model="sim"} 1.0' in await metrics_text(prefiller)
        await collect(decoder.stub, with_session(session))
        gone = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert gone.code() == grpc.StatusCode.NOT_FOUND
        nixl = pb.KvSessionRef()
        nixl.CopyFrom(session)
        nixl.transfer_backend = "nixl"
        refused = await rpc_error(lambda: collect(decoder.stub, with_session(nixl)))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        text = await metrics_text(decoder)
        for outcome, count in (("ok", 1), ("not_found", 1), ("refused", 1)):
            line = f'kvplane_engine_kv_pulls_total{{model="sim",outcome="{outcome}"}} {count}.0'
            assert line in text, outcome
        assert 'kvplane_engine_kv_pulled_blocks_total{model="sim"} 2.0' in text
        assert 'kvplane_engine_open_kv_sessions{model="sim"} 0.0' in await metrics_text(prefiller)


async def test_a_prefill_engine_with_auth_serves_pulls_to_its_token_only(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    auth = AuthConfig(token_file=token_file)
    peer = KvTransferConfig(peer_token_file=token_file)
    async with engines(
        sim_config(role="prefill", auth=auth),
        sim_config(role="decode"),
        sim_config(role="decode", kv_transfer=peer),
    ) as (prefiller, anonymous, trusted):
        session = await prefill(prefiller)  # inference needs no token
        stub = kt_grpc.KvTransferStub(prefiller.channel)
        pull = stub.PullKvSession(kt.PullKvSessionRequest(session_id=session.session_id))
        _, error = await stream_error(pull)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        refused = await rpc_error(lambda: collect(anonymous.stub, with_session(session)))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "peer_token_file" in (refused.details() or "")
        decoded = await collect(trusted.stub, with_session(session))
        assert decoded[-1].usage.cached_prompt_tokens == 8


async def test_a_decode_engine_pulls_with_its_peer_tls_files_renewed_on_disk(
    pki: Path, tmp_path: Path
) -> None:
    """A prefill engine serving mutual TLS, and a decode engine whose `peer_tls` client
    certificate it does not trust: the pull is refused. The certificate renewed on disk with
    one it trusts, the next pull is served, the decode engine not restarted. (Its channel to
    the peer kept the certificate it was dialled with: every pull failed until a restart.)"""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_bytes((pki / "other-ca-client.pem").read_bytes())
    key.write_bytes((pki / "other-ca-client.key").read_bytes())
    serving = TlsConfig(
        cert_file=pki / "server.pem", key_file=pki / "server.key", client_ca_file=pki / "ca.pem"
    )
    trusted = ClientTlsConfig(
        ca_file=pki / "ca.pem", cert_file=pki / "client.pem", key_file=pki / "client.key"
    )
    peer = KvTransferConfig(
        peer_tls=ClientTlsConfig(ca_file=pki / "ca.pem", cert_file=cert, key_file=key)
    )
    async with AsyncExitStack() as stack:
        prefiller = await stack.enter_async_context(
            running_engine(sim_config(role="prefill", tls=serving), ClientChannels.load(trusted))
        )
        decoder = await stack.enter_async_context(
            running_engine(sim_config(role="decode", kv_transfer=peer))
        )
        session = await prefill(prefiller)
        refused = await rpc_error(lambda: collect(decoder.stub, with_session(session)))
        assert "Socket closed" in (refused.details() or ""), refused.details()
        replace_file(cert, (pki / "client.pem").read_bytes())
        replace_file(key, (pki / "client.key").read_bytes())
        decoded = await collect(decoder.stub, with_session(await prefill(prefiller)))
        assert decoded[-1].usage.cached_prompt_tokens == 8


async def test_prefill_and_decode_engines_are_ready_and_advertise_their_connector() -> None:
    async with engines(sim_config(role="prefill"), sim_config(role="decode"), sim_config()) as (
        prefiller,
        decoder,
        aggregated,
    ):
        for engine, role in (
            (prefiller, pb.ENGINE_ROLE_PREFILL),
            (decoder, pb.ENGINE_ROLE_DECODE),
        ):
            health = await engine.stub.Health(pb.HealthRequest(role=role))
            assert health.state == pb.HEALTH_STATE_READY, health
            assert "kv_connector" in [c.name for c in health.checks]
            connector = await engine.stub.GetKvConnectorInfo(pb.GetKvConnectorInfoRequest())
            info = await engine.stub.GetEngineInfo(pb.GetEngineInfoRequest())
            assert info.kv_connector == connector
            assert connector.enabled and connector.transfer_backend == "kvplane-pull"
            assert [(e.host, e.port, e.protocol) for e in connector.local_endpoints] == [
                ("127.0.0.1", engine.app.port, "grpc")
            ]
            assert list(connector.supported_protocols) == ["grpc"]
            assert connector.supports_remote_prefill == (role == pb.ENGINE_ROLE_PREFILL)
            assert connector.supports_decode_pull == (role == pb.ENGINE_ROLE_DECODE)
            assert connector.supports_abort_cleanup and connector.supports_drain
            probed = await engine.stub.Health(pb.HealthRequest(include_inference_probe=True))
            assert probed.state == pb.HEALTH_STATE_READY
        connector = await aggregated.stub.GetKvConnectorInfo(pb.GetKvConnectorInfoRequest())
        assert connector.HasField("enabled") and not connector.enabled


async def test_every_completed_pull_counts_one_import_outcome(tmp_path: Path) -> None:
    """`kvplane_engine_kv_imports_total` counts one outcome for each pull that ended "ok":
    blocks imported, blocks never imported because the request's adapter was loaded again
    meanwhile ("superseded"), and a request aborted as its pull ended, never submitted
    ("aborted", the Abort landing in the same turn of the event loop as the pull's end). The
    last two used to count none. The held bytes are exported (none held here)."""
    async with (
        held_prefill_engine() as (held, session),
        engines(
            sim_config(role="decode", lora=LoraConfig(enabled=True), metrics_listen="127.0.0.1:0")
        ) as (decoder,),
    ):
        decoded = await reload_while_pulled(decoder, held, session, tmp_path)
        assert decoded[-1].finished.reason == pb.FINISH_REASON_LENGTH
        imported = await collect(decoder.stub, with_session(session))  # no adapter
        assert imported[-1].usage.cached_prompt_tokens == 8

        service = decoder.app.service
        assert service.metrics is not None
        request = EngineRequest("late", tuple(PROMPT), SamplingParams(max_tokens=1))
        handle = service.begin_pull(request)
        assert await service.abort("late") == AbortOutcome.ABORTED
        pulled = PulledSession(tuple(PROMPT[:8]), [b"", b""])
        importer = pulled.importer(
            request, max_held_bytes=0, on_outcome=service.metrics.on_kv_import
        )
        with pytest.raises(RequestAbortedError):
            service.end_pull(handle, request, importer, num_blocks=2)

        text = await metrics_text(decoder)
        assert 'kvplane_engine_kv_pulls_total{model="sim",outcome="ok"} 3.0' in text
        assert import_outcomes(text) == {"superseded": 1.0, "imported": 1.0, "aborted": 1.0}
        assert 'kvplane_engine_held_kv_bytes{model="sim"} 0.0' in text
