"""The engine config's cross-field checks: `kv_transfer.*` only on PREFILL/DECODE engines
(an AGGREGATED engine never moves KV, so the keys would be ignored), and the shipped configs
still load. `runner: pooling`'s checks are in test_server_pooling_runner.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from kvplane.config import load_config, validate_config
from kvplane.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("session_ttl_s", 5.0),
        ("pull_timeout_s", 60.0),  # the default's value, still set by hand
        ("peer_token_file", "/run/token"),
        ("peer_tls", {}),
    ],
)
def test_kv_transfer_keys_on_an_aggregated_engine_are_refused(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(EngineConfig, {"kv_transfer": {key: value}}, "engine.yaml")
    message = str(err.value)
    assert f"kv_transfer.{key} applies to PREFILL and DECODE engines only" in message
    assert "role: prefill or role: decode" in message and "\n" not in message


def test_the_role_flag_is_named_when_it_makes_the_engine_aggregated() -> None:
    data = {"role": "aggregated", "kv_transfer": {"session_ttl_s": 5.0}}
    with pytest.raises(ConfigError, match=r"with --role: .*kv_transfer\.session_ttl_s"):
        validate_config(EngineConfig, data, "engine.yaml", frozenset({"role"}))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_transfer_keys_on_prefill_and_decode_engines_are_accepted(role: str) -> None:
    config = EngineConfig(role=role, kv_transfer={"session_ttl_s": 5.0, "pull_timeout_s": 3.0})
    assert config.kv_transfer.session_ttl_s == 5.0


def test_an_empty_kv_transfer_section_sets_nothing_and_is_accepted() -> None:
    assert EngineConfig(kv_transfer={}).kv_transfer.session_ttl_s == 60.0


@pytest.mark.parametrize("name", ["engine-sim.yaml", "engine-tiny-llama.yaml"])
def test_the_shipped_engine_configs_load(name: str) -> None:
    load_config(EngineConfig, REPO / "configs" / name)
