"""The shared index over TLS to a real redis-server (docs/redis.md, `redis.tls`): a
`redis://` or `rediss://` URL with the files of `redis.tls` reaches a Redis that asks for a
client certificate, and a file that is missing or unusable is one ConfigError naming it as
the index opens, not a failed connection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.batch import ActionType
from indexer.redis_backend import open_redis_backend
from kvplane.errors import ConfigError
from tests.indexer.redis_refusals import WORKER, batch, held
from tests.redis_servers import RedisServer, free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tls_port(tmp_path: Path, pki: Path) -> Iterator[int]:
    """The TLS port of a redis-server that requires a client certificate of the test CA
    (its plain port answers the test's own client only)."""
    port = free_port()
    server = RedisServer(
        tmp_path / "redis",
        extra_args=(
            "--tls-port", str(port),
            "--tls-cert-file", str(pki / "server.pem"),
            "--tls-key-file", str(pki / "server.key"),
            "--tls-ca-cert-file", str(pki / "ca.pem"),
            "--tls-auth-clients", "yes",
        ),
    )  # fmt: skip
    server.start()
    try:
        yield port
    finally:
        server.stop()


@pytest.mark.parametrize("scheme", ["redis", "rediss"])
async def test_the_index_reaches_a_redis_serving_tls_with_its_tls_files(
    tls_port: int, pki: Path, scheme: str
) -> None:
    """Before, the client was refused by redis-py (TypeError: an unexpected `ssl` option)
    whatever the files, so the index could not open."""
    backend = await open_redis_backend(
        f"{scheme}://127.0.0.1:{tls_port}/0",
        buckets=16,
        tls_ca_file=pki / "ca.pem",
        tls_cert_file=pki / "client.pem",
        tls_key_file=pki / "client.key",
    )
    try:
        await backend.apply(batch(ActionType.REPORT, (1, 2)))
        assert await held(backend, [1, 2]) == [(WORKER, (1, 2))]
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        (
            {"tls_ca_file": "{missing}"},
            "redis.tls: cannot read ca_file {missing}: No such file or directory",
        ),
        (
            {"tls_ca_file": "{pki}/ca.pem", "tls_cert_file": "{pki}/client.pem"},
            "redis.tls: cert_file {pki}/client.pem does not hold a private key in PEM",
        ),
        (
            {"tls_cert_file": "{pki}/client.pem", "tls_key_file": "{pki}/server.key"},
            "redis.tls: key_file {pki}/server.key and cert_file {pki}/client.pem do not make"
            " a pair: not its key",
        ),
    ],
)
async def test_an_unusable_redis_tls_file_is_a_config_error_as_the_index_opens(
    tls_port: int, pki: Path, tmp_path: Path, files: dict[str, str], problem: str
) -> None:
    def filled(text: str) -> str:
        return text.replace("{missing}", str(tmp_path / "missing")).replace("{pki}", str(pki))

    with pytest.raises(ConfigError) as error:
        await open_redis_backend(
            f"redis://127.0.0.1:{tls_port}/0",
            buckets=16,
            **{option: Path(filled(path)) for option, path in files.items()},
        )
    assert str(error.value) == filled(problem)


async def test_tls_over_a_unix_socket_is_a_config_error(pki: Path, tmp_path: Path) -> None:
    """Redis serves TLS on a TCP port only. Before, redis-py refused the client's options (a
    TypeError: an unexpected `path`) as the index opened."""
    url = f"unix://{tmp_path}/redis.sock"
    with pytest.raises(ConfigError) as error:
        await open_redis_backend(url, buckets=16, tls_ca_file=pki / "ca.pem")
    assert str(error.value) == (
        f"redis.tls: a unix:// socket carries no TLS (Redis serves TLS on a TCP port), but"
        f" backend is {url}: remove redis.tls or set backend to rediss://HOST:PORT/DB"
    )
