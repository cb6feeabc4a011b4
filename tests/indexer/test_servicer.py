"""kv_indexer.v1.KVIndexer and kvplane.v1.KvIndex over real gRPC: validation -> status codes,
shedding, deadlines, auth, byte-level answers, token matching, stats and dump."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from indexer.backend import IndexStats, PrefixResult
from indexer.batch import BlockKey, to_sfixed64
from indexer.config import IndexerConfig
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.kv_wire import batch_from_proto
from indexer.memory_backend import MemoryBackend
from indexer.service import run_indexer
from indexer.servicer import IngestCounters, PrefixQueryLimiter, index_services
from indexer.vllm_hash import VllmHashAlgo, block_digests, block_hashes, digest_to_int
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.config import AuthConfig, ServerConfig
from kvplane.server import create_server
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from tests.indexer.served_backend import ServedBackend

pytestmark = pytest.mark.timeout(60)

HBM, DRAM, SSD = kv.TIER_HBM, kv.TIER_DRAM, kv.TIER_SSD
REPORT, REVOKE, CLEAR = kv.ACTION_REPORT, kv.ACTION_REVOKE, kv.ACTION_CLEAR_ALL_AT_TIER
INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNDEFINED_ACTION = kv.ExternalKvActionType.ValueType(9)  # a number the proto gives no action
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


class GatedBackend(MemoryBackend):
    """Prefix queries wait for `release` (to hold them in flight); applies do not."""

    def __init__(self, index: PrefixIndex) -> None:
        super().__init__(index)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.gated = False

    async def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult:
        if self.gated:
            self.entered.set()
            await self.release.wait()
        return await super().match_prefix(hashes, max_blocks)


@dataclass
class Server:
    index: PrefixIndex
    backend: GatedBackend
    kv: kv_grpc.KVIndexerAsyncStub
    api: api_grpc.KvIndexAsyncStub
    channel: grpc.aio.Channel


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Server]:
    index = PrefixIndex()
    backend = GatedBackend(index)
    services, _, _ = index_services(
        backend,
        default_block_size=4,
        max_concurrent_prefix_queries=1,
        ingest_counters=lambda: IngestCounters(num_batches_applied=7, num_events_dropped=2),
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Server(
            index, backend, kv_grpc.KVIndexerStub(channel), api_grpc.KvIndexStub(channel), channel
        )
    await server.stop(None)


def _batch(
    *actions: kv.ExternalKvAction, worker_id: str = "w0", address: str = "a:1"
) -> kv.ApplyExternalKvBatchRequest:
    return kv.ApplyExternalKvBatchRequest(
        worker_id=worker_id, seq=1, actions=actions, worker_address=address
    )


def _report(tier: int, hashes: list[int], **kwargs: object) -> kv.ExternalKvAction:
    return kv.ExternalKvAction(type=REPORT, tier=tier, hashes=hashes, **kwargs)  # type: ignore[arg-type]


async def _code(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (_batch(_report(HBM, [1]), worker_id=""), INVALID),
        (_batch(*[_report(HBM, [i]) for i in range(257)]), EXHAUSTED),
        (_batch(_report(HBM, list(range(10_000))), _report(DRAM, list(range(6_385)))), EXHAUSTED),
        (_batch(_report(kv.TIER_UNKNOWN, [1])), INVALID),
        (_batch(kv.ExternalKvAction(type=CLEAR, tier=kv.TIER_UNKNOWN)), INVALID),
        (_batch(_report(7, [1])), INVALID),
        (_batch(kv.ExternalKvAction(type=kv.ACTION_UNKNOWN, tier=HBM, hashes=[1])), INVALID),
        (_batch(kv.ExternalKvAction(type=UNDEFINED_ACTION, tier=HBM, hashes=[1])), INVALID),
        (_batch(_report(HBM, [])), INVALID),
        (_batch(kv.ExternalKvAction(type=REVOKE, tier=HBM)), INVALID),
        (_batch(_report(HBM, [1, 2], component_masks=[1])), INVALID),
        (_batch(_report(HBM, [1, 2], block_sizes=[4, 4, 4])), INVALID),
    ],
    ids=[
        "empty-worker",
        "257-actions",
        "16385-hashes",
        "tier-unknown",
        "clear-tier-unknown",
        "tier-7",
        "action-unknown",
        "action-9",
        "report-no-hashes",
        "revoke-no-hashes",
        "masks-misaligned",
        "sizes-misaligned",
    ],
)
async def test_apply_validation_status_codes_and_nothing_changes(
    served_backend: ServedBackend, request_: kv.ApplyExternalKvBatchRequest, code: grpc.StatusCode
) -> None:
    # A valid action first: the whole batch must still be rejected atomically.
    request_.actions.insert(0, _report(HBM, [424242]))
    assert await _code(served_backend.stub.ApplyExternalKvBatch(request_)) == code
    assert (await served_backend.stats()).num_placements == 0


@pytest.mark.parametrize(
    ("actions", "details"),
    [
        ([_report(HBM, [7], parent_block_hash=7)], "action 1: block hash cannot be its own parent"),
        (
            [_report(HBM, [5, 6], parent_block_hash=5)],
            "action 1: block hash cannot be its own parent",
        ),
        # Parents are checked after every action's shape, as SGLang's indexer orders them.
        (
            [_report(HBM, [7], parent_block_hash=7), _report(HBM, [1, 2], component_masks=[1])],
            "action 2: 1 component_masks for 2 hashes",
        ),
    ],
    ids=["parent-is-head", "parent-is-head-of-a-chain", "order"],
)
async def test_a_report_stating_its_head_as_its_own_parent_is_refused_and_nothing_changes(
    served_backend: ServedBackend, actions: list[kv.ExternalKvAction], details: str
) -> None:
    """SGLang's indexer refuses a block stated as its own parent (INVALID_ARGUMENT); the whole
    batch, a valid action before it included."""
    request_ = _batch(_report(HBM, [424242]), *actions)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served_backend.stub.ApplyExternalKvBatch(request_)
    assert (info.value.code(), info.value.details()) == (INVALID, details)
    assert (await served_backend.stats()).num_placements == 0
    # A REVOKE's hashes may repeat: it states no parent.
    await served_backend.stub.ApplyExternalKvBatch(
        _batch(kv.ExternalKvAction(type=REVOKE, tier=HBM, hashes=[5, 5]))
    )


@pytest.mark.parametrize(
    "hashes_and_parent",
    [([5, 6, 6], None), ([5, 6], 6), ([5, 6, 8, 5], None)],
    ids=["hash-repeats-its-parent", "parent-down-the-chain", "chain-loops"],
)
async def test_a_report_looping_down_its_chain_is_held_as_stated(
    served_backend: ServedBackend, hashes_and_parent: tuple[list[int], int | None]
) -> None:
    """SGLang's indexer also refuses a REPORT whose chain loops further down (a hash repeated,
    the parent among its blocks); kvplane takes it (a set per REPORT cost a fifth of 64-block
    ingestion: docs/indexer.md): each distinct block is held once and matched as any other."""
    hashes, parent = hashes_and_parent
    report = _report(HBM, hashes, **({} if parent is None else {"parent_block_hash": parent}))
    await served_backend.stub.ApplyExternalKvBatch(_batch(report))
    distinct = list(dict.fromkeys(hashes))
    assert (await served_backend.stats()).num_placements == len(distinct)
    reply = await served_backend.stub.MatchExternalKvPrefix(
        kv.MatchExternalKvPrefixRequest(hashes=distinct)
    )
    assert [m.matched_prefix_blocks for m in reply.matches] == [len(distinct)]


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (
            _batch(_report(HBM, [1]), worker_id="w" * 100_000),
            "worker_id must be at most 256 characters, got 100000",
        ),
        (_batch(_report(HBM, [1]), worker_id="w\x000"), "worker_id must be printable text"),
        (_batch(_report(HBM, [1]), worker_id="w0\n"), "worker_id must be printable text"),
        (_batch(_report(HBM, [1]), worker_id="w\x1b[2J"), "worker_id must be printable text"),
        (
            _batch(_report(HBM, [1]), address="a" * 257),
            "worker_address must be at most 256 characters, got 257",
        ),
        (_batch(_report(HBM, [1]), address="a:1\x00"), "worker_address must be printable text"),
    ],
    ids=["long-id", "nul-id", "newline-id", "escape-id", "long-address", "nul-address"],
)
async def test_worker_names_are_bounded_printable_text(
    served_backend: ServedBackend, request_: kv.ApplyExternalKvBatchRequest, details: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served_backend.stub.ApplyExternalKvBatch(request_)
    assert info.value.code() == INVALID
    assert details in str(info.value.details())
    assert (await served_backend.stats()).num_placements == 0


async def test_the_longest_printable_worker_names_are_taken(served_backend: ServedBackend) -> None:
    worker_id, address = "wörker-" + "x" * 249, "[::1]:8000 zone a"
    await served_backend.stub.ApplyExternalKvBatch(
        _batch(_report(HBM, [1]), worker_id=worker_id, address=address)
    )
    prefix = await served_backend.stub.MatchExternalKvPrefix(
        kv.MatchExternalKvPrefixRequest(hashes=[1])
    )
    assert [(m.worker_id, m.worker_address) for m in prefix.matches] == [(worker_id, address)]


async def test_revoke_and_clear_ignore_the_report_only_fields(
    served_backend: ServedBackend,
) -> None:
    """component_masks, block_sizes and parent_block_hash are REPORT-only ("REVOKE/CLEAR ignore
    it"), and a CLEAR's hashes are ignored: none of them is checked or counted against the
    16,384-hash limit, whatever their length."""
    stub = served_backend.stub
    sized = _report(HBM, [1, 2, 3], component_masks=[1, 1, 1], block_sizes=[16, 16, 16])
    await stub.ApplyExternalKvBatch(_batch(sized))
    revoke = kv.ExternalKvAction(
        type=REVOKE,
        tier=HBM,
        hashes=[2],
        component_masks=[7, 7],
        block_sizes=[4, 4, 4],
        parent_block_hash=1,
    )
    clear = kv.ExternalKvAction(
        type=CLEAR, tier=DRAM, hashes=range(16_384), component_masks=[1], block_sizes=[1, 2]
    )
    await stub.ApplyExternalKvBatch(_batch(revoke, clear, _report(DRAM, [9])))
    match = await stub.MatchExternalKv(kv.MatchExternalKvRequest(hashes=[1, 2, 3, 9]))
    assert [
        (t.tier, list(t.hashes), list(t.component_masks), list(t.block_sizes))
        for t in match.matches[0].hashes_by_tier
    ] == [(HBM, [1, 3], [1, 1], [16, 16]), (DRAM, [9], [0], [0])]


async def test_match_tokens_with_a_field_of_a_newer_revision_is_refused(served: Server) -> None:
    """KvIndex is strict: a newer controller's option an older indexer does not know would
    change the match silently, so the request is refused, naming the field."""
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, [1, 2])))
    request = api.MatchTokensRequest(token_ids=list(range(8)), block_size=4)
    request.MergeFromString(b"\xf8\x01\x01")  # field 31, varint 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await served.api.MatchTokens(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 31" in (refused.value.details() or "")
    request.DiscardUnknownFields()
    await served.api.MatchTokens(request)  # the same request without it is answered


async def test_a_batch_with_the_reserved_incarnation_field_is_applied(served: Server) -> None:
    """The seed reserved field 5 (it "held the worker incarnation token used for restart
    fencing"; applies are unconditional now): a bridge that still sends it is applied, as
    SGLang's indexer, which ignores fields it does not know, does. KVIndexer is not strict
    (docs/indexer.md)."""
    batch = _batch(_report(HBM, [1, 2]))
    batch.MergeFromString(b"\x28\x07")  # field 5, varint 7
    await served.kv.ApplyExternalKvBatch(batch)
    match = await served.kv.MatchExternalKv(kv.MatchExternalKvRequest(hashes=[1, 2]))
    assert [list(t.hashes) for t in match.matches[0].hashes_by_tier] == [[1, 2]]


async def test_a_batch_over_the_hash_limit_is_resource_exhausted_whatever_else_is_wrong(
    served_backend: ServedBackend,
) -> None:
    """SGLang's indexer checks a batch's size (actions, then hashes summed over them) before
    any action's own rules, so a batch too large is RESOURCE_EXHAUSTED even when one of its
    actions is malformed too: a sender splits it and retries, whatever it would learn next."""
    stub = served_backend.stub
    too_many = [_report(HBM, list(range(10_000))), _report(DRAM, list(range(6_385)))]
    for malformed in (
        _report(kv.TIER_UNKNOWN, [1]),
        kv.ExternalKvAction(type=kv.ACTION_UNKNOWN, tier=HBM, hashes=[1]),
        _report(HBM, [1, 2], component_masks=[1]),
        kv.ExternalKvAction(type=REVOKE, tier=HBM),
    ):
        for actions in ((malformed, *too_many), (*too_many, malformed)):
            assert await _code(stub.ApplyExternalKvBatch(_batch(*actions))) == EXHAUSTED
    assert (await served_backend.stats()).num_placements == 0


async def test_limits_are_inclusive_and_an_empty_batch_refreshes_the_address(
    served_backend: ServedBackend,
) -> None:
    await served_backend.stub.ApplyExternalKvBatch(
        _batch(*[_report(HBM, [i + 1]) for i in range(256)])
    )
    await served_backend.stub.ApplyExternalKvBatch(_batch(_report(SSD, list(range(1, 16_385)))))
    await served_backend.stub.ApplyExternalKvBatch(_batch(address="b:2"))
    prefix = await served_backend.stub.MatchExternalKvPrefix(
        kv.MatchExternalKvPrefixRequest(hashes=[1])
    )
    assert [m.worker_address for m in prefix.matches] == ["b:2"]


Request = TypeVar("Request")


async def _check_hash_limits(
    rpc: Callable[[Request], Awaitable[object]], request: Callable[..., Request]
) -> None:
    """No hashes: INVALID_ARGUMENT; 16,385: RESOURCE_EXHAUSTED; 16,384 are answered."""
    assert await _code(rpc(request(hashes=[]))) == INVALID
    assert await _code(rpc(request(hashes=list(range(16_385))))) == EXHAUSTED
    await rpc(request(hashes=list(range(16_384))))


async def test_match_and_hit_count_validation(served_backend: ServedBackend) -> None:
    stub = served_backend.stub
    await _check_hash_limits(stub.MatchExternalKv, kv.MatchExternalKvRequest)
    await _check_hash_limits(stub.GetExternalKvHitCounts, kv.GetExternalKvHitCountsRequest)
    empty = kv.MatchExternalKvPrefixRequest(hashes=[])
    assert await _code(served_backend.stub.MatchExternalKvPrefix(empty)) == INVALID
    # No length cap on prefix queries.
    long = kv.MatchExternalKvPrefixRequest(hashes=list(range(40_000)))
    assert (await served_backend.stub.MatchExternalKvPrefix(long)).best_prefix_blocks == 0


async def test_answers_are_byte_identical_to_the_seed_layout(served_backend: ServedBackend) -> None:
    await served_backend.stub.ApplyExternalKvBatch(
        _batch(
            _report(DRAM, [-5, 6], component_masks=[1, 3], block_sizes=[16, 0]),
            _report(HBM, [6], parent_block_hash=-5),
        )
    )
    match = await served_backend.stub.MatchExternalKv(
        kv.MatchExternalKvRequest(hashes=[6, -5, 6, 99], count_as_hit=True)
    )
    expected = kv.MatchExternalKvResponse(
        matches=[
            kv.ExternalKvNodeMatch(
                worker_id="w0",
                address="a:1",
                hashes_by_tier=[
                    kv.TierHashes(tier=HBM, hashes=[6], component_masks=[0], block_sizes=[0]),
                    kv.TierHashes(
                        tier=DRAM, hashes=[6, -5], component_masks=[3, 1], block_sizes=[0, 16]
                    ),
                ],
            )
        ]
    )
    assert match.SerializeToString() == expected.SerializeToString()
    hits = await served_backend.stub.GetExternalKvHitCounts(
        kv.GetExternalKvHitCountsRequest(hashes=[99, 6, -5, 6])
    )
    assert [(e.hash, e.hit_count_total) for e in hits.entries] == [(6, 1), (-5, 1)]
    # w0 has component masks but no spec: it fails closed (prefix 0) and is left out.
    await served_backend.stub.ApplyExternalKvBatch(
        _batch(_report(SSD, [-5, 6, 7]), worker_id="w1", address="b:2")
    )
    prefix = await served_backend.stub.MatchExternalKvPrefix(
        kv.MatchExternalKvPrefixRequest(hashes=[-5, 6, 7], max_blocks=2)
    )
    assert (
        prefix.SerializeToString()
        == kv.MatchExternalKvPrefixResponse(
            matches=[
                kv.ExternalKvPrefixMatch(
                    worker_address="b:2", matched_prefix_blocks=2, worker_id="w1"
                )
            ],
            best_prefix_blocks=2,
            blocks_read=prefix.blocks_read,
        ).SerializeToString()
    )


async def test_concurrent_prefix_queries_beyond_the_limit_are_shed_not_queued(
    served: Server,
) -> None:
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, [1])))
    served.backend.gated = True
    first = asyncio.ensure_future(
        served.kv.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=[1]))
    )
    await asyncio.wait_for(served.backend.entered.wait(), 10)
    shed = served.kv.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=[1]))
    assert await _code(shed) == EXHAUSTED
    tokens = served.api.MatchTokens(api.MatchTokensRequest(token_ids=list(range(8))))
    assert await _code(tokens) == EXHAUSTED
    # Applies are never shed.
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, [2], parent_block_hash=1)))
    served.backend.release.set()
    assert (await first).best_prefix_blocks == 1
    again = await served.kv.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=[1, 2]))
    assert again.best_prefix_blocks == 2


async def test_an_expired_deadline_is_deadline_exceeded(served: Server) -> None:
    for _ in range(20):
        call = served.kv.MatchExternalKvPrefix(
            kv.MatchExternalKvPrefixRequest(hashes=[1]), timeout=-1.0
        )
        assert await _code(call) == grpc.StatusCode.DEADLINE_EXCEEDED


class ExpiredContext:
    """Just enough of a servicer context: the deadline has passed; abort raises."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def time_remaining(self) -> float:
        return 0.0

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.RpcError(details)


async def test_the_limiter_answers_an_expired_query_before_counting_it() -> None:
    limiter = PrefixQueryLimiter(1)
    context = ExpiredContext()
    with pytest.raises(grpc.RpcError):
        await limiter.enter(context)  # type: ignore[arg-type]
    assert context.aborted is not None
    assert context.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert limiter.in_flight == 0


async def test_match_tokens_stats_and_dump(served: Server) -> None:
    tokens = list(range(100, 110))  # 2 full blocks of 4 + 2 tokens
    keys = block_keys(tokens, 4)
    salted = block_keys(tokens, 4, cache_salt="t")
    await served.kv.ApplyExternalKvBatch(
        _batch(_report(HBM, keys[:1], block_sizes=[4]), _report(DRAM, keys, block_sizes=[4, 4]))
    )
    response = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens))
    assert list(response.block_keys) == keys and response.num_query_blocks == 2
    (match,) = response.matches
    assert (match.worker_id, match.matched_blocks, match.matched_tokens) == ("w0", 2, 8)
    assert [(t.tier, t.matched_blocks) for t in match.tiers] == [(HBM, 1), (DRAM, 2)]
    assert salted != keys
    miss = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens, cache_salt="t"))
    assert list(miss.block_keys) == salted and not miss.matches
    capped = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens, max_blocks=1))
    assert capped.matches[0].matched_blocks == 1
    short = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=[1, 2], block_size=4))
    assert short.num_query_blocks == 0 and not short.matches

    stats = await served.api.GetIndexStats(api.GetIndexStatsRequest())
    assert (stats.backend, stats.num_blocks, stats.num_placements, stats.num_workers) == (
        "memory",
        2,
        3,
        1,
    )
    assert (stats.num_batches_applied, stats.num_events_dropped) == (7, 2)

    dumped = [b async for b in served.api.DumpIndex(api.DumpIndexRequest())]
    rebuilt = PrefixIndex()
    for request in dumped:
        rebuilt.apply(batch_from_proto(request))
    assert list(rebuilt.placements()) == list(served.index.placements())
    assert [b async for b in served.api.DumpIndex(api.DumpIndexRequest(worker_id="nobody"))] == []


