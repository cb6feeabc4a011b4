"""`kvplane admin ...` through CliRunner against a real controller and real engines (the
synchronous CLI runs in a worker thread so the servers keep serving)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner, Result

from controller import admin_cli
from controller.admin_cli import ControllerRequiredError
from controller.registry import EngineState
from engine.config import KvEventsConfig
from indexer.backends import open_backend
from indexer.config import IndexerConfig
from indexer.servicer import index_services
from kvplane.cli import app
from kvplane.metrics import start_metrics_server
from kvplane.server import create_server
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

PREFIX = list(range(300, 364))


async def cli(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, app, ["admin", *args])


async def admin_process(*args: str) -> tuple[int, str, str]:
    """`kvplane admin ARGS` run as a script runs it, a process of its own: its exit code,
    stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvplane",
        "admin",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def cli_json(*args: str) -> Any:
    """The JSON `kvplane admin ARGS --output json` prints: its stdout alone. The CLI runs in
    this process (`cli`) and, while it runs, points the process's logging at its own stderr:
    a log line of the controller or an engine here (an engine just closed is unreachable,
    say) written meanwhile is in its `output`, stdout and stderr together."""
    result = await cli(*args, "--output", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


async def holder(tokens: Path, target: list[str]) -> str | None:
    """The engine `match` shows holding all four full blocks of the prompt in `tokens`."""
    matched = await cli_json("match", "--tokens-file", str(tokens), *target)
    full = [m for m in matched["matches"] if m.get("device_blocks", 0) >= 4]
    return full[0]["instance_id"] if full else None


async def wait_for_holder(tokens: Path, target: list[str]) -> str:
    """The holder of the prompt in `tokens`, once its engine's KV events reached the index."""
    engine = None
    async with asyncio.timeout(60):  # a CLI process a try
        for _ in itertools.count():
            engine = await holder(tokens, target)
            if engine is not None:
                break
            await asyncio.sleep(0.05)
    assert engine is not None
    return engine


async def test_admin_cli_against_the_controller(fleet: Fleet, tmp_path: Path) -> None:
    t = ["--target", fleet.target]
    [r async for r in fleet.gateway.Generate(generate_request("a", [*PREFIX, 1]))]

    workers = await cli_json("workers", *t)
    assert sorted(w["instance_id"] for w in workers["workers"]) == ["e0", "e1", "e2"]
    assert workers["policy"] == "kvplane"
    # 64-bit fields are numbers, as every other integer (protobuf's JSON would quote them).
    assert [w["total_kv_blocks"] for w in workers["workers"]] == [256, 256, 256]
    assert type(workers["index_blocks"]) is int
    # The form: --target on the admin group applies to every command under it.
    group_level = await cli(*t, "workers", "--output", "json")
    assert group_level.exit_code == 0, group_level.output
    group_ids = sorted(w["instance_id"] for w in json.loads(group_level.stdout)["workers"])
    assert group_ids == ["e0", "e1", "e2"]
    table = await cli("workers", *t)
    assert table.exit_code == 0, table.output
    policy, header, *rows = table.stdout.splitlines()
    assert policy == "policy kvplane"
    # SOURCE: where each engine came from, as in the JSON (these are the config's engines).
    # MODELS: what each engine serves, as the JSON's `models`.
    assert header.split()[:6] == ["ENGINE", "ADDRESS", "SOURCE", "MODELS", "ROLE", "STATE"]
    by_engine = {w["instance_id"]: w for w in workers["workers"]}
    assert sorted(row.split()[:6] for row in rows) == [
        [engine, by_engine[engine]["address"], "config", "sim", "aggregated", "ready"]
        for engine in ("e0", "e1", "e2")
    ]
    # The engines' health checks name their model ("sim"): information, not an ERROR.
    assert [w["last_error"] for w in workers["workers"]] == ["", "", ""]
    assert not any(line.rstrip().endswith("sim") for line in table.output.splitlines())

    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))

    engine = await wait_for_holder(tokens, t)

    # A model no engine serves: NOT_FOUND from both, not an empty table from `match`.
    for command in ("match", "route"):
        unknown = await cli(command, "--tokens-file", str(tokens), "--model", "nope", *t)
        assert unknown.exit_code == 1
        assert str(unknown.exception) == (
            f"{fleet.target}: NOT_FOUND: no engine serves model 'nope'"
        ), command

    route = await cli_json("route", "--tokens-file", str(tokens), *t)
    assert (route["instance_id"], route["reason"]) == (engine, "cache")
    assert len(route["costs"]) == 3
    explained = await cli("route", "--tokens-file", str(tokens), *t)
    assert f"-> {engine}" in explained.output
    columns = explained.stdout.splitlines()[1].split()
    assert columns == [
        "ENGINE",
        "CACHED",
        "HOST",
        "DISK",
        "PREFILL",
        "QUEUE",
        "DECODE",
        "MEMORY",
        "TOTAL",
        "BUSY",
    ]

    health = await cli_json("health", *t)
    assert health["state"] == "HEALTH_STATE_READY" and len(health["checks"]) == 3
    load = await cli_json("load", *t)
    assert load["attributes"]["routable_engines"] == "3"
    assert load["total_kv_blocks"] == 768
    info = await cli_json("info", *t)
    assert info["engine"]["engine_name"] == "kvplane-controller"
    assert info["models"][0]["kv_block_size"] == 16

    cordoned = await cli("cordon", engine, *t)
    assert cordoned.exit_code == 0 and "cordoned" in cordoned.output
    assert not next(
        w for w in (await cli_json("workers", *t))["workers"] if w["instance_id"] == engine
    )["routable"]
    # `match` still shows what the cordoned engine holds (to decide whether to uncordon it).
    assert await holder(tokens, t) == engine
    routed = await cli_json("route", "--tokens-file", str(tokens), *t)
    assert engine not in [c["instance_id"] for c in routed["costs"]]
    uncordoned = await cli("uncordon", engine, *t)
    assert uncordoned.exit_code == 0 and "not routed" not in uncordoned.output

    drained = await cli("drain", engine, "--deadline-ms", "30000", *t)
    assert drained.exit_code == 0, drained.output
    assert drained.stdout.strip().splitlines()[-1].startswith("COMPLETE")
    state = next(
        w for w in (await cli_json("workers", *t))["workers"] if w["instance_id"] == engine
    )
    assert state["state"] == "draining"
    # Uncordon does not undo a drain: it says the engine still takes no traffic, and why.
    still = await cli("uncordon", engine, *t)
    assert still.exit_code == 0, still.output
    assert "uncordoned; still not routed: draining" in still.output, still.output

    missing = await cli("abort", "nobody", *t)
    assert missing.exit_code != 0 and "NOT_FOUND" in str(missing.exception or missing.output)
    everything = await cli_json("abort", "--all", *t)
    assert everything["status"] in ("ABORT_STATUS_ABORTED", "ABORT_STATUS_ALREADY_FINISHED")
    # The sim engines, with LoRA off (their default), say supports_lora: false, so the fleet
    # refuses every LoRA call.
    for lora in (["list"], ["load", "x", "/tmp", "--id", "1"]):
        refused = await cli("lora", *lora, *t)
        assert refused.exit_code != 0 and "FAILED_PRECONDITION" in str(refused.exception)


