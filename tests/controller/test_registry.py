"""The registry: the seed's revision check (fail closed), routability, backoff; and the
controller's config."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.registry import (
    CAPPED_EJECTION,
    CAPPED_HOLD_DOWN,
    ROUTABLE_MEMO_SIZE,
    EjectionPolicy,
    EngineIdentity,
    EngineState,
    HoldDownPolicy,
    IncompatibleEngineError,
    LoraNotLoadedError,
    LoraUnavailableError,
    LoraUnsupportedError,
    ModelFacts,
    ModelRequiredError,
    PollFailure,
    Registry,
    RegistryMemo,
    Role,
    UnknownEngineError,
    agreed_block_size,
    check_revision,
)
from controller.router import LoadSnapshot
from kvplane.config import load_config
from kvplane.errors import ConfigError


def identity(
    instance: str = "e0", revision: int = 1, minimum: int = 1, release: str = "v1.0.0"
) -> EngineIdentity:
    facts = ModelFacts(block_size=16, total_kv_blocks=256, supports_lora=False)
    return EngineIdentity(
        instance, "sim", "0", Role.AGGREGATED, ("m",), 16, revision, minimum, release, (facts,)
    )


@pytest.mark.parametrize(
    ("revision", "minimum", "release", "problem"),
    [
        (0, 1, "v1", "schema_revision 0"),
        (2, 1, "v2", "outside the tested range"),
        (1, 2, "v1", "requires client revision >= 2"),
        (1, 1, "main", "not an immutable release"),
        (1, 1, "", "not an immutable release"),
        # A moving release however it is spelled (case, padding).
        (1, 1, "Main", "not an immutable release"),
        (1, 1, " latest ", "not an immutable release"),
    ],
)
def test_revision_check_fails_closed(
    revision: int, minimum: int, release: str, problem: str
) -> None:
    with pytest.raises(IncompatibleEngineError, match=problem):
        check_revision(revision, minimum, release)


def two_models(*facts: ModelFacts) -> EngineIdentity:
    models = ("gen", "emb")[: len(facts)]
    return dataclasses.replace(identity(), models=models, model_facts=facts)


def test_a_generate_or_a_task_is_routed_by_its_own_models_facts() -> None:
    """An engine serving a generating model and an embedding one: each request sees its own
    model's GetModelInfo; one naming no model, the engine's default (first) model's."""
    registry = Registry()
    registry.add("h:1")
    embedder = ModelFacts(block_size=16, tasks=frozenset({"embed"}), generates=False)
    registry.on_identity("h:1", two_models(ModelFacts(block_size=16), embedder))
    registry.on_health("h:1", EngineState.READY, 0.0)
    assert [r.address for r in registry.routable("gen", generating=True)] == ["h:1"]
    assert [r.address for r in registry.routable("", generating=True)] == ["h:1"]
    assert registry.routable("emb", generating=True) == []
    record = registry.get("h:1")
    assert record.identity is not None
    assert record.identity.facts_of("emb").tasks == {"embed"}
    assert record.identity.facts_of("gen").tasks == frozenset()
    assert record.identity.generates  # not a pooling-only engine: one model generates


def test_models_of_one_engine_must_agree_on_the_block_size() -> None:
    same = (ModelFacts(block_size=16), ModelFacts(block_size=16))
    assert agreed_block_size(("a", "b"), same) == 16
    assert agreed_block_size(("a", "b"), (ModelFacts(), ModelFacts(block_size=32))) == 32
    assert agreed_block_size(("a", "b"), ()) is None  # GetModelInfo not asked
    with pytest.raises(IncompatibleEngineError, match=r"block sizes differ \(a 16, b 32\)"):
        agreed_block_size(("a", "b"), (ModelFacts(block_size=16), ModelFacts(block_size=32)))


def test_incompatible_engine_is_never_routable() -> None:
    registry = Registry()
    registry.add("h:1")
    with pytest.raises(IncompatibleEngineError):
        registry.on_identity("h:1", identity(revision=2))
    registry.on_health("h:1", EngineState.READY, 1.0)
    record = registry.get("h:1")
    assert record.state is EngineState.INCOMPATIBLE and not record.routable
    assert registry.routable() == []


def test_one_engine_under_a_second_address_is_refused_while_the_first_answers() -> None:
    registry = Registry()
    registry.add("127.0.0.1:1")
    registry.add("localhost:1")
    registry.on_identity("127.0.0.1:1", identity("e0"))
    registry.on_health("127.0.0.1:1", EngineState.READY, 0.0)
    same = r"the same engine \(instance e0\) as 127\.0\.0\.1:1"
    with pytest.raises(IncompatibleEngineError, match=same):
        registry.on_identity("localhost:1", identity("e0"))
    assert registry.get("localhost:1").state is EngineState.INCOMPATIBLE
    assert registry.get("e0").address == "127.0.0.1:1"
    # The first address stops answering (the engine moved): the second one takes over.
    registry.on_poll_failed("127.0.0.1:1", 2.0, "gone")
    registry.on_identity("localhost:1", identity("e0"))
    registry.on_health("localhost:1", EngineState.READY, 3.0)
    assert [r.address for r in registry.routable()] == ["localhost:1"]
    # The first address answers again: now it is the twin, and the instance id names the
    # address that answers for the engine (a cordon by instance id must reach it).
    with pytest.raises(IncompatibleEngineError, match="as localhost:1"):
        registry.on_identity("127.0.0.1:1", identity("e0"))
    assert registry.get("e0").address == "localhost:1"


def test_lora_requests_are_routable_only_to_engines_holding_the_adapter() -> None:
    registry = Registry()
    for i in range(2):
        registry.add(f"h:{i}")
        registry.on_identity(f"h:{i}", identity(f"e{i}"))
        registry.on_health(f"h:{i}", EngineState.READY, 0.0)
    with pytest.raises(LoraUnsupportedError):  # neither engine serves LoRA
        registry.check_lora("x", "m")
    registry.on_loras("h:0", frozenset())
    registry.on_loras("h:1", frozenset({"y"}))
    with pytest.raises(LoraNotLoadedError, match="no engine has LoRA adapter 'x' loaded"):
        registry.check_lora("x", "m")
    registry.on_lora_loaded("h:0", "x")
    assert [r.address for r in registry.routable("m", lora_name="x")] == ["h:0"]
    assert [r.address for r in registry.routable("m", lora_name="y")] == ["h:1"]
    assert len(registry.routable("m")) == 2
    registry.set_cordoned("h:0", True)
    assert registry.routable("m", lora_name="x") == []
    with pytest.raises(LoraUnavailableError, match="e0"):
        registry.check_lora("x", "m")
    registry.on_lora_unloaded("h:0", "x")
    with pytest.raises(LoraNotLoadedError):
        registry.check_lora("x", "m")
    # A new engine process has loaded nothing the controller knows of.
    registry.on_identity("h:1", identity("e1-restarted"))
    assert registry.routable("m", lora_name="y") == []


