"""Scaling of the train *stage* over the GPUs of one host, as a user runs it: ``python stages/train.py`` with
``train.gpus: N`` (the stage starts itself under torchrun; DDP, or FSDP with ``train.fsdp``) against the same stage
on one GPU with ``train.accumulate: N``, the same global batch and so the same updates.

Every arm runs the stage's real loop in a project laid out as the graph lays it out (params.yaml, models/verifier,
data/extract, data/vocab, MLflow on the project's sqlite file), over feature shards written to disk by extract's
own writer at a harness shape (``train_stage_throughput.write_project``: random verifier states, no 8B or 1T
verifier here); the page cache is dropped before each arm, so each first epoch reads from the disk, and each arm
compiles into a cache of its own, as a first run does (a warm inductor cache halved a later arm's start). TTT noise is
off in every arm (``noise_std: 0``; a process draws its own noise), so the arms' loss curves may differ only by the
order in which gradients are summed and by bf16 rounding. Reported per shape and mode:

- ``stage_tok_s_1gpu``, ``stage_tok_s_{N}gpu``: the stage's training rate, the tokens of all its epochs over the
  epochs' seconds as the stage logs them (``epoch_tok_per_s``; the first step, which compiles, left out), and
  ``stage_tok_s_wall_*``, the same tokens over the whole command (start-up, compile, checkpoints, outputs);
- ``scaling_efficiency`` = N-GPU rate / (N x 1-GPU rate), and ``scaling_efficiency_wall``;
- ``loss_max_rel_diff``: the largest |N-GPU - 1-GPU| / |1-GPU| over the loss windows the stage logs (``train/loss``
  in MLflow, the mean of each ``log_every`` steps);
- ``peak_gib_per_gpu``: each process's peak CUDA memory, as the stage records it (manifest ``gpu_peak_gib``).

  python benchmarks/train_stage_scaling.py --gpus 2 --gib 12 --out benchmarks/results/train_stage_gpu_h200x2.json

On the CPU (``--cpu``: SmolLM2's shape, gloo processes) it checks the mechanics only: torchrun splits the host's
cores among its processes, so the rates say nothing about GPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
import yaml
from harness import SHAPES, header, write_report
from train_stage_throughput import drop_page_cache, shards_folder, write_project

from expman.data.features import STORE_VARIABLE
from expman.params import STAGE_SECTIONS
from expman.paths import TrainPaths
from expman.provenance import read_manifest
from expman.registry.tracking import run_of_manifest

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / "stages/train.py"
CONFIGS = {"cuda": (8192, 2048), "cpu": (1024, 256)}
"""Tokens per micro-batch and document length: the peer harness's on GPU, the default recipe's on the CPU."""


def write_params(root: Path, train: dict) -> None:
    """A params.yaml the stage accepts: every section at its defaults but ``train``."""
    (root / "data/prompts").mkdir(parents=True, exist_ok=True)
    (root / "data/prompts/train.jsonl").write_text('{"id": "bench-0", "prompt": "unused"}\n')
    params: dict = {name: {} for name in STAGE_SECTIONS}
    params["generate"] = {"datasets": [{"path": "data/prompts/train.jsonl", "split": "train"}]}
    params["train"] = train
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def run_arm(root: Path, train: dict) -> dict:
    """``python stages/train.py`` in ``root`` with ``train`` as its section, from a cold page cache and no resume
    state; the stage's own numbers, read back from its outputs and its MLflow run."""
    from mlflow import MlflowClient

    where = TrainPaths.default()
    for folder in (where.out, where.state, where.plots):
        shutil.rmtree(root / folder, ignore_errors=True)
    write_params(root, train)
    cache = drop_page_cache(shards_folder(root))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    env = os.environ | {"MLFLOW_TRACKING_URI": uri, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path[1:]])}
    env[STORE_VARIABLE] = str(root / "features")  # where write_project published the features
    compiled = Path(tempfile.mkdtemp(prefix="compile-cache-", dir=root))  # each arm compiles cold, as a first run
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(compiled / "inductor"), "TRITON_CACHE_DIR": str(compiled / "triton")}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(STAGE)], cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise click.ClickException(f"the train stage failed ({train}):\n{done.stderr[-3000:]}")
    manifest = read_manifest(root / where.out / "manifest.json", "train")
    run_id = _run_of(root / where.out / "manifest.json", uri)
    client = MlflowClient(uri)
    epochs = sorted(client.get_metric_history(run_id, "epoch_tok_per_s"), key=lambda m: m.step)
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    return {
        "train": train,
        "page_cache": cache,
        "command_seconds": seconds,
        "epoch_tok_s": [m.value for m in epochs],
        "steps": manifest["metrics"]["steps"],
        "loss_windows": losses,
        "peak_gib_per_gpu": manifest.get("gpu_peak_gib"),
        "mlflow_run_id": run_id,
    }


