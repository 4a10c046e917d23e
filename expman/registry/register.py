"""register: the trained drafter as a new version of the registered model, alias ``candidate``.

Refuses an evaluation of another drafter (the evaluated candidate's sha256 must equal the drafter's). The version
is tagged with its lineage (every upstream manifest's digest and run, the train run's inputs included), the
capture contract, the evaluation's tau / speedup / acceptance rate per k, the draft vocab's coverage and the
evaluate run, whose ``evaluation.json`` ``expman compare`` reads. Its description is that comparison against
@baseline (τ and speedup per k with 95 % CIs, the engine's numbers and the integration-fault verdict), and the
register run, the version's source, holds the figures of training, evaluation and benchmark, so the registry page
tells the story without the CLI. ``models/registered.json`` (the stage's DVC output) records the name, version and
``models:/`` URI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError
from expman.params import RegisterParams
from expman.paths import RegisterPaths
from expman.provenance import read_manifest, sha256_file, upstream_entry
from expman.registry.compare import compare, render_markdown, summary_metrics
from expman.registry.reader import open_registry
from expman.registry.tracking import StageRun, lineage_of, run_of_manifest, set_version_description, stage_run
from expman.registry.versions import INTEGRATION_FAULT_TAG, contract_tags, register_drafter, registered_model_name

__all__ = ["describe", "engine_tags", "register"]


def _read_evaluation(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ExpmanError(f"{path}: not found; run `dvc repro {path.parent.name}` first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ExpmanError(f"{path}: not valid JSON") from None


def engine_tags(benchmark: dict[str, Any]) -> dict[str, str]:
    """The candidate's engine numbers and integration-fault verdict as version tags (``expman promote`` refuses
    ``expman.integration_fault`` other than ``false``); a number the engine did not measure has no tag."""
    if benchmark.get("skipped"):
        return {"expman.engine": "none", INTEGRATION_FAULT_TAG: "not measured"}
    arm = benchmark["arms"]["candidate"]
    tags = {"expman.engine": benchmark.get("engine_version") or benchmark["engine"]}
    tags[INTEGRATION_FAULT_TAG] = "true" if arm["integration_fault"] else "false"
    for k, result in arm["k"].items():
        numbers = {**{x: result["engine"][x] for x in ("tau", "speedup")}, "tau_ratio": result["tau_ratio"]}
        tags |= {f"expman.engine.k{k}.{name}": f"{value:.6g}" for name, value in numbers.items() if value is not None}
    reasons = sorted({reason for result in arm["k"].values() for reason in result["reasons"]})
    if reasons:
        tags[INTEGRATION_FAULT_TAG + ".reasons"] = "; ".join(reasons)[:4000]
    return tags


def describe(model_name: str, version: int, tags: dict[str, str]) -> str:
    """The version's description: ``expman compare`` of it against @baseline, τ and speedup only, under the
    integration-fault verdict its ``tags`` carry."""
    engine, reasons = tags["expman.engine"], tags.get(INTEGRATION_FAULT_TAG + ".reasons")
    verdict = f"**Integration fault: {tags[INTEGRATION_FAULT_TAG]}**"
    if engine == "none":
        verdict += ": no engine ran (benchmark.engine: none)."
    else:
        verdict += f" in `{engine}`" + (f": {reasons}" if reasons else ".")
    report = compare(open_registry(), [str(version)], model_name)
    return "\n".join(
        [
            verdict,
            "",
            render_markdown(report, metrics=("tau", "speedup")),
            "",
            f"`expman compare {version}` adds acceptance per draft position. The source run's artifacts hold the "
            "figures: `figures/train.png` (training curves), `figures/evaluate.png` (τ and speedup per k, acceptance "
            "per draft position, τ per category) and, when an engine ran, `figures/benchmark.png`.",
        ]
    )


def _log_figures(run: StageRun, curves_dir: Path, evaluation: dict[str, Any], benchmark: dict[str, Any]) -> None:
    """The figures the train, evaluate and benchmark runs logged, drawn again from their outputs in this run."""
    from expman.plots import (
        BENCHMARK_FIGURE,
        EVALUATE_FIGURE,
        TRAIN_FIGURE,
        benchmark_figure,
        evaluation_figure,
        read_table,
        train_figure,
    )

    steps, heldout = (read_table(curves_dir / f"{name}.csv") for name in ("steps", "heldout"))
    run.log_figure(train_figure(steps, heldout, "train"), TRAIN_FIGURE)
    run.log_figure(evaluation_figure(evaluation), EVALUATE_FIGURE)
    figure = benchmark_figure(benchmark)
    if figure is not None:
        run.log_figure(figure, BENCHMARK_FIGURE)


def _check_inputs(where: RegisterPaths, manifests: dict[str, Any], evaluation: dict[str, Any]) -> str:
    """That the evaluation measured this drafter, and the benchmark this evaluation; the drafter's sha256."""
    evaluation_path = where.evaluate / "evaluation.json"
    sha = sha256_file(where.drafter / "model.safetensors")
    evaluated = ((evaluation.get("arms") or {}).get("candidate") or {}).get("sha256")
    if evaluated != sha:
        raise ExpmanError(
            f"{evaluation_path}: evaluates another drafter (candidate sha256 {evaluated}), not {where.drafter}; "
            "rerun `dvc repro evaluate`"
        )
    measured = manifests["benchmark"]["upstream"]["evaluate"]["manifest_sha256"]
    if measured != sha256_file(where.evaluate / "manifest.json"):
        raise ExpmanError(
            f"{where.benchmark / 'manifest.json'}: benchmarks another evaluation; rerun `dvc repro benchmark`"
        )
    return sha


