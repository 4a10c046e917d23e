"""The project's root from any of its workspaces: DVC runs queued and temporary experiments in a copy under
``<project>/.dvc/tmp/exps/``, and what must outlive that copy (MLflow store, feature store) resolves to the project."""

from pathlib import Path

from expman.data.features import FeatureStore
from expman.project import project_root
from expman.registry.tracking import default_tracking_uri


def test_a_dvc_temporary_workspace_resolves_to_its_project(tmp_path: Path, monkeypatch) -> None:
    project = tmp_path / "project"
    workspace = project / ".dvc/tmp/exps/tmpab12cd"
    workspace.mkdir(parents=True)
    assert project_root(workspace) == project.resolve()
    assert project_root(project) == project.resolve()
    assert project_root(tmp_path / "elsewhere/.dvc/tmp") == (tmp_path / "elsewhere/.dvc/tmp").resolve()
    monkeypatch.chdir(workspace)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("EXPMAN_FEATURE_STORE", raising=False)
    assert default_tracking_uri() == f"sqlite:///{project.resolve() / 'mlflow.db'}"
    assert FeatureStore.default().root == project.resolve() / ".expman/features"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("EXPMAN_FEATURE_STORE", str(tmp_path / "team-store"))
    assert default_tracking_uri() == "http://127.0.0.1:5000"
    assert FeatureStore.default().root == (tmp_path / "team-store").resolve()
