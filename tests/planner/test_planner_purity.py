"""The planner's core ring is pure: no I/O library, no clock, no randomness is imported, so the
same `decide()` runs live, in dry-run and in the offline replay."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The pure ring (planner/core/) and the config its types come from.
CORE = sorted(
    [f"core.{p.stem}" for p in (REPO / "planner" / "core").glob("*.py") if p.stem != "__init__"]
    + ["config"]
)


def test_core_imports_no_io() -> None:
    code = (
        "import sys\n"
        + "".join(f"import planner.{name}\n" for name in CORE)
        + "bad = [m for m in ('torch', 'grpc', 'zmq', 'redis', 'asyncio') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_core_reads_no_clock_and_draws_no_random_number() -> None:
    for name in CORE:
        tree = ast.parse((REPO / "planner" / f"{name.replace('.', '/')}.py").read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & {"time", "datetime", "random", "os", "asyncio"}, name
