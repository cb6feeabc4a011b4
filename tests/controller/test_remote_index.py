"""The controller's remote index (`index: {remote: HOST:PORT}`) against a real `kvplane indexer`
gRPC server: a worker indexed in vLLM's own hash space (a `hash: engine` source fed by vLLM)
is found only when the controller hashes prompts in that space (`remote_key_space`)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.config import ControllerConfig
from controller.fleet import Fleet
from controller.remote_index import RemoteIndex, RemoteIndexError
from controller.router import PrefixHit, cacheable_blocks
from indexer.backend import IndexBackend
from indexer.batch import to_sfixed64
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import RedisBackend, open_redis_backend
from indexer.servicer import index_services
from indexer.vllm_hash import VllmHashAlgo, block_hashes
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.config import AuthConfig, ServerConfig
from kvplane.errors import KvplaneError
from kvplane.server import create_server
from kvplane_api.v1 import index_pb2 as ipb
from kvplane_api.v1 import index_pb2_grpc as ipb_grpc
from tests.controller.conftest import start_sim_engine
from tests.controller.test_processes import KVPLANE
from tests.partial_servicers import PartialKvIndex
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(120)

TOKENS = list(range(1000, 1070))  # 4 full blocks of 16, then 6 more tokens


async def _own_index_hits(index: IndexBackend) -> dict[str, PrefixHit]:
    """Each engine's hit of TOKENS (blocks of 16) in a controller's own index, every block
    served alike (`Fleet._indexed_hits`)."""
    keys = block_keys(TOKENS, 16)
    cacheable = cacheable_blocks(len(TOKENS), 16, len(keys))
    return await Fleet._indexed_hits(index, keys, PrefixHit.blocks_within, cacheable)


ENGINE = "10.0.0.7:8000"
CANONICAL_KEYS = [to_sfixed64(k) for k in block_keys(TOKENS, 16)]


@pytest.mark.parametrize(
    ("algo", "key_space", "seed"),
    [
        (VllmHashAlgo.SHA256, "sha256", None),
        (VllmHashAlgo.SHA256_CBOR, "sha256_cbor", None),
        (VllmHashAlgo.SHA256, "sha256", "42"),
    ],
)
async def test_vllm_hashed_worker_is_matched_in_its_key_space(
    algo: VllmHashAlgo, key_space: str, seed: str | None
) -> None:
    services, _, _ = index_services(
        MemoryBackend(PrefixIndex()), default_block_size=16, max_concurrent_prefix_queries=8
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    target = f"127.0.0.1:{port}"
    vllm_keys = [to_sfixed64(h) for h in block_hashes(TOKENS, 16, algo=algo, python_hash_seed=seed)]
    canonical = RemoteIndex(target, 5.0)
    vllm = RemoteIndex(target, 5.0, key_space, seed)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(
                kv.ApplyExternalKvBatchRequest(
                    worker_id="vllm-0",
                    worker_address=ENGINE,
                    actions=[
                        kv.ExternalKvAction(
                            type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=vllm_keys
                        )
                    ],
                )
            )
        keys, hits = await vllm.match(TOKENS, 16, "", "")
        assert list(keys) == vllm_keys
        assert hits[ENGINE].device_blocks == 4
        _, hits = await canonical.match(TOKENS, 16, "", "")
        assert ENGINE not in hits  # the canonical keys never meet vLLM's
    finally:
        await canonical.close()
        await vllm.close()
        await server.stop(None)


def test_remote_key_space_is_a_config_choice() -> None:
    config = ControllerConfig.model_validate(
        {"index": {"remote": "h:1", "remote_key_space": "sha256_cbor", "remote_hash_seed": "7"}}
    )
    assert (config.index.remote_key_space, config.index.remote_hash_seed) == ("sha256_cbor", "7")
    with pytest.raises(ValueError, match="remote_key_space"):
        ControllerConfig.model_validate({"index": {"remote_key_space": "md5"}})


def refused_at_start(tmp_path: Path, index: str) -> str:
    """What `kvplane controller serve` says on stderr as it exits 1 with `index: INDEX` (a
    YAML flow mapping) in its config."""
    config = tmp_path / "controller.yaml"
    config.write_text(f"listen: 127.0.0.1:0\nengines: []\nindex: {index}\n")
    out = subprocess.run(
        [*KVPLANE, "controller", "serve", "--config", str(config)],
        capture_output=True,
        timeout=60,
    )
    message = out.stderr.decode()
    assert out.returncode == 1, message
    return message.replace(str(config), "FILE")


def test_a_hash_seed_without_a_vllm_key_space_is_refused(tmp_path: Path) -> None:
    """`kvplane controller serve` with `remote_hash_seed` and the canonical key space (the
    default) exits naming both settings, as the indexer refuses `hash_seed` without
    `vllm_hash`. Before, it started and ignored the seed: canonical keys have none, and the
    operator who meant vLLM's key space was told nothing."""
    message = refused_at_start(tmp_path, "{remote: '127.0.0.1:1', remote_hash_seed: '7'}")
    assert (
        "index: remote_hash_seed needs remote_key_space sha256 or sha256_cbor (the vLLM "
        "algorithm it seeds): kvplane's canonical keys have no seed"
    ) in message, message