async def test_apply_needs_the_bearer_token_when_auth_is_configured(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    services, _, _ = index_services(
        MemoryBackend(), default_block_size=4, max_concurrent_prefix_queries=4
    )
    config = ServerConfig(listen="127.0.0.1:0", auth=AuthConfig(token_file=token_file))
    server, port = await create_server(config, services)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_grpc.KVIndexerStub(channel)
            request = _batch(_report(HBM, [1]))
            assert await _code(stub.ApplyExternalKvBatch(request)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            await stub.ApplyExternalKvBatch(request, metadata=(("authorization", "Bearer s3cret"),))
            prefix = await stub.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=[1]))
            assert prefix.best_prefix_blocks == 1
    finally:
        await server.stop(None)


class BrokenBackend(MemoryBackend):
    async def stats(self) -> IndexStats:
        raise RuntimeError("secret internals")


async def test_an_unexpected_backend_error_is_internal_without_details() -> None:
    services, _, _ = index_services(
        BrokenBackend(), default_block_size=4, max_concurrent_prefix_queries=4
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await api_grpc.KvIndexStub(channel).GetIndexStats(api.GetIndexStatsRequest())
    finally:
        await server.stop(None)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (info.value.details() or "")


async def test_match_tokens_counts_tokens_by_the_request_block_size_and_skips_no_address(
    served: Server,
) -> None:
    tokens = list(range(200, 212))  # 3 full blocks of 4
    keys = block_keys(tokens, 4)
    # Reported without block_sizes: the index knows no token counts for these blocks.
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, keys)))
    # A worker with an empty address holds a longer prefix but is no routing answer.
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, keys), worker_id="hidden", address=""))
    (match,) = (await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens))).matches
    assert (match.worker_id, match.matched_blocks, match.matched_tokens) == ("w0", 3, 12)
    assert [(t.tier, t.matched_blocks, t.matched_tokens) for t in match.tiers] == [(HBM, 3, 12)]
    prefix = await served.kv.MatchExternalKvPrefix(kv.MatchExternalKvPrefixRequest(hashes=keys))
    assert [m.worker_id for m in prefix.matches] == ["w0"]  # the same rule


