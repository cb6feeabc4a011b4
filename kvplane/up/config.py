"""A `kvplane up` fleet file (`FleetConfig`) and the embedded default fleet; `load_fleet` also
checks each member's own config and reads the files it names (`kvplane.up.preflight`), and
reports a bad one against the fleet file and the member (not the copy `up` writes for the
member's process), before any member starts.

Members of the server kinds (engine, indexer, controller) run `kvplane KIND serve`; a
planner runs `kvplane planner run`: it serves nothing, and starts (and stops) engines of its
own, which it registers with the controller its `live.controller` names, by default the
fleet's controller."""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from controller.config import ControllerConfig
from engine.config import EngineConfig, check_model_source
from indexer.config import IndexerConfig
from kvplane.config import (
    ClientTlsConfig,
    ServerConfig,
    StrictFloat,
    StrictInt,
    StrictModel,
    load_config,
    parse_host_port,
    validate_config,
)
from kvplane.errors import ConfigError
from kvplane.up.member import STOP_TIMEOUT_S, cpus_missing
from kvplane.up.preflight import check_member_files
from planner.config import PlannerConfig

MemberKind = Literal["engine", "indexer", "controller", "planner"]
# A member's name is a file name in the fleet's folder and is referred to as ${name}.
_NAME = r"[A-Za-z0-9_.-]+"
PLACEHOLDER = re.compile(rf"\$\{{({_NAME})\}}")
# The model (engines) and tokenizer (controllers) kvplane builds on first use.
BUILTIN = "builtin"
# The config model of each kind's process (what `kvplane KIND serve --config`, or `kvplane
# planner run --config`, loads).
CONFIG_MODELS: dict[MemberKind, type[ServerConfig] | type[PlannerConfig]] = {
    "engine": EngineConfig,
    "indexer": IndexerConfig,
    "controller": ControllerConfig,
    "planner": PlannerConfig,
}


class MemberConfig(StrictModel):
    name: str  # letters, digits, '_', '.', '-' (not '.' or '..')
    kind: MemberKind
    # The member's own config file content (its server's YAML schema); `listen` defaults to
    # 127.0.0.1:0. Strings may refer to earlier members' addresses as ${name}.
    config: dict[str, Any] = Field(default_factory=dict)
    # The CPUs the member's process may run on (Linux CPU affinity), e.g. one core per
    # engine; unset: every CPU this process may use.
    cpus: list[StrictInt] | None = Field(default=None, min_length=1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not re.fullmatch(_NAME, value) or value in (".", ".."):
            raise ValueError(
                f"{value!r} is not a member name: use letters, digits, '_', '.' and '-'"
            )
        return value

    @property
    def serves(self) -> bool:
        """A server (it listens, writes its port, answers health checks); not a planner."""
        return self.kind != "planner"

    def refers_to(self) -> set[str]:
        return set(PLACEHOLDER.findall(yaml.safe_dump(self.config)))

    def command(self, config_path: Path, port_file: Path) -> list[str]:
        """The `kvplane` arguments that run the member."""
        if not self.serves:
            return ["planner", "run", "--config", str(config_path)]
        return [self.kind, "serve", "--config", str(config_path), "--port-file", str(port_file)]

    def fixed_listen_addresses(self) -> list[tuple[str, str]]:
        """(setting, HOST:PORT) of each address the member is configured to listen on with a
        port of its own: `listen` and `metrics_listen` (a planner's `live.metrics_listen`).
        Port 0 (picked at run time) is left out, as is a value naming another member or not
        an address at all (the member's config check reports it)."""
        settings: dict[str, Any] = {}
        if self.serves:
            settings = {k: self.config.get(k) for k in ("listen", "metrics_listen")}
        elif isinstance(live := self.config.get("live"), dict):
            settings = {"live.metrics_listen": live.get("metrics_listen")}
        fixed = []
        for setting, value in settings.items():
            if not isinstance(value, str) or PLACEHOLDER.search(value):
                continue
            with contextlib.suppress(ValueError):
                if parse_host_port(value)[1] != 0:
                    fixed.append((setting, value))
        return fixed

    def server_config(self, addresses: dict[str, str], folder: Path) -> dict[str, Any]:
        """The YAML `up` gives the member's process: `config` with each ${name} replaced by
        `addresses[name]`, a server's `listen` defaulting to 127.0.0.1:0, a controller's
        `metrics_listen` too (the live status reads its routing counters there), and a
        planner's `live.workdir` (its local engines' logs) defaulting to a folder in `folder`,
        the fleet's, where up keeps the members' logs."""
        config: dict[str, Any] = _substitute(self.config, addresses)
        if self.kind == "planner":
            live = config.get("live")
            # Anything but a section is the planner config's to refuse; a Deployment's pods
            # log in the cluster (and `workdir` with `kubernetes` is refused).
            if isinstance(live, dict) and "kubernetes" not in live:
                live.setdefault("workdir", str(folder / f"{self.name}-engines"))
            return config
        config = {"listen": "127.0.0.1:0", **config}
        if self.kind == "controller":
            config.setdefault("metrics_listen", "127.0.0.1:0")
        return config

    def planned_controller(self, controllers: list[str]) -> None:
        """Fill in a planner's `live.controller`, when it names none, as the address of the
        fleet's controller (`controllers`: those listed before it), as ${name}."""
        if self.config.get("live") is None:
            self.config["live"] = {}
        live = self.config["live"]
        if not isinstance(live, dict) or "controller" in live:
            return  # given (or not a section: the planner config refuses it)
        if len(controllers) != 1:
            which = "no controller" if not controllers else f"controllers {', '.join(controllers)}"
            raise ValueError(
                f"member {self.name!r}: {which} listed before it, so live.controller (the "
                "controller its engines are registered with) must be given"
            )
        live["controller"] = f"${{{controllers[0]}}}"


def _substitute(value: Any, addresses: dict[str, str]) -> Any:
    if isinstance(value, str):
        return PLACEHOLDER.sub(lambda m: addresses[m.group(1)], value)
    if isinstance(value, list):
        return [_substitute(v, addresses) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, addresses) for k, v in value.items()}
    return value


