"""Every RPC of every server kvplane runs, fed malformed-but-decodable requests
(`tests/proto_strategies.py`) through a real client: a sim engine with LoRA on (OpenEngine,
vllm.Generate, KvTransfer), the builtin torch model (Generate, Embed, Classify, Score,
vllm.Generate), a controller fronting two sim engines and the torch one (its OpenEngine
gateway, vllm.Generate, Admin) and an indexer on the memory backend and one on Redis
(kv_indexer.v1 KVIndexer, KvIndex).

The property: a refusal is a status a client can act on, never UNKNOWN (an exception escaped
the servicer) nor INTERNAL (kvplane keeps INTERNAL for its own documented faults, none of
which a request can cause on these servers), and never a wedged call; afterwards the server
still answers a well-formed request correctly, so nothing it holds was corrupted.

The servers run on one event loop in a background thread for the whole module, because
hypothesis drives a synchronous test body; each example is one coroutine sent to that loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import message_factory, struct_pb2
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import LoraConfig
from engine.server.service import EngineApp, start_engine
from indexer.backend import IndexBackend
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import open_redis_backend
from indexer.servicer import index_services
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kvplane.config import ServerConfig
from kvplane.server import create_server
from kvplane_api.v1 import admin_pb2, index_pb2, kv_transfer_pb2
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import Fleet, close_fleet, make_fleet, start_sim_engine
from tests.engine.engine_server_harness import sim_config, torch_config
from tests.engine.lora_adapters import write_adapter_config
from tests.proto_strategies import messages, mutations
from tests.redis_servers import RedisServer
from vllm_grpc import vllm_grpc_pb2 as vpb

T = TypeVar("T")

# The indexer on each backend: the same servicers, different stores behind them.
INDEXERS = ("indexer", "redis-indexer")

OPENENGINE = pb.DESCRIPTOR.services_by_name["OpenEngine"]
VLLM = vpb.DESCRIPTOR.services_by_name["Generate"]
KV_TRANSFER = kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"]
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"]
KV_INDEXER = kv.DESCRIPTOR.services_by_name["KVIndexer"]
KV_INDEX = index_pb2.DESCRIPTOR.services_by_name["KvIndex"]

# A drain may stop admission for good, which would fail every later check of the shared
# engine: it has its own test, on a fresh engine per example. (The admin API's DrainEngine
# stays: random input never names an engine of the fleet.)
DRAIN = OPENENGINE.methods_by_name["Drain"]

# A unary call that takes this long is wedged (every refusal here is local and immediate).
UNARY_DEADLINE_S = 20.0
# How long a server stream gets to refuse before it counts as accepted; an accepted
# subscription never ends by itself, so the window is short and then the call is cancelled.
STREAM_WINDOW_S = 0.05
STREAM_MESSAGES = 4

NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}


class BackgroundLoop:
    """An event loop in its own thread; `run` sends it a coroutine and waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@dataclass(repr=False)  # hypothesis prints the fixture with each failure
class Servers:
    loop: BackgroundLoop
    engine: EngineApp
    torch_engine: EngineApp
    fleet: Fleet
    indexers: list[tuple[grpc.aio.Server, IndexBackend]]
    channels: dict[str, grpc.aio.Channel]
    # WELL_FORMED and the requests that name a file the fixture wrote.
    well_formed: dict[str, Message]