async def test_match_shows_the_engines_out_of_routing_and_why(fleet: Fleet, tmp_path: Path) -> None:
    """`match` also lists the engines the router would not choose, each marked with why
    (cordoned, draining, unreachable) and with what the index holds of it, so an operator sees
    what a drained or lost engine held; `route` (what the router sees) still leaves them out."""
    t = ["--target", fleet.target]
    [r async for r in fleet.gateway.Generate(generate_request("a", [*PREFIX, 1]))]
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))
    engine = await wait_for_holder(tokens, t)
    registry = fleet.app.controller.fleet.registry
    record = registry.get(engine)
    others = sorted({"e0", "e1", "e2"} - {engine})

    async def matched() -> dict[str, Any]:
        reply = await cli_json("match", "--tokens-file", str(tokens), *t)
        return {m["instance_id"]: m for m in reply["matches"]}

    # All routable: no engine marked, and the table has no column for it.
    first = await matched()
    assert [m["out_of_routing"] for m in first.values()] == ["", "", ""]
    table = await cli("match", "--tokens-file", str(tokens), *t)
    assert "OUT OF ROUTING" not in table.stdout

    assert (await cli("cordon", others[0], *t)).exit_code == 0
    # Nothing is in flight: the drain completes at once. Its deadline is for a request that
    # might be (one just served, its stream still ending on a loaded machine), not a race.
    drained = await cli("drain", engine, "--deadline-ms", "30000", *t)
    assert drained.exit_code == 0, drained.output
    rows = await matched()
    assert sorted(rows) == ["e0", "e1", "e2"]
    assert rows[engine]["out_of_routing"] == "draining"
    assert rows[engine]["device_blocks"] >= 4  # what the index holds of it
    assert rows[others[0]]["out_of_routing"] == "cordoned"
    assert rows[others[1]]["out_of_routing"] == ""
    table = await cli("match", "--tokens-file", str(tokens), *t)
    header, *lines = table.stdout.splitlines()[1:]
    assert header.endswith("CACHED TOKENS  OUT OF ROUTING"), header
    marks = {line.split()[0]: line.split()[-1] for line in lines}
    assert marks == {engine: "draining", others[0]: "cordoned", others[1]: "-"}
    # What the router sees is unchanged: `route` weighs the one routable engine alone.
    routed = await cli_json("route", "--tokens-file", str(tokens), *t)
    assert [c["instance_id"] for c in routed["costs"]] == [others[1]]

    # The drained engine's process gone: unreachable, what the index still holds of it shown.
    await next(e for e in fleet.engines if fleet.address(e) == record.address).close()
    await fleet.app.controller.fleet.wait_for(lambda: record.state is EngineState.UNREACHABLE, 20)
    rows = await matched()
    assert rows[engine]["out_of_routing"] == "unreachable"
    assert rows[engine]["device_blocks"] >= 4