class FleetConfig(StrictModel):
    members: list[MemberConfig] = Field(min_length=1)
    # Seconds each member gets to become healthy.
    start_timeout_s: StrictFloat = Field(default=120.0, gt=0)
    # Seconds a member gets to stop after SIGTERM, then it is killed; at the latest this long
    # past the drain's deadline (`Fleet.stop`). Members are told it (a planner fits its
    # engines' stop in it: `kvplane.up.member.stop_within_s`).
    stop_timeout_s: StrictFloat = Field(default=STOP_TIMEOUT_S, gt=0)
    # On Ctrl-C engines finish what they run for this long; what is left is then aborted.
    drain_deadline_s: StrictFloat = Field(default=3.0, ge=0)
    # How up dials its members (readiness, status, drain, --check): members serving `tls:`
    # need it; unset: insecure.
    client_tls: ClientTlsConfig | None = None
    # The bearer token up sends its members (members run with `auth` ask for it on Drain and
    # Abort, and on every call with `protect_reads`); unset: none.
    client_token_file: Path | None = None

    @model_validator(mode="after")
    def _check_names(self) -> FleetConfig:
        seen: set[str] = set()
        controllers: list[str] = []
        names = [m.name for m in self.members]
        for member in self.members:
            if member.name in seen:
                raise ValueError(f"duplicate member name {member.name!r}")
            if member.kind == "planner":
                member.planned_controller(controllers)
            elif member.kind == "controller":
                controllers.append(member.name)
            for ref in sorted(member.refers_to()):
                if ref not in names:
                    raise ValueError(
                        f"member {member.name!r} refers to ${{{ref}}}, but no member is named "
                        f"{ref!r} (members: {', '.join(names)})"
                    )
                if ref not in seen:
                    raise ValueError(
                        f"member {member.name!r} refers to ${{{ref}}} before it is defined: "
                        f"list {ref!r} above it"
                    )
            seen.add(member.name)
        return self


# The embedded defaults (configs/local.yaml spells out the same fleet): three engines serving
# the builtin model (a tiny random Llama built on first use, see
# engine.torch_runner.builtin_model) behind a controller with the embedded in-memory index.
NUM_DEFAULT_ENGINES = 3
DEFAULT_FLEET: dict[str, Any] = {
    "members": [
        *(
            {
                "name": f"engine-{i}",
                "kind": "engine",
                "config": {"model": BUILTIN, "num_threads": 1},
            }
            for i in range(NUM_DEFAULT_ENGINES)
        ),
        {
            "name": "controller",
            "kind": "controller",
            "config": {
                "listen": "127.0.0.1:8100",
                "index": {"backend": "memory"},
                "router": {"policy": "kvplane"},
                "tokenizer": BUILTIN,
                "engines": [{"address": f"${{engine-{i}}}"} for i in range(NUM_DEFAULT_ENGINES)],
            },
        },
    ]
}


# What a controller member may ask of its clients (its `tls`, its `auth`), and what a planner
# dials it without unless a setting of its says how.
Secured = Literal["tls", "auth"]
_PLANNER_LACKS: dict[Secured, tuple[str, str]] = {
    "tls": ("TLS", "live.controller_tls"),  # first: the connection's, before any call
    "auth": ("a token", "live.controller_token_file"),
}


