"""A bearer token kept in a file, followed as the file changes: a token rotated on disk (a
Kubernetes Secret's atomic swap, an operator's edit) takes effect without a restart, on the
servers that ask for it (`auth.token_file`) and on the clients that present it
(`engine_token_file`, the planner's token files, ...), as Prometheus' `bearer_token_file` and
client-go's service-account token are followed.

`TokenFile.current()` costs one `stat` while the file is unchanged; the file is read again
when its identity (inode, size, modification time) changes, which a Secret's swap of a
symlink also changes. A file that cannot be read, or is empty, once changed (caught halfway
through a non-atomic write, or removed) keeps the last token, with one warning a change.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvplane.config import read_token_file
from kvplane.errors import ConfigError

log = logging.getLogger(__name__)

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


class TokenFile:
    """The token `path` holds (surrounding whitespace ignored), read again when it changes.
    The first read raises a ConfigError naming `setting` (the file is missing, unreadable or
    empty at start: a configuration mistake); later ones never raise."""

    def __init__(self, path: Path, setting: str) -> None:
        self.path = path
        self._setting = setting
        self._seen = file_identity(path)
        self._token = read_token_file(path, setting)

    def current(self) -> str:
        seen = file_identity(self.path)
        if seen == self._seen:
            return self._token
        self._seen = seen
        try:
            token = read_token_file(self.path, self._setting)
        except ConfigError as exc:
            log.warning("%s; keeping the token read before", exc)
            return self._token
        if token != self._token:
            log.info("%s %s changed: using its new token", self._setting, self.path)
        self._token = token
        return token
