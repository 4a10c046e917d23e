"""The only module that talks to MLflow: one run per stage, tagged so the UI shows the chain of runs, and the
model registry's writes (versions, tags, aliases).

Tracking URI: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<project>/mlflow.db`` (never ``./mlruns``);
artifacts of the default store go to ``<project>/mlartifacts``. ``<project>`` is the project's main workspace
from every workspace of it (``expman.project``): a queued or temporary DVC experiment records into the same store
as ``dvc repro``, not into a copy deleted with its temporary folder. Each run carries the git sha, the stage, the
DVC experiment name, the dvc.lock digest, the digest of the manifest it wrote, and per upstream stage its
manifest digest and the run that wrote that manifest (found by the digest, from whichever workspace it ran in);
its description links to those runs, so a user can walk from any run to the runs that produced its inputs. The
experiment is tagged as model training, so the UI opens it on the runs table, not the GenAI overview.
Runs and registry live in the same store: expman passes the tracking URI as the registry URI too.

Reads for ``expman compare`` and ``expman runs`` do not come here: ``expman.registry.reader`` reads the same
store without importing mlflow.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from expman.project import project_root
from expman.provenance import atomic_write_json, git_sha, provenance, sha256_file

__all__ = [
    "DRAFTER_ARTIFACT",
    "StageRun",
    "default_tracking_uri",
    "download_artifact_text",
    "download_version",
    "lineage_of",
    "lineage_tags",
    "register_version",
    "run_of_manifest",
    "serve_ui",
    "set_alias",
    "set_version_description",
    "set_version_tags",
    "stage_run",
]

DRAFTER_ARTIFACT = "drafter"  # the run artifact folder a registered version points at
MANIFEST_TAG = "expman.manifest_sha256"  # on each stage run: the digest of the manifest it wrote
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
TABLE_VIEW = "expman"
"""The runs-table view ``expman ui`` points at (``#/experiments/<id>/runs?viewStateShareKey=expman``): a view state
MLflow's UI shares through the experiment tag ``VIEW_TAG`` (JSON), holding the columns to show: each run's stage,
its duration, and the τ and speedup the evaluate stage logs (``StageRun.show_columns``)."""
VIEW_TAG = "mlflow.sharedViewState." + TABLE_VIEW
BASE_COLUMNS = ("tags.`expman.stage`", "attributes.`Duration`")  # MLflow's column keys: <kind>.`<name>`

# MLflow's usage telemetry is off unless the user turns it on: expman sends nothing unasked, and offline the
# telemetry thread edits os.environ while requests reads it (a KeyError crashed a registrant in test_team).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def default_tracking_uri(root: Path | None = None) -> str:
    """The URI expman uses: the environment's, else the project's sqlite file. Credentials in an http(s) URI
    (``http://user:password@host``) first move to MLflow's own variables, see ``_move_credentials``."""
    root = project_root(root)
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

    def __init__(
        self, run_id: str, stage: str, params: Mapping[str, Any], upstream: Mapping[str, Any], runs: Mapping[str, str]
    ):
        self.run_id = run_id
        self.stage = stage
        self.params = params
        self.upstream = upstream
        self.upstream_runs = runs
        self._sender: Any = None  # the thread that sends metrics, started on first use, and its client
        self._client: Any = None
        self._sent: list[Any] = []

    def write_manifest(
        self, path: Path, facts: Mapping[str, Any], recorded: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write the stage's manifest.json atomically: the facts, the resolved params and the upstream digests,
        nothing that differs between two runs of the same content. The run gets the manifest, its digest (tag
        ``MANIFEST_TAG``) and ``provenance.json``: git sha, packages, argv, run ids, and ``recorded`` (facts of this
        run only, such as the registry version it made). Returns the manifest with that provenance under
        ``provenance``."""
        import mlflow

        manifest = {"stage": self.stage, **facts, "params": dict(self.params), "upstream": dict(self.upstream)}
        atomic_write_json(path, manifest)
        record = provenance(dict(self.upstream_runs), self.run_id) | dict(recorded or {})
        self.log_artifact(path)
        mlflow.log_dict(record, "provenance.json")
        mlflow.set_tag(MANIFEST_TAG, sha256_file(path))
        return manifest | {"provenance": record}

    def show_columns(self, metrics: Sequence[str]) -> None:
        """Add ``metrics`` to the columns of the runs table ``expman ui`` opens (``TABLE_VIEW``)."""
        from mlflow import MlflowClient

        client = MlflowClient()
        experiment_id = client.get_run(self.run_id).info.experiment_id

        def merge() -> None:
            view = json.loads(client.get_experiment(experiment_id).tags.get(VIEW_TAG) or "{}")
            columns = view.get("selectedColumns") or list(BASE_COLUMNS)
            columns += [key for key in (f"metrics.`{name}`" for name in metrics) if key not in columns]
            client.set_experiment_tag(experiment_id, VIEW_TAG, json.dumps({**view, "selectedColumns": columns}))

        _retry_contended(merge)

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
    It carries ``KIND_TAG`` and the runs-table view ``VIEW_TAG``: an existing experiment without them gets them,
    one of another kind keeps its own."""
    from mlflow.exceptions import MlflowException

    tags = {KIND_TAG: KIND, VIEW_TAG: json.dumps({"selectedColumns": list(BASE_COLUMNS)})}
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = (root / "mlartifacts").as_uri() if _project_store(uri, root) else None
        try:
            return _retry_contended(lambda: client.create_experiment(name, artifact_location=location, tags=tags))
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        experiment = client.get_experiment_by_name(name)
    for key, value in tags.items():
        if key not in experiment.tags:
            _retry_contended(
                lambda key=key, value=value: client.set_experiment_tag(experiment.experiment_id, key, value)
            )
    return experiment.experiment_id


def _run_link(client: Any, run_id: str) -> str:
    try:
        info = client.get_run(run_id).info
    except Exception:  # an upstream run from another store: keep the id, drop the link
        return f"`{run_id}`"
    return f"[{info.run_name or run_id}](#/experiments/{info.experiment_id}/runs/{run_id})"


def lineage_tags(upstream: Mapping[str, Mapping[str, str]], runs: Mapping[str, str]) -> dict[str, str]:
    """Per input stage, the digest of its manifest and the run that wrote it, as tags (runs and versions alike)."""
    tags = {}
    for name, entry in upstream.items():
        tags[f"expman.upstream.{name}.manifest_sha256"] = entry["manifest_sha256"]
        if runs.get(name):
            tags[f"expman.upstream.{name}.run_id"] = runs[name]
    return tags


def _run_of_digest(client: Any, stage: str, digest: str) -> str | None:
    """The latest finished run of ``stage`` that wrote a manifest with this digest, in this store."""
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`{MANIFEST_TAG}` = '{digest}' and tags.`expman.stage` = '{stage}'"
        " and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def upstream_runs(client: Any, upstream: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """Per input stage, the run that wrote the manifest the stage read (where this store has one)."""
    found = {}
    for name, entry in upstream.items():
        manifest = Path(entry["manifest"])
        stage = json.loads(manifest.read_text()).get("stage") if manifest.is_file() else None
        run_id = _run_of_digest(client, stage, entry["manifest_sha256"]) if stage else None
        if run_id:
            found[name] = run_id
    return found


def lineage_of(upstream: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """``lineage_tags`` of ``upstream``, its runs looked up in the project's store."""
    from mlflow import MlflowClient

    with _store(default_tracking_uri()):
        return lineage_tags(upstream, upstream_runs(MlflowClient(), upstream))


def run_of_manifest(path: Path) -> str | None:
    """The run that wrote the manifest at ``path`` (its stage and digest), in the project's store."""
    from mlflow import MlflowClient

    stage = json.loads(path.read_text()).get("stage")
    with _store(default_tracking_uri()):
        return _run_of_digest(MlflowClient(), stage, sha256_file(path))


@contextmanager
def _store(uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking and registry URIs set to ``uri`` for the block, then put back as they were.
    ``mlflow.set_tracking_uri`` also exports ``MLFLOW_TRACKING_URI`` (for subprocesses: the block's evaluate workers
    and torchrun ranks inherit it); left set, it would send a later stage in the same process, run from another
    project, to this project's store."""
    import mlflow

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])  # None unsets it
        mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)


@contextmanager
def stage_run(stage: str, params: Mapping[str, Any], upstream: Mapping[str, Mapping[str, str]]) -> Iterator[StageRun]:
    """Open the MLflow run of one stage execution; it ends FAILED if the stage raises."""
    import mlflow
    from mlflow import MlflowClient

    workspace = Path.cwd().resolve()
    root = project_root(workspace)
    uri = default_tracking_uri(root)
    with _store(uri):
        client = MlflowClient()
        experiment_id = _experiment_id(client, os.environ.get("MLFLOW_EXPERIMENT_NAME", "expman"), uri, root)
        runs = upstream_runs(client, upstream)
        sha = git_sha(workspace)
        tags = {"expman.stage": stage, "git.sha": sha, "mlflow.source.git.commit": sha}
        for env, tag in (("DVC_EXP_NAME", "dvc.exp_name"), ("DVC_EXP_BASELINE_REV", "dvc.baseline_rev")):
            if os.environ.get(env):
                tags[tag] = os.environ[env]
        if (workspace / "dvc.lock").is_file():
            tags["dvc.lock.sha256"] = sha256_file(workspace / "dvc.lock")
        tags.update(lineage_tags(upstream, runs))
        lines = [f"expman stage **{stage}**."]
        lines += [f"- input from {name}: {_run_link(client, run_id)}" for name, run_id in runs.items()]
        tags["mlflow.note.content"] = "\n".join(lines)
        run_name = f"{os.environ['DVC_EXP_NAME']}/{stage}" if os.environ.get("DVC_EXP_NAME") else stage
        with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags) as run:
            mlflow.log_params(_flatten(params))
            handle = StageRun(run.info.run_id, stage, params, upstream, runs)
            try:
                yield handle
            finally:
                handle.flush()


def _print_table_link(uri: str, host: str, port: int) -> None:
    """Where the stage runs' table is, with the stage, τ and speedup columns (``TABLE_VIEW``)."""
    from mlflow import MlflowClient

    experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name(
        os.environ.get("MLFLOW_EXPERIMENT_NAME", "expman")
    )
    if experiment is not None:
        link = f"http://{host}:{port}/#/experiments/{experiment.experiment_id}/runs?viewStateShareKey={TABLE_VIEW}"
        print(f"stage runs (stage, tau and speedup columns): {link}", flush=True)


def serve_ui(host: str, port: int) -> None:
    """Become ``mlflow ui`` on the project's store (exec, so a signal to this pid reaches the server itself, and no
    parent is left to outlive it); MLflow's background job workers stay off unless the user turns them on."""
    import sys

    root = project_root()
    uri = default_tracking_uri(root)
    _print_table_link(uri, host, port)
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

    with _store(default_tracking_uri()):
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst)))


def download_artifact_text(location: str) -> str:
    """The text of one artifact in a store only MLflow's downloaders read (s3, gs, ...)."""
    import tempfile

    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=tmp)).read_text("utf-8")
