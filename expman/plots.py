"""Pictures of a run: the small CSV tables ``dvc plots`` draws (dvc.yaml's top-level ``plots``) and the same
pictures as matplotlib figures, which the stages log to their MLflow runs as PNGs.

Tables are written atomically. A number a run does not have (an arm it did not run, a TTT step without scored
positions) is written ``nan``: Vega-Lite leaves it out of the line, where an empty cell would be drawn as 0.
Figures are ``matplotlib.figure.Figure`` objects made without pyplot: no global state, no display, Agg on save.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from expman.provenance import atomic_write

__all__ = [
    "ARMS",
    "BENCHMARK_FIGURE",
    "EVALUATE_FIGURE",
    "TRAIN_FIGURE",
    "benchmark_figure",
    "evaluation_figure",
    "evaluation_tables",
    "read_table",
    "train_figure",
    "train_row",
    "write_table",
    "write_tables",
]

ARMS = ("baseline", "candidate")
TRAIN_FIGURE, EVALUATE_FIGURE, BENCHMARK_FIGURE = "figures/train.png", "figures/evaluate.png", "figures/benchmark.png"
COLORS = {"baseline": "#8c8c8c", "candidate": "#1f77b4"}
STEP_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def write_table(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as CSV, the first row's keys as columns; floats with 6 significant digits."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})
    text = buffer.getvalue()
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_tables(folder: Path, tables: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Each table as ``folder/<name>.csv``."""
    for name, rows in tables.items():
        write_table(folder / f"{name}.csv", rows)


