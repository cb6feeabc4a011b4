"""Several `kvplane indexer serve` (real processes) with the same ZMQ source on one private
redis-server, following one real ZMQ publisher: exactly one replica follows the engine (the
holder of its writer lease, as `/metrics` says), so a replica killed with -9 and restarted
beside it does not wipe what the holder keeps, even when the publisher's replay buffer no
longer holds everything; the other replica takes a killed holder's place from a fresh replay,
batches published while nobody wrote included; a holder restarted under its `replica_name`
takes its lease back at once; ApplyExternalKvBatch stays unconditional on every replica. The
shared index is compared with a reference follower of the same publisher (its own memory
index)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq.asyncio

from indexer.backend import IndexBackend
from indexer.backends import open_backend
from indexer.memory_backend import MemoryBackend
from indexer.sources.zmq import ZmqSource, ZmqSourceSettings
from indexer.translate import TranslateOptions, WorkerTranslator
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from tests.indexer.backend_views import worker_keys
from tests.indexer.fake_kv_publisher import FakeKvPublisher, running
from tests.polling import eventually
from tests.redis_servers import RedisServer
from tests.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.timeout(120)
KVPLANE = [str(Path(sys.executable).parent / "kvplane")]
WAIT_S = 30.0
TOPIC = b"kv@test"
WORKER = "w0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _message(seq: int, *events: object) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), msgpack.packb([float(seq), list(events), None])]


def _stored(block: int) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None,
            "medium": "GPU"}  # fmt: skip


def _removed(block: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [block], "medium": "GPU"}


class Replica:
    """One `kvplane indexer serve` on the shared Redis, restartable on the same ports."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        redis: RedisServer,
        publisher: FakeKvPublisher,
        *,
        lease_s: float | None = None,
        replica_name: str | None = None,
        through: tuple[TcpForwarder, TcpForwarder] | None = None,
    ) -> None:
        self.name = name
        self.port = _free_port()
        self.metrics_port = _free_port()
        self.log = workdir / f"{name}.log"
        self.config = workdir / f"{name}.yaml"
        named = f"replica_name: {replica_name}\n" if replica_name else ""
        if lease_s is not None:
            named += f"writer_lease_s: {lease_s}\n"
        # The publisher's endpoints, or forwarders to them (`through`: publisher, replay).
        endpoint, replay = (publisher.endpoint, publisher.replay_endpoint)
        if through is not None:
            endpoint, replay = (through[0].endpoint, through[1].endpoint)
        self.config.write_text(
            f"listen: 127.0.0.1:{self.port}\nmetrics_listen: 127.0.0.1:{self.metrics_port}\n"
            f"backend: {redis.url}\n{named}"
            f"sources:\n  - {{kind: zmq, worker_id: {WORKER}, worker_address: 10.0.0.1:8000, "
            f"endpoint: '{endpoint}', replay_endpoint: '{replay}', "
            "topic: 'kv@', heartbeat_interval_s: 0.2, heartbeat_timeout_s: 1.0}\n"
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [*KVPLANE, "indexer", "serve", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def kill(self) -> None:
        """kill -9: no lease given back, nothing flushed."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _metrics(self) -> str | None:
        """Its `/metrics` page (None: not served yet)."""
        assert self.process is not None
        assert self.process.poll() is None, self.log.read_text()
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return str(reply.read().decode())
        except OSError:
            return None

    def _sample(self, metric: str) -> float | None:
        """The worker's sample of `metric` on `/metrics` (None: not reported)."""
        for line in (self._metrics() or "").splitlines():
            if line.startswith(f'{metric}{{worker_id="{WORKER}"}}'):
                return float(line.split()[-1])
        return None

    def followed(self) -> float | None:
        """`kvplane_indexer_source_followed` of the worker (None: not reported)."""
        return self._sample("kvplane_indexer_source_followed")

    def resyncs(self) -> float | None:
        """`kvplane_indexer_source_resyncs_total` of the worker (None: not reported)."""
        return self._sample("kvplane_indexer_source_resyncs_total")

    async def wait_serving(self) -> None:
        """Until its metrics answer (its sources, or their leases, are started then)."""
        await eventually(
            lambda: self._metrics() is not None, WAIT_S, f"{self.name} to serve its metrics"
        )

    async def wait_followed(self, value: float) -> None:
        await eventually(
            lambda: self.followed() == value,
            WAIT_S,
            f"{self.name} to report kvplane_indexer_source_followed {value:g}",
        )


class Setup:
    def __init__(self, workdir: Path, publisher: FakeKvPublisher, redis: RedisServer) -> None:
        self.workdir = workdir
        self.publisher = publisher
        self.redis = redis
        self.reference = MemoryBackend()
        self.shared: IndexBackend | None = None
        self.replicas: list[Replica] = []
        self.seq = 0

    def replica(self, name: str, **options: object) -> Replica:
        replica = Replica(name, self.workdir, self.redis, self.publisher, **options)  # type: ignore[arg-type]
        self.replicas.append(replica)
        replica.start()
        return replica

    async def publish(self, *events: object) -> None:
        await self.publisher.publish(_message(self.seq, *events))
        self.seq += 1

    async def index_exact(self, what: str) -> None:
        """Until the shared index places on the worker exactly the publisher's live blocks."""
        assert self.shared is not None
        shared = self.shared

        async def exact() -> bool:
            want = await worker_keys(self.reference, WORKER)
            return bool(want) and await worker_keys(shared, WORKER) == want

        await eventually(exact, WAIT_S, f"the shared index to hold the live blocks {what}")


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    """A redis-server, a publisher (replay buffer of 3 batches, as a busy vLLM's may hold
    less than the engine's blocks) and the reference follower; replicas stopped at the end."""
    context = zmq.asyncio.Context()
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    publisher = FakeKvPublisher(context, buffer_steps=3)
    publisher.start_replay()
    state = Setup(tmp_path, publisher, redis)
    try:
        async with AsyncExitStack() as stack:
            reference = ZmqSource(
                ZmqSourceSettings(
                    endpoint=publisher.endpoint,
                    replay_endpoint=publisher.replay_endpoint,
                    topic="kv@",
                    backoff_initial_s=0.05,
                    backoff_max_s=0.2,
                ),
                WorkerTranslator(TranslateOptions(WORKER, "10.0.0.1:8000")),
                state.reference,
                context=context,
            )
            await stack.enter_async_context(running(reference.run()))
            await publisher.wait_subscribed(topic=b"kv@")
            state.shared = await open_backend(redis.url)
            stack.push_async_callback(state.shared.close)
            yield state
    finally:
        for replica in state.replicas:
            replica.stop()
        await publisher.close()
        context.destroy(linger=0)
        redis.stop()


async def report_block_9(channel: grpc.aio.Channel) -> None:
    """ApplyExternalKvBatch: block 9, which the publisher does not hold, on its worker."""
    await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(
        kv.ApplyExternalKvBatchRequest(
            worker_id=WORKER,
            worker_address="10.0.0.1:8000",
            actions=[kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=[9])],
        )
    )


async def test_a_replica_killed_and_restarted_beside_the_holder_keeps_the_index(
    setup: Setup,
) -> None:
    first = setup.replica("first")
    await setup.publisher.wait_subscribed()  # it holds the engine's lease, then follows it
    second = setup.replica("second")
    await second.wait_serving()
    for block in range(8):  # more batches than the replay buffer keeps
        await setup.publish(_stored(100 + block))
    await setup.index_exact("after 8 batches")

    second.kill()
    second.start()
    await second.wait_serving()
    await setup.publish(_stored(200), _removed(100))
    await setup.index_exact("after the other replica restarted")
    assert len(await worker_keys(setup.reference, WORKER)) == 8
    assert (first.followed(), second.followed()) == (1, 0)

    # The KVIndexer API's applies are unconditional on every replica (seed 004).
    async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
        await kv_grpc.KVIndexerStub(channel).ApplyExternalKvBatch(
            kv.ApplyExternalKvBatchRequest(
                worker_id="external",
                worker_address="10.0.0.9:8000",
                actions=[
                    kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_HBM, hashes=[7, 8])
                ],
            )
        )
        # Even to a worker a source of another replica feeds under its lease (last: the
        # worker then holds a block its publisher does not).
        await report_block_9(channel)
    assert setup.shared is not None
    assert await worker_keys(setup.shared, "external") == {7, 8}
    assert 9 in await worker_keys(setup.shared, WORKER)


