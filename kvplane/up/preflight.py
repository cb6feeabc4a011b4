"""`kvplane up`'s preflight of a member's files: what its process reads as it starts (its TLS
certificate, key and CA files, its bearer-token files, a controller's tokenizers, a Redis
index's password and TLS files, a planner's Kubernetes token and CA files and the files of its
engines' config), read here, before any member starts, by the loaders the process itself
uses, so that a missing or unusable file is the same one-line ConfigError naming its setting
and no member is started only to be stopped again when a later one fails on it.

What is read only once a member runs (a checkpoint's weights) is left to the member, as is the
builtin model and its tokenizer, which kvplane builds on first use.

What a server reads as it starts is its own to say (`kvplane.server.read_server_files`, an
engine's `engine.start_files`, a planner's local engines' `planner.engine_args`, which
`kvplane planner run` also reads as it loads); what this module adds is the members'
channels, a controller's tokenizers and an index's Redis files."""

from __future__ import annotations

import os
from pathlib import Path

from controller.config import ControllerConfig
from controller.tokenizers import BUILTIN, ModelTokenizers
from engine.config import EngineConfig
from engine.start_files import read_start_files
from indexer.backends import REDIS_SCHEMES
from indexer.config import IndexerConfig, OpenEngineSourceConfig, RedisBackendConfig
from indexer.redis_client import RedisOptions
from kvplane.channels import ClientChannels
from kvplane.config import ServerConfig
from kvplane.errors import config_in
from kvplane.server import read_server_files
from planner.config import PlannerConfig
from planner.engine_args import read_pool_engine_files


def check_member_files(config: ServerConfig | PlannerConfig, where: str) -> None:
    """Read the files the member of `config` reads as it starts; a ConfigError
    (`invalid config in WHERE: ...`) for the first that is missing or cannot be used."""
    with config_in(where):
        _read_files(config)


def _read_files(config: ServerConfig | PlannerConfig) -> None:
    if isinstance(config, PlannerConfig):
        _planner_files(config)
        return
    if isinstance(config, EngineConfig):
        read_start_files(config)
        return
    read_server_files(config)
    if isinstance(config, ControllerConfig):
        _controller_files(config)
    elif isinstance(config, IndexerConfig):
        for source in config.sources:  # indexer.service's
            if isinstance(source, OpenEngineSourceConfig):
                source.channels()
        _redis_files(config.backend, config.redis)


def _planner_files(config: PlannerConfig) -> None:
    """planner.live.run_live's channels and Kubernetes API client, and the files each pool's
    local engines read as they start (those their --config names)."""
    live = config.live
    if live is None:
        return  # the offline replay: nothing to read
    from planner.kubernetes import kube_api
    from planner.live import live_channels

    live_channels(live)
    if live.kubernetes is not None:
        # The planner member runs here, in this environment: outside a pod, in-cluster
        # defaults it is left to (its service-account files) fail it as they would here.
        kube_api(live.kubernetes, os.environ)
    read_pool_engine_files(config)


def _controller_files(config: ControllerConfig) -> None:
    """controller.fleet's channels to the engines and the remote index, and
    controller.service's tokenizers (but the builtin one, built on first use)."""
    ClientChannels.load(config.engine_tls, "engine_tls").with_token_file(
        config.engine_token_file, "engine_token_file"
    )
    index = config.index
    if index.remote is not None:
        ClientChannels.load(index.remote_tls, "index.remote_tls").with_token_file(
            index.remote_token_file, "index.remote_token_file"
        )
    else:
        _redis_files(index.backend, index.redis)
    default = config.tokenizer if config.tokenizer != Path(BUILTIN) else None
    ModelTokenizers.load(
        {model: path for model, path in config.tokenizers.items() if path != Path(BUILTIN)},
        default,
    )


def _redis_files(backend: str, redis: RedisBackendConfig) -> None:
    """indexer.redis_client's password file and TLS files, read as the index opens (at
    start)."""
    if backend.startswith(REDIS_SCHEMES):
        options = RedisOptions(**redis.backend_options())
        options.read_password()
        options.tls_files()
