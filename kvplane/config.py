"""Configuration shared by every kvplane server: listen address, TLS, bearer-token auth.

Each process has one pydantic model (extra="forbid") loaded from YAML; `--listen` on the CLI
overrides the file, and an invalid value is reported against the flag or the file it came
from: a CommandLineError (a usage error) for a flag's or a file that cannot be read, a
ConfigError for the file's. Environment variables are read only by the CLI, never here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated, Any, Self, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from kvplane.errors import CommandLineError, ConfigError

# Every config's booleans and numbers are strict, the one definition of each here: a boolean
# is YAML's true/false ("yes" is a mistake, not true), a number is a YAML number, never a
# string ("5" is not five) nor a boolean (`true` is not 1 s); a whole number is a float too
# (YAML's `5` for 5.0 s). Enums and paths are read from strings as ever.
StrictBool = Annotated[bool, Strict()]
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, numbers are finite (YAML's .inf
    and .nan are refused), instances are immutable. Its booleans and numbers are
    StrictBool, StrictInt and StrictFloat (tests/foundation/test_config.py checks)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Hosts that mean "every interface" when bound to: never advertised, never dialled (the seed:
# a KV event source's endpoint_addr is a connectable host:port, never a bind wildcard such as
# * or 0.0.0.0).
BIND_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def parse_host_port(value: str) -> tuple[str, int]:
    """Split "HOST:PORT" ("[::1]:50051" for IPv6); raises ValueError on anything else: a
    scheme or path, whitespace or a control character, an IPv6 address without brackets, a
    port that is not ASCII digits or is above 65535."""
    host, sep, port_text = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    elif any(c in host for c in "[]:"):  # "::1:80", "[::1:80": an IPv6 host needs brackets
        host = ""
    if (
        not sep
        or not host
        or not (port_text.isascii() and port_text.isdigit())
        or any(c.isspace() or c == "/" for c in host)  # "a b:80", "http://h:80"
        # gRPC ends a target at a NUL ("a\x00b:80" dials a, on port 443): no control
        # characters, nor invisible ones.
        or not host.isprintable()
    ):
        raise ValueError(f"expected HOST:PORT ([ADDRESS]:PORT for IPv6), got {value!r}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


def join_host_port(host: str, port: int | str) -> str:
    """The HOST:PORT `parse_host_port` reads back: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_dial_target(value: str) -> tuple[str, int]:
    """`parse_host_port` for an address to connect to: port 0 (any free port, for a listen
    address) names no server."""
    host, port = parse_host_port(value)
    if port == 0:
        raise ValueError(f"port 0 in {value!r}: give the port the server listens on")
    return host, port


# The transports libzmq knows (`zmq_bind`/`zmq_connect`); which ones this build supports,
# connect / bind tells (EPROTONOSUPPORT).
ZMQ_TRANSPORTS = frozenset(
    {"tcp", "ipc", "inproc", "pgm", "epgm", "tipc", "vmci", "udp", "ws", "wss", "norm"}
)


def check_zmq_endpoint(
    endpoint: str, *, bind: bool = False, transports: frozenset[str] = ZMQ_TRANSPORTS
) -> str:
    """`transport://address` with a transport of `transports` (default: every one libzmq
    knows); for tcp, the address is `HOST:PORT`, where `*` (any interface, any port) is for
    binding only. Raises ValueError otherwise. What it cannot see (a host name that does not
    resolve, a transport this build lacks) the socket reports when it connects or binds: an
    indexer's source, an engine's KV-event publisher."""
    transport, sep, address = endpoint.partition("://")
    if not (transport and sep and address):
        raise ValueError(f"expected a ZMQ endpoint like tcp://HOST:PORT, got {endpoint!r}")
    if transport not in transports:
        known = "unknown" if transport not in ZMQ_TRANSPORTS else "unsupported"
        raise ValueError(f"{known} ZMQ transport {transport!r} in {endpoint!r}")
    if transport == "tcp":
        host, sep, port = address.rpartition(":")
        if not (host and sep and (port == "*" or (port.isascii() and port.isdigit()))):
            raise ValueError(f"expected tcp://HOST:PORT, got {endpoint!r}")
        if port != "*" and int(port) > 65535:
            raise ValueError(f"port out of range in {endpoint!r}")
        if not bind and "*" in (host, port):
            raise ValueError(f"'*' in {endpoint!r} is for binding (bind: true): give the address")
    return endpoint