@pytest.mark.parametrize(
    ("index", "refused"),
    [
        (
            "{remote_key_space: sha256, remote_hash_seed: '7'}",
            "index: remote_key_space is only read with remote (a kvplane indexer): set that, or "
            "remove remote_key_space",
        ),
        (
            "{backend: 'redis://127.0.0.1:1', remote_token_file: token}",
            "index: remote_token_file is only read with remote (a kvplane indexer): set that, or "
            "remove remote_token_file",
        ),
    ],
)
def test_remote_settings_without_a_remote_indexer_are_refused(
    tmp_path: Path, index: str, refused: str
) -> None:
    """`kvplane controller serve` with `remote_key_space` / `remote_hash_seed` (or the remote
    indexer's TLS or token) but no `index.remote` exits naming them: nothing reads them
    without a remote indexer. Before, it started on its own index and ignored them, and the
    operator who forgot `remote` was told nothing."""
    message = refused_at_start(tmp_path, index)
    assert f"invalid config in FILE: {refused}\n" in message, message


async def test_stats_of_a_remote_index_that_does_not_answer_fail_in_one_line() -> None:
    """The controller logs this every few seconds while the indexer is down (index-size
    metrics, admin `workers`): one line, not the gRPC error's multi-line repr."""
    remote = RemoteIndex("127.0.0.1:1", 5.0)
    try:
        with pytest.raises(KvplaneError, match=r"^remote index: UNAVAILABLE: ") as caught:
            await remote.stats()
        assert "\n" not in str(caught.value)
    finally:
        await remote.close()


