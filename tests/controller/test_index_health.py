"""The controller's Health while its index cannot answer: a shared redis-server killed under
it (or out of memory), a remote `kvplane indexer serve` process killed under it, each started
again. The fleet still serves (routed by load), so Health is DEGRADED, not NOT_READY, with a
`kv_index` check naming the index and its error; `kvplane admin health` shows it, and
`kvplane_controller_index_reachable` is 0 meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import controller.remote_index
import controller.service
from controller.config import ControllerConfig
from controller.remote_index import RemoteIndex
from indexer.backend import IndexStats
from indexer.memory_backend import MemoryBackend
from kvplane.cli import app
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_fleet_events import scrape
from tests.controller.test_processes import indexer_process
from tests.controller.test_remote_index_faults import scrape_url
from tests.indexer.fake_kv_publisher import FakeKvPublisher
from tests.indexer.vllm_capture import live_messages
from tests.polling import eventually
from tests.redis_servers import RedisServer, free_port

pytestmark = pytest.mark.timeout(120)


async def index_check(fleet: Fleet) -> tuple[int, pb.HealthCheck | None]:
    """The gateway's Health state and its `kv_index` check (None: it has none)."""
    reply = await fleet.gateway.Health(pb.HealthRequest())
    checks = [c for c in reply.checks if c.name == "kv_index"]
    assert len(checks) <= 1, reply
    return reply.state, checks[0] if checks else None


async def admin_health(fleet: Fleet) -> tuple[str, list[str]]:
    """`kvplane admin health` against the controller: its state line and its `kv_index`
    row, split into columns."""
    result = await asyncio.to_thread(
        CliRunner().invoke, app, ["admin", "health", "--target", fleet.target]
    )
    assert result.exit_code == 0, result.output
    # Its stdout alone: the controller runs in this process, and a line it logs meanwhile
    # (the runner's swapped stderr) is not the command's.
    lines = result.stdout.splitlines()
    (row,) = [line for line in lines if line.startswith("kv_index ")]
    return lines[0], row.split(maxsplit=2)


async def index_shown_as(
    fleet: Fleet, state: pb.HealthState.ValueType, message: str, *, answers: bool | None = None
) -> str:
    """Waits until the gateway's Health is `state` (the index's client finds an outage, or its
    end, at its next call: a request's match, the Redis backend's upkeep, the index-stats
    refresh); then the `kv_index` check, over gRPC and in `kvplane admin health`, has that
    state and a one-line message starting with `message` (exactly it when READY: the index's
    address), and the reachability gauge says whether the index `answers` (default: while
    READY). The check's message."""

    async def reached() -> bool:
        return (await index_check(fleet))[0] == state

    await eventually(reached, 30, f"Health {pb.HealthState.Name(state)}")
    _, check = await index_check(fleet)
    name = pb.HealthState.Name(state)
    state_line, (check_name, check_state, shown) = await admin_health(fleet)
    assert (state_line, check_name, check_state) == (f"state {name}", "kv_index", name)
    assert check is not None and check.state == state, check
    for text in (check.message, shown):
        assert text.startswith(message) and "\n" not in text, text
        assert state != pb.HEALTH_STATE_READY or text == message, text
    gauge = "kvplane_controller_index_reachable"
    reachable = fleet.app.controller.metrics.registry.get_sample_value(gauge)
    assert reachable == (state == pb.HEALTH_STATE_READY if answers is None else answers)
    return check.message


async def index_size_shown(fleet: Fleet) -> dict[str, float]:
    """The index-size gauges on the controller's /metrics, by name (absent: not there)."""
    text = await scrape(fleet)
    names = ("kvplane_controller_index_blocks", "kvplane_controller_index_placements")
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in names
    }


async def test_health_is_degraded_while_the_shared_redis_is_down(
    redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Meanwhile the index's size is not on /metrics, rather than its last value frozen."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    fleet = await make_fleet(2, index={"backend": redis.url}, metrics_listen="127.0.0.1:0")
    where = f"Redis at 127.0.0.1:{redis.port}"
    try:
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)

        async def size_shown() -> bool:
            return len(await index_size_shown(fleet)) == 2

        await eventually(size_shown, 30, "the index's size on /metrics")

        await asyncio.to_thread(redis.kill)
        await index_shown_as(
            fleet, pb.HEALTH_STATE_DEGRADED, f"shared index unavailable: {where} did not answer ("
        )
        assert await index_size_shown(fleet) == {}
        # The engines are fine: only the index's check says what is wrong.
        checks = (await fleet.gateway.Health(pb.HealthRequest())).checks
        engines = [c.state for c in checks if c.name.startswith("engine:")]
        assert engines == [pb.HEALTH_STATE_READY] * 2

        await asyncio.to_thread(redis.start)
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
        await eventually(size_shown, 30, "the index's size on /metrics again")
    finally:
        await close_fleet(fleet)


