"""The README's CLI section is the CLI: every command line it shows names commands that exist,
under the groups it names, and options that the command (or a group on its way) takes. A
command or option renamed or removed without the README fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from kvplane.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _cli_block() -> list[str]:
    """The README's CLI block, line by line, comments cut."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## The CLI\n", 1)[1].split("```\n", 2)[1]
    return [raw.partition("  #")[0].rstrip() for raw in block.splitlines()]


def _cli_lines() -> list[str]:
    """The CLI block's command lines, each with the indented lines that go on with it
    (`kvplane engine serve ...` and its second line of options)."""
    lines: list[str] = []
    for line in _cli_block():
        if line.startswith("kvplane "):
            lines.append(line)
        elif line.startswith(" ") and line.strip() and lines:
            lines[-1] += " " + line.strip()
    return lines


# The commands are click's (typer's own copy of it, which it does not export): Any.


def _is_group(command: Any) -> bool:
    return hasattr(command, "list_commands")


def _options(command: Any) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def _check(line: str, root: Any) -> list[str]:
    """What `line` names that the CLI lacks: a word (or `a|b` alternatives) where a group
    expects its command, an option none of the commands named so far takes."""
    ctx = root.make_context("kvplane", [], resilient_parsing=True)
    path: list[list[Any]] = [[root]]  # the commands each word named (alternatives)
    problems = []
    for token in line.split()[1:]:
        pieces = [piece.strip("[]") for piece in token.split("|")]
        groups = [c for c in path[-1] if _is_group(c)]
        if groups == path[-1] and all(re.fullmatch(r"[a-z]+", piece) for piece in pieces):
            named = [(piece, group.get_command(ctx, piece)) for group in groups for piece in pieces]
            problems += [f"command {piece!r}" for piece, command in named if command is None]
            path.append([command for _, command in named if command is not None])
            continue
        known = set().union(*(_options(command) for level in path for command in level))
        problems += [p for p in pieces if p.startswith("--") and p not in known]
    return problems


def _root() -> Any:
    root = typer.main.get_command(app)
    assert _is_group(root)
    return root


def test_the_readme_shows_command_lines() -> None:
    lines = _cli_lines()
    assert any(line.startswith("kvplane admin ") for line in lines)
    assert any(line.startswith("kvplane bench ") for line in lines)
    # Every option the block shows (outside comments) is in a line checked below, those of
    # a command's second line (`--instance-id`, `--session-key`) included.
    shown = set(re.findall(r"--[a-z][a-z-]*", "\n".join(_cli_block())))
    checked = set(re.findall(r"--[a-z][a-z-]*", " ".join(lines)))
    assert shown == checked, shown - checked


@pytest.mark.parametrize("line", _cli_lines())
def test_every_command_and_option_exists(line: str) -> None:
    assert not _check(line, _root()), line


def test_a_missing_option_or_command_is_found() -> None:
    root = _root()
    assert _check("kvplane admin --target HOST:PORT drain --no-such-flag", root)
    assert _check("kvplane admin --target HOST:PORT nonsense", root)
    assert _check("kvplane bench index|nonsense ...", root)
    assert _check("kvplane admin --target HOST:PORT workers --all", root)  # abort's option
    assert not _check("kvplane admin --target HOST:PORT drain ENGINE|--self", root)
