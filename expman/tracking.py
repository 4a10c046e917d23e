"""The only module that talks to MLflow: one run per stage, tagged so the UI shows the chain of runs.

Tracking URI: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<project>/mlflow.db`` (never ``./mlruns``);
artifacts of the default store go to ``<project>/mlartifacts``. Each run carries the git sha, the stage, the
DVC experiment name, the dvc.lock digest, and per upstream stage its manifest digest and run id; its
description links to those runs, so a user can walk from any run to the runs that produced its inputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from expman.provenance import atomic_write_json, git_sha, provenance, sha256_file

__all__ = ["StageRun", "default_tracking_uri", "serve_ui", "stage_run"]

MAX_PARAM_LENGTH = 6000


def default_tracking_uri(root: Path | None = None) -> str:
    """The URI expman uses: the environment's, else the project's sqlite file."""
    root = (root or Path.cwd()).resolve()
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[name] = text[:MAX_PARAM_LENGTH]
    return flat


class StageRun:
    """Handle on the active stage run: metrics, artifacts and the stage's manifest go through here."""

    def __init__(self, run_id: str, stage: str, params: Mapping[str, Any], upstream: Mapping[str, Any]):
        self.run_id = run_id
        self.stage = stage
        self.params = params
        self.upstream = upstream

    def write_manifest(self, path: Path, facts: Mapping[str, Any]) -> dict[str, Any]:
        """Write the stage's manifest.json (facts + provenance with this run's id) atomically; log it here too."""
        manifest = {
            "stage": self.stage,
            **facts,
            "provenance": provenance(dict(self.params), dict(self.upstream), self.run_id),
        }
        atomic_write_json(path, manifest)
        self.log_artifact(path)
        return manifest

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifact(str(path), artifact_path=artifact_path)


def _project_store(uri: str, root: Path) -> bool:
    return uri == f"sqlite:///{root / 'mlflow.db'}"


def _experiment_id(client: Any, name: str, uri: str, root: Path) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = (root / "mlartifacts").as_uri() if _project_store(uri, root) else None
    return client.create_experiment(name, artifact_location=location)


def _run_link(client: Any, run_id: str) -> str:
    try:
        info = client.get_run(run_id).info
    except Exception:  # an upstream run from another store: keep the id, drop the link
        return f"`{run_id}`"
    return f"[{info.run_name or run_id}](#/experiments/{info.experiment_id}/runs/{run_id})"


@contextmanager
def stage_run(stage: str, params: Mapping[str, Any], upstream: Mapping[str, Mapping[str, str]]) -> Iterator[StageRun]:
    """Open the MLflow run of one stage execution; it ends FAILED if the stage raises."""
    import mlflow
    from mlflow import MlflowClient

    root = Path.cwd().resolve()
    uri = default_tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient()
    experiment_id = _experiment_id(client, os.environ.get("MLFLOW_EXPERIMENT_NAME", "expman"), uri, root)
    sha = git_sha(root)
    tags = {"expman.stage": stage, "git.sha": sha, "mlflow.source.git.commit": sha}
    for env, tag in (("DVC_EXP_NAME", "dvc.exp_name"), ("DVC_EXP_BASELINE_REV", "dvc.baseline_rev")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    if (root / "dvc.lock").is_file():
        tags["dvc.lock.sha256"] = sha256_file(root / "dvc.lock")
    lines = [f"expman stage **{stage}**."]
    for name, entry in upstream.items():
        tags[f"expman.upstream.{name}.manifest_sha256"] = entry["manifest_sha256"]
        if entry.get("mlflow_run_id"):
            tags[f"expman.upstream.{name}.run_id"] = entry["mlflow_run_id"]
            lines.append(f"- input from {name}: {_run_link(client, entry['mlflow_run_id'])}")
    tags["mlflow.note.content"] = "\n".join(lines)
    run_name = f"{os.environ['DVC_EXP_NAME']}/{stage}" if os.environ.get("DVC_EXP_NAME") else stage
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags) as run:
        mlflow.log_params(_flatten(params))
        yield StageRun(run.info.run_id, stage, params, upstream)


def serve_ui(host: str, port: int) -> None:
    """Run ``mlflow ui`` on the project's store until interrupted."""
    import subprocess
    import sys

    root = Path.cwd().resolve()
    uri = default_tracking_uri(root)
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri]
    if _project_store(uri, root):
        command += ["--default-artifact-root", (root / "mlartifacts").as_uri()]
    subprocess.run([*command, "--host", host, "--port", str(port)], check=False)
