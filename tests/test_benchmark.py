"""The benchmark stage and the integration-fault gate: a checkpoint whose config serves other aux layers than it
was trained on is flagged (statically and by the engine), the reference evaluator keeps feeding the trained
layers, `benchmark.engine: none` is recorded as not measured; the slow tier runs the default recipe through vLLM
on CPU, checks the engine's τ against the reference evaluator's and refuses to promote a shifted export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from expman import paths
from expman.data.generate import read_responses
from expman.errors import ExpmanError
from expman.evaluation.benchmark import benchmark, contract_mismatch
from expman.params import load_params
from expman.paths import BenchmarkPaths, EvaluatePaths, TrainPaths
from tests.test_dvc import REPO, _run, make_dvc_project


def _shift_served_layers(drafter: Path, by: int = 1) -> list[int]:
    """Rewrite the checkpoint's aux ids (what an engine reads), as a faulty export would; weights untouched."""
    config_path = drafter / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + by for i in config["eagle_aux_hidden_state_layer_ids"]]
    config_path.write_text(json.dumps(config))
    return config["eagle_aux_hidden_state_layer_ids"]


def _trained_project(project: Path) -> None:
    from expman.evaluation.evaluate import evaluate
    from expman.training.baseline import baseline
    from expman.training.train import train
    from tests.test_pipeline import run_until

    run_until("vocab")
    params = load_params("params.yaml")
    baseline(params, TrainPaths.baseline())
    train(params.train, TrainPaths.default())
    evaluate(params, EvaluatePaths.default())


def test_a_shifted_export_is_flagged_and_the_reference_keeps_the_trained_layers(project: Path) -> None:
    _trained_project(project)
    assert contract_mismatch(project / paths.DRAFTER) is None
    contract = json.loads((project / paths.DRAFTER / "manifest.json").read_text())["contract"]["aux_layers"]
    served = _shift_served_layers(project / paths.DRAFTER)
    reason = contract_mismatch(paths.DRAFTER)
    assert reason == f"{paths.DRAFTER}/config.json serves aux layers {served}, the drafter was trained on {contract}"

    from expman.evaluation.evaluate import evaluate

    evaluate(load_params("params.yaml"), EvaluatePaths.default())
    evaluation = json.loads((project / paths.EVALUATE / "evaluation.json").read_text())
    assert evaluation["arms"]["candidate"]["aux_layers"] == contract  # the reference measures the drafter itself


def _run_benchmark() -> dict:
    return benchmark(load_params("params.yaml"), BenchmarkPaths.default())


def test_engine_none_is_recorded_as_not_measured(project: Path) -> None:
    _trained_project(project)
    manifest = _run_benchmark()
    result = json.loads((project / paths.BENCHMARK / "benchmark.json").read_text())
    assert "engine is none" in result["skipped"] and result["arms"] == {}
    assert manifest["upstream"]["evaluate"]["manifest_sha256"]
    import mlflow

    run_id = manifest["provenance"]["mlflow_run_id"]
    assert not mlflow.MlflowClient().list_artifacts(run_id, "figures"), "no engine ran: nothing to draw"

    from expman.registry.register import engine_tags

    assert engine_tags(result) == {"expman.engine": "none", "expman.integration_fault": "not measured"}


def test_benchmark_ks_must_have_been_evaluated(project: Path) -> None:
    _trained_project(project)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["benchmark"]["ks"] = [2]
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ExpmanError, match=r"^benchmark.ks: \[2\] were not evaluated"):
        _run_benchmark()
    assert not (project / paths.BENCHMARK).exists()


def test_an_in_process_engine_leaves_vllm_s_environment_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU expman runs vLLM's engine core in this process; an engine started later elsewhere (a GPU's) must still
    start spawned, so the switch is undone and vLLM's frozen view of the environment thrown away."""
    pytest.importorskip("vllm")
    import vllm.envs

    from expman.engines.vllm import _engine_core_in_process

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with _engine_core_in_process():
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
        vllm.envs.enable_envs_cache()  # what an engine core started here does
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True


