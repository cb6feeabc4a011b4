"""End to end: a `kvplane indexer serve` process on a real redis-server whose Redis loses its
data (flushed, or restarted empty) while a worker is fed through ApplyExternalKvBatch. The
indexer refuses that worker's batches with ABORTED until its client resends it from a clear,
and the bridge, following a real ZMQ publisher, resyncs at the refusal: the index then holds
exactly the publisher's live blocks, even though the block the bridge would probe (its
canary) was stored after the loss.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq.asyncio
from fake_kv_publisher import FakeKvPublisher, running
from redis_servers import RedisServer

from indexer.batch import Action, ActionType, Batch, Tier
from indexer.bridge import BridgeSettings, build_bridge, follow
from indexer.sources.resync import LostExternalWorkers, WorkerLostError
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from tests.polling import eventually

pytestmark = pytest.mark.timeout(90)
WAIT_S = 30.0
PROBE_S = 0.05
HBM, DRAM, SSD = kv.TIER_HBM, kv.TIER_DRAM, kv.TIER_SSD
LOSS_NOTICED = "lost the index; resyncing"  # the Redis backend's log when its boot token changed


def _clear(*tiers: int) -> list[kv.ExternalKvAction]:
    return [kv.ExternalKvAction(type=kv.ACTION_CLEAR_ALL_AT_TIER, tier=t) for t in tiers]


def _report(*hashes: int) -> kv.ExternalKvAction:
    return kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=HBM, hashes=hashes)


def test_a_loss_ends_only_with_a_clear_admitted_after_it() -> None:
    """A clear that was being applied when a newer loss was noticed may have been written
    before that loss: it is refused too, and the loss stays until the next clear."""
    clear = Batch("w0", tuple(Action(ActionType.CLEAR_ALL_AT_TIER, t) for t in Tier))
    report = Batch("w0", (Action(ActionType.REPORT, Tier.HBM, (1,)),))
    lost = LostExternalWorkers()
    lost.applied(report, lost.admit(report))  # nothing lost: taken
    lost.mark_lost("w0")
    with pytest.raises(WorkerLostError):
        lost.admit(report)
    admitted_under = lost.admit(clear)
    lost.mark_lost("w0")  # noticed while the clear was being applied
    with pytest.raises(WorkerLostError):
        lost.applied(clear, admitted_under)
    with pytest.raises(WorkerLostError):
        lost.admit(report)
    lost.applied(clear, lost.admit(clear))
    lost.applied(report, lost.admit(report))  # the loss is over
    # A plain batch during whose apply the loss was noticed is refused as well.
    admitted_under = lost.admit(report)
    lost.mark_lost("w0")
    with pytest.raises(WorkerLostError):
        lost.applied(report, admitted_under)


class Indexer:
    """A `kvplane indexer serve` process (no sources) on its own redis-server."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.redis = RedisServer(workdir / "redis")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        return (self.workdir / "serve.log").read_text()

    async def start(self) -> str:
        self.redis.start()
        config = self.workdir / "indexer.yaml"
        config.write_text(f"backend: {self.redis.url}\nredis: {{buckets: 64}}\n")
        port_file = self.workdir / "port"
        self._spawn(config, port_file)

        def up() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log
            return port_file.exists() and bool(port_file.read_text())

        await eventually(up, WAIT_S, "the indexer's port file")
        return f"127.0.0.1:{int(port_file.read_text())}"

    def _spawn(self, config: Path, port_file: Path) -> None:
        with (self.workdir / "serve.log").open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvplane", "indexer", "serve", "--config", str(config),
                 "--listen", "127.0.0.1:0", "--port-file", str(port_file)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    async def noticed_loss(self) -> None:
        await eventually(lambda: LOSS_NOTICED in self.log, WAIT_S, "the indexer to see the loss")

    def redis_state(self) -> dict[bytes, bytes]:
        """Every key of the Redis behind the index, serialized (DUMP)."""
        client = self.redis.client()
        return {key: client.dump(key) for key in sorted(client.scan_iter())}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(20)
        self.redis.stop()


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    started = Indexer(tmp_path)
    yield started
    started.stop()


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def _held(stub: kv_grpc.KVIndexerAsyncStub, worker_id: str, hashes: list[int]) -> set[int]:
    """Which of `hashes` the index places on `worker_id`."""
    reply = await stub.MatchExternalKv(kv.MatchExternalKvRequest(hashes=hashes))
    return {
        h for m in reply.matches if m.worker_id == worker_id for t in m.hashes_by_tier
        for h in t.hashes
    }  # fmt: skip