def read_table(path: Path) -> list[dict[str, Any]]:
    """A table ``write_table`` wrote, numbers as floats."""

    def value(text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            return text

    with open(path, encoding="utf-8", newline="") as handle:
        return [{key: value(text) for key, text in row.items()} for row in csv.DictReader(handle)]


def train_row(step: int, metrics: Mapping[str, float], ttt_steps: int) -> dict[str, float]:
    """One row of the training curves: the objective, accuracy per TTT step and simulated τ per k."""
    names = ["loss", *(f"acc_{k}" for k in range(ttt_steps)), *(f"sim_tau_k{k}" for k in range(1, ttt_steps + 1))]
    return {"step": step, **{name: float(metrics.get(name, math.nan)) for name in names}}


def evaluation_tables(evaluation: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """From ``evaluation.json``'s summary: τ and speedup per k and arm, the acceptance rate at each draft position
    and τ per category (both at the largest k)."""
    summary, ks = evaluation["summary"], evaluation["ks"]
    largest = max(ks)

    def value(arm: str, k: int, name: str) -> Any:
        return summary[arm][f"k{k}"][name] if arm in summary else math.nan

    def rate(arm: str, position: int) -> float:
        return summary[arm][f"k{largest}"]["per_position"][position] if arm in summary else math.nan

    return {
        "tau": [{"k": k, **{arm: value(arm, k, "tau") for arm in ARMS}} for k in ks],
        "speedup": [{"k": k, **{arm: value(arm, k, "speedup") for arm in ARMS}} for k in ks],
        "per_position": [{"position": i + 1, **{arm: rate(arm, i) for arm in ARMS}} for i in range(largest)],
        "by_category": [
            {"label": f"{category} · {arm}", "category": category, "arm": arm, "tau": block[arm][f"k{largest}"]["tau"]}
            for category, block in summary["by_category"].items()
            for arm in ARMS
            if arm in block
        ],
    }


def _figure(layout: list[list[str]], size: tuple[float, float], title: str = "") -> tuple[Any, dict[str, Any]]:
    """A figure of named panels (matplotlib's mosaic ``layout``), gridded."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    axes = figure.subplot_mosaic(layout)
    if title:
        figure.suptitle(title)
    for ax in axes.values():
        ax.grid(alpha=0.3)
    return figure, axes


def _finite(rows: Sequence[Mapping[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(row[x], row[y]) for row in rows if not math.isnan(row[y])]
    return [p[0] for p in points], [p[1] for p in points]


def train_figure(steps: Sequence[Mapping[str, Any]], heldout: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """Loss, accuracy per TTT step and simulated τ per k over optimizer steps: lines for the training windows,
    dashed markers for the held-out samples after each epoch."""
    figure, axes = _figure([["loss", "accuracy per TTT step"], ["simulated τ per k"] * 2], (11, 8.4), title)
    columns = list(steps[0]) if steps else list(heldout[0]) if heldout else []
    panels = [
        ("loss", ["loss"], "objective (soft cross-entropy)"),
        ("accuracy per TTT step", [c for c in columns if c.startswith("acc_")], "accuracy"),
        ("simulated τ per k", [c for c in columns if c.startswith("sim_tau_k")], "τ"),
    ]
    for name, fields, label in panels:
        ax = axes[name]
        for index, field in enumerate(fields):
            color = STEP_COLORS[index % len(STEP_COLORS)]
            ax.plot(*_finite(steps, "step", field), color=color, label=f"{field} train")
            ax.plot(*_finite(heldout, "step", field), "o--", color=color, label=f"{field} held-out")
        ax.set(title=name, xlabel="optimizer step", ylabel=label)
        ax.legend(fontsize="small")
    return figure


def evaluation_figure(evaluation: Mapping[str, Any]) -> Any:
    """``evaluation_tables`` drawn: τ and speedup per k, acceptance per draft position and τ per category, one color
    per arm."""
    tables = evaluation_tables(evaluation)
    title = f"evaluate: {len(evaluation['prompts'])} held-out prompts, {evaluation['target']}"
    figure, axes = _figure([["tau", "speedup"], ["per_position", "by_category"]], (11, 8.4), title)
    largest = int(max(row["k"] for row in tables["tau"]))
    ks = [int(row["k"]) for row in tables["tau"]]
    for name, label in (("tau", "τ (tokens per verifier forward)"), ("speedup", "speedup")):
        for arm in ARMS:
            axes[name].plot(*_finite(tables[name], "k", arm), "o-", color=COLORS[arm], label=arm)
        axes[name].axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="no speculation")
        axes[name].set(title=f"{label} per k", xlabel="k (draft chain length)", ylabel=label, xticks=ks)
    width = 0.8 / len(ARMS)
    positions = [int(row["position"]) for row in tables["per_position"]]
    for index, arm in enumerate(ARMS):
        rates = [row[arm] for row in tables["per_position"]]
        if not all(math.isnan(r) for r in rates):
            offsets = [p + (index - 0.5) * width for p in positions]
            axes["per_position"].bar(offsets, rates, width, color=COLORS[arm], label=arm)
    axes["per_position"].set(
        title=f"acceptance per draft position (k = {largest})", xlabel="position", ylabel="rate", xticks=positions
    )
    categories = sorted({row["category"] for row in tables["by_category"]})
    for index, arm in enumerate(ARMS):
        taus = {row["category"]: row["tau"] for row in tables["by_category"] if row["arm"] == arm}
        if taus:
            rows = [i + (index - 0.5) * width for i, c in enumerate(categories) if c in taus]
            values = [taus[c] for c in categories if c in taus]
            axes["by_category"].barh(rows, values, width, color=COLORS[arm], label=arm)
    axes["by_category"].set(title=f"τ per category (k = {largest})", xlabel="τ", yticks=range(len(categories)))
    axes["by_category"].set_yticklabels(categories)
    axes["by_category"].invert_yaxis()
    for ax in axes.values():
        ax.legend(fontsize="small")
    return figure


def benchmark_figure(benchmark: Mapping[str, Any]) -> Any | None:
    """Engine against reference, per arm and k: τ and speedup, with the integration-fault verdict in the title;
    None when no engine ran."""
    if benchmark.get("skipped"):
        return None
    labels, reference, engine = [], {"tau": [], "speedup": []}, {"tau": [], "speedup": []}
    for arm, result in benchmark["arms"].items():
        for k, numbers in result["k"].items():
            labels.append(f"{arm}\nk = {k}")
            for name in ("tau", "speedup"):
                reference[name].append(numbers["reference"][name])
                engine[name].append(numbers["engine"][name] or math.nan)
    verdicts = ", ".join(
        f"{arm} {'FAULT' if result['integration_fault'] else 'ok'}" for arm, result in benchmark["arms"].items()
    )
    name = benchmark.get("engine_version") or benchmark["engine"]
    title = f"{name} against the reference evaluator; integration fault: {verdicts}"
    figure, axes = _figure([["tau", "speedup"]], (11, 4.6), title)
    places = range(len(labels))
    for metric, label in (("tau", "τ"), ("speedup", "speedup")):
        ax = axes[metric]
        ax.bar([p - 0.2 for p in places], reference[metric], 0.4, color="#8c8c8c", label="reference (torch, batch 1)")
        ax.bar([p + 0.2 for p in places], engine[metric], 0.4, color="#ff7f0e", label=f"{name} (one batch)")
        ax.set(title=f"{label}: engine and reference", ylabel=label, xticks=list(places))
        ax.set_xticklabels(labels)
        ax.legend(fontsize="small")
    axes["speedup"].axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    return figure