async def _serve_index(backend: IndexBackend) -> tuple[grpc.aio.Server, IndexBackend, int]:
    """`backend` behind both index services, as `kvplane indexer serve` runs them."""
    services, _, _ = index_services(backend, default_block_size=16, max_concurrent_prefix_queries=8)
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    return server, backend, port


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Servers]:
    redis_server.flushall()
    from engine.torch_runner.builtin_model import write_builtin_model  # torch: only here

    loop = BackgroundLoop()
    builtin_dir = write_builtin_model(tmp_path_factory.mktemp("builtin"))
    adapter_dir = write_adapter_config(tmp_path_factory.mktemp("lora") / "adapter", r=4)
    adapter = pb.LoraAdapter(lora_id=1, lora_name="adapter", source_path=str(adapter_dir))
    well_formed = {
        **WELL_FORMED,
        "openengine.v1.OpenEngine.LoadLora": pb.LoadLoraRequest(adapter=adapter),
    }

    async def start() -> Servers:
        engine = await start_engine(sim_config(lora=LoraConfig(enabled=True)))
        torch_engine = await start_engine(
            torch_config(str(builtin_dir), served_model_name="builtin", max_model_len=256)
        )
        # The controller fronts the torch engine too, so that its pooling relays are reached.
        fleet = await make_fleet(
            engines=[await start_sim_engine(f"sim-{i}") for i in range(2)] + [torch_engine]
        )
        indexers = [
            await _serve_index(MemoryBackend()),
            await _serve_index(await open_redis_backend(redis_server.url, buckets=16)),
        ]
        channels = {
            name: grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            for name, port in [
                ("engine", engine.port),
                ("torch", torch_engine.port),
                ("controller", fleet.app.port),
                *zip(INDEXERS, (port for _, _, port in indexers), strict=True),
            ]
        }
        # The sentinel entry the indexer checks answer from (`healthy`).
        sentinel = kv.ApplyExternalKvBatchRequest(worker_id="sentinel", worker_address="s:1")
        sentinel.actions.add(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=[11, 12])
        apply = KV_INDEXER.methods_by_name["ApplyExternalKvBatch"]
        for name in INDEXERS:
            await call_rpc(channels[name], apply, sentinel)
        served = [(server, backend) for server, backend, _ in indexers]
        return Servers(loop, engine, torch_engine, fleet, served, channels, well_formed)

    s = loop.run(start())
    try:
        yield s
    finally:

        async def stop() -> None:
            for channel in s.channels.values():
                await channel.close()
            for server, backend in s.indexers:
                await server.stop(None)
                await backend.close()
            await close_fleet(s.fleet)
            await s.engine.close()  # the fleet closed the torch engine

        loop.run(stop())
        loop.close()


async def call_rpc(
    channel: grpc.aio.Channel,
    method: MethodDescriptor,
    request: Message,
    *,
    window_s: float = STREAM_WINDOW_S,
    max_messages: int | None = STREAM_MESSAGES,
) -> list[Message]:
    """Call `method` with `request`; a server stream is read for at most `max_messages`
    (None: all) within `window_s`, then cancelled. Raises the call's AioRpcError."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_class = message_factory.GetMessageClass(method.output_type)
    serialize = type(request).SerializeToString
    if not method.server_streaming:
        unary = channel.unary_unary(
            path, request_serializer=serialize, response_deserializer=response_class.FromString
        )
        return [await unary(request, timeout=UNARY_DEADLINE_S)]
    stream = channel.unary_stream(
        path, request_serializer=serialize, response_deserializer=response_class.FromString
    )(request)
    got: list[Message] = []
    try:
        async with asyncio.timeout(window_s):
            async for response in stream:
                got.append(response)
                if max_messages is not None and len(got) >= max_messages:
                    break
    except TimeoutError:
        pass  # accepted and still streaming
    finally:
        stream.cancel()
    return got


async def index_dump(channel: grpc.aio.Channel) -> list[bytes]:
    """Everything the indexer holds, as DumpIndex streams it (in a stable order)."""
    batches = await call_rpc(
        channel,
        KV_INDEX.methods_by_name["DumpIndex"],
        index_pb2.DumpIndexRequest(),
        window_s=UNARY_DEADLINE_S,
        max_messages=None,
    )
    return sorted(b.SerializeToString(deterministic=True) for b in batches)


def _generate(request_id: str, model: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=pb.TokenIds(ids=_prompt(5)),
        stopping=pb.StoppingOptions(max_tokens=3, ignore_eos=True),
    )


_probe_ids = itertools.count()


async def healthy(servers: Servers, server: str) -> None:
    """`server` answers well-formed requests as it did before the fuzzing started."""
    channel = servers.channels[server]
    if server in INDEXERS:
        match = kv.MatchExternalKvRequest(hashes=[11, 12])
        (reply,) = await call_rpc(channel, KV_INDEXER.methods_by_name["MatchExternalKv"], match)
        assert isinstance(reply, kv.MatchExternalKvResponse)
        sentinel = [m for m in reply.matches if m.worker_id == "sentinel"]
        assert [list(t.hashes) for t in sentinel[0].hashes_by_tier] == [[11, 12]]
        return
    (health,) = await call_rpc(channel, OPENENGINE.methods_by_name["Health"], pb.HealthRequest())
    assert isinstance(health, pb.HealthResponse)
    assert health.state == pb.HEALTH_STATE_READY
    generate = OPENENGINE.methods_by_name["Generate"]
    # Named: the controller's engines serve two models (the sim engines' and the torch one's),
    # and a request naming none is refused there.
    probe = _generate(f"probe-{next(_probe_ids)}", "builtin" if server == "torch" else "sim")
    responses = await call_rpc(
        channel, generate, probe, window_s=UNARY_DEADLINE_S, max_messages=None
    )
    generated = [r for r in responses if isinstance(r, pb.GenerateResponse)]
    assert generated == responses
    tokens = [t.token_id for r in generated if r.HasField("token") for t in r.token.tokens]
    assert len(tokens) == 3, responses
    assert responses[-1].HasField("finished"), responses[-1]


def assert_refused_cleanly(exc: grpc.aio.AioRpcError) -> None:
    """The client received the server's own status: a code it can act on and one line."""
    details = exc.details() or ""
    assert exc.code() not in NEVER, f"{exc.code()}: {details}"
    # grpc's words when the client dropped a call whose trailers passed its metadata limit.
    assert "Stream removed" not in details, f"{exc.code()}: {details[:300]}"
    assert "\n" not in details and "Traceback" not in details, details


