"""Property-style check of the controller replicas' shared membership against a naive model,
each field of the hash as the last admin change that succeeded (through either replica) left
it, by wall time: that is what both replicas hold once they have read the hash, whatever
Redis did between the changes (restarted empty, restarted from an older snapshot) and
whichever replica read the hash when. (A change through a replica that has not read what
Redis lost may act on an older view than the model's, one of an engine the other removed
meanwhile, say: the model takes what it changed, as the hash does.) Seeded random sequences of
operations on one engine address per sequence, against a real redis-server and two real
controller replicas that read the hash only when the sequence says so."""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc
import pytest

from kvplane_api.v1 import admin_pb2 as apb
from tests.controller.conftest import Fleet
from tests.controller.test_shared_membership import (
    replicas_reading_when_told,
    restart_empty,
    restart_from_snapshot,
    snapshot,
    workers,
)
from tests.redis_servers import RedisServer, free_port

pytestmark = pytest.mark.timeout(300)

SEQUENCES, OPERATIONS = 30, 12
CHANGES = ("register", "register as p", "remove", "cordon", "uncordon")
# Each also drawn: a replica's read, and Redis restarted empty, saved, or restarted from its
# last save.
EVENTS = (*CHANGES, *CHANGES, "read", "read", "wipe", "save", "restore")


@dataclass
class Engine:
    """The model: the engine's fields (`a:`, `c:`) as the last admin change that succeeded
    left each; as the replicas show it, cordoned only while registered."""

    registered: bool = False
    cordoned: bool = False
    owner: str = ""

    def shown(self) -> Engine:
        if not self.registered:
            return Engine()
        return Engine(True, self.cordoned, self.owner)


async def change(replica: Fleet, operation: str, address: str) -> bool:
    """`operation` on the engine at `address` through `replica`; whether it succeeded (a
    replica that cannot know the engine refuses it: NOT_FOUND, ALREADY_EXISTS)."""
    admin, ref = replica.admin, apb.EngineRef(engine=address)
    try:
        if operation.startswith("register"):
            owner = operation.removeprefix("register as ").removeprefix("register")
            await admin.RegisterEngine(apb.RegisterEngineRequest(address=address, owner=owner))
        elif operation == "remove":
            await admin.RemoveEngine(ref)
        elif operation == "cordon":
            await admin.Cordon(ref)
        else:
            await admin.Uncordon(ref)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS), exc
        return False
    return True


def applied(engine: Engine, operation: str) -> Engine:
    if operation.startswith("register"):  # an engine registered afresh is not cordoned
        return Engine(True, False, operation.removeprefix("register as ").removeprefix("register"))
    if operation == "remove":
        return Engine()
    return Engine(engine.registered, operation == "cordon", engine.owner)


async def test_both_replicas_end_with_the_last_change_whatever_redis_did(
    redis: RedisServer,
) -> None:
    async with replicas_reading_when_told(redis) as (a, b, _):
        for seed in range(SEQUENCES):
            draw = random.Random(seed)
            # An engine of its own per sequence (none answers: membership needs none).
            address = f"127.0.0.1:{free_port()}"
            model, history = Engine(), []
            saved = False
            for _ in range(OPERATIONS):
                event = draw.choice(EVENTS)
                replica = draw.choice((a, b))
                name = "a" if replica is a else "b"
                if event in CHANGES:
                    if await change(replica, event, address):
                        model = applied(model, event)
                    history.append(f"{event} via {name}")
                elif event == "read":
                    await replica.app.controller.membership.refresh()
                    history.append(f"read by {name}")
                elif event == "wipe":
                    await restart_empty(redis)
                    saved = False
                    history.append("restart empty")
                elif event == "save":
                    await snapshot(redis)
                    saved = True
                    history.append("save")
                elif saved:
                    await restart_from_snapshot(redis)
                    history.append("restart from the save")
            for replica in (a, b, a, b):
                await replica.app.controller.membership.refresh()
            for name, replica in (("a", a), ("b", b)):
                held = (await workers(replica)).get(address)
                got = Engine() if held is None else Engine(True, held.cordoned, held.owner)
                assert got == model.shown(), f"seed {seed}, replica {name}: {history}"
