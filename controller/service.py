"""The controller process's service layer: the fleet, the router, the index and the metrics,
and the one path every routed request takes (tokenise -> keys -> index match -> route).

`Controller.start()` opens the index, starts polling every configured engine and a task that
refreshes the index-size metrics; `close()` cancels all of it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from controller.config import ControllerConfig
from controller.fleet import Fleet, PromptView
from controller.metrics import ControllerMetrics
from controller.registry import Role
from controller.router import Decision, Router, RouteRequest, make_policy
from indexer.backend import IndexBackend
from indexer.backends import open_backend
from indexer.sources.resync import connect_resync
from kvplane.errors import ConfigError

log = logging.getLogger(__name__)

INDEX_STATS_INTERVAL_S = 5.0
STATS_CANCEL_WAIT_S = 1.0


class PromptInput(NamedTuple):
    """A request's prompt and routing context, as the gateways hand it over (a named tuple:
    one is built on every routed request)."""

    request_id: str
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    model: str = ""
    lora_name: str = ""
    cache_salt: str = ""
    session_key: str | None = None


class Plan(NamedTuple):
    """A prompt ready to route (a named tuple: one is built on every routed request)."""

    request: RouteRequest
    view: PromptView
    # False: a text prompt and no tokenizer, so the router could not see the cache.
    tokenized: bool


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        index: IndexBackend | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._own_index = index is None
        self.index = index
        self.rng = rng or random.Random(config.router.seed)
        self.clock = clock
        self.router = Router(
            make_policy(config.router.policy, config.router.weights()),
            busy=config.router.busy(),
            pending_ttl_s=config.router.pending_ttl_s,
        )
        self.fleet = Fleet(config, index, clock=clock, on_engine_gone=self._engine_gone)
        self.metrics = ControllerMetrics(self.fleet.registry)
        self._tokenizer: Any | None = None
        self._stats_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.config.tokenizer is not None:
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_file(str(self.config.tokenizer))
            except Exception as exc:
                raise ConfigError(f"cannot load tokenizer {self.config.tokenizer}: {exc}") from exc
        if self.index is None and self.config.index.remote is None:
            index = self.config.index
            self.index = await open_backend(index.backend, **index.backend_options())
            self.fleet.index = self.index
            # A shared index that dropped or lost an engine's entries: its source rebuilds them.
            connect_resync(self.index, self.fleet.source_of)
        await self.fleet.start()
        self._stats_task = asyncio.create_task(self._refresh_index_stats(), name="index stats")

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            # A shared backend may finish its current command before it sees the cancel.
            await asyncio.wait([self._stats_task], timeout=STATS_CANCEL_WAIT_S)
        await self.fleet.close()
        if self._own_index and self.index is not None:
            await self.index.close()

    def _engine_gone(self, address: str) -> None:
        self.router.forget_engine(address)

    def tokenize(self, prompt: str) -> list[int] | None:
        if self._tokenizer is None:
            return None
        return list(self._tokenizer.encode(prompt).ids)

    async def plan(self, query: PromptInput, role: Role | None = Role.AGGREGATED) -> Plan:
        tokens: Sequence[int] | None = query.token_ids
        tokenized = tokens is not None
        if tokens is None and query.prompt is not None:
            tokens = self.tokenize(query.prompt)
            tokenized = tokens is not None
        view = await self.fleet.prompt_view(
            tokens,
            model=query.model,
            lora_name=query.lora_name,
            cache_salt=query.cache_salt,
            role=role,
        )
        # No tokenizer: a rough size (4 characters a token) keeps the load terms meaningful.
        num_tokens = len(tokens) if tokens is not None else max(1, len(query.prompt or "") // 4)
        request = RouteRequest(
            query.request_id, num_tokens, view.block_size, view.block_keys, query.session_key
        )
        return Plan(request, view, tokenized)

    def route(self, plan: Plan, exclude: frozenset[str] = frozenset()) -> Decision:
        candidates = plan.view.candidates
        if exclude:  # a retry: not the engines that already failed it
            candidates = tuple(c for c in candidates if c.engine_id not in exclude)
        decision = self.router.route(plan.request, candidates, self.rng, self.clock())
        self.metrics.count_decision(decision.policy, decision.reason.value)
        return decision

    def explain(self, plan: Plan) -> Decision:
        return self.router.explain(plan.request, plan.view.candidates, self.rng, self.clock())

    async def _refresh_index_stats(self) -> None:
        while True:
            await asyncio.sleep(INDEX_STATS_INTERVAL_S)
            if self.index is not None:
                try:
                    stats = await self.index.stats()
                except Exception:
                    log.exception("index stats failed")
                else:
                    self.metrics.index_blocks.set(stats.num_blocks)
                    self.metrics.index_placements.set(stats.num_placements)
                    self.fleet.indexed_blocks = {w.worker_id: w.num_blocks for w in stats.workers}
