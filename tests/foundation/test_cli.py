"""The `kvplane` command: groups, exit codes, config errors, a server started on port 0."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import grpc
import pytest
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.core import TyperGroup
from typer.testing import CliRunner

from kvplane.cli import _KvplaneCommand, app, main
from kvplane.up.config import MemberKind

REPO = Path(__file__).resolve().parents[2]
KVPLANE = [sys.executable, "-m", "kvplane"]
GROUPS = ["engine", "indexer", "controller", "planner", "up", "admin", "bench", "version"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`kvplane ARGS` as a process of its own: for what only a process shows (its exit
    status as the shell sees it, a signal, a server's sockets, gRPC core's own stderr lines),
    and at least once per command group."""
    return subprocess.run(
        [*KVPLANE, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


Kvplane = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def kvplane(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Kvplane:
    """`kvplane ARGS` through the entry point's own `main` in this process, with its exit
    code, stdout and stderr as `run` gives them: the same code path, without starting Python
    and importing kvplane once per call (most of this file's time when every test did). For
    commands that fail before anything is served."""
    monkeypatch.chdir(REPO)

    def invoke(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "argv", ["kvplane", *args])
        capsys.readouterr()  # only this call's output
        try:
            main()
            code: object = 0
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        status = code if isinstance(code, int) else (0 if code is None else 1)
        return subprocess.CompletedProcess(["kvplane", *args], status, out, err)

    return invoke


def test_help_lists_every_command_group() -> None:
    result = run("--help")
    assert result.returncode == 0
    for group in GROUPS:
        assert re.search(rf"^\W*{group}\b", result.stdout, re.MULTILINE), group


def test_up_help_names_every_member_kind(kvplane: Kvplane) -> None:
    # What a fleet file may hold, as a newcomer reads it from `kvplane up --help`.
    result = kvplane("up", "--help")
    assert result.returncode == 0
    for kind in get_args(MemberKind):
        assert kind in result.stdout, kind
    # The argument as the README writes it, and what runs without it (it said only "embedded
    # defaults", and the usage line `[config]`).
    assert "kvplane up [OPTIONS] [FLEET.yaml]" in result.stdout
    flat = _flat_help(result.stdout)
    assert "configs/local.yaml: three engines serving the builtin model" in flat
    assert "a controller on 127.0.0.1:8100" in flat


def _flat_help(text: str) -> str:
    """--help as one line of words: the boxes' frames gone, wrapped lines joined."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize(
    ("command", "target"),
    [
        (["match"], "the controller."),
        (["route"], "the controller."),
        (["register"], "the controller."),
        (["remove"], "the controller."),
        (["cordon"], "the controller."),
        (["uncordon"], "the controller."),
        (["drain"], "the controller or engine."),  # --self drains an engine too
        (["workers"], "the controller or engine."),
    ],
)
def test_admin_target_help_names_what_the_command_needs(
    command: list[str], target: str, kvplane: Kvplane
) -> None:
    """The fleet commands answer an engine "needs a controller": their --target said "of the
    controller or engine" as every admin command's does."""
    result = kvplane("admin", *command, "--help")
    assert result.returncode == 0
    assert f"--target -t <str> HOST:PORT of {target}" in _flat_help(result.stdout)


def _commands(command: object, path: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """Every leaf command under `command`, with its path (typer's groups are its own click's,
    which it vendors)."""
    if not isinstance(command, TyperGroup):
        return [(" ".join(path), command)]
    ctx = command.context_class(command)
    leaves = []
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        assert sub is not None, f"kvplane {' '.join(path)} lists {name} but has no such command"
        leaves.extend(_commands(sub, (*path, name)))
    return leaves


def test_every_command_has_a_one_line_summary() -> None:
    """A group's --help lists each command with its help's first paragraph, keeping its line
    breaks: a summary wrapped over two lines reads as a sentence cut in the middle."""
    commands = _commands(typer.main.get_command(app))
    assert len(commands) > 30
    for path, command in commands:
        help_text = (getattr(command, "help", None) or "").strip()
        summary = help_text.split("\n\n")[0]
        assert summary and "\n" not in summary, f"kvplane {path}: {summary!r}"


def _help_lines(output: str) -> list[str]:
    """The lines of a rendered --help, without the padding rich puts around them."""
    return [line.strip() for line in output.splitlines()]


@pytest.mark.parametrize(
    ("command", "paragraph"),
    [
        (
            ["admin", "drain"],
            [
                "Progress is shown until COMPLETE, each event as it comes (with --output json,",
                "one JSON object a line). A deadline that passes with requests in flight ends",
                "it with an error.",
            ],
        ),
        (
            ["admin", "lora", "load"],
            [
                "Through a controller, --engine and --model together load it on that engine for",
                "that base model. Behind a controller, each engine's outcome is shown.",
            ],
        ),
    ],
)
def test_a_help_paragraph_flows_to_the_terminal_width(
    command: list[str], paragraph: list[str], kvplane: Kvplane
) -> None:
    """A docstring paragraph wrapped at the source's 88 columns is wrapped at the terminal's
    80, not cut where the source's lines end ("... ends it" / "with an error.")."""
    result = kvplane(*command, "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = _help_lines(result.stdout)
    start = lines.index(paragraph[0])
    assert lines[start : start + len(paragraph) + 1] == [*paragraph, ""]


def test_a_help_keeps_its_lists_and_examples() -> None:
    """What a help lays out line by line (a list, an example) stays so; the prose around it
    flows, and the summary a group lists is left as written."""
    demo = typer.Typer(cls=_KvplaneCommand)

    @demo.command()
    def show() -> None:
        """Show what a fleet holds.

        The table has one row per engine of the fleet, and one per engine that the
        controller has seen leave.

        Columns:
        - ADDRESS: where it serves
        - STATE: serving or draining

        Example:
            kvplane admin workers -o json
        """

    @demo.command()
    def other() -> None:
        """Another command, so that `show` is one of a group."""

    result = CliRunner(env={"COLUMNS": "120"}).invoke(demo, ["show", "--help"])
    assert result.exit_code == 0, result.output
    lines = _help_lines(result.output)
    assert (
        "The table has one row per engine of the fleet, and one per engine that the controller"
        " has seen leave." in lines
    )
    start = lines.index("Columns:")
    assert lines[start : start + 3] == [
        "Columns:",
        "- ADDRESS: where it serves",
        "- STATE: serving or draining",
    ]
    start = lines.index("Example:")
    assert lines[start : start + 2] == ["Example:", "kvplane admin workers -o json"]


# Runs `kvplane ARGS` in a fresh interpreter, then prints on stderr's last line which of the
# components' packages (and their heavy dependencies) it imported.
_IMPORTS_PROBE = """
import json, sys
from kvplane.cli import main
sys.argv = ["kvplane", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
packages = {"controller", "engine", "indexer", "planner", "redis", "torch"}
print(json.dumps(sorted(packages & {name.split(".")[0] for name in sys.modules})), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("args", "packages"),
    [
        (["version"], []),
        (["engine", "serve", "--help"], ["engine"]),
        (["indexer", "serve", "--help"], ["indexer"]),
        (["planner", "run", "--help"], ["planner"]),
    ],
)
def test_a_command_imports_no_other_components_modules(
    args: list[str], packages: list[str]
) -> None:
    """`kvplane engine serve` starts every engine of a fleet: it imported the controller's,
    planner's and benchmarks' modules too (Redis' client among them), 0.35 s of its 0.55 s of
    imports, for each engine started."""
    probe = subprocess.run(
        [sys.executable, "-c", _IMPORTS_PROBE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert probe.returncode == 0, probe.stderr
    assert "Usage: " in probe.stdout or probe.stdout.startswith("kvplane ")
    assert json.loads(probe.stderr.splitlines()[-1]) == packages


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "kvplane"
    result = subprocess.run([str(script), "version"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("kvplane ")


def test_version_json(kvplane: Kvplane) -> None:
    result = kvplane("version", "--output", "json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["version"]


def test_every_option_says_what_it_does() -> None:
    """Each option of every command has a help text in its --help (`version --output` had
    none, only its choices)."""
    for path, command in _commands(typer.main.get_command(app)):
        for param in getattr(command, "params", ()):
            if param.param_type_name == "option":
                assert getattr(param, "help", None), f"kvplane {path} {param.opts[0]}"


def test_planner_run_without_a_config_is_a_usage_error(kvplane: Kvplane) -> None:
    """A required option left out, as click reports one, saying what the file must hold (it
    was exit 1, `kvplane: error: ...`, as if a file had been given)."""
    line = _usage_error_line(kvplane("planner", "run"))
    assert line == (
        "Error: Missing option '--config' / '-c'. Give a YAML file whose `live:` section names "
        "the controller (example: configs/planner.yaml)."
    )


def test_planner_run_on_a_file_without_a_live_section_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "planner.yaml"
    config.write_text("sla: {ttft_ms: 1000, itl_ms: 40}\n")
    result = run("planner", "run", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "kvplane: error: the live planner needs a `live:` section (the controller's address) "
        "in its --config file (example: configs/planner.yaml)"
    )


def test_planner_run_help_asks_for_a_config_with_a_live_section(kvplane: Kvplane) -> None:
    """The servers' --config falls back to embedded defaults; the planner's cannot (they name
    no controller), and its help must not promise that it does."""
    result = kvplane("planner", "run", "--help")
    assert result.returncode == 0
    help_text = " ".join(result.stdout.replace("│", " ").split())
    assert "embedded defaults" not in help_text
    assert "YAML config file with a `live:` section naming the controller" in help_text


def test_usage_error_exits_2() -> None:
    result = run("indexer", "serve", "--no-such-option")
    assert result.returncode == 2
    assert "Error: No such option: --no-such-option" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("group", [[], ["admin"], ["admin", "index"]])
def test_a_command_left_out_prints_the_help_and_exits_2(group: list[str], kvplane: Kvplane) -> None:
    """`kvplane` (or a group) without a command: its help, then exit 2 as any usage error
    (README: exit codes), not 0: nothing was done."""
    result = kvplane(*group)
    assert result.returncode == 2, result.stderr
    assert "Usage: " in result.stdout and "Commands" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["version"], ["version", "-o", "json"], ["admin", "--help"]])
def test_output_that_cannot_be_written_is_one_line(args: list[str]) -> None:
    """Output to a full disk (`> /dev/full`): one line and exit 1, as `cat`'s "write error",
    for a command's output and for a help (it was a traceback)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [*KVPLANE, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60
        )
    assert result.returncode == 1, result.stderr
    assert result.stderr == "kvplane: error: write error: No space left on device\n"


@pytest.mark.parametrize("args", [["version"], ["--help"]])
def test_output_to_a_closed_pipe_exits_141_quietly(args: list[str]) -> None:
    """`kvplane ... | head -1` once head has gone: nothing on stderr and 141, as a coreutils
    command killed by SIGPIPE (it was exit 1, as for a failure)."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        result = subprocess.run(
            [*KVPLANE, *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(write)
    assert result.returncode == 128 + signal.SIGPIPE
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("option", "value", "choices"),
    [("--log-level", "bogus", "'debug', 'info'"), ("--log-format", "JSONL", "'text', 'json'")],
)
def test_an_unknown_log_level_or_format_is_a_usage_error(
    option: str, value: str, choices: str, kvplane: Kvplane
) -> None:
    """Not a traceback (an unknown level once reached `logging`), nor silently plain text."""
    result = kvplane(option, value, "version")
    assert result.returncode == 2
    assert f"Invalid value for {option}: " in result.stderr and choices in result.stderr
    assert "Traceback" not in result.stderr


def test_log_level_and_format_ignore_case() -> None:
    result = run("--log-level", "debug", "--log-format", "JSON", "version")
    assert result.returncode == 0 and result.stdout.startswith("kvplane ")


def test_a_command_run_in_process_leaves_its_logging_as_it_found_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command run in a process that goes on (CliRunner, beside the test's own controller
    and engines) logs to its stderr while it runs, and no longer: a server's warning after it
    reaches the process's own handlers (here pytest's), not the command's stderr, captured
    and closed by then ("Logging error"), nor the next command's output."""
    root = logging.getLogger()
    handlers = root.handlers[:]
    levels = {name: logging.getLogger(name).level for name in ("", "asyncio", "grpc")}
    ran = CliRunner().invoke(app, ["--log-level", "debug", "--log-format", "json", "version"])
    assert ran.exit_code == 0 and ran.stdout.startswith("kvplane ")
    assert root.handlers == handlers
    assert {name: logging.getLogger(name).level for name in levels} == levels
    with caplog.at_level("WARNING", logger="controller.gateway"):
        logging.getLogger("controller.gateway").warning("engine e0 unreachable")
    assert caplog.messages == ["engine e0 unreachable"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot read token file {path}: No such file or directory"),
        (b"\x85\xff token", "token file {path} is not UTF-8 text (byte 0)"),
        (b" \n", "token file {path} is empty"),
        # gRPC metadata carries printable ASCII only: every call would fail INTERNAL "Invalid
        # metadata", after a line of gRPC's C core on stderr.
        (
            b"two\nlines\n",
            "token file {path} holds a character a bearer token cannot carry (character 4: a "
            "line break, a control or a non-ASCII character; a token is printable ASCII)",
        ),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["admin", "--token-file", "{path}", "health"],  # the group's, read by every command
        ["admin", "index", "--token-file", "{path}", "stats"],
        ["admin", "cordon", "e0", "--token-file", "{path}"],  # a command's own
        ["admin", "index", "resync", "e0", "--token-file", "{path}"],
    ],
)
def test_a_token_file_that_cannot_be_used_is_a_usage_error(
    tmp_path: Path,
    content: bytes | None,
    why: str,
    command: list[str],
    kvplane: Kvplane,
) -> None:
    """Missing, not text (a key file given by mistake) or empty: a file an option gives, so a
    usage error naming the option (it was exit 1, `kvplane: error: ...`), before anything is
    dialled, and never left for $KVPLANE_TOKEN."""
    token = tmp_path / "token"
    if content is not None:
        token.write_bytes(content)
    args = [arg.format(path=token) for arg in command]
    result = kvplane(*args, "--target", "127.0.0.1:9", env={"KVPLANE_TOKEN": "s3cret"})
    line = _usage_error_line(result)
    assert line == f"Error: Invalid value for --token-file: {why.format(path=token)}"


def test_a_kvplane_token_that_cannot_be_sent_is_one_line(kvplane: Kvplane) -> None:
    """$KVPLANE_TOKEN holding a line break (a file's two lines pasted in): one line naming
    it, not gRPC's C-core lines and INTERNAL "Invalid metadata" for every call, nor the token
    itself."""
    result = kvplane(
        "admin", "--target", "127.0.0.1:9", "health", env={"KVPLANE_TOKEN": "s3cret\nline"}
    )
    assert result.returncode == 1, result
    assert result.stderr == (
        "kvplane: error: $KVPLANE_TOKEN holds a character a bearer token cannot carry "
        "(character 7: a line break, a control or a non-ASCII character; a token is "
        "printable ASCII)\n"
    )


def test_unknown_config_key_is_rejected(tmp_path: Path, kvplane: Kvplane) -> None:
    config = tmp_path / "indexer.yaml"
    config.write_text("listen: 127.0.0.1:0\nlisten_port: 5\n")
    result = kvplane("indexer", "serve", "--config", str(config))
    assert result.returncode == 1
    assert "listen_port" in result.stderr
    assert "Traceback" not in result.stderr


def _usage_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The `Error: ...` line of a usage error as `kvplane` prints it (exit 2, click's
    "Usage:" lines first, no traceback)."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Usage: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[-1]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["engine", "serve", "--role", "bogus"], "--role: Input should be 'aggregated'"),
        (["engine", "serve", "--runner", "bogus"], "--runner: Input should be 'generate'"),
        (["engine", "serve", "--listen", "nonsense"], "--listen: expected HOST:PORT"),
        (["controller", "serve", "--listen", "h:x"], "--listen: expected HOST:PORT"),
        (["indexer", "serve", "--listen", "h:99999"], "--listen: port out of range"),
        (
            ["engine", "serve", "--model", "/nonexistent/model"],
            "--model: model '/nonexistent/model' is not 'sim', 'builtin' or an HF model",
        ),
        # Empty is not "make one up": leaving the flag out is.
        (["engine", "serve", "--instance-id", ""], "--instance-id: must not be empty"),
        (["engine", "serve", "--instance-id", " "], "--instance-id: must not be empty"),
        (
            # A check across fields, on the flags alone: the defaults pass every check.
            ["engine", "serve", "--runner", "pooling"],
            "--runner: runner: pooling needs a torch model",
        ),
        (
            ["engine", "serve", "--runner", "pooling", "--model", "builtin", "--role", "decode"],
            "--model / --role / --runner: runner: pooling serves Embed/Classify/Score only",
        ),
    ],
)
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(
    args: list[str], error: str, kvplane: Kvplane
) -> None:
    """As click reports its own checks, and as every bench command does (it was exit 1 and
    `kvplane: error: invalid --role: ...`, like a bad config file)."""
    line = _usage_error_line(kvplane(*args))
    assert line.startswith(f"Error: Invalid value for {error}"), line
    assert "embedded defaults" not in line


@pytest.mark.parametrize(
    "command",
    [["engine", "serve"], ["controller", "serve"], ["indexer", "serve"], ["planner", "run"]],
)
def test_a_config_file_that_cannot_be_read_is_a_usage_error(
    command: list[str], tmp_path: Path, kvplane: Kvplane
) -> None:
    missing = tmp_path / "absent.yaml"
    line = _usage_error_line(kvplane(*command, "--config", str(missing)))
    assert line == (
        f"Error: Invalid value for --config: cannot read config {missing}: No such file or "
        "directory"
    )


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("absent.yaml", None, "cannot read config {path}: No such file or directory"),
        ("binary.yaml", b"\xff", "config {path} is not UTF-8 text (byte 0: invalid start byte)"),
    ],
)
def test_a_fleet_file_that_cannot_be_read_is_a_usage_error(
    name: str, content: bytes | None, problem: str, tmp_path: Path, kvplane: Kvplane
) -> None:
    """`kvplane up FILE` as every server's `--config FILE` (README: exit codes); it was exit
    1, `kvplane: error: ...`, as if the file had held a bad value. What a file holds stays
    the file's error (exit 1)."""
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    line = _usage_error_line(kvplane("up", str(path)))
    assert line == f"Error: Invalid value for FLEET.yaml: {problem.format(path=path)}"
    path.write_text("members: []\nbogus: 1\n")
    result = kvplane("up", str(path))
    assert result.returncode == 1
    assert result.stderr.startswith(f"kvplane: error: invalid config in {path}: "), result.stderr


