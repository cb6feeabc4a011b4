"""Every example config in configs/ loads with the model of the server it is for, and given
where another kind is wanted is named for what it is."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

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


# A commented-out setting, `# key: value` (a value of one word or a flow collection, then
# maybe a comment; a flow collection may go on over lines of its own indentation), or
# `# key:` opening a commented block, or `# - {...}` adding to a list; prose (`# role: prefill
# or decode (...)`) has words after its value and is left alone.
_EXAMPLE = re.compile(
    r"^(?P<indent> *)# (?P<body>- \{.*|[a-z_]+:(?: +(?:[\[{].*|[^\s#]+))?) *(?:#.*)?$"
)
_BLOCK_LINE = re.compile(r"^(?P<indent> *)# (?P<body> +\S.*?) *(?:#.*)?$")


def _balanced(text: str) -> bool:
    return text.count("{") + text.count("[") == text.count("}") + text.count("]")


def _parents(above: list[str], indent: int) -> list[str | int]:
    """The path of the mapping a line indented `indent` belongs in, from the uncommented lines
    `above` it: the keys less indented, and a list item's index for a `- ` line."""
    path: list[str | int] = []
    items = 0  # `- ` lines met at the depth of the list being walked up
    for line in reversed(above):
        stripped = line.strip()
        depth = len(line) - len(line.lstrip())
        if not stripped or stripped.startswith("#"):
            continue
        if items and depth == indent and stripped.startswith("- "):
            items += 1
        elif depth < indent:
            if items:
                path.insert(0, items - 1)
                items = 0
            if stripped.startswith("- "):
                items = 1
            else:
                path.insert(0, stripped.split(":")[0])
            indent = depth
    return path


def _commented_examples(text: str) -> Iterator[tuple[int, list[str | int], str]]:
    """(line, path of the mapping it belongs in, YAML) of each commented-out setting."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _EXAMPLE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, indent, body = i, len(match["indent"]), [match["body"]]
        i += 1
        while i < len(lines) and (block := _BLOCK_LINE.match(lines[i])) is not None:
            opens_block = body[0].endswith(":") and len(block["indent"]) == indent
            continues_flow = not _balanced("\n".join(body))
            if not (opens_block or continues_flow):
                break
            body.append(block["body"] if opens_block else block["body"].strip())
            i += 1
        joiner = "\n" if body[0].endswith(":") else " "
        yield start + 1, _parents(lines[:start], indent), joiner.join(body)


COMMENTED_EXAMPLES = [
    pytest.param(path, parents, example, id=f"{path.name}:{line}")
    for path in sorted(CONFIGS.glob("*.yaml"))
    for line, parents, example in _commented_examples(path.read_text())
]


def test_the_configs_comment_out_settings() -> None:
    """The parser above finds them (an empty list would pass every case below)."""
    assert len(COMMENTED_EXAMPLES) >= 20


@pytest.mark.parametrize(("path", "parents", "example"), COMMENTED_EXAMPLES)
def test_a_commented_out_setting_loads_when_uncommented(
    path: Path, parents: list[str | int], example: str
) -> None:
    """A newcomer uncomments `# engine_tls: {...}` and expects it to load: every key a
    config shows commented out is its model's, with a value of its type. Checks across
    fields are left out (`kv_transfer`'s keys belong to one role each, as their comments
    say): a field's own error is the example's."""
    data = yaml.safe_load(path.read_text())
    mapping = data
    for key in parents:
        mapping = mapping[key]
    setting = yaml.safe_load(example)
    if isinstance(setting, list):
        mapping.extend(setting)
    else:
        mapping.update(setting)
    try:
        _model(path).model_validate(data)
    except ValidationError as error:
        own = [e for e in error.errors() if e["loc"]]
        assert not own, f"{path.name}: {example!r}: {own}"
