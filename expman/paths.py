"""Where each stage writes, relative to the project root; dvc.yaml declares the same paths (a test checks)."""

from pathlib import Path

__all__ = ["DRAFTER", "EXTRACT", "GENERATED", "TRAIN_METRICS", "TRAIN_STATE", "VERIFIER", "VOCAB"]

VERIFIER = Path("models/verifier")  # prepare: HF safetensors folder + manifest.json
GENERATED = Path("data/generated")  # generate: <split>/shard-*.jsonl + manifest.json
EXTRACT = Path("data/extract")  # extract: manifest.json (the shards go to extract.shard_dir)
VOCAB = Path("data/vocab")  # vocab: vocab.safetensors + metrics.json + manifest.json
DRAFTER = Path("models/drafter")  # train: speculators-format checkpoint + manifest.json
TRAIN_STATE = Path("models/.train-state")  # train: resume state (model, optimizer, scheduler, data position, RNG)
TRAIN_METRICS = Path("metrics/train.json")  # train: held-out per-step accuracy and simulated tau