async def test_route_explains_a_request_that_bypasses_the_prefix_cache(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`route --bypass-prefix-cache` explains a request with `kv.bypass_prefix_cache`: 0
    cached tokens on every engine, the holder's included, where the same prompt without the
    flag shows what the holder caches."""
    t = ["--target", fleet.target]
    [r async for r in fleet.gateway.Generate(generate_request("a", [*PREFIX, 1]))]
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))
    engine = await wait_for_holder(tokens, t)

    reading = await cli_json("route", "--tokens-file", str(tokens), *t)
    assert reading["predicted_cached_tokens"] == len(PREFIX)
    cached = {c["instance_id"]: c.get("cached_tokens", 0) for c in reading["costs"]}
    assert cached[engine] == len(PREFIX)

    bypassing = await cli_json("route", "--tokens-file", str(tokens), "--bypass-prefix-cache", *t)
    assert bypassing.get("predicted_cached_tokens", 0) == 0
    assert bypassing["reason"] != "cache"
    assert sorted(c["instance_id"] for c in bypassing["costs"]) == ["e0", "e1", "e2"]
    assert [c.get("cached_tokens", 0) for c in bypassing["costs"]] == [0, 0, 0]
    table = await cli("route", "--tokens-file", str(tokens), "--bypass-prefix-cache", *t)
    assert table.exit_code == 0, table.output
    assert "predicted cached 0 of 65 tokens" in table.output
    assert "bypass_prefix_cache: the request reads no cached prefix" in table.output
    # What the engines hold does not change with a request that does not read it: `match`
    # takes no such flag (a usage error), and still shows the holder.
    refused = await cli("match", "--tokens-file", str(tokens), "--bypass-prefix-cache", *t)
    assert refused.exit_code == 2
    assert await holder(tokens, t) == engine


async def test_route_explains_a_request_of_a_bound_session(tmp_path: Path) -> None:
    """`route --session-key K` explains a request carrying session K: it goes to the engine
    the session is bound to, reason `session`, even for a prompt no engine holds; its table
    says that no engine was weighed, so its columns are the engines' own figures."""
    fleet = await make_fleet(router={"session_metadata_key": "session"})
    try:
        t = ["--target", fleet.target]
        bound = generate_request("a", [*PREFIX, 1], session="alice")
        [r async for r in fleet.gateway.Generate(bound)]
        tokens = tmp_path / "tokens.txt"
        tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))
        engine = await wait_for_holder(tokens, t)  # where alice's request went

        fresh = tmp_path / "fresh.txt"
        fresh.write_text(" ".join(str(t) for t in range(900, 964)))
        # Without a key, or with a session bound to no engine, the prompt is placed by load.
        for session in ([], ["--session-key", "bob"]):
            route = await cli_json("route", "--tokens-file", str(fresh), *session, *t)
            assert route["reason"] != "session", session
        alice = await cli_json("route", "--tokens-file", str(fresh), "--session-key", "alice", *t)
        assert (alice["instance_id"], alice["reason"]) == (engine, "session")
        table = await cli("route", "--tokens-file", str(fresh), "--session-key", "alice", *t)
        assert table.exit_code == 0, table.output
        assert f"-> {engine} " in table.output and "reason session" in table.output
        # The session, not the policy, chose: no engine was weighed, and the table says what
        # its columns hold then (the engines' own figures), not only TOTAL `-`.
        assert all("total" not in row for row in alice["costs"])
        assert "not weighed (no TOTAL): PREFILL is each engine's uncached prompt tokens" in (
            table.output
        )
        weighed = await cli("route", "--tokens-file", str(fresh), *t)
        assert "not weighed" not in weighed.output
    finally:
        await close_fleet(fleet)