@pytest.mark.parametrize(
    ("key_space", "algo"),
    [
        (api.KEY_SPACE_VLLM_SHA256, VllmHashAlgo.SHA256),
        (api.KEY_SPACE_VLLM_SHA256_CBOR, VllmHashAlgo.SHA256_CBOR),
    ],
)
async def test_match_tokens_in_vllms_key_space(
    served: Server, key_space: int, algo: VllmHashAlgo
) -> None:
    tokens = list(range(400, 412))
    seeded = [to_sfixed64(h) for h in block_hashes(tokens, 4, algo=algo, python_hash_seed="7")]
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, seeded[:2]), worker_id="vllm"))
    request = api.MatchTokensRequest(token_ids=tokens, key_space=key_space, hash_seed="7")  # type: ignore[arg-type]
    response = await served.api.MatchTokens(request)
    assert list(response.block_keys) == seeded
    assert [(m.worker_id, m.matched_blocks) for m in response.matches] == [("vllm", 2)]
    default_seed = await served.api.MatchTokens(
        api.MatchTokensRequest(token_ids=tokens, key_space=key_space)  # type: ignore[arg-type]
    )
    assert list(default_seed.block_keys) == [
        to_sfixed64(h) for h in block_hashes(tokens, 4, algo=algo)
    ]
    assert not default_seed.matches
    canonical = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens))
    assert list(canonical.block_keys) == block_keys(tokens, 4) and not canonical.matches