async def writer_and_reader(
    setup: Setup, lease_s: float, through: tuple[TcpForwarder, TcpForwarder] | None = None
) -> tuple[Replica, Replica]:
    """Two replicas, the first (reaching the publisher `through` forwarders, if given)
    holding the engine's lease and the second not, with four batches indexed."""
    first = setup.replica("first", lease_s=lease_s, through=through)
    await first.wait_followed(1)
    second = setup.replica("second", lease_s=lease_s)
    await second.wait_followed(0)
    for block in range(4):
        await setup.publish(_stored(100 + block))
    await setup.index_exact("with the first replica writing")
    return first, second


async def test_the_other_replica_takes_a_killed_holders_engine_over_from_the_replay(
    setup: Setup,
) -> None:
    setup.publisher.buffer_steps = None  # a takeover rebuilds from the whole replay
    first, second = await writer_and_reader(setup, 2.0)

    first.kill()  # for good: its lease expires
    await setup.publish(_stored(300), _removed(100))  # written by nobody until the takeover
    await second.wait_followed(1)
    await setup.index_exact("after the other replica took the engine over")
    await setup.publisher.restart()  # a new engine process (seqs from 0, empty replay)
    setup.seq = 0
    await setup.publish(_stored(500))
    await setup.index_exact("after the publisher restarted")
    assert await worker_keys(setup.reference, WORKER) == {500}


