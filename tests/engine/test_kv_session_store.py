"""A PREFILL engine's KV session store (engine/server/kv_transfer.py): the states a session goes
through, one pull at a time, release on every path, TTL on a clock of the test's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from engine.server.errors import KvSessionNotFoundError
from engine.server.kv_transfer import PULLED_GRACE_S, KvNamespace, KvSessionStore


class FakeCore:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release_kv_session(self, session_id: str) -> bool:
        self.released.append(session_id)
        return True


class FakeLoop:
    """EngineLoop.call, run at once."""

    def __init__(self) -> None:
        self.core = FakeCore()

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(self.core))
        return future


class Clock:
    now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def store(clock: Clock | None = None) -> tuple[KvSessionStore, FakeLoop]:
    loop = FakeLoop()
    sessions = KvSessionStore(
        loop,  # type: ignore[arg-type]
        ttl_s=10.0,
        block_size=4,
        kv_layout="sim:B4",
        clock=clock or Clock(),
    )
    return sessions, loop


async def test_a_session_is_pullable_once_handed_over_until_its_puller_releases_it() -> None:
    clock = Clock()
    sessions, loop = await store(clock)
    session_id = sessions.open(KvNamespace())
    assert sessions.num_open == 0  # prefilling: a request in flight, not a session yet
    with pytest.raises(KvSessionNotFoundError):
        await sessions.claim(session_id)
    sessions.ready(session_id)
    assert sessions.num_open == 1
    await sessions.claim(session_id)
    sessions.end_pull(session_id, complete=True)
    # Kept for a retry (the puller may fail before its request is accepted) ...
    assert loop.core.released == [] and sessions.num_open == 1
    await sessions.claim(session_id)
    sessions.end_pull(session_id, complete=True)
    sessions.abort(session_id)  # ... until its puller releases it (ReleaseKvSession)
    assert loop.core.released == [session_id] and sessions.num_open == 0
    with pytest.raises(KvSessionNotFoundError):
        await sessions.claim(session_id)
    await sessions.close()


async def test_a_session_pulled_in_full_waits_for_its_release_a_short_grace_only() -> None:
    clock = Clock()
    sessions, loop = await store(clock)  # TTL 10 s
    short, whole = sessions.open(KvNamespace()), sessions.open(KvNamespace())
    sessions.ready(short)
    clock.now_s = 9.0
    sessions.ready(whole)
    for session_id in (short, whole):
        await sessions.claim(session_id)
        sessions.end_pull(session_id, complete=True)
    clock.now_s = 10.0  # `short`'s TTL is shorter than the grace: it ends there
    sessions.expire()
    assert loop.core.released == [short]
    clock.now_s = 9.0 + PULLED_GRACE_S - 0.1  # `whole`'s TTL (19 s) is past the grace (19 s)
    sessions.expire()
    assert loop.core.released == [short]
    clock.now_s = 9.0 + PULLED_GRACE_S
    sessions.expire()
    assert loop.core.released == [short, whole]
    await sessions.close()


async def test_a_second_pull_waits_for_the_first_and_gets_it_if_that_one_was_cut_short() -> None:
    sessions, loop = await store()
    session_id = sessions.open(KvNamespace())
    sessions.ready(session_id)
    await sessions.claim(session_id)
    second = asyncio.create_task(sessions.claim(session_id))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not second.done()
    sessions.end_pull(session_id, complete=False)  # the first puller went away
    await asyncio.wait_for(second, timeout=5)
    sessions.end_pull(session_id, complete=True)
    sessions.abort(session_id)  # the second puller's request was accepted: released
    with pytest.raises(KvSessionNotFoundError):
        await sessions.claim(session_id)
    assert loop.core.released == [session_id]
    await sessions.close()


async def test_abort_releases_at_once_even_during_a_pull() -> None:
    """A pull in progress does not delay the release: its puller may never end it."""
    sessions, loop = await store()
    idle, pulled = sessions.open(KvNamespace()), sessions.open(KvNamespace())
    sessions.ready(idle)
    sessions.ready(pulled)
    assert sessions.abort(idle)
    assert loop.core.released == [idle]
    await sessions.claim(pulled)
    waiting = asyncio.create_task(sessions.claim(pulled))  # a second pull waits for the first
    await asyncio.sleep(0)
    assert sessions.abort(pulled)
    assert loop.core.released == [idle, pulled] and sessions.num_open == 0
    with pytest.raises(KvSessionNotFoundError):  # woken: the session is gone
        await asyncio.wait_for(waiting, timeout=5)
    assert not sessions.abort(pulled)  # a second abort changes nothing
    sessions.end_pull(pulled, complete=False)  # the pull that was cut ends: nothing left
    assert loop.core.released == [idle, pulled] and sessions.num_open == 0
    # Ended sessions are remembered (Abort answers ALREADY_FINISHED); unknown ones are not.
    assert not sessions.abort(idle) and not sessions.abort(pulled)
    with pytest.raises(KvSessionNotFoundError):
        sessions.abort("unknown")
    await sessions.close()


async def test_a_prefill_that_ends_without_handing_over_releases_what_the_core_holds() -> None:
    sessions, loop = await store()
    session_id = sessions.open(KvNamespace())
    sessions.discard(session_id)
    assert loop.core.released == [session_id]
    kept = sessions.open(KvNamespace())
    sessions.ready(kept)
    sessions.discard(kept)  # handed over: not the prefill's to drop any more
    assert loop.core.released == [session_id] and sessions.num_open == 1
    await sessions.close()


async def test_ttl_and_drain_release_only_sessions_handed_over() -> None:
    clock = Clock()
    sessions, loop = await store(clock)
    prefilling, ready, pulling = (
        sessions.open(KvNamespace()),
        sessions.open(KvNamespace()),
        sessions.open(KvNamespace()),
    )
    sessions.ready(ready)
    sessions.ready(pulling)
    await sessions.claim(pulling)
    clock.now_s = 9.9
    sessions.expire()
    assert loop.core.released == []
    clock.now_s = 10.0
    sessions.expire()
    assert loop.core.released == [ready]  # a pull in progress is not cut by the TTL ...
    sessions.end_pull(pulling, complete=False)
    assert loop.core.released == [ready, pulling]  # ... but not put back past it either
    other, pulled = sessions.open(KvNamespace()), sessions.open(KvNamespace())
    sessions.ready(other)
    sessions.ready(pulled)
    await sessions.claim(pulled)
    sessions.release_all()  # a pull in progress included
    assert loop.core.released == [ready, pulling, other, pulled]
    assert sessions.num_open == 0
    sessions.discard(prefilling)
    await sessions.close()