async def test_match_tokens_with_multimodal_items(served: Server) -> None:
    # Blocks of 4; an image on tokens [2, 7) overlaps blocks 0 and 1, another on [9, 12) block 2.
    tokens = [1, 2, 0, 0, 0, 0, 0, 3, 4, 0, 0, 0]
    items = [api.MultimodalItem(id="img-a", offset=2, length=5)]
    items.append(api.MultimodalItem(id="img-b", offset=9, length=3))
    keys = block_keys(tokens, 4, mm_hashes=[["img-a"], ["img-a"], ["img-b"]])
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, keys)))
    hit = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens, mm_items=items))
    assert list(hit.block_keys) == keys and hit.matches[0].matched_blocks == 3
    other = [items[0], api.MultimodalItem(id="img-c", offset=9, length=3)]
    partial = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens, mm_items=other))
    assert partial.matches[0].matched_blocks == 2  # same first image, another second one
    text_only = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens))
    assert not text_only.matches
    # vLLM's key space takes (id, offset in block) pairs, as vLLM hashes them.
    vllm = await served.api.MatchTokens(
        api.MatchTokensRequest(
            token_ids=tokens, mm_items=items, key_space=api.KEY_SPACE_VLLM_SHA256
        )
    )
    expected = block_digests(
        tokens, 4, extra_keys=[(("img-a", 2),), (("img-a", -2),), (("img-b", 1),)]
    )
    assert list(vllm.block_keys) == [to_sfixed64(digest_to_int(d)) for d in expected]