async def test_admin_cli_against_a_single_engine(fleet: Fleet) -> None:
    t = ["--target", fleet.address(fleet.engines[0])]
    workers = await cli_json("workers", *t)
    assert [w["instance_id"] for w in workers["workers"]] == ["e0"]
    assert workers["workers"][0]["state"] == "ready"
    assert workers["workers"][0]["total_kv_blocks"] == 256  # a number, as from a controller
    assert (await cli_json("load", *t))["total_kv_blocks"] == 256
    assert (await cli_json("health", *t))["state"] == "HEALTH_STATE_READY"
    assert (await cli_json("load", *t))["instance_id"] == "e0"
    assert (await cli_json("info", *t))["engine"]["instance_id"] == "e0"
    drained = await cli("drain", "--self", *t)
    assert drained.exit_code == 0 and "COMPLETE" in drained.output


async def test_load_table_shows_every_figure_the_json_has(fleet: Fleet) -> None:
    """`admin load`'s table, of the controller and of an engine, lists every LoadInfo figure
    the JSON has (`active_kv_sessions` and `running_tokens` included, which it used to leave
    out though both are reported and the fleet sums them)."""
    for target in (fleet.target, fleet.address(fleet.engines[0])):
        as_json = await cli_json("load", "--target", target)
        table = await cli("load", "--target", target)
        assert table.exit_code == 0, table.output
        figures = re.split(r"\n(?:RANK|ATTRIBUTE) ", table.output)[0].splitlines()[1:]
        shown = {line.split()[0]: line.split()[1] for line in figures}
        # Every figure but the call's own timestamp, which moves from one call to the next.
        lists = ("attributes", "ranks", "timestamp_unix_nanos")
        expected = {k: str(v) for k, v in as_json.items() if k not in lists}
        assert {k: shown.get(k) for k in expected} == expected, table.output
        assert {"active_kv_sessions", "running_tokens"} <= expected.keys()
        assert shown.get("timestamp_unix_nanos", "").isdigit(), table.output


async def test_load_shows_a_data_parallel_engines_rank() -> None:
    """`admin load` against an engine shows its data-parallel rank's figures, in the table
    (a column per rank) and as JSON `ranks`: which rank of a data-parallel engine is busy is
    what an operator looks for. An engine reports them only when GetLoad asks, and the CLI
    did not ask: the ranks table docs/controller.md describes never showed."""
    engine = await start_sim_engine("e3", kv_events=KvEventsConfig(data_parallel_rank=3))
    try:
        t = ["--target", f"127.0.0.1:{engine.port}"]
        as_json = await cli_json("load", *t)
        assert [r["data_parallel_rank"] for r in as_json["ranks"]] == [3], as_json
        rank = as_json["ranks"][0]
        table = await cli("load", *t)
        assert table.exit_code == 0, table.output
        ranks = table.stdout.split("\nRANK ", 1)[1].split("\nATTRIBUTE ", 1)[0].splitlines()
        assert ranks[0].split() == ["3"], table.stdout
        shown = {line.split()[0]: line.split()[1:] for line in ranks[1:]}
        expected = {k: [str(v)] for k, v in rank.items() if k != "data_parallel_rank"}
        assert shown == expected, table.stdout
        assert {"running_requests", "total_kv_blocks"} <= shown.keys()
    finally:
        await engine.close()