async def test_a_lost_workers_batches_are_refused_unchanged_until_one_clears_it(
    indexer: Indexer,
) -> None:
    target = await indexer.start()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kv_grpc.KVIndexerStub(channel)

        async def apply(worker_id: str, seq: int, *actions: kv.ExternalKvAction) -> None:
            request = kv.ApplyExternalKvBatchRequest(worker_id=worker_id, seq=seq, actions=actions)
            await stub.ApplyExternalKvBatch(request)

        await apply("w0", 0, *_clear(HBM, DRAM, SSD), _report(1, 2))
        await apply("w1", 0, _report(3))
        indexer.redis.flushall()  # Redis lost the index
        await indexer.noticed_loss()
        before = indexer.redis_state()

        refused = [
            [_report(5)],  # the client goes on as if nothing happened
            [*_clear(HBM, DRAM), _report(1, 2)],  # not every tier: SSD blocks would survive
            [_report(1, 2), *_clear(HBM, DRAM, SSD)],  # clears, but not first
        ]
        for actions in refused:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await apply("w0", 1, *actions)
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert str(info.value.details()).startswith(
                "the index lost this worker's blocks (worker 'w0': "
            )
            assert "resend them from a clear" in str(info.value.details())
        assert indexer.redis_state() == before  # the refusals changed nothing
        assert await _held(stub, "w0", [1, 2, 5]) == set()

        await apply("w0", 1, *_clear(SSD, HBM, DRAM), _report(1, 2))  # the client resyncs
        await apply("w0", 2, _report(5))  # ... and goes on
        assert await _held(stub, "w0", [1, 2, 5]) == {1, 2, 5}
        # Each worker is rebuilt on its own: w1's client has not resent it yet.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await apply("w1", 1, _report(4))
        assert info.value.code() == grpc.StatusCode.ABORTED
    assert "worker w0 lost its blocks and no source of this process feeds it" in indexer.log
    assert "worker w1 lost its blocks" in indexer.log


def _frames(seq: int, event: list[object]) -> list[bytes]:
    return [b"kv@", seq.to_bytes(8, "big"), msgpack.packb([float(seq), [event], None])]


def _stored(seq: int, hashes: list[int], parent: int | None) -> list[bytes]:
    return _frames(seq, ["BlockStored", hashes, parent, [1] * 4 * len(hashes), 4, None, "GPU"])


def _removed(seq: int, hashes: list[int]) -> list[bytes]:
    return _frames(seq, ["BlockRemoved", hashes, "GPU"])


@pytest.mark.parametrize("loss", ["flushed", "restarted-empty", "flushed-then-published-at-once"])
async def test_the_bridge_rebuilds_a_worker_the_index_lost_when_its_apply_is_refused(
    indexer: Indexer, context: zmq.asyncio.Context, loss: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The canary cannot find this loss: the bridge's canary was revoked before it, and the
    block stored after it (which the index holds) is the next canary. The refusal does:
    `flushed-then-published-at-once` publishes before the indexer's upkeep saw the loss, so the
    apply that finds Redis emptied is itself refused."""
    target = await indexer.start()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    settings = BridgeSettings(
        endpoint=publisher.endpoint,
        target=target,
        worker_id="sgl-0",
        worker_address="10.0.0.9:30000",
        replay_endpoint=publisher.replay_endpoint,
        topic="kv@",
        probe_interval_s=PROBE_S,
    )
    source, sink = build_bridge(settings, context=context)
    try:
        async with (
            running(follow(source, sink, probe_interval_s=PROBE_S)),
            grpc.aio.insecure_channel(target) as channel,
        ):
            stub = kv_grpc.KVIndexerStub(channel)

            async def indexed() -> set[int]:
                return await _held(stub, "sgl-0", [11, 12, 13])

            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, [11, 12], None))  # 11 is the canary ...
            await publisher.publish(_removed(1, [11]))  # ... until it goes
            await eventually(lambda: sink.num_sent == 3, WAIT_S, "seqs 0 and 1 applied")
            assert await indexed() == {12}

            if loss == "restarted-empty":
                indexer.redis.kill()
                indexer.redis.start()
            else:
                indexer.redis.flushall()
            if loss != "flushed-then-published-at-once":
                await indexer.noticed_loss()
            await publisher.publish(_stored(2, [13], 12))  # the next canary

            async def exact() -> bool:
                return await indexed() == {12, 13}

            await eventually(exact, WAIT_S, "the publisher's live blocks, 12 and 13")
    finally:
        await publisher.close()
        await sink.close()
    assert source.counters.num_resyncs == 1
    assert sink.num_lost_refusals == 1 and sink.num_canary_misses == 0
    assert publisher.replay_requests == [0, 0]  # the start's rebuild, then the resync's
    refusals = [r.getMessage() for r in caplog.records if r.name == "indexer.bridge"]
    assert [m for m in refusals if "the index lost this worker's blocks" in m] == [
        f"{target} refused batch seq 2 of worker sgl-0: the index lost this worker's blocks "
        "(worker 'sgl-0': its store lost its data, or dropped them in an outage); resend them "
        "from a clear: a batch that starts with CLEAR_ALL_AT_TIER at every tier, then the "
        "worker's blocks; resyncing"
    ]
