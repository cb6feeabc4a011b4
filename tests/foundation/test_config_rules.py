"""The rules every kvplane config shares across its fields (docs/architecture.md), through the
real commands: a setting read only beside another is refused while that one is off
(`kvplane.config.check_needs`), and a doubling wait's longest may not be below its first
(`check_ceilings`). Each refusal is one line naming the section and the keys, exit 1, before
anything serves or starts. Before, each of these configs started and the setting did nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from controller.config import ControllerConfig
from engine.config import EngineConfig
from indexer.config import IndexerConfig
from kvplane.config import load_config

_ZMQ = "{kind: zmq, worker_id: w0, endpoint: 'tcp://127.0.0.1:5557'"
_OPENENGINE = "{kind: openengine, target: '127.0.0.1:9000'"
_NEEDS = "is only read with"
KVPLANE = [sys.executable, "-m", "kvplane"]

# (command, config, its problem, a config that sets what it needs and loads)
REFUSED = [
    pytest.param(
        "controller",
        "index: {remote_tls: {ca_file: ca.pem}}",
        f"index: remote_tls {_NEEDS} remote (a kvplane indexer): set that, or remove remote_tls",
        "index: {remote: '127.0.0.1:50051', remote_tls: {ca_file: ca.pem}}",
        id="controller-remote_tls",
    ),
    pytest.param(
        "controller",
        "index: {remote_key_space: sha256}",
        f"index: remote_key_space {_NEEDS} remote (a kvplane indexer): set that, or remove "
        "remote_key_space",
        "index: {remote: '127.0.0.1:50051', remote_key_space: sha256}",
        id="controller-remote_key_space",
    ),
    pytest.param(
        "controller",
        "index: {writer_lease_s: 5}",
        f"index: writer_lease_s {_NEEDS} a Redis backend (backend is memory): set that, or "
        "remove writer_lease_s",
        "index: {backend: 'redis://127.0.0.1:6379', writer_lease_s: 5}",
        id="controller-writer_lease_s",
    ),
    pytest.param(
        "controller",
        "engines: [{address: '127.0.0.1:9001', kv_events: none, array_tail: vllm}]",
        f"engines.0: array_tail {_NEEDS} kv_events zmq or grpc: set that, or remove array_tail",
        "engines: [{address: '127.0.0.1:9001', kv_events: zmq, array_tail: vllm}]",
        id="controller-array_tail",
    ),
    pytest.param(
        "controller",
        "health: {backoff_initial_s: 60, backoff_max_s: 1}",
        "health: backoff_max_s (1) is below backoff_initial_s (60)",
        "health: {backoff_initial_s: 60, backoff_max_s: 60}",
        id="controller-backoff",
    ),
    pytest.param(
        "controller",
        "health: {eject_for_s: 200}",
        "health: eject_max_s (120, its default) is below eject_for_s (200)",
        "health: {eject_for_s: 200, eject_max_s: 600}",
        id="controller-eject",
    ),
    pytest.param(
        "indexer",
        "replica_name: indexer-0",
        f"replica_name {_NEEDS} a Redis backend (backend is memory): set that, or remove "
        "replica_name",
        "backend: 'redis://127.0.0.1:6379/0'\nreplica_name: indexer-0",
        id="indexer-replica_name",
    ),
    pytest.param(
        "indexer",
        f"sources: [{_ZMQ}, replay_bytes: 1048576}}]",
        f"sources.0: replay_bytes {_NEEDS} replay_endpoint: set that, or remove replay_bytes",
        f"sources: [{_ZMQ}, replay_endpoint: 'tcp://127.0.0.1:5558', replay_bytes: 1048576}}]",
        id="indexer-replay_bytes",
    ),
    pytest.param(
        "indexer",
        f"sources: [{_OPENENGINE}, discover_zmq: false, array_tail: vllm}}]",
        f"sources.0: array_tail {_NEEDS} discover_zmq: true: set that, or remove array_tail",
        f"sources: [{_OPENENGINE}, array_tail: vllm}}]",
        id="indexer-array_tail",
    ),
    pytest.param(
        "engine",
        "kv_events: {topic: kv@gpu-0}",
        f"kv_events: topic {_NEEDS} zmq_enabled: true: set that, or remove topic",
        "kv_events: {zmq_enabled: true, topic: kv@gpu-0}",
        id="engine-topic",
    ),
    pytest.param(
        "engine",
        "lora: {max_loras: 2}",
        f"lora: max_loras {_NEEDS} enabled: true: set that, or remove max_loras",
        "lora: {enabled: true, max_loras: 2}",
        id="engine-max_loras",
    ),
]
MODELS: dict[str, type[BaseModel]] = {
    "controller": ControllerConfig,
    "indexer": IndexerConfig,
    "engine": EngineConfig,
}


def _refused(args: list[str], error: str) -> None:
    """`kvplane ARGS` exits 1 with `error` as its one line. (The old code served, or started
    the fleet, instead: the timeout ends such a process.)"""
    out = subprocess.run([*KVPLANE, *args], capture_output=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert out.stderr.decode().splitlines() == [f"kvplane: error: {error}"]


@pytest.mark.parametrize(("command", "text", "problem", "fixed"), REFUSED)
def test_serve_refuses_the_config_in_one_line_and_loads_it_fixed(
    tmp_path: Path, command: str, text: str, problem: str, fixed: str
) -> None:
    path = tmp_path / f"{command}.yaml"
    path.write_text(f"listen: 127.0.0.1:0\n{text}\n")
    _refused([command, "serve", "--config", str(path)], f"invalid config in {path}: {problem}")
    path.write_text(f"{fixed}\n")  # with what the setting needs, it loads
    load_config(MODELS[command], path)


def test_up_refuses_a_member_config_before_any_member_starts(tmp_path: Path) -> None:
    """A fleet file's member is checked by the same rules: nothing is started."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: e0, kind: engine, config: {model: sim, lora: {max_lora_rank: 32}}}\n"
        "  - {name: c, kind: controller, config: {engines: [{address: '${e0}'}]}}\n"
    )
    _refused(
        ["up", str(fleet), "--check", "--no-live"],
        f"invalid config in {fleet}, member e0: lora: max_lora_rank {_NEEDS} enabled: true: "
        "set that, or remove max_lora_rank",
    )


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        (f"{_ZMQ}, topc: kv@}}", "sources.0.topc: Extra inputs are not permitted"),
        ("{kind: zmq, worker_id: endpoint}", "sources.0.endpoint: Field required"),
        (f"{_OPENENGINE}, tls: {{ca: x}}}}", "sources.0.tls.ca: Extra inputs are not permitted"),
    ],
)
def test_a_source_key_is_named_by_the_path_written(
    tmp_path: Path, source: str, problem: str
) -> None:
    """A source's keys are named as the file spells them: was `sources.0.zmq.topc`, the
    source's `kind` put in the path as if it were a key."""
    path = tmp_path / "indexer.yaml"
    path.write_text(f"listen: 127.0.0.1:0\nsources: [{source}]\n")
    _refused(["indexer", "serve", "--config", str(path)], f"invalid config in {path}: {problem}")


