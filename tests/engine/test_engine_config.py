"""The engine config's cross-field checks: each `kv_transfer.*` key only on the role that reads
it (an AGGREGATED engine never moves KV, a DECODE engine holds no sessions, a PREFILL engine
pulls none, so the key would be ignored); no bind wildcard as the advertised host; the
admission bound (`max_queued_requests`) off unless set, and then positive; `generation_config`
auto unless set to none (its effect: test_server_generation_config.py); `sim:` on the sim
runner only.
`runner: pooling`'s checks are in test_server_pooling_runner.py; the shipped configs load in
tests/foundation/."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.config import EngineConfig, KvTransferConfig
from kvplane.cli import app
from kvplane.config import validate_config
from kvplane.errors import ConfigError

KEYS = [
    ("session_ttl_s", 5.0, "prefill"),
    ("pull_timeout_s", 30.0, "decode"),  # the default's value, still set by hand
    ("max_held_kv_bytes", 0, "decode"),
    ("peer_token_file", "/run/token", "decode"),
    ("peer_tls", {}, "decode"),
]


@pytest.mark.parametrize(("key", "value", "reader"), KEYS)
@pytest.mark.parametrize("role", ["aggregated", "prefill", "decode"])
def test_kv_transfer_keys_are_refused_on_the_roles_that_ignore_them(
    key: str, value: object, reader: str, role: str
) -> None:
    data: dict[str, object] = {"role": role, "kv_transfer": {key: value}}
    if role == reader:
        config = validate_config(EngineConfig, data, "engine.yaml")
        assert key in config.kv_transfer.model_fields_set
        return
    with pytest.raises(ConfigError) as err:
        validate_config(EngineConfig, data, "engine.yaml")
    message = str(err.value)
    assert f"kv_transfer.{key} applies to {reader.upper()} engines only" in message
    assert f"role: {reader}" in message and "\n" not in message


def test_every_kv_transfer_key_names_the_role_that_reads_it() -> None:
    assert set(KvTransferConfig.ROLE_OF_KEY) == set(KvTransferConfig.model_fields)
    assert {key for key, _, _ in KEYS} == set(KvTransferConfig.model_fields)


def test_the_role_flag_is_named_when_it_makes_the_engine_aggregated() -> None:
    """The file's `role: prefill` replaced by `--role aggregated`; a file without a role
    fails alone (the default is aggregated), and no flag is named."""
    data: dict[str, object] = {"role": "aggregated", "kv_transfer": {"session_ttl_s": 5.0}}
    with pytest.raises(ConfigError, match=r"with --role: .*kv_transfer\.session_ttl_s"):
        validate_config(
            EngineConfig, data, "engine.yaml", frozenset({"role"}), under_flags={"role": "prefill"}
        )
    with pytest.raises(ConfigError, match=r"^invalid config in engine.yaml: kv_transfer\."):
        validate_config(EngineConfig, data, "engine.yaml", frozenset({"role"}))


def test_an_empty_kv_transfer_section_sets_nothing_and_is_accepted() -> None:
    config = EngineConfig.model_validate({"kv_transfer": {}})
    assert config.kv_transfer.session_ttl_s == 60.0


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "::", "[::]"])
def test_a_bind_wildcard_is_refused_as_the_advertised_host(wildcard: str) -> None:
    """The seed: a KV event source's endpoint_addr is a routable host:port, never a bind
    wildcard; a configured one would be advertised as it is."""
    data: dict[str, object] = {"kv_events": {"advertised_host": wildcard}}
    with pytest.raises(ConfigError) as err:
        validate_config(EngineConfig, data, "engine.yaml")
    message = str(err.value)
    assert "kv_events.advertised_host" in message and "bind wildcard" in message
    assert "\n" not in message
    assert validate_config(EngineConfig, {"kv_events": {"advertised_host": "10.0.0.7"}}, "e.yaml")


@pytest.mark.parametrize("which", ["endpoint", "replay_endpoint"])
def test_an_ipv6_advertised_host_is_refused_for_zmq_on_ipv4_only(which: str) -> None:
    """ZMQ on 0.0.0.0 listens on IPv4 only: advertised at a configured IPv6 address, no
    consumer could reach it."""
    kv_events = {"zmq_enabled": True, which: "tcp://0.0.0.0:5557", "advertised_host": "fd00::1"}
    with pytest.raises(ConfigError) as err:
        validate_config(EngineConfig, {"kv_events": kv_events}, "engine.yaml")
    message = str(err.value)
    assert f"kv_events.{which} tcp://0.0.0.0:5557 listens on IPv4 only" in message
    assert "\n" not in message
    for fine in ({"advertised_host": "10.0.0.7"}, {which: "tcp://*:5557"}):
        assert validate_config(EngineConfig, {"kv_events": {**kv_events, **fine}}, "e.yaml")


def test_the_admission_bound_is_off_by_default_and_positive_when_set() -> None:
    assert EngineConfig().max_queued_requests is None
    assert EngineConfig(max_queued_requests=1).max_queued_requests == 1
    with pytest.raises(ConfigError, match="max_queued_requests") as err:
        validate_config(EngineConfig, {"max_queued_requests": 0}, "engine.yaml")
    assert "\n" not in str(err.value)


def test_generation_config_is_auto_by_default_and_takes_auto_or_none() -> None:
    assert EngineConfig().generation_config == "auto"
    config = validate_config(EngineConfig, {"generation_config": "none"}, "engine.yaml")
    assert config.generation_config == "none"
    # vLLM's own word for its fixed defaults is not one of kvplane's.
    with pytest.raises(ConfigError) as err:
        validate_config(EngineConfig, {"generation_config": "vllm"}, "engine.yaml")
    assert str(err.value) == (
        "invalid config in engine.yaml: generation_config: Input should be 'auto' or 'none'"
    )


def test_a_bracketed_ipv6_advertised_host_is_the_address_itself() -> None:
    """Advertised as `[fd00::1]:PORT`, not `[[fd00::1]]:PORT`."""
    config = validate_config(
        EngineConfig, {"kv_events": {"advertised_host": "[fd00::1]"}}, "e.yaml"
    )
    assert config.kv_events.advertised_host == "fd00::1"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        # Lax pydantic took these: "yes" as true, `true` as 1, "16" as 16.
        ({"lora": {"enabled": "yes"}}, "lora.enabled: Input should be a valid boolean"),
        (
            {"kv_events": {"zmq_enabled": 1}},
            "kv_events.zmq_enabled: Input should be a valid boolean",
        ),
        ({"block_size": True}, "block_size: Input should be a valid integer"),
        ({"max_num_seqs": "64"}, "max_num_seqs: Input should be a valid integer"),
        ({"num_kv_blocks": 1024.0}, "num_kv_blocks: Input should be a valid integer"),
        ({"sim": {"time_scale": "0"}}, "sim.time_scale: Input should be a valid number"),
        (
            {"sim": {"prefill_ms_coeffs": [1, True, 0]}},
            "sim.prefill_ms_coeffs.1: Input should be a valid number",
        ),
        (
            {"role": "prefill", "kv_transfer": {"session_ttl_s": True}},
            "kv_transfer.session_ttl_s: Input should be a valid number",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_not_a_coercion(
    data: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(EngineConfig, data, "engine.yaml")
    assert f"invalid config in engine.yaml: {problem}" in str(err.value)


def test_yamls_own_booleans_and_numbers_load() -> None:
    """A whole number is a float setting's too; enums are read from strings."""
    config = validate_config(
        EngineConfig,
        {
            "role": "prefill",
            "block_size": 32,
            "lora": {"enabled": True},
            "sim": {"time_scale": 0, "prefill_ms_coeffs": [1, 0.5, 0]},
            "kv_transfer": {"session_ttl_s": 5},
        },
        "engine.yaml",
    )
    assert (config.role, config.block_size, config.lora.enabled) == ("prefill", 32, True)
    assert config.sim.prefill_ms_coeffs == (1.0, 0.5, 0.0)
    assert config.kv_transfer.session_ttl_s == 5.0


