"""How a child process ended, in words (`kvplane.process_exit`): its log's last lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvplane.process_exit import exit_how, log_tail

# The address space the process reading a huge log is given: a log read whole does not fit.
_READER_LIMIT_BYTES = 1024 * 1024 * 1024


def test_log_tail_of_a_huge_log_reads_its_end_only(tmp_path: Path) -> None:
    """An engine's log after days of serving (here 4 GiB, sparse) is not read whole to say how
    it crashed: the planner (and `kvplane up`) would stall on it, or run out of memory."""
    log_path = tmp_path / "default-4.log"
    with log_path.open("wb") as file:
        file.truncate(4 * 1024**3)
        file.seek(0, 2)
        file.write(b"\nserving\n\nTraceback (most recent call last):\nMemoryError\n")
    reader = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from kvplane.process_exit import log_tail\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({_READER_LIMIT_BYTES}, {_READER_LIMIT_BYTES}))\n"
        "print(log_tail(Path(sys.argv[1])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", reader, str(log_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "serving | Traceback (most recent call last): | MemoryError"


def test_log_tail_drops_the_line_its_read_starts_within(tmp_path: Path) -> None:
    log_path = tmp_path / "engine.log"
    log_path.write_text("x" * 200_000 + "\nlast\n")
    assert log_tail(log_path) == "last"


def test_log_tail_of_a_missing_log_is_empty(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "absent.log") == ""


def test_exit_how_names_the_signal() -> None:
    assert exit_how(1) == "code 1"
    assert exit_how(-9) == "code -9 (SIGKILL)"