async def test_health_exits_1_when_the_target_is_not_serving(fleet: Fleet) -> None:
    """A probe or a script reads `health`'s exit code: 0 while the target serves (READY, or
    DEGRADED: some engines out), 1 otherwise, the state shown all the same. It exited 0
    whatever the state, so a controller with no engine to route to passed as healthy."""
    t = ["--target", fleet.target]

    async def until_health(wanted: pb.HealthState.ValueType) -> None:
        async def reached() -> bool:
            return (await fleet.gateway.Health(pb.HealthRequest())).state == wanted

        await eventually(reached, what=pb.HealthState.Name(wanted))

    assert (await cli("cordon", "e0", *t)).exit_code == 0
    await until_health(pb.HEALTH_STATE_DEGRADED)
    code, out, err = await admin_process("health", *t)
    assert (code, err) == (0, ""), (out, err)
    assert out.splitlines()[0] == "state HEALTH_STATE_DEGRADED"

    for engine in ("e1", "e2"):
        assert (await cli("cordon", engine, *t)).exit_code == 0
    await until_health(pb.HEALTH_STATE_NOT_READY)
    code, out, err = await admin_process("health", *t)
    assert code == 1, (out, err)
    assert out.splitlines()[0] == "state HEALTH_STATE_NOT_READY"
    assert out.splitlines()[1].split() == ["CHECK", "STATE", "MESSAGE"]
    assert err == (
        f"kvplane: error: {fleet.target} is not serving: its health is HEALTH_STATE_NOT_READY\n"
    )
    code, out, err = await admin_process("health", *t, "--output", "json")
    assert code == 1, (out, err)
    assert json.loads(out)["state"] == "HEALTH_STATE_NOT_READY"
    assert err.startswith(f"kvplane: error: {fleet.target} is not serving: ")


async def test_route_explains_while_the_controller_drains(fleet: Fleet, tmp_path: Path) -> None:
    """`route` sends nothing: it was refused "UNAVAILABLE: the controller is draining", as
    Generate is."""
    t = ["--target", fleet.target]
    drained = await cli("drain", "--self", *t)
    assert drained.exit_code == 0 and "COMPLETE" in drained.output, drained.output
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in PREFIX))
    route = await cli_json("route", "--tokens-file", str(tokens), *t)
    assert route["instance_id"] in {"e0", "e1", "e2"}
    assert len(route["costs"]) == 3
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [r async for r in fleet.gateway.Generate(generate_request("late", PREFIX))]
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == "the controller is draining"


async def test_info_names_the_model_as_requests_must() -> None:
    """MODEL is the served name a GenerateRequest carries; SOURCE, where it was loaded from."""
    engine = await start_sim_engine("e0", served_model_name="chat")
    try:
        info = await cli("info", "--target", f"127.0.0.1:{engine.port}")
        assert info.exit_code == 0, info.output
        model_row = info.stdout.splitlines()[-1].split()
        assert model_row[:2] == ["chat", "sim"]
    finally:
        await engine.close()


