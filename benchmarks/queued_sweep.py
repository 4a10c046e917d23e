"""A queued sweep as DVC users run it, on the default graph, at two commits in one run (before and after a change).

Per commit: a fresh clone of this repository at that commit; README command 1's ``dvc repro`` (timed per stage from
the stage runs' start and end, read from the MLflow store of the clone: the workspace run); commit its lock and
outputs; then ``dvc exp run --queue -S train.lr=<lr>`` per point and ``dvc queue start -j <jobs>``, polled until the
queue is empty. Per experiment: seconds from the previous one's end (with ``-j 1``) to its end (when DVC writes its
``refs/exps/.../<name>`` ref), the stages it ran (``dvc queue logs``), and the bytes of feature shards written during
the sweep, in DVC's temporary workspaces and in the feature store. The script polls git refs and the file system
only: ``dvc queue status`` waits for the running experiment's lock, so it cannot time one. The goal it checks: each
experiment costs at most 1.1x the sum of the workspace run's train, evaluate, benchmark and register stages, runs no
stage upstream of train and writes 0 bytes of features.

The clone runs its own code: ``PYTHONPATH`` puts the clone ahead of this venv's editable expman.

  python benchmarks/queued_sweep.py --rev 6d7e9a3 --rev HEAD --out benchmarks/results/queued_sweep_cpu.json
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import click
from harness import header, write_report

REPO = Path(__file__).resolve().parents[1]
GRAPH = ("prepare", "generate", "extract", "vocab", "baseline", "train", "evaluate", "benchmark", "register")
DOWNSTREAM = ("train", "evaluate", "benchmark", "register")
RUNNING = re.compile(r"Running stage '(\w+)'")
SWEEP_TIMEOUT = 3 * 3600


def _env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EXPMAN_", "DVC_"))}
    env["PYTHONPATH"] = str(clone)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"], env[f"GIT_{role}_EMAIL"] = "bench", "bench@example.com"
    return env


def _run(args: list[str], clone: Path) -> str:
    result = subprocess.run(args, cwd=clone, env=_env(clone), capture_output=True, text=True)
    if result.returncode:
        raise click.ClickException(f"{args} failed in {clone}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def _dvc(clone: Path, *args: str) -> str:
    return _run([sys.executable, "-m", "dvc", *args], clone)


def _stage_seconds(clone: Path) -> dict[str, float]:
    """Seconds of each stage run in the clone's own MLflow store (the workspace run)."""
    with sqlite3.connect(clone / "mlflow.db") as db:
        rows = db.execute(
            "select t.value, r.start_time, r.end_time from runs r join tags t on t.run_uuid = r.run_uuid "
            "where t.key = 'expman.stage'"
        ).fetchall()
    return {stage: (end - start) / 1000 for stage, start, end in rows}


def _shard_bytes(clone: Path) -> dict[str, int]:
    """Bytes of safetensors shards per place they can be written: each temporary workspace, and the feature store."""
    found: dict[str, int] = {}
    places = [*(clone / ".dvc/tmp/exps").glob("tmp*"), clone / ".expman"]
    for place in places:
        if place.is_dir():
            found[str(place)] = sum(p.stat().st_size for p in place.rglob("*.safetensors") if "verifier" not in p.parts)
    return found


def sweep(rev: str, work: Path, rates: list[str], jobs: int) -> dict:
    clone = work / rev
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    _run(["git", "checkout", "-q", rev], clone)
    sha = _run(["git", "rev-parse", "HEAD"], clone).strip()
    started = time.monotonic()
    _dvc(clone, "repro")
    repro_seconds = time.monotonic() - started
    stages = _stage_seconds(clone)
    _run(["git", "add", "-A"], clone)
    _run(["git", "commit", "-qm", "workspace run"], clone)
    store_before = _shard_bytes(clone).get(str(clone / ".expman"), 0)
    names = [f"lr-{n}" for n in range(1, len(rates) + 1)]
    for name, rate in zip(names, rates, strict=True):
        _dvc(clone, "exp", "run", "--queue", "-S", f"train.lr={rate}", "-n", name)
    started = time.monotonic()
    _dvc(clone, "queue", "start", "-j", str(jobs))
    finished: dict[str, float] = {}
    written: dict[str, int] = {}
    while len(finished) < len(names) and time.monotonic() - started < SWEEP_TIMEOUT:
        refs = _run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], clone).split()
        for name in names:
            if name not in finished and any(ref.endswith(f"/{name}") for ref in refs):
                finished[name] = time.monotonic() - started
        for place, size in _shard_bytes(clone).items():
            written[place] = max(written.get(place, 0), size)
        time.sleep(1)
    status = _dvc(clone, "queue", "status")
    states = {name: next((row for row in status.splitlines() if f" {name} " in f" {row} "), "") for name in names}
    written[str(clone / ".expman")] = written.get(str(clone / ".expman"), 0) - store_before
    experiments = {}
    previous = 0.0
    for name in names:
        log = _dvc(clone, "queue", "logs", name)
        ran = RUNNING.findall(log)
        experiments[name] = {
            "seconds": finished.get(name, float("nan")) - previous,
            "stages_run": ran,
            "succeeded": "Success" in states.get(name, ""),
        }
        previous = finished.get(name, previous)
    budget = 1.1 * sum(stages.get(stage, 0.0) for stage in DOWNSTREAM)
    features_written = sum(written.values())
    for result in experiments.values():
        result["within_goal"] = (
            result["seconds"] <= budget and not set(result["stages_run"]) & set(GRAPH[:5]) and features_written == 0
        )
    return {
        "commit": sha,
        "workspace_repro_seconds": repro_seconds,
        "workspace_stage_seconds": stages,
        "goal_seconds_per_experiment": budget,
        "jobs": jobs,
        "experiments": experiments,
        "feature_bytes_written_during_sweep": features_written,
        "feature_bytes_by_place": {k.removeprefix(str(clone) + "/"): v for k, v in written.items() if v},
    }


@click.command()
@click.option("--rev", "revs", multiple=True, default=["HEAD"], show_default=True, help="commits to sweep at")
@click.option("--lr", "rates", multiple=True, default=["1e-4", "1e-3"], show_default=True, help="one point each")
@click.option("--jobs", default=1, show_default=True, help="dvc queue start -j (1: per-experiment seconds)")
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/queued-sweep"), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(revs: tuple[str, ...], rates: tuple[str, ...], jobs: int, work: Path, out: Path | None) -> None:
    """Time a queued sweep of train.lr at each REV, in one run."""
    work.mkdir(parents=True, exist_ok=True)
    report = header("queued_sweep", "cpu") | {"points": list(rates), "revs": {}}
    for rev in revs:
        click.echo(f"sweep at {rev}", err=True)
        report["revs"][rev] = sweep(rev, work, list(rates), jobs)
    write_report(out, report)


if __name__ == "__main__":
    main()
