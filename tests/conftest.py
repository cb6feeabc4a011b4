"""Fixtures shared by every component's tests: private redis-server processes (session-scoped;
tests flush what they use), a test PKI made by openssl, and click's plain output under
CliRunner."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.core

from tests.redis_servers import RedisClusterNodes, RedisServer, running_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (no persistence)."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


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
def replicated_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A private Redis Cluster of three primaries with one replica each (a killed primary's
    replica takes over: `RedisClusterNodes.fail_over`)."""
    nodes = RedisClusterNodes(tmp_path / "replicated-cluster", replicas=1)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


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
    client certificate (client.pem/.key) it signed, and another CA (other-ca.pem); made by
    openssl. Server certificates that do not verify against ca.pem, each with its key:
    other-ca-server.pem (signed by other-ca), elsewhere.pem (for elsewhere.example only) and
    expired.pem (its validity ended in 2020); other-ca-client.pem, a client certificate
    other-ca signed."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
            "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"),
        )  # fmt: skip
    local = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    for name, ext, ca in [
        ("server", local, "ca"),
        ("client", "extendedKeyUsage=clientAuth", "ca"),
        ("other-ca-server", local, "other-ca"),
        ("other-ca-client", "extendedKeyUsage=clientAuth", "other-ca"),
        ("elsewhere", "subjectAltName=DNS:elsewhere.example", "ca"),
    ]:
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
        )  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.pem"),
            "-CAkey", str(d / f"{ca}.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"),
        )  # fmt: skip
    _expired_certificate(d, local)
    return d


def _expired_certificate(d: Path, ext: str) -> None:
    """expired.pem/.key, signed by ca.pem, valid in January 2020 only. `openssl x509` takes
    no start date (before 3.4), `openssl ca` does, with its database in files."""
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=expired",
        "-keyout", str(d / "expired.key"), "-out", str(d / "expired.csr"),
    )  # fmt: skip
    (d / "ca-db").mkdir()
    (d / "ca-db" / "index.txt").write_text("")
    (d / "ca-db" / "serial").write_text("1000\n")
    (d / "ca.cnf").write_text(
        "[ca]\ndefault_ca = expired\n"
        f"[expired]\ndatabase = {d}/ca-db/index.txt\nserial = {d}/ca-db/serial\n"
        f"new_certs_dir = {d}/ca-db\ndefault_md = sha256\npolicy = any\n"
        "x509_extensions = names\n"
        "[any]\ncommonName = supplied\n"
        f"[names]\n{ext}\n"
    )
    _openssl(
        "ca", "-batch", "-config", str(d / "ca.cnf"), "-cert", str(d / "ca.pem"),
        "-keyfile", str(d / "ca.key"), "-in", str(d / "expired.csr"),
        "-startdate", "20200101000000Z", "-enddate", "20200201000000Z", "-notext",
        "-out", str(d / "expired.pem"),
    )  # fmt: skip