@pytest.fixture(scope="module")
def smollm2_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default recipe at a CI-sized scale, through evaluate: 64 train prompts, 8 held-out, k = 3."""
    pytest.importorskip("vllm")
    pytest.importorskip("gguf")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["generate"].update(max_new_tokens=96, batch_size=32, shard_size=32)
    params["baseline"]["train"].update(epochs=1)
    params["train"].update(epochs=3)
    params["evaluate"].update(ks=[3], max_prompts=8, max_new_tokens=48)
    project = make_dvc_project(tmp_path_factory.mktemp("smollm2-engine"), params, train=64, heldout=8)
    _run([sys.executable, "-m", "dvc", "repro", "evaluate"], project)
    return project


def _expman(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(["expman", *args], cwd=project, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_vllm_agrees_with_the_reference_evaluator_on_smollm2(smollm2_project: Path) -> None:
    project = smollm2_project
    _run([sys.executable, "-m", "dvc", "repro"], project)  # benchmark (vLLM CPU) and register
    result = json.loads((project / paths.BENCHMARK / "benchmark.json").read_text())
    assert result["engine_version"].startswith("vllm")
    for arm in ("baseline", "candidate"):
        measured = result["arms"][arm]["k"]["3"]
        engine, reference = measured["engine"], measured["reference"]
        assert measured["integration_fault"] is False, measured["reasons"]
        assert abs(engine["tau"] - reference["tau"]) <= 0.1 * reference["tau"], (arm, engine["tau"], reference["tau"])
        assert engine["outputs_equal_to_nospec"] >= 6  # of 8: batched greedy may flip near-ties
        parity = result["arms"][arm]["parity"]  # an honest export: no false alarm at any layer
        assert parity["checked"] and parity["reasons"] == [], parity
        assert min(parity["cosine_per_layer"].values()) > 0.999, parity
    compare = _expman(project, "compare", "@candidate", "--json")
    assert compare.returncode == 0, compare.stderr
    row = json.loads(compare.stdout)["rows"][0]
    assert row["engine"]["integration_fault"] == "false" and row["engine"]["tau"] > 1.0


@pytest.mark.slow
def test_parity_alone_flags_a_shifted_export_and_a_post_norm_final_state(smollm2_project: Path, tmp_path: Path) -> None:
    """The hidden-state parity check by itself (no aux-id contract check, no acceptance): ids shifted by one in the
    checkpoint, and features whose final state was the post-norm one, are each flagged at the layer concerned;
    the honest drafter beside them is not."""
    import shutil

    from expman.engines.factory import serving_engine
    from expman.evaluation.state_parity import served_state_parity

    project = smollm2_project
    arms = {name: tmp_path / name for name in ("honest", "shifted", "post_norm")}
    for folder in arms.values():
        shutil.copytree(project / paths.DRAFTER, folder)
    _shift_served_layers(arms["shifted"])
    manifest = json.loads((arms["post_norm"] / "manifest.json").read_text())
    manifest["contract"]["final_state"] = "post_norm"
    (arms["post_norm"] / "manifest.json").write_text(json.dumps(manifest))
    evaluation = json.loads((project / paths.EVALUATE / "evaluation.json").read_text())
    responses = {r["id"]: r for r in read_responses(project / paths.GENERATED, "heldout")}
    prompts = [
        responses[row["id"]]["input_ids"][: responses[row["id"]]["prompt_tokens"]] for row in evaluation["prompts"]
    ]
    engine = serving_engine("vllm")
    result = served_state_parity(engine, project / paths.VERIFIER, arms, prompts[:2], "cpu", "float32", False, 0.99)
    assert result["honest"]["reasons"] == [], result["honest"]
    assert len(result["shifted"]["reasons"]) == 3, result["shifted"]  # every aux layer, not the final state
    assert "states at aux id 3 (served by the checkpoint)" in result["shifted"]["reasons"][0]
    assert "trained features' layer 2" in result["shifted"]["reasons"][0]
    assert len(result["post_norm"]["reasons"]) == 1, result["post_norm"]
    assert "at id 30 (the last layer, before the final norm)" in result["post_norm"]["reasons"][0]
    assert "final state (post_norm)" in result["post_norm"]["reasons"][0]
    print(json.dumps({name: r["cosine_per_layer"] for name, r in result.items()}))


@pytest.mark.slow
def test_a_shifted_export_is_an_integration_fault_and_cannot_be_promoted(smollm2_project: Path) -> None:
    project = smollm2_project
    _shift_served_layers(project / paths.DRAFTER)
    _run([sys.executable, "-m", "dvc", "repro", "--single-item", "benchmark"], project)
    _run([sys.executable, "-m", "dvc", "repro", "--single-item", "register"], project)
    result = json.loads((project / paths.BENCHMARK / "benchmark.json").read_text())
    candidate = result["arms"]["candidate"]
    assert candidate["integration_fault"] is True
    assert "serves aux layers [3, 16, 28], the drafter was trained on [2, 15, 27]" in candidate["static_fault"]
    assert any("states at aux id 3" in reason for reason in candidate["k"]["3"]["reasons"]), candidate["k"]["3"]
    registered = json.loads((project / paths.REGISTERED).read_text())
    refused = _expman(project, "promote", registered["model_name"], str(registered["version"]), "--alias", "champion")
    assert refused.returncode != 0
    assert "integration_fault: measured true" in refused.stderr, refused.stderr