def test_a_bad_value_in_the_file_stays_a_config_error_naming_the_file(
    tmp_path: Path, kvplane: Kvplane
) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("model: sim\nblock_size: 0\n")
    result = kvplane("engine", "serve", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {config}: block_size: Input should be greater than 0"
    ]
    # With a bad flag too, the command line is checked first, as click checks its options.
    line = _usage_error_line(kvplane("engine", "serve", "--config", str(config), "--role", "bogus"))
    assert line.startswith("Error: Invalid value for --role: Input should be 'aggregated'")


def test_an_empty_instance_id_in_the_file_is_a_config_error_naming_it(
    tmp_path: Path, kvplane: Kvplane
) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("listen: 127.0.0.1:0\ninstance_id: ''\n")
    result = kvplane("engine", "serve", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {config}: instance_id: must not be empty (leave it "
        "out for a fresh id per process)"
    ]


def test_a_flag_at_odds_with_the_file_is_blamed_on_both(tmp_path: Path, kvplane: Kvplane) -> None:
    """Neither value is wrong alone: a config error, naming the file and the flag (not the
    flags given with it that the check does not involve)."""
    config = tmp_path / "engine.yaml"
    config.write_text("model: builtin\nkv_cache_bytes: 1000000\n")
    listen = ["--listen", "127.0.0.1:0"]  # given too, and not at odds with anything
    result = kvplane("engine", "serve", "--config", str(config), "--model", "sim", *listen)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {config} with --model: the sim runner needs"
        " num_kv_blocks, not kv_cache_bytes"
    ]