async def test_a_holder_cut_off_from_the_publisher_hands_the_engine_to_a_replica_that_reaches_it(
    setup: Setup,
) -> None:
    """The holder reaches the publisher through TCP forwarders, the other replica directly.
    The forwarders stop (a partition between the holder and the engine; both still reach
    Redis): after a lease term without the publisher, the holder gives the lease up, the other
    replica takes the engine over from the replay, and what was published meanwhile is
    indexed (before, the holder kept the lease and nothing was)."""
    setup.publisher.buffer_steps = None  # a takeover rebuilds from the whole replay
    through = (
        await TcpForwarder.start(setup.publisher.endpoint),
        await TcpForwarder.start(setup.publisher.replay_endpoint),
    )
    try:
        first, second = await writer_and_reader(setup, 1.0, through)
        assert through[0].tunnels > 0  # the first reaches the publisher through them

        for forwarder in through:
            await forwarder.cut()
        await setup.publish(_stored(300), _removed(100))
        await second.wait_followed(1)
        await setup.index_exact("after the replica that reaches the publisher took over")
        assert first.followed() == 0
    finally:
        for forwarder in through:
            await forwarder.cut()


async def test_a_holder_restarted_under_its_replica_name_takes_its_lease_back_at_once(
    setup: Setup,
) -> None:
    setup.publisher.buffer_steps = None
    # A term far longer than the test: the lease can only come back by the replica's name.
    first = setup.replica("first", lease_s=600.0, replica_name="indexer-a")
    await first.wait_followed(1)
    second = setup.replica("second", lease_s=600.0, replica_name="indexer-b")
    await second.wait_followed(0)
    for block in range(4):
        await setup.publish(_stored(100 + block))
    await setup.index_exact("with the first replica writing")

    first.kill()
    await setup.publish(_stored(300), _removed(100))  # written by nobody yet
    first.start()
    await first.wait_followed(1)
    await setup.index_exact("after the holder came back under its replica_name")
    assert second.followed() == 0


async def test_a_lease_found_taken_anew_is_counted_as_a_resync(setup: Setup) -> None:
    """The holder's lease key gone from Redis (it expired under a holder paused past its
    term that no other replica took over, or Redis lost it): the holder's next renewal takes
    it anew and replaces its own subscription with a fresh one, which clears and rebuilds the
    worker; `kvplane_indexer_source_resyncs_total` counts that as one resync, as the
    controller's `kvplane_controller_engine_kv_event_resyncs_total` does (before, 0)."""
    setup.publisher.buffer_steps = None  # the fresh subscription rebuilds from the replay
    only = setup.replica("only", lease_s=1.5)
    await only.wait_followed(1)
    for block in range(4):
        await setup.publish(_stored(100 + block))
    await setup.index_exact("with the replica writing")
    assert only.resyncs() == 0

    keys = [k for k in setup.redis.command("KEYS", "*") if k.endswith(f":l:{WORKER}".encode())]
    assert len(keys) == 1, keys
    setup.redis.command("DEL", keys[0])
    await eventually(lambda: only.resyncs() == 1, WAIT_S, "the lease taken anew counted")
    await setup.publish(_stored(300), _removed(100))
    await setup.index_exact("after the lease was taken anew")
    assert (only.followed(), only.resyncs()) == (1, 1)


