"""The controller's remote index against a real `kvplane indexer serve` process that a user's
faults reach: killed and started again after a long outage, stopped (SIGSTOP) while requests
wait on it, killed while the router's record of recent prompts is in a vLLM key space, and
behind a connection gone silent without a reset."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.fleet import Fleet
from controller.remote_index import SHEDDING_DEGRADES_AFTER_S, RemoteIndex
from kvplane.errors import KvplaneError
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.controller.test_processes import indexer_process
from tests.polling import eventually
from tests.redis_servers import RedisServer, free_port, restartable_port
from tests.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.timeout(90)

TOKENS = list(range(1000, 1070))  # 4 full blocks of 16, then 6 more tokens


async def test_an_indexer_back_after_a_long_outage_is_used_at_once(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """The indexer killed and started again: the controller asks it again within a second
    of its return, whatever the engines' reconnect backoff (`health.backoff_max_s`). Before,
    the remote index's channel backed off as the engines' do, failing every call at once
    meanwhile: after an outage long enough for the backoff to grow (30 s by default), the
    fleet went on routing by load, its Health DEGRADED, for up to that long after the
    indexer was back."""
    listen = f"127.0.0.1:{restartable_port()}"
    target = await indexer_process(tmp_path, [], processes, listen=listen)
    config = ControllerConfig.model_validate(
        {
            "index": {"remote": target},
            "health": {"backoff_initial_s": 60.0, "backoff_max_s": 60.0},
        }
    )
    fleet = Fleet(config, None)
    remote = fleet.remote
    assert remote is not None
    try:
        await remote.match(TOKENS, 16, "", "")
        processes[0].kill()
        processes[0].wait()
        with pytest.raises(KvplaneError, match=r"^remote index: UNAVAILABLE: "):
            await remote.match(TOKENS, 16, "", "")
        assert remote.unavailable is not None

        await indexer_process(tmp_path, [], processes, listen=listen)

        async def answered() -> bool:
            try:
                await remote.match(TOKENS, 16, "", "")
            except KvplaneError:
                return False
            return True

        await eventually(answered, timeout_s=15, what="the restarted indexer answers")
        assert remote.unavailable is None
    finally:
        await fleet.close()


async def test_requests_waiting_on_a_stopped_indexer_pause_it_once(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """The indexer stopped (SIGSTOP) while several requests wait on it: they all time out,
    and the pause that follows is the first one (`backoff_initial_s`), as for one request.
    Before, each timed-out call doubled the pause, so that a short stall under load (eight
    requests in flight) kept the controller from asking the indexer for the longest pause
    (30 s by default) after it answered again."""
    target = await indexer_process(tmp_path, [], processes)
    now = [0.0]
    remote = RemoteIndex(target, 0.5, backoff_s=(1.0, 64.0), clock=lambda: now[0])
    indexer = processes[0]
    try:
        await remote.match(TOKENS, 16, "", "")
        indexer.send_signal(signal.SIGSTOP)
        outcomes = await asyncio.gather(
            *(remote.match(TOKENS, 16, "", "") for _ in range(6)), return_exceptions=True
        )
        assert {str(o) for o in outcomes} == {
            "remote index: DEADLINE_EXCEEDED: Deadline Exceeded"
        }, outcomes
        with pytest.raises(KvplaneError, match=r"not answering; asked again within 1 s$"):
            await remote.match(TOKENS, 16, "", "")
        indexer.send_signal(signal.SIGCONT)
        now[0] = 1.0  # the first pause is over: the indexer is asked again, and answers
        await remote.match(TOKENS, 16, "", "")
        assert remote.unavailable is None
    finally:
        indexer.send_signal(signal.SIGCONT)
        await remote.close()


async def test_a_prompt_routed_in_a_vllm_key_space_still_meets_its_record_when_the_indexer_dies(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """`remote_key_space: sha256`: a prompt routed while the indexer answered is recorded
    under the keys it gave (vLLM's hashes); killed, the indexer cannot answer the repeat, and
    the router's record of the prompts it just routed still sends it where its prefix went
    (docs/controller.md: routed "by load and by the router's own record"). Before, the keys
    of a prompt the indexer could not answer were kvplane's canonical ones, which no record
    made while it answered holds: the repeat was routed by load alone."""
    engines = [await start_sim_engine(f"k{i}") for i in range(2)]
    target = await indexer_process(tmp_path, [f"127.0.0.1:{e.port}" for e in engines], processes)
    fleet = await make_fleet(
        engines=engines,
        index={"remote": target, "remote_key_space": "sha256"},
        router={"pending_ttl_s": 600.0},
    )
    try:
        prompt = list(range(3000, 3064))  # 4 blocks of 16
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prompt, 1]))
        first = await fleet.admin.Route(query)
        assert first.index_error == ""
        [r async for r in fleet.gateway.Generate(generate_request("routed", [*prompt, 2]))]
        sent = await fleet.admin.Route(query)
        assert (sent.reason, sent.predicted_cached_tokens) == ("cache", 64)

        processes[0].kill()
        processes[0].wait()
        blind = await fleet.admin.Route(query)
        assert blind.index_error.startswith("remote index: UNAVAILABLE: ")
        assert (blind.engine, blind.reason, blind.predicted_cached_tokens) == (
            sent.engine,
            "cache",
            64,
        )
    finally:
        await close_fleet(fleet)


async def test_an_indexer_whose_connection_went_silent_is_reached_on_a_new_one(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """The connection to the indexer goes silent without a reset (a host gone, a NAT entry
    expired: a forwarder that drops what it reads, both ways), while the indexer answers
    new connections. The call that times out starts the pause and has the next call made on
    a new connection: the indexer is used again once the pause is over. Before, every call
    went on the dead connection, each timing out, until the kernel gave up on it (some 15
    minutes without keepalive)."""
    target = await indexer_process(tmp_path, [], processes)
    forwarder = await TcpForwarder.start(target)
    now = [0.0]
    remote = RemoteIndex(forwarder.address, 0.5, backoff_s=(1.0, 64.0), clock=lambda: now[0])
    try:
        await remote.match(TOKENS, 16, "", "")
        forwarder.silence()
        with pytest.raises(KvplaneError, match=r"^remote index: DEADLINE_EXCEEDED: "):
            await remote.match(TOKENS, 16, "", "")
        now[0] = 1.0
        await remote.match(TOKENS, 16, "", "")
        assert remote.unavailable is None
        assert forwarder.tunnels == 2
    finally:
        await remote.close()
        await forwarder.cut()


async def test_an_error_answered_after_a_stall_ends_the_pause(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """After a stall, the indexer answers again, with an error (here NOT_FOUND: a resync of
    an engine it does not know; as well the UNAVAILABLE of its Redis down): it answers, so
    the pause ends and every request asks it. Before, only a reply ended the pause, and
    until one came every request but one at a time failed at once ("not answering") without
    asking the indexer that answered."""
    target = await indexer_process(tmp_path, [], processes)
    now = [0.0]
    remote = RemoteIndex(target, 0.5, backoff_s=(1.0, 64.0), clock=lambda: now[0])
    indexer = processes[0]
    try:
        indexer.send_signal(signal.SIGSTOP)
        with pytest.raises(KvplaneError, match=r"^remote index: DEADLINE_EXCEEDED: "):
            await remote.match(TOKENS, 16, "", "")
        indexer.send_signal(signal.SIGCONT)
        now[0] = 1.0
        await remote.resync_engine("10.0.0.9:8000")  # NOT_FOUND: done, nothing to drop
        outcomes = await asyncio.gather(
            *(remote.match(TOKENS, 16, "", "") for _ in range(2)), return_exceptions=True
        )
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    finally:
        indexer.send_signal(signal.SIGCONT)
        await remote.close()


async def test_a_shed_query_leaves_the_index_answering_until_shedding_persists(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], redis: RedisServer
) -> None:
    """The indexer sheds a query (RESOURCE_EXHAUSTED: more prefix queries in flight than it
    takes, here one held by its Redis stopped): it answers, protecting itself, and the next
    query may well be answered, so the index still counts as answering (Health READY); only
    once queries have been shed, none answered, for `SHEDDING_DEGRADES_AFTER_S` does it not
    (at the next query, or when Health reads it), and an answered query ends that. A single
    shed never counts, however long ago. Before, a single shed made the controller's Health
    DEGRADED until the next answered call; and after that, a controller asking less than
    once every 10 s never degraded (its sheds 10 s apart each began the shedding again), nor
    did one whose sheds had lasted 10 s by the time Health was read, no query since."""
    metrics = f"127.0.0.1:{free_port()}"
    settings = (
        f"max_concurrent_prefix_queries: 1\nmetrics_listen: {metrics}\nredis: {{timeout_s: 60.0}}\n"
    )
    target = await indexer_process(tmp_path, [], processes, backend=redis.url, settings=settings)
    now = [0.0]
    # Three controllers' clients: one asking often, one rarely, one shed once.
    often, rarely, once = (RemoteIndex(target, 5.0, clock=lambda: now[0]) for _ in range(3))
    holder = RemoteIndex(target, 60.0)
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    held = asyncio.ensure_future(holder.match(TOKENS, 16, "", ""))
    shed = "RESOURCE_EXHAUSTED: more than 1 concurrent prefix queries; retry later"

    async def shed_query(remote: RemoteIndex) -> None:
        with pytest.raises(KvplaneError, match=f"^remote index: {shed}$"):
            await remote.match(TOKENS, 16, "", "")

    def shed_for(seconds: int) -> str:
        return f"remote index at {target}: {shed} (every query shed for {seconds} s)"

    try:

        async def query_held() -> bool:
            text = await asyncio.to_thread(scrape_url, f"http://{metrics}/metrics")
            return "kvplane_indexer_prefix_queries_in_flight 1.0" in text

        await eventually(query_held, timeout_s=30, what="the holder's query in flight")
        for now[0] in (0.0, SHEDDING_DEGRADES_AFTER_S / 2):
            for remote in (often, rarely, once) if now[0] == 0 else (often,):
                await shed_query(remote)
                assert remote.unavailable is None
        # Shed 5 s ago and now, none answered: not yet 10 s of shedding.
        now[0] = SHEDDING_DEGRADES_AFTER_S - 1
        assert often.unavailable is None
        # Read by Health 10 s after the first shed, no query since: shedding that lasted.
        now[0] = SHEDDING_DEGRADES_AFTER_S
        assert often.unavailable == shed_for(10), often.unavailable
        # The one asking every 12 s: its second shed finds 12 s of nothing but sheds.
        now[0] = 12.0
        assert rarely.unavailable is None
        await shed_query(rarely)
        assert rarely.unavailable == shed_for(12), rarely.unavailable
        # One shed alone is no shedding that lasted, a minute later as at once.
        now[0] = 60.0
        assert once.unavailable is None
        assert often.unavailable == shed_for(60), often.unavailable

        redis.proc.send_signal(signal.SIGCONT)
        await held
        for remote in (often, rarely):
            await remote.match(TOKENS, 16, "", "")
            assert remote.unavailable is None
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        held.cancel()
        for remote in (often, rarely, once, holder):
            await remote.close()


def scrape_url(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


async def test_a_call_that_outlives_its_pause_on_a_silent_connection_starts_no_other(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Two requests wait on a connection gone silent; the first to time out starts the pause,
    and once it is over the indexer answers on a new connection. The second then times out
    on the old one: it waited on the same silence, and the indexer is used on as it answers.
    Before, it started a new pause (and dialled yet another connection): under load, the
    requests made in the timeout before the pause ended kept the indexer paused, routing by
    load, for up to another timeout after it answered again."""
    target = await indexer_process(tmp_path, [], processes)
    forwarder = await TcpForwarder.start(target)
    now = [0.0]
    # Calls time out after 6 s: long for an answer on a loaded machine, and for the second
    # call to be made well before the first times out.
    remote = RemoteIndex(forwarder.address, 6.0, backoff_s=(1.0, 64.0), clock=lambda: now[0])
    try:
        await remote.match(TOKENS, 16, "", "")
        forwarder.silence()
        first = asyncio.ensure_future(remote.match(TOKENS, 16, "", ""))
        await asyncio.sleep(1.5)  # the second made well before the first times out
        second = asyncio.ensure_future(remote.match(TOKENS, 16, "", ""))
        with pytest.raises(KvplaneError, match=r"^remote index: DEADLINE_EXCEEDED: "):
            await first
        now[0] = 1.0  # the pause is over: asked again on a new connection, it answers
        await remote.match(TOKENS, 16, "", "")
        assert forwarder.tunnels == 2
        with pytest.raises(KvplaneError, match=r"^remote index: DEADLINE_EXCEEDED: "):
            await second
        await remote.match(TOKENS, 16, "", "")
        assert forwarder.tunnels == 2
    finally:
        await remote.close()
        await forwarder.cut()
