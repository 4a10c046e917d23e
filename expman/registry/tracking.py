"""The only module that talks to MLflow: one run per stage, tagged so the UI shows the chain of runs, and the
model registry (versions, tags, aliases).

Tracking URI: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<project>/mlflow.db`` (never ``./mlruns``);
artifacts of the default store go to ``<project>/mlartifacts``. Each run carries the git sha, the stage, the
DVC experiment name, the dvc.lock digest, and per upstream stage its manifest digest and run id; its
description links to those runs, so a user can walk from any run to the runs that produced its inputs. The
experiment is tagged as model training, so the UI opens it on the runs table, not the GenAI overview.
Runs and registry live in the same store: expman passes the tracking URI as the registry URI too.

Writes (stage runs, register, promote, import) go through the mlflow client. Reads for ``expman compare`` and
``expman runs`` go through ``open_registry()``, which does not import mlflow: ``import mlflow`` alone takes
about 2 s, ten times what those commands need. It reads MLflow's own tables (sqlite, postgresql, mysql) or the
REST API of an ``mlflow server``; see ``RegistryReader``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from expman.errors import ExpmanError
from expman.provenance import atomic_write_json, git_sha, provenance, sha256_file

__all__ = [
    "DRAFTER_ARTIFACT",
    "RegistryReader",
    "RunRecord",
    "StageRun",
    "VersionRecord",
    "default_tracking_uri",
    "download_version",
    "lineage_tags",
    "open_registry",
    "register_version",
    "serve_ui",
    "set_alias",
    "set_version_description",
    "set_version_tags",
    "stage_run",
]

DRAFTER_ARTIFACT = "drafter"  # the run artifact folder a registered version points at
WRITE_ATTEMPTS = 8
CONTENDED = (  # how a write that lost a race to another writer fails, on sqlite and postgresql
    "database is locked",
    "UNIQUE constraint failed",
    "duplicate key value violates unique constraint",
    "0 were matched",  # an update whose row another writer deleted in between
)
T = TypeVar("T")

MAX_PARAM_LENGTH = 6000
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
"""The experiment tag MLflow's UI reads to open an experiment on its runs table ("Model training") instead of the
GenAI overview."""

# MLflow's usage telemetry is off unless the user turns it on: expman sends nothing unasked, and offline the
# telemetry thread edits os.environ while requests reads it (a KeyError crashed a registrant in test_team).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def default_tracking_uri(root: Path | None = None) -> str:
    """The URI expman uses: the environment's, else the project's sqlite file. Credentials in an http(s) URI
    (``http://user:password@host``) first move to MLflow's own variables, see ``_move_credentials``."""
    root = (root or Path.cwd()).resolve()
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{root / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = _move_credentials(uri)
    return os.environ["MLFLOW_TRACKING_URI"]


def _move_credentials(uri: str) -> str:
    """``uri`` without the ``user:password@`` of an http(s) URI; the pair goes to ``MLFLOW_TRACKING_USERNAME`` and
    ``MLFLOW_TRACKING_PASSWORD`` (unless those are set), from where MLflow's client and the REST reader send it as
    basic auth, as they would from the URI. MLflow prints the tracking URI (a run's link when the run ends) and puts
    it in its error messages, so a URI that names a password would show it there."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https") or "@" not in parts.netloc:
        return uri
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(parts.username or ""))
    os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(parts.password or ""))
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


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
        self._sender: Any = None  # the thread that sends metrics, started on first use, and its client
        self._client: Any = None
        self._sent: list[Any] = []

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
        """Queue ``metrics`` for one background thread that sends them in order, so a training loop never waits on
        the tracking store; ``flush`` (at the end of the stage run) waits for them and raises what failed."""
        from concurrent.futures import ThreadPoolExecutor

        from mlflow import MlflowClient
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        batch = [Metric(k, float(v), timestamp, step or 0) for k, v in metrics.items()]
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="mlflow-metrics")
            self._client = MlflowClient()
        self._sent.append(self._sender.submit(self._client.log_batch, self.run_id, metrics=batch))

    def flush(self) -> None:
        """Wait until every queued metric is stored; re-raise the first failure."""
        sent, self._sent = self._sent, []
        for future in sent:
            future.result()
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as the image ``artifact_file`` (e.g. ``figures/evaluate.png``) of this run."""
        import mlflow

        mlflow.log_figure(figure, artifact_file)


def _project_store(uri: str, root: Path) -> bool:
    return uri == f"sqlite:///{root / 'mlflow.db'}"


def _experiment_id(client: Any, name: str, uri: str, root: Path) -> str:
    """The experiment's id, created on first use; when another process created it in between, that one is used.
    It carries ``KIND_TAG``: an existing experiment without it gets it, one of another kind keeps its own."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = (root / "mlartifacts").as_uri() if _project_store(uri, root) else None
        try:
            return _retry_contended(
                lambda: client.create_experiment(name, artifact_location=location, tags={KIND_TAG: KIND})
            )
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        experiment = client.get_experiment_by_name(name)
    if KIND_TAG not in experiment.tags:
        _retry_contended(lambda: client.set_experiment_tag(experiment.experiment_id, KIND_TAG, KIND))
    return experiment.experiment_id


def _run_link(client: Any, run_id: str) -> str:
    try:
        info = client.get_run(run_id).info
    except Exception:  # an upstream run from another store: keep the id, drop the link
        return f"`{run_id}`"
    return f"[{info.run_name or run_id}](#/experiments/{info.experiment_id}/runs/{run_id})"


def lineage_tags(upstream: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """Per input stage, the digest of its manifest and the run that wrote it, as tags (runs and versions alike)."""
    tags = {}
    for name, entry in upstream.items():
        tags[f"expman.upstream.{name}.manifest_sha256"] = entry["manifest_sha256"]
        if entry.get("mlflow_run_id"):
            tags[f"expman.upstream.{name}.run_id"] = entry["mlflow_run_id"]
    return tags


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
    tags.update(lineage_tags(upstream))
    lines = [f"expman stage **{stage}**."]
    for name, entry in upstream.items():
        if entry.get("mlflow_run_id"):
            lines.append(f"- input from {name}: {_run_link(client, entry['mlflow_run_id'])}")
    tags["mlflow.note.content"] = "\n".join(lines)
    run_name = f"{os.environ['DVC_EXP_NAME']}/{stage}" if os.environ.get("DVC_EXP_NAME") else stage
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags) as run:
        mlflow.log_params(_flatten(params))
        handle = StageRun(run.info.run_id, stage, params, upstream)
        try:
            yield handle
        finally:
            handle.flush()


def serve_ui(host: str, port: int) -> None:
    """Become ``mlflow ui`` on the project's store (exec, so a signal to this pid reaches the server itself, and no
    parent is left to outlive it); MLflow's background job workers stay off unless the user turns them on."""
    import sys

    root = Path.cwd().resolve()
    uri = default_tracking_uri(root)
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri]
    if _project_store(uri, root):
        command += ["--default-artifact-root", (root / "mlartifacts").as_uri()]
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execv(sys.executable, [*command, "--host", host, "--port", str(port)])


