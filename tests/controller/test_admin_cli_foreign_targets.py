"""`kvplane admin` pointed at a port where no kvplane server answers, run as an operator runs
it (a subprocess): what the one line on stderr says of the port."""

from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

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


def test_a_silent_server_is_named_by_the_calls_without_a_deadline(
    silent_listener: str, pki: Path
) -> None:
    """A drain and an index dump carry no deadline of their own (they may run long): a server
    that takes the connection and says nothing fails them when gRPC's connect timeout passes,
    which said "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: connection
    attempt timed out before receiving SETTINGS frame"; now what to check, as the calls with a
    deadline say it ("did not answer within 10 s (is its process hung, ...)"). Over TLS too,
    where gRPC says "Handshake read failed (Endpoint closing)" instead."""
    says = (
        f"kvplane: error: {silent_listener}: UNAVAILABLE: the server took the connection but "
        "did not answer (is its process hung, stopped or overloaded, or is it not a gRPC "
        "server? check it and its log)"
    )
    tls = ["--tls-ca", str(pki / "ca.pem")]
    commands = (["drain", "--self"], ["index", "dump"], [*tls, "drain", "--self"])
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


@pytest.fixture
def older_controller() -> Iterator[str]:
    """A controller of an older release, as the CLI sees one: its health service names the
    admin and OpenEngine services it serves, but the calls (newer than it) are not found (here
    none is: an older release lacks only some)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    checks = health.HealthServicer()
    for service in ("kvplane.v1.Admin", "openengine.v1.OpenEngine"):
        checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_a_controller_without_a_call_is_said_older_not_another_kind(older_controller: str) -> None:
    """A controller answering "Method not found!" was said to be what it is not: "is not a
    controller or an engine: it is a kvplane controller", or "`drain ENGINE` needs a
    controller: ... is a kvplane controller, which serves no kvplane admin API"; now a
    release older than the CLI's, in JSON mode too (stdout empty, one line on stderr)."""
    says = (
        f"kvplane: error: {older_controller} is a kvplane controller without this call (a "
        "kvplane release older than this CLI's? upgrade it)"
    )
    commands = (["health"], ["drain", "e1"], ["drain", "e1", "--output", "json"], ["workers"])
    for command in commands:
        assert _failed_with(_admin(older_controller, *command)) == says, command


@contextmanager
def _accepting(handle: Callable[[socket.socket], object]) -> Iterator[str]:
    """A port (its address) whose every connection `handle` takes, in a thread of its own."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            with connection, contextlib.suppress(OSError):
                handle(connection)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        listener.close()
        thread.join()


@pytest.fixture
def tls_service(pki: Path) -> Iterator[str]:
    """A TLS service that is not gRPC (OpenSSL's, as a TLS proxy's or an HTTPS server's port):
    it offers no HTTP/2, and resets a plaintext client's connection (the bytes it did not
    read)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.pem", pki / "server.key")

    def handshake(connection: socket.socket) -> None:
        with context.wrap_socket(connection, server_side=True) as secured:
            secured.recv(1)

    with _accepting(handshake) as address:
        yield address


def test_a_tls_service_that_is_not_grpc_is_said_so(tls_service: str, pki: Path) -> None:
    """Dialled in plaintext it resets the connection: that was gRPC's words as they are,
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:...: recvmsg:Connection
    reset by peer (104)", where a gRPC TLS server's hang-up gets the TLS hint; over TLS,
    "... Cannot check peer: missing selected ALPN property." as it was."""
    plain = _failed_with(_admin(tls_service, "health"))
    assert plain.startswith(
        f"kvplane: error: {tls_service}: UNAVAILABLE: the server reset the connection (recvmsg:"
    ), plain
    assert plain.endswith(") (a TLS server? give --tls-ca)"), plain
    secured = _failed_with(_admin(tls_service, "--tls-ca", str(pki / "ca.pem"), "health"))
    assert secured == (
        f"kvplane: error: {tls_service}: UNAVAILABLE: the server does not speak gRPC (a TLS "
        "service without HTTP/2: another listens there?)"
    )


def test_a_host_that_does_not_resolve_is_said_so() -> None:
    """gRPC's resolver said it at length: "errors resolving nope.invalid:8100:
    [field:hostname lookup error:address lookup failed for nope.invalid:8100: Domain name not
    found]". Now the host does not resolve, why, and which option names it."""
    target = "nope.invalid:8100"  # .invalid never resolves (RFC 2606)
    said = _failed_with(_admin(target, "health"))
    assert said.startswith(f"kvplane: error: {target}: UNAVAILABLE: the host does not resolve ("), (
        said
    )
    assert said.endswith(") (a misspelt host? give --target HOST:PORT)"), said
    assert "lookup" not in said and "resolving" not in said, said


@pytest.fixture
def resetting_listener() -> Iterator[str]:
    """A port that resets each connection once the client speaks (a firewall's, a service
    dropping what it does not read)."""

    def reset(connection: socket.socket) -> None:
        # No lingering: close sends a reset, not a FIN.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.recv(1)

    with _accepting(reset) as address:
        yield address


def test_a_connection_reset_in_the_tls_handshake_is_said_so(
    resetting_listener: str, pki: Path
) -> None:
    """Over TLS it was gRPC's words as they are: "failed to connect to all addresses; last
    error: UNAVAILABLE: ipv4:...: Handshake read failed (recvmsg:Connection reset by peer
    (104))"; now as the reset of a plaintext connection is said."""
    said = _failed_with(_admin(resetting_listener, "--tls-ca", str(pki / "ca.pem"), "health"))
    assert said.startswith(
        f"kvplane: error: {resetting_listener}: UNAVAILABLE: the server reset the connection in "
        "the TLS handshake (recvmsg:Connection reset by peer"
    ), said
    assert "failed to connect" not in said, said
