"""Experiments the way DVC users run them, on the tiny verifier: queued sweeps run by `dvc queue start -j 2`,
`dvc exp run --temp`, experiments that change extract, a second clone sharing a DVC remote and the feature store,
and `expman features gc`. Nothing tracked is lost (the project's MLflow store gets every run), a sweep reruns only
what its params change, and features are found instead of computed again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expman.provenance import sha256_file
from tests.conftest import tiny_params
from tests.test_dvc import DVC, GRAPH, _run, make_dvc_project

UPSTREAM_OF_TRAIN = GRAPH[: GRAPH.index("train")]
QUEUE_TIMEOUT = 900


def _runs(project: Path) -> list:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    return mlflow.search_runs(search_all_experiments=True, output_format="list")


def _store(project: Path) -> dict[str, tuple[int, float]]:
    """Every file of the feature store: (size, mtime)."""
    root = project / ".expman/features"
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*") if p.is_file()}


def _sets(project: Path) -> set[str]:
    return {p.name for p in (project / ".expman/features").iterdir() if p.is_dir()}


def _expman(project: Path, *args: str) -> subprocess.CompletedProcess:
    return _run([str(Path(sys.executable).parent / "expman"), *args], project)


def _wait_for_queue(project: Path) -> None:
    """`dvc queue start` returns at once; the workers run the experiments in the background."""
    deadline = time.monotonic() + QUEUE_TIMEOUT
    while time.monotonic() < deadline:
        status = _run([*DVC, "queue", "status"], project).stdout
        if not any(state in status for state in ("Queued", "Running")):
            assert "Failed" not in status, status + _run([*DVC, "queue", "logs", "lr-1"], project).stdout
            return
        time.sleep(5)
    raise AssertionError(f"the queue did not finish in {QUEUE_TIMEOUT} s")


@pytest.fixture(scope="module")
def repro(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_source: Path) -> Path:
    """The tiny project after `dvc repro`, committed with its lock, metrics and extract manifest."""
    params = tiny_params("tiny-verifier")
    params["train"].update(finetune_from="models/baseline", lr=3e-4)  # as in the shipped params.yaml
    params["evaluate"]["max_new_tokens"] = 10
    project = make_dvc_project(tmp_path_factory.mktemp("experiments") / "project", params, train=8, heldout=3)
    shutil.copytree(tiny_verifier_source, project / "tiny-verifier")
    _run(["git", "add", "-A"], project)
    _run(["git", "commit", "-qm", "the verifier"], project)
    first = _run([*DVC, "repro"], project)
    assert all(f"Running stage '{stage}'" in first.stdout for stage in GRAPH)
    _run(["git", "add", "-A"], project)
    _run(["git", "commit", "-qm", "first repro"], project)
    assert _run(["git", "status", "--porcelain"], project).stdout == ""
    return project


@pytest.mark.integration
def test_a_queued_sweep_reruns_train_onward_and_loses_no_run(repro: Path) -> None:
    project = repro
    before = _runs(project)
    store = _store(project)
    versions = _registered_versions(project)
    for n, lr in enumerate(("1e-3", "2e-3"), start=1):
        _run([*DVC, "exp", "run", "--queue", "-S", f"train.lr={lr}", "-n", f"lr-{n}"], project)
    _run([*DVC, "queue", "start", "-j", "2"], project)
    _wait_for_queue(project)

    new = [r for r in _runs(project) if r.info.run_id not in {b.info.run_id for b in before}]
    for name in ("lr-1", "lr-2"):
        stages = sorted(r.data.tags["expman.stage"] for r in new if r.data.tags.get("dvc.exp_name") == name)
        assert stages == sorted(["train", "evaluate", "benchmark", "register"]), (name, stages)
    assert len(new) == 8, [(r.data.tags.get("dvc.exp_name"), r.data.tags["expman.stage"]) for r in new]
    assert all(r.info.status == "FINISHED" for r in new)
    trains = [r for r in new if r.data.tags["expman.stage"] == "train"]
    assert {r.data.params["lr"] for r in trains} == {"0.001", "0.002"}
    assert all(r.data.tags.get("expman.upstream.extract.run_id") for r in trains), "lineage to the workspace's runs"
    registered = _registered_versions(project) - versions
    assert len(registered) == 2, "each experiment's drafter is a registered version of the project's store"
    assert _store(project) == store, "no feature shard written"

    shown = json.loads(_run([*DVC, "exp", "show", "--json"], project).stdout)
    taus = {
        exp["name"]: exp["data"]["metrics"]["metrics/evaluate.json"]["data"]
        for commit in shown
        for exp in (commit.get("experiments") or [])
        for exp in exp["revs"]
    }
    assert {"lr-1", "lr-2"} <= set(taus) and all(taus[n] for n in ("lr-1", "lr-2"))
    _run([*DVC, "exp", "apply", "lr-1"], project)
    assert "up to date" in _run([*DVC, "status"], project).stdout
    _run(["git", "checkout", "--", "."], project)  # back to the commit's outputs
    _run([*DVC, "checkout", "--force"], project)


def _registered_versions(project: Path) -> set[str]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    return {f"{v.name}/{v.version}" for v in client.search_model_versions()}


@pytest.mark.integration
def test_a_temporary_experiment_on_evaluate_reruns_evaluate_onward(repro: Path) -> None:
    before = {r.info.run_id for r in _runs(repro)}
    done = _run([*DVC, "exp", "run", "--temp", "-S", "evaluate.max_new_tokens=8", "-n", "short-eval"], repro)
    rerun = ("evaluate", "benchmark", "register")
    for stage in GRAPH:
        assert (f"Running stage '{stage}'" in done.stdout) == (stage in rerun), stage
    new = [r for r in _runs(repro) if r.info.run_id not in before]
    assert sorted(r.data.tags["expman.stage"] for r in new) == sorted(rerun)
    assert {r.data.tags.get("dvc.exp_name") for r in new} == {"short-eval"}


@pytest.mark.integration
def test_an_extract_experiment_computes_its_features_once(repro: Path) -> None:
    """A new extract setting gets a new key, computed by the first experiment and read by the second; gc keeps every
    set a commit or experiment names and removes the set no longer named."""
    before_sets = _sets(repro)
    first = _run([*DVC, "exp", "run", "--temp", "-S", "extract.samples_per_shard=2", "-n", "short-1"], repro)
    assert "Running stage 'extract'" in first.stdout and "Running stage 'generate'" not in first.stdout
    added = _sets(repro) - before_sets
    assert len(added) == 1, added
    key = added.pop()
    written = _store(repro)
    _run([*DVC, "exp", "run", "--temp", "-S", "extract.samples_per_shard=2", "-n", "short-2"], repro)
    assert _store(repro) == written, "the second experiment reads the published set, it writes nothing"
    extracts = [r for r in _runs(repro) if r.data.tags["expman.stage"] == "extract"]
    computed = [r for r in extracts if "features_computed_tokens" in r.data.metrics]
    assert len(computed) == 2, "the workspace's repro and the first experiment computed; the second read"

    listed = json.loads(_expman(repro, "features", "--json").stdout)["sets"]
    named = {s["key"]: s["referenced_by"] for s in listed}
    assert "workspace" in named[json.loads((repro / "data/extract/manifest.json").read_text())["features"]["key"]]
    assert {"exp short-1", "exp short-2"} <= set(named[key]), named
    orphan = repro / ".expman/features/0123456789abcdef0123456789abcdef"
    orphan.mkdir()
    (orphan / "set.json").write_text(json.dumps({"key": orphan.name, "shards": [], "tokens": 0}))
    dry = _expman(repro, "features", "gc").stdout
    assert f"would remove {orphan.name}" in dry and key not in dry and orphan.exists()
    _run([*DVC, "exp", "remove", "short-1", "short-2"], repro)
    removed = _expman(repro, "features", "gc", "--yes").stdout
    assert f"removed {orphan.name}" in removed and f"removed {key}" in removed
    assert _sets(repro) == before_sets, "every set a commit names is kept"


@pytest.mark.integration
def test_a_second_clone_sharing_the_remote_and_the_store_runs_nothing_upstream_of_train(
    repro: Path, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    _run([*DVC, "remote", "add", "--local", "-d", "shared", str(remote)], repro)
    _run([*DVC, "push"], repro)
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(repro), str(clone)], tmp_path)
    shutil.copy(repro / ".dvc/config.local", clone / ".dvc/config.local")
    _run([*DVC, "pull"], clone)

    alone = subprocess.run([str(Path(sys.executable).parent / "expman"), "doctor"], cwd=clone, capture_output=True)
    assert alone.returncode == 1 and b"which the feature store" in alone.stdout, alone.stdout.decode()

    os.environ["EXPMAN_FEATURE_STORE"] = str(repro / ".expman/features")  # the team's store (conftest unsets it)
    status = _run([*DVC, "status"], clone).stdout
    assert "up to date" in status, status
    again = _run([*DVC, "repro"], clone)
    assert "Running stage" not in again.stdout, again.stdout
    forced = _run([*DVC, "repro", "--force", "--single-item", "train"], clone)
    assert not any(f"Running stage '{stage}'" in forced.stdout for stage in UPSTREAM_OF_TRAIN)
    assert "Running stage 'train'" in forced.stdout
    assert sha256_file(clone / "data/extract/manifest.json") == sha256_file(repro / "data/extract/manifest.json")


DEPENDED_ON = (  # every DVC-tracked output another stage depends on (dvc.yaml), up to train
    "models/verifier/manifest.json",
    "data/generated/manifest.json",
    "data/extract/manifest.json",
    "data/vocab/manifest.json",
    "data/vocab/vocab.safetensors",
    "models/baseline",
    "models/drafter",
)


def _digests(project: Path) -> dict[str, str]:
    found = {}
    for name in DEPENDED_ON:
        path = project / name
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                found[str(file.relative_to(project))] = sha256_file(file)
    return found


@pytest.mark.integration
def test_outputs_other_stages_depend_on_hash_by_content(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage run twice from nothing, under other run ids, another commit, a dirty tree and an experiment name:
    every file another stage depends on has the same bytes (so DVC reruns nothing below an unchanged stage)."""
    monkeypatch.delenv("GIT_CEILING_DIRECTORIES")
    repo = Path(__file__).resolve().parents[1]

    def run_stages() -> dict[str, str]:
        for stage in UPSTREAM_OF_TRAIN + ("train",):
            subprocess.run([sys.executable, str(repo / f"stages/{stage}.py")], check=True, capture_output=True)
        return _digests(project)

    _run(["git", "init", "-q"], project)
    _run(["git", "add", "params.yaml", "prompts"], project)
    _run(["git", "commit", "-qm", "one"], project)
    first = run_stages()
    assert len(first) > 10 and "data/extract/manifest.json" in first
    for name in ("models", "data", ".expman", "metrics", "plots"):
        shutil.rmtree(project / name, ignore_errors=True)
    (project / "notes.txt").write_text("another commit\n")
    _run(["git", "add", "notes.txt"], project)
    _run(["git", "commit", "-qm", "two"], project)
    (project / "notes.txt").write_text("and a dirty tree\n")
    monkeypatch.setenv("DVC_EXP_NAME", "another-experiment")
    second = run_stages()
    changed = sorted(name for name in first.keys() | second.keys() if first.get(name) != second.get(name))
    assert not changed, f"differ between two runs of the same content: {changed}"
    runs = _runs(project)
    assert len({r.info.run_id for r in runs if r.data.tags["expman.stage"] == "train"}) == 2
