"""Dependency rules of ARCHITECTURE.md and STYLE.md, checked on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["kvplane", "indexer", "controller", "planner", "engine"]
# The pure cores: no I/O frameworks, no torch, no environment reads.
CORE_GLOBS = [
    "indexer/batch.py",
    "indexer/index.py",
    "indexer/validation.py",
    "indexer/keys.py",
    "indexer/vllm_hash.py",
    "indexer/zmq_decode.py",
    "indexer/translate.py",
    "engine/core/*.py",
    "controller/router/*.py",
    "controller/registry.py",
    "controller/replay.py",
    "planner/core/*.py",
]
FORBIDDEN_IN_CORE = {"grpc", "zmq", "redis", "asyncio", "torch"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def reads_environment(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv"}:
            return True
    return False


def core_modules() -> list[Path]:
    return sorted({p for pattern in CORE_GLOBS for p in REPO.glob(pattern)})


def test_core_modules_import_no_io_framework_or_torch() -> None:
    modules = core_modules()
    assert modules, "no core module found"
    offenders = {
        str(path.relative_to(REPO)): sorted(
            {m for m in imported_modules(path) if m.split(".")[0] in FORBIDDEN_IN_CORE}
        )
        for path in modules
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert [str(p.relative_to(REPO)) for p in modules if reads_environment(p)] == []


def test_only_the_engine_imports_torch() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        if package != "engine"
        for path in (REPO / package).rglob("*.py")
        if any(m.split(".")[0] == "torch" for m in imported_modules(path))
    ]
    assert offenders == []


def test_control_plane_starts_without_torch() -> None:
    # Importing the whole CLI (every command group) must not import torch.
    code = (
        "import sys, kvplane.cli, indexer, controller, planner, engine.cli;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_no_print_outside_cli_code() -> None:
    offenders = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if path.name.endswith("cli.py") or "bench" in path.name:
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "print"
                ):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
