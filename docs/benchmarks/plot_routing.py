"""Draw docs/benchmarks/routing_{reuse,ttft}.png from routing_results.json.

Usage: python docs/benchmarks/plot_routing.py [RESULTS_JSON]   (needs matplotlib, which is
not a kvplane dependency: `pip install matplotlib` in any environment)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
POLICIES = [
    "kvplane", "dynamo_kv_router", "dynamo_cost", "sglang_cache_aware", "llmd_longest_prefix",
    "least_loaded", "round_robin",
]  # fmt: skip


def _panel(ax: Any, runs: list[dict[str, Any]], metric: str, title: str) -> None:
    labels = [
        f"{r['trace'].split('_')[0][:4]} {r['blocks_per_worker']} x{r['speedup']:g}" for r in runs
    ]
    width = 0.8 / len(POLICIES)
    for i, name in enumerate(POLICIES):
        values = []
        for r in runs:
            row = r["policies"].get(name)
            if row is None:
                values.append(0.0)
            elif metric == "reuse":
                values.append(row["hit_ratio"])
            else:
                values.append(row["ttft_ms"]["mean"])
        xs = [x + i * width for x in range(len(runs))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(runs))], labels, rotation=30, ha="right")
    ax.set_title(title)
    if metric == "ttft":
        ax.set_yscale("log")  # saturated configurations reach minutes


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "routing_results.json"
    runs = json.loads(path.read_text())["runs"]
    for metric, title, out in (
        ("reuse", "prefix reuse (higher is better)", "routing_reuse.png"),
        ("ttft", "TTFT mean, ms, log scale (lower is better)", "routing_ttft.png"),
    ):
        fig, ax = plt.subplots(figsize=(12, 4.5))
        _panel(ax, runs, metric, title)
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        fig.savefig(HERE / out, dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
