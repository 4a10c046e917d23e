"""Team mode: one ``mlflow server`` (on PostgreSQL with S3-compatible artifacts, then on the sqlite default with an
artifact folder) and 8 team members, each in its own process, registering versions of one model and moving its
aliases at the same time through expman's own registry code: ``register_drafter`` as the register stage calls it,
``promote`` as ``expman promote --force`` calls it.

Checked on each setup: no version is lost (numbers 1..N, each handed to exactly one writer), each alias points at
the version of a move that succeeded and that no later move overwrote, every promoted version carries its audit
tags, expman's mlflow-free readers (REST and SQL) see exactly what MLflow's client sees, and the files went to the
artifact store and come back as registered."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from expman.provenance import sha256_file
from expman.registry.compare import EVALUATE_RUN_TAG
from expman.registry.versions import DRAFTER_SHA_TAG
from tests.registry_fixtures import _empty_store, log_evaluation, synthetic_evaluation, tiny_checkpoint
from tests.servers import TELEMETRY_OFF, mlflow_server, postgres, s3_bucket, s3_client

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
MODEL = "eagle3-team"
MEMBERS = 8
ROUNDS = 3
VERSIONS = MEMBERS * ROUNDS
AUDIT = "expman.promote.champion."


@dataclass(frozen=True)
class Team:
    """A server the members worked on, and every alias move a member saw succeed."""

    url: str  # what a team member sets MLFLOW_TRACKING_URI to
    backend: str  # the server's backend store
    artifacts: str  # the artifact store it proxies: s3://bucket/prefix or a folder
    store_env: dict[str, str]  # the S3 endpoint and credentials, which only the server has
    moves: list[dict[str, Any]]  # alias, version, start and end (wall clock), reason (promotions)


def member(index: int, drafter: str, evaluate_run: str, barrier: Any, out: Path) -> None:
    """One team member: once all are ready, ROUNDS times register ``drafter`` as a new version with alias
    ``candidate``, then force-promote that version to ``champion``; write the moves it saw succeed to ``out``."""
    from expman.params import PromoteParams
    from expman.registry.promote import promote
    from expman.registry.reader import open_registry
    from expman.registry.tracking import stage_run
    from expman.registry.versions import register_drafter

    barrier.wait()
    moves = []
    for round_ in range(ROUNDS):
        start = time.time()
        with stage_run("register", {"member": index, "round": round_}, {}) as run:
            version = register_drafter(run, Path(drafter), MODEL, "candidate", {EVALUATE_RUN_TAG: evaluate_run})
        moves.append({"alias": "candidate", "version": version, "start": start, "end": time.time()})
        reason, start = f"member {index} round {round_}", time.time()
        promote(open_registry(), MODEL, str(version), "champion", PromoteParams(), force=True, reason=reason)
        moves.append({"alias": "champion", "version": version, "reason": reason, "start": start, "end": time.time()})
    out.write_text(json.dumps(moves))


def members(drafter: str, evaluate_run: str, folder: str) -> None:
    """The members' parent process (MLFLOW_TRACKING_URI points at the server): import expman and MLflow once, fork
    MEMBERS processes and let them start together; exit non-zero if one failed. Forking after the imports saves
    each member the 5 s of importing transformers and MLflow, which on 2 cores would stagger their start."""
    import multiprocessing

    for module in ("mlflow", "expman.drafter.checkpoint", "expman.registry.promote", "expman.registry.versions"):
        importlib.import_module(module)
    context = multiprocessing.get_context("fork")  # no thread runs yet: nothing to inherit half-locked
    barrier = context.Barrier(MEMBERS)
    processes = [
        context.Process(target=member, args=(i, drafter, evaluate_run, barrier, Path(folder) / f"member-{i}.json"))
        for i in range(MEMBERS)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    sys.exit(max(p.exitcode for p in processes))


def _work_together(url: str, folder: Path) -> list[dict[str, Any]]:
    """Log one evaluation (its run in another experiment, so the members race to create ``expman``), run the members
    on the server and return their moves."""
    drafter = tiny_checkpoint(folder / "drafter")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_TRACKING_URI", url)
        patch.setenv("MLFLOW_EXPERIMENT_NAME", "evaluations")
        patch.setenv("GIT_CEILING_DIRECTORIES", str(folder.parent))
        evaluate_run = log_evaluation(
            synthetic_evaluation({"candidate": (sha256_file(drafter / "model.safetensors"), 0.6)})
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "PYTEST_"))}
    env.update(TELEMETRY_OFF, MLFLOW_TRACKING_URI=url, PYTHONPATH=str(REPO), GIT_CEILING_DIRECTORIES=str(folder.parent))
    code = f"from tests.test_team import members; members{(str(drafter), evaluate_run, str(folder))!r}"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"a member failed:\n{done.stderr[-6000:]}"
    return [move for i in range(MEMBERS) for move in json.loads((folder / f"member-{i}.json").read_text())]


@pytest.fixture(scope="module", params=["postgresql-s3", "sqlite-folder"])
def team(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    """One server per setup (its start-up is the slow part), the members' work done on it once: PostgreSQL with an
    S3-compatible artifact store (the README's team setup), and the sqlite default with an artifact folder."""
    folder = tmp_path_factory.mktemp(request.param)
    with ExitStack() as stack:
        if request.param == "postgresql-s3":
            backend = stack.enter_context(postgres())
            artifacts, store_env = stack.enter_context(s3_bucket(folder))
        else:  # a store with MLflow's schema in place, as a team's server finds it after its first start
            shutil.copyfile(_empty_store(), folder / "mlflow.db")
            backend, artifacts, store_env = f"sqlite:///{folder / 'mlflow.db'}", str(folder / "artifacts"), {}
        url = stack.enter_context(mlflow_server(backend, artifacts, folder, store_env))
        yield Team(url, backend, artifacts, store_env, _work_together(url, folder))


def _client(team: Team) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=team.url, registry_uri=team.url)