async def test_health_is_degraded_while_the_shared_redis_is_out_of_memory(
    redis: RedisServer,
) -> None:
    """Redis at its maxmemory (noeviction) answers, but refuses every write: the index could
    not take a removal, so it is as unavailable as a Redis that is down, and says why. The
    backend's upkeep (a write, refused) finds it with no request; raising the cap ends it."""
    fleet = await make_fleet(2, index={"backend": redis.url})
    where = f"Redis at 127.0.0.1:{redis.port}"
    try:
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)

        await asyncio.to_thread(redis.command, "CONFIG", "SET", "maxmemory", 1)
        await index_shown_as(
            fleet,
            pb.HEALTH_STATE_DEGRADED,
            f"shared index unavailable: {where} is out of memory and refuses writes (",
        )

        await asyncio.to_thread(redis.command, "CONFIG", "SET", "maxmemory", 0)
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
    finally:
        await close_fleet(fleet)


async def test_health_is_degraded_while_the_remote_indexer_is_down(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No request meanwhile: the controller's index-stats refresh is what finds the indexer
    gone and back (here every 0.1 s rather than 5 s)."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    engines = [await start_sim_engine(f"r{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    listen = f"127.0.0.1:{free_port()}"
    remote = await indexer_process(tmp_path, addresses, processes, listen)
    fleet = await make_fleet(engines=engines, index={"remote": remote})
    where = f"remote index at {remote}"
    try:
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)

        processes[-1].send_signal(signal.SIGKILL)
        await asyncio.to_thread(processes[-1].wait, 10)
        await index_shown_as(fleet, pb.HEALTH_STATE_DEGRADED, f"{where}: UNAVAILABLE: ")

        assert await indexer_process(tmp_path, addresses, processes, listen) == remote
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
    finally:
        await close_fleet(fleet)


async def test_health_is_ready_again_without_traffic_once_the_indexer_answers_queries(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The remote indexer sheds the controller's queries (RESOURCE_EXHAUSTED: one prefix
    query in flight at most, here one held by its Redis stopped) until its Health is DEGRADED
    (shedding that lasts: from the second shed here, rather than 10 s); its Redis resumed, and
    no request since, the index-stats refresh asks one query of its own, answered: READY.
    Before, nothing but a request's query ended the shedding: a controller with no traffic
    stayed DEGRADED ("every query shed for N s") however long the indexer had answered."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    monkeypatch.setattr(controller.remote_index, "SHEDDING_DEGRADES_AFTER_S", 0.0)
    metrics = f"127.0.0.1:{free_port()}"
    settings = (
        f"max_concurrent_prefix_queries: 1\nmetrics_listen: {metrics}\nredis: {{timeout_s: 60.0}}\n"
    )
    target = await indexer_process(tmp_path, [], processes, backend=redis.url, settings=settings)
    # The refresh's stats wait on the stopped Redis rather than time out meanwhile.
    fleet = await make_fleet(2, index={"remote": target}, health={"rpc_timeout_s": 60.0})
    holder = RemoteIndex(target, 60.0)
    where = f"remote index at {target}"
    assert redis.proc is not None

    async def query_held() -> bool:
        text = await asyncio.to_thread(scrape_url, f"http://{metrics}/metrics")
        return "kvplane_indexer_prefix_queries_in_flight 1.0" in text

    try:
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
        redis.proc.send_signal(signal.SIGSTOP)
        held = asyncio.ensure_future(holder.match(list(range(32)), 16, "", ""))
        try:
            await eventually(query_held, 30, "the holder's query in flight")
            for i in range(2):  # each routed by load, its query shed
                call = fleet.gateway.Generate(generate_request(f"r{i}", [i] * 40))
                replies = [r async for r in call]
                assert replies[-1].WhichOneof("event") == "finished", replies[-1]
            message = await index_shown_as(
                fleet, pb.HEALTH_STATE_DEGRADED, f"{where}: RESOURCE_EXHAUSTED: more than 1 "
            )
            assert "(every query shed for " in message, message

            redis.proc.send_signal(signal.SIGCONT)
            await held
            await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
            held.cancel()
    finally:
        await holder.close()
        await close_fleet(fleet)


@pytest.mark.parametrize(
    "keyings",
    [
        # The source indexes canonical keys; the controller asks in vLLM's sha256.
        (
            "hash: canonical",
            {"remote_key_space": "sha256"},
            "canonical",
            "sha256 with vLLM's default hash seed",
        ),
        # Both in vLLM's sha256, the engines' PYTHONHASHSEED (declared at the indexer) not
        # given to the controller.
        (
            "hash: engine, vllm_hash: sha256, hash_seed: '7'",
            {"remote_key_space": "sha256"},
            "sha256 with hash seed '7'",
            "sha256 with vLLM's default hash seed",
        ),
    ],
)
async def test_health_is_degraded_while_the_remote_indexer_keys_workers_otherwise(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    keyings: tuple[str, dict[str, str], str, str],
) -> None:
    """The indexer keys its workers otherwise than the controller hashes prompts: it answers,
    but every match finds 0 blocks. Its stats say how it keys each worker, so the controller
    logs one ERROR naming both, Health is DEGRADED (the fleet serves, routed by load) with
    that message, and `kvplane_controller_index_key_space_mismatch` is 1; the indexer started
    again with the controller's key space ends it. Before, all was READY, and nothing said
    why no prompt ever hit the cache. `keyings`: the indexer's sources' keying, the
    controller's index settings, and how the message names each."""
    keyed, index, theirs, ours = keyings
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    engines = [await start_sim_engine(f"r{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    listen = f"127.0.0.1:{free_port()}"
    remote = await indexer_process(tmp_path, addresses, processes, listen, keyed=keyed)
    fleet = await make_fleet(engines=engines, index={"remote": remote, **index})
    where = f"remote index at {remote}"
    mismatch = fleet.app.controller.metrics.registry.get_sample_value
    gauge = "kvplane_controller_index_key_space_mismatch"
    try:
        message = await index_shown_as(
            fleet, pb.HEALTH_STATE_DEGRADED, f"{where}: worker ", answers=True
        )
        assert f" is keyed {theirs} there, but the controller asks in {ours} " in message
        assert "(and 1 more worker(s))" in message
        assert mismatch(gauge) == 1
        await fleet.app.controller.index_stats()  # asked again: the same, not logged again
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert errors == [message], errors

        processes[-1].send_signal(signal.SIGKILL)
        await asyncio.to_thread(processes[-1].wait, 10)
        keyed_as_asked = "hash: canonical" if not index else "hash: engine, vllm_hash: sha256"
        await indexer_process(tmp_path, addresses, processes, listen, keyed=keyed_as_asked)
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
        assert mismatch(gauge) == 0
    finally:
        await close_fleet(fleet)


@contextlib.asynccontextmanager
async def vllm_capture_fleet(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    index: dict[str, str],
    block_size: int = 32,
) -> AsyncIterator[tuple[Fleet, FakeKvPublisher, str]]:
    """A fleet of one engine whose KV events a `kvplane indexer serve` (`index.remote`, with
    `index`'s other settings) reads from the publisher of the real vLLM 0.32.0 capture (vLLM's
    default hash seed, blocks of 32 tokens) on real ZMQ sockets, through a `hash: engine`
    source that declares no `vllm_hash` (nor seed), the engine reporting `block_size` (the
    capture's, unless a test makes the controller hash in another): the fleet, the publisher
    (subscribed to; nothing published yet) and the indexer's address."""
    engine = await start_sim_engine("vllm", block_size=block_size)
    address = f"127.0.0.1:{engine.port}"
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    sources = (
        f"  - {{kind: zmq, worker_id: vllm-0, worker_address: '{address}', "
        f"endpoint: '{publisher.endpoint}', replay_endpoint: '{publisher.replay_endpoint}', "
        "topic: 'kv@', array_tail: vllm, hash: engine}\n"
    )
    remote = await indexer_process(tmp_path, [], processes, sources=sources)
    fleet = await make_fleet(engines=[engine], index={"remote": remote, **index})
    try:
        await publisher.wait_subscribed()
        yield fleet, publisher, remote
    finally:
        await close_fleet(fleet)
        await publisher.close()
        context.term()


@pytest.mark.parametrize(
    ("index", "ours"),
    [
        ({"remote_key_space": "sha256", "remote_hash_seed": "7"}, "sha256 with hash seed '7'"),
        ({}, "canonical"),
        ({"remote_key_space": "sha256"}, None),  # as the engine hashes: no mismatch
    ],
)
async def test_a_worker_keyed_otherwise_than_declared_is_told_by_its_engines_blocks(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    index: dict[str, str],
    ours: str | None,
) -> None:
    """The real vLLM 0.32.0 capture (vLLM's default hash seed), published on real ZMQ sockets
    to a `kvplane indexer serve` whose `hash: engine` source declares no `vllm_hash` (nor
    seed). The indexer reports the latest block the engine stored at the start of a plain
    prompt (`root_block`: its tokens, its key), and the controller hashes those tokens as it
    hashes prompts: asking with another seed (or in canonical keys), it finds another key,
    and says so (Health DEGRADED naming both keys); asking as the engine hashes, it stays
    READY. Before, a source that declared nothing was never checked: READY, every match 0."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    async with vllm_capture_fleet(tmp_path, processes, index) as (fleet, publisher, remote):
        first = live_messages()[0]  # a plain prompt's blocks, the first one its root
        await publisher.publish(first.frames)

        async def indexed() -> bool:
            stats = await fleet.app.controller.index_stats()
            return stats is not None and stats.num_blocks > 0

        await eventually(indexed, 30, "the engine's blocks indexed")
        await fleet.app.controller.index_stats()  # the keyings read with them
        where = f"remote index at {remote}"
        if ours is None:
            await index_shown_as(fleet, pb.HEALTH_STATE_READY, where)
            return
        message = await index_shown_as(
            fleet,
            pb.HEALTH_STATE_DEGRADED,
            f"{where}: worker vllm-0 is keyed otherwise (",
            answers=True,
        )
        assert "its engine stored a prompt's first block under key " in message, message
        assert f"but the controller asks in {ours} " in message, message


async def test_a_worker_whose_engine_stores_blocks_of_another_size_is_told(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller asks in the engine's key space and seed, but hashes prompts in blocks
    of 16 tokens (the block size the engine reports) while the engine stores blocks of 32
    (the real vLLM capture's): no prompt can match, and the root block's size says so
    (Health DEGRADED, naming both sizes). Before, the root block's key was found as asked and
    Health stayed READY, while admin `match` found 0 blocks on the engine for a prompt it
    had just stored."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    index = {"remote_key_space": "sha256"}
    async with vllm_capture_fleet(tmp_path, processes, index, 16) as (fleet, publisher, remote):
        stored = live_messages()[0]  # a plain prompt's 5 blocks of 32 tokens
        await publisher.publish(stored.frames)
        message = await index_shown_as(
            fleet,
            pb.HEALTH_STATE_DEGRADED,
            f"remote index at {remote}: worker vllm-0 is keyed in blocks of 32 tokens (the "
            "size of the first block of a prompt its engine stored) there, but the controller "
            "hashes prompts for its engine in blocks of 16 (the block size its GetModelInfo "
            "reports, else default_block_size): no prompt can match it",
            answers=True,
        )
        assert message.endswith("no prompt can match it"), message


async def test_a_seed_mismatch_shown_by_every_new_prompt_is_logged_once(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A controller asking with another hash seed than its vLLM engine's, while the engine
    serves new prompts (the real vLLM capture on real ZMQ sockets to a `kvplane indexer
    serve`): each index-stats refresh may find another latest root block, whose keys the
    `kv_index` check names, but the mismatch is one, and so is its ERROR line. Before, every
    refresh that found a new root block logged the mismatch again: an ERROR every
    `INDEX_STATS_INTERVAL_S` for as long as the engine took new prompts."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    caplog.set_level(logging.ERROR, "controller.remote_index")
    index = {"remote_key_space": "sha256", "remote_hash_seed": "7"}
    async with vllm_capture_fleet(tmp_path, processes, index) as (fleet, publisher, _):
        remote_index = fleet.app.controller.fleet.remote
        assert remote_index is not None
        live = live_messages()

        async def shown(shown_before: str | None) -> str:
            async def found() -> bool:
                await fleet.app.controller.index_stats()
                mismatch = remote_index.keying_mismatch
                return mismatch is not None and mismatch != shown_before

            await eventually(found, 30, "a root block found keyed otherwise")
            assert remote_index.keying_mismatch is not None
            return remote_index.keying_mismatch

        await publisher.publish(live[0].frames)  # a plain prompt's blocks
        first = await shown(None)
        for message in live[1:19]:  # more prompts: the latest root block is another
            await publisher.publish(message.frames)
        latest = await shown(first)
        assert "its engine stored a prompt's first block under key " in latest, latest
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == [first], errors


async def test_kvplane_engines_followed_by_their_own_hashes_are_no_key_space_mismatch(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hash: engine` sources (the default) following kvplane engines index the engines' own
    hashes, which are canonical keys: the controller asking in canonical keys matches their
    blocks, and Health stays READY. Before, the controller took every `hash: engine` worker
    without `vllm_hash` for one no canonical prompt can match: an ERROR, and Health
    DEGRADED, for an index that matched every prompt."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    engines = [await start_sim_engine(f"r{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    remote = await indexer_process(tmp_path, addresses, processes, keyed="hash: engine")
    fleet = await make_fleet(engines=engines, index={"remote": remote})
    try:
        prefix = list(range(700, 764))
        [r async for r in fleet.gateway.Generate(generate_request("a", [*prefix, 1]))]
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prefix, 2]))

        async def matched() -> bool:
            match = await fleet.admin.Match(query)
            return any(m.device_blocks >= 4 for m in match.matches)

        await eventually(matched, 20, "the served prompt matched in canonical keys")
        await fleet.app.controller.index_stats()  # the indexer's keyings read again
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, f"remote index at {remote}")
        gauge = "kvplane_controller_index_key_space_mismatch"
        assert fleet.app.controller.metrics.registry.get_sample_value(gauge) == 0
    finally:
        await close_fleet(fleet)


async def test_an_indexer_following_engines_the_controller_does_not_route_is_no_mismatch(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One indexer follows this controller's engines (canonical keys, as it asks) and another
    fleet's engine (vLLM's sha256, as that fleet's controller asks): the controller checks
    the keyings of the workers of its own engines only, and Health stays READY. Before, the
    other fleet's worker was flagged (an ERROR, Health DEGRADED: "no prompt can match it")
    although this controller never routes to it."""
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.1)
    engines = [await start_sim_engine(f"r{i}") for i in range(2)]
    other = await start_sim_engine("other")
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    sources = (
        f"  - {{kind: openengine, target: '127.0.0.1:{other.port}', hash: engine, "
        "vllm_hash: sha256}\n"
    )
    remote = await indexer_process(tmp_path, addresses, processes, sources=sources)
    fleet = await make_fleet(engines=engines, index={"remote": remote})
    try:
        stats = await fleet.app.controller.index_stats()  # the indexer's keyings read
        assert stats is not None
        await index_shown_as(fleet, pb.HEALTH_STATE_READY, f"remote index at {remote}")
        gauge = "kvplane_controller_index_key_space_mismatch"
        assert fleet.app.controller.metrics.registry.get_sample_value(gauge) == 0
    finally:
        await close_fleet(fleet)
        await other.close()


async def test_the_embedded_index_has_no_check() -> None:
    """`index: {backend: memory}` lives in the controller's process: it cannot be unreachable,
    and the reachability gauge is always 1."""
    fleet = await make_fleet(2)
    try:
        assert await index_check(fleet) == (pb.HEALTH_STATE_READY, None)
        gauge = "kvplane_controller_index_reachable"
        assert fleet.app.controller.metrics.registry.get_sample_value(gauge) == 1
    finally:
        await close_fleet(fleet)


async def test_a_long_read_of_the_index_size_is_followed_by_a_longer_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a large shared index's size walks all of it on the controller's event loop
    (seconds at a million blocks): the next read waits ten times as long as that one took,
    so that routing keeps most of the loop, where a fixed 5 s period would keep it busy."""
    now = [0.0]

    class SlowStats(MemoryBackend):
        async def stats(self) -> IndexStats:
            now[0] += 3.0  # the read took 3 s
            return await super().stats()

    waits: list[float] = []

    async def first_wait(delay: float) -> None:
        waits.append(delay)
        raise asyncio.CancelledError  # one round is enough

    service = controller.service.Controller(ControllerConfig(), SlowStats(), clock=lambda: now[0])
    monkeypatch.setattr(asyncio, "sleep", first_wait)
    with pytest.raises(asyncio.CancelledError):
        await service._refresh_index_stats()
    monkeypatch.undo()
    assert waits == [30.0]
