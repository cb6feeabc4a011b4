"""Several controller replicas on one shared Redis index, in front of the same engines: each
engine's KV events are written by the one replica holding its writer lease, the others read.
The index holds exactly each engine's blocks after traffic through every replica, after an
engine is removed through one replica only, after the writing replica is killed (the other
takes over, blocks stored and evicted meanwhile included) and comes back, and a writer paused
past its lease cannot put back a block the engine has evicted since."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.config import ControllerConfig
from engine.server.service import EngineApp
from indexer.backends import open_backend
from indexer.batch import Batch
from indexer.keys import block_keys
from indexer.writer_lease import lease_holder
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_faults import cached_keys, indexed_keys
from tests.controller.test_gateway import generate
from tests.polling import eventually
from tests.redis_servers import RedisServer, free_port
from tests.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.timeout(120)

LEASE_S = 2.0  # short, for the takeovers to come quickly; the default is docs/controller.md's


def shared_index(redis: RedisServer) -> dict[str, Any]:
    return {"backend": redis.url, "writer_lease_s": LEASE_S}


async def small_engines(count: int) -> list[EngineApp]:
    """Engines with 16 KV blocks: a few prompts of three blocks evict the oldest."""
    return [await start_sim_engine(f"e{i}", num_kv_blocks=16) for i in range(count)]


def prompt(n: int) -> list[int]:
    return [*range(1000 * (n + 1), 1000 * (n + 1) + 48), 7]  # three blocks of 16 and a tail


async def serve(fleet: Fleet, n: int) -> None:
    reply = await generate(fleet, generate_request(f"p{n}-{id(fleet)}", prompt(n)))
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]


def follows(fleet: Fleet, engine: EngineApp) -> bool:
    """Whether the replica follows the engine's KV events into the index."""
    return fleet.app.controller.fleet.source_of(fleet.address(engine)) is not None


async def index_exact(reader: Fleet, engines: list[EngineApp]) -> None:
    """Wait until the shared index (read through `reader`) places on each engine exactly the
    blocks it holds."""
    for engine in engines:
        address = reader.address(engine)

        async def exact(address: str = address, engine: EngineApp = engine) -> bool:
            return await indexed_keys(reader, address) == cached_keys(engine)

        await eventually(exact, 20, f"the index to hold exactly {address}'s blocks")


async def close_replica(fleet: EngineFleet[Any]) -> None:
    """Close a replica sharing its engines with another (they are closed with that one)."""
    await fleet.channel.close()
    await fleet.app.close(0.2)


async def test_each_engine_is_written_by_one_replica_and_the_index_is_exact(
    redis: RedisServer,
) -> None:
    a = await make_fleet(engines=await small_engines(3), index=shared_index(redis))
    b = await make_fleet(engines=a.engines, index=shared_index(redis))
    try:
        for n in range(12):  # through both replicas, evicting the first prompts
            await serve((a, b)[n % 2], n)
        for engine in a.engines:

            def one_follows(engine: EngineApp = engine) -> bool:
                return follows(a, engine) != follows(b, engine)

            await eventually(one_follows)
        await index_exact(b, a.engines)
        await index_exact(a, a.engines)
        assert all(follows(a, e) for e in a.engines)  # the first replica took every lease
        assert not any(follows(b, e) for e in a.engines)
    finally:
        await close_replica(b)
        await close_fleet(a)


async def test_an_engine_removed_through_one_replica_stays_indexed_for_the_other(
    redis: RedisServer,
) -> None:
    """An engine leaves one replica's fleet while another still routes to it (a removal
    through the admin API reaches the others only at their next read of the shared membership,
    tests/controller/test_shared_membership.py): the index still holds all of its blocks (the
    removing replica wrote them: the other takes the engine over and rebuilds it from its
    snapshot)."""
    a = await make_fleet(engines=await small_engines(1), index=shared_index(redis))
    b = await make_fleet(engines=a.engines, index=shared_index(redis))
    engine = a.engines[0]
    try:
        for n in range(3):
            await serve(b, n)
        await index_exact(b, [engine])
        await a.app.controller.fleet.remove_engine(a.address(engine))
        await index_exact(b, [engine])
        await serve(b, 3)
        await index_exact(b, [engine])
    finally:
        await close_replica(b)
        await close_fleet(a)