def check_ceilings(config: BaseModel, *pairs: tuple[str, str]) -> None:
    """Raise ValueError at the first (floor, ceiling) pair of `config`'s fields whose ceiling
    is below its floor (a doubling wait's longest below its first), naming both; a ceiling
    left at its default is said to be one (a floor set alone above it: set the ceiling too)."""
    for floor, ceiling in pairs:
        low, high = getattr(config, floor), getattr(config, ceiling)
        if high < low:
            default = "" if ceiling in config.model_fields_set else ", its default"
            raise ValueError(f"{ceiling} ({high:g}{default}) is below {floor} ({low:g})")


def check_needs(config: BaseModel, keys: tuple[str, ...], needs: str, *, met: bool) -> None:
    """Settings read only beside another (`needs`, as a user sets it: `remote`,
    `zmq_enabled: true`) are refused while it is not (`met` false): they would do nothing,
    and whoever set one expects it to. Raises ValueError naming the first of `keys` given
    another value than its default (a file that spells a default out, as a template may,
    asks for nothing that is not done)."""
    if met:
        return
    for key in settings_given(config, keys):
        raise ValueError(f"{key} is only read with {needs}: set that, or remove {key}")


def settings_given(config: BaseModel, keys: tuple[str, ...]) -> list[str]:
    """Those of `keys` that `config` was given with another value than their default (in
    `keys`' order): what a file asks for, beyond spelling a default out."""
    fields = type(config).model_fields
    return [
        key
        for key in keys
        if key in config.model_fields_set
        and getattr(config, key) != fields[key].get_default(call_default_factory=True)
    ]


class TlsConfig(StrictModel):
    cert_file: Path
    key_file: Path
    # Set -> mutual TLS: clients must present a certificate signed by this CA.
    client_ca_file: Path | None = None


class ClientTlsFilesConfig(StrictModel):
    """A TLS client's files: `ca_file` verifies the server (None: the system's trusted
    roots), `cert_file` + `key_file` are a client certificate for servers that require
    mutual TLS (one without the other is refused, never ignored). Files are PEM."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _cert_with_key(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (a client certificate)")
        return self


class ClientTlsConfig(ClientTlsFilesConfig):
    """TLS for a client's connections (kvplane.channels): its files, and `server_name`, which
    overrides the name checked in the server's certificate (default: the host of the address
    dialled)."""

    server_name: str | None = Field(default=None, min_length=1)


class AuthConfig(StrictModel):
    # A file holding the bearer token (surrounding whitespace ignored).
    token_file: Path
    # Also require the token on read-only RPCs.
    protect_reads: StrictBool = False


def read_token_file(path: Path, setting: str) -> str:
    """The bearer token a file holds (surrounding whitespace ignored); a ConfigError naming
    `setting` when it cannot be read, is empty, or holds what a token cannot carry
    (`bearer_token_problem`)."""
    token = read_secret_file(path, setting)
    problem = bearer_token_problem(token)
    if problem is not None:
        raise ConfigError(f"{setting} {path} {problem}")
    return token


def bearer_token_problem(token: str) -> str | None:
    """Why `token` cannot be sent as `authorization: Bearer <token>`, or None: gRPC metadata
    (and an HTTP header) carries printable ASCII only, and a client given another character
    fails every call with INTERNAL "Invalid metadata" after a line of gRPC's C core (a
    server would wait for a token no client can send). The token itself is not quoted."""
    for position, character in enumerate(token, start=1):
        if not " " <= character <= "~":
            return (
                f"holds a character a bearer token cannot carry (character {position}: a "
                "line break, a control or a non-ASCII character; a token is printable ASCII)"
            )
    return None


def read_secret_file(path: Path, setting: str) -> str:
    """The secret a file holds (surrounding whitespace ignored): a token, a password; a
    ConfigError naming `setting` when it cannot be read or is empty."""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {setting} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{setting} {path} is not UTF-8 text (byte {exc.start})") from exc
    if not token:
        raise ConfigError(f"{setting} {path} is empty")
    return token


class ServerConfig(StrictModel):
    """The part of every server's YAML that the gRPC scaffolding reads."""

    listen: str = "127.0.0.1:0"
    tls: TlsConfig | None = None
    auth: AuthConfig | None = None
    # Prometheus /metrics on a side port; None disables it.
    metrics_listen: str | None = None
    # Seconds in-flight RPCs get to finish on SIGTERM/SIGINT.
    shutdown_grace_s: StrictFloat = Field(default=5.0, ge=0)

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value


