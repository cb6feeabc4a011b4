"""The LoRA lifecycle of one engine, for the OpenEngine servicer (asyncio side).

LoadLora: the request's triple is checked (`LoraAdapter.validate`), then against what is loaded
(the seed: the same triple again is idempotent, a conflicting name, id or path ALREADY_EXISTS);
the runner reads and checks the adapter in a worker thread (file I/O and tensor copies stay off
both the event loop and the engine thread); the engine thread then installs it between steps
(`EngineCore.load_lora`, which checks everything again: the registry belongs to that thread).
LoRA calls run one at a time (a lock), so two loads never read the same adapter twice or race
on a name. UnloadLora and ListLoras go to the registry (an unload through the engine thread);
UnloadLora with an empty name is malformed (INVALID_ARGUMENT, as LoadLora's).
A fresh load of a name drops the KV sessions a PREFILL engine held with that name's earlier
load (the core released them): Drain must not wait for them until their TTL; this follows the
engine thread's answer, so a LoadLora whose client leaves as the load completes drops them too.
Loading the very adapter unloaded while its requests still run resumes it (`LoraLoad.RESUMED`):
its sessions are kept.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Future
from pathlib import Path

from engine.core.engine_core import EngineLoop
from engine.core.errors import InvalidLoraError
from engine.core.lora import LoraAdapter, LoraLoad, LoraRegistry, LoraRunner
from engine.server.kv_transfer import KvSessionStore


class LoraService:
    def __init__(
        self,
        engine_loop: EngineLoop,
        *,
        max_lora_rank: int,
        kv_sessions: KvSessionStore | None = None,
    ) -> None:
        """`kv_sessions`: a PREFILL engine's, told when a load let go of sessions."""
        core = engine_loop.core
        if core.loras is None or not isinstance(core.runner, LoraRunner):
            raise ValueError("the engine core was built without LoRA (max_loras)")
        self._loop = engine_loop
        self._registry: LoraRegistry = core.loras
        self._runner: LoraRunner = core.runner
        self.max_lora_rank = max_lora_rank
        self._kv_sessions = kv_sessions
        self._lock = asyncio.Lock()

    async def load(self, adapter: LoraAdapter) -> bool:
        """Load (False) or find exactly this adapter loaded already (True)."""
        async with self._lock:
            # From this thread the registry's answer is advisory; the engine thread decides.
            if self._registry.check_load(adapter) is LoraLoad.ALREADY_LOADED:
                return True
            # Read even to resume an adapter whose requests still run: they may end before the
            # engine thread decides, and then it loads the adapter afresh.
            weights = await asyncio.to_thread(
                self._runner.read_lora, Path(adapter.path), max_rank=self.max_lora_rank
            )
            loading = self._loop.call(lambda core: core.load_lora(adapter, weights))
            if self._kv_sessions is not None:
                # From the engine thread's answer, not after the await: a LoadLora cancelled
                # as the load completes still lets go of the sessions (before it resumes).
                release = functools.partial(
                    _release_sessions, asyncio.get_running_loop(), self._kv_sessions, adapter.name
                )
                loading.add_done_callback(release)
            outcome: LoraLoad = await asyncio.wrap_future(loading)
            return outcome is LoraLoad.ALREADY_LOADED

    async def unload(self, name: str) -> LoraAdapter:
        if not name:
            raise InvalidLoraError("lora_name must be non-empty")
        async with self._lock:
            return await asyncio.wrap_future(self._loop.call(lambda core: core.unload_lora(name)))

    def list(self) -> list[LoraAdapter]:
        return sorted(self._registry.adapters.values(), key=lambda a: a.lora_id)


def _release_sessions(
    loop: asyncio.AbstractEventLoop, sessions: KvSessionStore, name: str, loading: Future[LoraLoad]
) -> None:
    """(engine thread) A fresh load of `name`: the store lets go of its earlier sessions."""
    if (
        not loading.cancelled()
        and loading.exception() is None
        and loading.result() is LoraLoad.LOADED
    ):
        try:
            loop.call_soon_threadsafe(sessions.release_lora, name)
        except RuntimeError:
            if not loop.is_closed():
                raise
            # Shut down: the event loop, and the sessions it served, are gone.