async def test_a_redis_that_lost_the_index_is_rebuilt_for_both_replicas(
    redis: RedisServer,
) -> None:
    """redis-server restarted empty under two replicas, no request since: the leases, lost
    with the data, are taken again (by either replica) and the index holds exactly each
    engine's blocks again, read through either replica."""
    a = await make_fleet(engines=await small_engines(2), index=shared_index(redis))
    b = await make_fleet(engines=a.engines, index=shared_index(redis))
    try:
        for n in range(4):
            await serve((a, b)[n % 2], n)
        await index_exact(b, a.engines)
        await asyncio.to_thread(redis.kill)
        await asyncio.to_thread(redis.start)
        await index_exact(b, a.engines)
        await index_exact(a, a.engines)
    finally:
        await close_replica(b)
        await close_fleet(a)


def start_replica_process(
    tmp_path: Path,
    redis: RedisServer,
    engines: list[EngineApp],
    listen: str = "127.0.0.1:0",
    lease_s: float = LEASE_S,
    *,
    engines_through: TcpForwarder | None = None,
) -> Any:
    """`kvplane controller serve` on the shared index, in front of `engines` (reached through
    the proxy `engines_through`, if given)."""
    config = tmp_path / "replica.yaml"
    config.write_text(
        f"listen: {listen}\nindex: {{backend: '{redis.url}', writer_lease_s: {lease_s}}}\n"
        "health: {poll_interval_s: 0.2, load_poll_interval_s: 0.1, backoff_initial_s: 0.1, "
        "backoff_max_s: 1.0}\nengines:\n"
        + "".join(f"  - {{address: 127.0.0.1:{e.port}}}\n" for e in engines)
    )
    environment = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    if engines_through is not None:
        environment["grpc_proxy"] = engines_through.url
    return subprocess.Popen(
        [sys.executable, "-m", "kvplane", "controller", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "replica.log").open("ab"),
        env={**environment, "PYTHONUNBUFFERED": "1"},
    )


async def lease_holders(redis: RedisServer, engines: list[EngineApp]) -> list[bytes | None]:
    client = redis.client()

    def holder(engine: EngineApp) -> bytes | None:
        value = client.get(f"kvplane:{{default:0}}:l:127.0.0.1:{engine.port}")
        assert value is None or isinstance(value, bytes)  # the client does not decode
        return value

    try:
        return [await asyncio.to_thread(holder, e) for e in engines]
    finally:
        client.close()


async def reading_replica(redis: RedisServer, engines: list[EngineApp]) -> Fleet:
    """A second replica in-process while another follows every engine: it serves prompts
    through its gateway and finds the index exact, written by the other alone."""
    reader = await make_fleet(engines=engines, index=shared_index(redis))
    for n in range(4):
        await serve(reader, n)
    await index_exact(reader, engines)
    assert not any(follows(reader, e) for e in engines)
    return reader