def test_health_states_and_cordon_decide_routability() -> None:
    registry = Registry()
    registry.add("h:1")
    assert registry.on_identity("h:1", identity("e0")) is True
    assert registry.on_identity("h:1", identity("e0")) is False
    for state, routable in [
        (EngineState.READY, True),
        (EngineState.DEGRADED, True),
        (EngineState.DRAINING, False),
        (EngineState.NOT_READY, False),
        (EngineState.STARTING, False),
    ]:
        registry.on_health("h:1", state, 2.0)
        assert registry.get("e0").routable is routable, state
    registry.on_health("h:1", EngineState.READY, 3.0)
    registry.set_cordoned("e0", True)
    assert registry.routable() == []
    registry.set_cordoned("h:1", False)
    assert [r.address for r in registry.routable(model="m")] == ["h:1"]
    assert registry.routable(model="other") == []
    assert registry.routable(role=Role.DECODE) == []
    # A restart (new instance id) is a new engine.
    assert registry.on_identity("h:1", identity("e1")) is True
    with pytest.raises(UnknownEngineError):
        registry.get("e0")


def test_health_messages_are_errors_only_for_engines_out_of_routing() -> None:
    """A READY engine's checks carry information (the model's name): not an error to show."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.on_poll_failed("h:1", 1.0, "UNAVAILABLE: connection refused")
    registry.on_health("h:1", EngineState.READY, 2.0, "builtin")
    assert registry.get("h:1").last_error == ""
    registry.on_health("h:1", EngineState.DEGRADED, 3.0, "kv: host tier offline")
    assert registry.get("h:1").last_error == ""
    registry.on_health("h:1", EngineState.NOT_READY, 4.0, "scheduler: not running")
    assert registry.get("h:1").last_error == "scheduler: not running"
    registry.on_health("h:1", EngineState.READY, 5.0, "builtin")
    assert registry.get("h:1").last_error == ""


def test_unreachable_engines_back_off_exponentially() -> None:
    registry = Registry(backoff_initial_s=0.5, backoff_max_s=3.0)
    registry.add("h:1")
    registry.on_identity("h:1", identity())
    registry.on_health("h:1", EngineState.READY, 0.0)
    delays = [registry.on_poll_failed("h:1", 10.0, "UNAVAILABLE") for _ in range(5)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert registry.get("h:1").state is EngineState.UNREACHABLE and registry.routable() == []
    registry.on_health("h:1", EngineState.READY, 11.0)
    assert registry.on_poll_failed("h:1", 12.0, "x") == 0.5


def test_an_outage_runs_from_the_first_unanswered_poll_until_an_answer() -> None:
    """What `health.abandon_streams_after_s` is measured against."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity())
    registry.on_health("h:1", EngineState.READY, 1.0)
    assert registry.unreachable_since("h:1") is None
    for now_s in (2.0, 4.0, 8.0):
        registry.on_poll_failed("h:1", now_s, "DEADLINE_EXCEEDED", PollFailure.TIMED_OUT)
    assert registry.unreachable_since("h:1") == 2.0
    registry.on_health("h:1", EngineState.READY, 9.0)
    assert registry.unreachable_since("h:1") is None
    registry.on_poll_failed("h:1", 10.0, "DEADLINE_EXCEEDED", PollFailure.TIMED_OUT)
    assert registry.unreachable_since("h:1") == 10.0  # a new outage


def test_an_engine_answering_with_an_error_is_in_no_outage() -> None:
    """An error answer (INTERNAL, UNIMPLEMENTED, a malformed reply) keeps the engine out of
    routing but proves it reachable: it neither starts an outage nor continues one."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity())
    registry.on_poll_failed("h:1", 1.0, "INTERNAL: boom", PollFailure.ERROR_ANSWER)
    assert registry.get("h:1").state is EngineState.FAILING and registry.routable() == []
    assert registry.unreachable_since("h:1") is None
    registry.on_poll_failed("h:1", 2.0, "DEADLINE_EXCEEDED", PollFailure.TIMED_OUT)
    assert registry.unreachable_since("h:1") == 2.0
    registry.on_poll_failed("h:1", 3.0, "INTERNAL: boom", PollFailure.ERROR_ANSWER)
    assert registry.unreachable_since("h:1") is None
    registry.on_poll_failed("h:1", 4.0, "UNAVAILABLE: refused", PollFailure.CONNECTION_LOST)
    assert registry.unreachable_since("h:1") == 4.0  # a new outage


def test_a_failed_poll_says_whether_the_engine_answered() -> None:
    """UNREACHABLE: the poll did not reach the engine; FAILING: it answered with an error.
    Either way out of routing, backed off and without load, and each turns into the other
    as the polls do."""
    registry = Registry(backoff_initial_s=0.5, backoff_max_s=3.0)
    registry.add("h:1")
    registry.on_identity("h:1", identity())
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.on_load("h:1", LoadSnapshot(running_requests=7))
    failures = [
        (PollFailure.ERROR_ANSWER, "INTERNAL: boom", EngineState.FAILING),
        (PollFailure.CONNECTION_LOST, "UNAVAILABLE: refused", EngineState.UNREACHABLE),
        (PollFailure.ERROR_ANSWER, "UNKNOWN: crashed", EngineState.FAILING),
        (PollFailure.TIMED_OUT, "DEADLINE_EXCEEDED", EngineState.UNREACHABLE),
    ]
    delays = []
    for failure, error, state in failures:
        delays.append(registry.on_poll_failed("h:1", 1.0, error, failure))
        record = registry.get("h:1")
        assert (record.state, record.last_error) == (state, error)
        assert registry.routable() == [] and record.load == LoadSnapshot()
    assert delays == [0.5, 1.0, 2.0, 3.0]  # one backoff, whichever way the polls fail
    registry.on_health("h:1", EngineState.READY, 2.0)
    assert registry.get("h:1").last_error == "" and len(registry.routable()) == 1


def test_an_engine_back_from_failing_is_the_same_process_unless_its_connection_was_lost() -> None:
    """Answering with errors proves the process alive: once healthy it keeps its drain (and
    index entries). One that could not be reached, then answered errors (a new process
    starting), then healthy, is a new process, as one back from unreachable alone is."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.request_drain("e0")
    registry.on_poll_failed("h:1", 1.0, "INTERNAL: boom", PollFailure.ERROR_ANSWER)
    assert registry.on_identity("h:1", identity("e0")) is False
    registry.on_health("h:1", EngineState.READY, 2.0)
    assert registry.get("h:1").state is EngineState.DRAINING  # its drain stands
    epoch = registry.get("h:1").epoch
    registry.on_poll_failed("h:1", 3.0, "UNAVAILABLE: refused", PollFailure.CONNECTION_LOST)
    registry.on_poll_failed("h:1", 4.0, "INTERNAL: starting", PollFailure.ERROR_ANSWER)
    assert registry.get("h:1").state is EngineState.FAILING
    assert registry.on_identity("h:1", identity("e0")) is True
    registry.on_health("h:1", EngineState.READY, 5.0)
    assert registry.get("h:1").epoch == epoch + 1
    assert [r.engine_id for r in registry.routable()] == ["e0"]  # a new process: no drain


def test_a_failing_engine_does_not_hold_its_instance_id_against_a_replacement() -> None:
    """An engine answering its polls with errors, replaced by a process under the same
    instance id at another address: the new address takes over, as from an unreachable one."""
    registry = Registry()
    for address in ("h:1", "h:2"):
        registry.add(address)
    registry.on_identity("h:1", identity("e0"))
    registry.on_poll_failed("h:1", 1.0, "INTERNAL: boom", PollFailure.ERROR_ANSWER)
    assert registry.on_identity("h:2", identity("e0")) is True
    registry.on_health("h:2", EngineState.READY, 2.0)
    assert [r.address for r in registry.routable()] == ["h:2"]


