"""`kvplane admin`'s tables show each figure in the column that names it, as its JSON has it:
the CLI through CliRunner against a real controller and a real sim engine in this process."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from engine.config import LoraConfig
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_admin_cli import PREFIX, cli, cli_json, wait_for_holder
from tests.engine.lora_adapters import write_adapter_config
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

WORKERS_COLUMNS = [
    "ENGINE", "ADDRESS", "SOURCE", "MODELS", "ROLE", "STATE", "CORDONED", "RUNNING", "QUEUED",
    "KV", "INDEXED", "KV EVENTS", "INFLIGHT", "ERROR",
]  # fmt: skip


def _cells(header: str, row: str, columns: list[str]) -> dict[str, str]:
    """A table row's cells by column (the columns are left-aligned, their header starting
    each; a cell may hold spaces)."""
    starts = [header.index(column) for column in columns]
    ends = [*starts[1:], None]
    return {
        column: row[start:end].strip()
        for column, start, end in zip(columns, starts, ends, strict=True)
    }


async def test_workers_table_shows_a_busy_engines_figures_in_their_columns() -> None:
    """An engine running one request: RUNNING 1, QUEUED 0, KV its used blocks of its 256,
    INDEXED the prompt's blocks, INFLIGHT the router's one request (each column its own
    figure, not a neighbour's)."""
    engine = await start_sim_engine("e0", 1.0, sim={"min_decode_ms": 50.0})
    fleet = await make_fleet(engines=[engine])
    stream = fleet.gateway.Generate(generate_request("long", PREFIX, max_tokens=100_000))
    try:
        await anext(aiter(stream))  # it runs
        t = ["--target", fleet.target]

        async def busy() -> bool:
            [worker] = (await cli_json("workers", *t))["workers"]
            return bool(
                worker.get("running_requests") == 1
                and worker.get("inflight_requests") == 1
                and worker.get("indexed_blocks", 0) >= len(PREFIX) // 16
                and "last_kv_event_unix_s" in worker
            )

        await eventually(busy)
        table = await cli("workers", *t)
        assert table.exit_code == 0, table.output
        policy, header, row = table.stdout.splitlines()
        assert policy == "policy kvplane"
        cells = _cells(header, row, WORKERS_COLUMNS)
        assert cells["ENGINE"] == "e0" and cells["STATE"] == "ready", table.stdout
        assert (cells["RUNNING"], cells["QUEUED"], cells["INFLIGHT"]) == ("1", "0", "1")
        assert re.fullmatch(r"[1-9][0-9]?/256", cells["KV"]), table.stdout
        assert int(cells["INDEXED"]) >= len(PREFIX) // 16, table.stdout
        assert cells["CORDONED"] == "-"
        time_of_day = r"\d\d:\d\d:\d\dZ"
        following = rf"following since {time_of_day} \(last {time_of_day}\)"
        assert re.fullmatch(following, cells["KV EVENTS"]), table.stdout
        cordoned = await cli("cordon", "e0", *t)
        assert cordoned.exit_code == 0, cordoned.output
        header, row = (await cli("workers", *t)).stdout.splitlines()[1:]
        assert _cells(header, row, WORKERS_COLUMNS)["CORDONED"] == "yes"
    finally:
        stream.cancel()
        with contextlib.suppress(Exception):
            await close_fleet(fleet)


ROUTE_COLUMNS = [
    "ENGINE", "CACHED", "HOST", "DISK", "PREFILL", "QUEUE", "DECODE", "MEMORY", "TOTAL", "BUSY",
]  # fmt: skip


async def test_route_table_shows_each_engines_cost_terms_in_their_columns(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`route`'s table is its JSON: the chosen engine and why, then per engine its cached
    tokens and each weighted cost term under its own name (to one decimal)."""
    [_ async for _ in fleet.gateway.Generate(generate_request("warm", [*PREFIX, 1]))]
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in [*PREFIX, 5]))
    t = ["--tokens-file", str(tokens), "--target", fleet.target]
    await wait_for_holder(tokens, t[2:])
    route = await cli_json("route", *t)
    table = await cli("route", *t)
    assert table.exit_code == 0, table.output
    head, header, *rows = table.stdout.splitlines()
    assert head == (
        f"-> {route['instance_id']} ({route['engine']}) reason {route['reason']}, policy "
        f"{route['policy']}, predicted cached {route['predicted_cached_tokens']} of "
        f"{route['num_prompt_tokens']} tokens"
    )
    shown = {cells["ENGINE"]: cells for cells in (_cells(header, r, ROUTE_COLUMNS) for r in rows)}
    assert set(shown) == {c["instance_id"] for c in route["costs"]}
    for cost in route["costs"]:
        cells = shown[cost["instance_id"]]
        assert cells["CACHED"] == str(cost.get("cached_tokens", 0))
        terms = ("prefill_cost", "queue_cost", "decode_cost", "memory_cost", "total")
        assert [cells[c] for c in ROUTE_COLUMNS[4:9]] == [
            f"{float(cost.get(term, 0)):.1f}" for term in terms
        ], table.stdout
        assert cells["BUSY"] == ("busy" if cost.get("busy") else "-")
    assert {c.get("prefill_cost", 0) for c in route["costs"]} != {0}  # the terms differ


async def test_route_table_marks_an_engine_past_its_busy_threshold(tmp_path: Path) -> None:
    """An engine whose KV usage is past `router.busy_kv_usage` (one running a request, at a
    threshold of 1%) is BUSY in `route`'s table, as its JSON says; an idle one is not."""
    engines = [await start_sim_engine(f"e{i}", 1.0, sim={"min_decode_ms": 50.0}) for i in (0, 1)]
    fleet = await make_fleet(engines=engines, router={"busy_kv_usage": 0.01})
    long = generate_request("long", PREFIX, max_tokens=100_000)
    stream = fleet.gateway.Generate(long)
    try:
        await anext(aiter(stream))
        tokens = tmp_path / "tokens.txt"
        tokens.write_text(" ".join(str(t) for t in range(900, 964)))
        t = ["--tokens-file", str(tokens), "--target", fleet.target]

        async def one_busy() -> bool:
            costs = (await cli_json("route", *t))["costs"]
            return sorted(bool(c.get("busy")) for c in costs) == [False, True]

        await eventually(one_busy)
        route = await cli_json("route", *t)
        busy = next(c["instance_id"] for c in route["costs"] if c.get("busy"))
        table = await cli("route", *t)
        assert table.exit_code == 0, table.output
        lines = table.stdout.splitlines()
        header, *rows = lines[next(i for i, x in enumerate(lines) if x.startswith("ENGINE")) :]
        shown = {c["ENGINE"]: c["BUSY"] for c in (_cells(header, r, ROUTE_COLUMNS) for r in rows)}
        assert shown == {"e0": "-", "e1": "-", busy: "busy"}, table.stdout
    finally:
        stream.cancel()
        with contextlib.suppress(Exception):
            await close_fleet(fleet)


async def test_lora_list_table_names_the_engines_holding_each_adapter(tmp_path: Path) -> None:
    """Behind a controller, `lora list`'s ENGINES column names the engines holding each
    adapter, as the JSON's per-engine `adapters` say."""
    lora = LoraConfig(enabled=True)
    engines = [await start_sim_engine(f"e{i}", lora=lora) for i in (0, 1)]
    fleet = await make_fleet(engines=engines)
    try:
        t = ["--target", fleet.target]
        x = str(write_adapter_config(tmp_path / "x"))
        y = str(write_adapter_config(tmp_path / "y", r=4))
        assert (await cli("lora", "load", "x", x, "--id", "1", "--engine", "e0", *t)).exit_code == 0
        assert (await cli("lora", "load", "y", y, "--id", "2", *t)).exit_code == 0
        listed = await cli("lora", "list", *t)
        assert listed.exit_code == 0, listed.output
        header, *rows = listed.stdout.splitlines()
        columns = ["ID", "NAME", "PATH", "ENGINES"]
        shown = {c["NAME"]: c["ENGINES"] for c in (_cells(header, r, columns) for r in rows)}
        assert shown == {"x": "e0", "y": "e0,e1"}, listed.stdout
    finally:
        await close_fleet(fleet)