async def stop_all(process: Any, replica: Fleet | None, engines: list[EngineApp]) -> None:
    """Stop a replica process, an in-process replica and the engines."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 20)
    if replica is not None:
        await close_replica(replica)
    for engine in engines:
        await engine.close()


async def test_a_killed_writer_replica_is_taken_over_and_the_index_is_exact_again(
    redis: RedisServer, tmp_path: Path
) -> None:
    """The replica writing every engine (a process) is killed with SIGKILL, so its leases run
    out rather than being given up: the other replica takes every engine over, and the index
    holds exactly the engines' blocks, those stored and evicted since included. Back, the
    killed replica writes nothing while the other holds the leases."""
    engines = await small_engines(2)
    writer = start_replica_process(tmp_path, redis, engines)
    b: Fleet | None = None
    try:

        async def writer_holds_every_lease() -> bool:
            return None not in await lease_holders(redis, engines)

        await eventually(writer_holds_every_lease, 60, "the replica process to take the leases")
        b = await reading_replica(redis, engines)

        writer.send_signal(signal.SIGKILL)
        await asyncio.to_thread(writer.wait)
        for n in range(4, 10):  # stored and evicted while nobody may write, or since
            await serve(b, n)
        await eventually(lambda: all(follows(b, e) for e in engines), 20, "the takeover")
        await index_exact(b, engines)

        writer = start_replica_process(tmp_path, redis, engines)
        for n in range(10, 14):
            await serve(b, n)
        await index_exact(b, engines)
        assert all(follows(b, e) for e in engines)
        own = b.app.controller.fleet.lease_holder.encode()
        assert await lease_holders(redis, engines) == [own] * len(engines)
    finally:
        await stop_all(writer, b, engines)


async def test_a_restarted_replica_takes_its_leases_back_at_once(
    redis: RedisServer, tmp_path: Path
) -> None:
    """A replica killed with SIGKILL and started again (a crash, a supervisor's restart) is the
    same replica (its host and listen address): it takes its engines' leases back at once
    instead of after `writer_lease_s` (here an hour), and the index follows the engines again."""
    engines = await small_engines(2)
    listen = f"127.0.0.1:{free_port()}"
    writer = start_replica_process(tmp_path, redis, engines, listen, lease_s=3600)
    reader: Fleet | None = None
    try:
        first: list[bytes | None] = []

        async def taken() -> bool:
            first[:] = await lease_holders(redis, engines)
            return None not in first

        await eventually(taken, 60, "the replica process to take the leases")
        writer.send_signal(signal.SIGKILL)
        await asyncio.to_thread(writer.wait)
        writer = start_replica_process(tmp_path, redis, engines, listen, lease_s=3600)

        async def taken_back() -> bool:
            holders = await lease_holders(redis, engines)
            return None not in holders and not set(holders) & set(first)

        await eventually(taken_back, 60, "the restarted process to take the leases back")
        reader = await reading_replica(redis, engines)
    finally:
        await stop_all(writer, reader, engines)


async def test_a_writer_cut_off_from_its_engine_hands_its_lease_to_a_replica_that_reaches_it(
    redis: RedisServer, tmp_path: Path
) -> None:
    """The replica writing the engine (a process, which reaches it through a proxy) is cut
    off from it (the proxy stops: a network partition between the two) while it still
    reaches Redis. After a lease term without the engine's events it gives the lease up, the
    other replica, which reaches the engine, takes it, and the engine's new blocks are
    indexed."""
    engine = (await small_engines(1))[0]
    proxy = await TcpForwarder.start()
    writer = start_replica_process(tmp_path, redis, [engine], lease_s=1, engines_through=proxy)
    reader: Fleet | None = None
    try:

        async def writer_holds_the_lease() -> bool:
            return None not in await lease_holders(redis, [engine])

        await eventually(writer_holds_the_lease, 60, "the replica process to take the lease")
        reader = await make_fleet(
            engines=[engine], index={"backend": redis.url, "writer_lease_s": 1.0}
        )
        await serve(reader, 0)
        await index_exact(reader, [engine])
        assert not follows(reader, engine)
        assert proxy.tunnels > 0  # the writer reaches the engine through the proxy

        await proxy.cut()
        await serve(reader, 1)
        await index_exact(reader, [engine])  # prompt 1's blocks are indexed
        assert follows(reader, engine)
        own = reader.app.controller.fleet.lease_holder.encode()
        assert await lease_holders(redis, [engine]) == [own]
    finally:
        await proxy.cut()
        await stop_all(writer, reader, [engine])


class PausableIndex:
    """A replica's shared index whose writes and lease renewals wait while `paused`, as those
    of a stopped process (SIGSTOP) do; `let_one()` lets one held write through, as the
    process, resumed, sends the write it had prepared before it can notice anything."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.paused = False
        self.waiting = 0
        self.let_through: list[Batch] = []
        self.done: list[Batch] = []
        self._changed = asyncio.Condition()
        self._passes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def _wait(self) -> bool:
        """Until not paused or given a pass; whether it went through on a pass."""
        async with self._changed:
            self.waiting += 1
            self._changed.notify_all()
            try:
                while self.paused and not self._passes:
                    await self._changed.wait()
                if self.paused:
                    self._passes -= 1
                    return True
                return False
            finally:
                self.waiting -= 1

    async def apply(self, batch: Batch) -> None:
        if self.paused and await self._wait():
            self.let_through.append(batch)
            try:
                await self._backend.apply(batch)
            finally:
                self.done.append(batch)
            return
        await self._backend.apply(batch)

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> Any:
        while self.paused:
            async with self._changed:
                await self._changed.wait()
        return await self._backend.hold_lease(name, holder, ttl_s)

    async def let_one(self) -> None:
        async with self._changed:
            self._passes += 1
            self._changed.notify_all()

    async def resume(self) -> None:
        async with self._changed:
            self.paused = False
            self._changed.notify_all()


async def test_a_paused_writer_cannot_write_after_losing_its_lease(redis: RedisServer) -> None:
    """The writing replica stops (its Redis calls held) with the engine's store of a prompt's
    blocks in hand. Its lease runs out, the other replica takes over from the engine's
    snapshot, and the engine evicts those blocks. Resumed, the paused replica's store is
    refused: the evicted blocks do not come back into the index."""
    engine = (await small_engines(1))[0]
    backend = await open_backend(redis.url)
    paused = PausableIndex(backend)
    a = await make_fleet(engines=[engine], index_backend=paused, index=shared_index(redis))
    b = await make_fleet(engines=[engine], index=shared_index(redis))
    try:
        await eventually(lambda: follows(a, engine))
        await serve(b, 0)
        await index_exact(b, [engine])

        paused.paused = True
        await serve(b, 1)  # its store reaches the paused replica, which holds it
        await eventually(lambda: paused.waiting > 0, 20, "the paused replica's store")
        await eventually(lambda: follows(b, engine), 20, "the other replica to take over")
        for n in range(2, 8):  # the engine evicts prompt 1's blocks
            await serve(b, n)
        evicted = set(block_keys(prompt(1)[:48], 16))
        assert not evicted & cached_keys(engine)
        await index_exact(b, [engine])

        await paused.let_one()
        await eventually(lambda: paused.done, 20, "the paused replica's store to be sent")
        assert evicted & {k for b in paused.let_through for a in b.actions for k in a.hashes}
        assert await indexed_keys(b, b.address(engine)) == cached_keys(engine)
        await paused.resume()
        await serve(b, 8)
        await index_exact(b, [engine])
        assert not follows(a, engine)
    finally:
        await paused.resume()
        await close_replica(b)
        await close_fleet(a)
        await backend.close()


@pytest.mark.parametrize("name", ["", "a b", "a/b"])
def test_a_replica_name_that_cannot_be_one_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="replica_name"):
        ControllerConfig.model_validate({"index": {"backend": "redis://h:1", "replica_name": name}})


def test_a_lease_holder_is_its_replica_and_its_process() -> None:
    assert lease_holder("c0", "127.0.0.1:0", "controller-1") == "c0/controller-1"
    host = socket.gethostname()
    assert lease_holder(None, "0.0.0.0:8100", "controller-1") == f"{host}:0.0.0.0:8100/controller-1"
    assert lease_holder(None, "127.0.0.1:0", "controller-1") == "controller-1/controller-1"
