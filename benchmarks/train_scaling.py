"""Data-parallel scaling of the train stage's step: N GPUs under torchrun (NCCL all-reduce, expman.training.parallel)
against one GPU at the same global batch.

  python benchmarks/train_scaling.py --gpus 2 --out benchmarks/results/train_scaling_h200x2.json
  python benchmarks/train_scaling.py --gpus 2 --fsdp --shape kimi-k2 --out benchmarks/results/train_fsdp_h200x2.json

The script starts itself under ``torchrun`` twice: one process with ``accumulate`` N, then N processes with
``accumulate`` 1. Both start from the same weights and see the same global batches (micro-batch i of step s is
drawn from seed (s, i) on whichever process takes it); TTT noise is off so that the inputs are identical and the
two loss curves may differ only by the order in which gradients are summed. Reported: the loss of every step
(mean over the global batch), the largest difference between the curves, step times, and scaling efficiency
t(1 GPU) / (N · t(N GPUs)) at equal work per GPU. With ``--fsdp`` the N processes shard the drafter (FSDP2) instead of
replicating it; each process's peak memory shows what the sharding saves.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import torch
from reporting import SHAPES, write_report
from train_throughput import random_batch, random_drafter

from expman.params import TrainParams
from expman.provenance import package_versions
from expman.training.parallel import DataParallel
from expman.training.train import new_optimizer, training_step


def _worker(
    shape_name: str,
    ttt: int,
    tokens: int,
    document: int,
    draft_vocab: int,
    steps: int,
    warmup: int,
    micro_batches: int,
    fsdp: bool,
) -> dict:
    parallel = DataParallel.from_env("cuda", fsdp)
    accumulate = micro_batches // parallel.world
    shape = SHAPES[shape_name]
    section = TrainParams(ttt_steps=ttt, max_tokens=tokens, noise_std=0.0, accumulate=accumulate, fsdp=fsdp)
    drafter, head = random_drafter(shape, section, draft_vocab, "cuda")
    drafter = parallel.shard(drafter, "cuda", torch.bfloat16)
    optimizer, scheduler = new_optimizer(drafter, section, total_steps=warmup + steps)
    noise = torch.Generator(device="cuda").manual_seed(parallel.rank)
    losses, times = [], []
    for step in range(warmup + steps):
        mine = range(parallel.rank * accumulate, (parallel.rank + 1) * accumulate)
        batches = [
            random_batch(shape, tokens, document, torch.Generator("cuda").manual_seed(1000 * step + i), "cuda")
            for i in mine
        ]
        torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = training_step(
            drafter, head, batches, optimizer, scheduler, section, noise, "cuda", micro_batches, parallel
        )
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - started)
        loss = metrics["loss"].reshape(1).float()
        if parallel.world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss.item() / parallel.world)
    parallel.close()
    return {
        "processes": parallel.world,
        "fsdp": parallel.sharded,
        "accumulate": accumulate,
        "step_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "tok_per_s": micro_batches * tokens / statistics.median(times),
        "losses": losses,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def _launch(processes: int, options: dict) -> dict:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        __file__,
        "--worker",
        "--out",
        os.devnull,
    ]
    for name, value in options.items():
        if isinstance(value, bool):
            argv += [f"--{name.replace('_', '-')}"] if value else []
        else:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"processes"')]
    if done.returncode or not lines:
        raise click.ClickException(f"torchrun with {processes} processes failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0])


@click.command()
@click.option("--gpus", default=2, show_default=True)
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="llama3-8b", show_default=True)
@click.option("--ttt", default=3, show_default=True)
@click.option("--tokens", default=8192, show_default=True, help="tokens per micro-batch")
@click.option("--document", default=2048, show_default=True)
@click.option("--draft-vocab", default=32000, show_default=True)
@click.option(
    "--steps", default=30, show_default=True, help="timed steps, each on a global batch of --gpus micro-batches"
)
@click.option("--warmup", default=3, show_default=True, help="first steps, untimed (compilation); their loss is kept")
@click.option("--fsdp", is_flag=True, help="the N-GPU run shards weights, gradients and AdamW state (train.fsdp)")
@click.option("--worker", is_flag=True, hidden=True)
@click.option("--micro-batches", type=int, hidden=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    gpus: int,
    shape: str,
    ttt: int,
    tokens: int,
    document: int,
    draft_vocab: int,
    steps: int,
    warmup: int,
    fsdp: bool,
    worker: bool,
    micro_batches: int | None,
    out: Path,
) -> None:
    if worker:
        result = _worker(shape, ttt, tokens, document, draft_vocab, steps, warmup, micro_batches, fsdp)
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(json.dumps(result))
        return
    options = {
        "shape": shape,
        "ttt": ttt,
        "tokens": tokens,
        "document": document,
        "draft_vocab": draft_vocab,
        "steps": steps,
        "warmup": warmup,
        "micro_batches": gpus,
    }
    one, many = _launch(1, options), _launch(gpus, options | {"fsdp": fsdp})
    gaps = [abs(a - b) for a, b in zip(one["losses"], many["losses"], strict=True)]
    write_report(
        {
            "benchmark": "train_scaling",
            "command": "python " + " ".join(sys.argv),
            "device": f"{gpus} × {torch.cuda.get_device_name()}",
            "config": options | {"noise_std": 0.0},
            "one_gpu": one,
            "n_gpus": many,
            "loss_max_abs_diff": max(gaps),
            "loss_max_rel_diff": max(g / a for g, a in zip(gaps, one["losses"], strict=True)),
            "scaling_efficiency": one["step_s"]["median"] / (gpus * many["step_s"]["median"]),
            "speedup": many["tok_per_s"] / one["tok_per_s"],
            "packages": package_versions(),
        },
        out,
    )


if __name__ == "__main__":
    main()