async def test_the_group_target_lasts_one_invocation(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`admin --target T` reaches T for that command only; the next invocation in the same
    process (the group settings once lived in module globals) goes to the default target:
    here a port bound but not listening (127.0.0.1:8100 may be taken where tests run, and a
    server there answered `health`)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # held, not listening: a connection is refused
        default = f"127.0.0.1:{unused.getsockname()[1]}"
        monkeypatch.setattr(admin_cli, "DEFAULT_TARGET", default)
        engine = fleet.address(fleet.engines[0])
        assert (await cli("--target", engine, "health")).exit_code == 0
        later = await cli("health")
    assert later.exit_code == 1
    assert str(later.exception).startswith(f"{default}: UNAVAILABLE")


@pytest.mark.parametrize(
    "command",
    [
        ["match", "--prompt", "hello"],
        ["route", "--prompt", "hello"],
        ["register", "127.0.0.1:9001"],
        ["remove", "e0"],
        ["cordon", "e0"],
        ["uncordon", "e0"],
        ["drain", "e0"],
        ["lora", "load", "x", "/tmp/x", "--id", "1", "--engine", "e0"],
    ],
)
async def test_fleet_commands_against_an_engine_say_they_need_a_controller(
    fleet: Fleet, command: list[str]
) -> None:
    engine = fleet.address(fleet.engines[0])
    result = await cli("--target", engine, *command)
    assert isinstance(result.exception, ControllerRequiredError), result.exception
    message = str(result.exception)
    assert message.startswith(f"`{command[0]}") and f"needs a controller: {engine}" in message
    assert "\n" not in message and "Method not found" not in message


async def test_a_drain_the_engine_refuses_leaves_it_in_routing(tmp_path: Path) -> None:
    """The engine answers the controller's Drain UNAUTHENTICATED (it wants a token the
    controller does not have): `drain ENGINE` fails with one line, and the engine, which
    never drained, takes traffic again instead of staying out of routing for good."""
    token = tmp_path / "token"
    token.write_text("engine-only")
    guarded = await start_sim_engine("e0", auth={"token_file": token})
    fleet = await make_fleet(engines=[guarded, await start_sim_engine("e1")])
    try:
        refused = await cli("drain", "e0", "--target", fleet.target)
        assert refused.exit_code == 1
        assert "UNAUTHENTICATED" in str(refused.exception)
        await fleet.wait_routable(2)
        assert (await fleet.gateway.Health(pb.HealthRequest())).state == pb.HEALTH_STATE_READY
    finally:
        await close_fleet(fleet)


async def test_every_command_carries_the_token_to_a_read_protected_server(
    tmp_path: Path,
) -> None:
    """With `auth.protect_reads` even reads need the token: every admin command sends the
    group's --token-file, else $KVPLANE_TOKEN (it once went only with drain, abort and
    LoRA calls, so `workers` could not read such a controller). A command's own
    --token-file wins over both. The controller reaches such an engine with
    `engine_token_file`."""
    token = tmp_path / "token"
    token.write_text("s3cret")
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    auth = {"token_file": token, "protect_reads": True}
    engine = await start_sim_engine("e0", auth=auth)
    fleet = await make_fleet(engines=[engine], auth=auth, engine_token_file=token)
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(PREFIX))

    def admin(*args: str, env: dict[str, str] | None = None) -> Result:
        runner = CliRunner(env={"KVPLANE_TOKEN": "", **(env or {})})
        return runner.invoke(app, ["admin", *args])

    try:
        for target in (fleet.target, fleet.address(engine)):
            for command in (["workers"], ["health"], ["load"], ["info"]):
                anonymous = await asyncio.to_thread(admin, "-t", target, *command)
                assert "UNAUTHENTICATED" in str(anonymous.exception), (target, command)
                group = await asyncio.to_thread(
                    admin, "--token-file", str(token), "-t", target, *command
                )
                assert group.exit_code == 0, (target, command, group.output)
                env = await asyncio.to_thread(
                    admin, "-t", target, *command, env={"KVPLANE_TOKEN": "s3cret"}
                )
                assert env.exit_code == 0, (target, command, env.output)
        route = ["route", "--tokens-file", str(tokens), "-t", fleet.target]
        assert (await asyncio.to_thread(admin, "--token-file", str(token), *route)).exit_code == 0
        # The command's own --token-file wins over the group's.
        cordon = ["cordon", "e0", "-t", fleet.target]
        overridden = await asyncio.to_thread(
            admin, "--token-file", str(token), *cordon, "--token-file", str(wrong)
        )
        assert "UNAUTHENTICATED" in str(overridden.exception)
        # The controller's own calls to the engine carry `engine_token_file`: its polls (it
        # is routable), and a mutating Abort fanned out to the engine.
        aborted = await asyncio.to_thread(
            admin, "--token-file", str(token), "abort", "--all", "-t", fleet.target
        )
        assert aborted.exit_code == 0, aborted.output
    finally:
        await close_fleet(fleet)