ConfigT = TypeVar("ConfigT", bound=BaseModel)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, which PyYAML would
    silently resolve by keeping the last (a second `engines:` list replacing the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own message spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = exc.problem or exc.context or "syntax error"
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def load_config(
    model: type[ConfigT],
    path: Path | None,
    flags: dict[str, object] | None = None,
    *,
    wanted_by: str = "--config",
) -> ConfigT:
    """Load and validate `path` (YAML) as `model`, with command-line `flags` applied on top.

    No file means the model's embedded defaults. `flags` maps a top-level field to the value
    of the flag that sets it, `--field-name` (None: the flag was not given). Every problem is
    a ConfigError naming where its value came from (see `validate_config`; `wanted_by`: what
    gave the file, for a file of another kind); a file that cannot be read is a
    CommandLineError of `wanted_by`.
    """
    data = _read_yaml(path, wanted_by) if path is not None else {}
    given = {field: value for field, value in (flags or {}).items() if value is not None}
    where = str(path) if path is not None else "the embedded defaults"
    return validate_config(
        model,
        {**data, **given},
        where,
        frozenset(given),
        wanted_by=wanted_by,
        from_file=path is not None,
        under_flags={field: data[field] for field in given if field in data},
    )


def _read_yaml(path: Path, wanted_by: str) -> dict[str, object]:
    """The top-level mapping of a YAML file (empty for an empty file). A file that cannot be
    read as text is the command line's mistake (a path mistyped, a folder, a binary file);
    one that reads is the file's."""
    try:
        loaded = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader
    except OSError as exc:
        message = f"cannot read config {path}: {exc.strerror}"
        raise CommandLineError(message, param_hint=wanted_by, problem=message) from exc
    except UnicodeDecodeError as exc:
        message = f"config {path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        raise CommandLineError(message, param_hint=wanted_by, problem=message) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {_yaml_problem(exc)}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a YAML mapping at the top level")
    return loaded


def _flag_name(field: str) -> str:
    """The command-line flag that sets a top-level config field: `instance_id` is
    `--instance-id`."""
    return "--" + field.replace("_", "-")


# Every kind of kvplane config file: the model that reads it, as "module:class" (imported only
# when a file fails to load: the components' config modules import this one), and its name.
CONFIG_KINDS = {
    "controller.config:ControllerConfig": "controller",
    "engine.config:EngineConfig": "engine",
    "indexer.config:IndexerConfig": "indexer",
    "planner.config:PlannerConfig": "planner",
    "kvplane.up.config:FleetConfig": "fleet",  # `kvplane up FILE`
}


def _kind_fields(spec: str) -> frozenset[str]:
    module, _, name = spec.partition(":")
    model: type[BaseModel] = getattr(importlib.import_module(module), name)
    return frozenset(model.model_fields)


