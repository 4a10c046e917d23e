"""Builders for registry tests and benchmarks: evaluation.json in the evaluate stage's exact shape, tiny drafter
checkpoints, and a tracking store with evaluated, registered versions (made through expman's own functions)."""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from expman.devices import resolve_device, speedup_target

TARGET = speedup_target(resolve_device("auto"), "auto")
"""Where the synthetic evaluations say they were measured: this machine's default target (``promote.target: auto``)."""


@functools.cache
def _empty_store() -> Path:
    """An MLflow sqlite file with its schema in place: a new file costs 2 s of migrations, a copy 2 ms."""
    from mlflow import MlflowClient

    folder = Path(tempfile.mkdtemp(prefix="expman-test-store-"))
    atexit.register(shutil.rmtree, folder, True)
    MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
    return folder / "mlflow.db"


def use_store(root: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make ``root`` the cwd and its sqlite file (a fresh, empty MLflow store) the tracking store, set only through
    MLFLOW_TRACKING_URI."""
    shutil.copyfile(_empty_store(), root / "mlflow.db")
    monkeypatch.chdir(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for name in ("MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "DVC_EXP_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(root.parent))
    return uri


def arm_result(
    k: int, rounds: int, per_position: Sequence[int], tokens: int, seconds: float, matches_greedy: bool | None = True
) -> dict[str, Any]:
    """One arm's counters for one prompt at chain length k (``accepted`` and ``drafted`` follow)."""
    assert len(per_position) == k
    return {
        "rounds": rounds,
        "accepted": sum(per_position),
        "drafted": rounds * k,
        "accepted_per_position": list(per_position),
        "tokens": tokens,
        "seconds": seconds,
        "matches_greedy": matches_greedy,
    }


def evaluation(
    prompts: list[dict[str, Any]], ks: Sequence[int], arms: Mapping[str, str], target: str = TARGET
) -> dict[str, Any]:
    """evaluation.json: ``prompts`` are rows ``{"id", "category", "nospec", <arm>: {str(k): arm_result}}``;
    ``arms`` maps arm name to the sha256 of its model.safetensors."""
    return {
        "ks": list(ks),
        "max_new_tokens": 128,
        "temperature": 0.0,
        "device": "cpu",
        "target": target,
        "arms": {arm: {"path": f"models/{arm}", "sha256": sha} for arm, sha in arms.items()},
        "prompts": prompts,
        "summary": {},
    }


def _decode(rng: random.Random, k: int, quality: float, tokens: int) -> tuple[int, list[int]]:
    """Rounds and accepts per position of a greedy chain of k whose draft i is accepted with prob quality^(i+1)."""
    rounds, per_position, produced = 0, [0] * k, 0
    while produced < tokens:
        accepted = 0
        while accepted < k and rng.random() < quality:
            accepted += 1
        for i in range(accepted):
            per_position[i] += 1
        rounds += 1
        produced += accepted + 1
    return rounds, per_position


def synthetic_evaluation(
    arms: Mapping[str, tuple[str, float]],
    prompts: int = 16,
    ks: Sequence[int] = (1, 2, 3),
    seed: int = 0,
    ids: Sequence[str] | None = None,
    target: str = TARGET,
) -> dict[str, Any]:
    """A plausible evaluation measured on ``target``: ``arms`` maps arm name to (sha256, per-draft acceptance
    quality); a round costs one verifier forward (20 ms) plus 3 ms per drafted token, so a weak drafter is slower
    than no speculation. Its summary is the evaluate stage's own."""
    from expman.evaluation.decoder import summarize

    rng = random.Random(seed)
    rows = []
    for index in range(prompts):
        tokens = rng.randint(60, 128)
        noise = rng.uniform(0.95, 1.05)
        row: dict[str, Any] = {
            "id": ids[index] if ids else f"heldout-{index:04d}",
            "category": ("coding", "math", "writing", "reasoning")[index % 4],
            "nospec": {"tokens": tokens, "seconds": tokens * 0.02 * noise},
        }
        for arm, (_, quality) in arms.items():
            row[arm] = {}
            for k in ks:
                rounds, per_position = _decode(rng, k, quality, tokens)
                seconds = rounds * (0.02 + 0.003 * k) * noise
                row[arm][str(k)] = arm_result(k, rounds, per_position, tokens, seconds)
        rows.append(row)
    result = evaluation(rows, ks, {arm: sha for arm, (sha, _) in arms.items()}, target)
    return result | {"summary": summarize(rows, list(arms), list(ks))}


def tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A valid speculators checkpoint of the tiny test drafter; ``seed`` shifts its weights (another sha256)."""
    import torch

    from expman.drafter.checkpoint import save_speculators
    from tests.test_checkpoint import _vocab
    from tests.test_drafter import _drafter

    model = _drafter()
    _vocab(model)
    with torch.no_grad():
        model.fc.weight.add_(seed)
    save_speculators(model, folder, "tiny-verifier", ["LlamaForCausalLM"], speculative_tokens=3)
    return folder


def log_evaluation(result: Mapping[str, Any], manifest: Path | None = None) -> str:
    """An evaluate-stage run holding ``result`` as its ``evaluation.json`` artifact; returns the run id. Given a
    ``manifest`` path, the run writes the stage's manifest there, as the evaluate stage does."""
    from expman.registry.tracking import stage_run

    with tempfile.TemporaryDirectory() as tmp, stage_run("evaluate", {}, {}) as run:
        path = Path(tmp) / "evaluation.json"
        path.write_text(json.dumps(result))
        run.log_artifact(path)
        if manifest is not None:
            run.write_manifest(manifest, {})
        return run.run_id


def add_version(
    name: str,
    drafter_dir: Path,
    result: Mapping[str, Any] | None = None,
    alias: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> int:
    """Register ``drafter_dir`` (tagged with the run of its evaluation ``result``, when given); returns the version."""
    from expman.registry.tracking import stage_run
    from expman.registry.versions import register_drafter

    version_tags = dict(tags or {})
    if result is not None:
        version_tags["expman.evaluate.run_id"] = log_evaluation(result)
    with stage_run("register", {}, {}) as run:
        return register_drafter(run, drafter_dir, name, alias, version_tags)