async def test_a_target_of_another_kind_is_named_in_one_line(fleet: Fleet) -> None:
    """An indexer given to the engine commands or the fleet commands, a controller or an
    engine given to `admin index`: one line naming what the target is not and what it is
    (`drain` said "(an engine?)" of an indexer), not gRPC's "Method not found!". A
    server's /metrics port (HTTP/1) given for its gRPC one: said to answer HTTP/1, not gRPC's
    "Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 79)"."""
    config = IndexerConfig(listen="127.0.0.1:0")
    backend = await open_backend("memory")
    services, _, _ = index_services(
        backend,
        default_block_size=config.block_size,
        max_concurrent_prefix_queries=config.max_concurrent_prefix_queries,
    )
    server, port = await create_server(config, services)
    metrics_server, metrics_port = start_metrics_server("127.0.0.1:0", CollectorRegistry())
    indexer, engine = f"127.0.0.1:{port}", fleet.address(fleet.engines[0])
    metrics = f"127.0.0.1:{metrics_port}"
    engines = f"{indexer} is not a controller or an engine: it is a kvplane indexer"

    def needs_a_controller(command: str) -> str:
        return (
            f"`{command}` needs a controller: {indexer} is a kvplane indexer, which serves no "
            "kvplane admin API; give the controller's --target"
        )

    def http1(target: str) -> str:
        return f"{target}: UNAVAILABLE: the server answers HTTP/1, not gRPC (a /metrics address?)"

    try:
        for target, command, says in (
            (indexer, ["workers"], engines),
            (indexer, ["health"], engines),
            (indexer, ["lora", "list"], engines),
            (indexer, ["abort", "--all"], engines),
            (indexer, ["drain", "e0"], needs_a_controller("drain ENGINE")),
            (indexer, ["cordon", "e0"], needs_a_controller("cordon")),
            (
                fleet.target,
                ["index", "stats"],
                f"{fleet.target} is not a kvplane indexer: it is a kvplane controller",
            ),
            (
                engine,
                ["index", "match", "--hashes", "1"],
                f"{engine} is not a kvplane indexer: it is a kvplane engine",
            ),
            (metrics, ["health"], http1(metrics)),
            (metrics, ["workers"], http1(metrics)),
            (metrics, ["index", "stats"], http1(metrics)),
        ):
            result = await cli("--target", target, *command)
            assert result.exit_code == 1, (command, result.output)
            assert str(result.exception) == says, command
    finally:
        metrics_server.shutdown()
        await server.stop(None)
        await backend.close()


