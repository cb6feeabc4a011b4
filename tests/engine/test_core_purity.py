"""The engine core is the pure ring: importing it pulls in no torch, grpc, zmq, redis or asyncio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_core_imports_no_io_or_torch() -> None:
    code = (
        "import sys\n"
        "import engine.core.api, engine.core.engine_core, engine.core.sim_fleet\n"
        "import engine.core.guided, engine.core.guided_json, engine.core.guided_vocab\n"
        "import engine.core.guided_regex, engine.core.guided_dfa, engine.core.guided_ebnf\n"
        "bad = [m for m in ('torch', 'grpc', 'zmq', 'redis', 'asyncio') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
