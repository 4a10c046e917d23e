"""expman runs: the recent stage runs and registered versions, read without mlflow (see expman.registry.reader)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from expman.registry.reader import open_registry
from expman.registry.tables import text_table
from expman.registry.versions import DRAFTER_SHA_TAG

__all__ = ["list_runs", "render_runs"]

KEY_METRIC = re.compile(r"tau|speedup|coverage")  # the numbers a drafter is judged by
CHAIN = re.compile(r"k(\d+)")
SHOWN_METRICS = 3


def _time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000).astimezone().isoformat(timespec="seconds") if ms else ""


def list_runs(limit: int) -> dict[str, list[dict[str, Any]]]:
    """The ``limit`` newest runs (stage, status, start, id, latest metrics) and versions (aliases, summary numbers)."""
    reader = open_registry()
    runs = [
        {
            "stage": run.tags.get("expman.stage", ""),
            "run_name": run.name,
            "status": run.status,
            "start": _time(run.start_ms),
            "run_id": run.run_id,
            "metrics": run.metrics,
        }
        for run in reader.recent_runs(limit)
    ]
    versions = [
        {
            "model": version.name,
            "version": version.version,
            "aliases": list(version.aliases),
            "created": _time(version.created_ms),
            "run_id": version.run_id,
            "drafter_sha256": version.tags.get(DRAFTER_SHA_TAG, ""),
            "metrics": {
                key.removeprefix("expman.metrics."): float(value)
                for key, value in version.tags.items()
                if key.startswith("expman.metrics.")
            },
        }
        for version in reader.recent_versions(limit)
    ]
    return {"runs": runs, "versions": versions}


def _key_metrics(metrics: dict[str, float]) -> str:
    """tau, speedup and coverage numbers at the largest chain length k present, the candidate's over the
    baseline's; per-step training curves (``train/*``) left out."""
    names = [n for n in metrics if KEY_METRIC.search(n) and not n.startswith(("train/", "baseline/"))]
    longest = max((int(k) for n in names for k in CHAIN.findall(n)), default=None)
    chosen = sorted(n for n in names if all(int(k) == longest for k in CHAIN.findall(n)))
    return "  ".join(f"{name}={metrics[name]:.4g}" for name in chosen[:SHOWN_METRICS])


def render_runs(listing: dict[str, list[dict[str, Any]]]) -> str:
    """Two aligned tables: runs, then versions."""
    runs = [["stage", "status", "start", "run id", "key metrics"]]
    runs += [
        [r["stage"] or r["run_name"], r["status"], r["start"], r["run_id"], _key_metrics(r["metrics"])]
        for r in listing["runs"]
    ]
    versions = [["model", "version", "aliases", "created", "drafter sha256", "run id", "key metrics"]]
    versions += [
        [
            v["model"],
            str(v["version"]),
            " ".join(f"@{a}" for a in v["aliases"]),
            v["created"],
            v["drafter_sha256"][:12],
            v["run_id"],
            _key_metrics(v["metrics"]),
        ]
        for v in listing["versions"]
    ]
    return "\n".join(["runs", *text_table(runs), "", "versions", *text_table(versions)])