# Registry writes: through the mlflow client.


def _client() -> Any:
    from mlflow import MlflowClient

    uri = default_tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _retry_contended(call: Callable[[], T]) -> T:
    """Run one registry write; when it lost a race with another writer, back off and run it again.

    Two races are retried. SQLite answers two transactions that both want to write with an immediate "database
    is locked" to one of them (MLflow's busy timeout does not cover that case); SQLite's remedy is to retry the
    transaction. And MLflow sets aliases and tags by merge (read, then insert or update): two writers inserting
    the same new row make one fail on the unique key, and a row deleted between the read and the update fails
    the update; run again, the merge sees the row as it now is."""
    for attempt in range(WRITE_ATTEMPTS - 1):
        try:
            return call()
        except Exception as err:  # MlflowException or a SQLAlchemy error, depending on where it hit
            lost_create = getattr(err, "error_code", None) == "RESOURCE_ALREADY_EXISTS"  # final; the caller decides
            if lost_create or not any(race in str(err) for race in CONTENDED):
                raise
            time.sleep(0.05 * 2**attempt * (1 + random.random()))
    return call()


def register_version(run: StageRun, folder: Path, name: str, tags: Mapping[str, str]) -> int:
    """Log ``folder`` as the run's artifact ``drafter`` and register it as a new version of ``name``; return it.

    The version's source is that artifact folder itself, not an MLflow Model: MLflow 3 registers any run
    artifact URI, and ``models:/<name>/<version>`` downloads give back exactly these files (no MLmodel file
    is needed or added), which is the folder an engine loads. Tags are written with the version, in one
    transaction."""
    from mlflow.exceptions import MlflowException

    client = _client()
    client.log_artifacts(run.run_id, str(folder), artifact_path=DRAFTER_ARTIFACT)
    source = f"{client.get_run(run.run_id).info.artifact_uri.rstrip('/')}/{DRAFTER_ARTIFACT}"
    try:
        _retry_contended(lambda: client.create_registered_model(name))
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = _retry_contended(lambda: client.create_model_version(name, source, run_id=run.run_id, tags=dict(tags)))
    return int(version.version)


