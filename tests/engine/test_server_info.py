"""OpenEngine metadata, load, health, unsupported features and auth, through real stubs."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import KvEventsConfig
from kvplane.config import AuthConfig
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    collect,
    generate_request,
    idle,
    rpc_error,
    running_engine,
    sim_config,
)
from tests.grpc_streams import remaining_replies
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)


async def test_engine_info_advertises_the_contract_revision() -> None:
    config = sim_config(instance_id="engine-7", served_model_aliases=["sim-alias"])
    async with running_engine(config) as engine:
        info = await engine.stub.GetEngineInfo(pb.GetEngineInfoRequest())
    assert (info.schema_revision, info.minimum_client_revision) == (1, 1)
    assert info.schema_release and info.schema_release not in ("main", "master")
    assert info.engine_name == "kvplane"
    assert info.instance_id == "engine-7"
    assert info.role == pb.ENGINE_ROLE_AGGREGATED
    assert list(info.supported_models) == ["sim", "sim-alias"]
    assert info.parallelism.HasField("data_parallel_rank")
    assert info.kv_connector.HasField("enabled") and not info.kv_connector.enabled


@pytest.mark.parametrize("rank", [0, 3])
async def test_engine_info_tells_no_data_parallel_size_its_rank_is_outside(rank: int) -> None:
    """A lone engine (rank 0) is a data-parallel group of 1; one given rank 3
    (`kv_events.data_parallel_rank`) is one rank of a group whose size it is not told: the
    size is left absent (not reported, the seed), as rank 3 < size 1 cannot be. It said 1
    whatever the rank."""
    config = sim_config(kv_events=KvEventsConfig(data_parallel_rank=rank))
    async with running_engine(config) as engine:
        info = await engine.stub.GetEngineInfo(pb.GetEngineInfoRequest())
    parallelism = info.parallelism
    assert (parallelism.data_parallel_rank, parallelism.data_parallel_start_rank) == (rank, rank)
    assert parallelism.HasField("data_parallel_size") is (rank == 0)
    if parallelism.HasField("data_parallel_size"):
        assert parallelism.data_parallel_rank < parallelism.data_parallel_size


async def test_model_info_says_exactly_what_is_supported() -> None:
    async with running_engine() as engine:
        assert (
            await rpc_error(engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="nope")))
        ).code() == grpc.StatusCode.NOT_FOUND
        assert (
            await rpc_error(engine.stub.GetModelInfo(pb.GetModelInfoRequest()))
        ).code() == grpc.StatusCode.INVALID_ARGUMENT
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
    assert info.served_model_name == "sim"
    assert (info.kv_block_size, info.total_kv_blocks, info.max_context_length) == (4, 64, 256)
    assert info.max_running_requests == 8 and info.max_batched_tokens == 256
    # The context is the KV cache's when that is smaller than the model's length: its 32
    # slots and the last token, sampled but never computed.
    async with running_engine(sim_config(num_kv_blocks=8)) as small:
        small_info = await small.stub.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
    assert (small_info.max_context_length, small_info.max_output_tokens) == (33, 32)
    # Unsupported is an explicit false, never absent.
    gen = info.generation
    assert gen.guided_decoding.HasField("supported") and not gen.guided_decoding.supported
    assert info.HasField("supports_lora") and not info.supports_lora
    assert info.HasField("supports_multimodal") and not info.supports_multimodal
    for task in (info.tasks.embed, info.tasks.classify, info.tasks.score):
        assert task.HasField("supported") and not task.supported
    # The sim runner has no tokenizer: token ids only.
    assert info.HasField("supports_text_input") and not info.supports_text_input
    assert info.supports_token_ids_input
    assert gen.output_logprobs.supported and gen.prompt_logprobs.supported
    assert (
        pb.CANDIDATE_TOKEN_SELECTION_MODE_UNSPECIFIED
        not in gen.output_logprobs.candidate_selection_modes
    )
    assert gen.supports_priority and gen.supports_cache_salt and gen.supports_prefix_cache_bypass


async def test_load_reports_every_scalar() -> None:
    async with running_engine() as engine:
        await collect(engine.stub, generate_request(list(range(12)), max_tokens=2))
        # The last response leaves before the engine's loop frees the request.
        await eventually(lambda: idle(engine), what="the engine to free the request")
        load = await engine.stub.GetLoad(pb.GetLoadRequest(include_per_rank=True))
    for name in (
        "timestamp_unix_nanos",
        "running_requests",
        "queued_requests",
        "active_kv_sessions",
        "used_kv_blocks",
        "total_kv_blocks",
        "running_tokens",
        "waiting_tokens",
        "prefill_batch_size",
        "decode_batch_size",
    ):
        assert load.HasField(name), name
    assert load.total_kv_blocks == 64
    assert load.running_requests == 0 and load.used_kv_blocks == 0  # a present, measured zero
    assert int(load.attributes["cached_kv_blocks"]) == 3  # the 12-token prompt's 3 blocks
    assert len(load.ranks) == 1 and load.ranks[0].HasField("data_parallel_rank")


async def test_health_with_probe_and_role() -> None:
    async with running_engine() as engine:
        health = await engine.stub.Health(pb.HealthRequest(include_inference_probe=True))
        assert health.state == pb.HEALTH_STATE_READY
        probe = {c.name: c for c in health.checks}["inference_probe"]
        assert probe.state == pb.HEALTH_STATE_READY
        wrong_role = await engine.stub.Health(pb.HealthRequest(role=pb.ENGINE_ROLE_PREFILL))
        assert wrong_role.state == pb.HEALTH_STATE_NOT_READY
        assert {c.name: c.state for c in wrong_role.checks}["role"] == pb.HEALTH_STATE_NOT_READY
        unknown = await rpc_error(engine.stub.Health(pb.HealthRequest(model="other")))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND
        standard = health_pb2_grpc.HealthStub(engine.channel)
        serving = await standard.Check(
            health_pb2.HealthCheckRequest(service="openengine.v1.OpenEngine")
        )
        assert serving.status == health_pb2.HealthCheckResponse.SERVING


async def test_unsupported_features_fail_before_acceptance() -> None:
    async with running_engine() as engine:
        stub = engine.stub
        ctx = pb.TaskRequestContext(request_id="t", model="sim")
        text = [pb.TaskInput(item_id="a", text="x")]
        for call in (
            stub.Embed(pb.EmbedRequest(context=ctx, inputs=text)),
            stub.Classify(pb.ClassifyRequest(context=ctx, inputs=text)),
            stub.Score(pb.ScoreRequest(context=ctx)),
            stub.LoadLora(pb.LoadLoraRequest()),
            stub.UnloadLora(pb.UnloadLoraRequest(lora_name="a")),
            stub.ListLoras(pb.ListLorasRequest()),
        ):
            assert (await rpc_error(call)).code() == grpc.StatusCode.FAILED_PRECONDITION
        other = pb.TaskRequestContext(request_id="t", model="other")
        embed = stub.Embed(pb.EmbedRequest(context=other, inputs=text))
        assert (await rpc_error(embed)).code() == grpc.StatusCode.NOT_FOUND
        connector = await stub.GetKvConnectorInfo(pb.GetKvConnectorInfoRequest())
        assert connector.HasField("enabled") and not connector.enabled


async def test_tasks_without_request_id_or_model_are_invalid_argument() -> None:
    # The seed: TaskRequestContext.request_id and model are required and non-empty; a
    # malformed request is INVALID_ARGUMENT even where the task itself is unsupported.
    async with running_engine() as engine:
        stub = engine.stub
        text = [pb.TaskInput(item_id="a", text="x")]
        for ctx in (
            pb.TaskRequestContext(request_id="", model="sim"),
            pb.TaskRequestContext(request_id="t", model=""),
        ):
            for call in (
                stub.Embed(pb.EmbedRequest(context=ctx, inputs=text)),
                stub.Classify(pb.ClassifyRequest(context=ctx, inputs=text)),
                stub.Score(pb.ScoreRequest(context=ctx)),
            ):
                assert (await rpc_error(call)).code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_decode_role_prefills_a_request_without_a_session_itself() -> None:
    async with running_engine(sim_config(role="decode")) as engine:
        info = await engine.stub.GetEngineInfo(pb.GetEngineInfoRequest())
        assert info.role == pb.ENGINE_ROLE_DECODE
        # As vLLM's decode instances do (the gateway's `router.skip_prefill_ratio` relies on it).
        responses = await collect(engine.stub, generate_request([1, 2, 3]))
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
        health = await engine.stub.Health(pb.HealthRequest(role=pb.ENGINE_ROLE_DECODE))
        assert health.state == pb.HEALTH_STATE_READY
        assert "kv_transfer" not in [c.name for c in health.checks]


async def test_bearer_token_guards_mutating_methods_only(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    async with running_engine(sim_config(auth=AuthConfig(token_file=token_file))) as engine:
        # Inference and reads need no token.
        done = await collect(engine.stub, generate_request([1, 2, 3], max_tokens=1))
        assert done[-1].HasField("usage")
        await engine.stub.GetLoad(pb.GetLoadRequest())
        # Abort and Drain do.
        error = await rpc_error(engine.stub.Abort(pb.AbortRequest(request_id="x")))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        drain = await rpc_error(remaining_replies(engine.stub.Drain(pb.DrainRequest())))
        assert drain.code() == grpc.StatusCode.UNAUTHENTICATED
        with_token = await rpc_error(
            engine.stub.Abort(
                pb.AbortRequest(request_id="x"), metadata=(("authorization", "Bearer s3cret"),)
            )
        )
        assert with_token.code() == grpc.StatusCode.NOT_FOUND  # authorised, then a real answer


async def test_prometheus_metrics_on_the_side_port() -> None:
    async with running_engine(sim_config(metrics_listen="127.0.0.1:0")) as engine:
        await collect(engine.stub, generate_request(list(range(12)), max_tokens=3))
        # Health probes are the engine's own work, not load: not counted.
        for _ in range(3):
            probed = await engine.stub.Health(pb.HealthRequest(include_inference_probe=True))
            assert probed.state == pb.HEALTH_STATE_READY
        # A client cannot pass for one.
        posing = generate_request([1, 2], request_id="kvplane-health-probe-1")
        refused = await rpc_error(lambda: collect(engine.stub, posing))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        port = engine.app.metrics_port
        assert port is not None
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        )
    text = body.decode()
    assert 'kvplane_engine_requests_total{model="sim"} 1.0' in text
    assert 'kvplane_engine_generation_tokens_total{model="sim"} 3.0' in text
    assert "kvplane_engine_step_seconds_bucket" in text
