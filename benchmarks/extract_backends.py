"""The extract stage end to end with each backend on one project's responses: transformers hooks (``hf``) against
vLLM's own states (``vllm``), timed as the user runs them (the verifier or engine loaded, every shard computed,
written and hashed), and how far their states differ.

Run it in a project whose generate stage has run (the default graph after ``dvc repro``):

  python benchmarks/extract_backends.py --project . --out benchmarks/results/extract_backends_cpu.json

Each arm writes its shards into a fresh feature store, ``--work``/features (nothing of the project is touched;
each backend's set has its own key). The
verifier's load, and the engine's start (on CPU, with its graph compile), are inside each arm's time, as they are
in the stage.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import click
from harness import header, write_report


def _arm(project: Path, work: Path, backend: str) -> tuple[dict, float]:
    """One extract stage run with ``backend`` into fresh folders (its features into the store ``main`` emptied): its
    manifest and wall seconds."""
    from expman.data.extract import extract
    from expman.params import load_params
    from expman.paths import ExtractPaths

    params = load_params(project / "params.yaml")
    shutil.rmtree(work / backend, ignore_errors=True)
    section = params.extract.model_copy(update={"backend": backend})
    params = params.model_copy(update={"extract": section})
    started = time.perf_counter()
    manifest = extract(params, ExtractPaths(project / "models/verifier", project / "data/generated", work / backend))
    return manifest, time.perf_counter() - started


def _difference(hf: dict, vllm: dict) -> dict:
    """Per tensor: minimum per-token cosine and max |difference| / max |hf|; top-1 agreement."""
    import torch

    from expman.data.extract import load_shard

    def rows(manifest: dict, key: str):
        return torch.cat([load_shard(manifest, i)[key] for i in range(len(manifest["shards"]))])

    out = {}
    for key in ("aux_hidden_states", "final_hidden_states"):
        a, b = rows(hf, key).float(), rows(vllm, key).float()
        out[key] = {
            "min_cosine": torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item(),
            "max_abs_over_max": ((a - b).abs().max() / a.abs().max()).item(),
        }
    out["top1_agreement"] = (rows(hf, "verifier_top1") == rows(vllm, "verifier_top1")).float().mean().item()
    return out


@click.command()
@click.option("--project", type=click.Path(exists=True, file_okay=False, path_type=Path), default=Path("."))
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/extract-backends"))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(project: Path, work: Path, out: Path | None) -> None:
    """Time the extract stage with the hf and vllm backends on the same responses."""
    import os

    from expman.data.features import STORE_VARIABLE

    os.chdir(project)  # the stage's MLflow runs land in the project's own store
    project = Path(".")
    work.mkdir(parents=True, exist_ok=True)
    store = (work / "features").absolute()
    shutil.rmtree(store, ignore_errors=True)  # no published set to reuse: every arm computes its shards
    os.environ[STORE_VARIABLE] = str(store)
    arms, manifests = {}, {}
    for backend in ("hf", "vllm"):
        manifest, seconds = _arm(project, work, backend)
        tokens = manifest["totals"]["tokens"]
        arms[backend] = {"seconds": seconds, "tok_per_s": tokens / seconds, "engine": manifest["engine"]}
        arms[backend]["precision"] = manifest["precision"]  # what dtype auto resolved to on this machine
        manifests[backend] = manifest
    report = {
        **header("extract_backends", "cpu"),
        "tokens": manifests["hf"]["totals"]["tokens"],
        "samples": manifests["hf"]["totals"]["samples"],
        "shards": len(manifests["hf"]["shards"]),
        "arms": arms,
        "vllm_over_hf": arms["vllm"]["tok_per_s"] / arms["hf"]["tok_per_s"],
        "difference": _difference(manifests["hf"], manifests["vllm"]),
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
