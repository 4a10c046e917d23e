"""vocab: the draft vocabulary, chosen by frequency of assistant (loss-masked) tokens in the train responses.

Outputs follow the speculators/EAGLE-3 convention: ``d2t`` (int64 [D], offsets, target id = i + d2t[i]) and
``t2d`` (bool [V], true where a target id is in the draft vocab). Ties in frequency go to the lower id, so the
choice is deterministic. Coverage (share of assistant tokens inside the draft vocab) is reported on train and
held-out responses: held-out coverage caps the acceptance a drafter can reach on unseen prompts.
"""

from __future__ import annotations

import math
from typing import Any

from expman.data.generate import read_responses
from expman.errors import ExpmanError
from expman.params import Params
from expman.paths import VocabPaths
from expman.provenance import atomic_write, atomic_write_json, read_manifest, upstream_entry
from expman.registry.tracking import stage_run

__all__ = ["build_vocab", "draft_vocab_size", "token_counts", "vocab"]


def draft_vocab_size(setting: int | str, vocab_size: int) -> int:
    """Resolve ``vocab.draft_vocab_size``: auto = vocab // 6 rounded up to a multiple of 64."""
    size = math.ceil(vocab_size / 6 / 64) * 64 if setting == "auto" else int(setting)
    if size > vocab_size:
        raise ExpmanError(f"vocab.draft_vocab_size: {size} exceeds the verifier's vocab size {vocab_size}")
    return size


def token_counts(records: list[dict[str, Any]], vocab_size: int) -> Any:
    """Counts of assistant (generated) token ids over records, int64 [V]."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for record in records:
        response = torch.tensor(record["input_ids"][record["prompt_tokens"] :], dtype=torch.int64)
        counts += torch.bincount(response, minlength=vocab_size)
    return counts


def build_vocab(counts: Any, size: int) -> tuple[Any, Any]:
    """(d2t, t2d) for the ``size`` most frequent ids, ties to the lower id, draft ids in ascending target order."""
    import torch

    most_frequent = torch.sort(-counts, stable=True).indices[:size]  # stable: equal counts keep id order
    chosen = torch.sort(most_frequent).values
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(size, dtype=torch.int64), t2d


def _coverage(counts: Any, t2d: Any) -> float:
    total = int(counts.sum())
    return int(counts[t2d].sum()) / total if total else 0.0


def vocab(params: Params, where: VocabPaths) -> dict[str, Any]:
    """Write ``vocab.safetensors`` (d2t, t2d, train token counts), ``metrics.json`` and ``manifest.json``."""
    from safetensors.torch import save_file

    section = params.vocab
    generated_manifest = read_manifest(where.generated / "manifest.json", "generate")
    vocab_size = generated_manifest["verifier"]["vocab_size"]
    size = draft_vocab_size(section.draft_vocab_size, vocab_size)
    upstream = {"generate": upstream_entry(where.generated / "manifest.json")}
    train = token_counts(read_responses(where.generated, "train"), vocab_size)  # shards checked before the run opens
    heldout = None
    if "heldout" in generated_manifest["splits"]:
        heldout = token_counts(read_responses(where.generated, "heldout"), vocab_size)
    with stage_run("vocab", section.model_dump(), upstream) as run:
        d2t, t2d = build_vocab(train, size)
        metrics = {
            "draft_vocab_size": size,
            "distinct_train_tokens": int((train > 0).sum()),
            "coverage_train": _coverage(train, t2d),
        }
        if heldout is not None:
            metrics["coverage_heldout"] = _coverage(heldout, t2d)
        tensors = {"d2t": d2t, "t2d": t2d, "train_token_counts": train}
        atomic_write(where.out / "vocab.safetensors", lambda tmp: save_file(tensors, str(tmp)))
        atomic_write_json(where.out / "metrics.json", metrics)
        run.log_metrics(metrics)
        facts = {
            "draft_vocab_size": size,
            "target_vocab_size": vocab_size,
            "verifier": generated_manifest["verifier"],
            "metrics": metrics,
        }
        return run.write_manifest(where.out / "manifest.json", facts)
