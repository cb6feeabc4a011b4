"""A `--tokens-file` that holds no token ids, given to the commands that read one (`admin
match`, `admin route`, `admin index match`, `kvplane complete`) run as an operator runs them
against real servers: a usage error, as a blank `--prompt` is."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.test_processes import _wait_port

KVPLANE = [sys.executable, "-m", "kvplane"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A sim engine, a controller (no engines) and an indexer, each its own process: their
    addresses by kind."""
    tmp_path = tmp_path_factory.mktemp("servers")
    started: list[subprocess.Popen[bytes]] = []
    addresses = {}
    try:
        for kind, serve in (
            ("engine", ["engine", "serve", "--model", "sim"]),
            ("controller", ["controller", "serve"]),
            ("indexer", ["indexer", "serve"]),
        ):
            port_file = tmp_path / f"{kind}.port"
            process = subprocess.Popen(
                [*KVPLANE, *serve, "--listen", "127.0.0.1:0", "--port-file", str(port_file)],
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / f"{kind}.log").open("wb"),
            )
            started.append(process)
            addresses[kind] = f"127.0.0.1:{_wait_port(port_file, process)}"
        yield addresses
    finally:
        for process in started:
            process.kill()
            process.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("holds", ["", "[]", '{"token_ids": []}', " \n"])
def test_a_tokens_file_without_ids_is_a_usage_error(
    tmp_path: Path, servers: dict[str, str], holds: str
) -> None:
    """It was sent as an empty prompt: the controller refused it (exit 1, "INVALID_ARGUMENT:
    the prompt is empty"), `complete` went on to the engine, and an indexer matched it ("0
    query blocks", exit 0)."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(holds)
    given = ["--tokens-file", str(tokens)]
    for command in (
        ["admin", "--target", servers["controller"], "match", *given],
        ["admin", "--target", servers["controller"], "route", *given],
        ["admin", "--target", servers["indexer"], "index", "match", *given],
        ["complete", "--target", servers["engine"], *given],
    ):
        result = subprocess.run([*KVPLANE, *command], capture_output=True, text=True)
        assert (result.returncode, result.stdout) == (2, ""), (command, result.stderr)
        error = " ".join(result.stderr.split())
        assert f"Error: Invalid value for --tokens-file: {tokens} holds no token ids" in error
