"""`kvplane engine ...` commands. torch is imported only when a torch model is served.

`engine_config_of_args` reads `kvplane engine serve` arguments as `serve` does, for a planner
that starts engines with them (its `engine_args`) to check them when it loads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import typer.core
import typer.main

from kvplane.cli_common import (
    ConfigOption,
    ListenOption,
    PortFileOption,
    load_command_config,
    usage_error_for,
)

if TYPE_CHECKING:
    from engine.config import EngineConfig

engine_app = typer.Typer(no_args_is_help=True)


@engine_app.command()
def serve(
    *,
    config: ConfigOption = None,
    listen: ListenOption = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="'sim', 'builtin' (a tiny random Llama built on first use) or an HF model "
            "directory (overrides the config's; default: sim).",
        ),
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(
            "--role",
            help="aggregated, prefill or decode (overrides the config's; default: aggregated).",
        ),
    ] = None,
    runner: Annotated[
        str | None,
        typer.Option(
            "--runner",
            help="generate, pooling (Embed/Classify/Score only) or auto (pooling for a "
            "classifier without an LM head) (overrides the config's; default: auto).",
        ),
    ] = None,
    generation_config: Annotated[
        str | None,
        typer.Option(
            "--generation-config",
            help="auto (the model's generation_config.json gives the defaults of the sampling "
            "options requests leave unset) or none (the engine's fixed defaults) (overrides "
            "the config's; default: auto).",
        ),
    ] = None,
    instance_id: Annotated[
        str | None,
        typer.Option(
            "--instance-id",
            help="This engine's id in EngineInfo/GetLoad (overrides the config's; default: a "
            "fresh id per process).",
        ),
    ] = None,
    port_file: PortFileOption = None,
) -> None:
    """Serve openengine.v1.OpenEngine and vllm.Generate over the bundled engine."""
    from engine.server.service import run_engine

    engine_config = _engine_config(
        config,
        {
            "listen": listen,
            "model": model,
            "role": role,
            "runner": runner,
            "generation_config": generation_config,
            "instance_id": instance_id,
        },
    )
    asyncio.run(run_engine(engine_config, port_file=port_file))


def _engine_config(config: Path | None, flags: dict[str, str | None]) -> EngineConfig:
    """The config `serve` runs with: the `--config` file under the flags given, and a model
    that is no checkpoint directory refused before anything loads (`--model`'s as a usage
    error, the file's as a config error naming the file)."""
    from engine.config import EngineConfig, check_model_source
    from kvplane.errors import ConfigError

    model = flags["model"]
    if model is not None:  # the command line first, as click checks its own options
        with usage_error_for("--model"):
            check_model_source(model)
    engine_config = load_command_config(EngineConfig, config, dict(flags))
    if model is None and config is not None:  # the file's model: a config error naming it
        try:
            check_model_source(engine_config.model)
        except ConfigError as exc:
            raise ConfigError(f"invalid config in {config}: {exc}") from None
    return engine_config


def engine_config_of_args(args: Sequence[str]) -> tuple[EngineConfig, Path | None]:
    """The config `kvplane engine serve ARGS` would serve with, read and checked as `serve`
    reads it (nothing is started), and its `--config` file (None: none). What `serve`
    refuses as a usage error (an unknown option, `--role bogus`, a `--config` that cannot be
    read) is a typer.TyperException, whose `format_message()` says it as click does; a bad
    `--config` file, a ConfigError naming it."""
    app = typer.main.get_command(engine_app)
    # The click command of a Typer of one command is that command; of several, their group.
    command = app.commands["serve"] if isinstance(app, typer.core.TyperGroup) else app
    context = command.make_context("kvplane engine serve", list(args))
    flags = dict(context.params)
    config, _ = flags.pop("config"), flags.pop("port_file")
    return _engine_config(config, flags), config
