"""What is made of files, made again as they change: a `stat` a file while none does, the files
read again when the identity of one (inode, size, modification time) changes, which a
Kubernetes Secret's swap of a symlink also changes. For the bearer token files
(`kvplane.token_file`) and the TLS files of servers and clients (`kvplane.server_tls`,
`kvplane.client_tls`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from kvplane.errors import ConfigError

log = logging.getLogger(__name__)

_Made = TypeVar("_Made")

FileIdentity = tuple[int, int, int, int]  # device, inode, size, modification time (ns)


def file_identity(path: Path | None) -> FileIdentity | None:
    """What changes when the file at `path` is replaced or rewritten (None: no file there,
    or no path); a symlink is followed, so a Kubernetes Secret's swap of its target shows."""
    if path is None:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


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
