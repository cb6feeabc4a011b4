"""`kvplane admin` numbers outside their proto fields' ranges (uint32 deadlines and token ids,
int64 LoRA ids) fail before anything is sent: a usage error (exit 2), for an option's value
and for a token id read from the file an option gives; never protobuf's ValueError. Options
that do not go together are usage errors too. No server is needed: nothing is sent."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from kvplane.cli import app
from tests.boxed_text import unboxed

UINT32_LIMIT = 2**32


def admin(*args: str) -> Result:
    return CliRunner().invoke(app, ["admin", *args])


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["drain", "e0", "--deadline-ms", "99999999999"], "--deadline-ms"),
        (["drain", "--self", "--deadline-ms", str(UINT32_LIMIT)], "--deadline-ms"),
        (["lora", "load", "x", "/tmp/x", "--id", str(2**63)], "--id"),
    ],
)
def test_an_option_out_of_range_is_a_usage_error(command: list[str], option: str) -> None:
    """Worded as every usage error of the project's own checks (README: exit codes), not
    click's `Invalid value for '--id'`."""
    result = admin(*command)
    assert result.exit_code == 2
    assert f"Invalid value for {option}: Input should be less than or equal to" in result.output
    assert not isinstance(result.exception, ValueError)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["match", "route"])
@pytest.mark.parametrize(("ids", "bad"), [("1 2 -3", -3), ("[1, 99999999999]", 99999999999)])
def test_a_token_id_out_of_range_is_a_usage_error(
    tmp_path: Path, command: str, ids: str, bad: int
) -> None:
    """A file an option gives holding what the option cannot take (it was exit 1)."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(ids)
    result = admin(command, "--tokens-file", str(tokens))
    assert result.exit_code == 2
    assert unboxed(
        f"Invalid value for --tokens-file: {tokens}: token id {bad} is out of range (0 to "
        f"{UINT32_LIMIT - 1})"
    ) in unboxed(result.output)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["match"], "give exactly one of --prompt and --tokens-file"),
        (["route", "--prompt", "a", "--tokens-file", "t"], "give exactly one of --prompt"),
        (["drain"], "give the ENGINE to drain, or --self"),
        (["drain", "e0", "--self"], "give the ENGINE to drain or --self, not both"),
        (["abort"], "give a REQUEST_ID or --all"),
        (["abort", "r1", "--all"], "give a REQUEST_ID or --all, not both"),
    ],
)
def test_arguments_that_do_not_go_together_are_a_usage_error(
    command: list[str], message: str
) -> None:
    """As typer's own (a missing argument) and `admin index match`'s: exit 2 (README)."""
    result = admin(*command)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["cordon", ""], "ENGINE"),
        (["uncordon", " "], "ENGINE"),
        (["remove", ""], "ENGINE"),
        (["drain", ""], "ENGINE"),
        (["abort", ""], "REQUEST_ID"),
        (["lora", "load", "x", "/tmp/x", "--id", "1", "--engine", ""], "--engine"),
        (["lora", "unload", "x", "--engine", " "], "--engine"),
        (["index", "resync", ""], "ENGINE"),
        (["match", "--prompt", ""], "--prompt"),
        (["route", "--prompt", " "], "--prompt"),
    ],
)
def test_an_empty_name_or_prompt_is_a_usage_error(args: list[str], hint: str) -> None:
    """`cordon "$UNSET"` names no engine: refused before anything is sent, as an empty
    --target is (it was the server's INVALID_ARGUMENT, exit 1, and an empty `--engine` of a
    LoRA call the controller's UNKNOWN); an empty prompt, as `kvplane complete` refuses one
    (match and route explained a prompt the gateway refuses)."""
    result = admin(*args)
    assert result.exit_code == 2, result.output
    what = "the prompt's text" if hint == "--prompt" else "a name"
    assert f"Invalid value for {hint}: is empty: give {what}" in result.output


@pytest.mark.parametrize(
    ("args", "option", "instead"),
    [
        (["index", "dump", "--worker-id", ""], "--worker-id", "a worker id, or leave it out for"),
        (["match", "--prompt", "a", "--model", ""], "--model", "a model name, or leave it out"),
        (["route", "--prompt", "a", "--model", " "], "--model", "a model name, or leave it out"),
        (["route", "--prompt", "a", "--session-key", ""], "--session-key", "a session key, or"),
    ],
)
def test_an_empty_value_is_not_taken_for_the_default(
    args: list[str], option: str, instead: str
) -> None:
    """An empty value (an unset shell variable) where leaving the option out means the
    default: `index dump --worker-id ""` dumped every worker, `--model ""` asked about the
    default model, `--session-key ""` about a request of no session. Refused before anything
    is dialled (the target, port 1, would be refused anyway: it was exit 1)."""
    result = admin(*args[:1], "--target", "127.0.0.1:1", *args[1:])
    assert result.exit_code == 2, result.output
    shown = unboxed(result.output)
    assert unboxed(f"Invalid value for {option}: is empty: give {instead}") in shown


@pytest.mark.parametrize(
    "args",
    [
        ["--target", "", "health"],
        ["health", "--target", " "],
        ["lora", "list", "-t", ""],
        ["index", "--target", "", "stats"],
        ["index", "stats", "-t", ""],
    ],
)
def test_an_empty_target_is_a_usage_error(args: list[str]) -> None:
    """`--target "$UNSET"` names no server; it must not quietly mean the default one."""
    result = admin(*args)
    assert result.exit_code == 2
    assert "Invalid value for --target: is empty: give HOST:PORT" in result.output


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("127.0.0.1:73636", "port out of range in '127.0.0.1:73636'"),  # gRPC: 73636 - 65536
        ("127.0.0.1:-57436", "expected HOST:PORT"),
        ("127.0.0.1", "expected HOST:PORT"),  # gRPC would dial :443
        ("127.0.0.1:0", "port 0 in '127.0.0.1:0'"),
        ("http://127.0.0.1:8100", "expected HOST:PORT"),
    ],
)
@pytest.mark.parametrize("command", [["health"], ["index", "stats"], ["drain", "e0"]])
def test_a_target_that_names_no_single_server_is_a_usage_error(
    target: str, message: str, command: list[str]
) -> None:
    """A mistyped port is refused before anything is dialled: gRPC itself would wrap an
    out-of-range port round to another one (73636 reaches 8100) and send a drain there."""
    result = admin(*command[:1], "--target", target, *command[1:])
    assert result.exit_code == 2, result.output
    assert "Invalid value for --target: " in result.output
    assert message in result.output