async def test_resync_asked_of_the_replica_without_the_lease_is_done_by_the_holder(
    setup: Setup,
) -> None:
    """ResyncEngine behind a load balancer lands on the replica that does not follow the
    engine: it hands the resync to the holder (through Redis) and says so, and the holder
    drops the worker and rebuilds it from the publisher's replay. Before, the non-holder
    answered as if it had dropped the worker and resubscribed, and nothing changed."""
    setup.publisher.buffer_steps = None  # the resync rebuilds from the whole replay
    first = setup.replica("first", replica_name="indexer-a")
    await first.wait_followed(1)
    second = setup.replica("second", replica_name="indexer-b")
    await second.wait_followed(0)
    for block in range(4):
        await setup.publish(_stored(100 + block))
    await setup.index_exact("with the first replica writing")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
        # A block the engine does not hold (an earlier process's, say): a resync drops it.
        await report_block_9(channel)
        assert setup.shared is not None
        assert 9 in await worker_keys(setup.shared, WORKER)

        reply = await api_grpc.KvIndexStub(channel).ResyncEngine(
            api.ResyncEngineRequest(engine="10.0.0.1:8000")
        )
    assert list(reply.dropped_worker_ids) == []
    assert reply.sources_resubscribed == 0
    assert len(reply.handed_to) == 1
    assert reply.handed_to[0].startswith("indexer-a/")
    await setup.index_exact("after the holder resynced the engine")  # block 9 is gone
    assert (first.followed(), second.followed()) == (1, 0)
    assert first.resyncs() == 1  # the resync handed over, counted once by the holder

    # As `kvplane admin index resync` prints it.
    admin = await asyncio.to_thread(
        subprocess.run,
        [*KVPLANE, "admin", "index", "resync", "w0", "-t", f"127.0.0.1:{second.port}"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert admin.returncode == 0, admin.stderr
    assert admin.stdout == (
        f"w0: 0 worker(s) dropped, 0 source(s) resubscribing; handed to {reply.handed_to[0]} "
        "(holding its writer lease)\n"
    )


async def test_a_holder_stopped_hands_its_engine_over_at_once(setup: Setup) -> None:
    """A holder stopped (SIGTERM: scaled down, rolled) gives its writer lease back: its key
    is gone as the process exits, not a term later, and the other replica takes the engine
    over at its next renewal (a third of the term) from the replay."""
    setup.publisher.buffer_steps = None  # the takeover rebuilds from the whole replay
    first, second = await writer_and_reader(setup, 30.0)
    lease = [k for k in setup.redis.command("KEYS", "*") if k.endswith(f":l:{WORKER}".encode())]
    assert len(lease) == 1, lease

    first.stop()
    assert setup.redis.command("EXISTS", lease[0]) == 0
    await setup.publish(_stored(300), _removed(100))
    await second.wait_followed(1)
    await setup.index_exact("after the stopped holder handed the engine over")


async def test_a_resync_only_if_the_stream_is_lost_handed_to_a_following_holder_does_nothing(
    setup: Setup,
) -> None:
    """ResyncEngine with `only_if_stream_lost` (a controller's first contact with the engine)
    on the replica without the lease is handed to the holder with its condition: the holder,
    whose stream follows the live publisher, leaves the engine's worker as it is (a block
    the engine does not hold stays, no resync counted), instead of dropping and rebuilding
    it as for an unconditional resync."""
    first, second = await writer_and_reader(setup, 1.5)
    assert setup.shared is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
        await report_block_9(channel)
        reply = await api_grpc.KvIndexStub(channel).ResyncEngine(
            api.ResyncEngineRequest(engine="10.0.0.1:8000", only_if_stream_lost=True)
        )
    assert len(reply.handed_to) == 1
    asked = [k for k in setup.redis.command("KEYS", "*") if k.endswith(f":r:{WORKER}".encode())]
    assert len(asked) == 1, asked
    await eventually(
        lambda: setup.redis.command("EXISTS", asked[0]) == 0, WAIT_S, "the holder to find it"
    )
    await setup.publish(_stored(300))
    await eventually(
        lambda: _holds(setup.shared, 300), WAIT_S, "the holder to write the next batch"
    )
    assert 9 in await worker_keys(setup.shared, WORKER)
    assert first.resyncs() == 0


async def _holds(index: IndexBackend | None, block: int) -> bool:
    assert index is not None
    return block in await worker_keys(index, WORKER)
