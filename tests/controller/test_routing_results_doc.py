"""docs/benchmarks/routing.md says what docs/benchmarks/routing_results.json holds: every
"All results" table row is its policy's figures to the printed digit, and every Summary cell
is `kvplane`'s figure, marked "best" exactly where no other row beats it (ties count), else
with the best other row's figure (its imbalance and reuse / oracle: `kvplane`'s own). A
re-run whose JSON is committed without its tables (or the other way round) fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs/benchmarks/routing.md").read_text()
RUNS: list[dict[str, Any]] = json.loads(
    (ROOT / "docs/benchmarks/routing_results.json").read_text()
)["runs"]
# The "All results" tables' labels of the Dynamo rows (their mocker's runs).
PEER_LABELS = {
    "Dynamo kv_router (its mocker, mean of 10)": "dynamo_kv_router",
    "Dynamo kv_router tuned (credit 4, load scale 4; its mocker, mean of 10)": (
        "dynamo_kv_router_tuned"
    ),
    "Dynamo round_robin (its mocker)": "dynamo_round_robin",
}


def _trace(run: dict[str, Any]) -> str:
    return str(run["trace"]).removesuffix("_trace.jsonl")


def _run_id(run: dict[str, Any]) -> str:
    return f"{_trace(run)} {run['blocks_per_worker']} x{run['speedup']:g}"


def _number(cell: str) -> float:
    return float(cell.strip("*").split()[0].replace(",", ""))


def _decimals(cell: str) -> int:
    digits = cell.strip("*").split()[0]
    return len(digits.partition(".")[2])


def _rows(table: str) -> list[list[str]]:
    """The body rows of a markdown table, as stripped cells."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


@pytest.mark.parametrize("run", RUNS, ids=_run_id)
def test_all_results_table_is_the_json(run: dict[str, Any]) -> None:
    heading = (
        f"### {_trace(run)}, {run['blocks_per_worker']} blocks per worker, "
        f"speed x{run['speedup']:g} (oracle reuse {run['oracle_hit_ratio']:.3f})\n"
    )
    assert heading in DOC, f"no table headed {heading!r}"
    table = DOC.split(heading, 1)[1].lstrip("\n").split("\n\n", 1)[0]
    seen = set()
    for cells in _rows(table):
        name = PEER_LABELS.get(cells[0], cells[0].strip("*"))
        row = run["policies"][name]
        seen.add(name)
        figures = [
            row["hit_ratio"],
            row["ttft_ms"]["mean"],
            row["ttft_ms"]["p50"],
            row["ttft_ms"]["p99"],
            row["itl_ms"]["mean"],
        ]
        for cell, value in zip(cells[1:6], figures, strict=True):
            assert _number(cell) == round(value, _decimals(cell)), (name, cell, value)
        imbalance = cells[6]
        if imbalance == "-":
            assert "imbalance" not in row, name
        else:
            assert _number(imbalance) == round(row["imbalance"], 3), (name, imbalance)
    assert seen == set(run["policies"]), f"rows missing: {set(run['policies']) - seen}"


def _figure(row: dict[str, Any], key: tuple[str, ...]) -> float:
    value: Any = row
    for part in key:
        value = value[part]
    return float(value)


def _summary_rows() -> dict[str, list[str]]:
    section = DOC.split("## Summary:", 1)[1].split("\n## ", 1)[0]
    table = section.split("| trace | blocks | speed |", 1)[1].split("\n\n", 1)[0]
    return {f"{c[0]} {c[1]} {c[2]}": c[3:] for c in _rows("|\n" + table)}


@pytest.mark.parametrize("run", RUNS, ids=_run_id)
def test_summary_cells_are_the_json(run: dict[str, Any]) -> None:
    *cells, imbalance, of_oracle = _summary_rows()[_run_id(run)]
    policies = run["policies"]
    kvplane = policies["kvplane"]
    assert _number(imbalance) == round(kvplane["imbalance"], 3), imbalance
    assert _number(of_oracle) == round(kvplane["hit_ratio"] / run["oracle_hit_ratio"], 2)
    others = [row for name, row in policies.items() if name != "kvplane"]
    metrics = [  # (what, its key in a row, higher is better)
        ("reuse", ("hit_ratio",), True),
        ("TTFT mean", ("ttft_ms", "mean"), False),
        ("TTFT p99", ("ttft_ms", "p99"), False),
    ]
    for cell, (what, key, higher) in zip(cells, metrics, strict=True):
        ours = _figure(policies["kvplane"], key)
        best_other = (max if higher else min)(_figure(row, key) for row in others)
        assert _number(cell) == round(ours, _decimals(cell)), (what, cell, ours)
        is_best = ours >= best_other if higher else ours <= best_other
        marked = re.search(r"\(best( [\d,.]+)?\)", cell)
        assert marked, (what, cell)
        if is_best:
            assert marked.group(1) is None, f"{what}: {cell} but kvplane is the best row"
        else:
            shown = marked.group(1) or ""
            assert shown, f"{what}: {cell} but {best_other} beats kvplane's {ours}"
            assert _number(shown) == round(best_other, _decimals(shown)), (what, cell)
