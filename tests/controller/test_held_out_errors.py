"""What operators read of the engines the cap on those held out decides on (admin `workers`,
the gateway's Health checks) is made when they read it, not written at each health answer
(`Registry.error_of`): a held-down engine's "routable in N s", and the end of the hold-down
of one routed all the same, count down as the controller's clock runs, with no health answer
recorded meanwhile. A real controller (its fleet not polling: the test records the health
answers itself, at the times of a clock it sets) behind real gRPC servers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from controller.admin import AdminServicer
from controller.config import ControllerConfig
from controller.gateway import GatewayServicer
from controller.registry import EngineIdentity, EngineState, Registry, Role
from controller.service import Controller
from indexer.memory_backend import MemoryBackend
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
ROUTED = (
    "held down but routed: more than half of the engines taking traffic would be out of "
    "routing otherwise; "
)
HELD = "left ready 2 times in 600 s (hold-down 60 s); "
POLLS = " and 2 more ready polls, if it stays ready"


@pytest.fixture
def now_s() -> list[float]:
    """The controller's clock, which the test sets."""
    return [0.0]


@pytest.fixture
async def controller(now_s: list[float]) -> AsyncIterator[Controller]:
    """Its fleet not polling: the test records the engines' health answers itself."""
    config = ControllerConfig.model_validate(
        {
            "health": {
                "hold_down_after_flaps": 2,
                "flap_window_s": 600,
                "hold_down_s": 60,
                "hold_down_ready_polls": 2,
            }
        }
    )
    controller = Controller(config, MemoryBackend(), clock=lambda: now_s[0])
    yield controller
    await controller.close()


@pytest.fixture
async def channel(controller: Controller) -> AsyncIterator[grpc.aio.Channel]:
    """To its admin API and its gateway, each a real server."""
    server = grpc.aio.server()
    apb_grpc.add_AdminServicer_to_server(AdminServicer(controller), server)
    pb_grpc.add_OpenEngineServicer_to_server(GatewayServicer(controller), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(0)


def add_ready(registry: Registry) -> None:
    """`ADDRESSES`, each with its identity read and READY at 0 s."""
    for n, address in enumerate(ADDRESSES):
        registry.add(address, now_s=0.0)
        identity = EngineIdentity(f"e{n}", "sim", "0", Role.AGGREGATED, ("sim",), 16, 1, 1, "v1")
        registry.on_identity(address, identity)
        registry.on_health(address, EngineState.READY, 0.0)


def flap_twice(registry: Registry, address: str, from_s: float) -> None:
    """NOT_READY, READY, NOT_READY (held down), then READY from `from_s + 3` on."""
    for n, state in enumerate((EngineState.NOT_READY, EngineState.READY) * 2):
        registry.on_health(address, state, from_s + n)


async def shown(channel: grpc.aio.Channel) -> dict[str, tuple[str, str, str]]:
    """Each engine's state and error in admin `workers`, with its gateway Health check's
    message, by address."""
    workers = await apb_grpc.AdminStub(channel).ListWorkers(apb.ListWorkersRequest())
    health = await pb_grpc.OpenEngineStub(channel).Health(pb.HealthRequest())
    checks = {c.name: c.message for c in health.checks}
    return {
        w.address: (w.state, w.last_error, checks[f"engine:{w.address}"]) for w in workers.workers
    }


async def test_a_held_down_engines_time_left_counts_down_between_its_health_answers(
    now_s: list[float], controller: Controller, channel: grpc.aio.Channel
) -> None:
    registry = controller.fleet.registry
    add_ready(registry)
    first, second, steady = ADDRESSES
    flap_twice(registry, first, 1.0)  # held down, ready since 4 s: until 64 s
    flap_twice(registry, second, 5.0)  # held down, ready since 8 s: until 68 s
    # Two held down of three taking traffic: the cap holds out one, the one whose hold-down
    # ends last, and routes the other.

    def expected(over_in_s: int, routable_in_s: int) -> dict[str, tuple[str, str, str]]:
        routed = f"{ROUTED}{HELD}hold-down over in {over_in_s} s{POLLS}"
        held = f"{HELD}routable in {routable_in_s} s{POLLS}"
        return {
            first: ("ready", routed, routed),
            second: ("held_down", held, f"held_down: {held}"),
            steady: ("ready", "", ""),
        }

    now_s[0] = 8.0
    assert await shown(channel) == expected(over_in_s=56, routable_in_s=60)
    # 25 s on, nothing recorded since: what is shown is as of now.
    now_s[0] = 33.0
    assert await shown(channel) == expected(over_in_s=31, routable_in_s=35)


def eject_routed_by_the_cap(registry: Registry) -> None:
    """The first engine ejected at 1 s, until 11 s (5 failures, 10 s: the defaults), then
    routed by the cap once the other two say NOT_READY at 2 s."""
    first, second, third = ADDRESSES
    for _ in range(5):
        registry.on_request_failed(first, 1.0, "INTERNAL: x")
    for address in (second, third):
        registry.on_health(address, EngineState.NOT_READY, 2.0, "scheduler: not running")


EJECTED_ROUTED = (
    "ejected but routed: more than half of the engines taking traffic would be out of routing "
    "otherwise; 5 requests failed in a row (last: INTERNAL: x); ejection over in "
)


async def test_an_engine_cordoned_and_uncordoned_shows_no_error_once_its_ejection_is_over(
    now_s: list[float], controller: Controller, channel: grpc.aio.Channel
) -> None:
    """Cordoned (its words kept while it takes no traffic) and uncordoned before its next
    health answer, an engine the cap routes past its ejection is back in the cap's decision:
    once the cap finds its ejection over, nothing is shown against it, not the words it was
    cordoned with."""
    registry = controller.fleet.registry
    add_ready(registry)
    eject_routed_by_the_cap(registry)
    first, second, _ = ADDRESSES
    admin = apb_grpc.AdminStub(channel)
    now_s[0] = 3.0
    await admin.Cordon(apb.EngineRef(engine=first))
    await admin.Uncordon(apb.EngineRef(engine=first))
    routed = f"{EJECTED_ROUTED}8 s"
    assert (await shown(channel))[first] == ("ready", routed, routed)
    # Another engine's answer after 11 s: the cap finds the ejection over, routed for good.
    now_s[0] = 12.0
    registry.on_health(second, EngineState.NOT_READY, 12.0, "scheduler: not running")
    assert registry.get(first).ejected_until_s is None
    assert (await shown(channel))[first] == ("ready", "", "")


async def test_a_new_process_keeps_what_its_engine_was_shown_with_when_it_was_found(
    now_s: list[float], controller: Controller, channel: grpc.aio.Channel
) -> None:
    """A new process found at an engine the cap routes past its ejection keeps the words its
    engine was shown with then, as of when it was found (not as of an earlier answer), until
    its next health answer."""
    registry = controller.fleet.registry
    add_ready(registry)
    eject_routed_by_the_cap(registry)
    first = ADDRESSES[0]
    registry.on_new_instance(first, 7.0)  # found by a poll at 7 s
    now_s[0] = 9.0  # (nothing recorded since: kept as it was at 7 s)
    kept = f"{EJECTED_ROUTED}4 s"
    assert (await shown(channel))[first] == ("unknown", kept, f"unknown: {kept}")
