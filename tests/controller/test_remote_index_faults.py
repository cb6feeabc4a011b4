"""The controller's remote index against a real `kvplane indexer serve` process that a user's
faults reach: killed and started again after a long outage, stopped (SIGSTOP) while requests
wait on it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.fleet import Fleet
from controller.remote_index import RemoteIndex
from kvplane.errors import KvplaneError
from tests.controller.test_processes import indexer_process
from tests.polling import eventually
from tests.redis_servers import restartable_port

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
