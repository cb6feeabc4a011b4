"""`kvplane admin register` and `kvplane admin remove` through CliRunner against a real
controller and real sim engines: an engine added at run time is routed to, one removed is
gone, and every refusal is one line."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.controller.conftest import Fleet, close_fleet, make_fleet, start_sim_engine
from tests.controller.test_admin_cli import cli
from tests.interrupted import interrupted
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)


async def cli_json(*args: str) -> Any:
    """The command's JSON, read from its stdout alone: the in-process controller logs its
    warnings (an engine it cannot reach) to the stderr CliRunner also captures."""
    result = await cli(*args, "--output", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _workers(listed: dict[str, list[dict[str, str]]]) -> dict[str, dict[str, str]]:
    return {w["address"]: w for w in listed["workers"]}


async def test_an_engine_registered_by_hand_is_routed_to_until_removed(fleet: Fleet) -> None:
    t = ["--target", fleet.target]
    extra = await start_sim_engine("e3")
    address = fleet.address(extra)
    try:
        added = await cli_json("register", address, *t)
        # The command waited for the controller to reach the engine: its identity is known.
        assert (added["instance_id"], added["state"], added["source"]) == ("e3", "ready", "admin")
        await fleet.wait_routable(4)
        assert _workers(await cli_json("workers", *t))[address]["instance_id"] == "e3"

        removed = await cli("remove", "e3", *t)
        assert removed.exit_code == 0, removed.output
        assert removed.stdout.strip() == f"e3 ({address}) removed"
        assert address not in _workers(await cli_json("workers", *t))

        # By address, with its KV events off; the table shows the engine's row.
        table = await cli("register", address, "--kv-events", "none", *t)
        assert table.exit_code == 0, table.output
        header, row = table.stdout.splitlines()
        assert header.split()[:6] == ["ENGINE", "ADDRESS", "SOURCE", "MODELS", "ROLE", "STATE"]
        assert row.split()[:6] == ["e3", address, "admin", "sim", "aggregated", "ready"]
        assert _workers(await cli_json("workers", *t))[address]["kv_events"] == "none"
        gone = await cli_json("remove", address, *t)
        assert (gone["instance_id"], gone["address"]) == ("e3", address)
        assert not gone.get("routable") and gone["kv_events_state"] == "not_followed"
        assert address not in _workers(await cli_json("workers", *t))
    finally:
        await extra.close()


async def test_an_engine_registered_by_hand_with_an_owner_is_listed_with_it(fleet: Fleet) -> None:
    """`register --owner` says who registers the engine, as a planner's Kubernetes actuator
    does for its pods (RegisterEngine `owner`): the controller lists the engine with it, and
    an engine registered without one has none."""
    t = ["--target", fleet.target]
    extra = await start_sim_engine("e3")
    address = fleet.address(extra)
    owner = "kubernetes:serving/kvplane-engine"
    try:
        added = await cli_json("register", address, "--owner", owner, *t)
        assert (added["address"], added["owner"]) == (address, owner)
        listed = _workers(await cli_json("workers", *t))
        assert listed[address]["owner"] == owner
        assert listed[fleet.address(fleet.engines[0])]["owner"] == ""  # a config engine's
    finally:
        await extra.close()


async def test_refusals_are_one_line(fleet: Fleet) -> None:
    t = ["--target", fleet.target]
    unknown = await cli("remove", "nobody", *t)
    assert unknown.exit_code == 1
    assert str(unknown.exception) == f"{fleet.target}: NOT_FOUND: no engine 'nobody' in the fleet"

    present = fleet.address(fleet.engines[0])
    twice = await cli("register", present, *t)
    assert twice.exit_code == 1
    assert str(twice.exception) == (
        f"{fleet.target}: ALREADY_EXISTS: engine {present} is already registered"
    )

    # An address nothing listens on: registered (the controller keeps retrying), but the
    # command says it was not reached and how to take it out again.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    unreachable = await cli("register", nobody, "--wait-s", "0.5", *t)
    assert unreachable.exit_code == 1
    message = str(unreachable.exception)
    assert message.startswith(f"engine {nobody} registered, but the controller has not reached")
    assert f"kvplane admin remove {nobody}" in message and "\n" not in message
    assert _workers(await cli_json("workers", *t))[nobody]["state"] in ("unknown", "unreachable")
    assert (await cli("remove", nobody, *t)).exit_code == 0
    # --wait-s 0 returns at once, before the controller has dialled the engine.
    at_once = await cli_json("register", nobody, "--wait-s", "0", *t)
    assert at_once["state"] == "unknown"


async def test_ctrl_c_while_waiting_for_the_engine_says_it_stays_registered(
    fleet: Fleet,
) -> None:
    """`register --wait-s` interrupted (Ctrl-C) while the controller has not reached the
    engine: exit 130, one line saying the engine stays registered and how to remove it, as
    the wait's own failure says (it exited 130 saying nothing)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    registry = fleet.app.controller.fleet.registry

    async def waiting(process: asyncio.subprocess.Process) -> None:
        # Registered, and polled in vain three times: the command, answered as soon as the
        # engine was registered, has been waiting on the controller for a while by then.
        await eventually(
            lambda: any(r.address == nobody and r.num_failures >= 3 for r in registry.records())
        )

    command = ["admin", "-t", fleet.target, "register", nobody, "--wait-s", "600"]
    result = await interrupted(command, waiting)
    assert result.returncode == 130
    assert result.stderr == (
        f"kvplane: interrupted: engine {nobody} stays registered (remove it: kvplane admin "
        f"remove {nobody})\n"
    )
    assert any(r.address == nobody for r in registry.records())


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["register", "nohost"], "ADDRESS"),
        (["register", "127.0.0.1:0"], "port 0"),
        (["register", "127.0.0.1:9001", "--kv-events", "redis"], "--kv-events"),
        (["register", "127.0.0.1:9001", "--wait-s", "-1"], "--wait-s"),
        (["register", "127.0.0.1:9001", "--wait-s", "inf"], "not a finite number"),
    ],
)
async def test_bad_arguments_are_usage_errors(
    fleet: Fleet, args: list[str], complaint: str
) -> None:
    before = await cli_json("workers", "--target", fleet.target)
    result = await cli(*args, "--target", fleet.target)
    assert result.exit_code == 2 and complaint in result.output, result.output
    assert await cli_json("workers", "--target", fleet.target) == before


async def test_register_and_remove_carry_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret")
    fleet = await make_fleet(num_engines=1, auth={"token_file": token})
    extra = await start_sim_engine("e9")
    address = fleet.address(extra)
    t = ["--target", fleet.target]
    try:
        for command in (["register", address], ["remove", "e0"]):
            anonymous = await cli(*command, *t)
            assert "UNAUTHENTICATED" in str(anonymous.exception), command
        listed = await cli_json("workers", *t)
        assert [w["instance_id"] for w in listed["workers"]] == ["e0"]
        added = await cli_json("register", address, "--token-file", str(token), *t)
        assert added["instance_id"] == "e9"
        assert (await cli("remove", "e0", "--token-file", str(token), *t)).exit_code == 0
        listed = await cli_json("workers", *t)
        assert [w["instance_id"] for w in listed["workers"]] == ["e9"]
    finally:
        await close_fleet(fleet)
        await extra.close()