def load_fleet(path: Path | None) -> FleetConfig:
    """The fleet file at `path` (None: the embedded defaults), with every member's server
    config checked, and the files it names read, before any member starts: a ConfigError
    names the file and the member."""
    if path is None:
        fleet = FleetConfig.model_validate(DEFAULT_FLEET)
    else:
        fleet = load_config(FleetConfig, path, wanted_by="`kvplane up`")
    where = str(path) if path is not None else "the embedded default fleet"
    # The members' addresses are known only once they listen: each has a stand-in of the
    # same shape, distinct from the others' (a controller refuses an engine listed twice).
    stand_ins = {m.name: f"127.0.0.1:{i}" for i, m in enumerate(fleet.members, start=1)}
    folder = Path(tempfile.gettempdir())  # a stand-in too: the fleet's folder is made at start
    secured: dict[str, set[Secured]] = {}  # controller members: what a planner needs for them
    planners: dict[str, str] = {}  # controller address -> the planner member using it
    members_at = {address: name for name, address in stand_ins.items()}
    for member in fleet.members:
        if member.cpus is not None and (missing := cpus_missing(member.cpus)):
            # Before any member starts: one started first would be stopped again.
            raise ConfigError(f"invalid config in {where}, member {member.name}: cpus: {missing}")
        server = validate_config(
            CONFIG_MODELS[member.kind],
            member.server_config(stand_ins, folder),
            f"{where}, member {member.name}",
            wanted_by=f"a member of kind {member.kind}",
        )
        if isinstance(server, EngineConfig):
            _check_engine_checkpoint(server, f"{where}, member {member.name}")
        # Its files too (TLS, tokens, tokenizers; a planner's engines' arguments and files):
        # a member failing on one as it starts would come after others were started, to be
        # stopped again.
        check_member_files(server, f"{where}, member {member.name}")
        if isinstance(server, ControllerConfig) and (server.tls or server.auth):
            secured[member.name] = {"tls"} if server.tls else set()
            if server.auth:
                secured[member.name].add("auth")
        if isinstance(server, PlannerConfig):
            _check_planner_reaches(member, server, secured, f"{where}, member {member.name}")
            _check_one_planner_per_controller(server, member.name, planners, members_at, where)
    return fleet


def _check_one_planner_per_controller(
    planner: PlannerConfig,
    name: str,
    planners: dict[str, str],
    members_at: dict[str, str],
    where: str,
) -> None:
    """Up counts a planner started once its controller routes to its pools' minimum of
    engines registered through the admin API; two planners of one controller would count each
    other's engines (and one planner takes any number of pools). `members_at`: the member
    at each stand-in address, to name it."""
    assert planner.live is not None  # FleetConfig fills in live.controller
    controller = planner.live.controller
    other = planners.setdefault(controller, name)
    if other != name:
        shown = members_at.get(controller, controller)
        raise ConfigError(
            f"invalid config in {where}: planners {other} and {name} both use controller "
            f"{shown}: give one planner all the pools"
        )


def _check_planner_reaches(
    member: MemberConfig, planner: PlannerConfig, secured: dict[str, set[Secured]], where: str
) -> None:
    """A planner dials its controller without TLS unless its `live.controller_tls` says how,
    and without a token unless its `live.controller_token_file` names one: one that names a
    controller member serving `tls` or asking for `auth` it has no setting for is refused here
    rather than failing to register an engine once the fleet runs."""
    live = planner.live
    given: dict[Secured, bool] = {
        "tls": live is not None and live.controller_tls is not None,
        "auth": live is not None and live.controller_token_file is not None,
    }
    for name in sorted(member.refers_to() & secured.keys()):
        for asks, (lacks, setting) in _PLANNER_LACKS.items():
            if asks not in secured[name] or given[asks]:
                continue
            raise ConfigError(
                f"invalid config in {where}: the planner dials its controller without {lacks} "
                f"(give it {setting}), and controller {name} has `{asks}`"
            )


def _check_engine_checkpoint(config: EngineConfig, where: str) -> None:
    """An engine whose `runner: auto` would serve its checkpoint for pooling only (a
    classifier without an LM head) with a config a pooling engine refuses (a role, LoRA, ZMQ
    events) is refused here, as a bad config, rather than by its process once the other
    members run. A `model` that is no checkpoint directory at all is refused here too (the
    members run on this machine); one that cannot be read is left to the engine to report."""
    try:
        check_model_source(config.model)
    except ConfigError as exc:
        raise ConfigError(f"invalid config in {where}: {exc}") from None
    if config.is_sim or config.is_builtin or config.pooling_conflicts() is None:
        return  # nothing to read: no checkpoint, or nothing a pooling engine refuses
    from engine.torch_runner.errors import CheckpointError

    try:
        config.pools_only(Path(config.model))
    except CheckpointError:
        return
    except ConfigError as exc:
        raise ConfigError(f"invalid config in {where}: {exc}") from None