@pytest.mark.parametrize(
    "request_",
    [
        api.MatchTokensRequest(token_ids=[1] * 8, mm_items=[api.MultimodalItem(id="x", length=0)]),
        api.MatchTokensRequest(
            token_ids=[1] * 8,
            mm_items=[
                api.MultimodalItem(id="x", offset=4, length=1),
                api.MultimodalItem(id="y", offset=0, length=1),
            ],
        ),
        api.MatchTokensRequest(token_ids=[1] * 8, key_space=9),  # type: ignore[arg-type]
    ],
    ids=["empty-item", "out-of-order", "unknown-key-space"],
)
async def test_match_tokens_rejects_what_it_cannot_hash(
    served: Server, request_: api.MatchTokensRequest
) -> None:
    assert await _code(served.api.MatchTokens(request_)) == INVALID


@pytest.mark.parametrize(
    ("item", "details"),
    [
        (api.MultimodalItem(id="", offset=0, length=4), "mm_items[0]: id must not be empty"),
        (
            api.MultimodalItem(id="img", offset=8, length=4),
            "mm_items[0]: offset 8 is past the end of the prompt (8 tokens)",
        ),
        (
            api.MultimodalItem(id="img", offset=4_000_000_000, length=1),
            "mm_items[0]: offset 4000000000 is past the end of the prompt (8 tokens)",
        ),
        (
            api.MultimodalItem(id="img", offset=4, length=(1 << 32) - 1),
            "mm_items[0]: offset 4 + length 4294967295 overflows a uint32",
        ),
    ],
    ids=["empty-id", "offset-at-end", "offset-far-past-end", "range-overflows"],
)
@pytest.mark.parametrize("key_space", [api.KEY_SPACE_CANONICAL, api.KEY_SPACE_VLLM_SHA256])
async def test_match_tokens_rejects_multimodal_items_outside_the_prompt(
    served: Server, item: api.MultimodalItem, details: str, key_space: api.KeySpace.ValueType
) -> None:
    request_ = api.MatchTokensRequest(token_ids=[1] * 8, mm_items=[item], key_space=key_space)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.api.MatchTokens(request_)
    assert info.value.code() == INVALID
    assert info.value.details() == details


