"""A queued sweep as DVC users run it, on the default graph, at two commits in one run (before and after a change).

Per commit: a fresh clone of this repository at that commit; README command 1's ``dvc repro``, each stage timed as
DVC runs it (from its ``Running stage`` line to the next one, or to the end: the stage's process start-up, its work,
and DVC hashing and caching its outputs), and its MLflow run's span read from the clone's store; commit its lock and
outputs; then ``dvc exp run --queue -S train.lr=<lr>`` per point and ``dvc queue start -j <jobs>``, polled until the
queue is empty. Per experiment: the seconds DVC's queue worker reports for it (``run_exp[...] succeeded in``: the
temporary workspace's set-up, every stage, collecting the result), the share of the queue's own start-up and
shut-down, the stages it ran (``dvc queue logs``), its MLflow runs' spans, and the bytes of feature shards written
during the sweep, in DVC's temporary workspaces and in the feature store. The goal it checks: each experiment costs
at most 1.1x the sum of the workspace run's train, evaluate, benchmark and register stages timed the same way, runs no
stage upstream of train and writes 0 bytes of features; the ratio to the stages' MLflow spans alone is reported too.

The clone runs its own code: ``PYTHONPATH`` puts the clone ahead of this venv's editable expman.

  python benchmarks/queued_sweep.py --rev 6d7e9a3 --rev HEAD --out benchmarks/results/queued_sweep_cpu.json
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import click
from harness import RUNNING_STAGE, header, timed_dvc, write_report

REPO = Path(__file__).resolve().parents[1]
GRAPH = ("prepare", "generate", "extract", "vocab", "baseline", "train", "evaluate", "benchmark", "register")
DOWNSTREAM = ("train", "evaluate", "benchmark", "register")
WORKER_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): .*run_exp\[([0-9a-f-]+)\] (received|succeeded in ([0-9.]+)s)"
)
SWEEP_TIMEOUT = 3 * 3600
GOAL = 1.1


def _env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EXPMAN_", "DVC_"))}
    env["PYTHONPATH"] = str(clone)
    env["PYTHONUNBUFFERED"] = "1"
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


def _stage_spans(clone: Path) -> dict[str | None, dict[str, float]]:
    """Seconds of each stage's MLflow run in the clone's store, by DVC experiment name (None: the workspace run)."""
    with sqlite3.connect(clone / "mlflow.db") as db:
        rows = db.execute(
            "select s.value, e.value, r.start_time, r.end_time from runs r "
            "join tags s on s.run_uuid = r.run_uuid and s.key = 'expman.stage' "
            "left join tags e on e.run_uuid = r.run_uuid and e.key = 'dvc.exp_name'"
        ).fetchall()
    spans: dict[str | None, dict[str, float]] = {}
    for stage, experiment, start, end in rows:
        spans.setdefault(experiment, {})[stage] = (end - start) / 1000
    return spans


def _worker_tasks(clone: Path) -> list[dict[str, float]]:
    """DVC's queue workers' experiment tasks from their logs: when each was received and how long it ran, in order."""
    tasks: dict[str, dict[str, float]] = {}
    for log in sorted((clone / ".dvc/tmp/exps/celery").glob("dvc-exp-worker-*.out")):
        for line in log.read_text(errors="replace").splitlines():
            if match := WORKER_LINE.match(line):
                stamp, millis, task, event, seconds = match.groups()
                at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp() + int(millis) / 1000
                entry = tasks.setdefault(task, {})
                if event == "received":
                    entry["received"] = at
                else:
                    entry["seconds"] = float(seconds)
    return sorted(tasks.values(), key=lambda entry: entry.get("received", 0.0))


def _shard_bytes(clone: Path) -> dict[str, int]:
    """Bytes of safetensors shards per place they can be written: each temporary workspace, and the feature store."""
    found: dict[str, int] = {}
    places = [*(clone / ".dvc/tmp/exps").glob("tmp*"), clone / ".expman"]
    for place in places:
        if place.is_dir():
            found[str(place)] = sum(p.stat().st_size for p in place.rglob("*.safetensors") if "verifier" not in p.parts)
    return found


def _start_queue(clone: Path, jobs: int) -> None:
    """``dvc queue start``. Its detached worker inherits the command's output: to a file, not a pipe, since reading
    a pipe to its end would wait for the worker, that is for the whole sweep, and nothing would be polled during it."""
    log = clone / ".dvc/tmp/queue-start.log"
    with open(log, "w", encoding="utf-8") as out:
        command = [sys.executable, "-m", "dvc", "queue", "start", "-j", str(jobs)]
        result = subprocess.run(command, cwd=clone, env=_env(clone), stdout=out, stderr=subprocess.STDOUT)
    if result.returncode:
        raise click.ClickException(f"dvc queue start failed in {clone}:\n{log.read_text()[-3000:]}")


def _run_queue(clone: Path, names: list[str], jobs: int) -> tuple[float, dict[str, int]]:
    """``dvc queue start -j JOBS``, polled (git refs, the file system) until every experiment has its ref."""
    started = time.monotonic()
    _start_queue(clone, jobs)
    written: dict[str, int] = {}
    finished: set[str] = set()
    while len(finished) < len(names) and time.monotonic() - started < SWEEP_TIMEOUT:
        refs = _run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], clone).split()
        finished |= {name for name in names if any(ref.endswith(f"/{name}") for ref in refs)}
        for place, size in _shard_bytes(clone).items():
            written[place] = max(written.get(place, 0), size)
        time.sleep(1)
    return time.monotonic() - started, written


def sweep(rev: str, work: Path, rates: list[str], jobs: int) -> dict:
    clone = work / rev
    shutil.rmtree(clone, ignore_errors=True)  # an earlier run's clone of the same rev
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    _run(["git", "checkout", "-q", rev], clone)
    sha = _run(["git", "rev-parse", "HEAD"], clone).strip()
    repro_seconds, stage_seconds = timed_dvc(["repro"], clone, _env(clone))
    workspace_spans = _stage_spans(clone).get(None, {})
    _run(["git", "add", "-A"], clone)
    _run(["git", "commit", "-qm", "workspace run"], clone)
    store_before = _shard_bytes(clone).get(str(clone / ".expman"), 0)
    names = [f"lr-{n}" for n in range(1, len(rates) + 1)]
    for name, rate in zip(names, rates, strict=True):
        _dvc(clone, "exp", "run", "--queue", "-S", f"train.lr={rate}", "-n", name)
    sweep_seconds, written = _run_queue(clone, names, jobs)
    written[str(clone / ".expman")] = written.get(str(clone / ".expman"), 0) - store_before
    features_written = sum(written.values())
    status = _dvc(clone, "queue", "status")
    tasks = _worker_tasks(clone)
    spans = _stage_spans(clone)
    queue_share = (sweep_seconds - sum(task.get("seconds", 0.0) for task in tasks)) / len(names)
    budget = GOAL * sum(stage_seconds.get(stage, 0.0) for stage in DOWNSTREAM)
    span_budget = sum(workspace_spans.get(stage, 0.0) for stage in DOWNSTREAM)
    experiments = {}
    for name, task in zip(names, tasks, strict=False):  # the queue runs experiments in the order they were queued
        ran = RUNNING_STAGE.findall(_dvc(clone, "queue", "logs", name))
        row = next((row for row in status.splitlines() if f" {name} " in f" {row} "), "")
        seconds = task.get("seconds", float("nan"))
        cost = seconds + queue_share if jobs == 1 else seconds
        experiments[name] = {
            "worker_seconds": seconds,
            "queue_share_seconds": queue_share if jobs == 1 else None,
            "seconds": cost,
            "ratio_to_workspace_stages": cost / (budget / GOAL),
            "ratio_to_workspace_stage_spans": cost / span_budget if span_budget else None,
            "stage_spans": spans.get(name, {}),
            "stages_run": ran,
            "succeeded": "Success" in row,
            "within_goal": cost <= budget and not set(ran) & set(GRAPH[:5]) and features_written == 0,
        }
    return {
        "commit": sha,
        "workspace_repro_seconds": repro_seconds,
        "workspace_stage_seconds": stage_seconds,
        "workspace_stage_spans": workspace_spans,
        "goal_seconds_per_experiment": budget,
        "jobs": jobs,
        "sweep_seconds": sweep_seconds,
        "experiments": experiments,
        "feature_bytes_written_during_sweep": features_written,
        "feature_bytes_by_place": {k.removeprefix(str(clone) + "/"): v for k, v in written.items() if v},
    }


@click.command()
@click.option("--rev", "revs", multiple=True, default=["HEAD"], show_default=True, help="commits to sweep at")
@click.option("--lr", "rates", multiple=True, default=["1e-4", "1e-3"], show_default=True, help="one point each")
@click.option("--jobs", default=1, show_default=True, help="dvc queue start -j (1: per-experiment costs)")
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
