"""Draw docs/benchmarks/routing_{reuse,ttft}.png from routing_results.json.

Usage: python docs/benchmarks/plot_routing.py [RESULTS_JSON]   (needs matplotlib: the `bench`
extra, `pip install -e '.[bench]'`, or `pip install matplotlib` in any environment)."""

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
    "kvplane", "dynamo_kv_router", "dynamo_kv_router_tuned", "dynamo_cost", "sglang_cache_aware",
    "llmd_longest_prefix", "least_loaded", "round_robin",
]  # fmt: skip
RATIO_CAP = 1.6  # TTFT ratios above this are clipped (and labelled)


def _labels(runs: list[dict[str, Any]]) -> list[str]:
    return [
        f"{r['trace'].split('_')[0][:4]} {r['blocks_per_worker']} x{r['speedup']:g}" for r in runs
    ]


def _value(row: dict[str, Any] | None, metric: str) -> float | None:
    if row is None:
        return None
    if metric == "reuse":
        return float(row["hit_ratio"])
    return float(row["ttft_ms"][metric])


def _panel(ax: Any, runs: list[dict[str, Any]], metric: str, title: str) -> None:
    width = 0.8 / len(POLICIES)
    for i, name in enumerate(POLICIES):
        xs, values = [], []
        for x, r in enumerate(runs):
            value = _value(r["policies"].get(name), metric)
            if value is None:
                continue
            if metric != "reuse":  # relative to round robin on the same configuration
                base = _value(r["policies"].get("round_robin"), metric) or 1.0
                value /= base
                if value > RATIO_CAP:
                    ax.text(x + i * width, RATIO_CAP, f"{value:.0f}x", rotation=90,
                            ha="center", va="top", fontsize=6, color="white")  # fmt: skip
                    value = RATIO_CAP
            xs.append(x + i * width)
            values.append(value)
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(runs))], _labels(runs), rotation=30,
                  ha="right")  # fmt: skip
    ax.set_title(title)
    if metric != "reuse":
        ax.set_ylim(0, RATIO_CAP)
        ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.grid(axis="y", linewidth=0.3)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "routing_results.json"
    runs = json.loads(path.read_text())["runs"]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    _panel(ax, runs, "reuse", "prefix reuse (higher is better)")
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(HERE / "routing_reuse.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(2, 1, figsize=(12, 8.5), sharex=True)
    _panel(axes[0], runs, "mean", "TTFT mean relative to round robin (lower is better)")
    _panel(axes[1], runs, "p99", "TTFT p99 relative to round robin (lower is better)")
    axes[1].legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(HERE / "routing_ttft.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
