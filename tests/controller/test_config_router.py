"""The controller's router settings reach the router that decides; a value of the wrong type
in any controller setting is an error naming its key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from controller.config import ControllerConfig, RouterConfig
from controller.router import BusyThresholds, KvplaneWeights
from controller.router.policies import KvplanePolicy
from controller.service import Controller
from kvplane.config import load_config, validate_config
from kvplane.errors import ConfigError


def test_every_kvplane_weight_is_a_router_setting() -> None:
    """A new cost term must be configurable, with the policy's default as its default."""
    defaults = RouterConfig()
    for field in dataclasses.fields(KvplaneWeights):
        assert getattr(defaults, field.name) == field.default, field.name
    assert defaults.weights() == KvplaneWeights()


def test_configured_weights_reach_the_controllers_policy(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "router:\n"
        "  policy: kvplane\n"
        "  overlap_weight: 7\n"
        "  idle_overlap_weight: 21\n"
        "  queue_knee: 0\n"
        "  pass_tokens: 4096\n"
        "  pass_decodes: 2\n"
        "  tie_tokens: 16\n"
        "  patience_tokens: 60000\n"
    )
    controller = Controller(load_config(ControllerConfig, path))
    policy = controller.router.policy
    assert isinstance(policy, KvplanePolicy)
    assert policy.weights == dataclasses.replace(
        KvplaneWeights(),
        overlap_weight=7.0,
        idle_overlap_weight=21.0,
        queue_knee=0.0,
        pass_tokens=4096.0,
        pass_decodes=2,
        tie_tokens=16.0,
        patience_tokens=60_000.0,
    )


@pytest.mark.parametrize(
    "setting",
    [
        "idle_overlap_weight: -1",
        "queue_knee: -5",
        "pass_tokens: -1",
        "pass_decodes: -1",
        "patience_tokens: -1",
    ],
)
def test_negative_weights_are_rejected(tmp_path: Path, setting: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"router: {{{setting}}}\n")
    with pytest.raises(ConfigError, match=setting.split(":", maxsplit=1)[0]):
        load_config(ControllerConfig, path)


def test_busy_settings_reach_the_router(tmp_path: Path) -> None:
    assert RouterConfig().busy() == BusyThresholds()  # the router's defaults are the config's
    path = tmp_path / "c.yaml"
    path.write_text(
        "router: {busy_kv_usage: 0.9, busy_queued_requests: 4, busy_max_fraction: 0.5}\n"
    )
    controller = Controller(load_config(ControllerConfig, path))
    assert controller.router.busy == BusyThresholds(0.9, 4, 0.5)


def test_a_busy_fraction_above_one_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("router: {busy_max_fraction: 1.5}\n")
    with pytest.raises(ConfigError, match="busy_max_fraction"):
        load_config(ControllerConfig, path)


def test_hot_prefix_requests_is_off_at_0_and_from_2_up(tmp_path: Path) -> None:
    """`router.hot_prefix_requests`: 0 turns the rule off, 2 or more sharers make a prefix
    hot; 1 (which divides by one, changing nothing, as 2 would behave) and negative numbers
    are refused with the reason."""
    path = tmp_path / "c.yaml"
    for value in (0, 2, 1_000_000):
        path.write_text(f"router: {{hot_prefix_requests: {value}}}\n")
        weights = load_config(ControllerConfig, path).router.weights()
        assert weights.hot_prefix_requests == value
    path.write_text("router: {hot_prefix_requests: 1}\n")
    with pytest.raises(ConfigError, match="hot_prefix_requests 1 divides the overlap weight"):
        load_config(ControllerConfig, path)
    for bad in ("-1", "1.5", "two"):
        path.write_text(f"router: {{hot_prefix_requests: {bad}}}\n")
        with pytest.raises(ConfigError, match="hot_prefix_requests"):
            load_config(ControllerConfig, path)


def test_rejecting_when_all_busy_is_off_by_default_and_needs_a_busy_threshold(
    tmp_path: Path,
) -> None:
    assert RouterConfig().reject_when_all_busy is False
    path = tmp_path / "c.yaml"
    path.write_text("router: {reject_when_all_busy: true, busy_queued_requests: 4}\n")
    assert Controller(load_config(ControllerConfig, path)).sheds_load
    path.write_text("router: {reject_when_all_busy: true, busy_kv_usage: null}\n")
    with pytest.raises(ConfigError, match="reject_when_all_busy needs busy_kv_usage or"):
        load_config(ControllerConfig, path)
    path.write_text("router: {reject_when_all_busy: maybe}\n")
    with pytest.raises(ConfigError, match="reject_when_all_busy"):
        load_config(ControllerConfig, path)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        # Lax pydantic took these: "yes" as true, `true` as 1 s, "5" as 5.
        (
            {"router": {"reject_when_all_busy": "yes"}},
            "router.reject_when_all_busy: Input should be a valid boolean",
        ),
        ({"router": {"replica_sync": 1}}, "router.replica_sync: Input should be a valid boolean"),
        (
            {"health": {"poll_interval_s": True}},
            "health.poll_interval_s: Input should be a valid number",
        ),
        ({"router": {"pass_decodes": "5"}}, "router.pass_decodes: Input should be a valid integer"),
        ({"router": {"seed": True}}, "router.seed: Input should be a valid integer"),
        (
            {"router": {"overlap_weight": "1.5"}},
            "router.overlap_weight: Input should be a valid number",
        ),
        (
            {"health": {"eject_after_failures": 5.0}},
            "health.eject_after_failures: Input should be a valid integer",
        ),
        ({"lora_timeout_s": "30"}, "lora_timeout_s: Input should be a valid number"),
        ({"tokenize_max_chars": True}, "tokenize_max_chars: Input should be a valid integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_not_a_coercion(
    data: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_config(ControllerConfig, data, "controller.yaml")
    assert f"invalid config in controller.yaml: {problem}" in str(caught.value)


def test_yamls_own_booleans_and_numbers_load(tmp_path: Path) -> None:
    """A whole number is a float setting's too; enums and paths are read from strings."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "router: {reject_when_all_busy: true, busy_queued_requests: 4, overlap_weight: 2}\n"
        "health: {poll_interval_s: 2, eject_after_failures: 3}\n"
        "engines: [{address: '127.0.0.1:9000', kv_events: zmq}]\n"
        "tokenizer: /models/tokenizer.json\n"
    )
    config = load_config(ControllerConfig, path)
    assert config.router.reject_when_all_busy is True
    assert (config.router.overlap_weight, config.health.poll_interval_s) == (2.0, 2.0)
    assert config.health.eject_after_failures == 3
    assert config.engines[0].kv_events == "zmq"
    assert config.tokenizer == Path("/models/tokenizer.json")


@pytest.mark.parametrize(
    ("data", "wait_s"),
    [
        ({}, 2.0),  # twice the default health poll
        ({"health": {"poll_interval_s": 5}}, 10.0),
        ({"router": {"prefill_wait_s": 0.25}, "health": {"poll_interval_s": 5}}, 0.25),
        ({"router": {"prefill_wait_s": 0}}, 0.0),  # no wait
    ],
)
def test_the_wait_for_a_prefill_engine_defaults_to_twice_the_health_poll(
    data: dict[str, object], wait_s: float
) -> None:
    controller = Controller(validate_config(ControllerConfig, data, "controller.yaml"))
    assert controller.prefill_wait_s == wait_s


def test_a_negative_wait_for_a_prefill_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"router\.prefill_wait_s"):
        validate_config(ControllerConfig, {"router": {"prefill_wait_s": -1}}, "controller.yaml")
