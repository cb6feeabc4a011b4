"""What a CLI printed in rich's error box (click's usage errors, through typer), compared as
text: rich wraps a line between words, and anywhere in a word longer than the box's line (a
file path under a long temporary folder), so the box's borders and every whitespace are left
out on both sides: `unboxed(expected) in unboxed(output)`."""

from __future__ import annotations


def unboxed(text: str) -> str:
    """`text` without the box's side borders and without whitespace."""
    return "".join(text.replace("│", "").split())
