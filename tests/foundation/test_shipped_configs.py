"""Every example config in configs/ loads with the model of the server it is for."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from controller.config import ControllerConfig
from engine.config import EngineConfig
from indexer.config import IndexerConfig
from kvplane.config import load_config
from kvplane.up.config import FleetConfig, load_fleet
from planner.config import PlannerConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# A config's name starts with the kind of server it configures; `local` is a `kvplane up` fleet.
MODELS: dict[str, type[BaseModel]] = {
    "controller": ControllerConfig,
    "engine": EngineConfig,
    "indexer": IndexerConfig,
    "local": FleetConfig,  # local.yaml, local-disagg.yaml, local-planner.yaml
    "planner": PlannerConfig,
}


def _model(path: Path) -> type[BaseModel]:
    kind = path.stem.split("-")[0]
    assert kind in MODELS, f"{path.name}: no config model for a config named {kind}-*"
    return MODELS[kind]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_loads(path: Path) -> None:
    load_config(_model(path), path)


def test_every_member_config_of_the_local_fleet_loads() -> None:
    """Each member's `config` is its server's own YAML, which `load_fleet` checks."""
    fleet = load_fleet(CONFIGS / "local.yaml")
    assert {member.kind for member in fleet.members} == {"engine", "controller"}


def test_every_member_config_of_the_planner_fleet_loads() -> None:
    fleet = load_fleet(CONFIGS / "local-planner.yaml")
    assert [member.kind for member in fleet.members] == ["engine", "controller", "planner"]
