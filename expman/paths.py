"""Where each stage writes, relative to the project root; dvc.yaml declares the same paths (a test checks).

Each stage function takes one ``<Stage>Paths`` object for its inputs and outputs; ``default()`` is the project's
layout below, which the stage scripts pass (tests and benchmarks point fields elsewhere with ``dataclasses.replace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BASELINE",
    "BASELINE_METRICS",
    "BASELINE_STATE",
    "BENCHMARK",
    "BENCHMARK_METRICS",
    "BenchmarkPaths",
    "DRAFTER",
    "EVALUATE",
    "EVALUATE_METRICS",
    "EVALUATE_PLOTS",
    "EVALUATE_STATE",
    "EXTRACT",
    "EvaluatePaths",
    "ExtractPaths",
    "GENERATED",
    "GENERATE_STATE",
    "GeneratePaths",
    "REGISTERED",
    "RegisterPaths",
    "TRAIN_METRICS",
    "TRAIN_PLOTS",
    "TRAIN_STATE",
    "TrainPaths",
    "VERIFIER",
    "VOCAB",
    "VocabPaths",
]

VERIFIER = Path("models/verifier")  # prepare: HF safetensors folder + manifest.json
GENERATED = Path("data/generated")  # generate: <split>/shard-*.jsonl + manifest.json
GENERATE_STATE = Path("data/.generate-state")  # generate: its finished shards, where DVC never deletes them
EXTRACT = Path("data/extract")  # extract: manifest.json (the shards go to the feature store, expman.data.features)
VOCAB = Path("data/vocab")  # vocab: vocab.safetensors + metrics.json + manifest.json
BASELINE = Path("models/baseline")  # baseline: speculators-format checkpoint + manifest.json
BASELINE_STATE = Path("models/.baseline-state")  # baseline: resume state when it is trained
BASELINE_METRICS = Path("metrics/baseline.json")  # baseline: held-out per-step accuracy when it is trained
DRAFTER = Path("models/drafter")  # train: speculators-format checkpoint + manifest.json
TRAIN_STATE = Path("models/.train-state")  # train: resume state (model, optimizer, scheduler, data position, RNG)
TRAIN_METRICS = Path("metrics/train.json")  # train: held-out per-step accuracy and simulated tau
TRAIN_PLOTS = Path("plots/train")  # train: steps.csv (each logging window) + heldout.csv (each epoch), for dvc plots
EVALUATE = Path("data/evaluate")  # evaluate: evaluation.json (per-prompt results + summary) + manifest.json
EVALUATE_METRICS = Path("metrics/evaluate.json")  # evaluate: τ, acceptance, speedup per arm and k
EVALUATE_PLOTS = Path("plots/evaluate")  # evaluate: tau, speedup, per_position, by_category CSVs, for dvc plots
EVALUATE_STATE = Path("data/.evaluate-state")  # evaluate: the rows of the prompts decoded so far, for a resumed run
REGISTERED = Path("models/registered.json")  # register: the registered model name, version and models:/ URI
BENCHMARK = Path("data/benchmark")  # benchmark: benchmark.json (engine vs reference numbers, verdicts) + manifest
BENCHMARK_METRICS = Path("metrics/benchmark.json")  # benchmark: engine τ and speedup, integration_fault per arm


@dataclass(frozen=True)
class GeneratePaths:
    """generate: the prepared verifier in, the response shards out. Shards are written into ``state`` and linked
    into ``out``: ``dvc exp run`` deletes an output its lock does not describe (after a kill, or a lost lock) before
    the stage runs, and the state is what a resumed run reuses."""

    verifier: Path
    out: Path
    state: Path

    @classmethod
    def default(cls) -> GeneratePaths:
        return cls(VERIFIER, GENERATED, GENERATE_STATE)


@dataclass(frozen=True)
class ExtractPaths:
    """extract: the verifier and its responses in, the shard manifest's folder out."""

    verifier: Path
    generated: Path
    out: Path

    @classmethod
    def default(cls) -> ExtractPaths:
        return cls(VERIFIER, GENERATED, EXTRACT)


@dataclass(frozen=True)
class VocabPaths:
    """vocab: the responses in, the draft vocabulary out."""

    generated: Path
    out: Path

    @classmethod
    def default(cls) -> VocabPaths:
        return cls(GENERATED, VOCAB)


@dataclass(frozen=True)
class TrainPaths:
    """train (and a trained baseline): verifier, features and vocab in; the checkpoint, its resume state, the
    held-out metrics and, when given, the plot tables out."""

    verifier: Path
    extract: Path
    vocab: Path
    out: Path
    state: Path
    metrics: Path
    plots: Path | None
    generated: Path = GENERATED
    """The responses online features are computed from (``train.features: online``)."""

    @classmethod
    def default(cls) -> TrainPaths:
        return cls(VERIFIER, EXTRACT, VOCAB, DRAFTER, TRAIN_STATE, TRAIN_METRICS, TRAIN_PLOTS)

    @classmethod
    def baseline(cls) -> TrainPaths:
        """The baseline stage's: the same inputs, its own outputs, no plot tables."""
        return cls(VERIFIER, EXTRACT, VOCAB, BASELINE, BASELINE_STATE, BASELINE_METRICS, None)


@dataclass(frozen=True)
class EvaluatePaths:
    """evaluate: the verifier, the held-out responses and the candidate drafter in (the baseline drafter is a
    param); the evaluation, its metrics and plot tables out. ``state`` keeps each decoded prompt's row until the
    stage finishes, so a killed run decodes only the prompts it had not reached."""

    verifier: Path
    generated: Path
    drafter: Path
    out: Path
    metrics: Path
    plots: Path
    state: Path

    @classmethod
    def default(cls) -> EvaluatePaths:
        return cls(VERIFIER, GENERATED, DRAFTER, EVALUATE, EVALUATE_METRICS, EVALUATE_PLOTS, EVALUATE_STATE)


@dataclass(frozen=True)
class BenchmarkPaths:
    """benchmark: the verifier, the held-out responses and the evaluation (its drafters and reference numbers)
    in; the engine's numbers and their metrics out."""

    verifier: Path
    generated: Path
    evaluate: Path
    out: Path
    metrics: Path

    @classmethod
    def default(cls) -> BenchmarkPaths:
        return cls(VERIFIER, GENERATED, EVALUATE, BENCHMARK, BENCHMARK_METRICS)


@dataclass(frozen=True)
class RegisterPaths:
    """register: the drafter, its evaluation, benchmark, verifier, vocab and training curves in; the pointer to the
    registered version out."""

    drafter: Path
    evaluate: Path
    benchmark: Path
    verifier: Path
    vocab: Path
    train_plots: Path
    out: Path

    @classmethod
    def default(cls) -> RegisterPaths:
        return cls(DRAFTER, EVALUATE, BENCHMARK, VERIFIER, VOCAB, TRAIN_PLOTS, REGISTERED)