async def test_match_tokens_takes_an_item_running_past_a_prompt_cut_short(served: Server) -> None:
    """An item that starts in the prompt may run past its end (a client sending a prefix of
    a long prompt): accepted, as before."""
    item = api.MultimodalItem(id="img", offset=6, length=100)
    reply = await served.api.MatchTokens(api.MatchTokensRequest(token_ids=[1] * 8, mm_items=[item]))
    assert list(reply.block_keys) == block_keys([1] * 8, 4, mm_hashes=[None, ["img"]])


@contextlib.asynccontextmanager
async def _serving_indexer(tmp_path: Path, backend_url: str) -> AsyncIterator[grpc.aio.Channel]:
    """`kvplane indexer serve`'s server (`run_indexer`) on `backend_url`, and a channel to
    it; stopped by its own graceful stop (SIGTERM) at the end."""
    port_file = tmp_path / "port"
    indexer = asyncio.create_task(
        run_indexer(IndexerConfig(listen="127.0.0.1:0", backend=backend_url), port_file=port_file)
    )
    try:
        async with asyncio.timeout(20):
            while not port_file.exists():  # noqa: ASYNC110 - a file, no event to await
                await asyncio.sleep(0.02)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        async with grpc.aio.insecure_channel(target) as channel:
            yield channel
    finally:
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(indexer, 20)


