"""A server's TLS credentials (`tls: {cert_file, key_file, client_ca_file}`), its files followed
as they change: a certificate renewed on disk (cert-manager's Secret, an operator's `mv`) is
served from the next connection, without a restart, as Envoy's and Go's reloading
certificate providers do.

gRPC asks `fetch` before every handshake; it costs one `stat` a file while
they are unchanged. Changed files are used only once they can be (`kvplane.tls_files`: each
holds PEM, the key is the certificate's, the client CA file loads): a rotation caught halfway
(one file written, not yet the other) keeps the pair served before, with a warning naming the
file, until the files match again. At start, a file that cannot be used is a one-line
PemFileError naming it (gRPC would fail with a bare "Failed to bind").
"""

from __future__ import annotations

import logging
from functools import partial

import grpc

from kvplane.config import TlsConfig
from kvplane.followed_files import FollowedFiles
from kvplane.tls_files import (
    CERTIFICATE,
    PRIVATE_KEY,
    PemFileError,
    check_key_pair,
    read_ca,
    read_pem,
)

log = logging.getLogger(__name__)


def _configuration(tls: TlsConfig) -> grpc.ServerCertificateConfiguration:
    """The files as a configuration; a PemFileError naming the file that cannot be used."""
    try:
        cert = read_pem(tls.cert_file, CERTIFICATE, "cert_file")
        key = read_pem(tls.key_file, PRIVATE_KEY, "key_file")
        check_key_pair(
            tls.cert_file,
            tls.key_file,
            f"key_file {tls.key_file} and cert_file {tls.cert_file} do not make a pair",
        )
        client_ca = read_ca(tls.client_ca_file, "client_ca_file") if tls.client_ca_file else None
    except PemFileError as exc:
        raise PemFileError(f"tls: {exc}") from exc
    return grpc.ssl_server_certificate_configuration([(key, cert)], client_ca)


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Credentials serving `tls`'s certificate (requiring a client certificate its
    `client_ca_file` signed, when set), read again as the files change. Files that cannot be
    used at start are a ConfigError."""
    files = FollowedFiles(
        (tls.cert_file, tls.key_file, tls.client_ca_file),
        partial(_configuration, tls),
        "serving the certificate read before",
    )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed and can be used; else None (gRPC
        keeps the one it has)."""
        configuration = files.renewed()
        if configuration is not None:
            log.info("tls: %s changed: serving it from the next connection", tls.cert_file)
        return configuration

    return grpc.dynamic_ssl_server_credentials(
        files.value,
        # (grpc's stub leaves out the None its documentation allows: "no change".)
        fetch,  # type: ignore[arg-type]
        require_client_authentication=tls.client_ca_file is not None,
    )