@pytest.mark.parametrize("model", ["builtin", "checkpoint"])
@pytest.mark.timeout(60)  # the old code served the builtin model, for good
def test_engine_serve_refuses_sim_settings_for_a_torch_model(tmp_path: Path, model: str) -> None:
    """`sim:` configures the sim runner only: beside a torch model (builtin, a checkpoint) it
    would do nothing, so `kvplane engine serve` refuses it before anything loads (it was
    silently ignored: an engine meant to be slowed down or given an EOS ran unchanged)."""
    if model == "checkpoint":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        model = str(tmp_path / "model")
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: '{model}'\nsim: {{time_scale: 0, eos_after: 4}}\n")
    result = CliRunner().invoke(app, ["engine", "serve", "--config", str(config)])
    assert result.exit_code == 1
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == (
        f"invalid config in {config}: sim applies only to model: sim (the sim runner), not to"
        f" the torch model {model!r} (sim.time_scale, sim.eos_after given): remove sim, or set"
        " model: sim"
    )


def test_sim_defaults_pass_beside_a_torch_model_and_a_model_flag_is_named() -> None:
    """A template that writes every key at its default asks for nothing left undone; a
    `--model` that makes the file's `sim:` useless is named."""
    data: dict[str, object] = {"model": "builtin", "sim": {"time_scale": 1.0, "vocab_size": 32000}}
    assert validate_config(EngineConfig, data, "engine.yaml").model == "builtin"
    with pytest.raises(ConfigError, match=r"with --model: sim applies only to model: sim"):
        validate_config(
            EngineConfig,
            {"model": "builtin", "sim": {"time_scale": 0}},
            "engine.yaml",
            frozenset({"model"}),
            under_flags={"model": "sim"},
        )