@pytest.mark.parametrize("backend_name", ["memory", "redis"])
async def test_the_indexer_answers_a_prefix_query_of_a_million_hashes(
    tmp_path: Path, request: pytest.FixtureRequest, backend_name: str
) -> None:
    """MatchExternalKvPrefix has no length cap in the seed: 1M hashes (8 MiB, twice gRPC's
    default 4 MiB receive limit) are answered by `kvplane indexer serve`'s server, on each
    backend, with a held prefix longer than one batch may carry (16,384 hashes)."""
    backend_url = "memory"
    if backend_name == "redis":
        redis_server = request.getfixturevalue("redis_server")
        redis_server.flushall()
        backend_url = redis_server.url
    async with _serving_indexer(tmp_path, backend_url) as channel:
        stub = kv_grpc.KVIndexerStub(channel)
        for start in (0, 16_384):
            chain = range(start, start + 16_384)
            report = _report(HBM, list(chain))
            if start:
                report.parent_block_hash = start - 1
            await stub.ApplyExternalKvBatch(_batch(report))
        query = kv.MatchExternalKvPrefixRequest(hashes=range(1_000_000))
        assert query.ByteSize() > 4 << 20
        reply = await stub.MatchExternalKvPrefix(query)
        assert reply.best_prefix_blocks == 32_768


