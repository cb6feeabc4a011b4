"""A server's TLS credentials (`tls: {cert_file, key_file, client_ca_file}`), its files followed
as they change: a certificate renewed on disk (cert-manager's Secret, an operator's `mv`) is
served from the next connection, without a restart, as Envoy's and Go's reloading
certificate providers do.

gRPC asks `_CertificateFiles.fetch` before every handshake; it costs one `stat` a file while
they are unchanged. Changed files are used only once they make a pair (the key is the
certificate's, each holds PEM): a rotation caught halfway (one file written, not yet the
other) keeps the pair served before, with a warning, until the files match again.
"""

from __future__ import annotations

import logging
import ssl

import grpc

from kvplane.config import TlsConfig
from kvplane.errors import ConfigError
from kvplane.token_file import file_identity

log = logging.getLogger(__name__)


class _CertificateFiles:
    def __init__(self, tls: TlsConfig) -> None:
        self._tls = tls
        self._seen = self._identities()
        self.initial = self._load()

    def _identities(self) -> tuple[object, ...]:
        tls = self._tls
        return tuple(file_identity(p) for p in (tls.cert_file, tls.key_file, tls.client_ca_file))

    def _load(self) -> grpc.ServerCertificateConfiguration:
        """The files as a configuration; a ConfigError saying why they cannot be used."""
        tls = self._tls
        try:
            key = tls.key_file.read_bytes()
            cert = tls.cert_file.read_bytes()
            client_ca = tls.client_ca_file.read_bytes() if tls.client_ca_file else None
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file: {exc}") from exc
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                tls.cert_file, tls.key_file, password=b""
            )
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls: key_file {tls.key_file} and cert_file {tls.cert_file} do not make a "
                f"pair: {exc}"
            ) from exc
        return grpc.ssl_server_certificate_configuration([(key, cert)], client_ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed and make a pair; else None (gRPC keeps
        the one it has)."""
        seen = self._identities()
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            configuration = self._load()
        except ConfigError as exc:
            log.warning("%s; serving the certificate read before", exc)
            return None
        log.info("tls: %s changed: serving it from the next connection", self._tls.cert_file)
        return configuration


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Credentials serving `tls`'s certificate (requiring a client certificate its
    `client_ca_file` signed, when set), read again as the files change. Files that cannot be
    used at start are a ConfigError."""
    files = _CertificateFiles(tls)
    return grpc.dynamic_ssl_server_credentials(
        files.initial,
        # (grpc's stub leaves out the None its documentation allows: "no change".)
        files.fetch,  # type: ignore[arg-type]
        require_client_authentication=tls.client_ca_file is not None,
    )