def test_an_unreachable_engine_reports_no_load() -> None:
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity())
    registry.on_load("h:1", LoadSnapshot(running_requests=7, total_kv_blocks=256))
    registry.on_poll_failed("h:1", 2.0, "UNAVAILABLE: connection refused")
    # Its last answer described a process that may be gone: the fleet's totals drop it.
    assert registry.get("h:1").load == LoadSnapshot()


def test_config_names_from_the_issue(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "listen: 127.0.0.1:8100\n"
        "index: {backend: memory}\n"
        "router: {policy: kvplane}\n"
        "engines:\n"
        "  - {address: 127.0.0.1:9001}\n"
        "  - {address: 127.0.0.1:9002, kv_events: zmq}\n"
    )
    config = load_config(ControllerConfig, path)
    assert [e.kv_events.value for e in config.engines] == ["grpc", "zmq"]
    assert (
        load_config(ControllerConfig, None, {"index": "redis://h:6379"}).index.backend
        == "redis://h:6379"
    )
    assert load_config(ControllerConfig, None, {"index": {"remote": "h:1"}}).index.remote == "h:1"
    path.write_text("router: {policy: fastest}\n")
    with pytest.raises(ConfigError, match="unknown policy"):
        load_config(ControllerConfig, path)
    path.write_text("index: {remote: indexer}\n")
    with pytest.raises(ConfigError, match=r"index\.remote: expected HOST:PORT"):
        load_config(ControllerConfig, path)
    for backend in ("memory", "'redis://h:6379'"):
        path.write_text(f"index: {{backend: {backend}, remote: 'h:1'}}\n")
        with pytest.raises(ConfigError, match=r"set either remote .* or backend .*, not both"):
            load_config(ControllerConfig, path)
    # As `kvplane indexer serve` checks its own index (indexer.backends).
    for index, message in (
        ("{backend: 'redis://h:6379/abc'}", "the DB must be a number, got 'abc'"),
        ("{backend: 'mongodb://h:1'}", "unknown index backend 'mongodb://h:1'"),
        ("{backend: memory, redis: {buckets: 8}}", "redis: options are for a Redis backend"),
    ):
        path.write_text(f"index: {index}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(ControllerConfig, path)
    path.write_text("engines: [{address: 'h:1'}, {address: 'h:1'}]\n")
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(ControllerConfig, path)
    path.write_text("tokenizer: /t/default.json\ntokenizers: {m1: /t/m1.json}\n")
    config = load_config(ControllerConfig, path)
    assert (config.tokenizer, config.tokenizers) == (
        Path("/t/default.json"),
        {"m1": Path("/t/m1.json")},
    )
    path.write_text("tokenizers: {'': /t/m1.json}\n")
    with pytest.raises(ConfigError, match="name a model"):
        load_config(ControllerConfig, path)


def test_a_password_in_the_index_backend_url_is_not_shown_in_its_error(tmp_path: Path) -> None:
    """`index.backend` set beside `index.remote`: the error named the Redis URL password and
    all; it shows the password as `***`, as the indexer's errors about a URL do
    (docs/redis.md)."""
    path = tmp_path / "c.yaml"
    path.write_text("index: {backend: 'redis://app:hunter2@h:6379/0', remote: 'h:1'}\n")
    with pytest.raises(ConfigError) as err:
        load_config(ControllerConfig, path)
    assert str(err.value) == (
        f"invalid config in {path}: index: set either remote (a kvplane indexer) or backend "
        "'redis://app:***@h:6379/0', not both"
    )


def test_a_drain_the_controller_started_sticks_until_the_engine_restarts() -> None:
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.request_drain("e0")
    assert registry.routable() == []
    # A health answer sent before the drain arrives late: still draining.
    registry.on_health("h:1", EngineState.READY, 1.1)
    assert registry.get("h:1").state is EngineState.DRAINING
    # A new process on the same address starts fresh.
    registry.on_identity("h:1", identity("e1"))
    registry.on_health("h:1", EngineState.READY, 2.0)
    assert [r.engine_id for r in registry.routable()] == ["e1"]


def test_an_engine_answering_again_after_it_was_unreachable_is_a_new_process() -> None:
    """A process restarted with an instance id set in its config keeps it: the registry
    cannot tell it from the old one, so it is new (its drain, its index entries go)."""
    registry = Registry()
    registry.add("h:1")
    assert registry.on_identity("h:1", identity("e0")) is True
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.request_drain("e0")
    registry.on_poll_failed("h:1", 2.0, "UNAVAILABLE: connection refused")
    assert registry.on_identity("h:1", identity("e0")) is True
    registry.on_health("h:1", EngineState.READY, 3.0)
    assert [r.engine_id for r in registry.routable()] == ["e0"]
    assert registry.on_identity("h:1", identity("e0")) is False
    # Too busy to answer in time is the same process: its drain (and index entries) stay.
    registry.request_drain("e0")
    registry.on_poll_failed("h:1", 5.0, "DEADLINE_EXCEEDED", PollFailure.TIMED_OUT)
    assert registry.on_identity("h:1", identity("e0")) is False
    registry.on_health("h:1", EngineState.READY, 5.5)
    assert registry.routable() == []
    # The fleet saw GetLoad name a new instance (GetEngineInfo may name none).
    assert registry.on_identity("h:1", identity("e0"), restarted=True) is True


def test_once_the_engine_says_draining_its_own_health_decides() -> None:
    """An engine restarted under the same (configured) instance id faster than a poll, so
    never seen unreachable nor under a new id, answers READY: routed again."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.request_drain("e0")
    registry.on_health("h:1", EngineState.DRAINING, 1.2)  # the engine drains
    registry.on_health("h:1", EngineState.READY, 3.0)  # a new process, the same id
    assert [r.engine_id for r in registry.routable()] == ["e0"]


def test_a_drain_of_an_unreachable_engine_leaves_it_unreachable_with_its_error() -> None:
    """Asking to drain is no health answer: the engine stays unreachable, its error and its
    backoff kept, while the drain that cannot reach it fails and is withdrawn."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.on_poll_failed("h:1", 1.0, "UNAVAILABLE: connection refused")
    registry.request_drain("e0")
    registry.withdraw_drain("h:1")
    record = registry.get("h:1")
    assert record.state is EngineState.UNREACHABLE
    assert record.last_error == "UNAVAILABLE: connection refused"
    assert record.num_failures == 1  # the backoff of its next failure (`on_poll_failed`)


def test_a_drain_the_engine_did_not_take_is_withdrawn() -> None:
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.request_drain("e0")
    registry.withdraw_drain("h:1")  # its Drain failed: UNAUTHENTICATED, unreachable, ...
    registry.on_health("h:1", EngineState.READY, 1.5)
    assert [r.engine_id for r in registry.routable()] == ["e0"]


def ready_registry(
    *addresses: str, policy: EjectionPolicy, hold_down: HoldDownPolicy | None = None
) -> Registry:
    registry = Registry(ejection=policy, hold_down=hold_down or HoldDownPolicy())
    for n, address in enumerate(addresses):
        registry.add(address)
        registry.on_identity(address, identity(f"e{n}"))
        registry.on_health(address, EngineState.READY, 0.0)
    return registry


def test_ejection_doubles_up_to_its_bound_and_a_new_process_starts_clean() -> None:
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(2, 10.0, 25.0))
    assert registry.on_request_failed("e0", 1.0, "INTERNAL: x") is None
    assert registry.on_request_failed("e0", 1.0, "INTERNAL: x") == 10.0
    assert [r.address for r in registry.routable()] == ["h:2"]
    registry.on_health("h:1", EngineState.READY, 5.0)  # its polls do not end it early
    assert registry.get("h:1").state is EngineState.EJECTED
    registry.on_health("h:1", EngineState.NOT_READY, 6.0, "warming up")
    assert registry.get("h:1").last_error == "warming up"
    registry.on_health("h:1", EngineState.READY, 7.0)
    assert registry.get("h:1").state is EngineState.EJECTED
    assert registry.error_of(registry.get("h:1")).startswith("2 requests failed in a row")
    durations = []
    for now_s in (11.0, 32.0, 58.0):
        registry.on_health("h:1", EngineState.READY, now_s)  # its time is up
        assert registry.get("h:1").routable
        durations.append(registry.on_request_failed("h:1", now_s, "INTERNAL: x"))
    assert durations == [20.0, 25.0, 25.0]
    # The same address, a new process (another instance id): its record starts clean.
    registry.on_identity("h:1", identity("e9"))
    registry.on_health("h:1", EngineState.READY, 60.0)
    assert registry.get("h:1").routable
    assert registry.on_request_failed("h:1", 61.0, "INTERNAL: x") is None


