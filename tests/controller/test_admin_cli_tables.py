"""`kvplane admin`'s tables show each figure in the column that names it, as its JSON has it:
the CLI through CliRunner against a real controller and a real sim engine in this process."""

from __future__ import annotations

import contextlib
import re

import pytest

from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.controller.test_admin_cli import PREFIX, cli, cli_json
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
        cordoned = await cli("cordon", "e0", *t)
        assert cordoned.exit_code == 0, cordoned.output
        header, row = (await cli("workers", *t)).stdout.splitlines()[1:]
        assert _cells(header, row, WORKERS_COLUMNS)["CORDONED"] == "yes"
    finally:
        stream.cancel()
        with contextlib.suppress(Exception):
            await close_fleet(fleet)
