"""`kvplane admin` pointed at a port where no kvplane server answers, run as an operator runs
it (a subprocess): what the one line on stderr says of the port."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.processes import DEFAULT_SIGNALS
from tests.redis_servers import RedisServer


def _admin(target: str, *command: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvplane", "admin", "--target", target, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _failed_with(process: subprocess.Popen[str]) -> str:
    """The one line a failed command printed on stderr (nothing on stdout, exit 1)."""
    out, err = process.communicate()
    assert (process.returncode, out) == (1, ""), err
    assert err.count("\n") == 1, err
    return err.strip()


def test_a_redis_port_is_not_taken_for_a_metrics_address(redis_server: RedisServer) -> None:
    """A Redis answers gRPC's HTTP/2 preface with "-ERR ...": said not to speak gRPC, where it
    was said to answer HTTP/1 ("a /metrics address?"), for every kind of call."""
    target = f"127.0.0.1:{redis_server.port}"
    says = (
        f"kvplane: error: {target}: UNAVAILABLE: the server does not speak gRPC (another "
        "service listens there?)"
    )
    for command in (["workers"], ["drain", "--self"], ["index", "stats"]):
        assert _failed_with(_admin(target, *command)) == says, command


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A port that takes connections and never sends a byte (a stopped process's socket)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_silent_server_is_named_by_the_calls_without_a_deadline(silent_listener: str) -> None:
    """A drain and an index dump carry no deadline of their own (they may run long): a server
    that takes the connection and says nothing fails them when gRPC's connect timeout passes,
    which said "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: connection
    attempt timed out before receiving SETTINGS frame"; now what to check, as the calls with a
    deadline say it ("did not answer within 10 s (is its process hung, ...)")."""
    says = (
        f"kvplane: error: {silent_listener}: UNAVAILABLE: the server took the connection but "
        "did not answer (is its process hung, stopped or overloaded, or is it not a gRPC "
        "server? check it and its log)"
    )
    commands = (["drain", "--self"], ["index", "dump"])
    running = [_admin(silent_listener, *command) for command in commands]  # side by side
    for command, process in zip(commands, running, strict=True):
        assert _failed_with(process) == says, command


def test_a_drain_interrupted_before_any_reply_is_not_said_to_go_on() -> None:
    """Ctrl-C while `drain --self` waits for a target that took the connection and has not
    answered: it said "the drain of HOST:PORT goes on (leaving it does not undo it)", of a
    drain no server had even heard of; now that none answered yet, and where to look."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(60)  # a hang guard
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        drain = subprocess.Popen(
            [
                *DEFAULT_SIGNALS,
                sys.executable,
                "-m",
                "kvplane",
                "admin",
                "-t",
                target,
                "drain",
                "--self",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        connection, _ = listener.accept()  # the CLI is in the call
        with connection:
            drain.send_signal(signal.SIGINT)
            out, err = drain.communicate()
    assert (drain.returncode, out) == (130, ""), err
    assert err == (
        f"kvplane: interrupted: no reply to the drain of {target} yet: `kvplane admin workers` "
        "or `health` shows whether it started\n"
    )
