"""The gateway's routing path in process (`Controller.plan`, then `Controller.route`): a
plan's candidates are routed as they are while the registry has not changed since the plan
(`Registry.version`), and re-checked once it has, so that an engine out of routing since the
plan (a shared or remote index may keep a plan waiting) is never chosen."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from controller.config import ControllerConfig, RouterConfig
from controller.registry import EngineIdentity, EngineState, ModelFacts, Registry, Role
from controller.router import NoEngineAvailableError, Reason
from controller.service import Controller, PromptInput
from indexer.memory_backend import MemoryBackend

ENGINES = ("127.0.0.1:1", "127.0.0.1:2")


def controller_of(*addresses: str) -> Controller:
    controller = Controller(ControllerConfig(router=RouterConfig(seed=0)), MemoryBackend())
    registry = controller.fleet.registry
    facts = ModelFacts(block_size=16, total_kv_blocks=256, supports_lora=True)
    for n, address in enumerate(addresses):
        registry.add(address)
        identity = EngineIdentity(
            f"e{n}", "sim", "0", Role.AGGREGATED, ("m",), 16, 1, 1, "v1.0.0", (facts,)
        )
        registry.on_identity(address, identity)
        registry.on_health(address, EngineState.READY, 0.0)
        registry.on_loras(address, frozenset({"x"}))
    return controller


def prompt(request_id: str = "r", lora_name: str = "") -> PromptInput:
    return PromptInput(request_id, token_ids=tuple(range(64)), model="m", lora_name=lora_name)


TAKEN_OUT: dict[str, Callable[[Registry, str], object]] = {
    "cordoned": lambda registry, address: registry.set_cordoned(address, True),
    "drained": lambda registry, address: registry.request_drain(address),
    "not ready": lambda registry, address: registry.on_health(address, EngineState.NOT_READY, 1.0),
    "unreachable": lambda registry, address: registry.on_poll_failed(address, 1.0, "gone"),
    "removed": lambda registry, address: registry.remove(address, 1.0),
    "restarted": lambda registry, address: registry.on_new_instance(address, 1.0),
}


@pytest.mark.parametrize("how", TAKEN_OUT)
async def test_an_engine_out_of_routing_since_the_plan_is_not_chosen(how: str) -> None:
    controller = controller_of(*ENGINES)
    plan = await controller.plan(prompt())
    assert [c.engine_id for c in plan.view.candidates] == list(ENGINES)
    TAKEN_OUT[how](controller.fleet.registry, ENGINES[0])
    decision = controller.route(plan)
    assert (decision.engine_id, decision.reason) == (ENGINES[1], Reason.ONLY)


async def test_a_plan_whose_every_engine_left_routing_finds_none() -> None:
    controller = controller_of(*ENGINES)
    plan = await controller.plan(prompt())
    for address in ENGINES:
        controller.fleet.registry.set_cordoned(address, True)
    with pytest.raises(NoEngineAvailableError, match="cordoned"):
        controller.route(plan)


async def test_an_adapter_unloaded_since_the_plan_takes_its_engine_out() -> None:
    controller = controller_of(*ENGINES)
    plan = await controller.plan(prompt(lora_name="x"))
    controller.fleet.registry.on_lora_unloaded(ENGINES[0], "x")
    assert controller.route(plan).engine_id == ENGINES[1]


async def test_with_nothing_changed_the_plan_is_routed_among_its_candidates() -> None:
    """Load reports do not change routability: the plan stands, a retry still excludes the
    engines that failed it."""
    controller = controller_of(*ENGINES)
    plan = await controller.plan(prompt())
    registry = controller.fleet.registry
    assert plan.view.registry_version == registry.version
    registry.on_health(ENGINES[0], EngineState.READY, 1.0)  # an unchanged health answer
    assert plan.view.registry_version == registry.version
    assert controller.route(plan).engine_id in ENGINES
    controller.router.finish("r")
    retry = controller.route(plan, exclude=frozenset({ENGINES[0]}))
    assert retry.engine_id == ENGINES[1]


async def test_a_plan_with_cordoned_engines_is_always_checked_again() -> None:
    """Admin `match` lists cordoned engines too: such a plan never skips the check."""
    controller = controller_of(*ENGINES)
    controller.fleet.registry.set_cordoned(ENGINES[0], True)
    plan = await controller.plan(prompt(), cordoned=True)
    assert plan.view.registry_version is None
    assert [c.engine_id for c in plan.view.candidates] == list(ENGINES)
    assert controller.route(plan).engine_id == ENGINES[1]