def _prompt(num_tokens: int) -> list[int]:
    return [(7 * i + 3) % 500 + 1 for i in range(num_tokens)]


def _task_input(item_id: str) -> pb.TaskInput:
    return pb.TaskInput(item_id=item_id, token_ids=pb.TokenIds(ids=_prompt(6)))


# The torch engine's served name: the sim engines refuse pooling tasks whatever they name.
TASK_CONTEXT = pb.TaskRequestContext(request_id="fuzz", model="builtin")

# Well-formed requests that `mutations` breaks one field at a time, so that most examples
# get past the first checks (a model name, a required field) to the code behind them.
WELL_FORMED: dict[str, Message] = {
    "openengine.v1.OpenEngine.Generate": pb.GenerateRequest(
        request_id="fuzz",
        token_ids=pb.TokenIds(ids=_prompt(12)),
        sampling=pb.SamplingParams(temperature=0.5, top_k=5, seed=1),
        stopping=pb.StoppingOptions(max_tokens=3, conditions=[pb.StopCondition(stop_token_id=9)]),
        response=pb.ResponseOptions(
            return_output_logprobs=True, output_candidates=pb.CandidateTokenSelection(top_n=2)
        ),
    ),
    "openengine.v1.OpenEngine.Embed": pb.EmbedRequest(
        context=TASK_CONTEXT,
        inputs=[_task_input("a"), _task_input("b")],
        options=pb.EmbedOptions(normalize=True, dimensions=8),
    ),
    "openengine.v1.OpenEngine.Classify": pb.ClassifyRequest(
        context=TASK_CONTEXT, inputs=[_task_input("a")]
    ),
    "openengine.v1.OpenEngine.Score": pb.ScoreRequest(
        context=TASK_CONTEXT,
        groups=[pb.ScoreGroup(group_id="g", query=_task_input("q"), candidates=[_task_input("c")])],
    ),
    "openengine.v1.OpenEngine.SubscribeKvEvents": pb.SubscribeKvEventsRequest(
        include_snapshot=True
    ),
    "vllm.Generate.Generate": vpb.GenerateRequest(
        token_ids=vpb.TokenIds(ids=_prompt(12)),
        temperature=0.5,
        stopping=vpb.StoppingCriteria(max_new_tokens=3),
        response=vpb.ResponseOptions(output_token_ids=True, output_logprobs=True),
    ),
    "kvplane.v1.Admin.Route": admin_pb2.PromptQuery(token_ids=pb.TokenIds(ids=_prompt(40))),
    "kvplane.v1.Admin.Match": admin_pb2.PromptQuery(token_ids=pb.TokenIds(ids=_prompt(40))),
    "kv_indexer.v1.KVIndexer.ApplyExternalKvBatch": kv.ApplyExternalKvBatchRequest(
        worker_id="w",
        worker_address="w:1",
        seq=1,
        actions=[
            kv.ExternalKvAction(
                type=kv.ACTION_REPORT,
                tier=kv.TIER_DRAM,
                hashes=[21, 22],
                component_masks=[1, 1],
                block_sizes=[16, 16],
                parent_block_hash=20,
            )
        ],
        cache_spec=kv.WorkerCacheSpec(version=1, components=1, full_tier_mask=7),
    ),
    "kv_indexer.v1.KVIndexer.MatchExternalKv": kv.MatchExternalKvRequest(hashes=[11, 12]),
    "kv_indexer.v1.KVIndexer.MatchExternalKvPrefix": kv.MatchExternalKvPrefixRequest(
        hashes=[11, 12], max_blocks=2
    ),
    "kv_indexer.v1.KVIndexer.GetExternalKvHitCounts": kv.GetExternalKvHitCountsRequest(hashes=[11]),
    "kvplane.v1.KvIndex.MatchTokens": index_pb2.MatchTokensRequest(
        token_ids=_prompt(64), block_size=16
    ),
}
WELL_FORMED["vllm.Generate.GenerateStream"] = WELL_FORMED["vllm.Generate.Generate"]