def test_a_served_request_clears_the_count_and_zero_never_ejects() -> None:
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(2))
    registry.on_request_failed("h:1", 1.0, "INTERNAL: x")
    registry.on_request_served("h:1")
    assert registry.on_request_failed("h:1", 2.0, "INTERNAL: x") is None
    never = ready_registry("h:1", "h:2", policy=EjectionPolicy(0))
    assert all(never.on_request_failed("h:1", 1.0, "x") is None for _ in range(50))


def test_an_ejected_engine_can_be_drained() -> None:
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(1))
    registry.on_request_failed("h:1", 1.0, "INTERNAL: x")
    assert registry.request_drain("h:1").state is EngineState.DRAINING
    registry.on_health("h:1", EngineState.DRAINING, 2.0)
    assert registry.get("h:1").state is EngineState.DRAINING


def test_requests_failing_while_it_is_down_do_not_count_toward_its_ejection() -> None:
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(2))
    # An outage of the same process (its polls time out): the streams it held fail.
    registry.on_poll_failed("h:1", 1.0, "DEADLINE_EXCEEDED: x", PollFailure.TIMED_OUT)
    for _ in range(5):
        assert registry.on_request_failed("h:1", 1.5, "UNAVAILABLE: unreachable") is None
    registry.on_health("h:1", EngineState.READY, 2.0)
    # Back: one failure is not yet `after_failures` in a row.
    assert registry.on_request_failed("h:1", 3.0, "INTERNAL: x") is None
    assert registry.get("h:1").routable
    assert registry.on_request_failed("h:1", 3.0, "INTERNAL: x") == 10.0


def test_the_last_engine_taking_traffic_is_never_ejected() -> None:
    registry = ready_registry("h:1", "h:2", "h:3", "h:4", policy=EjectionPolicy(1))
    registry.on_poll_failed("h:3", 1.0, "UNAVAILABLE: refused")
    registry.on_poll_failed("h:4", 1.0, "INTERNAL: broken", PollFailure.ERROR_ANSWER)
    assert registry.on_request_failed("h:1", 2.0, "INTERNAL: x") == 10.0
    # Half of the four engines, but all of those left to take the fleet's requests.
    assert registry.on_request_failed("h:2", 2.0, "INTERNAL: x") is None
    assert [r.address for r in registry.routable()] == ["h:2"]


def test_an_engine_failing_after_its_connection_came_back_is_new_once() -> None:
    """Lost, then answering its identity and failing its health (a new process starting):
    one new process, not one at every retry while it keeps failing."""
    registry = Registry()
    registry.add("h:1")
    registry.on_identity("h:1", identity("e0"))
    registry.on_health("h:1", EngineState.READY, 0.0)
    registry.on_poll_failed("h:1", 1.0, "UNAVAILABLE: refused", PollFailure.CONNECTION_LOST)
    epoch = registry.get("h:1").epoch
    answers = []
    for now_s in (2.0, 3.0, 4.0):
        answers.append(registry.on_identity("h:1", identity("e0")))
        registry.on_poll_failed("h:1", now_s, "INTERNAL: warming", PollFailure.ERROR_ANSWER)
    assert answers == [True, False, False]
    registry.on_health("h:1", EngineState.READY, 5.0)
    assert registry.get("h:1").epoch == epoch + 1
    # A later loss makes the next answer a new process again.
    registry.on_poll_failed("h:1", 6.0, "UNAVAILABLE: refused", PollFailure.CONNECTION_LOST)
    assert registry.on_identity("h:1", identity("e0")) is True


def test_a_cordoned_engine_does_not_make_room_for_ejecting_the_last_routable_one() -> None:
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(1))
    registry.set_cordoned("h:2", True)
    assert registry.on_request_failed("h:1", 1.0, "INTERNAL: x") is None
    assert [r.address for r in registry.routable()] == ["h:1"]


def test_a_request_served_while_ejected_does_not_end_its_probation() -> None:
    """A stream begun before the ejection and finished after it proves nothing of what failed
    since: the next failure after the ejection still ejects again, for twice as long."""
    registry = ready_registry("h:1", "h:2", "h:3", "h:4", policy=EjectionPolicy(2, 10.0))
    registry.on_request_failed("h:1", 1.0, "INTERNAL: x")
    assert registry.on_request_failed("h:1", 1.0, "INTERNAL: x") == 10.0
    registry.on_request_served("h:1")  # the stream it had been running
    registry.on_health("h:1", EngineState.READY, 12.0)
    assert registry.on_request_failed("h:1", 12.0, "INTERNAL: x") == 20.0


def _ready(registry: Registry, address: str, engine: EngineIdentity) -> None:
    registry.add(address)
    registry.on_identity(address, engine)
    registry.on_health(address, EngineState.READY, 0.0)


def test_engines_joining_and_leaving_are_listed_in_address_order_at_once() -> None:
    """The registry keeps its records sorted between joins and leaves (routing reads them at
    every request): each join or leave shows in the next listing."""
    registry = Registry()
    _ready(registry, "h:2", identity("e2"))
    _ready(registry, "h:1", identity("e1"))
    assert [r.address for r in registry.routable()] == ["h:1", "h:2"]
    _ready(registry, "h:0", identity("e0"))
    assert [r.address for r in registry.routable()] == ["h:0", "h:1", "h:2"]
    registry.remove("e1", 0.0)
    assert [r.address for r in registry.routable()] == ["h:0", "h:2"]
    listed = registry.records()
    listed.clear()  # a caller's list: the registry's own order is untouched
    assert [r.address for r in registry.records()] == ["h:0", "h:2"]