def set_version_tags(name: str, version: int, tags: Mapping[str, str]) -> None:
    """Set string tags on one model version."""
    client = _client()
    for key, value in tags.items():
        _retry_contended(lambda key=key, value=value: client.set_model_version_tag(name, str(version), key, value))


def set_version_description(name: str, version: int, text: str) -> None:
    """The version's description, which the registry page renders as markdown."""
    client = _client()
    _retry_contended(lambda: client.update_model_version(name, str(version), description=text))


def set_alias(name: str, alias: str, version: int) -> None:
    """Point ``alias`` at ``version``: MLflow writes the one alias row in a single transaction, so readers see
    the old or the new version, never a mix; concurrent movers serialize and the last one wins."""
    client = _client()
    _retry_contended(lambda: client.set_registered_model_alias(name, alias, str(version)))


def download_version(name: str, version: int, dst: Path) -> Path:
    """Download the files of ``models:/<name>/<version>`` into ``dst`` (the registered folder as logged)."""
    import mlflow

    uri = default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst)))


# Registry reads: without mlflow.


@dataclass(frozen=True)
class VersionRecord:
    """One registered model version, its tags and the aliases that point at it."""

    name: str
    version: int
    run_id: str
    source: str
    created_ms: int
    tags: dict[str, str]
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class RunRecord:
    """One tracking run: identity, status, where its artifacts are, its tags and latest metrics."""

    run_id: str
    name: str
    status: str
    start_ms: int
    artifact_uri: str
    tags: dict[str, str]
    metrics: dict[str, float]


class RegistryReader(ABC):
    """Read-only view of the tracking store (runs, registered versions, aliases, run artifacts).

    It exists for speed: ``expman compare`` must answer in well under 2 s, and ``import mlflow`` alone takes about
    2 s. Over a database URI it reads MLflow's tables (``registered_models``, ``registered_model_aliases``,
    ``model_versions``, ``model_version_tags``, ``runs``, ``tags``, ``latest_metrics``) with SQLAlchemy Core,
    sqlite opened read-only; over ``http(s)`` it calls the REST API of ``mlflow server``. Versions that MLflow
    soft-deleted (stage ``Deleted_Internal``) are invisible, as in MLflow's own client. The workspace column of
    multi-workspace stores is not filtered on: expman uses the default workspace."""

    @abstractmethod
    def model_names(self, prefix: str) -> list[str]:
        """Registered model names starting with ``prefix``, sorted."""

    @abstractmethod
    def alias(self, name: str, alias: str) -> int | None:
        """The version ``alias`` points at, or None."""

    @abstractmethod
    def version(self, name: str, version: int) -> VersionRecord | None:
        """One version (None when it does not exist or was deleted)."""

    @abstractmethod
    def versions_of_run(self, run_id: str) -> list[VersionRecord]:
        """Versions registered from artifacts of ``run_id``."""

    @abstractmethod
    def recent_versions(self, limit: int) -> list[VersionRecord]:
        """The newest versions of every model."""

    @abstractmethod
    def run(self, run_id: str) -> RunRecord | None:
        """One run (None when it does not exist)."""

    @abstractmethod
    def recent_runs(self, limit: int) -> list[RunRecord]:
        """Active runs of every experiment, newest first."""

    @abstractmethod
    def artifact_text(self, run: RunRecord, path: str) -> str:
        """The text of the artifact at ``path`` of ``run``."""

    def artifact_json(self, run: RunRecord, path: str) -> Any:
        """A JSON artifact of ``run``, parsed; a missing or broken one is an error naming the run and path."""
        try:
            return json.loads(self.artifact_text(run, path))
        except json.JSONDecodeError:
            raise ExpmanError(f"run {run.run_id}: artifact {path} is not valid JSON") from None


