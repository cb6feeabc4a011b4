"""YAML config loading shared by every server."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplane.config import (
    CONFIG_KINDS,
    ServerConfig,
    load_config,
    parse_dial_target,
    parse_host_port,
)
from kvplane.errors import CommandLineError, ConfigError


def test_embedded_defaults_without_a_file() -> None:
    assert load_config(ServerConfig, None).listen == "127.0.0.1:0"


def test_cli_listen_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listen: 127.0.0.1:7000\nshutdown_grace_s: 1.5\n")
    config = load_config(ServerConfig, path, {"listen": "0.0.0.0:7001"})
    assert (config.listen, config.shutdown_grace_s) == ("0.0.0.0:7001", 1.5)
    assert load_config(ServerConfig, path, {"listen": None}).listen == "127.0.0.1:7000"


def test_a_bad_flag_value_is_blamed_on_the_flag_and_a_bad_file_value_on_the_file(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(ServerConfig, None, {"listen": "nonsense", "metrics_listen": None})
    assert str(caught.value) == (
        "invalid --listen: expected HOST:PORT ([ADDRESS]:PORT for IPv6), got 'nonsense'"
    )
    path = tmp_path / "c.yaml"
    path.write_text("listen: nonsense\nshutdown_grace_s: -1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(ServerConfig, path, {"metrics_listen": "h:x"})
    message = str(caught.value)
    assert message.startswith(f"invalid config in {path}: listen: expected")
    assert "; shutdown_grace_s: Input should be greater than or equal to 0; " in message
    assert "; invalid --metrics-listen: expected HOST:PORT" in message


def test_what_the_command_line_got_wrong_is_told_apart_from_the_file(tmp_path: Path) -> None:
    """A command reports a CommandLineError as a usage error naming `param_hint`, any other
    ConfigError as a bad config file."""
    with pytest.raises(CommandLineError) as caught:
        load_config(ServerConfig, None, {"listen": "nonsense"})
    assert caught.value.param_hint == "--listen"
    assert caught.value.problem == ("expected HOST:PORT ([ADDRESS]:PORT for IPv6), got 'nonsense'")
    missing = tmp_path / "absent.yaml"
    with pytest.raises(CommandLineError) as caught:
        load_config(ServerConfig, missing, {"listen": "127.0.0.1:0"})
    assert caught.value.param_hint == "--config"
    assert caught.value.problem == f"cannot read config {missing}: No such file or directory"
    path = tmp_path / "c.yaml"
    for text in ("listen: nonsense\n", "listen: [\n"):
        path.write_text(text)
        with pytest.raises(ConfigError) as bad_file:
            load_config(ServerConfig, path, {"metrics_listen": None})
        assert not isinstance(bad_file.value, CommandLineError), bad_file.value


def test_a_check_across_fields_without_a_file_is_the_flags_alone() -> None:
    """The embedded defaults pass every check: a combination they refuse is the flags', those
    it involves (the sim model is the default: `--role decode` has no part in it)."""
    from engine.config import EngineConfig

    with pytest.raises(CommandLineError) as caught:
        load_config(EngineConfig, None, {"runner": "pooling", "role": "decode", "model": None})
    assert caught.value.param_hint == "--runner"
    assert caught.value.problem.startswith("runner: pooling needs a torch model")
    assert str(caught.value).startswith("invalid --runner: runner: pooling needs")


def test_a_check_across_fields_names_the_file_and_the_flags(tmp_path: Path) -> None:
    from engine.config import EngineConfig

    path = tmp_path / "e.yaml"
    path.write_text("model: builtin\nkv_cache_bytes: 1000000\n")
    with pytest.raises(ConfigError) as caught:
        load_config(EngineConfig, path, {"model": "sim", "role": "decode"})
    assert str(caught.value) == (
        f"invalid config in {path} with --model: the sim runner needs"
        " num_kv_blocks, not kv_cache_bytes"
    )
    # The file alone fails so (the sim model is the default): no flag is blamed.
    path.write_text("kv_cache_bytes: 1000000\n")
    with pytest.raises(ConfigError) as caught:
        load_config(EngineConfig, path, {"model": "sim", "role": None})
    assert str(caught.value) == (
        f"invalid config in {path}: the sim runner needs num_kv_blocks, not kv_cache_bytes"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("listen: [1, 2]\n", "listen"),
        ("tls: {cert_file: a.pem}\n", "tls.key_file"),
        ("auth: {token_file: t, extra: 1}\n", "auth.extra"),
        (
            'auth: {token_file: t, protect_reads: "yes"}\n',
            "auth.protect_reads: Input should be a valid boolean",
        ),
        ("- a\n- b\n", "mapping"),
        ("listen: '127.0.0.1:99999'\n", "port out of range"),
        ("key: [unclosed\n", "not valid YAML"),
        ("listen: 127.0.0.1:1\nlisten: 127.0.0.1:2\n", "duplicate key 'listen'"),
        ("shutdown_grace_s: .inf\n", "shutdown_grace_s: Input should be a finite number"),
        ("shutdown_grace_s: .nan\n", "shutdown_grace_s: Input should be a finite number"),
        ("shutdown_grace_s: -1\n", "shutdown_grace_s: Input should be greater than or equal"),
    ],
)
def test_invalid_configs_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(ServerConfig, path)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("key: [unclosed\n", "line 2, column 1"),
        ("a: b: c\n", "line 1, column 5"),
        ("auth:\n  token_file: t\n  token_file: u\n", "line 3, column 3"),
    ],
)
def test_invalid_yaml_is_one_line_with_its_place(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(ServerConfig, path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"config {path} is not valid YAML: ")
    assert message.endswith(f"({where})")


def test_a_config_that_is_not_utf8_text_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"listen: 127.0.0.1:1\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 25"):
        load_config(ServerConfig, path)


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("")
    assert load_config(ServerConfig, path) == ServerConfig()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:5", ("::1", 5)), ("host:0", ("host", 0))],
)
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


def test_a_merge_key_may_be_overridden_in_its_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("auth: {<<: {token_file: t, protect_reads: false}, protect_reads: true}\n")
    auth = load_config(ServerConfig, path).auth
    assert auth is not None and auth.protect_reads


@pytest.mark.parametrize(
    "text",
    [
        "nohost",
        ":80",
        "host:",
        "host:x",
        "host:70000",
        "host:\u0663",  # a digit, but not an ASCII one
        "a b:80",
        " host:80",
        "http://host:80",
        "::1:80",
        "[::1:80",
        "::1]:80",
        "[]:80",
        "a\x00b:80",  # gRPC would dial a:443
        "host\x7f:80",
        "ho\u200bst:80",  # invisible
    ],
)
def test_parse_host_port_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):  # names what it was given
        parse_host_port(text)


def test_a_dial_target_names_a_port() -> None:
    assert parse_dial_target("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError, match="port 0"):
        parse_dial_target("127.0.0.1:0")


def _lax_scalars(schema: Any, path: str = "") -> Iterator[str]:
    """The fields (dotted) where a pydantic core schema takes a bool, int or float in lax
    mode."""
    if isinstance(schema, list):
        for item in schema:
            yield from _lax_scalars(item, path)
        return
    if not isinstance(schema, dict):
        return
    if schema.get("type") in ("bool", "int", "float") and not schema.get("strict"):
        yield path
    for key, value in schema.items():
        if key == "fields" and schema.get("type") == "model-fields":
            for name, field in value.items():
                yield from _lax_scalars(field, f"{path}.{name}".lstrip("."))
        else:
            yield from _lax_scalars(value, path)


@pytest.mark.parametrize("spec", sorted(CONFIG_KINDS))
def test_every_boolean_and_number_of_every_config_is_strict(spec: str) -> None:
    """docs/architecture.md: a YAML boolean or number, never a string ("yes", "5") nor a
    boolean for a number; a setting added as a plain `bool`, `int` or `float` (lax) fails
    here: use kvplane.config's StrictBool, StrictInt, StrictFloat."""
    module, _, name = spec.partition(":")
    model = getattr(importlib.import_module(module), name)
    assert sorted(set(_lax_scalars(model.__pydantic_core_schema__))) == []