def test_no_version_is_lost(team: Team) -> None:
    client = _client(team)
    numbers = sorted(int(v.version) for v in client.search_model_versions(f"name = '{MODEL}'"))
    assert numbers == list(range(1, VERSIONS + 1))
    assert sorted(m["version"] for m in team.moves if m["alias"] == "candidate") == numbers  # one writer each
    for number in numbers:
        tags = client.get_model_version(MODEL, str(number)).tags
        assert {EVALUATE_RUN_TAG, DRAFTER_SHA_TAG, "git.sha"} <= tags.keys()
    experiment = client.get_experiment_by_name("expman")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # whichever member created it
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    assert len(runs) == VERSIONS and {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.parametrize("alias", ["candidate", "champion"])
def test_each_alias_points_at_the_last_move(team: Team, alias: str) -> None:
    """The alias holds the version of a move that succeeded and that no move begun after that one ended replaced."""
    moves = [m for m in team.moves if m["alias"] == alias]
    assert len(moves) == VERSIONS
    holder = int(_client(team).get_model_version_by_alias(MODEL, alias).version)
    (final,) = [m for m in moves if m["version"] == holder]
    assert not [m for m in moves if m["start"] > final["end"]], f"@{alias} -> v{holder}, yet later moves succeeded"


def test_every_promotion_left_its_audit_tags(team: Team) -> None:
    client = _client(team)
    promotions = [m for m in team.moves if m["alias"] == "champion"]
    for move in promotions:
        tags = client.get_model_version(MODEL, str(move["version"])).tags
        assert tags[AUDIT + "reason"] == move["reason"]
        assert tags[AUDIT + "forced"] == "true"  # no @baseline: the tau gate fails, --force overrode it
        assert "@" in tags[AUDIT + "by"] and datetime.fromisoformat(tags[AUDIT + "at"]).tzinfo is not None
        assert json.loads(tags[AUDIT + "gates"])["k"] == 3
    holder = int(client.get_model_version_by_alias(MODEL, "champion").version)
    assert client.get_model_version(MODEL, str(holder)).tags[AUDIT + "reason"] in {m["reason"] for m in promotions}


def test_expman_readers_see_what_mlflow_sees(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    from expman.registry.reader import VersionRecord, open_registry

    client = _client(team)
    expected = []
    for found in client.search_model_versions(f"name = '{MODEL}'"):
        version = client.get_model_version(MODEL, found.version)  # search results lack the aliases
        expected.append(
            VersionRecord(
                name=MODEL,
                version=int(version.version),
                run_id=version.run_id,
                source=version.source,
                created_ms=version.creation_timestamp,
                tags=version.tags,
                aliases=tuple(sorted(version.aliases)),
            )
        )
    holders = {
        alias: int(client.get_model_version_by_alias(MODEL, alias).version) for alias in ("candidate", "champion")
    }
    for uri in (team.url, team.backend):  # REST, then MLflow's tables read directly
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        reader = open_registry()
        assert reader.model_names("eagle3-") == [MODEL]
        assert {alias: reader.alias(MODEL, alias) for alias in holders} == holders
        assert reader.alias(MODEL, "baseline") is None
        assert sorted(reader.recent_versions(VERSIONS + 1), key=lambda v: v.version) == sorted(
            expected, key=lambda v: v.version
        )
        assert all(reader.version(MODEL, v.version) == v for v in expected)


def _stored_files(team: Team) -> list[str]:
    """The files in the server's artifact store."""
    if not team.artifacts.startswith("s3://"):
        return [str(path) for path in Path(team.artifacts).rglob("*") if path.is_file()]
    bucket, _, prefix = team.artifacts.removeprefix("s3://").partition("/")
    client = s3_client(team.store_env)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def test_registered_files_round_trip_through_the_artifact_store(
    team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each version's files went to the store the server proxies; a member downloads one as registered."""
    from expman.registry.tracking import download_version

    stored = _stored_files(team)
    assert len([f for f in stored if f.endswith("/drafter/model.safetensors")]) == VERSIONS
    assert len([f for f in stored if f.endswith("/drafter/eagle/model.safetensors")]) == VERSIONS
    monkeypatch.setenv("MLFLOW_TRACKING_URI", team.url)
    holder = _client(team).get_model_version_by_alias(MODEL, "champion")
    folder = download_version(MODEL, int(holder.version), tmp_path / "download")
    assert sha256_file(folder / "model.safetensors") == holder.tags[DRAFTER_SHA_TAG]