@pytest.mark.parametrize(
    ("command", "text", "key"),
    [
        ("engine", "served_model_name: ''", "served_model_name"),
        ("engine", "served_model_aliases: [llama, '']", "served_model_aliases.1"),
        ("controller", "router: {session_metadata_key: ''}", "router.session_metadata_key"),
    ],
)
def test_an_empty_name_is_refused(tmp_path: Path, command: str, text: str, key: str) -> None:
    """A name given empty (an unset shell variable in a template) is a mistake, not a
    choice: was an engine served under its default name, a session key no request carries."""
    path = tmp_path / f"{command}.yaml"
    path.write_text(f"listen: 127.0.0.1:0\n{text}\n")
    _refused(
        [command, "serve", "--config", str(path)],
        f"invalid config in {path}: {key}: String should have at least 1 character",
    )


@pytest.mark.parametrize(
    ("command", "text"),
    [
        ("controller", "index: {backend: memory, writer_lease_s: 10.0, replica_name: null}"),
        ("indexer", "backend: memory\nwriter_lease_s: 10.0\nreplica_name: null"),
        ("engine", "kv_events: {zmq_enabled: false, topic: null}"),
    ],
)
def test_a_default_spelt_out_is_not_refused(tmp_path: Path, command: str, text: str) -> None:
    """A file that writes a setting's default beside what it needs switched off (as a template
    writing every key out does) asks for nothing that is not done: it loads. Only another
    value is refused (REFUSED above)."""
    path = tmp_path / "config.yaml"
    path.write_text(text + "\n")
    load_config(MODELS[command], path)
