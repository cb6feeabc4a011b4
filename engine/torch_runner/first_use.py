"""What the first-use builds (the builtin model, the native kernels) share: the cache they
build into, and what they do when SIGTERM stops them: unwind, so that the scratch folder is
removed, then end the process as SIGTERM does.

The cache: `$KVPLANE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvplane`, else `~/.cache/kvplane`.

SIGTERM's default action ends the process on the spot, skipping every `finally`; `kvplane
up` stops members still starting with SIGTERM (Ctrl-C during a first start, or `up` gone),
so each such stop left a dead scratch folder in the cache (and a compiler running on).

torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """kvplane's cache folder, which every first-use build writes under (its own subfolder)."""
    root = os.environ.get("KVPLANE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvplane"


class _Terminated(BaseException):
    """SIGTERM arrived during the build (a BaseException: nothing on the way may catch it)."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block SIGTERM raises, and once the block has unwound it ends the process
    (its exit status still says SIGTERM). Only where SIGTERM is not handled already (a
    server's own graceful stop stays) and only in the main thread (the one Python signals
    reach); elsewhere the block runs as it is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # ends the process
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
