"""The files an engine reads as it starts (`kvplane engine serve`), by the loaders it uses: its
server's TLS and token files (`kvplane.server.read_server_files`) and a DECODE engine's for
its peers (`kv_transfer.peer_tls`, `peer_token_file`: `peer_channels`, which
engine.server.kv_pull dials them with). `read_start_files` reads them all, so that a check
made before any engine starts (`kvplane up`'s preflight of an engine member, and of a
planner's local engines: `planner.engine_args`, which `kvplane planner run` also makes as it
loads) fails on a missing or unusable file as the engine would, one ConfigError naming its
setting. Without torch, as engine.config (the control plane runs these checks)."""

from __future__ import annotations

from engine.config import EngineConfig, KvTransferConfig
from kvplane.channels import ClientChannels
from kvplane.server import read_server_files


def peer_channels(config: KvTransferConfig) -> ClientChannels:
    """The channels a DECODE engine pulls KV sessions from its peers on, their files read."""
    return ClientChannels.load(config.peer_tls, "kv_transfer.peer_tls").with_token_file(
        config.peer_token_file, "kv_transfer.peer_token_file"
    )


def read_start_files(config: EngineConfig) -> None:
    """Read the files an engine serving `config` reads as it starts; a ConfigError for the
    first that is missing or cannot be used."""
    read_server_files(config)
    peer_channels(config.kv_transfer)