def _version_tags(where: RegisterPaths, manifests: dict[str, Any], metrics: dict[str, float], benchmark: dict) -> dict:
    """Lineage, capture contract, evaluation metrics, the evaluate run and the engine verdict, as version tags."""
    evaluate_run = run_of_manifest(where.evaluate / "manifest.json")
    if not evaluate_run:
        raise ExpmanError(
            f"{where.evaluate / 'manifest.json'}: no MLflow run of the tracking store wrote it; compare could not find "
            "the results (rerun `dvc repro -f evaluate` against this store)"
        )
    return {
        **lineage_of(manifests["train"]["upstream"]),
        **contract_tags(manifests["train"]["contract"]),
        **{f"expman.metrics.{name}": f"{value:.6g}" for name, value in metrics.items()},
        "expman.evaluate.run_id": evaluate_run,
        **engine_tags(benchmark),
    }


def register(section: RegisterParams, where: RegisterPaths) -> dict[str, Any]:
    """Register ``where.drafter`` with the evaluation in ``where.evaluate``, the engine benchmark in
    ``where.benchmark`` and the training curves in ``where.train_plots``; write ``where.out``; return its content."""
    inputs = {
        "prepare": where.verifier,
        "vocab": where.vocab,
        "train": where.drafter,
        "evaluate": where.evaluate,
        "benchmark": where.benchmark,
    }
    manifests = {stage: read_manifest(folder / "manifest.json", stage) for stage, folder in inputs.items()}
    evaluation = _read_evaluation(where.evaluate / "evaluation.json")
    sha = _check_inputs(where, manifests, evaluation)
    benchmark = _read_evaluation(where.benchmark / "benchmark.json")
    model_name = registered_model_name(manifests["prepare"]) if section.model_name == "auto" else section.model_name
    metrics = summary_metrics(evaluation, str(where.evaluate / "evaluation.json"))
    coverage = manifests["vocab"]["metrics"]
    metrics["vocab_coverage"] = coverage.get("coverage_heldout", coverage["coverage_train"])
    tags = _version_tags(where, manifests, metrics, benchmark)
    upstream = {stage: upstream_entry(folder / "manifest.json") for stage, folder in inputs.items()}
    with stage_run("register", section.model_dump(), upstream) as run:
        _log_figures(run, where.train_plots, evaluation, benchmark)
        version = register_drafter(run, where.drafter, model_name, "candidate", tags)
        set_version_description(model_name, version, describe(model_name, version, tags))
        run.log_metrics(metrics)
        facts = {
            "model_name": model_name,
            "version": version,
            "uri": f"models:/{model_name}/{version}",
            "run_id": run.run_id,
            "drafter_sha256": sha,
        }
        return run.write_manifest(where.out, facts)