def _other_kind(model: type[BaseModel], keys: set[str]) -> tuple[str, str] | None:
    """(the kind `keys` look like, the kind `model` reads) when `model` is a kvplane config
    kind and the top-level `keys` are not all its fields but are all the fields of exactly
    one other kind; None otherwise (then each problem is listed as usual: keys every server
    shares, `listen` alone, say nothing of a kind)."""
    expected = CONFIG_KINDS.get(f"{model.__module__}:{model.__qualname__}")
    if expected is None or keys <= set(model.model_fields):
        return None
    found = [
        kind
        for spec, kind in CONFIG_KINDS.items()
        if kind != expected and keys <= _kind_fields(spec)
    ]
    return (found[0], expected) if len(found) == 1 else None


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def validate_config(
    model: type[ConfigT],
    data: dict[str, object],
    where: str,
    flag_fields: frozenset[str] = frozenset(),
    *,
    wanted_by: str = "--config",
    from_file: bool = True,
    under_flags: dict[str, object] | None = None,
) -> ConfigT:
    """Validate `data` as `model`. On failure, one ConfigError listing every problem by where
    its value came from: a field in `flag_fields` from its flag (`invalid --role: ...`), any
    other from `where` (`invalid config in FILE: key: ...`); a check across fields, from
    both (`invalid config in FILE with --model: ...`: the flags it involves, `_flags_involved`;
    `under_flags`: the file's values the flags replaced), or from the flags alone when not
    `from_file` (`where` then names defaults, which pass every check). When a flag is blamed,
    the error is a CommandLineError naming the first such flag. A config of another kind (its
    top-level keys all another kind's) is said to be one in a line instead (`FILE looks like a
    planner config; --config wants a controller config`), `wanted_by` naming what gave it."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        file_keys = {str(key) for key in data if key not in flag_fields}
        kinds = _other_kind(model, file_keys)
        if kinds is not None:
            found, expected = kinds
            raise ConfigError(
                f"{where} looks like {_a(found)} config; {wanted_by} wants {_a(expected)} config"
            ) from exc
        by_source: dict[str, list[str]] = {}
        by_flag: dict[str, list[str]] = {}  # the problems blamed on flags, by param hint
        for err in exc.errors():
            loc = _key_path(err["loc"], data)
            flag: str | None = None
            if loc and loc[0] in flag_fields:
                flag, loc = _flag_name(loc[0]), loc[1:]
                source = f"invalid {flag}"
            elif loc or not flag_fields:
                source = f"invalid config in {where}"
            else:
                involved = _flags_involved(model, data, flag_fields, under_flags or {}, err)
                if not from_file:  # the defaults pass every check: some flag is involved
                    flag = " / ".join(_flag_name(f) for f in involved or sorted(flag_fields))
                    source = f"invalid {flag}"
                elif involved:
                    flags = ", ".join(_flag_name(field) for field in involved)
                    source = f"invalid config in {where} with {flags}"
                else:
                    source = f"invalid config in {where}"
            message = _without_pydantic_prefix(err)
            problem = f"{'.'.join(loc)}: {message}" if loc else message
            by_source.setdefault(source, []).append(problem)
            if flag is not None:
                by_flag.setdefault(flag, []).append(problem)
        message = "; ".join(
            f"{source}: {'; '.join(problems)}" for source, problems in by_source.items()
        )
        if by_flag:  # the command line is checked first, as click checks its own options
            flag, problems = next(iter(by_flag.items()))
            raise CommandLineError(message, param_hint=flag, problem="; ".join(problems)) from exc
        raise ConfigError(message) from exc


def _key_path(loc: tuple[int | str, ...], data: object) -> list[str]:
    """An error's location as the keys the user wrote: pydantic puts a tagged union's tag
    between a list item and its keys (`sources.0.zmq.topic`, the source's `kind: zmq`), which
    names no key; it is left out (`sources.0.topic`). Found by walking `data`: a step that is
    not a key of the mapping it is in but is the value of one (its tag), once per mapping."""
    path: list[str] = []
    node, tag_seen = data, False
    for part in loc:
        if isinstance(node, dict):
            if part not in node and not tag_seen and part in node.values():
                tag_seen = True
                continue
            node, tag_seen = node.get(part), False
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node, tag_seen = node[part], False
        else:
            node, tag_seen = None, False
        path.append(str(part))
    return path


def _flags_involved(
    model: type[BaseModel],
    data: dict[str, object],
    flag_fields: frozenset[str],
    under_flags: dict[str, object],
    err: ErrorDetails,
) -> list[str]:
    """The fields of `flag_fields` whose flag a check across fields (`err`, failed on `data`)
    involves: those without whose flag (the file's value back, else the default) it passes.
    A `redis:` block with `backend: memory` involves no `--listen` given with it."""
    involved = []
    for field in sorted(flag_fields):
        without = {key: value for key, value in data.items() if key != field}
        if field in under_flags:
            without[field] = under_flags[field]
        try:
            model.model_validate(without)
        except ValidationError as exc:
            if any(not e["loc"] and e["msg"] == err["msg"] for e in exc.errors()):
                continue  # fails the same way without it
        involved.append(field)
    return involved


# What pydantic writes before the message of an exception raised by a validator (our checks):
# noise in a one-line error, so it is left out.
_PYDANTIC_PREFIXES = {"value_error": "Value error, ", "assertion_error": "Assertion failed, "}


def _without_pydantic_prefix(err: ErrorDetails) -> str:
    """An error's message as the check that failed wrote it."""
    return err["msg"].removeprefix(_PYDANTIC_PREFIXES.get(err["type"], ""))
