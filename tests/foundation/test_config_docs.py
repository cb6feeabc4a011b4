"""The docs and the config models name the same settings: every key a server's YAML takes is
written down in its component's doc (the shared server keys in docs/architecture.md), and
every `section.key` a doc names is a key some config takes. A setting added, renamed or
removed without its doc fails here."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from controller.config import ControllerConfig
from engine.config import EngineConfig
from indexer.config import IndexerConfig
from kvplane.config import ServerConfig, validate_config
from kvplane.errors import ConfigError
from kvplane.up.config import FleetConfig
from planner.config import PlannerConfig

ROOT = Path(__file__).resolve().parents[2]
# The doc(s) where each config's settings are written down.
DOCS: dict[type[BaseModel], tuple[str, ...]] = {
    ControllerConfig: ("docs/controller.md", "docs/redis.md"),
    IndexerConfig: ("docs/indexer.md", "docs/redis.md"),
    PlannerConfig: ("docs/planner.md",),
    EngineConfig: ("docs/engine.md",),
    FleetConfig: ("docs/up.md",),
}
SHARED_DOC = "docs/architecture.md"  # ServerConfig's keys, which every server shares
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The config models a field's type holds (`X | None`, `list[X]`, a union of sources)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _settings(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every key `model` takes, nested sections' keys included."""
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        yield path
        for sub in _models_in(field.annotation):
            yield from _settings(sub, path)


def _named(*docs: str) -> set[str]:
    """The identifiers a doc names as code: in `backticks` or in a ```yaml block."""
    text = "\n".join((ROOT / doc).read_text() for doc in docs)
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```ya?ml\n(.*?)```", text, re.S)
    return {name for span in spans for name in _IDENTIFIER.findall(span)}


@pytest.mark.parametrize("model", list(DOCS), ids=lambda m: m.__name__)
def test_every_setting_is_named_in_its_doc(model: type[BaseModel]) -> None:
    named, shared = _named(*DOCS[model]), _named(SHARED_DOC)
    server = issubclass(model, ServerConfig)
    missing = [
        ".".join(path)
        for path in _settings(model)
        if path[-1] not in (shared if server and path[0] in ServerConfig.model_fields else named)
    ]
    assert not missing, f"settings not named in {' or '.join(DOCS[model])}: {missing}"


def _sections_and_paths() -> tuple[set[str], set[str]]:
    """(the keys that hold a section, every dotted run of keys any config takes: a doc may
    write `live.kubernetes.poll_s` or `kubernetes.poll_s`)."""
    sections: set[str] = set()
    paths: set[str] = set()
    for model in DOCS:
        for path in _settings(model):
            for start in range(len(path)):
                paths.update(".".join(path[start:end]) for end in range(start + 1, len(path) + 1))
            if path[:-1]:
                sections.add(path[-2])
    return sections, paths


# A dotted name that is a file (`router.py`, `index.proto`), not a setting.
_FILE_SUFFIXES = {"py", "proto", "md", "yaml", "json", "txt"}


def test_every_setting_a_doc_names_exists() -> None:
    sections, paths = _sections_and_paths()
    stale = []
    for doc in sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]):
        for number, line in enumerate(doc.read_text().splitlines(), start=1):
            for name in re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)`", line):
                parts = name.split(".")
                if parts[0] in sections and parts[-1] not in _FILE_SUFFIXES and name not in paths:
                    stale.append(f"{doc.relative_to(ROOT)}:{number}: {name}")
    assert not stale, f"settings no config takes: {stale}"


def test_the_walk_finds_nested_settings() -> None:
    """The checks above see sections' keys, sources' and members' too."""
    controller = {".".join(p) for p in _settings(ControllerConfig)}
    assert {"health.poll_interval_s", "index.redis.buckets", "engines.kv_events"} <= controller
    assert ("sources", "replay_endpoint") in set(_settings(IndexerConfig))
    assert ("live", "kubernetes", "leader_election", "lease_name") in set(_settings(PlannerConfig))


def _yaml_examples() -> Iterator[tuple[str, str]]:
    """(doc:line, text) of every ```yaml block of the config docs."""
    for doc in sorted({doc for docs in DOCS.values() for doc in docs}):
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"```ya?ml\n(.*?)```", text, re.S):
            yield f"{doc}:{text.count(chr(10), 0, match.start()) + 1}", match.group(1)


@pytest.mark.parametrize(("where", "text"), list(_yaml_examples()), ids=lambda v: v[:40])
def test_every_yaml_example_in_the_docs_loads(where: str, text: str) -> None:
    """A config a doc shows is one its reader can copy: it loads as a config of its doc (a
    rule that refuses a setting shown there, as it is shown, fails here)."""
    doc = where.partition(":")[0]
    problems = []
    for model in [model for model, docs in DOCS.items() if doc in docs]:
        try:
            validate_config(model, yaml.safe_load(text), where, frozenset())
            return
        except ConfigError as exc:
            problems.append(str(exc))
    pytest.fail(" / ".join(problems))
