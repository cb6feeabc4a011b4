"""The PEM files of a TLS setting read and checked, for servers (`kvplane.server_tls`) and
clients (`kvplane.channels`) alike, at start and at each rotation: a file that is missing,
unreadable, not PEM of what it must hold, a key that is not the certificate's, or a CA file
OpenSSL cannot load is a `PemFileError` of one line naming the file. Left to gRPC, a server
given an unusable CA file logs lines of its C core and fails with a bare "Failed to bind",
and a client fails every handshake. `kvplane.followed_files` makes them again as they change.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from kvplane.errors import ConfigError

log = logging.getLogger(__name__)

# What each file must hold, and the PEM header that shows it does.
CERTIFICATE = ("a certificate", b"-----BEGIN CERTIFICATE-----")
PRIVATE_KEY = ("a private key", b"PRIVATE KEY-----")  # PRIVATE KEY, RSA/EC PRIVATE KEY


class PemFileError(ConfigError):
    """A TLS file that cannot be used; the message names it."""


def read_pem(path: Path, holds: tuple[str, bytes], what: str) -> bytes:
    """The bytes of the file `what` (its setting's words) names, which must hold `holds`
    (CERTIFICATE, PRIVATE_KEY) in PEM."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PemFileError(f"cannot read {what} {path}: {exc.strerror}") from exc
    noun, header = holds
    if header not in data:
        raise PemFileError(f"{what} {path} does not hold {noun} in PEM")
    return data


def read_ca(path: Path, what: str) -> bytes:
    """`read_pem` of a CA file, also checked to load as OpenSSL's trusted certificates."""
    data = read_pem(path, CERTIFICATE, what)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise PemFileError(f"{what} {path} holds no usable certificate (OpenSSL: {why})") from exc
    return data


def check_key_pair(cert_file: Path, key_file: Path, message: str) -> None:
    """Raise a PemFileError saying `message` ("... cannot be used with ...") and why, when
    the key at `key_file` is not the certificate's at `cert_file` (both read already)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file, password=b"")
    except (ssl.SSLError, OSError) as exc:
        why = (
            "not its key"
            if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH"
            else str(exc)
        )
        raise PemFileError(f"{message}: {why}") from exc
