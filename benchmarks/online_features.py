"""The default graph with online features against offline, in one run, on this machine (issue 52's CPU measurement).

A fresh clone of this repository at REV. Offline: README command 1's ``dvc repro``. Online: then
``dvc exp run -S train.features=online`` in the same workspace (extract records the shard plan; baseline, train,
evaluate, benchmark and register rerun, computing the states while training). Per mode: each stage's seconds as
DVC runs it (``harness.timed_dvc``) and as its MLflow run spans, the total, the bytes the feature store grew by,
held-out τ(k=3) of the candidate and the baseline (``metrics/evaluate.json``), and, online, the seconds train and
baseline spent computing features (their ``online_features_s`` metric). The clone runs its own code (PYTHONPATH).

  python benchmarks/online_features.py --rev HEAD --out benchmarks/results/online_features_cpu.json
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
from harness import header, timed_dvc, write_report

REPO = Path(__file__).resolve().parents[1]


def _env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EXPMAN_", "DVC_"))}
    env["PYTHONPATH"] = str(clone)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"], env[f"GIT_{role}_EMAIL"] = "bench", "bench@example.com"
    return env


def _store_bytes(clone: Path) -> int:
    store = clone / ".expman/features"
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) if store.is_dir() else 0


def _runs(clone: Path, since_ms: int) -> dict[str, dict[str, float]]:
    """Per stage run started after ``since_ms``: its span and its online_features_s metric, if any."""
    with sqlite3.connect(clone / "mlflow.db") as db:
        rows = db.execute(
            "select t.value, r.start_time, r.end_time, "
            "(select max(m.value) from metrics m where m.run_uuid = r.run_uuid and m.key = 'online_features_s') "
            "from runs r join tags t on t.run_uuid = r.run_uuid and t.key = 'expman.stage' where r.start_time >= ?",
            (since_ms,),
        ).fetchall()
    return {
        stage: {"span_s": (end - start) / 1000} | ({"online_features_s": computed} if computed is not None else {})
        for stage, start, end, computed in rows
    }


def _tau(clone: Path) -> dict[str, float]:
    summary = json.loads((clone / "metrics/evaluate.json").read_text())
    return {arm: summary[arm]["k3"]["tau"] for arm in ("candidate", "baseline") if arm in summary}


def _cache_gib(clone: Path) -> float:
    """The host memory the online run kept computed states in (0 before params.yaml had the key)."""
    import yaml

    return float(yaml.safe_load((clone / "params.yaml").read_text())["train"].get("online_cache_gib", 0))


def _mode(clone: Path, args: list[str]) -> dict:
    import time

    since = int(time.time() * 1000)
    before = _store_bytes(clone)
    seconds, stages = timed_dvc(args, clone, _env(clone))
    return {
        "command": "dvc " + " ".join(args),
        "seconds": seconds,
        "stage_seconds": stages,
        "runs": _runs(clone, since),
        "feature_bytes_written": _store_bytes(clone) - before,
        "heldout_tau_k3": _tau(clone),
    }


@click.command()
@click.option("--rev", default="HEAD", show_default=True, help="the commit to measure")
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/online-features"), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(rev: str, work: Path, out: Path | None) -> None:
    """The default graph offline, then online, in one fresh clone at REV."""
    clone = work / rev
    shutil.rmtree(clone, ignore_errors=True)  # an earlier run's clone of the same rev
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", rev], cwd=clone, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    offline = _mode(clone, ["repro"])
    online = _mode(clone, ["exp", "run", "-S", "train.features=online"])
    shared = set(offline["stage_seconds"]) & set(online["stage_seconds"])
    report = header("online_features", "cpu") | {
        "rev": rev,
        "measured_commit": commit,
        "offline": offline,
        "online": online,
        "online_cache_gib": _cache_gib(clone),
        "ratio_online_to_offline": {
            stage: online["stage_seconds"][stage] / offline["stage_seconds"][stage] for stage in sorted(shared)
        },
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
