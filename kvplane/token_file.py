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
from functools import partial
from pathlib import Path

from kvplane.config import read_token_file
from kvplane.followed_files import FollowedFiles

log = logging.getLogger(__name__)


class TokenFile:
    """The token `path` holds (surrounding whitespace ignored), read again when it changes.
    The first read raises a ConfigError naming `setting` (the file is missing, unreadable or
    empty at start: a configuration mistake); later ones never raise."""

    def __init__(self, path: Path, setting: str) -> None:
        self.path = path
        self._setting = setting
        self._file = FollowedFiles(
            (path,), partial(read_token_file, path, setting), "keeping the token read before"
        )

    def current(self) -> str:
        before = self._file.value
        token = self._file.renewed()
        if token is not None and token != before:
            log.info("%s %s changed: using its new token", self._setting, self.path)
        return self._file.value
