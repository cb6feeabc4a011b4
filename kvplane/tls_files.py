"""The PEM files of a TLS setting read and checked, for servers (`kvplane.server_tls`) and
clients (`kvplane.channels`) alike, at start and at each rotation: a file that is missing,
unreadable, not PEM of what it must hold, a key that is not the certificate's, or a CA file
OpenSSL cannot load is a `PemFileError` of one line naming the file. Left to gRPC, a server
given an unusable CA file logs lines of its C core and fails with a bare "Failed to bind",
and a client fails every handshake. `FollowedFiles` makes them again as they change.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from kvplane.errors import ConfigError
from kvplane.token_file import file_identity

log = logging.getLogger(__name__)

_Made = TypeVar("_Made")

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


class FollowedFiles(Generic[_Made]):
    """What `make` makes of the files at `paths` (`value`), made again when one of them
    changes: a `stat` a file while none does. The first `make` raises (a file that cannot be
    used at start is a mistake); later, a file that cannot be used (a rotation caught
    halfway) is a warning saying what is `kept`, and `value` stays."""

    def __init__(
        self, paths: tuple[Path | None, ...], make: Callable[[], _Made], kept: str
    ) -> None:
        self._paths = paths
        self._make = make
        self._kept = kept
        self._seen = self._identities()
        self.value = make()

    def _identities(self) -> tuple[object, ...]:
        return tuple(file_identity(path) for path in self._paths)

    def renewed(self) -> _Made | None:
        """The new `value` when the files changed since and can be used; else None."""
        seen = self._identities()
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            value = self._make()
        except ConfigError as exc:
            log.warning("%s; %s", exc, self._kept)
            return None
        self.value = value
        return value
