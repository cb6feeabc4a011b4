"""`kvplane engine ...` commands. torch is imported only when a torch model is served."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from kvplane.cli_common import (
    ConfigOption,
    ListenOption,
    PortFileOption,
    load_command_config,
    usage_error_for,
)

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
    from engine.config import EngineConfig, check_model_source
    from engine.server.service import run_engine
    from kvplane.errors import ConfigError

    if model is not None:  # the command line first, as click checks its own options
        with usage_error_for("--model"):
            check_model_source(model)
    engine_config = load_command_config(
        EngineConfig,
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
    if model is None and config is not None:  # the file's model: a config error naming it
        try:
            check_model_source(engine_config.model)
        except ConfigError as exc:
            raise ConfigError(f"invalid config in {config}: {exc}") from None
    asyncio.run(run_engine(engine_config, port_file=port_file))
