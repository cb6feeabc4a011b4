"""`kvplane up`'s preflight of a member's files: what its process reads as it starts (its TLS
certificate, key and CA files, its bearer-token files, a controller's tokenizers, a Redis
index's password and TLS files, a planner's Kubernetes token and CA files and the files of its
engines' config), read here, before any member starts, by the loaders the process itself
uses, so that a missing or unusable file is the same one-line ConfigError naming its setting
and no member is started only to be stopped again when a later one fails on it.

What is read only once a member runs (a checkpoint's weights) is left to the member, as is the
builtin model and its tokenizer, which kvplane builds on first use.

`kvplane planner run` makes the part of a planner's that concerns its local engines as it
loads (`check_pool_engines`): its own channels and Kubernetes client it makes as it starts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from controller.config import ControllerConfig
from controller.tokenizers import BUILTIN, ModelTokenizers
from engine.config import EngineConfig
from indexer.backends import REDIS_SCHEMES
from indexer.config import IndexerConfig, OpenEngineSourceConfig, RedisBackendConfig
from indexer.redis_client import RedisOptions
from kvplane.channels import ClientChannels
from kvplane.config import ServerConfig
from kvplane.errors import ConfigError
from kvplane.server_tls import server_credentials
from kvplane.token_file import TokenFile
from planner.config import PlannerConfig
from planner.engine_args import engine_args_problem, pool_engine_configs


def check_member_files(config: ServerConfig | PlannerConfig, where: str) -> None:
    """Read the files the member of `config` reads as it starts; a ConfigError
    (`invalid config in WHERE: ...`) for the first that is missing or cannot be used."""
    with _config_in(where):
        _read_files(config)


def check_pool_engines(config: PlannerConfig, where: str) -> None:
    """`kvplane planner run`'s check as it loads, before any engine starts: the arguments of
    each pool's local engines and the files their --config names, read as up reads a planner
    member's; a ConfigError (`invalid config in WHERE: live.engine_args ...: PROBLEM`)."""
    with _config_in(where):
        _pool_engine_files(config)


@contextmanager
def _config_in(where: str) -> Iterator[None]:
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"invalid config in {where}: {exc}") from None


def _read_files(config: ServerConfig | PlannerConfig) -> None:
    if isinstance(config, PlannerConfig):
        _planner_files(config)
        return
    if config.tls is not None:  # kvplane.server.start_server's
        server_credentials(config.tls)
    if config.auth is not None:
        TokenFile(config.auth.token_file, "auth.token_file")
    if isinstance(config, ControllerConfig):
        _controller_files(config)
    elif isinstance(config, EngineConfig):
        kv_transfer = config.kv_transfer  # a DECODE engine's (engine.server.kv_pull)
        ClientChannels.load(kv_transfer.peer_tls, "kv_transfer.peer_tls").with_token_file(
            kv_transfer.peer_token_file, "kv_transfer.peer_token_file"
        )
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
    _pool_engine_files(config)


def _pool_engine_files(config: PlannerConfig) -> None:
    """The arguments of each pool's local engines, read as `kvplane engine serve` reads them
    (planner.engine_args), and the files their --config names, as those engines read them."""
    for engines in pool_engine_configs(config):
        try:
            _read_files(engines.config)
        except ConfigError as exc:
            problem = f"invalid config in {engines.config_file}: {exc}"
            raise ConfigError(engine_args_problem(engines.setting, problem)) from None


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
