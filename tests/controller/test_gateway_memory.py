"""The router's memory term on a live fleet: the KV an engine's running requests hold (its
GetLoad's used blocks, or the router's own count of what it sent there) leaves no room for a
long prompt, which goes to the engine that can hold it (real sim engines, a real controller)."""

from __future__ import annotations

import pytest

from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.grpc_streams import next_reply

pytestmark = pytest.mark.timeout(60)

BLOCKS = 64  # 1,024 tokens of KV per engine (block size 16)


async def test_a_prompt_that_cannot_fit_beside_a_running_request_goes_to_the_other_engine() -> None:
    engines = [
        await start_sim_engine(f"e{i}", time_scale=1.0, num_kv_blocks=BLOCKS) for i in range(2)
    ]
    fleet = await make_fleet(engines=engines)
    try:
        # 800 tokens (50 blocks) that keep decoding: they hold their KV until cancelled.
        running = fleet.gateway.Generate(
            generate_request("long", list(range(1, 801)), max_tokens=100_000)
        )
        first = await next_reply(running)
        assert first.WhichOneof("event") != "error", first
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=list(range(5_000, 5_600))))  # 38 blocks
        explained = await fleet.admin.Route(query)
        memory = {c.engine: c.memory_cost for c in explained.costs}
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        holder = next(w.address for w in workers.workers if w.inflight_requests == 1)
        other = next(a for a in memory if a != holder)
        # At least 50 + 38 blocks in 64: the holder lacks 24 blocks or more, the other none.
        assert memory[holder] >= 16.0 * 24 * 16
        assert memory[other] == 0.0
        assert explained.engine == other
        running.cancel()
    finally:
        await close_fleet(fleet)