class _Unanswering(grpc.GenericRpcHandler):
    """Every method of every service, answered never: a hung server (wedged, overloaded)."""

    def __init__(self) -> None:
        self.calls = 0
        self.released = asyncio.Event()

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes]:
        async def hang(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            self.calls += 1
            await self.released.wait()
            return b""

        return grpc.unary_unary_rpc_method_handler(hang)


async def test_a_server_that_does_not_answer_is_named_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A target that takes the call and never answers: after the call's deadline, one line
    saying it did not answer within that many seconds (every admin CLI, the indexer's too),
    not gRPC's "DEADLINE_EXCEEDED: Deadline Exceeded"."""
    # A short deadline (the name the message reads and the names the calls read).
    for module in ("kvplane.cli_common", "controller.admin_cli", "indexer.admin_cli"):
        monkeypatch.setattr(f"{module}.RPC_TIMEOUT_S", 0.5)
    handler = _Unanswering()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        commands = (["workers"], ["health"], ["match", "--prompt", "x"], ["index", "stats"])
        for number, command in enumerate(commands, start=1):
            result = await cli("--target", target, *command)
            assert result.exit_code == 1, (command, result.output)
            assert str(result.exception) == (
                f"{target} did not answer within 0.5 s (is its process hung, stopped or "
                "overloaded? check it and its log)"
            ), command
            assert handler.calls == number  # the call reached the server, which sat on it
    finally:
        handler.released.set()
        await server.stop(None)


async def test_with_the_remote_index_down_the_router_still_knows_what_it_just_routed(
    tmp_path: Path,
) -> None:
    """The index answers nothing, but a prompt the controller routed a moment ago is still
    known to be where it sent it: a repeat goes there by cache, not by load alone."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    fleet = await make_fleet(2, index={"remote": dead})
    prompt = [*PREFIX, 5]
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in prompt))
    try:
        [*_] = [r async for r in fleet.gateway.Generate(generate_request("first", prompt))]
        data = await cli_json("route", "--tokens-file", str(tokens), "--target", fleet.target)
        assert data["index_error"].startswith("remote index: UNAVAILABLE")
        assert data["reason"] == "cache"
        assert int(data["predicted_cached_tokens"]) == len(PREFIX)
    finally:
        await close_fleet(fleet)


async def test_match_and_route_say_when_the_index_could_not_answer(tmp_path: Path) -> None:
    """A remote index that is down: the tables say so, rather than pass for engines that hold
    nothing of the prompt; `--output json` carries it as `index_error`."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    fleet = await make_fleet(2, index={"remote": dead})
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))
    try:
        for command in ("match", "route"):
            table = await cli(command, "--tokens-file", str(tokens), "--target", fleet.target)
            assert table.exit_code == 0, table.output
            assert "the index could not answer (remote index: UNAVAILABLE" in table.output
            assert "routed by load and by the prompts this controller itself" in table.output
            data = await cli_json(command, "--tokens-file", str(tokens), "--target", fleet.target)
            assert data["index_error"].startswith("remote index: UNAVAILABLE")
    finally:
        await close_fleet(fleet)


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize(
    ("command", "default"),
    [
        (["admin"], "127.0.0.1:8100, 127.0.0.1:50051 for `admin index`"),
        (["admin", "route"], "127.0.0.1:8100"),
        (["admin", "drain"], "127.0.0.1:8100"),
        (["admin", "index"], "127.0.0.1:50051"),
        (["admin", "index", "resync"], "127.0.0.1:50051"),
    ],
)
def test_help_shows_the_server_dialled_without_a_target(command: list[str], default: str) -> None:
    """--help said nothing of it: README's 127.0.0.1:8100 (a controller or an engine) and
    127.0.0.1:50051 (`admin index`) were found only by reading the docs."""
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    described = " ".join(result.output.split("--target", 1)[1].split("\n  -", 1)[0].split())
    assert described.endswith(f"[default: ({default})]"), described


async def test_route_explains_a_hot_prefix_by_the_requests_in_flight_sharing_it(
    tmp_path: Path,
) -> None:
    """With requests in flight that share the prompt's cached prefix (`kvplane`'s hot-prefix
    rule, `router.hot_prefix_requests`), `route` says how many share it: why an engine
    without the prefix shows a PREFILL cost divided by their number."""
    engines = [await start_sim_engine(f"e{i}", 1.0, num_kv_blocks=2000) for i in range(3)]
    fleet = await make_fleet(engines=engines)
    inflight = fleet.app.controller.router.inflight
    calls = []
    try:
        t = ["--target", fleet.target]
        [r async for r in fleet.gateway.Generate(generate_request("a", [*PREFIX, 1]))]
        tokens = tmp_path / "tokens.txt"
        tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))
        await wait_for_holder(tokens, t)
        for i in range(4):  # long answers, left unread: in flight until cancelled
            call = fleet.gateway.Generate(generate_request(f"q{i}", [*PREFIX, 10 + i], 2000))
            await call.read()
            calls.append(call)
        assert len(inflight) == 4

        route = await cli_json("route", "--tokens-file", str(tokens), *t)
        table = await cli("route", "--tokens-file", str(tokens), *t)
        assert len(inflight) == 4  # the four still shared the prefix when it was explained
        assert route["hot_prefix_sharers"] == 4, route
        assert table.exit_code == 0, table.output
        assert "hot prefix: 4 requests in flight share the cached prefix" in table.output
        assert "overlap weight / 4" in table.output
    finally:
        for call in calls:
            call.cancel()
        await close_fleet(fleet)
