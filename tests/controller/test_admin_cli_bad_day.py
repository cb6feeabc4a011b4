"""`kvplane admin` against a controller on an operator's bad day, every part its own process:
the controller dying while the CLI follows a drain, a fleet whose engines are all down."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.controller.test_processes import _wait_port

KVPLANE = [sys.executable, "-m", "kvplane"]


def _admin_json(target: str, *command: str) -> dict[str, Any]:
    out = subprocess.run(
        [*KVPLANE, "admin", "--target", target, *command, "--output", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    reply: dict[str, Any] = json.loads(out.stdout)
    return reply


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Poll `condition` until it holds; a hang guard, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[Any]]]:
    processes: list[subprocess.Popen[Any]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def _serve(tmp_path: Path, started: list[subprocess.Popen[Any]], kind: str, config: str) -> str:
    (tmp_path / f"{kind}.yaml").write_text(config)
    port_file = tmp_path / f"{kind}.port"
    serve = ["serve", "--config", str(tmp_path / f"{kind}.yaml"), "--port-file", str(port_file)]
    process = subprocess.Popen(
        [*KVPLANE, kind, *serve],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / f"{kind}.log").open("wb"),
    )
    started.append(process)
    return f"127.0.0.1:{_wait_port(port_file, process)}"


def _controller_of(
    tmp_path: Path, started: list[subprocess.Popen[Any]], engine: str, state: str
) -> str:
    """A controller process whose fleet is `engine`, once it shows the engine in `state`."""
    controller = _serve(
        tmp_path,
        started,
        "controller",
        f"listen: 127.0.0.1:0\nengines:\n  - {{address: {engine}}}\n",
    )
    _until(
        lambda: _admin_json(controller, "workers")["workers"][0]["state"] == state,
        f"the controller finds the engine {state}",
    )
    return controller


@pytest.mark.timeout(180)
def test_a_controller_lost_mid_drain_is_not_put_down_to_tls(
    tmp_path: Path, started: list[subprocess.Popen[Any]]
) -> None:
    """It said "UNAVAILABLE: Stream removed (Socket closed) (a TLS server? give --tls-ca)": a
    hang-up read as a TLS handshake refused, though the drain's events had come through, and
    nothing of the drain, which the engine goes on with."""
    # A slow sim engine (steps 10x longer), so that a long request keeps the drain going.
    engine = _serve(
        tmp_path,
        started,
        "engine",
        "listen: 127.0.0.1:0\nmodel: sim\nsim: {time_scale: 10.0}\n"
        "kv_events: {zmq_enabled: false}\n",
    )
    controller = _controller_of(tmp_path, started, engine, "ready")
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(i) for i in range(1, 65)))
    given = ["--tokens-file", str(tokens), "--max-tokens", "3000"]
    request = subprocess.Popen(
        [*KVPLANE, "complete", "--target", engine, *given],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started.append(request)
    _until(lambda: _admin_json(engine, "load")["running_requests"] == 1, "the request runs")

    drain = subprocess.Popen(
        [*KVPLANE, "admin", "--target", controller, "drain", engine],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(drain)
    assert drain.stdout is not None
    assert drain.stdout.readline().startswith("STARTED  in flight 1")
    started[1].send_signal(signal.SIGKILL)  # the controller
    out, err = drain.communicate()

    assert drain.returncode == 1, (out, err)
    assert err.count("\n") == 1, err
    assert err.startswith(f"kvplane: error: {controller}: UNAVAILABLE: "), err
    assert "TLS" not in err, err
    assert err.rstrip().endswith(
        f"(the drain of engine {engine} had started: `kvplane admin workers` or `health` "
        "shows whether it goes on)"
    ), err
    # And it does: the engine drains still, its request running (not serving: exit 1).
    health = subprocess.run(
        [*KVPLANE, "admin", "--target", engine, "health", "--output", "json"],
        capture_output=True,
        text=True,
    )
    assert health.returncode == 1, health.stderr
    assert json.loads(health.stdout)["state"] == "HEALTH_STATE_DRAINING", health.stdout


@pytest.mark.timeout(120)
def test_abort_all_in_a_fleet_of_unreachable_engines_names_them(
    tmp_path: Path, started: list[subprocess.Popen[Any]]
) -> None:
    """`abort --all` when no engine of the fleet can be reached said "no engine could be
    reached: the fleet has no engine", of a fleet that has one: now the engines, each with
    its state, as `route` names them."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        engine = f"127.0.0.1:{closed.getsockname()[1]}"
    controller = _controller_of(tmp_path, started, engine, "unreachable")
    result = subprocess.run(
        [*KVPLANE, "admin", "--target", controller, "abort", "--all"],
        capture_output=True,
        text=True,
    )
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert result.stderr == (
        f"kvplane: error: {controller}: UNAVAILABLE: no engine could be reached: {engine} "
        "unreachable\n"
    )
