"""Where each stage writes, relative to the project root; dvc.yaml declares the same paths (a test checks)."""

from pathlib import Path

__all__ = ["EXTRACT", "GENERATED", "VERIFIER", "VOCAB"]

VERIFIER = Path("models/verifier")  # prepare: HF safetensors folder + manifest.json
GENERATED = Path("data/generated")  # generate: <split>/shard-*.jsonl + manifest.json
EXTRACT = Path("data/extract")  # extract: manifest.json (the shards go to extract.shard_dir)
VOCAB = Path("data/vocab")  # vocab: vocab.safetensors + metrics.json + manifest.json
