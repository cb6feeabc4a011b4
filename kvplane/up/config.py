"""A `kvplane up` fleet file (`FleetConfig`) and the embedded default fleet."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from kvplane.config import ClientTlsConfig, StrictModel, load_config

# The planner is not a member kind yet: `kvplane planner run` is not implemented.
MemberKind = Literal["engine", "indexer", "controller"]
# A member's name is a file name in the fleet's folder and is referred to as ${name}.
_NAME = r"[A-Za-z0-9_.-]+"
PLACEHOLDER = re.compile(rf"\$\{{({_NAME})\}}")
# The model (engines) and tokenizer (controllers) kvplane builds on first use.
BUILTIN = "builtin"


class MemberConfig(StrictModel):
    name: str  # letters, digits, '_', '.', '-' (not '.' or '..')
    kind: MemberKind
    # The member's own config file content (its server's YAML schema); `listen` defaults to
    # 127.0.0.1:0. Strings may refer to earlier members' addresses as ${name}.
    config: dict[str, Any] = Field(default_factory=dict)
    # The CPUs the member's process may run on (Linux CPU affinity), e.g. one core per
    # engine; unset: every CPU this process may use.
    cpus: list[int] | None = Field(default=None, min_length=1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not re.fullmatch(_NAME, value) or value in (".", ".."):
            raise ValueError(
                f"{value!r} is not a member name: use letters, digits, '_', '.' and '-'"
            )
        return value

    def refers_to(self) -> set[str]:
        return set(PLACEHOLDER.findall(yaml.safe_dump(self.config)))


class FleetConfig(StrictModel):
    members: list[MemberConfig] = Field(min_length=1)
    # Seconds each member gets to become healthy, and to stop after SIGTERM.
    start_timeout_s: float = Field(default=120.0, gt=0)
    stop_timeout_s: float = Field(default=15.0, gt=0)
    # On Ctrl-C engines finish what they run for this long; what is left is then aborted.
    drain_deadline_s: float = Field(default=3.0, ge=0)
    # How up dials its members (readiness, status, drain, --check): members serving `tls:`
    # need it; unset: insecure.
    client_tls: ClientTlsConfig | None = None

    @model_validator(mode="after")
    def _check_names(self) -> FleetConfig:
        seen: set[str] = set()
        for member in self.members:
            if member.name in seen:
                raise ValueError(f"duplicate member name {member.name!r}")
            for ref in sorted(member.refers_to()):
                if ref not in seen:
                    raise ValueError(
                        f"member {member.name!r} refers to ${{{ref}}} before it is defined"
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


def load_fleet(path: Path | None) -> FleetConfig:
    if path is None:
        return FleetConfig.model_validate(DEFAULT_FLEET)
    return load_config(FleetConfig, path)