def test_any_routable_says_whether_routable_names_an_engine_of_the_role() -> None:
    """A fleet of one decode engine: a request takes the disaggregated path (no aggregated
    engine, a decode one); once the decode engine is cordoned, neither."""
    registry = Registry()
    _ready(registry, "h:1", dataclasses.replace(identity("d1"), role=Role.DECODE))
    assert not registry.any_routable(None, Role.AGGREGATED, generating=True)
    assert registry.any_routable(None, Role.DECODE, generating=True)
    assert registry.any_routable("m", Role.DECODE)
    assert not registry.any_routable("other", Role.DECODE)
    registry.set_cordoned("h:1", True)
    assert not registry.any_routable(None, Role.DECODE, generating=True)
    _ready(registry, "h:2", identity("a2"))
    assert registry.any_routable(None, Role.AGGREGATED, generating=True)
    assert [r.address for r in registry.routable(None, Role.AGGREGATED)] == ["h:2"]


def routable_at(registry: Registry, **kwargs: object) -> tuple[int, list[str]]:
    """The registry's version and the engines `routable` lists now (addresses)."""
    return registry.version, [r.address for r in registry.routable(**kwargs)]  # type: ignore[arg-type]


def test_every_change_of_routability_moves_the_version_and_shows_in_the_next_listing() -> None:
    """`routable` is kept between changes (every request asks it), and a plan's candidates
    are routed without a registry lookup each while the version stands: so every change
    that takes an engine into or out of routing moves the version, and the next listing
    shows it. A load report changes neither."""
    # h:2 leaves ready three times below: no hold-down, which would keep it out of the lists.
    registry = ready_registry(
        "h:1", "h:2", policy=EjectionPolicy(1, 10.0, 10.0), hold_down=HoldDownPolicy(0)
    )
    registry.add("h:3")
    registry.on_loras("h:1", frozenset())
    version, listed = routable_at(registry)
    assert listed == ["h:1", "h:2"]
    changes: list[tuple[Callable[[], object], list[str]]] = [
        (lambda: registry.set_cordoned("h:1", True), ["h:2"]),
        (lambda: registry.set_cordoned("h:1", False), ["h:1", "h:2"]),
        (lambda: registry.on_health("h:2", EngineState.NOT_READY, 1.0), ["h:1"]),
        (lambda: registry.on_health("h:2", EngineState.READY, 1.0), ["h:1", "h:2"]),
        (lambda: registry.request_drain("h:1"), ["h:2"]),
        (lambda: registry.on_identity("h:1", identity("e0-new")), ["h:2"]),
        (lambda: registry.on_health("h:1", EngineState.READY, 2.0), ["h:1", "h:2"]),
        (lambda: registry.on_poll_failed("h:2", 3.0, "gone"), ["h:1"]),
        (lambda: registry.on_identity("h:2", identity("e1")), ["h:1"]),
        (lambda: registry.on_health("h:2", EngineState.READY, 4.0), ["h:1", "h:2"]),
        (lambda: registry.on_request_failed("e1", 5.0, "INTERNAL: x"), ["h:1"]),
        (lambda: registry.on_health("h:2", EngineState.READY, 16.0), ["h:1", "h:2"]),
        (lambda: registry.on_new_instance("h:2", 16.0), ["h:1"]),
        (lambda: registry.on_identity("h:2", identity("e2")), ["h:1"]),
        (lambda: registry.on_health("h:2", EngineState.READY, 17.0), ["h:1", "h:2"]),
        (lambda: registry.mark_incompatible("h:2", "refused"), ["h:1"]),
        (lambda: registry.on_identity("h:3", identity("e3")), ["h:1"]),
        (lambda: registry.on_health("h:3", EngineState.READY, 18.0), ["h:1", "h:3"]),
        (lambda: registry.remove("h:1", 19.0), ["h:3"]),
    ]
    for change, expected in changes:
        change()
        now, listed = routable_at(registry)
        assert now > version and listed == expected, (now, version, listed, expected)
        version = now
    registry.on_load("h:3", LoadSnapshot(running_requests=3))
    registry.on_health("h:3", EngineState.READY, 19.0)  # no change of state
    assert routable_at(registry) == (version, ["h:3"])


def test_lora_changes_move_the_version_and_show_in_the_next_listing() -> None:
    registry = ready_registry("h:1", policy=EjectionPolicy())
    registry.on_loras("h:1", frozenset())
    version, listed = routable_at(registry, lora_name="x")
    assert listed == []
    changes: list[tuple[Callable[[], object], list[str]]] = [
        (lambda: registry.on_lora_loaded("h:1", "x"), ["h:1"]),
        (lambda: registry.on_lora_unloaded("h:1", "x"), []),
        (lambda: registry.on_loras("h:1", frozenset({"x"})), ["h:1"]),
        (lambda: registry.on_loras("h:1", frozenset({"x"}), conflicts=frozenset({"x"})), []),
    ]
    for change, expected in changes:
        change()
        now, listed = routable_at(registry, lora_name="x")
        assert now > version and listed == expected, (now, version, listed, expected)
        version = now


def serving(
    instance: str, *models: str, generates: bool = True, supports_lora: bool = False
) -> EngineIdentity:
    """An engine serving `models`, the first its default."""
    facts = ModelFacts(block_size=16, supports_lora=supports_lora, generates=generates)
    return dataclasses.replace(
        identity(instance), models=models, model_facts=(facts,) * len(models)
    )


def test_the_default_models_kept_follow_every_change_of_the_engines() -> None:
    """`base_models` (and so `default_model`) is kept between changes of the registry (a
    request naming no model asks it twice): every change of an engine's models, tasks, LoRA
    support or rejection, and every join or leave, shows in the next answer."""
    registry = Registry()
    _ready(registry, "h:1", serving("e1", "a", supports_lora=True))
    registry.add("h:2")

    def defaults() -> tuple[list[str], list[str], list[str]]:
        return (
            registry.base_models(),
            registry.base_models(generating=True),
            registry.base_models(lora=True),
        )

    assert defaults() == (["a"], ["a"], ["a"])
    changes: list[tuple[Callable[[], object], tuple[list[str], list[str], list[str]]]] = [
        (lambda: registry.on_identity("h:2", serving("e2", "b")), (["a", "b"], ["a", "b"], ["a"])),
        (lambda: registry.mark_incompatible("h:2", "refused"), (["a"], ["a"], ["a"])),
        (
            lambda: registry.on_identity("h:2", serving("e2", "b", generates=False)),
            (["a", "b"], ["a"], ["a"]),
        ),
        (
            lambda: registry.on_identity("h:2", serving("e2", "b", "a", supports_lora=True)),
            (["a", "b"], ["a", "b"], ["a", "b"]),
        ),
        (lambda: registry.on_identity("h:2", serving("e2", "a", "b")), (["a"], ["a"], ["a"])),
        (lambda: registry.remove("h:1", 19.0), (["a"], ["a"], [])),
        (lambda: _ready(registry, "h:3", serving("e3", "c")), (["a", "c"], ["a", "c"], [])),
    ]
    for change, expected in changes:
        change()
        assert defaults() == expected
    with pytest.raises(ModelRequiredError, match=r"\(a, c\)"):
        registry.default_model()


def test_the_routable_listings_kept_do_not_grow_with_the_models_requests_name() -> None:
    """An engine that lists no model serves any model a request names: the listings kept
    between changes stay bounded, and each is still right."""
    registry = Registry()
    _ready(registry, "h:1", dataclasses.replace(identity("e1"), models=(), model_facts=()))
    for n in range(3 * ROUTABLE_MEMO_SIZE):
        assert [r.address for r in registry.routable(f"model-{n}", generating=True)] == ["h:1"]


