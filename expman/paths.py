"""Where each stage writes, relative to the project root; dvc.yaml declares the same paths (a test checks)."""

from pathlib import Path

__all__ = [
    "BASELINE",
    "BASELINE_METRICS",
    "BASELINE_STATE",
    "BENCHMARK",
    "BENCHMARK_METRICS",
    "DRAFTER",
    "EVALUATE",
    "EVALUATE_METRICS",
    "EVALUATE_PLOTS",
    "EXTRACT",
    "GENERATED",
    "REGISTERED",
    "TRAIN_METRICS",
    "TRAIN_PLOTS",
    "TRAIN_STATE",
    "VERIFIER",
    "VOCAB",
]

VERIFIER = Path("models/verifier")  # prepare: HF safetensors folder + manifest.json
GENERATED = Path("data/generated")  # generate: <split>/shard-*.jsonl + manifest.json
EXTRACT = Path("data/extract")  # extract: manifest.json (the shards go to extract.shard_dir)
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
REGISTERED = Path("models/registered.json")  # register: the registered model name, version and models:/ URI
BENCHMARK = Path("data/benchmark")  # benchmark: benchmark.json (engine vs reference numbers, verdicts) + manifest
BENCHMARK_METRICS = Path("metrics/benchmark.json")  # benchmark: engine τ and speedup, integration_fault per arm
