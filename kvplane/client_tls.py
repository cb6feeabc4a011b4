"""A client's TLS credentials (a `ClientTlsConfig`: `ca_file`, a client certificate), its
files followed as they change, as a server's are (`kvplane.server_tls`): a client
certificate or CA bundle renewed on disk (cert-manager's Secret, an operator's `mv`) is used
by every channel dialled from then on, without a restart. A long-running client's channel
(`channels.Redialling`) is dialled again with the new files before its next call
(`ClientChannels.dialled_with_old_files`).

`ClientTlsFiles.current()` costs one `stat` a file while they are unchanged. Changed files
are used only once they can be (each holds PEM, the key is the certificate's): a rotation
caught halfway keeps the credentials read before, with a warning, until they can.
"""

from __future__ import annotations

import logging
from typing import Literal

import grpc

from kvplane import tls_files
from kvplane.config import ClientTlsConfig
from kvplane.errors import ConfigError
from kvplane.followed_files import FollowedFiles

log = logging.getLogger(__name__)

TlsFileField = Literal["ca_file", "cert_file", "key_file"]


class TlsFileError(ConfigError):
    """A file of a `ClientTlsConfig` that cannot be used (missing, unreadable, not PEM, a key
    not the certificate's); `field` says which, for a client whose settings are named
    otherwise (the CLIs' --tls-* flags)."""

    def __init__(self, message: str, field: TlsFileField) -> None:
        super().__init__(message)
        self.field: TlsFileField = field


class ClientTlsFiles:
    """The credentials `tls`'s files make, read again when they change. The first read
    raises a TlsFileError prefixed with `where` ("engine_tls: "); later ones never raise."""

    def __init__(self, tls: ClientTlsConfig, where: str = "") -> None:
        self._tls = tls
        self._prefix = f"{where}: " if where else ""
        self._files = FollowedFiles(
            (tls.ca_file, tls.cert_file, tls.key_file),
            self._load,
            "dialling with the files read before",
        )
        # A client certificate is presented (mutual TLS).
        self.client_certificate = tls.cert_file is not None

    def _load(self) -> grpc.ChannelCredentials:
        tls = self._tls
        field: TlsFileField = "ca_file"
        try:
            root = (
                tls_files.read_ca(tls.ca_file, "TLS CA file") if tls.ca_file is not None else None
            )
            key = chain = None
            if tls.cert_file is not None and tls.key_file is not None:
                field = "cert_file"
                chain = tls_files.read_pem(
                    tls.cert_file, tls_files.CERTIFICATE, "TLS certificate file"
                )
                field = "key_file"
                key = tls_files.read_pem(tls.key_file, tls_files.PRIVATE_KEY, "TLS key file")
                tls_files.check_key_pair(
                    tls.cert_file,
                    tls.key_file,
                    f"TLS key file {tls.key_file} cannot be used with certificate {tls.cert_file}",
                )
        except tls_files.PemFileError as exc:
            raise TlsFileError(f"{self._prefix}{exc}", field) from exc
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=chain
        )

    def current(self) -> grpc.ChannelCredentials:
        """The credentials for a channel dialled now."""
        if self._files.renewed() is not None:
            log.info("%sTLS files changed: dialling with them from now on", self._prefix)
        return self._files.value