def _run_of(manifest: Path, uri: str) -> str:
    """The MLflow run (in the store at ``uri``) that wrote ``manifest``."""
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        run_id = run_of_manifest(manifest)
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved
    if run_id is None:
        raise click.ClickException(f"{manifest}: no run in {uri} wrote it")
    return run_id


def stage_rate(arm: dict) -> float:
    """Tokens of all epochs over the epochs' seconds: the harmonic mean of the logged epoch rates."""
    return len(arm["epoch_tok_s"]) / sum(1 / rate for rate in arm["epoch_tok_s"])


def compare(single: dict, many: dict, gpus: int, tokens: int) -> dict:
    """One mode against one GPU: rates, efficiency, the curves' largest relative difference, memory. ``tokens``:
    the tokens of one epoch."""
    one, n = stage_rate(single), stage_rate(many)
    wall_one = tokens * len(single["epoch_tok_s"]) / single["command_seconds"]
    wall_n = tokens * len(many["epoch_tok_s"]) / many["command_seconds"]
    if [s for s, _ in single["loss_windows"]] != [s for s, _ in many["loss_windows"]]:
        raise click.ClickException("the arms logged their loss at different steps")
    pairs = zip(single["loss_windows"], many["loss_windows"], strict=True)
    differences = [abs(theirs - ours) / abs(ours) for (_, ours), (_, theirs) in pairs]
    return {
        "stage_tok_s_1gpu": one,
        f"stage_tok_s_{gpus}gpu": n,
        "scaling_efficiency": n / (gpus * one),
        "stage_tok_s_wall_1gpu": wall_one,
        f"stage_tok_s_wall_{gpus}gpu": wall_n,
        "scaling_efficiency_wall": wall_n / (gpus * wall_one),
        "loss_max_rel_diff": max(differences),
        "peak_gib_per_gpu": many["peak_gib_per_gpu"],
        "peak_gib_1gpu": single["peak_gib_per_gpu"],
    }


@click.command()
@click.option("--gpus", default=2, show_default=True, help="processes of the N-GPU arms (train.gpus)")
@click.option("--cpu", is_flag=True, help="SmolLM2's shape in gloo processes: the mechanics, not a rate")
@click.option("--shapes", default="llama3-8b,kimi-k2", show_default=True, help="harness shapes (GPU)")
@click.option("--modes", default="ddp,fsdp", show_default=True, help="N-GPU arms: ddp, fsdp")
@click.option("--gib", default=12.0, show_default=True, help="GiB of feature shards per shape")
@click.option("--shard-gib", default=0.5, show_default=True)
@click.option("--epochs", default=2, show_default=True)
@click.option("--log-every", default=5, show_default=True, help="train.log_every: the loss curves' resolution")
@click.option("--workdir", type=click.Path(path_type=Path), help="where the projects go (default: a temp folder)")
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    gpus: int,
    cpu: bool,
    shapes: str,
    modes: str,
    gib: float,
    shard_gib: float,
    epochs: int,
    log_every: int,
    workdir: Path | None,
    out: Path,
) -> None:
    device = "cpu" if cpu else "cuda"
    if device == "cuda" and torch.cuda.device_count() < gpus:
        raise click.UsageError(f"--gpus {gpus}: this host has {torch.cuda.device_count()} CUDA GPUs")
    tokens, document = CONFIGS[device]
    common = {"device": device, "ttt_steps": 3, "max_tokens": tokens, "epochs": epochs, "noise_std": 0.0}
    common |= {"val_fraction": 0.0, "log_every": log_every, "checkpoint_every": 1_000_000}
    results = []
    for shape in ["smollm2-135m"] if cpu else shapes.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"scaling-{shape}-", dir=workdir))
        try:
            where = TrainPaths.default()
            located = TrainPaths(*(root / p if p is not None else None for p in vars(where).values()))
            data = write_project(located, shards_folder(root), SHAPES[shape], gib, document, shard_gib, device)
            row = {"shape": shape, "ttt_steps": 3, "tokens_per_micro_batch": tokens, "document_tokens": document}
            row |= {"data": data, "single": run_arm(root, common | {"accumulate": gpus})}
            for mode in modes.split(","):
                many = run_arm(root, common | {"gpus": gpus, "fsdp": mode == "fsdp"})
                row[mode] = many
                row[f"{mode}_vs_1gpu"] = compare(row["single"], many, gpus, data["tokens"])
                click.echo(json.dumps({shape: {mode: row[f"{mode}_vs_1gpu"]}}), err=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results.append(row)
        write_report(out, _report(device, gpus, results))  # after each shape: a cut-off run keeps what it measured


def _report(device: str, gpus: int, results: list) -> dict:
    return header("train_stage_scaling", device) | {
        "gpus": gpus,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)] if device == "cuda" else None,
        "rate": "stage_tok_s: tokens of all epochs / the epochs' seconds as the stage logs them (first step left "
        "out); wall: / the whole stage command",
        "noise_std": "0 in every arm, so that the loss curves are comparable",
        "results": results,
    }


if __name__ == "__main__":
    main()