def test_what_is_derived_from_the_engines_is_kept_until_a_change_and_bounded() -> None:
    """A RegistryMemo (the registry's routable listings and served names, the gateway's
    bounds per model) derives a value once until the registry changes, None as any other
    (a model no engine names), and keeps ROUTABLE_MEMO_SIZE values at most: a request may
    name any model."""
    registry = Registry()
    derived: list[str] = []

    def derive(key: str) -> str | None:
        derived.append(key)
        return None if key == "unnamed" else key.upper()

    memo = RegistryMemo(registry, derive)
    value = memo.get

    assert [value("a"), value("a"), value("unnamed"), value("unnamed")] == ["A", "A", None, None]
    assert derived == ["a", "unnamed"]
    registry.add("h:1")  # a change
    assert value("a") == "A" and derived == ["a", "unnamed", "a"]
    keys = [f"model-{n}" for n in range(3 * ROUTABLE_MEMO_SIZE)]
    for key in keys:
        value(key)
    derived.clear()
    assert value(keys[-1]) == keys[-1].upper() and derived == []  # the latest is kept
    for key in keys:
        value(key)
    assert len(keys) - len(derived) <= ROUTABLE_MEMO_SIZE


def flapping_registry(policy: HoldDownPolicy, steady: int = 1) -> Registry:
    """h:1, which the tests flap, and `steady` engines more (h:2, ...), READY: a hold-down
    never holds out more than half of the fleet."""
    registry = Registry(hold_down=policy)
    for n in range(1, steady + 2):
        registry.add(f"h:{n}")
        registry.on_identity(f"h:{n}", identity(f"e{n}"))
        registry.on_health(f"h:{n}", EngineState.READY, 0.0)
    return registry


def flap(registry: Registry, now_s: float) -> None:
    """One poll NOT_READY, the next READY."""
    registry.on_health("h:1", EngineState.NOT_READY, now_s, "sick")
    registry.on_health("h:1", EngineState.READY, now_s + 1.0)


def test_an_engine_that_leaves_ready_once_is_back_at_its_first_ready_poll() -> None:
    registry = flapping_registry(HoldDownPolicy(3, 60.0, 10.0, 300.0, 3))
    registry.on_poll_failed("h:1", 1.0, "UNAVAILABLE: restarting")  # a restart
    registry.on_health("h:1", EngineState.STARTING, 2.0)
    registry.on_health("h:1", EngineState.READY, 3.0)
    assert registry.get("h:1").routable
    flap(registry, 100.0)  # a minute later: one in the window again
    assert registry.get("h:1").routable
    assert registry.get("h:1").num_flaps == 2


def test_a_flapping_engine_is_held_down_for_longer_at_each_flap_then_owes_ready_polls() -> None:
    registry = flapping_registry(HoldDownPolicy(3, 60.0, 10.0, 25.0, 2))
    record = registry.get("h:1")
    flap(registry, 1.0)
    flap(registry, 3.0)
    assert record.routable
    flap(registry, 5.0)  # the third within the window: held down once ready again
    assert record.state is EngineState.HELD_DOWN and not record.routable
    assert [r.address for r in registry.routable()] == ["h:2"]
    assert registry.error_of(record) == (
        "left ready 3 times in 60 s (hold-down 10 s); routable in 10 s and 2 more ready "
        "polls, if it stays ready"
    )
    registry.on_health("h:1", EngineState.READY, 15.9)
    assert record.state is EngineState.HELD_DOWN
    # A flap while held: held again, twice as long, from its next READY.
    flap(registry, 16.0)
    assert "hold-down 20 s" in registry.error_of(record)
    registry.on_health("h:1", EngineState.READY, 37.0)  # ready 20 s: the first poll owed
    assert record.state is EngineState.HELD_DOWN
    assert registry.error_of(record).endswith(
        "routable in 0 s and 1 more ready poll, if it stays ready"
    )
    registry.on_health("h:1", EngineState.READY, 38.0)
    assert record.routable and registry.error_of(record) == ""
    # Within a window of being put back, one flap holds it again: capped at 25 s.
    flap(registry, 50.0)
    assert record.state is EngineState.HELD_DOWN and "hold-down 25 s" in registry.error_of(record)
    registry.on_health("h:1", EngineState.READY, 76.0)
    registry.on_health("h:1", EngineState.READY, 77.0)
    assert record.routable
    # A whole window in routing after that clears its record: one flap is one flap again.
    flap(registry, 140.0)
    assert record.routable
    assert record.num_flaps == 6


def test_a_hold_down_is_logged_once_when_it_begins(caplog: pytest.LogCaptureFixture) -> None:
    registry = flapping_registry(HoldDownPolicy(3, 60.0, 10.0, 300.0, 2))
    with caplog.at_level(logging.WARNING, logger="controller.registry"):
        for now_s in (1.0, 3.0, 5.0):
            flap(registry, now_s)
        registry.on_health("h:1", EngineState.READY, 7.0)
    assert [r.getMessage() for r in caplog.records] == [
        "engine h:1 held down: left ready 3 times in 60 s; out of routing for 10 s once it "
        "says READY again, then 2 ready polls"
    ]


def test_a_new_process_keeps_the_hold_down_a_crash_loop_is_flapping() -> None:
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1))
    for now_s in (1.0, 3.0):
        registry.on_poll_failed("h:1", now_s, "UNAVAILABLE: crashed")
        registry.on_identity("h:1", identity("e1"))
        registry.on_health("h:1", EngineState.READY, now_s + 1.0)
    assert registry.get("h:1").state is EngineState.HELD_DOWN


def test_a_removed_engine_registered_again_takes_its_hold_down_back_within_a_window() -> None:
    """Registered again at its address within `window_s` of its removal, a held-down engine
    is held out at its first READY; a window later its record is gone."""
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1))
    flap(registry, 1.0)
    flap(registry, 3.0)
    assert registry.get("h:1").state is EngineState.HELD_DOWN
    for removed_s, registered_s, state in ((10.0, 69.0, EngineState.HELD_DOWN),
                                           (100.0, 160.0, EngineState.READY)):  # fmt: skip
        registry.remove("h:1", removed_s)
        record = registry.add("h:1", now_s=registered_s)
        registry.on_identity("h:1", identity("e1"))
        registry.on_health("h:1", EngineState.READY, registered_s)
        assert record.state is state
    assert registry.get("h:1").num_flaps == 0


def test_drains_and_cordons_are_no_flaps_and_a_drain_outranks_a_hold_down() -> None:
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1))
    record = registry.get("h:1")
    registry.set_cordoned("h:1", True)  # an operator restarts it while it is cordoned
    flap(registry, 1.0)
    flap(registry, 3.0)
    registry.set_cordoned("h:1", False)
    assert record.routable
    for now_s in (5.0, 7.0):  # it drains and comes back, twice
        registry.on_health("h:1", EngineState.DRAINING, now_s)
        registry.on_health("h:1", EngineState.NOT_READY, now_s + 0.5)
        registry.on_health("h:1", EngineState.READY, now_s + 1.0)
    assert record.routable and record.num_flaps == 0
    flap(registry, 10.0)
    flap(registry, 12.0)
    assert record.state is EngineState.HELD_DOWN
    registry.request_drain("h:1")
    assert registry.get("h:1").state is EngineState.DRAINING
    registry.on_health("h:1", EngineState.READY, 14.0)
    assert registry.get("h:1").state is EngineState.DRAINING


