"""Every example config in configs/ loads with the model of the server it is for, and given
where another kind is wanted is named for what it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from controller.config import ControllerConfig
from engine.config import EngineConfig
from indexer.config import IndexerConfig
from kvplane.config import load_config
from kvplane.errors import ConfigError
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


# What the error calls each kind (a `local*` file is a `kvplane up` fleet).
KIND_NAMES = {"controller": "a controller", "engine": "an engine", "indexer": "an indexer",
              "local": "a fleet", "planner": "a planner"}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "wanted"),
    [
        pytest.param(path, wanted, id=f"{path.name}-as-{wanted}")
        for path in sorted(CONFIGS.glob("*.yaml"))
        for wanted in sorted(MODELS)
        if wanted != path.stem.split("-")[0]
    ],
)
def test_a_config_of_another_kind_is_named_in_one_line(path: Path, wanted: str) -> None:
    """Was one "KEY: Extra inputs are not permitted" per top-level key of the file."""
    kind = path.stem.split("-")[0]
    with pytest.raises(ConfigError) as error:
        load_config(MODELS[wanted], path)
    assert str(error.value) == (
        f"{path} looks like {KIND_NAMES[kind]} config; --config wants {KIND_NAMES[wanted]} config"
    )


@pytest.mark.parametrize(
    ("model", "text", "problem"),
    [
        # Keys that are no kind's: a typo.
        (ControllerConfig, "listen: 127.0.0.1:0\nroutr: {}\n", "routr: Extra inputs"),
        # Keys of several kinds (every server's `listen`): no kind is guessed.
        (PlannerConfig, "listen: 127.0.0.1:0\n", "listen: Extra inputs"),
    ],
)
def test_keys_that_name_no_one_kind_are_listed_as_usual(
    tmp_path: Path, model: type[BaseModel], text: str, problem: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(model, path)
    assert str(error.value) == f"invalid config in {path}: {problem} are not permitted"


def test_every_member_config_of_the_local_fleet_loads() -> None:
    """Each member's `config` is its server's own YAML, which `load_fleet` checks."""
    fleet = load_fleet(CONFIGS / "local.yaml")
    assert {member.kind for member in fleet.members} == {"engine", "controller"}


def test_every_member_config_of_the_planner_fleet_loads() -> None:
    fleet = load_fleet(CONFIGS / "local-planner.yaml")
    assert [member.kind for member in fleet.members] == ["engine", "controller", "planner"]