def open_registry() -> RegistryReader:
    """The reader for the store expman uses (``MLFLOW_TRACKING_URI`` or the project's sqlite file)."""
    uri = default_tracking_uri()
    scheme = uri.partition(":")[0].partition("+")[0].lower()
    if scheme in ("http", "https"):
        return _RestReader(uri)
    if scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        return _SqlReader(uri)
    raise ExpmanError(
        f"MLFLOW_TRACKING_URI: a {scheme or 'file'} store is not supported; use sqlite, postgresql, mysql or an "
        "mlflow server"
    )


class _SqlReader(RegistryReader):
    """MLflow's tables through SQLAlchemy Core; the schema is MLflow's (store/db_migrations), read as is."""

    def __init__(self, uri: str):
        import sqlite3

        import sqlalchemy as sa

        url = sa.engine.make_url(uri)
        self.shown = url.render_as_string(hide_password=True)  # the store in error messages, password as ***
        if url.get_backend_name() == "sqlite":
            path = Path(url.database or "").resolve()
            if not path.is_file():
                raise ExpmanError(f"{path}: no MLflow store (run from the project root or set MLFLOW_TRACKING_URI)")
            read_only = f"{path.as_uri()}?mode=ro"
            self.engine = sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(read_only, uri=True))
        else:
            self.engine = sa.create_engine(url)
        self.sa = sa
        self.models = sa.table("registered_models", sa.column("name"))
        self.aliases = sa.table("registered_model_aliases", sa.column("name"), sa.column("alias"), sa.column("version"))
        self.versions = sa.table(
            "model_versions",
            *(sa.column(c) for c in ("name", "version", "run_id", "source", "creation_time", "current_stage")),
        )
        self.version_tags = sa.table(
            "model_version_tags", sa.column("name"), sa.column("version"), sa.column("key"), sa.column("value")
        )
        self.runs = sa.table(
            "runs",
            *(sa.column(c) for c in ("run_uuid", "name", "status", "start_time", "artifact_uri", "lifecycle_stage")),
        )
        self.run_tags = sa.table("tags", sa.column("run_uuid"), sa.column("key"), sa.column("value"))
        self.metrics = sa.table("latest_metrics", sa.column("run_uuid"), sa.column("key"), sa.column("value"))

    def _all(self, query: Any) -> list[Any]:
        try:
            with self.engine.connect() as connection:
                return list(connection.execute(query))
        except self.sa.exc.SQLAlchemyError as err:
            reason = str(err.orig if getattr(err, "orig", None) else err).splitlines()[0]
            raise ExpmanError(f"tracking store {self.shown}: cannot read MLflow's tables ({reason})") from None

    def model_names(self, prefix: str) -> list[str]:
        m = self.models.c
        return [r.name for r in self._all(self.sa.select(m.name).where(m.name.startswith(prefix)).order_by(m.name))]

    def alias(self, name: str, alias: str) -> int | None:
        a = self.aliases.c
        rows = self._all(self.sa.select(a.version).where(a.name == name, a.alias == alias))
        return int(rows[0].version) if rows else None

    def _versions(self, *conditions: Any, limit: int | None = None) -> list[VersionRecord]:
        v, t, a = self.versions.c, self.version_tags.c, self.aliases.c
        query = self.sa.select(self.versions).where(v.current_stage != "Deleted_Internal", *conditions)
        rows = self._all(query.order_by(v.creation_time.desc(), v.version.desc()).limit(limit))
        records = []
        for row in rows:
            tags = self._all(self.sa.select(t.key, t.value).where(t.name == row.name, t.version == row.version))
            aliases = self._all(self.sa.select(a.alias).where(a.name == row.name, a.version == row.version))
            records.append(
                VersionRecord(
                    name=row.name,
                    version=int(row.version),
                    run_id=row.run_id or "",
                    source=row.source or "",
                    created_ms=int(row.creation_time or 0),
                    tags={r.key: r.value for r in tags},
                    aliases=tuple(sorted(r.alias for r in aliases)),
                )
            )
        return records

    def version(self, name: str, version: int) -> VersionRecord | None:
        v = self.versions.c
        found = self._versions(v.name == name, v.version == version)
        return found[0] if found else None

    def versions_of_run(self, run_id: str) -> list[VersionRecord]:
        return self._versions(self.versions.c.run_id == run_id)

    def recent_versions(self, limit: int) -> list[VersionRecord]:
        return self._versions(limit=limit)

    def _runs(self, *conditions: Any, limit: int | None = None) -> list[RunRecord]:
        r, t, m = self.runs.c, self.run_tags.c, self.metrics.c
        rows = self._all(self.sa.select(self.runs).where(*conditions).order_by(r.start_time.desc()).limit(limit))
        ids = [row.run_uuid for row in rows]
        tags: dict[str, dict[str, str]] = {i: {} for i in ids}
        metrics: dict[str, dict[str, float]] = {i: {} for i in ids}
        if ids:
            for row in self._all(self.sa.select(t.run_uuid, t.key, t.value).where(t.run_uuid.in_(ids))):
                tags[row.run_uuid][row.key] = row.value
            for row in self._all(self.sa.select(m.run_uuid, m.key, m.value).where(m.run_uuid.in_(ids))):
                metrics[row.run_uuid][row.key] = float(row.value)
        return [
            RunRecord(
                run_id=row.run_uuid,
                name=row.name or "",
                status=row.status or "",
                start_ms=int(row.start_time or 0),
                artifact_uri=row.artifact_uri or "",
                tags=tags[row.run_uuid],
                metrics=metrics[row.run_uuid],
            )
            for row in rows
        ]

    def run(self, run_id: str) -> RunRecord | None:
        found = self._runs(self.runs.c.run_uuid == run_id)
        return found[0] if found else None

    def recent_runs(self, limit: int) -> list[RunRecord]:
        return self._runs(self.runs.c.lifecycle_stage == "active", limit=limit)

    def artifact_text(self, run: RunRecord, path: str) -> str:
        """Local artifact folders are read directly; other stores (s3, gs, ...) through mlflow's downloader."""
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        location = f"{run.artifact_uri.rstrip('/')}/{path}"
        parsed = urlparse(location)
        if parsed.scheme in ("", "file"):
            local = Path(url2pathname(parsed.path))
            if not local.is_file():
                raise ExpmanError(f"run {run.run_id}: artifact {path} not found ({local})")
            return local.read_text(encoding="utf-8")
        import tempfile

        import mlflow

        with tempfile.TemporaryDirectory() as tmp:
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=tmp)).read_text("utf-8")


