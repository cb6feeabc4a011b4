"""LoraService's hand-off from the engine thread to the event loop: a fresh load's sessions
released on the engine thread's answer (the gRPC behaviour is in test_server_kv_transfer.py),
and nothing logged when that answer comes after the event loop closed (shutdown)."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Future
from typing import cast

import pytest

from engine.core.lora import LoraLoad
from engine.server.kv_transfer import KvSessionStore
from engine.server.lora_service import _release_sessions


class _Sessions:
    """What `_release_sessions` asks of the store: the names it was told of."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release_lora(self, lora_name: str) -> None:
        self.released.append(lora_name)


def _answered(loop: asyncio.AbstractEventLoop, sessions: _Sessions) -> None:
    """The engine thread answers a fresh load of "a", `_release_sessions` its callback."""
    loading: Future[LoraLoad] = Future()
    store = cast(KvSessionStore, sessions)
    loading.add_done_callback(functools.partial(_release_sessions, loop, store, "a"))
    loading.set_result(LoraLoad.LOADED)


def test_a_load_answered_after_shutdown_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """At shutdown the event loop may close before the engine thread answers a load: there is
    nothing left to release then, and no traceback is logged (it used to log "exception
    calling callback", RuntimeError: Event loop is closed)."""
    loop = asyncio.new_event_loop()
    loop.close()
    sessions = _Sessions()
    with caplog.at_level(logging.DEBUG):
        _answered(loop, sessions)
    assert sessions.released == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_load_answered_while_the_loop_runs_releases_the_sessions() -> None:
    loop = asyncio.new_event_loop()
    try:
        sessions = _Sessions()
        _answered(loop, sessions)
        loop.run_until_complete(asyncio.sleep(0))
        assert sessions.released == ["a"]
    finally:
        loop.close()
