"""Fixtures shared by every component's tests: private redis-server processes (session-scoped;
tests flush what they use), a test PKI made by openssl, and click's plain output under
CliRunner."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.core
from redis_servers import RedisClusterNodes, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (no persistence)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster (no replicas) for the session."""
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def plain_click_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CliRunner (standalone mode) typer draws a usage error, and --help, in boxes;
    `kvplane` (kvplane.cli.main) prints a usage error as click's plain lines, `Error: ...` on
    one line. This makes CliRunner print click's plain text (help included)."""
    monkeypatch.setattr(typer.core, "HAS_RICH", False)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA (ca.pem), a server certificate for localhost and 127.0.0.1 (server.pem/.key) and a
    client certificate (client.pem/.key) it signed, and another CA (other-ca.pem) that signed
    nothing here; made by openssl."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
            "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"),
        )  # fmt: skip
    for name, ext in [
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
        )  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
            "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"),
        )  # fmt: skip
    return d
