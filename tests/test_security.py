"""Security: the MLflow UI that expman starts listens on loopback unless told otherwise (SGLang's launch command is
checked in test_sglang), and credentials in the tracking URI (``http://user:password@host``,
``postgresql://user:password@host/db``) reach no param, tag, registry entry, manifest, stored row or command
output, while the commands still work with them."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from expman.cli import main
from expman.provenance import sha256_file
from tests.registry_fixtures import _empty_store, add_version, synthetic_evaluation, tiny_checkpoint, use_store
from tests.servers import free_port, mlflow_server, postgres, stop_group

pytestmark = pytest.mark.integration

MODEL = "eagle3-tiny"


@pytest.fixture(autouse=True)
def _environment() -> Iterator[None]:
    """expman moves URI credentials into MLflow's variables; the next test gets the environment as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port}


def test_ui_listens_on_loopback_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``expman ui`` started for real. uvicorn binds before its workers load the app, so the check needs no answer
    from the UI."""
    use_store(tmp_path, monkeypatch)
    port = free_port()
    expman = Path(sys.executable).parent / "expman"
    with (tmp_path / "ui.log").open("wb") as log:
        ui = subprocess.Popen([expman, "ui", "--port", str(port)], stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (listening := _listening(port)):
            assert ui.poll() is None and time.monotonic() < deadline, (tmp_path / "ui.log").read_text()[-3000:]
            time.sleep(0.2)
        assert listening == {"127.0.0.1"}
        # expman ui execs into the MLflow server: a signal to the pid a user started reaches the server itself
        assert psutil.Process(ui.pid).cmdline()[1:4] == ["-m", "mlflow", "ui"]
    finally:
        stop_group(ui)


def test_ui_binds_the_host_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    launched = []
    monkeypatch.setattr(os, "execv", lambda _path, command: launched.append(command))
    assert CliRunner().invoke(main, ["ui", "--host", "0.0.0.0", "--port", "5001"]).exit_code == 0
    assert launched[0][-4:] == ["--host", "0.0.0.0", "--port", "5001"]


def _use_the_store(project: Path) -> list[str]:
    """What a team member does, through MLFLOW_TRACKING_URI: run a stage, register an evaluated drafter, import
    one, promote, compare, list and export; returns the commands' outputs."""
    from expman import paths
    from expman.data.verifier import prepare
    from expman.params import load_params

    prepare(load_params("params.yaml"), paths.VERIFIER)
    drafter = tiny_checkpoint(project / "drafter")
    evaluation = synthetic_evaluation({"candidate": (sha256_file(drafter / "model.safetensors"), 0.6)})
    add_version(MODEL, drafter, evaluation, "candidate")
    commands = [
        ["import", str(drafter), "--name", MODEL],
        ["promote", MODEL, "@candidate", "--force", "--reason", "security test"],
        ["compare", "--model", MODEL],
        ["runs"],
        ["export", "@champion", "--model", MODEL, "--format", "eagle", "--out", str(project / "exported")],
    ]
    outputs = []
    for command in commands:
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output
        outputs.append(result.output)
    return outputs


def _mlflow_records(uri: str) -> Iterator[tuple[str, str]]:
    """(where, text) of every param, tag, artifact location and version source MLflow's client returns."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiments = client.search_experiments()
    for experiment in experiments:
        yield f"experiment {experiment.name}", experiment.artifact_location
    for run in client.search_runs([e.experiment_id for e in experiments], max_results=1000):
        yield f"run {run.info.run_id} artifact_uri", run.info.artifact_uri
        for key, value in {**run.data.params, **run.data.tags}.items():
            yield f"run {run.info.run_id} {key}", value
    for model in client.search_registered_models():
        for key, value in model.tags.items():
            yield f"model {model.name} {key}", value
        for version in client.search_model_versions(f"name = '{model.name}'"):
            where = f"{model.name} v{version.version}"
            yield f"{where} source", version.source
            for key, value in client.get_model_version(model.name, version.version).tags.items():
                yield f"{where} {key}", value


def _stored_rows(uri: str) -> Iterator[tuple[str, str]]:
    """(table, row) of every row in MLflow's database at ``uri``."""
    import sqlalchemy as sa

    engine = sa.create_engine(uri)
    tables = sa.MetaData()
    tables.reflect(engine)
    try:
        with engine.connect() as connection:
            for table in tables.sorted_tables:
                for row in connection.execute(sa.select(table)):
                    yield table.name, repr(tuple(row))
    finally:
        engine.dispose()


def _leaks(secret: str, uri: str, database: str, folders: list[Path], outputs: list[str]) -> list[str]:
    """Where ``secret`` shows: MLflow's records, rows of its database, files under ``folders``, command outputs."""
    found = [where for where, text in _mlflow_records(uri) if secret in (text or "")]
    found += [f"table {table}" for table, row in _stored_rows(database) if secret in row]
    files = [path for folder in folders for path in folder.rglob("*") if path.is_file()]
    found += [str(path) for path in files if secret.encode() in path.read_bytes()]
    return found + [f"output {i}" for i, output in enumerate(outputs) if secret in output]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A team server on sqlite (URL, its folder: the database, the artifacts and its log)."""
    folder = tmp_path_factory.mktemp("server")
    shutil.copyfile(_empty_store(), folder / "mlflow.db")
    with mlflow_server(f"sqlite:///{folder / 'mlflow.db'}", str(folder / "artifacts"), folder) as url:
        yield url, folder


def test_credentials_in_an_http_tracking_uri_show_nowhere(
    project: Path, server: tuple[str, Path], capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from expman.registry.reader import open_registry

    url, folder = server
    secret = f"pw-{secrets.token_hex(8)}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url.replace("http://", f"http://alice:{secret}@"))
    outputs = _use_the_store(project)
    assert os.environ["MLFLOW_TRACKING_URI"] == url  # the credentials moved to MLflow's own variables ...
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("alice", secret)
    basic = base64.b64encode(f"alice:{secret}".encode()).decode()
    assert open_registry().headers["Authorization"] == f"Basic {basic}"  # ... and are still sent
    printed = capfd.readouterr()  # where MLflow prints each run's link as the run ends
    database = f"sqlite:///{folder / 'mlflow.db'}"
    assert not _leaks(secret, url, database, [project, folder], [*outputs, printed.out, printed.err])


def test_an_unreachable_server_is_named_with_its_password_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"pw-{secrets.token_hex(8)}"
    port = free_port()  # nothing listens there
    monkeypatch.chdir(tmp_path)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{secret}@127.0.0.1:{port}")
    result = CliRunner().invoke(main, ["runs"])
    assert result.exit_code == 2 and secret not in result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: tracking server http://alice:***@127.0.0.1:{port}: unreachable ("), line
    assert "Connection refused" in line


def test_credentials_in_a_postgresql_uri_show_nowhere(
    project: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"pw-{secrets.token_hex(8)}"
    with postgres() as uri:  # trust authentication: any password is accepted, so this one is only carried
        store = uri.replace("expman@", f"expman:{secret}@")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
        outputs = _use_the_store(project)
        printed = capfd.readouterr()
        assert not _leaks(secret, store, store, [project], [*outputs, printed.out, printed.err])