@pytest.mark.parametrize(
    ("command", "content", "problem"),
    [
        (
            ["indexer", "serve"],
            "backend: memory\nredis:\n  buckets: 4\n",
            "redis: options are for a Redis backend, but backend is memory: remove the redis: "
            "block or set backend to redis://HOST:PORT/DB",
        ),
        (
            # The file alone fails this way too: the sim model is the default.
            ["engine", "serve", "--model", "sim"],
            "kv_cache_bytes: 1000000\n",
            "the sim runner needs num_kv_blocks, not kv_cache_bytes",
        ),
    ],
)
def test_a_check_across_keys_of_the_file_alone_blames_no_flag(
    command: list[str], content: str, problem: str, tmp_path: Path, kvplane: Kvplane
) -> None:
    """A problem between the file's own keys, with a flag it does not involve given too (it
    said `invalid config in FILE with --listen: redis: ...`, blaming the flag)."""
    config = tmp_path / "server.yaml"
    config.write_text(content)
    result = kvplane(*command, "--config", str(config), "--listen", "127.0.0.1:0")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {config}: {problem}"
    ]


@pytest.mark.parametrize(
    ("group", "config"),
    [
        ("indexer", ""),
        ("controller", ""),
        ("engine", "model: sim\n"),
    ],
)
def test_a_metrics_address_in_use_is_one_line(tmp_path: Path, group: str, config: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        metrics = f"127.0.0.1:{busy.getsockname()[1]}"
        path = tmp_path / "c.yaml"
        path.write_text(f"listen: 127.0.0.1:0\nmetrics_listen: {metrics}\n{config}")
        result = run(group, "serve", "--config", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"kvplane: error: cannot serve metrics on {metrics}: Address already in use"


@pytest.mark.timeout(60)
def test_server_started_by_cli_answers_health_and_stops_on_sigint() -> None:
    proc = subprocess.Popen(
        [*KVPLANE, "indexer", "serve", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        port = None
        deadline = time.monotonic() + 45
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            match = re.search(r"serving .* on 127\.0\.0\.1:(\d+)", line)
            if match:
                port = int(match.group(1))
        assert port, "the server never said where it listens"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "serve", [["engine", "serve", "--model", "sim"], ["controller", "serve"], ["indexer", "serve"]]
)
def test_a_port_file_in_a_missing_folder_is_refused_before_serving(
    serve: list[str], tmp_path: Path, kvplane: Kvplane
) -> None:
    """Once the server listens it is too late: the write failed with a traceback and left a
    server half started."""
    missing = tmp_path / "absent" / "port"
    result = kvplane(*serve, "--listen", "127.0.0.1:0", "--port-file", str(missing))
    assert result.returncode == 2
    assert f"folder {missing.parent} does not exist" in result.stderr
    assert "Traceback" not in result.stderr and "serving" not in result.stderr


@pytest.mark.parametrize(
    "serve", [["engine", "serve", "--model", "sim"], ["controller", "serve"], ["indexer", "serve"]]
)
def test_a_port_file_that_is_a_folder_is_refused_before_serving(
    serve: list[str], tmp_path: Path, kvplane: Kvplane
) -> None:
    """The port cannot be written there: found once serving, that was an error line and then
    grpc's traceback of a server never stopped."""
    result = kvplane(*serve, "--listen", "127.0.0.1:0", "--port-file", str(tmp_path))
    assert result.returncode == 2
    assert f"{tmp_path} is a folder: give the path of a file to write" in result.stderr
    assert "Traceback" not in result.stderr and "serving" not in result.stderr


@pytest.mark.parametrize(
    "serve", [["engine", "serve", "--model", "sim"], ["controller", "serve"], ["indexer", "serve"]]
)
def test_a_port_file_that_cannot_be_written_is_one_line(serve: list[str]) -> None:
    """Found once serving (a folder that takes no files: /proc, even for root): the server
    is stopped before the error line, so no grpc traceback follows it at exit."""
    port_file = "/proc/kvplane-test-port"
    result = run(*serve, "--listen", "127.0.0.1:0", "--port-file", port_file)
    assert result.returncode == 1
    assert f"kvplane: error: cannot write --port-file {port_file}: " in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("group", ["indexer", "controller", "engine"])
def test_a_listen_address_in_use_is_one_line(group: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        extra = ["--model", "sim"] if group == "engine" else []
        result = run(group, "serve", "--listen", listen, *extra)
    assert result.returncode == 1
    # Only our line: not gRPC core's own log line before it, nor its "Failed to bind".
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: cannot listen on {listen}: Address already in use"
    ]