# The torch engine (the builtin model: a tokenizer, a pooler, real sampling) for the RPCs whose
# path differs from the sim engine's; every other RPC takes the same path on both.
TORCH_PATHS = [
    *(OPENENGINE.methods_by_name[name] for name in ("Generate", "Embed", "Classify", "Score")),
    *VLLM.methods,
]
TARGETS: list[tuple[str, MethodDescriptor]] = [
    *(
        (server, method)
        for server, services in [
            ("engine", [OPENENGINE, VLLM, KV_TRANSFER]),
            ("controller", [OPENENGINE, VLLM, ADMIN]),
            *((indexer, [KV_INDEXER, KV_INDEX]) for indexer in INDEXERS),
        ]
        for service in services
        for method in service.methods
        if method is not DRAIN
    ),
    *(("torch", method) for method in TORCH_PATHS),
]


@pytest.mark.parametrize(
    ("server", "method"),
    TARGETS,
    ids=[f"{server}-{method.containing_service.name}.{method.name}" for server, method in TARGETS],
)
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_a_malformed_request_is_refused_cleanly(
    servers: Servers, server: str, method: MethodDescriptor, data: st.DataObject
) -> None:
    base = servers.well_formed.get(method.full_name)
    if base is not None and server == "controller" and "model" in base.DESCRIPTOR.fields_by_name:
        # The controller's engines serve two models: a request naming none is refused there
        # before the code behind the model check is reached.
        base = type(base).FromString(base.SerializeToString())
        base.model = "sim"  # type: ignore[attr-defined]
    # Where a well-formed request is known, most examples break it a little.
    if base is not None and data.draw(st.integers(0, 3), label="mutate") > 0:
        request = data.draw(mutations(base), label="request")
    else:
        request = data.draw(messages(method.input_type), label="request")

    async def one_example() -> None:
        channel = servers.channels[server]
        before = await index_dump(channel) if server in INDEXERS else None
        try:
            await call_rpc(channel, method, request)
        except grpc.aio.AioRpcError as exc:
            assert_refused_cleanly(exc)
            if before is not None:
                # The indexer validates a whole request before it changes anything.
                assert await index_dump(channel) == before
        await healthy(servers, server)

    servers.loop.run(one_example())


LONG_VALUE = "v" * 70_000


@dataclass(frozen=True)
class LongValueRefusal:
    server: str
    method: MethodDescriptor
    request: Message
    code: grpc.StatusCode
    head: str
    tail: str


