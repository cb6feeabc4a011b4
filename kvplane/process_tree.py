"""A process's descendants, read from /proc (Linux): what a process started, and what those
started, so that stopping it can stop them all without a process group of their own."""

from __future__ import annotations

import contextlib
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """The processes under `pid`: its children, theirs, and so on (nearest first)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # it ended meanwhile
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
    found: list[int] = []
    generation = [pid]
    while generation:
        generation = [child for child, parent in parents.items() if parent in generation]
        found += generation
    return found
