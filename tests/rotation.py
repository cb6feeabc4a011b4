"""Files rotated on disk as a Kubernetes Secret's update or an operator's `mv` rotates them:
replaced at once, never seen half-written."""

from __future__ import annotations

from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    """Replace the file at `path` with one holding `data`, at once."""
    partial = path.with_name(f".{path.name}.new")
    partial.write_bytes(data)
    partial.replace(path)