# A status message quotes what the client sent; each of these once ended the call with
# RESOURCE_EXHAUSTED "Stream removed" (the trailer passed the client's metadata limit).
LONG_VALUE_REFUSALS = [
    LongValueRefusal(
        "engine",
        OPENENGINE.methods_by_name["GetModelInfo"],
        pb.GetModelInfoRequest(model=LONG_VALUE),
        grpc.StatusCode.NOT_FOUND,
        "model 'vvv",
        "is not served here",
    ),
    LongValueRefusal(
        "controller",
        ADMIN.methods_by_name["Cordon"],
        admin_pb2.EngineRef(engine=LONG_VALUE),
        grpc.StatusCode.NOT_FOUND,
        "no engine 'vvv",
        "in the fleet",
    ),
    LongValueRefusal(
        "indexer",
        KV_INDEX.methods_by_name["ResyncEngine"],
        index_pb2.ResyncEngineRequest(engine=LONG_VALUE),
        grpc.StatusCode.NOT_FOUND,
        "engine 'vvv",
        "as `kvplane admin index stats` lists them)",
    ),
]


@pytest.mark.parametrize(
    "refusal", LONG_VALUE_REFUSALS, ids=[f"{r.server}-{r.method.name}" for r in LONG_VALUE_REFUSALS]
)
def test_a_refusal_quoting_a_long_value_keeps_its_status(
    servers: Servers, refusal: LongValueRefusal
) -> None:
    async def refused() -> grpc.aio.AioRpcError:
        try:
            await call_rpc(servers.channels[refusal.server], refusal.method, refusal.request)
        except grpc.aio.AioRpcError as exc:
            return exc
        raise AssertionError("the call succeeded")

    exc = servers.loop.run(refused())
    details = exc.details() or ""
    assert exc.code() == refusal.code, details[:200]
    assert details.startswith(refusal.head) and details.endswith(refusal.tail), details


@settings(max_examples=25, deadline=None, derandomize=True)
@given(request=messages(DRAIN.input_type))
def test_a_drain_with_any_options_leaves_the_engine_serving_or_draining(
    servers: Servers, request: pb.DrainRequest
) -> None:
    async def one_example() -> None:
        engine = await start_engine(sim_config())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
            # A request in flight, so that deadline_ms and abort_after_deadline have a use.
            in_flight = channel.unary_stream(
                f"/{OPENENGINE.full_name}/Generate",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateResponse.FromString,
            )(_generate("in-flight"))
            try:
                # The first message (STARTED) says the drain has begun.
                await call_rpc(channel, DRAIN, request, window_s=UNARY_DEADLINE_S, max_messages=1)
            except grpc.aio.AioRpcError as exc:
                assert_refused_cleanly(exc)
            finally:
                in_flight.cancel()
            (health,) = await call_rpc(
                channel, OPENENGINE.methods_by_name["Health"], pb.HealthRequest()
            )
            assert isinstance(health, pb.HealthResponse)
            if request.stop_accepting_new_requests:
                assert health.state == pb.HEALTH_STATE_DRAINING
            else:
                assert health.state == pb.HEALTH_STATE_READY
        await engine.close()

    servers.loop.run(one_example())


def _nest(struct: struct_pb2.Struct, depth: int) -> None:
    """Fill `struct` (in place: a copy would parse it) `depth` levels deep; each level is
    three protobuf messages (Struct, its map entry, Value), so a few dozen levels pass
    protobuf's parse limit of 100."""
    for _ in range(depth):
        struct = struct.fields["a"].struct_value


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("server", ["engine", "controller"])
def test_a_request_nested_too_deep_to_parse_is_invalid_argument(
    servers: Servers, server: str, method: str
) -> None:
    """It was UNKNOWN ("Unexpected <class 'DecodeError'>"), the status of a server bug; a
    unary call and a server stream alike."""
    request = vpb.GenerateRequest(
        token_ids=vpb.TokenIds(ids=_prompt(5)),
        stopping=vpb.StoppingCriteria(max_new_tokens=2),
    )
    _nest(request.kv.kv_transfer_params, 60)

    async def refused() -> grpc.aio.AioRpcError:
        try:
            await call_rpc(servers.channels[server], VLLM.methods_by_name[method], request)
        except grpc.aio.AioRpcError as exc:
            return exc
        raise AssertionError("the call succeeded")

    exc = servers.loop.run(refused())
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
    assert (exc.details() or "").startswith("the request does not parse: "), exc.details()
    servers.loop.run(healthy(servers, server))