async def test_match_tokens_counts_a_lower_tiers_longer_prefix_by_the_request_block_size(
    served: Server,
) -> None:
    """Reported without block_sizes: 2 blocks in HBM, 3 on SSD (no routing tier: the
    any-tier prefix alone counts it). Every count of tokens comes from the request's block
    size, the any-tier prefix's too (3 blocks, 12 tokens)."""
    tokens = list(range(300, 312))  # 3 full blocks of 4
    keys = block_keys(tokens, 4)
    await served.kv.ApplyExternalKvBatch(_batch(_report(HBM, keys[:2]), _report(SSD, keys)))
    (match,) = (await served.api.MatchTokens(api.MatchTokensRequest(token_ids=tokens))).matches
    assert (match.any_tier_blocks, match.any_tier_tokens) == (3, 12)
    assert (match.matched_blocks, match.matched_tokens) == (2, 8)
    assert [(t.tier, t.matched_blocks, t.matched_tokens) for t in match.tiers] == [
        (HBM, 2, 8),
        (SSD, 3, 12),
    ]


async def test_the_indexers_stats_count_only_the_external_batches_applied(tmp_path: Path) -> None:
    """`kvplane indexer serve`'s GetIndexStats: an ApplyExternalKvBatch the index refused
    changed nothing and is not counted among the batches applied."""
    async with _serving_indexer(tmp_path, "memory") as channel:
        stub = kv_grpc.KVIndexerStub(channel)
        await stub.ApplyExternalKvBatch(_batch(_report(HBM, [1, 2])))
        assert await _code(stub.ApplyExternalKvBatch(_batch(_report(HBM, [])))) == INVALID
        stats = await api_grpc.KvIndexStub(channel).GetIndexStats(api.GetIndexStatsRequest())
    assert (stats.num_batches_applied, stats.num_blocks) == (1, 2)
