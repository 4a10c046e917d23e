"""Read-only access to the tracking store without importing mlflow: runs, registered versions, aliases and run
artifacts for ``expman compare``, ``expman runs``, promote and doctor.

``import mlflow`` alone takes about 2 s, ten times what those commands need. ``open_registry()`` reads MLflow's
own tables (sqlite, postgresql, mysql) with SQLAlchemy Core, or the REST API of an ``mlflow server``; see
``RegistryReader``. Writes go through ``expman.registry.tracking``.
"""

from __future__ import annotations

import base64
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.registry.tracking import default_tracking_uri

__all__ = ["RegistryReader", "RunRecord", "VersionRecord", "open_registry"]


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
        from expman.registry.tracking import download_artifact_text

        return download_artifact_text(location)


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