async def test_an_engine_indexed_rank_by_rank_holds_its_best_rank() -> None:
    """Two workers (data-parallel ranks) with one engine address: the engine's hit is the
    longer prefix, whichever order the indexer lists them in."""
    services, _, _ = index_services(
        MemoryBackend(PrefixIndex()), default_block_size=16, max_concurrent_prefix_queries=8
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    target = f"127.0.0.1:{port}"
    keys = [to_sfixed64(h) for h in block_hashes(TOKENS, 16, algo=VllmHashAlgo.SHA256)]
    remote = RemoteIndex(target, 5.0, "sha256")
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = kv_grpc.KVIndexerStub(channel)
            for rank, held in ((0, keys[:2]), (1, keys)):
                await stub.ApplyExternalKvBatch(
                    kv.ApplyExternalKvBatchRequest(
                        worker_id=f"vllm-0/dp{rank}",
                        worker_address=ENGINE,
                        actions=[
                            kv.ExternalKvAction(
                                type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=held
                            )
                        ],
                    )
                )
        _, hits = await remote.match(TOKENS, 16, "", "")
        assert hits[ENGINE].device_blocks == 4
    finally:
        await remote.close()
        await server.stop(None)


# Engines holding TOKENS' 4 blocks on tiers as (tier, first block, end), and the hit the
# router must see: device, then host, then disk blocks along the prefix.
_TIERED = {
    "10.0.0.1:1": ([(kv.TIER_HBM, 0, 1), (kv.TIER_DRAM, 1, 2), (kv.TIER_SSD, 2, 4)], (1, 1, 2)),
    "10.0.0.2:1": ([(kv.TIER_SSD, 0, 4)], (0, 0, 4)),
    "10.0.0.3:1": ([(kv.TIER_HBM, 0, 4)], (4, 0, 0)),
    "10.0.0.4:1": ([(kv.TIER_HBM, 0, 2), (kv.TIER_SSD, 2, 3), (kv.TIER_HBM, 3, 4)], (2, 0, 2)),
    "10.0.0.5:1": ([(kv.TIER_DRAM, 0, 3)], (0, 3, 0)),
}


@pytest.mark.parametrize("backend", ["memory", "redis", "remote"])
async def test_every_index_backend_shows_the_router_a_prefix_on_disk_alike(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The controller's view of each engine's prefix (`PrefixHit`: device, host, disk
    blocks) is the same from its own memory index, from a shared Redis, and from a remote
    `kvplane indexer` (MatchTokens): blocks on SSD continue a prefix, at the disk tier."""

    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        server.flushall()
        index: MemoryBackend | RedisBackend = await open_redis_backend(server.url, buckets=8)
    else:
        index = MemoryBackend(PrefixIndex())
    services, _, _ = index_services(index, default_block_size=16, max_concurrent_prefix_queries=8)
    grpc_server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    target = f"127.0.0.1:{port}"
    remote = RemoteIndex(target, 5.0)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = kv_grpc.KVIndexerStub(channel)
            for engine, (runs, _) in _TIERED.items():
                actions = [
                    kv.ExternalKvAction(
                        type=kv.ACTION_REPORT, tier=tier, hashes=CANONICAL_KEYS[start:end]
                    )
                    for tier, start, end in runs
                ]
                await stub.ApplyExternalKvBatch(
                    kv.ApplyExternalKvBatchRequest(
                        worker_id=engine, worker_address=engine, actions=actions
                    )
                )
        if backend == "remote":
            _, hits = await remote.match(TOKENS, 16, "", "")
        else:
            hits = await _own_index_hits(index)
        assert {e: tuple(hits[e]) for e in _TIERED} == {e: hit for e, (_, hit) in _TIERED.items()}
    finally:
        await remote.close()
        await grpc_server.stop(None)
        await index.close()


# Random histories of REPORT / REVOKE / CLEAR_ALL_AT_TIER, at random tiers, of TOKENS' blocks.
_ENGINES = ("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
_KV_TIERS = (kv.TIER_HBM, kv.TIER_DRAM, kv.TIER_SSD)
_KINDS = (kv.ACTION_REPORT, kv.ACTION_REPORT, kv.ACTION_REVOKE, kv.ACTION_CLEAR_ALL_AT_TIER)
# (engine, action type, tier, first block, blocks)
_TierAction = tuple[str, kv.ExternalKvActionType.ValueType, kv.TierType.ValueType, int, int]
_tier_actions = st.tuples(
    st.sampled_from(_ENGINES),
    st.sampled_from(_KINDS),
    st.sampled_from(_KV_TIERS),
    st.integers(0, len(CANONICAL_KEYS) - 1),
    st.integers(1, len(CANONICAL_KEYS)),
)


def _model_hit(held: list[set[int]]) -> tuple[int, int, int]:
    """The hit as "The router" in docs/controller.md defines it: along the prompt, each block
    counted at the slowest tier the prefix has needed up to it (a block's fastest tier: HBM
    device, DRAM host, SSD disk), up to the first block held on no tier."""
    counts, slowest = [0, 0, 0], 0
    for tiers in held:
        if not tiers:
            break
        slowest = max(slowest, _KV_TIERS.index(min(tiers)))
        counts[slowest] += 1
    return counts[0], counts[1], counts[2]


@pytest.mark.timeout(300)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=st.lists(_tier_actions, max_size=12))
def test_every_index_backend_gives_the_router_the_same_tiered_hit_after_removals(
    redis_server: RedisServer, history: list[_TierAction]
) -> None:
    """After any history of stores, removals and clears at any tier, the controller's hit of
    each engine (device, host, disk blocks) is the same from its own memory index, from a
    shared Redis, and from a remote `kvplane indexer` over either, and is the naive rule's:
    a block revoked from its only tier (an SSD block evicted, say) ends the prefix there; a
    block revoked from SSD while its GPU copy stays is still a device block."""

    async def hits_of_each() -> tuple[dict[str, tuple[int, int, int]], list[object]]:
        redis_server.flushall()
        backends: list[MemoryBackend | RedisBackend] = [
            MemoryBackend(PrefixIndex()),
            await open_redis_backend(redis_server.url, buckets=8),
        ]
        servers, remotes, channels = [], [], []
        held = {e: [set[int]() for _ in CANONICAL_KEYS] for e in _ENGINES}
        try:
            for backend in backends:
                services, _, _ = index_services(
                    backend, default_block_size=16, max_concurrent_prefix_queries=8
                )
                server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
                servers.append(server)
                remotes.append(RemoteIndex(f"127.0.0.1:{port}", 5.0))
                channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            for engine, kind, tier, start, length in history:
                hashes = CANONICAL_KEYS[start : start + length]
                action = kv.ExternalKvAction(type=kind, tier=tier)
                if kind == kv.ACTION_CLEAR_ALL_AT_TIER:
                    for blocks in held[engine]:
                        blocks.discard(tier)
                else:
                    action.hashes.extend(hashes)
                    for n in range(start, start + len(hashes)):
                        if kind == kv.ACTION_REPORT:
                            held[engine][n].add(tier)
                        else:
                            held[engine][n].discard(tier)
                batch = kv.ApplyExternalKvBatchRequest(
                    worker_id=engine, worker_address=engine, actions=[action]
                )
                for channel in channels:
                    await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(batch)
            seen: list[object] = []
            for backend, remote in zip(backends, remotes, strict=True):
                for hits in (
                    await _own_index_hits(backend),
                    (await remote.match(TOKENS, 16, "", ""))[1],
                ):
                    seen.append({e: tuple(hits.get(e, PrefixHit())) for e in _ENGINES})
            return {e: _model_hit(held[e]) for e in _ENGINES}, seen
        finally:
            for channel in channels:
                await channel.close()
            for remote in remotes:
                await remote.close()
            for server in servers:
                await server.stop(None)
            for backend in backends:
                await backend.close()

    expected, seen = asyncio.run(hits_of_each())
    assert seen == [expected] * 4


class _HungIndex(PartialKvIndex):
    """A KvIndex whose MatchTokens hangs (a stopped or stuck indexer) until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.released = asyncio.Event()

    async def MatchTokens(
        self,
        request: ipb.MatchTokensRequest,
        context: grpc.aio.ServicerContext[ipb.MatchTokensRequest, ipb.MatchTokensResponse],
    ) -> ipb.MatchTokensResponse:
        self.calls += 1
        await self.released.wait()
        return ipb.MatchTokensResponse()


async def test_a_hung_remote_index_is_asked_again_only_after_a_backoff() -> None:
    """A hung indexer used to cost every request the RPC deadline; now one request per
    backoff: between, `match` fails at once and the indexer is not asked."""
    servicer = _HungIndex()
    server = grpc.aio.server()
    ipb_grpc.add_KvIndexServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    now = [0.0]
    remote = RemoteIndex(f"127.0.0.1:{port}", 0.2, backoff_s=(1.0, 4.0), clock=lambda: now[0])

    async def match() -> None:
        await remote.match(TOKENS, 16, "", "")

    try:
        with pytest.raises(KvplaneError, match=r"^remote index: DEADLINE_EXCEEDED: "):
            await match()
        for _ in range(5):
            with pytest.raises(KvplaneError, match=r"not answering; asked again within 1 s$"):
                await match()
        assert servicer.calls == 1
        now[0] = 1.0  # the pause is over: one request asks again, the others still fail at once
        outcomes = await asyncio.gather(match(), match(), return_exceptions=True)
        assert sorted(str(o).split(":")[1].strip() for o in outcomes) == [
            "DEADLINE_EXCEEDED",
            "not answering; asked again within 1 s",
        ]
        assert servicer.calls == 2
        now[0] = 2.5  # still hung at 1.0: the pause doubled
        with pytest.raises(KvplaneError, match=r"within 2 s$"):
            await match()
        servicer.released.set()
        now[0] = 3.0
        await match()  # it answers: the pause ends
        await match()
        assert servicer.calls == 4
    finally:
        await remote.close()
        await server.stop(None)


async def test_a_remote_index_that_is_down_is_asked_every_time() -> None:
    """Nothing listening fails at once by itself: no pause, so an indexer back after an
    outage is used by the next request."""
    remote = RemoteIndex("127.0.0.1:1", 5.0, backoff_s=(60.0, 60.0))
    try:
        for _ in range(3):
            with pytest.raises(KvplaneError, match=r"^remote index: UNAVAILABLE: "):
                await remote.match(TOKENS, 16, "", "")
    finally:
        await remote.close()


class _Source:
    """Records resync requests, as `connect_resync`'s sources receive them."""

    def __init__(self) -> None:
        self.requests: list[str | None] = []
        self.stream_lost = False

    def request_resync(self, worker_id: str | None = None) -> None:
        self.requests.append(worker_id)


def _report(worker_id: str, address: str, keys: list[int]) -> kv.ApplyExternalKvBatchRequest:
    action = kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=keys)
    return kv.ApplyExternalKvBatchRequest(
        worker_id=worker_id, worker_address=address, actions=[action]
    )


async def _indexer_fed_by(source: _Source) -> tuple[grpc.aio.Server, str]:
    """An indexer's gRPC server on a memory index whose worker ENGINE `source` follows."""
    services, _, _ = index_services(
        MemoryBackend(PrefixIndex()),
        default_block_size=16,
        max_concurrent_prefix_queries=8,
        source_of={ENGINE: source}.get,
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    return server, f"127.0.0.1:{port}"


async def test_resync_engine_drops_every_worker_of_the_engine_and_wakes_its_source() -> None:
    """ResyncEngine, the RPC a controller calls when it sees an engine restart: the engine's
    worker, its data-parallel ranks and any worker addressed as it lose their entries before
    the answer, and the source following it is asked to resubscribe; other engines keep
    theirs. Until the indexer confirms, the controller ignores the engine's hits; an empty
    engine name is INVALID_ARGUMENT."""
    source = _Source()
    server, target = await _indexer_fed_by(source)
    remote = RemoteIndex(target, 5.0)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            kv_stub = kv_grpc.KVIndexerStub(channel)
            for worker_id, address in [
                (ENGINE, ENGINE),
                (f"{ENGINE}/dp1", ENGINE),
                ("named-otherwise", ENGINE),
                ("10.0.0.8:8000", "10.0.0.8:8000"),
            ]:
                await kv_stub.ApplyExternalKvBatch(_report(worker_id, address, CANONICAL_KEYS))
            _, hits = await remote.match(TOKENS, 16, "", "")
            assert hits[ENGINE].device_blocks == 4

            remote.restarted.add(ENGINE)  # seen restarting: ignored from that moment
            _, hits = await remote.match(TOKENS, 16, "", "")
            assert ENGINE not in hits and hits["10.0.0.8:8000"].device_blocks == 4
            await remote.resync_engine(ENGINE)
            assert remote.restarted == set()
            _, hits = await remote.match(TOKENS, 16, "", "")
            assert list(hits) == ["10.0.0.8:8000"]
            assert source.requests == [None]  # every rank it follows

            index_stub = ipb_grpc.KvIndexStub(channel)
            again = await index_stub.ResyncEngine(ipb.ResyncEngineRequest(engine=ENGINE))
            assert (list(again.dropped_worker_ids), again.sources_resubscribed) == ([], 1)
            stats = await index_stub.GetIndexStats(ipb.GetIndexStatsRequest())
            assert [w.worker_id for w in stats.workers] == ["10.0.0.8:8000"]
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await index_stub.ResyncEngine(ipb.ResyncEngineRequest())
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "engine is required" in (error.value.details() or "")
    finally:
        await remote.close()
        await server.stop(None)


async def test_a_restart_of_an_engine_the_indexer_knows_nothing_of_is_confirmed() -> None:
    """The indexer answers NOT_FOUND for an engine it holds nothing of and has no source for
    (an engine fed from outside that sent nothing yet): no stale block of it can attract
    traffic, so the controller counts its hits again rather than asking at every poll."""
    server, target = await _indexer_fed_by(_Source())
    remote = RemoteIndex(target, 5.0)
    try:
        await remote.resync_engine("10.0.0.9:8000")
        assert remote.restarted == set()
        await remote.resync_engine("10.0.0.9:8000", first_contact=True)
        assert remote.restarted == set()
    finally:
        await remote.close()
        await server.stop(None)


async def test_at_first_contact_only_an_engine_whose_source_lost_its_stream_is_dropped() -> None:
    """A controller meeting an engine for the first time asks ResyncEngine with
    `only_if_stream_lost`: while the indexer's source follows the live process, its entries
    stay (and nothing resubscribes); once the source has lost its stream (waiting out a
    reconnect backoff: the engine may have restarted unseen), they are dropped as on a
    restart and the source is woken."""
    source = _Source()
    server, target = await _indexer_fed_by(source)
    remote = RemoteIndex(target, 5.0)
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(
                _report(ENGINE, ENGINE, CANONICAL_KEYS)
            )
        await remote.resync_engine(ENGINE, first_contact=True)
        _, hits = await remote.match(TOKENS, 16, "", "")
        assert hits[ENGINE].device_blocks == 4 and source.requests == []
        assert remote.restarted == set()

        source.stream_lost = True
        await remote.resync_engine(ENGINE, first_contact=True)
        _, hits = await remote.match(TOKENS, 16, "", "")
        assert ENGINE not in hits and source.requests == [None]
    finally:
        await remote.close()
        await server.stop(None)


async def test_a_restarted_engine_stays_ignored_until_the_indexer_confirms() -> None:
    """An indexer that cannot be told (down) keeps the restarted engine's hits ignored: the
    call fails, and the controller asks again at its next poll (a first contact is not a
    known restart: its hits count again). One without the RPC (an older
    kvplane indexer, UNIMPLEMENTED) is left to see the restart itself, as before."""
    remote = RemoteIndex("127.0.0.1:1", 5.0)
    try:
        with pytest.raises(KvplaneError, match=r"^remote index: UNAVAILABLE: "):
            await remote.resync_engine(ENGINE, first_contact=True)
        assert remote.restarted == set()  # a first contact is asked once, not held
        with pytest.raises(KvplaneError, match=r"^remote index: UNAVAILABLE: "):
            await remote.resync_engine(ENGINE)
        assert remote.restarted == {ENGINE}
    finally:
        await remote.close()
    server = grpc.aio.server()
    ipb_grpc.add_KvIndexServicer_to_server(PartialKvIndex(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    older = RemoteIndex(f"127.0.0.1:{port}", 5.0)
    try:
        await older.resync_engine(ENGINE)
        assert older.restarted == set()
    finally:
        await older.close()
        await server.stop(None)


async def test_resync_engine_needs_the_indexers_token(tmp_path: Path) -> None:
    """ResyncEngine drops entries: with `auth` it needs the bearer token, as
    ApplyExternalKvBatch does. Without it (UNAUTHENTICATED) the engine stays ignored and the
    controller keeps asking; `index.remote_token_file` gives the controller the token."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    services, _, _ = index_services(
        MemoryBackend(PrefixIndex()), default_block_size=16, max_concurrent_prefix_queries=8
    )
    server, port = await create_server(
        ServerConfig(listen="127.0.0.1:0", auth=AuthConfig(token_file=token_file)), services
    )
    target = f"127.0.0.1:{port}"
    config = ControllerConfig.model_validate(
        {"index": {"remote": target, "remote_token_file": str(token_file)}}
    )
    fleet = Fleet(config, None)
    anonymous = RemoteIndex(target, 5.0)
    try:
        with pytest.raises(KvplaneError) as refused:
            await anonymous.resync_engine(ENGINE)
        assert str(refused.value) == (
            "remote index: UNAUTHENTICATED: missing or invalid bearer token (metadata "
            "'authorization: Bearer <token>') (a server requiring a token? give "
            "index.remote_token_file)"
        )
        assert anonymous.restarted == {ENGINE}
        await anonymous.match(TOKENS, 16, "", "")  # reads stay open without protect_reads
        assert fleet.remote is not None
        await fleet.remote.resync_engine(ENGINE)
        assert fleet.remote.restarted == set()
    finally:
        await anonymous.close()
        await fleet.close()
        await server.stop(None)
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(KvplaneError, match=r"index.remote_token_file .*empty"):
        Fleet(
            ControllerConfig.model_validate(
                {"index": {"remote": target, "remote_token_file": str(empty)}}
            ),
            None,
        )


class _SheddingIndex(PartialKvIndex):
    """An indexer that sheds every query (RESOURCE_EXHAUSTED, as one with more prefix
    queries in flight than it takes) and knows no engine a ResyncEngine names (NOT_FOUND);
    its GetIndexStats is left out (UNIMPLEMENTED)."""

    async def MatchTokens(
        self,
        request: ipb.MatchTokensRequest,
        context: grpc.aio.ServicerContext[ipb.MatchTokensRequest, ipb.MatchTokensResponse],
    ) -> ipb.MatchTokensResponse:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "scripted: shed")

    async def ResyncEngine(
        self,
        request: ipb.ResyncEngineRequest,
        context: grpc.aio.ServicerContext[ipb.ResyncEngineRequest, ipb.ResyncEngineResponse],
    ) -> ipb.ResyncEngineResponse:
        await context.abort(grpc.StatusCode.NOT_FOUND, "scripted: no such engine")


async def test_only_a_query_not_shed_ends_the_shedding() -> None:
    """Queries shed at 0 s and 5 s, none answered: at 10 s the index counts as not
    answering, whatever other calls met meanwhile (a ResyncEngine answered NOT_FOUND, a
    GetIndexStats refused): only a query that is not shed ends the shedding, as an answered
    GetIndexStats never did. Before, any other call's refusal (or failure) began it again, so
    an engine met (or restarted) while the indexer shed every query put off the DEGRADED
    Health by up to another 10 s each time."""
    server = grpc.aio.server()
    ipb_grpc.add_KvIndexServicer_to_server(_SheddingIndex(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    now = [0.0]
    remote = RemoteIndex(f"127.0.0.1:{port}", 5.0, clock=lambda: now[0])
    try:
        for now[0] in (0.0, 5.0):
            with pytest.raises(RemoteIndexError, match="RESOURCE_EXHAUSTED: scripted: shed"):
                await remote.match(TOKENS, 16, "", "")
        now[0] = 6.0
        await remote.resync_engine(ENGINE)  # NOT_FOUND: nothing of it to drop
        with pytest.raises(RemoteIndexError, match="UNIMPLEMENTED"):
            await remote.stats()
        assert remote.unavailable is None
        now[0] = 10.0
        assert remote.unavailable == (
            f"remote index at 127.0.0.1:{port}: RESOURCE_EXHAUSTED: scripted: shed (every "
            "query shed for 10 s)"
        ), remote.unavailable
    finally:
        await remote.close()
        await server.stop(None)


class _RefusingIndex(PartialKvIndex):
    """An indexer that refuses every ResyncEngine (UNAVAILABLE, as one starting up), keeping
    each request's engine."""

    def __init__(self) -> None:
        self.resync_engines: list[str] = []

    async def ResyncEngine(
        self,
        request: ipb.ResyncEngineRequest,
        context: grpc.aio.ServicerContext[ipb.ResyncEngineRequest, ipb.ResyncEngineResponse],
    ) -> ipb.ResyncEngineResponse:
        self.resync_engines.append(request.engine)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: starting")


async def test_a_remote_index_that_cannot_be_told_is_reported_once_per_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning is throttled engine by engine (its clock stands still here: everything
    happens within one throttle interval): each engine met while the indexer refuses
    ResyncEngine is reported, and a restarted engine asked again at every poll is not
    reported again."""
    servicer = _RefusingIndex()
    index_server = grpc.aio.server()
    ipb_grpc.add_KvIndexServicer_to_server(servicer, index_server)
    index_port = index_server.add_insecure_port("127.0.0.1:0")
    await index_server.start()
    engines = [await start_sim_engine(f"e{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    config = ControllerConfig.model_validate(
        {
            "engines": [{"address": a} for a in addresses],
            "index": {"remote": f"127.0.0.1:{index_port}"},
            "health": {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1},
        }
    )
    fleet = Fleet(config, None, clock=lambda: 0.0)

    def warnings_about(address: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "controller.fleet" and f"engine {address}" in r.getMessage()
            and "the remote index" in r.getMessage()
        ]  # fmt: skip

    try:
        await fleet.start()
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 2, 15)
        for address in addresses:  # both met at once, both refused
            assert address in servicer.resync_engines
            [warning] = warnings_about(address)
            assert "could not be asked to drop blocks" in warning
            assert "UNAVAILABLE: scripted: starting" in warning

        # e0 restarts: the indexer is asked again at each poll, and refuses each time.
        await engines[0].close()
        engines[0] = await start_sim_engine("e0-again", port=engines[0].port)

        async def asked_again_and_again() -> bool:
            return servicer.resync_engines.count(addresses[0]) >= 4

        await eventually(asked_again_and_again, 15)
        assert len(warnings_about(addresses[0])) == 1
        assert len(warnings_about(addresses[1])) == 1
    finally:
        await fleet.close()
        for engine in engines:
            await engine.close()
        await index_server.stop(None)


async def test_at_first_contact_an_engine_is_dropped_once_any_of_its_ranks_lost_its_stream() -> (
    None
):
    """An engine followed rank by rank (one configured source per data-parallel rank, each
    feeding `<engine>/dp<r>`): ResyncEngine with `only_if_stream_lost` does nothing while every
    rank's source follows the live process, and drops the engine's workers and resubscribes
    its sources once one rank's source has lost its stream (the engine may have restarted
    unseen)."""
    ranks = {f"{ENGINE}/dp{r}": _Source() for r in range(2)}
    services, _, _ = index_services(
        MemoryBackend(PrefixIndex()),
        default_block_size=16,
        max_concurrent_prefix_queries=8,
        source_of=ranks.get,
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for worker_id in ranks:
                await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(
                    _report(worker_id, ENGINE, CANONICAL_KEYS)
                )
            index_stub = ipb_grpc.KvIndexStub(channel)
            first_contact = ipb.ResyncEngineRequest(engine=ENGINE, only_if_stream_lost=True)
            kept = await index_stub.ResyncEngine(first_contact)
            assert (list(kept.dropped_worker_ids), kept.sources_resubscribed) == ([], 0)
            ranks[f"{ENGINE}/dp1"].stream_lost = True
            dropped = await index_stub.ResyncEngine(first_contact)
            stats = await index_stub.GetIndexStats(ipb.GetIndexStatsRequest())
    finally:
        await server.stop(None)
    assert sorted(dropped.dropped_worker_ids) == sorted(ranks)
    assert dropped.sources_resubscribed == 2
    assert [s.requests for s in ranks.values()] == [[None], [None]]
    assert list(stats.workers) == []
