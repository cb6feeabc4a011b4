"""End to end: the bridge, following a real ZMQ publisher, feeds a `kvplane indexer serve`
process on a real redis-server, and that Redis loses the worker's blocks, all of them (flushed,
restarted empty) or some (bucket keys evicted). The seed's applies are unconditional, so no
apply tells the bridge; its probe (MatchExternalKv for the blocks it delivered) finds the loss
and resyncs the worker, and the index then holds exactly the publisher's live blocks: even when
the block it probed first (the canary) was revoked before the loss, and even when the block
stored after the loss is in the index.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq.asyncio

from indexer.bridge import BridgeSettings, KvIndexerSink, build_bridge, follow
from indexer.redis_codec import pack_key
from indexer.sources.zmq import ZmqSource
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from tests.indexer.fake_kv_publisher import FakeKvPublisher, running
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(90)
WAIT_S = 30.0
PROBE_S = 0.05
WORKER = "sgl-0"
LOSS_NOTICED = "lost the index; resyncing"  # the Redis backend's log when its boot token changed
LOSS_FOUND = f"of worker {WORKER} at HBM"  # in the bridge's warning as its probe finds a loss


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

    def evict_buckets_of(self, keys: list[int]) -> None:
        """Delete the bucket hashes (`P:b:<bucket>`, docs/redis.md) holding `keys`, as Redis
        evicting keys under maxmemory does: whole keys, not fields."""
        client = self.redis.client()
        buckets = list(client.scan_iter(match="kvplane:*:b:*"))
        doomed = {b for b in buckets for k in keys if client.hexists(b, pack_key(k))}
        assert doomed and client.delete(*doomed) == len(doomed)

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


@pytest.fixture
async def publisher(context: zmq.asyncio.Context) -> AsyncIterator[FakeKvPublisher]:
    started = FakeKvPublisher(context)
    started.start_replay()
    yield started
    await started.close()


def _frames(seq: int, event: list[object]) -> list[bytes]:
    return [b"kv@", seq.to_bytes(8, "big"), msgpack.packb([float(seq), [event], None])]


def _stored(seq: int, hashes: list[int], parent: int | None) -> list[bytes]:
    return _frames(seq, ["BlockStored", hashes, parent, [1] * 4 * len(hashes), 4, None, "GPU"])


def _removed(seq: int, hashes: list[int]) -> list[bytes]:
    return _frames(seq, ["BlockRemoved", hashes, "GPU"])


async def _indexed(target: str, hashes: list[int]) -> set[int]:
    """Which of `hashes` the index places on the bridge's worker."""
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await kv_grpc.KVIndexerStub(channel).MatchExternalKv(
            kv.MatchExternalKvRequest(hashes=hashes)
        )
    return {
        h for m in reply.matches if m.worker_id == WORKER for t in m.hashes_by_tier
        for h in t.hashes
    }  # fmt: skip


async def _until_indexed(target: str, hashes: list[int], live: set[int], what: str) -> None:
    async def exact() -> bool:
        return await _indexed(target, hashes) == live

    await eventually(exact, WAIT_S, what)


def _bridge(
    target: str, publisher: FakeKvPublisher, context: zmq.asyncio.Context
) -> tuple[ZmqSource, KvIndexerSink]:
    settings = BridgeSettings(
        endpoint=publisher.endpoint,
        target=target,
        worker_id=WORKER,
        worker_address="10.0.0.9:30000",
        replay_endpoint=publisher.replay_endpoint,
        topic="kv@",
        probe_interval_s=PROBE_S,
    )
    return build_bridge(settings, context=context)


def _losses_found(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == "indexer.bridge" and LOSS_FOUND in r.getMessage()
    ]  # fmt: skip


def _one_resync(source: ZmqSource, publisher: FakeKvPublisher) -> None:
    assert source.counters.num_resyncs == 1
    assert publisher.replay_requests == [0, 0]  # the start's rebuild, then the resync's


@pytest.mark.parametrize("loss", ["flushed", "restarted-empty", "flushed-then-published-at-once"])
async def test_the_probe_finds_a_whole_loss_the_block_stored_after_it_would_hide(
    indexer: Indexer,
    context: zmq.asyncio.Context,
    publisher: FakeKvPublisher,
    loss: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The canary (11) is revoked before the loss; the block stored after the loss (13) is in
    the index, and would hide the loss were it the next canary. The block still held from
    before (12) replaced the canary at once, and the probe finds it gone.
    `flushed-then-published-at-once` publishes before the indexer's upkeep saw the loss: the
    apply that finds Redis emptied writes 13 into the emptied index."""
    caplog.set_level(logging.WARNING, logger="indexer.bridge")
    target = await indexer.start()
    source, sink = _bridge(target, publisher, context)
    try:
        async with running(follow(source, sink, probe_interval_s=PROBE_S)):
            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, [11, 12], None))  # 11 is the canary ...
            await publisher.publish(_removed(1, [11]))  # ... until it goes
            await _until_indexed(target, [11, 12, 13], {12}, "seqs 0 and 1 applied")

            if loss == "restarted-empty":
                indexer.redis.kill()
                indexer.redis.start()
            else:
                indexer.redis.flushall()
            if loss != "flushed-then-published-at-once":
                await indexer.noticed_loss()
            await publisher.publish(_stored(2, [13], 12))  # stored after the loss
            await eventually(lambda: source.counters.num_resyncs >= 1, WAIT_S, "a resync")
            await _until_indexed(target, [11, 12, 13], {12, 13}, "the live blocks, 12 and 13")
    finally:
        await sink.close()
    _one_resync(source, publisher)
    assert sink.num_losses_found == 1
    assert _losses_found(caplog) == [
        f"{target} no longer holds block 12 of worker {WORKER} at HBM: it lost the worker's "
        "state; resyncing"
    ]


async def test_the_probes_sample_finds_a_partial_loss_that_spares_the_canary(
    indexer: Indexer,
    context: zmq.asyncio.Context,
    publisher: FakeKvPublisher,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis evicts the buckets of three of the worker's 40 blocks, not the canary's (100), and
    the engine publishes nothing more: the rotating sample asks about every delivered block in
    turn (16 a probe), finds the three missing twice in a row, and the worker is rebuilt."""
    caplog.set_level(logging.WARNING, logger="indexer.bridge")
    target = await indexer.start()
    blocks = list(range(100, 140))  # one block per bucket of 64
    source, sink = _bridge(target, publisher, context)
    try:
        async with running(follow(source, sink, probe_interval_s=PROBE_S)):
            await publisher.wait_subscribed()
            await publisher.publish(_stored(0, blocks, None))
            await _until_indexed(target, blocks, set(blocks), "the 40 blocks")
            probes = sink.num_probes
            await eventually(lambda: sink.num_probes >= probes + 3, WAIT_S, "a sample's turn")
            assert source.counters.num_resyncs == 0

            indexer.evict_buckets_of([120, 121, 122])
            assert await _indexed(target, blocks) == set(blocks) - {120, 121, 122}
            await eventually(lambda: source.counters.num_resyncs >= 1, WAIT_S, "a resync")
            await _until_indexed(target, blocks, set(blocks), "the 40 blocks again")
    finally:
        await sink.close()
    _one_resync(source, publisher)
    assert sink.num_losses_found == 1
    (found,) = _losses_found(caplog)
    assert re.match(rf"{target} no longer holds block 12[012] of worker {WORKER} at HBM", found)