def test_hold_down_config_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("health: {hold_down_s: 30, hold_down_max_s: 20}\n")
    with pytest.raises(ConfigError, match=r"hold_down_max_s \(20\) is below hold_down_s \(30\)"):
        load_config(ControllerConfig, path)
    path.write_text("health: {hold_down_ready_polls: 0}\n")
    with pytest.raises(ConfigError, match="hold_down_ready_polls"):
        load_config(ControllerConfig, path)


def test_hold_down_off() -> None:
    registry = flapping_registry(HoldDownPolicy(0, 60.0, 10.0, 300.0, 1))
    for now_s in range(10):
        flap(registry, float(now_s * 2))
    assert registry.get("h:1").routable


def blip(registry: Registry, now_s: float, *addresses: str) -> None:
    """A poll of each engine fails (the controller's own polls time out), the next answers
    READY: every engine flaps at once."""
    for address in addresses:
        registry.on_poll_failed(address, now_s, "DEADLINE_EXCEEDED: slow", PollFailure.TIMED_OUT)
    for address in addresses:
        registry.on_health(address, EngineState.READY, now_s + 1.0)


def test_a_fleet_wide_blip_never_holds_down_more_than_half_of_the_engines() -> None:
    """Every engine flapping together (the controller's blip, not the engines'): held down,
    they would all be out of routing, every request refused while each says READY. Half are
    held out at most, the others routed with their hold-down running on; first out, the one
    that flapped most."""
    registry = flapping_registry(HoldDownPolicy(3, 60.0, 10.0, 300.0, 1), steady=2)
    engines = ("h:1", "h:2", "h:3")
    registry.on_health("h:3", EngineState.NOT_READY, 0.5)  # h:3 flapped once more
    registry.on_health("h:3", EngineState.READY, 0.7)
    for now_s in (1.0, 3.0, 5.0):
        blip(registry, now_s, *engines)
    assert [r.address for r in registry.routable()] == ["h:1", "h:2"]
    held = registry.get("h:3")
    assert held.state is EngineState.HELD_DOWN
    assert registry.error_of(held).startswith("left ready 4 times in 60 s (hold-down 20 s)")
    for address in ("h:1", "h:2"):
        routed = registry.get(address)
        assert routed.state is EngineState.READY and routed.hold_s == 10.0
        assert registry.error_of(routed).startswith(
            "held down but routed: more than half of the engines taking traffic would be out "
            "of routing otherwise; left ready 3 times in 60 s (hold-down 10 s); hold-down over in "
        )
    # Their hold-downs run on: once over, no error is left; h:3's, twice as long, after.
    for now_s in (16.0, 17.0):
        for address in engines:
            registry.on_health(address, EngineState.READY, now_s)
    assert [r.address for r in registry.routable()] == ["h:1", "h:2"]
    assert registry.error_of(registry.get("h:1")) == registry.error_of(registry.get("h:2")) == ""
    for now_s in (26.0, 27.0):
        registry.on_health("h:3", EngineState.READY, now_s)
    assert [r.address for r in registry.routable()] == list(engines)
    assert all(registry.error_of(r) == "" for r in registry.records())
    # The routed ones were on probation all the same: a flap within the window holds again.
    blip(registry, 20.0, "h:1")
    assert registry.get("h:1").state is EngineState.HELD_DOWN


def test_ties_between_held_down_engines_are_decided_by_address() -> None:
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1), steady=3)
    engines = ("h:1", "h:2", "h:3", "h:4")
    for now_s in (1.0, 3.0):
        blip(registry, now_s, *engines)
    assert [r.address for r in registry.routable()] == ["h:3", "h:4"]
    assert registry.get("h:1").state is EngineState.HELD_DOWN
    assert registry.get("h:2").state is EngineState.HELD_DOWN


def test_ejection_and_hold_down_share_one_cap_ejection_first() -> None:
    """Four engines, two held down: an engine failing its requests is ejected all the same
    (it fails requests now; the held-down ones only flapped), and one held-down engine is
    routed instead: never more than two of the four out of routing."""
    registry = Registry(
        hold_down=HoldDownPolicy(2, 60.0, 10.0, 300.0, 1), ejection=EjectionPolicy(1)
    )
    for n in range(1, 5):
        registry.add(f"h:{n}")
        registry.on_identity(f"h:{n}", identity(f"e{n}"))
        registry.on_health(f"h:{n}", EngineState.READY, 0.0)
    registry.on_health("h:2", EngineState.NOT_READY, 0.5)  # h:2 flapped once more
    registry.on_health("h:2", EngineState.READY, 0.7)
    for now_s in (1.0, 3.0):
        blip(registry, now_s, "h:1", "h:2")
    assert [r.address for r in registry.routable()] == ["h:3", "h:4"]
    assert registry.on_request_failed("h:4", 5.0, "INTERNAL: x") == 10.0
    assert registry.get("h:2").state is EngineState.HELD_DOWN
    assert [r.address for r in registry.routable()] == ["h:1", "h:3"]
    # A second ejection routes the other held-down engine too; then half the fleet is out,
    # ejected: no further ejection.
    assert registry.on_request_failed("h:3", 5.0, "INTERNAL: x") == 10.0
    assert [r.address for r in registry.routable()] == ["h:1", "h:2"]
    assert registry.on_request_failed("h:1", 5.0, "INTERNAL: x") is None


def test_a_held_down_engine_is_routed_when_the_rest_of_the_fleet_leaves_traffic() -> None:
    """Cordoning (or losing) the steady engine leaves the held-down one the last that says
    READY: routed at once, without waiting for its next poll."""
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1))
    flap(registry, 1.0)
    flap(registry, 3.0)
    assert registry.get("h:1").state is EngineState.HELD_DOWN
    registry.set_cordoned("h:2", True)
    assert [r.address for r in registry.routable()] == ["h:1"]
    registry.set_cordoned("h:2", False)
    assert [r.address for r in registry.routable()] == ["h:2"]
    registry.on_poll_failed("h:2", 5.0, "UNAVAILABLE: refused")
    assert [r.address for r in registry.routable()] == ["h:1"]
    assert registry.error_of(registry.get("h:1")).startswith("held down but routed: ")


def test_a_held_down_engine_routed_by_the_cap_is_counted_once_whatever_its_health() -> None:
    """Routed by the cap (the only engine taking traffic), its health turning DEGRADED and
    READY again keeps it routed: one routing by the cap counted, not one per change."""
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1), steady=0)
    flap(registry, 1.0)
    flap(registry, 3.0)
    record = registry.get("h:1")
    assert record.state is EngineState.READY and record.hold_s == 10.0
    assert registry.routed_by_cap[CAPPED_HOLD_DOWN] == 1
    for now_s, state in ((5.0, EngineState.DEGRADED), (6.0, EngineState.READY)):
        registry.on_health("h:1", state, now_s)
        assert record.state is state and record.routable
        assert registry.error_of(record).startswith("held down but routed: ")
    assert registry.routed_by_cap[CAPPED_HOLD_DOWN] == 1