class _RestReader(RegistryReader):
    """The REST API of ``mlflow server`` (``/api/2.0/mlflow/...``) through urllib; artifacts through the server's
    ``get-artifact`` route, which serves any artifact store the server can read. Credentials come from
    ``MLFLOW_TRACKING_TOKEN`` or ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, as for mlflow itself."""

    def __init__(self, uri: str):
        from urllib.parse import quote, urlsplit

        self.base = uri.rstrip("/")
        self.shown = self.base  # the server in error messages: the user it is sent, never the password
        self.headers = {"Content-Type": "application/json"}
        if os.environ.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
        elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
            user = os.environ["MLFLOW_TRACKING_USERNAME"]
            pair = f"{user}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}"
            self.headers["Authorization"] = f"Basic {base64.b64encode(pair.encode()).decode()}"
            parts = urlsplit(self.base)
            self.shown = parts._replace(netloc=f"{quote(user, safe='')}:***@{parts.netloc}").geturl()

    def _fetch(
        self, route: str, query: Mapping[str, Any], body: Any = None, missing: tuple[str, ...] = ()
    ) -> bytes | None:
        """The response body, or None when the server answers 404 / RESOURCE_DOES_NOT_EXIST or a ``missing`` code."""
        from urllib.error import HTTPError, URLError
        from urllib.parse import urlencode
        from urllib.request import Request, urlopen

        url = f"{self.base}/{route}" + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        try:
            with urlopen(Request(url, data=data, headers=self.headers), timeout=60) as response:
                return response.read()
        except HTTPError as err:
            try:
                payload = json.loads(err.read() or b"{}")
            except json.JSONDecodeError:
                payload = {}
            if err.code == 404 or payload.get("error_code") in ("RESOURCE_DOES_NOT_EXIST", *missing):
                return None
            message = str(payload.get("message", err.reason)).splitlines()[0]
            raise ExpmanError(f"tracking server {self.shown}: {route}: HTTP {err.code}: {message}") from None
        except URLError as err:
            raise ExpmanError(f"tracking server {self.shown}: unreachable ({err.reason})") from None

    def _api(self, endpoint: str, body: Any = None, missing: tuple[str, ...] = (), **query: Any) -> dict | None:
        raw = self._fetch(f"api/2.0/mlflow/{endpoint}", query, body, missing)
        return None if raw is None else json.loads(raw)

    @staticmethod
    def _version(entry: Mapping[str, Any]) -> VersionRecord:
        return VersionRecord(
            name=entry["name"],
            version=int(entry["version"]),
            run_id=entry.get("run_id", ""),
            source=entry.get("source", ""),
            created_ms=int(entry.get("creation_timestamp", 0)),
            tags={t["key"]: t.get("value", "") for t in entry.get("tags", [])},
            aliases=tuple(sorted(entry.get("aliases", []))),
        )

    @staticmethod
    def _run(entry: Mapping[str, Any]) -> RunRecord:
        info, data = entry["info"], entry.get("data", {})
        return RunRecord(
            run_id=info["run_id"],
            name=info.get("run_name", ""),
            status=info.get("status", ""),
            start_ms=int(info.get("start_time", 0)),
            artifact_uri=info.get("artifact_uri", ""),
            tags={t["key"]: t.get("value", "") for t in data.get("tags", [])},
            metrics={m["key"]: float(m["value"]) for m in data.get("metrics", [])},
        )

    def model_names(self, prefix: str) -> list[str]:
        found = self._api("registered-models/search", filter=f"name LIKE '{prefix}%'", max_results=1000) or {}
        return sorted(m["name"] for m in found.get("registered_models", []))

    def alias(self, name: str, alias: str) -> int | None:
        # an unknown alias is INVALID_PARAMETER_VALUE ("... alias x not found"), not RESOURCE_DOES_NOT_EXIST
        found = self._api("registered-models/alias", missing=("INVALID_PARAMETER_VALUE",), name=name, alias=alias)
        return int(found["model_version"]["version"]) if found else None

    def version(self, name: str, version: int) -> VersionRecord | None:
        found = self._api("model-versions/get", name=name, version=str(version))
        return self._version(found["model_version"]) if found else None

    def _search_versions(self, **query: Any) -> list[VersionRecord]:
        """Search results lack aliases, so each found version is read again with model-versions/get."""
        found = self._api("model-versions/search", **query) or {}
        versions = (self.version(v["name"], int(v["version"])) for v in found.get("model_versions", []))
        return [v for v in versions if v is not None]

    def versions_of_run(self, run_id: str) -> list[VersionRecord]:
        return self._search_versions(filter=f"run_id = '{run_id}'")

    def recent_versions(self, limit: int) -> list[VersionRecord]:
        return self._search_versions(max_results=limit, order_by="creation_timestamp DESC")

    def run(self, run_id: str) -> RunRecord | None:
        found = self._api("runs/get", run_id=run_id)
        return self._run(found["run"]) if found else None

    def recent_runs(self, limit: int) -> list[RunRecord]:
        experiments = (self._api("experiments/search", {"max_results": 1000}) or {}).get("experiments", [])
        if not experiments:
            return []
        body = {
            "experiment_ids": [e["experiment_id"] for e in experiments],
            "max_results": limit,
            "order_by": ["attributes.start_time DESC"],
        }
        return [self._run(r) for r in (self._api("runs/search", body) or {}).get("runs", [])]

    def artifact_text(self, run: RunRecord, path: str) -> str:
        raw = self._fetch("get-artifact", {"run_uuid": run.run_id, "path": path})
        if raw is None:
            raise ExpmanError(f"run {run.run_id}: artifact {path} not found")
        return raw.decode("utf-8")
