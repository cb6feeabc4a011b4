"""redis-py can turn a cancellation that lands inside a command into a ConnectionError, which a
background loop catches and retries: such a loop outlived its cancellation, and whoever
awaited it (a controller's `close()`) waited forever (seen under load: the whole suite's run
hung a minute in a controller's close). Every loop that calls Redis stops at its next turn
instead; here the call turns the cancellation into an error as redis-py did."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from controller.config import ControllerConfig
from controller.fleet import Fleet
from controller.membership import Membership
from indexer.redis_client import IndexUnavailableError
from indexer.writer_lease import WriterLease
from tests.controller.conftest import start_sim_engine

# A loop that outlives its cancellation also holds up the test's own teardown: fail instead.
pytestmark = pytest.mark.timeout(30)


class _CancelledIntoAnError:
    """A Redis call that waits until cancelled, then fails as redis-py's did."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.entered = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise self.error from None


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=10)
    assert done, "the loop outlived its cancellation"


async def test_a_writer_lease_cancelled_inside_a_renewal_stops() -> None:
    call = _CancelledIntoAnError(IndexUnavailableError("Connection closed by server."))

    class Index:
        hold_lease = call

    async def nothing(_resync: bool) -> None:
        return None

    lease = WriterLease(
        Index(),  # type: ignore[arg-type]
        "127.0.0.1:9001",
        "replica/process",
        0.03,
        wanted=lambda: True,
        on_taken=nothing,
        on_lost=lambda: None,
    )
    task = asyncio.create_task(lease.run())
    await asyncio.wait_for(call.entered.wait(), 10)
    await _cancel_and_wait(task)


async def test_the_shared_membership_cancelled_inside_a_read_stops() -> None:
    call = _CancelledIntoAnError(RedisConnectionError("Connection closed by server."))
    config = ControllerConfig.model_validate({"health": {"poll_interval_s": 0.01}})
    membership = Membership(Fleet(config, None), config)
    membership.refresh = call  # type: ignore[method-assign]
    task = asyncio.create_task(membership._follow())
    await asyncio.wait_for(call.entered.wait(), 10)
    await _cancel_and_wait(task)


async def test_an_engine_removed_while_its_poll_reads_the_shared_drains_is_removed() -> None:
    """An engine leaving ready has its poll read the drains made through the other
    replicas (`Membership._drained`); removed meanwhile, the poll's cancellation landed in
    that read, which took redis-py's error for Redis not answering: the poll went on, and
    the removal, waiting for it, never ended (a registration of the address waits for the
    removal, under the shared membership's lock: every membership change hung with it)."""
    engine = await start_sim_engine("e0")
    address = f"127.0.0.1:{engine.port}"
    config = ControllerConfig.model_validate(
        {"health": {"poll_interval_s": 0.05, "load_poll_interval_s": 0.05}}
    )
    fleet = Fleet(config, None)
    membership = Membership(fleet, config)
    hget = _CancelledIntoAnError(RedisConnectionError("Connection closed by server."))

    class Client:
        pass

    client = Client()
    client.hget = hget  # type: ignore[attr-defined]
    membership._client = client  # type: ignore[assignment]
    fleet.shared_drains = membership._drained
    try:
        await fleet.add_engine(address, kv_events="none")
        await fleet.wait_for(lambda: fleet.registry.get(address).routable, 15)
        await engine.close()  # it leaves ready: its poll reads the shared drains
        await hget.entered.wait()
        await fleet.remove_engine(address)  # (the module's timeout, on the old code)
        assert fleet.removal(address) is None
    finally:
        await fleet.close()