def test_ejected_engines_are_routed_again_when_the_rest_of_the_fleet_leaves_traffic() -> None:
    """Two of four engines ejected, then the others go down or drain: the ejected ones
    would be more than half of those taking traffic. The cap is decided again at once, not
    only when an engine is ejected: the one whose ejection ends soonest is routed, its
    ejection running on, and held out again once the fleet is back."""
    registry = ready_registry("h:1", "h:2", "h:3", "h:4", policy=EjectionPolicy(2, 10.0, 60.0))
    for address, now_s in (("h:2", 1.0), ("h:1", 2.0)):  # h:2's ejection ends first
        registry.on_request_failed(address, now_s, "INTERNAL: x")
        assert registry.on_request_failed(address, now_s, "INTERNAL: x") == 10.0
    assert [r.address for r in registry.routable()] == ["h:3", "h:4"]
    registry.on_poll_failed("h:3", 3.0, "UNAVAILABLE: refused")
    assert [r.address for r in registry.routable()] == ["h:2", "h:4"]
    routed = registry.get("h:2")
    assert routed.state is EngineState.READY
    assert registry.error_of(routed) == (
        "ejected but routed: more than half of the engines taking traffic would be out of "
        "routing otherwise; 2 requests failed in a row (last: INTERNAL: x); ejection over in 8 s"
    )
    assert registry.get("h:1").state is EngineState.EJECTED
    registry.on_health("h:4", EngineState.DRAINING, 3.5)  # h:1 and h:2 left: one may be out
    assert [r.address for r in registry.routable()] == ["h:2"]
    registry.on_poll_failed("h:1", 4.0, "UNAVAILABLE: refused")  # h:2 alone: never out
    assert [r.address for r in registry.routable()] == ["h:2"]
    assert registry.routed_by_cap[CAPPED_EJECTION] == 1
    # The fleet back within h:2's ejection: it is out again, until its time is up.
    for address in ("h:1", "h:3", "h:4"):
        registry.on_health(address, EngineState.READY, 5.0)
    assert [r.address for r in registry.routable()] == ["h:3", "h:4"]
    assert registry.get("h:2").state is EngineState.EJECTED
    assert registry.error_of(routed) == (
        "2 requests failed in a row (last: INTERNAL: x); out of routing for 10 s"
    )
    registry.on_health("h:2", EngineState.READY, 11.0)
    assert [r.address for r in registry.routable()] == ["h:2", "h:3", "h:4"]


def test_an_ejection_the_cap_routes_past_ends_at_any_answer_after_its_time() -> None:
    """The cap's decision stands between changes of the fleet, but not past the end of an
    ejection it routes past: the first answer recorded after it (another engine's, which
    changes nothing of the fleet) finds it over, and the engine is routed for good."""
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(1, 10.0, 60.0))
    assert registry.on_request_failed("h:1", 1.0, "INTERNAL: x") == 10.0  # until 11 s
    registry.on_poll_failed("h:2", 2.0, "UNAVAILABLE: refused")  # h:1 routed by the cap
    assert registry.error_of(registry.get("h:1")).startswith("ejected but routed: ")
    registry.on_poll_failed("h:2", 12.0, "UNAVAILABLE: refused")  # the same state
    assert registry.get("h:1").ejected_until_s is None
    assert registry.error_of(registry.get("h:1"), 12.0) == ""


def test_a_cordoned_ejected_engine_neither_counts_as_ejected_nor_as_taking_traffic() -> None:
    """A cordoned engine takes no traffic, ejected or not: of the two engines left taking
    it, one may be ejected, as of any two."""
    registry = ready_registry("h:1", "h:2", "h:3", policy=EjectionPolicy(1))
    assert registry.on_request_failed("h:1", 1.0, "INTERNAL: x") == 10.0
    registry.set_cordoned("h:1", True)  # an operator looks into it
    assert registry.on_request_failed("h:2", 2.0, "INTERNAL: x") == 10.0
    assert [r.address for r in registry.routable()] == ["h:3"]
    assert registry.routed_by_cap[CAPPED_EJECTION] == 0
    # Uncordoned within its ejection: two of three would be out, so the one whose ejection
    # ends soonest is routed.
    registry.set_cordoned("h:1", False)
    assert [r.address for r in registry.routable()] == ["h:1", "h:3"]
    assert registry.routed_by_cap[CAPPED_EJECTION] == 1


def test_an_ejected_engine_routed_by_the_cap_stays_routed_once_its_ejection_is_over() -> None:
    """Routed by the cap while the rest of the fleet was down, an ejected engine is not held
    out again when the fleet comes back after its ejection ended, before its own next poll:
    routed for good once it is over."""
    registry = ready_registry("h:1", "h:2", policy=EjectionPolicy(1, 10.0, 60.0))
    assert registry.on_request_failed("h:1", 1.0, "INTERNAL: x") == 10.0  # until 11 s
    registry.on_poll_failed("h:2", 2.0, "UNAVAILABLE: refused")
    registry.on_health("h:1", EngineState.READY, 10.5)  # routed by the cap, still ejected
    assert [r.address for r in registry.routable()] == ["h:1"]
    registry.on_health("h:2", EngineState.READY, 12.0)  # h:1's ejection is over
    assert [r.address for r in registry.routable()] == ["h:1", "h:2"]
    assert registry.error_of(registry.get("h:1")) == ""
    assert registry.routed_by_cap[CAPPED_EJECTION] == 1


@pytest.mark.parametrize("spell", ["drained", "cordoned", "redeployed under its instance id"])
def test_a_hold_downs_ready_time_starts_again_after_any_spell_not_ready(spell: str) -> None:
    """A held-down engine that drains, or leaves ready while cordoned, or is taken as a new
    process under its instance id (no flap any of them), is held until it has said READY for
    its hold-down without a break since."""
    registry = flapping_registry(HoldDownPolicy(2, 60.0, 10.0, 300.0, 1))
    record = registry.get("h:1")
    flap(registry, 1.0)
    flap(registry, 3.0)  # held down, READY since 4 s
    assert record.state is EngineState.HELD_DOWN
    if spell == "drained":
        registry.on_health("h:1", EngineState.DRAINING, 6.0)
        registry.on_health("h:1", EngineState.NOT_READY, 7.0)
    elif spell == "redeployed under its instance id":  # a new process, no flap
        registry.on_new_instance("h:1", 6.0, same_instance=True)
        registry.on_identity("h:1", identity("e1"), restarted=True)  # READY at once, below
    else:
        registry.set_cordoned("h:1", True)
        registry.on_health("h:1", EngineState.NOT_READY, 6.0)
        registry.on_poll_failed("h:1", 7.0, "UNAVAILABLE: restarting")
        registry.set_cordoned("h:1", False)
    assert record.num_flaps == 2
    registry.on_health("h:1", EngineState.READY, 15.0)  # 11 s after its first READY
    assert record.state is EngineState.HELD_DOWN
    assert registry.error_of(record).startswith(
        "left ready 2 times in 60 s (hold-down 10 s); routable in 10 s"
    )
    registry.on_health("h:1", EngineState.READY, 25.0)
    assert record.routable


def test_hold_down_after_one_flap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("health: {hold_down_after_flaps: 1}\n")
    with pytest.raises(
        ConfigError, match=r"hold_down_after_flaps must be 0 \(never\) or at least 2"
    ):
        load_config(ControllerConfig, path)
    for flaps in (0, 2):
        path.write_text(f"health: {{hold_down_after_flaps: {flaps}}}\n")
        assert load_config(ControllerConfig, path).health.hold_down_after_flaps == flaps
