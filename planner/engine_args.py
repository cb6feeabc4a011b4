"""The `kvplane engine serve` arguments a planner starts its local engines with: `live.engine_args`,
then the pool's own `engine_args`, then the actuator's `--listen` and `--port-file`
(`serve_args`). `pool_engine_configs` reads them as `kvplane engine serve` itself reads them
(`engine.cli.engine_config_of_args`: its options, the engine's config model, the model
directory), and `read_pool_engine_files` also the files the configs so read name, as the
engines read them as they start (`engine.start_files`), when the planner config loads
(`check_pool_engines`, `kvplane planner run`; a `kvplane up` planner member:
kvplane.up.preflight), so that a typo, a wrong value or a missing file stops the planner at
once, one line naming the setting, rather than failing every engine it starts (each start
retried after a backoff)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import typer

from kvplane.errors import ConfigError, config_in
from planner.config import PlannerConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig


def serve_args(engine_args: Sequence[str], pool_args: Sequence[str], port_file: Path) -> list[str]:
    """The `kvplane engine serve` arguments of a local engine writing its port to `port_file`."""
    return [*engine_args, *pool_args, "--listen", "127.0.0.1:0", "--port-file", str(port_file)]


class PoolEngines(NamedTuple):
    """The config one or more pools' local engines serve with (`kvplane engine serve` of
    their arguments), and where it comes from."""

    setting: str  # the planner settings that give the arguments
    config: EngineConfig
    config_file: Path | None  # their --config


def pool_engine_configs(config: PlannerConfig) -> list[PoolEngines]:
    """The config the local engines of each pool serve with, once per distinct arguments, read
    as `kvplane engine serve` reads them; a ConfigError (`live.engine_args ...: PROBLEM`)
    when `serve` refuses them. None without `live:` (the offline replay) or with
    `live.kubernetes` (the Deployment's manifest holds the engines' arguments)."""
    from engine.cli import engine_config_of_args  # the engine's CLI: typer, pydantic only

    live = config.live
    if live is None or live.kubernetes is not None:
        return []
    engines: dict[tuple[str, ...], PoolEngines] = {}
    for number, pool in enumerate(config.pools):
        args = serve_args(live.engine_args, pool.engine_args, Path("engine.port"))
        if tuple(args) in engines:
            continue
        setting = "live.engine_args"
        if pool.engine_args:
            setting += f" with pools.{number}.engine_args (pool {pool.name})"
        try:
            engine, config_file = engine_config_of_args(args)
        except typer.TyperException as exc:  # what `serve` refuses as a usage error
            raise ConfigError(engine_args_problem(setting, exc.format_message())) from None
        except ConfigError as exc:  # its --config file's content
            raise ConfigError(engine_args_problem(setting, str(exc))) from None
        engines[tuple(args)] = PoolEngines(setting, engine, config_file)
    return list(engines.values())


def check_pool_engines(config: PlannerConfig, where: str) -> None:
    """`kvplane planner run`'s check as it loads, before any engine starts: the arguments of
    each pool's local engines and the files their --config names (`read_pool_engine_files`);
    a ConfigError (`invalid config in WHERE: live.engine_args ...: PROBLEM`)."""
    with config_in(where):
        read_pool_engine_files(config)


def read_pool_engine_files(config: PlannerConfig) -> None:
    """The arguments of each pool's local engines, read as `kvplane engine serve` reads them
    (`pool_engine_configs`), and the files their --config names, as those engines read them
    as they start; a ConfigError (`live.engine_args ...: PROBLEM`)."""
    from engine.start_files import read_start_files  # torch-free, as engine.cli

    for engines in pool_engine_configs(config):
        try:
            read_start_files(engines.config)
        except ConfigError as exc:
            problem = f"invalid config in {engines.config_file}: {exc}"
            raise ConfigError(engine_args_problem(engines.setting, problem)) from None


def engine_args_problem(setting: str, problem: str) -> str:
    """A problem of the engines' arguments `setting` gives, in one line."""
    return f"{setting}, the arguments of `kvplane engine serve`: {problem}"
